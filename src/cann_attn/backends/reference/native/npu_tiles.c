/* The fp16 pipelines' per-tile passes of the "npu" precision mode (docs/semantics/precision.md): one online-softmax
 * step from the float64 scores GEMM to the float64 probabilities the P V GEMM reads, and the running output's
 * rescale and add. Each gives the bits of the separate passes it replaces (npu_round_wide_fp16, fa_softmax_step,
 * npu_round, the widening to float64; the fp32 products and sums of the running output), with one read and one
 * write of the tile instead of five allocations and passes: a row is rounded into a per-thread buffer, its maximum,
 * exponentials and sum taken there while it is in L1 (softmax_step_row), and its rounded probabilities written over
 * the scores. AVX-512 and AVX2 (F16C) steps, scalar tails and a scalar path without F16C: the same floats (exact
 * integer steps and correctly rounded fp32 operations, lane by lane).
 *
 * Part of the attention_loops.c translation unit (included there, after npu_rounding.c; not compiled alone).
 */

/* npu_round_fp16_x8 on sixteen lanes: the same steps (F16C's conversion for half to even; the magnitude's bits
 * for half away), so the same floats. */
__attribute__((target("avx512f"))) static inline __m512 npu_round_fp16_x16(__m512 x, int away) {
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (!away)
        return _mm512_mask_blend_ps(
            nan, _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), x);
    const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u), bits = _mm512_castps_si512(x);
    const __m512i sign = _mm512_and_si512(bits, sign_bit);
    const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, bits));
    const __m512i u = _mm512_add_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(0x1000));
    const __m512 normal = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(~0x1FFF)));
    const __m512 steps = _mm512_mul_ps(a, _mm512_set1_ps(0x1p24f));
    const __m512 whole = _mm512_roundscale_ps(steps, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 up = _mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(_mm512_sub_ps(steps, whole), _mm512_set1_ps(0.5f), _CMP_GE_OQ), _mm512_set1_ps(1.0f));
    const __m512 subnormal = _mm512_mul_ps(_mm512_add_ps(whole, up), _mm512_set1_ps(0x1p-24f));
    __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-14f), _CMP_LT_OQ), normal, subnormal);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(65520.0f), _CMP_NLT_UQ), r,
                             _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign)), x);
}

/* npu_round_to_odd on the sixteen float64 values at x, as fp32 lanes. */
__attribute__((target("avx512f"))) static inline __m512 npu_round_to_odd_x16(const double *x) {
    const __m512i dropped = _mm512_set1_epi64((1ll << 29) - 1), sticky = _mm512_set1_epi64(1ll << 29);
    __m256 half_lanes[2];
    for (int h = 0; h < 2; ++h) {
        const __m512i u = _mm512_loadu_si512(x + 8 * h);
        const __m512i odd = _mm512_or_si512(
            _mm512_andnot_si512(dropped, u),
            _mm512_and_si512(_mm512_add_epi64(_mm512_and_si512(u, dropped), dropped), sticky));
        half_lanes[h] = _mm512_cvtpd_ps(_mm512_castsi512_pd(odd));
    }
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(half_lanes[0])),
                                               _mm256_castps_pd(half_lanes[1]), 1));
}

/* One fp16 logit from its float64 score: the score rounded to fp16 (ties away when `away`), times `scale`, rounded
 * to fp16 again (`away2`): npu_round_wide_fp16's scaled pass on one value. */
static inline float npu_wide_logit(double x, int away, float scale, int away2) {
    return npu_round_fp16(npu_round_fp16(npu_round_to_odd(x), away) * scale, away2);
}

__attribute__((target("avx512f"))) static int64_t npu_wide_logits16(const double *x, float *out, int64_t n, int away,
                                                                     float scale, int away2) {
    const __m512 sv = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 r = npu_round_fp16_x16(npu_round_to_odd_x16(x + j), away);
        _mm512_storeu_ps(out + j, npu_round_fp16_x16(_mm512_mul_ps(r, sv), away2));
    }
    return j;
}

__attribute__((target("avx2,fma,f16c"))) static int64_t npu_wide_logits8(const double *x, float *out, int64_t n,
                                                                         int64_t done, int away, float scale,
                                                                         int away2) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t j = done;
    for (; j + 8 <= n; j += 8) {
        const __m256 r = npu_round_fp16_x8(npu_round_to_odd_x8(x + j), away);
        _mm256_storeu_ps(out + j, npu_round_fp16_x8(_mm256_mul_ps(r, sv), away2));
    }
    return j;
}

/* out[0..n) = npu_wide_logit(x[j], ...): 16-lane steps where the loops take AVX-512, 8-lane ones with F16C, scalar
 * ones for the rest. */
static void npu_wide_logits_row(const double *x, float *out, int64_t n, int away, float scale, int away2, int f16c) {
    int64_t j = use_avx512 ? npu_wide_logits16(x, out, n, away, scale, away2) : 0;
    if (f16c)
        j = npu_wide_logits8(x, out, n, j, away, scale, away2);
    for (; j < n; ++j)
        out[j] = npu_wide_logit(x[j], away, scale, away2);
}

__attribute__((target("avx512f"))) static int64_t npu_widen_fp16_16(const float *p, double *out, int64_t n,
                                                                     int away) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 r = npu_round_fp16_x16(_mm512_loadu_ps(p + j), away);
        _mm512_storeu_pd(out + j, _mm512_cvtps_pd(_mm512_castps512_ps256(r)));
        _mm512_storeu_pd(out + j + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                                          _mm512_castps_pd(r), 1))));
    }
    return j;
}

__attribute__((target("avx2,fma,f16c"))) static int64_t npu_widen_fp16_8(const float *p, double *out, int64_t n,
                                                                         int64_t done, int away) {
    int64_t j = done;
    for (; j + 8 <= n; j += 8) {
        const __m256 r = npu_round_fp16_x8(_mm256_loadu_ps(p + j), away);
        _mm256_storeu_pd(out + j, _mm256_cvtps_pd(_mm256_castps256_ps128(r)));
        _mm256_storeu_pd(out + j + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)));
    }
    return j;
}

/* out[0..n) = p[j] rounded to fp16 (ties away when `away`), as float64 (exact). */
static void npu_widen_fp16_row(const float *p, double *out, int64_t n, int away, int f16c) {
    int64_t j = use_avx512 ? npu_widen_fp16_16(p, out, n, away) : 0;
    if (f16c)
        j = npu_widen_fp16_8(p, out, n, j, away);
    for (; j < n; ++j)
        out[j] = (double)npu_round_fp16(p[j], away);
}

/* One online-softmax step of an fp16 pipeline over a key tile of `rows` rows of `cols` columns (contiguous): the
 * logits are, where `logits` is NULL, the float64 scores s rounded to fp16 (ties away when scores_away), times
 * `scale`, rounded to fp16 again (logits_away); else the fp32 tile `logits` (already rounded and masked; it is
 * overwritten). Each row takes fa_softmax_step's step (row_max / row_sum updated, correction[i] = e^(old max -
 * shift)), and its exponentials rounded to fp16 (p_away) are written over s as float64. Returns 0, or -1 when a row
 * buffer could not be allocated (nothing written then). */
int64_t npu_fp16_softmax_step(double *s, float *logits, int64_t rows, int64_t cols, int64_t scores_away, float scale,
                              int64_t logits_away, int64_t p_away, float *row_max_io, float *row_sum_io,
                              float *correction, float log2e, float floor2) {
    const int f16c = npu_has_f16c();
    const int threads = omp_get_max_threads();
    float *buffers = logits ? NULL : malloc(sizeof(float) * (size_t)threads * (size_t)(cols > 0 ? cols : 1));
    if (!logits && !buffers)
        return -1;
#pragma omp parallel num_threads(threads)
    {
        float *row = buffers ? buffers + (size_t)omp_get_thread_num() * (size_t)cols : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
            double *si = s + i * cols;
            float *li = logits ? logits + i * cols : row;
            if (!logits)
                npu_wide_logits_row(si, li, cols, (int)scores_away, scale, (int)logits_away, f16c);
            correction[i] = softmax_step_row(li, cols, row_max_io + i, row_sum_io + i, log2e, floor2);
            npu_widen_fp16_row(li, si, cols, (int)p_away, f16c);
        }
    }
    free(buffers);
    return 0;
}

/* One value of the fp16 running output: fp16(fp16(acc * factor) + fp16(product)), factor already rounded. */
static inline float npu_fp16_update(float acc, float factor, double product, int products_away, int acc_away) {
    const float scaled = npu_round_fp16(acc * factor, acc_away);
    return npu_round_fp16(scaled + npu_round_fp16(npu_round_to_odd(product), products_away), acc_away);
}

__attribute__((target("avx512f"))) static int64_t npu_fp16_update16(float *acc, const double *products, int64_t n,
                                                                     float factor, int products_away, int acc_away) {
    const __m512 fv = _mm512_set1_ps(factor);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 scaled = npu_round_fp16_x16(_mm512_mul_ps(_mm512_loadu_ps(acc + j), fv), acc_away);
        const __m512 product = npu_round_fp16_x16(npu_round_to_odd_x16(products + j), products_away);
        _mm512_storeu_ps(acc + j, npu_round_fp16_x16(_mm512_add_ps(scaled, product), acc_away));
    }
    return j;
}

__attribute__((target("avx2,fma,f16c"))) static int64_t npu_fp16_update8(float *acc, const double *products,
                                                                         int64_t n, int64_t done, float factor,
                                                                         int products_away, int acc_away) {
    const __m256 fv = _mm256_set1_ps(factor);
    int64_t j = done;
    for (; j + 8 <= n; j += 8) {
        const __m256 scaled = npu_round_fp16_x8(_mm256_mul_ps(_mm256_loadu_ps(acc + j), fv), acc_away);
        const __m256 product = npu_round_fp16_x8(npu_round_to_odd_x8(products + j), products_away);
        _mm256_storeu_ps(acc + j, npu_round_fp16_x8(_mm256_add_ps(scaled, product), acc_away));
    }
    return j;
}

/* The fp16 running output after one key tile, per row i of `rows` (`dim` values each, contiguous): acc <-
 * fp16(fp16(acc * fp16(correction[i])) + fp16(products)), products the tile's float64 P V sums; the rescale factor
 * rounds ties away when rescale_away, the products when products_away, the running output when acc_away. */
void npu_fp16_accumulate(float *acc, const double *products, const float *correction, int64_t rows, int64_t dim,
                         int64_t products_away, int64_t rescale_away, int64_t acc_away) {
    const int f16c = npu_has_f16c();
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t i = 0; i < rows; ++i) {
        float *ai = acc + i * dim;
        const double *pi = products + i * dim;
        const float factor = npu_round_fp16(correction[i], (int)rescale_away);
        int64_t j = use_avx512 ? npu_fp16_update16(ai, pi, dim, factor, (int)products_away, (int)acc_away) : 0;
        if (f16c)
            j = npu_fp16_update8(ai, pi, dim, j, factor, (int)products_away, (int)acc_away);
        for (; j < dim; ++j)
            ai[j] = npu_fp16_update(ai[j], factor, pi[j], (int)products_away, (int)acc_away);
    }
}
