"""One test per documented SparseFlashAttention / SparseFlashAttentionGrad constraint (docs/semantics/layouts.md,
docs/operators/sparse_flash_attention.md, docs/semantics/errors.md and the
参数说明 / 约束说明 of aclnnSparseFlashAttentionGrad documentation): error type, aclnn status code, and a message naming
the
Python parameter."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import cann_attn

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def base(layout: str = "BSND", *, dtype=F32, b: int = 2, s1: int = 4, s2: int = 8, n1: int = 4, d: int = 16,
         dr: int = 8, k: int = 3, q_lens=(4, 3), kv_lens=(8, 5)) -> dict:
    """A VALID forward argument set; every error test changes exactly one thing."""
    g = torch.Generator().manual_seed(0)
    if layout == "TND":
        tq, tk = sum(q_lens), sum(kv_lens)
        lead_q, lead_kv = (tq,), (tk,)
    else:
        lead_q, lead_kv = (b, s1), (b, s2)
    args = {
        "query": torch.randn(*lead_q, n1, d, generator=g).to(dtype),
        "key": torch.randn(*lead_kv, 1, d, generator=g).to(dtype),
        "value": torch.randn(*lead_kv, 1, d, generator=g).to(dtype),
        "sparse_indices": torch.randint(0, 3, (*lead_q, 1, k), generator=g, dtype=torch.int32),
        "scale_value": d**-0.5,
        "query_rope": torch.randn(*lead_q, n1, dr, generator=g).to(dtype),
        "key_rope": torch.randn(*lead_kv, 1, dr, generator=g).to(dtype),
        "layout": layout,
    }
    if layout == "TND":
        args["actual_seq_lengths_query"] = list(torch.tensor(q_lens).cumsum(0).tolist())
        args["actual_seq_lengths_kv"] = list(torch.tensor(kv_lens).cumsum(0).tolist())
    return args


def grad_base(layout: str = "BSND", **kw) -> dict:
    """A VALID grad argument set (forward outputs of `base`)."""
    args = base(layout, **kw)
    fwd = cann_attn.sparse_flash_attention(**args)
    args.update(d_out=torch.randn_like(fwd.attention_out), out=fwd.attention_out, softmax_max=fwd.softmax_max,
                softmax_sum=fwd.softmax_sum)
    return args


def fwd(args, **overrides):
    return cann_attn.sparse_flash_attention(**{**args, **overrides})


def grad(args, **overrides):
    return cann_attn.sparse_flash_attention_grad(**{**args, **overrides})


def expect_error(param_pattern: str, fn, args, *, nullptr: bool = False, **overrides):
    exc_type = cann_attn.ParamNullptrError if nullptr else cann_attn.ParamInvalidError
    with pytest.raises(exc_type) as info:
        fn(args, **overrides)
    err = info.value
    assert isinstance(err, cann_attn.AclnnError)
    assert err.status_code == (161001 if nullptr else 161002)
    assert str(err).startswith(f"[{err.status_code}]")
    assert re.search(param_pattern, str(err)), f"message {str(err)!r} does not name {param_pattern!r}"
    return err


BOTH = pytest.mark.parametrize("fn,make", [(fwd, base), (grad, grad_base)], ids=["fwd", "grad"])
LAYOUTS = pytest.mark.parametrize("layout", ["BSND", "TND"])


@LAYOUTS
def test_base_arguments_are_valid(layout):
    """The error tests below are only meaningful if their unmodified argument sets run."""
    grad(grad_base(layout))
    for dtype in (F16, BF16):
        base(layout, dtype=dtype)  # constructing is enough; running half precision is covered elsewhere


# ------------------------------------------------------------------------------------------------------ nullptr
@BOTH
@pytest.mark.parametrize("name", ["query", "key", "value", "sparse_indices"])
def test_missing_required_tensor(fn, make, name):
    expect_error(name, fn, make(), nullptr=True, **{name: None})


@pytest.mark.parametrize("name", ["d_out", "out", "softmax_max", "softmax_sum"])
def test_grad_missing_required_tensor(name):
    expect_error(name, grad, grad_base(), nullptr=True, **{name: None})


# ------------------------------------------------------------------------------------------------------ heads
@BOTH
@LAYOUTS
def test_n2_must_be_1(fn, make, layout):
    args = make(layout)
    k = args["key"]
    two = torch.cat([k, k], dim=-2)
    expect_error("key", fn, args, key=two, value=torch.cat([args["value"]] * 2, dim=-2),
                 key_rope=torch.cat([args["key_rope"]] * 2, dim=-2))


@BOTH
def test_value_n2_must_be_1(fn, make):
    args = make()
    expect_error("value", fn, args, value=torch.cat([args["value"]] * 2, dim=-2))


@BOTH
def test_n1_at_most_128(fn, make):
    args = make()
    q = torch.randn(2, 4, 129, 16)
    extra = {}
    if fn is grad:
        extra = {"d_out": torch.randn(2, 4, 129, 16), "out": torch.randn(2, 4, 129, 16),
                 "softmax_max": torch.zeros(2, 1, 4, 129), "softmax_sum": torch.ones(2, 1, 4, 129)}
    expect_error("query", fn, args, query=q, query_rope=torch.randn(2, 4, 129, 8), **extra)


def test_n1_128_is_accepted():
    args = base(n1=128, b=1, s1=2, s2=4)
    fwd(args)


# -------------------------------------------------------------------------------------------- layout, mode, block
@BOTH
@pytest.mark.parametrize("layout", ["BSH", "BNSD", "SBH", "bsnd", ""])
def test_unsupported_layout(fn, make, layout):
    expect_error("layout", fn, make(), layout=layout)


@BOTH
@pytest.mark.parametrize("mode", [1, 2, 4, 5, 6, 7, 8, -1])
def test_unsupported_sparse_mode(fn, make, mode):
    expect_error("sparse_mode", fn, make(), sparse_mode=mode)


@BOTH
@pytest.mark.parametrize("bs", [0, 2, 4, 7, 12, 256, -8])
def test_unsupported_sparse_block_size(fn, make, bs):
    expect_error("sparse_block_size", fn, make(), sparse_block_size=bs)


@BOTH
@pytest.mark.parametrize("bs", [8.0, 1.0, "8", torch.tensor(8), None, True], ids=repr)
def test_sparse_block_size_must_be_an_int(fn, make, bs):
    """8.0 equals 8 but is no block size: the index arithmetic needs an int
    (docs/operators/sparse_flash_attention.md)."""
    expect_error("sparse_block_size", fn, make(), sparse_block_size=bs)


@BOTH
def test_numpy_integer_block_size_is_accepted(fn, make):
    args = make()
    ref = fn(args, sparse_block_size=8)
    for a, b in zip(fn(args, sparse_block_size=np.int64(8)), ref, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- pre/next tokens
@BOTH
@pytest.mark.parametrize("name", ["pre_tokens", "next_tokens"])
@pytest.mark.parametrize("value", [0, 5, -3, 2147483646, 2**62, 2147483647.0, "2147483647", None, True], ids=repr)
def test_window_bounds_only_the_documented_value(fn, make, name, value):
    """preTokens / nextTokens: "仅支持取值：2147483647" (aclnnSparseFlashAttentionGrad, 参数说明); this API's
    default 2**63-1 (docs/design.md) means the same. Anything else is rejected, not ignored."""
    expect_error(name, fn, make(), **{name: value})


@BOTH
@pytest.mark.parametrize("value", [2147483647, 2**63 - 1, np.int64(2147483647)], ids=repr)
def test_window_bounds_documented_values_accepted(fn, make, value):
    args = make()
    ref = fn(args)
    for a, b in zip(fn(args, pre_tokens=value, next_tokens=value), ref, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@BOTH
@LAYOUTS
def test_rank_must_match_layout(fn, make, layout):
    args = make(layout)
    q = args["query"]
    wrong = q.reshape(-1, *q.shape[-2:]) if layout == "BSND" else q.unsqueeze(0)
    expect_error("query", fn, args, query=wrong)


# ------------------------------------------------------------------------------------------------------ dtypes
@BOTH
@pytest.mark.parametrize("name", ["key", "value", "query_rope", "key_rope"])
def test_dtype_must_match_query(fn, make, name):
    args = make()
    expect_error(name, fn, args, **{name: args[name].to(F16)})


@BOTH
def test_query_dtype_must_be_float(fn, make):
    args = make()
    ints = {n: args[n].to(torch.int32) for n in ("query", "key", "value", "query_rope", "key_rope")}
    expect_error("query", fn, args, **ints)


@BOTH
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.float32, torch.bool])
def test_index_dtype(fn, make, dtype):
    args = make()
    expect_error("sparse_indices", fn, args, sparse_indices=args["sparse_indices"].to(dtype))


@pytest.mark.parametrize("name", ["d_out", "out"])
def test_grad_tensor_dtype_must_match_query(name):
    args = grad_base()
    expect_error(name, grad, args, **{name: args[name].to(F16)})


@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
def test_grad_statistics_dtype(name):
    args = grad_base()
    expect_error(name, grad, args, **{name: args[name].to(F16)})


# ------------------------------------------------------------------------------------------------------ indices
@BOTH
def test_index_below_minus_one(fn, make):
    args = make()
    idx = args["sparse_indices"].clone()
    idx[0, 1, 0, 1] = -2
    expect_error("sparse_indices", fn, args, sparse_indices=idx)


@BOTH
@LAYOUTS
@pytest.mark.parametrize("which", ["rows", "n2", "rank"])
def test_index_shape_mismatch(fn, make, layout, which):
    args = make(layout)
    idx = args["sparse_indices"]
    if which == "rows":
        wrong = idx[..., :-1, :, :] if layout == "BSND" else idx[:-1]
    elif which == "n2":
        wrong = torch.cat([idx, idx], dim=-2)
    else:
        wrong = idx[..., 0, :]
    expect_error("sparse_indices", fn, args, sparse_indices=wrong)


@BOTH
def test_index_batch_mismatch(fn, make):
    args = make()
    expect_error("sparse_indices", fn, args, sparse_indices=args["sparse_indices"][:1])


# ------------------------------------------------------------------------------------------------------ shapes
@BOTH
def test_key_head_dim_must_match_query(fn, make):
    args = make()
    expect_error("key", fn, args, key=args["key"][..., :8], value=args["value"][..., :8])


@BOTH
def test_value_head_dim_may_not_exceed_key(fn, make):
    """kD >= vD (docs/semantics/layouts.md): value's head dim may be smaller than key's (tested with the oracle), not
    larger."""
    args = make()
    wide = torch.cat([args["value"], args["value"][..., :8]], dim=-1)
    expect_error(r"value: expected head dim <= the key's 16", fn, args, value=wide)


@BOTH
def test_value_tokens_must_match_key(fn, make):
    args = make()
    expect_error("value", fn, args, value=args["value"][:, :-1])


@BOTH
def test_key_batch_must_match_query(fn, make):
    args = make()
    expect_error("key", fn, args, key=args["key"][:1], value=args["value"][:1], key_rope=args["key_rope"][:1])


# ------------------------------------------------------------------------------------------------------ rope
@BOTH
@pytest.mark.parametrize("missing", ["query_rope", "key_rope"])
def test_rope_given_for_one_side_only(fn, make, missing):
    expect_error(missing, fn, make(), **{missing: None})


@BOTH
def test_rope_dim_mismatch(fn, make):
    args = make()
    expect_error("key_rope", fn, args, key_rope=args["key_rope"][..., :4])


@BOTH
def test_query_rope_leading_dims(fn, make):
    args = make()
    expect_error("query_rope", fn, args, query_rope=args["query_rope"][:, :, :2])


@BOTH
def test_key_rope_leading_dims(fn, make):
    args = make()
    expect_error("key_rope", fn, args, key_rope=args["key_rope"][:, :-1])


# ------------------------------------------------------------------------------------------------------ grad shapes
@LAYOUTS
@pytest.mark.parametrize("name", ["d_out", "out"])
def test_grad_output_shape_mismatch(layout, name):
    args = grad_base(layout)
    expect_error(name, grad, args, **{name: args[name][..., :-1]})
    expect_error(name, grad, args, **{name: args[name][:-1]})


@LAYOUTS
@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
def test_grad_statistics_shape_mismatch(layout, name):
    args = grad_base(layout)
    stat = args[name]
    expect_error(name, grad, args, **{name: stat[..., :-1]})
    expect_error(name, grad, args, **{name: stat.unsqueeze(-1).expand(*stat.shape, 8)})  # FA's [.., 8] form


# ------------------------------------------------------------------------------------------------------ scale
@BOTH
@pytest.mark.parametrize("scale", ["0.1", None, True])
def test_scale_value_must_be_a_number(fn, make, scale):
    expect_error("scale_value", fn, make(), scale_value=scale)


@BOTH
def test_scale_value_may_be_a_numpy_scalar(fn, make):
    """One rule for real parameters (errors.require_real), as in the FA ops: a NumPy float acts as the Python one."""
    args = make()
    for a, b in zip(fn(args, scale_value=np.float64(args["scale_value"])), fn(args), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


# ------------------------------------------------------------------------------------------------------ TND lengths
@BOTH
@pytest.mark.parametrize("name", ["actual_seq_lengths_query", "actual_seq_lengths_kv"])
def test_tnd_lengths_required(fn, make, name):
    expect_error(name, fn, make("TND"), nullptr=True, **{name: None})


@BOTH
@pytest.mark.parametrize("name,value", [
    ("actual_seq_lengths_query", [4, 6]),  # last end != T1 = 7
    ("actual_seq_lengths_kv", [8, 14]),  # last end != T2 = 13
    ("actual_seq_lengths_query", [4, 3, 7]),  # decreasing (and 3 sequences vs 2)
    ("actual_seq_lengths_query", []),
])
def test_tnd_cumulative_lengths(fn, make, name, value):
    expect_error(name, fn, make("TND"), **{name: value})


@BOTH
def test_tnd_sequence_counts_must_agree(fn, make):
    expect_error("actual_seq_lengths_kv", fn, make("TND"), actual_seq_lengths_kv=[3, 8, 13])


@BOTH
def test_tnd_query_without_keys_rejected(fn, make):
    """Sq_b > 0 with Skv_b = 0 is rejected (docs/semantics/layouts.md)."""
    expect_error("actual_seq_lengths", fn, make("TND"), actual_seq_lengths_kv=[13, 13])


@BOTH
def test_tnd_float_lengths_rejected(fn, make):
    expect_error("actual_seq_lengths_query", fn, make("TND"), actual_seq_lengths_query=torch.tensor([4.0, 7.0]))


# ------------------------------------------------------------------------------------------------------ BSND lengths
@BOTH
@pytest.mark.parametrize("name,value", [
    ("actual_seq_lengths_query", [5, 2]),  # > S1 = 4
    ("actual_seq_lengths_kv", [3, 9]),  # > S2 = 8
    ("actual_seq_lengths_query", [-1, 2]),
    ("actual_seq_lengths_kv", [4, -3]),
    ("actual_seq_lengths_query", torch.tensor([1.5, 2.0])),
    ("actual_seq_lengths_kv", "8"),
])
def test_bsnd_actual_lengths(fn, make, name, value):
    expect_error(name, fn, make(), **{name: value})


@BOTH
@pytest.mark.parametrize("name", ["actual_seq_lengths_query", "actual_seq_lengths_kv"])
def test_bsnd_length_count(fn, make, name):
    """None, one value, or (at least) one value per batch; B=3 with two values is an error."""
    args = make(b=3)
    expect_error(name, fn, args, **{name: [2, 2]})
