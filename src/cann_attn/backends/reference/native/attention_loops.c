/* Fused attention loops for the CPU reference backend (AVX2 + FMA, fp32; AVX-512 steps where the CPU has them).
 *
 * One translation unit: this file holds what every kernel family shares (the CPU checks, the AVX-512 switch, the
 * thread split, the test counters) and includes the families in order, so the compiler sees every loop at once and
 * inlines across families exactly as it would in a single file (the bits of some sums depend on what is inlined:
 * see dsa.c's forward_range). The loader (native/__init__.py) compiles this file alone; the cache key covers every
 * file of the directory.
 *
 *   vector_ops.h       lane masks, horizontal sums, the flushed 2^x, row maxima and exponential passes, the
 *                      register-block macros: AVX2 loops with their AVX-512 twins (the same floats)
 *   gathered_rows.c    products over selected key rows: row_dots, row_combine, scatter_columns (DSA and KL)
 *   dsa.c              sparse (DSA) attention forward and backward rows
 *   kl_target.c        the lightning indexer's KL target rows
 *   softmax_passes.c   per-row softmax passes for the dense kernels' PyTorch loops
 *   blas.c             the BLAS sgemm (and MKL's packed GEMM) PyTorch links, one thread per call
 *   blas_order.c       AVX-512 GEMMs giving the BLAS's floats (checked per shape), the loops' gemm_nt / nn / tn_acc
 *   bf16_scores.c      scores of bf16 inputs from AVX512-BF16 dot products
 *   score_terms.c      what is added to a score tile: mask bias rows, generated ALiBi, dropout, live columns
 *   dense_tiles.c      key pieces of the fused dense loops and when they take packed GEMMs
 *   dense_forward.c    the fused dense forward (S = Q K^T, online softmax, O += P V per row block)
 *   dense_backward.c   the fused dense backward
 *   decode_dots.c      decode scores of bf16 query rows and keys: AVX512-BF16 dot products, or their emulation
 *   int8_dots.c        int32 dot products of an int8 query and int8 keys: AVX512-VNNI, or an integer loop
 *   decode.c           decode rows (one query token per sequence) over contiguous, paged or NZ caches
 *   npu_rounding.c     the "npu" precision mode's casts to fp16 / bf16
 *   npu_tiles.c        the npu mode's fp16 per-tile passes: softmax step to float64 P, running output update
 *   npu_grad.c         the "npu" mode gradient's P and dS of one key tile, cast, in one pass
 *
 * Semantics stay in Python: which entries are valid, masks, the statistics' conventions, the final normalisation.
 * These loops only compute sums in a fixed order: no result depends on the number of threads.
 *
 * Layouts (unless a function says otherwise): every per-row tensor is contiguous, row r at r * (H * D); K and V rows
 * have a row stride (ldk, ldv) and unit column stride. Entries: tok [R, W] int64 token positions, valid [R, W] bytes
 * (NULL: all valid).
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

/* ---- AVX-512 steps, bit for bit the AVX2 loops' results ----
 * Where the CPU has AVX-512F, the gathered dot products (row_dots), the weighted sums (row_combine) and the
 * exponential pass (row_exp) take 16-lane steps that run, lane by lane, the same correctly rounded operations in the
 * same order as the AVX2 loops, so every result is the same float (tests/test_native_kernels.py compares them
 * bitwise); only the speed differs. (The dot products keep 8-column sums: two heads share a vector, one per half,
 * rather than 16 columns of one head, which would change the order of the additions.) CANN_ATTN_NATIVE_AVX512=0
 * (read at load) keeps the AVX2 loops. */

static int use_avx512 = 0;
static int use_avx512dq = 0; /* with use_avx512: AVX-512DQ's VREDUCEPS too (row_exp_max) */
static int use_avx512bw = 0; /* with use_avx512: AVX-512BW's 16-bit interleaves too (decode's half_combine64) */

int cann_attn_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* 1 (where supported) or 0: whether the loops take their AVX-512 steps; returns the setting now in force. */
int cann_attn_set_avx512(int on) {
    use_avx512 = on && cann_attn_has_avx512();
    use_avx512dq = use_avx512 && __builtin_cpu_supports("avx512dq");
    use_avx512bw = use_avx512 && __builtin_cpu_supports("avx512bw");
    return use_avx512;
}

/* Exported entry points. Each splits its rows (or, for the scatter, the columns of dK and dV) into one contiguous
 * range per OpenMP thread. The library links the libgomp that PyTorch has loaded, so these regions reuse PyTorch's
 * threads rather than competing with them (Python threads did: PyTorch's idle OpenMP workers spin between ops). */

/* [0, n) split into `parts` ranges whose inner bounds are multiples of `align`: range `i`. */
static void part_range(int64_t n, int64_t parts, int64_t i, int64_t align, int64_t *lo, int64_t *hi) {
    *lo = i == 0 ? 0 : (n * i / parts) / align * align;
    *hi = i == parts - 1 ? n : (n * (i + 1) / parts) / align * align;
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

#include "vector_ops.h"
#include "gathered_rows.c"
#include "dsa.c"
#include "kl_target.c"
#include "softmax_passes.c"
#include "blas.c"
#include "blas_order.c"
#include "bf16_scores.c"
#include "score_terms.c"
#include "dense_tiles.c"
#include "dense_forward.c"
#include "dense_backward.c"
#include "decode_dots.c"
#include "int8_dots.c"
#include "decode.c"
#include "npu_rounding.c"
#include "npu_tiles.c"
#include "npu_grad.c"
