"""The "npu" precision mode (docs/semantics/precision.md): mode selection, the rounding primitives, and each
operator against the independent recipes of cann_attn.testing.npu_recipes (within 2 ulps of the output dtype)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError
from cann_attn.problem import precision as prec
from cann_attn.problem.mask import SequenceMask
from cann_attn.testing.npu_recipes import (
    assert_within_ulps,
    fa_grad_recipe,
    fa_recipe,
    ifa_recipe,
    kl_loss_recipe,
    op_plugin_pfa_golden,
    pfa_recipe,
    quant_indexer_recipe,
    rnd,
    sfa_grad_recipe,
    sfa_recipe,
)
from paged_utils import paginate

HALF_TYPES = [torch.float16, torch.bfloat16]


# --- mode selection ---------------------------------------------------------------------------------------------

def test_default_is_exact(monkeypatch):
    monkeypatch.delenv(prec.PRECISION_ENV, raising=False)
    assert prec.current_mode() == "exact"


def test_env_read_at_each_call_and_context_wins(monkeypatch):
    monkeypatch.setenv(prec.PRECISION_ENV, "npu")
    assert prec.npu_mode()
    with cann_attn.precision("exact"):
        assert prec.current_mode() == "exact"
        with cann_attn.precision("npu"):
            assert prec.npu_mode()
        assert not prec.npu_mode()
    monkeypatch.setenv(prec.PRECISION_ENV, "exact")
    assert not prec.npu_mode()


def test_bad_modes_name_their_source(monkeypatch):
    with pytest.raises(ParamInvalidError, match="precision"), cann_attn.precision("fp16"):
        pass
    monkeypatch.setenv(prec.PRECISION_ENV, "fast")
    with pytest.raises(ParamInvalidError, match=prec.PRECISION_ENV):
        prec.current_mode()


def test_context_is_per_thread(monkeypatch):
    monkeypatch.delenv(prec.PRECISION_ENV, raising=False)
    seen = []
    with cann_attn.precision("npu"):
        worker = threading.Thread(target=lambda: seen.append(prec.current_mode()))
        worker.start()
        worker.join()
        assert prec.npu_mode()
    assert seen == ["exact"]


def test_triton_backend_refused_and_auto_falls_back(monkeypatch):
    monkeypatch.delenv(prec.PRECISION_ENV, raising=False)
    q = torch.randn(1, 1, 4, 16, dtype=torch.float16)
    with cann_attn.precision("npu"):
        with pytest.raises(ParamInvalidError, match="npu"):
            cann_attn.flash_attention_score(q, q, q, 1, "BNSD", backend="triton")
        cann_attn.flash_attention_score(q, q, q, 1, "BNSD", backend="auto")  # reference, no error on CPU


# --- rounding primitives ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,step", [(torch.float16, 2.0**-10), (torch.bfloat16, 2.0**-7)])
def test_round_float_ties(dtype, step):
    ties = torch.tensor([1 + step / 2, 1 + 1.5 * step, -(1 + step / 2), 2 + step], dtype=torch.float64)
    even = prec.round_float(ties, dtype, prec.HALF_EVEN).double()
    away = prec.round_float(ties, dtype, prec.HALF_AWAY).double()
    assert even.tolist() == [1.0, 1 + 2 * step, -1.0, 2.0]
    assert away.tolist() == [1 + step, 1 + 2 * step, -(1 + step), 2 + 2 * step]


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_round_float_matches_torch_off_ties_and_rounds_once(dtype):
    x = torch.randn(10000, dtype=torch.float32) * 100
    assert torch.equal(prec.round_float(x, dtype), x.to(dtype))
    away = prec.round_half_away(x, dtype)
    differ = away != x.to(dtype)  # only at ties (about 1 in 2^13 fp32 values for fp16), and upward in magnitude
    assert int(differ.sum()) < 20
    assert bool((away[differ].double().abs() > x[differ].double().abs()).all())
    assert torch.equal(prec.round_float(torch.tensor([float("inf"), -float("inf"), 1e6]), torch.float16),
                       torch.tensor([float("inf"), -float("inf"), float("inf")], dtype=torch.float16))
    # Just above a tie in float64, below it after an fp32 rounding: one rounding goes up.
    above = torch.tensor([1 + 2.0**-11 + 2.0**-40], dtype=torch.float64)
    assert prec.round_float(above, torch.float16).item() == 1 + 2.0**-10


def test_recipe_rounding_agrees_with_library_rounding():
    x = torch.cat([torch.randn(5000, dtype=torch.float64), torch.tensor([1 + 2.0**-11, -(1 + 2.0**-11)])])
    for away in (False, True):
        mode = prec.HALF_AWAY if away else prec.HALF_EVEN
        assert torch.equal(rnd(x, torch.float16, away), prec.round_float(x, torch.float16, mode).float())


# --- operators against the recipes ------------------------------------------------------------------------------

def _inputs(dtype, heads=4, heads_kv=2, sq=48, skv=160, d=64, amp=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, sq, d, generator=g) * amp).to(dtype)
    k = (torch.randn(1, heads_kv, skv, d, generator=g) * amp).to(dtype)
    v = torch.randn(1, heads_kv, skv, d, generator=g).to(dtype)
    return q, k, v


def _random_mask(sq, skv, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(sq, skv, generator=g) < 0.3
    mask[:, 0] = False
    return mask


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("with_pse", [False, True])
def test_pfa_npu_mode_within_two_ulps(dtype, with_pse):
    q, k, v = _inputs(dtype)
    mask = _random_mask(q.shape[2], k.shape[2])
    pse = (torch.randn(1, 4, q.shape[2], k.shape[2]) * 0.5).to(dtype) if with_pse else None
    kwargs = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale_value=0.125, atten_mask=mask,
                  pse_shift=pse, next_tokens=2**31 - 1)  # PFA's next_tokens defaults to 0 (causal)
    with cann_attn.precision("npu"):
        out = cann_attn.prompt_flash_attention(q, k, v, **kwargs)
    # torch_npu's npu_prompt_flash_attention passes inner_precise=1: fp16 runs the high-performance (fp16) pipeline,
    # except with a pse shift, where the tiling switches fp16 to high precision.
    assert_within_ulps(out, pfa_recipe(q, k, v, 0.125, 1, mask=mask, pse=pse))
    exact = cann_attn.prompt_flash_attention(q, k, v, **kwargs)
    if dtype == torch.float16 and not with_pse:  # the recipe tells the fp16 pipeline from the fp32 one
        with pytest.raises(AssertionError):
            assert_within_ulps(exact, pfa_recipe(q, k, v, 0.125, 1, mask=mask, pse=pse))


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("inner_precise", [0, 1])
def test_fia_prefill_runs_the_pfa_pipeline_of_its_inner_precise(dtype, inner_precise):
    q, k, v = _inputs(dtype)
    with cann_attn.precision("npu"):
        out, _ = cann_attn.fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=2,
                                                       input_layout="BNSD", scale=0.125, inner_precise=inner_precise)
    assert_within_ulps(out, pfa_recipe(q, k, v, 0.125, inner_precise))
    if dtype == torch.float16:  # the two fp16 pipelines are told apart
        with pytest.raises(AssertionError):
            assert_within_ulps(out, pfa_recipe(q, k, v, 0.125, 1 - inner_precise))


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_decode_runs_the_ifa_pipeline(dtype):
    q, k, v = _inputs(dtype, sq=1, skv=300)
    q = torch.cat([q, q * 0.5])  # two sequences
    k, v = torch.cat([k, k.flip(2)]), torch.cat([v, v.flip(2)])
    recipe = ifa_recipe(q, k, v, 0.125)
    with cann_attn.precision("npu"):
        fia, _ = cann_attn.fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=2,
                                                       input_layout="BNSD", scale=0.125)
        ifa = cann_attn.incre_flash_attention(q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                                              scale_value=0.125)
        # Paged caches: the same pipeline over the gathered blocks.
        per_seq = {"key": [k[b].permute(1, 0, 2) for b in range(2)], "value": [v[b].permute(1, 0, 2) for b in range(2)]}
        caches, table = paginate(per_seq, 128, torch.Generator().manual_seed(2))
        paged, _ = cann_attn.fused_infer_attention_score(
            q.transpose(1, 2).flatten(2), caches["key"].flatten(2), caches["value"].flatten(2), num_heads=4,
            num_key_value_heads=2, input_layout="BSH", scale=0.125, block_table=table, block_size=128,
            actual_seq_lengths_kv=[300, 300])
    assert_within_ulps(fia, recipe)
    assert torch.equal(fia, ifa)
    assert torch.equal(paged, fia.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("quant1", [100.0, 127.96])  # 127.96 is no fp16 value: AscendQuant holds it as 128
def test_pfa_int8_npu_mode_within_two_ulps(quant1):
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-60, 60, (1, 2, 32, 64), generator=g, dtype=torch.int8)
    k = torch.randint(-60, 60, (1, 2, 96, 64), generator=g, dtype=torch.int8)
    v = torch.randint(-60, 60, (1, 2, 96, 64), generator=g, dtype=torch.int8)
    scales = {"deq1": 1.0 / 512, "quant1": quant1, "deq2": 1.0 / 4096}
    kwargs = dict(num_heads=2, input_layout="BNSD", scale_value=0.125,
                  deq_scale1=torch.tensor([scales["deq1"]]), quant_scale1=torch.tensor([scales["quant1"]]),
                  deq_scale2=torch.tensor([scales["deq2"]]))
    with cann_attn.precision("npu"):
        out = cann_attn.prompt_flash_attention(q, k, v, **kwargs)
    assert out.dtype == torch.float16
    assert_within_ulps(out, pfa_recipe(q, k, v, 0.125, int8=scales))


def test_pfa_scale_128_matches_op_plugin_golden():
    """Logits near 128 (q, k ~ N(0, 128^0.5), D = 128): the fp16 QK^T rounding moves whole rows; "npu" mode follows
    op-plugin's own golden where the exact golden does not."""
    d = 128
    scale = 1 / math.sqrt(d)
    q, k, v = _inputs(torch.float16, heads=2, heads_kv=2, sq=128, skv=256, d=d, amp=128**0.5, seed=0)
    golden = op_plugin_pfa_golden(q, k, v, scale)
    kwargs = dict(num_heads=2, input_layout="BNSD", scale_value=scale)
    with cann_attn.precision("npu"):
        npu = cann_attn.prompt_flash_attention(q, k, v, **kwargs)
    assert_within_ulps(npu, golden, name="npu mode vs op-plugin golden")
    exact = cann_attn.prompt_flash_attention(q, k, v, **kwargs)
    assert float((exact.float() - golden).abs().max()) > 0.1
    with pytest.raises(AssertionError):
        assert_within_ulps(exact, golden)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_fa_forward_npu_mode_within_two_ulps(dtype):
    q, k, v = _inputs(dtype)
    mask = _random_mask(q.shape[2], k.shape[2])
    with cann_attn.precision("npu"):
        result = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", atten_mask=mask, scale_value=0.125)
    out, row_max, row_sum = fa_recipe(q, k, v, 0.125, mask=mask)
    assert_within_ulps(result.attention_out, out)
    torch.testing.assert_close(result.softmax_max[..., 0], row_max, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(result.softmax_sum[..., 0], row_sum, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_fa_grad_npu_mode_within_two_ulps(dtype):
    q, k, v = _inputs(dtype)
    mask = _random_mask(q.shape[2], k.shape[2])
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    with cann_attn.precision("npu"):
        fwd = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", atten_mask=mask, scale_value=0.125)
        grads = cann_attn.flash_attention_score_grad(
            q, k, v, dy, 4, "BNSD", atten_mask=mask, attention_in=fwd.attention_out, softmax_max=fwd.softmax_max,
            softmax_sum=fwd.softmax_sum, scale_value=0.125)
    expected = fa_grad_recipe(q, k, v, dy, fwd.attention_out, fwd.softmax_max[..., 0], fwd.softmax_sum[..., 0],
                              0.125, mask=mask)
    for name, actual, recipe in zip(("dq", "dk", "dv"), grads[:3], expected, strict=True):
        assert_within_ulps(actual, recipe, name=name)


@pytest.mark.parametrize("s2,dtype", [(700, torch.float16), (1100, torch.bfloat16)])
def test_fa_npu_mode_causal_tensor_is_the_causal_band(s2, dtype):
    """Columns a mask hides add exact zeros: "npu" mode cuts them the same way whether a mask tensor or the band of
    sparse_mode 3 hides them, so both give the same bits (forward and grad)."""
    g = torch.Generator().manual_seed(11)
    q, k = ((torch.randn(1, 2, s2, 128, generator=g) * 1.5).to(dtype) for _ in range(2))
    v, dy = (torch.randn(1, 2, s2, 128, generator=g).to(dtype) for _ in range(2))
    results = []
    with cann_attn.precision("npu"):
        for mask, mode in ((torch.ones(s2, s2, dtype=torch.bool).triu(1), 0), (cann_attn.compressed_mask(3), 3)):
            fwd = cann_attn.flash_attention_score(q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=mode,
                                                  scale_value=128**-0.5)
            grads = cann_attn.flash_attention_score_grad(
                q, k, v, dy, 2, "BNSD", atten_mask=mask, sparse_mode=mode, attention_in=fwd.attention_out,
                softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum, scale_value=128**-0.5)
            results.append((fwd.attention_out, fwd.softmax_sum, *grads[:3]))
    for name, tensor_mask, band in zip(("out", "softmax_sum", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(tensor_mask, band), name


def test_visible_end_is_one_past_the_last_visible_column():
    explicit = torch.ones(1, 1, 6, 10, dtype=torch.bool)
    explicit[0, 0, 2, 3] = False
    explicit[0, 0, 4, 6] = False
    mask = SequenceMask(6, 10, explicit=explicit)
    assert mask.visible_end(0, 6, 0, 10) == 7
    assert mask.visible_end(0, 3, 0, 10) == 4  # rows 0..2 see column 3 only
    assert mask.visible_end(0, 2, 1, 10) == 1  # nothing visible: the tile's start
    assert mask.visible_end(3, 6, 5, 9) == 7
    assert SequenceMask(6, 10, upper=0).visible_end(0, 3, 0, 10) == 10  # no tensor: the band's range stands


def test_visible_columns_read_once_answer_as_the_mask_per_tile():
    """`SequenceMask.visible_columns` (the explicit mask read once per query tile) gives each key tile's
    `explicit_tile_all_masked` and `visible_end`; `row_bounds` is `masked_tile`'s band and prefix."""
    g = torch.Generator().manual_seed(5)
    explicit = torch.rand(2, 1, 40, 90, generator=g) < 0.93
    explicit[..., 30:, 50:60] = True  # a tile no row sees
    for i0, i1 in ((0, 16), (16, 40), (8, 9)):
        columns = SequenceMask(40, 90, explicit=explicit).visible_columns(i0, i1, 10, 90)
        for j0, j1 in ((10, 20), (20, 90), (50, 60), (61, 62), (30, 30)):
            mask = SequenceMask(40, 90, explicit=explicit)
            assert columns.all_masked(j0, j1) == mask.explicit_tile_all_masked(i0, i1, j0, j1)
            assert columns.visible_end(j0, j1) == mask.visible_end(i0, i1, j0, j1)
    for lower, upper, prefix in ((None, 0, None), (-7, 3, None), (-5, None, None), (None, 12, 30), (2, 50, None)):
        mask = SequenceMask(40, 90, lower=lower, upper=upper, prefix=prefix)
        lo, hi = mask.row_bounds(4, 37, torch.device("cpu"))
        columns = torch.arange(90)
        visible = (columns >= lo.view(-1, 1)) & (columns < hi.view(-1, 1))
        assert torch.equal(visible, ~mask.masked_tile(4, 37, 0, 90, torch.device("cpu")))
    assert SequenceMask(40, 90).row_bounds(0, 40, torch.device("cpu")) is None


def _sparse_inputs(dtype, b=2, s1=12, s2=48, heads=4, d=32, k=16, allowed=32, seed=7):
    """BSND DSA tensors (N2 = 1) and distinct token indices below `allowed` (all visible under sparse_mode 3)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s1, heads, d, generator=g).to(dtype)
    key = torch.randn(b, s2, 1, d, generator=g).to(dtype)
    value = torch.randn(b, s2, 1, d, generator=g).to(dtype)
    idx = torch.stack([torch.stack([torch.randperm(allowed, generator=g)[:k] for _ in range(s1)]) for _ in range(b)])
    return q, key, value, idx.unsqueeze(2).to(torch.int32), g


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_sfa_forward_and_grad_npu_mode_within_two_ulps(dtype):
    q, key, value, idx, g = _sparse_inputs(dtype)
    dy = torch.randn(q.shape, generator=g).to(dtype)
    with cann_attn.precision("npu"):
        fwd = cann_attn.sparse_flash_attention(q, key, value, idx, 0.2)
        grads = cann_attn.sparse_flash_attention_grad(q, key, value, idx, dy, fwd.attention_out, fwd.softmax_max,
                                                      fwd.softmax_sum, 0.2)
    out, row_max, row_sum = sfa_recipe(q, key, value, idx, 0.2)
    assert_within_ulps(fwd.attention_out, out)
    torch.testing.assert_close(fwd.softmax_max[:, 0], row_max, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fwd.softmax_sum[:, 0], row_sum, rtol=1e-5, atol=0)
    expected = sfa_grad_recipe(q, key, value, idx, dy, fwd.attention_out, fwd.softmax_max[:, 0],
                               fwd.softmax_sum[:, 0], 0.2)
    for name, actual, recipe in zip(("d_query", "d_key", "d_value"), grads[:3], expected, strict=True):
        assert_within_ulps(actual, recipe, name=name)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_kl_loss_npu_mode_within_two_ulps(dtype):
    q, key, _, idx, g = _sparse_inputs(dtype, s1=8, s2=40)
    q_index = torch.randn(2, 8, 4, 32, generator=g).to(dtype)
    k_index = torch.randn(2, 40, 1, 32, generator=g).to(dtype)
    weights = torch.randn(2, 8, 4, generator=g).to(dtype)
    stats = cann_attn.sparse_flash_attention(q, key, key, idx, 0.2)
    args = (q, key, q_index, k_index, weights, idx, stats.softmax_max, stats.softmax_sum, 0.2)
    with cann_attn.precision("npu"):
        result = cann_attn.sparse_lightning_indexer_grad_kl_loss(*args)
    *expected, loss = kl_loss_recipe(*args)
    for name, actual, recipe in zip(("d_query_index", "d_key_index", "d_weights"), result[:3], expected, strict=True):
        assert_within_ulps(actual, recipe, name=name)
    torch.testing.assert_close(result.loss, loss.reshape(1), rtol=1e-5, atol=0)
    exact = cann_attn.sparse_lightning_indexer_grad_kl_loss(*args)
    with pytest.raises(AssertionError):  # the ReLU gradient's rounding is what the recipe sees
        assert_within_ulps(exact.d_key_index, expected[1])


def test_quant_indexer_npu_mode_ranks_as_the_kernel_rounds():
    """int8 QuantLightningIndexer with fp16 weights / scales: the fp16 products and folded weights decide the order
    of near-equal scores; "npu" mode returns the recipe's indices exactly, "exact" mode does not."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (1, 16, 8, 128), generator=g, dtype=torch.int8)
    key = torch.randint(-127, 128, (1, 512, 1, 128), generator=g, dtype=torch.int8)
    weights = torch.randn(1, 16, 8, generator=g).half()
    q_scale = (torch.rand(1, 16, 8, generator=g) * 0.01 + 0.001).half()
    k_scale = (torch.rand(1, 512, 1, generator=g) * 0.01 + 0.001).half()
    args = (q, key, weights, q_scale, k_scale)
    with cann_attn.precision("npu"):
        npu = cann_attn.quant_lightning_indexer(*args, sparse_count=64, sparse_mode=0)
    recipe = quant_indexer_recipe(*args, 64)
    assert torch.equal(npu, recipe)
    assert not torch.equal(cann_attn.quant_lightning_indexer(*args, sparse_count=64, sparse_mode=0), recipe)


def test_exact_mode_is_untouched_by_the_switch(monkeypatch):
    """"exact" outputs are the same bits whether the mode is unset, set to "exact" by the environment or by the
    context manager, and after an "npu" call."""
    q, k, v = _inputs(torch.float16)
    monkeypatch.delenv(prec.PRECISION_ENV, raising=False)

    def run():
        fa = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", scale_value=0.125)
        pfa = cann_attn.prompt_flash_attention(q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                                               scale_value=0.125)
        return [fa.attention_out, fa.softmax_max, fa.softmax_sum, pfa]

    before = run()
    with cann_attn.precision("npu"):
        run()
    with cann_attn.precision("exact"):
        ctx = run()
    monkeypatch.setenv(prec.PRECISION_ENV, "exact")
    env = run()
    for a, b, c in zip(before, ctx, env, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_round_float_rounds_float64_once_near_ties(dtype):
    """float64 values a hair off a tie (where rounding through fp32 would land on the tie) and exact ties, in the
    normal and fp16 subnormal ranges, against the recipe's spacing arithmetic."""
    step = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    g = torch.Generator().manual_seed(4)
    base = (torch.randint(-2000, 2000, (4000,), generator=g).double() * step + 0.5 * step) \
        * torch.exp2(torch.randint(-20, 10, (4000,), generator=g).double())
    hair = base * 2.0**-35
    x = torch.cat([base, base + hair, base - hair, torch.tensor([3 * 2.0**-25, 5 * 2.0**-25, 2.0**-30])])
    for mode, away in ((prec.HALF_EVEN, False), (prec.HALF_AWAY, True)):
        assert torch.equal(prec.round_float(x, dtype, mode).float(), rnd(x, dtype, away))
        assert torch.equal(prec.round_float(x.float(), dtype, mode).float(), rnd(x.float(), dtype, away))


@pytest.mark.parametrize("feature", ["pse", "dropout", "sink"])
def test_fa_npu_mode_keeps_every_feature(feature):
    """pse (and its gradient), dropout and sinks reach the "npu" pipeline: its forward and gradients stay within a
    few bf16 steps of "exact" mode (dropping a feature moves them by far more)."""
    q, k, v = _inputs(torch.bfloat16, heads_kv=4, skv=48)
    g = torch.Generator().manual_seed(9)
    kwargs = {"scale_value": 0.125}
    if feature == "pse":
        kwargs.update(pse=torch.randn(1, 4, 48, 48, generator=g).to(torch.bfloat16), pse_type=1)
    elif feature == "dropout":
        numel = cann_attn.drop_mask_numel(4, batch=1, seq_q=48, seq_kv=48)
        kwargs.update(keep_prob=0.8, drop_mask=cann_attn.gen_drop_mask(numel, 0.8, generator=g))
    else:
        kwargs.update(sink=torch.full((4,), 3.0))  # a third or so of each row's weight
    dy = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    results = {}
    for mode in ("exact", "npu"):
        with cann_attn.precision(mode):
            fwd = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", **kwargs)
            grads = cann_attn.flash_attention_score_grad(q, k, v, dy, 4, "BNSD", attention_in=fwd.attention_out,
                                                         softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                         **kwargs)
        results[mode] = [fwd.attention_out, *(t for t in grads if t is not None)]
    for exact, npu in zip(*results.values(), strict=True):
        torch.testing.assert_close(npu.float(), exact.float(), rtol=0.05, atol=0.05)


# --- LightningIndexer ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [1, 3, 12, 16, 24, 64])
def test_lightning_head_sum_is_the_kernels_order(heads):
    from cann_attn.backends.reference.npu_attention import _head_sum
    from cann_attn.testing.npu_recipes import _lightning_head_sum

    g = torch.Generator().manual_seed(heads)
    terms = torch.randn(4, heads, 257, generator=g) * torch.logspace(-3, 3, heads).view(1, -1, 1)
    ours = _head_sum(terms, 16)
    assert torch.equal(ours, _lightning_head_sum(list(terms.unbind(1))))
    if heads > 2:  # the mutant: one sequential fp32 sum in head order
        sequential = terms[:, 0].clone()
        for h in range(1, heads):
            sequential += terms[:, h]
        assert not torch.equal(ours, sequential)


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("heads", [12, 64])
def test_lightning_indexer_npu_mode_is_the_recipe(dtype, heads):
    from cann_attn.testing.npu_recipes import lightning_indexer_recipe

    g = torch.Generator().manual_seed(11)
    query = torch.randn(1, 8, heads, 64, generator=g).to(dtype)
    key = torch.randn(1, 300, 1, 64, generator=g).to(dtype)
    weights = torch.randn(1, 8, heads, generator=g).to(dtype)
    with cann_attn.precision("npu"):
        indices, values = cann_attn.lightning_indexer(query, key, weights, sparse_count=48, sparse_mode=0,
                                                      return_value=True)
    want_indices, want_values = lightning_indexer_recipe(query, key, weights, 48)
    assert torch.equal(indices, want_indices)
    assert torch.equal(values, want_values)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_lightning_indexer_values_round_half_away(dtype):
    """Integer scores around 4096 (exact in fp32): the odd ones lie halfway between two fp16 neighbours (spacing 2),
    those 16 mod 32 between two bf16 ones (spacing 32); the kernel's CAST_ROUND rounds them away from zero, a plain
    cast to even."""
    from cann_attn.testing.npu_recipes import lightning_indexer_recipe

    g = torch.Generator().manual_seed(12)
    query = torch.randint(0, 5, (1, 4, 16, 64), generator=g).to(dtype)
    key = torch.randint(0, 5, (1, 256, 1, 64), generator=g).to(dtype)
    weights = torch.ones(1, 4, 16).to(dtype)
    with cann_attn.precision("npu"):
        _, values = cann_attn.lightning_indexer(query, key, weights, sparse_count=64, sparse_mode=0, return_value=True)
    _, want = lightning_indexer_recipe(query, key, weights, 64)
    assert torch.equal(values, want)
    _, exact = cann_attn.lightning_indexer(query, key, weights, sparse_count=64, sparse_mode=0, return_value=True)
    assert not torch.equal(exact, want)


# --- the merge operators: their kernels' fp32 pipeline is the "exact" one ----------------------------------------

@pytest.mark.parametrize("dtype", [*HALF_TYPES, torch.float32])  # fp32: the order of the sums shows
def test_attention_update_npu_mode_is_the_kernel_recipe(dtype):
    from cann_attn.testing.npu_recipes import attention_update_recipe

    g = torch.Generator().manual_seed(21)
    lse = [torch.randn(96, generator=g) * 4 for _ in range(5)]
    outs = [torch.randn(96, 64, generator=g).to(dtype) for _ in range(5)]
    with cann_attn.precision("npu"):
        out, lse_out = cann_attn.attention_update(lse, outs, 1)
    want_out, want_lse = attention_update_recipe(lse, outs)
    assert torch.equal(out, want_out)
    assert torch.equal(lse_out, want_lse)


@pytest.mark.parametrize("dtype", [*HALF_TYPES, torch.float32])
def test_ring_attention_update_npu_mode_is_the_kernel_recipe(dtype):
    from cann_attn.testing.npu_recipes import ring_update_recipe

    g = torch.Generator().manual_seed(22)
    s, b, n, d = 8, 2, 4, 32
    attn = [torch.randn(s, b, n * d, generator=g).to(dtype) for _ in range(2)]
    maxes = [(torch.randn(b, n, s, 1, generator=g) * 3).expand(b, n, s, 8).contiguous() for _ in range(2)]
    sums = [(torch.rand(b, n, s, 1, generator=g) * 50 + 1).expand(b, n, s, 8).contiguous() for _ in range(2)]
    with cann_attn.precision("npu"):
        out = cann_attn.ring_attention_update(attn[0], maxes[0], sums[0], attn[1], maxes[1], sums[1])[0]

    def rows(t):  # [S, B, N*D] -> [B, N, S, D]
        return t.view(s, b, n, d).permute(1, 2, 0, 3)

    want = ring_update_recipe(rows(attn[0]), maxes[0][..., :1], sums[0][..., :1], rows(attn[1]), maxes[1][..., :1],
                              sums[1][..., :1])
    assert torch.equal(rows(out), want)


def test_fa_grad_dpse_npu_mode_is_the_unrounded_score_gradient():
    """No A2/A3 FlashAttentionScoreGrad kernel writes dpse (docs/semantics/precision.md): "npu" mode gives the pse
    gradient from the fp32 dS, before dS is cast for dQ / dK, rounded once to the pse's dtype (as "exact" mode)."""
    q, k, v = _inputs(torch.bfloat16, heads_kv=4, skv=48)
    g = torch.Generator().manual_seed(9)
    pse = torch.randn(1, 4, 48, 48, generator=g).to(torch.bfloat16)
    dy = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    kwargs = {"scale_value": 0.1, "pse": pse, "pse_type": 1}
    with cann_attn.precision("npu"):
        fwd = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", **kwargs)
        dpse = cann_attn.flash_attention_score_grad(q, k, v, dy, 4, "BNSD", attention_in=fwd.attention_out,
                                                    softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                    **kwargs).dpse
    # recipe: logits = (Q K^T + pse) * scale (pse_type 1), P from the saved statistics, dS = P (dP - rowsum(dY * O))
    # in fp32; dpse = scale * dS, rounded once
    s = ((q.double() @ k.double().transpose(-1, -2)).float() + pse.float()) * 0.1
    p = torch.exp(s - fwd.softmax_max[..., :1]) / fwd.softmax_sum[..., :1]
    dp = (dy.double() @ v.double().transpose(-1, -2)).float()
    ds = p * (dp - (dy.float() * fwd.attention_out.float()).sum(-1, keepdim=True))
    recipe = rnd(ds * 0.1, torch.bfloat16).to(torch.bfloat16)
    assert torch.equal(dpse, recipe)
    # the mutant: dpse from the dS the kernel casts for dQ / dK (bf16, half away) differs (a scale that is no power
    # of two, so that the second rounding shows)
    assert not torch.equal(dpse, rnd(rnd(ds, torch.bfloat16, away=True) * 0.1, torch.bfloat16).to(torch.bfloat16))


def test_half_away_ties_near_the_float_maximum_stay_finite():
    """bf16 ties above 2^127 round away to their finite neighbour (an earlier 2y - r overflowed to inf)."""
    y = torch.tensor([0x7F648000, 0x7F528000, 0x7F088000], dtype=torch.int32).view(torch.float32)
    y = torch.cat([y, -y])
    want = rnd(y.double(), torch.bfloat16, away=True)
    assert torch.isfinite(want).all()
    assert torch.equal(prec.round_half_away(y, torch.bfloat16).float(), want)
    assert torch.equal(prec.half_away(torch.bfloat16)(y), want)


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("rounding", [prec.HALF_EVEN, prec.HALF_AWAY])
def test_native_rounding_is_the_cast_bit_for_bit(dtype, rounding):
    """The native one-pass cast of the npu pipelines gives the Cast's bits: random values of every scale, random bit
    patterns (subnormals, both fp16 ranges), ties, the overflow edge and infinities."""
    native = _native_library()
    x = _rounding_samples(dtype)
    ours = native.npu_round(x, dtype == torch.float16, rounding == prec.HALF_AWAY)
    assert torch.equal(ours.view(torch.int32), prec.Cast(dtype, rounding)(x).view(torch.int32))


@pytest.mark.parametrize("rounding", [prec.HALF_EVEN, prec.HALF_AWAY])
@pytest.mark.parametrize("logit_rounding", [None, prec.HALF_EVEN, prec.HALF_AWAY])
def test_native_wide_rounding_is_the_cast_bit_for_bit(rounding, logit_rounding):
    """The native cast of a float64 GEMM sum to fp16 (the fp16 pipelines' scores and products), alone and fused with
    the logits' scale and cast, gives the Casts' bits: the fp32 samples and values between them (whose round to
    odd decides ties)."""
    native = _native_library()
    x32 = _rounding_samples(torch.float16)
    g = torch.Generator().manual_seed(1)
    off_grid = x32.double() * (1 + (torch.rand(x32.shape, generator=g, dtype=torch.float64) - 0.5) * 2.0**-26)
    x = torch.cat([x32.double(), off_grid])
    cast = prec.Cast(torch.float16, rounding)
    if logit_rounding is None:
        ours, want = native.npu_round_wide_fp16(x, rounding == prec.HALF_AWAY), cast(x)
    else:
        scale = prec.Cast(torch.float16)(torch.tensor(128**-0.5))
        ours = native.npu_round_wide_fp16(x, rounding == prec.HALF_AWAY, float(scale),
                                          logit_rounding == prec.HALF_AWAY)
        want = prec.Cast(torch.float16, logit_rounding)(cast(x) * scale)
    assert torch.equal(ours.view(torch.int32), want.view(torch.int32))


GRAD_CASTS = [(torch.float32, prec.HALF_EVEN), (torch.bfloat16, prec.HALF_AWAY), (torch.bfloat16, prec.HALF_EVEN),
              (torch.float16, prec.HALF_AWAY), (torch.float16, prec.HALF_EVEN)]


@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("dtype,rounding", GRAD_CASTS)
def test_native_grad_scores_are_the_torch_ops_bit_for_bit(dtype, rounding, avx512):
    """The gradient's native pass (P and dS of a key tile, cast) gives the bits of the PyTorch ops it replaces, with the
    loops' exponential: fp32 S * scale, -inf where the band's bounds or the mask bytes hide a column, exp2((s - max)
    log2e) / sum, dS = (dP - D) P, each cast; values of every scale, NaN and infinities, statistics of rows that saw
    no key and a -inf max, on the AVX-512 and the AVX2 steps (a row 45 columns wide: partial vectors on both)."""
    native = _native_library()
    from cann_attn.backends.reference.softmax_exp import EXP2_FLOOR, LOG2E

    if avx512 and not native.set_avx512(True):
        pytest.skip("no AVX-512F on this CPU")
    g = torch.Generator().manual_seed(3)
    count, heads, group, rows, cols, j0 = 2, 4, 2, 5, 45, 7
    entries = count * heads // group
    s = torch.randn(entries, group * rows, cols, generator=g, dtype=torch.float64) * 8
    dp = torch.randn(entries, group * rows, cols, generator=g, dtype=torch.float64)
    dp *= 10.0 ** torch.randint(-6, 6, dp.shape, generator=g)
    s[0, 0, 3], s[0, 1, 4], s[1, 2, 5], dp[1, 0, 6], dp[0, 3, 9] = math.nan, math.inf, -math.inf, math.nan, math.inf
    n_rows = count * heads * rows
    row_max = (s.float().amax(-1).reshape(-1) * 0.125).nan_to_num(posinf=1.0)
    row_sum = torch.rand(n_rows, generator=g) * 30 + 1
    row_max[1], row_sum[1] = -3.4028234663852886e38, 3.4028234663852886e38  # a row that saw no key
    row_max[2] = -math.inf
    d_sum = torch.randn(n_rows, generator=g)
    d_sum[5] = float(dp[0, 5, 0])  # dP - D exactly 0 at one element
    lo = torch.randint(0, 20, (rows,), generator=g) + j0
    hi = lo + torch.randint(0, 40, (rows,), generator=g)
    mask = torch.rand(count, 1, rows, cols, generator=g) < 0.3
    kind = native.npu_cast_kind(dtype, rounding == prec.HALF_AWAY)
    cast = prec.Cast(dtype, rounding)
    scale = 0.08838834764831845
    try:
        for bounds, tile_mask in ((None, None), ((lo, hi, j0), None), (None, mask), ((lo, hi, j0), mask.byte() * 3)):
            p, ds = torch.empty(s.shape), torch.empty(s.shape)
            native.npu_grad_scores(s, dp, row_max, row_sum, d_sum, scale, heads, rows, p, ds, kind, kind, bounds,
                                   tile_mask)
            logits = s.to(torch.float32).view(count, heads, rows, cols) * scale
            visible = torch.ones(count, heads, rows, cols, dtype=torch.bool)
            if bounds is not None:
                columns = torch.arange(j0, j0 + cols)
                visible &= (columns >= lo.view(-1, 1)) & (columns < hi.view(-1, 1))
            if tile_mask is not None:
                visible &= tile_mask == 0
            logits = torch.where(visible, logits, -math.inf)
            stats = [t.view(count, heads, rows, 1) for t in (row_max, row_sum, d_sum)]
            want_p = native.exp2_flushed((logits - stats[0]) * LOG2E, EXP2_FLOOR) / stats[1]
            want_ds = (dp.to(torch.float32).view(want_p.shape) - stats[2]) * want_p
            for ours, want in ((p, want_p), (ds, want_ds)):
                _assert_same_bits(ours.view(want.shape), cast(want))
    finally:
        native.set_avx512(not native._switched_off(native.AVX512_SWITCH))


def _grad_cases():
    """(name, dtype, layout tensors and options) of FA grads whose tiles meet every mask form: several query and key
    tiles, GQA, two sequences."""
    g = torch.Generator().manual_seed(12)
    b, sq, skv = 2, 300, 700
    causal = torch.ones(sq, skv, dtype=torch.bool).triu(1)
    random_mask = (torch.rand(b, 1, sq, skv, generator=g) < 0.2).to(torch.uint8)
    yield "none", torch.bfloat16, {}
    yield "causal tensor", torch.float16, {"atten_mask": causal}
    yield "random uint8 mask", torch.bfloat16, {"atten_mask": random_mask}
    yield "band (sparse_mode 4)", torch.float16, {"atten_mask": cann_attn.compressed_mask(4), "sparse_mode": 4,
                                                  "pre_tokens": 200, "next_tokens": 50}
    yield "band and mask tensor", torch.bfloat16, {"atten_mask": random_mask, "pre_tokens": 150, "next_tokens": 0}
    yield "prefix (sparse_mode 6)", torch.bfloat16, {"atten_mask": cann_attn.compressed_mask(6), "sparse_mode": 6,
                                                     "prefix": [450, 600]}


@pytest.mark.parametrize("case", list(range(6)))
def test_npu_grad_native_pass_is_the_torch_path_with_its_exponential(monkeypatch, case):
    """The gradient's native pass changes no bit but the exponential's: with the PyTorch path's torch.exp swapped for
    the loops' exponential, both paths give the same dq, dk and dv under every mask form (the band's bounds, mask
    bytes, both, a prefix), GQA and several query and key tiles."""
    native = _native_library()
    from cann_attn.backends.reference import npu_attention
    from cann_attn.backends.reference.softmax_exp import EXP2_FLOOR, LOG2E

    name, dtype, options = list(_grad_cases())[case]
    g = torch.Generator().manual_seed(case)
    q = torch.randn(2, 4, 300, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 700, 64, generator=g).to(dtype) for _ in range(2))
    dy = torch.randn(q.shape, generator=g).to(dtype)
    calls = []
    real = native.npu_grad_scores
    monkeypatch.setattr(native, "npu_grad_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def grads():
        with cann_attn.precision("npu"):
            fwd = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", scale_value=0.125, **options)
            return cann_attn.flash_attention_score_grad(
                q, k, v, dy, 4, "BNSD", attention_in=fwd.attention_out, softmax_max=fwd.softmax_max,
                softmax_sum=fwd.softmax_sum, scale_value=0.125, **options)[:3]

    fused = grads()
    assert calls, "the native pass did not run"
    monkeypatch.setattr(npu_attention._GradScores, "applies", staticmethod(lambda run, k: False))
    monkeypatch.setattr(npu_attention, "_exp_shifted",
                        lambda s, row_max: native.exp2_flushed((s - row_max) * LOG2E, EXP2_FLOOR))
    count = len(calls)
    for ours, want in zip(fused, grads(), strict=True):
        assert torch.equal(ours, want), name
    assert len(calls) == count  # the PyTorch path


@pytest.mark.parametrize("native_on", [True, False])
def test_npu_grad_paired_gemms_are_the_separate_ones(monkeypatch, native_on):
    """The gradient's GEMMs taken in pairs (S with dP, dV with dK: one batched call each) give the bits of the
    separate calls: GQA (two query heads per kv head), a causal mask tensor, several query and key tiles."""
    from cann_attn.backends.reference import native, npu_attention

    if not native_on:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    g = torch.Generator().manual_seed(21)
    q = torch.randn(1, 4, 300, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 600, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    dy = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    mask = torch.ones(300, 600, dtype=torch.bool).triu(301)

    def grads():
        with cann_attn.precision("npu"):
            fwd = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", scale_value=0.125, atten_mask=mask)
            return cann_attn.flash_attention_score_grad(
                q, k, v, dy, 4, "BNSD", attention_in=fwd.attention_out, softmax_max=fwd.softmax_max,
                softmax_sum=fwd.softmax_sum, scale_value=0.125, atten_mask=mask)[:3]

    paired = grads()
    monkeypatch.setattr(npu_attention, "_paired", lambda problem: False)
    for ours, want in zip(paired, grads(), strict=True):
        assert torch.equal(ours, want)


def _assert_same_bits(ours: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equal, a NaN matching any NaN (the casts keep no payload)."""
    nan = want.isnan()
    assert torch.equal(ours.isnan(), nan)
    different = (ours.view(torch.int32) != want.view(torch.int32)) & ~nan
    assert not different.any(), (ours[different][:8], want[different][:8])


def _native_library():
    native = pytest.importorskip("cann_attn.backends.reference.native")
    if native.library() is None:
        pytest.skip("no native library on this machine")
    return native


def _rounding_samples(dtype: torch.dtype) -> torch.Tensor:
    """fp32 values of every scale, random bit patterns (subnormals, both fp16 ranges), ties of `dtype`, the overflow
    edge and infinities (no NaN: its payload is not kept); a length that is not a multiple of the vector width."""
    g = torch.Generator().manual_seed(0)
    scaled = [torch.randn(20000, generator=g) * s for s in (1e-8, 1e-5, 1e-3, 1.0, 100.0, 6e4)]
    patterns = torch.randint(0, 2**31 - 1, (50000,), generator=g, dtype=torch.int32).view(torch.float32)
    step = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    ties = (torch.arange(1, 2000, dtype=torch.float32) + 0.5) * step * 2.0**-1
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, math.inf, -math.inf, 0.0, -0.0, 2.0**-14,
                          1.5 * 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-25 - 2.0**-49])
    x = torch.cat([*scaled, patterns, -patterns, ties, -ties, edges])
    return x[~torch.isnan(x)]


def _npu_grads(seq_q: int, seq_kv: int, seed: int) -> list[torch.Tensor]:
    """dQ, dK, dV of an "npu" mode FlashAttentionScoreGrad (fp16, GQA, a causal mask tensor)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, seq_q, 64, generator=g).half()
    k, v = (torch.randn(1, 2, seq_kv, 64, generator=g).half() for _ in range(2))
    dy = torch.randn(q.shape, generator=g).half()
    mask = torch.ones(seq_q, seq_kv, dtype=torch.bool).triu(seq_kv - seq_q + 1)
    with cann_attn.precision("npu"):
        fwd = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", scale_value=0.125, atten_mask=mask)
        return list(cann_attn.flash_attention_score_grad(
            q, k, v, dy, 4, "BNSD", attention_in=fwd.attention_out, softmax_max=fwd.softmax_max,
            softmax_sum=fwd.softmax_sum, scale_value=0.125, atten_mask=mask)[:3])


def _held_bytes(workspace) -> int:
    """Bytes of the distinct storages the gradient's workspace keeps alive (its block and any view of it)."""
    tensors = [t for t in (workspace._block, *workspace._views.values()) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_npu_grad_workspace_keeps_no_stale_data_and_is_per_thread():
    """The gradient's buffers kept from call to call (per thread, docs/semantics/precision.md): a call after a larger
    one on the same thread gives the bits of that call on a fresh thread (whose workspace is its own), and a block
    within the bound stays for the next call."""
    from cann_attn.backends.reference import npu_attention

    _npu_grads(300, 700, seed=1)
    mine = npu_attention._workspace(torch.device("cpu"))
    after_large = _npu_grads(130, 200, seed=2)
    assert _held_bytes(mine) > 0
    fresh: dict[str, object] = {}

    def other_thread():
        fresh["grads"] = _npu_grads(130, 200, seed=2)
        fresh["workspace"] = npu_attention._workspace(torch.device("cpu"))

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert fresh["workspace"] is not mine
    for ours, want in zip(after_large, fresh["grads"], strict=True):
        assert torch.equal(ours.view(torch.int16), want.view(torch.int16))


def test_npu_grad_workspace_above_the_bound_is_freed_even_when_the_call_fails(monkeypatch):
    """A block larger than the bound is freed at the end of its call, views included, and so it is when the call
    raises part way."""
    from cann_attn.backends.reference import npu_attention

    monkeypatch.setattr(npu_attention, "GRAD_WORKSPACE_BYTES", 1 << 20)
    workspace = npu_attention._workspace(torch.device("cpu"))
    _npu_grads(130, 200, seed=3)
    assert _held_bytes(workspace) == 0

    def fails(*args, **kwargs):
        raise RuntimeError("part way")

    monkeypatch.setattr(npu_attention, "_backward_run", fails)
    with pytest.raises(RuntimeError, match="part way"):
        _npu_grads(130, 200, seed=3)
    assert _held_bytes(workspace) == 0
