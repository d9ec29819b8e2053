/* The register tile every x86 kernel instantiates: R rows of W times M vectors of x, R and M
 * constants after inlining. Included by each instruction set's file after it has named its
 * primitives (VEC, WVEC, ZERO, W, X, FMA, SUM, TAIL, ESIZE's wtype; for int8 FVEC, FZERO, FSET1,
 * FFMA, FCVT) and ROWS_FOR(M), its rows a tile. */
#ifndef SHARD_GEMV_TILE_H
#define SHARD_GEMV_TILE_H
#include "gemv.h"

/* ---------------------------------------------------------------- one tile: R rows x M vectors
 * The accumulators are named variables, not an array: GCC keeps an array of vectors in memory
 * and stores it back every iteration. R and M are constants after inlining, so the guarded
 * statements of unused rows and vectors vanish. Each ISA defines VEC, ZERO, W(r) (row r's next
 * weights, of type WVEC), X(b) (vector b's matching inputs), FMA, SUM and TAIL, then expands
 * TILE_STEP and TILE_STORE (of the accumulators named p<row><vector>). */
#define ACC(b) VEC a0##b = ZERO, a1##b = ZERO, a2##b = ZERO, a3##b = ZERO, a4##b = ZERO, a5##b = ZERO, \
                   a6##b = ZERO, a7##b = ZERO;
#define COL(b)                                                                 \
    if (M > b) {                                                               \
        const WVEC xv = X(b);                                                  \
        a0##b = FMA(a0##b, w0, xv);                                            \
        if (R > 1) a1##b = FMA(a1##b, w1, xv);                                 \
        if (R > 2) a2##b = FMA(a2##b, w2, xv);                                 \
        if (R > 3) a3##b = FMA(a3##b, w3, xv);                                 \
        if (R > 4) a4##b = FMA(a4##b, w4, xv);                                 \
        if (R > 5) a5##b = FMA(a5##b, w5, xv);                                 \
        if (R > 6) a6##b = FMA(a6##b, w6, xv);                                 \
        if (R > 7) a7##b = FMA(a7##b, w7, xv);                                 \
    }
#define TILE_MUL                                                               \
    {                                                                          \
        const WVEC w0 = W(0);                                                  \
        const WVEC w1 = R > 1 ? W(1) : w0, w2 = R > 2 ? W(2) : w0, w3 = R > 3 ? W(3) : w0; \
        const WVEC w4 = R > 4 ? W(4) : w0, w5 = R > 5 ? W(5) : w0, w6 = R > 6 ? W(6) : w0; \
        const WVEC w7 = R > 7 ? W(7) : w0;                                     \
        COL(0) COL(1) COL(2) COL(3) COL(4) COL(5) COL(6) COL(7)                \
    }
#define TILE_STEP { PREFETCH_NEXT TILE_MUL }
/* The next tile's rows, at the columns this step reads, once a cache line: rows of a few KiB are
 * too short for the hardware prefetchers to ramp up (int8 rows the most), and a tile's R rows
  * lie just before the next tile's, so this stays one tile ahead of the loads. Into L2, not L1:
  * a tile is as large as L1, and lines fetched a tile ahead into L1 were evicted before their
  * use (bfloat16 weights streamed at 0.64 of the plain read with T0, 0.85 with T1, on Zen 4). */
#define PREFETCH_ROWS                                                          \
    {                                                                          \
        const char *next = (const char *)j->w + ((row + R) * ldw + i) * (int64_t)ESIZE; \
        for (int r = 0; r < R; r++) _mm_prefetch(next + r * ldw * (int64_t)ESIZE, _MM_HINT_T1); \
    }
#define PREFETCH_NEXT if (((i * (int64_t)ESIZE) & 63) == 0) PREFETCH_ROWS
#define ESIZE (wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1)
#define OUT(p, b)                                                              \
    if (M > b) {                                                               \
        store(j, b, row, SUM(p##0##b) + TAIL(0, b));                           \
        if (R > 1) store(j, b, row + 1, SUM(p##1##b) + TAIL(1, b));            \
        if (R > 2) store(j, b, row + 2, SUM(p##2##b) + TAIL(2, b));            \
        if (R > 3) store(j, b, row + 3, SUM(p##3##b) + TAIL(3, b));            \
        if (R > 4) store(j, b, row + 4, SUM(p##4##b) + TAIL(4, b));            \
        if (R > 5) store(j, b, row + 5, SUM(p##5##b) + TAIL(5, b));            \
        if (R > 6) store(j, b, row + 6, SUM(p##6##b) + TAIL(6, b));            \
        if (R > 7) store(j, b, row + 7, SUM(p##7##b) + TAIL(7, b));            \
    }
#define TILE_STORE(p) OUT(p, 0) OUT(p, 1) OUT(p, 2) OUT(p, 3) OUT(p, 4) OUT(p, 5) OUT(p, 6) OUT(p, 7)
/* AVX-512: WIDTH columns a step with plain loads (`full`), then the row's tail with `mask` lanes */
#define MASKED_LOOP(WIDTH, MASK_T, ALL, TAIL_MASK)                             \
    int64_t i = 0;                                                             \
    {                                                                          \
        const int full = 1;                                                    \
        const MASK_T mask = ALL;                                               \
        for (; i + WIDTH <= k; i += WIDTH) TILE_STEP                           \
    }                                                                          \
    if (i < k) {                                                               \
        const int full = 0;                                                    \
        const MASK_T mask = (MASK_T)(TAIL_MASK);                               \
        TILE_STEP                                                              \
    }
#define DECLARE_ACCS ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)

/* int8 weights: the `a` accumulators hold the integer sums of one block of QBLOCK columns (FMA is
 * the ISA's int16 pair dot product), the `f` ones the float32 sums of the blocks so far, each
 * block's times its scale (FVEC, FZERO, FSET1, FFMA and FCVT: the float vector, its zero, a
 * broadcast, a fused multiply-add and int32 -> float32 conversion). I8_BLOCKS runs STEPS (the
 * block's columns from i to `end`) for each block, then folds it into `f`. */
#define FACC(b) FVEC f0##b = FZERO, f1##b = FZERO, f2##b = FZERO, f3##b = FZERO, f4##b = FZERO, \
                     f5##b = FZERO, f6##b = FZERO, f7##b = FZERO;
#define RESET(b) a0##b = a1##b = a2##b = a3##b = a4##b = a5##b = a6##b = a7##b = ZERO;
#define FOLD_ROW(r, b) if (R > r) f##r##b = FFMA(FCVT(a##r##b), s, f##r##b);
#define FOLD(b)                                                                \
    if (M > b) {                                                               \
        const FVEC s = FSET1(j->xs[b * j->nblk + blk]);                        \
        FOLD_ROW(0, b) FOLD_ROW(1, b) FOLD_ROW(2, b) FOLD_ROW(3, b)            \
        FOLD_ROW(4, b) FOLD_ROW(5, b) FOLD_ROW(6, b) FOLD_ROW(7, b)            \
    }
#define I8_BLOCKS(STEPS)                                                       \
    DECLARE_ACCS FACC(0) FACC(1) FACC(2) FACC(3) FACC(4) FACC(5) FACC(6) FACC(7) \
    const int64_t k = j->k, kpad = j->kpad, ldw = j->ldw;                      \
    const int8_t *wp = (const int8_t *)j->w;                                   \
    const int16_t *xq = j->xq;                                                 \
    for (int64_t blk = 0; blk < j->nblk; blk++) {                              \
        const int64_t end = (blk + 1) * QBLOCK < k ? (blk + 1) * QBLOCK : k;   \
        RESET(0) RESET(1) RESET(2) RESET(3) RESET(4) RESET(5) RESET(6) RESET(7) \
        int64_t i = blk * QBLOCK;                                              \
        STEPS                                                                  \
        FOLD(0) FOLD(1) FOLD(2) FOLD(3) FOLD(4) FOLD(5) FOLD(6) FOLD(7)        \
    }                                                                          \
    TILE_STORE(f)

#define RUN_BLOCKS(BLOCK, M, WT)                                              \
    do {                                                                      \
        const int R = ROWS_FOR(M);                                            \
        int64_t row = r0;                                                     \
        for (; row + R <= r1; row += R) BLOCK(j, row, R, M, WT);              \
        for (; row < r1; row++) BLOCK(j, row, 1, M, WT);                      \
    } while (0)

#define DISPATCH_M(BLOCK, WT)                                                 \
    switch (j->m) {                                                           \
        case 1: RUN_BLOCKS(BLOCK, 1, WT); break;                              \
        case 2: RUN_BLOCKS(BLOCK, 2, WT); break;                              \
        case 3: RUN_BLOCKS(BLOCK, 3, WT); break;                              \
        case 4: RUN_BLOCKS(BLOCK, 4, WT); break;                              \
        case 5: RUN_BLOCKS(BLOCK, 5, WT); break;                              \
        case 6: RUN_BLOCKS(BLOCK, 6, WT); break;                              \
        case 7: RUN_BLOCKS(BLOCK, 7, WT); break;                              \
        default: RUN_BLOCKS(BLOCK, 8, WT); break;                             \
    }

#endif
