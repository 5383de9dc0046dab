"""The dropout generator of the torch_npu spellings: a CPU int64 tensor ``[seed, offset]``.

Like torch_npu's default NPU generator it is seeded by ``torch.manual_seed`` (torch_npu seeds every NPU through
PyTorch's device hook): the first draw, and every eager draw after ``torch.initial_seed()`` changed, seed it from
``torch.initial_seed()`` at offset 0. So processes seeded differently draw different masks and the same seed gives
the same masks; :func:`manual_seed` (``torch_npu.npu.manual_seed``) sets it directly. Each draw takes the current
(seed, offset) and advances the offset by the mask's element count (docs/guides/torch_npu.md, "Random numbers").
"""

from __future__ import annotations

import torch
from torch import Tensor

_RNG_STATE = torch.zeros(2, dtype=torch.int64)
# torch.initial_seed() when the generator was last seeded from it or set by manual_seed (None: never used yet).
_SYNC = {"torch_seed": None}


def _sync_with_torch_seed() -> None:
    """Reseed from torch.initial_seed() on first use and after torch.manual_seed changed it (eager only: a
    compiled region uses the state as it finds it)."""
    if torch.compiler.is_compiling():
        return
    torch_seed = torch.initial_seed()
    if _SYNC["torch_seed"] != torch_seed:
        _SYNC["torch_seed"] = torch_seed
        _RNG_STATE[0] = _as_int64(torch_seed)
        _RNG_STATE[1] = 0


def _as_int64(seed: int) -> int:
    """torch seeds are uint64; the state holds their int64 bit pattern."""
    seed = int(seed) & (2**64 - 1)
    return seed - 2**64 if seed >= 2**63 else seed


def draw_state(numels: int) -> Tensor:
    """The (seed, offset) of the next draw of `numels` mask elements, as a fresh [2] int64 tensor; the generator
    advances past them."""
    _sync_with_torch_seed()
    state = _RNG_STATE.clone()
    _RNG_STATE[1] += numels
    return state


def manual_seed(seed: int) -> None:
    """Reset the dropout generator to (seed, offset 0) (``torch_npu.npu.manual_seed``)."""
    _RNG_STATE[0] = _as_int64(seed)
    _RNG_STATE[1] = 0
    _SYNC["torch_seed"] = torch.initial_seed()


def get_rng_state() -> Tensor:
    """A copy of the dropout generator state, an int64 tensor ``[seed, offset]``."""
    _sync_with_torch_seed()
    return _RNG_STATE.clone()


def set_rng_state(state: Tensor) -> None:
    """Restore a state returned by :func:`get_rng_state` (int64 ``[seed, offset]``) or by
    ``torch_npu.npu.get_rng_state`` (16 bytes, uint8)."""
    state = torch.as_tensor(state)
    if state.dtype == torch.uint8:
        state = state.reshape(-1).contiguous().view(torch.int64)
    _RNG_STATE.copy_(state.to(torch.int64).reshape(2))
    _SYNC["torch_seed"] = torch.initial_seed()


def initial_seed() -> int:
    """The seed of the generator (as ``torch_npu.npu.initial_seed``: the seed it was last seeded with)."""
    _sync_with_torch_seed()
    return int(_RNG_STATE[0]) & (2**64 - 1)
