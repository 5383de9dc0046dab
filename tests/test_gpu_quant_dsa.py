"""The quantised DSA inference operators on a CUDA GPU (docs/operators/quant_dsa.md): the kv-quant sparse attention
(dequantisation, then the Triton SparseFlashAttention kernels reading the paged cache) against the float64 oracle,
and the quantised indexer (reference kernels on the GPU) equal to the CPU result. Run with
`pytest -m gpu tests/test_gpu_quant_dsa.py`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cann_attn.testing.precision import assert_close_to_oracle
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


def test_quant_indexer_on_gpu_equals_cpu():
    gen = torch.Generator().manual_seed(0)
    case = QuantCase("BSND", gen, exact=True)
    want = case.run(sparse_count=5)
    assert torch.equal(_to(case, "cuda").run(sparse_count=5).cpu(), want)
