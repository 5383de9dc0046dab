"""The fused dense loops' AVX-512 GEMMs (native/blas_order.c) give the BLAS's own floats: each class of shapes is
served only where a check on pseudo-random and special operands found the BLAS's order of sums, so every result must
equal the BLAS's bit for bit, special values included, and the dense operators' outputs must not depend on whether
they run (docs/guides/backends.md)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

import cann_attn
from cann_attn.backends.reference import native

pytestmark = pytest.mark.skipif(not native.has_sgemm() or not native.set_avx512(True),
                                reason="no BLAS sgemm or no AVX-512F: the ordered loops never run")

# MKL's kernels on the AMD CPUs these loops were written for sum in the order the loops reproduce, so there they must
# serve the shapes below; other CPUs' BLAS kernels may sum otherwise, and then the BLAS keeps every shape.
SERVES_HERE = "AuthenticAMD" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False

SHAPES = [(256, 512, 128), (64, 100, 130), (37, 129, 300), (128, 64, 512), (200, 48, 1000), (16, 16, 1)]


def _special(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Signed zeros, a subnormal, inf and a huge finite value sprinkled over t."""
    r = torch.rand(t.shape, generator=gen)
    for lo, hi, value in ((0.0, 0.02, 0.0), (0.02, 0.04, -0.0), (0.04, 0.05, 1e-40), (0.05, 0.055, float("inf")),
                          (0.055, 0.06, -3e38)):
        t[(r >= lo) & (r < hi)] = value
    return t


def _operands(op: int, m: int, n: int, k: int, kind: str, gen: torch.Generator):
    a = torch.randn((k, m) if op == native.GEMM_TN else (m, k), generator=gen)
    b = torch.randn((n, k) if op == native.GEMM_NT else (k, n), generator=gen)
    c = torch.randn(m, n, generator=gen)
    if kind == "special":
        a, b, c = (_special(t, gen) for t in (a, b, c))
    elif kind == "tiny":  # products in the subnormal range
        a.mul_(1e-20)
        b.mul_(1e-20)
    elif kind == "negative zeros":
        a.zero_().neg_()
        c.zero_().neg_()
    elif kind == "unaligned":  # rows starting at odd float offsets from 64-byte lines
        a, b, c = (torch.cat([torch.zeros(shift), t.flatten()])[shift:].view(t.shape) for t, shift in
                   ((a, 3), (b, 5), (c, 7)))
    return a, b, c


def _gemm(op: int, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, ordered: bool) -> torch.Tensor:
    assert native.set_ordered_gemm(ordered) == ordered
    shift = c.storage_offset()  # the same alignment as c
    out = torch.empty(shift + c.numel())[shift:].view(c.shape).copy_(c)
    native.loops_gemm(op, a, b, out)
    return out


@pytest.fixture(autouse=True)
def _restore():
    yield
    native.set_ordered_gemm(not native._switched_off(native.ORDERED_GEMM_SWITCH))
    native.set_avx512(not native._switched_off(native.AVX512_SWITCH))


@pytest.mark.parametrize("op", [native.GEMM_NT, native.GEMM_NN, native.GEMM_TN])
def test_ordered_gemms_are_bitwise_the_blas(op):
    """C = A B^T, C += A B and C += A^T B at tile shapes, ragged ones and long sums (k past 192: blocks of the sum),
    on normal values, inf / huge / subnormal / signed-zero operands, subnormal products, -0 sums and operands off
    64-byte alignment: the same bits as the BLAS (NaN payloads included), and the ordered loops took the calls (where
    the BLAS sums in their order)."""
    gen = torch.Generator().manual_seed(41)
    native.ordered_gemms()
    for (m, n, k), kind in itertools.product(SHAPES, ("normal", "special", "tiny", "negative zeros", "unaligned")):
        a, b, c = _operands(op, m, n, k, kind, gen)
        blas = _gemm(op, a, b, c, False)
        ordered = _gemm(op, a, b, c, True)
        assert torch.equal(blas.view(torch.int32), ordered.view(torch.int32)), (m, n, k, kind)
    if SERVES_HERE:
        assert native.ordered_gemms() >= 5 * (len(SHAPES) - 1)


# Shape classes the ordered loops check at most once each per process (blas_order.c, ordered_kc): three operations,
# three regimes of k, narrow or wide rows, narrow or wide columns.
ORDERED_CLASSES = 3 * 3 * 2 * 2


def test_many_shapes_check_each_class_once():
    """300 distinct GEMM shapes (4-80 rows, 12-80 columns, sums of 2-700 terms: what variable-length batches meet)
    run at most one check per class of shapes, not one per shape, and every result is the BLAS's bit for bit."""
    rng = random.Random(47)
    shapes: set[tuple[int, int, int, int]] = set()
    while len(shapes) < 300:
        shapes.add((rng.choice((native.GEMM_NT, native.GEMM_NN, native.GEMM_TN)), rng.randint(4, 80),
                    rng.randint(12, 80), rng.randint(2, 700)))
    gen = torch.Generator().manual_seed(47)
    native.ordered_probes()
    native.ordered_gemms()
    for op, m, n, k in sorted(shapes):
        a, b, c = _operands(op, m, n, k, "normal", gen)
        ordered = _gemm(op, a, b, c, True)
        blas = _gemm(op, a, b, c, False)
        assert torch.equal(blas.view(torch.int32), ordered.view(torch.int32)), (op, m, n, k)
    assert native.ordered_probes() <= ORDERED_CLASSES
    if SERVES_HERE:
        assert native.ordered_gemms() == len(shapes)


def test_variable_length_batch_checks_few_classes_and_keeps_the_blas_bits():
    """FlashAttentionScore TND and its grad over 40 sequences of 20-300 tokens (each its own GEMM shapes) give the
    same bits with the ordered loops as with the BLAS alone, and check at most one class of shapes each."""
    gen = torch.Generator().manual_seed(53)
    lengths = torch.randint(20, 300, (40,), generator=gen)
    cum = torch.cumsum(lengths, 0).tolist()
    heads, dim = 2, 64
    q, k, v, dy = (torch.randn(cum[-1], heads, dim, generator=gen) for _ in range(4))

    def bits() -> list[torch.Tensor]:
        kw = {"scale_value": dim ** -0.5, "actual_seq_qlen": cum, "actual_seq_kvlen": cum}
        fwd = cann_attn.flash_attention_score(q, k, v, heads, "TND", **kw)
        grads = cann_attn.flash_attention_score_grad(q, k, v, dy, heads, "TND", attention_in=fwd.attention_out,
                                                     softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum, **kw)
        return [t.contiguous().view(torch.uint8) for t in (fwd.attention_out, *grads[:3])]

    native.set_ordered_gemm(False)
    blas = bits()
    native.set_ordered_gemm(True)
    native.ordered_probes()
    native.ordered_gemms()
    ordered = bits()
    assert native.ordered_probes() <= ORDERED_CLASSES
    served = native.ordered_gemms()
    for x, y in zip(blas, ordered, strict=True):
        assert torch.equal(x, y)
    if SERVES_HERE:
        assert served > len(lengths)


def _dense_bits(case: dict) -> list[torch.Tensor]:
    q, k, v, dy = case["tensors"]
    kw = {key: val for key, val in case.items() if key not in ("tensors", "heads")}
    fwd = cann_attn.flash_attention_score(q, k, v, case["heads"], "BNSD", scale_value=0.125, **kw)
    grads = cann_attn.flash_attention_score_grad(q, k, v, dy, case["heads"], "BNSD", attention_in=fwd.attention_out,
                                                 softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
                                                 scale_value=0.125, **kw)
    return [t.contiguous().view(torch.uint8) for t in (fwd.attention_out, fwd.softmax_max, fwd.softmax_sum,
                                                       *grads[:3])]


def _dense_cases() -> list[dict]:
    gen = torch.Generator().manual_seed(43)

    def tensors(b, n, n_kv, s, s_kv, d, dv):
        return tuple(torch.randn(shape, generator=gen) for shape in ((b, n, s, d), (b, n_kv, s_kv, d),
                                                                      (b, n_kv, s_kv, dv), (b, n, s, dv)))

    causal = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    return [
        {"tensors": tensors(1, 2, 2, 1100, 1100, 128, 128), "heads": 2},  # packed whole pieces, 1024-row tiles
        {"tensors": tensors(1, 4, 2, 600, 700, 72, 40), "heads": 4, "atten_mask": causal, "sparse_mode": 3},
        {"tensors": tensors(2, 2, 1, 333, 1030, 256, 256), "heads": 2, "atten_mask": causal, "sparse_mode": 2},
        {"tensors": tensors(1, 2, 2, 300, 520, 64, 64), "heads": 2, "keep_prob": 0.9,
         "drop_mask": torch.randint(0, 256, (1, 2, 300, 520 // 8), generator=gen, dtype=torch.uint8)},
    ]


def test_dense_operators_are_bitwise_the_same_with_and_without_ordered_gemms():
    """FlashAttentionScore and its grad (packed whole key pieces, causal tiles cut to live columns, GQA, head dims
    past 192, dropout) give the same bits with the ordered loops as with the BLAS alone, and took them."""
    cases = _dense_cases()
    native.set_ordered_gemm(False)
    blas = [_dense_bits(case) for case in cases]
    native.set_ordered_gemm(True)
    native.ordered_gemms()
    ordered = [_dense_bits(case) for case in cases]
    served = native.ordered_gemms()
    for i, (x, y) in enumerate(zip(blas, ordered, strict=True)):
        for a, b in zip(x, y, strict=True):
            assert torch.equal(a, b), i
    if SERVES_HERE:
        assert served > 0


def test_switch_keeps_the_blas(monkeypatch):
    """CANN_ATTN_NATIVE_ORDERED_GEMM=0, read when the library loads, leaves every GEMM to the BLAS."""
    monkeypatch.setenv(native.ORDERED_GEMM_SWITCH, "0")
    monkeypatch.setattr(native, "_state", {})
    try:
        assert native.library() is not None
        gen = torch.Generator().manual_seed(47)
        a, b, c = _operands(native.GEMM_NN, 256, 128, 512, "normal", gen)
        native.ordered_gemms()
        native.loops_gemm(native.GEMM_NN, a, b, c)
        assert native.ordered_gemms() == 0
        monkeypatch.delenv(native.ORDERED_GEMM_SWITCH)
        native.set_ordered_gemm(True)
        native.loops_gemm(native.GEMM_NN, a, b, c)
        if SERVES_HERE:
            assert native.ordered_gemms() == 1
    finally:
        native.set_ordered_gemm(True)
