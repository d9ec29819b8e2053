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

#define VEC __m512
#define WVEC __m512
#define ZERO _mm512_setzero_ps()
#define FMA(acc, w, x) _mm512_fmadd_ps(w, x, acc)
#define SUM(acc) _mm512_reduce_add_ps(acc)
#define TAIL(r, b) 0.0f
#define W(r) load16_512(wtype, j->w, (row + r) * ldw + i, full, mask)
#define X(b) (full ? _mm512_loadu_ps(j->xf + b * k + i) : _mm512_maskz_loadu_ps(mask, j->xf + b * k + i))
T512 void block_512(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    DECLARE_ACCS
    const int64_t k = j->k, ldw = j->ldw;
    MASKED_LOOP(16, __mmask16, 0xffff, (1u << (k - i)) - 1)
    TILE_STORE(a)
}

/* Rows per tile: enough to share each x load (and, for one vector, 8 rows: more streams in
 * flight), few enough that R x M accumulators fit the 32 vector registers beside the weights. */
#define ROWS_FOR(M) ((M) == 1 ? 8 : (M) <= 2 ? 4 : (M) <= 4 ? 3 : 2)

T512FN void rows_512_f32(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_512, W_F32); }
T512FN void rows_512_bf16(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_512, W_BF16); }

/* quantize_x with vectors (the same bits): 16 values a step with AVX-512, 8 with AVX2 + FMA,
 * rounded by cvtps2dq (round half to even, MXCSR's default, as the scalar code rounds) */
T512FN void quantize_x_512(const Job *j, int16_t *xq, float *xs) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), lo = _mm512_set1_epi32(-QMAX), hi = _mm512_set1_epi32(QMAX);
    for (int64_t b = 0; b < j->m; b++) {
        int16_t *q = xq + b * j->kpad;
        const float *xf32 = (const float *)j->x + b * j->ldx;
        const uint16_t *xb16 = (const uint16_t *)j->x + b * j->ldx;
#define LOAD_X(at, mask)                                                        \
    (j->xtype == X_F32 ? _mm512_maskz_loadu_ps(mask, xf32 + (at))             \
                       : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, xb16 + (at))), 16)))
        for (int64_t blk = 0; blk < j->nblk; blk++) {
            const int64_t c0 = blk * QBLOCK, n = c0 + QBLOCK < j->k ? QBLOCK : j->k - c0;
            __m512i big = _mm512_setzero_si512();
            for (int64_t t = 0; t < n; t += 16) {
                const __mmask16 mask = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
                big = _mm512_max_epu32(big, _mm512_and_si512(_mm512_castps_si512(LOAD_X(c0 + t, mask)), magnitude));
            }
            float inv;
            xs[b * j->nblk + blk] = block_scale((uint32_t)_mm512_reduce_max_epu32(big), &inv);
            const __m512 scale = _mm512_set1_ps(inv);
            for (int64_t t = 0; t < n; t += 16) {  /* whole vectors: lanes past k load as 0 */
                const __mmask16 mask = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
                __m512i v = inv != 0.0f ? _mm512_cvtps_epi32(_mm512_mul_ps(LOAD_X(c0 + t, mask), scale)) : _mm512_setzero_si512();
                v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
                _mm256_storeu_si256((__m256i *)(q + c0 + t), _mm512_cvtepi32_epi16(v));
            }
        }
#undef LOAD_X
        for (int64_t i = (j->k + 15) & ~(int64_t)15; i < j->kpad; i++) q[i] = 0;
    }
}

#endif
