/* Scores of bf16 inputs (S = Q K^T, the backward's dP = dO V^T) from AVX512-BF16 dot products with fp32 sums,
 * from keys packed once per piece in the pair layout VDPBF16PS reads.
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

/* ---- Scores of bf16 inputs: AVX512-BF16 dot products, fp32 accumulation ----
 * A product of two bf16 numbers is exact in fp32, so S = Q K^T from bf16 Q and K with fp32 sums is the fp32 GEMM of
 * the upcast inputs up to the order of the additions (VDPBF16PS adds each pair's products into the fp32 lane, round to
 * nearest even). The one difference: the instruction treats bf16 subnormal inputs (below 2^-126) as 0 and flushes
 * subnormal results. Only the score products S = Q K^T and dP = dO V^T use it (both operands are inputs); P and dS
 * stay fp32 (docs/semantics/index.md: fp32 accumulation everywhere), so their GEMMs stay sgemm. */
#if defined(__clang__) ? __clang_major__ >= 9 : (defined(__GNUC__) && __GNUC__ >= 10)
#define HAVE_BF16_DOT 1
#endif

int cann_attn_has_bf16_dot(void) {
#ifdef HAVE_BF16_DOT
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* Operands of the bf16 score GEMMs of a fused call: the query rows (unscaled, [E, rows, d16] contiguous) and keys
 * (entry stride, row stride) for S = scale Q K^T, and in the backward dY ([E, rows, dv] contiguous) and the values
 * for dP = dY V^T. The fp32 q and k of the call may hold further columns past d16 (ALiBi's rank-2 features), whose
 * products add_features adds. q == NULL: the scores take the fp32 sgemm path. */
struct bf16_scores {
    const uint16_t *q, *k, *dy, *v;
    int64_t ske, ldk, sve, ldv, d16;
    float scale;
};

/* s[i, j] += sum_f qf[i, f] kf[j, f] over the nf (<= 2) fp32 feature columns of the query rows (row stride ldq) and
 * keys (ldk): the ALiBi terms that ride in the fp32 GEMM's extra columns, added after a bf16 score GEMM. The keys'
 * features are first copied to `scratch` (nf * w floats) so that the row loop reads them contiguously. */
static void add_features(float *s, int64_t n, int64_t w, int64_t lds, const float *qf, int64_t ldq, const float *kf,
                         int64_t ldk, int64_t nf, float *scratch) {
    for (int64_t f = 0; f < nf; ++f)
        for (int64_t j = 0; j < w; ++j)
            scratch[f * w + j] = kf[j * ldk + f];
    for (int64_t i = 0; i < n; ++i) {
        float *si = s + i * lds;
        for (int64_t f = 0; f < nf; ++f) {
            const float qif = qf[i * ldq + f], *kff = scratch + f * w;
            for (int64_t j = 0; j < w; ++j)
                si[j] += qif * kff[j];
        }
    }
}

/* Rows per register block of the bf16 score kernel (4 x 32 columns: 8 accumulators; measured faster than 6, 8 or 12
 * on a 2-core EPYC, ~190 GFLOP/s on one core against ~93 for sgemm). */
#define BF16_ROWS 4

#ifdef HAVE_BF16_DOT
/* B [w, kk] (row-major bf16, row stride ldb) in the pair layout VDPBF16PS reads: 32-bit word j of pair row p holds
 * B[j, 2p] (low half) and B[j, 2p + 1] (high half; 0 past kk); pair rows are round16(w) + 32 words, zero-padded
 * (a 32-column block that starts inside the piece never reads past its pair row). */
static void pack_pairs(const uint16_t *b, int64_t ldb, int64_t w, int64_t kk, uint32_t *packed) {
    const int64_t wp = (w + 15) / 16 * 16 + 32;
    for (int64_t p = 0; p < (kk + 1) / 2; ++p) {
        uint32_t *row = packed + p * wp;
        for (int64_t j = 0; j < w; ++j) {
            const uint16_t *bj = b + j * ldb + 2 * p;
            row[j] = (uint32_t)bj[0] | (2 * p + 1 < kk ? (uint32_t)bj[1] << 16 : 0u);
        }
        for (int64_t j = w; j < wp; ++j)
            row[j] = 0;
    }
}

/* The pair of A's row `a` at pair p: two bf16 halves, the high one 0 past kk. */
static inline uint32_t row_pair(const uint16_t *a, int64_t p, int64_t kk) {
    uint32_t pair;
    if (2 * p + 1 < kk)
        memcpy(&pair, a + 2 * p, sizeof pair);
    else
        pair = a[2 * p];
    return pair;
}

/* C rows [0, BF16_ROWS) x the 32 columns of `packed` (masks m0 / m1 for the two halves) = alpha A B^T: BF16_ROWS x 2
 * accumulators, each pair of B's columns loaded once for all the rows. */
__attribute__((target("avx512f,avx512bf16"))) static void bf16_rows_block(const uint16_t *a, int64_t lda,
                                                                          const uint32_t *packed, int64_t wp,
                                                                          int64_t kk, float alpha, float *c,
                                                                          int64_t ldc, __mmask16 m0, __mmask16 m1) {
    __m512 acc0[BF16_ROWS], acc1[BF16_ROWS];
    for (int r = 0; r < BF16_ROWS; ++r)
        acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < (kk + 1) / 2; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(packed + p * wp);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(packed + p * wp + 16);
        for (int r = 0; r < BF16_ROWS; ++r) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)row_pair(a + r * lda, p, kk));
            acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
        }
    }
    const __m512 al = _mm512_set1_ps(alpha);
    for (int r = 0; r < BF16_ROWS; ++r) {
        _mm512_mask_storeu_ps(c + r * ldc, m0, _mm512_mul_ps(acc0[r], al));
        _mm512_mask_storeu_ps(c + r * ldc + 16, m1, _mm512_mul_ps(acc1[r], al));
    }
}

/* One row of C over the 32 columns of `packed` (the rows that do not fill a bf16_rows_block). */
__attribute__((target("avx512f,avx512bf16"))) static void bf16_row(const uint16_t *a, const uint32_t *packed,
                                                                   int64_t wp, int64_t kk, float alpha, float *c,
                                                                   __mmask16 m0, __mmask16 m1) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t p = 0; p < (kk + 1) / 2; ++p) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32((int)row_pair(a, p, kk));
        acc0 = _mm512_dpbf16_ps(acc0, av, (__m512bh)_mm512_loadu_si512(packed + p * wp));
        acc1 = _mm512_dpbf16_ps(acc1, av, (__m512bh)_mm512_loadu_si512(packed + p * wp + 16));
    }
    const __m512 al = _mm512_set1_ps(alpha);
    _mm512_mask_storeu_ps(c, m0, _mm512_mul_ps(acc0, al));
    _mm512_mask_storeu_ps(c + 16, m1, _mm512_mul_ps(acc1, al));
}
#endif

/* Packs the w keys (or values) of a piece for gemm_nt_bf16, once for every row block that reads them. */
static void pack_piece(const uint16_t *b, int64_t ldb, int64_t w, int64_t kk, uint32_t *packed) {
#ifdef HAVE_BF16_DOT
    pack_pairs(b, ldb, w, kk, packed);
#else
    (void)b, (void)ldb, (void)w, (void)kk, (void)packed;
#endif
}

/* Row-major C[m, n] (ldc) = alpha A[m, kk] (lda) B[n, kk]^T, A bf16 and B columns [col, col + n) of a piece packed by
 * pack_piece (`width` keys wide), fp32 sums. */
static void gemm_nt_bf16(int64_t m, int64_t n, int64_t kk, const uint16_t *a, int64_t lda, const uint32_t *packed,
                         int64_t width, int64_t col, float alpha, float *c, int64_t ldc) {
#ifdef HAVE_BF16_DOT
    const int64_t wp = (width + 15) / 16 * 16 + 32;
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
        const int64_t nc = n - j0 < 32 ? n - j0 : 32;
        const __mmask16 m0 = nc >= 16 ? 0xFFFF : (__mmask16)((1u << nc) - 1);
        const __mmask16 m1 = nc >= 32 ? 0xFFFF : nc <= 16 ? 0 : (__mmask16)((1u << (nc - 16)) - 1);
        int64_t i0 = 0;
        for (; i0 + BF16_ROWS <= m; i0 += BF16_ROWS)
            bf16_rows_block(a + i0 * lda, lda, packed + col + j0, wp, kk, alpha, c + i0 * ldc + j0, ldc, m0, m1);
        for (; i0 < m; ++i0)
            bf16_row(a + i0 * lda, packed + col + j0, wp, kk, alpha, c + i0 * ldc + j0, m0, m1);
    }
#else
    (void)m, (void)n, (void)kk, (void)a, (void)lda, (void)packed, (void)width, (void)col, (void)alpha, (void)c,
        (void)ldc;
#endif
}

/* Words of pair-packing scratch a thread needs for pieces up to sub_cols wide with depth up to kk. */
static int64_t packed_words(int64_t sub_cols, int64_t kk) { return (kk + 1) / 2 * ((sub_cols + 15) / 16 * 16 + 32); }
