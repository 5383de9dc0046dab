/* Decode rows (FusedInferAttentionScore / IncreFlashAttention / ATB with one query token per sequence): K/V
 * caches read in place in their own dtype (fp32, fp16, bf16, int8 / int4 anti-quantised), contiguous, paged or NZ.
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

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
