/* AVX2 with int8 weights: x quantized to int16, exact integer sums a block (vpmaddwd), the
 * blocks' sums added in float32; a block's last columns in scalar code. */
#include "gemv.h"
#if X86
#include "tile.h"

T256 float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the dot product of int8 weights and quantized x over [i, end), in scalar code */
INLINE int32_t dot_i8(const int8_t *w, const int16_t *x, int64_t i, int64_t end) {
    int32_t sum = 0;
    for (; i < end; i++) sum += w[i] * x[i];
    return sum;
}

/* 16 columns from i of R rows of int8 weights wp (widened to int16) times M vectors of quantized
 * x xq, added to the integer sums (vpmaddwd, vpaddd) */
T256 void step_256_i8(__m256i acc[MAX_R][MAX_M], const int8_t *wp, int64_t ldw, const int16_t *xq, int64_t kpad,
                      int64_t row, const int R, const int M, int64_t i) {
    __m256i w[MAX_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) w[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wp + (row + r) * ldw + i)));
#pragma GCC unroll 8
    for (int b = 0; b < M; b++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * kpad + i));
        __asm__("" : "+v"(xv));  /* one load into a register, not one memory operand a product */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][b] = _mm256_add_epi32(acc[r][b], _mm256_madd_epi16(w[r], xv));
    }
}

/* Rows [row, row + R) times M vectors: each block's integer sums (its last columns in scalar
 * code, added to lane 0), times its scales, added to the float32 sums of the blocks so far */
T256 void tile_256_i8(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    (void)wtype;  /* W_I8 */
    __m256 f[MAX_R][MAX_M];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int b = 0; b < M; b++) f[r][b] = _mm256_setzero_ps();
    /* locals: GCC reloads a field at every step otherwise */
    const int64_t k = j->k, ldw = j->ldw, kpad = j->kpad, nblk = j->nblk;
    const int8_t *wp = (const int8_t *)j->w;
    const int16_t *xq = j->xq;
    const float *xs = j->xs;
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t end = (blk + 1) * QBLOCK < k ? (blk + 1) * QBLOCK : k;
        __m256i a[MAX_R][MAX_M];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int b = 0; b < M; b++) a[r][b] = _mm256_setzero_si256();
        int64_t i = blk * QBLOCK;
        if (end - i == QBLOCK) {  /* a whole block in eight steps, a prefetch every fourth */
#pragma GCC unroll 8
            for (int s = 0; s < QBLOCK / 16; s++, i += 16) {
                if (s % 4 == 0) prefetch_rows(j, row, R, i, W_I8);
                step_256_i8(a, wp, ldw, xq, kpad, row, R, M, i);
            }
        }
        for (; i + 16 <= end; i += 16) {
            prefetch_next(j, row, R, i, W_I8);
            step_256_i8(a, wp, ldw, xq, kpad, row, R, M, i);
        }
        if (i < end) {
#pragma GCC unroll 8
            for (int b = 0; b < M; b++)
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const int32_t tail = dot_i8(wp + (row + r) * ldw, xq + b * kpad, i, end);
                    a[r][b] = _mm256_add_epi32(a[r][b], _mm256_zextsi128_si256(_mm_cvtsi32_si128(tail)));
                }
        }
#pragma GCC unroll 8
        for (int b = 0; b < M; b++) {
            const __m256 s = _mm256_set1_ps(xs[b * nblk + blk]);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) f[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][b]), s, f[r][b]);
        }
    }
#pragma GCC unroll 8
    for (int b = 0; b < M; b++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) store(j, b, row + r, hsum256(f[r][b]) + 0.0f);
}

static const int8_t ROWS_256_I8[MAX_M + 1] = {0, 4, 2, 1, 1, 1, 1, 1, 1};
T256FN void rows_256_i8(const Job *j, int64_t r0, int64_t r1) {
    rows_in_tiles(j, r0, r1, tile_256_i8, ROWS_256_I8, W_I8);
}

#endif
