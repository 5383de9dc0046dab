/* Per-row softmax passes for the dense kernels' PyTorch loops (taken where the fused loops are off): one
 * online-softmax step over a score tile, the backward's probabilities and dS, each in one pass over a row while it is
 * in L1, and the exponential on its own for tests.
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

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
 * the row is still in L1 when its exponentials are taken. softmax_step_row is one row's step (the npu mode's fused
 * tile pass takes it too), returning its correction. */
static inline float softmax_step_row(float *si, int64_t cols, float *row_max_io, float *row_sum_io, float log2e,
                                     float floor2) {
    const float m_old = *row_max_io;
    const float m_new = max_nan(m_old, row_max(si, cols));
    const float shift = m_new == -INFINITY ? 0.0f : m_new;
    const float total = row_exp(si, cols, shift, log2e, floor2, 1.0f);
    const float corr = expf(m_old - shift);
    *row_sum_io = *row_sum_io * corr + total;
    *row_max_io = m_new;
    return corr;
}

void fa_softmax_step(float *s, int64_t rows, int64_t cols, int64_t lds, float *row_max_io, float *row_sum_io,
                     float *correction, float log2e, float floor2) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i)
        correction[i] = softmax_step_row(s + i * lds, cols, row_max_io + i, row_sum_io + i, log2e, floor2);
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
