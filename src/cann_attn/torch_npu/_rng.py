"""The dropout generator of the torch_npu spellings: a CPU int64 tensor ``[seed, offset]``."""

import torch
from torch import Tensor

_RNG_STATE = torch.zeros(2, dtype=torch.int64)


def manual_seed(seed: int) -> None:
    """Reset the dropout generator to (seed, offset 0) (what ``torch_npu.npu.manual_seed`` does for the NPU)."""
    _RNG_STATE[0] = int(seed)
    _RNG_STATE[1] = 0


def get_rng_state() -> Tensor:
    """A copy of the dropout generator state, an int64 tensor ``[seed, offset]``."""
    return _RNG_STATE.clone()


def set_rng_state(state: Tensor) -> None:
    """Restore a state returned by :func:`get_rng_state`."""
    _RNG_STATE.copy_(torch.as_tensor(state, dtype=torch.int64).reshape(2))

