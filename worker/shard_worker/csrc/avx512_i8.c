/* AVX-512 with int8 weights: x quantized to int16, exact integer sums a block (vpmaddwd, or
 * vpdpwssd with AVX512_VNNI), the blocks' sums added in float32. */
#include "gemv.h"
#if X86
#include "tile.h"

/* int8 weights (AVX-512): 32 a step, widened to int16; the block's last step reads `mask` lanes
 * of weights (x is zero beyond k) */
#define VEC __m512i
#define WVEC __m512i
#define ZERO _mm512_setzero_si512()
#define FVEC __m512
#define FZERO _mm512_setzero_ps()
#define FSET1 _mm512_set1_ps
#define FFMA _mm512_fmadd_ps
#define FCVT _mm512_cvtepi32_ps
#define SUM(acc) _mm512_reduce_add_ps(acc)
#define TAIL(r, b) 0.0f
#define W(r) _mm512_cvtepi8_epi16(full ? _mm256_loadu_si256((const __m256i *)(wp + (row + r) * ldw + i)) \
                                       : _mm256_maskz_loadu_epi8(mask, wp + (row + r) * ldw + i))
#define X(b) _mm512_loadu_si512(xq + b * kpad + i)
/* A whole block in four steps with a prefetch every other one, no branch: a test in the loop
 * made GCC copy every accumulator at each step and keep x on the stack. */
#define STEPS_512                                                              \
    if (end - i == QBLOCK) {                                                   \
        const int full = 1;                                                    \
        const __mmask32 mask = 0xffffffffu;                                    \
        PREFETCH_ROWS TILE_MUL i += 32;                                        \
        TILE_MUL i += 32;                                                      \
        PREFETCH_ROWS TILE_MUL i += 32;                                        \
        TILE_MUL i += 32;                                                      \
    } else {                                                                   \
        const int full = 1;                                                    \
        const __mmask32 mask = 0xffffffffu;                                    \
        for (; i + 32 <= end; i += 32) TILE_STEP                               \
    }                                                                          \
    if (i < end) {                                                             \
        const int full = 0;                                                    \
        const __mmask32 mask = (__mmask32)((1ull << (end - i)) - 1);           \
        TILE_STEP                                                              \
    }
#define FMA(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
T512 void block_512_i8(const Job *j, int64_t row, const int R, const int M, const int wtype) { I8_BLOCKS(STEPS_512) }
#undef FMA
#define FMA(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
TVNNI void block_vnni_i8(const Job *j, int64_t row, const int R, const int M, const int wtype) { I8_BLOCKS(STEPS_512) }
#undef FMA

/* two accumulators per row and vector: fewer rows per tile than the float kernels; for one
 * vector 4 (3 to 4 streamed int8 weights ~10% faster than 8 or 2 on Zen 4) */
#define ROWS_FOR(M) ((M) <= 2 ? 4 : (M) <= 4 ? 3 : (M) <= 7 ? 2 : 1)
T512FN void rows_512_i8(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_512_i8, W_I8); }
TVNNIFN void rows_vnni_i8(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_vnni_i8, W_I8); }
#endif
