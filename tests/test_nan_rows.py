"""NaN input is not a fully masked row: FlashAttentionScore keeps NaN where the formulas give it.

docs/semantics/invalid-rows.md turns rows *without a visible key* into 0 output with -FLT_MAX / +FLT_MAX statistics. A
row whose logits hold a NaN has visible keys: its max and sum are NaN and so is its output, as the float64 oracle
computes them. Both backends used to test validity with "sum > 0", which a NaN sum fails: the reference backend wrote
the invalid-row statistics beside a NaN output, and the Triton kernel a zero output (NaN input passed off as a masked
row). Every other row must be unaffected.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn
from oracle import fa_forward_oracle, make_compressed_mask

B, N1, S, D = 1, 2, 300, 32


def _inputs(poison: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, N1, S, D, generator=gen) for _ in range(3))
    if poison == "query_row":
        q[0, 1, 7, 3] = float("nan")
    else:  # a key column: NaN logits for every row that sees it
        k[0, 0, 40, 5] = float("nan")
    return q, k, v


# Triton's interpreter reduces a row of NaN logits with NumPy, which warns; the NaN is the expected result.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("poison", ["query_row", "key_column"])
@pytest.mark.parametrize("variant", ["dense", "causal", "alibi"])
def test_nan_logits_give_nan_rows_and_leave_the_others_alone(every_path: str, poison: str, variant: str) -> None:
    q, k, v = _inputs(poison)
    kw: dict = {"scale_value": D**-0.5}
    if variant == "causal":  # rows before column 40 never see the NaN key: they must stay finite
        kw.update(atten_mask=make_compressed_mask(2), sparse_mode=2)
    elif variant == "alibi":  # with the per-head tile skipping of far ALiBi tiles
        kw.update(pse=torch.tensor([0.5, 2.0**-6]), pse_type=2)
    got = cann_attn.flash_attention_score(q, k, v, N1, "BNSD", backend=every_path, **kw)
    want = fa_forward_oracle(q.double(), k.double(), v.double(), N1, "BNSD", **kw)
    for name, actual, golden in zip(("attention_out", "softmax_max", "softmax_sum"), got[:3], want[:3], strict=True):
        golden = golden.to(actual.dtype)
        assert torch.equal(actual.isnan(), golden.isnan()), (
            f"{name}: NaN at {actual.isnan().sum().item()} elements, the oracle at {golden.isnan().sum().item()}"
        )
        torch.testing.assert_close(actual, golden, rtol=1e-4, atol=2e-5, equal_nan=True,
                                   msg=lambda m, n=name: f"{n}: {m}")
    nan_rows = want[0].isnan().any(-1)
    assert bool(nan_rows.any()) and not bool(nan_rows.all()), "the case must have both NaN and finite rows"
