"""trans_quant_param: bit-level checks against the independent oracle (docs/operators/prompt_flash_attention.md;
TransQuantParamV2 doc).

word = (fp32 bits of scale & 0xFFFFE000) | (1 << 46); with offset o = clamp(round(offset), -256, 255) stored as
(o & 0x1FF) << 37. Offsets here avoid exact .5 ties: the documents do not say which way those round.
"""

from __future__ import annotations

import struct

import pytest
import torch

import cann_attn
from cann_attn.testing.pfa_oracle import decode_deq_scale, trans_quant_param_oracle


def fp32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


SCALES = [1.0, 0.1, -0.1, 3.0e-5, 1.0e-38, 65504.0, 0.0, -0.0, 123.456, 2.0**-20 * 1.999, 1 / 3]


def test_oracle_against_hand_computed_words():
    """The oracle itself, on hand-computed words."""
    # 1.0 = 0x3F800000 (no low bits); 0.1 = 0x3DCCCCCD -> 0x3DCCC000
    assert int(trans_quant_param_oracle(torch.tensor([1.0]))[0]) == 0x3F800000 | (1 << 46)
    assert int(trans_quant_param_oracle(torch.tensor([0.1]))[0]) == 0x3DCCC000 | (1 << 46)
    # offset 3 -> 0b000000011 at bits 37..45; offset -1 -> 0x1FF
    assert int(trans_quant_param_oracle(torch.tensor([1.0]), torch.tensor([3.2]))[0]) == (
        0x3F800000 | (1 << 46) | (3 << 37)
    )
    assert int(trans_quant_param_oracle(torch.tensor([1.0]), torch.tensor([-1.0]))[0]) == (
        0x3F800000 | (1 << 46) | (0x1FF << 37)
    )


def test_no_offset_bit_exact():
    scale = torch.tensor(SCALES, dtype=torch.float32)
    out = cann_attn.trans_quant_param(scale)
    expected = trans_quant_param_oracle(scale)
    assert out.dtype == torch.int64
    assert tuple(out.shape) == tuple(scale.shape)
    assert out.tolist() == expected.tolist()
    for word, s in zip(out.tolist(), scale.tolist(), strict=True):
        assert word == (fp32_bits(s) & 0xFFFFE000) | (1 << 46)
        assert word >> 47 == 0, "nothing above bit 46"
        assert (word >> 32) & 0x7FFF == 1 << 14, "bits 32..45 clear, bit 46 set"


def test_random_scales_bit_exact(rng):
    scale = (torch.randn(257, generator=rng) * torch.exp(torch.randn(257, generator=rng) * 8)).to(torch.float32)
    assert cann_attn.trans_quant_param(scale).tolist() == trans_quant_param_oracle(scale).tolist()


@pytest.mark.parametrize(
    "offsets",
    [
        [0.0, 1.0, -1.0, 3.2, -3.7, 100.4, -100.6, 255.0, -256.0],
        [300.0, -300.0, 1.0e6, -1.0e6, 255.4, -256.4, 254.7],  # clamped
        [0.49, -0.49, 0.51, -0.51, 17.25, -17.75],
    ],
    ids=["in_range", "clamped", "near_half"],
)
def test_with_offset_bit_exact(offsets):
    scale = torch.linspace(0.01, 3.0, len(offsets), dtype=torch.float32)
    offset = torch.tensor(offsets, dtype=torch.float32)
    out = cann_attn.trans_quant_param(scale, offset)
    assert out.tolist() == trans_quant_param_oracle(scale, offset).tolist()
    for word, s, o in zip(out.tolist(), scale.tolist(), offsets, strict=True):
        field = (word >> 37) & 0x1FF
        signed = field - 512 if field >= 256 else field
        assert signed == max(-256, min(255, round(o)))
        assert word & 0xFFFFFFFF == fp32_bits(s) & 0xFFFFE000
        assert (word >> 46) & 1 == 1


def test_two_dim_scale_keeps_shape(rng):
    """scale [1, n] and offset [1, n] -> output [1, n]."""
    scale = torch.rand(1, 16, generator=rng, dtype=torch.float32) + 0.01
    offset = (torch.rand(1, 16, generator=rng, dtype=torch.float32) - 0.5) * 100
    out = cann_attn.trans_quant_param(scale, offset)
    assert tuple(out.shape) == (1, 16)
    assert out.tolist() == trans_quant_param_oracle(scale, offset).tolist()


def test_per_tensor_offset_broadcasts(rng):
    scale = torch.rand(8, generator=rng, dtype=torch.float32)
    offset = torch.tensor([-12.3])
    out = cann_attn.trans_quant_param(scale, offset)
    assert out.tolist() == trans_quant_param_oracle(scale, offset).tolist()


def test_per_tensor_scale_with_per_channel_offset_gives_per_channel_words(rng):
    """torch_npu npu_trans_quant_param: a 1-D scale and offset give the longer of the two shapes (t = 1 or n)."""
    scale = torch.tensor([0.37], dtype=torch.float32)
    offset = (torch.rand(8, generator=rng, dtype=torch.float32) - 0.5) * 50
    out = cann_attn.trans_quant_param(scale, offset)
    assert tuple(out.shape) == (8,)
    assert out.tolist() == trans_quant_param_oracle(scale, offset).tolist()


def test_decode_round_trip_is_truncation(rng):
    """The low 32 bits of a word read as fp32 are the scale with its 13 low mantissa bits cleared."""
    scale = torch.rand(64, generator=rng, dtype=torch.float32) * 10
    words = cann_attn.trans_quant_param(scale)
    for w, s in zip(words, scale.tolist(), strict=True):
        decoded = decode_deq_scale(w.reshape(1))
        assert fp32_bits(decoded) == fp32_bits(s) & 0xFFFFE000
        assert abs(decoded - s) <= abs(s) * 2.0**-10


def _from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# (fp32 bits in, high-19-bit pattern out) under round_mode 1: to nearest, ties to even on the 10 kept mantissa bits.
ROUNDED = {
    "exact": (0x3F800000, 0x3F800000),
    "below_half": (0x3F800FFF, 0x3F800000),
    "above_half": (0x3F801001, 0x3F802000),
    "tie_to_even_down": (0x3F801000, 0x3F800000),
    "tie_to_even_up": (0x3F803000, 0x3F804000),
    "negative": (0xBF801800, 0xBF802000),
    "carry_into_exponent": (0x3FFFFFFF, 0x40000000),
    "largest_finite_to_inf": (0x7F7FFFFF, 0x7F800000),
    "subnormal_to_zero": (0x00000FFF | 0x00400000, 0x00000000),
    "negative_subnormal": (0x80400001, 0x80000000),
    "inf": (0xFF800000, 0xFF800000),
    "nan_truncated": (0x7FC01FFF, 0x7FC00000),
}


@pytest.mark.parametrize("name", list(ROUNDED))
def test_round_mode_1_rounds_to_nearest_even(name):
    """round_mode 1 (TransQuantParamV2 "R_INT"): the op and the oracle against hand-worked bit patterns."""
    bits_in, high19 = ROUNDED[name]
    scale = torch.tensor([_from_bits(bits_in)], dtype=torch.float32)
    expected = high19 | (1 << 46)
    assert int(cann_attn.trans_quant_param(scale, round_mode=1)[0]) == expected
    assert int(trans_quant_param_oracle(scale, round_mode=1)[0]) == expected


def test_round_mode_1_random_scales_and_offsets_bit_exact(rng):
    """Random scales over many binades, with offsets; the oracle rounds the value, the op the bits."""
    scale = (torch.randn(4096, generator=rng) * torch.exp(torch.randn(4096, generator=rng) * 8)).to(torch.float32)
    offset = ((torch.rand(4096, generator=rng) - 0.5) * 600).to(torch.float32)
    for off in (None, offset):
        out = cann_attn.trans_quant_param(scale, off, round_mode=1)
        assert out.tolist() == trans_quant_param_oracle(scale, off, round_mode=1).tolist()
    rounded = cann_attn.trans_quant_param(scale, round_mode=1)
    truncated = cann_attn.trans_quant_param(scale)
    assert bool((rounded != truncated).any()), "rounding must differ from truncation somewhere"
    decoded = torch.tensor([decode_deq_scale(w.reshape(1)) for w in rounded[:512]], dtype=torch.float64)
    exact = scale[:512].double()
    assert bool(((decoded - exact).abs() <= exact.abs() * 2.0**-11).all()), "within half a kept ulp"


@pytest.mark.parametrize("round_mode", [2, -1, 1.0, True, "1"])
def test_round_mode_must_be_0_or_1(round_mode):
    with pytest.raises(cann_attn.ParamInvalidError, match="round_mode"):
        cann_attn.trans_quant_param(torch.tensor([1.0]), round_mode=round_mode)


def test_rejects_non_float32_scale():
    with pytest.raises(cann_attn.AclnnError) as info:
        cann_attn.trans_quant_param(torch.tensor([1.0], dtype=torch.float16))
    assert info.value.status_code == 161002 and "scale" in str(info.value)
