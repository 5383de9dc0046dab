"""One test per documented constraint of FlashAttentionScoreGradV2 (aclnnFlashAttentionScoreGradV2 documentation,
约束说明 and the parameter table; docs/semantics/layouts.md, docs/semantics/masks.md, docs/semantics/invalid-rows.md,
docs/semantics/pse.md, docs/semantics/dropout.md, docs/semantics/softmax-stats.md, docs/semantics/errors.md).

Each bad call must raise ParamInvalidError (status 161002) or, for a missing required input, ParamNullptrError
(161001), with a message that names the offending parameter.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError, ParamNullptrError
from oracle import make_compressed_mask

B, N, S, D = 2, 2, 8, 8


pytestmark = pytest.mark.usefixtures("single_thread")


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=_GEN, dtype=torch.float32).to(dtype)


_GEN = torch.Generator().manual_seed(0)


@pytest.fixture
def base():
    """A valid BSND call: inputs plus the forward's statistics and output."""
    q, k, v = _t(B, S, N, D), _t(B, S, N, D), _t(B, S, N, D)
    fwd = cann_attn.flash_attention_score(q, k, v, N, "BSND", scale_value=D**-0.5)
    dy = _t(*fwd.attention_out.shape)
    args = [q, k, v, dy, N, "BSND"]
    kw = {
        "scale_value": D**-0.5,
        "softmax_max": fwd.softmax_max,
        "softmax_sum": fwd.softmax_sum,
        "attention_in": fwd.attention_out,
    }
    return args, kw


def _raises(args, kw, param: str, error=ParamInvalidError, *extra: str):
    with pytest.raises(error) as info:
        cann_attn.flash_attention_score_grad(*args, **kw)
    exc = info.value
    assert exc.status_code == (161001 if error is ParamNullptrError else 161002)
    assert isinstance(exc, cann_attn.AclnnError)
    message = str(exc)
    assert str(exc.status_code) in message
    for word in (param, *extra):
        assert word in message, f"message should name {word!r}: {message}"
    return message


def _with(args, index, value):
    args = list(args)
    args[index] = value
    return args


def test_valid_base_call(base):
    args, kw = base
    res = cann_attn.flash_attention_score_grad(*args, **kw)
    assert res.dq.shape == args[0].shape and res.dpse is None


# ------------------------------------------------------------------------------------- required inputs
@pytest.mark.parametrize(("index", "param"), [(0, "query"), (1, "key"), (2, "value"), (3, "dy")])
def test_required_input_none(base, index, param):
    args, kw = base
    _raises(_with(args, index, None), kw, param, ParamNullptrError)


# ----------------------------------------------------------------------------------------------- dtypes
def test_unsupported_query_dtype(base):
    args, kw = base
    args = [t.to(torch.int32) if i < 4 else t for i, t in enumerate(args)]
    kw = {"scale_value": 1.0}
    _raises(args, kw, "query")


@pytest.mark.parametrize(("index", "param"), [(1, "key"), (2, "value")])
def test_qkv_dtypes_must_agree(base, index, param):
    args, kw = base
    _raises(_with(args, index, args[index].to(torch.float16)), kw, param)


def test_dy_dtype_mismatch(base):
    args, kw = base
    _raises(_with(args, 3, args[3].to(torch.bfloat16)), kw, "dy")


def test_attention_in_dtype_mismatch(base):
    args, kw = base
    _raises(args, {**kw, "attention_in": kw["attention_in"].to(torch.float16)}, "attention_in")


# ----------------------------------------------------------------------------------------------- shapes
def test_dy_shape_mismatch(base):
    args, kw = base
    _raises(_with(args, 3, _t(B, S + 1, N, D)), kw, "dy")


def test_dy_layout_rank_mismatch(base):
    args, kw = base
    _raises(_with(args, 3, _t(B, S, N * D)), kw, "dy")


def test_dy_must_have_value_head_dim():
    """With Dv < Dqk, dy (like attention_out) has the value's head dim."""
    q, k, v = _t(B, S, N, D), _t(B, S, N, D), _t(B, S, N, D // 2)
    _raises([q, k, v, _t(B, S, N, D), N, "BSND"], {}, "dy")


def test_attention_in_shape_mismatch(base):
    args, kw = base
    _raises(args, {**kw, "attention_in": _t(B, S, N, D + 1)}, "attention_in")


def test_batch_mismatch(base):
    args, _ = base
    _raises(_with(_with(args, 1, _t(B + 1, S, N, D)), 2, _t(B + 1, S, N, D)), {}, "key")


def test_qk_head_dim_mismatch(base):
    args, _ = base
    _raises(_with(args, 1, _t(B, S, N, D + 2)), {}, "key")


def test_dv_greater_than_dqk(base):
    args, _ = base
    _raises(_with(args, 2, _t(B, S, N, D + 1)), {}, "value")


def test_key_value_shapes_differ_except_d(base):
    args, _ = base
    _raises(_with(args, 2, _t(B, S + 1, N, D)), {}, "value")


@pytest.mark.parametrize("dim", [0, 513])
def test_head_dim_range(dim):
    q = _t(1, 1, 1, dim)
    _raises([q, q, q, q, 1, "BSND"], {}, "query")


def test_head_num_mismatch(base):
    args, _ = base
    _raises(_with(args, 4, N + 1), {}, "head_num")


@pytest.mark.parametrize("head_num", [0, -1, 2.0, True])
def test_head_num_not_positive_int(base, head_num):
    args, _ = base
    _raises(_with(args, 4, head_num), {}, "head_num")


def test_head_num_range():
    q = _t(1, 1, 257, 1)
    _raises([q, q, q, q, 257, "BSND"], {}, "head_num")


def test_gqa_n1_not_multiple_of_n2():
    q, k = _t(1, S, 3, D), _t(1, S, 2, D)
    _raises([q, k, k, q, 3, "BSND"], {}, "key")


def test_bsh_hidden_not_divisible_by_head_num():
    q = _t(B, S, 2 * D)
    _raises([q, q, q, q, 3, "BSH"], {}, "query")


# ---------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", ["BHSD", "bsnd", "", "BNSD_BSND"])
def test_unsupported_layout(base, layout):
    args, _ = base
    _raises(_with(args, 5, layout), {}, "input_layout")


@pytest.mark.parametrize(("index", "param"), [(5, "input_layout"), (4, "head_num")])
def test_missing_required_attribute_is_a_null_pointer(base, index, param):
    """A required attribute passed as None is a null pointer, 161001 (seed: 必选输入，输出或者必选属性，且是空指针)."""
    args, _ = base
    _raises(_with(args, index, None), {}, param, ParamNullptrError)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "TND"])
def test_rank_does_not_match_layout(base, layout):
    args, _ = base
    kw = {"actual_seq_qlen": [S], "actual_seq_kvlen": [S]} if layout == "TND" else {}
    _raises(_with(args, 5, layout), kw, "query")


@pytest.mark.parametrize("softmax_layout", ["BSH", "tnd", "TND"])
def test_softmax_layout(base, softmax_layout):
    """'' or 'TND'; 'TND' only with the TND layout."""
    args, kw = base
    _raises(args, {**kw, "softmax_layout": softmax_layout}, "softmax_layout")


# ----------------------------------------------------------------------------------- softmax statistics
@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
def test_only_one_statistic_given(base, name):
    args, kw = base
    kw = {**kw, name: None}
    _raises(args, kw, "softmax_max", ParamInvalidError, "softmax_sum")


@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
@pytest.mark.parametrize("shape", [(B, N, S, 1), (B, N, S), (B, S, N, 8), (B, N, S + 1, 8)], ids=str)
def test_statistic_wrong_shape(base, name, shape):
    args, kw = base
    _raises(args, {**kw, name: torch.zeros(shape)}, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
def test_statistic_wrong_dtype(base, name, dtype):
    args, kw = base
    _raises(args, {**kw, name: kw[name].to(dtype)}, name)


@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
def test_statistic_non_contiguous_accepted(base, name):
    """The GradV2 table marks softmax_max / softmax_sum as 非连续Tensor-capable: a dense-layout statistic is read
    by its logical [B, N1, Sq, 8] index, whatever its strides."""
    args, kw = base
    strided = torch.empty(B, N, 8, S).transpose(2, 3)
    strided.copy_(kw[name])
    assert tuple(strided.shape) == tuple(kw[name].shape) and not strided.is_contiguous()
    ref = cann_attn.flash_attention_score_grad(*args, **kw)
    res = cann_attn.flash_attention_score_grad(*args, **{**kw, name: strided})
    for grad in ("dq", "dk", "dv"):
        assert torch.equal(getattr(res, grad), getattr(ref, grad))


@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
def test_tnd_default_softmax_layout_statistic_non_contiguous(name):
    """TND with softmax_layout "": the [T, N1, 8] tensor's memory holds per-sequence [N1, Sq_b, 8] blocks
    (docs/semantics/softmax-stats.md), so only its memory order means anything and a strided view is refused."""
    q = _t(2 * S, N, D)
    lens = {"actual_seq_qlen": [S, 2 * S], "actual_seq_kvlen": [S, 2 * S]}
    fwd = cann_attn.flash_attention_score(q, q, q, N, "TND", **lens)
    kw = {**lens, "softmax_max": fwd.softmax_max, "softmax_sum": fwd.softmax_sum, "attention_in": fwd.attention_out}
    strided = torch.empty(N, 2 * S, 8).transpose(0, 1)
    strided.copy_(kw[name])
    _raises([q, q, q, q, N, "TND"], {**kw, name: strided}, name)


def test_tnd_statistic_shape():
    """TND: softmax_max / softmax_sum are [T, N1, 8] (not [B, N1, S, 8])."""
    q = _t(2 * S, N, D)
    kw = {
        "actual_seq_qlen": [S, 2 * S],
        "actual_seq_kvlen": [S, 2 * S],
        "softmax_max": torch.zeros(2, N, S, 8),
        "softmax_sum": torch.zeros(2, N, S, 8),
        "attention_in": q,
    }
    _raises([q, q, q, q, N, "TND"], kw, "softmax_max")


# ---------------------------------------------------------------------------------------- sparse modes
@pytest.mark.parametrize("mode", [-1, 9])
def test_sparse_mode_range(base, mode):
    args, kw = base
    _raises(args, {**kw, "sparse_mode": mode, "atten_mask": torch.zeros(S, S, dtype=torch.bool)}, "sparse_mode")


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
@pytest.mark.parametrize("mode", [7, 8])
def test_modes_7_8_only_with_tnd(mode, layout):
    q = {"BSH": _t(B, S, N * D), "SBH": _t(S, B, N * D), "BSND": _t(B, S, N, D), "BNSD": _t(B, N, S, D)}[layout]
    _raises([q, q, q, q, N, layout], {"sparse_mode": mode, "atten_mask": make_compressed_mask(mode)}, "sparse_mode")


def test_mode5_not_with_tnd():
    q = _t(S, N, D)
    kw = {
        "actual_seq_qlen": [S],
        "actual_seq_kvlen": [S],
        "sparse_mode": 5,
        "prefix": [4],
        "atten_mask": torch.zeros(1, 1, S, S, dtype=torch.bool),
    }
    _raises([q, q, q, q, N, "TND"], kw, "sparse_mode")


# ------------------------------------------------------------------------------------ compressed masks
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_compressed_mode_wrong_shape(base, mode):
    args, _ = base
    full = torch.ones(S, S, dtype=torch.bool).triu(1)  # a full [Sq, Skv] mask is not the compressed one
    _raises(args, {"sparse_mode": mode, "atten_mask": full}, "atten_mask")


@pytest.mark.parametrize("content", ["lower", "inverted", "zeros", "diagonal_included"])
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_compressed_mode_wrong_content(base, mode, content):
    args, _ = base
    tri = make_compressed_mask(2)
    bad = {
        "lower": tri.T,
        "inverted": ~tri,
        "zeros": torch.zeros_like(tri),
        "diagonal_included": torch.ones_like(tri).triu(0),
    }[content]
    _raises(args, {"sparse_mode": mode, "atten_mask": bad}, "atten_mask")


def test_mode6_needs_3072_rows(base):
    args, _ = base
    _raises(args, {"sparse_mode": 6, "prefix": [4, 4], "atten_mask": make_compressed_mask(2)}, "atten_mask")


def test_mode6_wrong_prefix_block(base):
    args, _ = base
    bad = make_compressed_mask(6).clone()
    bad[2048:] = ~bad[2048:]  # left half 1, right half 0
    _raises(args, {"sparse_mode": 6, "prefix": [4, 4], "atten_mask": bad}, "atten_mask")


@pytest.mark.parametrize("mode", [7, 8])
def test_tnd_mode_7_8_wrong_mask(mode):
    q = _t(S, N, D)
    kw = {
        "actual_seq_qlen": [S],
        "actual_seq_kvlen": [S],
        "sparse_mode": mode,
        "atten_mask": torch.zeros(S, S, dtype=torch.bool),
    }
    _raises([q, q, q, q, N, "TND"], kw, "atten_mask")


# ---------------------------------------------------------------------------------------- full masks
def test_atten_mask_dtype(base):
    args, kw = base
    _raises(args, {**kw, "sparse_mode": 1, "atten_mask": torch.zeros(S, S)}, "atten_mask")


@pytest.mark.parametrize("shape", [(S, S + 1), (B, N, S), (B + 1, 1, S, S), (B, N + 1, S, S), (1, S, S, 1)], ids=str)
def test_atten_mask_shape(base, shape):
    args, kw = base
    _raises(args, {**kw, "sparse_mode": 0, "atten_mask": torch.zeros(shape, dtype=torch.bool)}, "atten_mask")


def test_mode5_mask_batch_must_be_b(base):
    """Mode 5 takes [B,N,Sq,Skv] or [B,1,Sq,Skv] (docs/semantics/masks.md): [1,1,Sq,Skv] with B = 2 is refused."""
    args, kw = base
    mask = {"sparse_mode": 5, "prefix": [4, 4], "atten_mask": torch.zeros(1, 1, S, S, dtype=torch.bool)}
    _raises(args, {**kw, **mask}, "atten_mask")


def test_mode5_needs_four_dim_mask(base):
    args, kw = base
    _raises(
        args,
        {**kw, "sparse_mode": 5, "prefix": [4, 4], "atten_mask": torch.zeros(S, S, dtype=torch.bool)},
        "atten_mask",
    )


def test_tnd_full_mask_shape():
    q = _t(S + 3, N, D)
    kw = {
        "actual_seq_qlen": [S, S + 3],
        "actual_seq_kvlen": [S, S + 3],
        "sparse_mode": 1,
        "atten_mask": torch.zeros(S + 3, S + 3, dtype=torch.bool),
    }  # expected [maxSq, maxSkv] = [8, 8]
    _raises([q, q, q, q, N, "TND"], kw, "atten_mask")


# ----------------------------------------------------------------------------------- band and prefix
@pytest.mark.parametrize("mode", [0, 4])
def test_band_must_be_non_empty(base, mode):
    """band场景，preTokens和nextTokens之间必须要有交集."""
    args, _ = base
    mask = torch.zeros(S, S, dtype=torch.bool) if mode == 0 else make_compressed_mask(4)
    _raises(args, {"sparse_mode": mode, "atten_mask": mask, "pre_tokens": -3, "next_tokens": 1}, "pre_tokens")


@pytest.mark.parametrize("mode", [5, 6])
def test_prefix_required(base, mode):
    args, _ = base
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool) if mode == 5 else make_compressed_mask(6)
    _raises(args, {"sparse_mode": mode, "atten_mask": mask}, "prefix", ParamNullptrError)


@pytest.mark.parametrize(("sq", "skv", "bad"), [(8, 12, 3), (8, 12, 13), (12, 8, -1), (12, 8, 9)], ids=str)
def test_prefix_range(sq, skv, bad):
    """Sq > Skv: prefix in [0, Skv]; else [Skv - Sq, Skv]."""
    q, k = _t(1, sq, N, D), _t(1, skv, N, D)
    _raises(
        [q, k, k, q, N, "BSND"], {"sparse_mode": 6, "atten_mask": make_compressed_mask(6), "prefix": [bad]}, "prefix"
    )


def test_prefix_one_value_per_batch(base):
    args, _ = base
    _raises(args, {"sparse_mode": 6, "atten_mask": make_compressed_mask(6), "prefix": [4]}, "prefix")


# ---------------------------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("keep_prob", [0.0, -0.1, 1.5, float("nan")])
def test_keep_prob_range(base, keep_prob):
    args, kw = base
    _raises(
        args,
        {**kw, "keep_prob": keep_prob, "drop_mask": torch.full((B * N * S * S // 8,), 255, dtype=torch.uint8)},
        "keep_prob",
    )


def test_drop_mask_required_when_keep_prob_below_one(base):
    args, kw = base
    _raises(args, {**kw, "keep_prob": 0.8}, "drop_mask", ParamNullptrError)


def test_drop_mask_too_short(base):
    args, kw = base
    short = torch.full((B * N * S * S // 8 - 1,), 255, dtype=torch.uint8)
    _raises(args, {**kw, "keep_prob": 0.8, "drop_mask": short}, "drop_mask")


def test_drop_mask_too_short_tnd():
    """TND: N1 * sum(Sq_b * Skv_b) bits (not B * N1 * maxSq * maxSkv)."""
    q, k = _t(S + 2, N, D), _t(S + 5, N, D)
    kw = {"actual_seq_qlen": [S, S + 2], "actual_seq_kvlen": [S, S + 5], "keep_prob": 0.8}
    numel = N * (S * S + 2 * 5)
    cann_attn.flash_attention_score_grad(
        q, k, k, q, N, "TND", drop_mask=torch.zeros(-(-numel // 8), dtype=torch.uint8), **kw
    )
    _raises(
        [q, k, k, q, N, "TND"], {**kw, "drop_mask": torch.zeros(-(-numel // 8) - 1, dtype=torch.uint8)}, "drop_mask"
    )


def test_drop_mask_dtype(base):
    args, kw = base
    _raises(args, {**kw, "keep_prob": 0.8, "drop_mask": torch.ones(B * N * S * S, dtype=torch.int32)}, "drop_mask")


# -------------------------------------------------------------------------------------------------- pse
@pytest.mark.parametrize(
    "shape", [(B, N, S, S + 1), (B, N, 2, S), (B + 1, N, S, S), (B, N + 1, S, S), (N, S, S)], ids=str
)
@pytest.mark.parametrize("pse_type", [0, 1])
def test_pse_shape(base, pse_type, shape):
    args, kw = base
    _raises(args, {**kw, "pse": _t(*shape), "pse_type": pse_type}, "pse")


def test_pse_dtype(base):
    args, kw = base
    _raises(args, {**kw, "pse": _t(B, N, S, S, dtype=torch.float16), "pse_type": 1}, "pse")


@pytest.mark.parametrize("pse_type", [-1, 4])
def test_pse_type_range(base, pse_type):
    args, kw = base
    _raises(args, {**kw, "pse": _t(B, N, S, S), "pse_type": pse_type}, "pse_type")


@pytest.mark.parametrize(
    "slopes",
    [torch.ones(N, dtype=torch.float16), torch.ones(N + 1), torch.ones(B, N, 1), torch.ones(B + 1, N)],
    ids=["fp16", "N+1", "BN1", "B+1N"],
)
@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi_slopes(base, pse_type, slopes):
    args, kw = base
    _raises(args, {**kw, "pse": slopes, "pse_type": pse_type}, "pse")


@pytest.mark.parametrize(("mode", "sq", "skv"), [(4, 1030, 1030), (1, 1030, 1030), (3, 1030, 1031)], ids=str)
def test_compressed_pse_needs_lower_triangular_square(mode, sq, skv):
    """The 1024-row pse: Sq == Skv > 1024 and only lower-triangular attention (modes 2/3, or 0 with next <= 0)."""
    q, k = _t(1, 1, sq, 1), _t(1, 1, skv, 1)
    mask = make_compressed_mask(mode) if mode in (2, 3, 4) else torch.zeros(sq, skv, dtype=torch.bool)
    kw = {"sparse_mode": mode, "atten_mask": mask, "pse": _t(1, 1, 1024, skv), "pse_type": 1}
    _raises([q, k, k, q, 1, "BNSD"], kw, "pse")


def test_tnd_row_broadcast_pse_rejected():
    q = _t(2 * S, N, D)
    kw = {"actual_seq_qlen": [S, 2 * S], "actual_seq_kvlen": [S, 2 * S], "pse": _t(2, N, 1, S), "pse_type": 1}
    _raises([q, q, q, q, N, "TND"], kw, "pse")


@pytest.mark.parametrize("pse_type", [1, 2, 3])
@pytest.mark.parametrize("variant", ["zero_length_sequence", "mode7", "mode8_unequal_lengths"])
def test_tnd_pse_restrictions_every_pse_type(variant, pse_type):
    """FlashAttentionVarLenScore documentation (the grad shares the forward's checks): no pse, tensor or ALiBi
    slopes, with an Sq_b = 0 sequence or with sparse_mode 7; with mode 8 only if every Sq_b == Skv_b."""
    q_lens, kv_lens = {"zero_length_sequence": ([0, S], [3, S]), "mode7": ([4, S], [4, S]),
                       "mode8_unequal_lengths": ([4, S], [5, S])}[variant]
    q, k = _t(sum(q_lens), N, D), _t(sum(kv_lens), N, D)
    kw = {"actual_seq_qlen": [q_lens[0], sum(q_lens)], "actual_seq_kvlen": [kv_lens[0], sum(kv_lens)],
          "pse": _t(1, N, S, S) if pse_type == 1 else torch.full((N,), 0.5), "pse_type": pse_type}
    mode = {"mode7": 7, "mode8_unequal_lengths": 8}.get(variant)
    if mode is not None:
        kw.update(sparse_mode=mode, atten_mask=make_compressed_mask(mode))
    _raises([q, k, k, q, N, "TND"], kw, "pse")


def test_tnd_pse_with_zero_length_sequence_rejected():
    q = _t(S, N, D)
    kw = {"actual_seq_qlen": [0, S], "actual_seq_kvlen": [3, S + 3], "pse": _t(2, N, S, S + 3), "pse_type": 1}
    k = _t(S + 3, N, D)
    _raises([q, k, k, q, N, "TND"], kw, "pse")


# ------------------------------------------------------------------------------------ TND lengths
def test_tnd_lengths_required():
    q = _t(S, N, D)
    _raises([q, q, q, q, N, "TND"], {"actual_seq_kvlen": [S]}, "actual_seq_qlen", ParamNullptrError)
    _raises([q, q, q, q, N, "TND"], {"actual_seq_qlen": [S]}, "actual_seq_kvlen", ParamNullptrError)


@pytest.mark.parametrize("qlen", [[S + 1], [5, 3, S], [0, 4, S, 6]], ids=str)
def test_tnd_cumulative_lengths(qlen):
    """Cumulative ends without a leading 0, non-decreasing, ending at most at T (before T: end-of-document
    padding, tests/test_torch_npu_eod.py)."""
    q = _t(S, N, D)
    _raises([q, q, q, q, N, "TND"], {"actual_seq_qlen": qlen, "actual_seq_kvlen": [S] * len(qlen)}, "actual_seq_qlen")


def test_tnd_length_counts_differ():
    q = _t(S, N, D)
    _raises([q, q, q, q, N, "TND"], {"actual_seq_qlen": [4, S], "actual_seq_kvlen": [S]}, "actual_seq_kvlen")


def test_tnd_key_tokens_above_1m():
    """FlashAttentionVarLenScore documentation: T in 1..1M, for key/value as for the query."""
    t = (1 << 20) + 1
    q, k = _t(4, 1, 1), torch.zeros(t, 1, 1)
    _raises([q, k, k, q, 1, "TND"], {"actual_seq_qlen": [4], "actual_seq_kvlen": [t]}, "key")


def test_tnd_query_tokens_without_keys():
    q, k = _t(S, N, D), _t(S, N, D)
    _raises([q, k, k, q, N, "TND"], {"actual_seq_qlen": [4, S], "actual_seq_kvlen": [S, S]}, "actual_seq_kvlen")


# ------------------------------------------------------------------------------------ other attributes
@pytest.mark.parametrize("inner_precise", [-1, 7, 1.5])
def test_inner_precise(base, inner_precise):
    args, kw = base
    _raises(args, {**kw, "inner_precise": inner_precise}, "inner_precise")


@pytest.mark.parametrize(("name", "value"), [("pre_tokens", 1.5), ("next_tokens", "3"), ("sparse_mode", 2.0)])
def test_integer_attributes(base, name, value):
    args, kw = base
    _raises(args, {**kw, name: value}, name)


def test_batch_range_doc_allows_more_than_2k():
    """GradV2's documented B range is 1..2M for BSH/SBH/BSND/BNSD (2K with prefix); B = 2049 must be accepted."""
    q = _t(2049, 1, 1, 2)
    res = cann_attn.flash_attention_score_grad(q, q, q, q, 1, "BSND")
    assert res.dq.shape == q.shape


def test_prefix_batch_limit_dense_2k():
    """B <= 2K with prefix for BSH/SBH/BSND/BNSD (aclnnFlashAttentionScoreGradV2 documentation)."""
    q = _t(1500, 1, 2, 1)
    res = cann_attn.flash_attention_score_grad(q, q, q, q, 1, "BNSD", sparse_mode=6,
                                               atten_mask=make_compressed_mask(6), prefix=[2] * 1500)
    assert res.dq.shape == q.shape
    q = _t(2049, 1, 2, 1)
    _raises([q, q, q, q, 1, "BNSD"], {"sparse_mode": 6, "atten_mask": make_compressed_mask(6), "prefix": [2] * 2049},
            "prefix")


def test_prefix_batch_limit_tnd_1k():
    """TND (FlashAttentionVarLenScore's backward): B <= 1K with prefix (FlashAttentionVarLenScore documentation)."""
    q = _t(1025, 1, 1)
    lens = list(range(1, 1026))
    kw = {"actual_seq_qlen": lens, "actual_seq_kvlen": lens, "sparse_mode": 6,
          "atten_mask": make_compressed_mask(6), "prefix": [1] * 1025}
    _raises([q, q, q, q, 1, "TND"], kw, "prefix")
