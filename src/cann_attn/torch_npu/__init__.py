"""torch_npu's attention operators, names, argument names, defaults and return tuples, on CPU and GPU.

``import cann_attn.torch_npu as torch_npu`` lets code written for Ascend run unchanged but for that import. Every
function runs the ``cann_attn::*`` custom ops of :mod:`cann_attn.library`, so it is traceable by
``torch.compile(fullgraph=True)`` and the forward functions are differentiable like torch_npu's (autograd routes
``npu_fusion_attention(_v2)`` to the FlashAttentionScoreGrad op and ``npu_sparse_flash_attention`` to the
SparseFlashAttentionGrad op).

Signatures follow op-plugin's ``op_plugin_functions.yaml`` and the torch_npu API documentation:

* ``npu_fusion_attention`` (v1 spelling ``pre_tockens``/``next_tockens``, pse always type 1) ->
  ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``;
  ``npu_fusion_attention_grad`` -> ``(dq, dk, dv, dpse, dsink)``.
* ``npu_fusion_attention_v2`` (``pre_tokens``/``next_tokens``, ``pse_type``, ``q_start_idx``/``kv_start_idx``,
  ``query_rope``/``key_rope``) -> the same 7-tuple; ``npu_fusion_attention_grad_v2`` ->
  ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)`` as in current torch_npu (older releases returned the first 4 or
  6 of these). ``query_rope``/``key_rope`` are concatenated to query/key along the head dim (S = scale *
  (Q K^T + Qr Kr^T)). ``sink`` (float32 [head_num], one softmax logit per head, docs/semantics/sinks.md) is taken
  by the forwards and grads of both spellings; the grads return ``dsink`` (an empty float32 tensor without a sink, as op-plugin).
* ``npu_ring_attention_update`` (-> ``(attn_out, softmax_max, softmax_sum)``) and ``npu_attention_update``
  (-> ``(out, lse_out)``, ``lse_out`` None for ``update_type=0``): the merges of context-parallel attention.
* ``npu_fused_infer_attention_score`` (+ ``_v2``) -> ``(attention_out, softmax_lse)`` and
  ``npu_incre_flash_attention`` (``_infer.py``).
* ``npu_prompt_flash_attention``, ``npu_trans_quant_param``, ``npu_sparse_flash_attention`` (with
  ``return_softmax_lse``), ``npu_sparse_flash_attention_grad``, ``npu_lightning_indexer``,
  ``npu_sparse_lightning_indexer_grad_kl_loss``. The sparse attention and indexer forwards read a paged cache
  (``layout_kv``/``layout_key='PA_BSND'`` with ``block_table``, docs/semantics/paged-kv.md).

Dropout (``keep_prob < 1``): like torch_npu, the mask is not returned but drawn from (seed, offset) of a generator,
and the grad functions regenerate it from the ``seed``, ``offset`` and ``numels`` the forward returned. Here the
generator is this module's state, a CPU int64 tensor ``[seed, offset]``: each dropout call draws the keep mask of
``numels = B*N1*Sq*Skv`` (TND: ``N1 * sum(Sq_b*Skv_b)``) elements at the current (seed, offset) through the
``cann_attn::dropout_mask`` op (see :func:`cann_attn.library.mix_seed`) and advances ``offset`` by ``numels`` in
place. :func:`manual_seed` resets it to ``[seed, 0]``. With ``keep_prob == 1`` nothing is drawn and seed and offset
are 0; numels is still the mask size, as torch_npu reports it.

``seed`` and ``offset`` are Python ints in eager mode. While ``torch.compiler.is_compiling()`` they are 0-d int64
(CPU) tensors instead, so that reading the generator does not break the graph; the grad functions accept both.
``numels`` is always an int.

Differences from Ascend that remain: masks are not bit-identical to an NPU's (a different random generator; the
bit layout is the same); ``softmax_out`` is an empty tensor (reserved); ``gen_mask_parallel``, ``sync``,
``inner_precise`` and ``padding_mask`` are accepted and have no effect; length tensors are turned into lists with
``.tolist()`` (a graph break under torch.compile: pass Python lists there).
"""


from . import npu
from ._common import INT64_MAX  # noqa: F401  (re-exported for callers of the old module)
from ._fusion import (
    npu_fusion_attention,
    npu_fusion_attention_grad,
    npu_fusion_attention_grad_v2,
    npu_fusion_attention_grad_v3,
    npu_fusion_attention_v2,
    npu_fusion_attention_v3,
)
from ._infer import (
    npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2,
    npu_incre_flash_attention,
)
from ._install import TorchNpuPresentError, install
from ._merge import npu_attention_update, npu_ring_attention_update
from ._prompt import PFA_PRE_TOKENS, npu_prompt_flash_attention, npu_trans_quant_param  # noqa: F401
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
    "TorchNpuPresentError",
    "active_release",
    "get_rng_state",
    "install",
    "manual_seed",
    "npu",
    "npu_attention_update",
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_fusion_attention_grad_v2",
    "npu_fusion_attention_grad_v3",
    "npu_fusion_attention_v2",
    "npu_fusion_attention_v3",
    "npu_incre_flash_attention",
    "npu_lightning_indexer",
    "npu_op",
    "npu_prompt_flash_attention",
    "npu_ring_attention_update",
    "npu_sparse_flash_attention",
    "npu_sparse_flash_attention_grad",
    "npu_sparse_lightning_indexer_grad_kl_loss",
    "npu_trans_quant_param",
    "set_rng_state",
    "use_release",
]
