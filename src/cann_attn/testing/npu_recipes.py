"""Independent recipes of the NPU kernels' rounding, for tests of the "npu" precision mode
(docs/semantics/precision.md).

Written from the public kernel sources (Ascend ops-transformer `op_kernel` code; the table of the precision page
cites file and line for each cast) and from op-plugin's test goldens, not from cann_attn's kernels or its pipeline
descriptions: each recipe forms the whole [Sq, Skv] score matrix of a small BNSD problem in fp32 and rounds, in
one place each, where the kernel does. Rounding is done here from float64 by explicit spacing arithmetic (another
route than `problem.precision`'s), half to even or half away from zero.

`assert_within_ulps` is the gate: at most 2 ulps of the output dtype, except a tail of at most 0.5% of the elements,
which must still be within 4 ulps of their row's largest value (nearly cancelling sums).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "assert_within_ulps",
    "attention_update_recipe",
    "fa_grad_recipe",
    "fa_recipe",
    "ifa_recipe",
    "kernel_key_tile",
    "kl_loss_recipe",
    "lightning_indexer_recipe",
    "op_plugin_pfa_golden",
    "pfa_recipe",
    "post_quant_recipe",
    "quant_indexer_recipe",
    "ring_update_recipe",
    "rnd",
    "sfa_grad_recipe",
    "sfa_recipe",
    "ulp",
    "ulp_errors",
    "ulp_verdict",
]

_FORMAT = {torch.float16: (10, -14), torch.bfloat16: (7, -126)}  # fraction bits, smallest normal exponent


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (float64): 2^(e - fraction bits) with 2^e <= |x| < 2^(e+1), subnormals fixed."""
    if dtype == torch.float32:
        bits, emin = 23, -126
    else:
        bits, emin = _FORMAT[dtype]
    x = x.to(torch.float64).abs()
    _, exponent = torch.frexp(x)  # |x| = m * 2^exponent, m in [0.5, 1)
    return torch.exp2((exponent - 1).clamp(min=emin).to(torch.float64) - bits)


def rnd(x: torch.Tensor, dtype: torch.dtype, away: bool = False) -> torch.Tensor:
    """`x` rounded once to `dtype` (half to even, or half away from zero with `away`), returned as float32."""
    if dtype == torch.float32:
        return x.to(torch.float32)
    x = x.to(torch.float64)
    spacing = ulp(x, dtype)
    steps = x.abs() / spacing
    rounded = torch.floor(steps + 0.5) if away else torch.round(steps)
    result = (torch.sign(x) * rounded * spacing).to(dtype)
    return torch.where(torch.isfinite(x), result, x.to(dtype)).to(torch.float32)


def _softmax_parts(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row max, exp(s - max), row sum) in fp32; rows without a finite logit give 0 terms."""
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    return m, e, e.sum(-1, keepdim=True)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float64: the cube's fp32 accumulation taken as exact (its order is not public); callers round."""
    return a.to(torch.float64) @ b.to(torch.float64)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def kernel_key_tile(op: str, *, sq: int, skv: int, d: int = 128, masked: bool = False, layout: str = "BNSD",
                    group: int = 1, dtype: torch.dtype = torch.float16, inner_precise: int = 1,
                    block_size: int = 0) -> int:
    """Columns of one online-softmax step, read off the kernels' host tiling (the precision page cites the lines).

    "fa": flash_attention_score_tiling_general.cpp: s2 basic block min(128, S2) times nRatio; nRatio is 8, but 5
    when S2 / 128 == 8 with a remainder of 1..16, and 6 when 2049 <= S2 <= 2304, D == 64 and BNSD (not TND).
    "pfa": prompt_flash_attention_tiling.cpp AdjustCVTilingCVDiff: rectangleFactor 1024; 512 when KV_S <= 1024
    and the input is not int8; 512 for bf16 and fp16 high precision; 2048 when Q_S <= 16, KV_S > 2048 and no
    mask. "ifa": incre_flash_attention_tiling.cpp CalcInnerSize: {8192, 4096, 2048}[min(G / 5, 2)]; over a paged
    cache (`block_size` > 0, PageAttention) a step the block size does not divide is cut down to whole blocks
    (sInnerSize_ / blockSize_ * blockSize_).
    "sfa": 512 (the SFA vector's largest step)."""
    if op == "fa":
        ratio = 8
        if layout != "TND" and skv // 128 == 8 and skv % 128 in range(1, 17):
            ratio = 5
        if layout == "BNSD" and d == 64 and 2049 <= skv <= 2304:
            ratio = 6
        return 128 * ratio
    if op == "pfa":
        precise = dtype == torch.bfloat16 or (dtype == torch.float16 and not inner_precise & 1)
        tile = 512 if precise or (skv <= 1024 and dtype != torch.int8) else 1024
        return 2048 if sq <= 16 and skv > 2048 and not masked else tile
    if op == "ifa":
        inner = [8192, 4096, 2048][min(group // 5, 2)]
        return inner - inner % block_size if block_size else inner
    return 512


def _online(s: torch.Tensor, v: torch.Tensor, tile: int, to_p, mix):
    """The kernels' online softmax over column steps of `tile`: per step, the new running max m (fp32), e =
    exp(s - m) in fp32, the fp32 sum updated with exp(m_old - m), P = to_p(e, the step's columns), and the running
    output updated by
    `mix(acc, exp(m_old - m), P)` (acc None on the first step). Returns (acc, max, sum)."""
    m = torch.full((*s.shape[:-1], 1), float("-inf"))
    total = torch.zeros_like(m)
    acc = None
    for c0 in range(0, s.shape[-1], tile):
        part = s[..., c0:c0 + tile]
        m_new = torch.maximum(m, part.amax(-1, keepdim=True))
        base = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        e = torch.exp(part - base)
        carry = torch.exp(m - base)
        total = total * carry + e.sum(-1, keepdim=True)
        acc = mix(acc, carry, to_p(e, slice(c0, c0 + tile)), v[..., c0:c0 + tile, :])
        m = m_new
    return acc, m, total


def _fp32_mix(acc, carry, p, v_part):
    """fp32 running output: acc * carry + P V (the product taken exactly, rounded once to fp32)."""
    pv = _matmul(p, v_part).float()
    return pv if acc is None else acc * carry + pv


def pfa_recipe(q, k, v, scale: float, inner_precise: int = 1, mask: torch.Tensor | None = None,
               pse: torch.Tensor | None = None, int8: dict | None = None, compute_output: bool = False,
               tile: int | None = None) -> torch.Tensor:
    """PromptFlashAttention on BNSD tensors, online over key steps of `tile` columns (default: the kernel's,
    `kernel_key_tile`).

    fp16 with inner_precise bit 0 set and no pse (the tiling switches fp16 with pse to high precision), and int8
    (prompt_flash_attention_base.h: mmOutputType and softmaxType half): S = half(Q K^T) (int8: half(int32 *
    deq_scale1)); S = half(S * half(scale)) (x910.h Muls in computeType); max / sum fp32 (SoftmaxFlashV2 with float
    max / sum); P and the rescale factor exp(m_old - m) cast to half with CAST_ROUND (SoftmaxFlashV2's v220
    FLOAT2HALF_ROUND_MODE); int8: P = int8(half(P * half(quant_scale1))), PV = half(int32 * deq_scale2); else
    PV = half(P V); running output half(half(acc * factor) + PV); O = half(acc / half_away(sum)) (Bmm2UpdateDivNoTail
    casts the sum CAST_ROUND, divides in half).
    fp16 with bit 0 clear or with pse, and bf16: fp32 throughout (pse added in fp32), P = half_away(exp(S - max)) to
    the input dtype (x910.h SoftmaxResCopyOut, CAST_ROUND), O = half_away(acc / sum) (x910_base.h
    DataCopyTransposeOut, CAST_ROUND).
    `mask`: True = masked, broadcast to [B, N, Sq, Skv]. `int8`: deq1, quant1, deq2 floats. `compute_output`: O as
    the kernel holds it before the output cast (fp32 in the fp32 pipelines), what an int8 output quantises.
    """
    heads = q.shape[1]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    low = int8 is not None or (q.dtype == torch.float16 and inner_precise & 1 and pse is None)
    if tile is None:
        tile = kernel_key_tile("pfa", sq=q.shape[2], skv=k.shape[2], masked=mask is not None,
                               dtype=torch.int8 if int8 is not None else q.dtype,
                               inner_precise=inner_precise if low or q.dtype != torch.float16 else 0)
    if int8 is not None:
        s = rnd(_matmul(q, k.transpose(-1, -2)) * int8["deq1"], torch.float16)
    else:
        s = _matmul(q, k.transpose(-1, -2))
    if low:
        half = torch.float16
        s = rnd(rnd(s, half) * rnd(torch.tensor(scale), half), half)
        if pse is not None:
            s = rnd(s + pse.float(), half)
    else:
        s = s.float() * scale
        if pse is not None:
            s = s + pse.float()
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    if not low:
        acc, _, total = _online(s, v, tile, lambda e, _: rnd(e, q.dtype, away=True), _fp32_mix)
        o = acc / total
        o = o if compute_output else rnd(o, q.dtype, away=True)
        return o.masked_fill(total == 0, 0.0)
    half = torch.float16

    def products(p, v_part):
        if int8 is None:
            return rnd(_matmul(p, v_part), half)
        # AscendQuant (QuantCompute with the float quant_scale1): the scale held in half, the product in half
        p_q = torch.round(rnd(p.double() * rnd(torch.tensor(int8["quant1"]), half).double(), half)).clamp(-128, 127)
        return rnd(_matmul(p_q, v_part) * int8["deq2"], half)

    def mix(acc, carry, p, v_part):
        pv = products(p, v_part)
        return pv if acc is None else rnd(rnd(acc.double() * rnd(carry, half, away=True).double(), half).double()
                                          + pv.double(), half)

    acc, _, total = _online(s, v, tile, lambda e, _: rnd(e, half, away=True), mix)
    o = rnd(acc.double() / rnd(total, half, away=True).double(), half)
    return o.masked_fill(total == 0, 0.0)


def fa_recipe(q, k, v, scale: float, mask: torch.Tensor | None = None,
              keep: torch.Tensor | None = None, keep_prob: float = 1.0, tile: int | None = None,
              layout: str = "BNSD") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttentionScore forward on BNSD tensors: (out, row max, row sum), online over key steps of `tile`
    (default: the kernel's, `kernel_key_tile`; `layout` the call's). fp32 throughout (fp16 takes the
    FLOAT16_PRECISION template, flash_attention_score.cpp); S = (Q K^T) * scale; max / sum fp32; P = exp(S - max),
    times keep / keep_prob, cast half away to the input dtype (s1s2_bn2gs1.h, Cast CAST_ROUND before bmm2);
    O = half_away(PV / sum) (Cast CAST_ROUND of the attention output)."""
    heads = q.shape[1]
    if tile is None:
        tile = kernel_key_tile("fa", sq=q.shape[2], skv=k.shape[2], d=q.shape[-1], layout=layout)
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    s = _matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))

    def to_p(e, cols):
        if keep is not None:
            e = e * keep[..., cols].float() / keep_prob
        return rnd(e, q.dtype, away=True)

    acc, m, total = _online(s, v, tile, to_p, _fp32_mix)
    o = rnd(acc / total, q.dtype, away=True).masked_fill(total == 0, 0.0)
    return o, m.squeeze(-1), total.squeeze(-1)


def fa_grad_recipe(q, k, v, dy, out, row_max, row_sum, scale: float, mask: torch.Tensor | None = None,
                   fp32_gemms: bool = False, score_grad: bool = False):
    """FlashAttentionScoreGrad on BNSD tensors: (dq, dk, dv). D = rowsum(dy * out) in fp32 (SoftmaxGradFront on
    the widened inputs); P = exp(S - max) / sum in fp32, cast half away before dV = P^T dy (grad s1s2_bn2gs1s2.h,
    "cast fp322bf16" CAST_ROUND); dP = dy V^T; dS = P (dP - D) in fp32, cast half away before dQ = dS K and
    dK = dS^T Q (CAST_ROUND); dq, dk times the scale in fp32, every gradient cast half away (grad_post.h).
    `fp32_gemms`: the dV, dQ, dK GEMMs accumulate in fp32 (PyTorch's order) instead of exactly; `score_grad`: return
    the rounded dS [B, N1, Sq, Skv] instead."""
    heads, heads_kv = q.shape[1], k.shape[1]
    group = heads // heads_kv
    ke, ve = _expand_kv(k, heads).float(), _expand_kv(v, heads).float()
    s = _matmul(q, ke.transpose(-1, -2)).float() * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.exp(s - row_max.float().unsqueeze(-1)) / row_sum.float().unsqueeze(-1)
    dyf = dy.float()
    d = (dyf * out.float()).sum(-1, keepdim=True)
    gemm = (lambda a, b: a.float() @ b.float()) if fp32_gemms else (lambda a, b: _matmul(a, b).float())
    dv = gemm(rnd(p, q.dtype, away=True).transpose(-1, -2), dyf)
    ds = rnd(p * (_matmul(dyf, ve.transpose(-1, -2)).float() - d), q.dtype, away=True)
    if score_grad:
        return ds
    dq = gemm(ds, ke) * scale
    dk = gemm(ds.transpose(-1, -2), q) * scale

    def fold(t):  # a GQA group's gradients sum into its kv head
        return t.reshape(t.shape[0], heads_kv, group, *t.shape[2:]).sum(2)

    return (rnd(dq, q.dtype, away=True), rnd(fold(dk), q.dtype, away=True), rnd(fold(dv), q.dtype, away=True))


def ifa_recipe(q, k, v, scale: float, compute_output: bool = False, tile: int | None = None,
               block_size: int = 0) -> torch.Tensor:
    """IncreFlashAttention (and FIA with one query token) on BNSD tensors, online over key steps of `tile` (default:
    the kernel's, `kernel_key_tile`, for a paged cache of `block_size`; 0: contiguous): fp32 throughout (preload.h
    `T = float`); S = (Q K^T) * scale; P = exp(S - max) cast half away to the KV dtype before P V (CAST_ROUND); the
    output divided in fp32 and cast half to even for bf16 (CAST_RINT), half away for fp16 (CAST_ROUND); with
    `compute_output` left in fp32 (what an int8 output quantises)."""
    heads = q.shape[1]
    if tile is None:
        tile = kernel_key_tile("ifa", sq=q.shape[2], skv=k.shape[2], group=heads // k.shape[1],
                               block_size=block_size)
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    s = _matmul(q, k.transpose(-1, -2)).float() * scale
    acc, _, total = _online(s, v, tile, lambda e, _: rnd(e, k.dtype, away=True), _fp32_mix)
    o = acc / total
    return o if compute_output else rnd(o, q.dtype, away=q.dtype != torch.bfloat16)


def post_quant_recipe(o: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, *,
                      fp32_per_channel: bool = False, scale_away: bool = False) -> torch.Tensor:
    """The int8 output step (quant_scale2, quant_offset2) of `o`, the attention output as the kernel holds it (fp32 or
    fp16 values), `scale` / `offset` broadcast to it.

    AscendQuant (the A2/A3 high-level API, ascend_quant_pre_impl.h: AscendQuantIntrinsicsImpl and
    AscendQuantPerChannelIntrinsicsImpl), which PFA's DataCopyTransposeOut (x910_base.h QuantCompute,
    PostQuant2PerChannel*) and IFA's per-tensor PostQuant call: o cast to half (CAST_NONE: to nearest even), the scale
    and offset held in half (static_cast, or Cast CAST_NONE; `scale_away`: PFA's fp16-compute per-channel path first
    casts its fp32 scale and offset with CAST_ROUND), Muls / Mul and Adds / Add in half, half to int8 with CAST_NONE
    (to nearest even). `fp32_per_channel`: IncreFlashAttention's per-channel PostQuant (preload.h), Mul and Add in
    fp32, Cast to half CAST_ROUND, then to int8 CAST_ROUND (half away from zero). Saturated to [-128, 127]."""
    if fp32_per_channel:
        y = o.float() * scale.float()
        if offset is not None:
            y = y + offset.float()
        y = rnd(y, torch.float16, away=True).double()
        return (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-128, 127).to(torch.int8)
    half = torch.float16
    y = rnd(rnd(o, half).double() * rnd(scale, half, away=scale_away).double(), half)
    if offset is not None:
        y = rnd(y.double() + rnd(offset, half, away=scale_away).double(), half)
    return torch.round(y.double()).clamp(-128, 127).to(torch.int8)


def _selected_rows(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[B, S2, 1, D] keys / values picked by [B, S1, 1, K] indices: [B, S1, K, D]."""
    b = torch.arange(t.shape[0]).view(-1, 1, 1)
    return t[:, :, 0][b, indices[:, :, 0].long()]


_F32 = torch.float32


def _away_to_integer(x: torch.Tensor) -> torch.Tensor:
    """Cast fp32 -> fp32 with CAST_ROUND: the nearest integer, ties away from zero."""
    return torch.trunc(x + torch.where(x < 0, -0.5, 0.5).to(x.dtype))


def sfa_recipe(q, k, v, indices, scale: float, skip_amla: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """SparseFlashAttention on BSND tensors (N2 = 1, token selection, every index valid): (out, row max, row sum).
    sparse_flash_attention_service_vector_mla.h: fp32 (`T = float`), scale in fp32 (:428), the selected keys in
    steps of 512; after each step's SoftmaxFlashV2, AmlaVecCompute: n = CAST_ROUND(max * (-1/ln2)), x =
    exp(((max * (1/ln2)) + n) * ln2) in fp32, c = x cast CAST_ROUND to the KV dtype, P *= c; P cast CAST_ROUND to the
    KV dtype (:685); from the second step on, the fp32 running output's bits get the int32
    CAST_ROUND((max(n - n_prev, -30) + (cof_prev / cof - 1) * 1.5 + 1e-6) * 2^23) added (cof = x / c, ProcessAmlaNupdate
    atomic add); the divisor is sum * c of the last step; output bf16 half to even / fp16 half away (:1263-1265).
    `skip_amla`: the plain SoftmaxFlashV2 recipe (a planted difference for tests)."""
    keys, values = _selected_rows(k, indices), _selected_rows(v, indices)  # [B, S1, K, D]
    s = _matmul(q, keys.transpose(-1, -2)).float() * scale  # [B, S1, N1, K]
    ln2 = torch.tensor(0.6931471805599453094172, dtype=_F32)
    inv_ln2 = torch.tensor(1.0, dtype=_F32) / ln2
    m = torch.full((*s.shape[:-1], 1), float("-inf"))
    total = torch.zeros_like(m)
    acc = n_prev = cof_prev = c = None
    for c0 in range(0, s.shape[-1], 512):
        part = s[..., c0:c0 + 512]
        m_new = torch.maximum(m, part.amax(-1, keepdim=True))
        e = torch.exp(part - m_new)
        total = total * torch.exp(m - m_new) + e.sum(-1, keepdim=True)
        if skip_amla:
            pv = _matmul(rnd(e, k.dtype, away=True), values[..., c0:c0 + 512, :]).float()
            acc = pv if acc is None else acc * torch.exp(m - m_new) + pv
            m = m_new
            continue
        n = _away_to_integer(m_new * (torch.tensor(-1.0, dtype=_F32) * inv_ln2))
        x = torch.exp((m_new * inv_ln2 + n) * ln2)
        c = rnd(x.double(), k.dtype, away=True)
        cof = x / c
        pv = _matmul(rnd((e * c).double(), k.dtype, away=True), values[..., c0:c0 + 512, :]).float()
        if acc is not None:
            eps = (cof_prev / cof - 1.0) * 1.5 + torch.tensor(1e-6, dtype=_F32)
            step = torch.clamp(n - n_prev, min=-30.0) + eps
            add = _away_to_integer(step * 8388608.0).to(torch.int32)
            acc = (acc.view(torch.int32) + add).view(_F32) + pv
        else:
            acc = pv
        n_prev, cof_prev, m = n, cof, m_new
    divisor = total if skip_amla else total * c
    o = acc / divisor
    return rnd(o, q.dtype, away=q.dtype != torch.bfloat16), m.squeeze(-1), total.squeeze(-1)


def sfa_grad_recipe(q, k, v, indices, dy, out, row_max, row_sum, scale: float):
    """SparseFlashAttentionGrad on BSND tensors (as `sfa_recipe`): (dq, dk, dv). sparse_flash_attention_grad
    vec_op.h: dy, out widened (:458-459); P = exp(scale S - max) * (1 / sum) in fp32 (:537-550, the reciprocal
    taken once per row, then a multiply) cast half away (:557); dS =
    P (dP - D) in fp32 cast half away (:578-589); grad_post.h: dq, dk times the scale in fp32, every gradient cast
    half away (:533-542, :589-598, :644)."""
    keys, values = _selected_rows(k, indices), _selected_rows(v, indices)
    s = _matmul(q, keys.transpose(-1, -2)).float() * scale
    p = torch.exp(s - row_max.float().unsqueeze(-1)) * (1.0 / row_sum.float().unsqueeze(-1))
    dyf = dy.float()
    d = (dyf * out.float()).sum(-1, keepdim=True)
    ds = rnd(p * (_matmul(dyf, values.transpose(-1, -2)).float() - d), q.dtype, away=True)
    dq = _matmul(ds, keys).float() * scale
    dk_sel = _matmul(ds.transpose(-1, -2), q).float() * scale  # [B, S1, K, D]
    dv_sel = _matmul(rnd(p, q.dtype, away=True).transpose(-1, -2), dyf).float()
    dk = torch.zeros(k.shape[0], k.shape[1], k.shape[-1])
    dv = torch.zeros(v.shape[0], v.shape[1], v.shape[-1])
    for b in range(k.shape[0]):
        flat = indices[b, :, 0].reshape(-1).long()
        dk[b].index_add_(0, flat, dk_sel[b].reshape(-1, k.shape[-1]))
        dv[b].index_add_(0, flat, dv_sel[b].reshape(-1, v.shape[-1]))
    return (rnd(dq, q.dtype, away=True), rnd(dk, k.dtype, away=True).unsqueeze(2),
            rnd(dv, v.dtype, away=True).unsqueeze(2))


def kl_loss_recipe(query, key, query_index, key_index, weights, indices, softmax_max, softmax_sum, scale: float):
    """SparseLightningIndexerGradKLLoss on BSND tensors (N2 = 1, every index valid): (d_query_index, d_key_index,
    d_weights, loss). fp32 throughout: target p = mean over heads of exp(scale q.k - max) / sum; scores I = sum_h
    w_h ReLU(q_idx_h . k_idx); q = softmax(I); dI = q - p; dW = ReLU . dI cast half away (vector.h:1041); the ReLU
    gradient w_h dI [q_idx.k_idx > 0] cast half away to the index dtype (vector.h:916, `ReLUGrad`) before
    dq_idx = ds k_idx (written by its GEMM: half to even) and dk_idx = ds^T q_idx (vector2.h:173, half away)."""
    keys, k_idx = _selected_rows(key, indices), _selected_rows(key_index, indices)  # [B, S1, K, D]
    z = _matmul(query, keys.transpose(-1, -2)).float() * scale  # [B, S1, N1, K]
    stats_max = softmax_max[:, 0].float().unsqueeze(-1)  # [B, S1, N1, 1]
    stats_sum = softmax_sum[:, 0].float().unsqueeze(-1)
    target = (torch.exp(z - stats_max) / stats_sum).mean(2)  # [B, S1, K]
    relu = _matmul(query_index, k_idx.transpose(-1, -2)).float().clamp_min(0.0)  # [B, S1, H, K]
    w = weights.float()
    scores = (w.unsqueeze(-1) * relu).sum(2)
    dist = torch.softmax(scores, dim=-1)
    p_c, q_c = target.clamp_min(1e-8), dist.clamp_min(1e-8)
    loss = (p_c * (p_c.log() - q_c.log())).sum()
    d_scores = (dist - target).unsqueeze(2)  # [B, S1, 1, K]
    d_weights = rnd((relu * d_scores).sum(-1), weights.dtype, away=True)
    ds = rnd(w.unsqueeze(-1) * d_scores * (relu > 0), query_index.dtype, away=True)
    dq = rnd(_matmul(ds, k_idx).float(), query_index.dtype)
    dk_sel = _matmul(ds.transpose(-1, -2), query_index).float()  # [B, S1, K, D]
    dk = torch.zeros(key_index.shape[0], key_index.shape[1], key_index.shape[-1])
    for b in range(key_index.shape[0]):
        dk[b].index_add_(0, indices[b, :, 0].reshape(-1).long(), dk_sel[b].reshape(-1, key_index.shape[-1]))
    return dq, rnd(dk, key_index.dtype, away=True).unsqueeze(2), d_weights, loss


def _lightning_head_sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 sum of the per-head terms in LightningIndexer's vector order (service_vector.h:291-317 and
    vector.h:82-150, `groupInner_ = 16` at service_vector.h:175): head h goes to slot h % 16, each slot adding its
    heads in head order (DoScale's Add); then DoReduce over the min(16, H) slots: the slots beyond the largest power
    of two p added into slots 0.., then slot i += slot i + n for n = p/2, p/4, .. down to 2, the last step slot 0 +
    slot 1."""
    slots: list[torch.Tensor] = []
    for h, term in enumerate(terms):
        if h < 16:
            slots.append(term.clone())
        else:
            slots[h % 16] = term + slots[h % 16]
    count = len(slots)
    if count == 1:
        return slots[0]
    power = count if count <= 2 else 2 ** int(math.log2(count))
    for i in range(count - power):
        slots[i] = slots[i] + slots[power + i]
    n = power
    while n > 2:
        n //= 2
        for i in range(n):
            slots[i] = slots[i] + slots[i + n]
    return slots[0] + slots[1]


def lightning_indexer_recipe(query, key, weights, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LightningIndexer on BSND fp16 / bf16 tensors, every key visible (sparse_mode 0): (indices, values) of the
    top `count` keys, [B, S1, 1, count]. lightning_indexer op_kernel: service_cube.h:381-384 (Q . K leaves L0C in
    fp32, `NoQuant`, with `reluPre`), vector.h:82-115 (weights cast to fp32, CAST_NONE: exact; w_h * dot_h in fp32),
    the head order of `_lightning_head_sum`; the values cast to the input dtype with CAST_ROUND (service_vector.h:400,
    half away); the order ties to the smaller index."""
    dots = _matmul(query, key[:, :, 0].unsqueeze(1).transpose(-1, -2)).float().clamp_min(0.0)  # [B, S1, H, S2]
    terms = [dots[:, :, h] * weights[:, :, h].float().unsqueeze(-1) for h in range(query.shape[2])]
    scores = _lightning_head_sum(terms)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :count]
    values = rnd(torch.gather(scores, -1, order), query.dtype, away=True).to(query.dtype)
    return order.unsqueeze(2).to(torch.int32), values.unsqueeze(2)


def attention_update_recipe(lse: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """AttentionUpdate (attention_update op_kernel decode_update.h) on K parts without empty rows: everything in fp32
    (the outputs widened with CAST_NONE, exact); m = max_i lse_i; s = e_0 + e_1 + .. added in part order with
    e_i = exp(lse_i - m) (:244-262); lse_out = m + log(s) (:265-268); out = sum_i out_i exp(lse_i - lse_out) added in
    part order (:270-309); cast to fp16 / bf16 to nearest even (CAST_NONE / CAST_RINT, :324-333)."""
    m = lse[0].float()
    for t in lse[1:]:
        m = torch.maximum(m, t.float())
    exps = [torch.exp(t.float() - m) for t in lse]
    total = exps[0]
    for e in exps[1:]:
        total = total + e
    lse_out = m + torch.log(total)
    out = None
    for t, o in zip(lse, outs, strict=True):
        term = o.float() * torch.exp(t.float() - lse_out).unsqueeze(-1)
        out = term if out is None else out + term
    return rnd(out, outs[0].dtype).to(outs[0].dtype), lse_out


def ring_update_recipe(out_a, max_a, sum_a, out_b, max_b, sum_b) -> torch.Tensor:
    """RingAttentionUpdate's merged output (ring_attention_update op_kernel ring_attention_update.h) for rows valid
    in both inputs, statistics per row broadcast over the last dim: fp32 (outputs widened with CAST_NONE, :253-254);
    m = max; w = sum * exp(max - m) (:177-194); s = w_a + w_b (:200); r = w / s (:204-205); out = out_a r_a + out_b r_b
    (:264-268); to fp16 / bf16 to nearest even (CAST_NONE / CAST_RINT, :271-274)."""
    m = torch.maximum(max_a.float(), max_b.float())
    w_a, w_b = sum_a.float() * torch.exp(max_a.float() - m), sum_b.float() * torch.exp(max_b.float() - m)
    total = w_a + w_b
    out = out_a.float() * (w_a / total) + out_b.float() * (w_b / total)
    return rnd(out, out_a.dtype).to(out_a.dtype)


def quant_indexer_recipe(query, key, weights, query_scale, key_scale, count: int) -> torch.Tensor:
    """QuantLightningIndexer on BSND int8 tensors with fp16 weights / scales, every key visible (sparse_mode 0): the
    top-`count` key indices [B, S1, 1, count] (ties to the smaller index). quant_lightning_indexer op_kernel:
    service_cube.h:541-546 (fixpipe DEQF16 with ReLU and the scale 0x3a800000 = 2^-10: the int32 products to
    fp16), service_vector.h:306 (W * Scale_Q multiplied in half), the head sum on the cube (fp32 result, NoQuant,
    :564), service_vector.h:381-383 (times Scale_K widened to fp32)."""
    dots = _matmul(query, key[:, :, 0].unsqueeze(1).transpose(-1, -2))  # [B, S1, H, S2]
    dots = rnd(dots.clamp_min(0.0) * 2.0**-10, torch.float16)
    folded = rnd(weights.float() * query_scale.float(), torch.float16)  # [B, S1, H]
    scores = _matmul(folded.unsqueeze(-2), dots).squeeze(-2).float() * key_scale[:, :, 0].float().unsqueeze(1)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :count].unsqueeze(2).to(torch.int32)


def op_plugin_pfa_golden(q, k, v, scale: float) -> torch.Tensor:
    """op-plugin's own PFA golden (test/test_custom_ops/test_prompt_flash_attention.py, `supported_op_exec`), as its
    fp16 NPU tensors compute it: half(Q K^T) (fp32 accumulation), times the Python scale (a half scalar on a half
    tensor) into half, softmax in fp32 cast to half (normalised), then half(P V)."""
    heads = q.shape[1]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    half_scale = rnd(torch.tensor(scale), q.dtype)
    s = rnd(rnd(_matmul(q, k.transpose(-1, -2)), q.dtype) * half_scale, q.dtype)
    p = rnd(torch.softmax(s, dim=-1), q.dtype)
    return rnd(_matmul(p, v), q.dtype)


def ulp_errors(actual: torch.Tensor, recipe: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(|actual - recipe| in ulps of the recipe's value, the same in ulps of the row's largest |recipe|)."""
    a, r = actual.to(torch.float64), recipe.to(torch.float64)
    diff = (a - r).abs()
    diff = torch.where((a == r) | (a.isnan() & r.isnan()), torch.zeros_like(diff), diff)
    row_top = r.abs().amax(-1, keepdim=True)
    return diff / ulp(r, dtype), diff / ulp(row_top, dtype)


def ulp_verdict(actual: torch.Tensor, recipe: torch.Tensor, dtype: torch.dtype | None = None, ulps: float = 2.0,
                tail: float = 0.005, row_ulps: float = 4.0) -> tuple[bool, dict]:
    """(passed, figures): at most `ulps` ulps of `dtype` (default: actual's) from the recipe, except at most `tail`
    of the elements, which must be within `row_ulps` ulps of their row's largest value."""
    dtype = actual.dtype if dtype is None else dtype
    if tuple(actual.shape) != tuple(recipe.shape):
        return False, {"problem": f"shape {tuple(actual.shape)} != {tuple(recipe.shape)}"}
    own, row = ulp_errors(actual, recipe, dtype)
    beyond = own > ulps
    figures = {"max_ulps": float(own.max()) if own.numel() else 0.0,
               "tail_fraction": float(beyond.double().mean()) if own.numel() else 0.0,
               "tail_max_row_ulps": float(row[beyond].max()) if bool(beyond.any()) else 0.0}
    passed = figures["tail_fraction"] <= tail and figures["tail_max_row_ulps"] <= row_ulps \
        and not math.isnan(figures["max_ulps"])
    return passed, figures


def assert_within_ulps(actual: torch.Tensor, recipe: torch.Tensor, dtype: torch.dtype | None = None,
                       name: str = "output", ulps: float = 2.0, tail: float = 0.005, row_ulps: float = 4.0) -> dict:
    """`ulp_verdict`, raising AssertionError with the figures when it fails. Returns the figures."""
    passed, figures = ulp_verdict(actual, recipe, dtype, ulps, tail, row_ulps)
    if not passed:
        raise AssertionError(f"{name}: not within {ulps} ulps of the recipe ({figures})")
    return figures
