/* The BLAS the fused dense loops call: the sgemm inside PyTorch's CPU library (MKL on x86 builds) and, where it
 * has it, MKL's packed-operand GEMM, found by the Python loader and set here; every call runs with MKL's thread count
 * at 1 (ON_ONE_THREAD) so that its bits do not depend on the OpenMP team size.
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

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
static void blas_nt(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                    int ldc) {
    const float one = 1.0f;
    ON_ONE_THREAD(blas_sgemm("T", "N", &n, &m, &kk, &one, b, &ldb, a, &lda, &beta, c, &ldc));
}

/* Row-major C[m, n] (ldc) = A[m, kk] (lda) B[kk, n] (ldb) + beta C: column-major C^T = B^T A^T. */
static void blas_nn(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                    int ldc) {
    const float one = 1.0f;
    ON_ONE_THREAD(blas_sgemm("N", "N", &n, &m, &kk, &one, b, &ldb, a, &lda, &beta, c, &ldc));
}

/* Row-major C[m, n] (ldc) += A[kk, m]^T (lda) B[kk, n] (ldb): column-major C^T = B^T A. */
static void blas_tn_acc(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float *c, int ldc) {
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
