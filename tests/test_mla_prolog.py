"""MlaProlog (cann_attn.mla_prolog, torch_npu npu_mla_prolog / _v2 / _v3) against the independent float64 oracle
(docs/operators/mla_prolog.md): every cache mode callers use, [T, He] and [B, S, He] tokens, both scales and
epsilons, query_norm; the caches written only at their rows; NZ caches read back the way callers view them; the
custom op under torch.compile; every refusal naming its parameter with both caches untouched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.testing.mla_prolog_oracle import mla_prolog_oracle
from cann_attn.testing.precision import assert_close_to_oracle

pytestmark = pytest.mark.usefixtures("single_thread")

BF16, F64 = torch.bfloat16, torch.float64
WEIGHTS = ("token_x", "weight_dq", "weight_uq_qr", "weight_uk", "weight_dkv_kr", "rmsnorm_gamma_cq",
           "rmsnorm_gamma_ckv", "rope_sin", "rope_cos")


class PrologCase:
    """Inputs built as the callers build them: caches [block_num, block_size, 1, D] ("PA_*"), [B, S, 1, D]
    ("BSND") or [T, 1, D] ("TND"), cache_index = the tokens' slots (distinct, shuffled over the pool)."""

    def __init__(self, gen, *, dtype=BF16, lead=(5,), cache_mode="PA_BSND", hidden=48, q_latent=32, heads=2,
                 nope=16, rope=16, latent=32, blocks=3, block_size=16):
        self.cache_mode, self.dtype = cache_mode, dtype

        def draw(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(dtype)

        tokens = int(torch.Size(lead).numel())
        self.inputs = {
            "token_x": draw(*lead, hidden),
            "weight_dq": draw(hidden, q_latent, scale=hidden ** -0.5),
            "weight_uq_qr": draw(q_latent, heads * (nope + rope), scale=q_latent ** -0.5),
            "weight_uk": draw(heads, nope, latent, scale=nope ** -0.5),
            "weight_dkv_kr": draw(hidden, latent + rope, scale=hidden ** -0.5),
            "rmsnorm_gamma_cq": draw(q_latent) + 1,
            "rmsnorm_gamma_ckv": draw(latent) + 1,
            # cos / sin rows as a rotary embedding builds them: [c_0 .. c_{Dr/2-1}] twice, positions of the tokens
            **self._rotary(torch.randint(0, 4096, (tokens,), generator=gen), rope, lead, dtype),
        }
        if cache_mode in ("PA_BSND", "PA_NZ"):
            cache_lead = (blocks, block_size)
            # (a pool of 0 blocks is never written: any index will do)
            slots = torch.randperm(blocks * block_size, generator=gen)[:tokens] if blocks else torch.zeros(tokens)
            self.cache_index = slots.to(torch.int64).view(lead)
        else:
            cache_lead = lead
            self.cache_index = None
        self.kv_cache = draw(*cache_lead, 1, latent)
        self.kr_cache = draw(*cache_lead, 1, rope)

    @staticmethod
    def _rotary(positions, rope, lead, dtype):
        freq = 10000.0 ** (-torch.arange(rope // 2, dtype=F64) * 2 / rope)
        angle = positions.to(F64)[:, None] * freq
        angle = torch.cat([angle, angle], -1).view(*lead, rope)
        return {"rope_sin": angle.sin().to(dtype), "rope_cos": angle.cos().to(dtype)}

    def weights(self):
        return [self.inputs[n] for n in WEIGHTS]

    def run(self, **kw):
        kw = {"cache_index": self.cache_index, "cache_mode": self.cache_mode, **kw}
        return cann_attn.mla_prolog(*self.weights(), self.kv_cache, self.kr_cache, **kw)

    def oracle(self, kv_cache, kr_cache, **kw):
        return mla_prolog_oracle(*self.weights(), kv_cache, kr_cache, self.cache_index, cache_mode=self.cache_mode,
                                 **kw)


def naive(case: PrologCase, qc_qr_scale=1.0, kc_scale=1.0, eps_cq=1e-5, eps_ckv=1e-5, *, dtype=None,
          quantized=None, down_scales=None) -> dict:
    """The formulas in plain PyTorch in the input dtype (the "naive" side of the flash-attn precision rule) or in
    `dtype`: query, query_rope, query_norm and the latent / rope-key rows of every token. `quantized` = (int8 c^Q,
    its scales [T, 1], dequant_scale_w_uq_qr) replaces c^Q W^UQQR by the dequantised int8 product, `down_scales` =
    (dequant_scale_x, dequant_scale_w_dq, dequant_scale_w_dkv_kr) the down projections of an int8 token_x."""
    i = {k: v if v.dtype == torch.int8 else v.to(dtype or v.dtype) for k, v in case.inputs.items()}
    heads, nope, latent = i["weight_uk"].shape
    rope = i["rope_sin"].shape[-1]
    x = i["token_x"].reshape(-1, i["token_x"].shape[-1])
    cos, sin = i["rope_cos"].reshape(-1, 1, rope), i["rope_sin"].reshape(-1, 1, rope)

    def norm(v, gamma, eps):
        return gamma * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    def rotate(v):
        pairs = v.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return pairs * cos + torch.cat([-pairs[..., rope // 2 :], pairs[..., : rope // 2]], -1) * sin

    def down(name, index):
        if down_scales is None:
            return x @ i[name]
        product = (x.double() @ i[name].double()) * down_scales[0].double().reshape(-1, 1)
        return (product * down_scales[index].double().reshape(1, -1)).to(i["weight_uk"].dtype)

    c_q = qc_qr_scale * norm(down("weight_dq", 1), i["rmsnorm_gamma_cq"], eps_cq)
    if quantized is None:
        q = (c_q @ i["weight_uq_qr"]).view(-1, heads, nope + rope)
    else:
        values, scale, dequant = quantized
        product = values.reshape(-1, values.shape[-1]).double() @ i["weight_uq_qr"].double()
        q = (product * scale.double() * dequant.double()).to(c_q.dtype).view(-1, heads, nope + rope)
    kv = down("weight_dkv_kr", 2)
    lead = case.inputs["token_x"].shape[:-1]
    return {"query": torch.einsum("tnd,ndc->tnc", q[..., :nope], i["weight_uk"]).reshape(*lead, heads, latent),
            "query_rope": rotate(q[..., nope:]).reshape(*lead, heads, rope), "query_norm": c_q.reshape(*lead, -1),
            "kv_cache": kc_scale * norm(kv[:, :latent], i["rmsnorm_gamma_ckv"], eps_ckv),
            "kr_cache": rotate(kv[:, None, latent:])[:, 0]}


def token_rows(case: PrologCase, cache: torch.Tensor) -> torch.Tensor:
    """Every token's cache row [tokens, width], read the way the callers read their caches: row t of a BSND / TND
    cache, slot cache_index[t] of a PA_BSND pool, and through the [block_num, 1, width / 16, block_size, 16] view
    of a PA_NZ pool (width / 32 and 32 for an int8 pool)."""
    width = cache.shape[-1]
    if case.cache_index is None:
        return cache.reshape(-1, width)
    slots = case.cache_index.reshape(-1)
    if case.cache_mode == "PA_NZ":
        blocks, block_size = cache.shape[:2]
        c0 = 32 if cache.dtype == torch.int8 else 16  # 32 bytes a group (deepseek_r1's `16 * factor` view)
        view = cache.view(blocks, 1, width // c0, block_size, c0)
        return view[slots // block_size, 0, :, slots % block_size, :].flatten(1)
    return cache.reshape(-1, width)[slots]


def check_against_oracle(case: PrologCase, out, expected, kv_before, kr_before, *, query_norm=True, **scalars):
    """Outputs close to the float64 oracle (1e-12 for float64 inputs; for bf16 the Ascend rule, or the flash-attn
    rule against the naive bf16 computation), every token's cache row close to it too and every element no token
    writes bit for bit what it was."""
    plain = naive(case, **scalars) if case.dtype != F64 else {}
    pairs = [("query", out.query, expected.query), ("query_rope", out.query_rope, expected.query_rope)]
    if query_norm:
        pairs.append(("query_norm", out.query_norm, expected.query_norm))
    for cache, before, oracle_cache, written, name in (
            (case.kv_cache, kv_before, expected.kv_cache, expected.kv_written, "kv_cache"),
            (case.kr_cache, kr_before, expected.kr_cache, expected.kr_written, "kr_cache")):
        assert torch.equal(cache[~written], before[~written]), f"{name}: an element outside cache_index changed"
        pairs.append((name, token_rows(case, cache), token_rows(case, oracle_cache)))
    for name, actual, golden in pairs:
        assert actual.dtype == case.dtype, name
        if case.dtype == F64:
            torch.testing.assert_close(actual, golden, rtol=1e-12, atol=1e-12, msg=name)
        else:
            assert_close_to_oracle(actual, golden, plain[name].reshape(actual.shape), name=name)


@pytest.mark.parametrize("dtype", [F64, BF16])
@pytest.mark.parametrize(("cache_mode", "lead"), [
    ("PA_BSND", (5,)), ("PA_BSND", (2, 3)), ("PA_NZ", (5,)), ("PA_NZ", (3, 1)), ("BSND", (1, 6)), ("TND", (4,))])
def test_matches_the_oracle_and_writes_only_the_indexed_rows(cache_mode, lead, dtype):
    """Callers: cann-recipes-infer models/deepseek_v3_2_exp/models/modeling_deepseek.py:1475 (decode: [T, He]
    tokens, "PA_BSND", cache_index = slot_mapping.view(-1), query_norm_flag=True) and :1309 (prefill under context
    parallelism: cache_mode "BSND", token_x.view(1, token_num, -1)); models/deepseek_r1/models/modeling_deepseek.py
    :1251 ("PA_NZ", [T, He], cache_index = slot_mapping); models/kimi_k2_thinking/models/modeling_deepseek.py:1234;
    vllm-ascend vllm_ascend/device/device_op.py:1409 ([bsz, 1, He] tokens, cache_index [bsz, 1]) and
    vllm_ascend/attention/sfa_v1.py:1041."""
    case = PrologCase(torch.Generator().manual_seed(len(lead) * 7 + len(cache_mode)), dtype=dtype, lead=lead,
                      cache_mode=cache_mode)
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    out = case.run(query_norm_flag=True)
    expected = case.oracle(kv_before, kr_before)
    assert isinstance(out, cann_attn.MlaPrologResult) and cann_attn.MlaPrologResult._fields == (
        "query", "query_rope", "dequant_scale_q_nope", "query_norm", "dequant_scale_q_norm")
    assert out.query.shape == (*lead, 2, 32) and out.query_rope.shape == (*lead, 2, 16)
    assert out.query_norm.shape == (*lead, 32)
    assert out.dequant_scale_q_nope.shape == (0,) and out.dequant_scale_q_norm.shape == (0,)
    assert out.dequant_scale_q_nope.dtype == torch.float32
    check_against_oracle(case, out, expected, kv_before, kr_before)
    assert int(expected.kv_written.sum()) == out.query.shape[:-2].numel() * 32  # every token's row, nothing else


@settings(max_examples=12)
@given(tokens=st.integers(1, 6), heads=st.sampled_from([1, 2, 3]), nope=st.sampled_from([8, 16]),
       rope=st.sampled_from([16, 32]), latent=st.sampled_from([16, 48]), q_latent=st.integers(4, 24),
       hidden=st.integers(8, 40), blocks=st.integers(1, 3), block_size=st.sampled_from([16, 32]),
       cache_mode=st.sampled_from(["PA_BSND", "PA_NZ", "TND"]), batched=st.booleans(), seed=st.integers(0, 99))
def test_hypothesis_sizes_against_the_oracle(tokens, heads, nope, rope, latent, q_latent, hidden, blocks, block_size,
                                             cache_mode, batched, seed):
    """Any sizes (the page fixes DeepSeek's; the formulas do not depend on them), float64 to 1e-12."""
    slots = blocks * block_size
    assume(tokens <= slots)
    lead = (1, tokens) if batched and cache_mode != "TND" else (tokens,)
    case = PrologCase(torch.Generator().manual_seed(seed), dtype=F64, lead=lead, cache_mode=cache_mode,
                      hidden=hidden, q_latent=q_latent, heads=heads, nope=nope, rope=rope, latent=latent,
                      blocks=blocks, block_size=block_size)
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    out = case.run(query_norm_flag=True)
    check_against_oracle(case, out, case.oracle(kv_before, kr_before), kv_before, kr_before)


@pytest.mark.parametrize("cache_mode", ["PA_NZ", "PA_BSND"])
def test_scales_and_epsilons(cache_mode):
    """qc_qr_scale scales c^Q (query and query rope), kc_scale the cached latent, the epsilons their RmsNorm
    (longcat: models/longcat_flash/models/modeling_longcat_flash.py:951, "PA_NZ" with qc_qr_scale; longcat_flash_lite
    models/longcat_flash_lite/models/modeling_longcat_flash_lite.py:537, qc_qr_scale with kc_scale=1.0)."""
    case = PrologCase(torch.Generator().manual_seed(3), dtype=F64, cache_mode=cache_mode)
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    scalars = dict(qc_qr_scale=0.37, kc_scale=2.5)
    epsilons = dict(rmsnorm_epsilon_cq=0.3, rmsnorm_epsilon_ckv=0.05)
    out = case.run(**scalars, **epsilons)
    expected = case.oracle(kv_before, kr_before, eps_cq=0.3, eps_ckv=0.05, **scalars)
    check_against_oracle(case, out, expected, kv_before, kr_before, query_norm=False)
    bf16 = PrologCase(torch.Generator().manual_seed(3), cache_mode=cache_mode)
    kv_before, kr_before = bf16.kv_cache.clone(), bf16.kr_cache.clone()
    out = bf16.run(**scalars, **epsilons)
    expected = bf16.oracle(kv_before, kr_before, eps_cq=0.3, eps_ckv=0.05, **scalars)
    check_against_oracle(bf16, out, expected, kv_before, kr_before, query_norm=False, eps_cq=0.3, eps_ckv=0.05,
                         **scalars)
    assert out.query_norm.shape == (0,)  # query_norm_flag=False


def test_nz_cache_reads_back_through_the_callers_view():
    """deepseek_r1 reads the "PA_NZ" caches as nope_cache.view(block_num, 1, Hckv // 16, block_size, 16)
    (models/deepseek_r1/models/modeling_deepseek.py:1281): token t's channel c at [block, 0, c // 16, slot, c % 16]
    equals what "PA_BSND" writes at [block, slot, 0, c]."""
    gen = torch.Generator().manual_seed(5)
    nz = PrologCase(gen, cache_mode="PA_NZ")
    nd = PrologCase(torch.Generator().manual_seed(5), cache_mode="PA_BSND")
    out_nz, out_nd = nz.run(), nd.run()
    assert torch.equal(out_nz.query, out_nd.query) and torch.equal(out_nz.query_rope, out_nd.query_rope)
    for cache_nz, cache_nd in ((nz.kv_cache, nd.kv_cache), (nz.kr_cache, nd.kr_cache)):
        blocks, block_size, _, width = cache_nz.shape
        view = cache_nz.view(blocks, 1, width // 16, block_size, 16)
        slots = nz.cache_index.view(-1)
        written = view[slots // block_size, 0, :, slots % block_size, :].flatten(1)
        assert torch.equal(written, cache_nd.view(-1, width)[slots])


def test_weights_after_format_cast_equal_plain_weights():
    """Callers pass weight_dq / weight_uq_qr / weight_dkv_kr through npu_format_cast(w, 29) (op-plugin's example,
    vllm-ascend, every recipe): the logical tensor is unchanged, so the result is the plain weights' bit for bit."""
    plain = PrologCase(torch.Generator().manual_seed(8))
    nz = PrologCase(torch.Generator().manual_seed(8))
    for name in ("weight_dq", "weight_uq_qr", "weight_dkv_kr"):
        nz.inputs[name] = torch_npu.npu_format_cast(nz.inputs[name].contiguous(), 29)
        assert torch_npu.get_npu_format(nz.inputs[name]) == 29
    a, b = plain.run(), nz.run()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(plain.kv_cache, nz.kv_cache) and torch.equal(plain.kr_cache, nz.kr_cache)


def test_rope_pairs_interleaved_channels():
    """A mutant that rotates the halves (rotate_half without taking the pairs (x0, x1), (x2, x3), ...) differs
    from the oracle: the test above would catch it."""
    from cann_attn.problem import rope as rope_rule

    x = torch.randn(3, 8, dtype=F64)
    angle = torch.rand(3, 4, dtype=F64)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    ours = rope_rule.interleaved_rope(x, cos, sin)
    # pair i = (x_{2i}, x_{2i+1}) rotated by angle i, written at channels i and 4 + i
    even, odd = x[:, 0::2], x[:, 1::2]
    expected = torch.cat([even * angle.cos() - odd * angle.sin(), odd * angle.cos() + even * angle.sin()], -1)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-15)
    half_split = x * cos + torch.cat([-x[:, 4:], x[:, :4]], -1) * sin
    assert not torch.allclose(ours, half_split)


@pytest.mark.parametrize("cache_mode", ["PA_BSND", "PA_NZ"])
def test_padding_tokens_with_slot_minus_one_write_nothing(cache_mode, monkeypatch):
    """vllm-ascend vllm_ascend/attention/sfa_v1.py:1006 passes cache_index = slot_mapping, whose graph-mode padding
    tokens hold -1 (vllm_ascend/worker/model_runner_v1.py:2904): their queries are computed, nothing is written for
    them (docs/semantics/beyond-docs.md); under CANN_ATTN_STRICT_DOCS=1 refused naming cache_index."""
    monkeypatch.delenv("CANN_ATTN_STRICT_DOCS", raising=False)
    case = PrologCase(torch.Generator().manual_seed(17), dtype=F64, lead=(6,), cache_mode=cache_mode)
    case.cache_index[[1, 4]] = -1
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    out = case.run()
    expected = case.oracle(kv_before, kr_before)
    assert int(expected.kv_written.sum()) == 4 * 32
    assert torch.equal(case.kv_cache[~expected.kv_written], kv_before[~expected.kv_written])
    torch.testing.assert_close(case.kv_cache, expected.kv_cache, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(case.kr_cache, expected.kr_cache, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.query, expected.query, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("CANN_ATTN_STRICT_DOCS", "1")
    case.kv_cache.copy_(kv_before)
    with pytest.raises(cann_attn.ParamInvalidError, match=r"cache_index:.*CANN_ATTN_STRICT_DOCS"):
        case.run()
    assert torch.equal(case.kv_cache, kv_before)


def test_empty_token_batch_and_empty_pool():
    """T = 0: empty outputs and nothing written; BlockNum = 0 (Skv = 0): the queries are computed and nothing is
    written (op-plugin's page, "B、S、T、Skv值允许一个或多个取0")."""
    case = PrologCase(torch.Generator().manual_seed(9), lead=(0,))
    kv_before = case.kv_cache.clone()
    out = case.run(query_norm_flag=True)
    assert out.query.shape == (0, 2, 32) and out.query_norm.shape == (0, 32)
    assert torch.equal(case.kv_cache, kv_before)
    case = PrologCase(torch.Generator().manual_seed(9), blocks=0, dtype=F64)
    out = case.run()
    expected = case.oracle(case.kv_cache, case.kr_cache)
    torch.testing.assert_close(out.query, expected.query, rtol=1e-12, atol=1e-12)


def quantized_uq_qr(case: PrologCase, gen, smooth_shape) -> dict:
    """weight_quant_mode 1 inputs as the W8A8 recipes pass them: int8 weight_uq_qr with its per-column float32
    dequant scales [1, N (D + Dr)], optional smooth scales."""
    w = case.inputs["weight_uq_qr"]
    case.inputs["weight_uq_qr"] = torch.randint(-127, 128, w.shape, generator=gen, dtype=torch.int8)
    extra = {"dequant_scale_w_uq_qr": torch.rand(1, w.shape[1], generator=gen) / (127 * w.shape[0] ** 0.5),
             "weight_quant_mode": 1}
    if smooth_shape is not None:
        extra["smooth_scales_cq"] = 0.5 + torch.rand(*smooth_shape, generator=gen)
    return extra


@pytest.mark.parametrize("smooth_shape", [None, (1, 32), (1,)])
@pytest.mark.parametrize("dtype", [F64, BF16])
def test_weight_quant_mode_1(dtype, smooth_shape):
    """int8 weight_uq_qr: c^Q quantised per token (scale = max |c^Q * smooth| / 127), the int8 product dequantised
    by that scale and the column's dequant_scale_w_uq_qr; query_norm is the int8 c^Q and dequant_scale_q_norm its
    scale [T, 1]. Caller: cann-recipes-infer models/deepseek_v3_2_exp/models/modeling_deepseek.py:1475 (W8A8:
    weight_quant_mode=1, dequant_scale_w_uq_qr=q_b_proj.weight_scale.view(1, -1), query_norm_flag=True; the indexer
    takes dequant_q_norm as its per-token scale, :1497)."""
    gen = torch.Generator().manual_seed(21)
    case = PrologCase(gen, dtype=dtype, lead=(2, 3))
    quant = quantized_uq_qr(case, gen, smooth_shape)
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    out = case.run(query_norm_flag=True, **quant)
    expected = case.oracle(kv_before, kr_before, dequant_scale_w_uq_qr=quant["dequant_scale_w_uq_qr"],
                           smooth_scales_cq=quant.get("smooth_scales_cq"))
    assert out.query_norm.dtype == torch.int8 and out.query_norm.shape == (2, 3, 32)
    assert out.dequant_scale_q_norm.dtype == torch.float32 and out.dequant_scale_q_norm.shape == (6, 1)
    torch.testing.assert_close(out.dequant_scale_q_norm.double(), expected.query_norm_scale, rtol=1e-2 if
                               dtype == BF16 else 1e-6, atol=0)
    off = (out.query_norm.double() - expected.query_norm).abs()
    if dtype == F64:
        assert off.max() == 0
        torch.testing.assert_close(out.query, expected.query, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out.query_rope, expected.query_rope, rtol=1e-9, atol=1e-9)
    else:  # c^Q is bf16 before it is quantised: a value next to a rounding boundary may land one step away
        assert off.max() <= 1 and (off > 0).float().mean() < 0.25  # bf16 c^Q: 2^-9 relative, up to 0.25 step
        # past the quantisation: the float64 formulas from the int8 c^Q the call made (the naive side in bf16)
        given = (out.query_norm, out.dequant_scale_q_norm, quant["dequant_scale_w_uq_qr"])
        golden, plain = naive(case, dtype=F64, quantized=given), naive(case, quantized=given)
        for name in ("query", "query_rope"):
            assert_close_to_oracle(getattr(out, name), golden[name], plain[name], name=name)
    assert torch.equal(case.kv_cache[~expected.kv_written], kv_before[~expected.kv_written])


def quantized_inputs(case: PrologCase, gen) -> dict:
    """weight_quant_mode 2 inputs as the W8A8 recipes build them: token_x quantised per token (npu_dynamic_quant:
    int8 values, float32 scales [T, 1]), weight_dq / weight_uq_qr / weight_dkv_kr int8 with per-column float32
    scales [1, columns]."""
    extra = quantized_uq_qr(case, gen, None)
    extra["weight_quant_mode"] = 2
    x = case.inputs["token_x"].double()
    rows = x.reshape(-1, x.shape[-1])
    scale = rows.abs().amax(-1, keepdim=True) / 127
    case.inputs["token_x"] = torch.round(rows / scale).to(torch.int8).view(x.shape)
    extra["dequant_scale_x"] = scale.float()
    for name, scale_name in (("weight_dq", "dequant_scale_w_dq"), ("weight_dkv_kr", "dequant_scale_w_dkv_kr")):
        w = case.inputs[name]
        case.inputs[name] = torch.randint(-127, 128, w.shape, generator=gen, dtype=torch.int8)
        extra[scale_name] = torch.rand(1, w.shape[1], generator=gen) / (127 * w.shape[0] ** 0.5)
    return extra


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_weight_quant_mode_2(dtype):
    """int8 token_x (per-token scales) and int8 weight_dq / weight_uq_qr / weight_dkv_kr (per-column scales): each
    down projection is x8 W8 * dequant_scale_x[token] * dequant_scale_w_*[column], the rest as weight_quant_mode 1;
    outputs in weight_uk's float dtype. Callers: vllm-ascend vllm_ascend/attention/sfa_v1.py:1023 (W8A8Dynamic:
    token_x, dequant_x = npu_dynamic_quant(hidden_states); dequant_scale_x=dequant_x.view(-1, 1),
    weight_quant_mode=2) and cann-recipes-infer models/deepseek_r1/models/modeling_deepseek.py:1251 (a8w8:
    weight_scale.view(1, -1) per weight, "PA_NZ")."""
    gen = torch.Generator().manual_seed(23)
    case = PrologCase(gen, dtype=dtype, cache_mode="PA_NZ")
    quant = quantized_inputs(case, gen)
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    out = case.run(query_norm_flag=True, **quant)
    scales = {k: v for k, v in quant.items() if k != "weight_quant_mode"}
    expected = case.oracle(kv_before, kr_before, **scales)
    assert out.query.dtype == dtype and out.query_norm.dtype == torch.int8 and out.dequant_scale_q_norm.shape == (5, 1)
    assert torch.equal(case.kv_cache[~expected.kv_written], kv_before[~expected.kv_written])
    if dtype == F64:
        assert torch.equal(out.query_norm.double(), expected.query_norm)
        for name, actual, golden in (("query", out.query, expected.query), ("query_rope", out.query_rope,
                                     expected.query_rope), ("kv_cache", token_rows(case, case.kv_cache),
                                     token_rows(case, expected.kv_cache))):
            torch.testing.assert_close(actual, golden, rtol=1e-9, atol=1e-9, msg=name)
    else:  # the float64 formulas from the int8 c^Q the call made; the naive side in bf16
        assert (out.query_norm.double() - expected.query_norm).abs().max() <= 1
        down = (quant["dequant_scale_x"], quant["dequant_scale_w_dq"], quant["dequant_scale_w_dkv_kr"])
        given = (out.query_norm, out.dequant_scale_q_norm, quant["dequant_scale_w_uq_qr"])
        golden = naive(case, dtype=F64, quantized=given, down_scales=down)
        plain = naive(case, quantized=given, down_scales=down)
        for name in ("query", "query_rope"):
            assert_close_to_oracle(getattr(out, name), golden[name], plain[name], name=name)
        for name, cache in (("kv_cache", case.kv_cache), ("kr_cache", case.kr_cache)):
            assert_close_to_oracle(token_rows(case, cache), token_rows(case, getattr(expected, name)), plain[name],
                                   name=name)


def int8_caches(case: PrologCase, gen, *, kr_int8: bool) -> None:
    """Int8 pools (kv_cache; kr_cache too with `kr_int8`) holding random values, so that an element the call must
    not write is seen if it changes."""
    case.kv_cache = torch.randint(-128, 128, case.kv_cache.shape, generator=gen, dtype=torch.int8)
    if kr_int8:
        case.kr_cache = torch.randint(-128, 128, case.kr_cache.shape, generator=gen, dtype=torch.int8)


def oracle_int8_rows(case: PrologCase, oracle_cache: torch.Tensor) -> torch.Tensor:
    """The token rows of the oracle's (float64) copy of an int8 cache, read as the int8 cache is read."""
    return token_rows(case, oracle_cache.to(torch.int8)).double()


def assert_int8_rows(actual: torch.Tensor, golden: torch.Tensor, dtype, name: str) -> None:
    """Int8 values against the float64 oracle's: equal for float64 inputs; for bf16 inputs the value quantised
    was rounded to bf16 on its way (2^-9 relative), so a value next to a rounding boundary may land one step
    away."""
    off = (actual.double() - golden).abs()
    if dtype == F64:
        assert off.max() == 0, name
    else:
        assert off.max() <= 1 and (off > 0).double().mean() < 0.25, (name, off.max(), (off > 0).double().mean())


@pytest.mark.parametrize("cache_mode", ["PA_BSND", "PA_NZ"])
@pytest.mark.parametrize("dtype", [F64, BF16])
def test_kv_cache_quant_mode_2_per_channel(dtype, cache_mode):
    """The page's partial quantisation with a quantised cache (weight_quant_mode=1, kv_cache_quant_mode=2): the
    latent and the rope key written as int8, each channel multiplied by its quant scale (quant_scale_ckv [1, Hckv],
    quant_scale_ckr [1, Dr]) and rounded, as ops-transformer's MlaProlog kernel quantises them (QuantPerChannel,
    RopePostQuantPerChannel: multiply, round to nearest even); the queries are those of the same call with bf16
    caches, bit for bit."""
    gen = torch.Generator().manual_seed(31)
    case = PrologCase(gen, dtype=dtype, cache_mode=cache_mode, latent=64, rope=32)
    quant = quantized_uq_qr(case, gen, None)
    unquantised = cann_attn.mla_prolog(*case.weights(), case.kv_cache.clone(), case.kr_cache.clone(),
                                       cache_index=case.cache_index, cache_mode=cache_mode, **quant)
    int8_caches(case, gen, kr_int8=True)
    scales = {"quant_scale_ckv": 20 + 10 * torch.rand(1, 64, generator=gen),
              "quant_scale_ckr": 20 + 10 * torch.rand(1, 32, generator=gen)}
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    out = case.run(kv_cache_quant_mode=2, **quant, **scales)
    expected = case.oracle(kv_before, kr_before, dequant_scale_w_uq_qr=quant["dequant_scale_w_uq_qr"],
                           kv_cache_quant_mode=2, **scales)
    assert torch.equal(out.query, unquantised.query) and torch.equal(out.query_rope, unquantised.query_rope)
    for cache, before, golden, written in ((case.kv_cache, kv_before, expected.kv_cache, expected.kv_written),
                                           (case.kr_cache, kr_before, expected.kr_cache, expected.kr_written)):
        assert cache.dtype == torch.int8 and torch.equal(cache[~written], before[~written])
        assert_int8_rows(token_rows(case, cache), oracle_int8_rows(case, golden), dtype, "cache rows")
    rows = token_rows(case, case.kv_cache)
    assert rows.abs().max() > 60  # the scales reach the int8 range: not a cache of zeros


@pytest.mark.parametrize("ckv_shape", [(1,), (1, 64)])
@pytest.mark.parametrize(("dtype", "cache_mode"), [(F64, "PA_NZ"), (BF16, "PA_NZ"), (BF16, "PA_BSND")])
def test_full_quant_per_tensor_cache_and_int8_query(dtype, cache_mode, ckv_shape):
    """deepseek_r1's C8 decode: cann-recipes-infer models/deepseek_r1/models/modeling_deepseek.py:1252-1284
    (npu_dynamic_quant token_x, weight_quant_mode=2, kv_cache_quant_mode=1, query_quant_mode=1,
    quant_scale_ckv=ckv_scale_reci = reciprocal of a float32 [1] (:969, :1366), "PA_NZ" int8 latent pool read
    through a 32-channel NZ view, bf16 rope pool (:1288-1292)); the [1, Hckv] form repeats that value
    (ckv_scale_reci_repeat, :1367; aclnnMlaPrologV3WeightNz lists (1, Hckv)). The latent is written as
    round(latent * quant_scale_ckv), the rope key unquantised; the query int8 per token and head with
    dequant_scale_q_nope = max |q^N| / 127 [T, N, 1], query_rope multiplied by quant_scale_ckv / that scale
    (ops-transformer MlaProlog kernel: QuantPerTensor, DynamicQuantQnWithMulQr)."""
    gen = torch.Generator().manual_seed(32)
    case = PrologCase(gen, dtype=dtype, cache_mode=cache_mode, latent=64, rope=32)
    quant = quantized_inputs(case, gen)
    plain_kv, plain_kr = case.kv_cache.clone(), case.kr_cache.clone()
    unquantised = cann_attn.mla_prolog(*case.weights(), plain_kv, plain_kr, cache_index=case.cache_index,
                                       cache_mode=cache_mode, **quant)
    int8_caches(case, gen, kr_int8=False)
    ckv = torch.full(ckv_shape, 25.0)
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    out = case.run(kv_cache_quant_mode=1, query_quant_mode=1, quant_scale_ckv=ckv, **quant)
    scales = {k: v for k, v in quant.items() if k != "weight_quant_mode"}
    expected = case.oracle(kv_before, kr_before, kv_cache_quant_mode=1, query_quant_mode=1, quant_scale_ckv=ckv,
                           **scales)
    assert out.query.dtype == torch.int8 and out.query.shape == (5, 2, 64)
    assert out.dequant_scale_q_nope.dtype == torch.float32 and out.dequant_scale_q_nope.shape == (5, 2, 1)
    assert out.query_rope.dtype == dtype
    assert torch.equal(case.kv_cache[~expected.kv_written], kv_before[~expected.kv_written])
    assert torch.equal(case.kr_cache[~expected.kr_written], kr_before[~expected.kr_written])
    assert torch.equal(token_rows(case, case.kr_cache), token_rows(case, plain_kr))  # the rope key unquantised
    if dtype == F64:
        assert torch.equal(out.query.double(), expected.query)
        torch.testing.assert_close(out.dequant_scale_q_nope.double(), expected.query_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(out.query_rope, expected.query_rope, rtol=1e-6, atol=1e-9)
        assert_int8_rows(token_rows(case, case.kv_cache), oracle_int8_rows(case, expected.kv_cache), dtype, "kv_cache")
        torch.testing.assert_close(token_rows(case, case.kr_cache), token_rows(case, expected.kr_cache), rtol=1e-9,
                                   atol=1e-9)
        return
    # bf16: the int8 c^Q the call made decides everything after it; compare from there (as weight_quant_mode 2)
    assert (out.query_norm.double() - expected.query_norm).abs().max() <= 1 if out.query_norm.numel() else True
    assert_int8_rows(token_rows(case, case.kv_cache), oracle_int8_rows(case, expected.kv_cache), dtype, "kv_cache")
    # the quantisation (in fp32, as the kernel) of the bf16 query the unquantised call gives, by the stated rule
    q_bf16 = unquantised.query.float()
    scale = q_bf16.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(out.dequant_scale_q_nope, scale)
    assert torch.equal(out.query.float(), torch.round(q_bf16 / scale).clamp(-128, 127))
    golden_rope = unquantised.query_rope.double() * 25.0 / out.dequant_scale_q_nope.double()
    torch.testing.assert_close(out.query_rope.double(), golden_rope, rtol=2 ** -7, atol=0)
    # and the query against the float64 oracle: one int8 step at most, the scales within bf16's precision
    assert_int8_rows(out.query, expected.query, dtype, "query")
    torch.testing.assert_close(out.dequant_scale_q_nope.double(), expected.query_scale, rtol=2e-2, atol=0)


def test_int8_query_of_a_zero_head_has_scale_one():
    """A head whose query row is all zeros: scale 1 (no division by zero), int8 zeros, query_rope * quant_scale_ckv."""
    gen = torch.Generator().manual_seed(33)
    case = PrologCase(gen, dtype=F64, latent=64, rope=32)
    quant = quantized_inputs(case, gen)
    case.inputs["weight_uk"][1] = 0
    int8_caches(case, gen, kr_int8=False)
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    out = case.run(kv_cache_quant_mode=1, query_quant_mode=1, quant_scale_ckv=torch.tensor([4.0]), **quant)
    scales = {k: v for k, v in quant.items() if k != "weight_quant_mode"}
    expected = case.oracle(kv_before, kr_before, kv_cache_quant_mode=1, query_quant_mode=1,
                           quant_scale_ckv=torch.tensor([4.0]), **scales)
    assert torch.all(out.dequant_scale_q_nope[:, 1] == 1) and torch.all(out.query[:, 1] == 0)
    torch.testing.assert_close(out.query_rope, expected.query_rope, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("mode", [1, 2, "per channel cache", "c8", "per tile"])
def test_weight_quant_modes_under_the_custom_op(mode):
    gen = torch.Generator().manual_seed(22)
    case = PrologCase(gen)
    quant = (quantized_uq_qr(case, gen, (1, 32)) if mode in (1, "per channel cache", "per tile")
             else quantized_inputs(case, gen))
    if mode == "per channel cache":
        int8_caches(case, gen, kr_int8=True)
        quant.update(kv_cache_quant_mode=2, quant_scale_ckv=torch.full((1, 32), 20.0),
                     quant_scale_ckr=torch.full((1, 16), 20.0))
    elif mode == "per tile":  # packed rows [.., 1, 32 + 16 * 2 + 4] in kv_cache, an empty kr_cache
        case.kv_cache = torch.zeros(*case.kv_cache.shape[:-1], 68, dtype=torch.int8)
        case.kr_cache = torch.empty(1, 2, 1, 0, dtype=BF16)
        quant.update(kv_cache_quant_mode=3, ckvkr_repo_mode=1, quant_scale_repo_mode=1, tile_size=32,
                     k_nope_clip_alpha=torch.ones(1))
    elif mode == "c8":  # the fake kernel's int8 query and [T, N, 1] scales
        int8_caches(case, gen, kr_int8=False)
        quant.update(kv_cache_quant_mode=1, query_quant_mode=1, quant_scale_ckv=torch.tensor([20.0]))
    args = (*case.weights(), case.kv_cache, case.kr_cache)
    result = torch.library.opcheck(torch.ops.cann_attn.mla_prolog, args,
                                   {"cache_index": case.cache_index, "query_norm_flag": True, **quant})
    assert all(v == "SUCCESS" for v in result.values()), result


# ------------------------------------------------------------------------------------------------- torch_npu
def test_torch_npu_spellings_return_their_outputs():
    """v3 -> (query, query_rope, dequant_scale_q_nope [0], query_norm, dequant_scale_q_norm [0]); v2 -> (query,
    query_rope, kv_cache, kr_cache, dequant_scale_q_nope [1]); v1 -> the first four of v2; install() makes
    torch.ops.npu.npu_mla_prolog_v3 the same function."""
    reference = PrologCase(torch.Generator().manual_seed(11))
    expected = reference.run(query_norm_flag=True)
    v3 = PrologCase(torch.Generator().manual_seed(11))
    out = torch_npu.npu_mla_prolog_v3(*v3.weights(), v3.kv_cache, v3.kr_cache, cache_index=v3.cache_index,
                                      query_norm_flag=True)
    assert len(out) == 5 and all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
    assert torch.equal(v3.kv_cache, reference.kv_cache) and torch.equal(v3.kr_cache, reference.kr_cache)
    for spelling, arity in ((torch_npu.npu_mla_prolog_v2, 5), (torch_npu.npu_mla_prolog, 4)):
        case = PrologCase(torch.Generator().manual_seed(11))
        out = spelling(*case.weights(), case.cache_index, case.kv_cache, case.kr_cache)
        assert len(out) == arity and out[2] is case.kv_cache and out[3] is case.kr_cache
        assert torch.equal(out[0], expected.query) and torch.equal(case.kv_cache, reference.kv_cache)
    case = PrologCase(torch.Generator().manual_seed(11))
    assert torch_npu.npu_mla_prolog_v2(*case.weights(), case.cache_index, case.kv_cache, case.kr_cache)[4].shape == (1,)


def test_unmodified_recipe_code_after_install():
    """The recipes' lines as written: ``torch_npu.npu_format_cast(w, 29)`` on the three NZ weights, then
    ``torch.ops.npu.npu_mla_prolog_v3(...)`` (deepseek_r1 models/deepseek_r1/models/modeling_deepseek.py:1251,
    longcat models/longcat_flash/models/modeling_longcat_flash.py:951) and ``torch_npu.npu_mla_prolog_v3(...)``
    after install() (a subprocess: install() replaces the torch_npu module for the process). The op schema's
    Tensor(a!) caches are written in place through torch.ops.npu too."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from patience import HANG_SECONDS

    script = textwrap.dedent("""
        import torch
        import cann_attn.torch_npu
        cann_attn.torch_npu.install()
        import torch_npu
        g = torch.Generator().manual_seed(0)
        w = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).bfloat16()
        x, w_dq, w_uq_qr, w_uk, w_dkv_kr = w(3, 32), w(32, 16), w(16, 2 * (8 + 16)), w(2, 8, 32), w(32, 48)
        nz = [torch_npu.npu_format_cast(t.contiguous(), 29) for t in (w_dq, w_uq_qr, w_dkv_kr)]
        assert [torch_npu.get_npu_format(t) for t in nz] == [29, 29, 29]
        gamma_cq, gamma_ckv = torch.ones(16, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
        sin, cos = torch.rand(3, 16).bfloat16(), torch.rand(3, 16).bfloat16()
        outs, caches = [], []
        for fn, weights in ((torch.ops.npu.npu_mla_prolog_v3, nz), (torch_npu.npu_mla_prolog_v3,
                                                                     (w_dq, w_uq_qr, w_dkv_kr))):
            kv, kr = torch.zeros(2, 16, 1, 32, dtype=torch.bfloat16), torch.zeros(2, 16, 1, 16, dtype=torch.bfloat16)
            outs.append(fn(token_x=x, weight_dq=weights[0], weight_uq_qr=weights[1], weight_uk=w_uk,
                           weight_dkv_kr=weights[2], rmsnorm_gamma_cq=gamma_cq, rmsnorm_gamma_ckv=gamma_ckv,
                           rope_sin=sin, rope_cos=cos, cache_index=torch.tensor([3, 17, 30]), kv_cache=kv,
                           kr_cache=kr, cache_mode="PA_NZ"))
            caches.append((kv, kr))
        assert len(outs[0]) == 5 and all(torch.equal(a, b) for a, b in zip(*outs))
        assert torch.equal(caches[0][0], caches[1][0]) and caches[0][0].abs().sum() > 0
        print("OK")
    """)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=HANG_SECONDS)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


@pytest.mark.parametrize(("release", "has_dtype_overrides"), [("current", True), ("26.0", False), ("7.3", False)])
def test_v3_signature_per_release(release, has_dtype_overrides):
    """op-plugin's op_plugin_functions.yaml: npu_mla_prolog_v3 from 7.3 on, master adds the *_dtype overrides."""
    import inspect

    previous = torch_npu.use_release(release)
    try:
        params = inspect.signature(torch_npu.npu_mla_prolog_v3).parameters
        assert list(params)[:11] == [*WEIGHTS, "kv_cache", "kr_cache"]
        assert params["cache_index"].kind is inspect.Parameter.KEYWORD_ONLY and params["tile_size"].default == 128
        assert ("kv_cache_dtype" in params) == has_dtype_overrides
    finally:
        torch_npu.use_release(previous)


def test_custom_op_under_torch_compile_writes_the_caches():
    """The cann_attn::mla_prolog custom op marks kv_cache / kr_cache as written: a compiled call updates them."""
    eager = PrologCase(torch.Generator().manual_seed(12))
    compiled_case = PrologCase(torch.Generator().manual_seed(12))
    expected = eager.run(query_norm_flag=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(*tensors, cache_index):
        return cann_attn.mla_prolog(*tensors, cache_index=cache_index, query_norm_flag=True)

    out = step(*compiled_case.weights(), compiled_case.kv_cache, compiled_case.kr_cache,
               cache_index=compiled_case.cache_index)
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
    assert torch.equal(compiled_case.kv_cache, eager.kv_cache)
    args = (*compiled_case.weights(), compiled_case.kv_cache, compiled_case.kr_cache)
    result = torch.library.opcheck(torch.ops.cann_attn.mla_prolog, args,
                                   {"cache_index": compiled_case.cache_index, "query_norm_flag": True})
    assert all(v == "SUCCESS" for v in result.values()), result


# ------------------------------------------------------------------------------------------------ bad input
def _bad_calls():
    """(what is wrong, the parameter the error must name, a change to a fresh case's call)."""
    def set_input(name, value):
        return lambda c, kw: c.inputs.__setitem__(name, value(c.inputs[name]))

    def cast(dtype):
        return lambda t: t.to(dtype)

    def trim(t):
        return t[..., :-2] if t.dim() > 1 else t[:-2]

    # The sizes come from token_x (He), weight_dq (Hcq), weight_uk (N, D, Hckv) and rope_sin (Dr): those four are
    # broken in a dim another tensor fixes, every other tensor in its last dim.
    own_dim = {"weight_dq": lambda t: t[:-1], "weight_uk": lambda t: t[0], "rope_sin": lambda t: t[:-1]}
    calls = []
    for name in WEIGHTS[1:]:
        calls.append((f"{name} dtype", name, set_input(name, cast(torch.float16))))
        calls.append((f"{name} shape", name, set_input(name, own_dim.get(name, trim))))
    calls += [
        ("token_x int8", "token_x", set_input("token_x", cast(torch.int8))),
        ("token_x 4-D", "token_x", set_input("token_x", lambda t: t[None, None])),
        ("kv_cache dtype", "kv_cache", lambda c, kw: setattr(c, "kv_cache", c.kv_cache.float())),
        ("kr_cache shape", "kr_cache", lambda c, kw: setattr(c, "kr_cache", c.kr_cache[..., :8])),
        ("kr_cache blocks", "kr_cache", lambda c, kw: setattr(c, "kr_cache", c.kr_cache[:2])),
        ("Nkv 2", "kv_cache", lambda c, kw: setattr(c, "kv_cache", c.kv_cache.expand(-1, -1, 2, -1).clone())),
        ("block size 8", "kv_cache", lambda c, kw: (setattr(c, "kv_cache", c.kv_cache[:, :8]),
                                                     setattr(c, "kr_cache", c.kr_cache[:, :8]),
                                                     setattr(c, "cache_index", c.cache_index % 8))),
        ("cache_mode PA_BLK_NZ", "cache_mode", lambda c, kw: kw.update(cache_mode="PA_BLK_NZ")),
        ("cache_mode unknown", "cache_mode", lambda c, kw: kw.update(cache_mode="BNSD")),
        ("cache_index missing", "cache_index", lambda c, kw: setattr(c, "cache_index", None)),
        ("cache_index int32", "cache_index", lambda c, kw: setattr(c, "cache_index", c.cache_index.int())),
        ("cache_index shape", "cache_index", lambda c, kw: setattr(c, "cache_index", c.cache_index[:2])),
        ("cache_index past the pool", "cache_index",
         lambda c, kw: c.cache_index.__setitem__(-1, c.kv_cache.shape[0] * c.kv_cache.shape[1])),
        ("cache_index below -1", "cache_index", lambda c, kw: c.cache_index.__setitem__(0, -2)),
        ("cache_index repeated", "cache_index", lambda c, kw: c.cache_index.__setitem__(1, int(c.cache_index[0]))),
        ("qc_qr_scale with query_norm", "qc_qr_scale", lambda c, kw: kw.update(qc_qr_scale=0.5,
                                                                              query_norm_flag=True)),
        ("epsilon not a number", "rmsnorm_epsilon_cq", lambda c, kw: kw.update(rmsnorm_epsilon_cq="1e-5")),
        ("kc_scale nan", "kc_scale", lambda c, kw: kw.update(kc_scale=float("nan"))),
        ("query_norm_flag int", "query_norm_flag", lambda c, kw: kw.update(query_norm_flag=1)),
        ("actual_seq_len", "actual_seq_len", lambda c, kw: kw.update(actual_seq_len=torch.tensor([5]))),
        ("tile_size float", "tile_size", lambda c, kw: kw.update(tile_size=128.0)),
    ]
    def mode_1(change):
        def apply(c, kw):
            kw.update(quantized_uq_qr(c, torch.Generator().manual_seed(1), (1, 32)))
            change(c, kw)
        return apply

    calls += [
        ("mode 1 with a bf16 weight_uq_qr", "weight_uq_qr", lambda c, kw: kw.update(weight_quant_mode=1)),
        ("mode 1 without dequant scales", "dequant_scale_w_uq_qr",
         mode_1(lambda c, kw: kw.update(dequant_scale_w_uq_qr=None))),
        ("mode 1 dequant scales shape", "dequant_scale_w_uq_qr",
         mode_1(lambda c, kw: kw.update(dequant_scale_w_uq_qr=kw["dequant_scale_w_uq_qr"][:, :-1]))),
        ("mode 1 dequant scales dtype", "dequant_scale_w_uq_qr",
         mode_1(lambda c, kw: kw.update(dequant_scale_w_uq_qr=kw["dequant_scale_w_uq_qr"].double()))),
        ("mode 1 smooth shape", "smooth_scales_cq", mode_1(lambda c, kw: kw.update(smooth_scales_cq=torch.ones(2)))),
        ("mode 1 with quant_scale_ckv", "quant_scale_ckv",
         mode_1(lambda c, kw: kw.update(quant_scale_ckv=torch.ones(1, 32)))),
        ("mode 0 with smooth", "smooth_scales_cq", lambda c, kw: kw.update(smooth_scales_cq=torch.ones(1, 32))),
    ]
    def mode_2(change):
        def apply(c, kw):
            kw.update(quantized_inputs(c, torch.Generator().manual_seed(2)))
            change(c, kw)
        return apply

    calls += [
        ("mode 2 with a bf16 token_x", "token_x", lambda c, kw: kw.update(weight_quant_mode=2)),
        ("mode 2 without token scales", "dequant_scale_x", mode_2(lambda c, kw: kw.update(dequant_scale_x=None))),
        ("mode 2 token scales shape", "dequant_scale_x",
         mode_2(lambda c, kw: kw.update(dequant_scale_x=kw["dequant_scale_x"][:-1]))),
        ("mode 2 weight_dq scales shape", "dequant_scale_w_dq",
         mode_2(lambda c, kw: kw.update(dequant_scale_w_dq=kw["dequant_scale_w_dq"][:, :-1]))),
        ("mode 2 without weight_dkv_kr scales", "dequant_scale_w_dkv_kr",
         mode_2(lambda c, kw: kw.update(dequant_scale_w_dkv_kr=None))),
        ("mode 2 bf16 weight_dkv_kr", "weight_dkv_kr",
         mode_2(lambda c, kw: c.inputs.__setitem__("weight_dkv_kr", c.inputs["weight_dkv_kr"].bfloat16()))),
        ("mode 1 with token scales", "dequant_scale_x",
         mode_1(lambda c, kw: kw.update(dequant_scale_x=torch.ones(5, 1)))),
    ]
    for mode, value in ( ("kv_cache_quant_mode", 1),
                        ("kv_cache_quant_mode", 2), ("kv_cache_quant_mode", 3), ("query_quant_mode", 1),
                        ("ckvkr_repo_mode", 1), ("quant_scale_repo_mode", 1), ("weight_quant_mode", 7)):
        calls.append((f"{mode} {value}", mode, lambda c, kw, m=mode, v=value: kw.update({m: v})))
    def per_tile(change):
        def apply(c, kw):
            kw.update(quantized_uq_qr(c, torch.Generator().manual_seed(4), None), kv_cache_quant_mode=3,
                      ckvkr_repo_mode=1, quant_scale_repo_mode=1, tile_size=32, k_nope_clip_alpha=torch.ones(1))
            c.kv_cache = torch.zeros(*c.kv_cache.shape[:-1], 68, dtype=torch.int8)  # 32 + 16 * 2 + 4 bytes
            c.kr_cache = torch.empty(1, 2, 1, 0, dtype=BF16)
            change(c, kw)
        return apply

    def c8(change):
        def apply(c, kw):
            kw.update(quantized_inputs(c, torch.Generator().manual_seed(3)), kv_cache_quant_mode=1, query_quant_mode=1,
                      quant_scale_ckv=torch.tensor([20.0]))
            c.kv_cache = c.kv_cache.to(torch.int8)
            change(c, kw)
        return apply

    calls += [
        ("c8 kv_cache_quant_mode 3", "kv_cache_quant_mode", c8(lambda c, kw: kw.update(kv_cache_quant_mode=3))),
        ("c8 query_quant_mode 0", "kv_cache_quant_mode", c8(lambda c, kw: kw.update(query_quant_mode=0))),
        ("c8 with weight_quant_mode 1", "kv_cache_quant_mode",
         mode_1(lambda c, kw: kw.update(kv_cache_quant_mode=1, query_quant_mode=1))),
        ("query_quant_mode 1 over float caches", "query_quant_mode",
         mode_2(lambda c, kw: kw.update(query_quant_mode=1))),
        ("c8 without quant_scale_ckv", "quant_scale_ckv", c8(lambda c, kw: kw.update(quant_scale_ckv=None))),
        ("c8 quant_scale_ckv not one value", "quant_scale_ckv",
         c8(lambda c, kw: kw.update(quant_scale_ckv=torch.arange(1.0, 33.0).view(1, 32)))),
        ("c8 quant_scale_ckv float64", "quant_scale_ckv",
         c8(lambda c, kw: kw.update(quant_scale_ckv=torch.tensor([20.0], dtype=F64)))),
        ("c8 with quant_scale_ckr", "quant_scale_ckr", c8(lambda c, kw: kw.update(quant_scale_ckr=torch.ones(1, 16)))),
        ("c8 bf16 kv_cache", "kv_cache", c8(lambda c, kw: setattr(c, "kv_cache", c.kv_cache.bfloat16()))),
        ("c8 int8 kr_cache", "kr_cache", c8(lambda c, kw: setattr(c, "kr_cache", c.kr_cache.to(torch.int8)))),
        ("per channel without quant_scale_ckr", "quant_scale_ckr",
         mode_1(lambda c, kw: (kw.update(kv_cache_quant_mode=2, quant_scale_ckv=torch.ones(1, 32)),
                               setattr(c, "kv_cache", c.kv_cache.to(torch.int8)),
                               setattr(c, "kr_cache", c.kr_cache.to(torch.int8))))),
        ("per channel quant_scale_ckv [1]", "quant_scale_ckv",
         mode_1(lambda c, kw: kw.update(kv_cache_quant_mode=2, quant_scale_ckv=torch.ones(1),
                                        quant_scale_ckr=torch.ones(1, 16)))),
        ("per tile in PA_NZ", "cache_mode", per_tile(lambda c, kw: kw.update(cache_mode="PA_NZ"))),
        ("per tile repo modes 0", "ckvkr_repo_mode",
         per_tile(lambda c, kw: kw.update(ckvkr_repo_mode=0, quant_scale_repo_mode=0))),
        ("per tile without k_nope_clip_alpha", "k_nope_clip_alpha",
         per_tile(lambda c, kw: kw.update(k_nope_clip_alpha=None))),
        ("per tile k_nope_clip_alpha shape", "k_nope_clip_alpha",
         per_tile(lambda c, kw: kw.update(k_nope_clip_alpha=torch.ones(1, 1)))),
        ("per tile tile_size 24", "tile_size", per_tile(lambda c, kw: kw.update(tile_size=24))),
        ("per tile row width", "kv_cache", per_tile(lambda c, kw: setattr(c, "kv_cache", c.kv_cache[..., :-4]))),
        ("per tile kr_cache not empty", "kr_cache",
         per_tile(lambda c, kw: setattr(c, "kr_cache", torch.zeros(3, 16, 1, 16, dtype=BF16)))),
        ("per tile with bf16 weights", "kv_cache_quant_mode",
         lambda c, kw: (kw.update(kv_cache_quant_mode=3, ckvkr_repo_mode=1, quant_scale_repo_mode=1, tile_size=32,
                                  k_nope_clip_alpha=torch.ones(1)),
                        setattr(c, "kv_cache", torch.zeros(3, 16, 1, 68, dtype=torch.int8)),
                        setattr(c, "kr_cache", torch.empty(1, 2, 1, 0, dtype=BF16)))),
        ("per channel bf16 kr_cache", "kr_cache",
         mode_1(lambda c, kw: (kw.update(kv_cache_quant_mode=2, quant_scale_ckv=torch.ones(1, 32),
                                         quant_scale_ckr=torch.ones(1, 16)),
                               setattr(c, "kv_cache", c.kv_cache.to(torch.int8))))),
    ]
    for name in ("dequant_scale_x", "dequant_scale_w_dq", "dequant_scale_w_uq_qr", "dequant_scale_w_dkv_kr",
                 "quant_scale_ckv", "quant_scale_ckr", "smooth_scales_cq", "k_nope_clip_alpha"):
        calls.append((name, name, lambda c, kw, n=name: kw.update({n: torch.ones(1, 4)})))
    return calls


@pytest.mark.parametrize(("what", "param", "change"), _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_names_the_parameter_and_writes_nothing(what, param, change):
    case = PrologCase(torch.Generator().manual_seed(13))
    kw = {}
    change(case, kw)
    kv_before, kr_before = case.kv_cache.clone(), case.kr_cache.clone()
    nullptr = "missing" in what or "without" in what
    with pytest.raises(cann_attn.ParamNullptrError if nullptr else cann_attn.ParamInvalidError,
                       match=rf"^\[\d+\] {param}:"):
        case.run(**kw)
    assert torch.equal(case.kv_cache, kv_before) and torch.equal(case.kr_cache, kr_before)


def test_missing_weight_and_the_spellings_own_refusals():
    case = PrologCase(torch.Generator().manual_seed(14))
    weights = case.weights()
    weights[3] = None
    with pytest.raises(cann_attn.ParamNullptrError, match="weight_uk"):
        cann_attn.mla_prolog(*weights, case.kv_cache, case.kr_cache, cache_index=case.cache_index)
    with pytest.raises(cann_attn.ParamInvalidError, match=r"^\[161002\] cache_mode"):
        torch_npu.npu_mla_prolog_v2(*case.weights(), case.cache_index, case.kv_cache, case.kr_cache,
                                    cache_mode="TND")
    with pytest.raises(cann_attn.ParamInvalidError, match="kv_cache_dtype"):
        torch_npu.npu_mla_prolog_v3(*case.weights(), case.kv_cache, case.kr_cache, cache_index=case.cache_index,
                                    kv_cache_dtype=2)
    bsnd = PrologCase(torch.Generator().manual_seed(14), lead=(1, 3), cache_mode="BSND")
    with pytest.raises(cann_attn.ParamInvalidError, match="cache_index"):  # BSND writes row t: no index
        cann_attn.mla_prolog(*bsnd.weights(), bsnd.kv_cache, bsnd.kr_cache, cache_mode="BSND",
                             cache_index=torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(cann_attn.ParamInvalidError, match="token_x"):  # TND takes [T, He] tokens
        cann_attn.mla_prolog(*bsnd.weights(), bsnd.kv_cache, bsnd.kr_cache, cache_mode="TND")


def test_c8_prolog_feeds_the_int8_mla_attention():
    """deepseek_r1's C8 decode step end to end: npu_mla_prolog_v3 with weight_quant_mode=2, kv_cache_quant_mode=1,
    query_quant_mode=1 into "PA_NZ" pools (cann-recipes-infer models/deepseek_r1/models/modeling_deepseek.py:
    1252-1284), then npu_fused_infer_attention_score_v2 over the pools' NZ views with query_quant_mode=3,
    dequant_scale_query = dequant_scale_q_nope.view(num_tokens, -1), dequant_scale_key = dequant_scale_value =
    ckv_scale = 1 / quant_scale_ckv, "TND_NTD" (:1288-1318). The attention equals the same layer computed in float64
    from the unquantised oracle (query, latent and rope key), within the two int8 roundings: the scales of the
    query, its rope part and the cache compose as the docs state."""
    gen = torch.Generator().manual_seed(41)
    lengths, heads, block_size, blocks = [19, 7, 12], 2, 32, 4
    tokens = sum(lengths)
    case = PrologCase(gen, dtype=BF16, lead=(tokens,), cache_mode="PA_NZ", heads=heads, latent=512, rope=64,
                      blocks=blocks, block_size=block_size)
    quant = quantized_inputs(case, gen)
    # each sequence's tokens in its own blocks, in order (the block table maps them back)
    table = torch.randperm(blocks, generator=gen)[:3].view(3, 1).int()
    slots = torch.cat([table[b, 0] * block_size + torch.arange(n) for b, n in enumerate(lengths)])
    case.cache_index = slots.to(torch.int64)
    case.kv_cache = torch.zeros(blocks, block_size, 1, 512, dtype=torch.int8)
    ckv_scale = torch.tensor([0.12])  # the latent reaches ~13: 13 / 0.12 stays inside the int8 range
    out = torch_npu.npu_mla_prolog_v3(*case.weights(), case.kv_cache, case.kr_cache, cache_index=case.cache_index,
                                      cache_mode="PA_NZ", kv_cache_quant_mode=1, query_quant_mode=1,
                                      quant_scale_ckv=torch.reciprocal(ckv_scale), **quant)
    last = torch.tensor(lengths).cumsum(0) - 1  # the decode token of each sequence
    k_nope = case.kv_cache.view(blocks, 1, 512 // 32, block_size, 32)
    k_rope = case.kr_cache.view(blocks, 1, 64 // 16, block_size, 16)
    attention, _ = torch_npu.npu_fused_infer_attention_score_v2(
        out[0][last], k_nope, k_nope, query_rope=out[1][last], key_rope=k_rope, actual_seq_kvlen=lengths,
        actual_seq_qlen=[1, 2, 3], block_table=table, dequant_scale_query=out[2][last].view(3, -1),
        dequant_scale_key=ckv_scale, dequant_scale_value=ckv_scale, num_query_heads=heads, num_key_value_heads=1,
        softmax_scale=0.1, input_layout="TND_NTD", sparse_mode=0, block_size=block_size, query_quant_mode=3,
        key_quant_mode=0, value_quant_mode=0)
    # (a) the attention of the prolog's own int8 outputs, each standing for its value times its scale as the docs
    # state (query * s, query_rope * s * ckv_scale, latent * ckv_scale): the scales compose, up to the bf16 output
    s = out[2].double()
    own = (out[0].double() * s, out[1].double() * s * ckv_scale.double(),
           token_rows(case, case.kv_cache).double() * ckv_scale.double(), token_rows(case, case.kr_cache).double())
    # (b) the same layer in float64 without quantisation: within the two int8 roundings
    scales = {k: v for k, v in quant.items() if k != "weight_quant_mode"}
    plain = case.oracle(torch.zeros(blocks, block_size, 1, 512), case.kr_cache.double(), **scales)
    unquantised = (plain.query, plain.query_rope, token_rows(case, plain.kv_cache), token_rows(case, plain.kr_cache))
    for (query, query_rope, latent, key_rope), tolerance in ((own, 1e-2), (unquantised, 5e-2)):
        expected = []
        for b, end in enumerate(last.tolist()):
            keys = slice(end + 1 - lengths[b], end + 1)
            scores = (query[end] @ latent[keys].T + query_rope[end] @ key_rope[keys].T) * 0.1
            expected.append(torch.softmax(scores, -1) @ latent[keys])  # [N, Hckv]
        expected = torch.stack(expected, 1)  # TND_NTD: [N, T, Hckv]
        error = (attention.double() - expected).abs().max() / expected.abs().max()
        assert error < tolerance, (tolerance, error)


def test_v1_v2_spellings_select_the_quantised_scenario_by_dtype():
    """The v1 / v2 pages select the scenario by dtypes, v3 by its modes; the same call gives the same bits.
    v2: vllm-ascend vllm_ascend/device/device_op.py:318-337 (fa_quant layers: npu_dynamic_quant token_x, int8
    weights with their scales, quant_scale_ckv = quant_kscale, the reciprocal of fa_k_scale repeated to [1, Hckv]
    (vllm_ascend/quantization/methods/kv_c8.py:70-72), "PA_NZ" int8 latent pool, bf16 rope pool; it returns
    dequant_scale_q_nope for the int8 query). v1: int8 weight_uq_qr with int8 caches quantised per channel (the
    npu_mla_prolog page: quant_scale_ckv [1, Hckv], quant_scale_ckr [1, Dr] required)."""
    gen = torch.Generator().manual_seed(51)
    case = PrologCase(gen, cache_mode="PA_NZ", latent=64, rope=32)
    quant = quantized_inputs(case, gen)
    scales = {k: v for k, v in quant.items() if k != "weight_quant_mode"}
    int8_caches(case, gen, kr_int8=False)
    ckv = torch.full((1, 64), 1 / 0.04)
    pools = [(case.kv_cache.clone(), case.kr_cache.clone()) for _ in range(2)]
    v2 = torch_npu.npu_mla_prolog_v2(*case.weights(), case.cache_index, *pools[0], quant_scale_ckv=ckv,
                                     cache_mode="PA_NZ", **scales)
    v3 = torch_npu.npu_mla_prolog_v3(*case.weights(), *pools[1], cache_index=case.cache_index, quant_scale_ckv=ckv,
                                     cache_mode="PA_NZ", kv_cache_quant_mode=1, query_quant_mode=1, **quant)
    assert v2[0].dtype == torch.int8 and v2[4].shape == (5, 2, 1)
    for ours, theirs in ((v2[0], v3[0]), (v2[1], v3[1]), (v2[4], v3[2]), *zip(pools[0], pools[1], strict=True)):
        assert torch.equal(ours, theirs)

    gen = torch.Generator().manual_seed(52)
    case = PrologCase(gen, latent=64, rope=32)
    quant = quantized_uq_qr(case, gen, (1, 32))
    scales = {k: v for k, v in quant.items() if k != "weight_quant_mode"}
    int8_caches(case, gen, kr_int8=True)
    per_channel = {"quant_scale_ckv": torch.full((1, 64), 30.0), "quant_scale_ckr": torch.full((1, 32), 30.0)}
    pools = [(case.kv_cache.clone(), case.kr_cache.clone()) for _ in range(2)]
    v1 = torch_npu.npu_mla_prolog(*case.weights(), case.cache_index, *pools[0], **scales, **per_channel)
    v3 = torch_npu.npu_mla_prolog_v3(*case.weights(), *pools[1], cache_index=case.cache_index, kv_cache_quant_mode=2,
                                     **quant, **per_channel)
    for ours, theirs in ((v1[0], v3[0]), (v1[1], v3[1]), *zip(pools[0], pools[1], strict=True)):
        assert torch.equal(ours, theirs)

    plain = PrologCase(torch.Generator().manual_seed(53))
    int8_caches(plain, torch.Generator().manual_seed(54), kr_int8=True)
    with pytest.raises(cann_attn.ParamInvalidError, match=r"^\[\d+\] kv_cache:"):
        torch_npu.npu_mla_prolog_v2(*plain.weights(), plain.cache_index, plain.kv_cache, plain.kr_cache)


def packed_parts(rows: torch.Tensor, latent: int, rope: int, dtype, tiles: int):
    """A packed row's parts as the attention reads them (docs/operators/quant_dsa.md): int8 latent, the rope key's
    bytes in `dtype`, float32 tile scales."""
    raw = rows.contiguous().view(torch.uint8)
    rope_bytes = rope * dtype.itemsize
    return (raw[:, :latent].view(torch.int8), raw[:, latent : latent + rope_bytes].contiguous().view(dtype),
            raw[:, latent + rope_bytes : latent + rope_bytes + 4 * tiles].contiguous().view(torch.float32))


@pytest.mark.parametrize(("dtype", "cache_mode", "lead", "alpha"), [
    (F64, "PA_BSND", (5,), 1.0), (BF16, "PA_BSND", (5,), 1.0), (BF16, "PA_BSND", (2, 3), 0.75),
    (BF16, "TND", (4,), 1.0), (F64, "BSND", (1, 4), 0.5)])
def test_kv_cache_quant_mode_3_packed_rows(dtype, cache_mode, lead, alpha):
    """DeepSeek-V3.2's C8 prolog: cann-recipes-infer models/deepseek_v3_2_exp/models/modeling_deepseek.py:1443-1477
    (weight_quant_mode=1 W8A8, kv_cache_quant_mode=3, query_quant_mode=0, ckvkr_repo_mode=1, quant_scale_repo_mode=1,
    tile_size=128, k_nope_clip_alpha=ckv_a_alpha, a float32 [1] of ones (:985), kr_cache=fake_kr_cache, an empty bf16
    (1, 2, 1, 0) tensor (:988), "PA_BSND"; "BSND" under context parallelism, :1275). Each token's row of kv_cache
    [.., 1, Dtile] is [int8 latent | rope key in the float dtype | one float32 scale per tile]: per tile a = max |x|,
    x clipped to [-alpha a, alpha a], scale = alpha a / 127, int8 round(x / scale) (ops-transformer's MlaProlog
    kernel: PerTileClipWithAlpha, DynamicQuant, ScatterCkv / ScatterKr offsets Hckv and Hckv + Dr * 2 bytes); the
    queries are those of the same call with float caches."""
    gen = torch.Generator().manual_seed(61)
    latent, rope, tile = 256, 32, 128
    case = PrologCase(gen, dtype=dtype, lead=lead, cache_mode=cache_mode, latent=latent, rope=rope)
    quant = quantized_uq_qr(case, gen, None)
    unquantised = case.run(query_norm_flag=True, **quant)
    width = latent + rope * dtype.itemsize + 4 * (latent // tile)
    case.kv_cache = torch.randint(-128, 128, (*case.kv_cache.shape[:-1], width), generator=gen, dtype=torch.int8)
    float_kr = case.kr_cache
    case.kr_cache = torch.empty((1, 2, 1, 0), dtype=dtype)
    clip = torch.tensor([alpha])
    kv_before = case.kv_cache.clone()
    out = case.run(kv_cache_quant_mode=3, ckvkr_repo_mode=1, quant_scale_repo_mode=1, tile_size=tile,
                   k_nope_clip_alpha=clip, query_norm_flag=True, **quant)
    assert torch.equal(out.query, unquantised.query) and torch.equal(out.query_rope, unquantised.query_rope)
    expected = mla_prolog_oracle(*case.weights(), kv_before, float_kr, case.cache_index, cache_mode=cache_mode,
                                 dequant_scale_w_uq_qr=quant["dequant_scale_w_uq_qr"], kv_cache_quant_mode=3,
                                 tile_size=tile, k_nope_clip_alpha=clip)
    assert torch.equal(case.kv_cache[~expected.kv_written], kv_before[~expected.kv_written])
    assert int(expected.kv_written.sum()) == len(case.inputs["token_x"].reshape(-1, 48)) * width
    rows = case.kv_cache.reshape(-1, width)[case.cache_index.reshape(-1)] if case.cache_index is not None else \
        case.kv_cache.reshape(-1, width)
    values, key_rope, scales = packed_parts(rows, latent, rope, dtype, latent // tile)
    assert_int8_rows(values, expected.packed_latent, dtype, "packed latent")
    if dtype == F64:
        torch.testing.assert_close(key_rope, expected.packed_key_rope, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(scales.double(), expected.tile_scales, rtol=1e-6, atol=0)
    else:
        plain = naive(case, quantized=(out.query_norm, out.dequant_scale_q_norm, quant["dequant_scale_w_uq_qr"]))
        assert_close_to_oracle(key_rope, expected.packed_key_rope, plain["kr_cache"].reshape(key_rope.shape),
                               name="packed rope key")
        torch.testing.assert_close(scales.double(), expected.tile_scales, rtol=2e-2, atol=0)
    if alpha < 1:  # clipping: the largest value of a tile reaches the int8 limit
        assert (values.view(-1, latent // tile, tile).abs().amax(-1) == 127).all()


def test_packed_rows_feed_the_kv_quant_sparse_attention():
    """DeepSeek-V3.2's C8 step the recipes' way: npu_mla_prolog_v3 with kv_cache_quant_mode=3 writes the packed
    rows (cann-recipes-infer models/deepseek_v3_2_exp/models/modeling_deepseek.py:1443-1477), and
    npu_kv_quant_sparse_flash_attention reads the same pool as key and value (layout_kv "PA_BSND",
    quant_scale_repo_mode=1, tile_size=128, rope_head_dim=64, attention_mode=2, as that model calls it). Every key
    selected: the attention equals the one of the prolog's oracle rows (the int8 latent times its tile scale, the
    rope key) within the bf16 output, and the unquantised float64 layer within the int8 rounding."""
    gen = torch.Generator().manual_seed(71)
    lengths, heads, block_size = [20, 9], 2, 32
    tokens = sum(lengths)
    case = PrologCase(gen, lead=(tokens,), heads=heads, latent=512, rope=64, blocks=3, block_size=block_size)
    quant = quantized_uq_qr(case, gen, None)
    table = torch.tensor([[2], [0]], dtype=torch.int32)
    case.cache_index = torch.cat([table[b, 0] * block_size + torch.arange(n) for b, n in enumerate(lengths)])
    case.kv_cache = torch.zeros(3, block_size, 1, 656, dtype=torch.int8)
    float_kr = case.kr_cache
    case.kr_cache = torch.empty((1, 2, 1, 0), dtype=BF16)
    clip = torch.ones(1)
    q_nope, q_pe, _, _, _ = torch_npu.npu_mla_prolog_v3(
        *case.weights(), case.kv_cache, case.kr_cache, cache_index=case.cache_index, kv_cache_quant_mode=3,
        ckvkr_repo_mode=1, quant_scale_repo_mode=1, tile_size=128, k_nope_clip_alpha=clip, **quant)
    last = torch.tensor(lengths).cumsum(0) - 1
    indices = torch.full((2, 1, max(lengths)), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        indices[b, 0, :n] = torch.arange(n)
    scale = 0.05
    attention = torch_npu.npu_kv_quant_sparse_flash_attention(
        torch.cat([q_nope[last], q_pe[last]], -1).contiguous(), case.kv_cache, case.kv_cache, indices, scale, 2, 2,
        block_table=table, actual_seq_lengths_query=torch.tensor([1, 2], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor(lengths, dtype=torch.int32), layout_query="TND", layout_kv="PA_BSND",
        sparse_mode=3, attention_mode=2, quant_scale_repo_mode=1, tile_size=128, rope_head_dim=64)
    oracle = mla_prolog_oracle(*case.weights(), torch.zeros(3, block_size, 1, 656, dtype=torch.int8), float_kr,
                               case.cache_index, dequant_scale_w_uq_qr=quant["dequant_scale_w_uq_qr"],
                               kv_cache_quant_mode=3, tile_size=128, k_nope_clip_alpha=clip)
    plain = mla_prolog_oracle(*case.weights(), torch.zeros(3, block_size, 1, 512), float_kr, case.cache_index,
                              dequant_scale_w_uq_qr=quant["dequant_scale_w_uq_qr"])
    stored = oracle.packed_latent.view(tokens, 4, 128) * oracle.tile_scales.unsqueeze(-1)
    for latent, key_rope, tolerance in ((stored.view(tokens, 512), oracle.packed_key_rope, 1e-2),
                                        (token_rows(case, plain.kv_cache)[:, :512], plain.kr_cache.view(-1, 64)[
                                            case.cache_index], 5e-2)):
        expected = []
        for b, end in enumerate(last.tolist()):
            keys = slice(end + 1 - lengths[b], end + 1)
            scores = q_nope[end].double() @ latent[keys].T + q_pe[end].double() @ key_rope[keys].T
            expected.append(torch.softmax(scale * scores, -1) @ latent[keys])
        expected = torch.stack(expected)  # [T, N, 512]
        error = (attention.double() - expected).abs().max() / expected.abs().max()
        assert error < tolerance, (tolerance, error)
