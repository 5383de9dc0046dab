/* What the fused dense loops add to a score tile or apply to it: mask bias rows, generated ALiBi (with the test
 * that skips blocks whose every term flushes to 0), dropout keep bits, and the live columns of a masked piece.
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

/* Adds a bias tile's rows to the score block s [n, w] (lds): row i reads bias row (r0 + i) % bias_rows, columns
 * from `col` of a tile `tile_w` wide. A -inf bias (a masked element) sets -inf rather than adding it: a masked
 * element is excluded whatever its logit, and NaN + -inf would let a NaN key reach rows that cannot see it (the
 * compare and blend cost next to nothing beside the add). */
static void add_mask_rows(float *s, int64_t n, int64_t w, int64_t lds, const float *bias, int64_t r0,
                          int64_t bias_rows, int64_t tile_w, int64_t col) {
    for (int64_t i = 0; i < n; ++i) {
        const float *bi = bias + ((r0 + i) % bias_rows) * tile_w + col;
        float *si = s + i * lds;
        const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= w; j += 8) {
            const __m256 b = _mm256_loadu_ps(bi + j);
            const __m256 sum = _mm256_add_ps(_mm256_loadu_ps(si + j), b);
            _mm256_storeu_ps(si + j, _mm256_blendv_ps(sum, minus_inf, _mm256_cmp_ps(b, minus_inf, _CMP_EQ_OQ)));
        }
        for (; j < w; ++j)
            si[j] = bi[j] == -INFINITY ? -INFINITY : si[j] + bi[j];
    }
}

/* Generated ALiBi (pse_type 2 / 3, docs/semantics/pse.md) for the rows of a fused call, indexed over all its entries' rows:
 * row r's bias at key column j is -slope[r] * f(|j - pos[r]|), f the identity (type 2) or sqrt (type 3), where pos[r]
 * is the row's query index plus q_start - kv_start. Positions and distances are integers, exact in fp32 below 2^24,
 * so the bias is the one rounding of f(d) * -slope, as the PyTorch path forms it. With q_norm (|scale| |q_r| per
 * row; NULL: no skipping) and k_norm (|k_j| per key column, entry stride sk_norm), alibi_reaches skips the blocks of
 * a piece whose every term provably flushes to exactly 0. */
struct alibi_rows {
    const float *slope, *pos, *q_norm, *k_norm;
    int64_t sqrt_dist, sk_norm;
    float slack;
};

/* Rows whose ALiBi skipping is decided together: a skipped block costs no GEMM, reaching ones are merged into one. */
#define ALIBI_SUB_ROWS 32

/* s[i, j] += the ALiBi bias of row i (slope[i], pos[i]) at key column j0 + j, for the n x w score block s (lds). */
static void add_alibi_rows(float *s, int64_t n, int64_t w, int64_t lds, const float *slope, const float *pos,
                           int64_t sqrt_dist, int64_t j0) {
    const __m256 iota = _mm256_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n; ++i) {
        float *si = s + i * lds;
        const float neg = -slope[i];
        const __m256 neg_slope = _mm256_set1_ps(neg);
        int64_t j = 0;
        for (; j + 8 <= w; j += 8) {
            __m256 d = _mm256_andnot_ps(sign, _mm256_add_ps(_mm256_set1_ps((float)(j0 + j) - pos[i]), iota));
            if (sqrt_dist)
                d = _mm256_sqrt_ps(d);
            _mm256_storeu_ps(si + j, _mm256_add_ps(_mm256_loadu_ps(si + j), _mm256_mul_ps(d, neg_slope)));
        }
        for (; j < w; ++j) {
            const float d = fabsf((float)(j0 + j) - pos[i]);
            si[j] += (sqrt_dist ? sqrtf(d) : d) * neg;
        }
    }
}

/* Whether a term of rows [r, r + n) (indices over all entries' rows; shift: those rows' maxima) at key columns
 * [c0, c0 + w) of entry e may survive the flush to 0: s <= |scale| |q| max|k| + the largest bias over the columns
 * (at the nearest or the farthest distance: -slope f(|d|) is monotone in |d|), with a margin for the fp32 rounding
 * of the GEMM and of the bias (2^-12 relative, plus `slack`), is tested against (s - shift) log2e <= floor2. A NaN
 * norm, slope or shift counts as reaching. */
static int alibi_reaches(const struct alibi_rows *a, int64_t e, int64_t r, int64_t n, int64_t c0, int64_t w,
                         const float *shift, float log2e, float floor2) {
    if (!a->q_norm)
        return 1;
    const float *kn = a->k_norm + e * a->sk_norm + c0;
    float k_max = 0.0f;
    for (int64_t j = 0; j < w; ++j) {
        if (kn[j] != kn[j])
            return 1;
        k_max = kn[j] > k_max ? kn[j] : k_max;
    }
    const float margin = 1.0f / 4096.0f;
    for (int64_t i = 0; i < n; ++i) {
        const float p = a->pos[r + i], neg = -a->slope[r + i];
        const float lo = (float)c0 - p, hi = (float)(c0 + w - 1) - p;
        float nearest = lo > 0.0f ? lo : hi < 0.0f ? -hi : 0.0f;
        float farthest = fabsf(lo) > fabsf(hi) ? fabsf(lo) : fabsf(hi);
        if (a->sqrt_dist) {
            nearest = sqrtf(nearest);
            farthest = sqrtf(farthest);
        }
        const float b_near = nearest * neg, b_far = farthest * neg;
        const float qk = a->q_norm[r + i] * k_max;
        const float bound = qk * (1.0f + margin) + (b_near > b_far ? b_near : b_far)
                            + margin * (fabsf(b_near) > fabsf(b_far) ? fabsf(b_near) : fabsf(b_far)) + a->slack;
        if (!((bound - shift[i]) * log2e <= floor2))
            return 1;
    }
    return 0;
}

/* Rows times key columns skipped by alibi_reaches since the last read (tests check that a case exercises it). */
static int64_t alibi_skipped_terms = 0;

int64_t cann_attn_alibi_skipped_terms(void) { return take_count(&alibi_skipped_terms); }

/* The next run of rows in [*a0, end) (row indices from row0; shift: those rows' maxima) whose ALiBi blocks of
 * ALIBI_SUB_ROWS rows may reach the key columns [c0, c0 + w) of entry e: *a0 moves past the blocks that do not (every
 * term there flushes to 0), and the run's end is returned (*a0 == end: none left). Without ALiBi skipping the run is
 * the whole range. */
static int64_t alibi_live_run(const struct alibi_rows *a, int64_t e, int64_t row0, int64_t *a0, int64_t end,
                              int64_t c0, int64_t w, const float *shift, float log2e, float floor2) {
    if (!a || !a->q_norm)
        return end;
    int64_t b = *a0;
    for (int live = 0; b < end;) {
        const int64_t n = end - b < ALIBI_SUB_ROWS ? end - b : ALIBI_SUB_ROWS;
        if (alibi_reaches(a, e, row0 + b, n, c0, w, shift + b, log2e, floor2)) {
            live = 1;
        } else if (live) {
            break;
        } else {
#pragma omp atomic
            alibi_skipped_terms += n * w;
            *a0 = b + n;
        }
        b += n;
    }
    return b;
}

/* s[0..w) *= factor where keep bit `first` + j of the bit-packed mask is set (bit b: bit b % 8 of byte b / 8, LSB
 * first), else 0: the dropout of one row. */
static void keep_row(float *s, const uint8_t *bits, int64_t first, int64_t w, float factor) {
    for (int64_t j = 0; j < w; ++j) {
        const int64_t b = first + j;
        s[j] = (bits[b >> 3] >> (b & 7)) & 1 ? s[j] * factor : 0.0f;
    }
}

/* Rows per sub-block where a piece's bias can hide columns, at most MAX_SUB_BLOCKS sub-blocks per row block: each
 * sub-block then computes only the columns some row of it can see, so a causal or band diagonal tile skips most of
 * its hidden part instead of multiplying it by zero. */
#define MASKED_SUB_ROWS 64
#define MAX_SUB_BLOCKS 16

/* The first j < a with b[j] not -inf (a where there is none), 8 entries per compare: live_columns' scans took 4% of
 * a band forward (B=1 N=8 S=2048, pre = next = 256, fp32, one thread) one entry at a time. */
static int64_t first_live(const float *b, int64_t a) {
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= a; j += 8) {
        const int live = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(b + j), minus_inf, _CMP_NEQ_UQ));
        if (live)
            return j + __builtin_ctz((unsigned)live);
    }
    while (j < a && b[j] == -INFINITY)
        ++j;
    return j;
}

/* One past the last j in [lo, w) with b[j] not -inf (lo where there is none). */
static int64_t last_live(const float *b, int64_t lo, int64_t w) {
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    int64_t g = w;
    for (; g - 8 >= lo; g -= 8) {
        const int live = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(b + g - 8), minus_inf, _CMP_NEQ_UQ));
        if (live)
            return g - 8 + 32 - __builtin_clz((unsigned)live);
    }
    while (g > lo && b[g - 1] == -INFINITY)
        --g;
    return g;
}

/* [*lo, *hi): the columns of a piece (w columns from column `col` of a bias tile `tile_w` wide) that some row of the
 * block [r0, r0 + n) can see; outside it every row's bias is -inf, so every term there is exactly 0 (and its logit is
 * never formed). Rounded out to multiples of 8 from the piece's start: the 8-lane row sums then add the same nonzero
 * terms in the same lanes as over the whole piece. lo >= hi: no row sees any column. */
static void live_columns(const float *bias, int64_t r0, int64_t n, int64_t bias_rows, int64_t tile_w, int64_t col,
                         int64_t w, int64_t *lo, int64_t *hi) {
    int64_t a = w, b = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float *bi = bias + ((r0 + i) % bias_rows) * tile_w + col;
        a = first_live(bi, a);
        b = last_live(bi, b, w);
    }
    *lo = a / 8 * 8;
    *hi = round8(b) < w ? round8(b) : w;
}

/* How a row block [r0, r0 + n) goes through one piece: returns the sub-block height and writes each sub-block's live
 * columns to ranges[2 b], ranges[2 b + 1] (live_columns). Without a bias, or where every sub-block sees the whole
 * piece, it is one sub-block of n rows over [0, w), so that unmasked tiles keep their full-height GEMMs. */
static int64_t live_blocks(const float *bias, int64_t r0, int64_t n, int64_t bias_rows, int64_t tile_w, int64_t col,
                           int64_t w, int64_t *ranges) {
    ranges[0] = 0;
    ranges[1] = w;
    if (!bias)
        return n;
    int64_t step = MASKED_SUB_ROWS;
    if ((n + step - 1) / step > MAX_SUB_BLOCKS)
        step = (n + MAX_SUB_BLOCKS - 1) / MAX_SUB_BLOCKS;
    int whole = 1;
    for (int64_t s0 = 0, b = 0; s0 < n; s0 += step, ++b) {
        live_columns(bias, r0 + s0, n - s0 < step ? n - s0 : step, bias_rows, tile_w, col, w, ranges + 2 * b,
                     ranges + 2 * b + 1);
        whole = whole && ranges[2 * b] == 0 && ranges[2 * b + 1] == w;
    }
    if (!whole)
        return step;
    ranges[0] = 0;
    ranges[1] = w;
    return n;
}
