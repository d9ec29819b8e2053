/* AVX512_BF16: bfloat16 weights and x, pairs of them a dot-product instruction, float32 sums. */
#include "gemv.h"
#if X86
#include "tile.h"

/* 32 bfloat16 values from p: all (`full`, a constant) or only the `mask` lanes (zeroed tail lanes
 * add nothing) */
TBF __m512bh load32_bf16(const uint16_t *p, const int full, __mmask32 mask) {
    return (__m512bh)(full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask, p));
}

/* 32 columns from i of R rows times M vectors: pairs of bfloat16 weights times pairs of bfloat16
 * inputs, float32 sums added to acc */
TBF void step_bf16dp(const Job *j, __m512 acc[MAX_R][MAX_M], int64_t row, const int R, const int M, int64_t i,
                     const int full, __mmask32 mask) {
    const int64_t ldw = j->ldw, ldx = j->ldx;  /* locals: GCC reloads a field at every step otherwise */
    const uint16_t *wp = (const uint16_t *)j->w, *xp = (const uint16_t *)j->x;
    prefetch_next(j, row, R, i, W_BF16);
    __m512bh w[MAX_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) w[r] = load32_bf16(wp + (row + r) * ldw + i, full, mask);
#pragma GCC unroll 8
    for (int b = 0; b < M; b++) {
        __m512bh xv = load32_bf16(xp + b * ldx + i, full, mask);
        __asm__("" : "+v"(xv));  /* one load into a register, not one memory operand a product */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], w[r], xv);
    }
}

/* Rows [row, row + R) times M vectors: 32 columns a step with plain loads, then the rows' tail
 * with `mask` lanes */
TBF void tile_bf16dp(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    (void)wtype;  /* W_BF16 */
    __m512 acc[MAX_R][MAX_M];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int b = 0; b < M; b++) acc[r][b] = _mm512_setzero_ps();
    const int64_t k = j->k;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) step_bf16dp(j, acc, row, R, M, i, 1, 0xffffffffu);
    if (i < k) step_bf16dp(j, acc, row, R, M, i, 0, (__mmask32)((1ull << (k - i)) - 1));
#pragma GCC unroll 8
    for (int b = 0; b < M; b++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) store(j, b, row + r, _mm512_reduce_add_ps(acc[r][b]) + 0.0f);
}

static const int8_t ROWS_BF16DP[MAX_M + 1] = {0, 8, 4, 3, 3, 2, 2, 2, 2};  /* as the float32 tiles */

/* One vector (decode at batch 1): row after row, each row one sequential stream summed in 4
 * accumulators side by side, the weights ROW_PREFETCH bytes ahead fetched into L2. With nothing
 * to share a weight load between vectors, one stream is what the prefetchers follow best: on Zen 4
 * this read bfloat16 weights at 0.95-1.0 of a plain read in the same process, the 8-row tiles at
 * 0.90-0.93 (interleaved A/B, 8 pairs; 2 KiB ahead 0.95-1.0, 8 KiB 0.76, none 0.83); two processes
 * at once, 26-28 GB/s each against 22-25. The tiles stay for 2-8 vectors. */
#define ROW_PREFETCH 4096
TBFFN static void rows_bf16dp_one(const Job *j, int64_t r0, int64_t r1) {
    const int64_t k = j->k, ldw = j->ldw;
    const uint16_t *xp = (const uint16_t *)j->x;
    for (int64_t row = r0; row < r1; row++) {
        const uint16_t *w = (const uint16_t *)j->w + row * ldw;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t i = 0;
        for (; i + 128 <= k; i += 128) {  /* 256 bytes: 4 cache lines */
            const char *ahead = (const char *)(w + i) + ROW_PREFETCH;
            _mm_prefetch(ahead, _MM_HINT_T1);
            _mm_prefetch(ahead + 64, _MM_HINT_T1);
            _mm_prefetch(ahead + 128, _MM_HINT_T1);
            _mm_prefetch(ahead + 192, _MM_HINT_T1);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(xp + i));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + i + 32), (__m512bh)_mm512_loadu_si512(xp + i + 32));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + i + 64), (__m512bh)_mm512_loadu_si512(xp + i + 64));
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + i + 96), (__m512bh)_mm512_loadu_si512(xp + i + 96));
        }
        for (; i + 32 <= k; i += 32)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(xp + i));
        if (i < k) {  /* zeroed tail lanes add nothing */
            const __mmask32 mask = (__mmask32)((1ull << (k - i)) - 1);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i),
                                  (__m512bh)_mm512_maskz_loadu_epi16(mask, xp + i));
        }
        store(j, 0, row, _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))));
    }
}
TBFFN void rows_bf16dp(const Job *j, int64_t r0, int64_t r1) {
    if (j->m == 1) {
        rows_bf16dp_one(j, r0, r1);
        return;
    }
    rows_in_tiles(j, r0, r1, tile_bf16dp, ROWS_BF16DP, W_BF16);
}

#endif
