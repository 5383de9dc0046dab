/* Sparse (DSA) attention rows: the forward (online softmax over each row's selected keys in chunks of KEY_CHUNK)
 * and the backward (P, dS and dQ per row; dK / dV left to sfa_scatter), with their exported entry points. Which
 * entries are valid is decided in Python (docs/operators/sparse_flash_attention.md).
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

/* Keys per chunk of the forward: a chunk's K rows (which hold V's columns when V is K's first columns) stay in L2
 * between the dot products and the weighted sum that read them; a whole row's 512 keys would come from L3 twice. */
#define KEY_CHUNK 128

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
                 * was inlined here, and stopped once row_exp was restructured, moving the sums by an ulp). */
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
