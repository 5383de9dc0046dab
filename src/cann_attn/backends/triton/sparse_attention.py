"""Triton kernels of SparseFlashAttention (DSA sparse MLA) forward and backward (docs/semantics/invalid-rows.md,
docs/operators/sparse_flash_attention.md).

One program computes one query token for a group of BLOCK_H heads. MLA-absorbed MQA has N2 = 1, so every head of
a token reads the same selected latent rows: a key chunk ([BLOCK_N, Dqk] latent + [BLOCK_N, Drope]) is gathered
once and multiplied against all heads of the group (heads are the M dimension of tl.dot; 64 heads per program at
N1 = 128 on Hopper). The program walks the token's selected key positions in chunks of BLOCK_N: position p is
entry p // bs, offset p % bs of the row's sparse_indices, and the selection rule of `problem.sparse`
(`scan_lengths` for the scan-and-stop part, precomputed per row in sparse_plan.py; then idx >= 0, block start
< thr, token < thr) decides which positions count. Duplicated entries are simply visited twice.

Forward: online softmax in fp32 (natural-log units, so softmax_max/softmax_sum are the documented statistics).
Backward: the same walk recomputes P from the given statistics; Dl = rowsum(dO * O) is computed by the program
itself from its dO/O tiles (no separate preprocess pass: both tiles are loaded once per program anyway).
dQ (+ dQ_rope) stays in registers (no atomics); dK, dK_rope and dV of a chunk are summed over the head group by
tl.dot and scattered into fp32 buffers with relaxed atomics, or, for deterministic=True, written per
(row, head group, position) to a workspace that a second kernel reduces per key in a fixed (sorted) order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .jit import device_function, tuning_configs
from .sparse_plan import RowTables, interpreting

# softmax_max of a row with nothing selected (docs/semantics/invalid-rows.md); constexpr because kernels use it.
INVALID_MAX = tl.constexpr(-2e38)
# Deterministic backward workspace per slab of query rows (fp32 contributions of every selected position).
DETERMINISTIC_WORKSPACE_BYTES = 2 << 30


# ----------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------
def _next_pow2(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def _rows3(t: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, N, D] view in `dtype` (a copy only if the leading dims do not merge, D is strided or dtype differs)."""
    v = t.reshape(rows, t.shape[-2], t.shape[-1]).to(dtype)
    return v if v.stride(-1) == 1 else v.contiguous()


def _rows2(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R2, D] view in `dtype` of a key-side tensor [B, S2, 1, D] / [T2, 1, D]."""
    v = t.reshape(-1, t.shape[-1]).to(dtype)
    return v if v.stride(-1) == 1 else v.contiguous()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands (fp32 inputs, or anything in the interpreter): exact fp32 products; tf32 would miss the fp32
    # precision standard of docs/semantics/precision.md. 16-bit operands ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


class _Dims:
    """Padded block sizes of one call (powers of two; >= 16 where tl.dot needs it on GPUs)."""

    def __init__(self, n1: int, d: int, dr: int, dv: int, max_positions: int, dtype: torch.dtype):
        interp = interpreting()
        floor = 1 if interp else 16
        self.block_h = _next_pow2(n1, floor) if interp else min(64, _next_pow2(n1, 16))
        self.block_d = _next_pow2(d, floor)
        self.block_dr = _next_pow2(dr, floor) if dr else floor
        self.block_dv = _next_pow2(dv, floor)
        # The backward keeps dQ [BLOCK_H, D] and dQ_rope in fp32 registers besides Q, dO and the K/V chunk: at
        # DSA's 512 + 64 (+ 512) head dims, 64 heads need 288-376 KB of shared memory (over Hopper's 227 KB per
        # block) and spill kilobytes per thread; 32 heads fit (100-136 KB, < 0.6 KB spilled; sm_90 AOT compile,
        # benchmarks/kernel_report.py).
        # fp32 operands (no tensor-core path) halve that again, and the forward too: at 64 heads it keeps its
        # whole tile in local memory (13-28 KB per thread); 16 heads with 8 warps spill nothing.
        wide = self.block_d + self.block_dr + self.block_dv > 512
        fp32 = dtype == torch.float32
        if not interp and wide:
            self.block_h = min(self.block_h, 16 if fp32 else 64)
        self.block_h_bwd = self.block_h if interp or not wide else min(self.block_h, 16 if fp32 else 32)
        # Interpreter: few, wide chunks (its cost grows with programs x loop iterations, not with tile size);
        # None: autotuned on GPUs.
        self.block_n = min(512, _next_pow2(max_positions, 1)) if interp else None


@device_function
def selected_keys(row_idx, start, npos, nblk, thr, kv0, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Selected key positions [start, start + BLOCK_N) of one query row (row_idx: its sparse_indices): position
    p is entry p // BS, offset p % BS. Returns (pos, valid, key_row): which positions count under the rule of
    `problem.sparse` (scanned prefix from `scan_lengths`, entry >= 0, block start < thr, token < thr) and their
    key rows (kv0 + token; kv0 where not valid)."""
    pos = start + tl.arange(0, BLOCK_N)
    in_scan = pos < npos
    entry = tl.load(row_idx + pos // BS, mask=in_scan, other=-1)
    block_ok = in_scan & (entry >= 0) & (entry < nblk)  # tested before multiplying: no int overflow
    token = tl.where(block_ok, entry, 0).to(tl.int32) * BS + pos % BS
    valid = block_ok & (token < thr)
    return pos, valid, kv0 + tl.where(valid, token, 0).to(tl.int64)


@device_function
def paged_key_slots(key_row, kv0, valid, BT, PAGE: tl.constexpr):
    """(physical block, slot) of selected keys in a paged cache (docs/semantics/paged-kv.md): kv0 is the offset of
    the row's sequence in the block table, key_row - kv0 its logical key position p; block BT[kv0 + p // PAGE],
    slot p % PAGE. Table entries of positions that are not valid are not read (block 0, never loaded)."""
    token = key_row - kv0
    block = tl.load(BT + kv0 + token // PAGE, mask=valid, other=0).to(tl.int64)
    return block, token % PAGE


@device_function
def round_bf16_rtne(x):
    """fp32 -> bfloat16 rounded to nearest even, by its bits (the interpreter's own conversion truncates; NaN kept)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)


@device_function
def dequantized_tile(x, scale_ptr, mask, FP8: tl.constexpr, DEQ: tl.constexpr, EXPLICIT_RTNE: tl.constexpr,
                     OUT_DTYPE: tl.constexpr):
    """Quantised latent values x (int8, or fp8 e4m3 as its bytes) times the fp32 scale of their tile (scale_ptr:
    per element), taken in fp32 and rounded once to DEQ, the query's dtype (problem/dequant.py), as OUT_DTYPE."""
    if FP8:
        x = x.to(tl.float8e4nv, bitcast=True)
    product = x.to(tl.float32) * tl.load(scale_ptr, mask=mask, other=0.0)
    rounded = round_bf16_rtne(product) if EXPLICIT_RTNE else product.to(DEQ)
    return rounded.to(OUT_DTYPE)


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _sfa_fwd_kernel(
    Q, QR, K, KR, V, IDX, KV_START, THR, SCAN, OUT, MAX, SUM, BT, KS, VS,
    scale,
    stride_qt, stride_qh, stride_qrt, stride_qrh, stride_kt, stride_krt, stride_vt, stride_it, stride_ot, stride_oh,
    stride_kb, stride_krb, stride_vb, stride_kst, stride_ksb, stride_vst, stride_vsb,
    N1, D, DR, DV,
    BS: tl.constexpr, HAS_ROPE: tl.constexpr, V_IS_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr, DEQ: tl.constexpr, EXPLICIT_RTNE: tl.constexpr,
    TILE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """PAGE > 0: K, KR and V are paged caches [block_num, PAGE, D] (block strides stride_*b, token strides
    stride_*t) read in place through the block table BT, KV_START holding each row's offset into BT.
    QUANT: K and V hold quantised latent values (int8, or fp8 bytes with FP8) and KS / VS one fp32 scale per TILE
    of them (rows of the combined cache, strides stride_*st / stride_*sb); each gathered tile is dequantised in
    registers as dequantized_tile says before the dot (KvQuantSparseFlashAttention, problem/dequant.py)."""
    # One flat grid axis (x allows 2**31 - 1 programs; y and z only 65535, fewer than the rows of a long sequence),
    # head groups varying fastest: the programs of one token run together and share its gathered rows in L2.
    groups = tl.cdiv(N1, BLOCK_H)
    heads = (tl.program_id(0) % groups) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = (tl.program_id(0) // groups).to(tl.int64)
    h_ok = heads < N1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    # Head offsets in int64: head-major views (an einsum's output) have head strides of T * D, and heads * stride
    # passes 2**31 once T * N1 * D does.
    q = tl.load(Q + r * stride_qt + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    offs_r = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < DR
    if HAS_ROPE:
        qr = tl.load(QR + r * stride_qrt + heads[:, None].to(tl.int64) * stride_qrh + offs_r[None, :],
                     mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < DV
    kv0 = tl.load(KV_START + r)
    thr = tl.load(THR + r)
    npos = tl.load(SCAN + r) * BS
    nblk = (thr + BS - 1) // BS
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(0, npos, BLOCK_N):
        _pos, valid, key_row = selected_keys(IDX + r * stride_it, start, npos, nblk, thr, kv0, BS, BLOCK_N)
        if PAGE > 0:
            block, slot = paged_key_slots(key_row, kv0, valid, BT, PAGE)
            k_off = block * stride_kb + slot * stride_kt
            kr_off = block * stride_krb + slot * stride_krt
            v_off = block * stride_vb + slot * stride_vt
            ks_off = block * stride_ksb + slot * stride_kst  # the scale rows (QUANT only)
            vs_off = block * stride_vsb + slot * stride_vst
        else:
            k_off = key_row * stride_kt
            kr_off = key_row * stride_krt
            v_off = key_row * stride_vt
            ks_off = key_row * stride_kst
            vs_off = key_row * stride_vst
        k_mask = valid[:, None] & d_ok[None, :]
        if QUANT:
            k = dequantized_tile(tl.load(K + k_off[:, None] + offs_d[None, :], mask=k_mask, other=0),
                                 KS + ks_off[:, None] + (offs_d // TILE)[None, :], k_mask, FP8, DEQ, EXPLICIT_RTNE,
                                 Q.dtype.element_ty)
        else:
            k = tl.load(K + k_off[:, None] + offs_d[None, :], mask=k_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_ROPE:
            kr = tl.load(KR + kr_off[:, None] + offs_r[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
            s += tl.dot(qr, tl.trans(kr), input_precision=PRECISION)
        z = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        # A row (so far) without valid keys keeps m = -inf; shift by 0 there so no inf - inf NaN appears.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(z - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K:
            v = k  # DSA passes one latent as key and value: reuse the gathered tile
        elif QUANT:
            v_mask = valid[:, None] & v_ok[None, :]
            v = dequantized_tile(tl.load(V + v_off[:, None] + offs_v[None, :], mask=v_mask, other=0),
                                 VS + vs_off[:, None] + (offs_v // TILE)[None, :], v_mask, FP8, DEQ, EXPLICIT_RTNE,
                                 Q.dtype.element_ty)
        else:
            v = tl.load(V + v_off[:, None] + offs_v[None, :], mask=valid[:, None] & v_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    has = m_i > float("-inf")
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(OUT + r * stride_ot + heads[:, None].to(tl.int64) * stride_oh + offs_v[None, :],
             out.to(OUT.dtype.element_ty), mask=h_ok[:, None] & v_ok[None, :])
    stat = r * N1 + heads
    tl.store(MAX + stat, tl.where(has, m_i, INVALID_MAX), mask=h_ok)
    tl.store(SUM + stat, tl.where(has, l_i, 0.0), mask=h_ok)


def _fwd_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n in (32, 64) for w in (4, 8) for s in (1, 2)]


_sfa_fwd_tuned = triton.autotune(tuning_configs(_fwd_configs()),
                                 key=["N1", "D", "DR", "DV", "BS", "V_IS_K", "PAGE", "QUANT", "FP8"])(_sfa_fwd_kernel)


def _pages3(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[block_num, block_size, D] view of a paged cache [block_num, block_size, 1, D] in `dtype`, with its block
    stride as given (a cache may be a view with gaps between blocks). A copy only where the dtype differs (the
    interpreter's fp32) or D is strided."""
    v = cache[:, :, 0].to(dtype)
    return v if v.stride(-1) == 1 else v.contiguous()


@dataclass(frozen=True)
class QuantizedLatent:
    """The quantised key / value latent of KvQuantSparseFlashAttention as the forward kernel reads it in place:
    `key` / `value` are then the int8 / fp8 latent views of the combined cache rows and these their fp32 tile
    scales (views too; problem/dequant.py CombinedCache), dequantised to `dtype` (the query's) in the kernel."""

    key_scales: torch.Tensor
    value_scales: torch.Tensor
    dtype: torch.dtype
    tile: int


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _quantized(t: torch.Tensor, paged: bool) -> torch.Tensor:
    """[R2, W] / [block_num, block_size, W] view of a quantised latent or scale view, never converted (fp8 as its
    bytes: the interpreter has no fp8 tensors; the kernel reinterprets them)."""
    v = t[:, :, 0] if paged else t.reshape(-1, t.shape[-1])
    return v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v


def sparse_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, indices: torch.Tensor,
                   query_rope: torch.Tensor | None, key_rope: torch.Tensor | None, tables: RowTables, scale: float,
                   block_size: int, stats_shape: tuple[int, ...], block_table: torch.Tensor | None = None,
                   wide_output: bool = False, quantized: QuantizedLatent | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention_out, softmax_max, softmax_sum) of SparseFlashAttention; `indices` is [R, K]. Every row is
    written by the kernel (rows with nothing selected: 0, -2e38, 0). With `block_table`, key/value/key_rope are
    paged caches read in place (`tables.kv_start` then holds each row's offset into the table). With `wide_output`
    the output stays fp32 (for the sinks merged into it before the one rounding, problem/sink.py). With
    `quantized`, key / value are quantised latents dequantised in the kernel (`QuantizedLatent`)."""
    rows, n1, d = tables.rows, query.shape[-2], query.shape[-1]
    dv = value.shape[-1]
    dev = query.device
    softmax_max = torch.empty(stats_shape, dtype=torch.float32, device=dev)
    softmax_sum = torch.empty(stats_shape, dtype=torch.float32, device=dev)
    out_dtype = torch.float32 if wide_output else query.dtype
    if rows == 0:
        return torch.empty((*query.shape[:-1], dv), dtype=out_dtype, device=dev), softmax_max, softmax_sum
    # Interpreter: fp32 operands and output (its 16-bit dots are wrong); cast back at the end.
    work = torch.float32 if interpreting() else query.dtype
    paged = block_table is not None
    keys = _pages3 if paged else _rows2
    quant = quantized is not None
    latent = (lambda t, _dtype: _quantized(t, paged)) if quant else keys
    q3, k2 = _rows3(query, rows, work), latent(key, work)
    v2 = k2 if _same_storage(value, key) else latent(value, work)
    has_rope = query_rope is not None
    qr3 = _rows3(query_rope, rows, work) if has_rope else q3
    kr2 = keys(key_rope, work) if has_rope else k2
    dr = query_rope.shape[-1] if has_rope else 0
    out3 = torch.empty((rows, n1, dv), dtype=out_dtype if wide_output else work, device=dev)
    dims = _Dims(n1, d, dr, dv, tables.max_positions, q3.dtype)
    v_is_k = v2 is k2 and dims.block_dv == dims.block_d
    ks2 = _quantized(quantized.key_scales, paged) if quant else k2
    vs2 = (ks2 if _same_storage(quantized.value_scales, quantized.key_scales)
           else _quantized(quantized.value_scales, paged)) if quant else k2
    # (block, token) strides of the key-side tensors: a paged cache's own, else (0, row stride).
    k_s, kr_s, v_s, ks_s, vs_s = ((t.stride(0), t.stride(1)) if paged else (0, t.stride(0))
                                  for t in (k2, kr2, v2, ks2, vs2))
    args = (q3, qr3, k2, kr2, v2, indices, tables.kv_start, tables.thr, tables.scan, out3, softmax_max, softmax_sum,
            block_table if paged else tables.kv_start, ks2, vs2,
            float(scale), q3.stride(0), q3.stride(1), qr3.stride(0), qr3.stride(1), k_s[1], kr_s[1], v_s[1],
            indices.stride(0), out3.stride(0), out3.stride(1), k_s[0], kr_s[0], v_s[0], ks_s[1], ks_s[0], vs_s[1],
            vs_s[0], n1, d, dr, dv)
    deq = quantized.dtype if quant else query.dtype
    meta = dict(BS=block_size, HAS_ROPE=has_rope, V_IS_K=v_is_k, PRECISION=_precision(work), BLOCK_H=dims.block_h,
                BLOCK_D=dims.block_d, BLOCK_DR=dims.block_dr, BLOCK_DV=dims.block_dv,
                PAGE=key.shape[1] if paged else 0, QUANT=quant,
                FP8=quant and key.dtype == torch.float8_e4m3fn, DEQ=_TL_DTYPES.get(deq, tl.float32),
                EXPLICIT_RTNE=quant and interpreting() and deq == torch.bfloat16,
                TILE=quantized.tile if quant else 1)
    grid = (triton.cdiv(n1, dims.block_h) * rows,)
    if dims.block_n is not None:
        _sfa_fwd_kernel[grid](*args, **meta, BLOCK_N=dims.block_n)
    else:
        _sfa_fwd_tuned[grid](*args, **meta)
    out = out3.to(out_dtype).view(*query.shape[:-1], dv)
    return out, softmax_max, softmax_sum


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _sfa_bwd_kernel(
    Q, QR, K, KR, V, DO, O, MAX, SUM, IDX, KV_START, THR, SCAN,
    DQ, DQR, DKV, KEYS,
    scale, row0, width,
    stride_qt, stride_qh, stride_qrt, stride_qrh, stride_kt, stride_krt, stride_vt, stride_it,
    stride_dot, stride_doh, stride_ot, stride_oh, stride_dqt, stride_dqh, stride_dqrt, stride_dqrh,
    stride_dkv,
    N1, D, DR, DV,
    BS: tl.constexpr, HAS_ROPE: tl.constexpr, V_IS_K: tl.constexpr, PRECISION: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """DKV holds [dK | dK_rope | dV] columns (D + DR + DV). Atomic mode: fp32 [R2, *] accumulators.
    DETERMINISTIC: an [items, *] workspace of the slab starting at query row `row0`, item = ((r - row0) * groups
    + group) * width + position, and KEYS [items] receives each item's flat key row (-1: not selected)."""
    # One flat grid axis, head groups fastest (see the forward).
    groups = tl.cdiv(N1, BLOCK_H)
    group = tl.program_id(0) % groups
    heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
    r = row0 + (tl.program_id(0) // groups).to(tl.int64)
    h_ok = heads < N1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_r = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < DR
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < DV
    hd = h_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + r * stride_qt + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :], mask=hd, other=0.0)
    if HAS_ROPE:
        qr = tl.load(QR + r * stride_qrt + heads[:, None].to(tl.int64) * stride_qrh + offs_r[None, :],
                     mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    hv = h_ok[:, None] & v_ok[None, :]
    do = tl.load(DO + r * stride_dot + heads[:, None].to(tl.int64) * stride_doh + offs_v[None, :], mask=hv, other=0.0)
    o = tl.load(O + r * stride_ot + heads[:, None].to(tl.int64) * stride_oh + offs_v[None, :], mask=hv, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # Dl = rowsum(dO * O)
    stat = r * N1 + heads
    m = tl.load(MAX + stat, mask=h_ok, other=0.0)
    inv_l = 1.0 / tl.load(SUM + stat, mask=h_ok, other=1.0)
    kv0 = tl.load(KV_START + r)
    thr = tl.load(THR + r)
    npos = tl.load(SCAN + r) * BS
    nblk = (thr + BS - 1) // BS
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    dqr = tl.zeros([BLOCK_H, BLOCK_DR], tl.float32)
    item0 = ((r - row0) * groups + group) * width
    for start in range(0, npos, BLOCK_N):
        pos, valid, key_row = selected_keys(IDX + r * stride_it, start, npos, nblk, thr, kv0, BS, BLOCK_N)
        kd = valid[:, None] & d_ok[None, :]
        k = tl.load(K + key_row[:, None] * stride_kt + offs_d[None, :], mask=kd, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_ROPE:
            kr = tl.load(KR + key_row[:, None] * stride_krt + offs_r[None, :], mask=valid[:, None] & r_ok[None, :],
                         other=0.0)
            s += tl.dot(qr, tl.trans(kr), input_precision=PRECISION)
        # P from the given statistics (no renormalisation, docs/operators/sparse_flash_attention.md).
        p = tl.where(valid[None, :] & h_ok[:, None], tl.exp(s * scale - m[:, None]) * inv_l[:, None], 0.0)
        if V_IS_K:
            v = k
        else:
            v = tl.load(V + key_row[:, None] * stride_vt + offs_v[None, :], mask=valid[:, None] & v_ok[None, :],
                        other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None]) * scale  # the softmax scale folded into dS once
        ds_in = ds.to(k.dtype)  # 16-bit operands for the tensor cores, fp32 accumulation
        p_in = p.to(do.dtype)
        dq += tl.dot(ds_in, k, input_precision=PRECISION)
        dv_part = tl.dot(tl.trans(p_in), do, input_precision=PRECISION)  # [BLOCK_N, BLOCK_DV], summed over the heads
        dk_part = tl.dot(tl.trans(ds_in), q, input_precision=PRECISION)
        if HAS_ROPE:
            dqr += tl.dot(ds_in, kr, input_precision=PRECISION)
            dkr_part = tl.dot(tl.trans(ds_in), qr, input_precision=PRECISION)
        if DETERMINISTIC:
            item = item0 + pos
            i_ok = pos < width
            tl.store(KEYS + item, tl.where(valid, key_row, -1), mask=i_ok)
            dst = DKV + item[:, None] * stride_dkv
            tl.store(dst + (D + DR) + offs_v[None, :], dv_part, mask=i_ok[:, None] & v_ok[None, :])
            tl.store(dst + offs_d[None, :], dk_part, mask=i_ok[:, None] & d_ok[None, :])
            if HAS_ROPE:
                tl.store(dst + D + offs_r[None, :], dkr_part, mask=i_ok[:, None] & r_ok[None, :])
        else:
            dst = DKV + key_row[:, None] * stride_dkv
            tl.atomic_add(dst + (D + DR) + offs_v[None, :], dv_part, mask=valid[:, None] & v_ok[None, :],
                          sem="relaxed")
            tl.atomic_add(dst + offs_d[None, :], dk_part, mask=kd, sem="relaxed")
            if HAS_ROPE:
                tl.atomic_add(dst + D + offs_r[None, :], dkr_part, mask=valid[:, None] & r_ok[None, :],
                              sem="relaxed")
    tl.store(DQ + r * stride_dqt + heads[:, None].to(tl.int64) * stride_dqh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=hd)
    if HAS_ROPE:
        tl.store(DQR + r * stride_dqrt + heads[:, None].to(tl.int64) * stride_dqrh + offs_r[None, :],
                 dqr.to(DQR.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])


def _bwd_configs() -> list[triton.Config]:
    # 8 warps only: with 4, the fp32 dQ accumulator alone spills 4-8 KB per thread at D = 512 (sm_90 AOT
    # compile); 64-key chunks exceed the shared-memory limit there.
    return [triton.Config({"BLOCK_N": n}, num_warps=8, num_stages=s) for n in (16, 32) for s in (1, 2)]


_sfa_bwd_atomic_tuned = triton.autotune(tuning_configs(_bwd_configs()), key=["N1", "D", "DR", "DV", "BS", "V_IS_K"],
                                        reset_to_zero=["DKV"])(_sfa_bwd_kernel)


@triton.jit
def _segment_sum_kernel(SRC, ORDER, STARTS, COUNTS, TARGETS, DST, width, stride_src, stride_dst,
                        BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    """DST[target] += sum of SRC[ORDER[start : start + count]] for one segment (one key): the items are read in
    the fixed sorted order and reduced by a fixed tree, and each target belongs to exactly one segment, so the
    result is bitwise reproducible."""
    seg = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < width
    start = tl.load(STARTS + seg)
    count = tl.load(COUNTS + seg)
    target = tl.load(TARGETS + seg)
    acc = tl.zeros([BLOCK_I, BLOCK_D], tl.float32)
    for i0 in range(0, count, BLOCK_I):
        ii = i0 + tl.arange(0, BLOCK_I)
        ok = ii < count
        items = tl.load(ORDER + start + ii, mask=ok, other=0)
        acc += tl.load(SRC + items[:, None] * stride_src + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                       other=0.0)
    dst = DST + target * stride_dst + offs_d
    tl.store(dst, tl.load(dst, mask=d_ok, other=0.0) + tl.sum(acc, 0), mask=d_ok)


def deterministic_scatter_add(keys: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[keys[i]] += src[i] (src [items, w], dst [rows, w] fp32), skipping keys < 0, in a fixed order: items
    sorted (stably) by key, each key reduced by one program."""
    sorted_keys, order = torch.sort(keys, stable=True)
    skipped = int((sorted_keys < 0).sum().item())
    if skipped == sorted_keys.numel():
        return
    targets, counts = torch.unique_consecutive(sorted_keys[skipped:], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts + skipped  # positions in the full sorted order
    width = src.shape[1]
    interp = interpreting()
    block_d = _next_pow2(width, 1) if interp else min(128, _next_pow2(width, 16))
    grid = (targets.numel(), triton.cdiv(width, block_d))
    _segment_sum_kernel[grid](src, order, starts, counts, targets, dst, width, src.stride(0), dst.stride(0),
                              BLOCK_I=16 if interp else 32, BLOCK_D=block_d)


def sparse_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, indices: torch.Tensor,
                    d_out: torch.Tensor, out: torch.Tensor, softmax_max: torch.Tensor, softmax_sum: torch.Tensor,
                    query_rope: torch.Tensor | None, key_rope: torch.Tensor | None, tables: RowTables, scale: float,
                    block_size: int, deterministic: bool):
    """(d_query, d_key, d_value, d_query_rope, d_key_rope) of SparseFlashAttentionGrad
    (docs/operators/sparse_flash_attention.md)."""
    rows, n1, d = tables.rows, query.shape[-2], query.shape[-1]
    dv = value.shape[-1]
    has_rope = query_rope is not None
    dr = query_rope.shape[-1] if has_rope else 0
    dev = query.device
    # Interpreter: fp32 operands and outputs (its 16-bit dots are wrong); cast back at the end.
    work = torch.float32 if interpreting() else query.dtype
    dq = torch.zeros((rows, n1, d), dtype=work, device=dev)
    dq_rope = torch.zeros((rows, n1, dr), dtype=work, device=dev) if has_rope else None
    k2 = _rows2(key, work)
    v2 = k2 if _same_storage(value, key) else _rows2(value, work)
    kr2 = _rows2(key_rope, work) if has_rope else k2
    acc = torch.zeros((k2.shape[0], d + dr + dv), dtype=torch.float32, device=dev)  # [dK | dK_rope | dV]
    if rows > 0 and k2.shape[0] > 0:
        _launch_backward(_rows3(query, rows, work), k2, v2, kr2, indices, _rows3(d_out, rows, work),
                         _rows3(out, rows, work), softmax_max, softmax_sum,
                         _rows3(query_rope, rows, work) if has_rope else None, tables, scale, block_size,
                         deterministic, dq, dq_rope, acc, n1, d, dr, dv)
    d_query = laid_out_like(dq, query)
    d_query_rope = laid_out_like(dq_rope, query_rope) if has_rope else None
    d_key = laid_out_like(acc[:, :d], key, owned=True)
    d_key_rope = laid_out_like(acc[:, d : d + dr], key_rope, owned=True) if has_rope else None
    d_value = laid_out_like(acc[:, d + dr :], value, owned=True)
    return d_query, d_key, d_value, d_query_rope, d_key_rope


def laid_out_like(values: torch.Tensor, like: torch.Tensor, *, owned: bool = False) -> torch.Tensor:
    """A gradient computed in a work buffer, returned in `like`'s dtype, shape and strides (those of
    torch.empty_like(like), which the reference backend and the custom ops' fake twins give): a buffer that already
    matches is returned as it is, anything else is copied. `owned` always copies: the columns of the shared
    [dK | dK_rope | dV] accumulator must not come back as views of one buffer, since outputs that alias one another
    break the custom op (torch.library forbids it) and surprise callers who write into one gradient."""
    if not owned and like.is_contiguous() and values.dtype == like.dtype:
        return values.view(like.shape)
    return torch.empty_like(like).copy_(values.view(like.shape))


def _launch_backward(q3, k2, v2, kr2, indices, do3, o3, softmax_max, softmax_sum, qr3, tables, scale, block_size,
                     deterministic, dq3, dqr3, acc, n1, d, dr, dv) -> None:
    rows = tables.rows
    has_rope = qr3 is not None
    qr3 = q3 if qr3 is None else qr3
    dqr3 = dq3 if dqr3 is None else dqr3
    stat_max = softmax_max.float().contiguous()
    stat_sum = softmax_sum.float().contiguous()
    dims = _Dims(n1, d, dr, dv, tables.max_positions, q3.dtype)
    v_is_k = v2 is k2 and dims.block_dv == dims.block_d
    groups = triton.cdiv(n1, dims.block_h_bwd)
    common = dict(BS=block_size, HAS_ROPE=has_rope, V_IS_K=v_is_k, PRECISION=_precision(q3.dtype),
                  BLOCK_H=dims.block_h_bwd, BLOCK_D=dims.block_d, BLOCK_DR=dims.block_dr, BLOCK_DV=dims.block_dv)

    def launch(grid_rows, row0, width, keys, dkv, det):
        args = (q3, qr3, k2, kr2, v2, do3, o3, stat_max, stat_sum, indices, tables.kv_start, tables.thr,
                tables.scan, dq3, dqr3, dkv, keys, float(scale), row0, width,
                q3.stride(0), q3.stride(1), qr3.stride(0), qr3.stride(1), k2.stride(0), kr2.stride(0), v2.stride(0),
                indices.stride(0), do3.stride(0), do3.stride(1), o3.stride(0), o3.stride(1), dq3.stride(0),
                dq3.stride(1), dqr3.stride(0), dqr3.stride(1), dkv.stride(0), n1, d, dr, dv)
        grid = (groups * grid_rows,)
        if dims.block_n is not None:
            _sfa_bwd_kernel[grid](*args, **common, DETERMINISTIC=det, BLOCK_N=dims.block_n)
        elif det:
            # Fixed tiles: the workspace layout must not depend on an autotuning run.
            _sfa_bwd_kernel[grid](*args, **common, DETERMINISTIC=True, BLOCK_N=16, num_warps=8, num_stages=1)
        else:
            _sfa_bwd_atomic_tuned[grid](*args, **common, DETERMINISTIC=False)

    if not deterministic:
        launch(rows, 0, 0, acc, acc, False)
        return
    width = max(tables.max_positions, 1)
    per_row = groups * width * acc.shape[1] * 4
    slab = max(1, min(rows, DETERMINISTIC_WORKSPACE_BYTES // per_row))
    for row0 in range(0, rows, slab):
        n = min(slab, rows - row0)
        items = n * groups * width
        keys = torch.full((items,), -1, dtype=torch.int64, device=acc.device)
        work = torch.empty((items, acc.shape[1]), dtype=torch.float32, device=acc.device)
        launch(n, row0, width, keys, work, True)
        deterministic_scatter_add(keys, work, acc)
