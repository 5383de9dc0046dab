"""attention_update replaying decode context parallelism (the call pattern of vllm-ascend's DCP decode, written
from what it calls): the KV cache of each request is split over K ranks; each rank attends its query tokens to its
own keys (here flash_attention_score, lse = softmax_max + log(softmax_sum)); the per-rank outputs and lse values,
flattened to [batch * seqLen * headNum, headDim] and [batch * seqLen * headNum], are merged with attention_update.
The merged output must equal full attention over all keys (float64 oracle, tests/oracle.py), and lse_out its
log-sum-exp.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

import cann_attn
import oracle
from cann_attn.problem.stats import FLT_MAX

SCALE = 0.25


def split_points(total: int, parts: int, gen) -> list[int]:
    """Cut [0, total) into `parts` consecutive pieces of random sizes (some may be empty)."""
    cuts = sorted(torch.randint(0, total + 1, (parts - 1,), generator=gen).tolist())
    return [0, *cuts, total]


def rank_partials(q, k, v, heads, cuts, out_dtype):
    """Per-rank (lse [B*S*N], out [B*S*N, D]) from BNSD attention over keys cuts[i]:cuts[i+1]. A rank without keys
    contributes -inf lse (and zeros), as a decode kernel reports an empty KV shard."""
    b, n, s, d = q.shape
    lse_list, out_list = [], []
    for lo, hi in pairwise(cuts):
        if hi == lo:
            lse_list.append(torch.full((b * s * n,), -torch.inf))
            out_list.append(torch.zeros(b * s * n, d, dtype=out_dtype))
            continue
        res = cann_attn.flash_attention_score(q, k[:, :, lo:hi], v[:, :, lo:hi], heads, "BNSD", scale_value=SCALE)
        lse = res.softmax_max[..., 0] + torch.log(res.softmax_sum[..., 0])  # [B, N, S]
        lse_list.append(lse.permute(0, 2, 1).reshape(-1))  # rows ordered (b, s, n)
        out_list.append(res.attention_out.permute(0, 2, 1, 3).reshape(-1, d).to(out_dtype))
    return lse_list, out_list


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("update_type", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 16])
def test_merging_kv_shards_equals_full_attention(rng, parts, dtype, update_type, backend):
    b, heads, s, skv, d = 2, 3, 2, 40, 16
    q = torch.randn(b, heads, s, d, generator=rng).to(dtype)
    k = torch.randn(b, heads, skv, d, generator=rng).to(dtype)
    v = torch.randn(b, heads, skv, d, generator=rng).to(dtype)
    cuts = split_points(skv, parts, rng)
    lse_list, out_list = rank_partials(q, k, v, heads, cuts, dtype)
    out, lse_out = cann_attn.attention_update(lse_list, out_list, update_type, backend=backend)
    assert out.dtype == dtype and out.shape == (b * s * heads, d)

    golden = oracle.fa_forward_oracle(q, k, v, heads, "BNSD", scale_value=SCALE)
    naive = oracle.naive_same_dtype_forward(q, k, v, heads, "BNSD", scale_value=SCALE)
    def rows(t):
        return t.permute(0, 2, 1, 3).reshape(-1, d)

    try:
        oracle.assert_close_to_oracle(out, rows(golden[0]), rows(naive[0]), name="out")
    except AssertionError:
        # the partial outputs were stored in `dtype` before the merge (as on the NPU): two roundings
        err = (out.double() - rows(golden[0])).abs().max().item()
        assert err <= 2 * (rows(naive[0]).double() - rows(golden[0])).abs().max().item() + 1e-5
    if update_type == 0:
        assert lse_out is None
    else:
        assert lse_out.dtype == torch.float32 and lse_out.shape == (b * s * heads,)
        want = (golden[1][..., 0] + torch.log(golden[2][..., 0])).permute(0, 2, 1).reshape(-1)
        torch.testing.assert_close(lse_out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_parts_and_rows(backend):
    """A part whose lse is -inf or -FLT_MAX is not read; a row empty in every part is 0 with no NaN."""
    live_out = torch.randn(6, 8)
    live_lse = torch.randn(6)
    dead_out = torch.full((6, 8), float("nan"))
    for dead in (torch.full((6,), -torch.inf), torch.full((6,), -FLT_MAX)):
        out, lse = cann_attn.attention_update([dead, live_lse, dead], [dead_out, live_out, dead_out], 1,
                                              backend=backend)
        torch.testing.assert_close(out, live_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, live_lse, rtol=0, atol=0)
        out, lse = cann_attn.attention_update([dead, dead], [dead_out, dead_out], 1, backend=backend)
        assert torch.equal(out, torch.zeros(6, 8)) and torch.equal(lse, dead)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_tensors(backend):
    out, lse = cann_attn.attention_update([torch.empty(0)] * 2, [torch.empty(0, 8, dtype=torch.float16)] * 2, 1,
                                          backend=backend)
    assert out.shape == (0, 8) and out.dtype == torch.float16 and lse.shape == (0,)


def test_triton_matches_reference(rng):
    lse = [torch.randn(37, generator=rng) * 5 for _ in range(4)]
    lse[2][::3] = -torch.inf
    outs = [torch.randn(37, 136, generator=rng).to(torch.bfloat16) for _ in range(4)]
    ref = cann_attn.attention_update(lse, outs, 1, backend="reference")
    tri = cann_attn.attention_update(lse, outs, 1, backend="triton")
    torch.testing.assert_close(tri.out.float(), ref.out.float(), rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(tri.lse_out, ref.lse_out, rtol=1e-6, atol=1e-6)


def test_inputs_are_not_written(rng):
    lse = [torch.randn(5, generator=rng) for _ in range(2)]
    outs = [torch.randn(5, 8, generator=rng) for _ in range(2)]
    before = [t.clone() for t in lse + outs]
    cann_attn.attention_update(lse, outs, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, lse + outs, strict=True))
