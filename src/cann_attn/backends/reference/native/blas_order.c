/* AVX-512 GEMMs that give the BLAS's own floats, for the fused dense loops (blas.c's gemm_nt, gemm_nn, gemm_tn_acc).
 *
 * MKL's sgemm on the AVX-512 AMD CPUs these loops were measured on runs its AVX2 kernels at ~100 GFLOP/s on one
 * thread, and copies both operands on every call; a register-blocked AVX-512 loop reaches ~110 GFLOP/s on the same
 * core with no copy of the row-major operands. Its floats are the BLAS's because it runs the same sums in the same
 * order: each element of a product over k is one chain of fused multiply-adds from +0 over a block of kc consecutive
 * k, the blocks added to the element one after the other (to 0 with beta 0, to C with beta 1), which is what MKL's
 * kernels do there (ordered_block: kc = k up to 192, k / 2 up to 383, then 192).
 *
 * What is assumed, and what is checked. MKL compared with this order on an AMD EPYC (one thread; every k from 2 to
 * 1500 at one shape; every C of 1..64 rows and 1..64 columns at 8 to 11 values of k from 8 to 700; about a thousand
 * random shapes up to 2048 x 2048, k up to 4000, with tight and padded leading dimensions) summed in it wherever C
 * has at least ORDERED_MIN_ROWS rows and ORDERED_MIN_COLS columns and k >= 2, whatever m, n and the leading
 * dimensions; narrower C (its gemv-like and small-matrix kernels) and k = 1 (whose -0 it keeps) sum otherwise. So
 * the loops assume that the BLAS sums every shape of a class in one order, a class being the operation, k's regime
 * of ordered_block (up to 192, 193..383, beyond), rows of C below 16 or not and columns below 32 or not; the order
 * itself they check: the first GEMM of a class runs the BLAS and this loop on shapes of the class (its smallest C
 * with tight leading dimensions and an odd larger one with padded ones, each at k values at and around the ends of
 * the regime, and a large one: ordered_check_rows) on four sets of operands (two of many magnitudes, two of special values), and the loop serves the
 * class only where every element of all of them matched bit for bit. The BLAS serves every other class, and every
 * class where other CPUs' kernels or other libraries sum otherwise. At most 36 classes are checked in a process,
 * however many shapes it meets (variable-length batches meet hundreds).
 *
 * Part of the attention_loops.c translation unit (included there, after blas.c; not compiled alone).
 */

/* Rows of a register tile: ORDERED_NT_ROWS x 32 columns for C = A B^T, ORDERED_ACC_ROWS x 64 for C += A B. */
#define ORDERED_NT_ROWS 8
#define ORDERED_ACC_ROWS 6
/* C with fewer rows or columns, and sums of one term, keep the BLAS (MKL takes other kernels there). */
#define ORDERED_MIN_ROWS 4
#define ORDERED_MIN_COLS 12
/* The class boundaries (ordered_kc): rows and columns of C from which a shape is in the second row or column class,
 * and the block of MKL's order (ordered_block). */
#define ORDERED_WIDE_ROWS 16
#define ORDERED_WIDE_COLS 32
#define ORDERED_KC 192

/* Floats of the panels ordered_pack_t makes of B [n, k] (n rounded up to whole panels of 32 rows). */
static int64_t ordered_panel_floats(int64_t n, int64_t k) { return (n + 31) / 32 * 32 * k; }

/* B [n, k] (row stride ldb) as panels of 32 rows: packed[(p k + d) 32 + j] = B[32 p + j, d], zero past row n. */
static void ordered_pack_t(int64_t n, int64_t k, const float *b, int64_t ldb, float *packed) {
    for (int64_t p = 0; p * 32 < n; ++p) {
        float *panel = packed + p * k * 32;
        for (int64_t j = 0; j < 32; ++j) {
            const int64_t row = p * 32 + j;
            for (int64_t d = 0; d < k; ++d)
                panel[d * 32 + j] = row < n ? b[row * ldb + d] : 0.0f;
        }
    }
}

static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* C[m, n] (ldc) = A[m, k] (lda) B[n, k]^T with B packed by ordered_pack_t: each element the chains over the blocks of
 * kc k (ordered_acc's order, beta 0). */
__attribute__((target("avx512f"))) static void ordered_nt(int64_t m, int64_t n, int64_t k, const float *a,
                                                           int64_t lda, const float *packed, float *c, int64_t ldc,
                                                           int64_t kc) {
    for (int64_t i0 = 0; i0 < m; i0 += ORDERED_NT_ROWS) {
        const int64_t rows = m - i0 < ORDERED_NT_ROWS ? m - i0 : ORDERED_NT_ROWS;
        const float *ar[ORDERED_NT_ROWS];
        for (int r = 0; r < ORDERED_NT_ROWS; ++r) /* rows past m repeat the first: computed, never stored */
            ar[r] = a + (i0 + (r < rows ? r : 0)) * lda;
        for (int64_t p = 0; p * 32 < n; ++p) {
            const float *panel = packed + p * k * 32;
            const __mmask16 m0 = first_lanes(n - p * 32), m1 = first_lanes(n - p * 32 - 16);
            for (int64_t k0 = 0; k0 < k; k0 += kc) {
                const int64_t k1 = k - k0 < kc ? k : k0 + kc;
                __m512 c0[ORDERED_NT_ROWS], c1[ORDERED_NT_ROWS];
#pragma GCC unroll 8
                for (int r = 0; r < ORDERED_NT_ROWS; ++r)
                    c0[r] = c1[r] = _mm512_setzero_ps();
                for (int64_t d = k0; d < k1; ++d) {
                    const __m512 b0 = _mm512_load_ps(panel + d * 32), b1 = _mm512_load_ps(panel + d * 32 + 16);
#pragma GCC unroll 8
                    for (int r = 0; r < ORDERED_NT_ROWS; ++r) {
                        const __m512 x = _mm512_set1_ps(ar[r][d]);
                        c0[r] = _mm512_fmadd_ps(x, b0, c0[r]);
                        c1[r] = _mm512_fmadd_ps(x, b1, c1[r]);
                    }
                }
#pragma GCC unroll 8
                for (int r = 0; r < ORDERED_NT_ROWS; ++r) {
                    if (r >= rows)
                        break;
                    float *dst = c + (i0 + r) * ldc + p * 32;
                    if (k0 > 0) {
                        c0[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, dst), c0[r]);
                        c1[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, dst + 16), c1[r]);
                    }
                    _mm512_mask_storeu_ps(dst, m0, c0[r]);
                    _mm512_mask_storeu_ps(dst + 16, m1, c1[r]);
                }
            }
        }
    }
}

/* C[m, n] (ldc) += A B with A's element (i, d) at a[i ars + d aks] and B [k, n] row-major (ldb): for each block of kc
 * consecutive d, every element's chain of fused multiply-adds from +0 over the block, then added to C. */
__attribute__((target("avx512f"))) static void ordered_acc(int64_t m, int64_t n, int64_t k, const float *a,
                                                            int64_t ars, int64_t aks, const float *b, int64_t ldb,
                                                            float *c, int64_t ldc, int64_t kc) {
    for (int64_t i0 = 0; i0 < m; i0 += ORDERED_ACC_ROWS) {
        const int64_t rows = m - i0 < ORDERED_ACC_ROWS ? m - i0 : ORDERED_ACC_ROWS;
        const float *ar[ORDERED_ACC_ROWS];
        for (int r = 0; r < ORDERED_ACC_ROWS; ++r)
            ar[r] = a + (i0 + (r < rows ? r : 0)) * ars;
        for (int64_t j = 0; j < n; j += 64) {
            const int full = n - j >= 64;
            __mmask16 mk[4];
            for (int x = 0; x < 4; ++x)
                mk[x] = first_lanes(n - j - 16 * x);
            for (int64_t k0 = 0; k0 < k; k0 += kc) {
                const int64_t k1 = k - k0 < kc ? k : k0 + kc;
                __m512 acc[ORDERED_ACC_ROWS][4];
#pragma GCC unroll 6
                for (int r = 0; r < ORDERED_ACC_ROWS; ++r)
#pragma GCC unroll 4
                    for (int x = 0; x < 4; ++x)
                        acc[r][x] = _mm512_setzero_ps();
                for (int64_t d = k0; d < k1; ++d) {
                    const float *bd = b + d * ldb + j;
                    __m512 bv[4];
#pragma GCC unroll 4
                    for (int x = 0; x < 4; ++x)
                        bv[x] = full ? _mm512_loadu_ps(bd + 16 * x) : _mm512_maskz_loadu_ps(mk[x], bd + 16 * x);
#pragma GCC unroll 6
                    for (int r = 0; r < ORDERED_ACC_ROWS; ++r) {
                        const __m512 x = _mm512_set1_ps(ar[r][d * aks]);
#pragma GCC unroll 4
                        for (int y = 0; y < 4; ++y)
                            acc[r][y] = _mm512_fmadd_ps(x, bv[y], acc[r][y]);
                    }
                }
#pragma GCC unroll 6
                for (int r = 0; r < ORDERED_ACC_ROWS; ++r) {
                    if (r >= rows)
                        break;
                    float *dst = c + (i0 + r) * ldc + j;
#pragma GCC unroll 4
                    for (int x = 0; x < 4; ++x)
                        _mm512_mask_storeu_ps(dst + 16 * x, mk[x],
                                              _mm512_add_ps(_mm512_maskz_loadu_ps(mk[x], dst + 16 * x), acc[r][x]));
                }
            }
        }
    }
}

/* The operations of blas.c the ordered loops can take. */
enum ordered_op { ORDERED_NT, ORDERED_NN, ORDERED_TN };

struct ordered_shape {
    int64_t op, m, n, k, lda, ldb, ldc, kc; /* kc 0: the BLAS */
};

/* 0 switches the ordered loops off (tests compare them with the BLAS); cann_attn_set_ordered_gemm. */
static int ordered_enabled = 1;

int cann_attn_set_ordered_gemm(int on) {
    ordered_enabled = on != 0;
    return ordered_enabled;
}

/* GEMM calls the ordered loops took since the last read (tests check that a case takes them). */
static int64_t ordered_gemms = 0;

int64_t cann_attn_ordered_gemms(void) { return take_count(&ordered_gemms); }

/* Operands for the class check: values of many magnitudes (2^-12 .. 2^12, both signs, full mantissas), so that sums
 * in another order round differently almost surely. */
static void ordered_probe_fill(float *x, int64_t count, uint64_t seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < count; ++i) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t bits = (uint32_t)(s >> 32), exponent = 127 - 12 + (bits >> 23) % 25;
        const uint32_t value = (bits & 0x807fffffu) | exponent << 23; /* +-1.mantissa x 2^(exponent - 127) */
        memcpy(x + i, &value, sizeof value);
    }
}

/* Operands of the special kinds the check also compares: signed zeros, subnormals, infinities and huge values among
 * the others (which = 0), or A and C all -0 and B positive (which = 1: a sum that starts from +0 ends at +0, one that
 * starts from the first product keeps -0). With beta 0, C holds NaN: the BLAS must not read it. */
static void ordered_probe_special(float *x, int64_t count, uint64_t seed, int which, int operand, int beta0) {
    ordered_probe_fill(x, count, seed);
    if (operand == 2 && beta0) {
        for (int64_t i = 0; i < count; ++i)
            x[i] = NAN;
        return;
    }
    if (which == 1) { /* every product -0 */
        for (int64_t i = 0; i < count; ++i)
            x[i] = operand == 1 ? fabsf(x[i]) : -0.0f;
        return;
    }
    static const float values[] = {0.0f, -0.0f, 1e-40f, -1e-41f, INFINITY, -3e38f, 3e38f};
    for (int64_t i = 0; i < count; ++i) {
        const uint64_t h = (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        if ((h >> 40) % 16 == 0)
            x[i] = values[(h >> 20) % (sizeof values / sizeof values[0])];
    }
}

static void blas_call(const struct ordered_shape *sh, const float *a, const float *b, float *c);

/* The ordered loop's result of shape sh (with its kc) on a, b, c; 0 where it had no room for B's panels. */
static int ordered_call(const struct ordered_shape *sh, const float *a, const float *b, float *c) {
    if (sh->op == ORDERED_NT) {
        float *packed = aligned_alloc(64, sizeof(float) * ordered_panel_floats(sh->n, sh->k));
        if (!packed)
            return 0;
        ordered_pack_t(sh->n, sh->k, b, sh->ldb, packed);
        ordered_nt(sh->m, sh->n, sh->k, a, sh->lda, packed, c, sh->ldc, sh->kc);
        free(packed);
    } else if (sh->op == ORDERED_NN) {
        ordered_acc(sh->m, sh->n, sh->k, a, sh->lda, 1, b, sh->ldb, c, sh->ldc, sh->kc);
    } else {
        ordered_acc(sh->m, sh->n, sh->k, a, 1, sh->lda, b, sh->ldb, c, sh->ldc, sh->kc);
    }
    return 1;
}

/* Sizes (floats) of the operands of shape sh: A, B, C. */
static void ordered_sizes(const struct ordered_shape *sh, int64_t *na, int64_t *nb, int64_t *nc) {
    *na = sh->op == ORDERED_TN ? (sh->k - 1) * sh->lda + sh->m : (sh->m - 1) * sh->lda + sh->k;
    *nb = sh->op == ORDERED_NT ? (sh->n - 1) * sh->ldb + sh->k : (sh->k - 1) * sh->ldb + sh->n;
    *nc = (sh->m - 1) * sh->ldc + sh->n;
}

/* The block of the order the loop runs for a sum of k terms (MKL's: the whole sum, two halves, or blocks of 192). */
static int64_t ordered_block(int64_t k) { return k <= ORDERED_KC ? k : k < 2 * ORDERED_KC ? k / 2 : ORDERED_KC; }

/* The k regimes of ordered_block (a class's k): up to ORDERED_KC, below 2 ORDERED_KC, beyond. */
static int ordered_regime(int64_t k) { return k <= ORDERED_KC ? 0 : k < 2 * ORDERED_KC ? 1 : 2; }

/* The k a class's check runs, per regime: both ends of the regime, the terms around them, powers of two and odd
 * lengths between (0 ends a list). */
static const int64_t ordered_check_k[3][12] = {{2, 3, 8, 17, 63, 64, 127, 128, 129, 191, 192, 0},
                                               {193, 194, 255, 256, 301, 382, 383, 0},
                                               {384, 385, 575, 576, 577, 769, 0}};
/* Rows and columns of the three shapes a class's check runs, per class: its smallest C, an odd larger one, and a
 * large one (the class's largest narrow size, or 128 x 256): a BLAS may take other kernels for small and large
 * operands, and the small shapes alone would not show a large-operand kernel that sums otherwise. The large shape runs
 * at one k per regime (ordered_large_k: 2-5 ms per class on one core), the others at every ordered_check_k. */
static const int64_t ordered_check_rows[2][3] = {{ORDERED_MIN_ROWS, 13, ORDERED_WIDE_ROWS - 1},
                                                 {ORDERED_WIDE_ROWS, 37, 128}};
static const int64_t ordered_check_cols[2][3] = {{ORDERED_MIN_COLS, 29, ORDERED_WIDE_COLS - 1},
                                                 {ORDERED_WIDE_COLS, 45, 256}};
static const int64_t ordered_large_k[3][2] = {{192, 0}, {301, 0}, {577, 0}};

/* Classes checked since the last read (tests check that a workload of many shapes checks few). */
static int64_t ordered_probes = 0;

int64_t cann_attn_ordered_probes(void) { return take_count(&ordered_probes); }

/* Whether the ordered loop (block ordered_block(k)) gives the BLAS's floats for shape sh on operands a, b and c0
 * (want, got: scratch for C). */
static int ordered_matches(struct ordered_shape sh, const float *a, const float *b, const float *c0, float *want,
                           float *got) {
    int64_t na, nb, nc;
    ordered_sizes(&sh, &na, &nb, &nc);
    sh.kc = ordered_block(sh.k);
    memcpy(want, c0, sizeof(float) * nc);
    memcpy(got, c0, sizeof(float) * nc);
    blas_call(&sh, a, b, want);
    int same = ordered_call(&sh, a, b, got);
    for (int64_t r = 0; r < sh.m && same; ++r)
        same = memcmp(got + r * sh.ldc, want + r * sh.ldc, sizeof(float) * sh.n) == 0;
    return same;
}

/* Check shape s (0: the class's smallest C with tight leading dimensions, 1: the larger one, padded, 2: the large
 * one, padded) at k. */
static struct ordered_shape ordered_check_shape(int64_t op, int row_class, int col_class, int s, int64_t k) {
    const int64_t m = ordered_check_rows[row_class][s], n = ordered_check_cols[col_class][s], pad = s ? 3 : 0;
    return (struct ordered_shape){op, m, n, k, (op == ORDERED_TN ? m : k) + pad, (op == ORDERED_NT ? k : n) + pad,
                                  n + pad, 0};
}

/* Whether the ordered loop gives the BLAS's floats on every check shape of class (op, regime, row class, column
 * class), each on four sets of operands (two of values of many magnitudes, two of special values; a set is made once
 * for the largest shape, the others read its first elements). */
static int ordered_check_class(int64_t op, int regime, int row_class, int col_class) {
    int64_t na = 0, nb = 0, nc = 0;
    for (int s = 0; s < 3; ++s)
        for (const int64_t *k = s < 2 ? ordered_check_k[regime] : ordered_large_k[regime]; *k; ++k) {
            int64_t sa, sb, sc;
            const struct ordered_shape shape = ordered_check_shape(op, row_class, col_class, s, *k);
            ordered_sizes(&shape, &sa, &sb, &sc);
            na = sa > na ? sa : na;
            nb = sb > nb ? sb : nb;
            nc = sc > nc ? sc : nc;
        }
    float *a = malloc(sizeof(float) * na), *b = malloc(sizeof(float) * nb), *c0 = malloc(sizeof(float) * nc);
    float *want = malloc(sizeof(float) * nc), *got = malloc(sizeof(float) * nc);
    int same = a && b && c0 && want && got; /* without room for the check, the BLAS keeps the class */
    for (uint64_t seed = 1; seed <= 4 && same; ++seed) {
        if (seed <= 2) {
            ordered_probe_fill(a, na, 3 * seed);
            ordered_probe_fill(b, nb, 3 * seed + 1);
            ordered_probe_fill(c0, nc, 3 * seed + 2);
        } else {
            const int beta0 = op == ORDERED_NT;
            ordered_probe_special(a, na, 3 * seed, (int)seed - 3, 0, beta0);
            ordered_probe_special(b, nb, 3 * seed + 1, (int)seed - 3, 1, beta0);
            ordered_probe_special(c0, nc, 3 * seed + 2, (int)seed - 3, 2, beta0);
        }
        for (int s = 0; s < 3 && same; ++s)
            for (const int64_t *k = s < 2 ? ordered_check_k[regime] : ordered_large_k[regime]; *k && same; ++k)
                same = ordered_matches(ordered_check_shape(op, row_class, col_class, s, *k), a, b, c0, want, got);
    }
    free(got);
    free(want);
    free(c0);
    free(b);
    free(a);
    return same;
}

/* Per class (op, k regime, row class, column class): 0 not checked yet, 1 the ordered loop serves it, -1 the BLAS. */
static int ordered_classes[3][3][2][2];

/* The kc of shape sh where the ordered loop serves its class, else 0 (each class checked once, ordered_check_class). */
static int64_t ordered_kc(struct ordered_shape sh) {
    if (!use_avx512 || !ordered_enabled || sh.m < ORDERED_MIN_ROWS || sh.n < ORDERED_MIN_COLS || sh.k < 2)
        return 0;
    const int regime = ordered_regime(sh.k), rows = sh.m >= ORDERED_WIDE_ROWS, cols = sh.n >= ORDERED_WIDE_COLS;
    int *slot = &ordered_classes[sh.op][regime][rows][cols], served;
#pragma omp atomic read
    served = *slot;
    if (!served) {
#pragma omp critical(ordered_classes)
        {
            if (!*slot) {
                const int verdict = ordered_check_class(sh.op, regime, rows, cols) ? 1 : -1;
#pragma omp atomic write
                *slot = verdict;
#pragma omp atomic
                ordered_probes += 1;
            }
            served = *slot;
        }
    }
    return served > 0 ? ordered_block(sh.k) : 0;
}

static void count_ordered(void) {
#pragma omp atomic
    ordered_gemms += 1;
}

/* The ordered loop on shape sh (its kc found here) where it gives the BLAS's floats for the shape, counted; 0 where
 * the shape is not served or there was no room for B's panels (the caller then takes the BLAS). */
static int ordered_try(struct ordered_shape sh, const float *a, const float *b, float *c) {
    sh.kc = ordered_kc(sh);
    if (!sh.kc || !ordered_call(&sh, a, b, c))
        return 0;
    count_ordered();
    return 1;
}

static void blas_call(const struct ordered_shape *sh, const float *a, const float *b, float *c) {
    const int m = (int)sh->m, n = (int)sh->n, k = (int)sh->k, lda = (int)sh->lda, ldb = (int)sh->ldb;
    if (sh->op == ORDERED_NT)
        blas_nt(m, n, k, a, lda, b, ldb, 0.0f, c, (int)sh->ldc);
    else if (sh->op == ORDERED_NN)
        blas_nn(m, n, k, a, lda, b, ldb, 1.0f, c, (int)sh->ldc);
    else
        blas_tn_acc(m, n, k, a, lda, b, ldb, c, (int)sh->ldc);
}

/* The fused loops' GEMMs (blas.c's conventions): the ordered loop where it gives the BLAS's floats for the shape,
 * else the BLAS. */
static void gemm_nt(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                    int ldc) {
    if (beta != 0.0f || !ordered_try((struct ordered_shape){ORDERED_NT, m, n, kk, lda, ldb, ldc, 0}, a, b, c))
        blas_nt(m, n, kk, a, lda, b, ldb, beta, c, ldc);
}

static void gemm_nn(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                    int ldc) {
    if (beta != 1.0f || !ordered_try((struct ordered_shape){ORDERED_NN, m, n, kk, lda, ldb, ldc, 0}, a, b, c))
        blas_nn(m, n, kk, a, lda, b, ldb, beta, c, ldc);
}

static void gemm_tn_acc(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float *c, int ldc) {
    if (!ordered_try((struct ordered_shape){ORDERED_TN, m, n, kk, lda, ldb, ldc, 0}, a, b, c))
        blas_tn_acc(m, n, kk, a, lda, b, ldb, c, ldc);
}

/* One of the fused loops' GEMMs by name (op: ORDERED_NT with beta 0, ORDERED_NN or ORDERED_TN with beta 1), for tests
 * that compare the ordered loops with the BLAS (cann_attn_set_ordered_gemm(0)) on chosen operands. */
void cann_attn_loops_gemm(int64_t op, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
                          int64_t ldb, float *c, int64_t ldc) {
    if (op == ORDERED_NT)
        gemm_nt((int)m, (int)n, (int)k, a, (int)lda, b, (int)ldb, 0.0f, c, (int)ldc);
    else if (op == ORDERED_NN)
        gemm_nn((int)m, (int)n, (int)k, a, (int)lda, b, (int)ldb, 1.0f, c, (int)ldc);
    else
        gemm_tn_acc((int)m, (int)n, (int)k, a, (int)lda, b, (int)ldb, c, (int)ldc);
}
