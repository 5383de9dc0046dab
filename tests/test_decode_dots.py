"""The decode loop's scores of bf16 query rows and bf16 keys (docs/guides/backends.md, "Decode"): AVX512-BF16 dot
products and their emulations (16 lanes with AVX-512F, 8 with AVX2) give the same bits, and all follow the documented
order, checked against a model of it written here from the documented rule (fp32 FMAs from float64 sums, odd column
first in each pair of a lane, the 16 lanes in a fixed tree, then times the scale, subnormals flushed throughout)."""

from __future__ import annotations

import math

import pytest
import torch

from cann_attn.backends.reference import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the native loops")

HAS_DOT = native.library() is not None and native.set_bf16_dot(True)
MIN_NORMAL = 2.0**-126
SCALE = 0.3


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Subnormal values to zeros of their sign."""
    return torch.where(x.abs() < MIN_NORMAL, x * 0, x)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), rounded once: a b is exact in float64 (bf16 operands) and the float64 sum rounds to the
    same fp32 value as the exact one (the operands' bits are too far apart for a double rounding to land on a tie)."""
    return (a.double() * b.double() + c.double()).float()


def documented_dots(q: torch.Tensor, k: torch.Tensor, scale: float, even_first: bool = False,
                    flush: bool = True) -> torch.Tensor:
    """scale * q k^T [H, n] in the documented order; `even_first` swaps each lane's pair, `flush=False` keeps
    subnormals (wrong orders, for the tests that show a difference is seen)."""
    keep = _flush if flush else (lambda x: x)
    dim = q.shape[1]
    width = math.ceil(dim / 32) * 32
    qf = keep(torch.nn.functional.pad(q.float(), (0, width - dim)))
    kf = keep(torch.nn.functional.pad(k.float(), (0, width - dim)))
    acc = torch.zeros(q.shape[0], k.shape[0], 16)
    for c in range(width // 32):
        for first in ((0, 1) if even_first else (1, 0)):
            cols = slice(32 * c + first, 32 * c + 32, 2)
            acc = keep(_fma32(qf[:, None, cols], kf[None, :, cols], acc))
    x = keep(acc[..., :8] + acc[..., 8:])
    x = keep(x[..., :4] + x[..., 4:])
    x = keep(x[..., :2] + x[..., 2:])
    return keep(keep(x[..., 0] + x[..., 1]) * torch.tensor(scale, dtype=torch.float32))


def _bf16(shape, gen, exponent_low: int = -4, exponent_high: int = 4) -> torch.Tensor:
    """Random bf16 values of random sign with magnitudes 2^e, e uniform in [exponent_low, exponent_high)."""
    mantissa = torch.rand(shape, generator=gen) + 1.0
    exponent = torch.randint(exponent_low, exponent_high, shape, generator=gen).double()
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return (sign * mantissa.double() * torch.pow(2.0, exponent)).to(torch.bfloat16)


def _inputs(kind: str, gen, heads: int, n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [heads, dim], k [n, dim]. "normal": magnitudes 2^-4..2^4. "tiny": products near 2^-126, so that partial
    sums are subnormal or cross it (flushed), zeros of both signs among them. "subnormal": bf16 subnormal query
    entries (below 2^-126) in some columns, where the keys are huge: unflushed, their products (~2^-20) would show in
    sums of order 1."""
    if kind == "normal":
        return _bf16((heads, dim), gen), _bf16((n, dim), gen)
    if kind == "tiny":
        q, k = _bf16((heads, dim), gen, -66, -60), _bf16((n, dim), gen, -66, -60)
        k[torch.rand(n, dim, generator=gen) < 0.05] = -0.0
        return q, k
    q, k = _bf16((heads, dim), gen, -1, 1), _bf16((n, dim), gen, -1, 1)
    columns = torch.rand(dim, generator=gen) < 0.3
    q[:, columns] = _bf16((heads, int(columns.sum())), gen, -133, -127)
    k[:, columns] = _bf16((n, int(columns.sum())), gen, 104, 108)
    return q, k


KINDS = ["normal", "tiny", "subnormal"]
SHAPES = [(1, 17, 128), (2, 16, 128), (3, 21, 40), (4, 33, 64), (5, 9, 33), (8, 40, 576), (4, 7, 1), (6, 19, 96)]


@pytest.fixture(params=[True, False], ids=["avx512", "avx2"])
def vector_width(request):
    """The emulation's 16-lane (AVX-512F) or 8-lane (AVX2) kernel."""
    if request.param and not native.library().cann_attn_has_avx512():
        pytest.skip("needs AVX-512F")
    try:
        native.set_avx512(request.param)
        yield request.param
    finally:
        native.set_avx512(not native._switched_off(native.AVX512_SWITCH))


@pytest.mark.parametrize("heads, n, dim", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_emulation_follows_the_documented_order(heads, n, dim, kind, vector_width):
    gen = torch.Generator().manual_seed(heads * 1000 + n * 10 + dim)
    q, k = _inputs(kind, gen, heads, n, dim)
    got = native.decode_dots(q, k, SCALE, emulate=True)
    assert torch.equal(got.view(torch.int32), documented_dots(q, k, SCALE).view(torch.int32))


@pytest.mark.skipif(not HAS_DOT, reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("heads, n, dim", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_dot_products_give_the_emulation_bits(heads, n, dim, kind):
    gen = torch.Generator().manual_seed(heads * 1000 + n * 10 + dim + 1)
    q, k = _inputs(kind, gen, heads, n, dim)
    instruction = native.decode_dots(q, k, SCALE, emulate=False)
    assert torch.equal(instruction.view(torch.int32), native.decode_dots(q, k, SCALE, emulate=True).view(torch.int32))
    assert torch.equal(instruction.view(torch.int32), documented_dots(q, k, SCALE).view(torch.int32))


def test_the_pair_order_is_observable():
    """The check above can fail: with the pair's even column first the documented model gives other bits on these
    inputs (a change of the kernels' order would be caught the same way)."""
    gen = torch.Generator().manual_seed(5)
    q, k = _bf16((4, 128), gen), _bf16((64, 128), gen)
    want = documented_dots(q, k, SCALE)
    assert not torch.equal(documented_dots(q, k, SCALE, even_first=True), want)
    assert torch.equal(native.decode_dots(q, k, SCALE, emulate=True), want)


def test_the_scale_is_applied_after_the_sum():
    """scale * (q . k) in fp32, not (scale * q) . k: a scale that is not a power of two changes the bits of the
    second but the first is one rounding of the unscaled sum."""
    gen = torch.Generator().manual_seed(6)
    q, k = _bf16((4, 128), gen), _bf16((32, 128), gen)
    unscaled = native.decode_dots(q, k, 1.0, emulate=True)
    assert torch.equal(native.decode_dots(q, k, 0.1, emulate=True), unscaled * torch.tensor(0.1))


@pytest.mark.parametrize("kind", ["tiny", "subnormal"])
def test_the_flushes_are_observable(kind):
    """The inputs that check the flushes reach them: without the flushes the model gives other bits."""
    gen = torch.Generator().manual_seed(7)
    q, k = _inputs(kind, gen, 4, 64, 128)
    unflushed = documented_dots(q, k, SCALE, flush=False)
    assert not torch.equal(unflushed.view(torch.int32), documented_dots(q, k, SCALE).view(torch.int32))


@pytest.mark.parametrize("dim", [64, 40])
def test_special_values_give_the_same_scores_on_every_path(dim, vector_width):
    """Infinities, values whose products overflow, zeros of both signs, bf16 subnormals and NaN among the inputs: the
    emulation gives the instruction's bits (where the CPU has it) and, without NaN, the documented model's; a NaN
    score is NaN on every path (its sign and payload are not kept: the AVX2 emulation's tree may take another
    NaN operand first)."""
    gen = torch.Generator().manual_seed(dim)
    specials = torch.tensor([math.inf, -math.inf, 3e38, -3e38, 0.0, -0.0, 1e-39, -1e-39, math.nan])  # NaN last
    for trial in range(40):
        q, k = _bf16((4, dim), gen), _bf16((20, dim), gen)
        for x in (q, k):
            pick = torch.rand(x.shape, generator=gen) < 0.03
            x[pick] = specials[torch.randint(0, len(specials) - (trial % 2), x.shape, generator=gen)][pick].to(x.dtype)
        got = native.decode_dots(q, k, SCALE, emulate=True)
        if trial % 2:  # no NaN among the inputs: the model's bits
            want = documented_dots(q, k, SCALE)
        elif HAS_DOT:
            want = native.decode_dots(q, k, SCALE, emulate=False)
        else:
            continue
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
