/* Decode rows (FusedInferAttentionScore / IncreFlashAttention / ATB with one query token per sequence, no mask and
 * no pse): each (batch, kv head) pair's G grouped query rows q [G, D] (fp32, already scaled; or q16, bf16 and
 * unscaled, over bf16 keys) attend to that pair's first len[b] key/value rows, read in place in their own dtype (fp32,
 * fp16, bf16; int8 / int4 anti-quantised) from contiguous, paged (a block table) or NZ caches, and widened to fp32 a
 * tile of DECODE_BLOCK rows at a time (bf16 keys of q16: scored as they are): the
 * caches are read once, each K / V row once for all G query rows (they are the rows of the tile's products). out
 * [pairs, G, Dv] is left unnormalised with row_max / row_sum [pairs, G] (max in natural-log units); pairs with
 * len 0 are not touched.
 *
 * Order of the sums (docs/guides/backends.md, "Decode"), fixed whatever the thread count, the cache layout (paged or
 * not) and the vector width:
 *   - a score of q16 is dot_scores's (decode_dots.c: VDPBF16PS's order, or its emulation, times the scale); of q8
 *     (an int8 MLA query) ((float)(q8 . k8) + r) * f: the int32 dot product of the latent columns (int8_dots.c,
 *     exact), plus r, the rope columns' row_dots sum of the fp32 query rope and the widened key rope, times the
 *     row's factor f; any other is row_dots's: 8-column partial sums (column d in lane d % 8, FMAs in increasing
 *     d), then hsum;
 *   - a sequence is cut into chunks of DECODE_SPLIT keys (the work items), a chunk into tiles of DECODE_BLOCK keys;
 *     per tile and query row: the running max m, p = 2^((s - shift) log2e) flushed at floor2 (row_exp),
 *     l = fma(l, c, sum p) with c = 2^((m_old - shift) log2e), and acc = fma(acc, c, sum_j p_j v_j) per column
 *     (row_combine: the tile's sum by FMAs in key order from +0);
 *   - the chunks of a sequence are combined in order (decode_combine).
 * --------------------------------------------------------------------------------------------------------------- */
#define DECODE_BLOCK 64
/* Keys per work item: a longer sequence is split into chunks of DECODE_SPLIT keys whose partial sums are combined in
 * chunk order (decode_combine), so that one long sequence keeps every thread busy. A fixed length, not one derived
 * from the thread count or the batch: a sequence's result depends on its own length only. */
#define DECODE_SPLIT 512
/* Rows are fetched into L2 one tile ahead (prefetch_rows): measured best against none (1.3x slower), into L1, or
 * two and four tiles ahead (BNSD, BSH and paged bf16 caches, one thread). */
#define DECODE_AHEAD 1
/* Each 4 KiB page of the key / value rows DECODE_PAGE_AHEAD tiles on is touched (one line, touch_tile_pages), so that
 * its address translation is done before the tile's rows are fetched. Caches in 4 KiB pages read slower than the
 * same bytes in 2 MiB pages, by an amount that varies from allocation to allocation (a plain sum over them too:
 * 19-26 against 31-34 GB/s); the touch takes back most of the decode's share of it (bf16 BNSD, B 8, N 32/8, Skv
 * 8192, D 128, one thread, ns per key, 4 KiB-page caches: 41.9 -> 33.3, 39.7 -> 32.1, 34.7 -> 32.8; BSH 37.4 ->
 * 34.8; paged BSH 38.8 -> 37.0; 2 MiB pages: 30.7 -> 30.2), two and six tiles ahead about the same, eight and
 * sixteen less; a T2 prefetch of the line or a load instead gained less or nothing. */
#define DECODE_PAGE_AHEAD 4
/* Bound on the partial sums of split chunks held at once (floats): pairs are taken in waves below it. */
#define DECODE_PARTIAL_FLOATS ((int64_t)4 << 20)

/* A decode call's inputs, shared by its work items (fia_decode_rows documents them). */
struct decode_args {
    const void *k, *v;
    int64_t dtype, esize, heads_kv, group, dim, dim_v;
    int64_t k_sb, k_sh, k_ss, v_sb, v_sh, v_ss;
    const int32_t *table;
    int64_t table_stride, page;
    const float *k_scale, *v_scale;
    int64_t k_c0, k_cs, v_c0, v_cs;
    /* MLA's rope keys (NULL: none): each key is its latent row (dim - dim_r columns) followed by its rope row (dim_r),
     * of dtype r_dtype (fp32, fp16, bf16: the rope is never quantised, so an int8 latent has a float rope), from a
     * cache of its own in the key's format (its own strides and NZ chunk width), read through the same block table. */
    const void *r;
    int64_t r_dtype, r_esize, dim_r, r_sb, r_sh, r_ss, r_c0, r_cs;
    float log2e, floor2;
    float *out, *row_max, *row_sum;
    /* bf16 query rows [pairs, G, D], unscaled (NULL: q holds them in fp32, scaled): with bf16 keys (and rope keys), the
     * scores are dot_scores's, times `scale` (decode_dots.c). */
    const uint16_t *q16;
    float scale;
    /* int8 MLA query rows (NULL: none): q8 [pairs, G, D - dim_r] int8, q8_rope [pairs, G, dim_r] fp32 (the query
     * rope, unscaled), q8_factor [pairs, G] (softmax scale x query scale x key scale) and q8_bias [pairs, G] (128 x
     * the sum of each q8 row, for int8_dots); the int8 key's scale is then not applied to the scores. */
    const int8_t *q8;
    const float *q8_rope, *q8_factor;
    const int32_t *q8_bias;
};

_Static_assert(DECODE_BLOCK <= INT8_DOT_KEYS, "a decode tile's keys go to int8_dots in one call");

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

/* Fetches rows[0..w) (each `bytes` long, or n / c0 chunks of c0 elements chunk_stride apart: NZ) into L2 ahead of
 * their tile: with a row stride of N2 * D elements (BSH caches) or across the blocks of a paged cache, the hardware
 * prefetchers did not keep the loads fed (widening the rows took most of the loop's time). */
static inline void prefetch_rows(const char **rows, int64_t w, int64_t n, int64_t esize, int64_t c0,
                                 int64_t chunk_stride) {
    const int64_t piece = c0 > 0 ? c0 : n, pieces = c0 > 0 ? n / c0 : 1;
    for (int64_t j = 0; j < w; j++)
        for (int64_t c = 0; c < pieces; c++) {
            const char *start = rows[j] + c * chunk_stride * esize;
            for (int64_t off = 0; off < piece * esize; off += 64)
                _mm_prefetch(start + off, _MM_HINT_T1);
        }
}

/* ---- Decode scores from key pairs (AVX-512): row_dots's floats for any G ----
 * A tile's keys are widened in pairs: vector t of pair i holds key 2i's columns [8t, 8t + 8) in lanes 0-7 and key
 * 2i + 1's in lanes 8-15 (zero past dim, and past the tile's last key). A query row's 8 columns broadcast to both
 * halves then give each half the AVX2 loop's 8-lane sum of its key (the same FMAs in the same order, the same
 * hsum), so the scores are row_dots's bits; blocks of 4 heads x 3 pairs (6 keys) keep 12 sums in registers whatever
 * G is (row_dots16 needs blocks of 8 heads). */

/* Floats of one key pair's vectors. */
static int64_t pair_floats(int64_t dim) { return (dim + 7) / 8 * 16; }

/* Rows ra and rb (NULL: zeros) of fp32 into pair vectors pk. */
__attribute__((target("avx512f"))) static void pair_rows16(const float *ra, const float *rb, int64_t dim, float *pk) {
    const int64_t full = dim / 8 * 8;
    const __m256i tail = lane_mask(dim - full);
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 lo = d < full ? _mm256_loadu_ps(ra + d) : _mm256_maskload_ps(ra + d, tail);
        const __m256 hi = !rb ? _mm256_setzero_ps() : d < full ? _mm256_loadu_ps(rb + d) : _mm256_maskload_ps(rb + d, tail);
        _mm512_store_ps(pk + 2 * d, _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                                                          _mm256_castps_pd(hi), 1)));
    }
}

/* bf16 (dtype 2) or fp16 (1) rows ra and rb (NULL: zeros) widened straight into pair vectors pk (exact). */
__attribute__((target("avx512f,f16c"))) static void pair_half_rows16(const uint16_t *ra, const uint16_t *rb,
                                                                     int64_t dtype, int64_t dim, float *pk) {
    const int64_t full = dim / 8 * 8;
    for (int64_t d = 0; d < full; d += 8) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(ra + d));
        const __m128i b = rb ? _mm_loadu_si128((const __m128i *)(rb + d)) : _mm_setzero_si128();
        const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
        const __m512 x = dtype == 1 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm512_store_ps(pk + 2 * d, x);
    }
    if (full < dim) {
        float *v = pk + 2 * full;
        for (int64_t c = 0; c < 16; c++) {
            const int64_t d = full + c % 8;
            const uint16_t *r = c < 8 ? ra : rb;
            float x = 0.0f;
            if (r && d < dim) {
                if (dtype == 1) {
                    x = _cvtsh_ss(r[d]);
                } else {
                    const uint32_t bits = (uint32_t)r[d] << 16;
                    memcpy(&x, &bits, sizeof x);
                }
            }
            v[c] = x;
        }
    }
}

/* Value rows of later tiles that half_combine64 fetches into L2 as it goes: its step for key j and a block of
 * columns fetches those columns of rows[0][j] (j < count[0]) and rows[1][j] (j < count[1]). */
struct fetch_ahead {
    const char **rows[2];
    int64_t count[2];
};

/* Fetches bytes [off, off + len) of row r into L2, line by line. */
static inline void prefetch_span(const char *r, int64_t off, int64_t len) {
    const uintptr_t first = (uintptr_t)(r + off) & ~(uintptr_t)63, last = (uintptr_t)(r + off + len - 1);
    for (uintptr_t line = first; line <= last; line += 64)
        _mm_prefetch((const char *)line, _MM_HINT_T1);
}

/* Pair vector of columns [d, d + 8) of bf16 (dtype 2) or fp16 (1) keys ra and rb, widened in registers (the floats
 * pair_half_rows16 stores). */
__attribute__((target("avx512f,f16c"))) static inline __m512 half_pair16(const char *ra, const char *rb,
                                                                        int64_t dtype, int64_t d) {
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)ra + d / 8)),
                                              _mm_loadu_si128((const __m128i *)rb + d / 8), 1);
    return dtype == 1 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Scores of heads h0..h0 + nh - 1 (nh <= 4; rows past nh repeat the first) against the 8 keys of the 4 pairs at p0
 * (stride floats apart) or, with `keys`, of the 8 bf16 / fp16 rows keys[0..8) read in place (dim a multiple of 8):
 * each sum the FMAs of pair_dots16's blocks in the same order, reduced by hsum_pairs8 (the same floats). */
__attribute__((target("avx512f,f16c"))) static void pair_dots16_block8(const float *q, int64_t nh, int64_t dim,
                                                                        const float *p0, int64_t stride,
                                                                        const char **keys, int64_t dtype, float *s,
                                                                        int64_t lds) {
    const int64_t steps = (dim + 7) / 8, full = dim / 8;
    const __m256i tail = lane_mask(dim - full * 8);
    const float *p1 = p0 + stride, *p2 = p1 + stride, *p3 = p2 + stride;
    BLOCK_ROWS(a, q, dim);
    ZERO_BLOCK16;
    __m512 c03 = c00, c13 = c00, c23 = c00, c33 = c00;
#define PAIR_ROW(i, LOAD)                                                                                            \
    do {                                                                                                             \
        const __m512 y = both_halves(LOAD(a##i + 8 * t));                                                            \
        FMA_ROW16(i, y);                                                                                             \
        c##i##3 = _mm512_fmadd_ps(y, x3, c##i##3);                                                                   \
    } while (0)
#define PAIR_STEP(LOAD)                                                                                              \
    do {                                                                                                             \
        PAIR_ROW(0, LOAD);                                                                                           \
        PAIR_ROW(1, LOAD);                                                                                           \
        PAIR_ROW(2, LOAD);                                                                                           \
        PAIR_ROW(3, LOAD);                                                                                           \
    } while (0)
    if (keys) {
        for (int64_t t = 0; t < steps; t++) {
            const __m512 x0 = half_pair16(keys[0], keys[1], dtype, 8 * t), x1 = half_pair16(keys[2], keys[3], dtype, 8 * t);
            const __m512 x2 = half_pair16(keys[4], keys[5], dtype, 8 * t), x3 = half_pair16(keys[6], keys[7], dtype, 8 * t);
            PAIR_STEP(LOAD_FULL);
        }
    } else {
        for (int64_t t = 0; t < steps; t++) {
            const __m512 x0 = _mm512_load_ps(p0 + 16 * t), x1 = _mm512_load_ps(p1 + 16 * t);
            const __m512 x2 = _mm512_load_ps(p2 + 16 * t), x3 = _mm512_load_ps(p3 + 16 * t);
            if (t < full)
                PAIR_STEP(LOAD_FULL);
            else
                PAIR_STEP(LOAD_TAIL);
        }
    }
#undef PAIR_STEP
#undef PAIR_ROW
    /* hsum_pairs8's order back to keys 0..7 of each of its two heads. */
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const __m512 first = _mm512_permutexvar_ps(order, hsum_pairs8(c00, c10, c01, c11, c02, c12, c03, c13));
    const __m512 second = _mm512_permutexvar_ps(order, hsum_pairs8(c20, c30, c21, c31, c22, c32, c23, c33));
    const __m256 rows[4] = {_mm512_castps512_ps256(first), high_half(first), _mm512_castps512_ps256(second),
                            high_half(second)};
    for (int64_t i = 0; i < nh; i++)
        _mm256_storeu_ps(s + i * lds, rows[i]);
}

/* s[g * lds + j] = q[g] . key j for g < heads, j < w, from the tile's key pairs pk (pair_floats(dim) floats each):
 * blocks of 8 whole keys by pair_dots16_block8, the rest below. */
__attribute__((target("avx512f"))) static void pair_dots16(const float *q, int64_t heads, int64_t dim, const float *pk,
                                                            int64_t w, float *s, int64_t lds) {
    const int64_t steps = (dim + 7) / 8, full = dim / 8, pairs = (w + 1) / 2, stride = pair_floats(dim);
    const __m256i tail = lane_mask(dim - full * 8);
    const int64_t blocked = w / 8 * 4;
    for (int64_t i0 = 0; i0 < blocked; i0 += 4)
        for (int64_t h0 = 0; h0 < heads; h0 += 4)
            pair_dots16_block8(q + h0 * dim, heads - h0 < 4 ? heads - h0 : 4, dim, pk + i0 * stride, stride, NULL, 0,
                               s + h0 * lds + 2 * i0, lds);
    for (int64_t i0 = blocked; i0 < pairs; i0 += 3) {
        const int64_t np = pairs - i0 < 3 ? pairs - i0 : 3;
        const float *p0 = pk + i0 * stride, *p1 = np > 1 ? p0 + stride : p0, *p2 = np > 2 ? p0 + 2 * stride : p0;
        for (int64_t h0 = 0; h0 < heads; h0 += 4) {
            const int64_t nh = heads - h0 < 4 ? heads - h0 : 4;
            BLOCK_ROWS(a, q + h0 * dim, dim);
            ZERO_BLOCK16;
            for (int64_t t = 0; t < steps; t++) {
                const __m512 x0 = _mm512_load_ps(p0 + 16 * t), x1 = _mm512_load_ps(p1 + 16 * t);
                const __m512 x2 = _mm512_load_ps(p2 + 16 * t);
                if (t < full) {
                    FMA_ROW16(0, both_halves(_mm256_loadu_ps(a0 + 8 * t)));
                    FMA_ROW16(1, both_halves(_mm256_loadu_ps(a1 + 8 * t)));
                    FMA_ROW16(2, both_halves(_mm256_loadu_ps(a2 + 8 * t)));
                    FMA_ROW16(3, both_halves(_mm256_loadu_ps(a3 + 8 * t)));
                } else {
                    FMA_ROW16(0, both_halves(_mm256_maskload_ps(a0 + 8 * t, tail)));
                    FMA_ROW16(1, both_halves(_mm256_maskload_ps(a1 + 8 * t, tail)));
                    FMA_ROW16(2, both_halves(_mm256_maskload_ps(a2 + 8 * t, tail)));
                    FMA_ROW16(3, both_halves(_mm256_maskload_ps(a3 + 8 * t, tail)));
                }
            }
            const __m512 sums[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
            for (int64_t i = 0; i < nh; i++)
                for (int64_t v = 0; v < np; v++) {
                    const int64_t j = 2 * (i0 + v);
                    s[(h0 + i) * lds + j] = hsum(_mm512_castps512_ps256(sums[i][v]));
                    if (j + 1 < w)
                        s[(h0 + i) * lds + j + 1] = hsum(high_half(sums[i][v]));
                }
        }
    }
}

/* One key widened into dst [dim]: its latent row (ks: int8 scales, NULL: none), then its rope row where the call has
 * rope keys. */
static void widen_key_row(const struct decode_args *a, const char *krow, const char *rrow, const float *ks,
                          float *dst) {
    const int64_t dk = a->dim - a->dim_r;
    widen_chunks(krow, a->dtype, dk, dst, ks, a->k_c0, a->k_cs, a->esize);
    if (rrow)
        widen_chunks(rrow, a->r_dtype, a->dim_r, dst + dk, NULL, a->r_c0, a->r_cs, a->r_esize);
}

/* The tile's w key rows (addresses `rows`, rope rows `rrows` or NULL) into pair vectors pk: bf16 / fp16 rows
 * straight, others widened into `row` (a dim-float scratch) first. */
static void decode_key_pairs(const struct decode_args *a, const char **rows, const char **rrows, int64_t w,
                             const float *ks, float *row, float *pk) {
    const int64_t stride = pair_floats(a->dim);
    const int direct = (a->dtype == 1 || a->dtype == 2) && a->k_c0 <= 0 && !rrows;
    for (int64_t j = 0; j < w; j += 2) {
        const char *rb = j + 1 < w ? rows[j + 1] : NULL;
        if (direct) {
            pair_half_rows16((const uint16_t *)rows[j], (const uint16_t *)rb, a->dtype, a->dim, pk + j / 2 * stride);
            continue;
        }
        widen_key_row(a, rows[j], rrows ? rrows[j] : NULL, ks, row);
        if (rb)
            widen_key_row(a, rb, rrows ? rrows[j + 1] : NULL, ks, row + a->dim);
        pair_rows16(row, rb ? row + a->dim : NULL, a->dim, pk + j / 2 * stride);
    }
}

/* One element of a bf16 (dtype 2) or fp16 (1) row, widened (exact). */
__attribute__((target("f16c"))) static inline float half_value(const uint16_t *r, int64_t dtype, int64_t c) {
    if (dtype == 1)
        return _cvtsh_ss(r[c]);
    const uint32_t bits = (uint32_t)r[c] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Vector v (16 columns from column d) of a bf16 / fp16 row, widened in registers: `lanes` of them live (16: a
 * whole vector; 1..15: a last partial vector, through a scratch; 0 or less: zeros). */
__attribute__((target("avx512f,f16c"))) static inline __m512 half_vector16(const uint16_t *r, int64_t dtype,
                                                                          int64_t d, int64_t lanes) {
    if (lanes >= 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(r + d));
        return dtype == 1 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    float part[16] = {0.0f};
    for (int64_t c = 0; c < lanes; ++c)
        part[c] = half_value(r, dtype, d + c);
    return _mm512_loadu_ps(part);
}

/* How half_block reads a row's 64 columns: bf16 interleaved with zeros (below), 16 whole columns per vector, or a
 * last partial block (`cols` < 64). */
enum half_load { HALF_BF16, HALF_WHOLE, HALF_PART };

/* One block of half_combine64: heads [h0, h0 + nh) (nh <= 4) x columns [d, d + cols) (cols <= 64, live lanes
 * `lanes`) over the n keys, its 16 sums in registers, then stored (see half_combine64). An inline body that the three
 * loads each compile on their own (half_block_bf16 / _whole / _part): in one function with the three key loops, GCC
 * kept one of the 16 sums in a stack slot through the bf16 loop (a load, FMA and store per key); on their own, none
 * (bf16 decode 2-4% faster with dot_step44's scores: BNSD and paged BSH, B 1, N 32/8, Skv 256, D 128, cache in L2,
 * one thread). */
__attribute__((target("avx512f,avx512bw,f16c"), always_inline)) static inline void
half_block(enum half_load load, const float *w, int64_t ts, int64_t h0, int64_t nh, int64_t n, const char **rows,
           int64_t dtype, int64_t d, int64_t cols, const __mmask16 *lanes, int64_t dim, const float *keep, float *out,
           const struct fetch_ahead *ahead) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i zero = _mm512_setzero_si512();
    BLOCK_ROWS(w, w + h0 * ts, ts);
    ZERO_BLOCK16;
    __m512 c03 = c00, c13 = c00, c23 = c00, c33 = c00;
    for (int64_t j = 0; j < n; ++j) {
        const uint16_t *r = (const uint16_t *)rows[j];
        if (ahead) {
            if (j < ahead->count[0])
                prefetch_span(ahead->rows[0][j], 2 * d, 2 * cols);
            if (j < ahead->count[1])
                prefetch_span(ahead->rows[1][j], 2 * d, 2 * cols);
        }
        __m512 x0, x1, x2, x3;
        if (load == HALF_BF16) {
            /* bf16: two 32-column loads, each value into the high half of a lane by one in-lane interleave with
             * zeros (no widening shuffle, no shift); vectors 0 / 1 then hold columns {0-3, 8-11, 16-19, 24-27} /
             * {4-7, 12-15, 20-23, 28-31} of the first 32, vectors 2 / 3 the same of the second 32, and the sums are
             * put back in column order below. */
            const __m512i lo32 = _mm512_loadu_si512((const void *)(r + d));
            const __m512i hi32 = _mm512_loadu_si512((const void *)(r + d + 32));
            x0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, lo32));
            x1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, lo32));
            x2 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, hi32));
            x3 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, hi32));
        } else if (load == HALF_WHOLE) {
            x0 = half_vector16(r, dtype, d, 16);
            x1 = half_vector16(r, dtype, d + 16, 16);
            x2 = half_vector16(r, dtype, d + 32, 16);
            x3 = half_vector16(r, dtype, d + 48, 16);
        } else {
            x0 = half_vector16(r, dtype, d, cols);
            x1 = half_vector16(r, dtype, d + 16, cols - 16);
            x2 = half_vector16(r, dtype, d + 32, cols - 32);
            x3 = half_vector16(r, dtype, d + 48, cols - 48);
        }
        __m512 y = _mm512_set1_ps(w0[j]);
        FMA_ROW16(0, y);
        c03 = _mm512_fmadd_ps(y, x3, c03);
        y = _mm512_set1_ps(w1[j]);
        FMA_ROW16(1, y);
        c13 = _mm512_fmadd_ps(y, x3, c13);
        y = _mm512_set1_ps(w2[j]);
        FMA_ROW16(2, y);
        c23 = _mm512_fmadd_ps(y, x3, c23);
        y = _mm512_set1_ps(w3[j]);
        FMA_ROW16(3, y);
        c33 = _mm512_fmadd_ps(y, x3, c33);
    }
    if (load == HALF_BF16) {
        /* Sums of interleaved vectors a {0-3, 8-11, 16-19, 24-27} and b {4-7, ...} back to columns 0-15 and 16-31. */
        const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#define UNINTERLEAVE(a, b)                                                                                           \
    do {                                                                                                             \
        const __m512 natural_a = _mm512_permutex2var_ps(a, first16, b);                                              \
        b = _mm512_permutex2var_ps(a, second16, b);                                                                  \
        a = natural_a;                                                                                               \
    } while (0)
        UNINTERLEAVE(c00, c01);
        UNINTERLEAVE(c02, c03);
        UNINTERLEAVE(c10, c11);
        UNINTERLEAVE(c12, c13);
        UNINTERLEAVE(c20, c21);
        UNINTERLEAVE(c22, c23);
        UNINTERLEAVE(c30, c31);
        UNINTERLEAVE(c32, c33);
#undef UNINTERLEAVE
    }
    /* Each sum stored by name (an array of them indexed by head and vector lives in memory). */
#define STORE_SUM(i, v)                                                                                              \
    do {                                                                                                             \
        float *o = out + (h0 + i) * dim + d + 16 * v;                                                                \
        __m512 x = _mm512_mul_ps(c##i##v, one);                                                                      \
        if (keep)                                                                                                    \
            x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes[v], o), _mm512_set1_ps(keep[h0 + i]), x);               \
        _mm512_mask_storeu_ps(o, lanes[v], x);                                                                       \
    } while (0)
#define STORE_HEAD(i)                                                                                                \
    if (i < nh) {                                                                                                    \
        STORE_SUM(i, 0);                                                                                             \
        STORE_SUM(i, 1);                                                                                             \
        STORE_SUM(i, 2);                                                                                             \
        STORE_SUM(i, 3);                                                                                             \
    }
    STORE_HEAD(0)
    STORE_HEAD(1)
    STORE_HEAD(2)
    STORE_HEAD(3)
#undef STORE_HEAD
#undef STORE_SUM
}

#define HALF_BLOCK_ARGS                                                                                              \
    const float *w, int64_t ts, int64_t h0, int64_t nh, int64_t n, const char **rows, int64_t dtype, int64_t d,     \
        int64_t cols, const __mmask16 *lanes, int64_t dim, const float *keep, float *out,                            \
        const struct fetch_ahead *ahead
#define HALF_BLOCK_PASS w, ts, h0, nh, n, rows, dtype, d, cols, lanes, dim, keep, out, ahead
__attribute__((target("avx512f,avx512bw,f16c"), noinline)) static void half_block_bf16(HALF_BLOCK_ARGS) {
    half_block(HALF_BF16, HALF_BLOCK_PASS);
}
__attribute__((target("avx512f,avx512bw,f16c"), noinline)) static void half_block_whole(HALF_BLOCK_ARGS) {
    half_block(HALF_WHOLE, HALF_BLOCK_PASS);
}
__attribute__((target("avx512f,avx512bw,f16c"), noinline)) static void half_block_part(HALF_BLOCK_ARGS) {
    half_block(HALF_PART, HALF_BLOCK_PASS);
}
#undef HALF_BLOCK_PASS
#undef HALF_BLOCK_ARGS

/* row_combine(w, ts, heads, n, rows, dim, 1, keep, out) over bf16 / fp16 value rows `rows` read in place, in blocks
 * of 4 heads x 64 columns (16 sums in registers; D = 128 is two whole blocks: half_block): each output column is the
 * same chain of FMAs over the keys as in row_combine48 (the lanes are independent, so the column blocking does not
 * reach the bits), its store the same (store_block48's multiply by 1 and FMA with keep), with the rows widened in
 * registers instead of into a copy first, so the same floats. The first block of heads of each column block fetches
 * `ahead`'s rows' columns (NULL: none). */
__attribute__((target("avx512f,avx512bw,f16c"))) static void half_combine64(const float *w, int64_t ts, int64_t heads,
                                                                   int64_t n, const char **rows, int64_t dtype,
                                                                   int64_t dim, const float *keep, float *out,
                                                                   const struct fetch_ahead *ahead) {
    for (int64_t d = 0; d < dim; d += 64) {
        const int64_t cols = dim - d < 64 ? dim - d : 64;
        __mmask16 lanes[4];
        for (int64_t v = 0; v < 4; ++v) {
            const int64_t live = cols - 16 * v;
            lanes[v] = live >= 16 ? 0xFFFF : live <= 0 ? 0 : (__mmask16)((1u << live) - 1);
        }
        for (int64_t h0 = 0; h0 < heads; h0 += 4) {
            const int64_t nh = heads - h0 < 4 ? heads - h0 : 4;
            const struct fetch_ahead *fetch = h0 == 0 ? ahead : NULL;
            if (dtype == 2 && cols == 64)
                half_block_bf16(w, ts, h0, nh, n, rows, dtype, d, cols, lanes, dim, keep, out, fetch);
            else if (cols == 64)
                half_block_whole(w, ts, h0, nh, n, rows, dtype, d, cols, lanes, dim, keep, out, fetch);
            else
                half_block_part(w, ts, h0, nh, n, rows, dtype, d, cols, lanes, dim, keep, out, fetch);
        }
    }
}

/* One work item of the decode loop: keys [j0, j1) of every kv head of batch entry `batch`, chunk `chunk` of its
 * `chunks`; a split entry's partial sums for kv head h lie at slot + h * chunks + chunk (decode_item_run says in
 * which order its tiles and heads go). */
struct decode_item {
    int64_t batch, j0, j1, chunk, chunks, slot, length; /* length: the sequence's keys */
};

/* A thread's scratch: key / value rows widened (kbuf [DECODE_BLOCK, D], vbuf [DECODE_BLOCK, Dv]), key pairs
 * (kpairs; NULL: row_dots scores), the queries packed for row_dots16 per kv head (packed; NULL: none), scores
 * s [N2, G, DECODE_BLOCK] and corrections corr [N2, G] (one kv head's at a time, or every head's: decode_heads_tile),
 * and iota = 0..DECODE_BLOCK - 1 (the widened rows' indices). decode_heads_tile's too: each kv head's results
 * (acc, m, l [N2]) and the pieces of the next tile's rows it fetches (fetch_k, fetch_v [DECODE_BLOCK * N2]). */
struct decode_scratch {
    float *kbuf, *vbuf, *kpairs, *packed, *s, *corr;
    int64_t iota[DECODE_BLOCK];
    float **acc, **m, **l;
    const char **fetch_k, **fetch_v;
    struct dot_scratch dots; /* with q16: the bf16 scores' */
    int32_t *idots;          /* with q8: a tile's integer dot products [G, DECODE_BLOCK] */
    float *rope_s;           /* with q8: a tile's rope sums [G, DECODE_BLOCK] */
    uint8_t *keys8;          /* with q8: a tile's key rows gathered for int8_dots [DECODE_BLOCK, D - dim_r] */
};

/* A bf16 row of n elements copied into dst (NZ: chunks of c0, chunk_stride elements apart; c0 = 0: contiguous). */
static void gather_half_row(const char *src, int64_t n, uint16_t *dst, int64_t c0, int64_t chunk_stride) {
    if (c0 <= 0) {
        memcpy(dst, src, sizeof(uint16_t) * n);
        return;
    }
    for (int64_t c = 0; c < n; c += c0)
        memcpy(dst + c, src + (c / c0) * chunk_stride * sizeof(uint16_t), sizeof(uint16_t) * c0);
}

/* The keys rows[0..nk) (rope rows rrows or NULL) for dot_scores: read in place where each key's row is contiguous
 * and, before a rope row, whole chunks wide; else gathered into whole rows (NZ caches, other latent widths). */
static struct dot_keys decode_dot_keys(const struct decode_args *a, const char **rows, const char **rrows, int64_t nk,
                                       struct dot_scratch *ds) {
    const int64_t dk = a->dim - a->dim_r, chunks = dot_chunks(a->dim), width = chunks * DOT_CHUNK;
    if (a->k_c0 <= 0 && (!rrows || (dk % DOT_CHUNK == 0 && a->r_c0 <= 0)))
        return (struct dot_keys){rows, rrows ? rrows : rows, rrows ? dk / DOT_CHUNK : chunks, chunks, dot_tail(a->dim)};
    for (int64_t k = 0; k < nk; k++) {
        uint16_t *dst = ds->gathered + k * width;
        gather_half_row(rows[k], dk, dst, a->k_c0, a->k_cs);
        if (rrows)
            gather_half_row(rrows[k], a->dim_r, dst + dk, a->r_c0, a->r_cs);
    }
    return (struct dot_keys){ds->gathered_rows, ds->gathered_rows, chunks, chunks, dot_tail(a->dim)};
}

/* The online softmax step of a tile's scores S [G, DECODE_BLOCK] (W of each row live) into M, L [G] (FIRST: the
 * range's first tile, which sets them): S becomes p, CORR [G] the factors of the earlier sums (`group`: G). A macro,
 * so that decode_tile's code stays as it was written inline there: as a function (always_inline included) the BNSD
 * work loop compiled differently and measured slower. */
#define TILE_SOFTMAX(S, W, FIRST, M, L, CORR)                                                                        \
    for (int64_t g = 0; g < group; g++) {                                                                            \
        float *sg = (S) + g * DECODE_BLOCK;                                                                          \
        const float m_old = (FIRST) ? -INFINITY : (M)[g];                                                            \
        const float m_new = max_nan(m_old, row_max(sg, W));                                                          \
        const float shift = m_new == -INFINITY ? 0.0f : m_new;                                                       \
        const float total = row_exp_max(sg, W, shift, a->log2e, a->floor2);                                          \
        (CORR)[g] = (FIRST) ? 0.0f : exp2f((m_old - shift) * a->log2e);                                              \
        (L)[g] = (FIRST) ? total : fmaf((L)[g], (CORR)[g], total);                                                   \
        (M)[g] = m_new;                                                                                              \
    }

/* The scores s [G, DECODE_BLOCK] of int8 query rows (a->q8, pair `pair`) against the tile's w keys (latent rows
 * `rows`, rope rows `rrows` or NULL): ((float)(q8 . k8) + r) * f (decode.c's order of the sums); `packed`: the
 * pair's rope query rows packed for row_dots (NULL: none). The next tile's wn key rows `next_k` are fetched
 * meanwhile. */
static void int8_query_scores(const struct decode_args *a, int64_t pair, const char **rows, const char **rrows,
                              int64_t w, const char **next_k, int64_t wn, const float *packed,
                              struct decode_scratch *sc, float *s) {
    const int64_t group = a->group, dk = a->dim - a->dim_r, dr = a->dim_r;
    prefetch_rows(next_k, wn, dk, 1, a->k_c0, a->k_cs);
    int8_dots(a->q8 + pair * group * dk, group, dk, (const int8_t *const *)rows, w, a->k_c0, a->k_cs,
              a->q8_bias + pair * group, sc->keys8, sc->idots, DECODE_BLOCK);
    const float *f = a->q8_factor + pair * group;
    if (rrows) {
        for (int64_t j = 0; j < w; j++)
            widen_chunks(rrows[j], a->r_dtype, dr, sc->kbuf + j * dr, NULL, a->r_c0, a->r_cs, a->r_esize);
        row_dots(a->q8_rope + pair * group * dr, group, dr, sc->kbuf, dr, sc->iota, w, sc->rope_s, DECODE_BLOCK,
                 packed);
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < w; j++) {
            const float r = rrows ? sc->rope_s[g * DECODE_BLOCK + j] : 0.0f;
            s[g * DECODE_BLOCK + j] = ((float)sc->idots[g * DECODE_BLOCK + j] + r) * f[g];
        }
}

/* Whether rows of a cache of dtype `dtype` and NZ chunk width c0 are bf16 / fp16 read in place in whole vectors (no
 * NZ chunks): the condition of decode_tile's fused key-pair scores (keys) and its in-register P V (values), which
 * heads_items_fit takes too, as its items call the same functions. */
static int halves_in_place(int64_t dtype, int64_t c0) { return (dtype == 1 || dtype == 2) && c0 <= 0; }

/* Tile [j0, j0 + w) of kv head h of batch entry b (pair = b * heads_kv + h), its query rows qp [G, D]: the online
 * softmax step into acc [G, Dv], m [G], l [G] (`first`: the range's first tile, which sets them). The rows of the
 * tile to come (wn of them from jn, kv head hn; and, w2 > 0, the w2 rows of kv head h2 at this tile's positions)
 * are fetched meanwhile, a few at a time between this tile's rows (issued in one burst they waited on the line fill
 * buffers). */
static void decode_tile(const struct decode_args *a, int64_t b, int64_t h, int64_t j0, int64_t w, int64_t hn,
                        int64_t jn, int64_t wn, int64_t h2, int64_t w2,
                        int first, const float *qp, const float *packed, float *acc, float *m, float *l,
                        struct decode_scratch *sc) {
    const int64_t group = a->group;
    const int32_t *table_row = a->table ? a->table + b * a->table_stride : NULL;
    const int64_t seq = a->table ? 0 : b; /* paged: k_sb / v_sb are block strides, the table finds blocks */
    const char *kp = (const char *)a->k + (seq * a->k_sb + h * a->k_sh) * a->esize;
    const char *vp = (const char *)a->v + (seq * a->v_sb + h * a->v_sh) * a->esize;
    const char *rp = a->r ? (const char *)a->r + (seq * a->r_sb + h * a->r_sh) * a->r_esize : NULL;
    const float *ks = a->k_scale ? a->k_scale + h * (a->dim - a->dim_r) : NULL;
    const float *vs = a->v_scale ? a->v_scale + h * a->dim_v : NULL;
    const int64_t dk = a->dim - a->dim_r;
    const int64_t kbytes = a->dtype >= 6 ? dk / 2 : dk, vbytes = a->dtype >= 6 ? a->dim_v / 2 : a->dim_v;
    const int half_v = use_avx512bw && halves_in_place(a->dtype, a->v_c0);
    const char *rows[DECODE_BLOCK], *next_k[DECODE_BLOCK], *next_v[DECODE_BLOCK], *rrows[DECODE_BLOCK];
    const char *also_k[DECODE_BLOCK], *also_v[DECODE_BLOCK];
    if (rp) {
        tile_rows(rrows, rp, j0, w, a->r_ss, a->r_esize, table_row, a->page, a->r_sb);
        for (int64_t j = 0; j < w; j++)
            prefetch_rows(rrows + j, 1, a->dim_r, a->r_esize, a->r_c0, a->r_cs);
    }
    if (wn > 0) {
        tile_rows(next_k, kp + (hn - h) * a->k_sh * a->esize, jn, wn, a->k_ss, a->esize, table_row, a->page, a->k_sb);
        tile_rows(next_v, vp + (hn - h) * a->v_sh * a->esize, jn, wn, a->v_ss, a->esize, table_row, a->page, a->v_sb);
    }
    if (w2 > 0) {
        tile_rows(also_k, kp + (h2 - h) * a->k_sh * a->esize, j0, w2, a->k_ss, a->esize, table_row, a->page, a->k_sb);
        tile_rows(also_v, vp + (h2 - h) * a->v_sh * a->esize, j0, w2, a->v_ss, a->esize, table_row, a->page, a->v_sb);
    }
    tile_rows(rows, kp, j0, w, a->k_ss, a->esize, table_row, a->page, a->k_sb);
    float *s = sc->s;
    /* bf16 / fp16 keys in whole vectors: blocks of 8 keys scored straight from the rows (pair_dots16_block8), the
     * next tile's key and value rows fetched a block at a time between them (the value rows' fetches, issued in one
     * burst of the tile's rows, waited on memory: bf16 BSH 29.3 -> 23.5 ms, B 8, N 32/8, Skv 8192, D 128, one
     * thread); the last w % 8 keys through key pairs below.
     * With bf16 query rows (q16), every key of the tile by dot_scores, fetching the same way, 8 keys at a time (16
     * for a single head: dot_step's block for it; fetches of 16 rows at a time measured slower). */
    const int dots = a->q16 != NULL, q8 = a->q8 != NULL;
    const int64_t step = dots && group == 1 ? DOT_STEP : 8;
    const int64_t fused = dots ? w
                          : q8 ? 0
                          : sc->kpairs && halves_in_place(a->dtype, a->k_c0) && !rp && a->dim % 8 == 0
                              ? w / 8 * 8 : 0;
    if (dots)
        dot_query(a->q16 + (b * a->heads_kv + h) * group * a->dim, group, a->dim, &sc->dots);
    const unsigned int csr = dots ? dot_flush_begin() : 0;
    for (int64_t j = 0; j < fused; j += step) {
        if (j < wn) {
            prefetch_rows(next_k + j, wn - j < step ? wn - j : step, kbytes, a->esize, a->k_c0, a->k_cs);
            if (!half_v)
                prefetch_rows(next_v + j, wn - j < step ? wn - j : step, vbytes, a->esize, a->v_c0, a->v_cs);
        }
        if (j < w2) {
            prefetch_rows(also_k + j, w2 - j < step ? w2 - j : step, kbytes, a->esize, a->k_c0, a->k_cs);
            if (!half_v)
                prefetch_rows(also_v + j, w2 - j < step ? w2 - j : step, vbytes, a->esize, a->v_c0, a->v_cs);
        }
        if (dots) {
            const int64_t nk = w - j < step ? w - j : step;
            const struct dot_keys keys = decode_dot_keys(a, rows + j, rp ? rrows + j : NULL, nk, &sc->dots);
            dot_scores(group, a->dim, &keys, nk, 0, a->scale, s + j, DECODE_BLOCK, &sc->dots);
            continue;
        }
        for (int64_t h0 = 0; h0 < group; h0 += 4)
            pair_dots16_block8(qp + h0 * a->dim, group - h0 < 4 ? group - h0 : 4, a->dim, NULL, 0, rows + j, a->dtype,
                               s + h0 * DECODE_BLOCK + j, DECODE_BLOCK);
    }
    if (dots)
        dot_flush_end(csr);
    if (q8) {
        int8_query_scores(a, b * a->heads_kv + h, rows, rp ? rrows : NULL, w, next_k, wn, packed, sc, s);
    } else if (sc->kpairs) {
        for (int64_t j = fused; j < w; j += 2) {
            if (j < wn)
                prefetch_rows(next_k + j, wn - j < 2 ? wn - j : 2, kbytes, a->esize, a->k_c0, a->k_cs);
            decode_key_pairs(a, rows + j, rp ? rrows + j : NULL, w - j < 2 ? w - j : 2, ks, sc->kbuf,
                             sc->kpairs + (j - fused) / 2 * pair_floats(a->dim));
        }
    } else if (!dots) {
        for (int64_t j = 0; j < w; j++) {
            if (j < wn)
                prefetch_rows(next_k + j, 1, kbytes, a->esize, a->k_c0, a->k_cs);
            widen_key_row(a, rows[j], rp ? rrows[j] : NULL, ks, sc->kbuf + j * a->dim);
        }
    }
    tile_rows(rows, vp, j0, w, a->v_ss, a->esize, table_row, a->page, a->v_sb);
    for (int64_t j = 0; j < w; j++) {
        if (j < wn && j >= fused && !half_v)
            prefetch_rows(next_v + j, 1, vbytes, a->esize, a->v_c0, a->v_cs);
        if (!half_v)
            widen_chunks(rows[j], a->dtype, a->dim_v, sc->vbuf + j * a->dim_v, vs, a->v_c0, a->v_cs, a->esize);
    }
    if (sc->kpairs)
        pair_dots16(qp, group, a->dim, sc->kpairs, w - fused, s + fused, DECODE_BLOCK);
    else if (!dots && !q8)
        row_dots(qp, group, a->dim, sc->kbuf, a->dim, sc->iota, w, s, DECODE_BLOCK, packed);
    TILE_SOFTMAX(s, w, first, m, l, sc->corr);
    if (half_v) {
        /* The next value rows fetched by the combine, a row's columns at its key's step, rather than between the
         * scores' blocks: the scores then fetch half the lines, and the fetches keep pace with the arithmetic
         * instead of waiting on a full miss queue (bf16 BSH 24.8 -> 22.3 ms, B 8, N 32/8, Skv 8192, D 128, one
         * thread). */
        const struct fetch_ahead ahead = {{next_v, also_v}, {wn, w2}};
        half_combine64(s, DECODE_BLOCK, group, w, rows, a->dtype, a->dim_v, first ? NULL : sc->corr, acc, &ahead);
    } else {
        row_combine(s, DECODE_BLOCK, group, w, sc->vbuf, a->dim_v, sc->iota, a->dim_v, 1.0f, first ? NULL : sc->corr,
                    acc);
    }
}

/* Touches (a non-temporal prefetch of one line) each 4 KiB page of `rows` rows `stride` bytes apart from `first`,
 * each `bytes` long. */
static inline void touch_run_pages(const char *first, int64_t rows, int64_t stride, int64_t bytes) {
    if (rows <= 0)
        return;
    if (stride >= 4096) {
        for (int64_t j = 0; j < rows; j++)
            _mm_prefetch(first + j * stride, _MM_HINT_NTA);
        return;
    }
    const uintptr_t end = (uintptr_t)first + (uintptr_t)((rows - 1) * stride + bytes);
    _mm_prefetch(first, _MM_HINT_NTA);
    for (uintptr_t p = ((uintptr_t)first & ~(uintptr_t)4095) + 4096; p < end; p += 4096)
        _mm_prefetch((const char *)p, _MM_HINT_NTA);
}

/* The pages of kv head h's key and value rows of the tile at jp of work item it's sequence (nothing past the
 * sequence's end; NZ caches untouched). */
__attribute__((always_inline)) static inline void touch_tile_pages(const struct decode_args *a,
                                                                   const struct decode_item *it, int64_t h,
                                                                   int64_t jp) {
    if (jp >= it->length || a->k_c0 > 0 || a->v_c0 > 0)
        return;
    const int64_t wp = it->length - jp < DECODE_BLOCK ? it->length - jp : DECODE_BLOCK;
    const int32_t *table_row = a->table ? a->table + it->batch * a->table_stride : NULL;
    const int64_t seq = a->table ? 0 : it->batch;
    for (int s = 0; s < 2; s++) {
        const int64_t n = s ? a->dim_v : a->dim - a->dim_r, row_bytes = (a->dtype >= 6 ? n / 2 : n) * a->esize;
        const int64_t sb = s ? a->v_sb : a->k_sb, sh = s ? a->v_sh : a->k_sh, ss = s ? a->v_ss : a->k_ss;
        const char *base = (const char *)(s ? a->v : a->k) + (seq * sb + h * sh) * a->esize;
        if (!table_row) {
            touch_run_pages(base + jp * ss * a->esize, wp, ss * a->esize, row_bytes);
            continue;
        }
        for (int64_t j = jp; j < jp + wp;) {
            const int64_t slot = j % a->page, run = a->page - slot < jp + wp - j ? a->page - slot : jp + wp - j;
            touch_run_pages(base + ((int64_t)table_row[j / a->page] * sb + slot * ss) * a->esize, run, ss * a->esize,
                            row_bytes);
            j += run;
        }
    }
}

/* Whether the caches go tile by tile (decode_item_run): not where each kv head's rows lie closer together than a
 * position's heads (BNSD). */
static int heads_adjacent(const struct decode_args *a) { return !(a->k_ss < a->k_sh && a->v_ss < a->v_sh); }

/* Whether a call's work items go to decode_heads_items rather than decode_item_run: a position's kv heads adjacent
 * (BSH, paged BSH), and bf16 / fp16 key and value rows read in place in whole vectors (no NZ chunks, no rope keys),
 * scored from the rows and from key pairs (AVX-512, G not a multiple of 8: pair_dots16_block8, pair_dots16) or by
 * dot_scores (q16), and combined in registers (AVX-512BW: half_combine64): the functions decode_tile calls on such
 * tiles. */
static int heads_items_fit(const struct decode_args *a) {
    return heads_adjacent(a) && (a->q16 || (use_avx512 && a->group % 8 != 0)) && use_avx512bw &&
           halves_in_place(a->dtype, a->k_c0) && halves_in_place(a->dtype, a->v_c0) && !a->r && !a->q8 &&
           a->dim % 8 == 0;
}

/* The addresses of every kv head's slice of rows[0..n) (each row's kv head 0), position by position: out[p * heads +
 * h] = rows[p] + h * sh elements. */
static void head_pieces(const char **out, const char *const *rows, int64_t n, int64_t heads, int64_t sh,
                        int64_t esize) {
    for (int64_t p = 0; p < n; p++)
        for (int64_t h = 0; h < heads; h++)
            out[p * heads + h] = rows[p] + h * sh * esize;
}

/* Tile [j0, j0 + w) of every kv head of batch entry b (queries qb [N2, G, D], or with q16 every head's packed by
 * dot_query, query row h G + g for head h; results sc->acc, m, l [N2]) where a
 * position's kv heads are adjacent (BSH, paged BSH): decode_tile's arithmetic for each head (the same functions on
 * the same rows, so the same bits) in another order. The scores go block by block of 8 positions, every head's in
 * turn while the block's rows are in L1 (a head's 64 rows alone lie 2 KiB apart on 32 pages, which the tile's other
 * heads then read again: bf16 BSH, N2 8, D 128); then each head's softmax and weighted sum of the values. The rows
 * of the tile to come (wn of them from jn) are fetched meanwhile, in memory order (every head's slice of a position
 * in turn): the key rows between the score blocks, the value rows by the weighted sums. */
static void decode_heads_tile(const struct decode_args *a, int64_t b, int64_t j0, int64_t w, int64_t jn, int64_t wn,
                              int first, const float *qb, struct decode_scratch *sc) {
    const int64_t group = a->group, heads = a->heads_kv, es = a->esize, dim = a->dim;
    const int32_t *table_row = a->table ? a->table + b * a->table_stride : NULL;
    const int64_t seq = a->table ? 0 : b; /* paged: k_sb / v_sb are block strides, the table finds blocks */
    const char *kp = (const char *)a->k + seq * a->k_sb * es, *vp = (const char *)a->v + seq * a->v_sb * es;
    const char *rows[DECODE_BLOCK], *head_rows[DECODE_BLOCK];
    const int64_t blocks = w / 8, fused = 8 * blocks, pieces = wn * heads, calls = blocks * heads;
    if (wn > 0) {
        tile_rows(rows, kp, jn, wn, a->k_ss, es, table_row, a->page, a->k_sb);
        head_pieces(sc->fetch_k, rows, wn, heads, a->k_sh, es);
        tile_rows(rows, vp, jn, wn, a->v_ss, es, table_row, a->page, a->v_sb);
        head_pieces(sc->fetch_v, rows, wn, heads, a->v_sh, es);
    }
    tile_rows(rows, kp, j0, w, a->k_ss, es, table_row, a->page, a->k_sb);
    const unsigned int csr = a->q16 ? dot_flush_begin() : 0;
    for (int64_t i = 0, c = 0; i < blocks; i++) {
        for (int64_t h = 0; h < heads; h++, c++) {
            /* The next tile's key pieces, spread evenly over the score calls in order. */
            const int64_t f0 = pieces * c / calls, f1 = pieces * (c + 1) / calls;
            if (f1 > f0)
                prefetch_rows(sc->fetch_k + f0, f1 - f0, dim, es, 0, 0);
            for (int64_t j = 0; j < 8; j++)
                head_rows[j] = rows[8 * i + j] + h * a->k_sh * es;
            float *s = sc->s + h * group * DECODE_BLOCK + 8 * i;
            if (a->q16) {
                const struct dot_keys keys = decode_dot_keys(a, head_rows, NULL, 8, &sc->dots);
                dot_scores(group, dim, &keys, 8, h * group, a->scale, s, DECODE_BLOCK, &sc->dots);
                continue;
            }
            const float *qp = qb + h * group * dim;
            for (int64_t h0 = 0; h0 < group; h0 += 4)
                pair_dots16_block8(qp + h0 * dim, group - h0 < 4 ? group - h0 : 4, dim, NULL, 0, head_rows, a->dtype,
                                   s + h0 * DECODE_BLOCK, DECODE_BLOCK);
        }
    }
    if (fused < w) {
        if (calls == 0)
            prefetch_rows(sc->fetch_k, pieces, dim, es, 0, 0);
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t j = fused; j < w; j++)
                head_rows[j] = rows[j] + h * a->k_sh * es;
            if (a->q16) {
                const struct dot_keys keys = decode_dot_keys(a, head_rows + fused, NULL, w - fused, &sc->dots);
                dot_scores(group, dim, &keys, w - fused, h * group, a->scale, sc->s + h * group * DECODE_BLOCK + fused,
                           DECODE_BLOCK, &sc->dots);
                continue;
            }
            for (int64_t j = fused; j < w; j += 2)
                decode_key_pairs(a, head_rows + j, NULL, w - j < 2 ? w - j : 2, NULL, sc->kbuf,
                                 sc->kpairs + (j - fused) / 2 * pair_floats(dim));
            pair_dots16(qb + h * group * dim, group, dim, sc->kpairs, w - fused,
                        sc->s + h * group * DECODE_BLOCK + fused, DECODE_BLOCK);
        }
    }
    if (a->q16)
        dot_flush_end(csr);
    tile_rows(rows, vp, j0, w, a->v_ss, es, table_row, a->page, a->v_sb);
    for (int64_t h = 0; h < heads; h++) {
        float *s = sc->s + h * group * DECODE_BLOCK, *corr = sc->corr + h * group;
        TILE_SOFTMAX(s, w, first, sc->m[h], sc->l[h], corr);
        for (int64_t j = 0; j < w; j++)
            head_rows[j] = rows[j] + h * a->v_sh * es;
        /* The next tile's value pieces, as many per head and one per key step (half_combine64's fetch). */
        const int64_t f0 = pieces * h / heads, f1 = pieces * (h + 1) / heads;
        const struct fetch_ahead ahead = {{sc->fetch_v + f0, NULL}, {f1 - f0, 0}};
        half_combine64(s, DECODE_BLOCK, group, w, head_rows, a->dtype, a->dim_v, first ? NULL : corr, sc->acc[h],
                       &ahead);
    }
}

/* One work item as decode_item_run's tile-by-tile order, each tile's kv heads at once (decode_heads_tile). */
__attribute__((noinline)) static void decode_heads_item(const struct decode_args *a, const struct decode_item *it,
                                                        const float *q, float *part_acc, float *part_m,
                                                        float *part_l, struct decode_scratch *sc) {
    const int64_t heads = a->heads_kv, group = a->group, per_chunk = group * a->dim_v;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t pair = it->batch * heads + h;
        const int64_t at = it->chunks == 1 ? pair : it->slot + h * it->chunks + it->chunk;
        sc->acc[h] = it->chunks == 1 ? a->out + at * per_chunk : part_acc + at * per_chunk;
        sc->m[h] = (it->chunks == 1 ? a->row_max : part_m) + at * group;
        sc->l[h] = (it->chunks == 1 ? a->row_sum : part_l) + at * group;
    }
    if (a->q16)
        dot_query(a->q16 + it->batch * heads * group * a->dim, heads * group, a->dim, &sc->dots);
    for (int64_t j0 = it->j0; j0 < it->j1; j0 += DECODE_BLOCK) {
        const int64_t w = it->j1 - j0 < DECODE_BLOCK ? it->j1 - j0 : DECODE_BLOCK;
        /* The tile to come: the range's next, or past its end the sequence's next chunk's first (the work item one
         * thread takes next). */
        const int64_t jn = j0 + w, end = jn < it->j1 ? it->j1 : it->length;
        const int64_t wn = end - jn < DECODE_BLOCK ? end - jn : DECODE_BLOCK;
        touch_tile_pages(a, it, 0, j0 + DECODE_PAGE_AHEAD * DECODE_BLOCK);
        decode_heads_tile(a, it->batch, j0, w, jn, wn, j0 == it->j0, a->q16 ? NULL : q + it->batch * heads * group * a->dim,
                          sc);
    }
}

/* One work item: each kv head's tiles of its range in order. Its results go to the output rows (an unsplit entry)
 * or to the partial sums of its chunk. */
static void decode_item_run(const struct decode_args *a, const struct decode_item *it, const float *q,
                            float *part_acc, float *part_m, float *part_l, struct decode_scratch *sc) {
    const int64_t group = a->group, per_chunk = group * a->dim_v, heads_kv = a->heads_kv;
    /* The query rows row_dots scores, packed once per item: with q8, its rope rows. */
    const int64_t packed_dim = a->q8 ? a->dim_r : a->dim;
    const float *packed_rows = a->q8 ? a->q8_rope : q;
    const int64_t packed_size = sc->packed ? packed_floats16(group, packed_dim) : 0;
    for (int64_t h = 0; h < heads_kv && sc->packed; h++)
        pack_heads16(packed_rows + (it->batch * heads_kv + h) * group * packed_dim, group / 8, packed_dim,
                     sc->packed + h * packed_size);
    /* Tile by tile, each for every kv head in turn, where a position's heads are adjacent (BSH, paged BSH): each
     * tile then reads whole runs of memory rather than one head's slice of every row (2x slower than BNSD when it
     * did). Head by head where a head's rows are adjacent (BNSD): its next tile, which decode_tile fetches, comes
     * next (tile by tile it came N2 tiles later: bf16 BNSD 24.7 -> 23.3 ms, B 8, N 32/8, Skv 8192, D 128, one
     * thread). The order of each head's sums is the same either way (and in decode_heads_item, which takes the
     * items instead where heads_items_fit: each tile's kv heads at once). */
    const int64_t tiles = (it->j1 - it->j0 + DECODE_BLOCK - 1) / DECODE_BLOCK;
    const int heads_outer = !heads_adjacent(a);
    for (int64_t x = 0; x < tiles * heads_kv; x++) {
        const int64_t h = heads_outer ? x / tiles : x % heads_kv;
        const int64_t j0 = it->j0 + (heads_outer ? x % tiles : x / heads_kv) * DECODE_BLOCK;
        const int64_t w = it->j1 - j0 < DECODE_BLOCK ? it->j1 - j0 : DECODE_BLOCK;
        /* The tile to fetch: DECODE_AHEAD tiles on in the same head; head by head, past the head's last tile, the
         * next head's first (unfetched, the first tiles cost bf16 BNSD 23.2 -> 21.1 ms, B 8, N 32/8, Skv 8192, D 128,
         * one thread). */
        int64_t hn = h, jn = j0 + DECODE_AHEAD * DECODE_BLOCK, end = it->j1;
        if (heads_outer && jn >= it->j1 && h + 1 < heads_kv) {
            hn = h + 1;
            jn = it->j0 + (jn - it->j1) / DECODE_BLOCK * DECODE_BLOCK;
        } else if (jn >= it->j1 && it->j1 < it->length) {
            /* Past the range's end: the sequence's next chunk's first tile (head 0 when head by head), the work
             * item one thread takes next. */
            hn = heads_outer ? 0 : h;
            jn = it->j1;
            end = it->length;
        }
        const int64_t ahead = end - jn;
        const int64_t wn = ahead < DECODE_BLOCK ? ahead : DECODE_BLOCK;
        const int64_t pair = it->batch * heads_kv + h;
        const int64_t at = it->chunks == 1 ? pair : it->slot + h * it->chunks + it->chunk;
        float *acc = it->chunks == 1 ? a->out + at * per_chunk : part_acc + at * per_chunk;
        float *m = (it->chunks == 1 ? a->row_max : part_m) + at * group;
        float *l = (it->chunks == 1 ? a->row_sum : part_l) + at * group;
        /* Tile by tile, the range's first tiles have no earlier tile of their head to fetch them: each fetches the
         * next head's too (same positions; bf16 BSH 24.7 -> 23.6 ms, B 8, N 32/8, Skv 8192, D 128, one thread). */
        const int64_t h2 = !heads_outer && j0 == it->j0 && h + 1 < heads_kv ? h + 1 : h;
        /* Tile by tile, the kv heads of a position share its pages: the first head touches them for all. */
        if (heads_outer || h == 0)
            touch_tile_pages(a, it, h, j0 + DECODE_PAGE_AHEAD * DECODE_BLOCK);
        decode_tile(a, it->batch, h, j0, w, hn, jn, wn, h2, h2 != h ? w : 0, j0 == it->j0,
                    a->q16 || a->q8 ? NULL : q + pair * group * a->dim,
                    sc->packed ? sc->packed + h * packed_size : NULL, acc, m, l, sc);
    }
}

/* A split entry's chunks combined in chunk order into its output rows, kv head by kv head: chunk c's (m_c, l_c,
 * acc_c) joins the running (m, l, acc) as shift = max(m, m_c) (0 while both are -inf), a = 2^((m - shift) log2e),
 * b = 2^((m_c - shift) log2e), l = fma(l, a, l_c b), acc = fma(acc, a, acc_c b) per element. */
static void decode_combine(const struct decode_args *a, const struct decode_item *first, const float *part_acc,
                           const float *part_m, const float *part_l) {
    const int64_t group = a->group, dv = a->dim_v;
    for (int64_t h = 0; h < a->heads_kv; h++) {
        const int64_t pair = first->batch * a->heads_kv + h, slot = first->slot + h * first->chunks;
        float *acc = a->out + pair * group * dv, *m = a->row_max + pair * group, *l = a->row_sum + pair * group;
        for (int64_t g = 0; g < group; g++) {
            float mg = part_m[slot * group + g], lg = part_l[slot * group + g];
            float *ag = acc + g * dv;
            memcpy(ag, part_acc + (slot * group + g) * dv, sizeof(float) * dv);
            for (int64_t c = 1; c < first->chunks; c++) {
                const int64_t sc = (slot + c) * group + g;
                const float m_new = max_nan(mg, part_m[sc]);
                const float shift = m_new == -INFINITY ? 0.0f : m_new;
                const float fa = exp2f((mg - shift) * a->log2e), fb = exp2f((part_m[sc] - shift) * a->log2e);
                const float *ac = part_acc + sc * dv;
                lg = fmaf(lg, fa, part_l[sc] * fb);
                for (int64_t d = 0; d < dv; d++)
                    ag[d] = fmaf(ag[d], fa, ac[d] * fb);
                mg = m_new;
            }
            m[g] = mg;
            l[g] = lg;
        }
    }
}

/* Chunks of a sequence of n keys: DECODE_SPLIT keys each, the last one shorter. */
static int64_t decode_chunks(int64_t n) { return n <= 0 ? 0 : (n + DECODE_SPLIT - 1) / DECODE_SPLIT; }

/* fia_decode_rows's work loop and combine for the work items of a call that heads_items_fit, with
 * decode_heads_item's scratch: a parallel region of its own, so that the other calls' loop (BNSD's) compiles as it
 * did (dispatched from inside decode_item_run, bf16 BNSD decode measured up to ~3% slower, one long sequence ~2-4%:
 * B 8 / 1, N 32/8, Skv 8192 / 65536, D 128, one thread, alternated in one process). */
__attribute__((noinline)) static void decode_heads_items(const struct decode_args *a, const struct decode_item *work,
                                                         int64_t n_items, const float *q, float *part_acc,
                                                         float *part_m, float *part_l) {
    const int64_t heads = a->heads_kv, group = a->group, dim = a->dim;
#pragma omp parallel
    {
        struct decode_scratch sc = {0};
        sc.kbuf = malloc(sizeof(float) * 2 * dim);
        sc.s = malloc(sizeof(float) * heads * group * DECODE_BLOCK);
        sc.corr = malloc(sizeof(float) * heads * group);
        if (a->q16) /* every kv head's query rows */
            dot_scratch_alloc(&sc.dots, heads * group, dim);
        else
            sc.kpairs = aligned_alloc(64, sizeof(float) * DECODE_BLOCK / 2 * pair_floats(dim));
        sc.acc = malloc(sizeof(float *) * heads);
        sc.m = malloc(sizeof(float *) * heads);
        sc.l = malloc(sizeof(float *) * heads);
        sc.fetch_k = malloc(sizeof(char *) * DECODE_BLOCK * heads);
        sc.fetch_v = malloc(sizeof(char *) * DECODE_BLOCK * heads);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++)
            decode_heads_item(a, work + i, q, part_acc, part_m, part_l, &sc);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++)
            if (work[i].chunks > 1 && work[i].chunk == 0)
                decode_combine(a, work + i, part_acc, part_m, part_l);
        if (a->q16)
            dot_scratch_free(&sc.dots);
        free(sc.fetch_v);
        free(sc.fetch_k);
        free(sc.l);
        free(sc.m);
        free(sc.acc);
        free(sc.kpairs);
        free(sc.corr);
        free(sc.s);
        free(sc.kbuf);
    }
}

void fia_decode_rows(const float *q, int64_t pairs, int64_t heads_kv, int64_t group, int64_t dim, int64_t dim_v,
                     const void *k, const void *v, int64_t dtype, int64_t k_sb, int64_t k_sh, int64_t k_ss,
                     int64_t v_sb, int64_t v_sh, int64_t v_ss, const int64_t *len, float *out, float *row_max,
                     float *row_sum, const int32_t *table, int64_t table_stride, int64_t page,
                     const float *k_scale, const float *v_scale, int64_t k_c0, int64_t k_cs, int64_t v_c0,
                     int64_t v_cs, const void *r, int64_t r_dtype, int64_t dim_r, int64_t r_sb, int64_t r_sh, int64_t r_ss,
                     int64_t r_c0, int64_t r_cs, float log2e, float floor2, const uint16_t *q16, float scale,
                     const int8_t *q8, const float *q8_rope, const float *q8_factor, const int32_t *q8_bias) {
    const struct decode_args a = {k, v, dtype, dtype == 0 ? 4 : dtype <= 2 ? 2 : 1, heads_kv, group, dim, dim_v,
                                  k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, table, table_stride, page, k_scale, v_scale,
                                  k_c0, k_cs, v_c0, v_cs, r, r_dtype, r_dtype == 0 ? 4 : 2, r ? dim_r : 0, r_sb, r_sh, r_ss, r_c0, r_cs, log2e,
                                  floor2, out, row_max, row_sum, q16, scale, q8, q8_rope, q8_factor, q8_bias};
    const int64_t per_slot = group * dim_v, batch = heads_kv > 0 ? pairs / heads_kv : 0;
    /* Batch entries go in waves whose split chunks' partial sums fit DECODE_PARTIAL_FLOATS (a wave holds one entry
     * at least): the waves change no result, only the scratch a call needs. */
    for (int64_t b0 = 0; b0 < batch;) {
        int64_t b1 = b0, items = 0, slots = 0;
        for (; b1 < batch; b1++) {
            const int64_t c = decode_chunks(len[b1]), add = c > 1 ? c : 0;
            if (b1 > b0 && (slots + add * heads_kv) * per_slot > DECODE_PARTIAL_FLOATS)
                break;
            items += c;
            slots += add * heads_kv;
        }
        struct decode_item *work = malloc(sizeof(struct decode_item) * (items > 0 ? items : 1));
        int64_t n_items = 0;
        for (int64_t b = b0, slot = 0; b < b1; b++) {
            const int64_t n = len[b], c = decode_chunks(n);
            for (int64_t i = 0; i < c; i++) {
                const int64_t j1 = (i + 1) * DECODE_SPLIT < n ? (i + 1) * DECODE_SPLIT : n;
                work[n_items++] = (struct decode_item){b, i * DECODE_SPLIT, j1, i, c, c > 1 ? slot : -1, n};
            }
            slot += c > 1 ? c * heads_kv : 0;
        }
        float *part_acc = slots ? malloc(sizeof(float) * slots * per_slot) : NULL;
        float *part_m = slots ? malloc(sizeof(float) * slots * group) : NULL;
        float *part_l = slots ? malloc(sizeof(float) * slots * group) : NULL;
        if (heads_items_fit(&a))
            decode_heads_items(&a, work, n_items, q, part_acc, part_m, part_l);
        else
#pragma omp parallel
        {
            struct decode_scratch sc;
            sc.kbuf = malloc(sizeof(float) * DECODE_BLOCK * (dim > 2 ? dim : 2));
            sc.vbuf = malloc(sizeof(float) * DECODE_BLOCK * dim_v);
            sc.s = malloc(sizeof(float) * group * DECODE_BLOCK);
            sc.corr = malloc(sizeof(float) * group);
            for (int64_t j = 0; j < DECODE_BLOCK; j++)
                sc.iota[j] = j;
            if (q16)
                dot_scratch_alloc(&sc.dots, group, dim);
            /* Scores: of bf16 query rows, dot_scores; else with AVX-512, from key pairs where G is not a multiple of 8
             * (pair_dots16), else by row_dots16 from the queries packed once per item; row_dots otherwise. */
            sc.kpairs = use_avx512 && group % 8 != 0 && !q16 && !q8
                            ? aligned_alloc(64, sizeof(float) * DECODE_BLOCK / 2 * pair_floats(dim)) : NULL;
            /* With q8: its rope rows packed (int8_query_scores). */
            const int64_t packed_dim = q8 ? a.dim_r : dim;
            sc.packed = use_avx512 && !sc.kpairs && !q16 && packed_dim > 0
                            ? aligned_alloc(64, sizeof(float) * heads_kv * packed_floats16(group, packed_dim)) : NULL;
            sc.idots = q8 ? malloc(sizeof(int32_t) * group * DECODE_BLOCK) : NULL;
            sc.rope_s = q8 ? malloc(sizeof(float) * group * DECODE_BLOCK) : NULL;
            sc.keys8 = q8 ? malloc((size_t)DECODE_BLOCK * (dim - a.dim_r)) : NULL;
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_items; i++)
                decode_item_run(&a, work + i, q, part_acc, part_m, part_l, &sc);
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_items; i++)
                if (work[i].chunks > 1 && work[i].chunk == 0)
                    decode_combine(&a, work + i, part_acc, part_m, part_l);
            if (q16)
                dot_scratch_free(&sc.dots);
            free(sc.keys8);
            free(sc.rope_s);
            free(sc.idots);
            free(sc.packed);
            free(sc.kpairs);
            free(sc.corr);
            free(sc.s);
            free(sc.vbuf);
            free(sc.kbuf);
        }
        free(part_l);
        free(part_m);
        free(part_acc);
        free(work);
        b0 = b1;
    }
}
