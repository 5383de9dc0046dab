/* Decode scores of an int8 MLA query (FusedInferAttentionScore v2, query_quant_mode 3) over an int8 latent cache
 * (docs/operators/fused_infer_attention_score.md, "int8 MLA query"): the latent part of a score is the integer dot
 * product q8 . k8, summed in int32. With D <= 512, |q8 . k8| <= 512 * 128 * 128 = 2^23, so the sum is exact in any
 * order and its conversion to fp32 is exact: AVX512-VNNI (VPDPBUSD) and the AVX2 integer loop give the same bits.
 *
 * VPDPBUSD multiplies unsigned bytes by signed bytes: the key bytes are made unsigned by flipping their sign bit
 * (k + 128), and 128 * sum(q8) of each query row (`bias`, computed once per call) is taken off again:
 * sum (k + 128) q = q . k + 128 sum q. Each 32-bit lane sums four products of at most 255 * 128, so a row of up to
 * 2^16 columns cannot wrap. */

/* Keys per int8_dots call at most. */
#define INT8_DOT_KEYS 64

static int use_int8_vnni = 0; /* VPDPBUSD (cann_attn_set_int8_dot); 0: the integer loop */

/* 1 (where the CPU has AVX512-VNNI and AVX512-BW) or 0: whether the int8 query's scores take VPDPBUSD instead of the
 * integer loop (the same bits either way); returns the setting now in force. */
int cann_attn_set_int8_dot(int on) {
    __builtin_cpu_init();
    use_int8_vnni = on && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    return use_int8_vnni;
}

/* The query rows of the block of 4 heads from h0 into r (past the last head, its first row again, whose sums are not
 * stored); returns how many of the 4 are heads. */
static inline int64_t head_block(const int8_t *q, int64_t heads, int64_t dk, int64_t h0, const int8_t *r[4]) {
    const int64_t nh = heads - h0 < 4 ? heads - h0 : 4;
    for (int64_t h = 0; h < 4; h++)
        r[h] = q + (h0 + (h < nh ? h : 0)) * dk;
    return nh;
}

/* Sums of the 16 vectors c[4 h + k] into lane 4 h + k of one vector (integer sums: any order is the same). */
__attribute__((target("avx512f,avx512bw"))) static inline __m512i sum_lanes16(const __m512i *c) {
    __m512i pair[8], quad[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pair[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(c[2 * i], c[2 * i + 1]),
                                   _mm512_unpackhi_epi32(c[2 * i], c[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [a, b, c, d] */
        quad[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pair[2 * i], pair[2 * i + 1]),
                                   _mm512_unpackhi_epi64(pair[2 * i], pair[2 * i + 1]));
    const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(quad[0], quad[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(quad[0], quad[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(quad[2], quad[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(quad[2], quad[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[g * ld + j] = q[g] . key j (int32) for g < heads, j < nk: q [heads, dk] int8, keys[j] dk bytes each, their sign
 * bits flipped (k + 128 as unsigned bytes), bias[g] = 128 * sum(q[g]). Blocks of 4 heads x 4 keys, 16 sums in
 * registers, 64 columns a step (the last step masked). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void int8_dots_vnni(const int8_t *q, int64_t heads,
                                                                                 int64_t dk, const uint8_t *const *keys,
                                                                                 int64_t nk, const int32_t *bias,
                                                                                 int32_t *out, int64_t ld) {
    for (int64_t j0 = 0; j0 < nk; j0 += 4) {
        const int64_t nj = nk - j0 < 4 ? nk - j0 : 4;
        const uint8_t *k[4];
        for (int64_t j = 0; j < 4; j++)
            k[j] = keys[j0 + (j < nj ? j : 0)];
        for (int64_t h0 = 0; h0 < heads; h0 += 4) {
            const int8_t *r[4];
            const int64_t nh = head_block(q, heads, dk, h0, r);
            __m512i c[16];
            for (int i = 0; i < 16; i++)
                c[i] = _mm512_setzero_si512();
            for (int64_t d = 0; d < dk; d += 64) {
                const __mmask64 live = dk - d >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (dk - d)) - 1);
                const __m512i x0 = _mm512_maskz_loadu_epi8(live, k[0] + d);
                const __m512i x1 = _mm512_maskz_loadu_epi8(live, k[1] + d);
                const __m512i x2 = _mm512_maskz_loadu_epi8(live, k[2] + d);
                const __m512i x3 = _mm512_maskz_loadu_epi8(live, k[3] + d);
                for (int h = 0; h < 4; h++) {
                    const __m512i y = _mm512_maskz_loadu_epi8(live, r[h] + d);
                    c[4 * h] = _mm512_dpbusd_epi32(c[4 * h], x0, y);
                    c[4 * h + 1] = _mm512_dpbusd_epi32(c[4 * h + 1], x1, y);
                    c[4 * h + 2] = _mm512_dpbusd_epi32(c[4 * h + 2], x2, y);
                    c[4 * h + 3] = _mm512_dpbusd_epi32(c[4 * h + 3], x3, y);
                }
            }
            int32_t sums[16];
            _mm512_storeu_si512((void *)sums, sum_lanes16(c));
            for (int64_t h = 0; h < nh; h++)
                for (int64_t j = 0; j < nj; j++)
                    out[(h0 + h) * ld + j0 + j] = sums[4 * h + j] - bias[h0 + h];
        }
    }
}

/* The same integers from the signed key bytes as they are (keys[j] unflipped), with AVX2 (which the library
 * requires): 16 columns a step sign-extended to 16 bits, VPMADDWD's exact products summed in pairs into int32 lanes
 * (each lane's sum at most dk / 8 * 2 * 2^14 in magnitude), blocks of 4 heads x 2 keys; the last dk % 16 columns in
 * a scalar loop. */
__attribute__((target("avx2"))) static void int8_dots_loop(const int8_t *q, int64_t heads, int64_t dk,
                                                           const int8_t *const *keys, int64_t nk, int32_t *out,
                                                           int64_t ld) {
    const int64_t body = dk / 16 * 16;
    for (int64_t j0 = 0; j0 < nk; j0 += 2) {
        const int64_t nj = nk - j0 < 2 ? nk - j0 : 2;
        const int8_t *k0 = keys[j0], *k1 = keys[j0 + (nj > 1 ? 1 : 0)];
        for (int64_t h0 = 0; h0 < heads; h0 += 4) {
            const int8_t *r[4];
            const int64_t nh = head_block(q, heads, dk, h0, r);
            __m256i c[8];
            for (int i = 0; i < 8; i++)
                c[i] = _mm256_setzero_si256();
            for (int64_t d = 0; d < body; d += 16) {
                const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k0 + d)));
                const __m256i x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k1 + d)));
                for (int h = 0; h < 4; h++) {
                    const __m256i y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(r[h] + d)));
                    c[2 * h] = _mm256_add_epi32(c[2 * h], _mm256_madd_epi16(x0, y));
                    c[2 * h + 1] = _mm256_add_epi32(c[2 * h + 1], _mm256_madd_epi16(x1, y));
                }
            }
            int32_t lanes[8];
            for (int64_t h = 0; h < nh; h++)
                for (int64_t j = 0; j < nj; j++) {
                    _mm256_storeu_si256((__m256i *)lanes, c[2 * h + j]);
                    int32_t sum = 0;
                    for (int i = 0; i < 8; i++)
                        sum += lanes[i];
                    const int8_t *x = j ? k1 : k0;
                    for (int64_t d = body; d < dk; d++)
                        sum += (int32_t)x[d] * (int32_t)r[h][d];
                    out[(h0 + h) * ld + j0 + j] = sum;
                }
        }
    }
}

/* Key row `src` (dk int8 values; NZ: chunks of c0 values chunk_stride bytes apart, c0 = 0: contiguous) into dst,
 * sign bits flipped where `flip`. */
static void gather_int8_row(const int8_t *src, int64_t dk, int64_t c0, int64_t chunk_stride, int flip, uint8_t *dst) {
    const int64_t piece = c0 > 0 ? c0 : dk;
    for (int64_t c = 0; c < dk; c += piece) {
        const int8_t *from = src + (c0 > 0 ? (c / c0) * chunk_stride : 0);
        for (int64_t d = 0; d < piece; d++)
            dst[c + d] = (uint8_t)from[d] ^ (flip ? 0x80u : 0u);
    }
}

/* out[g * ld + j] = q[g] . key j, the int32 dot products of int8 rows for g < heads, j < nk <= INT8_DOT_KEYS (keys[j]:
 * dk values, NZ chunks of c0 values chunk_stride bytes apart, c0 = 0: contiguous; bias[g] = 128 * sum(q[g])), by
 * VPDPBUSD or the loop; `work` (nk * dk bytes) holds the keys gathered (flipped for VPDPBUSD) where they are not read
 * in place. */
static void int8_dots(const int8_t *q, int64_t heads, int64_t dk, const int8_t *const *keys, int64_t nk, int64_t c0,
                      int64_t chunk_stride, const int32_t *bias, uint8_t *work, int32_t *out, int64_t ld) {
    const int8_t *rows[INT8_DOT_KEYS];
    if (!use_int8_vnni && c0 <= 0) {
        int8_dots_loop(q, heads, dk, keys, nk, out, ld);
        return;
    }
    for (int64_t j = 0; j < nk; j++) {
        gather_int8_row(keys[j], dk, c0, chunk_stride, use_int8_vnni, work + j * dk);
        rows[j] = (const int8_t *)(work + j * dk);
    }
    if (use_int8_vnni)
        int8_dots_vnni(q, heads, dk, (const uint8_t *const *)rows, nk, bias, out, ld);
    else
        int8_dots_loop(q, heads, dk, rows, nk, out, ld);
}

/* Test entry: out [heads, n] = q [heads, dim] . k [n, dim] (int8 rows, contiguous) in int32, through VPDPBUSD
 * (emulate 0, where the CPU has it) or the integer loop (1). Returns 0, or -1 if VPDPBUSD was asked for but is not
 * there. */
int cann_attn_int8_dots(const int8_t *q, const int8_t *k, int64_t heads, int64_t n, int64_t dim, int emulate,
                        int32_t *out) {
    const int saved = use_int8_vnni;
    if (!emulate && !cann_attn_set_int8_dot(1))
        return -1;
    use_int8_vnni = !emulate;
    int32_t *bias = malloc(sizeof(int32_t) * (heads > 0 ? heads : 1));
    for (int64_t g = 0; g < heads; g++) {
        int32_t sum = 0;
        for (int64_t d = 0; d < dim; d++)
            sum += q[g * dim + d];
        bias[g] = 128 * sum;
    }
    const int8_t **rows = malloc(sizeof(int8_t *) * (n > 0 ? n : 1));
    for (int64_t j = 0; j < n; j++)
        rows[j] = k + j * dim;
    uint8_t *work = malloc((size_t)(INT8_DOT_KEYS * dim > 0 ? INT8_DOT_KEYS * dim : 1));
    for (int64_t j0 = 0; j0 < n; j0 += INT8_DOT_KEYS)
        int8_dots(q, heads, dim, rows + j0, n - j0 < INT8_DOT_KEYS ? n - j0 : INT8_DOT_KEYS, 0, 0, bias, work, out + j0,
                  n);
    free(work);
    free(rows);
    free(bias);
    use_int8_vnni = saved;
    return 0;
}
