"""The differentiable layer under torch.compile: `flash_attention`, `sparse_attention` and `indexer_kl_loss` trace
with `fullgraph=True` (their autograd.Functions call the custom ops while compiling) and give the eager results,
bit for bit; a tensor passed twice (DSA's latent as key and value) gets the sum of both gradients, as in eager
autograd. Compiled with the "aot_eager" backend: dynamo + AOT autograd over the real ops, no C++ code generation."""

from __future__ import annotations

import warnings

import pytest
import torch

import cann_attn


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out if out.dim() == 0 else (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()


def _run(fn, inputs, compiled: bool):
    """fn's output and the gradients of every input that requires grad, eager or compiled (fullgraph)."""
    for t in inputs:
        t.grad = None
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn(*inputs)
    _loss(out).backward()
    return out.detach(), [t.grad.clone() for t in inputs]


def _assert_compiled_matches_eager(fn, inputs) -> None:
    out_e, grads_e = _run(fn, inputs, compiled=False)
    out_c, grads_c = _run(fn, inputs, compiled=True)
    assert torch.equal(out_e, out_c)
    for g_e, g_c in zip(grads_e, grads_c, strict=True):
        assert torch.equal(g_e, g_c)


def _leaf(gen, *shape):
    return torch.randn(*shape, generator=gen).requires_grad_()


def test_flash_attention_fullgraph_bsnd_gqa_causal_pse(rng):
    q, k, v = _leaf(rng, 2, 9, 4, 16), _leaf(rng, 2, 11, 2, 16), _leaf(rng, 2, 11, 2, 8)
    pse = _leaf(rng, 1, 4, 9, 11)
    mask = cann_attn.compressed_mask(3)

    def fn(q, k, v, pse):
        return cann_attn.flash_attention(q, k, v, 4, "BSND", pse=pse, pse_type=0, atten_mask=mask, sparse_mode=3,
                                         scale_value=0.25)

    _assert_compiled_matches_eager(fn, [q, k, v, pse])


def test_flash_attention_fullgraph_sink_sliding_window(rng):
    """gpt-oss attention as MindSpeed-LLM calls it: a learnable per-head sink, sparse_mode 4 (sliding window), GQA;
    the sink is a leaf that gets its gradient through the compiled graph."""
    q, k, v = _leaf(rng, 1, 9, 4, 16), _leaf(rng, 1, 9, 2, 16), _leaf(rng, 1, 9, 2, 16)
    sink = _leaf(rng, 4)
    mask = cann_attn.compressed_mask(4)

    def fn(q, k, v, sink):
        return cann_attn.flash_attention(q, k, v, 4, "BSND", atten_mask=mask, sparse_mode=4, pre_tokens=3,
                                         next_tokens=0, scale_value=0.25, sink=sink)

    _assert_compiled_matches_eager(fn, [q, k, v, sink])


def test_flash_attention_fullgraph_tnd_varlen(rng):
    q, k, v = _leaf(rng, 7, 2, 8), _leaf(rng, 9, 1, 8), _leaf(rng, 9, 1, 8)

    def fn(q, k, v):
        return cann_attn.flash_attention(q, k, v, 2, "TND", actual_seq_qlen=[3, 7], actual_seq_kvlen=[4, 9],
                                         scale_value=0.3)

    _assert_compiled_matches_eager(fn, [q, k, v])


def _dsa_inputs(rng, s1=6, s2=10, n1=4, d=16, dr=8, k=4):
    q, latent = _leaf(rng, 1, s1, n1, d), _leaf(rng, 1, s2, 1, d)
    q_rope, k_rope = _leaf(rng, 1, s1, n1, dr), _leaf(rng, 1, s2, 1, dr)
    allowed = torch.arange(s1) + (s2 - s1 + 1)  # sparse_mode 3: row t sees keys [0, s2 - s1 + t + 1)
    idx = torch.stack([torch.randperm(int(a), generator=rng)[:k] for a in allowed]).to(torch.int32)
    return q, latent, q_rope, k_rope, idx.view(1, s1, 1, k)


def test_sparse_attention_fullgraph_latent_as_key_and_value(rng):
    q, latent, q_rope, k_rope, idx = _dsa_inputs(rng)

    def fn(q, latent, q_rope, k_rope):
        return cann_attn.sparse_attention(q, latent, latent, idx, 0.2, query_rope=q_rope, key_rope=k_rope,
                                          deterministic=True)

    _assert_compiled_matches_eager(fn, [q, latent, q_rope, k_rope])


def test_sparse_attention_fullgraph_with_sinks(rng):
    """The sinks are a leaf of the compiled graph too (docs/semantics/sinks.md)."""
    q, latent, q_rope, k_rope, idx = _dsa_inputs(rng)
    sinks = _leaf(rng, 4)

    def fn(q, latent, q_rope, k_rope, sinks):
        return cann_attn.sparse_attention(q, latent, latent, idx, 0.2, query_rope=q_rope, key_rope=k_rope,
                                          sinks=sinks)

    _assert_compiled_matches_eager(fn, [q, latent, q_rope, k_rope, sinks])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_indexer_kl_loss_fullgraph(rng, reduction):
    q, latent, q_rope, k_rope, idx = _dsa_inputs(rng)
    idx[0, 1, 0, 1:] = -1  # a row with fewer valid keys
    stats = cann_attn.sparse_flash_attention(q.detach(), latent.detach(), latent.detach(), idx, 0.2,
                                             query_rope=q_rope.detach(), key_rope=k_rope.detach())
    q_idx, k_idx, weights = _leaf(rng, 1, 6, 2, 8), _leaf(rng, 1, 10, 1, 8), _leaf(rng, 1, 6, 2)

    def fn(q_idx, k_idx, weights):
        return cann_attn.indexer_kl_loss(q, latent, q_idx, k_idx, weights, idx, stats.softmax_max, stats.softmax_sum,
                                         0.2, query_rope=q_rope, key_rope=k_rope, reduction=reduction)

    _assert_compiled_matches_eager(fn, [q_idx, k_idx, weights])


def test_one_tensor_as_key_and_value_gets_both_gradients(rng):
    """The same tensor as key and value: its gradient is dK + dV, as for two copies whose gradients are added."""
    q, kv = _leaf(rng, 1, 5, 2, 8), _leaf(rng, 1, 7, 2, 8)
    k2, v2 = kv.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    _loss(cann_attn.flash_attention(q, kv, kv, 2, "BSND", scale_value=0.3)).backward()
    _loss(cann_attn.flash_attention(q.detach(), k2, v2, 2, "BSND", scale_value=0.3)).backward()
    assert torch.equal(kv.grad, k2.grad + v2.grad)

    qs, latent, q_rope, k_rope, idx = _dsa_inputs(rng)
    k3, v3 = latent.detach().clone().requires_grad_(), latent.detach().clone().requires_grad_()
    _loss(cann_attn.sparse_attention(qs, latent, latent, idx, 0.2, query_rope=q_rope, key_rope=k_rope)).backward()
    _loss(cann_attn.sparse_attention(qs.detach(), k3, v3, idx, 0.2, query_rope=q_rope.detach(),
                                     key_rope=k_rope.detach())).backward()
    # Close, not equal: with value is key the kernel gets dP from the logits' GEMM (another summation order).
    torch.testing.assert_close(latent.grad, k3.grad + v3.grad, rtol=1e-5, atol=1e-6)


def test_dropout_compiles_with_a_graph_break_and_matches_eager(rng):
    """A torch.Generator cannot be traced: dropout draws its mask eagerly (a graph break), then runs as eager."""
    q, k, v = _leaf(rng, 1, 6, 2, 8), _leaf(rng, 1, 6, 2, 8), _leaf(rng, 1, 6, 2, 8)

    def fn(q, k, v):
        gen = torch.Generator().manual_seed(5)
        return cann_attn.flash_attention(q, k, v, 2, "BSND", keep_prob=0.7, generator=gen, scale_value=0.3)

    out_e, grads_e = _run(fn, [q, k, v], compiled=False)
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    out_c = torch.compile(fn, backend="aot_eager")(q, k, v)
    _loss(out_c).backward()
    assert torch.equal(out_e, out_c.detach())
    for g_e, t in zip(grads_e, (q, k, v), strict=True):
        assert torch.equal(g_e, t.grad)


def _raw_op_cases(gen):
    """(name, fn, inputs) calling each operator of `cann_attn` directly (no autograd)."""
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen) for _ in range(3))
    fwd = cann_attn.flash_attention_score(q, k, v, 2, "BSND", scale_value=0.25)
    dy = torch.randn_like(fwd.attention_out)
    sink = torch.tensor([0.5, -1.0])
    qs, latent, q_rope, k_rope, idx = (t.detach() if t.is_floating_point() else t for t in _dsa_inputs(gen))
    sfa = cann_attn.sparse_flash_attention(qs, latent, latent, idx, 0.2, query_rope=q_rope, key_rope=k_rope)
    q_idx, k_idx, weights = torch.randn(1, 6, 2, 8, generator=gen), torch.randn(1, 10, 1, 8), torch.randn(1, 6, 2)
    ring_out = torch.randn(3, 2, 64, generator=gen)
    ring_max, ring_sum = torch.randn(3, 2, 1, generator=gen).expand(3, 2, 8), torch.rand(3, 2, 1).expand(3, 2, 8) + 1
    fwd_sbh = cann_attn.flash_attention_score(q[0].transpose(0, 1).reshape(2, 8, 16), k[0].transpose(0, 1).reshape(
        2, 8, 16), v[0].transpose(0, 1).reshape(2, 8, 16), 2, "SBH")
    lse_a, lse_b = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen)
    return {
        "flash_attention_score": (lambda q, k, v: cann_attn.flash_attention_score(
            q, k, v, 2, "BSND", scale_value=0.25, atten_mask=cann_attn.compressed_mask(2), sparse_mode=2), (q, k, v)),
        "flash_attention_var_len_score": (lambda q, k, v: cann_attn.flash_attention_var_len_score(
            q[0], k[0], v[0], 2, actual_seq_qlen=[3, 8], actual_seq_kvlen=[3, 8]), (q, k, v)),
        "flash_attention_score_grad": (lambda q, k, v, dy: cann_attn.flash_attention_score_grad(
            q, k, v, dy, 2, "BSND", scale_value=0.25, softmax_max=fwd.softmax_max, softmax_sum=fwd.softmax_sum,
            attention_in=fwd.attention_out), (q, k, v, dy)),
        "flash_attention_score_grad_sink": (lambda q, k, v, dy: cann_attn.flash_attention_score_grad(
            q, k, v, dy, 2, "BSND", scale_value=0.25, sink=sink), (q, k, v, dy)),
        "flash_attention_score_sink": (lambda q, k, v: cann_attn.flash_attention_score(
            q, k, v, 2, "BSND", scale_value=0.25, sink=sink), (q, k, v)),
        "prompt_flash_attention": (lambda q, k, v: cann_attn.prompt_flash_attention(
            q, k, v, num_heads=2, input_layout="BSND", scale_value=0.25, next_tokens=2147483647), (q, k, v)),
        "fused_infer_attention_score": (lambda q, k, v: cann_attn.fused_infer_attention_score(
            q, k, v, num_heads=2, input_layout="BSND", scale=0.25, actual_seq_lengths_kv=[5],
            softmax_lse_flag=True), (q, k, v)),
        "fused_infer_attention_score_v2": (lambda q, k, v: cann_attn.fused_infer_attention_score_v2(
            q[:, :1], k, v, num_query_heads=2, input_layout="BSND_NBSD", softmax_scale=0.25,
            return_softmax_lse=True), (q, k, v)),
        "incre_flash_attention": (lambda q, k, v: cann_attn.incre_flash_attention(
            q[:, :1], k, v, num_heads=2, num_key_value_heads=1, input_layout="BSND", scale_value=0.25,
            actual_seq_lengths=[6]), (q, k[:, :, :1], v[:, :, :1])),
        "sparse_flash_attention": (lambda q, kv: cann_attn.sparse_flash_attention(
            q, kv, kv, idx, 0.2, query_rope=q_rope, key_rope=k_rope), (qs, latent)),
        "sparse_flash_attention_grad": (lambda q, kv: cann_attn.sparse_flash_attention_grad(
            q, kv, kv, idx, torch.ones_like(sfa.attention_out), sfa.attention_out, sfa.softmax_max, sfa.softmax_sum,
            0.2, query_rope=q_rope, key_rope=k_rope), (qs, latent)),
        "lightning_indexer": (lambda qi, ki, w: cann_attn.lightning_indexer(
            qi, ki, w, sparse_count=4, return_value=True), (q_idx, k_idx, weights)),
        "sparse_lightning_indexer_grad_kl_loss": (lambda qi, ki, w: cann_attn.sparse_lightning_indexer_grad_kl_loss(
            qs, latent, qi, ki, w, idx, sfa.softmax_max, sfa.softmax_sum, 0.2, query_rope=q_rope, key_rope=k_rope),
            (q_idx, k_idx, weights)),
        "ring_attention_update": (lambda a, b: cann_attn.ring_attention_update(
            a, ring_max, ring_sum, b, ring_max * 0.5, ring_sum + 1, actual_seq_qlen=[0, 1, 3],
            input_layout="TND"), (ring_out, ring_out.flip(0))),
        "ring_attention_update_sbh": (lambda a, b: cann_attn.ring_attention_update(
            a, fwd_sbh.softmax_max, fwd_sbh.softmax_sum, b, fwd_sbh.softmax_max + 1, fwd_sbh.softmax_sum),
            (fwd_sbh.attention_out, fwd_sbh.attention_out * 2)),
        "attention_update": (lambda x, y: cann_attn.attention_update([x[:, 0], y[:, 0]], [x, y], 0), (lse_a, lse_b)),
        "attention_update_with_lse": (lambda x, y: cann_attn.attention_update([x[:, 0], y[:, 0]], [x, y], 1),
                                      (lse_a, lse_b)),
    }


@pytest.mark.parametrize("name", list(_raw_op_cases(torch.Generator().manual_seed(0))))
def test_operator_fullgraph_matches_eager(rng, name):
    """Each operator called directly inside compiled code routes to its custom op (traceable.py) and returns what
    the eager call returns."""
    fn, inputs = _raw_op_cases(rng)[name]
    eager = fn(*inputs)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)
    for e, c in zip(eager if isinstance(eager, tuple) else (eager,), compiled if isinstance(compiled, tuple)
                    else (compiled,), strict=True):
        assert (e is None) == (c is None)
        if e is not None:
            assert torch.equal(e, c)
