"""The "npu" precision mode's int8 output step (quant_scale2, quant_offset2; docs/semantics/precision.md, PostQuant):
the kernels' rounding against the independent recipe of cann_attn.testing.npu_recipes.post_quant_recipe."""

from __future__ import annotations

import pytest
import torch

import cann_attn
from cann_attn.problem import precision as prec
from cann_attn.testing.npu_recipes import ifa_recipe, pfa_recipe, post_quant_recipe


def _ties_and_noise(shape, seed=0):
    """fp32 attention outputs with many values whose products land on or near fp16 and int8 ties."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(shape, generator=g) * 0.6
    o.view(-1)[::7] = (torch.randint(-200, 200, (o.view(-1)[::7].numel(),), generator=g) + 0.5) / 128
    return o


@pytest.mark.parametrize("kernel, per_channel, recipe_kwargs", [
    ("prompt_fp32", False, {}),
    ("prompt_fp32", True, {}),
    ("prompt_fp16", False, {}),
    ("prompt_fp16", True, {"scale_away": True}),
    ("incre", False, {}),
    ("incre", True, {"fp32_per_channel": True}),
])
def test_post_quant_step_is_the_recipe_bit_for_bit(kernel, per_channel, recipe_kwargs):
    pipeline = {"prompt_fp32": prec.pfa_pipeline(torch.bfloat16, 0), "prompt_fp16": prec.pfa_pipeline(torch.float16, 1),
                "incre": prec.ifa_pipeline(torch.float16, torch.float16)}[kernel]
    o = _ties_and_noise((2, 4, 16, 32))
    if kernel == "prompt_fp16":
        o = o.half().float()  # the fp16 pipeline's output is fp16
    g = torch.Generator().manual_seed(5)
    if per_channel:
        # fp32 factors on fp16 ties (1 + 2^-11 between 1 and 1 + 2^-10), where half away and half even differ
        scale = (100.0 + torch.randint(0, 40, (1, 4, 1, 32), generator=g).float()) * (1 + 2.0**-11)
        offset = torch.randint(-8, 8, (1, 4, 1, 32), generator=g).float() * (1 + 2.0**-11) + 0.25
    else:
        scale, offset = torch.tensor(113.37).view(1, 1, 1, 1), torch.tensor(-0.3).view(1, 1, 1, 1)
    step = prec.post_quant_pipeline(pipeline, per_channel)
    assert torch.equal(step(o, scale, offset), post_quant_recipe(o, scale, offset, **recipe_kwargs))
    assert torch.equal(step(o, scale, None), post_quant_recipe(o, scale, None, **recipe_kwargs))
    # Mutant: the exact rule (fp32 product, half to even) differs on these inputs.
    exact = torch.round(o * scale + offset).clamp(-128, 127).to(torch.int8)
    assert not torch.equal(exact, post_quant_recipe(o, scale, offset, **recipe_kwargs))


def _close_int8(actual: torch.Tensor, recipe: torch.Tensor) -> None:
    """At most one step apart everywhere, and unequal in at most 0.2% of the elements (a float output within
    2 ulps of its recipe can still cross an int8 rounding boundary)."""
    diff = (actual.int() - recipe.int()).abs()
    assert int(diff.max()) <= 1, f"int8 outputs {int(diff.max())} steps apart"
    share = float((diff > 0).double().mean())
    assert share <= 0.002, f"{share:.2%} of the int8 outputs differ from the recipe"


def _inputs(dtype, heads=4, sq=48, skv=160, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, sq, d, generator=g).to(dtype)
    k = torch.randn(1, heads, skv, d, generator=g).to(dtype)
    v = torch.randn(1, heads, skv, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype, per_channel", [(torch.float16, False), (torch.float16, True),
                                                (torch.bfloat16, True)])
def test_pfa_int8_output_rounds_as_the_kernel(dtype, per_channel):
    q, k, v = _inputs(dtype)
    g = torch.Generator().manual_seed(9)
    shape = (1, 4, 1, 64) if per_channel else (1,)
    scale = (150.0 + torch.rand(shape, generator=g) * 60).to(dtype if dtype == torch.bfloat16 else torch.float32)
    offset = (torch.rand(shape, generator=g) - 0.5).to(scale.dtype)
    kwargs = dict(num_heads=4, input_layout="BNSD", scale_value=0.125, next_tokens=2**31 - 1,
                  quant_scale2=scale, quant_offset2=offset)
    with cann_attn.precision("npu"):
        out = cann_attn.prompt_flash_attention(q, k, v, **kwargs)
    assert out.dtype == torch.int8
    half_compute = dtype == torch.float16  # torch_npu's PFA passes inner_precise=1: fp16 computes in fp16
    o = pfa_recipe(q, k, v, 0.125, 1, compute_output=True)
    recipe = post_quant_recipe(o, scale.float().view(-1, *shape[1:]) if per_channel else scale.float(),
                               offset.float().view(-1, *shape[1:]) if per_channel else offset.float(),
                               scale_away=per_channel and half_compute)
    _close_int8(out, recipe)
    # the exact rule (fp32 product of the rounded output) is not the kernel's
    exact = cann_attn.prompt_flash_attention(q, k, v, **kwargs)
    with pytest.raises(AssertionError):
        _close_int8(exact, recipe)


@pytest.mark.parametrize("per_channel", [False, True])
def test_decode_int8_output_rounds_as_the_ifa_kernel(per_channel):
    q, k, v = _inputs(torch.float16, sq=1, skv=300)
    q = torch.cat([q, q * 0.5])
    k, v = torch.cat([k, k.flip(2)]), torch.cat([v, v.flip(2)])
    g = torch.Generator().manual_seed(4)
    shape = (1, 4, 1, 64) if per_channel else (1,)
    scale = 500.0 + torch.rand(shape, generator=g) * 200  # outputs up to ~0.2: the whole int8 range
    offset = torch.rand(shape, generator=g) - 0.5
    recipe = post_quant_recipe(ifa_recipe(q, k, v, 0.125, compute_output=True), scale, offset,
                               fp32_per_channel=per_channel)
    with cann_attn.precision("npu"):
        fia, _ = cann_attn.fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD", scale=0.125,
                                                       quant_scale2=scale, quant_offset2=offset)
        ifa = cann_attn.incre_flash_attention(q, k, v, num_heads=4, input_layout="BNSD", scale_value=0.125,
                                              quant_scale2=scale, quant_offset2=offset)
    assert fia.dtype == torch.int8
    _close_int8(fia, recipe)
    assert torch.equal(fia, ifa)
    # the exact rule (fp32 product of the rounded output) is not the kernel's
    exact = cann_attn.fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD", scale=0.125,
                                                  quant_scale2=scale, quant_offset2=offset)[0]
    with pytest.raises(AssertionError):
        _close_int8(exact, recipe)
