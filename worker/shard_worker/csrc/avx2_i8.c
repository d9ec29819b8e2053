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

/* int8 weights (AVX2): 16 a step, widened to int16; a block's last columns in scalar code, added
 * to lane 0 of its integer sums */
INLINE int32_t dot_i8(const int8_t *w, const int16_t *x, int64_t i, int64_t end) {
    int32_t sum = 0;
    for (; i < end; i++) sum += w[i] * x[i];
    return sum;
}
#define VEC __m256i
#define WVEC __m256i
#define ZERO _mm256_setzero_si256()
#define FVEC __m256
#define FZERO _mm256_setzero_ps()
#define FSET1 _mm256_set1_ps
#define FFMA _mm256_fmadd_ps
#define FCVT _mm256_cvtepi32_ps
#define SUM(acc) hsum256(acc)
#define TAIL(r, b) 0.0f
#define FMA(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#define W(r) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wp + (row + r) * ldw + i)))
#define X(b) _mm256_loadu_si256((const __m256i *)(xq + b * kpad + i))
#define TAIL_ROW(r, b) \
    if (R > r) a##r##b = _mm256_add_epi32(a##r##b, _mm256_zextsi128_si256(_mm_cvtsi32_si128(dot_i8(wp + (row + r) * ldw, xq + b * kpad, i, end))));
#define TAIL_COL(b)                                                            \
    if (M > b) {                                                               \
        TAIL_ROW(0, b) TAIL_ROW(1, b) TAIL_ROW(2, b) TAIL_ROW(3, b)            \
        TAIL_ROW(4, b) TAIL_ROW(5, b) TAIL_ROW(6, b) TAIL_ROW(7, b)            \
    }
#define STEPS_256                                                              \
    if (end - i == QBLOCK) {                                                   \
        PREFETCH_ROWS TILE_MUL i += 16; TILE_MUL i += 16; TILE_MUL i += 16; TILE_MUL i += 16; \
        PREFETCH_ROWS TILE_MUL i += 16; TILE_MUL i += 16; TILE_MUL i += 16; TILE_MUL i += 16; \
    }                                                                          \
    for (; i + 16 <= end; i += 16) TILE_STEP                                   \
    if (i < end) { TAIL_COL(0) TAIL_COL(1) TAIL_COL(2) TAIL_COL(3) TAIL_COL(4) TAIL_COL(5) TAIL_COL(6) TAIL_COL(7) }
T256 void block_256_i8(const Job *j, int64_t row, const int R, const int M, const int wtype) { I8_BLOCKS(STEPS_256) }
#define ROWS_FOR(M) ((M) == 1 ? 4 : (M) <= 2 ? 2 : 1)
T256FN void rows_256_i8(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_256_i8, W_I8); }

#endif
