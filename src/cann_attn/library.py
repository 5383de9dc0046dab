"""Every cann_attn operator as a ``torch.library`` custom op, so ``torch.compile(fullgraph=True)`` traces models
that call them without graph breaks (docs/design.md; the style of flash-attention's ``flash_attn_interface.py``).

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
* A Python wrapper below (same name, same signature as the eager operator in ``cann_attn``) that converts length
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

import torch
from torch import Tensor

from .errors import ParamInvalidError
from .ops.attention_update import AttentionUpdateResult
from .ops.attention_update import attention_update as _eager_attention_update
from .ops.fia_problem import scalar_type_number
from .ops.flash_attention_score import (
    INT_MAX,
    FlashAttentionScoreResult,
)
from .ops.flash_attention_score import (
    flash_attention_score as _eager_flash_attention_score,
)
from .ops.flash_attention_score import (
    flash_attention_var_len_score as _eager_flash_attention_var_len_score,
)
from .ops.flash_attention_score_grad import FlashAttentionScoreGradResult
from .ops.flash_attention_score_grad import flash_attention_score_grad as _eager_flash_attention_score_grad
from .ops.fused_infer_attention_score import FIA_LAYOUTS
from .ops.fused_infer_attention_score import PACKED as FIA_PACKED
from .ops.fused_infer_attention_score import _output_shape as _fia_output_shape
from .ops.fused_infer_attention_score import (
    fused_infer_attention_score as _eager_fused_infer_attention_score,
)
from .ops.fused_infer_attention_score import (
    fused_infer_attention_score_v2 as _eager_fused_infer_attention_score_v2,
)
from .ops.incre_flash_attention import incre_flash_attention as _eager_incre_flash_attention
from .ops.lightning_indexer import (
    LightningIndexerResult,
    SparseLightningIndexerGradKLLossResult,
)
from .ops.lightning_indexer import (
    count_tokens_with_keys as _eager_count_tokens_with_keys,
)
from .ops.lightning_indexer import lightning_indexer as _eager_lightning_indexer
from .ops.lightning_indexer import (
    sparse_lightning_indexer_grad_kl_loss as _eager_sparse_lightning_indexer_grad_kl_loss,
)
from .ops.prompt_flash_attention import prompt_flash_attention as _eager_prompt_flash_attention
from .ops.ring_attention_update import RingAttentionUpdateResult
from .ops.ring_attention_update import ring_attention_update as _eager_ring_attention_update
from .ops.sparse_flash_attention import INT64_MAX, SparseFlashAttentionGradResult, SparseFlashAttentionResult
from .ops.sparse_flash_attention import sparse_flash_attention as _eager_sparse_flash_attention
from .ops.sparse_flash_attention import sparse_flash_attention_grad as _eager_sparse_flash_attention_grad
from .problem.dropout import gen_drop_mask
from .problem.layout import BATCH_SEQ_DIMS
from .problem.lengths import to_int_list
from .problem.page_table import PAGED_KV_LAYOUT
from .problem.quant import trans_quant_param as _eager_trans_quant_param
from .problem.stats import accumulation_dtype

__all__ = [
    "attention_update",
    "count_tokens_with_keys",
    "dropout_mask",
    "flash_attention_score",
    "flash_attention_score_grad",
    "flash_attention_var_len_score",
    "fused_infer_attention_score",
    "fused_infer_attention_score_v2",
    "incre_flash_attention",
    "lightning_indexer",
    "mix_seed",
    "prompt_flash_attention",
    "ring_attention_update",
    "sparse_flash_attention",
    "sparse_flash_attention_grad",
    "sparse_lightning_indexer_grad_kl_loss",
    "trans_quant_param",
]

_MASK64 = (1 << 64) - 1


def _empty_like_none(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The ``(0,)`` placeholder for an absent optional output."""
    return like.new_empty((0,), dtype=dtype or like.dtype)


def _none_if_placeholder(t: Tensor, present: bool) -> Tensor | None:
    return t if present else None


def _ints(value, name: str) -> list[int] | None:
    """Length lists and start indices as Python int lists (tensors converted; one int becomes a list)."""
    return to_int_list(value, name)


# ================================================================================================ dropout masks
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
    return gen_drop_mask(int(numel), float(keep_prob), generator=generator, device=target)


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
    return torch.ops.cann_attn.dropout_mask(state, numel, float(keep_prob),
                                            torch.device(device) if device is not None else None)


# ================================================================================ FlashAttentionScore (+ VarLen)
_FA_NAMES = (
    "query", "key", "value", "head_num", "input_layout", "pse", "drop_mask", "padding_mask", "atten_mask", "prefix",
    "actual_seq_qlen", "actual_seq_kvlen", "q_start_idx", "kv_start_idx", "scale_value", "keep_prob", "pre_tokens",
    "next_tokens", "inner_precise", "sparse_mode", "pse_type", "softmax_layout", "backend", "sink",
)
# Forward arguments the grad op takes unchanged, in its keyword names.
_FA_SHARED = (
    "head_num", "input_layout", "prefix", "actual_seq_qlen", "actual_seq_kvlen", "q_start_idx", "kv_start_idx",
    "scale_value", "keep_prob", "pre_tokens", "next_tokens", "inner_precise", "sparse_mode", "pse_type",
    "softmax_layout", "backend",
)


def _fa_call(eager, query, key, value, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, prefix,
             actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx, scale_value, keep_prob, pre_tokens,
             next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout, backend, sink):
    result = eager(
        query, key, value, head_num, input_layout, pse=pse, drop_mask=drop_mask, padding_mask=padding_mask,
        atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob,
        pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode,
        pse_type=pse_type, softmax_layout=softmax_layout, backend=backend, sink=sink,
    )
    return tuple(result)


@torch.library.custom_op("cann_attn::flash_attention_score", mutates_args=())
def _fa_op(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, pse: Tensor | None = None,
    drop_mask: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    prefix: list[int] | None = None, actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None, q_start_idx: list[int] | None = None,
    kv_start_idx: list[int] | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, inner_precise: int = 0, sparse_mode: int = 0,
    pse_type: int = 1, softmax_layout: str = "", backend: str = "auto", sink: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlashAttentionScore -> (attention_out, softmax_max, softmax_sum, softmax_out)."""
    return _fa_call(_eager_flash_attention_score, query, key, value, head_num, input_layout, pse, drop_mask,
                    padding_mask, atten_mask, prefix, actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx,
                    scale_value, keep_prob, pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type,
                    softmax_layout, backend, sink)


@torch.library.custom_op("cann_attn::flash_attention_var_len_score", mutates_args=())
def _fa_varlen_op(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str = "TND", pse: Tensor | None = None,
    drop_mask: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    prefix: list[int] | None = None, actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None, q_start_idx: list[int] | None = None,
    kv_start_idx: list[int] | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, inner_precise: int = 0, sparse_mode: int = 0,
    pse_type: int = 1, softmax_layout: str = "", backend: str = "auto", sink: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlashAttentionVarLenScore (TND) -> (attention_out, softmax_max, softmax_sum, softmax_out)."""
    return _fa_call(_eager_flash_attention_var_len_score, query, key, value, head_num, input_layout, pse, drop_mask,
                    padding_mask, atten_mask, prefix, actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx,
                    scale_value, keep_prob, pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type,
                    softmax_layout, backend, sink)


def _fa_out_shape(query: Tensor, key: Tensor, value: Tensor, head_num: int, layout: str) -> tuple:
    """attention_out: the query's layout with value's head dim (docs/semantics/layouts.md)."""
    if layout in ("BSH", "SBH"):
        head_dim = query.shape[2] // head_num
        heads_kv = key.shape[2] // head_dim
        return (query.shape[0], query.shape[1], head_num * (value.shape[2] // heads_kv))
    if layout in ("BSND", "BNSD"):
        return (*query.shape[:3], value.shape[3])
    return (query.shape[0], query.shape[1], value.shape[2])  # TND keeps the token count


def _fa_stat_shape(query: Tensor, head_num: int, layout: str) -> tuple:
    """softmax_max / softmax_sum: [B, N1, Sq, 8], TND [T, N1, 8] (docs/semantics/softmax-stats.md)."""
    if layout == "TND":
        return (query.shape[0], head_num, 8)
    batch, seq = BATCH_SEQ_DIMS[layout]
    return (query.shape[batch], head_num, query.shape[seq], 8)


def _fa_fake(query, key, value, head_num, input_layout, *args, **kwargs):
    stat_dtype = accumulation_dtype(query.dtype)
    stat_shape = _fa_stat_shape(query, head_num, input_layout)
    return (
        query.new_empty(_fa_out_shape(query, key, value, head_num, input_layout)),
        query.new_empty(stat_shape, dtype=stat_dtype),
        query.new_empty(stat_shape, dtype=stat_dtype),
        query.new_empty((0,)),
    )


_fa_op.register_fake(_fa_fake)
_fa_varlen_op.register_fake(_fa_fake)


def _fa_setup_context(ctx, inputs, output):
    args = dict(zip(_FA_NAMES, inputs, strict=False))
    attention_out, softmax_max, softmax_sum, softmax_out = output
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["pse"], args["drop_mask"],
                          args["atten_mask"], attention_out, softmax_max, softmax_sum, args.get("sink"))
    ctx.options = {name: args[name] for name in _FA_SHARED if name in args}
    ctx.mark_non_differentiable(softmax_max, softmax_sum, softmax_out)


def _fa_backward(ctx, d_out, d_max, d_sum, d_softmax_out):
    query, key, value, pse, drop_mask, atten_mask, attention_out, softmax_max, softmax_sum, sink = ctx.saved_tensors
    options = ctx.options
    dq, dk, dv, dpse, dsink = torch.ops.cann_attn.flash_attention_score_grad(
        query, key, value, d_out.contiguous(), options["head_num"], options["input_layout"], pse=pse,
        drop_mask=drop_mask, atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        attention_in=attention_out, sink=sink,
        **{k: v for k, v in options.items() if k not in ("head_num", "input_layout")},
    )
    pse_grad = None
    if pse is not None and options["pse_type"] in (0, 1) and ctx.needs_input_grad[_FA_NAMES.index("pse")]:
        pse_grad = dpse
    sink_grad = dsink if sink is not None and ctx.needs_input_grad[_FA_NAMES.index("sink")] else None
    grads = {"query": dq, "key": dk, "value": dv, "pse": pse_grad, "sink": sink_grad}
    return tuple(grads.get(name) for name in _FA_NAMES)


_fa_op.register_autograd(_fa_backward, setup_context=_fa_setup_context)
_fa_varlen_op.register_autograd(_fa_backward, setup_context=_fa_setup_context)


@torch.library.custom_op("cann_attn::flash_attention_score_grad", mutates_args=())
def _fa_grad_op(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str,
    pse: Tensor | None = None, drop_mask: Tensor | None = None, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None,
    softmax_in: Tensor | None = None, attention_in: Tensor | None = None, prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None, actual_seq_kvlen: list[int] | None = None,
    q_start_idx: list[int] | None = None, kv_start_idx: list[int] | None = None, scale_value: float = 1.0,
    keep_prob: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, inner_precise: int = 0,
    sparse_mode: int = 0, pse_type: int = 1, softmax_layout: str = "", backend: str = "auto",
    sink: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FlashAttentionScoreGradV2 -> (dq, dk, dv, dpse, dsink); dpse is an empty (0,) tensor without a type 0/1
    pse, dsink one without a sink."""
    result = _eager_flash_attention_score_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, drop_mask=drop_mask, padding_mask=padding_mask,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in,
        attention_in=attention_in, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx,
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type, softmax_layout=softmax_layout,
        backend=backend, sink=sink,
    )
    dpse = result.dpse if result.dpse is not None else _empty_like_none(query)
    dsink = result.dsink if result.dsink is not None else _empty_like_none(query, torch.float32)
    return result.dq, result.dk, result.dv, dpse, dsink


@_fa_grad_op.register_fake
def _(query, key, value, dy, head_num, input_layout, pse=None, drop_mask=None, padding_mask=None, atten_mask=None,
      softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, prefix=None, actual_seq_qlen=None,
      actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0, keep_prob=1.0, pre_tokens=INT_MAX,
      next_tokens=INT_MAX, inner_precise=0, sparse_mode=0, pse_type=1, softmax_layout="", backend="auto", sink=None):
    dpse = pse.new_empty(pse.shape) if pse is not None and pse_type in (0, 1) else _empty_like_none(query)
    dsink = sink.new_empty(sink.shape) if sink is not None else _empty_like_none(query, torch.float32)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dpse, dsink


def flash_attention_score(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, *, pse: Tensor | None = None,
    drop_mask: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None,
    scale_value: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX,
    inner_precise: int = 0, sparse_mode: int = 0, pse_type: int = 1, softmax_layout: str = "",
    sink: Tensor | None = None, backend: str = "auto",
) -> FlashAttentionScoreResult:
    """``cann_attn.flash_attention_score`` through the ``cann_attn::flash_attention_score`` custom op:
    traceable by torch.compile and differentiable (gradients to query, key, value and a type 0/1 pse)."""
    return FlashAttentionScoreResult(*torch.ops.cann_attn.flash_attention_score(
        query, key, value, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, _ints(prefix, "prefix"),
        _ints(actual_seq_qlen, "actual_seq_qlen"), _ints(actual_seq_kvlen, "actual_seq_kvlen"),
        _ints(q_start_idx, "q_start_idx"), _ints(kv_start_idx, "kv_start_idx"), float(scale_value),
        float(keep_prob), pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout, backend,
        sink,
    ))


def flash_attention_var_len_score(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str = "TND", *,
    pse: Tensor | None = None, drop_mask: Tensor | None = None, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, q_start_idx=None,
    kv_start_idx=None, scale_value: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX, inner_precise: int = 0, sparse_mode: int = 0, pse_type: int = 1,
    softmax_layout: str = "", sink: Tensor | None = None, backend: str = "auto",
) -> FlashAttentionScoreResult:
    """``cann_attn.flash_attention_var_len_score`` through the ``cann_attn::flash_attention_var_len_score`` op."""
    return FlashAttentionScoreResult(*torch.ops.cann_attn.flash_attention_var_len_score(
        query, key, value, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, _ints(prefix, "prefix"),
        _ints(actual_seq_qlen, "actual_seq_qlen"), _ints(actual_seq_kvlen, "actual_seq_kvlen"),
        _ints(q_start_idx, "q_start_idx"), _ints(kv_start_idx, "kv_start_idx"), float(scale_value),
        float(keep_prob), pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout, backend,
        sink,
    ))


def flash_attention_score_grad(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str, *,
    pse: Tensor | None = None, drop_mask: Tensor | None = None, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None,
    softmax_in: Tensor | None = None, attention_in: Tensor | None = None, prefix=None, actual_seq_qlen=None,
    actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, inner_precise: int = 0, sparse_mode: int = 0,
    pse_type: int = 1, softmax_layout: str = "", sink: Tensor | None = None, backend: str = "auto",
) -> FlashAttentionScoreGradResult:
    """``cann_attn.flash_attention_score_grad`` through the ``cann_attn::flash_attention_score_grad`` op; dpse is
    None without a type 0/1 pse tensor, dsink None without a sink."""
    dq, dk, dv, dpse, dsink = torch.ops.cann_attn.flash_attention_score_grad(
        query, key, value, dy, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, softmax_max,
        softmax_sum, softmax_in, attention_in, _ints(prefix, "prefix"), _ints(actual_seq_qlen, "actual_seq_qlen"),
        _ints(actual_seq_kvlen, "actual_seq_kvlen"), _ints(q_start_idx, "q_start_idx"),
        _ints(kv_start_idx, "kv_start_idx"), float(scale_value), float(keep_prob), pre_tokens, next_tokens,
        inner_precise, sparse_mode, pse_type, softmax_layout, backend, sink,
    )
    return FlashAttentionScoreGradResult(dq, dk, dv, _none_if_placeholder(dpse, pse is not None and pse_type in (0, 1)),
                                         _none_if_placeholder(dsink, sink is not None))


# ================================================================================ PromptFlashAttentionV2 + quant
@torch.library.custom_op("cann_attn::prompt_flash_attention", mutates_args=())
def _pfa_op(
    query: Tensor, key: Tensor, value: Tensor, pse_shift: Tensor | None = None, atten_mask: Tensor | None = None,
    actual_seq_lengths: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    deq_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, deq_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, num_heads: int = 1,
    scale_value: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = 0, input_layout: str = "BSH",
    num_key_value_heads: int = 0, sparse_mode: int = 0, backend: str = "auto",
) -> Tensor:
    """PromptFlashAttentionV2 -> attention_out."""
    return _eager_prompt_flash_attention(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, deq_scale1=deq_scale1, quant_scale1=quant_scale1,
        deq_scale2=deq_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2, num_heads=num_heads,
        scale_value=scale_value, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, backend=backend,
    )


def _pfa_output_dtype(query_dtype: torch.dtype, quant_scale2) -> torch.dtype:
    """int8 with quant_scale2, else float16 for int8 inputs, else the query dtype
    (docs/operators/prompt_flash_attention.md)."""
    if quant_scale2 is not None:
        return torch.int8
    return torch.float16 if query_dtype == torch.int8 else query_dtype


@_pfa_op.register_fake
def _(query, key, value, pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
      deq_scale1=None, quant_scale1=None, deq_scale2=None, quant_scale2=None, quant_offset2=None, num_heads=1,
      scale_value=1.0, pre_tokens=INT_MAX, next_tokens=0, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
      backend="auto"):
    shape = tuple(query.shape)
    if input_layout == "BNSD_BSND":  # input BNSD, output BSND
        shape = (query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    return query.new_empty(shape, dtype=_pfa_output_dtype(query.dtype, quant_scale2))


def prompt_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, *, pse_shift: Tensor | None = None, atten_mask: Tensor | None = None,
    actual_seq_lengths=None, actual_seq_lengths_kv=None, deq_scale1: Tensor | None = None,
    quant_scale1: Tensor | None = None, deq_scale2: Tensor | None = None, quant_scale2: Tensor | None = None,
    quant_offset2: Tensor | None = None, num_heads: int = 1, scale_value: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = 0, input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
    backend: str = "auto",
) -> Tensor:
    """``cann_attn.prompt_flash_attention`` through the ``cann_attn::prompt_flash_attention`` custom op."""
    return torch.ops.cann_attn.prompt_flash_attention(
        query, key, value, pse_shift, atten_mask, _ints(actual_seq_lengths, "actual_seq_lengths"),
        _ints(actual_seq_lengths_kv, "actual_seq_lengths_kv"), deq_scale1, quant_scale1, deq_scale2, quant_scale2,
        quant_offset2, num_heads, float(scale_value), pre_tokens, next_tokens, input_layout, num_key_value_heads,
        sparse_mode, backend,
    )


@torch.library.custom_op("cann_attn::trans_quant_param", mutates_args=())
def _tqp_op(scale: Tensor, offset: Tensor | None = None, round_mode: int = 0) -> Tensor:
    """UINT64 deq-scale words of float32 `scale` (and `offset`) as an int64 tensor of scale's shape."""
    return _eager_trans_quant_param(scale, offset, round_mode)


@_tqp_op.register_fake
def _(scale, offset=None, round_mode=0):
    shape = scale.shape if offset is None else torch.broadcast_shapes(scale.shape, offset.shape)
    return scale.new_empty(shape, dtype=torch.int64)


def trans_quant_param(scale, offset=None, round_mode: int = 0) -> Tensor:
    """``cann_attn.trans_quant_param`` through the ``cann_attn::trans_quant_param`` custom op (Python numbers are
    turned into float32 tensors first)."""
    if not isinstance(scale, Tensor):
        scale = torch.tensor(scale, dtype=torch.float32)
    if offset is not None and not isinstance(offset, Tensor):
        offset = torch.tensor(offset, dtype=torch.float32)
    return torch.ops.cann_attn.trans_quant_param(scale, offset, round_mode)


# ============================================================ FusedInferAttentionScore (v1, v2), IncreFlashAttention
def _fia_fake_outputs(query, value, num_heads, num_key_value_heads, input_layout, quant_scale2, softmax_lse_flag,
                      paged: bool = False):
    """(attention_out, softmax_lse) shapes and dtypes of FusedInferAttentionScore
    (docs/operators/fused_infer_attention_score.md); `paged`: value is a block cache (docs/semantics/paged-kv.md),
    whose 3-D form [block_num, block_size, H] packs the heads like BSH."""
    q_layout, out_layout = FIA_LAYOUTS.get(input_layout, ("BSH", "BSH"))
    heads_kv = num_key_value_heads or num_heads
    packs_heads = q_layout == "BSH" or (paged and value.dim() == 3)
    dim_v = value.shape[-1] // heads_kv if packs_heads else value.shape[-1]
    if q_layout in FIA_PACKED:
        batch, seq = None, query.shape[0 if q_layout == "TND" else 1]  # seq: the token count T
    else:
        batch_dim, seq_dim = BATCH_SEQ_DIMS[q_layout]
        batch, seq = query.shape[batch_dim], query.shape[seq_dim]
    out = query.new_empty(_fia_output_shape(out_layout, batch, seq, num_heads, dim_v),
                          dtype=_pfa_output_dtype(query.dtype, quant_scale2))
    if not softmax_lse_flag:
        return out, query.new_empty((1,), dtype=torch.float32)
    lse_shape = (seq, num_heads, 1) if batch is None else (batch, num_heads, seq, 1)
    return out, query.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("cann_attn::fused_infer_attention_score", mutates_args=())
def _fia_op(
    query: Tensor, key: Tensor, value: Tensor, pse_shift: Tensor | None = None, atten_mask: Tensor | None = None,
    actual_seq_lengths: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, antiquant_scale: Tensor | None = None,
    antiquant_offset: Tensor | None = None, key_antiquant_scale: Tensor | None = None,
    key_antiquant_offset: Tensor | None = None, value_antiquant_scale: Tensor | None = None,
    value_antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    query_padding_size: Tensor | None = None, kv_padding_size: Tensor | None = None,
    key_shared_prefix: Tensor | None = None, value_shared_prefix: Tensor | None = None,
    actual_shared_prefix_len: list[int] | None = None, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, key_rope_antiquant_scale: Tensor | None = None, num_heads: int = 1,
    scale: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, input_layout: str = "BSH",
    num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0,
    antiquant_mode: int = 0, key_antiquant_mode: int = 0, value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False, backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """FusedInferAttentionScore -> (attention_out, softmax_lse)."""
    return _eager_fused_infer_attention_score(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset, key_antiquant_scale=key_antiquant_scale,
        key_antiquant_offset=key_antiquant_offset, value_antiquant_scale=value_antiquant_scale,
        value_antiquant_offset=value_antiquant_offset, block_table=block_table,
        query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
        key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len, query_rope=query_rope, key_rope=key_rope,
        key_rope_antiquant_scale=key_rope_antiquant_scale, num_heads=num_heads, scale=scale, pre_tokens=pre_tokens,
        next_tokens=next_tokens, input_layout=input_layout, num_key_value_heads=num_key_value_heads,
        sparse_mode=sparse_mode, inner_precise=inner_precise, block_size=block_size, antiquant_mode=antiquant_mode,
        key_antiquant_mode=key_antiquant_mode, value_antiquant_mode=value_antiquant_mode,
        softmax_lse_flag=softmax_lse_flag, backend=backend,
    )


@_fia_op.register_fake
def _(query, key, value, pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
      dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None, quant_offset2=None,
      antiquant_scale=None, antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
      value_antiquant_scale=None, value_antiquant_offset=None, block_table=None, query_padding_size=None,
      kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
      query_rope=None, key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX,
      next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
      antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0, softmax_lse_flag=False, backend="auto"):
    return _fia_fake_outputs(query, value, num_heads, num_key_value_heads, input_layout, quant_scale2,
                             softmax_lse_flag, block_table is not None)


def fused_infer_attention_score(
    query: Tensor, key: Tensor, value: Tensor, *, pse_shift: Tensor | None = None,
    atten_mask: Tensor | None = None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, antiquant_scale: Tensor | None = None,
    antiquant_offset: Tensor | None = None, key_antiquant_scale: Tensor | None = None,
    key_antiquant_offset: Tensor | None = None, value_antiquant_scale: Tensor | None = None,
    value_antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    query_padding_size: Tensor | None = None, kv_padding_size: Tensor | None = None,
    key_shared_prefix: Tensor | None = None, value_shared_prefix: Tensor | None = None,
    actual_shared_prefix_len=None, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    key_rope_antiquant_scale: Tensor | None = None, num_heads: int = 1, scale: float = 1.0,
    pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, input_layout: str = "BSH", num_key_value_heads: int = 0,
    sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0,
    key_antiquant_mode: int = 0, value_antiquant_mode: int = 0, softmax_lse_flag: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``cann_attn.fused_infer_attention_score`` through the ``cann_attn::fused_infer_attention_score`` custom op."""
    return torch.ops.cann_attn.fused_infer_attention_score(
        query, key, value, pse_shift, atten_mask, _ints(actual_seq_lengths, "actual_seq_lengths"),
        _ints(actual_seq_lengths_kv, "actual_seq_lengths_kv"), dequant_scale1, quant_scale1, dequant_scale2,
        quant_scale2, quant_offset2, antiquant_scale, antiquant_offset, key_antiquant_scale, key_antiquant_offset,
        value_antiquant_scale, value_antiquant_offset, block_table, query_padding_size, kv_padding_size,
        key_shared_prefix, value_shared_prefix, _ints(actual_shared_prefix_len, "actual_shared_prefix_len"),
        query_rope, key_rope, key_rope_antiquant_scale, num_heads, float(scale), pre_tokens, next_tokens,
        input_layout, num_key_value_heads, sparse_mode, inner_precise, block_size, antiquant_mode,
        key_antiquant_mode, value_antiquant_mode, bool(softmax_lse_flag), backend,
    )


@torch.library.custom_op("cann_attn::fused_infer_attention_score_v2", mutates_args=())
def _fia_v2_op(
    query: Tensor, key: Tensor, value: Tensor, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    pse_shift: Tensor | None = None, atten_mask: Tensor | None = None, actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None, block_table: Tensor | None = None,
    dequant_scale_query: Tensor | None = None, dequant_scale_key: Tensor | None = None,
    dequant_offset_key: Tensor | None = None, dequant_scale_value: Tensor | None = None,
    dequant_offset_value: Tensor | None = None, dequant_scale_key_rope: Tensor | None = None,
    quant_scale_out: Tensor | None = None, quant_offset_out: Tensor | None = None,
    quant_scale_p: Tensor | None = None, learnable_sink: Tensor | None = None, num_query_heads: int = 1,
    num_key_value_heads: int = 0, softmax_scale: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX, input_layout: str = "BSH", sparse_mode: int = 0, block_size: int = 0,
    query_quant_mode: int = 0, key_quant_mode: int = 0, value_quant_mode: int = 0, inner_precise: int = 0,
    return_softmax_lse: bool = False, query_dtype: int | None = None, key_dtype: int | None = None,
    value_dtype: int | None = None, query_rope_dtype: int | None = None, key_rope_dtype: int | None = None,
    key_shared_prefix_dtype: int | None = None, value_shared_prefix_dtype: int | None = None,
    dequant_scale_query_dtype: int | None = None, dequant_scale_key_dtype: int | None = None,
    dequant_scale_value_dtype: int | None = None, dequant_scale_key_rope_dtype: int | None = None,
    out_dtype: int | None = None, backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """FusedInferAttentionScore with v2's argument set -> (attention_out, softmax_lse)."""
    return _eager_fused_infer_attention_score_v2(
        query, key, value, query_rope=query_rope, key_rope=key_rope, pse_shift=pse_shift, atten_mask=atten_mask,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, block_table=block_table,
        dequant_scale_query=dequant_scale_query, dequant_scale_key=dequant_scale_key,
        dequant_offset_key=dequant_offset_key, dequant_scale_value=dequant_scale_value,
        dequant_offset_value=dequant_offset_value, dequant_scale_key_rope=dequant_scale_key_rope,
        quant_scale_out=quant_scale_out, quant_offset_out=quant_offset_out, quant_scale_p=quant_scale_p,
        learnable_sink=learnable_sink, num_query_heads=num_query_heads, num_key_value_heads=num_key_value_heads,
        softmax_scale=softmax_scale, pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
        sparse_mode=sparse_mode, block_size=block_size, query_quant_mode=query_quant_mode,
        key_quant_mode=key_quant_mode, value_quant_mode=value_quant_mode, inner_precise=inner_precise,
        return_softmax_lse=return_softmax_lse, query_dtype=query_dtype, key_dtype=key_dtype, value_dtype=value_dtype,
        query_rope_dtype=query_rope_dtype, key_rope_dtype=key_rope_dtype,
        key_shared_prefix_dtype=key_shared_prefix_dtype, value_shared_prefix_dtype=value_shared_prefix_dtype,
        dequant_scale_query_dtype=dequant_scale_query_dtype, dequant_scale_key_dtype=dequant_scale_key_dtype,
        dequant_scale_value_dtype=dequant_scale_value_dtype,
        dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype, out_dtype=out_dtype, backend=backend,
    )


@_fia_v2_op.register_fake
def _(query, key, value, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None, actual_seq_qlen=None,
      actual_seq_kvlen=None, block_table=None, dequant_scale_query=None, dequant_scale_key=None,
      dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None, dequant_scale_key_rope=None,
      quant_scale_out=None, quant_offset_out=None, quant_scale_p=None, learnable_sink=None, num_query_heads=1,
      num_key_value_heads=0, softmax_scale=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
      sparse_mode=0, block_size=0, query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
      return_softmax_lse=False, query_dtype=None, key_dtype=None, value_dtype=None, query_rope_dtype=None,
      key_rope_dtype=None, key_shared_prefix_dtype=None, value_shared_prefix_dtype=None,
      dequant_scale_query_dtype=None, dequant_scale_key_dtype=None, dequant_scale_value_dtype=None,
      dequant_scale_key_rope_dtype=None, out_dtype=None, backend="auto"):
    return _fia_fake_outputs(query, value, num_query_heads, num_key_value_heads, input_layout, quant_scale_out,
                             return_softmax_lse, block_table is not None)


def fused_infer_attention_score_v2(
    query: Tensor, key: Tensor, value: Tensor, *, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    pse_shift: Tensor | None = None, atten_mask: Tensor | None = None, actual_seq_qlen=None, actual_seq_kvlen=None,
    block_table: Tensor | None = None, dequant_scale_query: Tensor | None = None,
    dequant_scale_key: Tensor | None = None, dequant_offset_key: Tensor | None = None,
    dequant_scale_value: Tensor | None = None, dequant_offset_value: Tensor | None = None,
    dequant_scale_key_rope: Tensor | None = None, quant_scale_out: Tensor | None = None,
    quant_offset_out: Tensor | None = None, quant_scale_p: Tensor | None = None,
    learnable_sink: Tensor | None = None, num_query_heads: int = 1, num_key_value_heads: int = 0,
    softmax_scale: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, input_layout: str = "BSH",
    sparse_mode: int = 0, block_size: int = 0, query_quant_mode: int = 0, key_quant_mode: int = 0,
    value_quant_mode: int = 0, inner_precise: int = 0, return_softmax_lse: bool = False,
    query_dtype: int | None = None, key_dtype: int | None = None, value_dtype: int | None = None,
    query_rope_dtype: int | None = None, key_rope_dtype: int | None = None,
    key_shared_prefix_dtype: int | None = None, value_shared_prefix_dtype: int | None = None,
    dequant_scale_query_dtype: int | None = None, dequant_scale_key_dtype: int | None = None,
    dequant_scale_value_dtype: int | None = None, dequant_scale_key_rope_dtype: int | None = None,
    out_dtype: int | torch.dtype | None = None, backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``cann_attn.fused_infer_attention_score_v2`` through its custom op; `out_dtype` may be a torch.dtype, passed
    on as its ScalarType number as op-plugin's binding does."""
    return torch.ops.cann_attn.fused_infer_attention_score_v2(
        query, key, value, query_rope, key_rope, pse_shift, atten_mask, _ints(actual_seq_qlen, "actual_seq_qlen"),
        _ints(actual_seq_kvlen, "actual_seq_kvlen"), block_table, dequant_scale_query, dequant_scale_key,
        dequant_offset_key, dequant_scale_value, dequant_offset_value, dequant_scale_key_rope, quant_scale_out,
        quant_offset_out, quant_scale_p, learnable_sink, num_query_heads, num_key_value_heads, float(softmax_scale),
        pre_tokens, next_tokens, input_layout, sparse_mode, block_size, query_quant_mode, key_quant_mode,
        value_quant_mode, inner_precise, bool(return_softmax_lse), query_dtype, key_dtype, value_dtype,
        query_rope_dtype, key_rope_dtype, key_shared_prefix_dtype, value_shared_prefix_dtype,
        dequant_scale_query_dtype, dequant_scale_key_dtype, dequant_scale_value_dtype, dequant_scale_key_rope_dtype,
        scalar_type_number(out_dtype), backend,
    )


@torch.library.custom_op("cann_attn::incre_flash_attention", mutates_args=())
def _ifa_op(
    query: Tensor, key: Tensor, value: Tensor, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    pse_shift: Tensor | None = None, actual_seq_lengths: list[int] | None = None,
    antiquant_scale: Tensor | None = None, antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, kv_padding_size: Tensor | None = None,
    num_heads: int = 1, scale_value: float = 1.0, input_layout: str = "BSH", num_key_value_heads: int = 0,
    block_size: int = 0, inner_precise: int = 1, backend: str = "auto",
) -> Tensor:
    """IncreFlashAttention -> attention_out."""
    return _eager_incre_flash_attention(
        query, key, value, padding_mask=padding_mask, atten_mask=atten_mask, pse_shift=pse_shift,
        actual_seq_lengths=actual_seq_lengths, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        block_table=block_table, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        kv_padding_size=kv_padding_size, num_heads=num_heads, scale_value=scale_value, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, block_size=block_size, inner_precise=inner_precise,
        backend=backend,
    )


@_ifa_op.register_fake
def _(query, key, value, padding_mask=None, atten_mask=None, pse_shift=None, actual_seq_lengths=None,
      antiquant_scale=None, antiquant_offset=None, block_table=None, dequant_scale1=None, quant_scale1=None,
      dequant_scale2=None, quant_scale2=None, quant_offset2=None, kv_padding_size=None, num_heads=1,
      scale_value=1.0, input_layout="BSH", num_key_value_heads=0, block_size=0, inner_precise=1, backend="auto"):
    return _fia_fake_outputs(query, value, num_heads, num_key_value_heads, input_layout, quant_scale2, False,
                             block_table is not None)[0]


def incre_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, *, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, pse_shift: Tensor | None = None, actual_seq_lengths=None,
    antiquant_scale: Tensor | None = None, antiquant_offset: Tensor | None = None, block_table: Tensor | None = None,
    dequant_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, kv_padding_size: Tensor | None = None,
    num_heads: int = 1, scale_value: float = 1.0, input_layout: str = "BSH", num_key_value_heads: int = 0,
    block_size: int = 0, inner_precise: int = 1, backend: str = "auto",
) -> Tensor:
    """``cann_attn.incre_flash_attention`` through the ``cann_attn::incre_flash_attention`` custom op."""
    return torch.ops.cann_attn.incre_flash_attention(
        query, key, value, padding_mask, atten_mask, pse_shift, _ints(actual_seq_lengths, "actual_seq_lengths"),
        antiquant_scale, antiquant_offset, block_table, dequant_scale1, quant_scale1, dequant_scale2, quant_scale2,
        quant_offset2, kv_padding_size, num_heads, float(scale_value), input_layout, num_key_value_heads,
        block_size, inner_precise, backend,
    )


# ================================================================================ SparseFlashAttention (+ Grad)
_SFA_NAMES = (
    "query", "key", "value", "sparse_indices", "scale_value", "query_rope", "key_rope", "actual_seq_lengths_query",
    "actual_seq_lengths_kv", "sparse_block_size", "layout", "sparse_mode", "pre_tokens", "next_tokens", "backend",
    "block_table", "layout_kv", "sinks",
)
_SFA_SHARED = ("actual_seq_lengths_query", "actual_seq_lengths_kv", "layout", "sparse_mode", "pre_tokens",
               "next_tokens", "backend")


@torch.library.custom_op("cann_attn::sparse_flash_attention", mutates_args=())
def _sfa_op(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    actual_seq_lengths_query: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    sparse_block_size: int = 1, layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX, backend: str = "auto", block_table: Tensor | None = None, layout_kv: str = "",
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """SparseFlashAttention -> (attention_out, softmax_max, softmax_sum); `block_table` / `layout_kv="PA_BSND"`:
    a paged key/value cache (docs/semantics/paged-kv.md); `sinks`: docs/semantics/sinks.md."""
    return tuple(_eager_sparse_flash_attention(
        query, key, value, sparse_indices, scale_value, query_rope=query_rope, key_rope=key_rope,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        sparse_block_size=sparse_block_size, layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
        next_tokens=next_tokens, backend=backend, block_table=block_table, layout_kv=layout_kv or None, sinks=sinks,
    ))


def _dsa_stat_shape(query: Tensor, layout: str) -> tuple:
    """[B, N2=1, S1, G=N1] or [N2=1, T1, G] (docs/operators/sparse_flash_attention.md)."""
    if layout == "TND":
        return (1, query.shape[0], query.shape[1])
    return (query.shape[0], 1, query.shape[1], query.shape[2])


@_sfa_op.register_fake
def _(query, key, value, sparse_indices, scale_value, query_rope=None, key_rope=None, actual_seq_lengths_query=None,
      actual_seq_lengths_kv=None, sparse_block_size=1, layout="BSND", sparse_mode=3, pre_tokens=INT64_MAX,
      next_tokens=INT64_MAX, backend="auto", block_table=None, layout_kv="", sinks=None):
    stat_dtype = accumulation_dtype(query.dtype)
    stat_shape = _dsa_stat_shape(query, layout)
    return (query.new_empty((*query.shape[:-1], value.shape[-1])), query.new_empty(stat_shape, dtype=stat_dtype),
            query.new_empty(stat_shape, dtype=stat_dtype))


def _sfa_setup_context(ctx, inputs, output):
    args = dict(zip(_SFA_NAMES, inputs, strict=False))
    attention_out, softmax_max, softmax_sum = output
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["sparse_indices"], args["query_rope"],
                          args["key_rope"], attention_out, softmax_max, softmax_sum, args.get("sinks"))
    ctx.scale_value, ctx.sparse_block_size = args["scale_value"], args.get("sparse_block_size", 1)
    ctx.options = {name: args[name] for name in _SFA_SHARED if name in args}
    ctx.paged = args.get("block_table") is not None or args.get("layout_kv") == PAGED_KV_LAYOUT
    ctx.mark_non_differentiable(softmax_max, softmax_sum)


def _sfa_backward(ctx, d_out, d_max, d_sum):
    if ctx.paged:
        # SparseFlashAttentionGrad takes contiguous BSND/TND keys only (docs/semantics/paged-kv.md): a paged cache
        # is an inference input.
        raise ParamInvalidError("block_table: gradients through a paged (PA_BSND) key/value cache are not "
                                "supported; SparseFlashAttentionGrad takes BSND or TND keys")
    query, key, value, sparse_indices, query_rope, key_rope, out, softmax_max, softmax_sum, sinks = ctx.saved_tensors
    dq, dk, dv, dq_rope, dk_rope, d_sinks = torch.ops.cann_attn.sparse_flash_attention_grad(
        query, key, value, sparse_indices, d_out.contiguous(), out, softmax_max, softmax_sum, ctx.scale_value,
        ctx.sparse_block_size, query_rope=query_rope, key_rope=key_rope, sinks=sinks, **ctx.options,
    )
    grads = {"query": dq, "key": dk, "value": dv,
             "query_rope": dq_rope if query_rope is not None else None,
             "key_rope": dk_rope if key_rope is not None else None,
             "sinks": d_sinks if sinks is not None and ctx.needs_input_grad[_SFA_NAMES.index("sinks")] else None}
    return tuple(grads.get(name) for name in _SFA_NAMES)


_sfa_op.register_autograd(_sfa_backward, setup_context=_sfa_setup_context)


@torch.library.custom_op("cann_attn::sparse_flash_attention_grad", mutates_args=())
def _sfa_grad_op(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, d_out: Tensor, out: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, sparse_block_size: int = 1,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    actual_seq_lengths_query: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    deterministic: bool = False, backend: str = "auto", sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """SparseFlashAttentionGrad -> (d_query, d_key, d_value, d_query_rope, d_key_rope, d_sinks); the rope gradients
    are empty (0,) tensors without rope inputs, d_sinks one without sinks."""
    result = _eager_sparse_flash_attention_grad(
        query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, scale_value,
        sparse_block_size=sparse_block_size, query_rope=query_rope, key_rope=key_rope,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        deterministic=deterministic, backend=backend, sinks=sinks,
    )
    dq_rope = result.d_query_rope if result.d_query_rope is not None else _empty_like_none(query)
    dk_rope = result.d_key_rope if result.d_key_rope is not None else _empty_like_none(key)
    d_sinks = result.d_sinks if result.d_sinks is not None else _empty_like_none(query, torch.float32)
    return result.d_query, result.d_key, result.d_value, dq_rope, dk_rope, d_sinks


@_sfa_grad_op.register_fake
def _(query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, scale_value, sparse_block_size=1,
      query_rope=None, key_rope=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None, layout="BSND",
      sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, deterministic=False, backend="auto", sinks=None):
    dq_rope = torch.empty_like(query_rope) if query_rope is not None else _empty_like_none(query)
    dk_rope = torch.empty_like(key_rope) if key_rope is not None else _empty_like_none(key)
    d_sinks = torch.empty_like(sinks) if sinks is not None else _empty_like_none(query, torch.float32)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dq_rope, dk_rope, d_sinks


def sparse_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float, *,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None, sparse_block_size: int = 1, layout: str = "BSND", sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, backend: str = "auto",
    block_table: Tensor | None = None, layout_kv: str | None = None, sinks: Tensor | None = None,
) -> SparseFlashAttentionResult:
    """``cann_attn.sparse_flash_attention`` through the ``cann_attn::sparse_flash_attention`` custom op:
    traceable and differentiable (gradients to query, key, value, query_rope, key_rope; not through a paged
    cache)."""
    return SparseFlashAttentionResult(*torch.ops.cann_attn.sparse_flash_attention(
        query, key, value, sparse_indices, float(scale_value), query_rope, key_rope,
        _ints(actual_seq_lengths_query, "actual_seq_lengths_query"),
        _ints(actual_seq_lengths_kv, "actual_seq_lengths_kv"), sparse_block_size, layout, sparse_mode, pre_tokens,
        next_tokens, backend, block_table=block_table, layout_kv=layout_kv or "", sinks=sinks,
    ))


def sparse_flash_attention_grad(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, d_out: Tensor, out: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, *, sparse_block_size: int = 1,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None, layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX, deterministic: bool = False, backend: str = "auto", sinks: Tensor | None = None,
) -> SparseFlashAttentionGradResult:
    """``cann_attn.sparse_flash_attention_grad`` through its custom op; rope gradients are None without rope,
    d_sinks None without sinks."""
    dq, dk, dv, dq_rope, dk_rope, d_sinks = torch.ops.cann_attn.sparse_flash_attention_grad(
        query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, float(scale_value),
        sparse_block_size, query_rope, key_rope, _ints(actual_seq_lengths_query, "actual_seq_lengths_query"),
        _ints(actual_seq_lengths_kv, "actual_seq_lengths_kv"), layout, sparse_mode, pre_tokens, next_tokens,
        deterministic, backend, sinks,
    )
    return SparseFlashAttentionGradResult(dq, dk, dv, _none_if_placeholder(dq_rope, query_rope is not None),
                                          _none_if_placeholder(dk_rope, key_rope is not None),
                                          _none_if_placeholder(d_sinks, sinks is not None))


# ===================================================================== LightningIndexer and its KL-loss grad op
@torch.library.custom_op("cann_attn::lightning_indexer", mutates_args=())
def _li_op(
    query_index: Tensor, key_index: Tensor, weights: Tensor, actual_seq_lengths_query: list[int] | None = None,
    actual_seq_lengths_key: list[int] | None = None, layout: str = "BSND", sparse_count: int = 2048,
    sparse_mode: int = 3, return_value: bool = False, backend: str = "auto", block_table: Tensor | None = None,
    layout_key: str = "",
) -> tuple[Tensor, Tensor]:
    """LightningIndexer -> (sparse_indices, sparse_values); sparse_values is an empty (0,) tensor unless
    return_value; `block_table` / `layout_key="PA_BSND"`: a paged key cache (docs/semantics/paged-kv.md)."""
    result = _eager_lightning_indexer(
        query_index, key_index, weights, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_key, layout=layout, sparse_count=sparse_count,
        sparse_mode=sparse_mode, return_value=return_value, backend=backend, block_table=block_table,
        layout_key=layout_key or None,
    )
    values = result.sparse_values if result.sparse_values is not None else _empty_like_none(query_index)
    return result.sparse_indices, values


@_li_op.register_fake
def _(query_index, key_index, weights, actual_seq_lengths_query=None, actual_seq_lengths_key=None, layout="BSND",
      sparse_count=2048, sparse_mode=3, return_value=False, backend="auto", block_table=None, layout_key=""):
    shape = (*query_index.shape[:-2], 1, sparse_count)
    indices = query_index.new_empty(shape, dtype=torch.int32)
    values = query_index.new_empty(shape) if return_value else _empty_like_none(query_index)
    return indices, values


def lightning_indexer(
    query_index: Tensor, key_index: Tensor, weights: Tensor, *, actual_seq_lengths_query=None,
    actual_seq_lengths_key=None, layout: str = "BSND", sparse_count: int = 2048, sparse_mode: int = 3,
    return_value: bool = False, backend: str = "auto", block_table: Tensor | None = None,
    layout_key: str | None = None,
) -> LightningIndexerResult:
    """``cann_attn.lightning_indexer`` through the ``cann_attn::lightning_indexer`` custom op."""
    indices, values = torch.ops.cann_attn.lightning_indexer(
        query_index, key_index, weights, _ints(actual_seq_lengths_query, "actual_seq_lengths_query"),
        _ints(actual_seq_lengths_key, "actual_seq_lengths_key"), layout, sparse_count, sparse_mode, return_value,
        backend, block_table=block_table, layout_key=layout_key or "",
    )
    return LightningIndexerResult(indices, _none_if_placeholder(values, return_value))


@torch.library.custom_op("cann_attn::sparse_lightning_indexer_grad_kl_loss", mutates_args=())
def _sli_kl_op(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, sparse_indices: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, actual_seq_lengths_query: list[int] | None = None,
    actual_seq_lengths_key: list[int] | None = None, layout: str = "BSND", sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, deterministic: bool = False, backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """SparseLightningIndexerGradKLLoss -> (d_query_index, d_key_index, d_weights, loss)."""
    return tuple(_eager_sparse_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum, scale_value,
        query_rope=query_rope, key_rope=key_rope, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_key, layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
        next_tokens=next_tokens, deterministic=deterministic, backend=backend,
    ))


@_sli_kl_op.register_fake
def _(query, key, query_index, key_index, weights, *args, **kwargs):
    loss = query.new_empty((1,), dtype=accumulation_dtype(query_index.dtype))
    return torch.empty_like(query_index), torch.empty_like(key_index), torch.empty_like(weights), loss


def sparse_lightning_indexer_grad_kl_loss(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, sparse_indices: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, *, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    deterministic: bool = False, backend: str = "auto",
) -> SparseLightningIndexerGradKLLossResult:
    """``cann_attn.sparse_lightning_indexer_grad_kl_loss`` through its custom op."""
    return SparseLightningIndexerGradKLLossResult(*torch.ops.cann_attn.sparse_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum, float(scale_value),
        query_rope, key_rope, _ints(actual_seq_lengths_query, "actual_seq_lengths_query"),
        _ints(actual_seq_lengths_key, "actual_seq_lengths_key"), layout, sparse_mode, pre_tokens, next_tokens,
        deterministic, backend,
    ))


@torch.library.custom_op("cann_attn::count_tokens_with_keys", mutates_args=())
def _count_op(
    query_index: Tensor, key_index: Tensor, sparse_indices: Tensor, layout: str, sparse_mode: int,
    actual_seq_lengths_query: list[int] | None = None, actual_seq_lengths_key: list[int] | None = None,
) -> Tensor:
    """max(1, query tokens with a valid selected key) as a 0-d fp32 CPU tensor: the divisor of
    ``cann_attn.indexer_kl_loss(reduction="mean")``, a tensor so that compiled code needs no data-dependent int."""
    # float32 whatever torch's default dtype (the fake's promise).
    return torch.tensor(float(max(1, _eager_count_tokens_with_keys(
        query_index, key_index, sparse_indices, layout, sparse_mode, actual_seq_lengths_query,
        actual_seq_lengths_key))), dtype=torch.float32)


@_count_op.register_fake
def _(query_index, key_index, sparse_indices, layout, sparse_mode, actual_seq_lengths_query=None,
      actual_seq_lengths_key=None):
    return torch.empty((), dtype=torch.float32)


def count_tokens_with_keys(query_index: Tensor, key_index: Tensor, sparse_indices: Tensor, layout: str,
                           sparse_mode: int, actual_seq_lengths_query=None, actual_seq_lengths_key=None) -> Tensor:
    """The ``cann_attn::count_tokens_with_keys`` custom op (see there)."""
    return torch.ops.cann_attn.count_tokens_with_keys(
        query_index, key_index, sparse_indices, layout, sparse_mode,
        _ints(actual_seq_lengths_query, "actual_seq_lengths_query"),
        _ints(actual_seq_lengths_key, "actual_seq_lengths_key"))


# ============================================================== RingAttentionUpdate and AttentionUpdate (merges)
@torch.library.custom_op("cann_attn::ring_attention_update", mutates_args=())
def _ring_update_op(
    prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor, cur_attn_out: Tensor,
    cur_softmax_max: Tensor, cur_softmax_sum: Tensor, actual_seq_qlen: list[int] | None = None,
    input_layout: str = "SBH", input_softmax_layout: str = "", backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """RingAttentionUpdate -> (attn_out, softmax_max, softmax_sum)."""
    return tuple(_eager_ring_attention_update(
        prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
        actual_seq_qlen=actual_seq_qlen, input_layout=input_layout, input_softmax_layout=input_softmax_layout,
        backend=backend,
    ))


@_ring_update_op.register_fake
def _(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
      actual_seq_qlen=None, input_layout="SBH", input_softmax_layout="", backend="auto"):
    return (torch.empty_like(prev_attn_out), torch.empty_like(prev_softmax_max),
            torch.empty_like(prev_softmax_sum))


def ring_attention_update(
    prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor, cur_attn_out: Tensor,
    cur_softmax_max: Tensor, cur_softmax_sum: Tensor, *, actual_seq_qlen=None, input_layout: str = "SBH",
    input_softmax_layout: str = "", backend: str = "auto",
) -> RingAttentionUpdateResult:
    """``cann_attn.ring_attention_update`` through the ``cann_attn::ring_attention_update`` custom op."""
    return RingAttentionUpdateResult(*torch.ops.cann_attn.ring_attention_update(
        prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum,
        _ints(actual_seq_qlen, "actual_seq_qlen"), input_layout, input_softmax_layout, backend,
    ))


@torch.library.custom_op("cann_attn::attention_update", mutates_args=())
def _attention_update_op(lse: list[Tensor], local_out: list[Tensor], update_type: int, backend: str = "auto"
                         ) -> tuple[Tensor, Tensor]:
    """AttentionUpdate -> (out, lse_out); lse_out is an empty (0,) tensor when update_type == 0."""
    result = _eager_attention_update(lse, local_out, update_type, backend=backend)
    lse_out = result.lse_out if result.lse_out is not None else _empty_like_none(lse[0])
    return result.out, lse_out


@_attention_update_op.register_fake
def _(lse, local_out, update_type, backend="auto"):
    lse_out = torch.empty_like(lse[0]) if update_type == 1 else _empty_like_none(lse[0])
    return torch.empty_like(local_out[0]), lse_out


def attention_update(lse, local_out, update_type: int, *, backend: str = "auto") -> AttentionUpdateResult:
    """``cann_attn.attention_update`` through the ``cann_attn::attention_update`` custom op (lse_out None when
    update_type == 0)."""
    out, lse_out = torch.ops.cann_attn.attention_update(list(lse), list(local_out), update_type, backend)
    return AttentionUpdateResult(out, _none_if_placeholder(lse_out, update_type == 1))


# The dense indexer pair and the quantised DSA inference operators live in their own module (library_quant.py);
# their wrappers are re-exported here, where `traced_as_custom_op` looks them up.
from .library_quant import (  # noqa: E402
    dense_lightning_indexer_grad_kl_loss,
    dense_lightning_indexer_softmax_lse,
    kv_quant_sparse_flash_attention,
    quant_lightning_indexer,
)

__all__ += ["dense_lightning_indexer_grad_kl_loss", "dense_lightning_indexer_softmax_lse",
            "kv_quant_sparse_flash_attention", "quant_lightning_indexer"]

# The ATB attention operators' custom ops (library_atb.py), re-exported for `traced_as_custom_op`.
from .library_atb import (  # noqa: E402
    atb_flash_attention,
    atb_flash_attention_unpad,
    atb_paged_attention,
    atb_paged_attention_splitfuse,
)

__all__ += ["atb_flash_attention", "atb_flash_attention_unpad", "atb_paged_attention",
            "atb_paged_attention_splitfuse"]
