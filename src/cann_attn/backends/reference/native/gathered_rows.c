/* Gathered products over selected key rows, the core of the DSA and KL loops: row_dots (a row's heads against the
 * rows it selected; AVX-512 register blocks of 16 / 8 heads x 3 keys), row_combine (weighted sums of selected rows),
 * scatter_columns (dK / dV accumulation into selected rows, columns split over threads) and the plain exported
 * rows_dot / rows_combine / rows_scatter that DSA's PyTorch formulation calls.
 *
 * Why: at block size 1 DSA selects scattered tokens, so every query row reads its own K rows; in PyTorch that takes
 * a gather (a copy of [rows, K, D] through memory) and batched GEMMs whose M is the head count. Here the products
 * read the selected rows in place, and they stay in cache between the products that read them.
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

/* The valid entries of one row, in order: their tokens into `out`; returns their count. */
static int64_t compact_row(const int64_t *tok, const uint8_t *valid, int64_t w, int64_t *out) {
    if (!valid) {
        memcpy(out, tok, sizeof(int64_t) * w);
        return w;
    }
    int64_t n = 0;
    for (int64_t j = 0; j < w; ++j)
        if (valid[j]) out[n++] = tok[j];
    return n;
}

/* One step of row_dots: 4 head rows against 3 key rows, columns [d, d + 8) loaded by LOAD. */
#define DOT_STEP(LOAD)                                                                                               \
    do {                                                                                                             \
        const __m256 x0 = LOAD(b0 + d), x1 = LOAD(b1 + d), x2 = LOAD(b2 + d);                                        \
        FMA_ROW(0, LOAD(a0 + d));                                                                                    \
        FMA_ROW(1, LOAD(a1 + d));                                                                                    \
        FMA_ROW(2, LOAD(a2 + d));                                                                                    \
        FMA_ROW(3, LOAD(a3 + d));                                                                                    \
    } while (0)

/* row_dots16 fetches the key rows of the block of 3 keys PREFETCH_BLOCKS ahead into L2 (a block takes ~1 us at DSA
 * shapes, ample for an L3 or DRAM miss); the loads then find them in L2. Measured (DSA forward, block size 1, one
 * thread, native loops alone): T1 one block ahead 187 ms, two blocks 189 ms, four 195 ms; T0 (into L1) one block
 * ahead 201 ms, two 205 ms, three 209 ms; the earlier burst of T0 prefetches two blocks ahead 241 ms. */
#define PREFETCH_BLOCKS 1
#define PREFETCH_HINT _MM_HINT_T1

/* The queries of row_dots16: head blocks of 8, 8 columns at a time, lanes 0-7 of a vector head 2i's columns [d, d + 8)
 * and lanes 8-15 head 2i + 1's, zero past dim: packed[((hb * steps + t) * 4 + i) * 16 + lane], steps = ceil(dim / 8). */
__attribute__((target("avx512f"))) static void pack_heads16(const float *a, int64_t blocks, int64_t dim, float *packed) {
    const int64_t steps = (dim + 7) / 8, full = dim / 8 * 8;
    const __m256i tail = lane_mask(dim - full);
    for (int64_t hb = 0; hb < blocks; ++hb)
        for (int64_t h = 0; h < 8; ++h) {
            const float *ah = a + (hb * 8 + h) * dim;
            float *ph = packed + hb * steps * 64 + (h / 2) * 16 + (h % 2) * 8;
            for (int64_t t = 0; t < steps; ++t)
                _mm256_store_ps(ph + t * 64, 8 * t < full ? _mm256_loadu_ps(ah + 8 * t) : LOAD_TAIL(ah + 8 * t));
        }
}

/* Floats of pack_heads16's buffer for `heads` heads of `dim` columns. */
static int64_t packed_floats16(int64_t heads, int64_t dim) { return heads / 8 * ((dim + 7) / 8) * 64; }

/* Fetch line d / 16 of the three future key rows (every other step: one line covers 16 columns). */
#define PREFETCH_KEYS(d)                                                                                             \
    do {                                                                                                             \
        if (((d) & 8) == 0) {                                                                                        \
            _mm_prefetch(f0 + 4 * (d), PREFETCH_HINT);                                                               \
            _mm_prefetch(f1 + 4 * (d), PREFETCH_HINT);                                                               \
            _mm_prefetch(f2 + 4 * (d), PREFETCH_HINT);                                                               \
        }                                                                                                            \
    } while (0)

/* Packed query vector Q (qa or qc + 16 * I) times the 3 keys into row i of the sums. The empty asm keeps the loaded
 * vector in a register: otherwise GCC folds the load into each of the 3 FMAs, and 3 loads per 3 FMAs made the loop
 * load-bound (2 512-bit loads per cycle). */
#define DOT_ROW(i, Q, I)                                                                                             \
    do {                                                                                                             \
        __m512 y = _mm512_load_ps((Q) + 16 * (I));                                                                   \
        __asm__("" : "+v"(y));                                                                                       \
        FMA_ROW16(i, y);                                                                                             \
    } while (0)

/* The 3 keys' columns [d, d + 8), loaded by LOAD, in both halves. */
#define DOT_KEYS(LOAD)                                                                                               \
    const __m512 x0 = both_halves(LOAD(b0 + d)), x1 = both_halves(LOAD(b1 + d)), x2 = both_halves(LOAD(b2 + d))
/* The 4 vectors (8 heads) of packed block Q into rows I0..I0 + 3 of the sums. */
#define DOT_BLOCK(I0, I1, I2, I3, Q)                                                                                 \
    DOT_ROW(I0, Q, 0);                                                                                               \
    DOT_ROW(I1, Q, 1);                                                                                               \
    DOT_ROW(I2, Q, 2);                                                                                               \
    DOT_ROW(I3, Q, 3)
/* Steps of 16 heads (two packed blocks, qa and qc) against 3 keys: 24 sums; of 8 heads (qa): 12 sums. */
#define DOT16_STEP(LOAD)                                                                                             \
    do {                                                                                                             \
        DOT_KEYS(LOAD);                                                                                              \
        DOT_BLOCK(0, 1, 2, 3, qa);                                                                                   \
        DOT_BLOCK(4, 5, 6, 7, qc);                                                                                   \
    } while (0)
#define DOT8_STEP(LOAD)                                                                                              \
    do {                                                                                                             \
        DOT_KEYS(LOAD);                                                                                              \
        DOT_BLOCK(0, 1, 2, 3, qa);                                                                                   \
    } while (0)
/* A register block's column loop: STEP every 8 columns (the first head block also fetching the keys ahead), NEXT
 * moving the packed queries on, then the last 1..7 columns masked. */
#define DOT_COLUMNS(STEP, NEXT)                                                                                      \
    do {                                                                                                             \
        int64_t d = 0;                                                                                               \
        if (hb == 0)                                                                                                 \
            for (; d < full; d += 8, NEXT) {                                                                         \
                PREFETCH_KEYS(d);                                                                                    \
                STEP(LOAD_FULL);                                                                                     \
            }                                                                                                        \
        else                                                                                                         \
            for (; d < full; d += 8, NEXT)                                                                           \
                STEP(LOAD_FULL);                                                                                     \
        if (d < dim)                                                                                                 \
            STEP(LOAD_TAIL);                                                                                         \
    } while (0)

/* Sums c<i>0..c<i>2 of packed vector i (heads h and h + 1) into s, keys j0..j0 + nj. */
#define STORE_PAIR(i, h)                                                                                             \
    do {                                                                                                             \
        const __m512 pair[3] = {c##i##0, c##i##1, c##i##2};                                                          \
        for (int64_t j = 0; j < nj; ++j) {                                                                           \
            s[(h) * ts + j0 + j] = hsum(_mm512_castps512_ps256(pair[j]));                                            \
            s[((h) + 1) * ts + j0 + j] = hsum(high_half(pair[j]));                                                   \
        }                                                                                                            \
    } while (0)
/* Rows I0..I0 + 3 of the sums (heads h..h + 7) into s. */
#define STORE_BLOCK(I0, I1, I2, I3, h)                                                                               \
    do {                                                                                                             \
        STORE_PAIR(I0, h);                                                                                           \
        STORE_PAIR(I1, (h) + 2);                                                                                     \
        STORE_PAIR(I2, (h) + 4);                                                                                     \
        STORE_PAIR(I3, (h) + 6);                                                                                     \
    } while (0)

/* row_dots for the first heads / 8 * 8 heads (returns how many it took), from their queries packed by pack_heads16
 * (`packed`; NULL: packed here). Lanes 0-7 of a vector carry head 2i's columns [d, d + 8), lanes 8-15 head 2i + 1's,
 * against the key's 8 columns in both halves: each half is the AVX2 loop's 8-lane sum of its head and key, formed by
 * the same FMAs in the same order and reduced by the same hsum, so the same floats. Register blocks of 16 heads x 3
 * keys (24 sums; each key row is read once) while 16 heads remain, then 8 heads x 3 keys. */
__attribute__((target("avx512f"))) static int64_t row_dots16(const float *a, int64_t heads, int64_t dim,
                                                              const float *b, int64_t ldb, const int64_t *tok,
                                                              int64_t n, float *s, int64_t ts, const float *packed) {
    const int64_t blocks = heads / 8, steps = (dim + 7) / 8;
    if (blocks == 0 || n == 0)
        return 0;
    float *own = NULL;
    if (!packed) {
        own = aligned_alloc(64, sizeof(float) * packed_floats16(heads, dim));
        pack_heads16(a, blocks, dim, own);
        packed = own;
    }
    const int64_t full = dim / 8 * 8;
    const __m256i tail = lane_mask(dim - full);
    for (int64_t j0 = 0; j0 < n; j0 += 3) {
        const int64_t nj = n - j0 < 3 ? n - j0 : 3;
        const float *b0 = b + tok[j0] * ldb;
        const float *b1 = nj > 1 ? b + tok[j0 + 1] * ldb : b0;
        const float *b2 = nj > 2 ? b + tok[j0 + 2] * ldb : b0;
        /* The key rows PREFETCH_BLOCKS blocks ahead, one line of each every other step of the first head block:
         * issued in one burst they stalled the loop (~1/4 of its time) waiting for line fill buffers. */
        const int64_t jf = j0 + 3 * PREFETCH_BLOCKS;
        const char *f0 = (const char *)(b + tok[jf < n ? jf : n - 1] * ldb);
        const char *f1 = (const char *)(b + tok[jf + 1 < n ? jf + 1 : n - 1] * ldb);
        const char *f2 = (const char *)(b + tok[jf + 2 < n ? jf + 2 : n - 1] * ldb);
        int64_t hb = 0;
        for (; hb + 2 <= blocks; hb += 2) {
            const float *qa = packed + hb * steps * 64, *qc = qa + steps * 64;
            ZERO_BLOCK16;
            __m512 c40 = c00, c41 = c00, c42 = c00, c50 = c00, c51 = c00, c52 = c00;
            __m512 c60 = c00, c61 = c00, c62 = c00, c70 = c00, c71 = c00, c72 = c00;
            DOT_COLUMNS(DOT16_STEP, (qa += 64, qc += 64));
            STORE_BLOCK(0, 1, 2, 3, hb * 8);
            STORE_BLOCK(4, 5, 6, 7, hb * 8 + 8);
        }
        if (hb < blocks) {
            const float *qa = packed + hb * steps * 64;
            ZERO_BLOCK16;
            DOT_COLUMNS(DOT8_STEP, qa += 64);
            STORE_BLOCK(0, 1, 2, 3, hb * 8);
        }
    }
    free(own);
    return blocks * 8;
}

/* s[h * ts + j] = a[h] . b[tok[j]] over d < dim, for h < heads, j < n. Blocks of 4 heads x 3 keys keep 12 sums in
 * registers (named: arrays of vectors measured 2x slower); the 3 key rows are reused from L1 by every head block. */
static void row_dots(const float *a, int64_t heads, int64_t dim, const float *b, int64_t ldb, const int64_t *tok,
                     int64_t n, float *s, int64_t ts, const float *packed) {
    const int64_t first = use_avx512 ? row_dots16(a, heads, dim, b, ldb, tok, n, s, ts, packed) : 0;
    if (first == heads)
        return;
    const int64_t full = dim / 8 * 8;
    const __m256i tail = lane_mask(dim - full);
    for (int64_t j0 = 0; j0 < n; j0 += 3) {
        const int64_t nj = n - j0 < 3 ? n - j0 : 3;
        const float *b0 = b + tok[j0] * ldb;
        const float *b1 = nj > 1 ? b + tok[j0 + 1] * ldb : b0;
        const float *b2 = nj > 2 ? b + tok[j0 + 2] * ldb : b0;
        /* The key rows two blocks ahead are scattered in memory: start fetching them now. */
        for (int64_t j = j0 + 6; j < j0 + 9 && j < n; ++j)
            for (int64_t d = 0; d < dim; d += 16)
                _mm_prefetch((const char *)(b + tok[j] * ldb + d), _MM_HINT_T0);
        for (int64_t h0 = first; h0 < heads; h0 += 4) {
            const int64_t nh = heads - h0 < 4 ? heads - h0 : 4;
            BLOCK_ROWS(a, a + h0 * dim, dim);
            ZERO_BLOCK;
            int64_t d = 0;
            for (; d < full; d += 8)
                DOT_STEP(LOAD_FULL);
            if (d < dim)
                DOT_STEP(LOAD_TAIL);
            const float sums[4][3] = {{hsum(c00), hsum(c01), hsum(c02)}, {hsum(c10), hsum(c11), hsum(c12)},
                                      {hsum(c20), hsum(c21), hsum(c22)}, {hsum(c30), hsum(c31), hsum(c32)}};
            for (int64_t i = 0; i < nh; ++i)
                for (int64_t j = 0; j < nj; ++j)
                    s[(h0 + i) * ts + j0 + j] = sums[i][j];
        }
    }
}

/* One step of row_combine48: entry j's weights for 4 heads times 3 vectors of its row, loaded by LOAD(p, v). */
#define COMBINE48_STEP(LOAD)                                                                                         \
    do {                                                                                                             \
        const float *bj = b + tok[j] * ldb + d;                                                                      \
        const __m512 x0 = LOAD(bj, 0), x1 = LOAD(bj, 1), x2 = LOAD(bj, 2);                                           \
        FMA_ROW16(0, _mm512_set1_ps(w0[j]));                                                                         \
        FMA_ROW16(1, _mm512_set1_ps(w1[j]));                                                                         \
        FMA_ROW16(2, _mm512_set1_ps(w2[j]));                                                                         \
        FMA_ROW16(3, _mm512_set1_ps(w3[j]));                                                                         \
    } while (0)
#define LOAD16(p, v) _mm512_loadu_ps((p) + 16 * (v))
#define LOAD16_PART(p, v) _mm512_maskz_loadu_ps(lanes[v], (p) + 16 * (v))

/* The lane masks of a 48-column block's 3 vectors with `cols` (1..48) live columns. */
static inline void block_lanes48(int64_t cols, __mmask16 lanes[3]) {
    for (int64_t v = 0; v < 3; ++v) {
        const int64_t live = cols - 16 * v;
        lanes[v] = live >= 16 ? 0xFFFF : live <= 0 ? 0 : (__mmask16)((1u << live) - 1);
    }
}

/* Heads h0..h0 + nh - 1 of a 48-column block's sums into their output rows (out: the block's first column of head 0,
 * row stride dim): scale times the sums, plus keep[h] times what the row held when `keep` is given. */
__attribute__((target("avx512f"))) static inline void store_block48(const __m512 sums[4][3], __m512 scale,
                                                                     const float *keep, int64_t h0, int64_t nh,
                                                                     float *out, int64_t dim, const __mmask16 lanes[3]) {
    for (int64_t i = 0; i < nh; ++i) {
        float *oi = out + (h0 + i) * dim;
        for (int64_t v = 0; v < 3; ++v) {
            __m512 x = _mm512_mul_ps(sums[i][v], scale);
            if (keep)
                x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes[v], oi + 16 * v), _mm512_set1_ps(keep[h0 + i]), x);
            _mm512_mask_storeu_ps(oi + 16 * v, lanes[v], x);
        }
    }
}

/* row_combine in AVX-512 steps, 4 heads x 3 vectors (48 columns) at a time, the last block of 1..47 columns with
 * masked loads and stores (the AVX2 loop's 24- and 8-column blocks took ~1/5 of the forward's sums for the last 32 of
 * DSA's 512 columns). Each output column is the same chain of FMAs over j as in row_combine's blocks (the lanes are
 * independent), so the results are its bits. */
/* The block loops of row_combine48 and its twins: per 48-column block and block of 4 heads, the 12 sums zeroed, the
 * entries' steps (the arguments: FMA_ROW16s over j, with d, cols and w0..w3 in scope), then the sums stored
 * (store_block48, with `scale`, `keep` and `out` in scope). */
#define COMBINE48_BLOCKS(...)                                                                                        \
    for (int64_t d = 0; d < dim; d += 48) {                                                                          \
        const int64_t cols = dim - d < 48 ? dim - d : 48;                                                            \
        __mmask16 lanes[3];                                                                                          \
        block_lanes48(cols, lanes);                                                                                  \
        for (int64_t h0 = 0; h0 < heads; h0 += 4) {                                                                  \
            const int64_t nh = heads - h0 < 4 ? heads - h0 : 4;                                                      \
            BLOCK_ROWS(w, w + h0 * ts, ts);                                                                          \
            ZERO_BLOCK16;                                                                                            \
            __VA_ARGS__                                                                                              \
            const __m512 sums[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};          \
            store_block48(sums, scale, keep, h0, nh, out + d, dim, lanes);                                           \
        }                                                                                                            \
    }

__attribute__((target("avx512f"))) static void row_combine48(const float *w, int64_t ts, int64_t heads, int64_t n,
                                                              const float *b, int64_t ldb, const int64_t *tok,
                                                              int64_t dim, float alpha, const float *keep, float *out) {
    const __m512 scale = _mm512_set1_ps(alpha);
    COMBINE48_BLOCKS(
        if (cols == 48)
            for (int64_t j = 0; j < n; ++j)
                COMBINE48_STEP(LOAD16);
        else
            for (int64_t j = 0; j < n; ++j)
                COMBINE48_STEP(LOAD16_PART);
    )
}

/* One step of row_combine: entry j's weights for 4 heads times columns [d, d + 24) of its row, loaded by LOAD
 * (LOAD_PART covers a last block of 1..24 columns). */
#define COMBINE_STEP(LOAD)                                                                                           \
    do {                                                                                                             \
        const float *bj = b + tok[j] * ldb + d;                                                                      \
        const __m256 x0 = LOAD(bj, 0), x1 = LOAD(bj, 1), x2 = LOAD(bj, 2);                                           \
        FMA_ROW(0, _mm256_broadcast_ss(w0 + j));                                                                     \
        FMA_ROW(1, _mm256_broadcast_ss(w1 + j));                                                                     \
        FMA_ROW(2, _mm256_broadcast_ss(w2 + j));                                                                     \
        FMA_ROW(3, _mm256_broadcast_ss(w3 + j));                                                                     \
    } while (0)
#define LOAD_BLOCK(p, v) _mm256_loadu_ps((p) + 8 * (v))
#define LOAD_PART(p, v) (8 * (v) < cols ? load_part((p) + 8 * (v), cols - 8 * (v), tail) : _mm256_setzero_ps())

/* out[h * dim + d] = alpha * sum_j w[h * ts + j] * b[tok[j]][d] over j < n, plus keep[h] * out[h * dim + d] when
 * `keep` is given (the rescaled sum of earlier key chunks). Blocks of 4 heads x 24 columns; the
 * column block is the outer loop so the 4 head blocks re-read the same n x 24 slice of the selected rows from L2. */
static void row_combine(const float *w, int64_t ts, int64_t heads, int64_t n, const float *b, int64_t ldb,
                        const int64_t *tok, int64_t dim, float alpha, const float *keep, float *out) {
    if (use_avx512) {
        row_combine48(w, ts, heads, n, b, ldb, tok, dim, alpha, keep, out);
        return;
    }
    const __m256 scale = _mm256_set1_ps(alpha);
    for (int64_t d = 0; d < dim; d += 24) {
        const int64_t cols = dim - d < 24 ? dim - d : 24;
        const int64_t nv = (cols + 7) / 8;
        const __m256i tail = lane_mask(cols - (nv - 1) * 8);
        for (int64_t h0 = 0; h0 < heads; h0 += 4) {
            const int64_t nh = heads - h0 < 4 ? heads - h0 : 4;
            BLOCK_ROWS(w, w + h0 * ts, ts);
            ZERO_BLOCK;
            if (cols == 24)
                for (int64_t j = 0; j < n; ++j)
                    COMBINE_STEP(LOAD_BLOCK);
            else
                for (int64_t j = 0; j < n; ++j)
                    COMBINE_STEP(LOAD_PART);
            const __m256 sums[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
            for (int64_t i = 0; i < nh; ++i) {
                float *oi = out + (h0 + i) * dim + d;
                for (int64_t v = 0; v < nv; ++v) {
                    __m256 x = _mm256_mul_ps(sums[i][v], scale);
                    if (keep)
                        x = _mm256_fmadd_ps(load_part(oi + 8 * v, cols - 8 * v, tail), _mm256_set1_ps(keep[h0 + i]), x);
                    store_part(oi + 8 * v, x, cols - 8 * v, tail);
                }
            }
        }
    }
}

/* c[sel[r, j]][d0:d1] += sum_h wt[r, h, j] * a[r, h][d0:d1] for rows r < rows, entries j < count[r] (count NULL:
 * all w), in row then
 * entry order (duplicated tokens add up). Blocks of 3 entries x 32 columns keep 12 sums in registers; each block is
 * added to its rows one entry after the other, so two equal tokens in a block both land. Threads take disjoint
 * column ranges, so no two write the same element and no sum depends on the thread count. */
static void scatter_columns(const float *wt, const float *a, int64_t heads, int64_t dim, int64_t w, const int64_t *count,
                 const int64_t *sel, int64_t rows, float *c, int64_t ldc, int64_t d0, int64_t d1) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *wr = wt + r * heads * w, *ar = a + r * heads * dim;
        const int64_t *rsel = sel + r * w, n = count ? count[r] : w;
        for (int64_t j0 = 0; j0 < n; j0 += 3) {
            const int64_t nj = n - j0 < 3 ? n - j0 : 3;
            /* The next block's target rows are scattered: start fetching them now. */
            for (int64_t j = j0 + 3; j < j0 + 6 && j < n; ++j)
                for (int64_t d = d0; d < d1; d += 16)
                    _mm_prefetch((const char *)(c + rsel[j] * ldc + d), _MM_HINT_T0);
            for (int64_t d = d0; d < d1; d += 32) {
                const int64_t cols = d1 - d < 32 ? d1 - d : 32;
                const int64_t nv = (cols + 7) / 8;
                const __m256i tail = lane_mask(cols - (nv - 1) * 8);
                if (nj == 3 && cols == 32) {
                    /* The full block with named registers: the generic loop's runtime bounds keep acc in memory. */
                    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00;
                    __m256 c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00;
                    for (int64_t h = 0; h < heads; ++h) {
                        const float *ah = ar + h * dim + d, *wh = wr + h * w + j0;
                        const __m256 x0 = _mm256_loadu_ps(ah), x1 = _mm256_loadu_ps(ah + 8);
                        const __m256 x2 = _mm256_loadu_ps(ah + 16), x3 = _mm256_loadu_ps(ah + 24);
                        __m256 y = _mm256_broadcast_ss(wh);
                        c00 = _mm256_fmadd_ps(y, x0, c00); c01 = _mm256_fmadd_ps(y, x1, c01);
                        c02 = _mm256_fmadd_ps(y, x2, c02); c03 = _mm256_fmadd_ps(y, x3, c03);
                        y = _mm256_broadcast_ss(wh + 1);
                        c10 = _mm256_fmadd_ps(y, x0, c10); c11 = _mm256_fmadd_ps(y, x1, c11);
                        c12 = _mm256_fmadd_ps(y, x2, c12); c13 = _mm256_fmadd_ps(y, x3, c13);
                        y = _mm256_broadcast_ss(wh + 2);
                        c20 = _mm256_fmadd_ps(y, x0, c20); c21 = _mm256_fmadd_ps(y, x1, c21);
                        c22 = _mm256_fmadd_ps(y, x2, c22); c23 = _mm256_fmadd_ps(y, x3, c23);
                    }
                    const __m256 rows3[3][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}};
                    for (int i = 0; i < 3; ++i) {
                        float *ci = c + rsel[j0 + i] * ldc + d;
                        for (int v = 0; v < 4; ++v)
                            _mm256_storeu_ps(ci + 8 * v, _mm256_add_ps(_mm256_loadu_ps(ci + 8 * v), rows3[i][v]));
                    }
                    continue;
                }
                __m256 acc[3][4];
                for (int i = 0; i < 3; ++i)
                    acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm256_setzero_ps();
                for (int64_t h = 0; h < heads; ++h) {
                    const float *ah = ar + h * dim + d, *wh = wr + h * w + j0;
                    __m256 x[4];
                    for (int64_t v = 0; v < nv; ++v)
                        x[v] = v == nv - 1 ? load_part(ah + 8 * v, cols - 8 * v, tail) : _mm256_loadu_ps(ah + 8 * v);
                    for (int64_t i = 0; i < nj; ++i) {
                        __m256 y = _mm256_broadcast_ss(wh + i);
                        for (int64_t v = 0; v < nv; ++v)
                            acc[i][v] = _mm256_fmadd_ps(y, x[v], acc[i][v]);
                    }
                }
                for (int64_t i = 0; i < nj; ++i) {
                    float *ci = c + rsel[j0 + i] * ldc + d;
                    for (int64_t v = 0; v < nv; ++v) {
                        const int64_t m = cols - 8 * v;
                        store_part(ci + 8 * v, _mm256_add_ps(load_part(ci + 8 * v, m, tail), acc[i][v]), m, tail);
                    }
                }
            }
        }
    }
}

/* Plain gathered products over every entry of every row (the caller masks invalid entries, whose tokens it clamps
 * to a real row): out [R, H, W] = a[r, h] . b[tok[r, j]]; out [R, H, D] = alpha * sum_j wt[r, h, j] b[tok[r, j]];
 * c[tok[r, j]] += sum_h wt[r, h, j] a[r, h] (columns split over threads, rows and entries in order). */
void rows_dot(const float *a, int64_t heads, int64_t dim, const float *b, int64_t ldb, const int64_t *tok, int64_t w,
              int64_t rows, float *out) {
#pragma omp parallel
    {
        int64_t lo, hi;
        part_range(rows, omp_get_num_threads(), omp_get_thread_num(), 1, &lo, &hi);
        for (int64_t r = lo; r < hi; ++r)
            row_dots(a + r * heads * dim, heads, dim, b, ldb, tok + r * w, w, out + r * heads * w, w, NULL);
    }
}

void rows_combine(const float *wt, int64_t heads, int64_t w, const float *b, int64_t ldb, const int64_t *tok,
                  int64_t dim, int64_t rows, float alpha, float *out) {
#pragma omp parallel
    {
        int64_t lo, hi;
        part_range(rows, omp_get_num_threads(), omp_get_thread_num(), 1, &lo, &hi);
        for (int64_t r = lo; r < hi; ++r)
            row_combine(wt + r * heads * w, w, heads, w, b, ldb, tok + r * w, dim, alpha, NULL, out + r * heads * dim);
    }
}

void rows_scatter(const float *wt, const float *a, int64_t heads, int64_t dim, int64_t w, const int64_t *tok,
                  int64_t rows, float *c, int64_t ldc) {
#pragma omp parallel
    {
        int64_t lo, hi;
        part_range(dim, omp_get_num_threads(), omp_get_thread_num(), 8, &lo, &hi);
        if (hi > lo)
            scatter_columns(wt, a, heads, dim, w, NULL, tok, rows, c, ldc, lo, hi);
    }
}
