"""FusedInferAttentionScore and IncreFlashAttention against the independent float64 oracle, one parameter group at
a time (docs/operators/fused_infer_attention_score.md, docs/operators/incre_flash_attention.md)."""

from __future__ import annotations

import math

import pytest
import torch

import cann_attn
from cann_attn.ops.fia_problem import DECODE_EMPTY_BATCH_LSE
from cann_attn.testing.fia_oracle import fia_oracle
from fia_cases import check_fia, compare, make_qkv, rand, to_layout

INT_MAX = 2147483647
SCALE = 0.25


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD"])
@pytest.mark.parametrize("sq", [1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layouts_prefill_and_decode(layout, sq, dtype):
    if sq == 1 and layout in ("BNSD_BSND", "BNSD_NBSD"):
        pytest.skip("documented for Q_S > 1 only (an error test covers it)")
    q, k, v = make_qkv(layout, gen(1), b=2, n=4, nkv=2, sq=sq, skv=13, dtype=dtype)
    _out, lse = check_fia(q, k, v, num_heads=4, num_key_value_heads=2, input_layout=layout, scale=SCALE,
                         softmax_lse_flag=True)
    assert lse.shape == (2, 4, sq, 1)


@pytest.mark.parametrize("layout", ["TND", "NTD_TND", "TND_NTD"])
def test_packed_layouts(layout):
    g = gen(2)
    lens_q, lens_kv = [3, 0, 5], [4, 2, 6]
    tq, tk = sum(lens_q), sum(lens_kv)
    q = rand((tq, 2, 128), torch.float32, g)
    k, v = rand((tk, 1, 128), torch.float32, g), rand((tk, 1, 128), torch.float32, g)
    if layout.startswith("NTD"):
        q, k, v = (t.permute(1, 0, 2).contiguous() for t in (q, k, v))
    ends_q = [3, 3, 8]
    ends_kv = [4, 6, 12]
    for mode, mask in ((0, None), (3, cann_attn.compressed_mask(3))):
        _out, lse = check_fia(q, k, v, num_heads=2, num_key_value_heads=1, input_layout=layout, scale=SCALE,
                             actual_seq_lengths=ends_q, actual_seq_lengths_kv=ends_kv, sparse_mode=mode,
                             atten_mask=mask, softmax_lse_flag=True)
        assert lse.shape == (tq, 2, 1)


def test_packed_value_dim_192_128():
    g = gen(3)
    q = rand((5, 2, 192), torch.float32, g)
    k, v = rand((7, 2, 192), torch.float32, g), rand((7, 2, 128), torch.float32, g)
    out, _ = check_fia(q, k, v, num_heads=2, input_layout="TND", scale=SCALE, actual_seq_lengths=[2, 5],
                       actual_seq_lengths_kv=[3, 7])
    assert out.shape == (5, 2, 128)


# ------------------------------------------------------------------------------------------------- GQA / MQA
@pytest.mark.parametrize("nkv", [1, 2, 8])
@pytest.mark.parametrize("sq", [1, 5])
def test_gqa(nkv, sq):
    q, k, v = make_qkv("BSH", gen(4), b=2, n=8, nkv=nkv, sq=sq, skv=11)
    check_fia(q, k, v, num_heads=8, num_key_value_heads=nkv, input_layout="BSH", scale=SCALE, softmax_lse_flag=True)


# ---------------------------------------------------------------------------------------------- actual lengths
def test_prefill_actual_lengths_with_empty_batches():
    q, k, v = make_qkv("BNSD", gen(5), b=3, n=2, sq=7, skv=9)
    out, lse = check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, actual_seq_lengths=[7, 0, 3],
                         actual_seq_lengths_kv=[9, 4, 0], softmax_lse_flag=True)
    # "数据为inf的代表无效数据": rows without keys carry +inf (docs/semantics/invalid-rows.md)
    assert torch.isposinf(lse[2]).all() and (out[2] == 0).all()


@pytest.mark.parametrize("lengths", [[5], [1, 13, 7], [13, 0, 2, 99]])
def test_decode_actual_lengths_kv(lengths):
    q, k, v = make_qkv("BSND", gen(6), b=3, n=4, nkv=2, sq=1, skv=13)
    check_fia(q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BSND", scale=SCALE,
              actual_seq_lengths_kv=lengths[:3] if len(lengths) == 4 else lengths, softmax_lse_flag=True)


def test_decode_ignores_actual_seq_lengths_and_band():
    q, k, v = make_qkv("BNSD", gen(7), b=2, n=2, sq=1, skv=10)
    base, _ = cann_attn.fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE)
    other, _ = cann_attn.fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE,
                                                     actual_seq_lengths=[1, 1], pre_tokens=0, next_tokens=0,
                                                     sparse_mode=2, atten_mask=None)
    assert torch.equal(base, other)


# ------------------------------------------------------------------------------------------------------ masks
def _bool_mask(shape, g, p=0.3):
    return torch.rand(shape, generator=g) < p


@pytest.mark.parametrize("shape_kind", ["2d", "1qk", "b1qk", "11qk"])
def test_explicit_mask_shapes(shape_kind):
    g = gen(8)
    b, sq, skv = 2, 6, 9
    q, k, v = make_qkv("BSND", g, b=b, n=2, sq=sq, skv=skv)
    shape = {"2d": (sq, skv), "1qk": (1, sq, skv), "b1qk": (b, 1, sq, skv), "11qk": (1, 1, sq, skv)}[shape_kind]
    mask = _bool_mask(shape, g)
    check_fia(q, k, v, num_heads=2, input_layout="BSND", scale=SCALE, atten_mask=mask, softmax_lse_flag=True)


@pytest.mark.parametrize("mode,pre,nxt", [(0, 2, 1), (0, INT_MAX, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 3, 1),
                                          (4, 2, -1)])
def test_sparse_modes(mode, pre, nxt):
    g = gen(9)
    q, k, v = make_qkv("BNSD", g, b=2, n=2, sq=7, skv=10)
    mask = _bool_mask((7, 10), g, 0.2) if mode in (0, 1) else cann_attn.compressed_mask(mode)
    check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, atten_mask=mask, sparse_mode=mode,
              pre_tokens=pre, next_tokens=nxt, actual_seq_lengths=[7, 4], actual_seq_lengths_kv=[10, 6],
              softmax_lse_flag=True)


def test_fully_masked_rows_are_zero_with_inf_lse():
    q, k, v = make_qkv("BNSD", gen(10), b=1, n=2, sq=4, skv=5)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[1] = True
    out, lse = check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, atten_mask=mask,
                         softmax_lse_flag=True)
    assert (out[:, :, 1] == 0).all() and torch.isposinf(lse[:, :, 1]).all()


@pytest.mark.parametrize("shape_kind", ["bk", "b11k", "11k"])
def test_decode_masks(shape_kind):
    g = gen(11)
    q, k, v = make_qkv("BSH", g, b=3, n=2, sq=1, skv=12)
    shape = {"bk": (3, 12), "b11k": (3, 1, 1, 12), "11k": (1, 1, 12)}[shape_kind]
    mask = _bool_mask(shape, g, 0.4).to(torch.uint8)
    check_fia(q, k, v, num_heads=2, input_layout="BSH", scale=SCALE, atten_mask=mask, softmax_lse_flag=True,
              actual_seq_lengths_kv=[12, 5, 9])


# -------------------------------------------------------------------------------------------------------- pse
@pytest.mark.parametrize("sq", [1, 6])
@pytest.mark.parametrize("pse_batch", [1, 2])
def test_pse_shift(sq, pse_batch):
    g = gen(12)
    q, k, v = make_qkv("BNSD", g, b=2, n=2, sq=sq, skv=8, dtype=torch.float16)
    pse = rand((pse_batch, 2, sq, 8), torch.float16, g)
    check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, pse_shift=pse, softmax_lse_flag=True)


# ---------------------------------------------------------------------------------------------------- padding
def test_query_and_kv_left_padding():
    g = gen(13)
    q, k, v = make_qkv("BSND", g, b=2, n=2, sq=10, skv=12)
    mask = _bool_mask((10, 12), g, 0.2)
    out, _lse = check_fia(q, k, v, num_heads=2, input_layout="BSND", scale=SCALE, actual_seq_lengths=[4, 7],
                         actual_seq_lengths_kv=[5, 9], query_padding_size=torch.tensor([2]),
                         kv_padding_size=torch.tensor([1]), atten_mask=mask, softmax_lse_flag=True)
    # batch 0: rows 4..7 hold the data (10 - 2 - 4 = 4); everything else is 0
    assert (out[0, :4] == 0).all() and (out[0, 8:] == 0).all() and not (out[0, 4:8] == 0).all()


def test_decode_kv_left_padding_and_out_of_range_start():
    g = gen(14)
    q, k, v = make_qkv("BNSD", g, b=2, n=2, sq=1, skv=9)
    # batch 1 would start at 9 - 2 - 9 = -2: zeros (the documented Q_S = 1 behaviour)
    out, lse = check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, actual_seq_lengths_kv=[3, 9],
                         kv_padding_size=torch.tensor([2]), softmax_lse_flag=True)
    # the decode kernel's value for a batch without keys (docs/semantics/invalid-rows.md)
    assert (out[1] == 0).all() and (lse[1] == DECODE_EMPTY_BATCH_LSE).all() and not (out[0] == 0).all()
    # a negative padding counts as 0
    check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, actual_seq_lengths_kv=[3, 9],
              kv_padding_size=torch.tensor([-5]), softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------------- shared prefix
@pytest.mark.parametrize("sq", [1, 5])
@pytest.mark.parametrize("prefix_len", [None, 3, 0])
def test_shared_prefix(sq, prefix_len):
    g = gen(15)
    q, k, v = make_qkv("BSH", g, b=2, n=4, nkv=2, sq=sq, skv=7)
    pk, pv = (to_layout(rand((1, 2, 6, 16), torch.float32, g), "BSH") for _ in range(2))
    extra = {} if prefix_len is None else {"actual_shared_prefix_len": [prefix_len]}
    total = 7 + (6 if prefix_len is None else prefix_len)
    mask = _bool_mask((sq, total), g, 0.2) if sq > 1 else None
    check_fia(q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BSH", scale=SCALE, key_shared_prefix=pk,
              value_shared_prefix=pv, actual_seq_lengths_kv=[7, 4], atten_mask=mask, softmax_lse_flag=True, **extra)


# ------------------------------------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("d,nkv,layout,sq", [(512, 1, "BNSD", 1), (512, 1, "BSND", 3), (128, 2, "BSH", 4),
                                             (128, 2, "BSH_BNSD", 2)])
def test_mla_rope(d, nkv, layout, sq):
    g = gen(16)
    q, k, v = make_qkv(layout, g, b=2, n=4, nkv=nkv, sq=sq, skv=6, d=d, dtype=torch.float16)
    qr = to_layout(rand((2, 4, sq, 64), torch.float16, g), layout)
    kr = to_layout(rand((2, nkv, 6, 64), torch.float16, g), layout)
    check_fia(q, k, v, query_rope=qr, key_rope=kr, num_heads=4, num_key_value_heads=nkv, input_layout=layout,
              scale=1 / math.sqrt(d + 64), softmax_lse_flag=d == 128)


# ------------------------------------------------------------------------------------------------ int8 output
@pytest.mark.parametrize("kind", ["tensor", "channel", "channel_offset"])
@pytest.mark.parametrize("sq", [1, 6])
def test_int8_output(kind, sq):
    g = gen(17)
    q, k, v = make_qkv("BSND", g, b=2, n=2, sq=sq, skv=8, d=32, dtype=torch.float16)
    if kind == "tensor":
        scale2, offset2 = torch.tensor([40.0]), None
    else:
        scale2 = torch.rand(2, 32, generator=g) * 50 + 20
        offset2 = torch.round(torch.randn(2, 32, generator=g) * 3) if kind == "channel_offset" else None
    check_fia(q, k, v, num_heads=2, input_layout="BSND", scale=SCALE, quant_scale2=scale2, quant_offset2=offset2)


# ------------------------------------------------------------------------------------------- KV anti-quantisation
def _antiquant_factor(shape, g, dtype, lo=0.01, hi=0.03):
    return (lo + (hi - lo) * torch.rand(shape, generator=g)).to(dtype)


@pytest.mark.parametrize("kind", ["tensor", "channel_bnsd", "channel_bsnd", "channel_h"])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("offset", [False, True])
def test_antiquant_combined_per_channel(kind, sq, offset):
    g = gen(18)
    n2, d = 2, 16
    q, k, v = make_qkv("BNSD", g, b=2, n=4, nkv=n2, sq=sq, skv=9, dtype=torch.float16, kv_dtype=torch.int8)
    shape = {"tensor": (2,), "channel_bnsd": (2, n2, 1, d), "channel_bsnd": (2, n2, d), "channel_h": (2, n2 * d)}[kind]
    sc = _antiquant_factor(shape, g, torch.float16)
    off = (torch.randn(shape, generator=g) * 2).to(torch.float16) if offset else None
    check_fia(q, k, v, num_heads=4, num_key_value_heads=n2, input_layout="BNSD", scale=SCALE, antiquant_scale=sc,
              antiquant_offset=off, softmax_lse_flag=True)


def test_antiquant_combined_per_token_decode():
    g = gen(19)
    q, k, v = make_qkv("BSH", g, b=2, n=2, sq=1, skv=7, dtype=torch.bfloat16, kv_dtype=torch.int8)
    sc = _antiquant_factor((2, 2, 7), g, torch.float32)
    off = torch.randn(2, 2, 7, generator=g)
    check_fia(q, k, v, num_heads=2, input_layout="BSH", scale=SCALE, antiquant_scale=sc, antiquant_offset=off,
              antiquant_mode=1)


@pytest.mark.parametrize("key_mode,value_mode", [(0, 0), (1, 1), (0, 1), (2, 2), (3, 3)])
def test_antiquant_separate_modes_decode(key_mode, value_mode):
    g = gen(20)
    b, n2, s, d = 2, 2, 7, 16
    q, k, v = make_qkv("BSND", g, b=b, n=4, nkv=n2, sq=1, skv=s, dtype=torch.float16, kv_dtype=torch.int8)
    shapes = {0: (n2, d), 1: (1, b, s), 2: (n2,), 3: (b, n2, s)}
    dt = {0: torch.float16, 1: torch.float32, 2: torch.float32, 3: torch.float32}
    ks, vs = (_antiquant_factor(shapes[m], g, dt[m]) for m in (key_mode, value_mode))
    ko, vo = ((torch.randn(shapes[m], generator=g)).to(dt[m]) for m in (key_mode, value_mode))
    check_fia(q, k, v, num_heads=4, num_key_value_heads=n2, input_layout="BSND", scale=SCALE,
              key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko, value_antiquant_offset=vo,
              key_antiquant_mode=key_mode, value_antiquant_mode=value_mode, actual_seq_lengths_kv=[7, 3])


def test_antiquant_separate_prefill_per_token():
    g = gen(21)
    q, k, v = make_qkv("BNSD", g, b=2, n=2, sq=5, skv=6, dtype=torch.float16, kv_dtype=torch.int8)
    ks, vs = _antiquant_factor((1, 2, 6), g, torch.float32), _antiquant_factor((1, 2, 6), g, torch.float32)
    check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, key_antiquant_scale=ks,
              value_antiquant_scale=vs, key_antiquant_mode=1, value_antiquant_mode=1, softmax_lse_flag=True)


def test_antiquant_with_shared_prefix():
    g = gen(22)
    q, k, v = make_qkv("BNSD", g, b=2, n=2, sq=1, skv=6, dtype=torch.float16, kv_dtype=torch.int8)
    pk, pv = rand((1, 2, 4, 16), torch.int8, g), rand((1, 2, 4, 16), torch.int8, g)
    sc = _antiquant_factor((2, 2, 1, 16), g, torch.float16)
    check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, antiquant_scale=sc, key_shared_prefix=pk,
              value_shared_prefix=pv)


# --------------------------------------------------------------------------------------- int8 full quantisation
def test_int8_inputs_equal_prompt_flash_attention():
    g = gen(23)
    q, k, v = make_qkv("BSH", g, b=2, n=2, sq=6, skv=8, d=32, dtype=torch.int8)
    scales = {"dequant_scale1": torch.tensor([2e-4]), "quant_scale1": torch.tensor([100.0]),
              "dequant_scale2": torch.tensor([1e-4])}
    out, _ = check_fia(q, k, v, num_heads=2, input_layout="BSH", scale=SCALE, next_tokens=0, **scales)
    pfa = cann_attn.prompt_flash_attention(q, k, v, num_heads=2, input_layout="BSH", scale_value=SCALE,
                                           deq_scale1=scales["dequant_scale1"], quant_scale1=scales["quant_scale1"],
                                           deq_scale2=scales["dequant_scale2"])
    assert torch.equal(out, pfa)


# ------------------------------------------------------------------------------- FIA == PFA where they agree
PFA_CASES = [
    {"input_layout": "BSH", "num_heads": 4, "num_key_value_heads": 2},
    {"input_layout": "BNSD", "num_heads": 2, "sparse_mode": 3, "mask": "compressed3",
     "actual_seq_lengths": [6, 3], "actual_seq_lengths_kv": [9, 9]},
    {"input_layout": "BSND", "num_heads": 2, "sparse_mode": 0, "mask": "explicit", "pre_tokens": 3,
     "next_tokens": 1},
    {"input_layout": "BNSD_BSND", "num_heads": 2, "sparse_mode": 4, "mask": "compressed4", "pre_tokens": 2,
     "next_tokens": 2, "pse": True},
    {"input_layout": "BSH", "num_heads": 2, "quant_scale2": True},
]


@pytest.mark.parametrize("case", range(len(PFA_CASES)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fia_with_pfa_arguments_is_prompt_flash_attention_bit_for_bit(case, dtype):
    """FIA's Q_S > 1 branch is PromptFlashAttention (FIA documentation): same arguments, same bits (FIA's
    next_tokens default differs, so both get it explicitly)."""
    spec = dict(PFA_CASES[case])
    g = gen(24 + case)
    n = spec["num_heads"]
    q, k, v = make_qkv(spec["input_layout"], g, b=2, n=n, nkv=spec.get("num_key_value_heads") or n, sq=6, skv=9,
                       dtype=dtype, d=32)
    mask_kind = spec.pop("mask", None)
    mask = None
    if mask_kind == "explicit":
        mask = torch.rand(6, 9, generator=g) < 0.3
    elif mask_kind:
        mask = cann_attn.compressed_mask(int(mask_kind[-1]))
    pse = rand((2, n, 6, 9), dtype, g) if spec.pop("pse", False) else None
    scale2 = torch.tensor([30.0]) if spec.pop("quant_scale2", False) else None
    pre = spec.pop("pre_tokens", INT_MAX)
    nxt = spec.pop("next_tokens", 0)
    pfa = cann_attn.prompt_flash_attention(q, k, v, atten_mask=mask, pse_shift=pse, quant_scale2=scale2,
                                           scale_value=SCALE, pre_tokens=pre, next_tokens=nxt, **spec)
    for lse_flag in (False, True):
        if lse_flag and scale2 is not None:
            continue
        fia, _ = cann_attn.fused_infer_attention_score(q, k, v, atten_mask=mask, pse_shift=pse, quant_scale2=scale2,
                                                       scale=SCALE, pre_tokens=pre, next_tokens=nxt,
                                                       softmax_lse_flag=lse_flag, **spec)
        assert fia.dtype == pfa.dtype and torch.equal(fia, pfa)


# ------------------------------------------------------------------------------------------------- v2 and IFA
def test_v2_is_v1_under_its_names():
    g = gen(30)
    q, k, v = make_qkv("BSH", g, b=2, n=4, nkv=2, sq=1, skv=9, dtype=torch.float16, kv_dtype=torch.int8)
    ks = _antiquant_factor((2, 16), g, torch.float16)
    vs = _antiquant_factor((2, 16), g, torch.float16)
    v1 = cann_attn.fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=2, scale=SCALE,
                                               key_antiquant_scale=ks, value_antiquant_scale=vs,
                                               actual_seq_lengths_kv=[9, 4], softmax_lse_flag=True)
    v2 = cann_attn.fused_infer_attention_score_v2(q, k, v, num_query_heads=4, num_key_value_heads=2,
                                                  softmax_scale=SCALE, dequant_scale_key=ks, dequant_scale_value=vs,
                                                  actual_seq_kvlen=[9, 4], return_softmax_lse=True)
    assert torch.equal(v1[0], v2[0]) and torch.equal(v1[1], v2[1])


def test_v2_prefill_with_int8_output_and_mask():
    g = gen(31)
    q, k, v = make_qkv("BNSD", g, b=2, n=2, sq=5, skv=7, d=32, dtype=torch.bfloat16)
    mask = cann_attn.compressed_mask(3)
    out, _ = cann_attn.fused_infer_attention_score_v2(q, k, v, num_query_heads=2, softmax_scale=SCALE,
                                                      input_layout="BNSD", sparse_mode=3, atten_mask=mask,
                                                      quant_scale_out=torch.tensor([25.0]))
    golden, _ = fia_oracle(q, k, v, num_heads=2, scale=SCALE, input_layout="BNSD", sparse_mode=3, atten_mask=mask,
                           quant_scale2=torch.tensor([25.0]))
    compare(out, golden, torch.int8)


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
def test_incre_flash_attention_is_fia_decode(layout):
    g = gen(32)
    q, k, v = make_qkv(layout, g, b=3, n=4, nkv=1, sq=1, skv=10, dtype=torch.float16)
    mask = torch.rand(3, 10, generator=g) < 0.3
    out = cann_attn.incre_flash_attention(q, k, v, num_heads=4, num_key_value_heads=1, scale_value=SCALE,
                                          input_layout=layout, actual_seq_lengths=[10, 2, 6], atten_mask=mask)
    golden, _ = fia_oracle(q, k, v, num_heads=4, num_key_value_heads=1, scale=SCALE, input_layout=layout,
                           actual_seq_lengths_kv=[10, 2, 6], atten_mask=mask)
    compare(out, golden, torch.float16)


def test_incre_flash_attention_antiquant_and_kv_padding():
    g = gen(33)
    q, k, v = make_qkv("BNSD", g, b=2, n=2, sq=1, skv=8, dtype=torch.float16, kv_dtype=torch.int8)
    sc = _antiquant_factor((2, 2, 1, 16), g, torch.float16)
    off = torch.randn(2, 2, 1, 16, generator=g).to(torch.float16)
    out = cann_attn.incre_flash_attention(q, k, v, num_heads=2, scale_value=SCALE, input_layout="BNSD",
                                          antiquant_scale=sc, antiquant_offset=off, actual_seq_lengths=[5, 3],
                                          kv_padding_size=torch.tensor([1]))
    golden, _ = fia_oracle(q, k, v, num_heads=2, scale=SCALE, input_layout="BNSD", antiquant_scale=sc,
                           antiquant_offset=off, actual_seq_lengths_kv=[5, 3], kv_padding_size=torch.tensor([1]))
    compare(out, golden, torch.float16)


# ------------------------------------------------------------------------------------------------- empty inputs
def test_empty_query_and_empty_keys():
    q, k, v = make_qkv("BNSD", gen(34), b=2, n=2, sq=3, skv=0)
    out, lse = check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, softmax_lse_flag=True)
    assert (out == 0).all() and torch.isposinf(lse).all()
    q0 = torch.empty(0, 2, 3, 16)
    out, lse = cann_attn.fused_infer_attention_score(q0, q0, q0, num_heads=2, input_layout="BNSD",
                                                     softmax_lse_flag=True)
    assert out.shape == (0, 2, 3, 16) and lse.shape == (0, 2, 3, 1)


# ------------------------------------------------------------------------------------------- Triton (interpreter)
@pytest.mark.skipif("not __import__('os').environ.get('TRITON_INTERPRET')", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("sq", [1, 7])
def test_triton_float_paths(sq):
    g = gen(35)
    q, k, v = make_qkv("BSH", g, b=2, n=4, nkv=2, sq=sq, skv=12, dtype=torch.float16)
    mask = cann_attn.compressed_mask(3)
    before = cann_attn.backends.dispatch_counts[("fused_infer_attention_score", "triton")]
    check_fia(q, k, v, num_heads=4, num_key_value_heads=2, scale=SCALE, softmax_lse_flag=True, backend="triton",
              actual_seq_lengths_kv=[12, 5], atten_mask=mask if sq > 1 else None, sparse_mode=3 if sq > 1 else 0)
    assert cann_attn.backends.dispatch_counts[("fused_infer_attention_score", "triton")] > before


# ------------------------------------------------------------------------------------- native decode loop (CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_decode_loop_reads_caches_in_place(dtype, layout, monkeypatch):
    """Decode without mask or pse takes the native loop (caches read in their dtype, strided BSH views included)
    where it is available; either way the result is the oracle's, lengths of 0 included."""
    from cann_attn.backends.reference import decode_forward, native

    calls = []
    original = decode_forward.forward
    monkeypatch.setattr(decode_forward, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    q, k, v = make_qkv(layout, gen(40), b=3, n=8, nkv=2, sq=1, skv=150, d=40, dtype=dtype)
    check_fia(q, k, v, num_heads=8, num_key_value_heads=2, input_layout=layout, scale=SCALE, softmax_lse_flag=True,
              actual_seq_lengths_kv=[150, 0, 67], backend="reference")
    kb = k if layout == "BNSD" else k.view(3, 150, 2, 40).permute(0, 2, 1, 3)
    assert bool(calls) == native.decode_usable(kb, kb)
