/* The "npu" precision mode's casts (docs/semantics/precision.md): fp32 values rounded once to the float16 or
 * bfloat16 grid, half to even or half away from zero, returned as fp32, in one pass. Bit for bit what
 * problem/precision.py's Cast computes with PyTorch ops (a NaN stays a NaN, its payload not kept).
 *
 * Part of the attention_loops.c translation unit (included there; not compiled alone).
 */

static inline float npu_round_bf16(float x, int away) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return x;
    /* bf16 is fp32's upper half: add half of the dropped range (ties: away, or to the even kept bit), clear it */
    u += away ? 0x8000u : 0x7FFFu + ((u >> 16) & 1u);
    u &= 0xFFFF0000u;
    memcpy(&x, &u, sizeof u);
    return x;
}

static inline float npu_round_fp16(float x, int away) {
    const float a = fabsf(x);
    if (!(a < 65520.0f))  /* NaN, or at least the midpoint past fp16's largest value: inf either way */
        return a != a ? x : copysignf(INFINITY, x);
    float r;
    if (a < 0x1p-14f) {  /* fp16 subnormals: a fixed step of 2^-24 (the scaled value and its half are exact) */
        const float steps = a * 0x1p24f, whole = floorf(steps);
        /* ties away from the fraction (exact), not floorf(steps + 0.5f): that sum rounds up to 1 just below 0.5 */
        r = (away ? whole + (steps - whole >= 0.5f ? 1.0f : 0.0f) : nearbyintf(steps)) * 0x1p-24f;
    } else {  /* 13 fraction bits dropped */
        uint32_t u;
        memcpy(&u, &a, sizeof u);
        u += away ? 0x1000u : 0x0FFFu + ((u >> 13) & 1u);
        u &= ~0x1FFFu;
        memcpy(&r, &u, sizeof u);
    }
    return copysignf(r, x);
}

/* out[i] = x[i] rounded to float16 (half = 1) or bfloat16 (half = 0), ties away from zero (away = 1) or to even. */
/* npu_round_fp16 on eight lanes, branch-free, the same bits: F16C's conversion to float16 and back rounds half to
 * even (subnormals and overflow included); half away adds to the magnitude's bits as the scalar code does. A NaN is
 * returned as it came, as there. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 npu_round_fp16_x8(__m256 x, int away) {
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (!away)
        return _mm256_blendv_ps(_mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                                x, nan);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256 sign = _mm256_and_ps(x, sign_bit), a = _mm256_andnot_ps(sign_bit, x);
    __m256i u = _mm256_add_epi32(_mm256_castps_si256(a), _mm256_set1_epi32(0x1000));
    const __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(~0x1FFF)));
    const __m256 steps = _mm256_mul_ps(a, _mm256_set1_ps(0x1p24f)), whole = _mm256_floor_ps(steps);
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(steps, whole), _mm256_set1_ps(0.5f), _CMP_GE_OQ),
                                    _mm256_set1_ps(1.0f));
    const __m256 subnormal = _mm256_mul_ps(_mm256_add_ps(whole, up), _mm256_set1_ps(0x1p-24f));
    __m256 r = _mm256_blendv_ps(normal, subnormal, _mm256_cmp_ps(a, _mm256_set1_ps(0x1p-14f), _CMP_LT_OQ));
    r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(a, _mm256_set1_ps(65520.0f), _CMP_NLT_UQ));
    return _mm256_blendv_ps(_mm256_or_ps(r, sign), x, nan);
}

__attribute__((target("avx2,fma,f16c"))) static void npu_round_fp16_rows(const float *x, float *out, int64_t n,
                                                                        int away) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n / 8 * 8; i += 8)
        _mm256_storeu_ps(out + i, npu_round_fp16_x8(_mm256_loadu_ps(x + i), away));
    for (int64_t i = n / 8 * 8; i < n; ++i)
        out[i] = npu_round_fp16(x[i], away);
}

static int npu_has_f16c(void) { return __builtin_cpu_supports("f16c"); }

/* npu_round_bf16 on eight lanes (AVX2, which the library requires): the same integer steps, a NaN kept. */
static inline __m256 npu_round_bf16_x8(__m256 v, int away) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i half = away ? _mm256_set1_epi32(0x8000)
                              : _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, half),
                                                          _mm256_set1_epi32((int)0xFFFF0000u)));
    return _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

static void npu_round_bf16_rows(const float *x, float *out, int64_t n, int away) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n / 8 * 8; i += 8)
        _mm256_storeu_ps(out + i, npu_round_bf16_x8(_mm256_loadu_ps(x + i), away));
    for (int64_t i = n / 8 * 8; i < n; ++i)
        out[i] = npu_round_bf16(x[i], away);
}

void npu_round(const float *x, float *out, int64_t n, int64_t half, int64_t away) {
    if (!half) {
        npu_round_bf16_rows(x, out, n, (int)away);
        return;
    }
    if (npu_has_f16c()) {
        npu_round_fp16_rows(x, out, n, (int)away);
        return;
    }
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i)
        out[i] = npu_round_fp16(x[i], (int)away);
}

/* A float64 value (an exact GEMM sum) as the fp32 value that rounds to float16 as it does: the 29 fraction bits fp32
 * lacks dropped, their being nonzero kept in the lowest kept bit (round to odd; problem/precision.py's
 * _to_fp32_round_to_odd, bit for bit). */
static inline float npu_round_to_odd(double x) {
    const uint64_t dropped = (1ull << 29) - 1ull;
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    u = (u & ~dropped) | (((u & dropped) + dropped) & (1ull << 29));
    memcpy(&x, &u, sizeof u);
    return (float)x;
}

/* out[i] = float64 x[i] rounded once to float16 (ties away when away = 1), as fp32; with scaled = 1 that value is
 * then multiplied by the fp32 `scale` and rounded to float16 again (ties away when away2 = 1): the scores and
 * logits stages of an fp16 pipeline in one pass. */
/* npu_round_to_odd on the eight float64 values at x, as fp32 lanes. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 npu_round_to_odd_x8(const double *x) {
    const __m256i dropped = _mm256_set1_epi64x((1ll << 29) - 1), sticky = _mm256_set1_epi64x(1ll << 29);
    __m128 half_lanes[2];
    for (int h = 0; h < 2; ++h) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(x + 4 * h));
        const __m256i odd = _mm256_or_si256(
            _mm256_andnot_si256(dropped, u),
            _mm256_and_si256(_mm256_add_epi64(_mm256_and_si256(u, dropped), dropped), sticky));
        half_lanes[h] = _mm256_cvtpd_ps(_mm256_castsi256_pd(odd));
    }
    return _mm256_set_m128(half_lanes[1], half_lanes[0]);
}

__attribute__((target("avx2,fma,f16c"))) static void npu_round_wide_fp16_x8(const double *x, float *out, int64_t n,
                                                                           int away, int scaled, float scale,
                                                                           int away2) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n / 8 * 8; i += 8) {
        __m256 r = npu_round_fp16_x8(npu_round_to_odd_x8(x + i), away);
        if (scaled)
            r = npu_round_fp16_x8(_mm256_mul_ps(r, _mm256_set1_ps(scale)), away2);
        _mm256_storeu_ps(out + i, r);
    }
    for (int64_t i = n / 8 * 8; i < n; ++i) {
        const float r = npu_round_fp16(npu_round_to_odd(x[i]), away);
        out[i] = scaled ? npu_round_fp16(r * scale, away2) : r;
    }
}

void npu_round_wide_fp16(const double *x, float *out, int64_t n, int64_t away, int64_t scaled, float scale,
                         int64_t away2) {
    if (npu_has_f16c()) {
        npu_round_wide_fp16_x8(x, out, n, (int)away, (int)scaled, scale, (int)away2);
        return;
    }
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) {
        const float r = npu_round_fp16(npu_round_to_odd(x[i]), (int)away);
        out[i] = scaled ? npu_round_fp16(r * scale, (int)away2) : r;
    }
}
