"""The Triton DSA kernels (sparse attention forward/backward, lightning indexer, indexer KL-loss backward) with an
explicit backend="triton", against the reference backend and the float64 oracle (docs/semantics/invalid-rows.md,
docs/operators/sparse_flash_attention.md, docs/operators/lightning_indexer.md, docs/semantics/precision.md). On a
machine without CUDA they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

import cann_attn
from cann_attn.backends import dispatch_counts
from dsa_utils import BF16, DT_IDS, F16, F32, F64, GRAD_NAMES, IndexerCase, SFACase

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    # CPU tensors reach the kernels only through the interpreter; GPU machines run tests/test_gpu_dsa.py.
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (no CUDA)"),
]
def _assert_same(a, b, name: str, exact: bool = False) -> None:
    if a is None or b is None:
        assert a is None and b is None, name
        return
    if exact:
        assert torch.equal(a, b), name
    else:
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=2e-3 if a.dtype in (F16, BF16) else 1e-5,
                                   atol=2e-3 if a.dtype in (F16, BF16) else 1e-5, msg=name)


# ----------------------------------------------------------------------------------------------------------
# Sparse attention
# ----------------------------------------------------------------------------------------------------------
SFA_CASES = {
    # name: (layout, SFACase keyword arguments)
    "bsnd_bs1_m3_lt": ("BSND", dict(s1=5, s2=21, block_size=1, mode=3, style="random")),
    "bsnd_bs8_m0_eq": ("BSND", dict(s1=19, s2=19, block_size=8, mode=0, style="dup")),
    "bsnd_bs16_m3_gt": ("BSND", dict(s1=24, s2=19, block_size=16, mode=3, style="middle")),
    "tnd_bs1_m0_dup": ("TND", dict(q_lens=[6, 0, 3], kv_lens=[20, 4, 9], block_size=1, mode=0, style="dup")),
    "tnd_bs32_m3_blocks": ("TND", dict(q_lens=[9, 4], kv_lens=[70, 33], block_size=32, mode=3, style="blocks")),
    "tnd_bs128_m3_lt": ("TND", dict(q_lens=[12, 3], kv_lens=[150, 2], block_size=128, mode=3, style="random", n1=1)),
    "bsnd_lengths_v_is_k": ("BSND", dict(b=3, s1=8, s2=20, q_lens=[5, 0, 8], kv_lens=[13, 7, 20], block_size=8,
                                          mode=3, style="random", value_is_key=True, nan_beyond_kv=True)),
    "bsnd_no_rope_dv": ("BSND", dict(s1=6, s2=14, d_rope=None, d_v=12, style="random")),
}


@pytest.mark.parametrize("name", list(SFA_CASES))
def test_sparse_attention_matches_reference_and_oracle(name, rng):
    layout, kw = SFA_CASES[name]
    kw = {"k": 5, "n1": 4, "d": 16, **kw}
    case = SFACase(layout, gen=rng, **kw)
    before = dispatch_counts[("sparse_flash_attention", "triton")], dispatch_counts[
        ("sparse_flash_attention_grad", "triton")]
    fwd = case.check_forward(case.forward(backend="triton"))
    grads = case.check_grads(case.grad(fwd, backend="triton"))
    assert dispatch_counts[("sparse_flash_attention", "triton")] == before[0] + 1
    assert dispatch_counts[("sparse_flash_attention_grad", "triton")] == before[1] + 1
    ref = case.forward(backend="reference")
    for a, b, n in zip(fwd, ref, ("attention_out", "softmax_max", "softmax_sum"), strict=True):
        _assert_same(a, b, n)
    ref_grads = case.grad(ref, backend="reference")
    for n in GRAD_NAMES:
        _assert_same(getattr(grads, n), getattr(ref_grads, n), n)
    det = case.grad(fwd, backend="triton", deterministic=True)
    for n in GRAD_NAMES:
        _assert_same(getattr(det, n), getattr(grads, n), n)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [F16, F32], ids=DT_IDS.get)
def test_sparse_attention_dtypes(dtype, index_dtype, rng):
    """fp16/fp32 inputs with int32/int64 indices (huge int64 entries must be skipped, not overflow)."""
    case = SFACase("TND", gen=rng, q_lens=[7, 5], kv_lens=[30, 12], block_size=8, k=5, n1=4, d=16, dtype=dtype,
                   index_dtype=index_dtype, style="random")
    if index_dtype == torch.int64:
        idx = case.inputs["sparse_indices"]
        idx[::3, 0, 1] = 2**40
    case.check_forward(case.forward(backend="triton"))
    case.check_grads(case.grad(backend="triton"))


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sparse_grad_deterministic_is_bitwise_repeatable(layout, rng):
    case = SFACase(layout, gen=rng, s1=12, s2=30, block_size=8, k=6, n1=4, style="dup")
    fwd = case.forward(backend="triton")
    runs = [case.grad(fwd, backend="triton", deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for n in GRAD_NAMES:
            _assert_same(getattr(other, n), getattr(runs[0], n), n, exact=True)
    case.check_grads(runs[0])


@pytest.mark.parametrize("dtype", [F16, F32], ids=DT_IDS.get)
def test_sparse_grad_outputs_are_separate_tensors(dtype, rng):
    """d_key, d_key_rope and d_value come out of one accumulator; each must own its memory, also in fp32 where a
    plain .to() returns a view: torch.library refuses a custom op whose outputs alias one another."""
    case = SFACase("BSND", gen=rng, s1=6, s2=14, k=4, n1=4, d=16, dtype=dtype, style="random")
    fwd = case.forward(backend="triton")
    grads = case.check_grads(case.grad(fwd, backend="triton"))
    storages = {g.untyped_storage().data_ptr() for g in (grads.d_key, grads.d_key_rope, grads.d_value)}
    assert len(storages) == 3
    assert all(g.is_contiguous() for g in (grads.d_key, grads.d_key_rope, grads.d_value))
    i = case.inputs
    kw = {k: v for k, v in case.kw.items() if k != "scale_value"}
    library_grads = cann_attn.library.sparse_flash_attention_grad(
        i["query"], i["key"], i["value"], i["sparse_indices"], case.d_out, fwd.attention_out, fwd.softmax_max,
        fwd.softmax_sum, case.kw["scale_value"], query_rope=i["query_rope"], key_rope=i["key_rope"],
        backend="triton", **kw)
    for n in GRAD_NAMES:
        _assert_same(getattr(library_grads, n), getattr(grads, n), n, exact=True)


def test_gradients_are_laid_out_like_their_inputs(rng):
    """Gradients have their input's strides (torch.empty_like), as the reference backend and the custom ops' fakes
    do: a compiled graph reads them with the fake's strides. opcheck compares real and fake, permuted inputs
    included (a query made by .transpose(1, 2) is dense but not contiguous)."""
    q = torch.randn(1, 2, 3, 8, generator=rng).transpose(1, 2)
    qr = torch.randn(1, 2, 3, 4, generator=rng).transpose(1, 2)
    k = torch.randn(1, 5, 1, 8, generator=rng)
    kr = torch.randn(1, 5, 1, 4, generator=rng)
    idx = torch.tensor([[0, 1], [2, -1], [1, 3]], dtype=torch.int32).view(1, 3, 1, 2)
    out, m, s = torch.ops.cann_attn.sparse_flash_attention(q, k, k, idx, 0.3, qr, kr, backend="triton")
    args = (q, k, k.clone(), idx, torch.randn(out.shape, generator=rng), out, m, s, 0.3, 1, qr, kr)
    result = torch.library.opcheck(torch.ops.cann_attn.sparse_flash_attention_grad.default, args,
                                   {"backend": "triton"})
    assert all(v == "SUCCESS" for v in result.values()), result
    grads = torch.ops.cann_attn.sparse_flash_attention_grad(*args, backend="triton")
    assert grads[0].stride() == torch.empty_like(q).stride() and grads[3].stride() == torch.empty_like(qr).stride()
    qi = torch.randn(1, 2, 3, 8, generator=rng).transpose(1, 2)
    w = torch.randn(1, 2, 3, generator=rng).transpose(1, 2)
    ki = torch.randn(1, 5, 1, 8, generator=rng)
    kl_args = (q, k, qi, ki, w, idx, m, s, 0.3, qr, kr)
    result = torch.library.opcheck(torch.ops.cann_attn.sparse_lightning_indexer_grad_kl_loss.default, kl_args,
                                   {"backend": "triton"})
    assert all(v == "SUCCESS" for v in result.values()), result


def test_global_deterministic_setting_reaches_the_kernels(rng, monkeypatch):
    """`deterministic` follows torch.use_deterministic_algorithms (the operator documentation: "与整网确定性参数
    use_deterministic_algorithms保持一致"), so backwards reached through autograd, which pass the default False,
    are deterministic when the user asked for it globally."""
    from cann_attn.backends.triton import indexer as triton_indexer
    from cann_attn.backends.triton import sparse_attention as triton_sfa

    seen = []
    real_sfa, real_kl = triton_sfa.sparse_backward, triton_indexer.kl_loss_backward
    monkeypatch.setattr(triton_sfa, "sparse_backward", lambda *a: seen.append(("sfa", a[-1])) or real_sfa(*a))
    monkeypatch.setattr(triton_indexer, "kl_loss_backward", lambda *a: seen.append(("kl", a[-1])) or real_kl(*a))
    sfa = SFACase("BSND", gen=rng, s1=5, s2=12, k=3, n1=4, d=16, style="random")
    kl = IndexerCase("BSND", gen=rng, s1=4, s2=6).kl_inputs(3, style="topk")
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        for enabled in (False, True):
            torch.use_deterministic_algorithms(enabled)
            sfa.grad(sfa.forward(backend="triton"), backend="triton")
            kl.kl(backend="triton")
    finally:
        torch.use_deterministic_algorithms(previous)
    assert seen == [("sfa", False), ("kl", False), ("sfa", True), ("kl", True)]


def test_sparse_rows_without_keys(rng):
    """Rows with nothing selected: output 0, softmax_max -2e38, softmax_sum 0, zero gradients
    (docs/semantics/invalid-rows.md)."""
    case = SFACase("BSND", gen=rng, s1=10, s2=6, k=3, style="topk", mode=3)
    case.inputs["sparse_indices"][0, ::2] = -1
    fwd = case.check_forward(case.forward(backend="triton"))
    dead = fwd.softmax_sum[0, 0, :, 0] == 0
    assert bool(dead.any())
    assert bool((fwd.attention_out[0][dead] == 0).all()) and bool((fwd.softmax_max[0, 0][dead] == -2e38).all())
    grads = case.check_grads(case.grad(fwd, backend="triton"))
    assert bool((grads.d_query[0][dead] == 0).all())


def test_sparse_triton_rejects_float64_with_reason(rng):
    case = SFACase("BSND", gen=rng, s1=4, s2=8, dtype=F64)
    with pytest.raises(cann_attn.ParamInvalidError, match="float64"):
        case.forward(backend="triton")
    with pytest.raises(cann_attn.ParamInvalidError, match="float64"):
        case.grad(case.forward(backend="reference"), backend="triton")


def test_sparse_triton_rejects_large_head_dim(rng):
    case = SFACase("BSND", gen=rng, s1=2, s2=4, d=520, d_rope=None, k=2)
    with pytest.raises(cann_attn.ParamInvalidError, match="head dim 520"):
        case.forward(backend="triton")


def test_sparse_attention_autograd_on_triton(rng):
    case = SFACase("TND", gen=rng, s1=7, s2=18, block_size=8, k=3, style="random", value_is_key=True)
    latent = case.inputs["key"].detach().clone().requires_grad_()
    q = case.inputs["query"].detach().clone().requires_grad_()
    out = cann_attn.sparse_attention(q, latent, latent, case.inputs["sparse_indices"],
                                     query_rope=case.inputs["query_rope"], key_rope=case.inputs["key_rope"],
                                     backend="triton", **case.kw)
    out.backward(case.d_out)
    golden = case.oracle_grads()
    torch.testing.assert_close(latent.grad.double(), golden["d_key"] + golden["d_value"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(q.grad.double(), golden["d_query"], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Lightning indexer
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_indexer_matches_reference(layout, mode, rng):
    """Integer-valued fp32 inputs: exact scores with many ties, so indices (ties to the smaller index, -1
    padding) and values must equal the reference's exactly."""
    kw = dict(q_lens=[6, 3, 0], kv_lens=[15, 7, 4]) if layout == "TND" else dict(s1=6, s2=15)
    case = IndexerCase(layout, gen=rng, dtype=F32, integer_valued=True, n_idx=3, d_idx=4, **kw)
    before = dispatch_counts[("lightning_indexer", "triton")]
    for k in (1, 4, 20):
        got = case.indexer(sparse_count=k, sparse_mode=mode, return_value=True, backend="triton")
        ref = case.indexer(sparse_count=k, sparse_mode=mode, return_value=True, backend="reference")
        assert got.sparse_indices.dtype == torch.int32
        assert torch.equal(got.sparse_indices, ref.sparse_indices), f"K={k}"
        assert torch.equal(got.sparse_values, ref.sparse_values), f"K={k}"
    assert dispatch_counts[("lightning_indexer", "triton")] == before + 3


def test_indexer_kernels_read_non_contiguous_weights(rng):
    """weights as a transposed view (head stride > 1, e.g. the output of a projection's .t()): the kernels read a
    row's heads at unit stride, so the launcher must hand them contiguous weights."""
    g = torch.Generator().manual_seed(0)
    qi = torch.randint(-3, 4, (1, 6, 3, 4), generator=g).float()
    ki = torch.randint(-3, 4, (1, 15, 1, 4), generator=g).float()
    w = torch.randint(-3, 4, (1, 6, 3), generator=g).float().permute(0, 2, 1).contiguous().permute(0, 2, 1)
    assert not w.is_contiguous()
    got = cann_attn.lightning_indexer(qi, ki, w, sparse_count=4, return_value=True, backend="triton")
    ref = cann_attn.lightning_indexer(qi, ki, w, sparse_count=4, return_value=True, backend="reference")
    assert torch.equal(got.sparse_indices, ref.sparse_indices) and torch.equal(got.sparse_values, ref.sparse_values)
    case = IndexerCase("BSND", gen=rng, s1=6, s2=15, dtype=F32, n_idx=3, d_idx=4).kl_inputs(3, style="topk")
    case.weights = case.weights.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    for a, b in zip(case.kl(backend="triton"), case.kl(backend="reference"), strict=True):
        _assert_same(a, b, "kl")


@pytest.mark.parametrize("dtype", [F16, F32], ids=DT_IDS.get)
def test_indexer_bsnd_lengths(dtype, rng):
    case = IndexerCase("BSND", gen=rng, b=3, s1=8, s2=14, q_lens=[5, 0, 8], kv_lens=[11, 6, 14], dtype=dtype,
                       integer_valued=True)
    for b, lk in enumerate([11, 6, 14]):
        case.key_index[b, lk:] = float("nan")
    got = case.indexer(sparse_count=9, return_value=True, backend="triton")
    ref = case.indexer(sparse_count=9, return_value=True, backend="reference")
    assert torch.equal(got.sparse_indices, ref.sparse_indices)
    assert torch.equal(got.sparse_values, ref.sparse_values)


def test_indexer_triton_rejects_float64_with_reason(rng):
    case = IndexerCase("BSND", gen=rng, s1=4, s2=6, dtype=F64)
    with pytest.raises(cann_attn.ParamInvalidError, match="float64"):
        case.indexer(sparse_count=3, backend="triton")


# ----------------------------------------------------------------------------------------------------------
# Indexer KL loss backward
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["indexer", "random", "dup"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_matches_reference_and_oracle(layout, style, rng):
    kw = dict(q_lens=[6, 3, 0], kv_lens=[15, 7, 4]) if layout == "TND" else dict(s1=6, s2=15)
    case = IndexerCase(layout, gen=rng, n1=8, n_idx=4, **kw).kl_inputs(5, style=style)
    before = dispatch_counts[("sparse_lightning_indexer_grad_kl_loss", "triton")]
    got = case.check_kl(case.kl(backend="triton"))
    assert dispatch_counts[("sparse_lightning_indexer_grad_kl_loss", "triton")] == before + 1
    ref = case.kl(backend="reference")
    for a, b, n in zip(got, ref, ("d_query_index", "d_key_index", "d_weights", "loss"), strict=True):
        _assert_same(a, b, n)
    det = case.kl(backend="triton", deterministic=True)
    for a, b, n in zip(det, got, ("d_query_index", "d_key_index", "d_weights", "loss"), strict=True):
        _assert_same(a, b, n)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DT_IDS.get)
def test_kl_half_precision(dtype, rng):
    case = IndexerCase("TND", gen=rng, q_lens=[6, 3], kv_lens=[15, 7], dtype=dtype).kl_inputs(5, style="indexer")
    res = case.check_kl(case.kl(backend="triton"))
    assert res.d_query_index.dtype == dtype and res.loss.dtype == F32


def test_kl_deterministic_is_bitwise_repeatable(rng):
    case = IndexerCase("BSND", gen=rng, s1=12, s2=12).kl_inputs(6, style="dup")
    runs = [case.kl(backend="triton", deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(other, runs[0], strict=True):
            assert torch.equal(a, b)


def test_kl_triton_rejects_float64_with_reason(rng):
    case = IndexerCase("BSND", gen=rng, s1=4, s2=6, dtype=F64).kl_inputs(3, style="topk")
    with pytest.raises(cann_attn.ParamInvalidError, match="float64"):
        case.kl(backend="triton")
