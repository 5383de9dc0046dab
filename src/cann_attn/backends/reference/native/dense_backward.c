/* The fused dense backward (FlashAttentionScoreGrad): per work item (entry, key pieces), S and dP, P and dS in
 * one pass, and dQ, dK, dV accumulated in a fixed order.
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

/* The per-row inputs of a fused backward call, shared by its pieces (fa_backward_blocks documents them). */
struct backward_rows {
    const float *q, *dy, *d_sum, *shift, *factor;
    int64_t dk, dg, dv, ldk, ldv, bias_rows;
    const uint8_t *keep;
    const int64_t *keep_first;
    float inv_keep, log2e, floor2;
    int64_t lddk, lddv;
    const struct bf16_scores *bf;
    const struct alibi_rows *al;
};

/* One score row of backward_piece: s[j] <- P = 2^((s[j] - shift) log2e) * factor (flushed at floor2: row_exp's
 * floats, without its sum) and dp[j] <- dS = (dp[j] - d) P, in one pass; probs_ds16 takes the first n / 16 * 16
 * entries where use_avx512 (the same operations on 16 lanes) and returns how many it took. */
__attribute__((target("avx512f"))) static int64_t probs_ds16(float *s, float *dp, int64_t n, float shift, float log2e,
                                                              float floor2, float factor, float d) {
    const __m512 sv = _mm512_set1_ps(shift), lv = _mm512_set1_ps(log2e), fl = _mm512_set1_ps(floor2);
    const __m512 fv = _mm512_set1_ps(factor), dv = _mm512_set1_ps(d);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp2_flushed16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), sv), lv), fl);
        const __m512 p = _mm512_mul_ps(e, fv);
        _mm512_storeu_ps(s + j, p);
        _mm512_storeu_ps(dp + j, _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(dp + j), dv), p));
    }
    return j;
}

static void probs_ds_row(float *s, float *dp, int64_t n, float shift, float log2e, float floor2, float factor,
                         float d) {
    const __m256 sv = _mm256_set1_ps(shift), lv = _mm256_set1_ps(log2e), fl = _mm256_set1_ps(floor2);
    const __m256 fv = _mm256_set1_ps(factor), dv = _mm256_set1_ps(d);
    for (int64_t j = use_avx512 ? probs_ds16(s, dp, n, shift, log2e, floor2, factor, d) : 0; j < n; j += 8) {
        const __m256i mask = lane_mask(n - j);
        const __m256 e = exp2_flushed(_mm256_mul_ps(_mm256_sub_ps(load_part(s + j, n - j, mask), sv), lv), fl);
        const __m256 p = _mm256_mul_ps(e, fv);
        store_part(s + j, p, n - j, mask);
        store_part(dp + j, _mm256_mul_ps(_mm256_sub_ps(load_part(dp + j, n - j, mask), dv), p), n - j, mask);
    }
}

/* The backward terms of n query rows (`row`: their index over all entries; `r0`: within the entry, for the bias)
 * against w key columns (kp, vp, dkp, dvp: their first rows; `col`: their column in the tile's bias and keep bits),
 * as fa_backward_blocks describes; s and dp are [n, round8(w)] scratch blocks, dq_rows the rows' dQ (ld_rows). With
 * a->bf, S and dP come from the bf16 rows and the piece's keys and values packed by pack_piece (packed_w wide; these
 * columns start at packed_col). a->al: the rows' generated ALiBi, these columns starting at key column j_abs. With
 * sk / sv (NULL: none), the fp32 S and dP take the piece's keys and values as pack_piece_for packed them (for
 * ordered_nt with sk_kc / sv_kc where > 0, else for the BLAS).
 * dP is formed before P, so that one pass per row turns S into P and dP into dS (probs_ds_row); with dropout, P then
 * becomes P * keep / keep_prob in place for dV. */
static void backward_piece(int64_t n, int64_t row, int64_t r0, int64_t col, int64_t w, const struct backward_rows *a,
                           const float *kp, const float *vp, const float *bt, int64_t tile_w, float *s,
                           float *dp, float *dq_rows, int64_t ld_rows, float *dkp, float *dvp,
                           const uint32_t *packed_k, const uint32_t *packed_v, int64_t packed_w, int64_t packed_col,
                           float *features, int64_t j_abs, const float *sk, int64_t sk_kc, const float *sv,
                           int64_t sv_kc) {
    const int64_t lds = round8(w);
    const struct bf16_scores *bf = a->bf;
    if (sk) {
        packed_nt(n, w, a->dk, a->q + row * a->dk, sk, sk_kc, s, lds);
        packed_nt(n, w, a->dv, a->dy + row * a->dv, sv, sv_kc, dp, lds);
    } else if (!bf) {
        gemm_nt((int)n, (int)w, (int)a->dk, a->q + row * a->dk, (int)a->dk, kp, (int)a->ldk, 0.0f, s, (int)lds);
        gemm_nt((int)n, (int)w, (int)a->dv, a->dy + row * a->dv, (int)a->dv, vp, (int)a->ldv, 0.0f, dp, (int)lds);
    } else {
        gemm_nt_bf16(n, w, bf->d16, bf->q + row * bf->d16, bf->d16, packed_k, packed_w, packed_col, bf->scale, s,
                     lds);
        if (a->dk > bf->d16)
            add_features(s, n, w, lds, a->q + row * a->dk + bf->d16, a->dk, kp + bf->d16, a->ldk, a->dk - bf->d16,
                         features);
        gemm_nt_bf16(n, w, a->dv, bf->dy + row * a->dv, a->dv, packed_v, packed_w, packed_col, 1.0f, dp, lds);
    }
    if (a->al)
        add_alibi_rows(s, n, w, lds, a->al->slope + row, a->al->pos + row, a->al->sqrt_dist, j_abs);
    if (bt)
        add_mask_rows(s, n, w, lds, bt, r0, a->bias_rows, tile_w, col);
    for (int64_t i = 0; i < n; ++i) {
        float *si = s + i * lds, *di = dp + i * lds;
        if (a->keep)
            keep_row(di, a->keep, a->keep_first[row + i] + col, w, a->inv_keep);
        probs_ds_row(si, di, w, a->shift[row + i], a->log2e, a->floor2, a->factor[row + i], a->d_sum[row + i]);
        if (a->keep)
            keep_row(si, a->keep, a->keep_first[row + i] + col, w, a->inv_keep);
    }
    gemm_tn_acc((int)w, (int)a->dv, (int)n, s, (int)lds, a->dy + row * a->dv, (int)a->dv, dvp, (int)a->lddv);
    gemm_tn_acc((int)w, (int)a->dg, (int)n, dp, (int)lds, a->q + row * a->dk, (int)a->dk, dkp, (int)a->lddk);
    gemm_nn((int)n, (int)a->dg, (int)w, dp, (int)lds, kp, (int)a->ldk, 1.0f, dq_rows, (int)ld_rows);
}

/* Dense backward of one query tile (docs/semantics/dropout.md), fused: for `entries` GEMM batch entries with `rows` query rows
 * q [E, rows, dk] (contiguous, scaled), dy [E, rows, dv], d_sum = rowsum(dY * O), shift = softmax_max and factor =
 * 1 / softmax_sum [E, rows] (all contiguous), keys k and values v (entry stride, row stride) and the key tiles with
 * their optional bias tiles (as fa_forward_blocks):
 *   P = 2^((Q K^T + mask - shift) log2e) * factor (flushed), dV += P^T dY, dP = dY V^T, dS = P (dP - d_sum),
 *   dK += dS^T Q, dQ += dS K,
 * with dropout (a single tile; `keep` and keep_first as in fa_forward_blocks) dV += (P keep inv_keep)^T dY and
 * dP = (dY V^T) keep inv_keep,
 * accumulating into dq, dk and dv (entry stride, row stride). The gradients take the first dg <= dk columns of Q and
 * K (the rest are ALiBi's rank-2 feature columns, which only enter S). A work item owns one entry's run of consecutive key
 * pieces (at most `sub_cols` wide), so it alone writes their dK / dV rows. Each entry's pieces are split into
 * ceil(min_items / entries) runs (a number that does not depend on the thread count): with one run per entry the
 * item owns its dQ rows too; with several, each run's dQ terms go to a private buffer and the buffers are added to
 * dq afterwards in run order. Query rows go in blocks of `block_rows`, split where a bias hides columns as in
 * fa_forward_blocks; with `al`, the generated ALiBi enters S and row blocks skip the pieces where every P flushes to 0
 * (alibi_reaches against `shift`). No result depends on the thread count. */
void fa_backward_blocks(const float *q, const float *dy, const float *d_sum, const float *shift, const float *factor,
                        int64_t entries, int64_t rows, int64_t dk, int64_t dg, int64_t dv, const float *k, int64_t ske,
                        int64_t ldk, const float *v, int64_t sve, int64_t ldv, int64_t n_tiles, const int64_t *tj0,
                        const int64_t *tj1, const int64_t *bias, int64_t bias_rows, int64_t bias_stride,
                        const uint8_t *keep, const int64_t *keep_first, float inv_keep, int64_t block_rows,
                        int64_t sub_cols, int64_t min_items, float log2e, float floor2, const struct bf16_scores *bf,
                        const struct alibi_rows *al, float *dq,
                        int64_t sdq,
                        int64_t lddq, float *dk_acc, int64_t sdk, int64_t lddk, float *dv_acc, int64_t sdv,
                        int64_t lddv) {
    int64_t max_pieces = n_tiles;
    for (int64_t t = 0; t < n_tiles; ++t)
        max_pieces += (tj1[t] - tj0[t]) / sub_cols;
    int64_t *pj0 = malloc(sizeof(int64_t) * 3 * (max_pieces + 1));
    int64_t *pj1 = pj0 + max_pieces + 1, *ptile = pj1 + max_pieces + 1;
    const int64_t pieces = key_pieces(n_tiles, tj0, tj1, sub_cols, pj0, pj1, ptile);
    int64_t runs = (min_items + entries - 1) / entries;
    runs = runs < pieces ? runs : pieces;
    runs = runs > 1 ? runs : 1;
    float *dq_part = runs > 1 ? calloc((size_t)(entries * runs * rows * dg), sizeof(float)) : NULL;
    if (!dq_part)
        runs = 1; /* also where the buffers could not be had: one item per entry, which owns its dQ rows */
    const int64_t br = block_rows < rows ? block_rows : rows;
    const struct backward_rows args = {q, dy, d_sum, shift, factor, dk, dg, dv, ldk, ldv, bias_rows, keep,
                                       keep_first, inv_keep, log2e, floor2, lddk, lddv,
                                       bf && bf->q ? bf : NULL, al};
#pragma omp parallel
    {
        float *s = aligned_alloc(64, sizeof(float) * round8(br) * round8(sub_cols));
        float *dp = aligned_alloc(64, sizeof(float) * round8(br) * round8(sub_cols));
        /* fp32 S and dP from packed pieces (pack_rows_t) where the call has PACK_MIN_BLOCKS row blocks to share them */
        const int sgemm_packed = !args.bf && blas_compute && br >= PACK_MIN_ROWS && rows / br >= PACK_MIN_BLOCKS;
        float *sk = sgemm_packed ? aligned_alloc(64, sizeof(float) * piece_slot_floats(sub_cols, br, dk)) : NULL;
        float *sv = sgemm_packed ? aligned_alloc(64, sizeof(float) * piece_slot_floats(sub_cols, br, dv)) : NULL;
        uint32_t *packed_k = args.bf ? malloc(sizeof(uint32_t) * packed_words(sub_cols, args.bf->d16)) : NULL;
        uint32_t *packed_v = args.bf ? malloc(sizeof(uint32_t) * packed_words(sub_cols, dv)) : NULL;
        float *features = args.bf && dk > args.bf->d16 ? malloc(sizeof(float) * (dk - args.bf->d16) * sub_cols) : NULL;
        int64_t ranges[2 * MAX_SUB_BLOCKS];
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < entries * runs; ++item) {
            const int64_t e = item / runs, run = item % runs;
            float *dq_rows = dq_part ? dq_part + item * rows * dg : dq + e * sdq;
            const int64_t ld_rows = dq_part ? dg : lddq;
            for (int64_t p = run * pieces / runs; p < (run + 1) * pieces / runs; ++p) {
                const int64_t c0 = pj0[p], w = pj1[p] - c0, t = ptile[p];
                const float *kp = k + e * ske + c0 * ldk, *vp = v + e * sve + c0 * ldv;
                float *dkp = dk_acc + e * sdk + c0 * lddk, *dvp = dv_acc + e * sdv + c0 * lddv;
                const float *bt = bias[t] ? (const float *)(intptr_t)bias[t] + e * bias_stride : NULL;
                const int64_t tile_w = tj1[t] - tj0[t];
                if (args.bf) {
                    pack_piece(bf->k + e * bf->ske + c0 * bf->ldk, bf->ldk, w, bf->d16, packed_k);
                    pack_piece(bf->v + e * bf->sve + c0 * bf->ldv, bf->ldv, w, dv, packed_v);
                }
                const int piece_packed = sk && sv && w >= PACK_MIN_COLS;
                const int64_t sk_kc = piece_packed ? pack_piece_for(w, br, dk, kp, ldk, sk) : 0;
                const int64_t sv_kc = piece_packed ? pack_piece_for(w, br, dv, vp, ldv, sv) : 0;
                for (int64_t r0 = 0; r0 < rows; r0 += br) {
                    const int64_t n = rows - r0 < br ? rows - r0 : br;
                    const int64_t step = live_blocks(bt, r0, n, bias_rows, tile_w, c0 - tj0[t], w, ranges);
                    for (int64_t s0 = 0, b = 0; s0 < n; s0 += step, ++b) {
                        const int64_t lo = ranges[2 * b], hi = ranges[2 * b + 1];
                        if (lo >= hi)
                            continue; /* every P there is 0: no gradient term */
                        const int64_t end = s0 + (n - s0 < step ? n - s0 : step), row0 = e * rows + r0;
                        const float *row_shift = shift + row0;
                        for (int64_t a0 = s0; a0 < end;) { /* runs of rows whose ALiBi terms may reach the columns */
                            const int64_t a1 = alibi_live_run(al, e, row0, &a0, end, c0 + lo, hi - lo, row_shift,
                                                              log2e, floor2);
                            if (a0 >= end)
                                break;
                            /* the packed pieces serve whole blocks of whole pieces only (their n, m and columns) */
                            const int whole = piece_packed && lo == 0 && hi == w && a1 - a0 == br;
                            backward_piece(a1 - a0, row0 + a0, r0 + a0, c0 - tj0[t] + lo, hi - lo, &args,
                                           kp + lo * ldk, vp + lo * ldv, bt, tile_w, s, dp,
                                           dq_rows + (r0 + a0) * ld_rows, ld_rows, dkp + lo * lddk, dvp + lo * lddv,
                                           packed_k, packed_v, w, lo, features, c0 + lo, whole ? sk : NULL,
                                           sk_kc, whole ? sv : NULL, sv_kc);
                            a0 = a1;
                        }
                    }
                }
            }
        }
        free(features);
        free(packed_k);
        free(packed_v);
        free(sk);
        free(sv);
        free(s);
        free(dp);
        if (dq_part) {
#pragma omp for schedule(static)
            for (int64_t er = 0; er < entries * rows; ++er) {
                const int64_t e = er / rows, r = er % rows;
                float *out = dq + e * sdq + r * lddq;
                for (int64_t run = 0; run < runs; ++run) {
                    const float *part = dq_part + ((e * runs + run) * rows + r) * dg;
                    for (int64_t d = 0; d < dg; ++d)
                        out[d] += part[d];
                }
            }
        }
    }
    free(dq_part);
    free(pj0);
}
