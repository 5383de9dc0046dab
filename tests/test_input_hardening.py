"""Inputs a fuzz of ~550 bad-input cases turned into raw Python errors, silent acceptance or a misleading message
(docs/semantics/errors.md): each now gives ParamInvalidError naming the parameter, or the documented result.

- a nonzero quant_offset2 where the user's mask hides every key of a row: accepted, as the documentation's exact rule
says
  (the docs' wording is now exact);
- integer lists taking True and 7.0, a 2-D length tensor flattened;
- distributed `timeout` NaN / inf (raw ValueError / OverflowError) and True (taken as 1 s);
- paged caches: 0 blocks with every length 0 (RuntimeError from a view), a negative length reported against a bound
  of 2**62, a single length copied to every sequence and then blamed on block_table;
- sparse_mode 2..8 without atten_mask (full attention, documented, but easy to hit by mistake): a UserWarning.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import cann_attn
from cann_attn import ParamInvalidError
from cann_attn.distributed import flash_attention as distributed_flash_attention

pytestmark = pytest.mark.usefixtures("single_thread")


def _raises(param: str, call, *args, **kwargs) -> str:
    with pytest.raises(ParamInvalidError, match=f"^\\[\\d+\\] {param}:") as info:
        call(*args, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------------------------------------- quant_offset2
def _int8_out_call(mask: torch.Tensor, op: str, **kw):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 32, generator=gen, dtype=torch.float32).half() for _ in range(3))
    quant = dict(quant_scale2=torch.tensor([10.0]), quant_offset2=torch.tensor([2.0]), atten_mask=mask, **kw)
    if op == "pfa":
        return lambda: cann_attn.prompt_flash_attention(q, k, v, num_heads=2, input_layout="BNSD", **quant)
    return lambda: cann_attn.fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD", **quant)[0]


@pytest.mark.parametrize("op", ["pfa", "fia"])
def test_quant_offset2_follows_the_seeds_interception_rule(op: str) -> None:
    """The fuzz flagged a nonzero offset accepted where the mask's content hides a whole row. The documented rule
    (PromptFlashAttentionV2, 约束说明) intercepts from the mode, band and lengths only, and never in modes 1 and 2:
    such a row is accepted and gives 0, like every invalid row (docs/operators/prompt_flash_attention.md)."""
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[3] = True
    for mode in (0, 1):
        out = _int8_out_call(mask, op, sparse_mode=mode)()
        assert bool((out[:, :, 3] == 0).all()) and bool((out[:, :, 4] != 0).any())
    _raises("quant_offset2", _int8_out_call(mask, op, sparse_mode=0, next_tokens=-1))  # a band condition of the seed


# ---------------------------------------------------------------------------------------------- integer lists
@pytest.mark.parametrize("lengths", [[True, 8], [8, 7.0], torch.tensor([[8, 7]])], ids=["bool", "float", "2d"])
def test_integer_lists_refuse_bools_floats_and_2d_tensors(lengths) -> None:
    q = torch.randn(2, 2, 8, 16).half()
    _raises("actual_seq_lengths", cann_attn.prompt_flash_attention, q, q, q, num_heads=2, input_layout="BNSD",
            actual_seq_lengths=lengths)


def test_integer_lists_still_take_numpy_and_0d_tensor_items() -> None:
    import numpy as np
    q = torch.randn(2, 2, 8, 16).half()
    want = cann_attn.prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD", actual_seq_lengths=[8, 5])
    for lengths in ([np.int64(8), 5], [torch.tensor(8), torch.tensor(5)], torch.tensor([8, 5])):
        got = cann_attn.prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD", actual_seq_lengths=lengths)
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- timeout
@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), True, 1e300, 0, -5.0, "10"],
                         ids=["nan", "inf", "true", "huge", "zero", "negative", "string"])
def test_distributed_timeout_must_be_a_positive_duration(timeout) -> None:
    q = torch.randn(1, 8, 2, 16)
    _raises("timeout", distributed_flash_attention, q, q, q, 2, "BSND", timeout=timeout)


# ---------------------------------------------------------------------------------------------- paged caches
N, D, PAGE = 2, 16, 16


def _paged_decode(blocks: int, table: torch.Tensor, lengths):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(table.shape[0], 1, N * D, generator=gen)
    k, v = (torch.randn(blocks, PAGE, N * D, generator=gen) for _ in range(2))
    return cann_attn.fused_infer_attention_score(q, k, v, num_heads=N, input_layout="BSH", block_table=table,
                                                 block_size=PAGE, actual_seq_lengths_kv=lengths, softmax_lse_flag=True)


def test_paged_cache_without_blocks_when_every_sequence_is_empty() -> None:
    out, lse = _paged_decode(0, torch.zeros(2, 1, dtype=torch.int32), [0, 0])
    assert torch.equal(out, torch.zeros_like(out)), "sequences without keys give 0 (docs/semantics/invalid-rows.md)"
    _, want_lse = _paged_decode(2, torch.zeros(2, 1, dtype=torch.int32), [0, 0])
    assert torch.equal(lse, want_lse), "and the lse of rows without keys, as with blocks"


def test_negative_paged_length_names_the_bound_it_breaks() -> None:
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    message = _raises("actual_seq_lengths_kv", _paged_decode, 4, table, [-1, 5])
    assert "must be >= 0, got -1" in message and str(2**62) not in message


def test_one_paged_length_for_two_sequences_is_refused() -> None:
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    message = _raises("actual_seq_lengths_kv", _paged_decode, 4, table, [20])
    assert "one value per sequence (B=2)" in message


# ---------------------------------------------------------------------------------------------- sparse_mode w/o mask
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_causal_modes_without_a_mask_warn(mode: int) -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.warns(UserWarning, match=f"sparse_mode={mode} without atten_mask: .* full attention") as record:
        cann_attn.flash_attention_score(q, q, q, 2, "BNSD", sparse_mode=mode)
    assert record[0].filename == __file__, "the warning must point at the caller's line"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cann_attn.flash_attention_score(q, q, q, 2, "BNSD", sparse_mode=mode,
                                        atten_mask=cann_attn.compressed_mask(mode))
        cann_attn.flash_attention_score(q, q, q, 2, "BNSD", sparse_mode=0)


def test_the_warning_names_the_callers_line_through_autograd() -> None:
    """flash_attention goes through torch.autograd.Function.apply: the warning skips torch's frames too (else every
    call site would share torch's line, and Python's default filter would show the warning once in all)."""
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.warns(UserWarning, match="sparse_mode=3 without atten_mask") as record:
        cann_attn.flash_attention(q, q, q, 2, "BNSD", sparse_mode=3)
    assert {w.filename for w in record} == {__file__}
