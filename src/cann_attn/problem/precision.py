"""Precision modes and the NPU kernels' rounding pipelines, described once (docs/semantics/precision.md).

Two modes:

- ``"exact"`` (the default): the operators' formulas in fp32 (float64 in the oracle), rounded once to each output's
  dtype. Nothing here touches that path.
- ``"npu"``: every operator rounds where the Ascend A2/A3 kernels round: each stage of its pipeline (the QK^T
  product, the scaled logits, the probabilities fed to P V, the P V product, the running output, the row-sum divisor,
  the outputs; for the gradients P and dS before their GEMMs) has a dtype and a rounding mode, read from the public
  kernel sources (the table of docs/semantics/precision.md cites file and line for each).

The mode comes from ``cann_attn.precision("npu")`` (a context manager, per thread and per asyncio task), else from the
environment variable ``CANN_ATTN_PRECISION`` (read at each call), else ``"exact"``. The reference backend computes
"npu" mode; the Triton kernels do not (yet): ``backend="auto"`` then runs the reference backend (with a
``BackendFallbackWarning`` on CUDA tensors), ``backend="triton"`` raises ParamInvalidError.

The pipelines (`AttentionPipeline`, `GradPipeline`) are what the reference backend and the golden tool read; the
independent recipes of ``cann_attn.testing.npu_recipes`` are written from the kernel sources, not from them.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ..errors import ParamInvalidError
from .quant import INT8_MAX, INT8_MIN, round_to_int8

__all__ = [
    "ASCEND_QUANT",
    "HALF_AWAY",
    "HALF_EVEN",
    "MODES",
    "PRECISION_ENV",
    "SFA_KEY_BLOCK",
    "AttentionPipeline",
    "Cast",
    "GradPipeline",
    "IndexerPipeline",
    "KeyShape",
    "PostQuant",
    "QuantIndexerPipeline",
    "amla_factor",
    "amla_rescale_bits",
    "current_mode",
    "fa_grad_pipeline",
    "fa_pipeline",
    "half_away",
    "ifa_pipeline",
    "indexer_pipeline",
    "infer_pipeline",
    "key_block",
    "kl_loss_pipeline",
    "npu_mode",
    "pfa_pipeline",
    "post_quant_pipeline",
    "precision",
    "quant_indexer_pipeline",
    "round_float",
    "round_half_away",
    "sfa_grad_pipeline",
    "sfa_pipeline",
]

MODES = ("exact", "npu")
PRECISION_ENV = "CANN_ATTN_PRECISION"
_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("cann_attn_precision", default=None)


def _check(mode: str, where: str) -> str:
    if mode not in MODES:
        raise ParamInvalidError(f"{where}: expected one of {list(MODES)}, got {mode!r}")
    return mode


def current_mode() -> str:
    """The precision mode of this call: the innermost `precision` block, else `CANN_ATTN_PRECISION`, else "exact"."""
    mode = _MODE.get()
    if mode is not None:
        return mode
    return _check(os.environ.get(PRECISION_ENV, "").strip().lower() or "exact", PRECISION_ENV)


def npu_mode() -> bool:
    """True when this call computes the NPU pipelines (`current_mode() == "npu"`)."""
    return current_mode() == "npu"


@contextlib.contextmanager
def precision(mode: str) -> Iterator[None]:
    """Compute every operator called inside the block in precision `mode` ("exact" or "npu"); it wins over
    `CANN_ATTN_PRECISION`, for this thread (or asyncio task) only. Blocks nest."""
    token = _MODE.set(_check(mode, "precision"))
    try:
        yield
    finally:
        _MODE.reset(token)


# Rounding modes of a cast. The Ascend vector Cast names them RoundMode::CAST_ROUND (half away from zero) and
# RoundMode::CAST_RINT (half to even); arithmetic results and the cube's fixpipe outputs round to nearest, ties to
# even (IEEE), which is also what a PyTorch `.to(dtype)` does.
HALF_AWAY = "half_away"
HALF_EVEN = "half_even"


# fp16: fp32 values from its smallest normal up are ties when their 13 fraction bits below fp16's are 1000...0; below
# it, fp16's spacing is a fixed 2^-24.
_FP16_MIN_NORMAL = 2.0**-14
_FP16_SUBNORMAL_STEPS = 2.0**24


def _ties(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where fp32 `y` lies exactly halfway between two neighbours of `dtype` (float16 or bfloat16)."""
    bits = y.view(torch.int32)
    if dtype == torch.bfloat16:  # bf16 is fp32's upper half, subnormals included
        return (bits & 0xFFFF) == 0x8000
    normal = (bits & 0x1FFF) == 0x1000
    steps = y.abs() * _FP16_SUBNORMAL_STEPS  # exact (a power of two)
    subnormal = (steps - steps.floor()) == 0.5
    return torch.where(y.abs() < _FP16_MIN_NORMAL, subnormal, normal)


# float64 -> fp32 "round to odd": the 29 fraction bits fp32 lacks are dropped and their being nonzero is kept in the
# lowest kept bit (a sticky bit). The result, exact in fp32, lies on a tie of float16 / bfloat16 (or on one of their
# values) only if the float64 value does, and rounds to them as the float64 value would: one rounding, not two.
_FP32_DROPPED_BITS = 29
_DROPPED_MASK = (1 << _FP32_DROPPED_BITS) - 1
_FP32_MIN_NORMAL_BITS = (1023 - 126) << 52  # float64 bit pattern of 2^-126


def _to_fp32_round_to_odd(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int64)
    # low + mask carries into bit 29 exactly when a dropped bit is set: the sticky bit without a comparison
    sticky = (bits & _DROPPED_MASK).add_(_DROPPED_MASK).bitwise_and_(1 << _FP32_DROPPED_BITS)
    return (bits & ~_DROPPED_MASK).bitwise_or_(sticky).view(torch.float64).to(torch.float32)


def _to_fp32_off_ties(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 `x` to fp32 to nearest, nudged one fp32 step back toward `x` where that step landed exactly on a tie of
    `dtype` (the only case in which two roundings differ from one): for fp32 subnormals, where round to odd does not
    apply (their spacing is coarser than the 29 dropped bits)."""
    y = x.to(torch.float32)
    off_tie = _ties(y, dtype) & (y.to(torch.float64) != x)
    if bool(off_tie.any()):
        toward = torch.where(x > y.to(torch.float64), float("inf"), float("-inf")).to(torch.float32)
        y = torch.where(off_tie, torch.nextafter(y, toward), y)
    return y


def _fp32_single_rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 `x` as an fp32 value that rounds to `dtype` (either rounding mode) as `x` itself does."""
    if dtype == torch.bfloat16:  # bf16 shares fp32's exponent range: its subnormals lie among fp32's
        magnitude = x.view(torch.int64) & 0x7FFFFFFFFFFFFFFF
        if bool(((magnitude < _FP32_MIN_NORMAL_BITS) & (magnitude != 0)).any()):
            return _to_fp32_off_ties(x, dtype)
    # fp16: every |x| < 2^-126 rounds to 0 either way, far below its smallest subnormal 2^-24
    return _to_fp32_round_to_odd(x)


def round_float(x: torch.Tensor, dtype: torch.dtype, rounding: str = HALF_EVEN) -> torch.Tensor:
    """`x` (fp32, or float64 such as an exact GEMM result) rounded ONCE to float16 or bfloat16, ties to even or away
    from zero (RoundMode::CAST_RINT / CAST_ROUND); returned in `dtype`.

    A float64 value is taken to an fp32 value that rounds as it does (`_fp32_single_rounding`); an fp32 value then
    rounds to nearest-even by the cast, and ties away from zero move one step outward (the other neighbour of a tie
    y rounded to r is y + (y - r), exact in fp32); bfloat16 rounds on the bit pattern (`_bf16_in_fp32`)."""
    y = _fp32_single_rounding(x, dtype) if x.dtype == torch.float64 else x.to(torch.float32)
    if dtype == torch.bfloat16:
        return _bf16_in_fp32(y, rounding).to(dtype)
    nearest = y.to(dtype)
    if rounding != HALF_AWAY:
        return nearest
    widened = nearest.to(torch.float32)
    inward = _ties(y, dtype) & (widened.abs() < y.abs())
    if not bool(inward.any()):
        return nearest
    # y + (y - r): both steps exact in fp32 (2y - r would overflow for |y| >= 2^127)
    return torch.where(inward, (y + (y - widened)).to(dtype), nearest)


_BF16_DROPPED = 0xFFFF  # the fp32 fraction bits bf16 lacks


def _bf16_in_fp32(y: torch.Tensor, rounding: str) -> torch.Tensor:
    """fp32 `y` rounded to bfloat16 and returned as fp32, on the bit pattern (bf16 is fp32's upper half): adding half
    of the dropped range (minus one, plus the kept lowest bit, for ties to even) and clearing the dropped bits rounds
    the magnitude, carries into the exponent included (overflow gives inf); a NaN takes the cast's own NaN (its bit
    pattern varies with the CPU path). Two conversions fewer than the cast round trip, and no tie search."""
    bits = y.view(torch.int32)
    half = 0x8000 if rounding == HALF_AWAY else 0x7FFF + ((bits >> 16) & 1)
    rounded = bits + half
    result = (rounded & ~_BF16_DROPPED).view(torch.float32)
    nan = torch.isnan(y)
    return torch.where(nan, y.to(torch.bfloat16).to(torch.float32), result) if bool(nan.any()) else result


def round_half_away(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded to `dtype` (float16 or bfloat16), ties away from zero (RoundMode::CAST_ROUND)."""
    return round_float(x, dtype, HALF_AWAY)


@dataclass(frozen=True)
class Cast:
    """One rounding point: values leave this stage as `dtype`, rounded `rounding` (HALF_EVEN or HALF_AWAY)."""

    dtype: torch.dtype
    rounding: str = HALF_EVEN

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (fp32, or a float64 GEMM result) rounded once to this stage and widened back to fp32 (the precision
        the next stage computes in)."""
        if self.dtype == torch.float32:
            return x.to(torch.float32)
        if self.dtype == torch.bfloat16:  # no round trip through a bf16 tensor
            y = _fp32_single_rounding(x, self.dtype) if x.dtype == torch.float64 else x.to(torch.float32)
            return _bf16_in_fp32(y, self.rounding)
        return round_float(x, self.dtype, self.rounding).to(torch.float32)

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.").replace("float16", "fp16").replace("bfloat16", "bf16")
        name = name.replace("float32", "fp32")
        return name if self.dtype == torch.float32 else f"{name}, {self.rounding.replace('_', ' ')}"


FP32 = Cast(torch.float32)


@dataclass(frozen=True)
class AttentionPipeline:
    """Where a forward kernel rounds. Every stage computes in fp32 from its inputs, then rounds to its Cast:

    scores = Q K^T (the GEMM accumulates in fp32); logits = scores * scale (the scale itself first rounded to
    `logits`' dtype) + pse, masked; row max and row sum in fp32 (online, per key block of `block`); probabilities =
    exp(logits - max) (with FA's dropout scale folded in when `dropout_in_probabilities`); products = P V;
    accumulator = accumulator * exp(old max - new max) + products; output = accumulator / divisor(row sum).
    """

    operator: str
    scores: Cast
    logits: Cast
    probabilities: Cast
    products: Cast
    accumulator: Cast
    divisor: Cast
    output: Cast
    dropout_in_probabilities: bool = False
    # Which kernel's tiling decides the key block (`key_block`): "fa", "pfa_fp16" (fp16 high performance),
    # "pfa_int8", "pfa_fp32" (fp16 high precision, bf16), "ifa", "sfa". P is rounded against its block's running
    # max, so the block boundaries change the bits.
    tiling: str = "fa"
    # The running output's rescale factor exp(old max - new max) (None: rounded as `accumulator`).
    rescale: Cast | None = None
    # SparseFlashAttention's AMLA step (`amla_factor`): P times 2^(m/ln2 - round(m/ln2)), rounded to the KV dtype,
    # before P's cast; the sum times the same factor.
    amla: bool = False

    @property
    def rescale_cast(self) -> Cast:
        return self.accumulator if self.rescale is None else self.rescale

    def stages(self) -> dict[str, Cast]:
        return {"scores": self.scores, "logits": self.logits, "probabilities": self.probabilities,
                "products": self.products, "accumulator": self.accumulator, "rescale": self.rescale_cast,
                "divisor": self.divisor, "output": self.output}


@dataclass(frozen=True)
class GradPipeline:
    """Where FlashAttentionScoreGrad rounds: D = rowsum(dy * y) in fp32 from the widened inputs; P recomputed in fp32
    from the saved statistics, dropout applied, rounded to `probabilities` before dV = P^T dy; dP = dy V^T in fp32;
    dS = P (dP - D) in fp32, rounded to `score_grad` before dQ = dS K and dK = dS^T Q (fp32 accumulation, times the
    scale in fp32); every gradient rounded to `outputs`."""

    operator: str
    probabilities: Cast
    score_grad: Cast
    outputs: Cast
    # The query-side gradient's rounding where it differs from `outputs` (written by a GEMM's fixpipe).
    query_output: Cast | None = None

    @property
    def query_outputs(self) -> Cast:
        return self.outputs if self.query_output is None else self.query_output


def half_away(dtype: torch.dtype) -> Cast:
    """The Cast to `dtype` half away from zero (RoundMode::CAST_ROUND); fp32 stays fp32."""
    return FP32 if dtype == torch.float32 else Cast(dtype, HALF_AWAY)


def pfa_pipeline(dtype: torch.dtype, inner_precise: int, pse: bool = False) -> AttentionPipeline:
    """PromptFlashAttention (and FIA's prefill kernel) for input `dtype`: fp16 with `inner_precise` bit 0 set
    (high performance) computes in fp16 (matmul outputs, scale, softmax, P V, the running output and the division),
    SoftmaxFlashV2 casting P and the rescale factor half away; fp16 with bit 0 clear (high precision), fp16 with a
    `pse` shift (the tiling forces high precision) and bf16 compute in fp32, cast P and the output half away; int8
    computes in fp16 like the high-performance mode (its P is quantised on top: `quant_attention`)."""
    if dtype == torch.int8 or (dtype == torch.float16 and inner_precise & 1 and not pse):
        half, away = Cast(torch.float16), Cast(torch.float16, HALF_AWAY)
        return AttentionPipeline("prompt_flash_attention", scores=half, logits=half, probabilities=away,
                                 products=half, accumulator=half, divisor=away, output=half, rescale=away,
                                 tiling="pfa_int8" if dtype == torch.int8 else "pfa_fp16")
    return AttentionPipeline("prompt_flash_attention", scores=FP32, logits=FP32, probabilities=half_away(dtype),
                             products=FP32, accumulator=FP32, divisor=FP32, output=half_away(dtype),
                             tiling="pfa_fp32")


def fa_pipeline(dtype: torch.dtype) -> AttentionPipeline:
    """FlashAttentionScore forward: fp32 throughout (fp16 inputs take the FLOAT16_PRECISION template whatever
    inner_precise says); P, with the dropout scale applied, cast to the input dtype half away before P V; the
    output cast half away."""
    return AttentionPipeline("flash_attention_score", scores=FP32, logits=FP32, probabilities=half_away(dtype),
                             products=FP32, accumulator=FP32, divisor=FP32, output=half_away(dtype),
                             dropout_in_probabilities=True)


def ifa_pipeline(kv_dtype: torch.dtype, out_dtype: torch.dtype) -> AttentionPipeline:
    """IncreFlashAttention (and FIA's decode kernel): fp32 throughout; P cast to the KV dtype half away before P V;
    a bf16 output rounds half to even, an fp16 one half away."""
    output = Cast(out_dtype, HALF_EVEN) if out_dtype == torch.bfloat16 else half_away(out_dtype)
    return AttentionPipeline("incre_flash_attention", scores=FP32, logits=FP32, probabilities=half_away(kv_dtype),
                             products=FP32, accumulator=FP32, divisor=FP32, output=output, tiling="ifa")


def infer_pipeline(op: str, dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype, inner_precise: int,
                   decode: bool, pse: bool = False) -> AttentionPipeline:
    """The pipeline of an inference operator's kernel: IncreFlashAttention, and FusedInferAttentionScore with one
    query token (`decode`), run the IFA kernel; PromptFlashAttention and FIA's prefill the PFA kernel with
    `inner_precise` (torch_npu's npu_prompt_flash_attention passes 1). An int8 output leaves the pipeline in its
    compute dtype (the accumulator's: no output cast) and is quantised by `post_quant_pipeline`."""
    if op == "incre_flash_attention" or (op.startswith("fused_infer_attention_score") and decode):
        pipeline = ifa_pipeline(kv_dtype, dtype if out_dtype == torch.int8 else out_dtype)
    else:
        pipeline = pfa_pipeline(dtype, inner_precise, pse)
    return replace(pipeline, output=pipeline.accumulator) if out_dtype == torch.int8 else pipeline


def _round_int8(y: torch.Tensor, rounding: str) -> torch.Tensor:
    """fp16-valued `y` to int8, ties to even or away from zero, saturated to [-128, 127]."""
    if rounding == HALF_EVEN:
        return round_to_int8(y)
    return _round_integer_half_away(y).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def _round_integer_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


@dataclass(frozen=True)
class PostQuant:
    """Where an int8 output (quant_scale2, quant_offset2) rounds: the attention output enters as `operand`, the
    scale and offset as `factors`; the product and the sum each round to `arithmetic`; the result is staged in
    `staging` (fp16) and cast to int8 rounding `int8_rounding`, saturated."""

    operator: str
    operand: Cast
    factors: Cast
    arithmetic: Cast
    staging: Cast
    int8_rounding: str

    def __call__(self, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        """int8 of `x` (fp32, already in the pipeline's compute dtype) with `scale` / `offset` (fp32, broadcast)."""
        # fp16 operands: their product and sum are exact in float64, so one Cast rounds each once; fp32 arithmetic
        # rounds natively.
        wide = torch.float32 if self.arithmetic.dtype == torch.float32 else torch.float64
        y = self.arithmetic(self.operand(x).to(wide) * self.factors(scale).to(wide))
        if offset is not None:
            y = self.arithmetic(y.to(wide) + self.factors(offset).to(wide))
        return _round_int8(self.staging(y), self.int8_rounding)


# AscendC's AscendQuant on A2/A3 (fp16 throughout, half to even): the int8 quantisation of PromptFlashAttention's P
# (quant_scale1) and of the outputs below.
_HALF = Cast(torch.float16)
ASCEND_QUANT = PostQuant("AscendQuant", operand=_HALF, factors=_HALF, arithmetic=_HALF, staging=_HALF,
                         int8_rounding=HALF_EVEN)


def post_quant_pipeline(pipeline: AttentionPipeline, per_channel: bool) -> PostQuant:
    """The int8 output step of the kernel `pipeline` describes. IncreFlashAttention's kernel (also FIA decode) with
    a per-channel scale computes x * scale + offset in fp32, casts to fp16 and then to int8, both half away from
    zero; every other case calls AscendQuant, which works in fp16: x, scale and offset to fp16 (half to even), fp16
    product and sum, fp16 to int8 half to even. PromptFlashAttention's fp16-compute kernels (high performance, int8
    inputs) round a per-channel fp32 scale and offset to fp16 half away before AscendQuant."""
    if pipeline.operator == "incre_flash_attention" and per_channel:
        return PostQuant(pipeline.operator, operand=FP32, factors=FP32, arithmetic=FP32,
                         staging=Cast(torch.float16, HALF_AWAY), int8_rounding=HALF_AWAY)
    if per_channel and pipeline.accumulator.dtype == torch.float16:
        return replace(ASCEND_QUANT, operator=pipeline.operator, factors=Cast(torch.float16, HALF_AWAY))
    return replace(ASCEND_QUANT, operator=pipeline.operator)


@dataclass(frozen=True)
class IndexerPipeline:
    """Where LightningIndexer's A2/A3 kernel rounds its scores: the cube's fp32 Q . K leaves through the fixpipe with
    the ReLU as `dots` (fp32); each head's term w_h * dots_h is an fp32 product (the weight widened exactly); the
    head sum runs in fp32 in the kernel's order: the heads in groups of `head_group`, each later group added
    element-wise into the first group's rows, then a halving tree over those rows (rows beyond the largest power of
    two folded in first); the returned values are cast to the input dtype as `values`."""

    operator: str
    dots: Cast
    values: Cast
    head_group: int = 16


def indexer_pipeline(dtype: torch.dtype) -> IndexerPipeline | None:
    """LightningIndexer's pipeline for fp16 / bf16 inputs (values cast half away); None for other dtypes (they
    compute as "exact")."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    return IndexerPipeline("lightning_indexer", dots=FP32, values=half_away(dtype))


@dataclass(frozen=True)
class QuantIndexerPipeline:
    """Where QuantLightningIndexer's A2/A3 kernel rounds its scores: the int32 products leave the cube through the
    fixpipe as `dots` = fp16(ReLU(Q . K) * `dot_scale`); the vector unit folds W * Scale_Q into `folded` (fp16
    operands, fp16 product); the cube sums folded_h * dots_h over the heads into `scores` (fp32); the vector unit
    multiplies by Scale_K in fp32. The constant `dot_scale` leaves the order of the scores (all the operator
    returns) unchanged but decides which products round to the same fp16 value."""

    operator: str
    dots: Cast
    folded: Cast
    scores: Cast
    dot_scale: float = 2.0**-10


def quant_indexer_pipeline(query_dtype: torch.dtype, weights_dtype: torch.dtype) -> QuantIndexerPipeline | None:
    """QuantLightningIndexer's pipeline for int8 inputs with fp16 weights and scales (the A2/A3 kernel's `half`
    operands); None for the other combinations, which no A2/A3 kernel source shows (they compute as "exact")."""
    if query_dtype != torch.int8 or weights_dtype != torch.float16:
        return None
    return QuantIndexerPipeline("quant_lightning_indexer", dots=Cast(torch.float16), folded=Cast(torch.float16),
                                scores=FP32)


# SparseFlashAttention's AMLA step, in fp32 as the kernel computes it (each operation one fp32 rounding).
_LN2 = torch.tensor(0.6931471805599453094172, dtype=torch.float32)
_RECIP_LN2 = 1.0 / _LN2  # an fp32 division of fp32 constants, as the kernel's constexpr
_AMLA_MIN_STEP = -30.0
_AMLA_EPS_GAIN = 1.5
_AMLA_EPS = torch.tensor(0.000001, dtype=torch.float32)
_MANTISSA_UNIT = 2.0**23


def amla_factor(row_max: torch.Tensor, kv: Cast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, c, cof) of AMLA for fp32 running maxima `row_max`: n = round_half_away(-max / ln2) (an integer in fp32);
    e = exp((max / ln2 + n) ln2), about 2^(max / ln2 - round(max / ln2)); c = e rounded to the KV dtype (`kv`) and
    widened; cof = e / c. P is multiplied by c before its cast and the row sum by c at the end."""
    n = _round_integer_half_away(row_max * -_RECIP_LN2)
    e = torch.exp(((row_max * _RECIP_LN2) + n) * _LN2)
    c = kv(e)
    return n, c, e / c


def amla_rescale_bits(acc: torch.Tensor, n_old: torch.Tensor, n_new: torch.Tensor, cof_old: torch.Tensor,
                      cof_new: torch.Tensor) -> torch.Tensor:
    """The running output `acc` (fp32, rows of [.., rows, D]) moved to the new step's scale the AMLA way: the int32
    round_half_away((max(n_new - n_old, -30) + 1.5 (cof_old / cof_new - 1) + 1e-6) 2^23), each step in fp32, added
    to every element's bit pattern (a power-of-two rescale and a linear correction of the mantissa)."""
    eps = ((cof_old / cof_new) - 1.0) * _AMLA_EPS_GAIN + _AMLA_EPS
    step = ((n_new - n_old).clamp(min=_AMLA_MIN_STEP) + eps) * _MANTISSA_UNIT
    bits = _round_integer_half_away(step).to(torch.int32).unsqueeze(-1)
    return (acc.contiguous().view(torch.int32) + bits).view(torch.float32)


@dataclass(frozen=True)
class KeyShape:
    """What the kernels' tiling reads to size the key block: the longest query and key sequence of the call, the
    query-key head dim, whether an attention-mask tensor is given, the layout, the query heads per kv head, and the
    page size of a paged cache (0: contiguous)."""

    seq_q: int
    seq_kv: int
    dim: int
    has_mask: bool = False
    layout: str = "BNSD"
    group: int = 1
    page_size: int = 0


_FA_BASE = 128  # FlashAttentionScore's s2 basic block; nRatio of them form one softmax step


def _fa_key_block(shape: KeyShape) -> int:
    """FlashAttentionScore forward: 128-column basic blocks, nRatio of them per vector step (8; 5 when
    1024 < S2 <= 1040; 6 for 2049 <= S2 <= 2304 with D = 64 in BNSD); TND always 8. S2 <= 1024 is one step."""
    n_ratio = 8
    if shape.layout != "TND":
        if shape.seq_kv // _FA_BASE == 8 and 0 < shape.seq_kv % _FA_BASE <= 16:
            n_ratio = 5
        if 2049 <= shape.seq_kv <= 2304 and shape.dim == 64 and shape.layout == "BNSD":
            n_ratio = 6
    return _FA_BASE * n_ratio


def _pfa_key_block(tiling: str, shape: KeyShape) -> int:
    """PromptFlashAttention (and FIA prefill): sInner 1024, 512 for Skv <= 1024 (not int8) and in the fp32-compute
    kernels (fp16 high precision, bf16); with Sq <= 16, no mask and Skv > 2048: 2048 on every path."""
    block = 1024
    if shape.seq_kv <= 1024 and tiling != "pfa_int8":
        block = 512
    if tiling == "pfa_fp32":
        block = 512
    if shape.seq_q <= 16 and shape.seq_kv > 2048 and not shape.has_mask:
        block = 2048
    return block


_IFA_BLOCKS = (8192, 4096, 2048)  # by query heads per kv head: < 5, < 10, more


def _ifa_key_block(shape: KeyShape) -> int:
    """IncreFlashAttention (and FIA decode): sInner 8192 / 4096 / 2048 as the group grows, floored to a multiple of
    the page size in a paged cache."""
    block = _IFA_BLOCKS[min(shape.group // 5, 2)]
    if shape.page_size and block % shape.page_size:
        block = block // shape.page_size * shape.page_size
    return block


SFA_KEY_BLOCK = 512  # SparseFlashAttention's s2 base size (selected keys per softmax step)


def key_block(pipeline: AttentionPipeline, shape: KeyShape) -> int:
    """The key block (columns of one online-softmax step) of `pipeline`'s kernel for a call of `shape`, as the
    kernel's host tiling decides it (docs/semantics/precision.md, "Key blocks")."""
    if pipeline.tiling == "fa":
        return _fa_key_block(shape)
    if pipeline.tiling.startswith("pfa"):
        return _pfa_key_block(pipeline.tiling, shape)
    if pipeline.tiling == "ifa":
        return _ifa_key_block(shape)
    return SFA_KEY_BLOCK


def fa_grad_pipeline(dtype: torch.dtype) -> GradPipeline:
    """FlashAttentionScoreGrad: P and dS cast to the input dtype half away before their GEMMs; gradients half away."""
    cast = half_away(dtype)
    return GradPipeline("flash_attention_score_grad", probabilities=cast, score_grad=cast, outputs=cast)


def sfa_pipeline(kv_dtype: torch.dtype, out_dtype: torch.dtype) -> AttentionPipeline:
    """SparseFlashAttention: IncreFlashAttention's stages over the selected keys (fp32; P to the KV dtype half away;
    bf16 output half to even, fp16 half away), with the AMLA step (`amla_factor`) before P's cast."""
    return replace(ifa_pipeline(kv_dtype, out_dtype), operator="sparse_flash_attention", tiling="sfa", amla=True)


def sfa_grad_pipeline(dtype: torch.dtype) -> GradPipeline:
    """SparseFlashAttentionGrad: FlashAttentionScoreGrad's stages over the selected keys."""
    return replace(fa_grad_pipeline(dtype), operator="sparse_flash_attention_grad")


def kl_loss_pipeline(dtype: torch.dtype) -> GradPipeline:
    """SparseLightningIndexerGradKLLoss: fp32 throughout; the ReLU gradient dI/d(q.k) = w (q - p) [q.k > 0] cast to
    the index dtype half away before d_query_index and d_key_index; d_key_index and d_weights cast half away,
    d_query_index written by its GEMM (half to even). (`probabilities` is unused: the target stays fp32.)"""
    cast = half_away(dtype)
    return GradPipeline("sparse_lightning_indexer_grad_kl_loss", probabilities=FP32, score_grad=cast, outputs=cast,
                        query_output=Cast(dtype))
