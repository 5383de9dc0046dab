"""AttentionUpdate: combine K partial attention outputs by their log-sum-exp (decode split over sequence-parallel
ranks; docs/operators/attention_update.md, the merge rule in cann_attn.problem.merge)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..backends import select_backend
from ..backends.reference import merge as reference
from ..errors import ParamInvalidError, ParamNullptrError, require, require_int
from ..traceable import traced_as_custom_op

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_PARTS = 16  # sequence-parallel degree sp in [1, 16]
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 8, 512, 8
UPDATE_TYPES = (0, 1)


class AttentionUpdateResult(NamedTuple):
    out: torch.Tensor
    lse_out: torch.Tensor | None


def _tensor_list(value, name: str) -> list[torch.Tensor]:
    if value is None:
        raise ParamNullptrError(f"{name}: a required list of tensors, got None")
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        raise ParamInvalidError(f"{name}: expected a list or tuple of tensors, got {type(value).__name__}")
    items = list(value)
    for i, t in enumerate(items):
        if t is None:
            raise ParamNullptrError(f"{name}[{i}]: a required tensor, got None")
        require(isinstance(t, torch.Tensor), f"{name}[{i}]", "a torch.Tensor", t)
    return items


def _validate(lse: list[torch.Tensor], local_out: list[torch.Tensor], update_type) -> int:
    update_type = require_int(update_type, "update_type")
    if update_type not in UPDATE_TYPES:
        raise ParamInvalidError(f"update_type: expected 0 (out only) or 1 (out and lse_out), got {update_type}")
    require(1 <= len(lse) <= MAX_PARTS, "lse", f"a list of 1 to {MAX_PARTS} tensors (sp)", f"{len(lse)} tensors")
    require(len(local_out) == len(lse), "local_out", f"as many tensors as lse ({len(lse)})",
            f"{len(local_out)} tensors")
    ref_out, ref_lse = local_out[0], lse[0]
    require(ref_out.dtype in OUT_DTYPES, "local_out[0]", "dtype float32, float16 or bfloat16", ref_out)
    require(ref_out.dim() == 2, "local_out[0]", "a 2-D tensor [batch * seqLen * headNum, headDim]", ref_out)
    lse_dtypes = (torch.float32, torch.float64) if ref_out.dtype == torch.float64 else (torch.float32,)
    head_dim = ref_out.shape[1]
    require(MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0, "local_out[0]",
            f"a head dim in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] and a multiple of {HEAD_DIM_MULTIPLE}", ref_out)
    for i, t in enumerate(local_out):
        require(t.dtype == ref_out.dtype, f"local_out[{i}]", f"local_out[0]'s dtype {ref_out.dtype}", t)
        require(t.shape == ref_out.shape, f"local_out[{i}]", f"local_out[0]'s shape {list(ref_out.shape)}", t)
    for i, t in enumerate(lse):
        require(t.dtype in lse_dtypes, f"lse[{i}]", "dtype float32", t)
        require(t.dim() == 1 and t.shape[0] == ref_out.shape[0], f"lse[{i}]",
                f"a 1-D tensor [batch * seqLen * headNum] = [{ref_out.shape[0]}] (local_out's rows)", t)
        require(t.dtype == ref_lse.dtype, f"lse[{i}]", f"lse[0]'s dtype {ref_lse.dtype}", t)
    return update_type


@traced_as_custom_op
def attention_update(
    lse: Sequence[torch.Tensor],
    local_out: Sequence[torch.Tensor],
    update_type: int,
    *,
    backend: str = "auto",
) -> AttentionUpdateResult:
    """O = sum_i O_i exp(lse_i - lse_m), lse_m = lse_max + log(sum_i exp(lse_i - lse_max)), lse_max = max_i lse_i.

    `lse`: K (1..16) float32 tensors [R] (R = batch * seqLen * headNum); `local_out`: K tensors [R, headDim]
    (float32, float16 or bfloat16, headDim in [8, 512], a multiple of 8). Returns (out [R, headDim] in local_out's
    dtype, lse_out [R] float32 when update_type == 1, else None). A part whose lse is -inf or <= -FLT_MAX (a row
    that saw no key) contributes nothing; a row empty in every part gives 0 (docs/operators/attention_update.md).
    """
    lse_list = _tensor_list(lse, "lse")
    out_list = _tensor_list(local_out, "local_out")
    update_type = _validate(lse_list, out_list, update_type)
    chosen = select_backend(backend, out_list[0].device, op="attention_update",
                            unsupported=lambda: _triton_unsupported(out_list[0], lse_list[0]))
    compute = reference.lse_update
    if chosen == "triton":
        from ..backends.triton import merge as triton_merge

        compute = triton_merge.lse_update
    out, lse_out = compute(lse_list, out_list)
    return AttentionUpdateResult(out, lse_out if update_type == 1 else None)


def _triton_unsupported(out: torch.Tensor, lse: torch.Tensor) -> str | None:
    if out.dtype == torch.float64 or lse.dtype == torch.float64:
        return "the kernels compute float16/bfloat16/float32 outputs with float32 lse, got float64"
    return None
