"""FIA v2 quantised calls (docs/operators/fused_infer_attention_score.md, "Quantised queries and fp8 caches"):
the int8 MLA query (query_quant_mode 3, per token and head) over the int8 latent with per-tensor scales, rope parts
unscaled; and float8_e4m3fn / int8 paged caches with per-token scales (key/value_quant_mode 4).

The calls are built the way production builds them:

* int8 MLA query: cann-recipes-infer models/deepseek_r1/models/modeling_deepseek.py:1301-1319
  (``dequant_scale_q_nope.view(num_tokens, -1)``, ``dequant_scale_key=self.ckv_scale`` a float32 [1] (:969),
  ``input_layout="TND_NTD"``, ``query_quant_mode=3, key_quant_mode=0, value_quant_mode=0``, k_nope passed as key
  and value over NZ views (:1290-1293)); vllm-ascend vllm_ascend/attention/mla_v1.py:1440 (TND_NTD,
  ``view(num_tokens, num_heads)``), :1452 (BNSD, ``view(num_tokens, num_heads, 1)``), :1461 (BSND_NBSD,
  ``view(num_tokens, 1, num_heads)``) and :1501-1508 (the quant arguments);
* fp8 caches: cann-recipes-infer models/qwen3_moe/models/modeling_qwen3_moe.py:684-705 (per-token
  ``npu_dynamic_quant`` of each token's H values to float8_e4m3fn, one float32 scale per cache slot) and :806-822
  (TND decode over [blockNum, blockSize, H] caches, ``dequant_scale_key=key_scale.squeeze()`` [blockNum, blockSize],
  ``key_quant_mode=4, value_quant_mode=4``).

Oracle: cann_attn.testing.fia_quant_oracle (float64, value times scale, from op-plugin's page).
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError, ParamNullptrError
from cann_attn.backends.reference import native
from cann_attn.ops import fused_infer_attention_score as fia_module
from cann_attn.problem.antiquant import PagedLatent
from cann_attn.problem.nz import to_nz
from cann_attn.testing.fia_oracle import fia_oracle
from cann_attn.testing.fia_quant_oracle import dequantised_values, int8_mla_oracle
from fia_cases import compare, rand
from paged_utils import int8_mla_pages, paginate

# Tests of how the native decode loop reads the caches (in place, no float32 copy): without the loops the calls take
# the converted pool, by design.
needs_native = pytest.mark.skipif(native.library() is None, reason="needs the native loops")

pytestmark = pytest.mark.usefixtures("single_thread")

LATENT, ROPE, PAGE = 512, 64, 16
LENGTHS, HEADS = [40, 17, 33], 4


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("CANN_ATTN_BACKEND", "reference")


def _query(layout: str, heads: int, dim: int, dtype, gen) -> torch.Tensor:
    """One decode token per sequence in `layout`: [T, N, D], [B, 1, N, D] or [B, N, 1, D]."""
    b = len(LENGTHS)
    if layout.startswith("TND"):
        return rand((b, heads, dim), dtype, gen)
    q = rand((b, 1, heads, dim), dtype, gen)
    if layout.startswith("BSH"):
        return q.flatten(2)
    return q.transpose(1, 2).contiguous() if layout.startswith("BNSD") else q


def _int8_mla(layout: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    latent, rope, nd, table = int8_mla_pages(LENGTHS, LATENT, ROPE, PAGE, g)
    query, query_rope = _query(layout, HEADS, LATENT, torch.int8, g), _query(layout, HEADS, ROPE, torch.bfloat16, g)
    scale_shape = (*query.shape[:-1], HEADS) if layout.startswith("BSH") else query.shape[:-1]
    scale_q = torch.rand(scale_shape, generator=g) * 0.01 + 0.001
    scale_kv = torch.tensor([0.02])
    # MlaProlog hands the rope over divided by the scales it is multiplied with here, so that its product weighs in
    # the scores like the int8 one: N(0, 4000^2) gives it ~1/4 of their spread and stays finite in fp16 (N(0, 1), it
    # would be ~1e-4 of it and no test could see the rope).
    query_rope = (query_rope.float() * 4000).to(torch.bfloat16)
    return latent, rope, nd, table, query, query_rope, scale_q, scale_kv


def _contiguous(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout.startswith("TND"):
        return torch.cat([t[b, :n] for b, n in enumerate(LENGTHS)])
    if layout.startswith("BSH"):
        return t.flatten(2)
    return t.transpose(1, 2).contiguous() if layout.startswith("BNSD") else t


@pytest.mark.parametrize("layout", ["TND_NTD", "BSND_NBSD", "BNSD", "BSND", "BSH"])
def test_int8_mla_query_paged_nd_nz_contiguous_and_oracle(layout):
    latent, rope, nd, table, query, query_rope, scale_q, scale_kv = _int8_mla(layout, len(layout))
    packed = layout.startswith("TND")
    common = dict(query_rope=query_rope, dequant_scale_query=scale_q, dequant_scale_key=scale_kv,
                  dequant_scale_value=scale_kv, query_quant_mode=3, key_quant_mode=0, value_quant_mode=0,
                  num_query_heads=HEADS, num_key_value_heads=1, input_layout=layout, softmax_scale=0.05)
    if packed:
        common["actual_seq_qlen"] = list(range(1, len(LENGTHS) + 1))
    paged = dict(block_table=table, block_size=PAGE, actual_seq_kvlen=LENGTHS)
    blocks = nd["k"].shape[0]
    k_nd, r_nd = nd["k"].view(blocks, PAGE, LATENT), nd["r"].view(blocks, PAGE, ROPE)
    over_nd, _ = cann_attn.fused_infer_attention_score_v2(query, k_nd, k_nd, key_rope=r_nd, **common, **paged)
    over_nz, _ = cann_attn.fused_infer_attention_score_v2(query, to_nz(nd["k"]), to_nz(nd["k"]),
                                                          key_rope=to_nz(nd["r"]), **common, **paged)
    kv_lens = torch.tensor(LENGTHS).cumsum(0).tolist() if packed else LENGTHS
    k, r = _contiguous(latent, layout), _contiguous(rope, layout)
    contiguous, _ = cann_attn.fused_infer_attention_score_v2(query, k, k, key_rope=r, actual_seq_kvlen=kv_lens,
                                                             **common)
    assert torch.equal(over_nd, over_nz), "int8 NZ cache != int8 ND cache"
    assert torch.equal(over_nd, contiguous), "paged != contiguous"
    golden, _ = int8_mla_oracle(query, k, k, query_rope=query_rope, key_rope=r, dequant_scale_query=scale_q,
                                dequant_scale_key=scale_kv, dequant_scale_value=scale_kv, num_heads=HEADS,
                                scale=0.05, input_layout=layout, actual_seq_lengths=common.get("actual_seq_qlen"),
                                actual_seq_lengths_kv=kv_lens)
    compare(over_nd, golden, torch.bfloat16)


def test_int8_query_scale_is_per_token_and_head():
    """A planted scale on one (token, head) changes that row only, by the factor the page's rule gives."""
    _latent, _rope, nd, table, query, query_rope, scale_q, scale_kv = _int8_mla("TND_NTD", 3)
    blocks = nd["k"].shape[0]
    k, r = nd["k"].view(blocks, PAGE, LATENT), nd["r"].view(blocks, PAGE, ROPE)
    kw = dict(query_rope=query_rope, key_rope=r, dequant_scale_key=scale_kv, dequant_scale_value=scale_kv,
              query_quant_mode=3, num_query_heads=HEADS, num_key_value_heads=1, input_layout="TND_NTD",
              softmax_scale=0.05, block_table=table, block_size=PAGE, actual_seq_kvlen=LENGTHS,
              actual_seq_qlen=[1, 2, 3])
    base, _ = cann_attn.fused_infer_attention_score_v2(query, k, k, dequant_scale_query=scale_q, **kw)
    planted = scale_q.clone()
    planted[1, 2] *= 4
    moved, _ = cann_attn.fused_infer_attention_score_v2(query, k, k, dequant_scale_query=planted, **kw)
    changed = (base != moved).any(-1)  # output [N, T, D]
    assert changed[2, 1] and int(changed.sum()) == 1


def _fp8_paged(seed: int, dtype=torch.float8_e4m3fn):
    """qwen3_moe's caches: each token's H values quantised with one float32 scale, [blockNum, blockSize, H]."""
    g = torch.Generator().manual_seed(seed)
    heads, heads_kv, dim = 4, 2, 64
    s = max(LENGTHS)
    k_f, v_f = (torch.randn(len(LENGTHS), s, heads_kv * dim, generator=g) for _ in range(2))
    k_scale, v_scale = (t.abs().amax(-1, keepdim=True) / (448 if dtype != torch.int8 else 127) for t in (k_f, v_f))
    k_q, v_q = ((t / sc).to(dtype) if dtype != torch.int8 else (t / sc).round().to(dtype)
                for t, sc in ((k_f, k_scale), (v_f, v_scale)))
    per_seq = {"k": [k_q[b, :n] for b, n in enumerate(LENGTHS)], "v": [v_q[b, :n] for b, n in enumerate(LENGTHS)],
               "ks": [k_scale[b, :n, 0] for b, n in enumerate(LENGTHS)],
               "vs": [v_scale[b, :n, 0] for b, n in enumerate(LENGTHS)]}
    caches, table = paginate(per_seq, PAGE, g)
    query = torch.randn(len(LENGTHS), heads, dim, generator=g).bfloat16()
    return caches, table, query, (k_q, v_q, k_scale, v_scale), (heads, heads_kv, dim)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_per_token_paged_scales_mode_4_oracle(kv_dtype):
    caches, table, query, (k_q, v_q, k_scale, v_scale), (heads, heads_kv, dim) = _fp8_paged(7, kv_dtype)
    call = dict(num_query_heads=heads, num_key_value_heads=heads_kv, softmax_scale=dim ** -0.5, input_layout="TND",
                actual_seq_qlen=[1, 2, 3], actual_seq_kvlen=LENGTHS, block_table=table, block_size=PAGE)
    out, _ = cann_attn.fused_infer_attention_score_v2(
        query, caches["k"], caches["v"], dequant_scale_key=caches["ks"], dequant_scale_value=caches["vs"],
        key_quant_mode=4, value_quant_mode=4, **call)
    # The stated rule: the same bf16 call over the caches dequantised (x * scale in fp32, rounded once).
    k_bf = (caches["k"].float() * caches["ks"].unsqueeze(-1)).bfloat16()
    v_bf = (caches["v"].float() * caches["vs"].unsqueeze(-1)).bfloat16()
    plain, _ = cann_attn.fused_infer_attention_score_v2(query, k_bf, v_bf, **call)
    assert torch.equal(out, plain)
    k64 = torch.cat([dequantised_values(k_q[b, :n], k_scale[b, :n]) for b, n in enumerate(LENGTHS)])
    v64 = torch.cat([dequantised_values(v_q[b, :n], v_scale[b, :n]) for b, n in enumerate(LENGTHS)])
    kv_ends = torch.tensor(LENGTHS).cumsum(0).tolist()
    golden, _ = fia_oracle(query, k64.view(-1, heads_kv, dim), v64.view(-1, heads_kv, dim), num_heads=heads,
                           num_key_value_heads=heads_kv, scale=dim ** -0.5, input_layout="TND",
                           actual_seq_lengths=[1, 2, 3], actual_seq_lengths_kv=kv_ends)
    compare(out, golden, torch.bfloat16)


def test_fp8_cache_is_beyond_docs_under_strict(monkeypatch):
    caches, table, query, _, (heads, heads_kv, _dim) = _fp8_paged(8)
    monkeypatch.setenv("CANN_ATTN_STRICT_DOCS", "1")
    with pytest.raises(ParamInvalidError, match=r"^\[\d+\] key: .*qwen3_moe"):
        cann_attn.fused_infer_attention_score_v2(
            query, caches["k"], caches["v"], dequant_scale_key=caches["ks"], dequant_scale_value=caches["vs"],
            key_quant_mode=4, value_quant_mode=4, num_query_heads=heads, num_key_value_heads=heads_kv,
            input_layout="TND", actual_seq_qlen=[1, 2, 3], actual_seq_kvlen=LENGTHS, block_table=table,
            block_size=PAGE)


def _int8_call(**change):
    _latent, _rope, nd, table, query, query_rope, scale_q, scale_kv = _int8_mla("TND_NTD", 11)
    blocks = nd["k"].shape[0]
    k = nd["k"].view(blocks, PAGE, LATENT)
    kw = dict(query=query, key=k, value=k, query_rope=query_rope, key_rope=nd["r"].view(blocks, PAGE, ROPE),
              dequant_scale_query=scale_q, dequant_scale_key=scale_kv, dequant_scale_value=scale_kv,
              query_quant_mode=3, num_query_heads=HEADS, num_key_value_heads=1, input_layout="TND_NTD",
              block_table=table, block_size=PAGE, actual_seq_kvlen=LENGTHS, actual_seq_qlen=[1, 2, 3])
    kw.update(change)
    return lambda: cann_attn.fused_infer_attention_score_v2(**kw)


INT8_BAD = {
    "dequant_scale_query shape": (dict(dequant_scale_query=torch.ones(3, HEADS, 1)), "dequant_scale_query"),
    "dequant_scale_query dtype": (dict(dequant_scale_query=torch.ones(3, HEADS, dtype=torch.bfloat16)),
                                  "dequant_scale_query"),
    "dequant_scale_key shape": (dict(dequant_scale_key=torch.ones(2)), "dequant_scale_key"),
    "dequant_scale_key dtype": (dict(dequant_scale_key=torch.ones(1, dtype=torch.float16)), "dequant_scale_key"),
    "dequant_scale_value shape": (dict(dequant_scale_value=torch.ones(1, LATENT)), "dequant_scale_value"),
    "query_quant_mode 6 (fa_quant.py)": (dict(query_quant_mode=6), "query_quant_mode"),
    "query_quant_mode 1": (dict(query_quant_mode=1), "query_quant_mode"),
    "key_quant_mode 3 with an int8 query": (dict(key_quant_mode=3, value_quant_mode=3), "key_quant_mode"),
    "quant_scale_p": (dict(quant_scale_p=torch.ones(1)), "quant_scale_p"),
    "dequant_offset_key": (dict(dequant_offset_key=torch.ones(1), dequant_offset_value=torch.ones(1)),
                           "dequant_offset_key"),
    "quant_scale_out": (dict(quant_scale_out=torch.ones(1)), "quant_scale_out"),
    "no rope": (dict(query_rope=None, key_rope=None), "query_rope"),
    "bf16 key": (dict(key=torch.zeros(8, PAGE, LATENT, dtype=torch.bfloat16)), "key"),
    "NZ key with an ND key_rope": (dict(key=to_nz(torch.zeros(8, PAGE, 1, LATENT, dtype=torch.int8))), "value"),
    "NZ key and value, ND key_rope": (dict(key=to_nz(torch.zeros(8, PAGE, 1, LATENT, dtype=torch.int8)),
                                           value=to_nz(torch.zeros(8, PAGE, 1, LATENT, dtype=torch.int8))),
                                      "key_rope"),
    "query D 128": (dict(query=torch.zeros(3, HEADS, 128, dtype=torch.int8)), "query"),
    "BSH heads 0": (dict(query=torch.zeros(3, 1, HEADS * LATENT, dtype=torch.int8), input_layout="BSH",
                         num_query_heads=0), "num_query_heads"),
    "query_dtype fp8 (fa_quant.py)": (dict(query_dtype=torch.float8_e4m3fn), "query_dtype"),
    "dequant_scale_query_dtype int code": (dict(dequant_scale_query_dtype=15), "dequant_scale_query_dtype"),
    "key_shared_prefix_dtype": (dict(key_shared_prefix_dtype=1), "key_shared_prefix_dtype"),
}


def test_int8_query_without_scale_and_mode_without_int8_query():
    with pytest.raises(ParamNullptrError, match=r"^\[\d+\] dequant_scale_query\b"):
        _int8_call(dequant_scale_query=None)()
    with pytest.raises(ParamInvalidError, match=r"^\[\d+\] query_quant_mode\b"):
        _int8_call(query=torch.zeros(3, HEADS, LATENT, dtype=torch.bfloat16))()
    with pytest.raises(ParamInvalidError, match=r"^\[\d+\] query_quant_mode\b"):
        _int8_call(query_quant_mode=0)()
    with pytest.raises(ParamInvalidError, match=r"^\[\d+\] dequant_scale_query\b"):
        _int8_call(query=torch.zeros(3, HEADS, LATENT, dtype=torch.bfloat16), query_quant_mode=0)()


def test_dtype_codes_restating_the_tensors_are_accepted():
    """query_dtype etc. as the tensor's own dtype (torch.dtype or its ScalarType number): the same result."""
    base, _ = _int8_call()()
    same, _ = _int8_call(query_dtype=torch.int8, key_dtype=1, dequant_scale_query_dtype=torch.float32,
                         query_rope_dtype=15)()
    assert torch.equal(base, same)


def test_fa_quant_mxfp8_call_is_refused_naming_the_mode():
    """cann-recipes-infer module/fa_quant/fa_quant.py:76-100: float8 q/k/v, query/key_quant_mode 6, value 8,
    query_dtype=torch.float8_e4m3fn: undocumented on the page, refused naming query_quant_mode (no dispatcher
    error)."""
    q = torch.zeros(4, 2, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ParamInvalidError, match=r"^\[\d+\] query_quant_mode\b"):
        cann_attn.fused_infer_attention_score_v2(
            q, q, q, dequant_scale_query=torch.ones(4, 2, 2), dequant_scale_key=torch.ones(4, 2, 2),
            dequant_scale_value=torch.ones(4, 2, 2), num_query_heads=2, num_key_value_heads=2, input_layout="TND",
            actual_seq_qlen=[4], actual_seq_kvlen=[4], query_quant_mode=6, key_quant_mode=6, value_quant_mode=8,
            query_dtype=torch.float8_e4m3fn, key_dtype=torch.float8_e4m3fn, value_dtype=torch.float8_e4m3fn)


def _mode4_call(**change):
    caches, table, query, _, (heads, heads_kv, _dim) = _fp8_paged(9)
    kw = dict(query=query, key=caches["k"], value=caches["v"], dequant_scale_key=caches["ks"],
              dequant_scale_value=caches["vs"], key_quant_mode=4, value_quant_mode=4, num_query_heads=heads,
              num_key_value_heads=heads_kv, input_layout="TND", actual_seq_qlen=[1, 2, 3],
              actual_seq_kvlen=LENGTHS, block_table=table, block_size=PAGE)
    kw.update(change)
    return lambda: cann_attn.fused_infer_attention_score_v2(**kw)


MODE4_BAD = {
    "dequant_scale_key shape": (dict(dequant_scale_key=torch.ones(3, PAGE)), "dequant_scale_key"),
    "dequant_scale_value dtype": (dict(dequant_scale_value=torch.ones(10, PAGE, dtype=torch.bfloat16)),
                                  "dequant_scale_value"),
    "mode 5": (dict(key_quant_mode=5, value_quant_mode=5), "key_quant_mode"),
    "modes 4 and 0": (dict(value_quant_mode=0), "key_quant_mode"),
    "no block_table": (dict(block_table=None), "key_quant_mode"),
    "offset": (dict(dequant_offset_key=torch.ones(10, PAGE), dequant_offset_value=torch.ones(10, PAGE)),
               "dequant_offset_key"),
    "fp8 without mode 4": (dict(key_quant_mode=0, value_quant_mode=0), "key_quant_mode"),
    "key_quant_mode 6": (dict(key_quant_mode=6, value_quant_mode=6), "key_quant_mode"),
    "quant_scale_p": (dict(quant_scale_p=torch.ones(1)), "quant_scale_p"),
    "key_dtype another dtype": (dict(key_dtype=torch.int8), "key_dtype"),
}


BAD = {**{f"int8 query: {name}": (_int8_call, *case) for name, case in INT8_BAD.items()},
       **{f"mode 4: {name}": (_mode4_call, *case) for name, case in MODE4_BAD.items()}}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_parameter(name):
    """Scale tensors of the wrong shape or dtype name themselves, unsupported modes name the mode parameter."""
    call, change, param = BAD[name]
    with pytest.raises(ParamInvalidError, match=rf"^\[\d+\] {param}\b"):
        call(**change)()


@needs_native
@pytest.mark.parametrize("layout, q_per_seq", [("TND_NTD", 1), ("BSND_NBSD", 1), ("TND", 2)])
def test_key_rope_columns_of_one_pool_give_the_separate_caches_bits(layout, q_per_seq, monkeypatch):
    """bf16 MLA pages whose rope columns follow the latent's in one [blocks, blockSize, 512 + 64] pool (what the
    int8 query's dequantisation builds) give the bits of the same caches passed separately: one query token per
    sequence (TND included) is read in place through the table by the decode loop, no gather; more are gathered
    (the pool's rows whole, the value as their first 512 columns)."""
    g = torch.Generator().manual_seed(7)
    s = max(LENGTHS)
    rows = rand((len(LENGTHS), s, 1, LATENT + ROPE), torch.bfloat16, g)
    nd, table = paginate({"kr": [rows[b, :n] for b, n in enumerate(LENGTHS)]}, PAGE, g)
    pool = nd["kr"].view(-1, PAGE, LATENT + ROPE)
    packed = layout.startswith("TND")
    tokens = len(LENGTHS) * q_per_seq
    q_shape = (tokens, HEADS) if packed else (len(LENGTHS), 1, HEADS)
    query, query_rope = rand((*q_shape, LATENT), torch.bfloat16, g), rand((*q_shape, ROPE), torch.bfloat16, g)
    kw = dict(query_rope=query_rope, num_query_heads=HEADS, num_key_value_heads=1, input_layout=layout,
              softmax_scale=0.05, block_table=table, block_size=PAGE, actual_seq_kvlen=LENGTHS,
              return_softmax_lse=True)
    if packed:
        kw["actual_seq_qlen"] = [q_per_seq * (b + 1) for b in range(len(LENGTHS))]
    if q_per_seq > 1:
        kw |= dict(sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
    latent, rope = pool[..., :LATENT], pool[..., LATENT:]
    if q_per_seq == 1:
        def no_gather(*args, **kwargs):
            raise AssertionError("one query token per sequence over paged caches must be read in place")

        monkeypatch.setattr("cann_attn.ops.paged_infer.PagedKv.group_bnsd", no_gather)
    separate = cann_attn.fused_infer_attention_score_v2(query, latent.contiguous(), latent.contiguous(),
                                                        key_rope=rope.contiguous(), **kw)
    joined = cann_attn.fused_infer_attention_score_v2(query, latent, latent, key_rope=rope, **kw)
    for name, a, b in zip(("out", "lse"), separate, joined, strict=True):
        assert torch.equal(a, b), f"{name}: joined pool != separate caches"


@needs_native
@pytest.mark.parametrize("layout, nz, rope_dtype, value_scale", [
    ("TND_NTD", True, torch.bfloat16, None), ("BSND_NBSD", False, torch.bfloat16, None),
    ("TND_NTD", False, torch.float16, 0.05), ("BSND_NBSD", True, torch.bfloat16, 2e36)])
def test_int8_mla_decode_reads_the_int8_pages_in_place(layout, nz, rope_dtype, value_scale, monkeypatch):
    """One query token per sequence over the paged int8 latent: the decode loop reads the int8 pages (and the
    unscaled rope pages) in place, converting no block to float32 first, its scores from the int8 query rows (exact
    integer dot products), the same bits (out and lse) on one thread and two, close to the converted float32 pool's.
    A value of its own (value_scale) included, and values near FLT_MAX (2e36 * 127 per element), whose P V sums
    overflow and are computed again with scaled values."""
    _latent, _rope, nd, table, query, query_rope, scale_q, scale_kv = _int8_mla(layout, 11)
    query_rope = query_rope.to(rope_dtype)
    blocks = nd["k"].shape[0]
    key, rope = nd["k"].view(blocks, PAGE, LATENT), nd["r"].view(blocks, PAGE, ROPE).to(rope_dtype)
    value, scale_v = key, scale_kv
    if value_scale is not None:
        value = rand(key.shape, torch.int8, torch.Generator().manual_seed(5))
        scale_v = torch.tensor([value_scale])
    if nz:
        key, value, rope = (to_nz(t.unsqueeze(2)) for t in (key, value, rope))
    kw = dict(query_rope=query_rope, key_rope=rope, dequant_scale_query=scale_q, dequant_scale_key=scale_kv,
              dequant_scale_value=scale_v, query_quant_mode=3, num_query_heads=HEADS, num_key_value_heads=1,
              input_layout=layout, softmax_scale=0.05, block_table=table, block_size=PAGE,
              actual_seq_kvlen=LENGTHS, return_softmax_lse=True)
    if layout.startswith("TND"):
        kw["actual_seq_qlen"] = list(range(1, len(LENGTHS) + 1))

    def call(threads: int):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return cann_attn.fused_infer_attention_score_v2(query, key, value, **kw)
        finally:
            torch.set_num_threads(previous)

    with monkeypatch.context() as patch:
        patch.setattr(fia_module, "_attend_int8_latent", lambda *args, **kwargs: False)
        converted = call(1)
    assert torch.isfinite(converted[0]).all()

    def no_conversion(self):
        raise AssertionError("the int8 pages were converted to float32 before the decode loop")

    monkeypatch.setattr(PagedLatent, "convert", no_conversion)
    in_place = call(1)
    for name, a, b in zip(("out", "lse"), in_place, call(2), strict=True):
        assert torch.equal(a, b), f"{name}: 1 thread != 2 threads"
    compare(in_place[0], converted[0], converted[0].dtype)
    torch.testing.assert_close(in_place[1], converted[1], rtol=1e-5, atol=1e-5)
