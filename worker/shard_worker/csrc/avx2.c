/* AVX2 + FMA: float32 and bfloat16 weights (widened to float32), and x quantized for int8 weights. */
#include "gemv.h"
#if X86
#include "tile.h"

/* The dot product of row `row` and vector b over [i, k), in scalar code (AVX2 row tails) */
INLINE float tail_dot(const Job *j, int64_t row, int64_t b, int64_t i) {
    float acc = 0.0f;
    for (; i < j->k; i++) acc += weight_at(j, row, i) * j->xf[b * j->k + i];
    return acc;
}
T256 __m256 load8_256(int wtype, const void *w, int64_t at) {
    switch (wtype) {
        case W_F32: return _mm256_loadu_ps((const float *)w + at);
        default: {  /* bfloat16 */
            __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + at));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
    }
}

T256 float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 columns from i of R rows times M vectors, added to acc */
T256 void step_256(const Job *j, __m256 acc[MAX_R][MAX_M], int64_t row, const int R, const int M, const int wtype,
                   int64_t i) {
    const int64_t k = j->k, ldw = j->ldw;  /* locals: GCC reloads a field at every step otherwise */
    const void *wp = j->w;
    const float *xf = j->xf;
    prefetch_next(j, row, R, i, wtype);
    __m256 w[MAX_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) w[r] = load8_256(wtype, wp, (row + r) * ldw + i);
#pragma GCC unroll 8
    for (int b = 0; b < M; b++) {
        __m256 xv = _mm256_loadu_ps(xf + b * k + i);
        __asm__("" : "+v"(xv));  /* one load into a register, not one memory operand an FMA */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][b] = _mm256_fmadd_ps(w[r], xv, acc[r][b]);
    }
}

/* Rows [row, row + R) times M vectors: 8 columns a step, the rows' tail in scalar code */
T256 void tile_256(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    __m256 acc[MAX_R][MAX_M];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int b = 0; b < M; b++) acc[r][b] = _mm256_setzero_ps();
    const int64_t k = j->k;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) step_256(j, acc, row, R, M, wtype, i);
#pragma GCC unroll 8
    for (int b = 0; b < M; b++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) store(j, b, row + r, hsum256(acc[r][b]) + tail_dot(j, row + r, b, i));
}

/* 16 registers: fewer accumulators than AVX-512 */
static const int8_t ROWS_256[MAX_M + 1] = {0, 4, 4, 2, 2, 1, 1, 1, 1};
T256FN void rows_256_f32(const Job *j, int64_t r0, int64_t r1) { rows_in_tiles(j, r0, r1, tile_256, ROWS_256, W_F32); }
T256FN void rows_256_bf16(const Job *j, int64_t r0, int64_t r1) { rows_in_tiles(j, r0, r1, tile_256, ROWS_256, W_BF16); }

/* 8 values of a row of x (x_row) as float32 */
T256 __m256 load_x8(int xtype, const void *x, int64_t at) {
    if (xtype == X_F32) return _mm256_loadu_ps((const float *)x + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

T256FN void quantize_x_256(const Job *j, int16_t *xq, float *xs) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), lo = _mm256_set1_epi32(-QMAX), hi = _mm256_set1_epi32(QMAX);
    for (int64_t b = 0; b < j->m; b++) {
        int16_t *q = xq + b * j->kpad;
        const void *x = x_row(j, b);
        for (int64_t blk = 0; blk < j->nblk; blk++) {
            const int64_t c0 = blk * QBLOCK, c1 = c0 + QBLOCK < j->k ? c0 + QBLOCK : j->k;
            __m256i big = _mm256_setzero_si256();
            int64_t i = c0;
            for (; i + 8 <= c1; i += 8) big = _mm256_max_epu32(big, _mm256_and_si256(_mm256_castps_si256(load_x8(j->xtype, x, i)), magnitude));
            uint32_t lanes[8], largest = 0;
            _mm256_storeu_si256((__m256i *)lanes, big);
            for (int l = 0; l < 8; l++) largest = lanes[l] > largest ? lanes[l] : largest;
            float inv;
            xs[b * j->nblk + blk] = block_scale(largest_bits(j, b, i, c1, largest), &inv);
            const __m256 scale = _mm256_set1_ps(inv);
            for (i = c0; i + 8 <= c1; i += 8) {
                __m256i v = inv != 0.0f ? _mm256_cvtps_epi32(_mm256_mul_ps(load_x8(j->xtype, x, i), scale)) : _mm256_setzero_si256();
                v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
                const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                _mm_storeu_si128((__m128i *)(q + i), packed);
            }
            quantize_range(j, b, q, i, c1, inv);
        }
        for (int64_t i = j->k; i < j->kpad; i++) q[i] = 0;
    }
}
#endif
