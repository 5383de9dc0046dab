"""One test per documented FlashAttentionScore / FlashAttentionVarLenScore constraint.

Sources: docs/semantics/layouts.md, docs/semantics/masks.md, docs/semantics/invalid-rows.md,
docs/semantics/pse.md, docs/semantics/dropout.md, docs/semantics/softmax-stats.md, docs/semantics/errors.md,
and the 约束说明 of FlashAttentionVarLenScore documentation. Each test checks the error type, its aclnn status code and
a
message naming the Python parameter.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import cann_attn
from oracle import INT_MAX, make_compressed_mask, pack_drop_mask, tnd_cum

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _bnsd_to(t, layout):
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()
    if layout == "BSND":
        return t.permute(0, 2, 1, 3).contiguous()
    return t.contiguous()


def base(
    layout="BSND", *, b=2, n1=2, n2=None, sq=8, skv=None, d=16, dv=None, dtype=F32, q_lens=None, kv_lens=None
):
    """A VALID argument set (every error test changes exactly one thing)."""
    n2 = n1 if n2 is None else n2
    skv = sq if skv is None else skv
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(0)
    if layout == "TND":
        q_lens = [sq, sq // 2] if q_lens is None else q_lens
        kv_lens = [skv, skv // 2] if kv_lens is None else kv_lens
        q = torch.randn(sum(q_lens), n1, d, generator=g).to(dtype)
        k = torch.randn(sum(kv_lens), n2, d, generator=g).to(dtype)
        v = torch.randn(sum(kv_lens), n2, dv, generator=g).to(dtype)
        return {
            "query": q,
            "key": k,
            "value": v,
            "head_num": n1,
            "input_layout": "TND",
            "actual_seq_qlen": tnd_cum(q_lens),
            "actual_seq_kvlen": tnd_cum(kv_lens),
        }
    q = _bnsd_to(torch.randn(b, n1, sq, d, generator=g).to(dtype), layout)
    k = _bnsd_to(torch.randn(b, n2, skv, d, generator=g).to(dtype), layout)
    v = _bnsd_to(torch.randn(b, n2, skv, dv, generator=g).to(dtype), layout)
    return {"query": q, "key": k, "value": v, "head_num": n1, "input_layout": layout}


def call(args, **overrides):
    return cann_attn.flash_attention_score(**{**args, **overrides})


def call_var_len(args, **overrides):
    return cann_attn.flash_attention_var_len_score(**{**args, **overrides})


def expect_error(param_pattern, fn, args, *, nullptr=False, **overrides):
    """Run fn(args, **overrides); expect ParamInvalidError (161002) / ParamNullptrError (161001) naming it."""
    exc_type = cann_attn.ParamNullptrError if nullptr else cann_attn.ParamInvalidError
    with pytest.raises(exc_type) as info:
        fn(args, **overrides)
    err = info.value
    assert isinstance(err, cann_attn.AclnnError)
    assert isinstance(err, cann_attn.errors.AclnnError)
    assert err.status_code == (161001 if nullptr else 161002)
    assert re.search(param_pattern, str(err)), f"message {str(err)!r} does not name {param_pattern!r}"
    return err


def test_base_configurations_are_valid():
    """The error tests below are only meaningful if their unmodified argument sets run."""
    for layout in ("BSH", "SBH", "BSND", "BNSD", "TND"):
        call(base(layout))
    call(base("BSND", n1=4, n2=2, dv=8))
    call_var_len(base("TND"))


def test_error_classes():
    assert issubclass(cann_attn.ParamInvalidError, cann_attn.AclnnError)
    assert issubclass(cann_attn.ParamNullptrError, cann_attn.AclnnError)
    assert cann_attn.ParamInvalidError.status_code == 161002
    assert cann_attn.ParamNullptrError.status_code == 161001


# ---------------------------------------------------------------------------------------- required inputs
@pytest.mark.parametrize("param", ["query", "key", "value"])
def test_missing_qkv_is_nullptr(param):
    expect_error(rf"\b{param}\b", call, base(), nullptr=True, **{param: None})


@pytest.mark.parametrize("param", ["actual_seq_qlen", "actual_seq_kvlen"])
def test_tnd_without_lengths_is_nullptr(param):
    expect_error(rf"\b{param}\b", call, base("TND"), nullptr=True, **{param: None})
    expect_error(rf"\b{param}\b", call_var_len, base("TND"), nullptr=True, **{param: None})


@pytest.mark.parametrize("mode", [5, 6])
def test_prefix_missing_for_modes_5_6(mode):
    args = base("BNSD", sq=8, skv=12)
    mask = make_compressed_mask(6) if mode == 6 else torch.zeros(2, 1, 8, 12, dtype=torch.bool)
    expect_error(r"\bprefix\b", call, args, nullptr=True, sparse_mode=mode, atten_mask=mask)


def test_drop_mask_missing_with_keep_prob_below_one():
    expect_error(r"\bdrop_mask\b", call, base(), nullptr=True, keep_prob=0.9)


# ------------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.complex64])
def test_unsupported_dtype(dtype):
    args = base()
    args = {
        **args,
        "query": args["query"].to(dtype),
        "key": args["key"].to(dtype),
        "value": args["value"].to(dtype),
    }
    expect_error(r"\bquery\b", call, args)


@pytest.mark.parametrize(("param", "dtype"), [("key", F16), ("value", BF16), ("key", torch.float64)])
def test_qkv_dtype_mismatch(param, dtype):
    args = base()
    expect_error(rf"\b{param}\b", call, args, **{param: args[param].to(dtype)})


@pytest.mark.parametrize("pse_type", [0, 1])
def test_pse_dtype_mismatch(pse_type):
    args = base("BNSD", dtype=F16)
    pse = torch.zeros(2, 2, 8, 8, dtype=F32)
    expect_error(r"\bpse\b", call, args, pse=pse, pse_type=pse_type)


# ------------------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "TND"])
def test_key_value_shape_mismatch(layout):
    args = base(layout)
    v = args["value"]
    if layout == "TND":
        bad = torch.cat([v, v[:1]])  # one more token than key
    elif layout == "BNSD":
        bad = torch.cat([v, v[:, :, :1]], dim=2)  # value S != key S
    else:
        bad = torch.cat([v, v[:, :1]], dim=1)
    expect_error(r"\bvalue\b", call, args, value=bad)


def test_value_heads_mismatch():
    args = base("BNSD", n1=4, n2=2)
    expect_error(r"\bvalue\b", call, args, value=torch.zeros(2, 1, 8, 16))


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_batch_mismatch(layout):
    args = base(layout, b=2)
    other = base(layout, b=3)
    expect_error(r"\b(key|value)\b", call, args, key=other["key"], value=other["value"])


def test_value_batch_mismatch_with_key():
    args = base("BNSD", b=2)
    expect_error(r"\bvalue\b", call, args, value=torch.zeros(3, 2, 8, 16))


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "TND"])
def test_dqk_mismatch(layout):
    args = base(layout, d=16)
    other = base(layout, d=8)
    expect_error(r"\bkey\b", call, args, key=other["key"], value=other["value"])


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "TND"])
def test_dv_greater_than_dqk(layout):
    args = base(layout, d=16)
    other = base(layout, d=16, dv=24)
    expect_error(r"\bvalue\b", call, args, value=other["value"])


@pytest.mark.parametrize("layout", ["bsnd", "BHSD", "NTD", "", "BNSD_BSND"])
def test_bad_layout_string(layout):
    expect_error(r"\binput_layout\b", call, base("BSND"), input_layout=layout)


def test_layout_rank_mismatch():
    args = base("BSND")
    expect_error(r"\b(query|input_layout)\b", call, args, input_layout="BSH")


@pytest.mark.parametrize(
    ("layout", "head_num"), [("BSND", 3), ("BNSD", 1), ("TND", 4), ("BSH", 3), ("BSND", 0)]
)
def test_head_num_mismatch(layout, head_num):
    expect_error(r"\bhead_num\b", call, base(layout, n1=2), head_num=head_num)


@pytest.mark.parametrize("head_num", [-2, 2.0, "2"])
def test_head_num_not_a_positive_int(head_num):
    expect_error(r"\bhead_num\b", call, base("BSND", n1=2), head_num=head_num)


@pytest.mark.parametrize("param", ["head_num", "input_layout"])
def test_missing_required_attribute_is_a_null_pointer(param):
    """A required attribute passed as None is a null pointer, 161001 (seed: 必选输入，输出或者必选属性，且是空指针)."""
    expect_error(rf"\b{param}\b", call, base("BSND", n1=2), nullptr=True, **{param: None})


def test_numpy_scalars_are_accepted_like_python_numbers():
    """head_num, scale_value and keep_prob given as NumPy scalars act as the Python numbers (errors.require_int /
    require_real), like the other integer parameters."""
    args = base("BSND", n1=2)
    drop = torch.full(((cann_attn.drop_mask_numel(2, batch=2, seq_q=8, seq_kv=8) + 7) // 8,), 0x5A, dtype=torch.uint8)
    ref = call(args, scale_value=0.25, keep_prob=0.5, drop_mask=drop)
    got = call(args, head_num=np.int64(2), scale_value=np.float32(0.25), keep_prob=np.float64(0.5), drop_mask=drop)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [True, "0.5", None, torch.tensor(0.5)])
def test_scale_value_must_be_a_number(scale):
    expect_error(r"\bscale_value\b", call, base("BSND"), scale_value=scale)


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
def test_sequence_length_at_most_1m(layout):
    """S: 1..1M for the dense layouts too (FlashAttentionVarLenScore documentation), checked before any work."""
    args = base(layout, b=1, n1=1, sq=1, skv=1, d=1)
    dims = {"BSND": (1, (1 << 20) + 1, 1, 1), "BNSD": (1, 1, (1 << 20) + 1, 1)}[layout]
    long_kv = torch.zeros(dims).expand(*dims)
    expect_error(r"\bkey\b.*S in 1\.\.1048576", call, args, key=long_kv, value=long_kv)
    expect_error(r"\bquery\b.*S in 1\.\.1048576", call, args, query=long_kv)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "TND"])
def test_n1_not_multiple_of_n2(layout):
    args = base(layout, n1=3, n2=2)
    expect_error(r"\b(key|head_num)\b", call, args)


def test_bsh_key_hidden_not_multiple_of_d():
    args = base("BSH", n1=2, d=16)  # query H = 32, D = 16
    expect_error(r"\bkey\b", call, args, key=torch.zeros(2, 8, 24), value=torch.zeros(2, 8, 24))


def test_heads_above_256():
    q = torch.zeros(1, 1, 257, 1)
    expect_error(
        r"\bhead_num\b", call, {"query": q, "key": q, "value": q, "head_num": 257, "input_layout": "BSND"}
    )


def test_head_dim_above_512():
    q = torch.zeros(1, 1, 1, 513)
    expect_error(
        r"\bquery\b", call, {"query": q, "key": q, "value": q, "head_num": 1, "input_layout": "BSND"}
    )


def test_batch_above_2m_dense_layouts():
    # FlashAttentionScore(GradV2) allow B up to 2M in the dense layouts; the 2K limit is FlashAttentionVarLenScore's
    # (TND, tested below). Zero-size S keeps the tensor tiny.
    q = torch.zeros(2 * 1024 * 1024 + 1, 1, 0, 1)
    expect_error(
        r"\b(query|batch)\b", call, {"query": q, "key": q, "value": q, "head_num": 1, "input_layout": "BNSD"}
    )


def test_tnd_batch_above_2048():
    q = torch.zeros(2049, 1, 1)
    lens = list(range(1, 2050))
    args = {
        "query": q,
        "key": q,
        "value": q,
        "head_num": 1,
        "input_layout": "TND",
        "actual_seq_qlen": lens,
        "actual_seq_kvlen": lens,
    }
    expect_error(r"\b(query|batch|actual_seq_qlen)\b", call, args)


def test_tnd_tokens_above_1m():
    t = (1 << 20) + 1
    q = torch.zeros(t, 1, 1)
    args = {
        "query": q,
        "key": q,
        "value": q,
        "head_num": 1,
        "input_layout": "TND",
        "actual_seq_qlen": [t],
        "actual_seq_kvlen": [t],
    }
    expect_error(r"\b(query|actual_seq_qlen)\b", call, args)


def test_tnd_key_tokens_above_1m():
    """FlashAttentionVarLenScore documentation, T in 1..1M, holds for the key/value tokens too."""
    t = (1 << 20) + 1
    q, k = torch.zeros(4, 1, 1), torch.zeros(t, 1, 1)
    args = {"query": q, "key": k, "value": k, "head_num": 1, "input_layout": "TND",
            "actual_seq_qlen": [4], "actual_seq_kvlen": [t]}
    expect_error(r"\bkey\b", call, args)


@pytest.mark.parametrize("mode", [5, 6])
def test_prefix_batch_dense_limit_2048(mode):
    """Dense layouts: B <= 2K with prefix (aclnnFlashAttentionScoreGradV2 documentation), 1K is TND's limit."""
    q = torch.zeros(2048, 1, 2, 1)
    args = {"query": q, "key": q, "value": q, "head_num": 1, "input_layout": "BNSD"}
    mask = torch.zeros(2048, 1, 2, 2, dtype=torch.bool) if mode == 5 else make_compressed_mask(6)
    call(args, sparse_mode=mode, atten_mask=mask, prefix=[1] * 2048)
    q = torch.zeros(2049, 1, 2, 1)
    args = {"query": q, "key": q, "value": q, "head_num": 1, "input_layout": "BNSD"}
    mask = torch.zeros(2049, 1, 2, 2, dtype=torch.bool) if mode == 5 else make_compressed_mask(6)
    expect_error(r"\bprefix\b", call, args, sparse_mode=mode, atten_mask=mask, prefix=[1] * 2049)


def test_prefix_batch_tnd_limit_1024():
    """TND: B <= 1K with prefix (FlashAttentionVarLenScore documentation)."""
    q = torch.zeros(1025, 1, 1)
    lens = list(range(1, 1026))
    args = {"query": q, "key": q, "value": q, "head_num": 1, "input_layout": "TND",
            "actual_seq_qlen": lens, "actual_seq_kvlen": lens}
    expect_error(r"\bprefix\b", call, args, sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=[1] * 1025)
    expect_error(r"\bprefix\b", call_var_len, args, sparse_mode=6, atten_mask=make_compressed_mask(6),
                 prefix=[1] * 1025)


# ---------------------------------------------------------------------------------------------- scalars
@pytest.mark.parametrize("keep_prob", [0.0, -0.1, 1.5, 1.0000001])
def test_keep_prob_out_of_range(keep_prob):
    args = base("BSND")
    drop = pack_drop_mask(torch.ones(2 * 2 * 8 * 8, dtype=torch.bool))
    expect_error(r"\bkeep_prob\b", call, args, keep_prob=keep_prob, drop_mask=drop)


@pytest.mark.parametrize("mode", [-1, 9, 100])
def test_sparse_mode_out_of_range(mode):
    expect_error(r"\bsparse_mode\b", call, base("BSND"), sparse_mode=mode, atten_mask=make_compressed_mask(2))


@pytest.mark.parametrize("mode", [-1, 9])
def test_sparse_mode_out_of_range_without_mask(mode):
    expect_error(r"\bsparse_mode\b", call, base("BSND"), sparse_mode=mode)


@pytest.mark.parametrize("pse_type", [-1, 4])
def test_pse_type_out_of_range(pse_type):
    args = base("BNSD")
    expect_error(r"\bpse_type\b", call, args, pse=torch.zeros(2, 2, 8, 8), pse_type=pse_type)


@pytest.mark.parametrize("layout", ["", "BSND"])
def test_softmax_layout_bad_value(layout):
    expect_error(r"\bsoftmax_layout\b", call, base("TND"), softmax_layout=layout or "NTD")
    if layout:
        expect_error(r"\bsoftmax_layout\b", call, base("BSND"), softmax_layout="TND")


# --------------------------------------------------------------------------------------- modes and masks
def test_mode5_in_tnd():
    args = base("TND")
    mask = torch.zeros(8, 8, dtype=torch.bool)
    expect_error(r"\bsparse_mode\b", call, args, sparse_mode=5, atten_mask=mask, prefix=[0, 0])
    expect_error(r"\bsparse_mode\b", call_var_len, args, sparse_mode=5, atten_mask=mask, prefix=[0, 0])


@pytest.mark.parametrize("mode", [7, 8])
@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_modes_7_8_outside_tnd(layout, mode):
    expect_error(
        r"\bsparse_mode\b", call, base(layout), sparse_mode=mode, atten_mask=make_compressed_mask(mode)
    )


@pytest.mark.parametrize(("pre", "nxt"), [(-5, 2), (2, -5), (-1, 0)])
@pytest.mark.parametrize("mode", [4, 0])
def test_empty_band(mode, pre, nxt):
    args = base("BSND", sq=8, skv=8)
    mask = make_compressed_mask(4) if mode == 4 else torch.zeros(8, 8, dtype=torch.bool)
    expect_error(
        r"\b(pre_tokens|next_tokens)\b",
        call,
        args,
        sparse_mode=mode,
        atten_mask=mask,
        pre_tokens=pre,
        next_tokens=nxt,
    )


@pytest.mark.parametrize(
    ("sq", "skv", "prefix"), [(8, 12, [3, 5]), (8, 12, [4, 13]), (12, 8, [-1, 0]), (12, 8, [0, 9])]
)
def test_prefix_out_of_range_mode6(sq, skv, prefix):
    args = base("BNSD", sq=sq, skv=skv)
    expect_error(r"\bprefix\b", call, args, sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=prefix)


def test_prefix_out_of_range_mode6_tnd():
    args = base("TND", q_lens=[4, 6], kv_lens=[10, 6])
    expect_error(r"\bprefix\b", call, args, sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=[5, 6])


def test_prefix_too_short():
    args = base("BNSD", b=3, sq=8, skv=12)
    expect_error(r"\bprefix\b", call, args, sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=[5])


@pytest.mark.parametrize("shape", [(1024, 1024), (2048, 2047), (1, 2048, 2048), (3072, 2048), (8, 8)])
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_wrong_compressed_mask_shape(mode, shape):
    args = base("BSND")
    kw = {"pre_tokens": 2, "next_tokens": 2} if mode == 4 else {}
    expect_error(
        r"\batten_mask\b", call, args, sparse_mode=mode, atten_mask=torch.zeros(shape, dtype=torch.bool), **kw
    )


@pytest.mark.parametrize("mode", [7, 8])
def test_wrong_compressed_mask_shape_tnd(mode):
    expect_error(
        r"\batten_mask\b", call, base("TND"), sparse_mode=mode, atten_mask=torch.zeros(8, 8, dtype=bool)
    )


def test_wrong_compressed_mask_shape_mode6():
    args = base("BNSD")
    expect_error(
        r"\batten_mask\b", call, args, sparse_mode=6, atten_mask=make_compressed_mask(2), prefix=[0, 0]
    )


BAD_CONTENTS = ("zeros", "lower", "with_diagonal", "triu_diagonal_2", "all_ones_uint8")


def _bad_content(name):
    tri = make_compressed_mask(2)
    if name == "zeros":
        return torch.zeros(2048, 2048, dtype=torch.bool)
    if name == "lower":
        return tri.t().contiguous()
    if name == "with_diagonal":  # triu(diagonal=0): off by one
        return tri | torch.eye(2048, dtype=torch.bool)
    if name == "triu_diagonal_2":  # off by one the other way
        return torch.ones(2048, 2048, dtype=torch.bool).triu(2)
    return torch.ones(2048, 2048, dtype=torch.uint8)


@pytest.mark.parametrize("name", BAD_CONTENTS)
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_wrong_compressed_mask_content(mode, name):
    kw = {"pre_tokens": 2, "next_tokens": 2} if mode == 4 else {}
    expect_error(r"\batten_mask\b", call, base("BSND"), sparse_mode=mode, atten_mask=_bad_content(name), **kw)


@pytest.mark.parametrize("mode", [7, 8])
def test_wrong_compressed_mask_content_tnd(mode):
    mask = make_compressed_mask(2).t().contiguous()
    expect_error(r"\batten_mask\b", call, base("TND"), sparse_mode=mode, atten_mask=mask)


@pytest.mark.parametrize("variant", ["triangle_only_rows_wrong", "block_swapped"])
def test_wrong_compressed_mask_content_mode6(variant):
    mask = make_compressed_mask(6).clone()
    if variant == "triangle_only_rows_wrong":
        mask[:2048] = ~mask[:2048]
    else:
        mask[2048:] = ~mask[2048:]
    expect_error(r"\batten_mask\b", call, base("BNSD"), sparse_mode=6, atten_mask=mask, prefix=[0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int8])
def test_atten_mask_dtype(dtype):
    expect_error(
        r"\batten_mask\b", call, base("BSND"), sparse_mode=1, atten_mask=torch.zeros(8, 8, dtype=dtype)
    )


@pytest.mark.parametrize(
    "shape",
    [(8, 9), (9, 8), (2, 8, 8), (3, 1, 8, 8), (2, 3, 8, 8), (1, 8, 8, 8), (8,), (1, 1, 1, 8, 8)],
    ids=str,
)
@pytest.mark.parametrize("mode", [0, 1])
def test_atten_mask_shape(mode, shape):
    args = base("BSND", b=2, n1=2, sq=8, skv=8)
    expect_error(
        r"\batten_mask\b", call, args, sparse_mode=mode, atten_mask=torch.zeros(shape, dtype=torch.bool)
    )


@pytest.mark.parametrize("shape", [(8, 12), (1, 8, 12), (2, 2, 8, 13), (3, 1, 8, 12), (1, 1, 8, 12)], ids=str)
def test_mode5_atten_mask_shape(shape):
    """Mode 5 takes [B,N,Sq,Skv] or [B,1,Sq,Skv] (docs/semantics/masks.md), here with B = 2: a batch-shared mask cannot
    carry the per-batch prefix."""
    args = base("BNSD", sq=8, skv=12)
    expect_error(
        r"\batten_mask\b",
        call,
        args,
        sparse_mode=5,
        prefix=[4, 4],
        atten_mask=torch.zeros(shape, dtype=torch.bool),
    )


@pytest.mark.parametrize("shape", [(8, 7), (2, 8, 8), (1, 1, 8, 8), (16, 16)], ids=str)
def test_tnd_atten_mask_shape(shape):
    args = base("TND", q_lens=[8, 3], kv_lens=[8, 5])  # [maxSq, maxSkv] = [8, 8]
    expect_error(
        r"\batten_mask\b", call, args, sparse_mode=1, atten_mask=torch.zeros(shape, dtype=torch.bool)
    )


# ------------------------------------------------------------------------------------------- TND lengths
@pytest.mark.parametrize("param", ["actual_seq_qlen", "actual_seq_kvlen"])
def test_tnd_lengths_not_non_decreasing(param):
    args = base("TND", q_lens=[5, 3, 4], kv_lens=[5, 3, 4])  # cumulative [5, 8, 12]
    expect_error(rf"\b{param}\b", call, args, **{param: [5, 4, 12]})


@pytest.mark.parametrize("param", ["actual_seq_qlen", "actual_seq_kvlen"])
@pytest.mark.parametrize("last", [13, 20])
def test_tnd_last_length_beyond_t(param, last):
    """A last end past T is an error; one before T is the end-of-document padded form (tests/test_torch_npu_eod.py)."""
    args = base("TND", q_lens=[5, 3, 4], kv_lens=[5, 3, 4])
    expect_error(rf"\b{param}\b", call, args, **{param: [5, 8, last]})


def test_tnd_negative_first_length():
    args = base("TND", q_lens=[5, 3], kv_lens=[5, 3])
    expect_error(r"\bactual_seq_qlen\b", call, args, actual_seq_qlen=[-1, 8])


def test_tnd_sq_positive_with_skv_zero():
    args = base("TND", q_lens=[5, 3], kv_lens=[5, 3])
    expect_error(
        r"\bactual_seq_kvlen\b",
        call,
        args,
        key=args["key"][:5],
        value=args["value"][:5],
        actual_seq_kvlen=[5, 5],
    )


def test_tnd_length_count_mismatch():
    args = base("TND", q_lens=[5, 3], kv_lens=[5, 3])
    expect_error(r"\bactual_seq_(q|kv)len\b", call, args, actual_seq_kvlen=[2, 5, 8])


def test_var_len_with_non_tnd_layout():
    args = base("BSND")
    expect_error(r"\binput_layout\b", call_var_len, args)


# ------------------------------------------------------------------------------------------------------ pse
def test_tnd_pse_with_zero_length_sequence():
    args = base("TND", q_lens=[4, 0, 6], kv_lens=[5, 0, 6])
    expect_error(r"\bpse\b", call, args, pse=torch.zeros(3, 2, 6, 6), pse_type=1)


@pytest.mark.parametrize("pse_type", [1, 2, 3])
@pytest.mark.parametrize("variant", ["zero_length_sequence", "mode7", "mode8_unequal_lengths"])
def test_tnd_pse_restrictions_every_pse_type(variant, pse_type):
    """FlashAttentionVarLenScore documentation: no pse (tensor or ALiBi slopes) with an Sq_b = 0 sequence, none
    with sparse_mode 7, and with sparse_mode 8 only when every sequence has Sq_b == Skv_b."""
    q_lens, kv_lens = {"zero_length_sequence": ([4, 0, 6], [5, 2, 6]), "mode7": ([4, 6], [4, 6]),
                       "mode8_unequal_lengths": ([4, 6], [5, 6])}[variant]
    args = base("TND", q_lens=q_lens, kv_lens=kv_lens)
    mode = {"mode7": 7, "mode8_unequal_lengths": 8}.get(variant, 0)
    extra = {"sparse_mode": mode, "atten_mask": make_compressed_mask(mode)} if mode else {}
    pse = torch.zeros(1, 2, 6, 6) if pse_type == 1 else torch.full((2,), 0.5)
    expect_error(r"\bpse\b", call, args, pse=pse, pse_type=pse_type, **extra)
    expect_error(r"\bpse\b", call_var_len, args, pse=pse, pse_type=pse_type, **extra)


@pytest.mark.parametrize("pse_type", [1, 2, 3])
def test_tnd_mode8_pse_with_equal_lengths_accepted(pse_type):
    """The valid side of the mode-8 rule: equal Sq_b == Skv_b in every sequence allows pse."""
    args = base("TND", q_lens=[4, 6], kv_lens=[4, 6])
    pse = torch.zeros(1, 2, 6, 6) if pse_type == 1 else torch.full((2,), 0.5)
    call(args, pse=pse, pse_type=pse_type, sparse_mode=8, atten_mask=make_compressed_mask(8), next_tokens=1)


def test_tnd_broadcast_pse_rejected():
    args = base("TND", q_lens=[4, 6], kv_lens=[5, 6])
    expect_error(r"\bpse\b", call, args, pse=torch.zeros(2, 2, 1, 6), pse_type=1)


@pytest.mark.parametrize(
    "shape",
    [(2, 2, 9, 8), (2, 2, 8, 9), (3, 2, 8, 8), (2, 3, 8, 8), (2, 2, 8), (2, 2, 2, 8), (2, 1, 8, 8)],
    ids=str,
)
def test_pse_wrong_shape(shape):
    expect_error(r"\bpse\b", call, base("BNSD", b=2, n1=2, sq=8, skv=8), pse=torch.zeros(shape), pse_type=1)


def test_tnd_pse_wrong_shape():
    args = base("TND", q_lens=[4, 6], kv_lens=[5, 6])
    expect_error(r"\bpse\b", call, args, pse=torch.zeros(2, 2, 6, 7), pse_type=1)


def _compressed_args(sq=1030, skv=1030):
    return base("BNSD", b=1, n1=1, sq=sq, skv=skv, d=4)


def test_compressed_pse_with_mode1():
    args = _compressed_args()
    mask = torch.ones(1030, 1030, dtype=torch.bool).triu(1)
    expect_error(r"\bpse\b", call, args, pse=torch.zeros(1, 1, 1024, 1030), sparse_mode=1, atten_mask=mask)


@pytest.mark.filterwarnings("ignore:sparse_mode=.* without atten_mask:UserWarning")  # on purpose
def test_compressed_pse_without_mask():
    """No atten_mask means full attention: a compressed (lower-triangular) pse cannot serve it."""
    expect_error(r"\bpse\b", call, _compressed_args(), pse=torch.zeros(1, 1, 1024, 1030), sparse_mode=2)


def test_compressed_pse_mode0_with_positive_next():
    mask = torch.ones(1030, 1030, dtype=torch.bool).triu(1)
    expect_error(
        r"\bpse\b",
        call,
        _compressed_args(),
        pse=torch.zeros(1, 1, 1024, 1030),
        sparse_mode=0,
        atten_mask=mask,
        next_tokens=1,
    )


def test_compressed_pse_with_sq_ne_skv():
    args = _compressed_args(sq=1030, skv=1100)
    expect_error(
        r"\bpse\b",
        call,
        args,
        pse=torch.zeros(1, 1, 1024, 1100),
        sparse_mode=3,
        atten_mask=make_compressed_mask(3),
    )


def test_compressed_pse_mode4():
    expect_error(
        r"\bpse\b",
        call,
        _compressed_args(),
        pse=torch.zeros(1, 1, 1024, 1030),
        sparse_mode=4,
        atten_mask=make_compressed_mask(4),
        pre_tokens=10,
        next_tokens=3,
    )


@pytest.mark.parametrize("pse_type", [2, 3])
@pytest.mark.parametrize("shape", [(3,), (3, 2), (2, 3), (2, 2, 1), (1, 2, 8, 8), ()], ids=str)
def test_alibi_slopes_wrong_shape(pse_type, shape):
    args = base("BNSD", b=2, n1=2)
    expect_error(r"\bpse\b", call, args, pse=torch.zeros(shape), pse_type=pse_type)


@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi_slopes_wrong_dtype(pse_type):
    args = base("BNSD", b=2, n1=2, dtype=F16)
    expect_error(r"\bpse\b", call, args, pse=torch.zeros(2, dtype=F16), pse_type=pse_type)


# -------------------------------------------------------------------------------------------------- dropout
def test_drop_mask_too_short():
    args = base("BSND", b=2, n1=2, sq=8, skv=8)  # numel 256 -> 32 bytes
    expect_error(r"\bdrop_mask\b", call, args, keep_prob=0.9, drop_mask=torch.zeros(31, dtype=torch.uint8))


def test_drop_mask_too_short_tnd():
    args = base("TND", q_lens=[5, 3], kv_lens=[6, 2])  # numel 2 * (30 + 6) = 72 -> 9 bytes
    call(args, keep_prob=0.9, drop_mask=torch.zeros(9, dtype=torch.uint8))
    expect_error(r"\bdrop_mask\b", call, args, keep_prob=0.9, drop_mask=torch.zeros(8, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.float32, torch.int64])
def test_drop_mask_wrong_dtype(dtype):
    args = base("BSND", b=2, n1=2, sq=8, skv=8)
    expect_error(r"\bdrop_mask\b", call, args, keep_prob=0.9, drop_mask=torch.zeros(256, dtype=dtype))


# -------------------------------------------------------------------------------------- nothing is written
def test_inputs_untouched_on_error():
    args = base("BNSD", b=2, n1=2, sq=8, skv=12)
    pse = torch.randn(2, 2, 8, 12)
    drop = pack_drop_mask(torch.rand(2 * 2 * 8 * 12) < 0.8)
    mask = make_compressed_mask(6)
    tensors = {
        "query": args["query"],
        "key": args["key"],
        "value": args["value"],
        "pse": pse,
        "drop": drop,
        "mask": mask,
    }
    before = {name: t.clone() for name, t in tensors.items()}
    versions = {name: t._version for name, t in tensors.items()}
    expect_error(
        r"\bprefix\b",
        call,
        args,
        pse=pse,
        drop_mask=drop,
        keep_prob=0.8,
        atten_mask=mask,
        sparse_mode=6,
        prefix=[1, 100],
    )
    for name, t in tensors.items():
        assert torch.equal(t, before[name]), f"{name} was modified"
        assert t._version == versions[name], f"{name} was written in place"


def test_pre_next_tokens_must_be_ints():
    expect_error(r"\bpre_tokens\b", call, base("BSND"), pre_tokens=1.5)
    expect_error(r"\bnext_tokens\b", call, base("BSND"), next_tokens="3")


def test_int_max_band_accepted():
    """Sanity for the band tests above: INT_MAX and a valid negative band are accepted."""
    args = base("BSND", sq=8, skv=8)
    call(args, sparse_mode=4, atten_mask=make_compressed_mask(4), pre_tokens=INT_MAX, next_tokens=-3)
    call(args, sparse_mode=0, atten_mask=torch.zeros(8, 8, dtype=torch.bool), pre_tokens=5, next_tokens=-2)
