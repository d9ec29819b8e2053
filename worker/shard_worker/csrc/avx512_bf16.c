/* AVX512_BF16: bfloat16 weights and x, pairs of them a dot-product instruction, float32 sums. */
#include "gemv.h"
#if X86
#include "tile.h"

#define VEC __m512
#define ZERO _mm512_setzero_ps()
#define SUM(acc) _mm512_reduce_add_ps(acc)
#define TAIL(r, b) 0.0f
/* AVX512_BF16: pairs of bf16 weights times pairs of bf16 inputs, 32 a step, float32 sums */
#define WVEC __m512bh
#define FMA(acc, w, x) _mm512_dpbf16_ps(acc, w, x)
#define LOAD32(p) (full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask, p))
#define W(r) (__m512bh)LOAD32(wp + (row + r) * ldw + i)
#define X(b) (__m512bh)LOAD32(xp + b * ldx + i)
TBF void block_bf16dp(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    (void)wtype;
    DECLARE_ACCS
    const int64_t k = j->k, ldx = j->ldx, ldw = j->ldw;
    const uint16_t *wp = (const uint16_t *)j->w, *xp = (const uint16_t *)j->x;
    MASKED_LOOP(32, __mmask32, 0xffffffffu, (1ull << (k - i)) - 1)  /* zeroed tail lanes add nothing */
    TILE_STORE(a)
}

#define ROWS_FOR(M) ((M) == 1 ? 8 : (M) <= 2 ? 4 : (M) <= 4 ? 3 : 2)  /* as the float32 tiles */

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
    DISPATCH_M(block_bf16dp, W_BF16);
}

#endif
