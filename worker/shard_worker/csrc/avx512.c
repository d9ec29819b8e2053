/* AVX-512: float32 and bfloat16 weights (widened to float32), and x quantized for int8 weights. */
#include "gemv.h"
#if X86
#include "tile.h"

/* 16 float32 or bfloat16 weights of a row as float32; `full` (a constant) or only the `mask`
 * lanes (a row's tail).
 * Masked loads cost an extra vector uop on Intel cores, so the main loop has none. */
T512 __m512 load16_512(int wtype, const void *w, int64_t at, const int full, __mmask16 mask) {
    if (wtype == W_F32) return full ? _mm512_loadu_ps((const float *)w + at) : _mm512_maskz_loadu_ps(mask, (const float *)w + at);
    __m256i h = full ? _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at))
                     : _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 columns from i of R rows of W (wp, rows ldw apart) times M vectors of x as float32 (xf, rows k
 * apart), added to acc */
T512 void step_512(__m512 acc[MAX_R][MAX_M], const void *wp, int64_t ldw, const float *xf, int64_t k, int64_t row,
                   const int R, const int M, const int wtype, int64_t i, const int full, __mmask16 mask) {
    __m512 w[MAX_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) w[r] = load16_512(wtype, wp, (row + r) * ldw + i, full, mask);
#pragma GCC unroll 8
    for (int b = 0; b < M; b++) {
        const float *x = xf + b * k + i;
        __m512 xv = full ? _mm512_loadu_ps(x) : _mm512_maskz_loadu_ps(mask, x);
        __asm__("" : "+v"(xv));  /* one load into a register, not one memory operand an FMA */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][b] = _mm512_fmadd_ps(w[r], xv, acc[r][b]);
    }
}

/* Rows [row, row + R) times M vectors: 16 columns a step with plain loads, then the rows' tail
 * with `mask` lanes */
T512 void tile_512(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    __m512 acc[MAX_R][MAX_M];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int b = 0; b < M; b++) acc[r][b] = _mm512_setzero_ps();
    const int64_t k = j->k, ldw = j->ldw;  /* locals: GCC reloads a field at every step otherwise */
    const void *wp = j->w;
    const float *xf = j->xf;
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        prefetch_next(j, row, R, i, wtype);
        step_512(acc, wp, ldw, xf, k, row, R, M, wtype, i, 1, 0xffff);
    }
    if (i < k) {
        prefetch_next(j, row, R, i, wtype);
        step_512(acc, wp, ldw, xf, k, row, R, M, wtype, i, 0, (__mmask16)((1u << (k - i)) - 1));
    }
#pragma GCC unroll 8
    for (int b = 0; b < M; b++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) store(j, b, row + r, _mm512_reduce_add_ps(acc[r][b]) + 0.0f);
}

/* Rows per tile: enough to share each x load (and, for one vector, 8 rows: more streams in
 * flight), few enough that R x M accumulators fit the 32 vector registers beside the weights. */
static const int8_t ROWS_512[MAX_M + 1] = {0, 8, 4, 3, 3, 2, 2, 2, 2};

T512FN void rows_512_f32(const Job *j, int64_t r0, int64_t r1) { rows_in_tiles(j, r0, r1, tile_512, ROWS_512, W_F32); }
T512FN void rows_512_bf16(const Job *j, int64_t r0, int64_t r1) { rows_in_tiles(j, r0, r1, tile_512, ROWS_512, W_BF16); }

/* the `mask` values of 16 of a row of x (x_row) as float32 */
T512 __m512 load_x16(int xtype, const void *x, int64_t at, __mmask16 mask) {
    if (xtype == X_F32) return _mm512_maskz_loadu_ps(mask, (const float *)x + at);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* quantize_x with vectors (the same bits): 16 values a step with AVX-512, 8 with AVX2 + FMA,
 * rounded by cvtps2dq (round half to even, MXCSR's default, as the scalar code rounds) */
T512FN void quantize_x_512(const Job *j, int16_t *xq, float *xs) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), lo = _mm512_set1_epi32(-QMAX), hi = _mm512_set1_epi32(QMAX);
    for (int64_t b = 0; b < j->m; b++) {
        int16_t *q = xq + b * j->kpad;
        const void *x = x_row(j, b);
        for (int64_t blk = 0; blk < j->nblk; blk++) {
            const int64_t c0 = blk * QBLOCK, n = c0 + QBLOCK < j->k ? QBLOCK : j->k - c0;
            __m512i big = _mm512_setzero_si512();
            for (int64_t t = 0; t < n; t += 16) {
                const __mmask16 mask = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
                big = _mm512_max_epu32(big, _mm512_and_si512(_mm512_castps_si512(load_x16(j->xtype, x, c0 + t, mask)), magnitude));
            }
            float inv;
            xs[b * j->nblk + blk] = block_scale((uint32_t)_mm512_reduce_max_epu32(big), &inv);
            const __m512 scale = _mm512_set1_ps(inv);
            for (int64_t t = 0; t < n; t += 16) {  /* whole vectors: lanes past k load as 0 */
                const __mmask16 mask = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
                __m512i v = inv != 0.0f ? _mm512_cvtps_epi32(_mm512_mul_ps(load_x16(j->xtype, x, c0 + t, mask), scale)) : _mm512_setzero_si512();
                v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
                _mm256_storeu_si256((__m256i *)(q + c0 + t), _mm512_cvtepi32_epi16(v));
            }
        }
        for (int64_t i = (j->k + 15) & ~(int64_t)15; i < j->kpad; i++) q[i] = 0;
    }
}

#endif
