"""torch_npu's FlashAttentionScore spellings: ``npu_fusion_attention`` (v1, v2, v3) and their grads.

Schemas: op-plugin ``op_plugin_functions.yaml`` per release (see :mod:`._registry`); outputs and absent optional
outputs as op-plugin's ``FlashAttentionKernelNpuOpApi.cpp`` / ``FlashAttentionV2KernelNpuOpApi.cpp`` return them:
``dpse`` (and v2's ``dq_rope``/``dk_rope``) is None without the input, ``dsink`` an empty (0,) float32 tensor
without ``sink`` (docs/guides/torch_npu.md).
"""

import warnings

import torch
from torch import Tensor

from ..errors import ParamInvalidError, caller_stacklevel, require_real
from ..ops.flash_attention_score import INT_MAX
from ..problem.dropout import drop_mask_numel, validate_drop_mask
from ..problem.layout import BATCH_SEQ_DIMS, head_dim_of
from ..problem.lengths import ends_without_trailing_zeros, to_int_list
from ._registry import npu_op
from ._rng import draw_state

NPU_FUSION_ATTENTION_SCHEMAS = {
    ('7.1',): (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
    ),
    ('7.2',): (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="") -> (Tensor, Tensor, Tensor, '
        "Tensor, int, int, int)"
    ),
    ('7.3',): (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None) -> (Tensor, '
        "Tensor, Tensor, Tensor, int, int, int)"
    ),
    ('26.0', 'current'): (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None, '
        "Tensor? dropout_mask=None, int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, "
        "int)"
    ),
}

NPU_FUSION_ATTENTION_GRAD_SCHEMAS = {
    ('7.1',): (
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    ('7.2',): (
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="") -> (Tensor, Tensor, Tensor, '
        "Tensor)"
    ),
    ('7.3', '26.0', 'current'): (
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None) -> (Tensor, '
        "Tensor, Tensor, Tensor, Tensor)"
    ),
}

NPU_FUSION_ATTENTION_V2_SCHEMAS = {
    ('7.1', '7.2'): (
        "npu_fusion_attention_v2(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, *, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, float scale=1., float keep_prob=1., int pre_tokens=2147483647, "
        "int next_tokens=2147483647, int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
        "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
        "int pse_type=1, int[]? q_start_idx=None, int[]? kv_start_idx=None) -> (Tensor, Tensor, Tensor, "
        "Tensor, int, int, int)"
    ),
    ('7.3',): (
        "npu_fusion_attention_v2(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, *, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, float scale=1., float keep_prob=1., int pre_tokens=2147483647, "
        "int next_tokens=2147483647, int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
        "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
        'int pse_type=1, int[]? q_start_idx=None, int[]? kv_start_idx=None, str softmax_layout="", '
        "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
    ),
    ('26.0', 'current'): (
        "npu_fusion_attention_v2(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, *, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, float scale=1., float keep_prob=1., int pre_tokens=2147483647, "
        "int next_tokens=2147483647, int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
        "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
        'int pse_type=1, int[]? q_start_idx=None, int[]? kv_start_idx=None, str softmax_layout="", '
        "Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, "
        "Tensor, int, int, int)"
    ),
}

NPU_FUSION_ATTENTION_GRAD_V2_SCHEMAS = {
    ('7.1', '7.2'): (
        "npu_fusion_attention_grad_v2(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, Tensor? query_rope=None, Tensor? key_rope=None, float scale_value=1., "
        "float keep_prob=1., int pre_tokens=2147483647, int next_tokens=2147483647, int inner_precise=0, "
        "int seed=0, int offset=0, int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
        "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
        "int pse_type=1, int[]? q_start_idx=None, int[]? kv_start_idx=None) -> (Tensor, Tensor, Tensor, "
        "Tensor, Tensor, Tensor)"
    ),
    ('7.3', '26.0', 'current'): (
        "npu_fusion_attention_grad_v2(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, Tensor? query_rope=None, Tensor? key_rope=None, float scale_value=1., "
        "float keep_prob=1., int pre_tokens=2147483647, int next_tokens=2147483647, int inner_precise=0, "
        "int seed=0, int offset=0, int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
        "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
        'int pse_type=1, int[]? q_start_idx=None, int[]? kv_start_idx=None, str softmax_layout="", '
        "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
}

NPU_FUSION_ATTENTION_V3_SCHEMAS = {
    ('26.0', 'current'): (
        "npu_fusion_attention_v3(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, "
        'int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", '
        "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
}

NPU_FUSION_ATTENTION_GRAD_V3_SCHEMAS = {
    ('26.0', 'current'): (
        "npu_fusion_attention_grad_v3(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, Tensor? seed=None, Tensor? offset=None, "
        "SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, "
        'int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", '
        "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
}


def _lengths(layout: str, actual_seq_qlen, actual_seq_kvlen):
    """Cumulative ends for TND (trailing zeros = batches left out). Other layouts ignore the lengths: op-plugin
    passes them on, but FlashAttentionScore's tiling reads them only for TND; a UserWarning names each one given."""
    if layout == "TND":
        return (ends_without_trailing_zeros(actual_seq_qlen, "actual_seq_qlen"),
                ends_without_trailing_zeros(actual_seq_kvlen, "actual_seq_kvlen"))
    for name, value in (("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)):
        if value is not None:
            warnings.warn(f"{name}: ignored with input_layout {layout!r} (only TND uses sequence lengths)",
                          UserWarning, stacklevel=caller_stacklevel())
    return None, None


def _mask_numel(query: Tensor, key: Tensor, head_num: int, layout: str, q_ends, kv_ends) -> int:
    """Elements of the logical keep mask: B*N1*Sq*Skv, TND N1*sum(Sq_b*Skv_b) (docs/semantics/dropout.md)."""
    if layout == "TND":
        return drop_mask_numel(head_num, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends)
    if layout not in BATCH_SEQ_DIMS:
        raise ParamInvalidError(f"input_layout: expected one of BSH, SBH, BSND, BNSD, TND, got {layout!r}")
    batch, seq = BATCH_SEQ_DIMS[layout]
    return drop_mask_numel(head_num, batch=query.shape[batch], seq_q=query.shape[seq], seq_kv=key.shape[seq])


def _uses_dropout(keep_prob) -> bool:
    return require_real(keep_prob, "keep_prob") < 1.0


def _mask_at(state: Tensor, numels: int, keep_prob: float, device) -> Tensor:
    return torch.ops.cann_attn.dropout_mask(state, numels, require_real(keep_prob, "keep_prob"), device)


def _as_int_pair(state: Tensor):
    """(seed, offset) as the forward returns them: ints in eager mode, 0-d tensors while compiling."""
    if torch.compiler.is_compiling():
        return state[0], state[1]
    seed, offset = state.tolist()
    return seed, offset


def _forward_drop_mask(query, numels: int, keep_prob, dropout_mask, seed, offset):
    """The keep mask of a forward and the (seed, offset) it returns (docs/guides/torch_npu.md, "Dropout"):
    an external ``dropout_mask`` is used as given with the caller's seed/offset; else a non-zero ``seed`` draws at
    (seed, offset) ("若seed非0，则使用指定的种子值生成dropout mask"); else the generator draws and advances."""
    if not _uses_dropout(keep_prob):
        zero = torch.zeros(2, dtype=torch.int64)
        return None, zero
    if dropout_mask is not None:
        validate_drop_mask(dropout_mask, numels, "dropout_mask")  # torch_npu's name for the op's drop_mask
        return dropout_mask, _state_of(seed, offset)
    if not (isinstance(seed, int) and seed == 0):
        state = _state_of(seed, offset)
        return _mask_at(state, numels, keep_prob, query.device), state
    state = draw_state(numels)
    return _mask_at(state, numels, keep_prob, query.device), state


def _state_of(seed, offset) -> Tensor:
    if isinstance(seed, Tensor) or isinstance(offset, Tensor):
        state = torch.stack([torch.as_tensor(seed).reshape(-1)[0], torch.as_tensor(offset).reshape(-1)[0]])
        return state.to(device="cpu", dtype=torch.int64)
    return torch.tensor([int(seed), int(offset)], dtype=torch.int64)


def _regenerate_drop_mask(query, key, head_num, layout, keep_prob, seed, offset, numels, q_ends, kv_ends):
    """The keep mask a forward drew at (seed, offset), for the grad functions (None without dropout)."""
    if not _uses_dropout(keep_prob):
        return None
    expected = _mask_numel(query, key, head_num, layout, q_ends, kv_ends)
    if isinstance(numels, int) and numels not in (0, expected):
        raise ParamInvalidError(
            f"numels: expected the forward's mask size {expected} (or 0 to derive it), got {numels}"
        )
    return _mask_at(_state_of(seed, offset), expected, keep_prob, query.device)


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
    head_dim = head_dim_of(query, head_num, layout)
    rope_dim = 0 if query_rope is None else head_dim_of(query_rope, head_num, layout)
    return head_dim, rope_dim


def _layout(input_layout):
    """torch_npu upper-cases input_layout before checking it ("BSH/SBH/BNSD/BSND/TND (case-insensitive)")."""
    return input_layout.upper() if isinstance(input_layout, str) else input_layout


def _empty_dsink(key: Tensor) -> Tensor:
    """op-plugin's dsink without sink: ``at::empty({0}, key.options().dtype(at::kFloat))``."""
    return torch.empty(0, dtype=torch.float32, device=key.device)


# ------------------------------------------------------------------------------------ FlashAttentionScore
def _fusion_attention(query, key, value, head_num, input_layout, *, pse, padding_mask, atten_mask, scale, keep_prob,
                      pre_tokens, next_tokens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                      pse_type, q_start_idx, kv_start_idx, softmax_layout, sink, dropout_mask=None, seed=0,
                      offset=0):
    """-> (out, softmax_max, softmax_sum, softmax_out, state [seed, offset] int64, numels)."""
    q_ends, kv_ends = _lengths(input_layout, actual_seq_qlen, actual_seq_kvlen)
    numels = _mask_numel(query, key, head_num, input_layout, q_ends, kv_ends)
    drop_mask, state = _forward_drop_mask(query, numels, keep_prob, dropout_mask, seed, offset)
    out, softmax_max, softmax_sum, softmax_out = torch.ops.cann_attn.flash_attention_score(
        query, key, value, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask,
        to_int_list(prefix, "prefix"), q_ends, kv_ends, to_int_list(q_start_idx, "q_start_idx"),
        to_int_list(kv_start_idx, "kv_start_idx"), require_real(scale, "scale"), require_real(keep_prob, "keep_prob"),
        pre_tokens,
        next_tokens, inner_precise, sparse_mode, pse_type, softmax_layout, sink=sink,
    )
    return out, softmax_max, softmax_sum, softmax_out, state, numels


@npu_op(NPU_FUSION_ATTENTION_SCHEMAS)
def npu_fusion_attention(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, pse: Tensor | None = None,
    padding_mask: Tensor | None = None, atten_mask: Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX, inner_precise: int = 0, prefix=None,
    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False, softmax_layout: str = "", sink: Tensor | None = None, dropout_mask: Tensor | None = None,
    seed: int = 0, offset: int = 0,
):
    """torch_npu.npu_fusion_attention (FlashAttentionScore, pse type 1: S = scale * (Q K^T + pse)).

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``; differentiable
    w.r.t. query, key, value and pse. With ``keep_prob < 1`` the keep mask is drawn at (seed, offset) of this
    package's generator (:mod:`cann_attn.torch_npu.npu`), or taken from ``dropout_mask`` / a non-zero ``seed``;
    pass seed, offset and numels to :func:`npu_fusion_attention_grad`.
    """
    input_layout = _layout(input_layout)
    out, smax, ssum, sout, state, numels = _fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1, q_start_idx=None, kv_start_idx=None,
        softmax_layout=softmax_layout, sink=sink, dropout_mask=dropout_mask, seed=seed, offset=offset,
    )
    return (out, smax, ssum, sout, *_as_int_pair(state), numels)


@npu_op(NPU_FUSION_ATTENTION_V2_SCHEMAS)
def npu_fusion_attention_v2(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, *, pse: Tensor | None = None,
    padding_mask: Tensor | None = None, atten_mask: Tensor | None = None, query_rope: Tensor | None = None,
    key_rope: Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX, inner_precise: int = 0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
    sparse_mode: int = 0, gen_mask_parallel: bool = True, sync: bool = False, pse_type: int = 1, q_start_idx=None,
    kv_start_idx=None, softmax_layout: str = "", sink: Tensor | None = None, dropout_mask: Tensor | None = None,
    seed: int = 0, offset: int = 0,
):
    """torch_npu.npu_fusion_attention_v2: ``npu_fusion_attention`` with ``pse_type`` (0..3, docs/semantics/pse.md),
    ``q_start_idx``/``kv_start_idx`` for ALiBi, and ``query_rope``/``key_rope`` appended to query/key along the head
    dim. Same 7-tuple; differentiable w.r.t. query, key, value, a type 0/1 pse and the rope tensors."""
    input_layout = _layout(input_layout)
    head_dim, rope_dim = _rope_dims(query, query_rope, key_rope, head_num, input_layout)
    query = _cat_rope(query, query_rope, input_layout, head_dim, rope_dim)
    key = _cat_rope(key, key_rope, input_layout, head_dim, rope_dim)
    out, smax, ssum, sout, state, numels = _fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=pse_type, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx, softmax_layout=softmax_layout, sink=sink, dropout_mask=dropout_mask, seed=seed,
        offset=offset,
    )
    return (out, smax, ssum, sout, *_as_int_pair(state), numels)


@npu_op(NPU_FUSION_ATTENTION_V3_SCHEMAS)
def npu_fusion_attention_v3(
    query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str, pse: Tensor | None = None,
    padding_mask: Tensor | None = None, atten_mask: Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX, inner_precise: int = 0, prefix=None,
    actual_seq_qlen: Tensor | None = None, actual_seq_kvlen: Tensor | None = None, sparse_mode: int = 0,
    gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention_v3 (the graph-mode form): lengths are (CPU) integer tensors and the result is
    ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset)`` with seed and offset int64 CPU tensors
    of shape [1] (no numels: :func:`npu_fusion_attention_grad_v3` recomputes it)."""
    input_layout = _layout(input_layout)
    out, smax, ssum, sout, state, _ = _fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1, q_start_idx=None, kv_start_idx=None,
        softmax_layout=softmax_layout, sink=sink,
    )
    return out, smax, ssum, sout, state[0:1].clone(), state[1:2].clone()


def _fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse, padding_mask, atten_mask,
                           softmax_max, softmax_sum, softmax_in, attention_in, scale_value, keep_prob, pre_tokens,
                           next_tokens, inner_precise, seed, offset, numels, prefix, actual_seq_qlen,
                           actual_seq_kvlen, sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout, sink):
    """-> (dq, dk, dv, dpse, dsink) as op-plugin returns them (dpse None without pse; dsink empty without sink)."""
    q_ends, kv_ends = _lengths(input_layout, actual_seq_qlen, actual_seq_kvlen)
    drop_mask = _regenerate_drop_mask(query, key, head_num, input_layout, keep_prob, seed, offset, numels, q_ends,
                                      kv_ends)
    dq, dk, dv, dpse, dsink = torch.ops.cann_attn.flash_attention_score_grad(
        query, key, value, dy, head_num, input_layout, pse, drop_mask, padding_mask, atten_mask, softmax_max,
        softmax_sum, softmax_in, attention_in, to_int_list(prefix, "prefix"), q_ends, kv_ends,
        to_int_list(q_start_idx, "q_start_idx"), to_int_list(kv_start_idx, "kv_start_idx"), require_real(scale_value,
        "scale_value"),
        require_real(keep_prob, "keep_prob"), pre_tokens, next_tokens, inner_precise, sparse_mode, pse_type,
        softmax_layout, sink=sink,
    )
    if pse is None:
        dpse = None  # op-plugin returns an undefined dpse without pse
    elif pse_type not in (0, 1):
        dpse = torch.zeros_like(pse)  # ALiBi slopes: op-plugin allocates dpse like pse; they get no gradient
    return dq, dk, dv, dpse, dsink if sink is not None else _empty_dsink(key)


@npu_op(NPU_FUSION_ATTENTION_GRAD_SCHEMAS)
def npu_fusion_attention_grad(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str, *,
    pse: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None, softmax_in: Tensor | None = None,
    attention_in: Tensor | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX, inner_precise: int = 0, seed: int = 0, offset: int = 0,
    numels: int = 0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode: int = 0,
    gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention_grad (FlashAttentionScoreGrad, pse type 1) -> ``(dq, dk, dv, dpse, dsink)``
    (``(dq, dk, dv, dpse)`` before torch_npu 7.3).

    With ``keep_prob < 1`` the forward's keep mask is regenerated from ``seed`` and ``offset`` (ints or the 0-d
    tensors a compiled forward returns); ``numels`` must be the forward's (or 0). dpse is None without pse; dsink
    an empty float32 tensor without sink.
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


@npu_op(NPU_FUSION_ATTENTION_GRAD_V2_SCHEMAS)
def npu_fusion_attention_grad_v2(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str, *,
    pse: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None, softmax_in: Tensor | None = None,
    attention_in: Tensor | None = None, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
    scale_value: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX,
    inner_precise: int = 0, seed: int = 0, offset: int = 0, numels: int = 0, prefix=None, actual_seq_qlen=None,
    actual_seq_kvlen=None, sparse_mode: int = 0, gen_mask_parallel: bool = True, sync: bool = False,
    pse_type: int = 1, q_start_idx=None, kv_start_idx=None, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention_grad_v2 -> ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)`` (the first 6
    before torch_npu 7.3). dpse is None without pse (zeros for ALiBi slopes); dq_rope/dk_rope None without rope
    inputs; dsink an empty float32 tensor without sink.
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


@npu_op(NPU_FUSION_ATTENTION_GRAD_V3_SCHEMAS)
def npu_fusion_attention_grad_v3(
    query: Tensor, key: Tensor, value: Tensor, dy: Tensor, head_num: int, input_layout: str, *,
    pse: Tensor | None = None, padding_mask: Tensor | None = None, atten_mask: Tensor | None = None,
    softmax_max: Tensor | None = None, softmax_sum: Tensor | None = None, softmax_in: Tensor | None = None,
    attention_in: Tensor | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX, next_tockens: int = INT_MAX, inner_precise: int = 0, seed: Tensor | None = None,
    offset: Tensor | None = None, prefix=None, actual_seq_qlen: Tensor | None = None,
    actual_seq_kvlen: Tensor | None = None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False, softmax_layout: str = "", sink: Tensor | None = None,
):
    """torch_npu.npu_fusion_attention_grad_v3 -> ``(dq, dk, dv, dpse, dsink)``: the grad of
    :func:`npu_fusion_attention_v3`, taking its seed/offset tensors; the mask size is recomputed from the shapes."""
    input_layout = _layout(input_layout)
    if _uses_dropout(keep_prob) and (seed is None or offset is None):
        raise ParamInvalidError("seed/offset: the forward's seed and offset tensors are required when keep_prob < 1")
    return _fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, seed=seed, offset=offset, numels=0, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1,
        q_start_idx=None, kv_start_idx=None, softmax_layout=softmax_layout, sink=sink,
    )
