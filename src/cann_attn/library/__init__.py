"""Every cann_attn operator as a ``torch.library`` custom op, so ``torch.compile(fullgraph=True)`` traces models
that call them without graph breaks (docs/design.md; the style of flash-attention's ``flash_attn_interface.py``).

One module per operator family, grouped as :mod:`cann_attn.torch_npu` groups the spellings: ``_fusion``
(FlashAttentionScore, var-len, grad), ``_prompt`` (PromptFlashAttention, TransQuantParam), ``_infer``
(FusedInferAttentionScore v1/v2, IncreFlashAttention), ``_sparse`` (SparseFlashAttention + grad, LightningIndexer,
its KL-loss grad), ``_quant_dsa`` (the dense indexer pair, QuantLightningIndexer, KvQuantSparseFlashAttention),
``_merge`` (RingAttentionUpdate, AttentionUpdate), ``_mla_prolog`` (MlaProlog, the one op that writes its inputs:
the caches), ``_atb`` (the ATB operators), ``_dropout`` (keep masks). Every wrapper is importable from here, where
``traced_as_custom_op`` looks it up.

Layering, once per operator:

* ``torch.ops.cann_attn.<name>``: a ``torch.library.custom_op`` (``mutates_args=()``) that runs the eager operator
  of ``cann_attn.ops``; schema types are ``Tensor`` / ``Tensor?``, ``int[]?`` for length lists, ``float`` for
  scales, ``int`` for modes and token counts, ``str`` for layouts.
* A ``register_fake`` twin that computes output shapes and dtypes only (no data): used by FakeTensor tracing,
  ``torch.compile`` and ``torch.export``. TND outputs keep the query's token count; the PromptFlashAttention output
  dtype is int8 with ``quant_scale2``, else float16 for int8 inputs, else the query dtype
  (docs/operators/prompt_flash_attention.md).
* ``register_autograd`` for the forward ops: ``flash_attention_score`` / ``flash_attention_var_len_score``
  backpropagate through the ``flash_attention_score_grad`` custom op (gradients to query, key, value and a type
  0/1 ``pse`` tensor; the drop mask the forward used is saved and reused), ``sparse_flash_attention`` through
  ``sparse_flash_attention_grad`` (gradients to query, key, value, query_rope, key_rope). The softmax statistics
  outputs are not differentiable.
* A Python wrapper (same name, same signature as the eager operator in ``cann_attn``) that converts length
  tensors to int lists before calling the op (do this yourself, or pass Python lists, inside compiled code: a
  ``.tolist()`` on a tensor is a graph break) and maps the placeholder outputs back to ``None``.

Custom ops cannot return ``None``: an absent optional output is an empty tensor of shape ``(0,)`` (``dpse`` without
a type 0/1 pse tensor, ``d_query_rope`` / ``d_key_rope`` without rope inputs, ``sparse_values`` without
``return_value``); the wrappers turn them into ``None``.

Dropout under compilation: ``cann_attn::dropout_mask(Tensor rng_state, SymInt numel, float keep_prob, Device?
device) -> Tensor`` draws the bit-packed keep mask (``cann_attn.gen_drop_mask``) from a ``torch.Generator`` seeded
from ``rng_state = [seed, offset]`` (an int64 tensor) with :func:`mix_seed`, so a forward and a later grad call
regenerate the same mask from the same (seed, offset) pair; ``cann_attn.torch_npu`` uses it to mimic torch_npu's
(seed, offset, numels) protocol.
"""

from ._atb import atb_flash_attention, atb_flash_attention_unpad, atb_paged_attention, atb_paged_attention_splitfuse
from ._dropout import dropout_mask, mix_seed
from ._fusion import flash_attention_score, flash_attention_score_grad, flash_attention_var_len_score
from ._infer import fused_infer_attention_score, fused_infer_attention_score_v2, incre_flash_attention
from ._merge import attention_update, ring_attention_update
from ._mla_prolog import mla_prolog
from ._prompt import prompt_flash_attention, trans_quant_param
from ._quant_dsa import (
    dense_lightning_indexer_grad_kl_loss,
    dense_lightning_indexer_softmax_lse,
    kv_quant_sparse_flash_attention,
    quant_lightning_indexer,
)
from ._sparse import (
    count_tokens_with_keys,
    lightning_indexer,
    sparse_flash_attention,
    sparse_flash_attention_grad,
    sparse_lightning_indexer_grad_kl_loss,
)

__all__ = [
    "atb_flash_attention",
    "atb_flash_attention_unpad",
    "atb_paged_attention",
    "atb_paged_attention_splitfuse",
    "attention_update",
    "count_tokens_with_keys",
    "dense_lightning_indexer_grad_kl_loss",
    "dense_lightning_indexer_softmax_lse",
    "dropout_mask",
    "flash_attention_score",
    "flash_attention_score_grad",
    "flash_attention_var_len_score",
    "fused_infer_attention_score",
    "fused_infer_attention_score_v2",
    "incre_flash_attention",
    "kv_quant_sparse_flash_attention",
    "lightning_indexer",
    "mix_seed",
    "mla_prolog",
    "prompt_flash_attention",
    "quant_lightning_indexer",
    "ring_attention_update",
    "sparse_flash_attention",
    "sparse_flash_attention_grad",
    "sparse_lightning_indexer_grad_kl_loss",
    "trans_quant_param",
]
