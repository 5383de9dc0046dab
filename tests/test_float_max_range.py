"""Finite answers near the float maximum stay finite (docs/semantics/precision.md, "Values near the float maximum").

A fuzz found inf where the answer is about 3e38: value tensors near FLT_MAX overflowed the fp32 P V accumulation
(sum_j p_j v_j reaches Skv * max|v| before the division by the row sum), in FA, PFA and FIA decode on both reference
paths and in the Triton dense kernel (interpreted here, on the GPU in test_gpu_triton_dense.py);
`ring_attention_update` with both softmax_sums near FLT_MAX divided by their overflowing total and wrote 0.
The fixes scale by exact powers of two (`problem.stats.value_column_scales`, the halving in `problem.merge`), so
ordinary inputs keep their bits.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn.backends import dispatch_counts
from cann_attn.backends.reference import native
from paged_utils import paginate

pytestmark = pytest.mark.usefixtures("single_thread")

B, N, S, D = 2, 2, 48, 16
SCALE = 0.25
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(params=["native", "pytorch_path", "triton"])
def path(request, monkeypatch) -> str:
    if request.param == "pytorch_path":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    if request.param == "triton":
        pytest.importorskip("triton")
    return request.param


def _call(path: str, op: str, *args, **kw):
    """`op` on the path's backend, checking that the Triton kernel (not a fallback) ran."""
    backend = "triton" if path == "triton" else "reference"
    before = dispatch_counts[(op, backend)]
    result = getattr(cann_attn, op)(*args, backend=backend, **kw)
    assert dispatch_counts[(op, backend)] == before + 1, f"{op} did not run on {backend}"
    return result


def inputs_near_max(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(B, N, S, D, generator=gen).to(dtype) for _ in range(2))
    # Near FLT_MAX with both signs, one ordinary column and one tiny column (which must keep its precision).
    v = torch.rand(B, N, S, D, generator=gen) * 0.5e38 + 2.8e38
    v[..., 1::2] *= -1
    v[..., 2] = torch.randn(B, N, S, generator=gen)
    v[..., 3] = torch.randn(B, N, S, generator=gen) * 1e-30
    return q, k, v.to(dtype)


def golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * SCALE, dim=-1)
    return p @ v.double()


def assert_matches_golden(got: torch.Tensor, want: torch.Tensor, v: torch.Tensor) -> None:
    """Within the dtype's tolerance relative to each value column's magnitude (a weighted mean's error scale)."""
    assert bool(got.isfinite().all()), f"{int((~got.isfinite()).sum())} non-finite outputs where the answer is finite"
    column_scale = v.double().abs().amax(dim=-2, keepdim=True)
    error = ((got.double() - want).abs() / column_scale).max().item()
    assert error <= TOLERANCE[got.dtype], f"error {error:.3g} of the column magnitude"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flash_attention_score(path: str, dtype: torch.dtype) -> None:
    q, k, v = inputs_near_max(dtype)
    out = _call(path, "flash_attention_score", q, k, v, N, "BNSD", scale_value=SCALE)[0]
    assert_matches_golden(out, golden(q, k, v), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_flash_attention(path: str, dtype: torch.dtype) -> None:
    q, k, v = inputs_near_max(dtype)
    out = _call(path, "prompt_flash_attention", q, k, v, num_heads=N, input_layout="BNSD", scale_value=SCALE)
    assert_matches_golden(out, golden(q, k, v), v)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_infer_attention_decode(path: str, dtype: torch.dtype, paged: bool) -> None:
    q, k, v = inputs_near_max(dtype)
    q = q[:, :, :1]
    kw: dict = {"num_heads": N, "input_layout": "BNSD", "scale": SCALE}
    key, value = k, v
    if paged:
        caches, table = paginate({"key": list(k.transpose(1, 2)), "value": list(v.transpose(1, 2))}, 16,
                                 torch.Generator().manual_seed(6), garbage=0.0)
        key, value = (caches[name].permute(0, 2, 1, 3).contiguous() for name in ("key", "value"))
        kw.update(block_table=table, block_size=16, actual_seq_lengths_kv=[S] * B)
    out = _call(path, "fused_infer_attention_score", q, key, value, **kw)[0]
    assert_matches_golden(out, golden(q, k, v), v)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ring_attention_update_with_sums_near_the_maximum(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(8)
    rows, heads, dim = 4, 2, 8
    out_a, out_b = (torch.randn(rows, 1, heads * dim, generator=gen) for _ in range(2))
    max_a = torch.zeros(1, heads, rows, 8)
    max_b = torch.full((1, heads, rows, 8), -0.5)
    sum_a = torch.full((1, heads, rows, 8), 3e38)
    sum_b = torch.full((1, heads, rows, 8), 2.5e38)
    got = cann_attn.ring_attention_update(out_a, max_a, sum_a, out_b, max_b, sum_b, backend=backend)
    weight_a, weight_b = 3e38, 2.5e38 * torch.exp(torch.tensor(-0.5, dtype=torch.float64)).item()
    want = (out_a.double() * weight_a + out_b.double() * weight_b) / (weight_a + weight_b)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-6)
    assert bool((got[2] == float("inf")).all()), "the merged sum exceeds FLT_MAX: +inf, as the formula gives"


def test_inf_value_keeps_the_formula_result(path: str) -> None:
    """An inf value is not a magnitude to rescale (its column gets no scale): the output column holding it stays
    as the formulas give it (inf: +inf with every weight positive), while the near-FLT_MAX columns beside it,
    in the same rows, are rescaled and match the golden."""
    q, k, v = inputs_near_max(torch.float32)
    v = v.clone()
    v[0, 0, 5, 0] = float("inf")
    v[..., 1] = torch.randn(v.shape[:-1], generator=torch.Generator().manual_seed(9))
    out = _call(path, "flash_attention_score", q, k, v, N, "BNSD", scale_value=SCALE)[0]
    assert bool((out[0, 0, :, 0] == float("inf")).all())
    want = golden(q, k, v)
    assert_matches_golden(out[..., 1:], want[..., 1:], v[..., 1:])
    assert_matches_golden(out[1], want[1], v[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_flash_attention(path: str, dtype: torch.dtype) -> None:
    """Every key selected (sparse_mode 0), so the answer is the dense one. Before: inf where the answer is ~3e38
    on every path."""
    q, k, v = inputs_near_max(dtype)
    q, k, v = q.transpose(1, 2), k[:, :1].transpose(1, 2), v[:, :1].transpose(1, 2)  # BSND, one kv head
    indices = torch.arange(S, dtype=torch.int32).expand(B, S, 1, S).contiguous()
    out = _call(path, "sparse_flash_attention", q, k, v, indices, SCALE, sparse_mode=0)[0]
    want = golden(q.transpose(1, 2), k.transpose(1, 2).expand(B, N, S, D), v.transpose(1, 2).expand(B, N, S, D))
    assert_matches_golden(out, want.transpose(1, 2), v.transpose(1, 2))  # column scales over the keys


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_rescaling_ignores_rows_it_does_not_read(paged: bool) -> None:
    """The overflow rescaling of the decode loop takes each value column's peak over the rows the call reads only:
    NaN in padding beyond actual_seq_lengths_kv, in a sequence's last block or in blocks no table entry names
    (a converted int8 pool leaves those unconverted) once made every scale NaN and the output all NaN."""
    q, k, v = inputs_near_max(torch.float32)
    q = q[:, :, :1]
    lengths = [S - 5, S - 13]
    kw: dict = {"num_heads": N, "input_layout": "BNSD", "scale": SCALE, "actual_seq_lengths_kv": lengths}
    if paged:
        caches, table = paginate({"key": [k[b].transpose(0, 1)[:n] for b, n in enumerate(lengths)],
                                  "value": [v[b].transpose(0, 1)[:n] for b, n in enumerate(lengths)]}, 16,
                                 torch.Generator().manual_seed(6))
        key, value = (caches[name].permute(0, 2, 1, 3).contiguous() for name in ("key", "value"))
        kw.update(block_table=table, block_size=16)
    else:
        key, value = k.clone(), v.clone()
        for b, n in enumerate(lengths):
            key[b, :, n:] = float("nan")
            value[b, :, n:] = float("nan")
    if native.library() is not None:
        out = _call("native", "fused_infer_attention_score", q, key, value, **kw)[0]
    else:  # the PyTorch path gathers the pages and dispatches once per group of sequences: only the outputs count
        out = cann_attn.fused_infer_attention_score(q, key, value, backend="reference", **kw)[0]
    for b, n in enumerate(lengths):
        assert_matches_golden(out[b : b + 1], golden(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n]),
                              v[b : b + 1, :, :n])
