"""torch_npu's attention operators, names, argument names, defaults and return tuples, on CPU and GPU.

``import cann_attn.torch_npu as torch_npu`` lets code written for Ascend run unchanged but for that import; or call
:func:`install` once at the entry point and leave ``import torch_npu`` and ``torch.ops.npu.<op>`` as they are
(docs/guides/torch_npu.md). Every function runs the ``cann_attn::*`` custom ops of :mod:`cann_attn.library`, so it
is traceable by ``torch.compile(fullgraph=True)`` and the forward functions are differentiable like torch_npu's.

Signatures, defaults and return arities are op-plugin's ``op_plugin_functions.yaml`` schemas, one table of schema
text per release (:mod:`._registry`; :func:`use_release` or ``CANN_ATTN_TORCH_NPU_RELEASE`` selects 7.1, 7.2, 7.3,
26.0 or current). Current outputs:

* ``npu_fusion_attention`` / ``_v2`` -> ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
  numels)``; ``npu_fusion_attention_v3`` -> the first six, seed and offset as int64 CPU tensors of shape [1].
* ``npu_fusion_attention_grad`` / ``_grad_v3`` -> ``(dq, dk, dv, dpse, dsink)``; ``_grad_v2`` -> ``(dq, dk, dv,
  dpse, dq_rope, dk_rope, dsink)`` (7.2: the first 4 and 6). As op-plugin returns them: dpse None without pse
  (zeros for ALiBi slopes), dq_rope/dk_rope None without rope inputs, dsink an empty (0,) float32 tensor without
  ``sink`` (float32 [head_num], docs/semantics/sinks.md).
* ``npu_ring_attention_update``, ``npu_attention_update`` (``_merge.py``); ``npu_fused_infer_attention_score``
  (+ ``_v2``), ``npu_incre_flash_attention`` (``_infer.py``); ``npu_prompt_flash_attention``,
  ``npu_trans_quant_param``; ``npu_sparse_flash_attention``, ``npu_sparse_flash_attention_grad``,
  ``npu_lightning_indexer``, ``npu_sparse_lightning_indexer_grad_kl_loss`` (paged caches: docs/semantics/paged-kv.md).
* ``npu_format_cast`` / ``npu_format_cast_`` / ``get_npu_format`` and the ``Format`` enum (``_format.py``): the
  logical tensor unchanged, the storage format recorded and read back.
* ``npu_mla_prolog`` / ``_v2`` / ``_v3`` (``_mla_prolog.py``): the MLA pre-processing, caches written in place.

Dropout (``keep_prob < 1``): like torch_npu, the mask is not returned but drawn from (seed, offset) of a generator
(:mod:`cann_attn.torch_npu.npu`, seeded from ``torch.initial_seed()``), and the grads regenerate it from the
``seed``, ``offset`` (and ``numels``) the forward returned; an external ``dropout_mask`` or a non-zero ``seed`` is
used as given. ``seed`` and ``offset`` are Python ints in eager mode and 0-d int64 tensors while
``torch.compiler.is_compiling()``; the grads accept both.

TND: trailing zero lengths leave batches out and a T larger than the last cumulative length is end-of-document
padding (docs/semantics/layouts.md). ``actual_seq_qlen``/``actual_seq_kvlen`` with another layout are ignored with a
UserWarning. Differences from Ascend that remain: masks are not bit-identical to an NPU's; ``softmax_out`` is empty
(reserved); ``gen_mask_parallel``, ``sync``, ``inner_precise`` and ``padding_mask`` have no effect; length tensors
are turned into lists with ``.tolist()`` (a graph break under torch.compile: pass Python lists there).
"""


from ..ops.sparse_flash_attention import INT64_MAX  # noqa: F401  (re-exported for callers of the old module)
from . import _C, npu  # noqa: F401  (_C: torch_npu._C's graph helpers)
from ._atb import (  # noqa: F401  (torch_npu's private ATB spellings, not in __all__)
    _npu_flash_attention,
    _npu_flash_attention_unpad,
    _npu_paged_attention,
    _npu_paged_attention_get_workspace,
    _npu_paged_attention_splitfuse,
)
from ._dropout import _npu_dropout_gen_mask  # noqa: F401  (torch_npu's private spelling, not in __all__)
from ._format import (
    Format,
    get_npu_format,
    npu_format_cast,
    npu_format_cast_,  # noqa: F401  (in-place form, overloaded in torch_npu; not in __all__)
)
from ._fusion import (
    npu_fusion_attention,
    npu_fusion_attention_grad,
    npu_fusion_attention_grad_v2,
    npu_fusion_attention_grad_v3,
    npu_fusion_attention_v2,
    npu_fusion_attention_v3,
)
from ._graphs import GraphCaptureError, GraphReplayError
from ._infer import (
    npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2,
    npu_incre_flash_attention,
)
from ._infer_out import (  # noqa: F401  (also sets npu_fused_infer_attention_score(_v2).out)
    _npu_fused_infer_attention_score_get_max_workspace,
    _npu_fused_infer_attention_score_v2_get_max_workspace,
)
from ._install import TorchNpuPresentError, install, installed, uninstall
from ._merge import npu_attention_update, npu_ring_attention_update
from ._mla_prolog import npu_mla_prolog, npu_mla_prolog_v2, npu_mla_prolog_v3
from ._prompt import PFA_PRE_TOKENS, npu_prompt_flash_attention, npu_trans_quant_param  # noqa: F401
from ._quant_dsa import (
    npu_dense_lightning_indexer_grad_kl_loss,
    npu_dense_lightning_indexer_softmax_lse,
    npu_kv_quant_sparse_flash_attention,
    npu_quant_lightning_indexer,
)
from ._registry import CURRENT, OPS, RELEASE_ENV, RELEASES, active_release, npu_op, use_release
from ._registry import _release_from_environment as _apply_environment
from ._rng import _RNG_STATE, get_rng_state, manual_seed, set_rng_state  # noqa: F401
from ._sparse import (
    npu_lightning_indexer,
    npu_sparse_flash_attention,
    npu_sparse_flash_attention_grad,
    npu_sparse_lightning_indexer_grad_kl_loss,
)

# New spelling modules are imported above this line (their @npu_op registers them), so the environment's release
# applies to every one of them.
_apply_environment()

__all__ = [
    "CURRENT",
    "OPS",
    "RELEASES",
    "RELEASE_ENV",
    "Format",
    "GraphCaptureError",
    "GraphReplayError",
    "TorchNpuPresentError",
    "active_release",
    "get_npu_format",
    "get_rng_state",
    "install",
    "installed",
    "manual_seed",
    "npu",
    "npu_attention_update",
    "npu_dense_lightning_indexer_grad_kl_loss",
    "npu_dense_lightning_indexer_softmax_lse",
    "npu_format_cast",
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_fusion_attention_grad_v2",
    "npu_fusion_attention_grad_v3",
    "npu_fusion_attention_v2",
    "npu_fusion_attention_v3",
    "npu_incre_flash_attention",
    "npu_kv_quant_sparse_flash_attention",
    "npu_lightning_indexer",
    "npu_mla_prolog",
    "npu_mla_prolog_v2",
    "npu_mla_prolog_v3",
    "npu_op",
    "npu_prompt_flash_attention",
    "npu_quant_lightning_indexer",
    "npu_ring_attention_update",
    "npu_sparse_flash_attention",
    "npu_sparse_flash_attention_grad",
    "npu_sparse_lightning_indexer_grad_kl_loss",
    "npu_trans_quant_param",
    "set_rng_state",
    "uninstall",
    "use_release",
]
