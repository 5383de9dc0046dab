"""The dense Triton kernels (backends/triton/dense_*.py) with backend="triton", against the reference backend.

On CPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1). Each case runs the forward and the
grad op on both backends with the same inputs and compares every output; the whole operator matrix also runs
on Triton in `make test` (CANN_ATTN_BACKEND=triton), checked there against the float64 oracle.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
import oracle
from cann_attn.backends import dispatch_counts
from cann_attn.errors import ParamInvalidError
from fa_grad_utils import GradCase
from oracle import FLT_MAX, make_compressed_mask

pytest.importorskip("triton")

TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 2e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
}


def _close(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None, dtype: torch.dtype) -> None:
    if expected is None:
        assert actual is None, f"{name}: expected None"
        return
    tol = TOL[dtype] if actual.dtype != torch.float32 or dtype == torch.float32 else TOL[torch.float32]
    if name in ("softmax_max", "softmax_sum", "dpse"):
        tol = TOL[torch.float32] if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(actual.float(), expected.float(), msg=lambda m: f"{name}: {m}", **tol)


def compare(case: GradCase, *, grad: bool = True, **kw) -> None:
    """Forward (and grad, with the forward's statistics and without) on Triton vs the reference backend."""
    kw = {**case.kw, **kw}
    before = dispatch_counts[("flash_attention_score", "triton")]
    ours = case.forward(backend="triton", **kw)
    ref = case.forward(backend="reference", **kw)
    assert dispatch_counts[("flash_attention_score", "triton")] == before + 1
    for name, a, r in zip(("attention_out", "softmax_max", "softmax_sum"), ours[:3], ref[:3], strict=True):
        _close(name, a, r, case.dtype)
    if not grad:
        return
    dy = case.randn(*ref.attention_out.shape)
    stats = {"softmax_max": ref.softmax_max, "softmax_sum": ref.softmax_sum, "attention_in": ref.attention_out}
    for extra in (stats, {}):
        args = (case.q, case.k, case.v, dy, case.n1, case.layout)
        before = dispatch_counts[("flash_attention_score_grad", "triton")]
        g_ours = cann_attn.flash_attention_score_grad(*args, backend="triton", **kw, **extra)
        g_ref = cann_attn.flash_attention_score_grad(*args, backend="reference", **kw, **extra)
        assert dispatch_counts[("flash_attention_score_grad", "triton")] == before + 1
        for name, a, r in zip(("dq", "dk", "dv", "dpse", "dsink"), g_ours, g_ref, strict=True):
            _close(name, a, r, case.dtype)


# ------------------------------------------------------------------------------------- layouts, modes
@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD", "TND"])
def test_layouts_gqa_causal(rng, layout):
    case = GradCase(layout, rng, n1=4, n2=2, sq=20, skv=27, q_lens=[20, 9], kv_lens=[27, 9])
    compare(case, sparse_mode=3, atten_mask=make_compressed_mask(3))


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5, 6])
def test_sparse_modes(rng, mode):
    case = GradCase("BSND", rng, sq=21, skv=35)
    compare(case, sparse_mode=mode, **case.mode_kwargs(mode))


@pytest.mark.parametrize("mode", [0, 2, 3, 4, 6, 7, 8])
def test_sparse_modes_tnd(rng, mode):
    case = GradCase("TND", rng, n1=2, q_lens=[18, 7, 20], kv_lens=[33, 7, 12])
    compare(case, sparse_mode=mode, **case.mode_kwargs(mode))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision(rng, dtype):
    case = GradCase("BNSD", rng, sq=19, skv=23, d=32, dtype=dtype)
    compare(case, sparse_mode=4, atten_mask=make_compressed_mask(4), pre_tokens=6, next_tokens=2)


def test_invalid_rows_are_zero_with_flt_max_statistics(rng):
    """Rows with nothing visible (docs/semantics/invalid-rows.md): out 0, max -FLT_MAX, sum +FLT_MAX, zero gradients."""
    case = GradCase("BNSD", rng, b=1, n1=2, sq=17, skv=9)
    mask = oracle.full_mask((17, 9), gen=rng)
    mask[3] = True
    mask[16] = True
    out = case.forward(backend="triton", atten_mask=mask, sparse_mode=1)
    assert out.attention_out[:, :, 3].abs().max() == 0
    assert (out.softmax_max[:, :, 16] == -FLT_MAX).all() and (out.softmax_sum[:, :, 16] == FLT_MAX).all()
    compare(case, atten_mask=mask, sparse_mode=1)
    # Right-down causal with Sq > Skv: the first Sq - Skv rows see nothing.
    compare(case, atten_mask=make_compressed_mask(3), sparse_mode=3)


# ------------------------------------------------------------------------------------- pse
@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("form", ["full", "batch_broadcast", "row_broadcast"])
def test_pse_tensor(rng, pse_type, form):
    case = GradCase("BSND", rng, b=2, n1=2, sq=18, skv=21)
    pse = case.pse_full(batch=1 if form == "batch_broadcast" else None, rows=1 if form == "row_broadcast" else None)
    compare(case, pse=pse, pse_type=pse_type, sparse_mode=3, atten_mask=make_compressed_mask(3))


def test_pse_tnd_blocks(rng):
    case = GradCase("TND", rng, n1=2, q_lens=[10, 17, 5], kv_lens=[14, 20, 9])
    compare(case, pse=case.pse_full(), pse_type=1)
    compare(case, pse=case.pse_full(batch=1), pse_type=0, sparse_mode=3, atten_mask=make_compressed_mask(3))


def test_pse_compressed_1024_rows(rng):
    """Sq == Skv > 1024 with the 1024-row Toeplitz form (its dpse accumulates with atomics)."""
    case = GradCase("BNSD", rng, b=2, n1=1, sq=1040, skv=1040, d=16)
    pse = case.randn(1, 1, 1024, 1040)
    compare(case, pse=pse, pse_type=1, sparse_mode=2, atten_mask=make_compressed_mask(2))


@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi(rng, pse_type):
    case = GradCase("TND", rng, n1=4, n2=2, q_lens=[18, 9, 4], kv_lens=[26, 9, 11])
    compare(case, pse=case.slopes(per_batch=True), pse_type=pse_type, q_start_idx=[5], kv_start_idx=[2])


# ------------------------------------------------------------------------------------- dropout, shapes
@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_dropout(rng, layout):
    case = GradCase(layout, rng, n1=2, sq=19, skv=22, q_lens=[19, 6], kv_lens=[22, 13])
    compare(case, keep_prob=0.8, drop_mask=case.drop_mask(0.8), sparse_mode=2, atten_mask=make_compressed_mask(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dv_smaller_than_dqk_mqa(rng, dtype):
    case = GradCase("BSND", rng, n1=4, n2=1, sq=15, skv=20, d=40, dv=24, dtype=dtype)
    compare(case)


def test_tnd_zero_length_sequence_and_softmax_layouts(rng):
    case = GradCase("TND", rng, n1=2, q_lens=[5, 0, 9, 3], kv_lens=[7, 4, 9, 3])
    compare(case, sparse_mode=3, atten_mask=make_compressed_mask(3))
    compare(case, softmax_layout="TND")


def test_multi_tile_online_softmax(rng):
    """Several key tiles per row block (the interpreter's 16-wide tiles) with a band that cuts some of them."""
    case = GradCase("BNSD", rng, b=1, n1=2, sq=70, skv=90)
    compare(case, sparse_mode=4, atten_mask=make_compressed_mask(4), pre_tokens=23, next_tokens=11)


def test_backward_is_deterministic(rng):
    case = GradCase("BSND", rng, n1=4, n2=1, sq=33, skv=40)
    kw = {**case.kw, "backend": "triton"}
    fwd = case.forward(**kw)
    dy = case.randn(*fwd.attention_out.shape)
    extra = {"softmax_max": fwd.softmax_max, "softmax_sum": fwd.softmax_sum, "attention_in": fwd.attention_out}
    a = cann_attn.flash_attention_score_grad(case.q, case.k, case.v, dy, case.n1, case.layout, **kw, **extra)
    b = cann_attn.flash_attention_score_grad(case.q, case.k, case.v, dy, case.n1, case.layout, **kw, **extra)
    for x, y in zip(a[:3], b[:3], strict=True):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------- PFA
@pytest.mark.parametrize("mode", [0, 3])
def test_pfa_fp16(rng, mode):
    q = torch.randn(2, 4, 13, 32, generator=rng).half()
    k = torch.randn(2, 2, 21, 32, generator=rng).half()
    v = torch.randn(2, 2, 21, 32, generator=rng).half()
    kw = {"num_heads": 4, "num_key_value_heads": 2, "input_layout": "BNSD", "scale_value": 32**-0.5,
          "actual_seq_lengths": [13, 9], "actual_seq_lengths_kv": [21, 14], "sparse_mode": mode}
    if mode == 3:
        kw["atten_mask"] = make_compressed_mask(3)
    before = dispatch_counts[("prompt_flash_attention", "triton")]
    ours = cann_attn.prompt_flash_attention(q, k, v, backend="triton", **kw)
    ref = cann_attn.prompt_flash_attention(q, k, v, backend="reference", **kw)
    assert dispatch_counts[("prompt_flash_attention", "triton")] == before + 1
    _close("attention_out", ours, ref, torch.float16)


# ------------------------------------------------------------------------------------- selection
def test_unsupported_case_raises_with_the_reason(rng):
    case = GradCase("BSND", rng, sq=5, dtype=torch.float64)
    with pytest.raises(ParamInvalidError, match=r"backend: 'triton' cannot compute.*float64"):
        case.forward(backend="triton")


def test_int8_pfa_stays_on_the_reference_backend(rng):
    q = torch.randint(-5, 5, (1, 2, 4, 16), dtype=torch.int8)
    scale = torch.tensor([1.0])
    with pytest.raises(ParamInvalidError, match="int8"):
        cann_attn.prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD", deq_scale1=scale,
                                         quant_scale1=scale, deq_scale2=scale, backend="triton")


def test_auto_on_cpu_is_the_reference_backend(rng, monkeypatch):
    monkeypatch.delenv("CANN_ATTN_BACKEND", raising=False)
    case = GradCase("BSND", rng, sq=5)
    before = dispatch_counts[("flash_attention_score", "reference")]
    case.forward()
    assert dispatch_counts[("flash_attention_score", "reference")] == before + 1


def test_plan_tnd_statistics_head_stride(rng):
    """softmax_layout "" stores per-sequence [N1, Sq_b, 8] blocks: the plan's head stride is 8 * Sq_b."""
    from cann_attn.backends.triton.dense_plan import COL, build_plan
    from cann_attn.ops.fa_problem import build_problem

    case = GradCase("TND", rng, n1=3, q_lens=[4, 0, 6], kv_lens=[5, 2, 6])
    problem, shapes = build_problem(
        case.q, case.k, case.v, 3, "TND", pse=None, drop_mask=None, atten_mask=None, prefix=None,
        actual_seq_qlen=case.kw["actual_seq_qlen"], actual_seq_kvlen=case.kw["actual_seq_kvlen"],
        q_start_idx=None, kv_start_idx=None, scale_value=1.0, keep_prob=1.0, pre_tokens=2147483647,
        next_tokens=2147483647, inner_precise=0, sparse_mode=0, pse_type=1, softmax_layout="",
        allowed_modes=(0,),
    )
    stats = torch.empty(shapes.total_q, 3, 8)
    plan = build_plan(problem, {"q": case.q, "k": case.k, "v": case.v}, stats=stats)
    table = plan.table
    assert table[:, COL["seq_q"]].tolist() == [4, 0, 6]
    assert table[[0, 2], COL["stat_hs"]].tolist() == [32, 48]
    assert table[[0, 2], COL["stat"]].tolist() == [0, 4 * 3 * 8]
    assert table[:, COL["q"]].tolist() == [0, 4 * case.q.stride(0), 4 * case.q.stride(0)]


def test_bf16_outputs_round_to_nearest_like_the_reference(rng):
    """bf16 stores round to nearest, as on a GPU (the interpreter alone would truncate: half the elements one
    ulp off), so Triton and the reference agree on almost every element of out, dq, dk and dv."""
    q, k, v, dy = (torch.randn(1, 4, 64, 32, generator=rng).to(torch.bfloat16) for _ in range(4))
    kw = {"scale_value": 32**-0.5}
    ours = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", backend="triton", **kw).attention_out
    ref = cann_attn.flash_attention_score(q, k, v, 4, "BNSD", backend="reference", **kw).attention_out
    assert (ours == ref).float().mean() > 0.98
    g_ours = cann_attn.flash_attention_score_grad(q, k, v, dy, 4, "BNSD", backend="triton", **kw)
    g_ref = cann_attn.flash_attention_score_grad(q, k, v, dy, 4, "BNSD", backend="reference", **kw)
    for name, a, r in zip(("dq", "dk", "dv"), g_ours, g_ref, strict=False):
        assert (a == r).float().mean() > 0.9, name
