"""Signatures and return arities of every ``cann_attn.torch_npu`` function against op-plugin's schema text, for the
current torch_npu and for 7.2 (``use_release("7.2")`` and the ``CANN_ATTN_TORCH_NPU_RELEASE`` environment variable).

The table below is copied from ``op_plugin/config/op_plugin_functions.yaml`` of Ascend/op-plugin: "current" is
master as read on 2026-08-21 (commit 517f2e7), "7.2" the 7.2.0 branch (None: the operator is not in 7.2, the
function keeps its current signature). It is parsed here by a parser of this file's own, independent of the
package's registry.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import cann_attn
import cann_attn.torch_npu as torch_npu
from dsa_utils import SFACase

SCHEMAS = {
    "npu_attention_update": {
        "current": "npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type) -> (Tensor, Tensor)",
        "7.2": "npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type) -> (Tensor, Tensor)",
    },
    "npu_ring_attention_update": {
        "current": (
            "npu_ring_attention_update(Tensor prev_attn_out, Tensor prev_softmax_max, Tensor prev_softmax_sum, "
            "Tensor cur_attn_out, Tensor cur_softmax_max, Tensor cur_softmax_sum, *, "
            'Tensor? actual_seq_qlen=None, str input_layout="SBH", str input_softmax_layout="") '
            "-> (Tensor, Tensor, Tensor)"
        ),
        "7.2": None,
    },
    "npu_fusion_attention": {
        "current": (
            "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
            "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
            "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
            "int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
            "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
            'str softmax_layout="", Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, '
            "int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
        ),
        "7.2": (
            "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
            "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
            "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
            "int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
            "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
            'str softmax_layout="") -> (Tensor, Tensor, Tensor, Tensor, int, int, int)'
        ),
    },
    "npu_fusion_attention_grad": {
        "current": (
            "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
            "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
            "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
            "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., "
            "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int seed=0, "
            "int offset=0, int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
            "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
            'str softmax_layout="", Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)'
        ),
        "7.2": (
            "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
            "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
            "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
            "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., "
            "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int seed=0, "
            "int offset=0, int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
            "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
            'str softmax_layout="") -> (Tensor, Tensor, Tensor, Tensor)'
        ),
    },
    "npu_fusion_attention_grad_v2": {
        "current": (
            "npu_fusion_attention_grad_v2(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
            "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
            "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
            "Tensor? attention_in=None, Tensor? query_rope=None, Tensor? key_rope=None, "
            "float scale_value=1., float keep_prob=1., int pre_tokens=2147483647, "
            "int next_tokens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
            "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
            "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, int pse_type=1, "
            'int[]? q_start_idx=None, int[]? kv_start_idx=None, str softmax_layout="", '
            "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
        ),
        "7.2": (
            "npu_fusion_attention_grad_v2(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
            "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
            "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
            "Tensor? attention_in=None, Tensor? query_rope=None, Tensor? key_rope=None, "
            "float scale_value=1., float keep_prob=1., int pre_tokens=2147483647, "
            "int next_tokens=2147483647, int inner_precise=0, int seed=0, int offset=0, int numels=0, "
            "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
            "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, int pse_type=1, "
            "int[]? q_start_idx=None, int[]? kv_start_idx=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
            "Tensor)"
        ),
    },
    "npu_fusion_attention_grad_v3": {
        "current": (
            "npu_fusion_attention_grad_v3(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
            "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
            "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
            "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., "
            "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
            "Tensor? seed=None, Tensor? offset=None, SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, "
            "Tensor? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
            'str softmax_layout="", Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)'
        ),
        "7.2": None,
    },
    "npu_fusion_attention_v2": {
        "current": (
            "npu_fusion_attention_v2(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
            "*, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
            "Tensor? query_rope=None, Tensor? key_rope=None, float scale=1., float keep_prob=1., "
            "int pre_tokens=2147483647, int next_tokens=2147483647, int inner_precise=0, int[]? prefix=None, "
            "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
            "bool gen_mask_parallel=True, bool sync=False, int pse_type=1, int[]? q_start_idx=None, "
            'int[]? kv_start_idx=None, str softmax_layout="", Tensor? sink=None, Tensor? dropout_mask=None, '
            "int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
        ),
        "7.2": (
            "npu_fusion_attention_v2(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
            "*, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
            "Tensor? query_rope=None, Tensor? key_rope=None, float scale=1., float keep_prob=1., "
            "int pre_tokens=2147483647, int next_tokens=2147483647, int inner_precise=0, int[]? prefix=None, "
            "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
            "bool gen_mask_parallel=True, bool sync=False, int pse_type=1, int[]? q_start_idx=None, "
            "int[]? kv_start_idx=None) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
        ),
    },
    "npu_fusion_attention_v3": {
        "current": (
            "npu_fusion_attention_v3(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
            "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
            "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
            "int inner_precise=0, SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, "
            "Tensor? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
            'str softmax_layout="", Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)'
        ),
        "7.2": None,
    },
    "npu_lightning_indexer": {
        "current": (
            "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, "
            "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, "
            'Tensor? block_table=None, str layout_query="BSND", str layout_key="BSND", '
            "int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
            "int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, Tensor)"
        ),
        "7.2": None,
    },
    "npu_prompt_flash_attention": {
        "current": (
            "npu_prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, "
            "Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? pse_shift=None, "
            "int[]? actual_seq_lengths=None, Tensor? deq_scale1=None, Tensor? quant_scale1=None, "
            "Tensor? deq_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, "
            "int num_heads=1, float scale_value=1.0, int pre_tokens=2147483647, int next_tokens=0, "
            'str input_layout="BSH", int num_key_value_heads=0, int[]? actual_seq_lengths_kv=None, '
            "int sparse_mode=0) -> Tensor"
        ),
        "7.2": (
            "npu_prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, "
            "Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? pse_shift=None, "
            "int[]? actual_seq_lengths=None, Tensor? deq_scale1=None, Tensor? quant_scale1=None, "
            "Tensor? deq_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, "
            "int num_heads=1, float scale_value=1.0, int pre_tokens=2147473647, int next_tokens=0, "
            'str input_layout="BSH", int num_key_value_heads=0, int[]? actual_seq_lengths_kv=None, '
            "int sparse_mode=0) -> Tensor"
        ),
    },
    "npu_sparse_flash_attention": {
        "current": (
            "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, "
            "float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
            "Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, "
            'int sparse_block_size=1, str layout_query="BSND", str layout_kv="BSND", int sparse_mode=3, '
            "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, int attention_mode=0, "
            "bool return_softmax_lse=False, Tensor? sinks=None) -> (Tensor, Tensor, Tensor)"
        ),
        "7.2": None,
    },
    "npu_sparse_flash_attention_grad": {
        "current": (
            "npu_sparse_flash_attention_grad(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, "
            "Tensor d_out, Tensor out, Tensor softmax_max, Tensor softmax_sum, float scale_value, "
            "int sparse_block_size, Tensor? query_rope=None, Tensor? key_rope=None, "
            'Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, str? layout="BSND", '
            "int? sparse_mode=3, int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807, "
            "int? attention_mode=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
        ),
        "7.2": None,
    },
    "npu_sparse_lightning_indexer_grad_kl_loss": {
        "current": (
            "npu_sparse_lightning_indexer_grad_kl_loss(Tensor query, Tensor key, Tensor query_index, "
            "Tensor key_index, Tensor weights, Tensor sparse_indices, Tensor softmax_max, "
            "Tensor softmax_sum, float scale_value, *, Tensor? query_rope=None, Tensor? key_rope=None, "
            "SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_klen=None, str? layout='BSND', "
            "int? sparse_mode=3, int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807, "
            "Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor)"
        ),
        "7.2": None,
    },
    "npu_trans_quant_param": {
        "current": (
            "npu_trans_quant_param(Tensor scale, Tensor? offset=None, int? round_mode=0) -> Tensor"
        ),
        "7.2": (
            "npu_trans_quant_param(Tensor scale, Tensor? offset=None, int? round_mode=0) -> Tensor"
        ),
    },
}


def _parse(schema: str):
    """-> ([(name, default or EMPTY, keyword_only)], number of returns)."""
    body, returns = re.fullmatch(r"\w+\((.*)\) -> (.*)", schema).groups()
    params, keyword_only = [], False
    for item in re.split(r",\s*(?![^\[]*\])", body):
        if item == "*":
            keyword_only = True
            continue
        decl, has_default, default = item.partition("=")
        type_name, name = decl.split()
        if not has_default:
            value = inspect.Parameter.empty
        elif default == "None":
            value = None
        elif default in ("True", "False"):
            value = default == "True"
        elif default[0] in "'\"":
            value = default[1:-1]
        else:
            value = float(default) if type_name == "float" else int(default)
        params.append((name, value, keyword_only))
    arity = len(returns.strip("()").split(",")) if returns.startswith("(") else 1
    return params, arity


def _schema(name: str, release: str) -> str:
    return SCHEMAS[name][release] or SCHEMAS[name]["current"]


@pytest.fixture
def release():
    """Restore the current release after a test that switches it."""
    yield
    torch_npu.use_release("current")


@pytest.mark.parametrize("rel", ["current", "7.2"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_signature_matches_the_schema(name, rel, release):
    """Parameter names, order, defaults and positional/keyword-only kinds, as inspect.signature reports them."""
    torch_npu.use_release(rel)
    expected, _ = _parse(_schema(name, rel))
    actual = inspect.signature(getattr(torch_npu, name)).parameters.values()
    assert [p.name for p in actual] == [n for n, _, _ in expected]
    for p, (param, default, keyword_only) in zip(actual, expected, strict=True):
        assert p.default == default and type(p.default) is type(default), (param, p.default, default)
        kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert p.kind == kind, param


def test_every_public_spelling_is_in_the_table():
    """Every spelling is registered (release switch, install()); the table covers all but the inference operators,
    tested with those operators."""
    spelled = {n for n in torch_npu.__all__ if n.startswith("npu_") and n != "npu_op"}
    # torch_npu's private _npu_* spellings and the .out overloads (attributes of their operator) aside
    public = {n for n in torch_npu.OPS if not n.startswith("_") and "." not in n}
    assert spelled == public and set(SCHEMAS) <= spelled


def _fa_inputs(rng):
    q, k, v = (torch.randn(1, 4, 16, generator=rng).requires_grad_() for _ in range(3))
    return q, k, v


def _calls(rng):
    """One small call per function: name -> zero-argument callable."""
    q, k, v = _fa_inputs(rng)
    dy = torch.randn(1, 4, 16, generator=rng)
    fwd = torch_npu.npu_fusion_attention(q, k, v, 2, "BSH", scale=0.3)
    grad_kw = dict(softmax_max=fwd[1], softmax_sum=fwd[2], attention_in=fwd[0].detach(), scale_value=0.3)
    case = SFACase("BSND", gen=rng, b=1, s1=4, s2=6, n1=2, d=8, d_rope=None, k=3)
    i, sfa_kw = case.inputs, dict(case.kw)
    scale, block = sfa_kw["scale_value"], sfa_kw["sparse_block_size"]
    sfa = case.forward()
    qi, ki, w = (torch.randn(1, 4, 2, 8, generator=rng), torch.randn(1, 6, 1, 8, generator=rng),
                 torch.randn(1, 4, 2, generator=rng))
    tnd = torch.randn(6, 2, 8, generator=rng)
    lens = torch.tensor([2, 6])
    return {
        "npu_fusion_attention": lambda: torch_npu.npu_fusion_attention(q, k, v, 2, "BSH", scale=0.3),
        "npu_fusion_attention_v2": lambda: torch_npu.npu_fusion_attention_v2(q, k, v, 2, "BSH", scale=0.3),
        "npu_fusion_attention_v3": lambda: torch_npu.npu_fusion_attention_v3(
            tnd, tnd, tnd, 2, "TND", scale=0.3, actual_seq_qlen=lens, actual_seq_kvlen=lens),
        "npu_fusion_attention_grad": lambda: torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BSH", **grad_kw),
        "npu_fusion_attention_grad_v2": lambda: torch_npu.npu_fusion_attention_grad_v2(q, k, v, dy, 2, "BSH",
                                                                                       **grad_kw),
        "npu_fusion_attention_grad_v3": lambda: torch_npu.npu_fusion_attention_grad_v3(q, k, v, dy, 2, "BSH",
                                                                                       **grad_kw),
        "npu_prompt_flash_attention": lambda: torch_npu.npu_prompt_flash_attention(q, k, v, num_heads=2),
        "npu_trans_quant_param": lambda: torch_npu.npu_trans_quant_param(torch.tensor([0.5])),
        "npu_sparse_flash_attention": lambda: torch_npu.npu_sparse_flash_attention(
            i["query"], i["key"], i["value"], i["sparse_indices"], scale, sparse_block_size=block),
        "npu_sparse_flash_attention_grad": lambda: torch_npu.npu_sparse_flash_attention_grad(
            i["query"], i["key"], i["value"], i["sparse_indices"], case.d_out, sfa.attention_out, sfa.softmax_max,
            sfa.softmax_sum, scale, block),
        "npu_lightning_indexer": lambda: torch_npu.npu_lightning_indexer(qi, ki, w, sparse_count=3),
        "npu_sparse_lightning_indexer_grad_kl_loss": lambda: torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(
            i["query"], i["key"], qi, ki, w, i["sparse_indices"], sfa.softmax_max, sfa.softmax_sum, scale),
    }


@pytest.mark.parametrize("rel", ["current", "7.2"])
def test_return_arity_matches_the_schema(rel, rng, release):
    """grad returns 5 (4 in 7.2), grad_v2 7 (6 in 7.2), the v3 pair 6 and 5; every function as its schema says."""
    calls = _calls(rng)  # the merge operators' outputs are tested with them (tests of ring/attention_update)
    assert set(calls) == set(SCHEMAS) - {"npu_attention_update", "npu_ring_attention_update"}
    torch_npu.use_release(rel)
    for name, call in calls.items():
        _, arity = _parse(_schema(name, rel))
        out = call()
        assert (len(out) if isinstance(out, tuple) else 1) == arity, name
    if rel == "7.2":
        assert len(calls["npu_fusion_attention_grad"]()) == 4 and len(calls["npu_fusion_attention_grad_v2"]()) == 6


def test_older_release_refuses_newer_parameters_and_restores_old_defaults(rng, release):
    q, k, v = _fa_inputs(rng)
    torch_npu.use_release("7.2")
    with pytest.raises(TypeError, match="sink"):
        torch_npu.npu_fusion_attention(q, k, v, 2, "BSH", sink=None)
    with pytest.raises(TypeError, match="positional"):  # dropout_mask is the 22nd positional only from 26.0 on
        torch_npu.npu_fusion_attention(q, k, v, 2, "BSH", *([None] * 3), 1.0, 1.0, 1, 1, 0, None, None, None, 0,
                                       True, False, "", None)
    assert inspect.signature(torch_npu.npu_prompt_flash_attention).parameters["pre_tokens"].default == 2147473647
    assert torch_npu.use_release("7.2.0") == "7.2"  # "7.2.0" spelling; returns the previous release
    with pytest.raises(cann_attn.ParamInvalidError, match="release"):
        torch_npu.use_release("6.9")
    torch_npu.use_release("current")
    assert inspect.signature(torch_npu.npu_prompt_flash_attention).parameters["pre_tokens"].default == 2147483647


def test_older_release_injects_its_defaults(monkeypatch, release):
    """A default that changed between releases reaches the implementation when the caller leaves it out."""
    seen = {}
    impl = torch_npu.OPS["npu_prompt_flash_attention"].impl
    monkeypatch.setattr(torch_npu.OPS["npu_prompt_flash_attention"], "impl",
                        lambda *a, **kw: seen.update(kw) or impl(*a, **kw))
    q = torch.randn(1, 2, 8)
    torch_npu.use_release("7.2")
    torch_npu.npu_prompt_flash_attention(q, q, q, num_heads=1)
    assert seen["pre_tokens"] == 2147473647
    seen.clear()
    torch_npu.npu_prompt_flash_attention(q, q, q, num_heads=1, pre_tokens=5)
    assert seen["pre_tokens"] == 5


def test_environment_variable_selects_the_release():
    code = ("import inspect, cann_attn.torch_npu as t; "
            "print(t.active_release(), len(inspect.signature(t.npu_fusion_attention).parameters))")
    env = dict(os.environ, CANN_ATTN_TORCH_NPU_RELEASE="7.2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in ("src", env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7.2", "20"]
