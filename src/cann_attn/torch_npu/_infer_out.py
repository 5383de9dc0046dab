"""The ``.out`` overloads of npu_fused_infer_attention_score (+ ``_v2``) and their
``_npu_fused_infer_attention_score(_v2)_get_max_workspace`` helpers, as op-plugin's op_plugin_functions.yaml spells
them and vllm-ascend's graph-capture code calls them (docs/operators/fused_infer_attention_score.md, "Writing into
given tensors"):

    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kw)
    torch_npu.npu_fused_infer_attention_score.out(query, key, value, **kw, workspace=workspace,
                                                  out=[attention_out, softmax_lse])

``out=[attention_out, softmax_lse]`` is the Python binding's form; the schema's keyword arguments
``attention_out=`` / ``softmax_lse=`` work too, and are the only form of ``torch.ops.npu.<name>.out`` after
install(). attention_out must have the shape, dtype and device the plain call returns; softmax_lse is written only
with ``softmax_lse_flag`` / ``return_softmax_lse`` (then [B, N, S, 1] or [T, N, 1] float32; otherwise any tensor,
vllm-ascend passes a one-element one). Both are checked before either is written.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from ..errors import ParamInvalidError, ParamNullptrError, describe, require
from ..ops.out_tensors import check_out_tensor
from ._infer import (
    NPU_FUSED_INFER_ATTENTION_SCORE_SCHEMAS,
    NPU_FUSED_INFER_ATTENTION_SCORE_V2_SCHEMAS,
    npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2,
)
from ._registry import npu_op, parse_schema

_OUT_ARGS = ", Tensor? workspace=None, Tensor(a!) attention_out, Tensor(b!) softmax_lse) -> (Tensor(a!), Tensor(b!))"


def _variant_schemas(schemas: dict, name: str, *, out: bool) -> dict:
    """The ``.out`` or ``_get_max_workspace`` schema text of each release, from the base operator's: the same
    parameters, then the workspace and the two output tensors (``.out``), or returning the workspace."""
    variants = {}
    for releases, text in schemas.items():
        if out:
            variants[releases] = text.replace(f"{name}(", f"{name}.out(", 1).replace(") -> (Tensor, Tensor)",
                                                                                  _OUT_ARGS)
        else:
            variants[releases] = text.replace(f"{name}(", f"_{name}_get_max_workspace(", 1).replace(
                "-> (Tensor, Tensor)", "-> Tensor")
    return variants


def _check_into(given, computed: Tensor, param: str, inputs: dict, outputs: dict | None = None) -> None:
    check_out_tensor(given, param, shape=tuple(computed.shape), dtype=computed.dtype, device=computed.device,
                     inputs=inputs, outputs=outputs)


def _outputs(attention_out, softmax_lse, out) -> tuple[Tensor, Tensor]:
    """The two output tensors from ``out=[attention_out, softmax_lse]`` or the schema's keywords (not both)."""
    if out is not None:
        if attention_out is not None or softmax_lse is not None:
            raise ParamInvalidError("out: give out=[attention_out, softmax_lse] or attention_out= / softmax_lse=, "
                                    "not both")
        require(isinstance(out, (list, tuple)) and len(out) == 2, "out", "[attention_out, softmax_lse]", out)
        attention_out, softmax_lse = out
    for name, tensor in (("attention_out", attention_out), ("softmax_lse", softmax_lse)):
        if tensor is None:
            raise ParamNullptrError(f"{name}: required by the .out overload, got None")
    return attention_out, softmax_lse


def _out_overload(compute, flag_name: str, schemas: dict):
    """The ``.out`` spelling of `compute` (the torch_npu function): it computes, checks both tensors against the
    result, then copies into them."""
    name = compute.__name__

    def impl(query: Tensor, key: Tensor, value: Tensor, *, workspace: Tensor | None = None,
             attention_out: Tensor | None = None, softmax_lse: Tensor | None = None, out=None, **kwargs):
        attention_out, softmax_lse = _outputs(attention_out, softmax_lse, out)
        if workspace is not None:
            require(isinstance(workspace, Tensor), "workspace", "a tensor (from the get_max_workspace helper)",
                    workspace)
        result, lse = compute(query, key, value, **kwargs)
        inputs = {"query": query, "key": key, "value": value, **kwargs}
        _check_into(attention_out, result, "attention_out", inputs)
        lse_written = bool(kwargs.get(flag_name, False))
        if lse_written:
            _check_into(softmax_lse, lse, "softmax_lse", inputs, {"attention_out": attention_out})
        elif not isinstance(softmax_lse, Tensor):
            raise ParamInvalidError(f"softmax_lse: expected a tensor, got {describe(softmax_lse)}")
        attention_out.copy_(result)
        if lse_written:
            softmax_lse.copy_(lse)
        return attention_out, softmax_lse

    impl.__name__ = impl.__qualname__ = f"{name}.out"
    signature = parse_schema(next(iter(schemas.values()))).signature()
    impl.__signature__ = signature.replace(parameters=[
        *signature.parameters.values(), inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None)])
    impl.__doc__ = (f"``{name}.out``: {name} written into ``attention_out`` / ``softmax_lse`` (or "
                    "``out=[attention_out, softmax_lse]``); ``workspace`` is accepted and unused.")
    return npu_op(schemas)(impl)


def _max_workspace(compute, schemas: dict):
    """``_<name>_get_max_workspace``: validates the call (by running it) and returns the workspace its ``.out``
    call takes: an empty uint8 tensor on the query's device (the computation here needs none)."""
    name = compute.__name__

    def impl(query: Tensor, key: Tensor, value: Tensor, **kwargs) -> Tensor:
        compute(query, key, value, **kwargs)
        return torch.empty(0, dtype=torch.uint8, device=query.device)

    impl.__name__ = impl.__qualname__ = f"_{name}_get_max_workspace"
    impl.__signature__ = parse_schema(next(iter(schemas.values()))).signature()
    impl.__doc__ = _max_workspace.__doc__.replace("``_<name>_get_max_workspace``", f"``_{name}_get_max_workspace``")
    return npu_op(schemas)(impl)


_FIA = "npu_fused_infer_attention_score"
_FIA_V2 = "npu_fused_infer_attention_score_v2"
NPU_FIA_OUT_SCHEMAS = _variant_schemas(NPU_FUSED_INFER_ATTENTION_SCORE_SCHEMAS, _FIA, out=True)
NPU_FIA_V2_OUT_SCHEMAS = _variant_schemas(NPU_FUSED_INFER_ATTENTION_SCORE_V2_SCHEMAS, _FIA_V2, out=True)
NPU_FIA_WORKSPACE_SCHEMAS = _variant_schemas(NPU_FUSED_INFER_ATTENTION_SCORE_SCHEMAS, _FIA, out=False)
NPU_FIA_V2_WORKSPACE_SCHEMAS = _variant_schemas(NPU_FUSED_INFER_ATTENTION_SCORE_V2_SCHEMAS, _FIA_V2, out=False)

# torch_npu.<name>.out, as vllm-ascend calls it.
npu_fused_infer_attention_score.out = _out_overload(npu_fused_infer_attention_score, "softmax_lse_flag",
                                                    NPU_FIA_OUT_SCHEMAS)
npu_fused_infer_attention_score_v2.out = _out_overload(npu_fused_infer_attention_score_v2, "return_softmax_lse",
                                                       NPU_FIA_V2_OUT_SCHEMAS)
_npu_fused_infer_attention_score_get_max_workspace = _max_workspace(npu_fused_infer_attention_score,
                                                                    NPU_FIA_WORKSPACE_SCHEMAS)
_npu_fused_infer_attention_score_v2_get_max_workspace = _max_workspace(npu_fused_infer_attention_score_v2,
                                                                       NPU_FIA_V2_WORKSPACE_SCHEMAS)
