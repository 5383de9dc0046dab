/* The "npu" precision mode's FlashAttentionScoreGrad over one key tile (docs/semantics/precision.md, "Gradients"),
 * one pass per row: from the float64 GEMM sums S = Q K^T and dP = dY V^T (each rounded once to fp32)
 *   P  = 2^((S scale - max) log2e) / sum    (softmax_exp's exponential, the loops' exp2_flushed; a masked column's
 *                                            logit is -inf, so its P is what -inf gives: 0 for finite statistics)
 *   dS = (dP - D) P
 * each cast as its stage rounds and written as fp32, ready for the fp32 GEMMs. Every operation is the one PyTorch's
 * elementwise ops take in the same order (fp32, one rounding each); the casts are npu_round's.
 *
 * Rows: r in [0, n_rows) is (entry b, head h, tile row i), i = r % tile_rows, h = r / tile_rows % heads,
 * b = r / (tile_rows heads); the statistics row_max, row_sum and d_sum are indexed by r. Column j of row r is visible
 * where lo[i] <= j0 + j < hi[i] (lo and hi NULL: every column) and, with a mask, mask[b sb + h sh + i sr + j] == 0.
 * A cast `kind`: 0 keeps fp32, else 1 | fp16 << 1 | half away << 2 (bf16 when the fp16 bit is clear).
 *
 * The AVX-512 steps (16 lanes) and the AVX2 ones (8 lanes; the F16C conversion or, without F16C, npu_round_fp16 lane
 * by lane for fp16) run the same correctly rounded operations lane by lane: the same floats on every path.
 *
 * Part of the attention_loops.c translation unit (included there, after npu_rounding.c and npu_tiles.c, whose
 * npu_round_fp16_x16 it takes; not compiled alone).
 */

struct npu_grad_tile {
    const double *s, *dp;
    const float *row_max, *row_sum, *d_sum;
    const int64_t *lo, *hi;
    const uint8_t *mask;
    float *p, *ds;
    int64_t cols, tile_rows, heads, j0, sb, sh, sr;
    int p_kind, ds_kind, f16c;
    float scale, log2e, floor2;
};

/* One row's constants: its statistics and its visible column range [a, e) of the tile. */
struct npu_grad_row {
    const double *s, *dp;
    const uint8_t *mask;
    float *p, *ds;
    int64_t a, e;
    float max, sum, d;
};

__attribute__((target("avx2,fma,f16c"))) static inline __m256 npu_cast8(__m256 x, int kind, int f16c) {
    if (!kind)
        return x;
    const int away = (kind >> 2) & 1;
    if (!(kind & 2))
        return npu_round_bf16_x8(x, away);
    if (f16c)
        return npu_round_fp16_x8(x, away);
    float lanes[8];
    _mm256_storeu_ps(lanes, x);
    for (int l = 0; l < 8; ++l)
        lanes[l] = npu_round_fp16(lanes[l], away);
    return _mm256_loadu_ps(lanes);
}

/* Columns [j, cols) of a row in 8-lane steps, the last one partial. */
__attribute__((target("avx2,fma,f16c"))) static void npu_grad_row8(const struct npu_grad_tile *g,
                                                                   const struct npu_grad_row *w, int64_t j) {
    const __m256 scale = _mm256_set1_ps(g->scale), log2e = _mm256_set1_ps(g->log2e);
    const __m256 floor2 = _mm256_set1_ps(g->floor2), minus_inf = _mm256_set1_ps(-INFINITY);
    const __m256 max = _mm256_set1_ps(w->max), sum = _mm256_set1_ps(w->sum), d = _mm256_set1_ps(w->d);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i a = _mm256_set1_epi32((int)w->a - 1), e = _mm256_set1_epi32((int)w->e);
    for (; j < g->cols; j += 8) {
        const int64_t n = g->cols - j < 8 ? g->cols - j : 8;
        /* a partial last step reads copies padded with zeros (never past the row) */
        double s_part[8] = {0}, dp_part[8] = {0};
        uint8_t mask_part[8] = {0};
        const double *s8 = w->s + j, *dp8 = w->dp + j;
        const uint8_t *mask8 = w->mask ? w->mask + j : NULL;
        if (n < 8) {
            memcpy(s_part, s8, (size_t)n * sizeof(double));
            memcpy(dp_part, dp8, (size_t)n * sizeof(double));
            if (mask8)
                memcpy(mask_part, mask8, (size_t)n);
            s8 = s_part;
            dp8 = dp_part;
            mask8 = mask8 ? mask_part : NULL;
        }
        const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)j), iota);
        __m256i visible = _mm256_and_si256(_mm256_cmpgt_epi32(idx, a), _mm256_cmpgt_epi32(e, idx));
        if (mask8) {
            const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mask8));
            visible = _mm256_and_si256(visible, _mm256_cmpeq_epi32(m, _mm256_setzero_si256()));
        }
        __m256 s = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(s8 + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(s8)));
        s = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(s, scale), _mm256_castsi256_ps(visible));
        const __m256 p = _mm256_div_ps(exp2_flushed(_mm256_mul_ps(_mm256_sub_ps(s, max), log2e), floor2), sum);
        const __m256 dp = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(dp8 + 4)),
                                          _mm256_cvtpd_ps(_mm256_loadu_pd(dp8)));
        const __m256 ds = _mm256_mul_ps(_mm256_sub_ps(dp, d), p);
        const __m256i lanes = lane_mask(n);
        store_part(w->p + j, npu_cast8(p, g->p_kind, g->f16c), n, lanes);
        store_part(w->ds + j, npu_cast8(ds, g->ds_kind, g->f16c), n, lanes);
    }
}

/* Two 8-lane halves as one 16-lane vector. */
__attribute__((target("avx512f"))) static inline __m512 npu_join16(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* npu_round_bf16_x8 on each half (integer steps: 16-lane ones would save next to nothing). */
__attribute__((target("avx512f"))) static inline __m512 npu_round_bf16_x16(__m512 v, int away) {
    return npu_join16(npu_round_bf16_x8(_mm512_castps512_ps256(v), away), npu_round_bf16_x8(high_half(v), away));
}

__attribute__((target("avx512f"))) static inline __m512 npu_cast16(__m512 x, int kind) {
    if (!kind)
        return x;
    const int away = (kind >> 2) & 1;
    return kind & 2 ? npu_round_fp16_x16(x, away) : npu_round_bf16_x16(x, away);
}

__attribute__((target("avx512f"))) static inline __m512 npu_wide16(const double *x) {
    return npu_join16(_mm512_cvtpd_ps(_mm512_loadu_pd(x)), _mm512_cvtpd_ps(_mm512_loadu_pd(x + 8)));
}

/* The row's whole 16-column steps; returns how many columns they took. */
__attribute__((target("avx512f"))) static int64_t npu_grad_row16(const struct npu_grad_tile *g,
                                                                  const struct npu_grad_row *w) {
    const __m512 scale = _mm512_set1_ps(g->scale), log2e = _mm512_set1_ps(g->log2e);
    const __m512 floor2 = _mm512_set1_ps(g->floor2), minus_inf = _mm512_set1_ps(-INFINITY);
    const __m512 max = _mm512_set1_ps(w->max), sum = _mm512_set1_ps(w->sum), d = _mm512_set1_ps(w->d);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i a = _mm512_set1_epi32((int)w->a), e = _mm512_set1_epi32((int)w->e);
    int64_t j = 0;
    for (; j + 16 <= g->cols; j += 16) {
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)j), iota);
        __mmask16 visible = _mm512_cmpge_epi32_mask(idx, a) & _mm512_cmplt_epi32_mask(idx, e);
        if (w->mask) {
            const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->mask + j)));
            visible &= _mm512_testn_epi32_mask(m, m);
        }
        const __m512 s = _mm512_mask_mul_ps(minus_inf, visible, npu_wide16(w->s + j), scale);
        const __m512 p = _mm512_div_ps(exp2_flushed16(_mm512_mul_ps(_mm512_sub_ps(s, max), log2e), floor2), sum);
        const __m512 ds = _mm512_mul_ps(_mm512_sub_ps(npu_wide16(w->dp + j), d), p);
        _mm512_storeu_ps(w->p + j, npu_cast16(p, g->p_kind));
        _mm512_storeu_ps(w->ds + j, npu_cast16(ds, g->ds_kind));
    }
    return j;
}

static int64_t npu_clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

void npu_grad_scores(const double *s, const double *dp, int64_t n_rows, int64_t cols, int64_t tile_rows,
                     int64_t heads, const float *row_max, const float *row_sum, const float *d_sum, float scale,
                     const int64_t *lo, const int64_t *hi, int64_t j0, const uint8_t *mask, int64_t sb, int64_t sh,
                     int64_t sr, float *p, float *ds, int64_t p_kind, int64_t ds_kind, float log2e, float floor2) {
    const struct npu_grad_tile g = {s, dp, row_max, row_sum, d_sum, lo, hi, mask, p, ds, cols, tile_rows, heads, j0,
                                    sb, sh, sr, (int)p_kind, (int)ds_kind, npu_has_f16c(), scale, log2e, floor2};
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t i = r % tile_rows, h = r / tile_rows % heads, b = r / (tile_rows * heads);
        struct npu_grad_row w = {s + r * cols, dp + r * cols, mask ? mask + b * sb + h * sh + i * sr : NULL,
                                 p + r * cols, ds + r * cols, 0, cols, row_max[r], row_sum[r], d_sum[r]};
        if (lo) {
            w.a = npu_clamp(lo[i] - j0, 0, cols);
            w.e = npu_clamp(hi[i] - j0, 0, cols);
        }
        npu_grad_row8(&g, &w, use_avx512 ? npu_grad_row16(&g, &w) : 0);
    }
}
