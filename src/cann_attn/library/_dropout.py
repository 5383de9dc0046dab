"""The ``cann_attn::dropout_mask`` custom op: the bit-packed keep mask drawn at (seed, offset)
(docs/semantics/dropout.md)."""

import torch
from torch import Tensor

from ..errors import ParamInvalidError, require_real
from ..problem.dropout import gen_drop_mask

_MASK64 = (1 << 64) - 1

def mix_seed(seed: int, offset: int) -> int:
    """The 64-bit ``torch.Generator`` seed of the keep mask drawn at (seed, offset).

    ``z = (seed * 0x9E3779B97F4A7C15 + offset) mod 2**64`` followed by the splitmix64 finaliser
    ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31`` (all mod 2**64).
    Distinct (seed, offset) pairs give unrelated streams; the same pair always gives the same mask on a given
    device type (CPU and CUDA generators differ).
    """
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(offset)) & _MASK64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z


def _mask_bytes(numel) -> int:
    return (numel + 7) // 8


@torch.library.custom_op("cann_attn::dropout_mask", mutates_args=())
def _dropout_mask_op(rng_state: Tensor, numel: int, keep_prob: float, device: torch.device | None = None) -> Tensor:
    """ceil(numel/8) bytes of LSB-first keep bits (docs/semantics/dropout.md) drawn at (rng_state[0], rng_state[1])."""
    if rng_state.numel() != 2 or rng_state.dtype not in (torch.int64, torch.int32):
        raise ParamInvalidError(f"rng_state: expected an int64 tensor [seed, offset], got {rng_state!r}")
    seed, offset = (int(v) for v in rng_state.reshape(-1).tolist())
    target = torch.device(device) if device is not None else rng_state.device
    generator = torch.Generator(device=target)
    generator.manual_seed(mix_seed(seed, offset))
    return gen_drop_mask(int(numel), require_real(keep_prob, "keep_prob"), generator=generator, device=target)


@_dropout_mask_op.register_fake
def _(rng_state, numel, keep_prob, device=None):
    target = torch.device(device) if device is not None else rng_state.device
    return torch.empty((_mask_bytes(numel),), dtype=torch.uint8, device=target)


def dropout_mask(seed, offset, numel: int, keep_prob: float, device: torch.device | str | None = None) -> Tensor:
    """The keep mask of ``numel`` elements drawn at (seed, offset) (ints or 0-d tensors) through the
    ``cann_attn::dropout_mask`` op; the same arguments always give the same mask."""
    if isinstance(seed, Tensor) or isinstance(offset, Tensor):
        state = torch.stack([torch.as_tensor(seed).reshape(()), torch.as_tensor(offset).reshape(())])
        state = state.to(device="cpu", dtype=torch.int64)
    else:
        state = torch.tensor([int(seed), int(offset)], dtype=torch.int64)
    return torch.ops.cann_attn.dropout_mask(state, numel, require_real(keep_prob, "keep_prob"),
                                            torch.device(device) if device is not None else None)
