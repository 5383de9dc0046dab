"""The dense indexer pair and the quantised DSA operators under torch.compile(fullgraph=True): called directly in
compiled code they route to their custom ops (cann_attn.library._quant_dsa) and return the eager results bit for bit;
the differentiable `dense_indexer_kl_loss` gives the eager gradients ("aot_eager": dynamo + AOT autograd over the
real ops)."""

from __future__ import annotations

import warnings

import pytest
import torch

import cann_attn
from test_dense_indexer import _grad_args, _lse, _make
from test_kv_quant_sfa import KvQuantCase
from test_quant_indexer import QuantCase

pytestmark = pytest.mark.usefixtures("single_thread")


def _compiled(fn, *inputs):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)


def _equal(a, b) -> bool:
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_quantised_operators_fullgraph_match_eager(rng):
    qli = QuantCase("TND", rng)
    kv = KvQuantCase("BSND", rng, sinks=True)
    lens_q = dict(qli.kw)
    cases = {
        "quant_lightning_indexer": (lambda q, k: cann_attn.quant_lightning_indexer(
            q, k, qli.weights, qli.query_scale, qli.key_scale, sparse_count=4, **lens_q), (qli.query, qli.key)),
        "kv_quant_sparse_flash_attention": (lambda q, c: cann_attn.kv_quant_sparse_flash_attention(
            q, c, c, kv.sparse_indices, kv.scale, sinks=kv.sinks, **kv.kw), (kv.query, kv.key)),
    }
    for name, (fn, inputs) in cases.items():
        assert _equal(fn(*inputs), _compiled(fn, *inputs)), name


def test_dense_pair_fullgraph_matches_eager(rng):
    x, rope_kw, kw = _make("BSND", rng, dtype=torch.float32)
    stats = tuple(_lse(x, kw))

    def lse(qi, ki, w):
        return cann_attn.dense_lightning_indexer_softmax_lse(qi, ki, w, **kw)

    assert _equal(tuple(lse(x["query_index"], x["key_index"], x["weights"])),
                  tuple(_compiled(lse, x["query_index"], x["key_index"], x["weights"])))

    def loss(qi, ki, w):
        args = dict(x, query_index=qi, key_index=ki, weights=w)
        return cann_attn.dense_indexer_kl_loss(*_grad_args(args, stats), 0.35, **rope_kw, **kw)

    grads = []
    for compiled in (False, True):
        leaves = [x[n].clone().requires_grad_() for n in ("query_index", "key_index", "weights")]
        value = _compiled(loss, *leaves) if compiled else loss(*leaves)
        value.backward()
        grads.append((value.detach(), *(t.grad for t in leaves)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
