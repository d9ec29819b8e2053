/* What the x86 register tiles of every instruction set share. Each instruction set's file writes
 * its tile as inline functions of R rows of W times M vectors of x (R x M accumulators), with its
 * own loads and products; R and M are constants after inlining (rows_in_tiles calls the tile once
 * for each m), so the tile's loops unroll (`#pragma GCC unroll`) and its accumulator arrays live
 * in registers: an array GCC cannot scalarize stays in memory, stored back every iteration. The
 * tile reads Job's fields into locals once: read through the pointer they were reloaded at every
 * step (the same code as the macro-templated tiles this replaced, checked in the assembly). */
#ifndef SHARD_GEMV_TILE_H
#define SHARD_GEMV_TILE_H
#include "gemv.h"

#define MAX_R 8  /* rows a tile, at most */

/* one tile: rows [row, row + R) for all j->m (== M) vectors, W of dtype wtype */
typedef void (*TileFn)(const Job *j, int64_t row, int R, int M, int wtype);

INLINE int64_t esize(int wtype) { return wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1; }

/* The next tile's rows at the columns from i, into L2: rows of a few KiB are too short for the
 * hardware prefetchers to ramp up (int8 rows the most), and a tile's R rows lie just before the
 * next tile's, so this stays one tile ahead of the loads. Into L2, not L1: a tile is as large as
 * L1, and lines fetched a tile ahead into L1 were evicted before their use (bfloat16 weights
 * streamed at 0.64 of the plain read with T0, 0.85 with T1, on Zen 4). */
INLINE void prefetch_rows(const Job *j, int64_t row, const int R, int64_t i, int wtype) {
    const int64_t ldw = j->ldw, es = esize(wtype);
    const char *next = (const char *)j->w + ((row + R) * ldw + i) * es;
    for (int r = 0; r < R; r++) _mm_prefetch(next + r * ldw * es, _MM_HINT_T1);
}

/* ... once a cache line of the row */
INLINE void prefetch_next(const Job *j, int64_t row, const int R, int64_t i, int wtype) {
    if (((i * esize(wtype)) & 63) == 0) prefetch_rows(j, row, R, i, wtype);
}

/* rows [r0, r1) by tiles of R rows, the rest one row at a time */
INLINE void tiles(const Job *j, int64_t r0, int64_t r1, TileFn tile, const int R, const int M, int wtype) {
    int64_t row = r0;
    for (; row + R <= r1; row += R) tile(j, row, R, M, wtype);
    for (; row < r1; row++) tile(j, row, 1, M, wtype);
}

/* rows [r0, r1) with the tile of M = j->m (a constant in each case), rows_for[M] rows a tile */
INLINE void rows_in_tiles(const Job *j, int64_t r0, int64_t r1, TileFn tile, const int8_t rows_for[MAX_M + 1],
                          int wtype) {
    switch (j->m) {
        case 1: tiles(j, r0, r1, tile, rows_for[1], 1, wtype); break;
        case 2: tiles(j, r0, r1, tile, rows_for[2], 2, wtype); break;
        case 3: tiles(j, r0, r1, tile, rows_for[3], 3, wtype); break;
        case 4: tiles(j, r0, r1, tile, rows_for[4], 4, wtype); break;
        case 5: tiles(j, r0, r1, tile, rows_for[5], 5, wtype); break;
        case 6: tiles(j, r0, r1, tile, rows_for[6], 6, wtype); break;
        case 7: tiles(j, r0, r1, tile, rows_for[7], 7, wtype); break;
        default: tiles(j, r0, r1, tile, rows_for[8], 8, wtype); break;
    }
}

#endif
