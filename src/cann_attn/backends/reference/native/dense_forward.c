/* The fused dense forward (FlashAttentionScore, PFA, FIA prefill): per row block, S = Q K^T, the online softmax,
 * O += P V, with the optional ends that read and scale the query tile and finish the rows into the output and
 * statistics (struct forward_io).
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

/* One online-softmax step of n rows (q rows qr [n, dk], state m / l [n], unnormalised o [n, dv]) over w key columns
 * (kc, vc: their first rows), with the bias rows from bias_r0 at column bias_col of a tile_w-wide bias (NULL: none)
 * and the keep bits from keep_first[i] + keep_col (keep NULL: no dropout). With q16 (the rows' bf16 queries, unscaled)
 * the scores are scale * q16 K^T from the piece's keys packed by pack_piece (packed_w wide; these columns start at
 * packed_col). With `al`, the rows' generated ALiBi (their first row is arow over all entries; these columns start at
 * key column j_abs) is added before the mask. With sk (NULL: none), the fp32 scores take the piece's keys as
 * pack_piece_for packed them (sk_kc: what it returned). s: an [n, round8(w)] scratch block. */
static void forward_piece(const float *qr, int64_t n, int64_t dk, const float *kc, int64_t ldk, const float *vc,
                          int64_t ldv, int64_t dv, int64_t w, const float *bias, int64_t bias_r0, int64_t bias_rows,
                          int64_t tile_w, int64_t bias_col, const uint8_t *keep, const int64_t *keep_first,
                          int64_t keep_col, float log2e, float floor2, const uint16_t *q16, int64_t d16,
                          const uint32_t *packed, int64_t packed_w, int64_t packed_col, float scale,
                          float *features, const struct alibi_rows *al, int64_t arow, int64_t j_abs, const float *sk,
                          int64_t sk_kc, float *s, float *m, float *l, float *o) {
    const int64_t lds = round8(w);
    if (sk) {
        packed_nt(n, w, dk, qr, sk, sk_kc, s, lds);
    } else if (!q16) {
        gemm_nt((int)n, (int)w, (int)dk, qr, (int)dk, kc, (int)ldk, 0.0f, s, (int)lds);
    } else {
        gemm_nt_bf16(n, w, d16, q16, d16, packed, packed_w, packed_col, scale, s, lds);
        if (dk > d16)
            add_features(s, n, w, lds, qr + d16, dk, kc + d16, ldk, dk - d16, features);
    }
    if (al)
        add_alibi_rows(s, n, w, lds, al->slope + arow, al->pos + arow, al->sqrt_dist, j_abs);
    if (bias)
        add_mask_rows(s, n, w, lds, bias, bias_r0, bias_rows, tile_w, bias_col);
    for (int64_t i = 0; i < n; ++i) {
        float *si = s + i * lds;
        const float m_new = max_nan(m[i], use_avx512 ? row_max16(si, w) : row_max(si, w));
        const float shift = m_new == -INFINITY ? 0.0f : m_new;
        const float total = row_exp_max(si, w, shift, log2e, floor2);
        if (keep)
            keep_row(si, keep, keep_first[i] + keep_col, w, 1.0f);
        const float corr = expf(m[i] - shift);
        l[i] = l[i] * corr + total;
        m[i] = m_new;
        if (corr != 1.0f) {
            float *oi = o + i * dv;
            for (int64_t d = 0; d < dv; ++d)
                oi[d] *= corr;
        }
    }
    gemm_nn((int)n, (int)dv, (int)w, s, (int)lds, vc, (int)ldv, 1.0f, o, (int)dv);
}

/* Bound on a fused forward call's packed key pieces (fa_forward_blocks): 2 MB holds the pieces of one entry of 2048
 * keys, d 128, so each entry's are packed just before its row blocks run (B=1 N=8 S=2048 D=128 fp32, one thread,
 * alternated in one process: forward 2.5-3.7% faster than re-packing per block, forward + backward -1.2..+0.5%; with
 * 8 MB, all 8 entries at once, the forward gained 1.4-2.4% and forward + backward lost 0.6-1.6%). */
#define FORWARD_PACK_BYTES ((int64_t)2 << 20)
/* Keys of a piece the forward packs, in calls without a bias tile: PFA's GQA 8/2 causal tiles (4 heads x 256 rows,
 * 256-key pieces, or 512-key ones among masked tiles) measured 2.7-3.8% slower packed (one thread, alternated in one
 * process): masked pieces are cut to their live columns, which the packed pieces do not serve. */
#define FORWARD_PACK_MIN_COLS 512

/* Score GEMMs of fa_forward_blocks from packed key pieces since the last read (tests check that a case takes them). */
static int64_t forward_packed_gemms = 0;

int64_t cann_attn_forward_packed_gemms(void) { return take_count(&forward_packed_gemms); }

/* The optional ends of a fused forward call (fa_forward_blocks). With `q`, a row block's query rows are read from the
 * query tile itself (unscaled, fp32 / fp16 / bf16 by q_dtype 0 / 1 / 2, [count, N1, head_rows, dk] by the element
 * strides qs) and scaled into a per-thread block: the fp32 value times `scale`, rounded once, as the Python query tile
 * (a copy and a multiply, two passes over memory per tile) makes them (fp16 needs F16C). Entry e is sequence
 * e / heads_kv, kv head e % heads_kv; its grouped row r is head (e % heads_kv) * group + r / head_rows, row
 * r % head_rows. With `out`, each row block is finished where it ends, its accumulator still in cache: the output row
 * (out_dtype 0 fp32, 1 fp16 (F16C); strides os, unit column stride) is acc / (row_sum * keep_prob) rounded to its
 * dtype, or acc / 1 where row_sum is 0 (no visible key: acc is 0), and the 8-wide statistics (smax / ssum, strides
 * ms / ss; NULL: none) are the row's max and sum, or -FLT_MAX / FLT_MAX without a visible key (RunKernel.forward's
 * rules, the same floats: one fp32 product and quotient each); the accumulator is then a per-thread block and `acc` is
 * not written. *non_finite is set where some accumulator value is not finite (the caller reruns with scaled values,
 * docs/semantics/softmax-stats.md). */
struct forward_io {
    const void *q;
    int64_t q_dtype, qs[3];
    float scale;
    int64_t heads_kv, group, head_rows;
    void *out;
    int64_t out_dtype, os[3];
    float keep_prob;
    float *smax, *ssum;
    int64_t ms[3], ss[3];
    int32_t *non_finite;
};

/* The address offset (elements) of grouped row r of entry e in a [count, N1, head_rows, ..] tensor with strides st. */
static int64_t io_row(const struct forward_io *io, const int64_t *st, int64_t e, int64_t r) {
    const int64_t head = (e % io->heads_kv) * io->group + r / io->head_rows;
    return (e / io->heads_kv) * st[0] + head * st[1] + (r % io->head_rows) * st[2];
}

/* dst[0..n) = (float)src[0..n) * scale (src of dtype 0 fp32, 1 fp16, 2 bf16: converted exactly, then one product),
 * 16 lanes at a time; scaled_row is the AVX2 loop (the same operations on each element). */
__attribute__((target("avx512f"))) static int64_t scaled_row16(const void *src, int64_t dtype, int64_t n, float scale,
                                                                float *dst) {
    const __m512 sc = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + j));
        const __m512 x = dtype == 0   ? _mm512_loadu_ps((const float *)src + j)
                         : dtype == 1 ? _mm512_cvtph_ps(h)
                                      : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm512_storeu_ps(dst + j, _mm512_mul_ps(x, sc));
    }
    return j;
}

__attribute__((target("avx2,fma,f16c"))) static void scaled_row(const void *src, int64_t dtype, int64_t n,
                                                                 float scale, float *dst) {
    int64_t j = use_avx512 ? scaled_row16(src, dtype, n, scale, dst) : 0;
    for (; j < n; ++j) {
        float x;
        if (dtype == 0) {
            x = ((const float *)src)[j];
        } else if (dtype == 1) {
            x = _cvtsh_ss(((const uint16_t *)src)[j]);
        } else {
            const uint32_t bits = (uint32_t)((const uint16_t *)src)[j] << 16;
            memcpy(&x, &bits, sizeof x);
        }
        dst[j] = x * scale;
    }
}

/* The n query rows of a row block (grouped rows r0.. of entry e) scaled into qb [n, dk]. */
static void io_query_rows(const struct forward_io *io, int64_t e, int64_t r0, int64_t n, int64_t dk, float *qb) {
    const int64_t size = io->q_dtype == 0 ? 4 : 2;
    for (int64_t i = 0; i < n; ++i)
        scaled_row((const char *)io->q + size * io_row(io, io->qs, e, r0 + i), io->q_dtype, dk, io->scale,
                   qb + i * dk);
}

/* dst[0..n) = x / denom rounded to fp16 (the fp32 quotient rounded to nearest even, as PyTorch's division into an fp16
 * output rounds its fp32 result). */
__attribute__((target("avx2,fma,f16c"))) static void quotient_row_f16(const float *x, int64_t n, float denom,
                                                                       uint16_t *dst) {
    const __m256 dv = _mm256_set1_ps(denom);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(_mm256_div_ps(_mm256_loadu_ps(x + j), dv),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; j < n; ++j)
        dst[j] = _cvtss_sh(x[j] / denom, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* The finished rows of a row block (io->out): outputs, statistics, and the non-finite check of its accumulator. */
static void io_finish_rows(const struct forward_io *io, int64_t e, int64_t r0, int64_t n, int64_t dv, const float *m,
                           const float *l, const float *o) {
    int non_finite = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int valid = l[i] != 0.0f;
        const float denom = valid ? l[i] * io->keep_prob : 1.0f;
        const float *oi = o + i * dv;
        for (int64_t d = 0; d < dv; ++d)
            non_finite |= !isfinite(oi[d]);
        if (io->out_dtype == 0) {
            float *dst = (float *)io->out + io_row(io, io->os, e, r0 + i);
            for (int64_t d = 0; d < dv; ++d)
                dst[d] = oi[d] / denom;
        } else {
            quotient_row_f16(oi, dv, denom, (uint16_t *)io->out + io_row(io, io->os, e, r0 + i));
        }
        if (io->smax) {
            float *mx = io->smax + io_row(io, io->ms, e, r0 + i), *sm = io->ssum + io_row(io, io->ss, e, r0 + i);
            for (int j = 0; j < 8; ++j) {
                mx[j] = valid ? m[i] : -FLT_MAX;
                sm[j] = valid ? l[i] : FLT_MAX;
            }
        }
    }
    if (non_finite) {
#pragma omp atomic write
        *io->non_finite = 1;
    }
}

/* For `entries` GEMM batch entries (a kv head with its group's query rows), each with `rows` query rows q [E, rows,
 * dk] (contiguous, scaled), keys k (entry stride ske, row stride ldk) and values v (sve, ldv): run the online
 * softmax over the key tiles [tj0[t], tj1[t]) in order, each with an optional additive tile bias[t] (row-major, tile
 * width columns; 0: none): row r of entry e reads row r % bias_rows of the block at bias[t] + e * bias_stride (a mask
 * shared by every entry and head: bias_rows = rows of one head, stride 0; a pse tile: bias_rows = rows, stride =
 * rows * width). Updates row_max / row_sum [E, rows] (fa_softmax_step's conventions) and the unnormalised acc [E,
 * rows, dv], which are first reset (max -inf, sum 0, acc 0) when `init` is set. With dropout (a single tile), `keep` is
 * the bit-packed keep mask and keep_first [E, rows] the bit of each row's column tj0[0] (keep_row): dropped terms
 * count in the row sum but not in acc.
 * Work items are (entry, block of `block_rows` rows); each walks the key tiles in `sub_cols`-wide pieces so that its
 * score block stays in L2, and where a piece's bias hides columns from every row of a 64-row sub-block, that
 * sub-block skips them (live_blocks). With `al` (NULL: none), the rows' generated ALiBi is added to the scores before
 * the mask, and blocks of ALIBI_SUB_ROWS rows whose terms in a piece all flush to 0 skip it (alibi_reaches, against
 * the running maxima: the caller orders the tiles nearest the diagonal first). No result depends on the thread
 * count. */
void fa_forward_blocks(const float *q, int64_t entries, int64_t rows, int64_t dk, const float *k, int64_t ske,
                       int64_t ldk, const float *v, int64_t sve, int64_t ldv, int64_t dv, int64_t n_tiles,
                       const int64_t *tj0, const int64_t *tj1, const int64_t *bias, int64_t bias_rows,
                       int64_t bias_stride, const uint8_t *keep, const int64_t *keep_first, int64_t block_rows,
                       int64_t sub_cols, int64_t init, float log2e, float floor2, const struct bf16_scores *bf,
                       const struct alibi_rows *al, const struct forward_io *io, float *row_max_out,
                       float *row_sum_out, float *acc) {
    const int64_t blocks = (rows + block_rows - 1) / block_rows;
    const uint16_t *q16 = bf ? bf->q : NULL;
    const int64_t d16 = q16 ? bf->d16 : dk;
    /* The fp32 query rows are read only without bf16 scores, or for their feature columns. */
    const int own_q = io && io->q && (!q16 || dk > d16), own_o = io && io->out;
    /* fp32 scores of whole row blocks from key pieces packed once per call (pack_rows_t) where the call has
     * PACK_MIN_BLOCKS row blocks to share them: the entries go in groups whose packed pieces fit FORWARD_PACK_BYTES,
     * each group's pieces packed before its row blocks run. Every row still meets its pieces in the same order. */
    int64_t pieces = 0, group = entries, slot = 0;
    float *pk = NULL;
    if (!q16 && blas_compute && block_rows >= PACK_MIN_ROWS && rows / block_rows >= PACK_MIN_BLOCKS) {
        int64_t wide = 0, masked = 0;
        for (int64_t t = 0; t < n_tiles; ++t) {
            pieces += (tj1[t] - tj0[t] + sub_cols - 1) / sub_cols;
            wide += (tj1[t] - tj0[t]) / FORWARD_PACK_MIN_COLS;
            masked |= bias[t] != 0;
        }
        if (wide && !masked) {
            /* a piece packed for the BLAS or, where the ordered loop serves its shape, for ordered_nt */
            slot = piece_slot_floats(sub_cols, block_rows, dk);
            group = FORWARD_PACK_BYTES / (int64_t)sizeof(float) / (pieces * slot > 0 ? pieces * slot : 1);
            group = group < 1 ? 1 : group < entries ? group : entries;
            pk = pieces * slot > 0 ? aligned_alloc(64, sizeof(float) * group * pieces * slot) : NULL;
            group = pk ? group : entries;
        }
    }
#pragma omp parallel
    {
        float *s = aligned_alloc(64, sizeof(float) * round8(block_rows) * round8(sub_cols));
        uint32_t *packed = q16 ? malloc(sizeof(uint32_t) * packed_words(sub_cols, d16)) : NULL;
        float *features = q16 && dk > d16 ? malloc(sizeof(float) * (dk - d16) * sub_cols) : NULL;
        float *q_block = own_q ? aligned_alloc(64, sizeof(float) * round8(block_rows * dk)) : NULL;
        float *o_block = own_o ? aligned_alloc(64, sizeof(float) * round8(block_rows * dv)) : NULL;
        int64_t ranges[2 * MAX_SUB_BLOCKS];
        for (int64_t g0 = 0; g0 < entries; g0 += group) {
            const int64_t g1 = entries - g0 < group ? entries : g0 + group;
            if (pk) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t ep = g0 * pieces; ep < g1 * pieces; ++ep) {
                    const int64_t e = ep / pieces;
                    int64_t p = ep % pieces, t = 0, c0;
                    for (; p >= (tj1[t] - tj0[t] + sub_cols - 1) / sub_cols; ++t)
                        p -= (tj1[t] - tj0[t] + sub_cols - 1) / sub_cols;
                    c0 = tj0[t] + p * sub_cols;
                    const int64_t w = tj1[t] - c0 < sub_cols ? tj1[t] - c0 : sub_cols;
                    if (w >= FORWARD_PACK_MIN_COLS)
                        pack_piece_for(w, block_rows, dk, k + e * ske + c0 * ldk, ldk,
                                       pk + (ep - g0 * pieces) * slot);
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = g0 * blocks; item < g1 * blocks; ++item) {
                const int64_t e = item / blocks, r0 = (item % blocks) * block_rows;
                const float *pe = pk ? pk + (e - g0) * pieces * slot : NULL;
                const int64_t n = rows - r0 < block_rows ? rows - r0 : block_rows;
                const float *qe = q + (e * rows + r0) * dk;
                float *m = row_max_out + e * rows + r0, *l = row_sum_out + e * rows + r0;
                float *o = own_o ? o_block : acc + (e * rows + r0) * dv;
                if (own_q) {
                    io_query_rows(io, e, r0, n, dk, q_block);
                    qe = q_block;
                }
                if (init) {
                    for (int64_t i = 0; i < n; ++i) {
                        m[i] = -INFINITY;
                        l[i] = 0.0f;
                    }
                    memset(o, 0, sizeof(float) * n * dv);
                }
                for (int64_t t = 0; t < n_tiles; ++t) {
                    const float *bt = bias[t] ? (const float *)(intptr_t)bias[t] + e * bias_stride : NULL;
                    const int64_t tile_w = tj1[t] - tj0[t];
                    for (int64_t c0 = tj0[t]; c0 < tj1[t]; c0 += sub_cols, pe = pe ? pe + slot : NULL) {
                        const int64_t w = tj1[t] - c0 < sub_cols ? tj1[t] - c0 : sub_cols, col = c0 - tj0[t];
                        const int64_t step = live_blocks(bt, r0, n, bias_rows, tile_w, col, w, ranges);
                        if (q16)
                            pack_piece(bf->k + e * bf->ske + c0 * bf->ldk, bf->ldk, w, d16, packed);
                        for (int64_t s0 = 0, b = 0; s0 < n; s0 += step, ++b) {
                            const int64_t lo = ranges[2 * b], hi = ranges[2 * b + 1];
                            if (lo >= hi)
                                continue; /* every term 0: the row state would not change */
                            const int64_t end = s0 + (n - s0 < step ? n - s0 : step), row0 = e * rows + r0;
                            /* Runs of rows whose ALiBi terms may reach these columns; the others' terms are all 0. */
                            for (int64_t a0 = s0; a0 < end;) {
                                const int64_t a1 = alibi_live_run(al, e, row0, &a0, end, c0 + lo, hi - lo, m, log2e,
                                                                  floor2);
                                if (a0 >= end)
                                    break;
                                /* the packed pieces serve whole blocks of whole pieces only (their n, m and columns) */
                                const int whole = pe && w >= FORWARD_PACK_MIN_COLS && lo == 0 && hi == w &&
                                                  a1 - a0 == block_rows;
                                if (whole) {
#pragma omp atomic
                                    forward_packed_gemms += 1;
                                }
                                forward_piece(qe + a0 * dk, a1 - a0, dk, k + e * ske + (c0 + lo) * ldk, ldk,
                                              v + e * sve + (c0 + lo) * ldv, ldv, dv, hi - lo, bt, r0 + a0, bias_rows,
                                              tile_w, col + lo, keep, keep ? keep_first + e * rows + r0 + a0 : NULL,
                                              col + lo, log2e, floor2, q16 ? q16 + (e * rows + r0 + a0) * d16 : NULL,
                                              d16, packed, w, lo, q16 ? bf->scale : 0.0f, features, al, row0 + a0,
                                              c0 + lo, whole ? pe : NULL,
                                              whole ? whole_piece_kc(block_rows, w, dk, ldk) : 0, s, m + a0, l + a0,
                                              o + a0 * dv);
                                a0 = a1;
                            }
                        }
                    }
                }
                if (own_o)
                    io_finish_rows(io, e, r0, n, dv, m, l, o);
            }
        }
        free(o_block);
        free(q_block);
        free(features);
        free(packed);
        free(s);
    }
    free(pk);
}
