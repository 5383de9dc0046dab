"""``torch_npu._npu_dropout_gen_mask``: the bit-packed keep mask the fused attention operators draw, for goldens
(docs/guides/torch_npu.md, "Random numbers"; docs/semantics/dropout.md).

op-plugin's and Ascend/pytorch's flash-attention tests build their golden's dropout mask with this call at the
(seed, offset) the attention draws at, ``keep_prob = 1 - p``. Here it returns the very bits
``npu_fusion_attention`` draws for the same (seed, offset), keep probability and element count, so such a golden
matches this package's attention bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import ParamInvalidError, require, require_int, require_real
from ..library import dropout_mask
from ..problem.lengths import to_int_list
from ._registry import npu_op

# op-plugin's DropoutGenMask kernels allocate the mask in 128-bit units (DATA_ALIGN = 128 bits).
MASK_ALIGN_BITS = 128

NPU_DROPOUT_GEN_MASK_SCHEMAS = {
    ("7.1", "7.2", "7.3", "26.0", "current"): (
        "_npu_dropout_gen_mask.Tensor(Tensor self, int[] size, float p, int seed, int offset, *, "
        "bool? parallel=True, bool? sync=None) -> Tensor"
    ),
}


def gen_mask_bytes(numel: int) -> int:
    """Bytes of the returned mask: ``numel`` bits rounded up to whole 128-bit units."""
    return math.ceil(numel / MASK_ALIGN_BITS) * MASK_ALIGN_BITS // 8


def _host_int(value, param: str) -> int:
    """An int, or a one-element integer tensor as the peer tests pass (``seed_tensor[0]``)."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.reshape(()).item())
    return require_int(value, param)


@npu_op(NPU_DROPOUT_GEN_MASK_SCHEMAS)
def _npu_dropout_gen_mask(self: Tensor, size, p: float, seed: int, offset: int, *, parallel: bool | None = True,
                          sync: bool | None = None) -> Tensor:
    """uint8 [ceil(prod(size) / 128) * 16] on ``self``'s device: element e is kept iff bit e % 8 (LSB first) of
    byte e // 8 is 1, each with probability ``1 - p``, drawn at (seed, offset) exactly as the attention operators
    draw theirs (``cann_attn.library.dropout_mask``); bits past prod(size) are 0. ``self`` gives the device only
    (its dtype is the NPU kernel's probability dtype); ``parallel`` and ``sync`` choose an NPU stream and have no
    effect here."""
    require(isinstance(self, Tensor), "self", "a torch.Tensor (the mask's device)", self)
    # int[]: Python or NumPy ints and 0-dim integer tensors (op-plugin's test passes one), or a 1-d integer tensor.
    require(isinstance(size, (list, tuple, Tensor)), "size", "a list of non-negative ints", size)
    dims = to_int_list(size, "size")
    require(dims is not None and all(d >= 0 for d in dims), "size", "a list of non-negative ints", size)
    p = require_real(p, "p")
    if not 0.0 <= p <= 1.0:
        raise ParamInvalidError(f"p: dropout probability has to be between 0 and 1, got {p!r}")
    seed, offset = _host_int(seed, "seed"), _host_int(offset, "offset")
    numel = math.prod(dims)
    out = torch.zeros(gen_mask_bytes(numel), dtype=torch.uint8, device=self.device)
    if numel and p < 1.0:  # p = 1 keeps nothing: every bit stays 0
        bits = dropout_mask(seed, offset, numel, 1.0 - p, device=self.device)
        out[: bits.numel()] = bits
    return out
