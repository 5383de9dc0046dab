"""Rule edges that random data and the statistical precision rule miss: exact ties, off-by-one boundaries,
shared pse elements, bit order. Each test here was written against a mutant of the rule (a one-token change in
`cann_attn/problem/` or the ops' validation) that the rest of the suite let pass."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import cann_attn
import oracle
from cann_attn.problem.quant import round_to_int8
from fa_grad_utils import GradCase
from oracle import make_compressed_mask, pack_drop_mask
from test_fa_errors import base, call, call_var_len, expect_error


# MASK6: the mode-6 tail's 0/1 boundary shifted by one column (sampling every 7th column misses it).
@pytest.mark.parametrize("col", [1023, 1024])
def test_mode6_tail_boundary_shifted_by_one(col):
    mask = make_compressed_mask(6).clone()
    mask[2048:, col] = ~mask[2048:, col]
    expect_error(r"\batten_mask\b", call, base("BNSD"), sparse_mode=6, atten_mask=mask, prefix=[0, 0])


# PSE1: only element 0 of q_start_idx / kv_start_idx is used (deterministic, not left to Hypothesis).
@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi_start_index_uses_element_0_only(pse_type):
    args = base("BNSD", b=1, n1=2, sq=8, skv=11)
    slopes = torch.tensor([0.5, 0.25])
    one = call(args, pse=slopes, pse_type=pse_type, q_start_idx=[3], kv_start_idx=[1])[0]
    many = call(args, pse=slopes, pse_type=pse_type, q_start_idx=[3, 7, 0], kv_start_idx=[1, 9, 4])[0]
    assert torch.equal(one, many)
    gold = oracle.fa_forward_oracle(args["query"], args["key"], args["value"], 2, "BNSD", pse=slopes,
                                    pse_type=pse_type, q_start_idx=[3, 7, 0], kv_start_idx=[1, 9, 4])[0]
    oracle.assert_close_to_oracle(many, gold, name="attention_out")


# PSE4: compressed-pse dpse with many head rows (Sq - 1024 = 276 > one 256-row tile), so that the elements
# read by two rows are numerous enough to exceed the Ascend rule's t*numel allowance if not accumulated.
def test_pse_compressed_grad_accumulates_shared_elements(rng):
    sq = 1300
    case = GradCase("BNSD", rng, b=1, n1=1, sq=sq, skv=sq, d=8)
    pse = case.randn(1, 1, 1024, sq)
    case.check(pse=pse, pse_type=0, stats=(True,), sparse_mode=3, atten_mask=make_compressed_mask(3))


# DROP1: gen_drop_mask's bit e is draw e of the generator (LSB-first packing of torch.rand < keep_prob).
@pytest.mark.parametrize("numel", [1, 8, 37, 1000])
def test_gen_drop_mask_bit_order(numel):
    got = cann_attn.gen_drop_mask(numel, 0.6, generator=torch.Generator().manual_seed(5))
    keep = torch.rand(numel, generator=torch.Generator().manual_seed(5)) < 0.6
    assert torch.equal(got, pack_drop_mask(keep))


# DROP5: drop_mask_numel for TND reads cumulative ends (no leading 0).
def test_drop_mask_numel_tnd_cumulative():
    assert cann_attn.drop_mask_numel(2, actual_seq_qlen=[2, 5, 5], actual_seq_kvlen=[3, 7, 9]) == 2 * (2 * 3 + 3 * 4)
    assert cann_attn.drop_mask_numel(3, batch=2, seq_q=4, seq_kv=5) == 120


# LEN1: the smallest rejected case, Sq_b = 1 with Skv_b = 0.
@pytest.mark.parametrize("fn", [call, call_var_len])
def test_tnd_sq_one_with_skv_zero(fn):
    args = base("TND", q_lens=[5, 1], kv_lens=[5, 3])
    expect_error(r"\bactual_seq_kvlen\b", fn, args, key=args["key"][:5], value=args["value"][:5],
                 actual_seq_kvlen=[5, 5])


# Q1: int8 rounding is half-to-even, at the rule and through the operator.
def test_round_to_int8_ties_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -128.5, 300.0])
    assert round_to_int8(x).tolist() == [0, 2, 2, 0, -2, -2, 126, 127, -128, 127]


def test_pfa_int8_quant_scale1_tie_rounds_to_even():
    d = 32
    q = torch.zeros(1, 1, 1, d, dtype=torch.int8)  # all logits 0: p = 1 everywhere, p * quant_scale1 = 2.5 exactly
    k = torch.ones(1, 1, 4, d, dtype=torch.int8)
    v = torch.full((1, 1, 4, d), 10, dtype=torch.int8)
    out = cann_attn.prompt_flash_attention(
        q, k, v, num_heads=1, input_layout="BNSD", scale_value=1.0, deq_scale1=torch.tensor([1.0]),
        quant_scale1=torch.tensor([2.5]), deq_scale2=torch.tensor([0.5]))
    # p_q = round_half_even(2.5) = 2; o = (4 * 2 * 10) * 0.5 / 4 = 10 (half-up would give 15)
    assert torch.allclose(out.float(), torch.full_like(out.float(), 10.0)), out.flatten()[:4]


# MASK8: prefix columns beyond the band's key tiles (Skv > one 256-wide key tile, prefix far right of the band).
# (Mode 6 only: mode 5 is driven by its explicit mask, not by the band + prefix structure.)
def test_prefix_reaches_key_tiles_beyond_band(rng):
    b, n, s = 1, 1, 600
    q, k, v = oracle.make_qkv("BNSD", gen=rng, b=b, n1=n, sq=s, d=8)
    kw = dict(sparse_mode=6, atten_mask=make_compressed_mask(6), prefix=[580], scale_value=8**-0.5)
    result = cann_attn.flash_attention_score(q, k, v, n, "BNSD", **kw)
    oracle.check_fa_result(result, q, k, v, n, "BNSD", **kw)


@pytest.mark.parametrize("seq_kv", [16, 24, 13])
@pytest.mark.parametrize("base", [0, 5, 8])
@pytest.mark.parametrize("cols", [(0, 16), (3, 11), (8, 9)])
def test_keep_tile_reads_lsb_first_bits(seq_kv, base, cols):
    """keep_tile against NumPy's little-endian unpacking of the whole mask, on both of its paths (whole bytes where
    every row starts at the same bit, element indices where it does not) and at bit offsets within a byte."""
    from cann_attn.problem.dropout import SequenceDropout

    count, heads, seq_q = 2, 3, 5
    mask = torch.randint(0, 256, (200,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seq_kv + base))
    dropout = SequenceDropout(mask=mask, keep_prob=0.5, base=base, count=count, heads=heads, seq_q=seq_q,
                              seq_kv=seq_kv)
    bits = torch.from_numpy(np.unpackbits(mask.numpy(), bitorder="little"))
    j0, j1 = cols[0], min(cols[1], seq_kv)
    want = bits[base : base + count * heads * seq_q * seq_kv].view(count, heads, seq_q, seq_kv)[:, :, 1:4, j0:j1]
    torch.testing.assert_close(dropout.keep_tile(1, 4, j0, j1, torch.device("cpu")), want.bool())
