"""The .out overloads of npu_fused_infer_attention_score (+ _v2) and the get_max_workspace helpers, called as
vllm-ascend's graph-capture code calls them (docs/operators/fused_infer_attention_score.md, "Writing into given
tensors")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cann_attn.torch_npu as torch_npu
from cann_attn.errors import ParamInvalidError, ParamNullptrError
from paged_utils import paginate
from patience import HANG_SECONDS

pytestmark = pytest.mark.usefixtures("single_thread")


def _decode_call(rng):
    """vllm-ascend full_graph_fia: BNSD decode over a paged cache [blocks, block_size, N * D]."""
    lens = [21, 5, 16]
    keys = [torch.randn(n, 2 * 16, generator=rng).half() for n in lens]
    values = [torch.randn(n, 2 * 16, generator=rng).half() for n in lens]
    caches, table = paginate({"key": keys, "value": values}, 16, rng)
    query = torch.randn(3, 4, 1, 16, generator=rng).half()
    kw = dict(atten_mask=None, block_table=table, input_layout="BNSD", block_size=16, actual_seq_lengths=[1, 1, 1],
              actual_seq_lengths_kv=lens, num_key_value_heads=2, num_heads=4, sparse_mode=0, pre_tokens=2147483647,
              next_tokens=2147483647, scale=0.25)
    return query, caches["key"], caches["value"], kw


def test_out_with_a_workspace_equals_the_plain_call(rng):
    query, key, value, kw = _decode_call(rng)
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(query=query, key=key, value=value, **kw)
    assert workspace.dtype == torch.uint8
    output = torch.full((3, 4, 1, 16), 5.0, dtype=torch.float16)
    softmax_lse = torch.empty(1, dtype=torch.float16)  # vllm-ascend's placeholder without softmax_lse_flag
    lse_before = softmax_lse.clone()
    got = torch_npu.npu_fused_infer_attention_score.out(query=query, key=key, value=value, workspace=workspace,
                                                        out=[output, softmax_lse], **kw)
    expected, _ = torch_npu.npu_fused_infer_attention_score(query, key, value, **kw)
    assert got[0] is output and got[1] is softmax_lse
    assert torch.equal(output, expected)
    assert torch.equal(softmax_lse, lse_before) or softmax_lse.isnan().any()  # not written without the flag


def test_out_schema_keywords_and_the_lse(rng):
    query, key, value, kw = _decode_call(rng)
    expected, lse = torch_npu.npu_fused_infer_attention_score(query, key, value, softmax_lse_flag=True, **kw)
    output, softmax_lse = torch.empty_like(expected), torch.empty_like(lse)
    torch_npu.npu_fused_infer_attention_score.out(query, key, value, softmax_lse_flag=True, attention_out=output,
                                                  softmax_lse=softmax_lse, **kw)
    assert torch.equal(output, expected) and torch.equal(softmax_lse, lse)


def test_v2_out_as_vllm_ascend_full_graph_fia_v2(rng):
    """TND queries, a paged cache, sparse_mode 3 with the 2048 compressed mask and the lse returned."""
    kv_lens = [9, 20]  # query lengths 3 and 1
    keys = [torch.randn(n, 1, 128, generator=rng).bfloat16() for n in kv_lens]  # TND needs D = 128
    values = [torch.randn(n, 1, 128, generator=rng).bfloat16() for n in kv_lens]
    caches, table = paginate({"key": keys, "value": values}, 16, rng)
    query = torch.randn(4, 2, 128, generator=rng).bfloat16()
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    kw = dict(atten_mask=mask, block_table=table, input_layout="TND", block_size=16, actual_seq_qlen=[3, 4],
              actual_seq_kvlen=kv_lens, num_key_value_heads=1, num_query_heads=2, sparse_mode=3, next_tokens=0,
              softmax_scale=0.25, return_softmax_lse=True)
    key, value = caches["key"].flatten(2), caches["value"].flatten(2)
    workspace = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(query, key, value, **kw)
    expected, lse = torch_npu.npu_fused_infer_attention_score_v2(query, key, value, **kw)
    output, softmax_lse = torch.zeros_like(expected), torch.zeros_like(lse)
    torch_npu.npu_fused_infer_attention_score_v2.out(query, key, value, **kw, workspace=workspace,
                                                     out=[output, softmax_lse])
    assert torch.equal(output, expected) and torch.equal(softmax_lse, lse)


@pytest.mark.parametrize(("outs", "param"), [
    (lambda e, l: [e[:2], l], "attention_out"),
    (lambda e, l: [e.float(), l], "attention_out"),
    (lambda e, l: [e, l[:, :1]], "softmax_lse"),
    (lambda e, l: [e, l.half()], "softmax_lse"),
    (lambda e, l: [e], "out"),
])
def test_wrong_out_tensors_are_refused_before_anything_is_written(outs, param, rng):
    query, key, value, kw = _decode_call(rng)
    expected, lse = torch_npu.npu_fused_infer_attention_score(query, key, value, softmax_lse_flag=True, **kw)
    given = [torch.full_like(t, 7.0) for t in outs(expected, lse)]
    with pytest.raises(ParamInvalidError, match=rf"\] {param}:"):
        torch_npu.npu_fused_infer_attention_score.out(query, key, value, softmax_lse_flag=True, out=given, **kw)
    assert all((t == 7).all() for t in given)


def test_out_needs_both_tensors_once(rng):
    query, key, value, kw = _decode_call(rng)
    a, b = torch.empty(3, 4, 1, 16, dtype=torch.float16), torch.empty(1)
    with pytest.raises(ParamNullptrError, match=r"\] softmax_lse:"):
        torch_npu.npu_fused_infer_attention_score.out(query, key, value, attention_out=a, **kw)
    with pytest.raises(ParamInvalidError, match=r"\] out:"):
        torch_npu.npu_fused_infer_attention_score.out(query, key, value, attention_out=a, softmax_lse=b, out=[a, b],
                                                      **kw)
    with pytest.raises(ParamInvalidError, match=r"\] num_heads:"):  # the workspace helper validates the call
        torch_npu._npu_fused_infer_attention_score_get_max_workspace(query, key, value, **(kw | {"num_heads": 3}))


def test_torch_ops_npu_out_overloads_after_install():
    script = """
        import torch
        import cann_attn.torch_npu
        cann_attn.torch_npu.install(device="cpu")
        import torch_npu

        q = torch.randn(2, 1, 32).half()
        kv = torch.randn(2, 5, 32).half()
        ws = torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace(q, kv, kv, num_heads=2)
        a, l = torch.empty(2, 1, 32, dtype=torch.float16), torch.empty(1)
        got = torch.ops.npu.npu_fused_infer_attention_score.out(q, kv, kv, num_heads=2, workspace=ws,
                                                                attention_out=a, softmax_lse=l)
        ref, _ = torch_npu.npu_fused_infer_attention_score(q, kv, kv, num_heads=2)
        assert got[0] is a and torch.equal(a, ref)
        ws2 = torch.ops.npu._npu_fused_infer_attention_score_v2_get_max_workspace(q, kv, kv, num_query_heads=2)
        b = torch.empty_like(a)
        torch.ops.npu.npu_fused_infer_attention_score_v2.out(q, kv, kv, num_query_heads=2, workspace=ws2,
                                                             attention_out=b, softmax_lse=l)
        assert torch.equal(b, ref)
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ("src", os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                            timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("case", ["lse inside attention_out", "attention_out stride 0", "lse stride 0",
                                  "attention_out inside query", "attention_out inside value"])
def test_out_tensors_sharing_memory_are_refused_before_anything_is_written(case, v2, rng):
    """Before: a softmax_lse inside attention_out's memory was accepted and attention_out came back silently wrong
    (the lse copy overwrote part of it); a stride-0 out gave a raw torch error."""
    query, key, value, kw = _decode_call(rng)
    if v2:
        kw = {"block_table": kw["block_table"], "input_layout": "BNSD", "block_size": 16, "actual_seq_kvlen":
              kw["actual_seq_lengths_kv"], "num_key_value_heads": 2, "num_query_heads": 4, "softmax_scale": 0.25,
              "return_softmax_lse": True}
        op = torch_npu.npu_fused_infer_attention_score_v2
    else:
        kw = kw | {"softmax_lse_flag": True}
        op = torch_npu.npu_fused_infer_attention_score
    expected, lse = op(query, key, value, **kw)
    attention_out, softmax_lse = torch.full_like(expected, 7.0), torch.full_like(lse, 7.0)
    param, named = {"lse inside attention_out": ("softmax_lse", "attention_out"),
                    "attention_out stride 0": ("attention_out", "stride"), "lse stride 0": ("softmax_lse", "stride"),
                    "attention_out inside query": ("attention_out", "query"),
                    "attention_out inside value": ("attention_out", "value")}[case]
    if case == "lse inside attention_out":
        softmax_lse = attention_out.view(-1).view(torch.float32)[: lse.numel()].view(lse.shape)
    elif case == "attention_out stride 0":
        attention_out = attention_out[:1].expand(expected.shape)
    elif case == "lse stride 0":
        softmax_lse = softmax_lse[:1].expand(lse.shape)
    elif case == "attention_out inside query":
        attention_out = query.flatten()[: expected.numel()].view(expected.shape)
    else:
        attention_out = value.flatten()[: expected.numel()].view(expected.shape)
    before = [t.clone() for t in (attention_out, softmax_lse, query, key, value)]
    with pytest.raises(ParamInvalidError, match=rf"\] {param}: .*{named}"):
        op.out(query, key, value, out=[attention_out, softmax_lse], **kw)
    assert all(_same_bits(t, b) for t, b in zip((attention_out, softmax_lse, query, key, value), before,
                                                strict=True))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (the paged caches hold NaN in unread slots)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
