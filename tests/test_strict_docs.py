"""Calls beyond the operator documentation (docs/semantics/beyond-docs.md): each computes by default (against the
float64 oracle where the oracle covers it) and is refused, naming its parameter, under CANN_ATTN_STRICT_DOCS=1.
The strict side runs in a subprocess, so the variable is set before cann_attn is imported, as a tester sets it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cann_attn.problem.policy import STRICT_DOCS_ENV
from patience import HANG_SECONDS

SRC = Path(__file__).resolve().parents[1] / "src"

# `call()`: an FIA call over q with k as key and value and the keywords kw.
_FIA_QK_CALL = """
        def call():
            return cann_attn.fused_infer_attention_score(q, k, k, **kw)
        """
# ... and its `check()` against the oracle (bf16: to 2e-2).
_FIA_QK_CLOSE = _FIA_QK_CALL + """
        def check():
            out, _ = call()
            ref, _ = fia_oracle(q, k, k, **kw)
            torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
        """

# name -> (python source building the call as `call()`, the parameter the strict refusal names)
CALLS = {
    "mla decode BNSD_NBSD": ("""
        q = torch.randn(3, 2, 1, 512); qr = torch.randn(3, 2, 1, 64)
        k = torch.randn(3, 1, 20, 512); kr = torch.randn(3, 1, 20, 64)
        kw = dict(query_rope=qr, key_rope=kr, num_heads=2, num_key_value_heads=1, scale=0.04,
                  actual_seq_lengths_kv=[20, 5, 0], softmax_lse_flag=False)
        def call():
            return cann_attn.fused_infer_attention_score(q, k, k, input_layout="BNSD_NBSD", **kw)
        def check():
            out, _ = call()
            ref, _ = fia_oracle(q, k, k, input_layout="BNSD", **kw)
            assert out.shape == (2, 3, 1, 512)
            torch.testing.assert_close(out.double(), ref.permute(1, 0, 2, 3), atol=1e-4, rtol=1e-4)
        """, "input_layout"),
    "mla D=512 softmax_lse": ("""
        q = torch.randn(3, 1, 4, 512); qr = torch.randn(3, 1, 4, 64)
        k = torch.randn(3, 20, 1, 512); kr = torch.randn(3, 20, 1, 64)
        kw = dict(query_rope=qr, key_rope=kr, num_heads=4, num_key_value_heads=1, scale=0.04, input_layout="BSND",
                  actual_seq_lengths_kv=[20, 7, 0], softmax_lse_flag=True)
        """ + _FIA_QK_CALL + """
        def check():
            out, lse = call()
            ref, ref_lse = fia_oracle(q, k, k, **kw)
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
            assert (lse[2] == -3.40e38).all()  # a DCP rank without keys for this batch: merges with weight 0
        """, "softmax_lse_flag"),
    "gpt-oss TND D=64 GQA": ("""
        q = torch.randn(10, 4, 64).bfloat16(); k = torch.randn(10, 2, 64).bfloat16()
        kw = dict(num_heads=4, num_key_value_heads=2, input_layout="TND", scale=0.125, sparse_mode=3,
                  atten_mask=cann_attn.compressed_mask(3), actual_seq_lengths=[4, 10], actual_seq_lengths_kv=[4, 10])
        """ + _FIA_QK_CLOSE, "query"),
    "gemma-4 TND D=256 GQA": ("""
        q = torch.randn(9, 4, 256).bfloat16(); k = torch.randn(9, 2, 256).bfloat16()
        kw = dict(num_heads=4, num_key_value_heads=2, input_layout="TND", scale=0.0625, sparse_mode=4,
                  pre_tokens=3, next_tokens=0, atten_mask=cann_attn.compressed_mask(4), actual_seq_lengths=[4, 9],
                  actual_seq_lengths_kv=[4, 9])
        """ + _FIA_QK_CLOSE, "query"),
    "NZ cache undocumented heads": ("""
        q = torch.randn(2, 4, 1, 128).bfloat16()
        cache = torch.randint(-100, 100, (4, 2, 4, 32, 32)).to(torch.int8)
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        scale = torch.full((2, 1, 128), 0.02).bfloat16()
        def call():
            return cann_attn.fused_infer_attention_score(
                q, cache, cache, num_heads=4, num_key_value_heads=2, input_layout="BNSD", block_table=table,
                block_size=32, actual_seq_lengths_kv=[40, 9], key_antiquant_scale=scale, value_antiquant_scale=scale)
        def check():
            out, _ = call()
            assert out.shape == (2, 4, 1, 128) and bool(torch.isfinite(out).all())
        """, "block_size"),
    "fp8 KV with per-token paged scales": ("""
        q = torch.randn(2, 4, 64).bfloat16()
        k = (torch.randn(4, 16, 128) * 8).to(torch.float8_e4m3fn); v = (torch.randn(4, 16, 128) * 8).to(k.dtype)
        ks, vs = torch.rand(4, 16) * 0.1, torch.rand(4, 16) * 0.1
        kw = dict(num_query_heads=4, num_key_value_heads=2, input_layout="TND", actual_seq_qlen=[1, 2],
                  actual_seq_kvlen=[20, 9], block_table=torch.tensor([[0, 2], [3, -1]], dtype=torch.int32),
                  block_size=16, softmax_scale=0.125)
        def call():
            return cann_attn.fused_infer_attention_score_v2(q, k, v, dequant_scale_key=ks, dequant_scale_value=vs,
                                                            key_quant_mode=4, value_quant_mode=4, **kw)
        def check():
            out, _ = call()
            kd, vd = ((x.float() * s.unsqueeze(-1)).bfloat16() for x, s in ((k, ks), (v, vs)))
            assert torch.equal(out, cann_attn.fused_infer_attention_score_v2(q, kd, vd, **kw)[0])
        """, "key"),
    "SFA PA_BSND softmax_lse": ("""
        import cann_attn.torch_npu as torch_npu
        q = torch.randn(3, 2, 16); cache = torch.randn(2, 16, 1, 16)
        table = torch.tensor([[0, 1]], dtype=torch.int32)
        idx = torch.tensor([[[0, 1, 2, 3]]], dtype=torch.int32).expand(3, 1, 4).contiguous()
        def call():
            return torch_npu.npu_sparse_flash_attention(
                q, cache, cache, idx, 0.25, block_table=table, actual_seq_lengths_query=[3],
                actual_seq_lengths_kv=[20], layout_query="TND", layout_kv="PA_BSND", return_softmax_lse=True)
        def check():
            out, smax, ssum = call()
            assert smax.numel() > 0 and ssum.numel() > 0
        """, "return_softmax_lse"),
    "MlaProlog cache_index -1 padding": ("""
        import cann_attn.torch_npu as torch_npu
        g = lambda *s: torch.randn(*s) / s[0] ** 0.5
        w = [g(3, 32), g(32, 8), g(8, 24), g(2, 4, 16), g(32, 24), torch.ones(8), torch.ones(16)]
        rope = [torch.rand(3, 8), torch.rand(3, 8)]
        kv, kr = torch.zeros(2, 16, 1, 16), torch.zeros(2, 16, 1, 8)
        slots = torch.tensor([5, -1, 20])
        def call():
            return torch_npu.npu_mla_prolog_v3(w[0], *w[1:], *rope, kv, kr, cache_index=slots)
        def check():
            call()
            written = kv.view(-1, 16).abs().sum(-1) > 0
            assert written.nonzero().view(-1).tolist() == [5, 20]  # the padding token writes nothing
        """, "cache_index"),
}

HARNESS = """
import torch
import cann_attn
from cann_attn.testing.fia_oracle import fia_oracle
torch.manual_seed(0)
{body}
import os
if os.environ.get("{env}") == "1":
    try:
        call()
    except cann_attn.ParamInvalidError as exc:
        assert str(exc).split("] ", 1)[-1].startswith("{param}:"), str(exc)
        assert "{env}=1" in str(exc), str(exc)
        print("REFUSED")
    else:
        raise SystemExit("accepted under strict mode")
else:
    check()
    print("COMPUTED")
"""


def _run(name: str, strict: bool) -> str:
    body, param = CALLS[name]
    script = HARNESS.format(body=textwrap.dedent(body), env=STRICT_DOCS_ENV, param=param)
    env = {k: v for k, v in os.environ.items() if k != STRICT_DOCS_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env["CANN_ATTN_BACKEND"] = "reference"
    if strict:
        env[STRICT_DOCS_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("name", list(CALLS))
def test_beyond_docs_call_computes_by_default_and_is_refused_strictly(name):
    assert _run(name, strict=False) == "COMPUTED"
    assert _run(name, strict=True) == "REFUSED"


def test_strict_mode_is_read_at_each_call(monkeypatch):
    """In-process: the variable switches the refusal without re-importing (the helper reads it per call)."""
    import cann_attn

    q = torch.randn(6, 2, 64)
    k = torch.randn(6, 1, 64)
    kw = dict(num_heads=2, num_key_value_heads=1, input_layout="TND", actual_seq_lengths=[6],
              actual_seq_lengths_kv=[6])
    monkeypatch.setenv(STRICT_DOCS_ENV, "1")
    with pytest.raises(cann_attn.ParamInvalidError, match="query:"):
        cann_attn.fused_infer_attention_score(q, k, k, **kw)
    monkeypatch.setenv(STRICT_DOCS_ENV, "0")
    cann_attn.fused_infer_attention_score(q, k, k, **kw)
