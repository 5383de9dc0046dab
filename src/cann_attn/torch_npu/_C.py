"""The helpers of torch_npu's ``torch_npu._C`` that graph-capture code calls from Python (docs/guides/torch_npu.md,
"Graph capture"): vLLM-Ascend's ``weak_ref_tensors`` and torch_npu's one-call FIA task update."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from . import _graphs


def _weak_ref_tensor(tensor: Tensor) -> Tensor:
    """A tensor on the same memory as `tensor`, outside autograd. torch_npu's does not keep the memory alive; a
    Python tensor here always does, so code that drops the original only holds on to more memory."""
    return tensor.detach()


def _npu_fused_infer_attention_score_out_graph(stream: Any, handle: Any, event: _graphs.ExternalEvent, *args,
                                               **kwargs) -> tuple[Tensor, Tensor]:
    """A task update of one captured ``npu_fused_infer_attention_score.out`` call, then ``event.record(stream)``:
    ``graph_task_update_begin``, the call with these arguments, ``graph_task_update_end``, the record. Returns the
    call's output tensors."""
    from . import _infer_out  # noqa: F401  (defines npu_fused_infer_attention_score.out)
    from ._infer import npu_fused_infer_attention_score

    _graphs.graph_task_update_begin(stream, handle)
    try:
        outputs = npu_fused_infer_attention_score.out(*args, **kwargs)
    except BaseException:
        _graphs.cancel_task_update()
        raise
    _graphs.graph_task_update_end(stream)
    event.record(stream)
    return outputs
