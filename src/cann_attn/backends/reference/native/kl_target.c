/* The lightning indexer's KL target rows (docs/operators/lightning_indexer.md): the head-averaged attention
 * probabilities at each row's selected keys.
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

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
