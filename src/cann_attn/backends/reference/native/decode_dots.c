/* Decode scores of bf16 query rows against bf16 keys: AVX512-BF16 dot products (VDPBF16PS) straight from the cache
 * rows, or, on CPUs without the instruction, an emulation that gives the same bits (16 lanes with AVX-512F, 8 with
 * AVX2; docs/guides/backends.md, "Decode").
 *
 * Part of the attention_loops.c translation unit (included there, after bf16_scores.c and before decode.c; not
 * compiled alone).
 *
 * The order of a score s = scale * (q . k) over `dim` columns, the same on every CPU:
 *   - the columns go in chunks of 32 (zeros past dim); lane l (0..15) of chunk c adds column 32c + 2l + 1, then
 *     column 32c + 2l: acc_l = fma(q, k, acc_l) for each, rounded to nearest even, chunks in increasing c, every
 *     acc_l from +0 (VDPBF16PS's own order, checked bit for bit on the instruction: tests/test_decode_dots.py);
 *   - the 16 lanes are added in one tree: x_i + x_{i+8} (i < 8), then x_i + x_{i+4}, x_i + x_{i+2}, x_0 + x_1 (hsum's
 *     order);
 *   - the sum times scale, rounded once (the unscaled bf16 query: the fused forward's bf16 scores do the same);
 *   - subnormals are flushed throughout: bf16 subnormal inputs count as zeros of their sign and any subnormal result
 *     (a lane's partial sum, a sum of the tree, the scaled score) becomes a zero of its sign. The instruction does so
 *     in its chains whatever MXCSR says; MXCSR's DAZ and FTZ are set around the scores (dot_flush_begin), so the
 *     emulation's FMAs and every path's tree and scaling do the same, whatever the caller's MXCSR.
 */

/* Columns per chunk (32 bf16: one 512-bit vector, 16 lanes of pairs) and keys per scoring step. */
#define DOT_CHUNK 32
#define DOT_STEP 16
/* MXCSR's denormals-are-zero and flush-to-zero bits. */
#define MXCSR_DAZ_FTZ 0x8040u

static int use_bf16_dot = 0; /* VDPBF16PS (cann_attn_set_bf16_dot); 0: the emulation */

/* 1 (where the CPU has AVX512-BF16 and AVX512-BW) or 0: whether the decode scores take VDPBF16PS instead of its
 * emulation (the same bits either way); returns the setting now in force. */
int cann_attn_set_bf16_dot(int on) {
    use_bf16_dot = on && cann_attn_has_bf16_dot() && __builtin_cpu_supports("avx512bw");
    return use_bf16_dot;
}

static int64_t dot_chunks(int64_t dim) { return (dim + DOT_CHUNK - 1) / DOT_CHUNK; }

/* Columns of a row's last chunk (1..32). */
static int64_t dot_tail(int64_t dim) { return dim - (dot_chunks(dim) - 1) * DOT_CHUNK; }

/* Where a step's keys are read: key k's chunk c at lat[k] + c chunks (c < split) or rope[k] + (c - split) chunks,
 * the last chunk `tail` columns wide (1..32; zeros after them). */
struct dot_keys {
    const char *const *lat, *const *rope;
    int64_t split, chunks, tail;
};

static inline const uint16_t *dot_chunk(const struct dot_keys *keys, int64_t k, int64_t c) {
    return c < keys->split ? (const uint16_t *)keys->lat[k] + c * DOT_CHUNK
                           : (const uint16_t *)keys->rope[k] + (c - keys->split) * DOT_CHUNK;
}

/* The G query rows q [G, dim] (bf16) for the instruction: each row in whole chunks, zeros past dim (q16 [G, chunks *
 * 32], 64-byte aligned). */
static void pack_query16(const uint16_t *q, int64_t group, int64_t dim, uint16_t *q16) {
    const int64_t width = dot_chunks(dim) * DOT_CHUNK;
    for (int64_t g = 0; g < group; g++) {
        memcpy(q16 + g * width, q + g * dim, sizeof(uint16_t) * dim);
        memset(q16 + g * width + dim, 0, sizeof(uint16_t) * (width - dim));
    }
}

/* A chunk of a bf16 row (`valid` columns of src, 1..32, zeros after) as fp32: the odd (o) and even (e) columns of
 * lanes 0-7 (o0, e0) and 8-15 (o1, e1): the high half of each 32-bit word, and the low half shifted up. */
struct key_lanes {
    __m256 o0, e0, o1, e1;
};

__attribute__((target("avx2,fma"))) static inline struct key_lanes chunk_lanes(const uint16_t *src, int64_t valid) {
    uint16_t part[DOT_CHUNK];
    if (valid < DOT_CHUNK) {
        memset(part, 0, sizeof part);
        memcpy(part, src, sizeof(uint16_t) * valid);
        src = part;
    }
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)src), w1 = _mm256_loadu_si256((const __m256i *)(src + 16));
    return (struct key_lanes){_mm256_castsi256_ps(_mm256_and_si256(w0, high)),
                              _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)),
                              _mm256_castsi256_ps(_mm256_and_si256(w1, high)),
                              _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16))};
}

/* chunk_lanes's vectors stored in pack_query_lanes's layout: the 16 odd columns, then the 16 even ones. */
__attribute__((target("avx2,fma"))) static inline void store_lanes(struct key_lanes x, float *to) {
    _mm256_storeu_ps(to, x.o0);
    _mm256_storeu_ps(to + 8, x.o1);
    _mm256_storeu_ps(to + 16, x.e0);
    _mm256_storeu_ps(to + 24, x.e1);
}

/* The G query rows for the emulation, widened: per row and chunk c, 16 floats of the odd columns (lane l: column
 * 32c + 2l + 1) then 16 of the even ones (32c + 2l), zeros past dim (qe [G, chunks * 32]). */
static void pack_query_lanes(const uint16_t *q, int64_t group, int64_t dim, float *qe) {
    const int64_t chunks = dot_chunks(dim);
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++)
            store_lanes(chunk_lanes(q + g * dim + c * DOT_CHUNK, c + 1 < chunks ? DOT_CHUNK : dot_tail(dim)),
                        qe + (g * chunks + c) * DOT_CHUNK);
}

/* A block's 16 sums (sum (h, k) in accumulator 4 (L % 4) + L / 4, L = h KB + k) reduced, each in the tree above,
 * by the transposed reduction (the halves: dot_halves, then hsum_pairs8: dot_sums_store), which leaves sum (h, k) in
 * lane L; times scale, stored to s[h * lds + k] for h < nh, k < nk. */
__attribute__((target("avx512f"), always_inline)) static inline void dot_halves(const __m512 *acc, __m512 *half) {
#define HALVES16(x, y) _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE))
    for (int v = 0; v < 8; v++)
        half[v] = HALVES16(acc[2 * v], acc[2 * v + 1]);
#undef HALVES16
}

__attribute__((target("avx512f"), always_inline)) static inline void dot_sums_store(const __m512 *half, int kb,
                                                                                    int64_t nh, int64_t nk,
                                                                                    float scale, float *s,
                                                                                    int64_t lds) {
    const __m512 sums = hsum_pairs8(half[0], half[1], half[2], half[3], half[4], half[5], half[6], half[7]);
    const __m512 scaled = _mm512_mul_ps(sums, _mm512_set1_ps(scale));
    if (kb == 4 && nk == 4) {
        /* A whole 4-key row per head: plain 128-bit stores of the lanes (the masked 512-bit stores below measured
         * the scores ~3% slower, bf16 paged BSH, B 1, N 32/8, Skv 256, D 128, cache in L2). */
        _mm_storeu_ps(s, _mm512_castps512_ps128(scaled));
        if (nh > 1)
            _mm_storeu_ps(s + lds, _mm512_extractf32x4_ps(scaled, 1));
        if (nh > 2)
            _mm_storeu_ps(s + 2 * lds, _mm512_extractf32x4_ps(scaled, 2));
        if (nh > 3)
            _mm_storeu_ps(s + 3 * lds, _mm512_extractf32x4_ps(scaled, 3));
        return;
    }
    for (int64_t h = 0; h < nh; h++) /* lanes [h KB, h KB + nk) to s[h lds ..] */
        _mm512_mask_storeu_ps(s + h * lds - h * kb, (__mmask16)(((1u << nk) - 1) << (h * kb)), scaled);
}

__attribute__((target("avx512f"), always_inline)) static inline void dot_block_store(const __m512 *acc, int kb,
                                                                                     int64_t nh, int64_t nk,
                                                                                     float scale, float *s,
                                                                                     int64_t lds) {
    __m512 half[8];
    dot_halves(acc, half);
    dot_sums_store(half, kb, nh, nk, scale, s, lds);
}

/* The 16-lane kernels, one per flavour: BLOCK scores HB heads (query rows `width` elements apart) x KB keys (HB * KB
 * = 16 sums in registers), keys read in place (rows and keys past nh / nk repeat the first; their sums are dropped);
 * STEP scores heads [0, group) against a step's nk (<= DOT_STEP) keys in blocks of 4 heads x 4 keys, a last pair of
 * heads x 8 keys or a single head x 16 keys. A flavour gives its query vector type Q_T loaded by LOAD_Q, its key
 * vector type K_T made from a chunk's 32 bf16 by KEY, and MAC (one chunk into one accumulator). The key loop is
 * unrolled for every KB: left rolled (GCC did for KB 8 and 16), the accumulators lived in memory and a single head's
 * scores took 7.5-7.9 instead of 4.6-4.8 ns per key (D 128, cache in L1/L2). */
#define DEFINE_DOT_KERNELS(BLOCK, STEP, TARGET, Q_ELEM, Q_T, LOAD_Q, K_T, KEY, MAC)                                  \
    __attribute__((target(TARGET), always_inline)) static inline void BLOCK(                                         \
        const Q_ELEM *q, int64_t width, const struct dot_keys *keys, int64_t k0, int hb, int kb, int64_t nh,         \
        int64_t nk, float scale, float *s, int64_t lds) {                                                            \
        __m512 acc[16];                                                                                              \
        for (int v = 0; v < 16; v++)                                                                                 \
            acc[v] = _mm512_setzero_ps();                                                                            \
        const __mmask32 last = keys->tail >= DOT_CHUNK ? ~(__mmask32)0 : (__mmask32)((1u << keys->tail) - 1);       \
        for (int64_t c = 0; c < keys->chunks; c++) {                                                                 \
            const __mmask32 m = c + 1 < keys->chunks ? ~(__mmask32)0 : last;                                         \
            Q_T qv[4];                                                                                               \
            for (int h = 0; h < hb; h++)                                                                             \
                qv[h] = LOAD_Q(q + (h < nh ? h : 0) * width + c * DOT_CHUNK);                                        \
            _Pragma("GCC unroll 16") for (int k = 0; k < kb; k++) {                                                  \
                const K_T kv = KEY(_mm512_maskz_loadu_epi16(m, dot_chunk(keys, k0 + (k < nk ? k : 0), c)));          \
                for (int h = 0; h < hb; h++) {                                                                       \
                    const int lane = h * kb + k, v = 4 * (lane % 4) + lane / 4;                                     \
                    acc[v] = MAC(acc[v], qv[h], kv);                                                                 \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        dot_block_store(acc, kb, nh, nk, scale, s, lds);                                                             \
    }                                                                                                                \
    __attribute__((target(TARGET))) static void STEP(const Q_ELEM *q16, int64_t group, int64_t width,               \
                                                     const struct dot_keys *keys, int64_t nk, float scale, float *s, \
                                                     int64_t lds) {                                                  \
        for (int64_t h0 = 0; h0 < group;) {                                                                          \
            const int64_t left = group - h0;                                                                         \
            const Q_ELEM *q = q16 + h0 * width;                                                                      \
            if (left >= 3) {                                                                                         \
                const int64_t nh = left < 4 ? left : 4;                                                              \
                for (int64_t k0 = 0; k0 < nk; k0 += 4)                                                               \
                    BLOCK(q, width, keys, k0, 4, 4, nh, nk - k0 < 4 ? nk - k0 : 4, scale, s + h0 * lds + k0, lds);   \
                h0 += nh;                                                                                            \
            } else if (left == 2) {                                                                                  \
                for (int64_t k0 = 0; k0 < nk; k0 += 8)                                                               \
                    BLOCK(q, width, keys, k0, 2, 8, 2, nk - k0 < 8 ? nk - k0 : 8, scale, s + h0 * lds + k0, lds);    \
                h0 += 2;                                                                                             \
            } else {                                                                                                 \
                BLOCK(q, width, keys, 0, 1, 16, 1, nk, scale, s + h0 * lds, lds);                                    \
                h0 += 1;                                                                                             \
            }                                                                                                        \
        }                                                                                                            \
    }

#ifdef HAVE_BF16_DOT
/* VDPBF16PS: the bf16 query rows (pack_query16) and key chunks as they are. */
#define LOAD_Q16(p) ((__m512bh)_mm512_load_si512((const void *)(p)))
#define KEY16(x) ((__m512bh)(x))
#define MAC16(acc, q, k) _mm512_dpbf16_ps(acc, q, k)
DEFINE_DOT_KERNELS(dot_block, dot_step, "avx512f,avx512bw,avx512bf16", uint16_t, __m512bh, LOAD_Q16, __m512bh, KEY16,
                   MAC16)
#undef MAC16
#undef KEY16
#undef LOAD_Q16
#endif

#ifdef HAVE_BF16_DOT
/* dot_block's 4 heads x 4 keys on the instruction, for keys whose chunks all lie in their own rows (no rope rows):
 * the same 16 chains (accumulator 4 k + h for head h, key k: dot_block's 4 (L % 4) + L / 4 with L = 4 h + k) over
 * the same chunks in the same order, left in acc for dot_step44's reduction and stores (dot_block_store's), so the
 * same floats. The four key rows' addresses are taken once and every whole chunk is a plain load (dot_block, which
 * serves every block shape and the rope split, found each chunk's address per key and loaded it under a mask): the
 * scores of G = 4 took 35 -> 30 cycles per key (D 128, keys in L1, with dot_sums_store's plain stores). */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline void dot_block44(
    const uint16_t *q, int64_t width, const struct dot_keys *keys, int64_t k0, int64_t nh, int64_t nk, __m512 *acc) {
    for (int v = 0; v < 16; v++)
        acc[v] = _mm512_setzero_ps();
    const uint16_t *key[4];
    for (int k = 0; k < 4; k++)
        key[k] = (const uint16_t *)keys->lat[k0 + (k < nk ? k : 0)];
    const uint16_t *q0 = q, *q1 = nh > 1 ? q + width : q, *q2 = nh > 2 ? q + 2 * width : q;
    const uint16_t *q3 = nh > 3 ? q + 3 * width : q;
    const int64_t chunks = keys->chunks;
    const __mmask32 last = keys->tail >= DOT_CHUNK ? ~(__mmask32)0 : (__mmask32)((1u << keys->tail) - 1);
#define CHUNK44(LOAD)                                                                                                \
    do {                                                                                                             \
        const __m512bh a0 = (__m512bh)_mm512_load_si512((const void *)(q0 + c * DOT_CHUNK));                         \
        const __m512bh a1 = (__m512bh)_mm512_load_si512((const void *)(q1 + c * DOT_CHUNK));                         \
        const __m512bh a2 = (__m512bh)_mm512_load_si512((const void *)(q2 + c * DOT_CHUNK));                         \
        const __m512bh a3 = (__m512bh)_mm512_load_si512((const void *)(q3 + c * DOT_CHUNK));                         \
        _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {                                                        \
            const __m512bh kv = (__m512bh)LOAD(key[k] + c * DOT_CHUNK);                                              \
            acc[4 * k] = _mm512_dpbf16_ps(acc[4 * k], a0, kv);                                                       \
            acc[4 * k + 1] = _mm512_dpbf16_ps(acc[4 * k + 1], a1, kv);                                               \
            acc[4 * k + 2] = _mm512_dpbf16_ps(acc[4 * k + 2], a2, kv);                                               \
            acc[4 * k + 3] = _mm512_dpbf16_ps(acc[4 * k + 3], a3, kv);                                               \
        }                                                                                                            \
    } while (0)
#define LOAD_WHOLE(p) _mm512_loadu_si512((const void *)(p))
#define LOAD_LAST(p) _mm512_maskz_loadu_epi16(last, p)
    int64_t c = 0;
    for (; c + 1 < chunks; c++)
        CHUNK44(LOAD_WHOLE);
    if (last == ~(__mmask32)0)
        CHUNK44(LOAD_WHOLE);
    else
        CHUNK44(LOAD_LAST);
#undef LOAD_LAST
#undef LOAD_WHOLE
#undef CHUNK44
}

/* dot_step on the instruction for keys without rope rows: its blocks of 4 heads (3 or 4 left) by dot_block44, a last
 * 1 or 2 heads by dot_step itself (the blocks are each head's own sums, so the same floats). */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void dot_step44(const uint16_t *q16, int64_t group,
                                                                             int64_t width,
                                                                             const struct dot_keys *keys, int64_t nk,
                                                                             float scale, float *s, int64_t lds) {
    int64_t h0 = 0;
    for (; group - h0 >= 3; h0 += 4) {
        const int64_t nh = group - h0 < 4 ? group - h0 : 4;
        /* Each block's reduction finished after the next block's products: its halves (8 vectors) wait in
         * registers while the next block's dot products run. Reduced straight after its own products, each block's
         * reduction (a chain of shuffles and adds) held up the next block's (scores of G = 4: 29 -> 25 cycles per key,
         * D 128, keys in L1). */
        __m512 half[8];
        for (int64_t k0 = 0; k0 < nk; k0 += 4) {
            __m512 acc[16];
            dot_block44(q16 + h0 * width, width, keys, k0, nh, nk - k0 < 4 ? nk - k0 : 4, acc);
            if (k0 > 0)
                dot_sums_store(half, 4, nh, 4, scale, s + h0 * lds + k0 - 4, lds);
            dot_halves(acc, half);
        }
        if (nk > 0) {
            const int64_t k0 = (nk - 1) / 4 * 4;
            dot_sums_store(half, 4, nh, nk - k0, scale, s + h0 * lds + k0, lds);
        }
    }
    if (h0 < group)
        dot_step(q16 + h0 * width, group - h0, width, keys, nk, scale, s + h0 * lds, lds);
}
#endif

/* The emulation on 16 lanes (AVX-512F, a CPU without AVX512-BF16): the query rows widened (pack_query_lanes), each
 * key chunk split into its odd and even columns as fp32 (the high half of each 32-bit word, and the low half shifted
 * up), two FMAs per chunk, odd first. */
struct lanes16 {
    __m512 odd, even;
};
#define LOAD_LANES(p) ((struct lanes16){_mm512_loadu_ps(p), _mm512_loadu_ps((p) + 16)})
#define KEY_LANES(x)                                                                                                 \
    ((struct lanes16){_mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u))),               \
                      _mm512_castsi512_ps(_mm512_slli_epi32(x, 16))})
#define MAC_LANES(acc, q, k) _mm512_fmadd_ps((q).even, (k).even, _mm512_fmadd_ps((q).odd, (k).odd, acc))
DEFINE_DOT_KERNELS(dot_block_emulated, dot_step_emulated16, "avx512f,avx512bw", float, struct lanes16, LOAD_LANES,
                   struct lanes16, KEY_LANES, MAC_LANES)
#undef MAC_LANES
#undef KEY_LANES
#undef LOAD_LANES
#undef DEFINE_DOT_KERNELS

/* The 16 lane sums of heads x keys for the 8-lane emulation (AVX2), into lanes[h][k][16]: each key's chunks split
 * once into fp32 odd / even columns (`split`: DOT_STEP * chunks * 32 floats, pack_query_lanes's layout), then blocks
 * of 4 heads x 1 key (a block's heads past the end repeat the first, writing the same sums). */
__attribute__((target("avx2,fma"))) static void dot_lanes_emulated(const float *qe, int64_t group, int64_t chunks,
                                                                   const struct dot_keys *keys, int64_t nk,
                                                                   float *split, float *lanes) {
    for (int64_t k = 0; k < nk; k++)
        for (int64_t c = 0; c < chunks; c++)
            store_lanes(chunk_lanes(dot_chunk(keys, k, c), c + 1 < chunks ? DOT_CHUNK : keys->tail),
                        split + (k * chunks + c) * DOT_CHUNK);
    for (int64_t k = 0; k < nk; k++)
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            const float *q[4];
            for (int i = 0; i < 4; i++)
                q[i] = qe + (g0 + i < group ? g0 + i : g0) * chunks * DOT_CHUNK;
            __m256 lo[4], hi[4];
            for (int i = 0; i < 4; i++)
                lo[i] = hi[i] = _mm256_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                const float *kc = split + (k * chunks + c) * DOT_CHUNK;
                const __m256 o0 = _mm256_loadu_ps(kc), o1 = _mm256_loadu_ps(kc + 8);
                const __m256 e0 = _mm256_loadu_ps(kc + 16), e1 = _mm256_loadu_ps(kc + 24);
                for (int i = 0; i < 4; i++) { /* lane l: the odd column, then the even one */
                    const float *qc = q[i] + c * DOT_CHUNK;
                    lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qc), o0, lo[i]);
                    hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qc + 8), o1, hi[i]);
                    lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qc + 16), e0, lo[i]);
                    hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qc + 24), e1, hi[i]);
                }
            }
            for (int i = 0; i < 4; i++) {
                float *out = lanes + ((g0 + i < group ? g0 + i : g0) * DOT_STEP + k) * 16;
                _mm256_storeu_ps(out, lo[i]);
                _mm256_storeu_ps(out + 8, hi[i]);
            }
        }
}

/* dot_step's scores from the emulation (qe: pack_query_lanes's rows; lanes: scratch of group * DOT_STEP * 16). */
static void dot_step_emulated(const float *qe, int64_t group, int64_t chunks, const struct dot_keys *keys, int64_t nk,
                              float scale, float *s, int64_t lds, float *split, float *lanes) {
    dot_lanes_emulated(qe, group, chunks, keys, nk, split, lanes);
    for (int64_t g = 0; g < group; g++)
        for (int64_t k = 0; k < nk; k++) {
            const float *x = lanes + (g * DOT_STEP + k) * 16;
            s[g * lds + k] = hsum(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8))) * scale;
        }
}

/* A thread's scratch for the decode scores: query rows packed (q16 for the instruction, qe for the emulation: a kv
 * head's, or every kv head's of a batch entry), the 8-lane emulation's split keys and lane sums, and keys gathered
 * into whole rows where they are not read in place (NZ caches, or a latent row whose width is not whole chunks
 * before its rope row). */
struct dot_scratch {
    uint16_t *q16, *gathered;
    float *qe, *lanes, *split;
    const char *gathered_rows[DOT_STEP];
};

/* Scratch for up to `rows` query rows of `dim` columns. */
static void dot_scratch_alloc(struct dot_scratch *ds, int64_t rows, int64_t dim) {
    const int64_t width = dot_chunks(dim) * DOT_CHUNK;
    ds->q16 = aligned_alloc(64, sizeof(uint16_t) * (size_t)(rows * width + DOT_CHUNK));
    ds->qe = malloc(sizeof(float) * rows * width);
    ds->lanes = malloc(sizeof(float) * rows * DOT_STEP * 16);
    ds->split = malloc(sizeof(float) * DOT_STEP * width);
    ds->gathered = malloc(sizeof(uint16_t) * DOT_STEP * width);
    for (int64_t k = 0; k < DOT_STEP; k++)
        ds->gathered_rows[k] = (const char *)(ds->gathered + k * width);
}

static void dot_scratch_free(struct dot_scratch *ds) {
    free(ds->gathered);
    free(ds->split);
    free(ds->lanes);
    free(ds->qe);
    free(ds->q16);
}

/* The query rows for the scores (q [rows, dim], bf16), packed for the path in force. */
static void dot_query(const uint16_t *q, int64_t rows, int64_t dim, struct dot_scratch *ds) {
    if (use_bf16_dot)
        pack_query16(q, rows, dim, ds->q16);
    else
        pack_query_lanes(q, rows, dim, ds->qe);
}

/* MXCSR with DAZ and FTZ on for the scores that follow (dot_scores); returns the setting to restore with
 * dot_flush_end. The compiler barriers keep the scores' arithmetic between the two writes: its operands are loaded
 * after the first and its results stored before the second. */
static inline unsigned int dot_flush_begin(void) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | MXCSR_DAZ_FTZ);
    __asm__ volatile("" ::: "memory");
    return csr;
}

static inline void dot_flush_end(unsigned int csr) {
    __asm__ volatile("" ::: "memory");
    _mm_setcsr(csr);
}

/* s[g * lds + k] = scale * (q_g . key k), g < group, k < nk (<= DOT_STEP), q_g the packed query row first + g
 * (dot_query), in the order above, by the path in force; between dot_flush_begin and dot_flush_end (whose MXCSR the
 * order assumes). */
static void dot_scores(int64_t group, int64_t dim, const struct dot_keys *keys, int64_t nk, int64_t first,
                       float scale, float *s, int64_t lds, struct dot_scratch *ds) {
    const int64_t width = dot_chunks(dim) * DOT_CHUNK;
#ifdef HAVE_BF16_DOT
    if (use_bf16_dot && keys->split >= keys->chunks)
        dot_step44(ds->q16 + first * width, group, width, keys, nk, scale, s, lds);
    else if (use_bf16_dot)
        dot_step(ds->q16 + first * width, group, width, keys, nk, scale, s, lds);
    else
#endif
    if (use_avx512bw)
        dot_step_emulated16(ds->qe + first * width, group, width, keys, nk, scale, s, lds);
    else
        dot_step_emulated(ds->qe + first * width, group, dot_chunks(dim), keys, nk, scale, s, lds, ds->split,
                          ds->lanes);
}

/* Test entry: scores [heads, n] = scale * q [heads, dim] . k [n, dim] (bf16 rows, contiguous), through the
 * instruction (emulate 0, where the CPU has it) or the emulation (1). Returns 0, or -1 if the instruction was asked
 * for but is not there. */
int cann_attn_decode_dots(const uint16_t *q, const uint16_t *key_rows, int64_t heads, int64_t n, int64_t dim,
                          float scale, int emulate, float *scores) {
    const int saved = use_bf16_dot;
    if (!emulate && !cann_attn_set_bf16_dot(1))
        return -1;
    use_bf16_dot = !emulate;
    struct dot_scratch ds;
    dot_scratch_alloc(&ds, heads, dim);
    dot_query(q, heads, dim, &ds);
    const char *rows[DOT_STEP];
    for (int64_t j0 = 0; j0 < n; j0 += DOT_STEP) {
        const int64_t nk = n - j0 < DOT_STEP ? n - j0 : DOT_STEP;
        for (int64_t k = 0; k < nk; k++)
            rows[k] = (const char *)(key_rows + (j0 + k) * dim);
        const struct dot_keys keys = {rows, rows, dot_chunks(dim), dot_chunks(dim), dot_tail(dim)};
        const unsigned int csr = dot_flush_begin();
        dot_scores(heads, dim, &keys, nk, 0, scale, scores + j0, n, &ds);
        dot_flush_end(csr);
    }
    dot_scratch_free(&ds);
    use_bf16_dot = saved;
    return 0;
}
