"""Real-size fp16/bf16 dense FlashAttention on a CUDA GPU: the Triton kernels against an fp32 golden
(docs/semantics/masks.md, docs/semantics/invalid-rows.md, docs/semantics/pse.md, docs/semantics/dropout.md,
docs/semantics/softmax-stats.md, docs/semantics/precision.md). Run with `pytest -m gpu tests/test_gpu_dense.py`; skipped
without CUDA.

Golden: the reference backend on the same (rounded) inputs upcast to fp32. Naive (flash-attn rule): plain
PyTorch in the input dtype, materialising the score matrix, with autograd for the gradients.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn.backends import dispatch_counts
from cann_attn.testing.precision import assert_close_to_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _visible(sq: int, skv: int, *, causal: bool = False, window: tuple[int, int] | None = None,
             prefix: int | None = None) -> torch.Tensor:
    """[Sq, Skv] bool, True = visible (right-down origin, as modes 3/4/6 with delta = Skv - Sq)."""
    i = torch.arange(sq, device=DEV).view(-1, 1)
    j = torch.arange(skv, device=DEV).view(1, -1)
    d = j - i - (skv - sq)
    vis = torch.ones(sq, skv, dtype=torch.bool, device=DEV)
    if causal:
        vis &= d <= 0
    if window is not None:
        vis &= (d >= -window[0]) & (d <= window[1])
    if prefix is not None:
        vis = (d <= 0) | (j < prefix)
    return vis


def _naive(q, k, v, dy, scale, visible, bias=None, keep=None, keep_prob=1.0):
    """Plain PyTorch in the input dtype (BNSD, GQA by repeat): out and grads."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    if keep is not None:
        p = p * keep / keep_prob
    out = p @ vv
    out.backward(dy)
    return out.detach(), q.grad, k.grad, v.grad


def _run(dtype, *, b=2, n1=8, n2=8, sq=2048, skv=2048, d=128, mode_kw=None, visible=None, bias=None,
         pse_kw=None, keep_prob=1.0):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, n1, sq, d, generator=gen).to(DEV, dtype)
    k = torch.randn(b, n2, skv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(b, n2, skv, d, generator=gen).to(DEV, dtype)
    dy = torch.randn(b, n1, sq, d, generator=gen).to(DEV, dtype)
    scale = d**-0.5
    kw = {"scale_value": scale, **(mode_kw or {}), **(pse_kw or {})}
    keep = None
    if keep_prob < 1.0:
        numel = b * n1 * sq * skv
        mask = cann_attn.gen_drop_mask(numel, keep_prob, generator=torch.Generator().manual_seed(1)).to(DEV)
        kw.update(keep_prob=keep_prob, drop_mask=mask)
        shifts = torch.arange(8, dtype=torch.uint8, device=DEV)
        keep = ((mask.view(-1, 1) >> shifts) & 1).view(-1)[:numel].view(b, n1, sq, skv).to(dtype)
    before = dispatch_counts[("flash_attention_score_grad", "triton")]
    fwd = cann_attn.flash_attention_score(q, k, v, n1, "BNSD", backend="triton", **kw)
    grads = cann_attn.flash_attention_score_grad(q, k, v, dy, n1, "BNSD", backend="triton", softmax_max=fwd.softmax_max,
                                                 softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out, **kw)
    assert dispatch_counts[("flash_attention_score_grad", "triton")] == before + 1
    f32 = [t.float() for t in (q, k, v, dy)]
    gold_kw = {key: (val.float() if key == "pse" and val.dtype != torch.float32 else val) for key, val in kw.items()}
    gold = cann_attn.flash_attention_score(*f32[:3], n1, "BNSD", backend="reference", **gold_kw)
    gold_g = cann_attn.flash_attention_score_grad(*f32, n1, "BNSD", backend="reference",
                                                  softmax_max=gold.softmax_max, softmax_sum=gold.softmax_sum,
                                                  attention_in=gold.attention_out, **gold_kw)
    vis = visible if visible is not None else torch.ones(sq, skv, dtype=torch.bool, device=DEV)
    naive = _naive(q, k, v, dy, scale, vis, bias, keep, keep_prob)
    assert_close_to_oracle(fwd.attention_out, gold.attention_out, naive[0], name="attention_out")
    assert_close_to_oracle(fwd.softmax_max, gold.softmax_max, dtype=dtype, name="softmax_max")
    assert_close_to_oracle(fwd.softmax_sum, gold.softmax_sum, dtype=dtype, name="softmax_sum")
    for name, a, g, nv in zip(("dq", "dk", "dv"), grads[:3], gold_g[:3], naive[1:], strict=True):
        assert_close_to_oracle(a, g, nv, name=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dense_and_causal(dtype):
    _run(dtype)
    _run(dtype, mode_kw={"atten_mask": cann_attn.compressed_mask(3), "sparse_mode": 3},
         visible=_visible(2048, 2048, causal=True))


def test_gqa_causal_sq_lt_skv_bf16():
    _run(torch.bfloat16, n1=16, n2=2, sq=1000, skv=3000, mode_kw={"atten_mask": cann_attn.compressed_mask(3),
         "sparse_mode": 3}, visible=_visible(1000, 3000, causal=True))


def test_band_bf16():
    _run(torch.bfloat16, mode_kw={"atten_mask": cann_attn.compressed_mask(4), "sparse_mode": 4, "pre_tokens": 300,
                                  "next_tokens": 40}, visible=_visible(2048, 2048, window=(300, 40)))


def test_prefix_bf16():
    _run(torch.bfloat16, b=1, mode_kw={"atten_mask": cann_attn.compressed_mask(6), "sparse_mode": 6,
                                       "prefix": [700]}, visible=_visible(2048, 2048, prefix=700))


def test_alibi_bf16():
    n = 8
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / n) for h in range(n)], device=DEV)
    i = torch.arange(2048, device=DEV).view(-1, 1)
    j = torch.arange(2048, device=DEV).view(1, -1)
    bias = -slopes.view(1, n, 1, 1) * (j - i).abs()
    _run(torch.bfloat16, pse_kw={"pse": slopes, "pse_type": 2}, bias=bias)


def test_dropout_fp16():
    _run(torch.float16, b=1, sq=1024, skv=1024, keep_prob=0.9)


def test_varlen_tnd_bf16():
    """Packed documents, causal per document, against the reference backend in fp32."""
    gen = torch.Generator().manual_seed(0)
    lens = [1, 700, 1500, 63, 2048, 500]
    cum = torch.tensor(lens).cumsum(0).tolist()
    t, n, d = sum(lens), 8, 128
    q, k, v, dy = (torch.randn(t, n, d, generator=gen).to(DEV, torch.bfloat16) for _ in range(4))
    kw = {"scale_value": d**-0.5, "atten_mask": cann_attn.compressed_mask(3), "sparse_mode": 3,
          "actual_seq_qlen": cum, "actual_seq_kvlen": cum}
    fwd = cann_attn.flash_attention_var_len_score(q, k, v, n, backend="triton", **kw)
    grads = cann_attn.flash_attention_score_grad(q, k, v, dy, n, "TND", backend="triton", softmax_max=fwd.softmax_max,
                                                 softmax_sum=fwd.softmax_sum, attention_in=fwd.attention_out, **kw)
    f32 = [x.float() for x in (q, k, v, dy)]
    gold = cann_attn.flash_attention_var_len_score(*f32[:3], n, backend="reference", **kw)
    gold_g = cann_attn.flash_attention_score_grad(*f32, n, "TND", backend="reference", softmax_max=gold.softmax_max,
                                                  softmax_sum=gold.softmax_sum, attention_in=gold.attention_out, **kw)
    # Naive: each document on its own, plain bf16 PyTorch.
    naive = [torch.empty_like(x) for x in (q, q, k, v)]
    start = 0
    for length in lens:
        sl = slice(start, start + length)
        parts = [x[sl].transpose(0, 1).unsqueeze(0) for x in (q, k, v, dy)]
        res = _naive(*parts, d**-0.5, _visible(length, length, causal=True))
        for target, r in zip(naive, res, strict=True):
            target[sl] = r[0].transpose(0, 1)
        start += length
    assert_close_to_oracle(fwd.attention_out, gold.attention_out, naive[0], name="attention_out")
    for name, a, g, nv in zip(("dq", "dk", "dv"), grads[:3], gold_g[:3], naive[1:], strict=True):
        assert_close_to_oracle(a, g, nv, name=name)


def test_auto_picks_triton_and_falls_back_with_a_warning():
    """backend="auto" on CUDA tensors: Triton where supported; int8 PFA warns and runs on the reference."""
    q, k, v = (torch.randn(1, 4, 256, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    before = dispatch_counts[("flash_attention_score", "triton")]
    cann_attn.flash_attention_score(q, k, v, 4, "BNSD", scale_value=0.125)
    assert dispatch_counts[("flash_attention_score", "triton")] == before + 1
    qi, ki, vi = (torch.randint(-100, 100, (1, 4, 64, 64), device=DEV, dtype=torch.int8) for _ in range(3))
    deq = cann_attn.trans_quant_param(torch.tensor([0.01])).to(DEV)
    with pytest.warns(cann_attn.BackendFallbackWarning, match="int8"):
        cann_attn.prompt_flash_attention(qi, ki, vi, num_heads=4, input_layout="BNSD", deq_scale1=deq,
                                         quant_scale1=torch.tensor([0.02], device=DEV), deq_scale2=deq)


def test_backward_is_bitwise_deterministic_bf16():
    gen = torch.Generator().manual_seed(3)
    q, k, v, dy = (torch.randn(2, 16, 1536, 128, generator=gen).to(DEV, torch.bfloat16) for _ in range(4))
    kw = {"scale_value": 128**-0.5, "atten_mask": cann_attn.compressed_mask(3), "sparse_mode": 3}
    runs = [cann_attn.flash_attention_score_grad(q, k, v, dy, 16, "BNSD", backend="triton", **kw)[:3]
            for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows", ["full", "broadcast"])
def test_pse_tensor_with_dpse_bf16(rows):
    """pse_type 1 tensor bias with its gradient (direct writes, or atomics for the row-broadcast pse)."""
    gen = torch.Generator().manual_seed(4)
    b, n, s, d = 2, 4, 1024, 64
    q, k, v, dy = (torch.randn(b, n, s, d, generator=gen).to(DEV, torch.bfloat16) for _ in range(4))
    pse = torch.randn(b, n, s if rows == "full" else 1, s, generator=gen).to(DEV, torch.bfloat16)
    kw = {"scale_value": d**-0.5, "pse": pse, "pse_type": 1}
    ours = cann_attn.flash_attention_score_grad(q, k, v, dy, n, "BNSD", backend="triton", **kw)
    f32 = {**kw, "pse": pse.float()}
    gold = cann_attn.flash_attention_score_grad(*(t.float() for t in (q, k, v, dy)), n, "BNSD", backend="reference",
                                                **f32)
    for name, a, g in zip(("dq", "dk", "dv", "dpse"), ours[:4], gold[:4], strict=True):
        err = (a.float() - g).norm() / g.norm()
        assert err < 1e-2, (name, err.item())
