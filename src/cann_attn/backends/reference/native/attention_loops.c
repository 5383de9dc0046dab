/* Fused attention loops for the CPU reference backend (AVX2 + FMA, fp32): gathered (DSA) attention rows, and the
 * dense forward's online-softmax step (one pass over a score row instead of six PyTorch passes over the tile).
 *
 * Why this exists: DSA attention at block size 1 selects scattered tokens, so every query row reads its own K rows.
 * In PyTorch that takes a gather (a copy of [rows, K, D] through memory) and batched GEMMs whose M is the head count
 * (16): both far from the machine's GEMM rate. Here each row's scores, softmax numerators and weighted values are
 * formed straight from the K/V rows it selected, which stay in cache between the products that read them.
 *
 * Semantics stay in Python: which entries are valid (docs/operators/sparse_flash_attention.md, docs/operators/lightning_indexer.md), the statistics' conventions and the final
 * normalisation. These loops only compute sums over the entries they are told are valid, in a fixed order: the
 * result does not depend on the number of threads (rows and column ranges are independent).
 *
 * Layouts: every per-row tensor is contiguous, row r at r * (H * D); K and V rows have a row stride (ldk, ldv) and
 * unit column stride. Entries: tok [R, W] int64 token positions, valid [R, W] bytes (NULL: all valid).
 */
#include <float.h>
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int cann_attn_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

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

/* One step of row_dots: 4 head rows against 3 key rows, columns [d, d + 8) loaded by LOAD. */
#define DOT_STEP(LOAD)                                                                                               \
    do {                                                                                                             \
        const __m256 x0 = LOAD(b0 + d), x1 = LOAD(b1 + d), x2 = LOAD(b2 + d);                                        \
        FMA_ROW(0, LOAD(a0 + d));                                                                                    \
        FMA_ROW(1, LOAD(a1 + d));                                                                                    \
        FMA_ROW(2, LOAD(a2 + d));                                                                                    \
        FMA_ROW(3, LOAD(a3 + d));                                                                                    \
    } while (0)
#define FMA_ROW16(i, y)                                                                                              \
    do {                                                                                                             \
        c##i##0 = _mm512_fmadd_ps(y, x0, c##i##0);                                                                   \
        c##i##1 = _mm512_fmadd_ps(y, x1, c##i##1);                                                                   \
        c##i##2 = _mm512_fmadd_ps(y, x2, c##i##2);                                                                   \
    } while (0)
#define LOAD_FULL(p) _mm256_loadu_ps(p)
#define LOAD_TAIL(p) _mm256_maskload_ps((p), tail)

static int use_avx512; /* set by cann_attn_set_avx512, below */

/* row_dots16 fetches the key rows of the block of 3 keys PREFETCH_BLOCKS ahead into L2 (a block takes ~1 us at DSA
 * shapes, ample for an L3 or DRAM miss); the loads then find them in L2. Measured (DSA forward, block size 1, one
 * thread, native loops alone): T1 one block ahead 187 ms, two blocks 189 ms, four 195 ms; T0 (into L1) one block
 * ahead 201 ms, two 205 ms, three 209 ms; the earlier burst of T0 prefetches two blocks ahead 241 ms. */
#define PREFETCH_BLOCKS 1
#define PREFETCH_HINT _MM_HINT_T1

/* The high 8 lanes of v. */
__attribute__((target("avx512f"))) static inline __m256 high_half(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* 8 lanes broadcast to both halves. */
__attribute__((target("avx512f"))) static inline __m512 both_halves(__m256 x) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(x)));
}

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

/* ---- AVX-512 steps, bit for bit the AVX2 loops' results ----
 * Where the CPU has AVX-512F, the gathered dot products (row_dots), the weighted sums (row_combine) and the
 * exponential pass (row_exp) take 16-lane steps that run, lane by lane, the same correctly rounded operations in the
 * same order as the AVX2 loops, so every result is the same float (tests/test_native_kernels.py compares them
 * bitwise); only the speed differs. (The dot products keep 8-column sums: two heads share a vector, one per half,
 * rather than 16 columns of one head, which would change the order of the additions.) CANN_ATTN_NATIVE_AVX512=0
 * (read at load) keeps the AVX2 loops. */
static int use_avx512 = 0;
static int use_avx512dq = 0; /* with use_avx512: AVX-512DQ's VREDUCEPS too (row_exp_max) */

int cann_attn_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* 1 (where supported) or 0: whether the loops take their AVX-512 steps; returns the setting now in force. */
int cann_attn_set_avx512(int on) {
    use_avx512 = on && cann_attn_has_avx512();
    use_avx512dq = use_avx512 && __builtin_cpu_supports("avx512dq");
    return use_avx512;
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

/* row_combine in AVX-512 steps, 4 heads x 3 vectors (48 columns) at a time, the last block of 1..47 columns with
 * masked loads and stores (the AVX2 loop's 24- and 8-column blocks took ~1/5 of the forward's sums for the last 32 of
 * DSA's 512 columns). Each output column is the same chain of FMAs over j as in row_combine's blocks (the lanes are
 * independent), so the results are its bits. */
__attribute__((target("avx512f"))) static void row_combine48(const float *w, int64_t ts, int64_t heads, int64_t n,
                                                              const float *b, int64_t ldb, const int64_t *tok,
                                                              int64_t dim, float alpha, const float *keep, float *out) {
    const __m512 scale = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < dim; d += 48) {
        const int64_t cols = dim - d < 48 ? dim - d : 48;
        __mmask16 lanes[3];
        for (int64_t v = 0; v < 3; ++v) {
            const int64_t live = cols - 16 * v;
            lanes[v] = live >= 16 ? 0xFFFF : live <= 0 ? 0 : (__mmask16)((1u << live) - 1);
        }
        for (int64_t h0 = 0; h0 < heads; h0 += 4) {
            const int64_t nh = heads - h0 < 4 ? heads - h0 : 4;
            BLOCK_ROWS(w, w + h0 * ts, ts);
            ZERO_BLOCK16;
            if (cols == 48)
                for (int64_t j = 0; j < n; ++j)
                    COMBINE48_STEP(LOAD16);
            else
                for (int64_t j = 0; j < n; ++j)
                    COMBINE48_STEP(LOAD16_PART);
            const __m512 sums[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
            for (int64_t i = 0; i < nh; ++i) {
                float *oi = out + (h0 + i) * dim + d;
                for (int64_t v = 0; v < 3; ++v) {
                    __m512 x = _mm512_mul_ps(sums[i][v], scale);
                    if (keep)
                        x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes[v], oi + 16 * v), _mm512_set1_ps(keep[h0 + i]),
                                            x);
                    _mm512_mask_storeu_ps(oi + 16 * v, lanes[v], x);
                }
            }
        }
    }
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

/* Keys per chunk of the forward: a chunk's K rows (which hold V's columns when V is K's first columns) stay in L2
 * between the dot products and the weighted sum that read them; a whole row's 512 keys would come from L3 twice. */
#define KEY_CHUNK 128

static inline float max_nan(float a, float b) { return isnan(a) || isnan(b) ? NAN : (a > b ? a : b); }

/* Forward, rows [r0, r1): o [R, H, Dv] = sum_j 2^((s_j - m) log2e) V_j (unnormalised), m [R, H] the largest logit
 * (-inf for a row without valid entries, NaN propagated), l [R, H] the sum of the exponentials. q carries the
 * softmax scale. Keys go in chunks with the running maximum (online softmax): earlier chunks' sums are rescaled by
 * 2^((m_old - m_new) log2e) when the maximum grows, which changes only their rounding. */
/* The forward's queries as the caller holds them: row r, head h is scale * (q[r * q_row + h * q_head + [0, dq)] ++
 * qr[r * r_row + h * r_head + [0, dr)]) (qr NULL: dr = 0). Each row is assembled here, products rounded once as
 * PyTorch's multiply by the scale rounds them, instead of a scaled [R, H, Dqk] copy written and read back. */
struct query_rows {
    const float *q, *qr;
    int64_t q_row, q_head, dq, r_row, r_head, dr;
    float scale;
};

static void query_row(const struct query_rows *qs, int64_t r, int64_t heads, float *a) {
    const int64_t dqk = qs->dq + qs->dr;
    for (int64_t h = 0; h < heads; ++h) {
        const float *qh = qs->q + r * qs->q_row + h * qs->q_head;
        float *ah = a + h * dqk;
        for (int64_t d = 0; d < qs->dq; ++d)
            ah[d] = qh[d] * qs->scale;
        if (qs->qr) {
            const float *rh = qs->qr + r * qs->r_row + h * qs->r_head;
            for (int64_t d = 0; d < qs->dr; ++d)
                ah[qs->dq + d] = rh[d] * qs->scale;
        }
    }
}

static void forward_range(const struct query_rows *qs, int64_t heads, int64_t dqk, const float *k, int64_t ldk,
                          const float *v, int64_t ldv, int64_t dv, const int64_t *tok, const uint8_t *valid, int64_t w,
                          int64_t r0, int64_t r1, float log2e, float floor2, float *o, float *m, float *l) {
    const int64_t ts = round8(KEY_CHUNK);
    float *s = malloc(sizeof(float) * heads * ts);
    float *q = malloc(sizeof(float) * heads * dqk); /* this row's scaled queries */
    float *keep = malloc(sizeof(float) * heads);
    int64_t *sel = malloc(sizeof(int64_t) * (w > 0 ? w : 1));
    /* The row's queries packed once for its key chunks' dot products (NULL: row_dots16 does not run). */
    float *packed = use_avx512 && heads >= 8 ? aligned_alloc(64, sizeof(float) * packed_floats16(heads, dqk)) : NULL;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t n = compact_row(tok + r * w, valid ? valid + r * w : NULL, w, sel);
        float *mr = m + r * heads, *lr = l + r * heads, *orow = o + r * heads * dv;
        if (n > 0)
            query_row(qs, r, heads, q);
        if (packed && n > 0)
            pack_heads16(q, heads / 8, dqk, packed);
        for (int64_t h = 0; h < heads; ++h) {
            mr[h] = -INFINITY;
            lr[h] = 0.0f;
        }
        if (n == 0)
            memset(orow, 0, sizeof(float) * heads * dv);
        for (int64_t c0 = 0; c0 < n; c0 += KEY_CHUNK) {
            const int64_t nc = n - c0 < KEY_CHUNK ? n - c0 : KEY_CHUNK;
            row_dots(q, heads, dqk, k, ldk, sel + c0, nc, s, ts, packed);
            for (int64_t h = 0; h < heads; ++h) {
                const float m_new = max_nan(mr[h], row_max(s + h * ts, nc));
                const float shift = m_new == -INFINITY ? 0.0f : m_new;
                /* The first chunk has nothing to rescale (and -inf - -inf would be NaN). */
                keep[h] = c0 == 0 ? 0.0f : exp2f((mr[h] - shift) * log2e);
                /* fmaf: one rounding, whatever the compiler inlines (GCC contracted the plain expression while row_exp
                 * was inlined here, and stopped when 69171f6 restructured row_exp, moving the sums by an ulp). */
                lr[h] = fmaf(lr[h], keep[h], row_exp(s + h * ts, nc, shift, log2e, floor2, 1.0f));
                mr[h] = m_new;
            }
            row_combine(s, ts, heads, nc, v, ldv, sel + c0, dv, 1.0f, c0 == 0 ? NULL : keep, orow);
        }
    }
    free(packed);
    free(q);
    free(sel);
    free(keep);
    free(s);
}

/* Backward, rows [r0, r1). P = 2^((s - shift) log2e) * inv_l, dP = dO . V, dS = P (dP - dsum) over each row's valid
 * entries; dq [R, H, Dqk] = scale * dS K. The valid entries are left for sfa_scatter: count [R], sel [R, W] (their
 * tokens), p_out / ds_out [R, H, W] (entry j of row r, head h at (r * H + h) * W + j). q carries the scale. */
static void backward_range(const float *q, const float *dout, const float *dsum, const float *shift, const float *inv_l,
                       int64_t heads, int64_t dqk, int64_t dv, const float *k, int64_t ldk, const float *v,
                       int64_t ldv, const int64_t *tok, const uint8_t *valid, int64_t w, int64_t r0, int64_t r1,
                       float log2e, float floor2, float scale, float *dq, int64_t *count, int64_t *sel,
                       float *p_out, float *ds_out) {
    const int64_t ts = round8(KEY_CHUNK);
    float *dp = malloc(sizeof(float) * heads * ts);
    float *ones = malloc(sizeof(float) * heads);
    for (int64_t h = 0; h < heads; ++h)
        ones[h] = 1.0f;
    for (int64_t r = r0; r < r1; ++r) {
        int64_t *rsel = sel + r * w;
        const int64_t n = compact_row(tok + r * w, valid ? valid + r * w : NULL, w, rsel);
        count[r] = n;
        float *p = p_out + r * heads * w, *ds = ds_out + r * heads * w, *dqr = dq + r * heads * dqk;
        if (n == 0)
            memset(dqr, 0, sizeof(float) * heads * dqk);
        /* Key chunks, as in the forward: a chunk's K rows stay in L2 for the three products that read them. */
        for (int64_t c0 = 0; c0 < n; c0 += KEY_CHUNK) {
            const int64_t nc = n - c0 < KEY_CHUNK ? n - c0 : KEY_CHUNK;
            row_dots(q + r * heads * dqk, heads, dqk, k, ldk, rsel + c0, nc, p + c0, w, NULL);
            row_dots(dout + r * heads * dv, heads, dv, v, ldv, rsel + c0, nc, dp, ts, NULL);
            for (int64_t h = 0; h < heads; ++h) {
                float *ph = p + h * w + c0, *dph = dp + h * ts, *dsh = ds + h * w + c0;
                row_exp(ph, nc, shift[r * heads + h], log2e, floor2, inv_l[r * heads + h]);
                const float d0 = dsum[r * heads + h];
                for (int64_t j = 0; j < nc; ++j)
                    dsh[j] = ph[j] * (dph[j] - d0);
            }
            row_combine(ds + c0, w, heads, nc, k, ldk, rsel + c0, dqk, scale, c0 == 0 ? NULL : ones, dqr);
        }
    }
    free(ones);
    free(dp);
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

/* KL target, rows [r0, r1): p [R, W] = inv_heads * sum_h 2^(q_h . K_j - shift_h) (flushed at floor2) for valid
 * entries, exactly 0 for the others. q carries scale * log2e and shift = (max + ln sum) * log2e per head [R, H]. */
static void kl_target_range(const float *q, int64_t heads, int64_t dqk, const float *k, int64_t ldk, const int64_t *tok,
                    const uint8_t *valid, int64_t w, const float *shift, int64_t r0, int64_t r1, float floor2,
                    float inv_heads, float *p) {
    const int64_t ts = round8(w);
    float *s = malloc(sizeof(float) * heads * ts);
    int64_t *sel = malloc(sizeof(int64_t) * (w > 0 ? w : 1));
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *vr = valid ? valid + r * w : NULL;
        const int64_t n = compact_row(tok + r * w, vr, w, sel);
        row_dots(q + r * heads * dqk, heads, dqk, k, ldk, sel, n, s, ts, NULL);
        float *pr = p + r * w;
        memset(pr, 0, sizeof(float) * w);
        for (int64_t h = 0; h < heads; ++h)
            row_exp(s + h * ts, n, shift[r * heads + h], 1.0f, floor2, 1.0f);
        /* Head sums in a fixed order, then spread back to the entries' positions. */
        for (int64_t j = 0, e = 0; j < w; ++j) {
            if (vr && !vr[j])
                continue;
            float total = 0.0f;
            for (int64_t h = 0; h < heads; ++h)
                total += s[h * ts + e];
            pr[j] = total * inv_heads;
            ++e;
        }
    }
    free(sel);
    free(s);
}

/* Exported entry points. Each splits its rows (or, for the scatter, the columns of dK and dV) into one contiguous
 * range per OpenMP thread. The library links the libgomp that PyTorch has loaded, so these regions reuse PyTorch's
 * threads rather than competing with them (Python threads did: PyTorch's idle OpenMP workers spin between ops). */

/* [0, n) split into `parts` ranges whose inner bounds are multiples of `align`: range `i`. */
static void part_range(int64_t n, int64_t parts, int64_t i, int64_t align, int64_t *lo, int64_t *hi) {
    *lo = i == 0 ? 0 : (n * i / parts) / align * align;
    *hi = i == parts - 1 ? n : (n * (i + 1) / parts) / align * align;
}

/* The forward over rows [r0, r1); the queries as struct query_rows describes them. */
void sfa_forward_rows(const float *q, int64_t q_row, int64_t q_head, int64_t dq, const float *qr, int64_t r_row,
                      int64_t r_head, int64_t dr, float scale, int64_t heads, const float *k, int64_t ldk,
                      const float *v, int64_t ldv, int64_t dv, const int64_t *tok, const uint8_t *valid, int64_t w,
                      int64_t r0, int64_t r1, float log2e, float floor2, float *o, float *m, float *l) {
    const struct query_rows qs = {q, qr, q_row, q_head, dq, r_row, r_head, qr ? dr : 0, scale};
#pragma omp parallel
    {
        int64_t lo, hi;
        part_range(r1 - r0, omp_get_num_threads(), omp_get_thread_num(), 1, &lo, &hi);
        if (hi > lo)
            forward_range(&qs, heads, dq + qs.dr, k, ldk, v, ldv, dv, tok, valid, w, r0 + lo, r0 + hi, log2e, floor2, o,
                          m, l);
    }
}

void sfa_backward_rows(const float *q, const float *dout, const float *dsum, const float *shift, const float *inv_l,
                       int64_t heads, int64_t dqk, int64_t dv, const float *k, int64_t ldk, const float *v,
                       int64_t ldv, const int64_t *tok, const uint8_t *valid, int64_t w, int64_t r0, int64_t r1,
                       float log2e, float floor2, float scale, float *dq, int64_t *count, int64_t *sel,
                       float *p_out, float *ds_out) {
#pragma omp parallel
    {
        int64_t lo, hi;
        part_range(r1 - r0, omp_get_num_threads(), omp_get_thread_num(), 1, &lo, &hi);
        if (hi > lo)
            backward_range(q, dout, dsum, shift, inv_l, heads, dqk, dv, k, ldk, v, ldv, tok, valid, w, r0 + lo, r0 + hi,
                           log2e, floor2, scale, dq, count, sel, p_out, ds_out);
    }
}

/* dK += dS^T Q and dV += P^T dO over the entries left by sfa_backward_rows (see scatter_columns). */
void sfa_scatter(const float *ds, const float *q, int64_t dqk, float *dk, int64_t lddk, const float *p,
                 const float *dout, int64_t dv, float *dvt, int64_t lddv, int64_t heads, int64_t w,
                 const int64_t *count, const int64_t *sel, int64_t rows) {
#pragma omp parallel
    {
        const int64_t parts = omp_get_num_threads(), i = omp_get_thread_num();
        int64_t lo, hi;
        part_range(dqk, parts, i, 8, &lo, &hi);
        if (hi > lo)
            scatter_columns(ds, q, heads, dqk, w, count, sel, rows, dk, lddk, lo, hi);
        part_range(dv, parts, i, 8, &lo, &hi);
        if (hi > lo)
            scatter_columns(p, dout, heads, dv, w, count, sel, rows, dvt, lddv, lo, hi);
    }
}

void kl_target_rows(const float *q, int64_t heads, int64_t dqk, const float *k, int64_t ldk, const int64_t *tok,
                    const uint8_t *valid, int64_t w, const float *shift, int64_t r0, int64_t r1, float floor2,
                    float inv_heads, float *p) {
#pragma omp parallel
    {
        int64_t lo, hi;
        part_range(r1 - r0, omp_get_num_threads(), omp_get_thread_num(), 1, &lo, &hi);
        if (hi > lo)
            kl_target_range(q, heads, dqk, k, ldk, tok, valid, w, shift, r0 + lo, r0 + hi, floor2, inv_heads, p);
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

/* out[i] = exp2_flushed(x[i]): the loops' exponential on its own, for tests against softmax_exp.exp2_flushed_. */
void cann_attn_exp2_flushed(const float *x, float *out, int64_t n, float floor2) {
    const __m256 fl = _mm256_set1_ps(floor2);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i mask = lane_mask(n - i);
        store_part(out + i, exp2_flushed(load_part(x + i, n - i, mask), fl), n - i, mask);
    }
}

/* Dense flash-attention forward, one online-softmax step over a score tile (docs/semantics/softmax-stats.md statistics), in place:
 * for each of `rows` rows of s (row stride lds, `cols` logits), m_new = max(row_max, max(s)) with NaN propagated,
 * shift = m_new (0 while the row has seen only -inf), s <- 2^((s - shift) log2e) flushed at floor2,
 * correction = e^(row_max - shift), row_sum <- row_sum * correction + sum(s), row_max <- m_new. One pass per row:
 * the row is still in L1 when its exponentials are taken. */
void fa_softmax_step(float *s, int64_t rows, int64_t cols, int64_t lds, float *row_max_io, float *row_sum_io,
                     float *correction, float log2e, float floor2) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        float *si = s + i * lds;
        const float m_old = row_max_io[i];
        const float m_new = max_nan(m_old, row_max(si, cols));
        const float shift = m_new == -INFINITY ? 0.0f : m_new;
        const float total = row_exp(si, cols, shift, log2e, floor2, 1.0f);
        const float corr = expf(m_old - shift);
        correction[i] = corr;
        row_sum_io[i] = row_sum_io[i] * corr + total;
        row_max_io[i] = m_new;
    }
}

/* Dense backward, probabilities from the forward's statistics in place: s <- 2^((s - shift) log2e) * factor per row
 * (shift = softmax_max, factor = 1 / softmax_sum), flushed at floor2, in one pass per row. */
void fa_exp_rows(float *s, int64_t rows, int64_t cols, const float *shift, const float *factor, float log2e,
                 float floor2) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i)
        row_exp(s + i * cols, cols, shift[i], log2e, floor2, factor[i]);
}

/* Dense backward, dS = P (dP - D) in place in dp, per row i of `rows` with D = d_sum[i] (one pass instead of two). */
void fa_ds_rows(float *dp, const float *p, int64_t rows, int64_t cols, const float *d_sum) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        float *di = dp + i * cols;
        const float *pi = p + i * cols;
        const __m256 dv = _mm256_set1_ps(d_sum[i]);
        int64_t j = 0;
        for (; j + 8 <= cols; j += 8)
            _mm256_storeu_ps(di + j, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(di + j), dv), _mm256_loadu_ps(pi + j)));
        for (; j < cols; ++j)
            di[j] = (di[j] - d_sum[i]) * pi[j];
    }
}

/* ---- Dense forward, fused per row block: S = Q K^T, online softmax, O += P V ----
 * The GEMMs are the BLAS sgemm PyTorch links (MKL on x86 builds), found by the Python loader and set here; inside
 * the parallel region each call runs on its thread alone. Splitting whole row blocks over threads, rather than
 * each GEMM's work, is what makes the difference: on a 2-core EPYC one thread's sgemm at these shapes runs
 * ~80 GFLOP/s against ~125-130 for both threads together on torch.bmm of the same tiles. */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *, const int *);
static sgemm_fn blas_sgemm = NULL;

void cann_attn_set_sgemm(void *fn) { blas_sgemm = (sgemm_fn)fn; }

int cann_attn_has_sgemm(void) { return blas_sgemm != NULL; }

/* MKL's packed-operand GEMM (sgemm_pack_get_size, sgemm_pack, sgemm_compute), where the BLAS has it: the fused
 * backward packs a key (value) piece once for all the row blocks whose S (dP) it gives, where sgemm re-packed it
 * for each block (~1/5 of those GEMMs' time at B=1 N=8 S=2048 D=128). All three or none are set. */
typedef size_t (*sgemm_pack_size_fn)(const char *, const int *, const int *, const int *);
typedef void (*sgemm_pack_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                              const float *, const int *, float *);
typedef void (*sgemm_compute_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                                 const int *, const float *, const int *, const float *, float *, const int *);
static sgemm_pack_size_fn blas_pack_size = NULL;
static sgemm_pack_fn blas_pack = NULL;
static sgemm_compute_fn blas_compute = NULL;

void cann_attn_set_sgemm_pack(void *size, void *pack, void *compute) {
    const int all = size && pack && compute;
    blas_pack_size = all ? (sgemm_pack_size_fn)size : NULL;
    blas_pack = all ? (sgemm_pack_fn)pack : NULL;
    blas_compute = all ? (sgemm_compute_fn)compute : NULL;
}

int cann_attn_has_sgemm_pack(void) { return blas_compute != NULL; }

/* MKL's C-interface MKL_Set_Num_Threads_Local where the BLAS is MKL, else NULL. Every BLAS call below runs with
 * this thread's MKL thread count at 1 (the previous count restored after it), whatever the OpenMP team size.
 * The bits of MKL's sgemm depend on how many threads it may use, even inside our parallel region where it runs on
 * one: on its AVX2 code path (AVX2-only CPUs, or MKL_ENABLE_INSTRUCTIONS=AVX2 / MKL_CBWR=AVX2) S = Q K^T of a
 * 64-row block, 100 keys, d 130 (or 64 x 64 x 32) came out different with 2 threads allowed than with 1, which made
 * the fused loops' results depend on torch.set_num_threads. The pair of calls costs ~20 ns (measured), against
 * microseconds for a GEMM here. */
typedef int (*blas_threads_fn)(int);
static blas_threads_fn blas_threads_local = NULL;

void cann_attn_set_blas_threads(void *fn) { blas_threads_local = (blas_threads_fn)fn; }

#define ON_ONE_THREAD(call)                                                                                        \
    do {                                                                                                           \
        const int previous_ = blas_threads_local ? blas_threads_local(1) : 0;                                      \
        call;                                                                                                      \
        if (blas_threads_local)                                                                                    \
            blas_threads_local(previous_);                                                                         \
    } while (0)

/* Row-major C[m, n] (ldc) = A[m, kk] (lda) B[n, kk]^T (ldb) + beta C: column-major C^T = B A^T. */
static void gemm_nt(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                    int ldc) {
    const float one = 1.0f;
    ON_ONE_THREAD(blas_sgemm("T", "N", &n, &m, &kk, &one, b, &ldb, a, &lda, &beta, c, &ldc));
}

/* Row-major C[m, n] (ldc) = A[m, kk] (lda) B[kk, n] (ldb) + beta C: column-major C^T = B^T A^T. */
static void gemm_nn(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                    int ldc) {
    const float one = 1.0f;
    ON_ONE_THREAD(blas_sgemm("N", "N", &n, &m, &kk, &one, b, &ldb, a, &lda, &beta, c, &ldc));
}

/* Row-major C[m, n] (ldc) += A[kk, m]^T (lda) B[kk, n] (ldb): column-major C^T = B^T A. */
static void gemm_tn_acc(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float *c, int ldc) {
    const float one = 1.0f;
    ON_ONE_THREAD(blas_sgemm("N", "T", &n, &m, &kk, &one, b, &ldb, a, &lda, &one, c, &ldc));
}

/* Bytes of a buffer for pack_rows_t: an m x kk operand (64-byte aligned, as the packed format's metadata wants). */
static size_t packed_bytes(int m, int n, int kk) {
    size_t bytes = 0;
    ON_ONE_THREAD(bytes = blas_pack_size("A", &m, &n, &kk));
    return (bytes + 63) / 64 * 64;
}

/* B [m, kk] (row-major, ldb) packed for gemm_nt_packed, with n the number of rows of the A operands to come. */
static void pack_rows_t(int m, int n, int kk, const float *b, int ldb, float *packed) {
    const float one = 1.0f;
    ON_ONE_THREAD(blas_pack("A", "T", &m, &n, &kk, &one, b, &ldb, packed));
}

/* gemm_nt (beta 0) with B packed by pack_rows_t: row-major C[m, n] (ldc) = A[m, kk] (lda) B[n, kk]^T. */
static void gemm_nt_packed(int m, int n, int kk, const float *a, int lda, const float *packed, float *c, int ldc) {
    const float zero = 0.0f;
    ON_ONE_THREAD(blas_compute("P", "N", &n, &m, &kk, packed, &kk, a, &lda, &zero, c, &ldc));
}

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

/* A test counter's value, reset to 0. */
static int64_t take_count(int64_t *count) {
    int64_t n;
#pragma omp atomic capture
    {
        n = *count;
        *count = 0;
    }
    return n;
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

/* One online-softmax step of n rows (q rows qr [n, dk], state m / l [n], unnormalised o [n, dv]) over w key columns
 * (kc, vc: their first rows), with the bias rows from bias_r0 at column bias_col of a tile_w-wide bias (NULL: none)
 * and the keep bits from keep_first[i] + keep_col (keep NULL: no dropout). With q16 (the rows' bf16 queries, unscaled)
 * the scores are scale * q16 K^T from the piece's keys packed by pack_piece (packed_w wide; these columns start at
 * packed_col). With `al`, the rows' generated ALiBi (their first row is arow over all entries; these columns start at
 * key column j_abs) is added before the mask. With sk (NULL: none), the fp32 scores take the piece's keys packed by
 * pack_rows_t. s: an [n, round8(w)] scratch block. */
static void forward_piece(const float *qr, int64_t n, int64_t dk, const float *kc, int64_t ldk, const float *vc,
                          int64_t ldv, int64_t dv, int64_t w, const float *bias, int64_t bias_r0, int64_t bias_rows,
                          int64_t tile_w, int64_t bias_col, const uint8_t *keep, const int64_t *keep_first,
                          int64_t keep_col, float log2e, float floor2, const uint16_t *q16, int64_t d16,
                          const uint32_t *packed, int64_t packed_w, int64_t packed_col, float scale,
                          float *features, const struct alibi_rows *al, int64_t arow, int64_t j_abs, const float *sk,
                          float *s, float *m, float *l, float *o) {
    const int64_t lds = round8(w);
    if (sk) {
        gemm_nt_packed((int)n, (int)w, (int)dk, qr, (int)dk, sk, s, (int)lds);
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

/* The key tiles cut into pieces at most `sub_cols` wide: piece p covers [pj0[p], pj1[p]) of tile ptile[p]. Returns
 * the number of pieces (the arrays hold n_cols / 1 + n_tiles entries at most, allocated by the caller). */
static int64_t key_pieces(int64_t n_tiles, const int64_t *tj0, const int64_t *tj1, int64_t sub_cols, int64_t *pj0,
                          int64_t *pj1, int64_t *ptile) {
    int64_t n = 0;
    for (int64_t t = 0; t < n_tiles; ++t)
        for (int64_t c0 = tj0[t]; c0 < tj1[t]; c0 += sub_cols) {
            pj0[n] = c0;
            pj1[n] = tj1[t] - c0 < sub_cols ? tj1[t] : c0 + sub_cols;
            ptile[n++] = t;
        }
    return n;
}

/* The fp32 S and dP of whole row blocks of at least PACK_MIN_ROWS rows against whole key pieces of at least
 * PACK_MIN_COLS keys take the packed path (pack_rows_t): there MKL's sgemm_compute gave the floats of its sgemm
 * (checked with 64-128 rows, widths 256-512 and depths 8-256, on its AVX-512 kernels and with
 * MKL_ENABLE_INSTRUCTIONS=AVX2; narrower pieces or 16 rows differed on the AVX2 ones, 8 rows or fewer on both). */
#define PACK_MIN_ROWS 64
#define PACK_MIN_COLS 256
/* Whole row blocks a call needs for the packed path: causal tiles of 256 rows (two blocks) measured 2% slower packed
 * (the packing and its buffers cost about what the one saved re-pack did); 2048-row tiles 2-3% faster. */
#define PACK_MIN_BLOCKS 4
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
            slot = (int64_t)packed_bytes((int)sub_cols, (int)block_rows, (int)dk) / (int64_t)sizeof(float);
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
                        pack_rows_t((int)w, (int)block_rows, (int)dk, k + e * ske + c0 * ldk, (int)ldk,
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
                                              c0 + lo, whole ? pe : NULL, s, m + a0, l + a0, o + a0 * dv);
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
 * sk / sv (NULL: none), the fp32 S and dP take the piece's keys and values packed by pack_rows_t.
 * dP is formed before P, so that one pass per row turns S into P and dP into dS (probs_ds_row); with dropout, P then
 * becomes P * keep / keep_prob in place for dV. */
static void backward_piece(int64_t n, int64_t row, int64_t r0, int64_t col, int64_t w, const struct backward_rows *a,
                           const float *kp, const float *vp, const float *bt, int64_t tile_w, float *s,
                           float *dp, float *dq_rows, int64_t ld_rows, float *dkp, float *dvp,
                           const uint32_t *packed_k, const uint32_t *packed_v, int64_t packed_w, int64_t packed_col,
                           float *features, int64_t j_abs, const float *sk, const float *sv) {
    const int64_t lds = round8(w);
    const struct bf16_scores *bf = a->bf;
    if (sk) {
        gemm_nt_packed((int)n, (int)w, (int)a->dk, a->q + row * a->dk, (int)a->dk, sk, s, (int)lds);
        gemm_nt_packed((int)n, (int)w, (int)a->dv, a->dy + row * a->dv, (int)a->dv, sv, dp, (int)lds);
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
        float *sk = sgemm_packed ? aligned_alloc(64, packed_bytes((int)sub_cols, (int)br, (int)dk)) : NULL;
        float *sv = sgemm_packed ? aligned_alloc(64, packed_bytes((int)sub_cols, (int)br, (int)dv)) : NULL;
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
                if (piece_packed) {
                    pack_rows_t((int)w, (int)br, (int)dk, kp, (int)ldk, sk);
                    pack_rows_t((int)w, (int)br, (int)dv, vp, (int)ldv, sv);
                }
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
                                           whole ? sv : NULL);
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

/* ---------------------------------------------------------------------------------------------------------------
 * Decode rows (FusedInferAttentionScore / IncreFlashAttention with one query token, no mask and no pse): each
 * (batch, kv head) pair's G grouped query rows q [G, D] (fp32, already scaled) attend to that pair's first len[b]
 * key/value rows, read in place in their own dtype (0 fp32, 1 fp16, 2 bf16) and widened to fp32 one row at a time:
 * the caches are read once and never converted as a whole. Online softmax over blocks of DECODE_BLOCK keys; out
 * [pairs, G, Dv] is left unnormalised with row_max / row_sum [pairs, G] (max in natural-log units); pairs with
 * len 0 are not touched. Pairs are independent: the result does not depend on the number of threads.
 * --------------------------------------------------------------------------------------------------------------- */
#define DECODE_BLOCK 64

int cann_attn_has_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c");
}

static inline float round_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &bits, sizeof(bits));
    return x;
}

/* int8 (dtype 3..5) or int4 packed two to a byte, value 2k in the low nibble (6..8) key/value anti-quantised as
   FIA's rule says (problem/antiquant.py): x * scale[c] in fp32, rounded once to the query's dtype (bf16, fp16,
   fp32 in that order), then widened. An int4 row has n a multiple of 8. */
__attribute__((target("avx2,fma,f16c")))
static inline void dequant_row(const int8_t *x, int64_t dtype, int64_t n, float *dst, const float *scale) {
    int64_t i = 0;
    const int int4 = dtype >= 6;
    const int64_t round = int4 ? dtype - 3 : dtype;
    const __m256i nibble_shifts = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    for (; i + 8 <= n; i += 8) {
        __m256i values;
        if (int4) {
            int32_t word;
            memcpy(&word, x + i / 2, sizeof(word));
            values = _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(word), nibble_shifts), 28);
        } else {
            values = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x + i)));
        }
        __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(values), _mm256_loadu_ps(scale + i));
        if (round == 3) {
            __m256i b = _mm256_castps_si256(p);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
            b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
            p = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
        } else if (round == 4) {
            p = _mm256_cvtph_ps(_mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        _mm256_storeu_ps(dst + i, p);
    }
    for (; i < n; i++) {  /* int8 rows only (int4 rows are whole groups of 8) */
        const float p = (float)x[i] * scale[i];
        dst[i] = round == 3 ? round_to_bf16(p) : round == 4 ? _cvtsh_ss(_cvtss_sh(p, 0)) : p;
    }
}

__attribute__((target("avx2,fma,f16c")))
static inline void widen_row(const void *src, int64_t dtype, int64_t n, float *dst, const float *scale) {
    int64_t i = 0;
    if (dtype >= 3) {
        dequant_row((const int8_t *)src, dtype, n, dst, scale);
        return;
    }
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    if (dtype == 1) {
        const uint16_t *h = (const uint16_t *)src;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
        for (; i < n; i++)
            dst[i] = _cvtsh_ss(h[i]);
        return;
    }
    const uint16_t *b = (const uint16_t *)src;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; i < n; i++) {
        uint32_t bits = (uint32_t)b[i] << 16;
        memcpy(dst + i, &bits, sizeof(float));
    }
}

/* A row whose channels lie in chunks of c0 values, chunk_stride elements apart (an NZ cache [.., D/c0, .., c0]);
   c0 = 0: one contiguous row. */
__attribute__((target("avx2,fma,f16c")))
static inline void widen_chunks(const char *src, int64_t dtype, int64_t n, float *dst, const float *scale,
                                int64_t c0, int64_t chunk_stride, int64_t esize) {
    if (c0 <= 0) {
        widen_row(src, dtype, n, dst, scale);
        return;
    }
    for (int64_t c = 0; c < n; c += c0)
        widen_row(src + (c / c0) * chunk_stride * esize, dtype, c0, dst + c, scale ? scale + c : NULL);
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    float s = _mm_cvtss_f32(lo);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static inline void axpy_f32(float *y, float a, const float *x, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

/* The addresses of rows [j0, j0 + w) of a sequence: base + p * ss, or, through a block table (paged caches,
 * docs/semantics/paged-kv.md), block table_row[p / page] at slot p % page (base then holds no sequence offset and
 * sb is the block stride). One division per tile, not per row: a division on every row's address path measured
 * the loop 2.4x slower (fewer loads in flight). */
static inline void tile_rows(const char **rows, const char *base, int64_t j0, int64_t w, int64_t ss, int64_t esize,
                             const int32_t *table_row, int64_t page, int64_t sb) {
    if (!table_row) {
        for (int64_t j = 0; j < w; j++)
            rows[j] = base + (j0 + j) * ss * esize;
        return;
    }
    int64_t block = j0 / page, slot = j0 % page;
    const char *start = base + (int64_t)table_row[block] * sb * esize;
    for (int64_t j = 0; j < w; j++) {
        rows[j] = start + slot * ss * esize;
        if (++slot == page && j + 1 < w) {
            slot = 0;
            start = base + (int64_t)table_row[++block] * sb * esize;
        }
    }
}

void fia_decode_rows(const float *q, int64_t pairs, int64_t heads_kv, int64_t group, int64_t dim, int64_t dim_v,
                     const void *k, const void *v, int64_t dtype, int64_t k_sb, int64_t k_sh, int64_t k_ss,
                     int64_t v_sb, int64_t v_sh, int64_t v_ss, const int64_t *len, float *out, float *row_max,
                     float *row_sum, const int32_t *table, int64_t table_stride, int64_t page,
                     const float *k_scale, const float *v_scale, int64_t k_c0, int64_t k_cs, int64_t v_c0,
                     int64_t v_cs) {
    const int64_t esize = dtype == 0 ? 4 : dtype <= 2 ? 2 : 1;  /* int4: strides in bytes */
#pragma omp parallel
    {
        float *kbuf = malloc((size_t)(DECODE_BLOCK * dim + dim_v) * sizeof(float));
        float *scores = malloc((size_t)(group * DECODE_BLOCK) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t pair = 0; pair < pairs; pair++) {
            const int64_t b = pair / heads_kv, h = pair % heads_kv, n = len[b];
            if (n <= 0)
                continue;
            const float *qp = q + pair * group * dim;
            float *acc = out + pair * group * dim_v;
            float *m = row_max + pair * group, *l = row_sum + pair * group;
            const int32_t *table_row = table ? table + b * table_stride : NULL;
            const int64_t seq = table ? 0 : b;  /* paged: k_sb / v_sb are block strides, the table finds blocks */
            const char *kp = (const char *)k + (seq * k_sb + h * k_sh) * esize;
            const char *vp = (const char *)v + (seq * v_sb + h * v_sh) * esize;
            const float *ks = k_scale ? k_scale + h * dim : NULL, *vs = v_scale ? v_scale + h * dim_v : NULL;
            memset(acc, 0, (size_t)(group * dim_v) * sizeof(float));
            for (int64_t g = 0; g < group; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            float *vbuf = kbuf + DECODE_BLOCK * dim;
            for (int64_t j0 = 0; j0 < n; j0 += DECODE_BLOCK) {
                const int64_t w = n - j0 < DECODE_BLOCK ? n - j0 : DECODE_BLOCK;
                const char *rows[DECODE_BLOCK];
                tile_rows(rows, kp, j0, w, k_ss, esize, table_row, page, k_sb);
                for (int64_t j = 0; j < w; j++)
                    widen_chunks(rows[j], dtype, dim, kbuf + j * dim, ks, k_c0, k_cs, esize);
                for (int64_t g = 0; g < group; g++) {
                    float *s = scores + g * DECODE_BLOCK, mx = m[g];
                    for (int64_t j = 0; j < w; j++) {
                        s[j] = dot_f32(qp + g * dim, kbuf + j * dim, dim);
                        mx = s[j] > mx ? s[j] : mx;
                    }
                    const float rescale = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
                    float sum = 0.0f;
                    for (int64_t j = 0; j < w; j++) {
                        s[j] = expf(s[j] - mx);
                        sum += s[j];
                    }
                    if (rescale != 1.0f) {
                        float *a = acc + g * dim_v;
                        for (int64_t c = 0; c < dim_v; c++)
                            a[c] *= rescale;
                    }
                    l[g] = l[g] * rescale + sum;
                    m[g] = mx;
                }
                tile_rows(rows, vp, j0, w, v_ss, esize, table_row, page, v_sb);
                for (int64_t j = 0; j < w; j++) {
                    widen_chunks(rows[j], dtype, dim_v, vbuf, vs, v_c0, v_cs, esize);
                    for (int64_t g = 0; g < group; g++)
                        axpy_f32(acc + g * dim_v, scores[g * DECODE_BLOCK + j], vbuf, dim_v);
                }
            }
        }
        free(kbuf);
        free(scores);
    }
}
