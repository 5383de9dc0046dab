/* Vector helpers shared by every kernel family of the native loops: partial-vector masks, loads and stores, the
 * horizontal sum, the flushed 2^x (softmax_exp's rule), a row's maximum and its exponential pass, and the 4 x 3
 * register-block macros of the gathered products. Each AVX-512 step is the twin of an AVX2 loop: the same correctly
 * rounded operations lane by lane, in the same order, so the same floats (use_avx512 picks it at run time).
 * Included once, from attention_loops.c, after the AVX-512 switch it reads.
 */
#ifndef CANN_ATTN_VECTOR_OPS_H
#define CANN_ATTN_VECTOR_OPS_H

/* Lanes [0, n) of a vector (n in 0..8) for the last partial vector of a row. */
static inline __m256i lane_mask(int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes);
}

static inline __m256 load_part(const float *p, int64_t n, __m256i mask) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask);
}

static inline void store_part(float *p, __m256 x, int64_t n, __m256i mask) {
    if (n >= 8)
        _mm256_storeu_ps(p, x);
    else
        _mm256_maskstore_ps(p, mask, x);
}

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

/* The Taylor coefficients of 2^f, highest degree first (Horner), shared by the AVX2 and AVX-512 exponentials so that
 * both give the same floats. */
static const float EXP2_TAYLOR[8] = {1.5252733804059841e-5f, 1.5403530393381606e-4f, 1.3333558146428443e-3f,
                                     9.6181291076284772e-3f, 5.5504108664821580e-2f, 2.4022650695910071e-1f,
                                     6.9314718055994531e-1f, 1.0f};

/* 2^x, exactly 0 at or below `floor2` (>= -126; -inf included), NaN kept: the rule of softmax_exp.exp2_flushed_.
 * 2^x = 2^n * 2^f with n = round(x), |f| <= 1/2; 2^f by its Taylor series to degree 7 (relative error < 5e-9).
 * 2^n is applied in two halves so that every n in [-126, 129] gives normal factors and x >= 128 overflows to inf
 * in the product, as exp2 does. */
static inline __m256 exp2_flushed(__m256 x, __m256 floor2) {
    __m256 keep = _mm256_cmp_ps(x, floor2, _CMP_NLE_UQ);
    x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x); /* NaN stays: it is the second operand */
    x = _mm256_min_ps(_mm256_set1_ps(129.0f), x);
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; ++i)
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_TAYLOR[i]));
    const __m256i bias = _mm256_set1_epi32(127);
    __m256i n_all = _mm256_cvtps_epi32(n), n_low = _mm256_srai_epi32(n_all, 1);
    __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n_low, bias), 23));
    __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(n_all, n_low), bias), 23));
    return _mm256_and_ps(_mm256_mul_ps(_mm256_mul_ps(p, low), high), keep);
}

/* Rows P0..P3 of a block of up to 4 rows starting at BASE, STRIDE apart; rows past `nh` repeat the first (their
 * results are computed but never stored). */
#define BLOCK_ROWS(P, BASE, STRIDE)                                                                                  \
    const float *P##0 = (BASE);                                                                                      \
    const float *P##1 = nh > 1 ? P##0 + (STRIDE) : P##0;                                                             \
    const float *P##2 = nh > 2 ? P##0 + 2 * (STRIDE) : P##0;                                                         \
    const float *P##3 = nh > 3 ? P##0 + 3 * (STRIDE) : P##0

/* The 12 accumulators c00..c32 of a 4 x 3 register block of vector type T, zeroed (ZERO_BLOCK: AVX2;
 * ZERO_BLOCK16: AVX-512). */
#define ZERO_SUMS(T, ZERO)                                                                                           \
    T c00 = ZERO, c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;                                             \
    T c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00
#define ZERO_BLOCK ZERO_SUMS(__m256, _mm256_setzero_ps())
#define ZERO_BLOCK16 ZERO_SUMS(__m512, _mm512_setzero_ps())

/* Row i of the 4 x 3 register block of row_dots / row_combine: c_i0..c_i2 += y * (x0, x1, x2). */
#define FMA_ROW(i, y)                                                                                                \
    do {                                                                                                             \
        c##i##0 = _mm256_fmadd_ps(y, x0, c##i##0);                                                                   \
        c##i##1 = _mm256_fmadd_ps(y, x1, c##i##1);                                                                   \
        c##i##2 = _mm256_fmadd_ps(y, x2, c##i##2);                                                                   \
    } while (0)

#define FMA_ROW16(i, y)                                                                                              \
    do {                                                                                                             \
        c##i##0 = _mm512_fmadd_ps(y, x0, c##i##0);                                                                   \
        c##i##1 = _mm512_fmadd_ps(y, x1, c##i##1);                                                                   \
        c##i##2 = _mm512_fmadd_ps(y, x2, c##i##2);                                                                   \
    } while (0)
#define LOAD_FULL(p) _mm256_loadu_ps(p)
#define LOAD_TAIL(p) _mm256_maskload_ps((p), tail)

/* The high 8 lanes of v. */
__attribute__((target("avx512f"))) static inline __m256 high_half(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* 8 lanes broadcast to both halves. */
__attribute__((target("avx512f"))) static inline __m512 both_halves(__m256 x) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(x)));
}

/* hsum of both 8-lane halves of 8 vectors at once (decode's key pairs: a (head, pair p) sum's halves are keys 2p and
 * 2p + 1; decode_dots.c: two 16-lane sums after their first level). Returns, for
 * sums a..h, the 16 reductions [a0 c0 e0 g0 a1 c1 e1 g1 b0 d0 f0 h0 b1 d1 f1 h1] (x0 / x1: x's low / high half). Each
 * is hsum's tree, the same additions with the same operands first: lanes i and i + 4 (low 128 bits first), then
 * 0 + 2 and 1 + 3, then those two; only 21 vector operations for 16 sums instead of 16 hsums. */
__attribute__((target("avx512f"))) static inline __m512 hsum_pairs8(__m512 a, __m512 b, __m512 c, __m512 d, __m512 e,
                                                                     __m512 f, __m512 g, __m512 h) {
#define QUARTERS(x, y) _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD))
#define HALVES(x, y)                                                                                                 \
    _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))),                   \
                  _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))))
    const __m512 abcd = HALVES(QUARTERS(a, b), QUARTERS(c, d)), efgh = HALVES(QUARTERS(e, f), QUARTERS(g, h));
#undef HALVES
#undef QUARTERS
    return _mm512_add_ps(_mm512_shuffle_ps(abcd, efgh, 0x88), _mm512_shuffle_ps(abcd, efgh, 0xDD));
}

/* Largest of s[0..n) with NaN propagated (as torch.amax); -inf when n == 0. One running maximum per lane, in order:
 * where the largest value is a zero, its sign is that of the zero the order below keeps (row_max_fast defers to it). */
static float row_max_ordered(const float *s, int64_t n) {
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 x = _mm256_loadu_ps(s + j);
        mx = _mm256_max_ps(mx, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    float best = lanes[0];
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int i = 1; i < 8; ++i)
        best = lanes[i] > best ? lanes[i] : best;
    for (; j < n; ++j) {
        any_nan |= isnan(s[j]);
        best = s[j] > best ? s[j] : best;
    }
    return any_nan ? NAN : best;
}

/* row_max with four running maxima per lane (a single one waits on each max's latency). The largest value does not
 * depend on the order of the comparisons unless it is a zero, whose sign does: then row_max_ordered decides, so the
 * result is always its bits. */
static float row_max(const float *s, int64_t n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m256 x0 = _mm256_loadu_ps(s + j), x1 = _mm256_loadu_ps(s + j + 8);
        const __m256 x2 = _mm256_loadu_ps(s + j + 16), x3 = _mm256_loadu_ps(s + j + 24);
        m0 = _mm256_max_ps(m0, x0);
        m1 = _mm256_max_ps(m1, x1);
        m2 = _mm256_max_ps(m2, x2);
        m3 = _mm256_max_ps(m3, x3);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(x0, x1, _CMP_UNORD_Q), _mm256_cmp_ps(x2, x3, _CMP_UNORD_Q)));
    }
    if (_mm256_movemask_ps(nan))
        return NAN;
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    float best = lanes[0];
    for (int i = 1; i < 8; ++i)
        best = lanes[i] > best ? lanes[i] : best;
    for (; j < n; ++j) {
        if (isnan(s[j]))
            return NAN;
        best = s[j] > best ? s[j] : best;
    }
    return best == 0.0f ? row_max_ordered(s, n) : best;
}

/* exp2_flushed on 16 lanes: the same operations (max, min, round to nearest, sub, the FMA chain, the flush), so the
 * same floats. 2^n comes from VSCALEFPS, p 2^n rounded once: the halves' first product p 2^(n >> 1) is exact (a
 * normal float: p in [0.7, 1.5], n >> 1 in [-63, 64]), so their result is that same single rounding, overflow to inf
 * and subnormal results included (checked bitwise against the halves over all 2^32 inputs, floor2 -126, -125.5,
 * -100 and -20). It saves 8 of the 28 vector operations per 16 lanes: the forward's exponential pass took 17 ms of a
 * 120 ms B=1 N=8 S=2048 D=128 fp32 fused forward on one thread, 12.5 ms with it (Xeon, AVX-512). */
__attribute__((target("avx512f"))) static inline __m512 exp2_flushed16(__m512 x, __m512 floor2) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, floor2, _CMP_NLE_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-126.0f), x); /* NaN stays: it is the second operand */
    x = _mm512_min_ps(_mm512_set1_ps(129.0f), x);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; ++i)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[i]));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* row_exp's steps over the first n / 16 * 16 entries; returns how many it took, their sum added into *acc: the two
 * 8-entry halves one after the other, the AVX2 loop's order, so the row sum is the same float too. (This pass is
 * ~1/10 of the dense forward's time at D = 128.) */
__attribute__((target("avx512f"))) static int64_t row_exp16(float *s, int64_t n, float shift, float log2e,
                                                             float floor2, float factor, __m256 *acc) {
    const __m512 sv = _mm512_set1_ps(shift), lv = _mm512_set1_ps(log2e), fl = _mm512_set1_ps(floor2);
    const __m512 fv = _mm512_set1_ps(factor);
    __m256 sum = *acc;
    int64_t j = 0;
#define EXP_STEP(STORED)                                                                                             \
    for (; j + 16 <= n; j += 16) {                                                                                   \
        const __m512 e = exp2_flushed16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), sv), lv), fl);           \
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));                                                         \
        sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));                  \
        _mm512_storeu_ps(s + j, STORED);                                                                             \
    }
    if (factor == 1.0f) /* e * 1 is e: the forward's case skips the multiply */
        EXP_STEP(e)
    else
        EXP_STEP(_mm512_mul_ps(e, fv))
#undef EXP_STEP
    *acc = sum;
    return j;
}

/* row_exp's 8-lane steps over entries [done, n), their sum added to acc (the 16-lane steps' running sum). */
static float row_exp_tail(float *s, int64_t n, int64_t done, float shift, float log2e, float floor2, float factor,
                          __m256 acc) {
    const __m256 sv = _mm256_set1_ps(shift), lv = _mm256_set1_ps(log2e), fl = _mm256_set1_ps(floor2);
    const __m256 fv = _mm256_set1_ps(factor);
    for (int64_t j = done; j < n; j += 8) {
        const __m256i mask = lane_mask(n - j);
        __m256 e = exp2_flushed(_mm256_mul_ps(_mm256_sub_ps(load_part(s + j, n - j, mask), sv), lv), fl);
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mask)); /* lanes beyond n add nothing */
        acc = _mm256_add_ps(acc, e);
        store_part(s + j, _mm256_mul_ps(e, fv), n - j, mask);
    }
    return hsum(acc);
}

/* s[0..n) <- 2^((s - shift) * log2e) * factor (flushed at floor2); returns the sum of the exponentials (before
 * `factor`). */
static float row_exp(float *s, int64_t n, float shift, float log2e, float floor2, float factor) {
    __m256 acc = _mm256_setzero_ps();
    const int64_t done = use_avx512 ? row_exp16(s, n, shift, log2e, floor2, factor, &acc) : 0;
    return row_exp_tail(s, n, done, shift, log2e, floor2, factor, acc);
}

/* exp2_flushed16 for lanes x <= 0 or NaN (the forward's rows, shifted by at least their largest entry) and floor2 >=
 * -126: the clamps to [-126, 129] change no such lane that is kept, and VREDUCEPS gives f = x - round(x) in one step,
 * exactly as the subtraction does (|f| <= 1/2 is a float), with n = x - f = round(x) exactly; so the same floats
 * (checked bitwise over every such 32-bit input, floor2 -126 and -100), 3 fewer operations per 16 lanes: the forward's
 * exponential pass measured 13.3 -> 11.9 ms of a 113 ms B=1 N=8 S=2048 D=128 fp32 fused forward on one thread. */
__attribute__((target("avx512f,avx512dq"))) static inline __m512 exp2_flushed16_nonpos(__m512 x, __m512 floor2) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, floor2, _CMP_NLE_UQ);
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 n = _mm512_sub_ps(x, f);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; ++i)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[i]));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* row_exp16 with factor 1 for a row whose shift is at least every entry (row_exp_max). */
__attribute__((target("avx512f,avx512dq"))) static int64_t row_exp16_max(float *s, int64_t n, float shift,
                                                                           float log2e, float floor2, __m256 *acc) {
    const __m512 sv = _mm512_set1_ps(shift), lv = _mm512_set1_ps(log2e), fl = _mm512_set1_ps(floor2);
    __m256 sum = *acc;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp2_flushed16_nonpos(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), sv), lv), fl);
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
        sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
        _mm512_storeu_ps(s + j, e);
    }
    *acc = sum;
    return j;
}

/* row_exp(s, n, shift, log2e, floor2, 1) where shift is at least every entry of the row, or NaN (the online softmax's
 * new maximum): the same floats. */
static float row_exp_max(float *s, int64_t n, float shift, float log2e, float floor2) {
    __m256 acc = _mm256_setzero_ps();
    const int64_t done = use_avx512dq ? row_exp16_max(s, n, shift, log2e, floor2, &acc)
                         : use_avx512 ? row_exp16(s, n, shift, log2e, floor2, 1.0f, &acc)
                                      : 0;
    return row_exp_tail(s, n, done, shift, log2e, floor2, 1.0f, acc);
}

static int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }

static inline float max_nan(float a, float b) { return isnan(a) || isnan(b) ? NAN : (a > b ? a : b); }

/* row_max in 16-lane steps (two running maxima, the NaN test once per 32 entries): the same float, the largest value
 * being the same whatever the order except for the sign of a zero, which row_max_ordered then decides as row_max does.
 * ~1 ms of the 113 ms B=1 N=8 S=2048 D=128 fp32 fused forward on one thread (half of row_max's time). */
__attribute__((target("avx512f"))) static float row_max16(const float *s, int64_t n) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
    __mmask16 nan = 0;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m512 x0 = _mm512_loadu_ps(s + j), x1 = _mm512_loadu_ps(s + j + 16);
        m0 = _mm512_max_ps(m0, x0);
        m1 = _mm512_max_ps(m1, x1);
        nan |= _mm512_cmp_ps_mask(x0, x1, _CMP_UNORD_Q);
    }
    if (nan)
        return NAN;
    float best = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    for (; j < n; ++j) {
        if (isnan(s[j]))
            return NAN;
        best = s[j] > best ? s[j] : best;
    }
    return best == 0.0f ? row_max_ordered(s, n) : best;
}

#endif
