"""prompt_flash_attention (PromptFlashAttentionV2) against the independent oracle cann_attn.testing.pfa_oracle.

Layouts, GQA/MQA, actual lengths, sparse modes 0..4 with every mask dtype and shape, pse_shift, fp16/bf16 in with
fp16/bf16/int8 out (per-tensor and per-channel quant_scale2/quant_offset2), int8 in with fp16/int8 out and deq
scales as FLOAT32 or trans_quant_param words, invalid rows, empty inputs. docs/semantics/layouts.md,
docs/semantics/masks.md, docs/semantics/invalid-rows.md, docs/semantics/pse.md and 7.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn.testing.pfa_oracle import pfa_oracle
from pfa_cases import (
    DT_IDS,
    INT_MAX,
    LAYOUTS,
    channel_tensor,
    check_pfa,
    int8_scales,
    make_qkv,
    output_rows,
    rand_bnsd,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16)


def _ids(dtypes):
    return [DT_IDS[d] for d in dtypes]


def random_mask(gen, shape, dtype=torch.bool, p=0.3):
    m = torch.rand(shape, generator=gen) < p
    return m.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Layouts, GQA, scale
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_ids(FLOAT_DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(layout, dtype, rng):
    q, k, v = make_qkv(layout, rng, b=2, n=4, nkv=2, sq=24, skv=40, d=16, dtype=dtype)
    out = check_pfa(q, k, v, num_heads=4, num_key_value_heads=2, input_layout=layout, scale_value=0.25)
    expected = {"BSH": (2, 24, 64), "BSND": (2, 24, 4, 16), "BNSD": (2, 4, 24, 16), "BNSD_BSND": (2, 24, 4, 16)}
    assert tuple(out.shape) == expected[layout]


def test_bnsd_bsnd_output_is_bnsd_transposed(rng):
    q, k, v = make_qkv("BNSD", rng, b=2, n=3, sq=10, skv=12, d=8)
    a = cann_attn.prompt_flash_attention(q, k, v, num_heads=3, input_layout="BNSD", scale_value=0.3)
    b = cann_attn.prompt_flash_attention(q, k, v, num_heads=3, input_layout="BNSD_BSND", scale_value=0.3)
    assert tuple(b.shape) == (2, 10, 3, 8)
    torch.testing.assert_close(b, a.permute(0, 2, 1, 3), rtol=0, atol=0)


@pytest.mark.parametrize(
    "n,nkv", [(4, 4), (4, 2), (8, 2), (16, 2), (5, 1)], ids=["ratio1", "ratio2", "ratio4", "ratio8", "mqa"]
)
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_gqa(layout, n, nkv, rng):
    q, k, v = make_qkv(layout, rng, b=1, n=n, nkv=nkv, sq=12, skv=20, d=8)
    check_pfa(
        q,
        k,
        v,
        num_heads=n,
        num_key_value_heads=nkv,
        input_layout=layout,
        scale_value=0.35,
        atten_mask=cann_attn.compressed_mask(3),
        sparse_mode=3,
    )


def test_gqa_head_mapping_is_grouped(rng):
    """Query head h uses kv head h // G: make every kv head distinct and compare head by head with MHA."""
    q, k, v = make_qkv("BNSD", rng, b=1, n=6, nkv=2, sq=8, skv=8, d=8, dtype=torch.float32)
    out = cann_attn.prompt_flash_attention(q, k, v, num_heads=6, num_key_value_heads=2, input_layout="BNSD")
    ref = cann_attn.prompt_flash_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), num_heads=6, input_layout="BNSD"
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_num_key_value_heads_zero_means_num_heads(rng):
    q, k, v = make_qkv("BSND", rng, b=2, n=3, sq=8, skv=9, d=8)
    check_pfa(q, k, v, num_heads=3, num_key_value_heads=0, input_layout="BSND")


@pytest.mark.parametrize("scale", [1.0, 0.125, 0.0731, 2.5])
def test_scale_value(scale, rng):
    q, k, v = make_qkv("BSH", rng, b=1, n=2, sq=16, skv=16, d=16)
    check_pfa(q, k, v, num_heads=2, scale_value=scale)


def test_float32_inputs_extension(rng):
    """fp32 inputs are accepted by the reference backend (extension); output fp32."""
    q, k, v = make_qkv("BNSD", rng, b=1, n=2, sq=10, skv=14, d=8, dtype=torch.float32)
    check_pfa(q, k, v, num_heads=2, input_layout="BNSD", scale_value=0.5)


# ---------------------------------------------------------------------------------------------------------
# Sparse modes and masks
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sq,skv", [(16, 16), (12, 20), (20, 12)])
def test_mode0_without_mask_is_full_and_ignores_pre_next(sq, skv, rng):
    q, k, v = make_qkv("BNSD", rng, b=2, n=2, sq=sq, skv=skv, d=8)
    full = check_pfa(q, k, v, num_heads=2, input_layout="BNSD")
    odd = cann_attn.prompt_flash_attention(q, k, v, num_heads=2, input_layout="BNSD", pre_tokens=-3, next_tokens=1)
    torch.testing.assert_close(odd, full, rtol=0, atol=0)
    golden = pfa_oracle(q, k, v, num_heads=2, input_layout="BNSD", pre_tokens=INT_MAX, next_tokens=INT_MAX)
    torch.testing.assert_close(full.double(), golden, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("sq,skv", [(16, 16), (12, 20), (20, 12)])
def test_mode0_mask_default_next_tokens_is_zero(sq, skv, rng):
    """PFA's next_tokens default is 0: an all-zero mask in mode 0 with defaults keeps j <= i (top-left)."""
    q, k, v = make_qkv("BSND", rng, b=2, n=2, sq=sq, skv=skv, d=8)
    zeros = torch.zeros(sq, skv, dtype=torch.bool)
    out = check_pfa(q, k, v, num_heads=2, input_layout="BSND", atten_mask=zeros)
    causal = cann_attn.prompt_flash_attention(
        q, k, v, num_heads=2, input_layout="BSND", atten_mask=cann_attn.compressed_mask(2), sparse_mode=2
    )
    torch.testing.assert_close(out, causal, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(
    "pre,nxt",
    [(INT_MAX, 0), (INT_MAX, INT_MAX), (3, 2), (0, 0), (5, -2), (-2, 6), (2, INT_MAX), (INT_MAX, -3)],
)
def test_mode0_mask_and_band(pre, nxt, rng):
    """mode 0 with a mask: masked = user mask OR outside i - pre <= j <= i + next (top-left origin)."""
    q, k, v = make_qkv("BNSD", rng, b=2, n=2, sq=14, skv=18, d=8)
    mask = random_mask(rng, (14, 18), p=0.25)
    check_pfa(q, k, v, num_heads=2, input_layout="BNSD", atten_mask=mask, pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize("pre,nxt", [(0, 0), (INT_MAX, INT_MAX), (1, -1)])
def test_mode1_mask_content_only(pre, nxt, rng):
    """mode 1 ignores pre/next: the mask content decides; fully masked rows are 0."""
    q, k, v = make_qkv("BSH", rng, b=2, n=2, sq=12, skv=16, d=8)
    mask = random_mask(rng, (2, 12, 16), p=0.5)
    mask[0, 3] = True  # a fully masked row
    mask[1, :, 0] = False
    out = check_pfa(q, k, v, num_heads=2, atten_mask=mask, sparse_mode=1, pre_tokens=pre, next_tokens=nxt)
    assert bool((output_rows(out, "BSH", 2)[0, :, 3] == 0).all())


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("sq,skv", [(16, 16), (10, 24), (24, 10)])
def test_causal_modes(mode, sq, skv, rng):
    q, k, v = make_qkv("BSND", rng, b=2, n=2, sq=sq, skv=skv, d=8)
    out = check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BSND",
        atten_mask=cann_attn.compressed_mask(mode),
        sparse_mode=mode,
        pre_tokens=1,
        next_tokens=1,
    )  # pre/next ignored by modes 2/3
    if mode == 3 and sq > skv:  # rows i < sq - skv see nothing
        assert bool((output_rows(out, "BSND", 2)[:, :, : sq - skv] == 0).all())


@pytest.mark.parametrize("pre,nxt", [(2, 1), (0, 0), (INT_MAX, 0), (3, INT_MAX), (-2, 5), (6, -3), (INT_MAX, INT_MAX)])
@pytest.mark.parametrize("sq,skv", [(16, 16), (10, 20), (20, 10)])
def test_mode4_band(pre, nxt, sq, skv, rng):
    """mode 4: visible iff i + delta - pre <= j <= i + delta + next, delta = actKv - actQ."""
    q, k, v = make_qkv("BNSD", rng, b=1, n=2, sq=sq, skv=skv, d=8)
    check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        atten_mask=cann_attn.compressed_mask(4),
        sparse_mode=4,
        pre_tokens=pre,
        next_tokens=nxt,
    )


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
def test_modes_use_each_batch_actual_lengths(mode, rng):
    """Band origins and delta come from each batch's actual lengths, not the tensor's S."""
    b, sq, skv = 3, 16, 20
    q, k, v = make_qkv("BSH", rng, b=b, n=2, sq=sq, skv=skv, d=8)
    if mode in (0, 1):
        mask = random_mask(rng, (b, 1, sq, skv), p=0.2)
        mask[:, :, :, 0] = False
    else:
        mask = cann_attn.compressed_mask(mode)
    kw = {"pre_tokens": 4, "next_tokens": 2} if mode in (0, 4) else {}
    check_pfa(
        q,
        k,
        v,
        num_heads=2,
        atten_mask=mask,
        sparse_mode=mode,
        actual_seq_lengths=[16, 9, 5],
        actual_seq_lengths_kv=[11, 20, 7],
        **kw,
    )


MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=["bool", "int8", "uint8"])
@pytest.mark.parametrize("shape_kind", ["SS", "BSS", "1SS", "B1SS", "11SS", "BNSS"])
@pytest.mark.parametrize("mode", [0, 1])
def test_full_mask_shapes_and_dtypes(mode, shape_kind, mask_dtype, rng):
    b, sq, skv = 2, 10, 13
    shape = {
        "SS": (sq, skv),
        "BSS": (b, sq, skv),
        "1SS": (1, sq, skv),
        "B1SS": (b, 1, sq, skv),
        "11SS": (1, 1, sq, skv),
        "BNSS": (b, 2, sq, skv),  # docs/semantics/masks.md: per-head masks broadcast too
    }[shape_kind]
    q, k, v = make_qkv("BNSD", rng, b=b, n=2, sq=sq, skv=skv, d=8)
    mask = random_mask(rng, shape, mask_dtype, p=0.3)
    out = check_pfa(q, k, v, num_heads=2, input_layout="BNSD", atten_mask=mask, sparse_mode=mode, next_tokens=INT_MAX)
    as_bool = cann_attn.prompt_flash_attention(
        q, k, v, num_heads=2, input_layout="BNSD", atten_mask=mask.to(torch.bool), sparse_mode=mode, next_tokens=INT_MAX
    )
    torch.testing.assert_close(out, as_bool, rtol=0, atol=0)


def test_mask_per_batch_content_differs(rng):
    b, sq, skv = 3, 8, 8
    q, k, v = make_qkv("BSND", rng, b=b, n=2, sq=sq, skv=skv, d=8)
    mask = torch.zeros(b, sq, skv, dtype=torch.bool)
    mask[0] = torch.ones(sq, skv, dtype=torch.bool).triu(1)
    mask[1] = torch.ones(sq, skv, dtype=torch.bool).tril(-1)
    mask[2, :, ::2] = True
    check_pfa(q, k, v, num_heads=2, input_layout="BSND", atten_mask=mask, sparse_mode=1)


def test_mask_padded_kv_columns(rng):
    """The PromptFlashAttentionV2 documentation recommends padding atten_mask's KV_S to a multiple of 32 with ones:
    only the top-left block is
    used (docs/semantics/masks.md: top-left [actQ, actKv] block)."""
    q, k, v = make_qkv("BNSD", rng, b=1, n=2, sq=10, skv=20, d=8)
    mask = torch.ones(10, 32, dtype=torch.bool)
    mask[:, :20] = random_mask(rng, (10, 20), p=0.3)
    mask[:, 0] = False
    check_pfa(q, k, v, num_heads=2, input_layout="BNSD", atten_mask=mask, sparse_mode=1)


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=["bool", "int8", "uint8"])
@pytest.mark.parametrize("shape", [(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)], ids=["SS", "1SS", "11SS"])
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_compressed_mask_shapes_and_dtypes(mode, shape, mask_dtype, rng):
    q, k, v = make_qkv("BSH", rng, b=1, n=2, sq=9, skv=12, d=8)
    mask = cann_attn.compressed_mask(mode).to(mask_dtype).reshape(shape)
    check_pfa(q, k, v, num_heads=2, atten_mask=mask, sparse_mode=mode, pre_tokens=3, next_tokens=1)


# ---------------------------------------------------------------------------------------------------------
# Actual lengths
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lens_q,lens_kv",
    [
        (None, None),
        ([7], None),
        (None, [9]),
        ([16, 5, 11], [20, 20, 3]),
        ([16, 5, 11, 2, 1], [20, 1, 3, 4]),  # more than B values: the first B
        (torch.tensor([3, 16, 8]), torch.tensor([20, 2, 11])),  # integer tensors
        ([0, 5, 16], [20, 0, 6]),  # zero lengths
    ],
    ids=["none", "one_q", "one_kv", "B_values", "more_than_B", "tensors", "zeros"],
)
@pytest.mark.parametrize("layout", ["BSH", "BNSD_BSND"])
def test_actual_lengths(layout, lens_q, lens_kv, rng):
    b, sq, skv = 3, 16, 20
    q, k, v = make_qkv(layout, rng, b=b, n=2, sq=sq, skv=skv, d=8)
    out = check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout=layout,
        actual_seq_lengths=lens_q,
        actual_seq_lengths_kv=lens_kv,
        scale_value=0.3,
    )
    rows = output_rows(out, "BSND" if layout == "BNSD_BSND" else layout, 2)
    q_used = [sq] * b if lens_q is None else [int(x) for x in list(lens_q)]
    q_used = q_used * b if len(q_used) == 1 else q_used[:b]
    kv_used = [skv] * b if lens_kv is None else [int(x) for x in list(lens_kv)]
    kv_used = kv_used * b if len(kv_used) == 1 else kv_used[:b]
    for bi in range(b):
        assert bool((rows[bi, :, q_used[bi] :] == 0).all()), f"batch {bi}: rows beyond actQ must be 0"
        if kv_used[bi] == 0:
            assert bool((rows[bi] == 0).all()), f"batch {bi}: actKv = 0 must give zeros"


def test_actual_lengths_only_read_the_valid_region(rng):
    """Changing q rows beyond actQ or k/v rows beyond actKv must not change the output."""
    q, k, v = make_qkv("BNSD", rng, b=2, n=2, sq=12, skv=14, d=8)
    kw = {"num_heads": 2, "input_layout": "BNSD", "actual_seq_lengths": [7, 12], "actual_seq_lengths_kv": [9, 5]}
    a = cann_attn.prompt_flash_attention(q, k, v, **kw)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[0, :, 7:] = 100.0
    k2[0, :, 9:] = 100.0
    v2[1, :, 5:] = -100.0
    b = cann_attn.prompt_flash_attention(q2, k2, v2, **kw)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_key_length_zero_gives_zeros(rng):
    q = rand_bnsd((2, 2, 6, 8), torch.float16, rng)
    k = torch.zeros(2, 2, 0, 8, dtype=torch.float16)
    out = cann_attn.prompt_flash_attention(q, k, k.clone(), num_heads=2, input_layout="BNSD")
    assert out.dtype == torch.float16 and tuple(out.shape) == (2, 2, 6, 8)
    assert bool((out == 0).all())
    golden = pfa_oracle(q, k, k.clone(), num_heads=2, input_layout="BNSD")
    assert bool((golden == 0).all())


@pytest.mark.parametrize(
    "shape,layout",
    [((0, 4, 16), "BSH"), ((2, 0, 16), "BSH"), ((2, 2, 0, 8), "BNSD"), ((0, 3, 2, 8), "BSND"),
     ((2, 4, 0), "BSH"), ((2, 2, 4, 0), "BNSD")],
    ids=["B0", "S0_bsh", "S0_bnsd", "B0_bsnd", "D0_bsh", "D0_bnsd"],
)
def test_empty_query_gives_empty_output(shape, layout):
    q = torch.zeros(shape, dtype=torch.float16)
    h, d = shape[-1], shape[-1] // 2 if layout == "BSH" else shape[-1]  # H = N * D with N = 2
    if layout == "BSH":
        k = torch.randn(shape[0], 5, h).half()
    elif layout == "BNSD":
        k = torch.randn(shape[0], 2, 5, d).half()
    else:
        k = torch.randn(shape[0], 5, 2, d).half()
    out = cann_attn.prompt_flash_attention(q, k, k.clone(), num_heads=2, input_layout=layout)
    assert out.numel() == 0 and tuple(out.shape) == tuple(shape) and out.dtype == torch.float16


def test_empty_query_bnsd_bsnd_shape():
    q = torch.zeros(1, 2, 0, 8, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 4, 8).bfloat16()
    out = cann_attn.prompt_flash_attention(q, k, k.clone(), num_heads=2, input_layout="BNSD_BSND")
    assert tuple(out.shape) == (1, 0, 2, 8) and out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------
# pse_shift
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_ids(FLOAT_DTYPES))
@pytest.mark.parametrize("pse_batch", ["B", "1"])
def test_pse_shift_larger_than_needed(pse_batch, dtype, rng):
    """S = scale * x + pse_shift; pse_shift [B or 1, N, >= Q_S, >= KV_S], its top-left block used."""
    b, n, sq, skv = 2, 2, 10, 14
    q, k, v = make_qkv("BSND", rng, b=b, n=n, sq=sq, skv=skv, d=8, dtype=dtype)
    pse = rand_bnsd((b if pse_batch == "B" else 1, n, sq + 3, skv + 5), dtype, rng)
    check_pfa(q, k, v, num_heads=n, input_layout="BSND", pse_shift=pse, scale_value=0.4)


def test_pse_shift_with_lengths_mask_and_gqa(rng):
    b, n, sq, skv = 2, 4, 12, 16
    q, k, v = make_qkv("BSH", rng, b=b, n=n, nkv=2, sq=sq, skv=skv, d=8)
    pse = (3 * rand_bnsd((b, n, sq, skv + 2), torch.float32, rng)).half()
    check_pfa(
        q,
        k,
        v,
        num_heads=n,
        num_key_value_heads=2,
        pse_shift=pse,
        atten_mask=cann_attn.compressed_mask(3),
        sparse_mode=3,
        actual_seq_lengths=[12, 6],
        actual_seq_lengths_kv=[9, 16],
        scale_value=0.3,
    )


def test_pse_shift_is_not_scaled(rng):
    """pse_shift enters after the scale: with q = 0 the output is softmax(pse_shift) V whatever the scale."""
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float32)
    k = rand_bnsd((1, 1, 6, 8), torch.float32, rng)
    v = rand_bnsd((1, 1, 6, 8), torch.float32, rng)
    pse = rand_bnsd((1, 1, 4, 6), torch.float32, rng)
    out = cann_attn.prompt_flash_attention(
        q, k, v, pse_shift=pse, num_heads=1, input_layout="BNSD", scale_value=7.0, next_tokens=INT_MAX
    )
    ref = torch.softmax(pse.double(), -1) @ v.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# fp16/bf16 inputs with int8 output
# ---------------------------------------------------------------------------------------------------------
PER_CHANNEL_KINDS = {
    "BSH": ["tensor", "H", "11H"],
    "BNSD": ["tensor", "ND", "1N1D"],
    "BSND": ["tensor", "ND", "11ND"],
    "BNSD_BSND": ["tensor", "ND", "11ND"],
}
QUANT_CASES = [(layout, kind) for layout, kinds in PER_CHANNEL_KINDS.items() for kind in kinds]


@pytest.mark.parametrize("with_offset", [False, True], ids=["no_offset", "offset"])
@pytest.mark.parametrize("layout,kind", QUANT_CASES, ids=[f"{a}-{b}" for a, b in QUANT_CASES])
def test_fp16_in_int8_out(layout, kind, with_offset, rng):
    n, d = 3, 16
    q, k, v = make_qkv(layout, rng, b=2, n=n, sq=12, skv=15, d=d, dtype=torch.float16)
    scale2 = channel_tensor(kind, n, d, rng, lo=20.0, hi=90.0)
    offset2 = channel_tensor(kind, n, d, rng, lo=-20.0, hi=20.0) if with_offset else None
    check_pfa(
        q,
        k,
        v,
        num_heads=n,
        input_layout=layout,
        scale_value=0.25,
        quant_scale2=scale2,
        quant_offset2=offset2,
        actual_seq_lengths=[12, 7],
    )


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32_scale", "bf16_scale"])
@pytest.mark.parametrize("layout,kind", [("BSH", "11H"), ("BNSD", "1N1D"), ("BSND", "ND"), ("BNSD", "tensor")])
def test_bf16_in_int8_out(layout, kind, scale_dtype, rng):
    n, d = 2, 16
    q, k, v = make_qkv(layout, rng, b=2, n=n, sq=10, skv=10, d=d, dtype=torch.bfloat16)
    scale2 = channel_tensor(kind, n, d, rng, lo=20.0, hi=90.0, dtype=scale_dtype)
    offset2 = channel_tensor(kind, n, d, rng, lo=-10.0, hi=10.0, dtype=scale_dtype)
    check_pfa(
        q,
        k,
        v,
        num_heads=n,
        input_layout=layout,
        scale_value=0.25,
        quant_scale2=scale2,
        quant_offset2=offset2,
        atten_mask=cann_attn.compressed_mask(2),
        sparse_mode=2,
    )


def test_int8_out_saturates(rng):
    q, k, v = make_qkv("BNSD", rng, b=1, n=2, sq=8, skv=8, d=16, dtype=torch.float16)
    out = check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        quant_scale2=torch.tensor([1000.0]),
        quant_offset2=torch.tensor([5.0]),
    )
    assert int(out.max()) == 127 and int(out.min()) == -128


def test_int8_out_rows_beyond_actual_length_are_zero_with_offset(rng):
    """Rows beyond actQ are 0 in every output dtype, not quant(0) + offset
    (docs/operators/prompt_flash_attention.md)."""
    q, k, v = make_qkv("BSND", rng, b=2, n=2, sq=10, skv=10, d=8, dtype=torch.float16)
    out = check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BSND",
        quant_scale2=torch.tensor([50.0]),
        quant_offset2=torch.tensor([7.0]),
        actual_seq_lengths=[4, 10],
    )
    assert bool((out[0, 4:] == 0).all())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_ids(FLOAT_DTYPES))
def test_float_in_int8_out_fully_masked_row_is_zero_with_offset(dtype, rng):
    """A row with no visible key outputs 0 (docs/semantics/invalid-rows.md), also for int8 output with a nonzero offset.

    Mode 1 is never intercepted for a nonzero quant_offset2 (约束说明), so this configuration is valid."""
    q, k, v = make_qkv("BNSD", rng, b=1, n=2, sq=4, skv=6, d=8, dtype=dtype)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[1] = True
    out = check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        atten_mask=mask,
        sparse_mode=1,
        quant_scale2=torch.tensor([20.0]),
        quant_offset2=torch.tensor([3.0]),
    )
    assert bool((out[0, :, 1] == 0).all()), f"fully masked row: expected 0, got {out[0, :, 1, :4].tolist()}"


def test_float_in_int8_out_zero_kv_length_is_zero_with_offset(rng):
    """actual_seq_lengths_kv = 0 for a batch: that batch's output is all zero (docs/semantics/invalid-rows.md), also for
    int8 output with a nonzero offset (mode 0 without a mask is never intercepted)."""
    q, k, v = make_qkv("BSH", rng, b=2, n=2, sq=4, skv=6, d=8, dtype=torch.float16)
    out = check_pfa(
        q,
        k,
        v,
        num_heads=2,
        quant_scale2=torch.tensor([20.0]),
        quant_offset2=torch.tensor([3.0]),
        actual_seq_lengths_kv=[6, 0],
    )
    assert bool((out[1] == 0).all()), f"batch with actKv=0: expected zeros, got {out[1, 0, :4].tolist()}"


def test_int8_out_zero_offset_accepted_where_invalid_rows_occur(rng):
    """Mode 3 with actKv < actQ has invalid rows: a zero quant_offset2 is accepted and those rows are 0."""
    q, k, v = make_qkv("BNSD", rng, b=1, n=2, sq=10, skv=6, d=8, dtype=torch.float16)
    out = check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        atten_mask=cann_attn.compressed_mask(3),
        sparse_mode=3,
        quant_scale2=torch.tensor([40.0]),
        quant_offset2=torch.tensor([0.0]),
    )
    assert bool((out[0, :, :4] == 0).all())


# ---------------------------------------------------------------------------------------------------------
# int8 inputs
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("uint64", [False, True], ids=["deq_fp32", "deq_uint64"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_in_fp16_out(layout, uint64, rng):
    q, k, v = make_qkv(layout, rng, b=2, n=4, nkv=2, sq=12, skv=20, d=32, dtype=torch.int8)
    check_pfa(
        q,
        k,
        v,
        num_heads=4,
        num_key_value_heads=2,
        input_layout=layout,
        scale_value=0.9,
        **int8_scales(32, rng, uint64=uint64),
    )


@pytest.mark.parametrize("uint64", [False, True], ids=["deq_fp32", "deq_uint64"])
@pytest.mark.parametrize(
    "layout,kind", [("BSH", "tensor"), ("BSH", "H"), ("BNSD", "1N1D"), ("BSND", "11ND"), ("BNSD_BSND", "ND")]
)
def test_int8_in_int8_out(layout, kind, uint64, rng):
    n, d = 2, 32
    q, k, v = make_qkv(layout, rng, b=2, n=n, sq=16, skv=24, d=d, dtype=torch.int8)
    check_pfa(
        q,
        k,
        v,
        num_heads=n,
        input_layout=layout,
        scale_value=0.8,
        **int8_scales(d, rng, uint64=uint64),
        quant_scale2=channel_tensor(kind, n, d, rng, lo=20.0, hi=60.0),
        quant_offset2=channel_tensor(kind, n, d, rng, lo=-8.0, hi=8.0),
        actual_seq_lengths=[16, 11],
    )


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
def test_int8_in_modes_mask_pse_lengths(mode, rng):
    b, sq, skv, d = 2, 12, 16, 32
    q, k, v = make_qkv("BNSD", rng, b=b, n=2, sq=sq, skv=skv, d=d, dtype=torch.int8)
    if mode in (0, 1):
        mask = random_mask(rng, (sq, skv), torch.uint8, p=0.2)
    else:
        mask = cann_attn.compressed_mask(mode).to(torch.int8)
    pse = rand_bnsd((1, 2, sq, skv), torch.float16, rng)
    kw = {"pre_tokens": 5, "next_tokens": 3} if mode in (0, 4) else {}
    check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        scale_value=0.7,
        atten_mask=mask,
        sparse_mode=mode,
        pse_shift=pse,
        actual_seq_lengths=[12, 7],
        actual_seq_lengths_kv=[16, 10],
        **int8_scales(d, rng),
        **kw,
    )


def test_int8_deq_fp32_is_used_exactly_and_uint64_is_truncated(rng):
    """A FLOAT32 deq scale is used as given; the trans_quant_param word of the same value keeps only the high 19
    bits: with a scale whose low mantissa bits matter the two outputs differ, each matching its oracle."""
    n, d = 2, 32
    q, k, v = make_qkv("BNSD", rng, b=1, n=n, sq=16, skv=16, d=d, dtype=torch.int8)
    scales = int8_scales(d, rng)
    scales["deq_scale2"] = torch.tensor([1.0 / (127.0 * 40.0) * (1 + 8191 * 2**-23)], dtype=torch.float32)
    kw = {"num_heads": n, "input_layout": "BNSD", "quant_scale2": torch.tensor([100.0])}
    exact = check_pfa(q, k, v, **kw, **scales)
    words = dict(scales, deq_scale2=cann_attn.trans_quant_param(scales["deq_scale2"]))
    truncated = check_pfa(q, k, v, **kw, **words)
    assert not torch.equal(exact, truncated)


def test_int8_deq_uint64_word_ignores_offset_bits(rng):
    """Decoding a UINT64 deq word reads only its low 32 bits: words built with an offset give the same output."""
    n, d = 2, 32
    q, k, v = make_qkv("BSH", rng, b=1, n=n, sq=8, skv=8, d=d, dtype=torch.int8)
    scales = int8_scales(d, rng)
    plain, with_offset = dict(scales), dict(scales)
    for name in ("deq_scale1", "deq_scale2"):
        plain[name] = cann_attn.trans_quant_param(scales[name])
        with_offset[name] = cann_attn.trans_quant_param(scales[name], torch.tensor([-37.2]))
        assert int(with_offset[name].reshape(-1)[0]) != int(plain[name].reshape(-1)[0])
    a = cann_attn.prompt_flash_attention(q, k, v, num_heads=n, **plain)
    b = cann_attn.prompt_flash_attention(q, k, v, num_heads=n, **with_offset)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_int8_score_dequant_rounds_once_to_fp16():
    """s = fp16(s32 * deq1) is ONE rounding of the exact product (docs/operators/prompt_flash_attention.md).

    s32 = 1109 and deq1 = 968680 * 2^-30 give s32 * deq1 = 1 + 2^-11 + 8 * 2^-30, just above the fp16 tie
    between 1 and 1 + 2^-10: one rounding gives 1 + 2^-10. Rounding first to fp32 (1 + 2^-11 exactly, a tie) and
    then to fp16 (ties to even) gives 1. The other key has s32 = 1110 (score 1 + 2^-10); with scale 1024 the two
    logits are equal under one rounding and differ by 1 under double rounding."""
    d = 64

    def key_row(total):
        r = torch.full((d,), total // d, dtype=torch.int64)
        r[: total - (total // d) * d] += 1
        return r

    q = torch.ones(1, 1, 1, d, dtype=torch.int8)
    k = torch.stack([key_row(1110), key_row(1109)]).to(torch.int8).view(1, 1, 2, d)
    v = torch.stack([torch.full((d,), 20), torch.full((d,), 10)]).to(torch.int8).view(1, 1, 2, d)
    kw = {
        "num_heads": 1,
        "input_layout": "BNSD",
        "scale_value": 1024.0,
        "deq_scale1": torch.tensor([968680 * 2.0**-30], dtype=torch.float32),
        "quant_scale1": torch.tensor([100.0]),
        "deq_scale2": torch.tensor([0.01]),
    }
    out = cann_attn.prompt_flash_attention(q, k, v, **kw)
    # p = [1, 1] -> p_q = [100, 100]; o = (100*20 + 100*10) * 0.01 / 2 = 15
    assert torch.allclose(out.float(), torch.full_like(out.float(), 15.0)), f"expected 15.0, got {out[0, 0, 0, 0]}"
    check_pfa(q, k, v, **kw)


def test_int8_in_fully_masked_rows_and_zero_kv_are_zero(rng):
    d = 32
    q, k, v = make_qkv("BNSD", rng, b=2, n=2, sq=6, skv=8, d=d, dtype=torch.int8)
    mask = torch.zeros(6, 8, dtype=torch.bool)
    mask[2] = True
    out = check_pfa(
        q,
        k,
        v,
        num_heads=2,
        input_layout="BNSD",
        atten_mask=mask,
        sparse_mode=1,
        actual_seq_lengths_kv=[8, 0],
        **int8_scales(d, rng),
        quant_scale2=torch.tensor([30.0]),
        quant_offset2=torch.tensor([4.0]),
    )
    assert bool((out[0, :, 2] == 0).all()) and bool((out[1] == 0).all())


def test_int8_in_empty_query_and_zero_kv():
    q = torch.zeros(1, 0, 2, 32, dtype=torch.int8)
    k = torch.ones(1, 4, 2, 32, dtype=torch.int8)
    scales = int8_scales(32, torch.Generator().manual_seed(1))
    out = cann_attn.prompt_flash_attention(q, k, k.clone(), num_heads=2, input_layout="BSND", **scales)
    assert tuple(out.shape) == (1, 0, 2, 32) and out.dtype == torch.float16
    q = torch.ones(1, 3, 2, 32, dtype=torch.int8)
    k = torch.zeros(1, 0, 2, 32, dtype=torch.int8)
    out = cann_attn.prompt_flash_attention(
        q, k, k.clone(), num_heads=2, input_layout="BSND", **scales, quant_scale2=torch.tensor([10.0])
    )
    assert out.dtype == torch.int8 and tuple(out.shape) == (1, 3, 2, 32) and bool((out == 0).all())


# ---------------------------------------------------------------------------------------------------------
# The oracle itself, against torch SDPA with explicit masks
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,pre,nxt", [(0, 3, 1), (1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 2, 3)])
def test_oracle_matches_sdpa(mode, pre, nxt, rng):
    import torch.nn.functional as F

    sq, skv = 9, 13
    q = torch.randn(1, 4, sq, 8, generator=rng, dtype=torch.float64)
    k = torch.randn(1, 2, skv, 8, generator=rng, dtype=torch.float64)
    v = torch.randn(1, 2, skv, 8, generator=rng, dtype=torch.float64)
    user = torch.rand(sq, skv, generator=rng) < 0.2
    user[:, 0] = False
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(skv).view(1, -1)
    delta = skv - sq
    visible = {
        0: ~user & (j >= i - pre) & (j <= i + nxt),
        1: ~user,
        2: j <= i,
        3: j <= i + delta,
        4: (j >= i + delta - pre) & (j <= i + delta + nxt),
    }[mode]
    mask = user if mode in (0, 1) else cann_attn.compressed_mask(mode)
    golden = pfa_oracle(
        q,
        k,
        v,
        num_heads=4,
        num_key_value_heads=2,
        input_layout="BNSD",
        atten_mask=mask,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=nxt,
        scale_value=0.3,
    )
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=visible, scale=0.3
    )
    ref = torch.where(visible.any(-1).view(1, 1, sq, 1), ref, torch.zeros_like(ref))
    torch.testing.assert_close(golden, ref, rtol=1e-12, atol=1e-12)
