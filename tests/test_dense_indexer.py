"""DenseLightningIndexerSoftmaxLse and DenseLightningIndexerGradKLLoss (+ `dense_indexer_kl_loss`) against the
independent float64 oracle of cann_attn.testing.dsa_quant_oracle (docs/operators/dense_lightning_indexer.md):
BSND / TND, per-batch lengths including 0, rope or not, MHA and grouped heads, the torch_npu spellings,
hypothesis fuzzing, a mutant the oracle test catches, and one error per documented constraint."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cann_attn
import cann_attn.torch_npu as torch_npu
from cann_attn.backends import dispatch_counts
from cann_attn.backends.reference import dense_indexer as kernel
from cann_attn.testing import dsa_quant_oracle as oracle
from matrix_sample import fuzz_examples

pytestmark = pytest.mark.usefixtures("single_thread")

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
LAYOUT_LENGTHS = {
    # (q lengths, kv lengths): BSND per-batch actual lengths (S1 = 6, S2 = 9) or TND sequences
    "BSND": ([6, 0, 4], [9, 5, 2]),
    "TND": ([5, 0, 3, 2], [7, 4, 3, 2]),
}


def _make(layout, gen, *, dtype=F64, n1=4, n2=4, h=3, d=8, dr=4, rope=True):
    q_lens, kv_lens = LAYOUT_LENGTHS[layout]

    def t(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dt)

    if layout == "BSND":
        b, s1, s2 = len(q_lens), 6, 9
        lead_q, lead_k = (b, s1), (b, s2)
        lens = dict(actual_seq_qlen=q_lens, actual_seq_klen=kv_lens)
        head_stats = (b, n2, s1, n1 // n2)
    else:
        ends = lambda lens: [sum(lens[: i + 1]) for i in range(len(lens))]  # noqa: E731
        lead_q, lead_k = (sum(q_lens),), (sum(kv_lens),)
        lens = dict(actual_seq_qlen=ends(q_lens), actual_seq_klen=ends(kv_lens))
        head_stats = (n2, sum(q_lens), n1 // n2)
    x = dict(query=t(*lead_q, n1, d), key=t(*lead_k, n2, d), query_index=t(*lead_q, h, d),
             key_index=t(*lead_k, 1, d), weights=t(*lead_q, h))
    # Attention statistics that make each head's probabilities sum to about one over ~S2 keys.
    x["softmax_max"] = (torch.rand(head_stats, generator=gen, dtype=F64) + 1.0).to(F32)
    x["softmax_sum"] = (torch.rand(head_stats, generator=gen, dtype=F64) * 4 + 2).to(F32)
    rope_kw = dict(query_rope=t(*lead_q, n1, dr), key_rope=t(*lead_k, n2, dr)) if rope else {}
    return x, rope_kw, dict(layout=layout, **lens)


def _lse(x, kw):
    return cann_attn.dense_lightning_indexer_softmax_lse(x["query_index"], x["key_index"], x["weights"], **kw)


def _grad_args(x, stats):
    return (x["query"], x["key"], x["query_index"], x["key_index"], x["weights"], x["softmax_max"], x["softmax_sum"],
            *stats)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_softmax_lse_matches_oracle(layout, rng):
    x, _, kw = _make(layout, rng)
    got = _lse(x, kw)
    want = oracle.dense_softmax_lse_oracle(x["query_index"], x["key_index"], x["weights"], **kw)
    assert got.softmax_max_index.dtype == F64 and got.softmax_max_index.shape == want[0].shape
    torch.testing.assert_close(got.softmax_max_index, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.softmax_sum_index, want[1], rtol=1e-12, atol=1e-12)
    # rows without a visible key (BSND: batch 2 has 4 queries and 2 keys; rows beyond the actual length)
    assert torch.equal(got.softmax_sum_index == 0, want[1] == 0)


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_grad_kl_loss_matches_oracle(layout, heads, rope, rng):
    """float64: loss and the three gradients equal the oracle's (documented dI = q - p) to rounding."""
    n1, n2 = heads
    x, rope_kw, kw = _make(layout, rng, n1=n1, n2=n2, rope=rope)
    stats = tuple(_lse(x, kw))
    res = cann_attn.dense_lightning_indexer_grad_kl_loss(*_grad_args(x, stats), 0.35, **rope_kw, **kw)
    loss = oracle.dense_kl_loss_oracle(*_grad_args(x, stats), 0.35, **rope_kw, **kw)
    grads = oracle.dense_kl_grad_oracle(*_grad_args(x, stats), 0.35, **rope_kw, **kw)
    assert res.loss.shape == (1,) and float(loss) > 0
    torch.testing.assert_close(res.loss[0], loss, rtol=1e-10, atol=1e-12)
    for got, want in zip(res[:3], grads, strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_custom_ops_opcheck(layout, rng):
    """Both operators' torch.library custom ops: schema, FakeTensor twin (shapes and dtypes of the outputs, the
    loss a [1] float tensor) and AOT dispatch with dynamic shapes, bfloat16 inputs (fp32 statistics)."""
    x, rope_kw, kw = _make(layout, rng, dtype=BF16)
    ops = torch.ops.cann_attn
    torch.library.opcheck(ops.dense_lightning_indexer_softmax_lse.default,
                          (x["query_index"], x["key_index"], x["weights"]), kw)
    stats = tuple(_lse(x, kw))
    torch.library.opcheck(ops.dense_lightning_indexer_grad_kl_loss.default, (*_grad_args(x, stats), 0.35),
                          {**rope_kw, **kw})


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_half_inputs_within_tolerance(dtype, rng):
    """fp16 / bf16 inputs (fp32 accumulation) against the float64 oracle evaluated on the same rounded inputs."""
    x, rope_kw, kw = _make("BSND", rng, dtype=dtype)
    stats = tuple(_lse(x, kw))
    want_stats = oracle.dense_softmax_lse_oracle(x["query_index"], x["key_index"], x["weights"], **kw)
    for got, want in zip(stats, want_stats, strict=True):
        assert got.dtype == F32
        torch.testing.assert_close(got.double(), want.to(F32).double(), rtol=2e-5, atol=2e-5)
    res = cann_attn.dense_lightning_indexer_grad_kl_loss(*_grad_args(x, stats), 0.35, **rope_kw, **kw)
    grads = oracle.dense_kl_grad_oracle(*_grad_args(x, stats), 0.35, **rope_kw, **kw)
    assert res.d_query_index.dtype == dtype and res.loss.dtype == F32
    torch.testing.assert_close(res.loss[0].double(),
                               oracle.dense_kl_loss_oracle(*_grad_args(x, stats), 0.35, **rope_kw, **kw),
                               rtol=1e-4, atol=1e-5)
    for got, want in zip(res[:3], grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernel (interpreter or CUDA)")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_softmax_lse_on_the_triton_kernel(layout, dtype, rng, monkeypatch):
    """DenseLightningIndexerSoftmaxLse on its Triton kernel (dispatched there under CANN_ATTN_BACKEND=triton, or
    on CUDA tensors), lengths including 0 and rows without a visible key, against the oracle; the KL grad has no
    kernel yet and says so on CUDA tensors (BackendFallbackWarning)."""
    monkeypatch.setenv("CANN_ATTN_BACKEND", "triton")
    x, rope_kw, kw = _make(layout, rng, dtype=dtype, h=5, d=16)
    want = oracle.dense_softmax_lse_oracle(x["query_index"], x["key_index"], x["weights"], **kw)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_device = {name: t.to(device) for name, t in x.items()}
    counts = dict(dispatch_counts)
    got = _lse(on_device, kw)
    assert dispatch_counts[("dense_lightning_indexer_softmax_lse", "triton")] == \
        counts.get(("dense_lightning_indexer_softmax_lse", "triton"), 0) + 1
    for value, expected in zip(got, want, strict=True):
        assert value.dtype == F32
        torch.testing.assert_close(value.cpu().double(), expected.to(F32).double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.softmax_sum_index.cpu() == 0, want[1] == 0)
    if device == "cuda":
        rope_kw = {name: t.to(device) for name, t in rope_kw.items()}
        with pytest.warns(cann_attn.BackendFallbackWarning, match="no Triton kernel"):
            cann_attn.dense_lightning_indexer_grad_kl_loss(*_grad_args(on_device, tuple(got)), 0.35, **rope_kw, **kw)


def test_autograd_form_gives_the_operator_gradients(rng):
    x, rope_kw, kw = _make("TND", rng)
    stats = tuple(_lse(x, kw))
    res = cann_attn.dense_lightning_indexer_grad_kl_loss(*_grad_args(x, stats), 0.5, **rope_kw, **kw)
    for name in ("query_index", "key_index", "weights"):
        x[name].requires_grad_()
    loss = cann_attn.dense_indexer_kl_loss(*_grad_args(x, stats), 0.5, **rope_kw, **kw)
    (2.0 * loss).backward()
    torch.testing.assert_close(loss.detach().reshape(1), res.loss)
    for name, want in zip(("query_index", "key_index", "weights"), res[:3], strict=True):
        torch.testing.assert_close(x[name].grad, 2.0 * want)


def test_torch_npu_spellings(rng):
    x, rope_kw, kw = _make("TND", rng, dtype=BF16)
    stats = torch_npu.npu_dense_lightning_indexer_softmax_lse(
        x["query_index"], x["key_index"], x["weights"], actual_seq_qlen=kw["actual_seq_qlen"],
        actual_seq_klen=kw["actual_seq_klen"], layout="TND")
    assert isinstance(stats, tuple) and len(stats) == 2
    out = torch_npu.npu_dense_lightning_indexer_grad_kl_loss(*_grad_args(x, stats), 0.5, **rope_kw, **kw)
    want = cann_attn.dense_lightning_indexer_grad_kl_loss(*_grad_args(x, stats), 0.5, **rope_kw, **kw)
    assert len(out) == 4 and all(torch.equal(a, b) for a, b in zip(out, want, strict=True))


def test_mutant_swapped_stat_heads_is_caught(rng, monkeypatch):
    """A kernel that reads the attention statistics in the wrong head order (g-major instead of n2-major) must fail
    the oracle comparison: the grouped-head test can fail."""
    x, rope_kw, kw = _make("BSND", rng, n1=4, n2=2)
    stats = tuple(_lse(x, kw))
    original = kernel.kl_loss_sequence

    def mutant(**a):
        rows = a["row_max"].shape[0]
        a["row_max"] = a["row_max"].view(rows, 2, 2).transpose(1, 2).reshape(rows, 4)
        a["row_sum"] = a["row_sum"].view(rows, 2, 2).transpose(1, 2).reshape(rows, 4)
        return original(**a)

    monkeypatch.setattr(kernel, "kl_loss_sequence", mutant)
    res = cann_attn.dense_lightning_indexer_grad_kl_loss(*_grad_args(x, stats), 0.35, **rope_kw, **kw)
    loss = oracle.dense_kl_loss_oracle(*_grad_args(x, stats), 0.35, **rope_kw, **kw)
    assert not torch.allclose(res.loss[0], loss, rtol=1e-6)


@settings(max_examples=fuzz_examples(15), deadline=None)
@given(s1=st.integers(1, 5), extra=st.integers(0, 5), h=st.integers(1, 3), group=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16), rope=st.booleans())
def test_hypothesis_softmax_lse_and_grad_kl_loss(s1, extra, h, group, seed, rope):
    gen = torch.Generator().manual_seed(seed)
    s2, n2 = s1 + extra, 2
    n1 = n2 * group

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x = dict(query=t(1, s1, n1, 4), key=t(1, s2, n2, 4), query_index=t(1, s1, h, 4), key_index=t(1, s2, 1, 4),
             weights=t(1, s1, h), softmax_max=t(1, n2, s1, group).abs() + 1, softmax_sum=t(1, n2, s1, group).abs() + 2)
    rope_kw = dict(query_rope=t(1, s1, n1, 2), key_rope=t(1, s2, n2, 2)) if rope else {}
    kw = dict(layout="BSND")
    stats = tuple(_lse(x, kw))
    for got, want in zip(stats, oracle.dense_softmax_lse_oracle(x["query_index"], x["key_index"], x["weights"]),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    res = cann_attn.dense_lightning_indexer_grad_kl_loss(*_grad_args(x, stats), 0.4, **rope_kw, **kw)
    torch.testing.assert_close(res.loss[0], oracle.dense_kl_loss_oracle(*_grad_args(x, stats), 0.4, **rope_kw, **kw),
                               rtol=1e-10, atol=1e-12)
    for got, want in zip(res[:3], oracle.dense_kl_grad_oracle(*_grad_args(x, stats), 0.4, **rope_kw, **kw),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _bad(rng, **changes):
    x, rope_kw, kw = _make("BSND", rng, dtype=BF16)
    stats = list(_lse(x, kw))
    x.update({k: v for k, v in changes.items() if k in x})
    rope_kw.update({k: v for k, v in changes.items() if k in rope_kw})
    kw.update({k: v for k, v in changes.items() if k in ("layout", "sparse_mode", "pre_tokens", "actual_seq_klen")})
    if "softmax_max_index" in changes:
        stats[0] = changes["softmax_max_index"]
    return x, rope_kw, kw, stats


@pytest.mark.parametrize("change, param", [
    (lambda x: dict(query_index=x["query_index"].to(torch.int8)), "query_index"),
    (lambda x: dict(key_index=x["key_index"].half()), "key_index"),
    (lambda x: dict(weights=x["weights"].half()), "weights"),
    (lambda x: dict(layout="BNSD"), "layout"),
    (lambda x: dict(sparse_mode=0), "sparse_mode"),
    (lambda x: dict(pre_tokens=3), "pre_tokens"),
    (lambda x: dict(key_index=x["key_index"].expand(-1, -1, 2, -1)), "key_index"),
    (lambda x: dict(weights=x["weights"][..., :2]), "weights"),
    (lambda x: dict(actual_seq_klen=[10, 1, 1]), "actual_seq_klen"),
    (lambda x: dict(key_index=x["key_index"][:, :5]), "key_index"),
])
def test_softmax_lse_errors(change, param, rng):
    x, _, kw = _make("BSND", rng, dtype=BF16)
    changes = change(x)
    x.update({k: v for k, v in changes.items() if k in x})
    kw.update({k: v for k, v in changes.items() if k not in x})
    with pytest.raises(cann_attn.ParamInvalidError, match=param):
        _lse(x, kw)


@pytest.mark.parametrize("change, param", [
    (lambda x, s: dict(query=x["query"].half()), "query"),
    (lambda x, s: dict(key=x["key"][:, :, :3]), "key"),
    (lambda x, s: dict(query=x["query"][:, :5]), "query"),
    (lambda x, s: dict(softmax_max=x["softmax_max"][:, :, :3]), "softmax_max"),
    (lambda x, s: dict(softmax_sum=x["softmax_sum"].double().half()), "softmax_sum"),
    (lambda x, s: dict(softmax_max_index=s[0][:, :, :2]), "softmax_max_index"),
    (lambda x, s: dict(softmax_sum_index=s[1].unsqueeze(0)), "softmax_sum_index"),
    (lambda x, s: dict(query_rope=None), "query_rope"),
    (lambda x, s: dict(key_rope=torch.zeros(3, 9, 4, 2, dtype=BF16)), "key_rope"),
    (lambda x, s: dict(scale_value="0.5"), "scale_value"),
])
def test_grad_kl_loss_errors(change, param, rng):
    x, rope_kw, kw = _make("BSND", rng, dtype=BF16)
    s = list(_lse(x, kw))
    args = dict(x, softmax_max_index=s[0], softmax_sum_index=s[1], scale_value=0.5, **rope_kw)
    args.update(change(x, s))
    with pytest.raises(cann_attn.ParamInvalidError, match=param):
        cann_attn.dense_lightning_indexer_grad_kl_loss(**args, **kw)


def test_missing_input_is_nullptr(rng):
    x, _, kw = _make("BSND", rng, dtype=BF16)
    with pytest.raises(cann_attn.ParamNullptrError, match="weights"):
        cann_attn.dense_lightning_indexer_softmax_lse(x["query_index"], x["key_index"], None, **kw)
