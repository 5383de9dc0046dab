"""torch_npu's attention operators, names, argument names, defaults and return tuples, on CPU and GPU.

``import cann_attn.torch_npu as torch_npu`` lets code written for Ascend run unchanged but for that import. Every
function runs the ``cann_attn::*`` custom ops of :mod:`cann_attn.library`, so it is traceable by
``torch.compile(fullgraph=True)`` and the forward functions are differentiable like torch_npu's (autograd routes
``npu_fusion_attention(_v2)`` to the FlashAttentionScoreGrad op and ``npu_sparse_flash_attention`` to the
SparseFlashAttentionGrad op).

Signatures follow op-plugin's ``op_plugin_functions.yaml`` and the torch_npu API documentation:

* ``npu_fusion_attention`` (v1 spelling ``pre_tockens``/``next_tockens``, pse always type 1) ->
  ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``;
  ``npu_fusion_attention_grad`` -> ``(dq, dk, dv, dpse)``.
* ``npu_fusion_attention_v2`` (``pre_tokens``/``next_tokens``, ``pse_type``, ``q_start_idx``/``kv_start_idx``,
  ``query_rope``/``key_rope``) -> the same 7-tuple; ``npu_fusion_attention_grad_v2`` ->
  ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)`` as in current torch_npu (older releases returned the first 4 or
  6 of these). ``query_rope``/``key_rope`` are concatenated to query/key along the head dim (S = scale *
  (Q K^T + Qr Kr^T)). ``sink`` is not supported.
* ``npu_prompt_flash_attention``, ``npu_trans_quant_param``, ``npu_sparse_flash_attention`` (with
  ``return_softmax_lse``), ``npu_sparse_flash_attention_grad``, ``npu_lightning_indexer``,
  ``npu_sparse_lightning_indexer_grad_kl_loss``.

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
``inner_precise`` and ``padding_mask`` are accepted and have no effect; PageAttention (``block_table``,
``layout_kv='PA_BSND'``) is not supported; length tensors are turned into lists with ``.tolist()`` (a graph break
under torch.compile: pass Python lists there).
"""

import torch
from torch import Tensor

from . import library
from .errors import ParamInvalidError
from .ops.flash_attention_score import INT_MAX
from .problem.dropout import drop_mask_numel
from .problem.lengths import to_int_list

__all__ = [
    "get_rng_state",
    "manual_seed",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_fusion_attention_grad_v2",
    "npu_fusion_attention_v2",
    "npu_lightning_indexer",
    "npu_prompt_flash_attention",
    "npu_sparse_flash_attention",
    "npu_sparse_flash_attention_grad",
    "npu_sparse_lightning_indexer_grad_kl_loss",
    "npu_trans_quant_param",
    "set_rng_state",
]

INT64_MAX = 2**63 - 1
PFA_PRE_TOKENS = 2147473647  # torch_npu's documented default for npu_prompt_flash_attention (sic)

# [seed, offset] of the dropout generator; advanced in place (also inside compiled graphs).
_RNG_STATE = torch.zeros(2, dtype=torch.int64)


def manual_seed(seed: int) -> None:
    """Reset the dropout generator to (seed, offset 0) (what ``torch_npu.npu.manual_seed`` does for the NPU)."""
    _RNG_STATE[0] = int(seed)
    _RNG_STATE[1] = 0


def get_rng_state() -> Tensor:
    """A copy of the dropout generator state, an int64 tensor ``[seed, offset]``."""
    return _RNG_STATE.clone()


def set_rng_state(state: Tensor) -> None:
    """Restore a state returned by :func:`get_rng_state`."""
    _RNG_STATE.copy_(torch.as_tensor(state, dtype=torch.int64).reshape(2))


# ----------------------------------------------------------------------------------------------- helpers
def _ints(value, name: str) -> list[int] | None:
    return to_int_list(value, name)


def _tnd_ends(value, name: str) -> list[int] | None:
    """Cumulative TND ends, with torch_npu's form for batches left out at the end: "TND格式下，支持尾部部分Batch不参与
    计算，此时actual_seq_q_len和actual_seq_kv_len尾部传入对应个数个0即可" (npu_fusion_attention constraints; lengths
    [2, 3, 4] plus two batches left out are passed as [2, 5, 9, 0, 0]). Those trailing zeros become empty
    sequences, [2, 5, 9, 9, 9], the form the operators take (SEMANTICS.md 1)."""
    ends = _ints(value, name)
    if not ends:
        return ends
    kept = len(ends)
    while kept > 0 and ends[kept - 1] == 0:
        kept -= 1
    if kept in (0, len(ends)):
        return ends
    return ends[:kept] + [ends[kept - 1]] * (len(ends) - kept)


def _mask_numel(query: Tensor, key: Tensor, head_num: int, layout: str, q_ends, kv_ends) -> int:
    """Elements of the logical keep mask: B*N1*Sq*Skv, TND N1*sum(Sq_b*Skv_b) (SEMANTICS.md 5)."""
    if layout == "TND":
        return drop_mask_numel(head_num, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends)
    if layout not in ("BSH", "SBH", "BSND", "BNSD"):
        raise ParamInvalidError(f"input_layout: expected one of BSH, SBH, BSND, BNSD, TND, got {layout!r}")
    batch, seq = {"BSH": (0, 1), "SBH": (1, 0), "BSND": (0, 1), "BNSD": (0, 2)}[layout]
    return drop_mask_numel(head_num, batch=query.shape[batch], seq_q=query.shape[seq], seq_kv=key.shape[seq])


def _uses_dropout(keep_prob) -> bool:
    return float(keep_prob) < 1.0


def _draw_drop_mask(query: Tensor, numels: int, keep_prob: float):
    """(drop_mask, seed, offset) at the generator's current state, which then advances by numels."""
    state = _RNG_STATE.clone()
    _RNG_STATE[1] += numels
    drop_mask = torch.ops.cann_attn.dropout_mask(state, numels, float(keep_prob), query.device)
    if torch.compiler.is_compiling():
        return drop_mask, state[0], state[1]
    seed, offset = state.tolist()
    return drop_mask, seed, offset


def _no_draw():
    if torch.compiler.is_compiling():
        return torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    return 0, 0


def _regenerate_drop_mask(query, key, head_num, layout, keep_prob, seed, offset, numels, q_ends, kv_ends):
    """The keep mask a forward drew at (seed, offset), for the grad functions (None without dropout)."""
    if not _uses_dropout(keep_prob):
        return None
    expected = _mask_numel(query, key, head_num, layout, q_ends, kv_ends)
    if isinstance(numels, int) and numels not in (0, expected):
        raise ParamInvalidError(
            f"numels: expected the forward's mask size {expected} (or 0 to derive it), got {numels}"
        )
    if isinstance(seed, Tensor) or isinstance(offset, Tensor):
        state = torch.stack([torch.as_tensor(seed).reshape(()), torch.as_tensor(offset).reshape(())])
        state = state.to(device="cpu", dtype=torch.int64)
    else:
        state = torch.tensor([int(seed), int(offset)], dtype=torch.int64)
    return torch.ops.cann_attn.dropout_mask(state, expected, float(keep_prob), query.device)


def _head_dim(query: Tensor, head_num: int, layout: str) -> int:
    return query.shape[-1] // head_num if layout in ("BSH", "SBH") else query.shape[-1]


def _cat_rope(x: Tensor, rope: Tensor | None, layout: str, head_dim: int, rope_dim: int) -> Tensor:
    """[x ; rope] along the head dim (BSH/SBH: per head inside H)."""
    if rope is None:
        return x
    if layout in ("BSH", "SBH"):
        heads = x.shape[-1] // head_dim
        return torch.cat([x.unflatten(-1, (heads, head_dim)), rope.unflatten(-1, (heads, rope_dim))], -1).flatten(-2)
    return torch.cat([x, rope], -1)


def _split_rope(g: Tensor, layout: str, head_dim: int, rope_dim: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`_cat_rope` for a gradient."""
    if layout in ("BSH", "SBH"):
        heads = g.shape[-1] // (head_dim + rope_dim)
        per_head = g.unflatten(-1, (heads, head_dim + rope_dim))
        return per_head[..., :head_dim].flatten(-2), per_head[..., head_dim:].flatten(-2)
    return g[..., :head_dim].contiguous(), g[..., head_dim:].contiguous()


def _rope_dims(query: Tensor, query_rope: Tensor | None, key_rope: Tensor | None, head_num: int, layout: str):
    if (query_rope is None) != (key_rope is None):
        raise ParamInvalidError("query_rope/key_rope: give both rope tensors or neither")
    head_dim = _head_dim(query, head_num, layout)
    rope_dim = 0 if query_rope is None else _head_dim(query_rope, head_num, layout)
    return head_dim, rope_dim


def _layout(input_layout):
    """torch_npu upper-cases input_layout before checking it ("BSH/SBH/BNSD/BSND/TND (case-insensitive)")."""
    return input_layout.upper() if isinstance(input_layout, str) else input_layout


def _check_sink(sink) -> None:
    if sink is not None:
        raise ParamInvalidError("sink: attention sinks are not supported by cann_attn, got a tensor")


# ------------------------------------------------------------------------------------ FlashAttentionScore
def _fusion_attention(query, key, value, head_num, input_layout, *, pse, padding_mask, atten_mask, scale, keep_prob,
                      pre_tokens, next_tokens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                      pse_type, q_start_idx, kv_start_idx, softmax_layout):
    q_ends = _tnd_ends(actual_seq_qlen, "actual_seq_qlen")
    kv_ends = _tnd_ends(actual_seq_kvlen, "actual_seq_kvlen")
    drop_mask, numels = None, None
    if _uses_dropout(keep_prob):
        numels = _mask_numel(query, key, head_num, input_layout, q_ends, kv_ends)
        drop_mask, seed, offset = _draw_drop_mask(query, numels, keep_prob)
    else:
        seed, offset = _no_draw()
    out, softmax_max, softmax_sum, softmax_out = torch.ops.cann_attn.flash_attention_score(
        query, key, value, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, _ints(prefix, "prefix"),
        q_ends, kv_ends, _ints(q_start_idx, "q_start_idx"), _ints(kv_start_idx, "kv_start_idx"), float(scale),
        float(keep_prob), pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout,
    )
    if numels is None:  # torch_npu reports the mask size without dropout too (sized after the op validated)
        numels = _mask_numel(query, key, head_num, input_layout, q_ends, kv_ends)
    return out, softmax_max, softmax_sum, softmax_out, seed, offset, numels


def npu_fusion_attention(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, pse: Tensor | None = None,
    padding_mask: Tensor | None = None, atten_mask: Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX, inner_precise: int = 0, prefix=None,
    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False, softmax_layout: str = "",
):
    """torch_npu.npu_fusion_attention (FlashAttentionScore, pse type 1: S = scale * (Q K^T + pse)).

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``; differentiable
    w.r.t. query, key, value and pse. With ``keep_prob < 1`` the keep mask is drawn at (seed, offset) of this
    module's generator (module docstring); pass seed, offset and numels to :func:`npu_fusion_attention_grad`.
    """
    input_layout = _layout(input_layout)
    return _fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1, q_start_idx=None, kv_start_idx=None,
        softmax_layout=softmax_layout,
    )


def npu_fusion_attention_v2(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, *, pse: Tensor | None = None,
    padding_mask: Tensor | None = None, atten_mask: Tensor | None = None, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX, inner_precise: int = 0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
    sparse_mode: int = 0, gen_mask_parallel: bool = True, sync: bool = False, pse_type: int = 1, q_start_idx=None,
    kv_start_idx=None, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention_v2: ``npu_fusion_attention`` with ``pse_type`` (0..3, SEMANTICS.md 4),
    ``q_start_idx``/``kv_start_idx`` for ALiBi, and ``query_rope``/``key_rope`` appended to query/key along the head
    dim. Same 7-tuple; differentiable w.r.t. query, key, value, a type 0/1 pse and the rope tensors."""
    input_layout = _layout(input_layout)
    _check_sink(sink)
    head_dim, rope_dim = _rope_dims(query, query_rope, key_rope, head_num, input_layout)
    query = _cat_rope(query, query_rope, input_layout, head_dim, rope_dim)
    key = _cat_rope(key, key_rope, input_layout, head_dim, rope_dim)
    return _fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=pse_type, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx, softmax_layout=softmax_layout,
    )


def _fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse, padding_mask, atten_mask,
                           softmax_max, softmax_sum, softmax_in, attention_in, scale_value, keep_prob, pre_tokens,
                           next_tokens, inner_precise, seed, offset, numels, prefix, actual_seq_qlen,
                           actual_seq_kvlen, sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout):
    q_ends = _tnd_ends(actual_seq_qlen, "actual_seq_qlen")
    kv_ends = _tnd_ends(actual_seq_kvlen, "actual_seq_kvlen")
    drop_mask = _regenerate_drop_mask(query, key, head_num, input_layout, keep_prob, seed, offset, numels, q_ends,
                                      kv_ends)
    dq, dk, dv, dpse = torch.ops.cann_attn.flash_attention_score_grad(
        query, key, value, dy, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, softmax_max,
        softmax_sum, softmax_in, attention_in, _ints(prefix, "prefix"), q_ends, kv_ends,
        _ints(q_start_idx, "q_start_idx"), _ints(kv_start_idx, "kv_start_idx"), float(scale_value), float(keep_prob),
        pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout,
    )
    return dq, dk, dv, dpse if pse is not None and pse_type in (0, 1) else None


def npu_fusion_attention_grad(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str, *,
    pse: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None, softmax_in: Tensor | None = None,
    attention_in: Tensor | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX, inner_precise: int = 0, seed=0, offset=0, numels=0,
    prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False, softmax_layout: str = "",
):
    """torch_npu.npu_fusion_attention_grad (FlashAttentionScoreGrad, pse type 1) -> ``(dq, dk, dv, dpse)``.

    With ``keep_prob < 1`` the forward's keep mask is regenerated from ``seed`` and ``offset`` (ints or the 0-d
    tensors a compiled forward returns); ``numels`` must be the forward's (or 0). dpse is None without pse.
    """
    input_layout = _layout(input_layout)
    return _fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, seed=seed, offset=offset, numels=numels, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1,
        q_start_idx=None, kv_start_idx=None, softmax_layout=softmax_layout,
    )


def npu_fusion_attention_grad_v2(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str, *,
    pse: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None, softmax_in: Tensor | None = None,
    attention_in: Tensor | None = None, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    scale_value: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX,
    inner_precise: int = 0, seed=0, offset=0, numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
    sparse_mode: int = 0, gen_mask_parallel: bool = True, sync: bool = False, pse_type: int = 1, q_start_idx=None,
    kv_start_idx=None, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention_grad_v2 -> ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)``.

    dpse is None unless a type 0/1 pse tensor is given; dq_rope/dk_rope are None without rope inputs; dsink is
    always None (sinks are not supported).
    """
    input_layout = _layout(input_layout)
    _check_sink(sink)
    head_dim, rope_dim = _rope_dims(query, query_rope, key_rope, head_num, input_layout)
    full_query = _cat_rope(query, query_rope, input_layout, head_dim, rope_dim)
    full_key = _cat_rope(key, key_rope, input_layout, head_dim, rope_dim)
    dq, dk, dv, dpse = _fusion_attention_grad(
        full_query, full_key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in,
        attention_in=attention_in, scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, seed=seed, offset=offset, numels=numels,
        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
        pse_type=pse_type, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, softmax_layout=softmax_layout,
    )
    dq_rope = dk_rope = None
    if query_rope is not None:
        dq, dq_rope = _split_rope(dq, input_layout, head_dim, rope_dim)
        dk, dk_rope = _split_rope(dk, input_layout, head_dim, rope_dim)
    return dq, dk, dv, dpse, dq_rope, dk_rope, None


# ------------------------------------------------------------------------- PromptFlashAttention and quant
def npu_prompt_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, *, padding_mask: Tensor | None = None,
    atten_mask: Tensor | None = None, pse_shift: Tensor | None = None, actual_seq_lengths=None,
    deq_scale1: Tensor | None = None, quant_scale1: Tensor | None = None, deq_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None, quant_offset2: Tensor | None = None, num_heads: int = 1,
    scale_value: float = 1.0, pre_tokens: int = PFA_PRE_TOKENS, next_tokens: int = 0, input_layout: str = "BSH",
    num_key_value_heads: int = 0, actual_seq_lengths_kv=None, sparse_mode: int = 0,
) -> Tensor:
    """torch_npu.npu_prompt_flash_attention (PromptFlashAttentionV2, inference: not differentiable). The output
    dtype is int8 with quant_scale2, float16 for int8 inputs, else the query's. padding_mask is reserved."""
    return torch.ops.cann_attn.prompt_flash_attention(
        query, key, value, pse_shift, atten_mask, _ints(actual_seq_lengths, "actual_seq_lengths"),
        _ints(actual_seq_lengths_kv, "actual_seq_lengths_kv"), deq_scale1, quant_scale1, deq_scale2, quant_scale2,
        quant_offset2, num_heads, float(scale_value), pre_tokens, next_tokens, input_layout, num_key_value_heads,
        sparse_mode,
    )


def npu_trans_quant_param(scale: Tensor, offset: Tensor | None = None, round_mode: int | None = 0) -> Tensor:
    """torch_npu.npu_trans_quant_param: float32 scales (and offsets) -> UINT64 deq-scale words, returned as int64
    (SEMANTICS.md 7). ``round_mode`` 0 truncates the scale to its high 19 bits, 1 (R_INT) rounds it to nearest, ties
    to even; None (torch_npu's ``int?``) means 0."""
    return library.trans_quant_param(scale, offset, 0 if round_mode is None else round_mode)


# ------------------------------------------------------------------------------------------- DSA ops
def _check_no_page_attention(block_table, layout_query: str, layout_kv: str) -> None:
    if block_table is not None or layout_kv == "PA_BSND":
        raise ParamInvalidError("block_table/layout_kv: PageAttention (PA_BSND) is not supported by cann_attn")
    if layout_kv != layout_query:
        raise ParamInvalidError(f"layout_kv: expected the query's layout {layout_query!r}, got {layout_kv!r}")


def _check_attention_mode(attention_mode: int) -> None:
    if attention_mode not in (0, 2):
        raise ParamInvalidError(f"attention_mode: expected 0 or 2 (MLA-absorb), got {attention_mode!r}")


def npu_sparse_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float, *,
    block_table: Tensor | None = None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, sparse_block_size: int = 1,
    layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX, attention_mode: int = 0, return_softmax_lse: bool = False,
):
    """torch_npu.npu_sparse_flash_attention -> ``(attention_out, softmax_max, softmax_sum)``.

    The statistics ([B, N2, S1, G] / [N2, T1, G], fp32) are returned with ``return_softmax_lse=True``, else empty
    (0,) tensors. Differentiable w.r.t. query, key, value, query_rope and key_rope (SparseFlashAttentionGrad).
    """
    _check_no_page_attention(block_table, layout_query, layout_kv)
    _check_attention_mode(attention_mode)
    out, softmax_max, softmax_sum = torch.ops.cann_attn.sparse_flash_attention(
        query, key, value, sparse_indices, float(scale_value), query_rope, key_rope,
        _ints(actual_seq_lengths_query, "actual_seq_lengths_query"),
        _ints(actual_seq_lengths_kv, "actual_seq_lengths_kv"), sparse_block_size, layout_query, sparse_mode,
        pre_tokens, next_tokens,
    )
    if not return_softmax_lse:
        softmax_max = softmax_max.new_empty((0,))
        softmax_sum = softmax_sum.new_empty((0,))
    return out, softmax_max, softmax_sum


def npu_sparse_flash_attention_grad(
    query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, d_out: Tensor, out: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, sparse_block_size: int = 1, *,
    query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_qlen=None, actual_seq_kvlen=None,
    layout: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    attention_mode: int = 0,
):
    """torch_npu.npu_sparse_flash_attention_grad -> ``(d_query, d_key, d_value, d_query_rope, d_key_rope)``;
    like torch_npu the rope gradients are empty (0,) tensors without rope inputs, and the result is deterministic.
    """
    _check_attention_mode(attention_mode)
    return torch.ops.cann_attn.sparse_flash_attention_grad(
        query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, float(scale_value),
        sparse_block_size, query_rope, key_rope, _ints(actual_seq_qlen, "actual_seq_qlen"),
        _ints(actual_seq_kvlen, "actual_seq_kvlen"), layout, sparse_mode, pre_tokens, next_tokens, True,
    )


def npu_lightning_indexer(
    query: Tensor, key: Tensor, weights: Tensor, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
    block_table: Tensor | None = None, layout_query: str = "BSND", layout_key: str = "BSND",
    sparse_count: int = 2048, sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
    return_value: bool = False,
):
    """torch_npu.npu_lightning_indexer -> ``(sparse_indices, sparse_values)``; int32 indices [B, S1, 1, K] /
    [T1, 1, K]; sparse_values is an empty (0,) tensor unless ``return_value``."""
    _check_no_page_attention(block_table, layout_query, layout_key)
    return torch.ops.cann_attn.lightning_indexer(
        query, key, weights, _ints(actual_seq_lengths_query, "actual_seq_lengths_query"),
        _ints(actual_seq_lengths_key, "actual_seq_lengths_key"), layout_query, sparse_count, sparse_mode,
        return_value,
    )


def npu_sparse_lightning_indexer_grad_kl_loss(
    query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor, sparse_indices: Tensor,
    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, *, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, actual_seq_qlen=None, actual_seq_klen=None, layout: str = "BSND",
    sparse_mode: int = 3, pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX,
):
    """torch_npu.npu_sparse_lightning_indexer_grad_kl_loss -> ``(d_query_index, d_key_index, d_weights, loss)``
    (loss: fp32 [1], summed over all tokens; SEMANTICS.md 9)."""
    return torch.ops.cann_attn.sparse_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum, float(scale_value),
        query_rope, key_rope, _ints(actual_seq_qlen, "actual_seq_qlen"), _ints(actual_seq_klen, "actual_seq_klen"),
        layout, sparse_mode, pre_tokens, next_tokens, True,
    )
