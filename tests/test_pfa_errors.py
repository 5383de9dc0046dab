"""prompt_flash_attention: one test per documented constraint (参数说明 / 约束说明 of the
PromptFlashAttentionV2 documentation, docs/semantics/layouts.md,
docs/semantics/masks.md, docs/operators/prompt_flash_attention.md, docs/semantics/errors.md).

Each checks the error class, its aclnn status code and that the message names the parameter.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError, ParamNullptrError
from pfa_cases import INT_MAX, channel_tensor, int8_scales, make_qkv, rand_bnsd

GEN = torch.Generator().manual_seed(1234)


def expect(error, params, call):
    """`call()` must raise `error` (status code checked) whose message names one of `params`."""
    params = (params,) if isinstance(params, str) else params
    with pytest.raises(cann_attn.AclnnError) as info:
        call()
    exc = info.value
    assert isinstance(exc, error), f"expected {error.__name__}, got {type(exc).__name__}: {exc}"
    assert exc.status_code == error.status_code
    assert str(exc.status_code) in str(exc)
    assert any(p in str(exc) for p in params), f"message does not name {params}: {exc}"


def pfa(q, k, v, **kw):
    return lambda: cann_attn.prompt_flash_attention(q, k, v, **kw)


def fp16_bnsd(b=1, n=2, nkv=None, sq=8, skv=8, d=16, dtype=torch.float16):
    return make_qkv("BNSD", GEN, b=b, n=n, nkv=nkv, sq=sq, skv=skv, d=d, dtype=dtype)


def int8_bnsd(b=1, n=2, sq=8, skv=8, d=32):
    return make_qkv("BNSD", GEN, b=b, n=n, sq=sq, skv=skv, d=d, dtype=torch.int8)


# ---------------------------------------------------------------------------------------------------------
# Required inputs, dtypes, layout, shapes
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("missing", ["query", "key", "value"])
def test_missing_required_input(missing):
    q, k, v = fp16_bnsd()
    args = {"query": q, "key": k, "value": v}
    args[missing] = None
    expect(
        ParamNullptrError,
        missing,
        lambda: cann_attn.prompt_flash_attention(
            args["query"], args["key"], args["value"], num_heads=2, input_layout="BNSD"
        ),
    )


def test_query_dtype_unsupported():
    q, k, v = fp16_bnsd()
    expect(
        ParamInvalidError,
        "query",
        pfa(q.to(torch.int16), k.to(torch.int16), v.to(torch.int16), num_heads=2, input_layout="BNSD"),
    )


@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("other", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_dtype_mismatch(which, other):
    q, k, v = fp16_bnsd()
    if which == "key":
        k = k.to(other)
    else:
        v = v.to(other)
    expect(ParamInvalidError, which, pfa(q, k, v, num_heads=2, input_layout="BNSD"))


@pytest.mark.parametrize("layout", ["SBH", "TND", "bsh", "BNSD_BNSD", "", "NSD"])
def test_bad_layout(layout):
    q, k, v = fp16_bnsd()
    expect(ParamInvalidError, "input_layout", pfa(q, k, v, num_heads=2, input_layout=layout))


def test_wrong_rank_for_layout():
    q, k, v = fp16_bnsd()
    expect(ParamInvalidError, "query", pfa(q, k, v, num_heads=2, input_layout="BSH"))


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BNSD_BSND"])
def test_num_heads_mismatch_4d(layout):
    q, k, v = make_qkv(layout, GEN, b=1, n=4, sq=8, skv=8, d=8)
    expect(ParamInvalidError, "num_heads", pfa(q, k, v, num_heads=2, input_layout=layout))


def test_num_heads_not_dividing_bsh_hidden():
    q, k, v = make_qkv("BSH", GEN, b=1, n=4, sq=8, skv=8, d=8)  # H = 32
    expect(ParamInvalidError, ("num_heads", "query"), pfa(q, k, v, num_heads=5))


@pytest.mark.parametrize("num_heads", [0, -1])
def test_num_heads_not_positive(num_heads):
    q, k, v = make_qkv("BSH", GEN, b=1, n=4, sq=8, skv=8, d=8)
    expect(ParamInvalidError, "num_heads", pfa(q, k, v, num_heads=num_heads))


def test_num_heads_above_256():
    q, k, v = fp16_bnsd(n=257, sq=1, skv=1, d=2)
    expect(ParamInvalidError, "num_heads", pfa(q, k, v, num_heads=257, input_layout="BNSD"))


def test_head_dim_above_512():
    q, k, v = fp16_bnsd(n=1, sq=1, skv=1, d=513)
    expect(ParamInvalidError, ("query", "head dim"), pfa(q, k, v, num_heads=1, input_layout="BNSD"))


def test_batch_above_65536():
    q = torch.zeros(65537, 1, 1, 16, dtype=torch.float16)
    expect(ParamInvalidError, "query", pfa(q, q.clone(), q.clone(), num_heads=1, input_layout="BNSD"))


def test_batch_above_128_with_unaligned_head_dim():
    """Seed 约束说明: fp16/bf16 with D not 16-aligned (int8: not 32-aligned) supports B <= 128 only."""
    q = torch.zeros(129, 1, 1, 8, dtype=torch.float16)
    expect(ParamInvalidError, "query", pfa(q, q.clone(), q.clone(), num_heads=1, input_layout="BNSD"))


@pytest.mark.parametrize("layout", ["BSH", "BSND"])
def test_hidden_size_limit_bsh_bsnd(layout):
    """Seed 约束说明: for BSH and BSND, N * D must be below 65535 (N = 128, D = 512 gives 65536)."""
    n, d = 128, 512
    shape = (1, 1, n * d) if layout == "BSH" else (1, 1, n, d)
    q = torch.zeros(shape, dtype=torch.float16)
    expect(ParamInvalidError, ("query", "num_heads"), pfa(q, q.clone(), q.clone(), num_heads=n, input_layout=layout))


def test_key_head_dim_mismatch():
    q, _, _ = fp16_bnsd(d=16)
    _, k, v = fp16_bnsd(d=8)
    expect(ParamInvalidError, "key", pfa(q, k, v, num_heads=2, input_layout="BNSD"))


def test_key_batch_mismatch():
    q, _, _ = fp16_bnsd(b=2)
    _, k, v = fp16_bnsd(b=3)
    expect(ParamInvalidError, "key", pfa(q, k, v, num_heads=2, input_layout="BNSD"))


def test_value_shape_mismatch():
    q, k, _ = fp16_bnsd(skv=8)
    _, _, v = fp16_bnsd(skv=9)
    expect(ParamInvalidError, "value", pfa(q, k, v, num_heads=2, input_layout="BNSD"))


# ---------------------------------------------------------------------------------------------------------
# num_key_value_heads
# ---------------------------------------------------------------------------------------------------------
def test_num_key_value_heads_not_dividing():
    q, k, v = make_qkv("BSH", GEN, b=1, n=6, nkv=4, sq=4, skv=4, d=8)
    expect(ParamInvalidError, "num_key_value_heads", pfa(q, k, v, num_heads=6, num_key_value_heads=4))


def test_num_key_value_heads_ratio_above_64():
    q, k, v = make_qkv("BNSD", GEN, b=1, n=65, nkv=1, sq=2, skv=2, d=4)
    expect(
        ParamInvalidError, "num_key_value_heads", pfa(q, k, v, num_heads=65, num_key_value_heads=1, input_layout="BNSD")
    )


def test_num_key_value_heads_ratio_64_accepted():
    q, k, v = make_qkv("BNSD", GEN, b=1, n=64, nkv=1, sq=2, skv=2, d=4)
    out = cann_attn.prompt_flash_attention(q, k, v, num_heads=64, num_key_value_heads=1, input_layout="BNSD")
    assert tuple(out.shape) == (1, 64, 2, 4)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BNSD_BSND"])
@pytest.mark.parametrize("nkv_arg", [4, 0, 1], ids=["4", "0_means_N", "1"])
def test_num_key_value_heads_must_match_key_heads(layout, nkv_arg):
    q, k, v = make_qkv(layout, GEN, b=1, n=4, nkv=2, sq=4, skv=4, d=8)  # key has N = 2
    expect(
        ParamInvalidError,
        "num_key_value_heads",
        pfa(q, k, v, num_heads=4, num_key_value_heads=nkv_arg, input_layout=layout),
    )


def test_num_key_value_heads_negative():
    q, k, v = fp16_bnsd()
    expect(
        ParamInvalidError, "num_key_value_heads", pfa(q, k, v, num_heads=2, num_key_value_heads=-2, input_layout="BNSD")
    )


def test_bsh_key_hidden_inconsistent_with_num_key_value_heads():
    q, k, v = make_qkv("BSH", GEN, b=1, n=4, nkv=4, sq=4, skv=4, d=8)  # key H = 32, implies 4 kv heads of D 8
    expect(ParamInvalidError, "key", pfa(q, k, v, num_heads=4, num_key_value_heads=2))


# ---------------------------------------------------------------------------------------------------------
# Actual lengths
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("param", ["actual_seq_lengths", "actual_seq_lengths_kv"])
@pytest.mark.parametrize("lengths", [[4, 4], [4, 4, 4]], ids=["2_of_4", "3_of_4"])
def test_length_list_between_2_and_B(param, lengths):
    q, k, v = fp16_bnsd(b=4)
    expect(ParamInvalidError, param, pfa(q, k, v, num_heads=2, input_layout="BNSD", **{param: lengths}))


@pytest.mark.parametrize("param", ["actual_seq_lengths", "actual_seq_lengths_kv"])
@pytest.mark.parametrize("lengths", [[9], [8, 9], [-1], [3, -2]], ids=["one_gt_S", "B_gt_S", "neg", "B_neg"])
def test_length_out_of_range(param, lengths):
    q, k, v = fp16_bnsd(b=2, sq=8, skv=8)
    expect(ParamInvalidError, param, pfa(q, k, v, num_heads=2, input_layout="BNSD", **{param: lengths}))


# ---------------------------------------------------------------------------------------------------------
# sparse_mode and masks
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [5, 6, 7, 8, -1, 9])
def test_unsupported_sparse_modes(mode):
    q, k, v = fp16_bnsd()
    expect(
        ParamInvalidError,
        "sparse_mode",
        pfa(q, k, v, num_heads=2, input_layout="BNSD", sparse_mode=mode, atten_mask=cann_attn.compressed_mask(3)),
    )


@pytest.mark.parametrize("mode", [1, 2, 3, 4])
def test_modes_1_to_4_need_a_mask(mode):
    q, k, v = fp16_bnsd()
    expect(ParamInvalidError, "atten_mask", pfa(q, k, v, num_heads=2, input_layout="BNSD", sparse_mode=mode))


@pytest.mark.parametrize(
    "shape", [(8, 8), (2048, 1024), (1024, 2048), (2, 2048, 2048), (1, 2, 2048, 2048), (3072, 2048)]
)
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_compressed_mask_wrong_shape(mode, shape):
    q, k, v = fp16_bnsd()
    mask = torch.ones(shape, dtype=torch.bool).triu(1)
    expect(
        ParamInvalidError,
        "atten_mask",
        pfa(q, k, v, num_heads=2, input_layout="BNSD", sparse_mode=mode, atten_mask=mask),
    )


@pytest.mark.parametrize("content", ["zeros", "lower", "with_diagonal", "ones"])
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_compressed_mask_wrong_content(mode, content):
    q, k, v = fp16_bnsd()
    ones = torch.ones(2048, 2048, dtype=torch.bool)
    mask = {"zeros": ~ones, "lower": ones.tril(-1), "with_diagonal": ones.triu(0), "ones": ones}[content]
    expect(
        ParamInvalidError,
        "atten_mask",
        pfa(q, k, v, num_heads=2, input_layout="BNSD", sparse_mode=mode, atten_mask=mask),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int32], ids=["fp16", "fp32", "int32"])
def test_mask_dtype_unsupported(dtype):
    q, k, v = fp16_bnsd()
    mask = torch.zeros(8, 8, dtype=dtype)
    expect(
        ParamInvalidError, "atten_mask", pfa(q, k, v, num_heads=2, input_layout="BNSD", atten_mask=mask, sparse_mode=1)
    )


@pytest.mark.parametrize(
    "shape",
    [(7, 8), (8, 7), (3, 8, 8), (3, 1, 8, 8), (2, 8), (8,)],
    ids=["short_q", "short_kv", "bad_B_3d", "bad_B_4d", "short_both", "1d"],
)
@pytest.mark.parametrize("mode", [0, 1])
def test_full_mask_wrong_shape(mode, shape):
    q, k, v = fp16_bnsd(b=2)
    mask = torch.zeros(shape, dtype=torch.bool)
    expect(
        ParamInvalidError,
        "atten_mask",
        pfa(q, k, v, num_heads=2, input_layout="BNSD", atten_mask=mask, sparse_mode=mode),
    )


def test_mode4_empty_band():
    q, k, v = fp16_bnsd()
    expect(
        ParamInvalidError,
        ("pre_tokens", "next_tokens"),
        pfa(
            q,
            k,
            v,
            num_heads=2,
            input_layout="BNSD",
            sparse_mode=4,
            atten_mask=cann_attn.compressed_mask(4),
            pre_tokens=-3,
            next_tokens=2,
        ),
    )


def test_mode0_mask_empty_band():
    """docs/semantics/masks.md: negative pre/next are legal while the band is non-empty; an empty band is an error."""
    q, k, v = fp16_bnsd()
    expect(
        ParamInvalidError,
        ("pre_tokens", "next_tokens"),
        pfa(
            q,
            k,
            v,
            num_heads=2,
            input_layout="BNSD",
            atten_mask=torch.zeros(8, 8, dtype=torch.bool),
            pre_tokens=-3,
            next_tokens=2,
        ),
    )


# ---------------------------------------------------------------------------------------------------------
# pse_shift
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape",
    [(1, 2, 7, 8), (1, 2, 8, 7), (1, 3, 8, 8), (3, 2, 8, 8), (2, 8, 8), (1, 1, 8, 8)],
    ids=["short_q", "short_kv", "wrong_N", "wrong_B", "3d", "N1"],
)
def test_pse_shift_wrong_shape(shape):
    q, k, v = fp16_bnsd(b=2)
    pse = torch.zeros(shape, dtype=torch.float16)
    expect(ParamInvalidError, "pse_shift", pfa(q, k, v, num_heads=2, input_layout="BNSD", pse_shift=pse))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pse_shift_dtype_differs_from_fp16_query(dtype):
    q, k, v = fp16_bnsd()
    pse = torch.zeros(1, 2, 8, 8, dtype=dtype)
    expect(ParamInvalidError, "pse_shift", pfa(q, k, v, num_heads=2, input_layout="BNSD", pse_shift=pse))


# ---------------------------------------------------------------------------------------------------------
# Quantization combinations (约束说明; docs/operators/prompt_flash_attention.md)
# ---------------------------------------------------------------------------------------------------------
INT8_REQUIRED = ("deq_scale1", "quant_scale1", "deq_scale2")


@pytest.mark.parametrize("missing", INT8_REQUIRED)
@pytest.mark.parametrize("out", ["int8_out", "fp16_out"])
def test_int8_in_missing_scale(out, missing):
    q, k, v = int8_bnsd()
    scales = int8_scales(32, GEN)
    del scales[missing]
    if out == "int8_out":
        scales["quant_scale2"] = torch.tensor([30.0])
    expect(ParamInvalidError, missing, pfa(q, k, v, num_heads=2, input_layout="BNSD", **scales))


@pytest.mark.parametrize("extra", ["quant_offset2", "both"])
def test_int8_in_fp16_out_forbids_output_quant(extra):
    """int8 in + int8 out requires quant_scale2; quant_offset2 without it is the forbidden int8->fp16 case."""
    q, k, v = int8_bnsd()
    kw = dict(int8_scales(32, GEN), quant_offset2=torch.tensor([1.0]))
    if extra == "both":  # offset shape differs from the scale: still an error naming quant_offset2
        kw["quant_scale2"] = torch.tensor([2.0])
        kw["quant_offset2"] = torch.tensor([[1.0]])
    expect(ParamInvalidError, "quant_offset2", pfa(q, k, v, num_heads=2, input_layout="BNSD", **kw))


@pytest.mark.parametrize("name", INT8_REQUIRED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("out", ["float_out", "int8_out"])
def test_float_in_forbids_int8_input_scales(out, dtype, name):
    q, k, v = fp16_bnsd(dtype=dtype)
    kw = {name: int8_scales(16, GEN)[name]}
    if out == "int8_out":
        kw["quant_scale2"] = torch.tensor([30.0])
    expect(ParamInvalidError, name, pfa(q, k, v, num_heads=2, input_layout="BNSD", **kw))


def test_quant_offset2_without_quant_scale2_float_in():
    q, k, v = fp16_bnsd()
    expect(
        ParamInvalidError,
        "quant_offset2",
        pfa(q, k, v, num_heads=2, input_layout="BNSD", quant_offset2=torch.tensor([1.0])),
    )


def test_quant_offset2_dtype_differs_from_scale():
    q, k, v = fp16_bnsd(dtype=torch.bfloat16)
    expect(
        ParamInvalidError,
        "quant_offset2",
        pfa(
            q,
            k,
            v,
            num_heads=2,
            input_layout="BNSD",
            quant_scale2=torch.tensor([30.0]),
            quant_offset2=torch.tensor([1.0], dtype=torch.bfloat16),
        ),
    )


@pytest.mark.parametrize("scale_kind,offset_kind", [("ND", "1N1D"), ("ND", "tensor"), ("tensor", "ND")])
def test_quant_offset2_shape_differs_from_scale(scale_kind, offset_kind):
    q, k, v = fp16_bnsd(n=2, d=16)
    expect(
        ParamInvalidError,
        "quant_offset2",
        pfa(
            q,
            k,
            v,
            num_heads=2,
            input_layout="BNSD",
            quant_scale2=channel_tensor(scale_kind, 2, 16, GEN, lo=10, hi=20),
            quant_offset2=channel_tensor(offset_kind, 2, 16, GEN, lo=-1, hi=1),
        ),
    )


@pytest.mark.parametrize(
    "layout,shape",
    [
        ("BSH", (33,)),
        ("BSH", (1, 1, 16)),
        ("BNSD", (2, 15)),
        ("BNSD", (1, 2, 1, 8)),
        ("BSND", (1, 1, 2, 17)),
        ("BNSD_BSND", (2, 16, 2)),
        ("BNSD", (4, 16)),
        ("BSND", (2,)),
    ],
    ids=["BSH_H+1", "BSH_half", "BNSD_D-1", "BNSD_half_D", "BSND_D+1", "BNSD_BSND_extra", "BNSD_2N", "BSND_N"],
)
def test_per_channel_wrong_shape(layout, shape):
    q, k, v = make_qkv(layout, GEN, b=1, n=2, sq=4, skv=4, d=16)
    scale = torch.full(shape, 20.0)
    expect(ParamInvalidError, "quant_scale2", pfa(q, k, v, num_heads=2, input_layout=layout, quant_scale2=scale))


def test_bf16_quant_scale2_with_fp16_input():
    q, k, v = fp16_bnsd()
    expect(
        ParamInvalidError,
        "quant_scale2",
        pfa(q, k, v, num_heads=2, input_layout="BNSD", quant_scale2=torch.tensor([30.0], dtype=torch.bfloat16)),
    )


def test_bf16_quant_scale2_with_int8_input():
    q, k, v = int8_bnsd()
    expect(
        ParamInvalidError,
        "quant_scale2",
        pfa(
            q,
            k,
            v,
            num_heads=2,
            input_layout="BNSD",
            **int8_scales(32, GEN),
            quant_scale2=torch.tensor([30.0], dtype=torch.bfloat16),
        ),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
def test_quant_scale2_dtype_unsupported(dtype):
    q, k, v = fp16_bnsd(dtype=torch.bfloat16)
    expect(
        ParamInvalidError,
        "quant_scale2",
        pfa(q, k, v, num_heads=2, input_layout="BNSD", quant_scale2=torch.tensor([30.0], dtype=dtype)),
    )


@pytest.mark.parametrize("name", ["deq_scale1", "deq_scale2"])
@pytest.mark.parametrize("bad", ["fp16", "per_channel"])
def test_deq_scale_bad(name, bad):
    q, k, v = int8_bnsd()
    kw = int8_scales(32, GEN)
    kw[name] = torch.tensor([0.01], dtype=torch.float16) if bad == "fp16" else torch.tensor([0.01, 0.02])
    expect(ParamInvalidError, name, pfa(q, k, v, num_heads=2, input_layout="BNSD", **kw))


@pytest.mark.parametrize("bad", ["fp16", "per_channel", "int64"])
def test_quant_scale1_bad(bad):
    q, k, v = int8_bnsd()
    kw = int8_scales(32, GEN)
    kw["quant_scale1"] = {
        "fp16": torch.tensor([100.0], dtype=torch.float16),
        "per_channel": torch.tensor([1.0, 2.0]),
        "int64": torch.tensor([100]),
    }[bad]
    expect(ParamInvalidError, "quant_scale1", pfa(q, k, v, num_heads=2, input_layout="BNSD", **kw))


# Nonzero quant_offset2 with configurations that can produce invalid rows (约束说明;
# docs/operators/prompt_flash_attention.md)
INVALID_ROW_CASES = [
    # (mode, sq, skv, pre, next, lens_q, lens_kv)
    pytest.param(0, 16, 8, 4, 0, None, None, id="mode0_q-kv-pre>0"),
    pytest.param(0, 8, 8, INT_MAX, -1, None, None, id="mode0_next<0"),
    pytest.param(0, 8, 8, 2, 0, [8, 8], [8, 3], id="mode0_one_batch_by_lengths"),
    pytest.param(3, 16, 8, INT_MAX, 0, None, None, id="mode3_kv<q"),
    pytest.param(3, 8, 8, INT_MAX, 0, [8, 6], [8, 5], id="mode3_one_batch_by_lengths"),
    pytest.param(4, 8, 8, -1, 4, None, None, id="mode4_pre<0"),
    pytest.param(4, 16, 8, 100, 4, None, None, id="mode4_next+kv-q<0"),
]


def _invalid_row_call(mode, sq, skv, pre, nxt, lens_q, lens_kv, offset, dtype=torch.float16):
    if dtype == torch.int8:
        q, k, v = int8_bnsd(b=2, sq=sq, skv=skv)
        kw = int8_scales(32, GEN)
    else:
        q, k, v = fp16_bnsd(b=2, sq=sq, skv=skv)
        kw = {}
    mask = torch.zeros(sq, skv, dtype=torch.bool) if mode == 0 else cann_attn.compressed_mask(mode)
    return pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        atten_mask=mask,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=nxt,
        actual_seq_lengths=lens_q,
        actual_seq_lengths_kv=lens_kv,
        quant_scale2=torch.tensor([30.0]),
        quant_offset2=offset,
        **kw,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=["fp16_in", "int8_in"])
@pytest.mark.parametrize("mode,sq,skv,pre,nxt,lens_q,lens_kv", INVALID_ROW_CASES)
def test_nonzero_offset_rejected_with_invalid_rows(mode, sq, skv, pre, nxt, lens_q, lens_kv, dtype):
    expect(
        ParamInvalidError,
        "quant_offset2",
        _invalid_row_call(mode, sq, skv, pre, nxt, lens_q, lens_kv, torch.tensor([2.0]), dtype),
    )


@pytest.mark.parametrize("offset", ["zero", "none"])
@pytest.mark.parametrize("mode,sq,skv,pre,nxt,lens_q,lens_kv", INVALID_ROW_CASES)
def test_zero_or_no_offset_accepted_with_invalid_rows(mode, sq, skv, pre, nxt, lens_q, lens_kv, offset):
    off = torch.tensor([0.0]) if offset == "zero" else None
    out = _invalid_row_call(mode, sq, skv, pre, nxt, lens_q, lens_kv, off)()
    assert out.dtype == torch.int8


def test_per_channel_offset_nonzero_somewhere_rejected():
    q, k, v = fp16_bnsd(n=2, sq=16, skv=8, d=16)
    offset = torch.zeros(2, 16)
    offset[1, 5] = 1.0
    expect(
        ParamInvalidError,
        "quant_offset2",
        pfa(
            q,
            k,
            v,
            num_heads=2,
            input_layout="BNSD",
            atten_mask=cann_attn.compressed_mask(3),
            sparse_mode=3,
            quant_scale2=torch.full((2, 16), 30.0),
            quant_offset2=offset,
        ),
    )


@pytest.mark.parametrize(
    "mode,sq,skv,pre,nxt",
    [(1, 16, 8, INT_MAX, 0), (2, 16, 8, INT_MAX, 0), (0, 16, 8, INT_MAX, 0), (3, 8, 16, INT_MAX, 0), (4, 8, 8, 2, 0)],
    ids=["mode1", "mode2", "mode0_no_invalid", "mode3_kv>=q", "mode4_ok"],
)
def test_nonzero_offset_accepted_without_invalid_rows(mode, sq, skv, pre, nxt):
    q, k, v = fp16_bnsd(sq=sq, skv=skv)
    mask = torch.zeros(sq, skv, dtype=torch.bool) if mode in (0, 1) else cann_attn.compressed_mask(mode)
    out = cann_attn.prompt_flash_attention(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        atten_mask=mask,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=nxt,
        quant_scale2=torch.tensor([30.0]),
        quant_offset2=torch.tensor([2.0]),
    )
    assert out.dtype == torch.int8


def test_nonzero_offset_mode0_without_mask_not_intercepted():
    """The mode-0 interception needs a mask: without one, pre/next are ignored and every row is valid."""
    q, k, v = fp16_bnsd(sq=16, skv=8)
    out = cann_attn.prompt_flash_attention(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        pre_tokens=1,
        next_tokens=-1,
        quant_scale2=torch.tensor([30.0]),
        quant_offset2=torch.tensor([2.0]),
    )
    assert out.dtype == torch.int8


# ---------------------------------------------------------------------------------------------------------
# Arguments of the wrong kind
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,value", [("sparse_mode", 1.5), ("pre_tokens", "3"), ("next_tokens", None), ("num_heads", 2.0)]
)
def test_non_int_attributes(name, value):
    q, k, v = fp16_bnsd()
    expect(ParamInvalidError, name, pfa(q, k, v, input_layout="BNSD", **{"num_heads": 2, name: value}))


def test_pse_shift_not_a_tensor():
    q, k, v = fp16_bnsd()
    expect(
        ParamInvalidError,
        "pse_shift",
        pfa(q, k, v, num_heads=2, input_layout="BNSD", pse_shift=rand_bnsd((1, 2, 8, 8), torch.float16, GEN).tolist()),
    )
