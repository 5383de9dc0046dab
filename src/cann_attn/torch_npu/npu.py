"""``torch_npu.npu``'s random-number functions for the dropout generator of :mod:`cann_attn.torch_npu`.

They follow torch_npu's documented API (the ``torch.cuda`` counterparts): ``manual_seed(seed)`` and
``manual_seed_all(seed)`` set the seed and return None, ``seed()`` seeds with a random number, ``initial_seed()``
returns the current seed (int), ``get_rng_state(device="npu")`` returns the state as a uint8 CPU tensor (16 bytes:
seed and offset, int64 little-endian) and ``set_rng_state(new_state, device="npu")`` restores it. There is one
generator (one "device"): the ``device`` arguments are accepted and ignored. Device management
(``torch.npu.set_device``, streams, ``.npu()``) is out of scope (docs/guides/torch_npu.md).
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from . import _rng


def manual_seed(seed: int) -> None:
    _rng.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    _rng.manual_seed(seed)


def seed() -> None:
    """Seed the generator with a non-deterministic random number."""
    _rng.manual_seed(random.SystemRandom().getrandbits(63))


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return _rng.initial_seed()


def get_rng_state(device="npu") -> Tensor:
    return _rng.get_rng_state().view(torch.uint8).clone()


def set_rng_state(new_state: Tensor, device="npu") -> None:
    _rng.set_rng_state(new_state)


def get_rng_state_all() -> list[Tensor]:
    return [get_rng_state()]


def set_rng_state_all(new_states) -> None:
    for state in new_states:
        set_rng_state(state)
