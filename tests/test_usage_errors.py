"""Errors for the three usual slips of a first call (docs/semantics/errors.md): a tensor in another layout than
`input_layout` says, a keyword of a sibling operator, and TND lengths given per sequence instead of as prefix sums."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch

import cann_attn
import cann_attn.distributed
from cann_attn import ParamInvalidError, torch_npu

BSND = torch.randn(1, 16, 4, 8)  # B=1, S=16, N=4, D=8


@pytest.mark.parametrize(("call", "heads_param"), [
    (lambda q, layout: cann_attn.flash_attention_score(q, q, q, 4, layout, scale_value=0.3), "head_num"),
    (lambda q, layout: cann_attn.prompt_flash_attention(q, q, q, num_heads=4, input_layout=layout), "num_heads"),
    (lambda q, layout: cann_attn.fused_infer_attention_score(q, q, q, num_heads=4, input_layout=layout), "num_heads"),
], ids=["fa", "pfa", "fia"])
@pytest.mark.parametrize(("tensor", "given", "actual"), [
    (BSND, "BNSD", "BSND"), (BSND.transpose(1, 2).contiguous(), "BSND", "BNSD")])
def test_a_tensor_in_another_layout_is_named_a_layout_mismatch(call, heads_param, tensor, given, actual):
    shape = re.escape(str(list(tensor.shape)))
    with pytest.raises(ParamInvalidError, match=rf"input_layout: query {shape} read as {given} has N=16 heads.*"
                                                rf"{heads_param}=4 is its dimension.*looks laid out as {actual}, "
                                                rf"not {given}"):
        call(tensor, given)


def test_a_wrong_head_count_is_still_a_head_count_error():
    with pytest.raises(ParamInvalidError, match=r"head_num: expected the query's head count N=4, got 3"):
        cann_attn.flash_attention_score(BSND, BSND, BSND, 3, "BSND", scale_value=0.3)


@pytest.mark.parametrize(("call", "meant"), [
    (lambda: cann_attn.flash_attention_score(BSND, BSND, BSND, 4, "BSND", scale=0.3), "scale_value"),
    (lambda: cann_attn.flash_attention(BSND, BSND, BSND, 4, "BSND", scale_valeu=0.3), "scale_value"),
    (lambda: cann_attn.fused_infer_attention_score(BSND, BSND, BSND, num_heads=4, input_layout="BSND",
                                                   scale_value=0.3), "scale"),
    (lambda: cann_attn.prompt_flash_attention(BSND, BSND, BSND, head_num=4, input_layout="BSND"), "num_heads"),
    (lambda: torch_npu.npu_fusion_attention(BSND, BSND, BSND, 4, "BSND", scale_value=0.3), "scale"),
    (lambda: cann_attn.distributed.shard(BSND, 1, load_balanse=None), "load_balance"),
], ids=["fa", "fa-autograd-typo", "fia", "pfa", "torch_npu", "distributed"])
def test_a_wrong_keyword_names_the_one_meant(call, meant):
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '\w+'.*; did you mean {meant}=\?"):
        call()


def test_a_wrong_keyword_of_an_older_torch_npu_release_is_named_too():
    with torch_npu.installed("cpu", release="7.1"), pytest.raises(TypeError, match=r"torch_npu 7\.1.*did you mean"):
        torch_npu.npu_fusion_attention(BSND, BSND, BSND, 4, "BSND", scale_value=0.3)


@pytest.mark.parametrize("module", [cann_attn, torch_npu, cann_attn.distributed], ids=lambda m: m.__name__)
def test_every_public_function_refuses_an_unknown_keyword_by_name(module):
    for name in module.__all__:
        function = getattr(module, name)
        if not inspect.isfunction(function) or any(
                p.kind is p.VAR_KEYWORD for p in inspect.signature(function).parameters.values()):
            continue
        with pytest.raises(TypeError, match=rf"{function.__name__}\(\) got an unexpected keyword argument 'no_such'"):
            function(no_such=1)


T = torch.randn(20, 4, 8)


def test_tnd_lengths_out_of_order_are_refused_naming_the_parameter_and_the_prefix_sums():
    with pytest.raises(ParamInvalidError, match=r"actual_seq_qlen: cumulative lengths .* non-decreasing .* got "
                                                r"\[8, 5, 7\]; they are cumulative ends \(prefix sums\): .* pass "
                                                r"\[8, 13, 20\]"):
        cann_attn.flash_attention_score(T, T, T, 4, "TND", scale_value=0.3, actual_seq_qlen=[8, 5, 7],
                                        actual_seq_kvlen=[8, 13, 20])
    with pytest.raises(ParamInvalidError, match=r"actual_seq_lengths_query: cumulative .* pass \[8, 13, 20\]"):
        cann_attn.lightning_indexer(T, T[:, :1], torch.randn(20, 4), layout="TND", actual_seq_lengths_query=[8, 5, 7],
                                    actual_seq_lengths_key=[8, 13, 20])


def test_tnd_lengths_per_sequence_are_named_where_they_cannot_be_ends():
    with pytest.raises(ParamInvalidError, match=r"actual_seq_lengths: the last cumulative length must equal the "
                                                r"tensor's T=20, got \[5, 7, 8\]; .* pass \[5, 12, 20\]"):
        cann_attn.fused_infer_attention_score(T, T, T, num_heads=4, input_layout="TND", actual_seq_lengths=[5, 7, 8],
                                              actual_seq_lengths_kv=[5, 12, 20])


def test_tnd_ends_that_leave_padding_and_sum_to_t_warn():
    """FlashAttentionScore accepts ends short of T (end-of-document padding), so [5, 7, 8] with T = 20 is a valid
    call; because the values sum to T, it warns that they may be per-sequence lengths."""
    with pytest.warns(UserWarning, match=r"actual_seq_qlen: \[5, 7, 8\] leaves 12 of T=20 tokens .* pass "
                                         r"\[5, 12, 20\]"):
        cann_attn.flash_attention_score(T, T, T, 4, "TND", scale_value=0.3, actual_seq_qlen=[5, 7, 8],
                                        actual_seq_kvlen=[5, 12, 20])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # padding that is not such a sum stays silent
        cann_attn.flash_attention_score(T, T, T, 4, "TND", scale_value=0.3, actual_seq_qlen=[5, 12, 16],
                                        actual_seq_kvlen=[5, 12, 16])
