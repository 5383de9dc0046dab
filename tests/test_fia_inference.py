"""FusedInferAttentionScore calls of current inference code (docs/operators/fused_infer_attention_score.md), each
against the float64 oracle (cann_attn.testing.fia_oracle): block_size without a block table, v2's learnable_sink
and out_dtype, int4 key/value packed in int32, int8 paged caches (plain and NZ) with anti-quantisation in decode,
the invalid-row softmax_lse values, the decode per-channel factor shapes with a leading 1, prefill separate
anti-quantisation with a bfloat16 query, v2 MHA TND with D = 64; and bad input for each new parameter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cann_attn
from cann_attn import ParamInvalidError
from cann_attn.ops.fia_problem import DECODE_EMPTY_BATCH_LSE
from cann_attn.problem.antiquant import unpack_int4
from cann_attn.testing.fia_oracle import fia_oracle
from fia_cases import check_fia, check_lse, compare, make_qkv, rand, to_layout, v2_arguments
from matrix_sample import fuzz_examples
from paged_utils import paginate
from patience import HANG_SECONDS

SCALE = 0.125


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def factors(shape, g, dtype) -> torch.Tensor:
    """Anti-quantisation scales in [0.01, 0.03]: int8 keys of std ~70 become O(1) values."""
    return (0.01 + 0.02 * torch.rand(shape, generator=g)).to(dtype)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values in [-8, 7], last dim a multiple of 8, packed eight to an int32: value j in bits 4j..4j+3
    (op-plugin's npu_convert_weight_to_int4pack order)."""
    nibbles = (values.to(torch.int64) & 0xF).reshape(*values.shape[:-1], -1, 8)
    word = sum(nibbles[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def tnd(x: torch.Tensor) -> torch.Tensor:
    """[1, N, T, D] -> [T, N, D]."""
    return x[0].permute(1, 0, 2).contiguous()


# ----------------------------------------------------------------------------------------------- block_size alone
def test_block_size_without_block_table_is_ignored():
    """vLLM's PrefillNoCache: TND causal prefill passing its cache block size but no block table."""
    g = gen(1)
    q, k, v = (tnd(rand((1, 4, 40, 128), torch.float16, g)) for _ in range(3))
    kw = dict(num_heads=4, input_layout="TND", scale=SCALE, sparse_mode=3, atten_mask=cann_attn.compressed_mask(3),
              actual_seq_lengths=[16, 40], actual_seq_lengths_kv=[16, 40])
    out, _ = check_fia(q, k, v, **kw)
    with_block_size, _ = cann_attn.fused_infer_attention_score(q, k, v, block_size=128, **kw)
    assert torch.equal(out, with_block_size)


# --------------------------------------------------------------------------------------------------- learnable_sink
@pytest.mark.parametrize("layout", ["TND", "NTD_TND"])
@pytest.mark.parametrize("mode", [3, 4])
def test_learnable_sink_gpt_oss_prefill(layout, mode):
    """gpt-oss prefill (cann-recipes-infer, vllm-ascend): TND, causal (3) or sliding window (4, pre_tokens =
    window, next_tokens = 0), bfloat16 sinks, GQA."""
    g = gen(2 + mode)
    n, nkv, t, d = 4, 2, 37, 64
    q = rand((1, n, t, d), torch.bfloat16, g)
    k, v = rand((1, nkv, t, d), torch.bfloat16, g), rand((1, nkv, t, d), torch.bfloat16, g)
    if layout == "NTD_TND":
        q, k, v = (x[0].contiguous() for x in (q, k, v))
    else:
        q, k, v = tnd(q), tnd(k), tnd(v)
    sink = torch.randn(n, generator=g).to(torch.bfloat16)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout, scale=SCALE, sparse_mode=mode,
              atten_mask=cann_attn.compressed_mask(mode), actual_seq_lengths=[20, 37], actual_seq_lengths_kv=[20, 37],
              learnable_sink=sink, softmax_lse_flag=True)
    if mode == 4:
        kw.update(pre_tokens=8, next_tokens=0)
    out, _ = check_fia(q, k, v, **kw)
    plain, _ = cann_attn.fused_infer_attention_score(q, k, v, **{n_: x for n_, x in kw.items()
                                                                 if n_ != "learnable_sink"})
    assert not torch.equal(out, plain)  # the sink takes part


def test_learnable_sink_rows_without_keys_get_the_sink():
    """A sequence without keys: output 0, lse = the sink (its only softmax column); mode 2 hides nothing else."""
    g = gen(4)
    q = tnd(rand((1, 2, 6, 128), torch.bfloat16, g))
    k, v = (tnd(rand((1, 2, 3, 128), torch.bfloat16, g)) for _ in range(2))
    sink = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    out, lse = check_fia(q, k, v, num_heads=2, input_layout="TND", scale=SCALE, actual_seq_lengths=[3, 6],
                         actual_seq_lengths_kv=[3, 3], learnable_sink=sink, softmax_lse_flag=True)
    assert (out[3:] == 0).all() and torch.equal(lse[3:, :, 0], sink.float().expand(3, 2))


# ----------------------------------------------------------------------------------------------------------- int4
def test_unpack_int4_order_and_sign():
    words = torch.tensor([0x76543210, 0x11111111, -0x76543211], dtype=torch.int32)  # the last: 0x89ABCDEF
    assert unpack_int4(words).tolist() == [0, 1, 2, 3, 4, 5, 6, 7] + [1] * 8 + [-1, -2, -3, -4, -5, -6, -7, -8]
    values = torch.randint(-8, 8, (3, 64), generator=gen(5), dtype=torch.int64).to(torch.int8)
    assert torch.equal(unpack_int4(pack_int4(values)), values)


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_int4_key_value_decode_v1_and_v2(layout):
    """op-plugin's FIA tests: int4 key/value in int32 [B, N, S, D/8] with separate per-channel scales (1, H)."""
    g = gen(6)
    b, n, nkv, s, d = 2, 4, 2, 21, 64
    q = to_layout(rand((b, n, 1, d), torch.float16, g), layout)
    k4, v4 = (torch.randint(-8, 8, (b, nkv, s, d), generator=g).to(torch.int8) for _ in range(2))
    k, v = (pack_int4(to_layout(x, layout)) for x in (k4, v4))
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout, scale=SCALE, softmax_lse_flag=True,
              key_antiquant_scale=factors((1, nkv * d), g, torch.float16),
              value_antiquant_scale=factors((1, nkv * d), g, torch.float16), actual_seq_lengths_kv=[21, 9])
    out, lse = check_fia(q, k, v, **kw)
    unpacked, _ = cann_attn.fused_infer_attention_score(q, to_layout(k4, layout), to_layout(v4, layout), **kw)
    assert torch.equal(out, unpacked)
    out2, lse2 = cann_attn.fused_infer_attention_score_v2(q, k, v, **v2_arguments(kw))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_int4_prefill_combined_antiquant():
    g = gen(7)
    q = rand((1, 2, 5, 64), torch.float16, g)
    k4, v4 = (torch.randint(-8, 8, (1, 2, 9, 64), generator=g).to(torch.int8) for _ in range(2))
    check_fia(q, pack_int4(k4), pack_int4(v4), num_heads=2, input_layout="BNSD", scale=SCALE,
              antiquant_scale=factors((2, 2, 1, 64), g, torch.float16), antiquant_offset=factors((2, 2, 1, 64), g,
                                                                                                   torch.float16))


# ------------------------------------------------------------------------------------------------------ out_dtype
@pytest.mark.parametrize("spelling", ["dtype", "number"])
def test_out_dtype_given_as_a_dtype_or_its_number(spelling):
    g = gen(8)
    q, k, v = make_qkv("BNSD", g, b=1, n=2, sq=4, skv=6, dtype=torch.float16)
    scale_out = torch.tensor([20.0])
    out_dtype = torch.int8 if spelling == "dtype" else 1
    out, _ = cann_attn.fused_infer_attention_score_v2(q, k, v, num_query_heads=2, input_layout="BNSD",
                                                      softmax_scale=SCALE, quant_scale_out=scale_out,
                                                      out_dtype=out_dtype)
    golden, _ = fia_oracle(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, quant_scale2=scale_out)
    compare(out, golden, torch.int8)
    same, _ = cann_attn.fused_infer_attention_score_v2(q, k, v, num_query_heads=2, input_layout="BNSD",
                                                       softmax_scale=SCALE, out_dtype=torch.float16)
    compare(same, fia_oracle(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE)[0], torch.float16)


# ------------------------------------------------------------------------------------------ int8 paged caches
def _paged_int8(g, cache_layout: str, lengths, page, *, n=4, nkv=2, d=32, sq=1):
    """int8 key/value [B, N2, S, D] and their paged caches in `cache_layout` (BnBsH, BnNBsD or NZ)."""
    b, s = len(lengths), max(lengths) + 5
    k, v = (torch.randint(-127, 128, (b, nkv, s, d), generator=g).to(torch.int8) for _ in range(2))
    per_seq = {name: [t[i, :, : lengths[i]].permute(1, 0, 2) for i in range(b)] for name, t in (("k", k), ("v", v))}
    caches, table = paginate(per_seq, page, g)  # [block_num, page, N2, D]
    if cache_layout == "BnBsH":
        caches = {name: c.flatten(2) for name, c in caches.items()}
    elif cache_layout == "BnNBsD":
        caches = {name: c.permute(0, 2, 1, 3).contiguous() for name, c in caches.items()}
    else:  # NZ [block_num, N2, D/32, page, 32]
        caches = {name: c.unflatten(-1, (d // 32, 32)).permute(0, 2, 3, 1, 4).contiguous()
                  for name, c in caches.items()}
    return k, v, caches["k"], caches["v"], table


@pytest.mark.parametrize("cache_layout,layout", [("BnBsH", "BSH"), ("BnBsH", "BSND"), ("BnNBsD", "BNSD")])
@pytest.mark.parametrize("mode", [0, 1])
def test_int8_paged_decode_with_antiquant(cache_layout, layout, mode):
    g = gen(9 + mode)
    lengths, page, n, nkv, d = [50, 7, 33], 32, 4, 2, 32
    k, v, kc, vc, table = _paged_int8(g, cache_layout, lengths, page, n=n, nkv=nkv, d=d)
    q = to_layout(rand((3, n, 1, d), torch.bfloat16, g), layout)
    reach = table.shape[1] * page
    shape, dtype = ((nkv, 1, d), torch.bfloat16) if mode == 0 else ((3, reach), torch.float32)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout, scale=SCALE, actual_seq_lengths_kv=lengths,
              key_antiquant_scale=factors(shape, g, dtype), value_antiquant_scale=factors(shape, g, dtype),
              key_antiquant_mode=mode, value_antiquant_mode=mode, softmax_lse_flag=True)
    out, lse = cann_attn.fused_infer_attention_score(q, kc, vc, block_table=table, block_size=page, **kw)
    pad = reach - k.shape[2]
    k_full, v_full = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (k, v))
    golden, golden_lse = fia_oracle(q, to_layout(k_full, layout), to_layout(v_full, layout), **kw)
    compare(out, golden, torch.bfloat16)
    torch.testing.assert_close(lse.double(), golden_lse, atol=2e-3, rtol=2e-3)


def test_c8_decode_nz_cache_vllm_pattern():
    """vllm-ascend's C8 decode: BNSD bfloat16 query, NZ int8 caches [blocks, KV_N, D/32, block_size, 32],
    key/value_antiquant_scale (KV_N, 1, D) bfloat16, antiquant_mode 0, inner_precise 1, sparse_mode 0; one batch
    without keys (lse -3.40e38, the decode kernel's value)."""
    g = gen(11)
    lengths, page, n, nkv, d = [130, 0, 64, 3], 128, 8, 2, 128
    k, v, kc, vc, table = _paged_int8(g, "NZ", lengths, page, n=n, nkv=nkv, d=d)
    q = rand((4, n, 1, d), torch.bfloat16, g)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=SCALE, actual_seq_lengths_kv=lengths,
              key_antiquant_scale=factors((nkv, 1, d), g, torch.bfloat16),
              value_antiquant_scale=factors((nkv, 1, d), g, torch.bfloat16), antiquant_mode=0, key_antiquant_mode=0,
              value_antiquant_mode=0, inner_precise=1, sparse_mode=0, softmax_lse_flag=True)
    out, lse = cann_attn.fused_infer_attention_score(q, kc, vc, block_table=table, block_size=page, **kw)
    pad = table.shape[1] * page - k.shape[2]
    golden, golden_lse = fia_oracle(q, torch.nn.functional.pad(k, (0, 0, 0, pad)),
                                    torch.nn.functional.pad(v, (0, 0, 0, pad)),
                                    **{name: x for name, x in kw.items() if name != "inner_precise"})
    compare(out, golden, torch.bfloat16)
    assert (lse[1] == DECODE_EMPTY_BATCH_LSE).all() and (out[1] == 0).all()
    torch.testing.assert_close(lse.double(), golden_lse, atol=2e-3, rtol=2e-3)
    plain = _paged_int8(gen(11), "BnNBsD", lengths, page, n=n, nkv=nkv, d=d)
    out_plain, _ = cann_attn.fused_infer_attention_score(q, plain[2], plain[3], block_table=plain[4],
                                                         block_size=page, **kw)
    assert torch.equal(out, out_plain)  # the same keys in either cache layout


# ------------------------------------------------------------------------------ antiquant factor shapes, bf16 prefill
@pytest.mark.parametrize("shape", ["1,N,1,D", "1,N,D", "1,H"])
def test_decode_separate_per_channel_shapes_with_leading_one(shape):
    g = gen(12)
    n, nkv, d = 4, 2, 32
    q, k, v = make_qkv("BSND", g, b=2, n=n, nkv=nkv, sq=1, skv=11, d=d, dtype=torch.bfloat16, kv_dtype=torch.int8)
    dims = {"1,N,1,D": (1, nkv, 1, d), "1,N,D": (1, nkv, d), "1,H": (1, nkv * d)}[shape]
    check_fia(q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="BSND", scale=SCALE,
              key_antiquant_scale=factors(dims, g, torch.bfloat16), value_antiquant_scale=factors(dims, g,
                                                                                                  torch.bfloat16),
              actual_seq_lengths_kv=[11, 4], softmax_lse_flag=True)


@pytest.mark.parametrize("mode", [0, 1])
def test_prefill_separate_antiquant_bf16_query(mode):
    g = gen(13)
    q, k, v = make_qkv("BNSD", g, b=2, n=2, sq=16, skv=20, d=32, dtype=torch.bfloat16, kv_dtype=torch.int8)
    shape, dtype = ((2, 32), torch.bfloat16) if mode == 0 else ((2, 20), torch.float32)
    check_fia(q, k, v, num_heads=2, input_layout="BNSD", scale=SCALE, key_antiquant_scale=factors(shape, g, dtype),
              value_antiquant_scale=factors(shape, g, dtype), key_antiquant_mode=mode, value_antiquant_mode=mode,
              softmax_lse_flag=True)


def test_v2_mha_tnd_head_dim_64():
    g = gen(14)
    q, k, v = (tnd(rand((1, 4, 30, 64), torch.float16, g)) for _ in range(3))
    kw = dict(num_heads=4, input_layout="TND", scale=SCALE, sparse_mode=3, atten_mask=cann_attn.compressed_mask(3),
              actual_seq_lengths=[12, 30], actual_seq_lengths_kv=[12, 30], softmax_lse_flag=True)
    out, lse = check_fia(q, k, v, **kw)
    out2, lse2 = cann_attn.fused_infer_attention_score_v2(q, k, v, **v2_arguments(kw))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


# ------------------------------------------------------------------------------------------------------- bad input
def _tnd_call(**kw):
    q = torch.zeros(6, 2, 64, dtype=torch.bfloat16)
    args = dict(num_query_heads=2, input_layout="TND", actual_seq_qlen=[6], actual_seq_kvlen=[6]) | kw
    return lambda: cann_attn.fused_infer_attention_score_v2(q, q, q, **args)


def _dec_int8(**kw):
    q = torch.zeros(2, 2, 1, 32, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 8, 32, dtype=torch.int8)
    args = dict(num_heads=2, input_layout="BNSD") | kw
    return lambda: cann_attn.fused_infer_attention_score(q, k, k, **args)


BAD = {
    "sink dtype": (_tnd_call(learnable_sink=torch.zeros(2, dtype=torch.float16)), "learnable_sink"),
    "sink shape": (_tnd_call(learnable_sink=torch.zeros(3, dtype=torch.bfloat16)), "learnable_sink"),
    "sink not a tensor": (_tnd_call(learnable_sink=[0.0, 0.0]), "learnable_sink"),
    "sink layout": (lambda: cann_attn.fused_infer_attention_score_v2(
        torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), num_query_heads=2,
        input_layout="BNSD", learnable_sink=torch.zeros(2, dtype=torch.bfloat16)), "learnable_sink: supported"),
    "sink value D": (lambda: cann_attn.fused_infer_attention_score_v2(
        torch.zeros(6, 2, 192), torch.zeros(6, 2, 192), torch.zeros(6, 2, 192), num_query_heads=2,
        input_layout="TND", actual_seq_qlen=[6], actual_seq_kvlen=[6],
        learnable_sink=torch.zeros(2, dtype=torch.bfloat16)), "learnable_sink: needs value head dim"),
    "sink with int8 output": (_tnd_call(learnable_sink=torch.zeros(2, dtype=torch.bfloat16),
                                        quant_scale_out=torch.ones(1)), "quant_scale_out"),
    "out_dtype unknown number": (_tnd_call(out_dtype=99), "out_dtype"),
    "out_dtype not a dtype": (_tnd_call(out_dtype="bf16"), "out_dtype"),
    "out_dtype fp8 output": (_tnd_call(out_dtype=torch.float8_e5m2), "out_dtype"),
    "out_dtype float mismatch": (_tnd_call(out_dtype=torch.float16), "out_dtype: takes effect"),
    "decode scale shape": (_dec_int8(key_antiquant_scale=torch.ones(2, 1, 2, 32, dtype=torch.bfloat16),
                                     value_antiquant_scale=torch.ones(2, 1, 2, 32, dtype=torch.bfloat16)),
                           "key_antiquant_scale"),
    "prefill bf16 separate Q_S 17": (lambda: cann_attn.fused_infer_attention_score(
        torch.zeros(1, 2, 17, 32, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 32, dtype=torch.int8),
        torch.zeros(1, 2, 8, 32, dtype=torch.int8), num_heads=2, input_layout="BNSD",
        key_antiquant_scale=torch.ones(2, 32, dtype=torch.bfloat16),
        value_antiquant_scale=torch.ones(2, 32, dtype=torch.bfloat16)), "query: expected Q_S <= 16"),
    "prefill bf16 combined": (lambda: cann_attn.fused_infer_attention_score(
        torch.zeros(1, 2, 4, 32, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 32, dtype=torch.int8),
        torch.zeros(1, 2, 8, 32, dtype=torch.int8), num_heads=2, input_layout="BNSD",
        antiquant_scale=torch.ones(2, 2, 1, 32, dtype=torch.bfloat16)), "query"),
    "int4 with block_table": (lambda: cann_attn.fused_infer_attention_score(
        torch.zeros(1, 1, 2, 64, dtype=torch.float16), torch.zeros(4, 16, 16, dtype=torch.int32),
        torch.zeros(4, 16, 16, dtype=torch.int32), num_heads=2, input_layout="BSND",
        block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=16, actual_seq_lengths_kv=[3]),
        "block_table"),
    "int8 paged prefill": (lambda: cann_attn.fused_infer_attention_score(
        torch.zeros(1, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 128, 64, dtype=torch.int8),
        torch.zeros(2, 128, 64, dtype=torch.int8), num_heads=2, input_layout="BSH",
        block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=128, actual_seq_lengths_kv=[3],
        key_antiquant_scale=torch.ones(64, dtype=torch.bfloat16),
        value_antiquant_scale=torch.ones(64, dtype=torch.bfloat16)), "key: int8 key/value with PageAttention"),
    "NZ fp16 query": (lambda: cann_attn.fused_infer_attention_score(
        torch.zeros(1, 8, 1, 128, dtype=torch.float16), torch.zeros(2, 2, 4, 128, 32, dtype=torch.int8),
        torch.zeros(2, 2, 4, 128, 32, dtype=torch.int8), num_heads=8, num_key_value_heads=2, input_layout="BNSD",
        block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=128, actual_seq_lengths_kv=[3],
        key_antiquant_scale=torch.ones(2, 1, 128, dtype=torch.float16),
        value_antiquant_scale=torch.ones(2, 1, 128, dtype=torch.float16)), "query: expected bfloat16"),
    "NZ with offsets": (lambda: cann_attn.fused_infer_attention_score(
        torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16), torch.zeros(2, 2, 4, 128, 32, dtype=torch.int8),
        torch.zeros(2, 2, 4, 128, 32, dtype=torch.int8), num_heads=8, num_key_value_heads=2, input_layout="BNSD",
        block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=128, actual_seq_lengths_kv=[3],
        key_antiquant_scale=torch.ones(2, 1, 128, dtype=torch.bfloat16),
        value_antiquant_scale=torch.ones(2, 1, 128, dtype=torch.bfloat16),
        key_antiquant_offset=torch.ones(2, 1, 128, dtype=torch.bfloat16),
        value_antiquant_offset=torch.ones(2, 1, 128, dtype=torch.bfloat16)), "key_antiquant_offset"),
    "NZ float cache": (lambda: cann_attn.fused_infer_attention_score(
        torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16), torch.zeros(2, 2, 8, 128, 16, dtype=torch.bfloat16),
        torch.zeros(2, 2, 8, 128, 16, dtype=torch.bfloat16), num_heads=8, num_key_value_heads=2,
        input_layout="BNSD", block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=128,
        actual_seq_lengths_kv=[3]), "key: a torch.bfloat16 NZ cache"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_parameter(name):
    call, needle = BAD[name]
    with pytest.raises(ParamInvalidError) as info:
        call()
    assert needle in str(info.value), f"{name}: {info.value}"


# --------------------------------------------------------------------------------- quantised caches read in place
def test_int8_and_int4_decode_dequantise_as_they_read(monkeypatch):
    """On the reference backend with the native loops, int8 pages (plain and NZ) and contiguous int4 / int8 caches
    with per-channel factors are anti-quantised row by row in the decode loop: no dequantised copy of the pages
    and no unpacked copy of the int4 cache is made (benchmarks/bench_fia_quant.py measures the cost)."""
    from cann_attn.backends.reference import native
    from cann_attn.ops import fia_problem, paged_infer

    if native.library() is None:
        pytest.skip("native CPU loops unavailable")
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")

    def refuse(*args, **kwargs):
        raise AssertionError("a dequantised or unpacked copy of the cache was made")

    g = gen(15)
    n, nkv, d = 4, 2, 128
    scales = dict(key_antiquant_scale=factors((nkv, 1, d), g, torch.bfloat16),
                  value_antiquant_scale=factors((nkv, 1, d), g, torch.bfloat16))
    q = rand((2, n, 1, d), torch.bfloat16, g)
    expected = []
    for cache_layout in ("BnNBsD", "NZ"):
        _, _, kc, vc, table = _paged_int8(gen(16), cache_layout, [40, 9], 32, n=n, nkv=nkv, d=d)
        kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", actual_seq_lengths_kv=[40, 9],
                  block_table=table, block_size=32, **scales)
        expected.append(cann_attn.fused_infer_attention_score(q, kc, vc, **kw)[0])
        with monkeypatch.context() as m:
            m.setattr(paged_infer.PagedKv, "dequantized_blocks", refuse)
            m.setattr(paged_infer.PagedKv, "group_bnsd", refuse)
            assert torch.equal(cann_attn.fused_infer_attention_score(q, kc, vc, **kw)[0], expected[-1])
    # Bit for bit the bf16 cache of the anti-quantised values (x * scale in fp32, rounded once to bf16), read by
    # the same loop: the in-loop anti-quantisation is the rule, not an approximation of it.
    _, _, kc, vc, table = _paged_int8(gen(16), "BnNBsD", [40, 9], 32, n=n, nkv=nkv, d=d)
    as_bf16 = [(c.float() * s_.float().view(1, nkv, 1, d)).bfloat16()
               for c, s_ in ((kc, scales["key_antiquant_scale"]), (vc, scales["value_antiquant_scale"]))]
    plain = cann_attn.fused_infer_attention_score(q, *as_bf16, num_heads=n, num_key_value_heads=nkv,
                                                  input_layout="BNSD", actual_seq_lengths_kv=[40, 9],
                                                  block_table=table, block_size=32)[0]
    assert torch.equal(plain, expected[0])
    k4 = torch.randint(-8, 8, (2, nkv, 21, d), generator=g).to(torch.int8)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", **scales)
    with monkeypatch.context() as m:
        m.setattr(fia_problem.antiquants, "unpack_int4", refuse)
        out = cann_attn.fused_infer_attention_score(q, pack_int4(k4), pack_int4(k4), **kw)[0]
    assert torch.equal(out, cann_attn.fused_infer_attention_score(q, k4, k4, **kw)[0])


def test_torch_npu_spellings_and_torch_ops_npu_after_install():
    """The new parameters through cann_attn.torch_npu and through torch.ops.npu after install() (a subprocess:
    install() replaces the torch_npu module for the process): out_dtype as a torch.dtype, learnable_sink, int4
    key/value, an int8 paged cache, block_size without a table."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import torch
        import cann_attn
        import cann_attn.torch_npu
        cann_attn.torch_npu.install()
        import torch_npu
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 4, 16, generator=g).half()
        for fn in (torch_npu.npu_fused_infer_attention_score_v2, torch.ops.npu.npu_fused_infer_attention_score_v2):
            out, _ = fn(q, q, q, num_query_heads=2, input_layout="BNSD", quant_scale_out=torch.tensor([8.0]),
                        out_dtype=torch.int8)
            assert out.dtype == torch.int8
        t = torch.randn(12, 2, 64, generator=g).bfloat16()
        sink = torch.randn(2, generator=g).bfloat16()
        kw = dict(num_query_heads=2, input_layout="TND", actual_seq_qlen=[5, 12], actual_seq_kvlen=[5, 12],
                  sparse_mode=3, atten_mask=cann_attn.compressed_mask(3), learnable_sink=sink, block_size=128)
        a = torch_npu.npu_fused_infer_attention_score_v2(t, t, t, **kw)[0]
        b = torch.ops.npu.npu_fused_infer_attention_score_v2(t, t, t, **kw)[0]
        assert torch.equal(a, b)
        dq = torch.randn(2, 1, 2, 64, generator=g).half()
        packed = torch.randint(-2**31, 2**31 - 1, (2, 9, 2, 8), generator=g, dtype=torch.int64).to(torch.int32)
        scale = torch.full((1, 128), 0.05).half()
        kw = dict(num_heads=2, input_layout="BSND", key_antiquant_scale=scale, value_antiquant_scale=scale)
        a = torch_npu.npu_fused_infer_attention_score(dq, packed, packed, **kw)[0]
        b = torch.ops.npu.npu_fused_infer_attention_score(dq, packed, packed, **kw)[0]
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())
        cache = torch.randint(-100, 100, (3, 32, 128), generator=g).to(torch.int8)
        table = torch.tensor([[0, 2], [1, 0]], dtype=torch.int32)
        bq = torch.randn(2, 1, 128, generator=g).bfloat16()
        s = torch.full((2, 1, 64), 0.02).bfloat16()
        kw = dict(num_heads=2, input_layout="BSH", block_table=table, block_size=32, actual_seq_lengths_kv=[40, 7],
                  key_antiquant_scale=s, value_antiquant_scale=s, softmax_lse_flag=True)
        a = torch_npu.npu_incre_flash_attention(bq, cache, cache, num_heads=2, input_layout="BSH",
                                                block_table=table, block_size=32, actual_seq_lengths=[40, 7],
                                                antiquant_scale=torch.cat([s, s]).view(2, 2, 1, 64))
        b = torch.ops.npu.npu_fused_infer_attention_score(bq, cache, cache, **kw)[0]
        assert a.shape == b.shape == (2, 1, 128)
        print("OK")
    """)
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


@settings(max_examples=fuzz_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_quantised_decode_matches_the_oracle(data):
    """Fuzzed decode over int8 / int4 caches (contiguous, or paged BnBsH / BnNBsD), per-channel, per-tensor or
    per-head factors (the decode loop's in-place anti-quantisation) and per-token ones (the gathered path),
    against the float64 oracle on the contiguous values."""
    draw = data.draw
    g = gen(draw(st.integers(0, 10**6)))
    nkv = draw(st.sampled_from((1, 2)))
    n = nkv * draw(st.sampled_from((1, 2, 4)))
    d = draw(st.sampled_from((64, 128)))
    dtype = draw(st.sampled_from((torch.float16, torch.bfloat16)))
    lengths = draw(st.lists(st.integers(0, 70), min_size=1, max_size=3))
    storage = draw(st.sampled_from(("contiguous int8", "contiguous int4", "BnBsH", "BnNBsD")))
    mode = draw(st.sampled_from((0, 2) if storage == "contiguous int4" else (0, 1, 2)))
    b, s = len(lengths), max(lengths) + 2
    low = -8 if storage.endswith("int4") else -127
    k, v = (torch.randint(low, -low, (b, nkv, s, d), generator=g).to(torch.int8) for _ in range(2))
    q = rand((b, n, 1, d), dtype, g)
    page, caches, table = 32, None, None
    if not storage.startswith("contiguous"):
        per_seq = {name: [x[i, :, : lengths[i]].permute(1, 0, 2) for i in range(b)] for name, x in (("k", k),
                                                                                                  ("v", v))}
        caches, table = paginate(per_seq, page, g)
        if storage == "BnBsH":
            caches = {name: c.flatten(2) for name, c in caches.items()}
        else:
            caches = {name: c.permute(0, 2, 1, 3).contiguous() for name, c in caches.items()}
    reach = s if table is None else table.shape[1] * page  # the KV_S per-token factors cover
    shape, fdt = {0: ((nkv, 1, d), dtype), 1: ((b, reach), torch.float32), 2: ((nkv,), torch.float32)}[mode]
    if mode == 0 and draw(st.booleans()):
        shape = (1,)  # per-tensor
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=d**-0.5, softmax_lse_flag=True,
              actual_seq_lengths_kv=lengths, key_antiquant_scale=factors(shape, g, fdt),
              value_antiquant_scale=factors(shape, g, fdt), key_antiquant_mode=mode, value_antiquant_mode=mode)
    if storage.startswith("contiguous"):
        kk, vv = (pack_int4(x) for x in (k, v)) if storage.endswith("int4") else (k, v)
        out, lse = cann_attn.fused_infer_attention_score(q, kk, vv, **kw)
        golden, golden_lse = fia_oracle(q, kk, vv, **kw)
    else:
        out, lse = cann_attn.fused_infer_attention_score(q, caches["k"], caches["v"], block_table=table,
                                                         block_size=page, **kw)
        padded = [torch.nn.functional.pad(x, (0, 0, 0, max(reach - s, 0)))[:, :, :reach] for x in (k, v)]
        golden, golden_lse = fia_oracle(q, *padded, **kw)
    compare(out, golden, dtype)
    check_lse(lse, golden_lse)
