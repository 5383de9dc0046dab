"""The quantised DSA inference operators on a CUDA GPU (docs/operators/quant_dsa.md): the kv-quant sparse attention
(the Triton SparseFlashAttention kernel reading the combined rows in place, dequantising them) against the float64
oracle, the quantised indexer (the Triton indexer kernel with its scales) equal to the CPU result on exact inputs, and
the dense indexer softmax statistics on their Triton kernel (collected here with the gpu mark). Run with
`pytest -m gpu tests/test_gpu_quant_dsa.py`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cann_attn.testing.precision import assert_close_to_oracle
from test_dense_indexer import test_softmax_lse_on_the_triton_kernel as test_dense_softmax_lse_on_gpu  # noqa: F401
from test_kv_quant_sfa import KvQuantCase
from test_quant_indexer import QuantCase

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _to(case, device):
    for name, value in vars(case).items():
        if isinstance(value, torch.Tensor):
            setattr(case, name, value.to(device))
    return case


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kv_quant_sparse_attention_on_gpu(layout):
    gen = torch.Generator().manual_seed(0)
    case = KvQuantCase(layout, gen, sinks=True)
    want = case.oracle()
    got = _to(case, "cuda").run()
    assert got.is_cuda
    assert_close_to_oracle(got.cpu(), want, name="attention_out")


@pytest.mark.parametrize("dtype, qdtype", [(torch.int8, torch.bfloat16), (torch.float8_e4m3fn, torch.float16)])
def test_kv_quant_kernel_dequantises_like_the_rule_on_gpu(dtype, qdtype):
    """The in-kernel dequantisation (combined rows read in place, contiguous and paged) equals the same Triton
    SparseFlashAttention kernel on the cache dequantised by problem/dequant.py, bit for bit."""
    import cann_attn
    from cann_attn.testing import dsa_quant_oracle as oracle

    gen = torch.Generator().manual_seed(1)
    case = _to(KvQuantCase("BSND", gen, dtype=dtype, qdtype=qdtype, s2=40, sinks=True), "cuda")
    k_nope, k_rope = oracle.dequantize_combined_rows(case.key, qdtype)
    want = cann_attn.sparse_flash_attention(
        case.query[..., :512], k_nope, k_nope, case.sparse_indices, case.scale, query_rope=case.query[..., 512:],
        key_rope=k_rope, sinks=case.sinks, **case.kw).attention_out
    assert torch.equal(case.run(), want)
    assert torch.equal(case.run_paged(16), want)


def test_quant_indexer_on_gpu_equals_cpu():
    gen = torch.Generator().manual_seed(0)
    case = QuantCase("BSND", gen, exact=True)
    want = case.run(sparse_count=5)
    assert torch.equal(_to(case, "cuda").run(sparse_count=5).cpu(), want)


def test_quant_indexer_paged_on_gpu_equals_cpu():
    import cann_attn

    gen = torch.Generator().manual_seed(1)
    case = QuantCase("BSND", gen, exact=True, s2=40)
    want = case.run(sparse_count=6)
    key_cache, scale_cache, table = case.paged(torch.Generator().manual_seed(2))
    got = cann_attn.quant_lightning_indexer(
        case.query.cuda(), key_cache.cuda(), case.weights.cuda(), case.query_scale.cuda(), scale_cache.cuda(),
        block_table=table.cuda(), layout_key="PA_BSND", actual_seq_lengths_query=case.q_lens,
        actual_seq_lengths_key=case.kv_lens, sparse_count=6)
    assert torch.equal(got.cpu(), want)
