/* How the fused dense forward and backward cut their key tiles into pieces, and which row blocks and pieces take
 * MKL's packed GEMMs (the same floats as its sgemm there).
 *
 * Part of the attention_loops.c translation unit (included there, after vector_ops.h; not compiled alone).
 */

/* The key tiles cut into pieces at most `sub_cols` wide: piece p covers [pj0[p], pj1[p]) of tile ptile[p]. Returns
 * the number of pieces (the arrays hold n_cols / 1 + n_tiles entries at most, allocated by the caller). */
static int64_t key_pieces(int64_t n_tiles, const int64_t *tj0, const int64_t *tj1, int64_t sub_cols, int64_t *pj0,
                          int64_t *pj1, int64_t *ptile) {
    int64_t n = 0;
    for (int64_t t = 0; t < n_tiles; ++t)
        for (int64_t c0 = tj0[t]; c0 < tj1[t]; c0 += sub_cols) {
            pj0[n] = c0;
            pj1[n] = tj1[t] - c0 < sub_cols ? tj1[t] : c0 + sub_cols;
            ptile[n++] = t;
        }
    return n;
}

/* The fp32 S and dP of whole row blocks of at least PACK_MIN_ROWS rows against whole key pieces of at least
 * PACK_MIN_COLS keys take the packed path (pack_rows_t): there MKL's sgemm_compute gave the floats of its sgemm
 * (checked with 64-128 rows, widths 256-512 and depths 8-256, on its AVX-512 kernels and with
 * MKL_ENABLE_INSTRUCTIONS=AVX2; narrower pieces or 16 rows differed on the AVX2 ones, 8 rows or fewer on both). */
#define PACK_MIN_ROWS 64
#define PACK_MIN_COLS 256
/* Whole row blocks a call needs for the packed path: causal tiles of 256 rows (two blocks) measured 2% slower packed
 * (the packing and its buffers cost about what the one saved re-pack did); 2048-row tiles 2-3% faster. */
#define PACK_MIN_BLOCKS 4

/* The kc of ordered_nt for C [block_rows, w] = A B^T of a whole row block (A's rows contiguous, d wide) against a
 * whole packed piece of w rows of B (row stride ldb), into a round8(w)-wide score block, or 0 (the BLAS's packed
 * GEMM): the shape the fused forward and backward give gemm_nt there. */
static int64_t whole_piece_kc(int64_t block_rows, int64_t w, int64_t d, int64_t ldb) {
    return ordered_kc((struct ordered_shape){ORDERED_NT, block_rows, w, d, d, ldb, round8(w), 0});
}

/* Floats of a buffer for one packed piece of up to w rows, d wide: the BLAS's packed format (pack_rows_t, for blocks
 * of `rows` rows) or ordered_pack_t's, whichever is larger, in whole 64-byte lines. */
static int64_t piece_slot_floats(int64_t w, int64_t rows, int64_t d) {
    const int64_t blas = (int64_t)packed_bytes((int)w, (int)rows, (int)d) / (int64_t)sizeof(float);
    const int64_t own = (ordered_panel_floats(w, d) + 15) / 16 * 16;
    return blas > own ? blas : own;
}

/* Packs a piece of w rows of B (d wide, row stride ldb) for whole blocks of `rows` rows: for ordered_nt where it
 * serves that shape (returns its kc), else for the BLAS (pack_rows_t; returns 0). */
static int64_t pack_piece_for(int64_t w, int64_t rows, int64_t d, const float *b, int64_t ldb, float *packed) {
    const int64_t kc = whole_piece_kc(rows, w, d, ldb);
    if (kc)
        ordered_pack_t(w, d, b, ldb, packed);
    else
        pack_rows_t((int)w, (int)rows, (int)d, b, (int)ldb, packed);
    return kc;
}

/* C [n, w] (ldc) = A [n, d] (rows contiguous) B^T from a piece packed by pack_piece_for (kc: what it returned). */
static void packed_nt(int64_t n, int64_t w, int64_t d, const float *a, const float *packed, int64_t kc, float *c,
                      int64_t ldc) {
    if (kc) {
        count_ordered();
        ordered_nt(n, w, d, a, d, packed, c, ldc, kc);
    } else {
        gemm_nt_packed((int)n, (int)w, (int)d, a, (int)d, packed, c, (int)ldc);
    }
}
