"""torch_npu's FlashAttentionScore spellings: ``npu_fusion_attention(_v2)`` and their grads."""

import torch
from torch import Tensor

from ..errors import ParamInvalidError
from ..ops.flash_attention_score import INT_MAX
from ..problem.dropout import drop_mask_numel
from ._common import _ints
from ._rng import _RNG_STATE


def _tnd_ends(value, name: str) -> list[int] | None:
    """Cumulative TND ends, with torch_npu's form for batches left out at the end: "TND格式下，支持尾部部分Batch不参与
    计算，此时actual_seq_q_len和actual_seq_kv_len尾部传入对应个数个0即可" (npu_fusion_attention constraints; lengths
    [2, 3, 4] plus two batches left out are passed as [2, 5, 9, 0, 0]). Those trailing zeros become empty
    sequences, [2, 5, 9, 9, 9], the form the operators take (docs/semantics/layouts.md)."""
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
    """Elements of the logical keep mask: B*N1*Sq*Skv, TND N1*sum(Sq_b*Skv_b) (docs/semantics/dropout.md)."""
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


# ------------------------------------------------------------------------------------ FlashAttentionScore
def _fusion_attention(query, key, value, head_num, input_layout, *, pse, padding_mask, atten_mask, scale, keep_prob,
                      pre_tokens, next_tokens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                      pse_type, q_start_idx, kv_start_idx, softmax_layout, sink):
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
        float(keep_prob), pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout, sink=sink,
    )
    if numels is None:  # torch_npu reports the mask size without dropout too (sized after the op validated)
        numels = _mask_numel(query, key, head_num, input_layout, q_ends, kv_ends)
    return out, softmax_max, softmax_sum, softmax_out, seed, offset, numels


def npu_fusion_attention(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, pse: Tensor | None = None,
    padding_mask: Tensor | None = None, atten_mask: Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX, inner_precise: int = 0, prefix=None,
    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention (FlashAttentionScore, pse type 1: S = scale * (Q K^T + pse)).

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``; differentiable
    w.r.t. query, key, value, pse and ``sink`` (float32 [head_num], docs/semantics/sinks.md). With ``keep_prob < 1``
    the keep mask is drawn at (seed, offset) of this module's generator (module docstring); pass seed, offset and
    numels to :func:`npu_fusion_attention_grad`.
    """
    input_layout = _layout(input_layout)
    return _fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1, q_start_idx=None, kv_start_idx=None,
        softmax_layout=softmax_layout, sink=sink,
    )


def npu_fusion_attention_v2(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, *, pse: Tensor | None = None,
    padding_mask: Tensor | None = None, atten_mask: Tensor | None = None, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX, inner_precise: int = 0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
    sparse_mode: int = 0, gen_mask_parallel: bool = True, sync: bool = False, pse_type: int = 1, q_start_idx=None,
    kv_start_idx=None, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention_v2: ``npu_fusion_attention`` with ``pse_type`` (0..3, docs/semantics/pse.md),
    ``q_start_idx``/``kv_start_idx`` for ALiBi, and ``query_rope``/``key_rope`` appended to query/key along the head
    dim. Same 7-tuple; differentiable w.r.t. query, key, value, a type 0/1 pse, the rope tensors and the sink."""
    input_layout = _layout(input_layout)
    head_dim, rope_dim = _rope_dims(query, query_rope, key_rope, head_num, input_layout)
    query = _cat_rope(query, query_rope, input_layout, head_dim, rope_dim)
    key = _cat_rope(key, key_rope, input_layout, head_dim, rope_dim)
    return _fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=pse_type, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx, softmax_layout=softmax_layout, sink=sink,
    )


def _fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse, padding_mask, atten_mask,
                           softmax_max, softmax_sum, softmax_in, attention_in, scale_value, keep_prob, pre_tokens,
                           next_tokens, inner_precise, seed, offset, numels, prefix, actual_seq_qlen,
                           actual_seq_kvlen, sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout, sink):
    q_ends = _tnd_ends(actual_seq_qlen, "actual_seq_qlen")
    kv_ends = _tnd_ends(actual_seq_kvlen, "actual_seq_kvlen")
    drop_mask = _regenerate_drop_mask(query, key, head_num, input_layout, keep_prob, seed, offset, numels, q_ends,
                                      kv_ends)
    dq, dk, dv, dpse, dsink = torch.ops.cann_attn.flash_attention_score_grad(
        query, key, value, dy, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, softmax_max,
        softmax_sum, softmax_in, attention_in, _ints(prefix, "prefix"), q_ends, kv_ends,
        _ints(q_start_idx, "q_start_idx"), _ints(kv_start_idx, "kv_start_idx"), float(scale_value), float(keep_prob),
        pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout, sink=sink,
    )
    return (dq, dk, dv, dpse if pse is not None and pse_type in (0, 1) else None,
            dsink if sink is not None else None)


def npu_fusion_attention_grad(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str, *,
    pse: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None, softmax_in: Tensor | None = None,
    attention_in: Tensor | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX, inner_precise: int = 0, seed=0, offset=0, numels=0,
    prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention_grad (FlashAttentionScoreGrad, pse type 1) -> ``(dq, dk, dv, dpse, dsink)``.

    With ``keep_prob < 1`` the forward's keep mask is regenerated from ``seed`` and ``offset`` (ints or the 0-d
    tensors a compiled forward returns); ``numels`` must be the forward's (or 0). dpse is None without pse, dsink
    ([head_num] float32, docs/semantics/sinks.md) None without ``sink``.
    """
    input_layout = _layout(input_layout)
    return _fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, seed=seed, offset=offset, numels=numels, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1,
        q_start_idx=None, kv_start_idx=None, softmax_layout=softmax_layout, sink=sink,
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

    dpse is None unless a type 0/1 pse tensor is given; dq_rope/dk_rope are None without rope inputs; dsink
    ([head_num] float32, docs/semantics/sinks.md) is None without ``sink``.
    """
    input_layout = _layout(input_layout)
    head_dim, rope_dim = _rope_dims(query, query_rope, key_rope, head_num, input_layout)
    full_query = _cat_rope(query, query_rope, input_layout, head_dim, rope_dim)
    full_key = _cat_rope(key, key_rope, input_layout, head_dim, rope_dim)
    dq, dk, dv, dpse, dsink = _fusion_attention_grad(
        full_query, full_key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in,
        attention_in=attention_in, scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, seed=seed, offset=offset, numels=numels,
        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
        pse_type=pse_type, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, softmax_layout=softmax_layout,
        sink=sink,
    )
    dq_rope = dk_rope = None
    if query_rope is not None:
        dq, dq_rope = _split_rope(dq, input_layout, head_dim, rope_dim)
        dk, dk_rope = _split_rope(dk, input_layout, head_dim, rope_dim)
    return dq, dk, dv, dpse, dq_rope, dk_rope, dsink

