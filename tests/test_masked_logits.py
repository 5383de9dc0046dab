"""A masked element is excluded whatever its logit (docs/semantics/masks.md, "A masked element is excluded whatever
its value"): NaN or +inf in `pse` where the mask hides the element must leave every row as if it held 0 there.

A fuzz found whole rows of NaN from FA, PFA and FIA decode on the reference backend (PyTorch and native paths): the
pse tile plus the 0 / -inf mask tile gave NaN + -inf = NaN and +inf + -inf = NaN. The rule lives in
`problem.mask.add_mask_bias`; results must be bitwise those of the same call with 0 in the masked pse elements.
"""

from __future__ import annotations

import pytest
import torch

import cann_attn

pytestmark = pytest.mark.usefixtures("single_thread")

B, N, S, D = 1, 2, 40, 16
SCALE = 0.25


def _inputs(poison: float) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    qkv = tuple(torch.randn(B, N, S, D, generator=gen) for _ in range(3))
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    clean = torch.randn(B, N, S, S, generator=gen)
    clean[..., mask] = 0.0
    poisoned = clean.clone()
    poisoned[..., mask] = poison
    return qkv, mask, clean, poisoned


def _assert_same(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert not bool(got.isnan().any()), f"{name}: NaN from a NaN/inf pse element the mask hides"
    assert torch.equal(got, want), f"{name}: differs from the call with 0 at the masked pse elements"


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_flash_attention_forward_and_backward(every_path: str, poison: float) -> None:
    (q, k, v), mask, clean, poisoned = _inputs(poison)

    def run(pse: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = cann_attn.flash_attention(*leaves, N, "BNSD", pse=pse, atten_mask=mask, scale_value=SCALE,
                                        backend=every_path)
        out.backward(torch.ones_like(out))
        return (out.detach(), *(t.grad for t in leaves))

    for name, got, want in zip(("out", "dq", "dk", "dv"), run(poisoned), run(clean), strict=True):
        _assert_same(got, want, name)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_prompt_flash_attention(every_path: str, poison: float) -> None:
    (q, k, v), mask, clean, poisoned = _inputs(poison)
    got, want = (cann_attn.prompt_flash_attention(q, k, v, num_heads=N, input_layout="BNSD", pse_shift=pse,
                                                   atten_mask=mask, scale_value=SCALE, backend=every_path)
                 for pse in (poisoned, clean))
    _assert_same(got, want, "attention_out")


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_fused_infer_attention_decode(every_path: str, poison: float) -> None:
    (q, k, v), _, clean, poisoned = _inputs(poison)
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    mask[..., ::3] = True
    clean, poisoned = clean[:, :, :1].clone(), clean[:, :, :1].clone()
    clean[..., ::3] = 0.0
    poisoned[..., ::3] = poison
    got, want = (cann_attn.fused_infer_attention_score(q[:, :, :1], k, v, num_heads=N, input_layout="BNSD",
                                                        pse_shift=pse, atten_mask=mask, scale=SCALE,
                                                        softmax_lse_flag=True, backend=every_path)
                 for pse in (poisoned, clean))
    _assert_same(got[0], want[0], "attention_out")
    _assert_same(got[1], want[1], "softmax_lse")
