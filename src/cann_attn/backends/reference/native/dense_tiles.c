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
