/* AVX-512 with int8 weights: x quantized to int16, exact integer sums a block (vpmaddwd, or
 * vpdpwssd with AVX512_VNNI), the blocks' sums added in float32. */
#include "gemv.h"
#if X86
#include "tile.h"

/* acc + the sums of pairs of int16 products: vpmaddwd and vpaddd, or one vpdpwssd with VNNI */
typedef __m512i (*Madd512)(__m512i acc, __m512i w, __m512i x);
T512 __m512i madd_512(__m512i acc, __m512i w, __m512i x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
TVNNI __m512i dpwssd_512(__m512i acc, __m512i w, __m512i x) { return _mm512_dpwssd_epi32(acc, w, x); }

/* 32 columns from i of R rows of int8 weights wp (widened to int16; the block's last step reads
 * `mask` lanes, x is zero beyond k) times M vectors of quantized x xq, added to the integer sums */
T512 void step_512_i8(__m512i acc[MAX_R][MAX_M], const int8_t *wp, int64_t ldw, const int16_t *xq, int64_t kpad,
                      int64_t row, const int R, const int M, int64_t i, const int full, __mmask32 mask, Madd512 madd) {
    __m512i w[MAX_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const int8_t *p = wp + (row + r) * ldw + i;
        w[r] = _mm512_cvtepi8_epi16(full ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi8(mask, p));
    }
#pragma GCC unroll 8
    for (int b = 0; b < M; b++) {
        __m512i xv = _mm512_loadu_si512(xq + b * kpad + i);
        __asm__("" : "+v"(xv));  /* one load into a register, not one memory operand a product */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][b] = madd(acc[r][b], w[r], xv);
    }
}

/* Rows [row, row + R) times M vectors: each block's integer sums, times its scales, added to the
 * float32 sums of the blocks so far */
T512 void tile_i8(const Job *j, int64_t row, const int R, const int M, Madd512 madd) {
    __m512 f[MAX_R][MAX_M];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int b = 0; b < M; b++) f[r][b] = _mm512_setzero_ps();
    /* locals: GCC reloads a field at every step otherwise */
    const int64_t k = j->k, ldw = j->ldw, kpad = j->kpad, nblk = j->nblk;
    const int8_t *wp = (const int8_t *)j->w;
    const int16_t *xq = j->xq;
    const float *xs = j->xs;
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t end = (blk + 1) * QBLOCK < k ? (blk + 1) * QBLOCK : k;
        __m512i a[MAX_R][MAX_M];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int b = 0; b < M; b++) a[r][b] = _mm512_setzero_si512();
        int64_t i = blk * QBLOCK;
        if (end - i == QBLOCK) {
            /* a whole block in four steps with a prefetch every other one, no branch: a test in
             * the loop made GCC copy every accumulator at each step and keep x on the stack */
#pragma GCC unroll 4
            for (int s = 0; s < QBLOCK / 32; s++, i += 32) {
                if (s % 2 == 0) prefetch_rows(j, row, R, i, W_I8);
                step_512_i8(a, wp, ldw, xq, kpad, row, R, M, i, 1, 0xffffffffu, madd);
            }
        } else {
            for (; i + 32 <= end; i += 32) {
                prefetch_next(j, row, R, i, W_I8);
                step_512_i8(a, wp, ldw, xq, kpad, row, R, M, i, 1, 0xffffffffu, madd);
            }
        }
        if (i < end) {
            prefetch_next(j, row, R, i, W_I8);
            step_512_i8(a, wp, ldw, xq, kpad, row, R, M, i, 0, (__mmask32)((1ull << (end - i)) - 1), madd);
        }
#pragma GCC unroll 8
        for (int b = 0; b < M; b++) {
            const __m512 s = _mm512_set1_ps(xs[b * nblk + blk]);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) f[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][b]), s, f[r][b]);
        }
    }
#pragma GCC unroll 8
    for (int b = 0; b < M; b++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) store(j, b, row + r, _mm512_reduce_add_ps(f[r][b]) + 0.0f);
}

T512 void tile_512_i8(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    (void)wtype;  /* W_I8 */
    tile_i8(j, row, R, M, madd_512);
}
TVNNI void tile_vnni_i8(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    (void)wtype;
    tile_i8(j, row, R, M, dpwssd_512);
}

/* two accumulators per row and vector: fewer rows per tile than the float kernels; for one
 * vector 4 (3 to 4 streamed int8 weights ~10% faster than 8 or 2 on Zen 4) */
static const int8_t ROWS_512_I8[MAX_M + 1] = {0, 4, 4, 3, 3, 2, 2, 2, 1};
T512FN void rows_512_i8(const Job *j, int64_t r0, int64_t r1) {
    rows_in_tiles(j, r0, r1, tile_512_i8, ROWS_512_I8, W_I8);
}
TVNNIFN void rows_vnni_i8(const Job *j, int64_t r0, int64_t r1) {
    rows_in_tiles(j, r0, r1, tile_vnni_i8, ROWS_512_I8, W_I8);
}
#endif
