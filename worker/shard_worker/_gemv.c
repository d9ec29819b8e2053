/* Decode-time matrix products at the memory-bandwidth limit: y[m, n] = x[m, :] . W[n, :] (* s[n])
 * for a few rows of x (m <= 8) and W in nn.Linear's [out, in] layout (rows `ldw` elements apart:
 * a column slice of a wider matrix is read in place), float32, bfloat16 or int8
 * with one float32 scale per output row; x and y are float32 or bfloat16. A decode step reads
 * every weight once, so the whole job is to stream W at the speed of memory: each pass reads a
 * block of W's rows once and multiplies it with all m vectors, which stay in L1/L2 (one bfloat16
 * vector: row after row, one stream; see rows_bf16dp_one).
 *
 * int8 weights meet x quantized once per call to int16, one power-of-two scale per block of
 * QBLOCK columns (see quantize_x): a block's dot product is then an exact integer sum (vpdpwssd,
 * or vpmaddwd without AVX512_VNNI), two instructions per 32 weights where widening each weight to
 * float32 took six; the blocks' sums are added in float32 times their scales. Every path,
 * portable C included, computes the same quantized x, so they agree to float32 rounding.
 *
 * Plain C with no torch headers: the Python side passes data pointers, so the package builds with
 * any C compiler and no torch. The instruction set is chosen at run time (CPUID): AVX-512 (with
 * AVX512_VNNI for int8 weights and AVX512_BF16 dot products for bfloat16 weights when present),
 * AVX2 + FMA, or portable C. Rows are split over a small pool of persistent threads (the caller
 * is thread 0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(_M_X64)
#define X86 1
#include <immintrin.h>
#else
#define X86 0
#endif

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2 };    /* weight dtypes */
enum { X_F32 = 0, X_BF16 = 1 };              /* activation (and output) dtypes */
enum { PORTABLE = 0, AVX2 = 1, AVX512 = 2, AVX512_VNNI = 3, AVX512_BF16 = 4, LEVELS = 5 };
static const char *LEVEL_NAMES[LEVELS] = {"portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"};
#define MAX_M 8
/* int8 weights: x's columns share a scale by blocks of QBLOCK (a multiple of 32: a block is
 * whole vectors but in its last one); its values are int16 in [-QMAX, QMAX] */
#define QBLOCK 128  /* STEPS_512 and STEPS_256 unroll a block: 4 x 32 and 8 x 16 columns */
#define QMAX 32767
#define QEXP_MIN (-100)  /* blocks whose largest |x| is below 2^-101 are quantized as if it were */

typedef struct {
    int wtype, xtype;
    const void *w, *scale, *x;
    void *y;
    const float *xf;   /* x as float32 (the float paths but the bf16 dot products read this) */
    int64_t n, k, m, ldx, ldy;
    int64_t ldw;       /* elements from one weight row to the next (>= k: a column slice of a wider matrix) */
    const int16_t *xq; /* int8 weights: x quantized, [m, kpad] (zero beyond k) */
    const float *xs;   /* and its scales, [m, nblk] */
    int64_t kpad, nblk;
} Job;

typedef void (*RowsFn)(const Job *, int64_t, int64_t);

/* ---------------------------------------------------------------- scalar helpers
 * Always inlined: a call from a kernel to a function compiled for plain x86-64 costs a vzeroupper,
 * which makes the caller spill every vector accumulator around it. */
#define INLINE __attribute__((always_inline)) static inline

INLINE float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

INLINE float scale_at(const Job *j, int64_t row) {  /* int8 rows' scales are float32 */
    return j->wtype == W_I8 ? ((const float *)j->scale)[row] : 1.0f;
}

/* y[b, row] = acc * scale, in the activation dtype */
INLINE void store(const Job *j, int64_t b, int64_t row, float acc) {
    acc *= scale_at(j, row);
    if (j->xtype == X_F32) ((float *)j->y)[b * j->ldy + row] = acc;
    else ((uint16_t *)j->y)[b * j->ldy + row] = f32_to_bf16(acc);
}

/* ---------------------------------------------------------------- x for int8 weights
 * Each block of QBLOCK columns of each row of x gets the scale s = 2^(e - 15), e the exponent of
 * its largest magnitude (largest in [2^(e-1), 2^e)), and the values q = round(x / s) clamped to
 * [-QMAX, QMAX] (round half to even): |x - q s| <= s <= 2^-14 of the block's largest magnitude,
 * and none at all for a bfloat16 x within 2^7 of it (8 significant bits fit in 15). A block
 * holding inf or NaN gets q = 0 and s = NaN, so its products come out NaN. The scales and the
 * division are exact powers of two: quant.quantize_activations computes the same bits in torch. */
INLINE float pow2(int e) {  /* 2^e for e in [-126, 127] */
    const uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE float x_at(const Job *j, int64_t b, int64_t i) {
    return j->xtype == X_F32 ? ((const float *)j->x)[b * j->ldx + i]
                             : bf16_to_f32(((const uint16_t *)j->x)[b * j->ldx + i]);
}

/* A block's scale from the largest bits of its |x| (ordered as the magnitudes, NaN above inf);
 * *inv = 1 / scale, or 0 for a block with inf or NaN (whose values are stored as 0). */
INLINE float block_scale(uint32_t largest, float *inv) {
    if (largest >= 0x7f800000u) {
        *inv = 0.0f;
        return __builtin_nanf("");
    }
    int e = (int)(largest >> 23) - 126;  /* frexp's exponent (subnormals and 0 fall below QEXP_MIN) */
    e = e < QEXP_MIN ? QEXP_MIN : e;
    *inv = pow2(15 - e);
    return pow2(e - 15);
}

/* The largest bits of |x| over columns [i, end) of row b, and `largest` */
INLINE uint32_t largest_bits(const Job *j, int64_t b, int64_t i, int64_t end, uint32_t largest) {
    for (; i < end; i++) {
        const float v = x_at(j, b, i);
        uint32_t u;
        memcpy(&u, &v, 4);
        u &= 0x7fffffffu;
        largest = u > largest ? u : largest;
    }
    return largest;
}

/* q[i : end] = round(x * inv) of row b, clamped (0 where inv is 0: a block with inf or NaN) */
INLINE void quantize_range(const Job *j, int64_t b, int16_t *q, int64_t i, int64_t end, float inv) {
    for (; i < end; i++) {
        float v = inv != 0.0f ? x_at(j, b, i) * inv : 0.0f;  /* as torch's x * (1 / s): |v| < 2^15 */
        v = (v + 12582912.0f) - 12582912.0f;                     /* round half to even (1.5 * 2^23) */
        q[i] = (int16_t)(v > QMAX ? QMAX : v < -QMAX ? -QMAX : v);
    }
}

/* x's rows as int8 weights meet them: xq [m, kpad] (zero beyond k) and xs [m, nblk] */
static void quantize_x(const Job *j, int16_t *xq, float *xs) {
    for (int64_t b = 0; b < j->m; b++) {
        int16_t *q = xq + b * j->kpad;
        for (int64_t blk = 0; blk < j->nblk; blk++) {
            const int64_t c0 = blk * QBLOCK, c1 = c0 + QBLOCK < j->k ? c0 + QBLOCK : j->k;
            float inv;
            xs[b * j->nblk + blk] = block_scale(largest_bits(j, b, c0, c1, 0), &inv);
            quantize_range(j, b, q, c0, c1, inv);
        }
        for (int64_t i = j->k; i < j->kpad; i++) q[i] = 0;
    }
}

/* ---------------------------------------------------------------- portable C */
INLINE float weight_at(const Job *j, int64_t row, int64_t i) {
    const int64_t at = row * j->ldw + i;
    return j->wtype == W_F32 ? ((const float *)j->w)[at] : bf16_to_f32(((const uint16_t *)j->w)[at]);
}

static void rows_portable(const Job *j, int64_t r0, int64_t r1) {
    float acc[MAX_M];
    for (int64_t row = r0; row < r1; row++) {
        for (int64_t b = 0; b < j->m; b++) acc[b] = 0.0f;
        for (int64_t i = 0; i < j->k; i++) {
            const float w = weight_at(j, row, i);
            for (int64_t b = 0; b < j->m; b++) acc[b] += w * j->xf[b * j->k + i];
        }
        for (int64_t b = 0; b < j->m; b++) store(j, b, row, acc[b]);
    }
}

/* int8 weights: one exact integer sum per block of quantized x, added in float32 */
static void rows_portable_i8(const Job *j, int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; row++) {
        const int8_t *w = (const int8_t *)j->w + row * j->ldw;
        for (int64_t b = 0; b < j->m; b++) {
            float acc = 0.0f;
            for (int64_t blk = 0; blk < j->nblk; blk++) {
                const int64_t c0 = blk * QBLOCK, c1 = c0 + QBLOCK < j->k ? c0 + QBLOCK : j->k;
                int32_t sum = 0;
                for (int64_t i = c0; i < c1; i++) sum += w[i] * j->xq[b * j->kpad + i];
                acc += (float)sum * j->xs[b * j->nblk + blk];
            }
            store(j, b, row, acc);
        }
    }
}

#if X86
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

/* The dot product of row `row` and vector b over [i, k), in scalar code (AVX2 row tails) */
INLINE float tail_dot(const Job *j, int64_t row, int64_t b, int64_t i) {
    float acc = 0.0f;
    for (; i < j->k; i++) acc += weight_at(j, row, i) * j->xf[b * j->k + i];
    return acc;
}

/* ---------------------------------------------------------------- AVX-512 */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), always_inline)) static inline
#define T512FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

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
#undef WVEC
#undef W
#undef X
#undef FMA

/* AVX512_BF16: pairs of bf16 weights times pairs of bf16 inputs, 32 a step, float32 sums */
#define TBF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"), always_inline)) static inline
#define TBFFN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
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
#undef LOAD32
#undef VEC
#undef WVEC
#undef ZERO
#undef FMA
#undef SUM
#undef TAIL
#undef W
#undef X

/* Rows per tile: enough to share each x load (and, for one vector, 8 rows: more streams in
 * flight), few enough that R x M accumulators fit the 32 vector registers beside the weights. */
#define ROWS_FOR(M) ((M) == 1 ? 8 : (M) <= 2 ? 4 : (M) <= 4 ? 3 : 2)

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

T512FN static void rows_512_f32(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_512, W_F32); }
T512FN static void rows_512_bf16(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_512, W_BF16); }
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
TBFFN static void rows_bf16dp(const Job *j, int64_t r0, int64_t r1) {
    if (j->m == 1) {
        rows_bf16dp_one(j, r0, r1);
        return;
    }
    DISPATCH_M(block_bf16dp, W_BF16);
}

/* int8 weights (AVX-512): 32 a step, widened to int16; the block's last step reads `mask` lanes
 * of weights (x is zero beyond k) */
#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma"), always_inline)) static inline
#define TVNNIFN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
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
#undef ROWS_FOR
#define ROWS_FOR(M) ((M) <= 2 ? 4 : (M) <= 4 ? 3 : (M) <= 7 ? 2 : 1)
T512FN static void rows_512_i8(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_512_i8, W_I8); }
TVNNIFN static void rows_vnni_i8(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_vnni_i8, W_I8); }
#undef VEC
#undef WVEC
#undef ZERO
#undef FVEC
#undef FZERO
#undef FSET1
#undef FFMA
#undef FCVT
#undef SUM
#undef TAIL
#undef W
#undef X

/* ---------------------------------------------------------------- AVX2 + FMA */
#define T256 __attribute__((target("avx2,fma"), always_inline)) static inline
#define T256FN __attribute__((target("avx2,fma")))

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

#define VEC __m256
#define WVEC __m256
#define ZERO _mm256_setzero_ps()
#define FMA(acc, w, x) _mm256_fmadd_ps(w, x, acc)
#define SUM(acc) hsum256(acc)
#define TAIL(r, b) tail_dot(j, row + r, b, i)
#define W(r) load8_256(wtype, j->w, (row + r) * ldw + i)
#define X(b) _mm256_loadu_ps(j->xf + b * k + i)
T256 void block_256(const Job *j, int64_t row, const int R, const int M, const int wtype) {
    DECLARE_ACCS
    const int64_t k = j->k, ldw = j->ldw;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) TILE_STEP
    TILE_STORE(a)
}

/* 16 registers: fewer accumulators than AVX-512 */
#undef ROWS_FOR
#define ROWS_FOR(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)
T256FN static void rows_256_f32(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_256, W_F32); }
T256FN static void rows_256_bf16(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_256, W_BF16); }
#undef VEC
#undef WVEC
#undef ZERO
#undef FMA
#undef SUM
#undef TAIL
#undef W
#undef X

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
#undef ROWS_FOR
#define ROWS_FOR(M) ((M) == 1 ? 4 : (M) <= 2 ? 2 : 1)
T256FN static void rows_256_i8(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_256_i8, W_I8); }

/* quantize_x with vectors (the same bits): 16 values a step with AVX-512, 8 with AVX2 + FMA,
 * rounded by cvtps2dq (round half to even, MXCSR's default, as the scalar code rounds) */
T512FN static void quantize_x_512(const Job *j, int16_t *xq, float *xs) {
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

T256FN static void quantize_x_256(const Job *j, int16_t *xq, float *xs) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), lo = _mm256_set1_epi32(-QMAX), hi = _mm256_set1_epi32(QMAX);
    for (int64_t b = 0; b < j->m; b++) {
        int16_t *q = xq + b * j->kpad;
        const float *xf32 = (const float *)j->x + b * j->ldx;
        const uint16_t *xb16 = (const uint16_t *)j->x + b * j->ldx;
#define LOAD_X(at)                                                              \
    (j->xtype == X_F32 ? _mm256_loadu_ps(xf32 + (at))                          \
                       : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xb16 + (at)))), 16)))
        for (int64_t blk = 0; blk < j->nblk; blk++) {
            const int64_t c0 = blk * QBLOCK, c1 = c0 + QBLOCK < j->k ? c0 + QBLOCK : j->k;
            __m256i big = _mm256_setzero_si256();
            int64_t i = c0;
            for (; i + 8 <= c1; i += 8) big = _mm256_max_epu32(big, _mm256_and_si256(_mm256_castps_si256(LOAD_X(i)), magnitude));
            uint32_t lanes[8], largest = 0;
            _mm256_storeu_si256((__m256i *)lanes, big);
            for (int l = 0; l < 8; l++) largest = lanes[l] > largest ? lanes[l] : largest;
            float inv;
            xs[b * j->nblk + blk] = block_scale(largest_bits(j, b, i, c1, largest), &inv);
            const __m256 scale = _mm256_set1_ps(inv);
            for (i = c0; i + 8 <= c1; i += 8) {
                __m256i v = inv != 0.0f ? _mm256_cvtps_epi32(_mm256_mul_ps(LOAD_X(i), scale)) : _mm256_setzero_si256();
                v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
                const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                _mm_storeu_si128((__m128i *)(q + i), packed);
            }
            quantize_range(j, b, q, i, c1, inv);
        }
#undef LOAD_X
        for (int64_t i = j->k; i < j->kpad; i++) q[i] = 0;
    }
}
#endif /* X86 */

/* ---------------------------------------------------------------- which kernel */
static int supported[LEVELS];

static void detect(void) {
    supported[PORTABLE] = 1;
#if X86
    __builtin_cpu_init();
    supported[AVX2] = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    supported[AVX512] = supported[AVX2] && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    /* every CPU with AVX512_BF16 has AVX512_VNNI: the levels stay a ladder */
    supported[AVX512_VNNI] = supported[AVX512] && __builtin_cpu_supports("avx512vnni");
    supported[AVX512_BF16] = supported[AVX512_VNNI] && __builtin_cpu_supports("avx512bf16");
#endif
}

static RowsFn pick(int level, int wtype, int xtype) {
#if X86
    if (wtype == W_I8)
        return level >= AVX512_VNNI ? rows_vnni_i8 : level >= AVX512 ? rows_512_i8
             : level >= AVX2 ? rows_256_i8 : rows_portable_i8;
    if (level >= AVX512_BF16 && wtype == W_BF16 && xtype == X_BF16) return rows_bf16dp;
    if (level >= AVX512) return wtype == W_F32 ? rows_512_f32 : rows_512_bf16;
    if (level >= AVX2) return wtype == W_F32 ? rows_256_f32 : rows_256_bf16;
#endif
    (void)level; (void)xtype;
    return wtype == W_I8 ? rows_portable_i8 : rows_portable;
}

/* ---------------------------------------------------------------- the thread pool */
#define MAX_THREADS 64
#define SPINS 4000  /* a worker polls this long for the next job (decode calls come back to back) */

typedef struct {
    pthread_mutex_t call;  /* one job at a time */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    int started;                    /* worker threads running (thread 0 is the caller) */
    volatile uint64_t generation;   /* bumped for each job */
    volatile int remaining;         /* workers still on the current job */
    int active;                     /* threads taking part in the current job */
    void (*task)(void *, int, int);
    void *arg;
} Pool;

static Pool pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                    PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL};

static inline void relax(void) {
#if X86
    _mm_pause();
#endif
}

static void *worker_main(void *p) {
    const int id = (int)(intptr_t)p;
    uint64_t seen = 0;
    for (;;) {
        int spins = 0;
        while (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen && spins < SPINS) { relax(); spins++; }
        if (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen) {
            pthread_mutex_lock(&pool.mu);
            while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        if (id < pool.active) {
            pool.task(pool.arg, id, pool.active);
            if (__atomic_sub_fetch(&pool.remaining, 1, __ATOMIC_ACQ_REL) == 0) {
                pthread_mutex_lock(&pool.mu);
                pthread_cond_signal(&pool.done);
                pthread_mutex_unlock(&pool.mu);
            }
        }
    }
    return NULL;
}

/* A forked child has none of its parent's workers: it starts its own when it needs them. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.generation = 0;
    pool.remaining = 0;
}

/* Run task(arg, i, n) for i in [0, n) on n threads, the caller being thread 0. */
static void parallel(void (*task)(void *, int, int), void *arg, int n) {
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&pool.call);
    while (pool.started < n - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(pool.started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.started++;
    }
    if (n > pool.started + 1) n = pool.started + 1;
    if (n > 1) {
        pool.task = task;
        pool.arg = arg;
        pool.active = n;
        __atomic_store_n(&pool.remaining, n - 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&pool.mu);
        __atomic_add_fetch(&pool.generation, 1, __ATOMIC_ACQ_REL);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
    }
    task(arg, 0, n);
    if (n > 1) {
        int spins = 0;
        while (__atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE) && spins < SPINS) { relax(); spins++; }
        pthread_mutex_lock(&pool.mu);
        while (__atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE)) pthread_cond_wait(&pool.done, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
    }
    pthread_mutex_unlock(&pool.call);
}

/* ---------------------------------------------------------------- matrix products */
typedef struct { const Job *job; RowsFn fn; } GemvTask;

static void gemv_part(void *p, int i, int n) {
    const GemvTask *t = (const GemvTask *)p;
    const int64_t rows = t->job->n, per = (rows + n - 1) / n;
    const int64_t r0 = i * per, r1 = r0 + per < rows ? r0 + per : rows;
    if (r0 < r1) t->fn(t->job, r0, r1);
}

static void quantize_with(int level, const Job *j, int16_t *xq, float *xs) {
#if X86
    if (level >= AVX512) { quantize_x_512(j, xq, xs); return; }
    if (level >= AVX2) { quantize_x_256(j, xq, xs); return; }
#endif
    (void)level;
    quantize_x(j, xq, xs);
}

/* x as the chosen kernel reads it: quantized for int8 weights (quantize_x), as it is for the
 * bfloat16 dot products, float32 [m, k] contiguous for the other float paths. Returns the buffer
 * to free (or NULL); sets *failed when memory runs out. */
static void *prepare_x(Job *j, int level, int *failed) {
    const int64_t m = j->m, k = j->k;
    if (j->wtype == W_I8) {
        j->nblk = (k + QBLOCK - 1) / QBLOCK;
        j->kpad = j->nblk * QBLOCK;
        const size_t qbytes = (size_t)(m * j->kpad) * sizeof(int16_t);  /* a multiple of 64 */
        const size_t sbytes = ((size_t)(m * j->nblk) * sizeof(float) + 63) & ~(size_t)63;
        char *buf = (char *)aligned_alloc(64, qbytes + sbytes);
        if (!buf) { *failed = 1; return NULL; }
        j->xq = (const int16_t *)buf;
        j->xs = (const float *)(buf + qbytes);
        quantize_with(level, j, (int16_t *)buf, (float *)(buf + qbytes));
        return buf;
    }
    if (X86 && level >= AVX512_BF16 && j->wtype == W_BF16) return NULL;
    if (j->xtype == X_F32 && j->ldx == k) {
        j->xf = (const float *)j->x;
        return NULL;
    }
    float *xf = (float *)malloc((size_t)(m * k) * sizeof(float));
    if (!xf) { *failed = 1; return NULL; }
    for (int64_t b = 0; b < m; b++)
        for (int64_t i = 0; i < k; i++) xf[b * k + i] = x_at(j, b, i);
    j->xf = xf;
    return xf;
}

/* y = x W^T (* scale) for m rows of x, split over `threads`; 0, or -1 when memory ran out.
 * Runs without the GIL (the callers release it). */
static int gemv_run(int wtype, int xtype, const void *w, const void *scale, const void *x, void *y, int64_t n,
                    int64_t k, int64_t ldw, int64_t m, int64_t ldx, int64_t ldy, int threads, int level) {
    Job job = {wtype, xtype, w, scale, x, y, NULL, n, k, m, ldx, ldy, ldw, NULL, NULL, 0, 0};
    GemvTask task = {&job, pick(level, wtype, xtype)};
    int failed = 0;
    void *buffer = prepare_x(&job, level, &failed);
    if (!failed) {
        /* a thread per ~64K weights at least: below that, waking one costs more than it saves */
        const int64_t useful = (n * k) / 65536 + 1;
        int nt = threads < 1 ? 1 : threads;
        if (nt > useful) nt = (int)useful;
        parallel(gemv_part, &task, nt);
    }
    free(buffer);
    return failed ? -1 : 0;
}

/* the dtypes and shapes gemv_run takes */
static int gemv_valid(int wtype, int xtype, const void *scale, int64_t n, int64_t k, int64_t ldw, int64_t m,
                      int64_t ldx, int64_t ldy) {
    return !(wtype < W_F32 || wtype > W_I8 || xtype < X_F32 || xtype > X_BF16 || m < 1 || m > MAX_M || n < 0
             || k < 1 || ldw < k || ldx < k || ldy < n || (wtype == W_I8 && !scale)
             || (wtype == W_F32 && xtype != X_F32) || (wtype == W_BF16 && xtype != X_BF16));
}

static PyObject *py_linear(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long w, scale, x, y;
    int wtype, xtype, threads, level;
    long long n, k, ldw, m, ldx, ldy;
    if (!PyArg_ParseTuple(args, "iiKKKKLLLLLLii", &wtype, &xtype, &w, &scale, &x, &y, &n, &k, &ldw, &m, &ldx, &ldy,
                          &threads, &level))
        return NULL;
    if (!gemv_valid(wtype, xtype, (const void *)(uintptr_t)scale, n, k, ldw, m, ldx, ldy)) {
        PyErr_SetString(PyExc_ValueError, "linear: unsupported dtypes or shape");
        return NULL;
    }
    if (level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_Format(PyExc_ValueError, "linear: this CPU cannot run kernel level %d", level);
        return NULL;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = gemv_run(wtype, xtype, (const void *)(uintptr_t)w, (const void *)(uintptr_t)scale,
                      (const void *)(uintptr_t)x, (void *)(uintptr_t)y, n, k, ldw, m, ldx, ldy, threads, level);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, q, s;
    int xtype, level;
    long long k, m, ldx;
    if (!PyArg_ParseTuple(args, "iKKKLLLi", &xtype, &x, &q, &s, &k, &m, &ldx, &level)) return NULL;
    if (xtype < X_F32 || xtype > X_BF16 || m < 1 || k < 1 || ldx < k || level < 0 || level >= LEVELS
        || !supported[level]) {
        PyErr_SetString(PyExc_ValueError, "quantize: unsupported dtype, shape or level");
        return NULL;
    }
    Job job = {.wtype = W_I8, .xtype = xtype, .x = (const void *)(uintptr_t)x, .k = k, .m = m, .ldx = ldx};
    job.nblk = (k + QBLOCK - 1) / QBLOCK;
    job.kpad = job.nblk * QBLOCK;
    Py_BEGIN_ALLOW_THREADS
    quantize_with(level, &job, (int16_t *)(uintptr_t)q, (float *)(uintptr_t)s);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- the rest of a decode step
 * What a decode step does besides its matrix products, for one token a row, in one call each
 * where torch took several operators of a few microseconds (and its bfloat16 flash attention
 * ~120 us a layer at 34 cached columns, 7 ms at 2048): RMSNorm, and attention with its rope and
 * KV-cache write. GCC vector extensions (8 floats), compiled for AVX2 + FMA or plain x86-64 / C. */
#pragma GCC diagnostic ignored "-Wpsabi"  /* 32-byte vectors pass only between inlined functions */
typedef float f8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

INLINE float load1(int xtype, const void *p, int64_t at) {
    return xtype == X_F32 ? ((const float *)p)[at] : bf16_to_f32(((const uint16_t *)p)[at]);
}

INLINE void store1(int xtype, void *p, int64_t at, float v) {
    if (xtype == X_F32) ((float *)p)[at] = v;
    else ((uint16_t *)p)[at] = f32_to_bf16(v);
}

INLINE f8 load8(int xtype, const void *p, int64_t at) {
    f8 v;
    if (xtype == X_F32) {
        memcpy(&v, (const float *)p + at, sizeof v);
    } else {
        u16x8 h;
        memcpy(&h, (const uint16_t *)p + at, sizeof h);
        const u32x8 u = __builtin_convertvector(h, u32x8) << 16;
        memcpy(&v, &u, sizeof v);
    }
    return v;
}

/* *v rounded to bfloat16 (to nearest even, NaN kept NaN, as f32_to_bf16), still as float32 */
INLINE void round_bf16_8(f8 *v) {
    u32x8 u;
    memcpy(&u, v, sizeof u);
    const u32x8 nan = (u & 0x7fffffffu) > 0x7f800000u;  /* all ones where NaN */
    const u32x8 rounded = ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u) & ~nan;
    u = rounded | ((u | 0x400000u) & 0xffff0000u & nan);
    memcpy(v, &u, sizeof u);
}

/* p[at : at + 8] = *v in the activation dtype (a float32 *v already rounded for bfloat16) */
INLINE void store8(int xtype, void *p, int64_t at, const f8 *v) {
    if (xtype == X_F32) {
        memcpy((float *)p + at, v, sizeof *v);
    } else {
        u32x8 u;
        memcpy(&u, v, sizeof u);
        const u16x8 h = __builtin_convertvector(u >> 16, u16x8);
        memcpy((uint16_t *)p + at, &h, sizeof h);
    }
}

#define HSUM8(v) ((((v)[0] + (v)[4]) + ((v)[1] + (v)[5])) + (((v)[2] + (v)[6]) + ((v)[3] + (v)[7])))

/* dst[0 : len] = src[at : at + len] (the activation dtype) as float32 */
INLINE void to_float(float *dst, int xtype, const void *src, int64_t at, int64_t len) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const f8 v = load8(xtype, src, at + i);
        memcpy(dst + i, &v, sizeof v);
    }
    for (; i < len; i++) dst[i] = load1(xtype, src, at + i);
}

INLINE f8 load8f(const float *p) {
    f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* four sums side by side: one chain of dependent FMAs waited on each one's latency */
INLINE float dot(const float *a, const float *b, int64_t len) {
    f8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        s0 += load8f(a + i) * load8f(b + i);
        s1 += load8f(a + i + 8) * load8f(b + i + 8);
        s2 += load8f(a + i + 16) * load8f(b + i + 16);
        s3 += load8f(a + i + 24) * load8f(b + i + 24);
    }
    for (; i + 8 <= len; i += 8) s0 += load8f(a + i) * load8f(b + i);
    const f8 acc = (s0 + s1) + (s2 + s3);
    float sum = HSUM8(acc);
    for (; i < len; i++) sum += a[i] * b[i];
    return sum;
}

/* acc += p * v */
INLINE void add_scaled(float *acc, float p, const float *v, int64_t len) {
    const f8 pv = {p, p, p, p, p, p, p, p};
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const f8 a = load8f(acc + i) + pv * load8f(v + i);
        memcpy(acc + i, &a, sizeof a);
    }
    for (; i < len; i++) acc[i] += p * v[i];
}

/* e^x, 8 at a time (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-5 polynomial for e^r,
 * 2^n into the exponent; within 2 ulp), for x <= 0; below -87 it gives e^-87 rather than less. */
typedef int32_t i32x8 __attribute__((vector_size(32)));
INLINE f8 exp8(const f8 *in) {
    f8 x = *in;
    const f8 floor_ = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
    const i32x8 low = x < floor_;  /* -1 where below */
    i32x8 bits;
    memcpy(&bits, &x, sizeof bits);
    i32x8 fl;
    memcpy(&fl, &floor_, sizeof fl);
    bits = (bits & ~low) | (fl & low);
    memcpy(&x, &bits, sizeof x);
    const f8 shift = {12582912.f, 12582912.f, 12582912.f, 12582912.f, 12582912.f, 12582912.f, 12582912.f, 12582912.f};
    const f8 n = (x * 1.44269504088896341f + shift) - shift;  /* round(x / ln 2) */
    const f8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    f8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    i32x8 out;
    memcpy(&out, &p, sizeof out);
    out += __builtin_convertvector(n, i32x8) << 23;
    memcpy(&p, &out, sizeof p);
    return p;
}

/* RMSNorm of each row as HF computes it: x / rms(x) in float32, rounded to the dtype, times w */
INLINE void rms_norm_rows(int xtype, const void *x, const void *w, void *y, int64_t n, int64_t h, float eps) {
    for (int64_t b = 0; b < n; b++) {
        f8 acc = {0};
        int64_t i = 0;
        for (; i + 8 <= h; i += 8) {
            const f8 v = load8(xtype, x, b * h + i);
            acc += v * v;
        }
        float sum = HSUM8(acc);
        for (; i < h; i++) sum += load1(xtype, x, b * h + i) * load1(xtype, x, b * h + i);
        const float inv = 1.0f / __builtin_sqrtf(sum / (float)h + eps);
        const f8 invv = {inv, inv, inv, inv, inv, inv, inv, inv};
        for (i = 0; i + 8 <= h; i += 8) {
            f8 v = load8(xtype, x, b * h + i) * invv;
            if (xtype != X_F32) round_bf16_8(&v);
            v *= load8(xtype, w, i);
            if (xtype != X_F32) round_bf16_8(&v);
            store8(xtype, y, b * h + i, &v);
        }
        for (; i < h; i++) {
            float v = load1(xtype, x, b * h + i) * inv;
            if (xtype != X_F32) v = bf16_to_f32(f32_to_bf16(v));
            store1(xtype, y, b * h + i, v * load1(xtype, w, i));
        }
    }
}

/* SwiGLU's silu(g) = g / (1 + e^-g), in float32, from e = e^-|g| (exp8 takes x <= 0): g / (1 + e)
 * for g >= 0, g e / (1 + e) below (the same value, without computing e^-g, which overflows) */
INLINE f8 silu8(f8 g) {
    u32x8 bits;
    memcpy(&bits, &g, sizeof bits);
    f8 neg_abs;
    const u32x8 nb = bits | 0x80000000u;
    memcpy(&neg_abs, &nb, sizeof neg_abs);
    const f8 e = exp8(&neg_abs), one = {1, 1, 1, 1, 1, 1, 1, 1};
    const i32x8 below = g < (f8){0};  /* -1 where g < 0 */
    /* below -87, e^-g overflows float32 in torch's g / (1 + e^-g): -0, where exp8 stops at e^-87 */
    const i32x8 far = g < (f8){-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
    i32x8 gi, ei, gei;
    memcpy(&ei, &e, sizeof ei);
    ei &= ~far;
    f8 e_near;
    memcpy(&e_near, &ei, sizeof e_near);
    const f8 ge = g * e_near;
    memcpy(&gi, &g, sizeof gi);
    memcpy(&gei, &ge, sizeof gei);
    const i32x8 numi = (gei & below) | (gi & ~below);
    f8 num;
    memcpy(&num, &numi, sizeof num);
    return num / (one + e);
}

/* out[b] = silu(gate) * up for rows [n, 2 inter] = (gate | up), as torch's F.silu(gate) * up: the
 * silu rounded to the dtype, then the product */
INLINE void silu_mul_rows(int xtype, const void *gu, void *out, int64_t n, int64_t inter) {
    for (int64_t b = 0; b < n; b++) {
        const int64_t g0 = b * 2 * inter, u0 = g0 + inter, o0 = b * inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const int64_t len = inter - i < 8 ? inter - i : 8;
            f8 g = {0}, u = {0};
            if (len == 8) {
                g = load8(xtype, gu, g0 + i);
                u = load8(xtype, gu, u0 + i);
            } else {
                for (int64_t l = 0; l < len; l++) { g[l] = load1(xtype, gu, g0 + i + l); u[l] = load1(xtype, gu, u0 + i + l); }
            }
            f8 y = silu8(g);
            if (xtype != X_F32) round_bf16_8(&y);
            y *= u;
            if (xtype != X_F32) round_bf16_8(&y);
            if (len == 8) store8(xtype, out, o0 + i, &y);
            else for (int64_t l = 0; l < len; l++) store1(xtype, out, o0 + i + l, y[l]);
        }
    }
}

/* dst[b, :len] += src[b * ld : b * ld + len] for n rows (ld 0: one row for all, a bias), each sum
 * in float32 rounded to the dtype, as torch adds */
INLINE void add_rows(int xtype, void *dst, const void *src, int64_t n, int64_t len, int64_t ld) {
    for (int64_t b = 0; b < n; b++) {
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) {
            f8 v = load8(xtype, dst, b * len + i) + load8(xtype, src, b * ld + i);
            if (xtype != X_F32) round_bf16_8(&v);
            store8(xtype, dst, b * len + i, &v);
        }
        for (; i < len; i++) store1(xtype, dst, b * len + i, load1(xtype, dst, b * len + i) + load1(xtype, src, b * ld + i));
    }
}

typedef struct {
    int xtype;
    const void *qkv;              /* [n, (heads + 2 kv_heads) * hd]: q, k, v of each row */
    const void *cos, *sin;        /* [n, hd]: the rope of each row's position, in the dtype */
    void *kc, *vc;                /* the layer's cache from row r0: [rows, kv_heads, max_len, hd] */
    int64_t cache_row, cache_head; /* their strides, in elements (a column is hd) */
    const int64_t *first;         /* [n]: the first column each row attends to */
    int64_t col;                  /* the step's column: its k and v are written there */
    void *out;                    /* [n, heads * hd] */
    int64_t n, heads, kv_heads, hd;
    float scale;
} Attn;

/* HF's rope (rotate_half: the halves (x1, x2) -> (-x2, x1)) of hd values at `at`, in float32 */
INLINE void rope(float *out, const Attn *a, int64_t b, int64_t at) {
    const int64_t half = a->hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = load1(a->xtype, a->qkv, at + i), x2 = load1(a->xtype, a->qkv, at + half + i);
        out[i] = x1 * load1(a->xtype, a->cos, b * a->hd + i) - x2 * load1(a->xtype, a->sin, b * a->hd + i);
        out[half + i] = x2 * load1(a->xtype, a->cos, b * a->hd + half + i) + x1 * load1(a->xtype, a->sin, b * a->hd + half + i);
    }
}

/* Row b, KV head g: write its k (rotated) and v into the cache, then its `group` query heads
 * attend to columns [first[b], col]: the scores of every column (each column of K made float32
 * once for the group), their softmax in float32, then the values (each column of V made float32
 * once). `work`: 2 (group + 1) hd + group (col + 1) floats. */
INLINE void attend_one(const Attn *a, int64_t b, int64_t g, float *work) {
    const int64_t hd = a->hd, group = a->heads / a->kv_heads, width = (a->heads + 2 * a->kv_heads) * hd;
    const int64_t first = a->first[b], len = a->col + 1 - first;
    float *q = work, *acc = q + group * hd, *k = acc + group * hd, *v = k + hd, *score = v + hd;
    const int64_t head = b * a->cache_row + g * a->cache_head;
    rope(k, a, b, b * width + (a->heads + g) * hd);
    for (int64_t i = 0; i < hd; i++) {
        store1(a->xtype, a->kc, head + a->col * hd + i, k[i]);
        store1(a->xtype, a->vc, head + a->col * hd + i, load1(a->xtype, a->qkv, b * width + (a->heads + a->kv_heads + g) * hd + i));
    }
    for (int64_t j = 0; j < group; j++) rope(q + j * hd, a, b, b * width + (g * group + j) * hd);
    for (int64_t c = 0; c < len; c++) {
        to_float(k, a->xtype, a->kc, head + (first + c) * hd, hd);
        for (int64_t j = 0; j < group; j++) score[j * len + c] = dot(q + j * hd, k, hd) * a->scale;
    }
    for (int64_t j = 0; j < group; j++) {  /* softmax, in place; a NaN score makes the head's output NaN */
        float *sc = score + j * len, top = sc[0], sum = 0.0f;
        int nan = 0;
        for (int64_t c = 0; c < len; c++) {
            nan |= sc[c] != sc[c];
            top = sc[c] > top ? sc[c] : top;
        }
        const f8 topv = {top, top, top, top, top, top, top, top};
        int64_t c = 0;
        for (; c + 8 <= len; c += 8) {
            const f8 d = load8f(sc + c) - topv, e = exp8(&d);
            memcpy(sc + c, &e, sizeof e);
            sum += HSUM8(e);
        }
        for (; c < len; c++) {
            f8 e = {sc[c] - top, 0, 0, 0, 0, 0, 0, 0};
            e = exp8(&e);
            sc[c] = e[0];
            sum += e[0];
        }
        const float inv = nan ? __builtin_nanf("") : 1.0f / sum;
        for (c = 0; c < len; c++) sc[c] *= inv;
    }
    memset(acc, 0, (size_t)(group * hd) * sizeof(float));
    for (int64_t c = 0; c < len; c++) {
        to_float(v, a->xtype, a->vc, head + (first + c) * hd, hd);
        for (int64_t j = 0; j < group; j++) add_scaled(acc + j * hd, score[j * len + c], v, hd);
    }
    for (int64_t j = 0; j < group; j++)
        for (int64_t i = 0; i < hd; i++) store1(a->xtype, a->out, b * a->heads * hd + (g * group + j) * hd + i, acc[j * hd + i]);
}

typedef struct { const Attn *attn; int avx2; float *work; int64_t per_thread; } AttnTask;

#if X86
T256FN static void attend_rows_256(const Attn *a, int64_t t0, int64_t t1, float *work) {
    for (int64_t t = t0; t < t1; t++) attend_one(a, t / a->kv_heads, t % a->kv_heads, work);
}
T256FN static void rms_norm_256(int xtype, const void *x, const void *w, void *y, int64_t n, int64_t h, float eps) {
    rms_norm_rows(xtype, x, w, y, n, h, eps);
}
T256FN static void silu_mul_256(int xtype, const void *gu, void *out, int64_t n, int64_t inter) {
    silu_mul_rows(xtype, gu, out, n, inter);
}
T256FN static void add_rows_256(int xtype, void *dst, const void *src, int64_t n, int64_t len, int64_t ld) {
    add_rows(xtype, dst, src, n, len, ld);
}
#endif
static void attend_rows(const Attn *a, int64_t t0, int64_t t1, float *work) {
    for (int64_t t = t0; t < t1; t++) attend_one(a, t / a->kv_heads, t % a->kv_heads, work);
}
static void rms_norm_plain(int xtype, const void *x, const void *w, void *y, int64_t n, int64_t h, float eps) {
    rms_norm_rows(xtype, x, w, y, n, h, eps);
}
static void silu_mul_plain(int xtype, const void *gu, void *out, int64_t n, int64_t inter) {
    silu_mul_rows(xtype, gu, out, n, inter);
}
static void add_rows_plain(int xtype, void *dst, const void *src, int64_t n, int64_t len, int64_t ld) {
    add_rows(xtype, dst, src, n, len, ld);
}
static void silu_mul_run(int level, int xtype, const void *gu, void *out, int64_t n, int64_t inter) {
#if X86
    if (level >= AVX2) { silu_mul_256(xtype, gu, out, n, inter); return; }
#endif
    (void)level;
    silu_mul_plain(xtype, gu, out, n, inter);
}
static void add_rows_run(int level, int xtype, void *dst, const void *src, int64_t n, int64_t len, int64_t ld) {
#if X86
    if (level >= AVX2) { add_rows_256(xtype, dst, src, n, len, ld); return; }
#endif
    (void)level;
    add_rows_plain(xtype, dst, src, n, len, ld);
}

static void attend_part(void *p, int i, int nt) {  /* (row, KV head) pairs, split over the threads */
    const AttnTask *t = (const AttnTask *)p;
    const int64_t tasks = t->attn->n * t->attn->kv_heads, per = (tasks + nt - 1) / nt;
    const int64_t t0 = i * per, t1 = t0 + per < tasks ? t0 + per : tasks;
    float *work = t->work + i * t->per_thread;
#if X86
    if (t->avx2) { if (t0 < t1) attend_rows_256(t->attn, t0, t1, work); return; }
#endif
    if (t0 < t1) attend_rows(t->attn, t0, t1, work);
}

/* the shapes attend_run takes */
static int attend_valid(const Attn *a, int64_t n) {
    return !(a->xtype < X_F32 || a->xtype > X_BF16 || n < 1 || a->kv_heads < 1 || a->heads % a->kv_heads
             || a->hd < 2 || a->hd % 2 || a->col < 0 || a->cache_head < a->hd * (a->col + 1)
             || a->cache_row < a->cache_head * a->kv_heads);
}

/* One decode step's attention (see py_attend), split over `threads`; 0, or -1 when memory ran out */
static int attend_run(const Attn *a, int threads, int level) {
    const int64_t group = a->heads / a->kv_heads, per_thread = 2 * (group + 1) * a->hd + group * (a->col + 1);
    /* a thread per ~64K cached values read at least, as for the matrix products */
    const int64_t useful = (a->n * a->kv_heads * (a->col + 1) * a->hd) / 65536 + 1;
    int nt = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (nt > useful) nt = (int)useful;
    float *work = (float *)malloc((size_t)(nt * per_thread) * sizeof(float));
    if (!work) return -1;
    AttnTask task = {a, X86 && level >= AVX2, work, per_thread};
    parallel(attend_part, &task, nt);
    free(work);
    return 0;
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long qkv, cs, sn, kc, vc, first, out;
    int xtype, threads, level;
    long long n, heads, kv_heads, hd, cache_row, cache_head, col;
    double scale;
    if (!PyArg_ParseTuple(args, "iKKKKKKKLLLLLLLdii", &xtype, &qkv, &cs, &sn, &kc, &vc, &first, &out, &n, &heads,
                          &kv_heads, &hd, &cache_row, &cache_head, &col, &scale, &threads, &level))
        return NULL;
    Attn a = {xtype, (const void *)(uintptr_t)qkv, (const void *)(uintptr_t)cs, (const void *)(uintptr_t)sn,
              (void *)(uintptr_t)kc, (void *)(uintptr_t)vc, cache_row, cache_head, (const int64_t *)(uintptr_t)first,
              col, (void *)(uintptr_t)out, n, heads, kv_heads, hd, (float)scale};
    if (!attend_valid(&a, n) || level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_SetString(PyExc_ValueError, "attend: unsupported dtype, shape or level");
        return NULL;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = attend_run(&a, threads, level);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static void rms_norm_run(int level, int xtype, const void *x, const void *w, void *y, int64_t n, int64_t h, float eps) {
#if X86
    if (level >= AVX2) { rms_norm_256(xtype, x, w, y, n, h, eps); return; }
#endif
    (void)level;
    rms_norm_plain(xtype, x, w, y, n, h, eps);
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, y;
    int xtype, level;
    long long n, h;
    double eps;
    if (!PyArg_ParseTuple(args, "iKKKLLdi", &xtype, &x, &w, &y, &n, &h, &eps, &level)) return NULL;
    if (xtype < X_F32 || xtype > X_BF16 || n < 1 || h < 1 || level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: unsupported dtype, shape or level");
        return NULL;
    }
    rms_norm_run(level, xtype, (const void *)(uintptr_t)x, (const void *)(uintptr_t)w, (void *)(uintptr_t)y, n, h,
                 (float)eps);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- shared-memory all-reduce
 * One round of shm.ShmGroup.all_reduce in one call: this rank's part into its slot of the round's
 * slot set, then the round number published (a release store, after the slot), then every peer's
 * awaited (acquire loads; the GIL released; a sched_yield now and then for a peer that shares this
 * core), then the parts added in rank order in float32 into t: the same bits on every rank.
 * Returns the first peer that missed the timeout, or -1. */
static double monotonic_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int shm_round(int xtype, void *t, int64_t numel, char *slots, int64_t slot_bytes, int64_t *flag,
                     int64_t flag_stride, int size, int rank, int64_t round, double timeout) {
    const int64_t esize = xtype == X_F32 ? 4 : 2;
    int missed = -1;
    char *set = slots + (round % 2) * size * slot_bytes;
    memcpy(set + rank * slot_bytes, t, (size_t)(numel * esize));
    __atomic_store_n(flag + rank * flag_stride, round, __ATOMIC_RELEASE);
    for (int p = 0; p < size && missed < 0; p++) {
        uint64_t spins = 0;
        double deadline = 0.0;
        while (__atomic_load_n(flag + p * flag_stride, __ATOMIC_ACQUIRE) < round) {
            relax();
            if (++spins % 1024 == 0) {
                sched_yield();
                const double now = monotonic_seconds();
                if (deadline == 0.0) deadline = now + timeout;
                else if (now > deadline) { missed = p; break; }
            }
        }
    }
    for (int64_t i = 0; missed < 0 && i < numel; i++) {
        float sum = load1(xtype, set, i);
        for (int p = 1; p < size; p++) sum += load1(xtype, set + p * slot_bytes, i);
        store1(xtype, t, i, sum);
    }
    return missed;
}

static PyObject *py_shm_all_reduce(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long t, slots, flags;
    int xtype, size, rank;
    long long numel, slot_bytes, flag_stride, round;
    double timeout;
    if (!PyArg_ParseTuple(args, "iKLKLKLiiLd", &xtype, &t, &numel, &slots, &slot_bytes, &flags, &flag_stride, &size,
                          &rank, &round, &timeout))
        return NULL;
    const int64_t esize = xtype == X_F32 ? 4 : 2;
    if (xtype < X_F32 || xtype > X_BF16 || numel < 0 || numel * esize > slot_bytes || size < 1 || rank < 0
        || rank >= size || flag_stride < 1 || round < 1) {
        PyErr_SetString(PyExc_ValueError, "shm_all_reduce: unsupported dtype, size or rank");
        return NULL;
    }
    int missed;
    Py_BEGIN_ALLOW_THREADS
    missed = shm_round(xtype, (void *)(uintptr_t)t, numel, (char *)(uintptr_t)slots, slot_bytes,
                       (int64_t *)(uintptr_t)flags, flag_stride, size, rank, round, timeout);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(missed);
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long gu, out;
    int xtype, level;
    long long n, inter;
    if (!PyArg_ParseTuple(args, "iKKLLi", &xtype, &gu, &out, &n, &inter, &level)) return NULL;
    if (xtype < X_F32 || xtype > X_BF16 || n < 0 || inter < 1 || level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_SetString(PyExc_ValueError, "silu_mul: unsupported dtype, shape or level");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_run(level, xtype, (const void *)(uintptr_t)gu, (void *)(uintptr_t)out, n, inter);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- a whole decoder layer
 * A decode step's layer in one call, the GIL released throughout: what the Python layer does with
 * the calls above, in the same order and with the same roundings, so the bits are the same (the
 * tests compare them), without ~0.5 ms of Python and torch dispatch a layer (a fifth of a TP=2
 * rank's decode step in bfloat16):
 *   h = rms_norm(x); qkv = h Wqkv^T (+ b); a = attend(qkv); o = a Wo^T; all-reduce o (+ b); x += o;
 *   h = rms_norm(x); gu = h Wgu^T (+ b); m = silu(gate) up; d = m Wdown^T; all-reduce d (+ b); x += d.
 * The layer's fixed part (pointers, shapes, its KV cache, the shared-memory group) is a LayerPlan:
 * int64 fields (doubles by their bits) that Python packs by the names layer_fields() gives. */
#define LAYER_FIELDS(F)                                                                          \
    F(xtype) F(wtype) F(hidden) F(heads) F(kv_heads) F(head_dim) F(inter) F(eps_bits)            \
    F(in_norm) F(post_norm)                                                                      \
    F(qkv_w) F(qkv_ldw) F(qkv_scale) F(qkv_bias) F(o_w) F(o_ldw) F(o_scale) F(o_bias)            \
    F(gate_up_w) F(gate_up_ldw) F(gate_up_scale) F(gate_up_bias)                                 \
    F(down_w) F(down_ldw) F(down_scale) F(down_bias)                                             \
    F(k_cache) F(v_cache) F(cache_rows) F(cache_row) F(cache_head) F(cache_len)                   \
    F(shm_slots) F(shm_slot_bytes) F(shm_flags) F(shm_flag_stride) F(shm_size) F(shm_rank) F(shm_timeout_bits)
#define PLAN_FIELD(name) int64_t name;
typedef struct { LAYER_FIELDS(PLAN_FIELD) } LayerPlan;
#define PLAN_NAME(name) #name,
static const char *LAYER_FIELD_NAMES[] = {LAYER_FIELDS(PLAN_NAME)};
#define N_LAYER_FIELDS ((Py_ssize_t)(sizeof LAYER_FIELD_NAMES / sizeof LAYER_FIELD_NAMES[0]))

#define PTR(v) ((void *)(uintptr_t)(v))
static double bits_double(int64_t bits) { double d; memcpy(&d, &bits, sizeof d); return d; }

/* What is wrong with a plan, or NULL */
static const char *layer_problem(const LayerPlan *p) {
    const int64_t h = p->hidden, q = p->heads * p->head_dim, kv = p->kv_heads * p->head_dim, esize = p->xtype ? 2 : 4;
    const void *scales[4] = {PTR(p->qkv_scale), PTR(p->o_scale), PTR(p->gate_up_scale), PTR(p->down_scale)};
    const int64_t ns[4] = {q + 2 * kv, h, 2 * p->inter, h}, ks[4] = {h, q, h, p->inter};
    const int64_t ldws[4] = {p->qkv_ldw, p->o_ldw, p->gate_up_ldw, p->down_ldw};
    const int64_t ws[4] = {p->qkv_w, p->o_w, p->gate_up_w, p->down_w};
    for (int i = 0; i < 4; i++)
        if (!ws[i] || !gemv_valid((int)p->wtype, (int)p->xtype, scales[i], ns[i], ks[i], ldws[i], 1, ks[i], ns[i]))
            return "a projection's dtype or shape is not one the matrix products take";
    if (h < 1 || p->heads < 1 || p->kv_heads < 1 || p->heads % p->kv_heads || p->head_dim < 2 || p->head_dim % 2
        || p->inter < 1)
        return "bad sizes";
    if (!p->in_norm || !p->post_norm || !p->k_cache || !p->v_cache) return "a norm weight or a cache is missing";
    if (p->cache_rows < 1 || p->cache_len < 1 || p->cache_head < p->head_dim * p->cache_len
        || p->cache_row < p->cache_head * p->kv_heads)
        return "the KV cache's strides do not fit its shape";
    if (p->shm_size > 1 && (!p->shm_slots || !p->shm_flags || p->shm_rank < 0 || p->shm_rank >= p->shm_size
                            || p->shm_flag_stride < 1 || h * esize > p->shm_slot_bytes))
        return "the shared-memory group cannot take this layer's all-reduces";
    return NULL;
}

/* The all-reduce of y over the TP ranks, when there are several: the time it took is added to
 * *comm; returns the peer that missed the timeout, or -1 */
static int reduce(const LayerPlan *p, void *y, int64_t n, int64_t *round, double *comm) {
    int missed = -1;
    if (p->shm_size > 1) {
        const double start = monotonic_seconds();
        missed = shm_round((int)p->xtype, y, n * p->hidden, (char *)PTR(p->shm_slots), p->shm_slot_bytes,
                           (int64_t *)PTR(p->shm_flags), p->shm_flag_stride, (int)p->shm_size, (int)p->shm_rank,
                           ++*round, bits_double(p->shm_timeout_bits));
        *comm += monotonic_seconds() - start;
    }
    return missed;
}

/* x [n, hidden] (in place): the layer's decode step for rows [r0, r0 + n) of its cache at column
 * `col`. Returns 0; -1 when memory ran out; or 1 + the peer that missed an all-reduce. */
static int decode_layer_run(const LayerPlan *p, void *x, int64_t n, int64_t col, const int64_t *first,
                            const void *cos, const void *sin, int64_t r0, int threads, int level, int64_t *round,
                            double *comm) {
    const int xt = (int)p->xtype, wt = (int)p->wtype;
    const int64_t h = p->hidden, hd = p->head_dim, q = p->heads * hd, kv = p->kv_heads * hd, inter = p->inter;
    const int64_t nqkv = q + 2 * kv, esize = xt == X_F32 ? 4 : 2;
    const float eps = (float)bits_double(p->eps_bits);
    char *buf = (char *)malloc((size_t)(n * (h + nqkv + q + 3 * inter) * esize));
    if (!buf) return -1;
    char *hbuf = buf, *qkv = hbuf + n * h * esize, *att = qkv + n * nqkv * esize, *gu = att + n * q * esize;
    char *act = gu + n * 2 * inter * esize;
    void *out = hbuf;  /* the o and down products reuse h's rows: h is read before each is written */
    int status = 0;
    rms_norm_run(level, xt, x, PTR(p->in_norm), hbuf, n, h, eps);
    if (gemv_run(wt, xt, PTR(p->qkv_w), PTR(p->qkv_scale), hbuf, qkv, nqkv, h, p->qkv_ldw, n, h, nqkv, threads, level))
        goto oom;
    if (p->qkv_bias) add_rows_run(level, xt, qkv, PTR(p->qkv_bias), n, nqkv, 0);
    const Attn a = {xt, qkv, cos, sin, (char *)PTR(p->k_cache) + r0 * p->cache_row * esize,
                    (char *)PTR(p->v_cache) + r0 * p->cache_row * esize, p->cache_row, p->cache_head, first, col, att,
                    n, p->heads, p->kv_heads, hd, (float)(1.0 / __builtin_sqrt((double)hd))};
    if (attend_run(&a, threads, level)) goto oom;
    if (gemv_run(wt, xt, PTR(p->o_w), PTR(p->o_scale), att, out, h, q, p->o_ldw, n, q, h, threads, level)) goto oom;
    int missed = reduce(p, out, n, round, comm);
    if (missed >= 0) { status = 1 + missed; goto done; }
    if (p->o_bias) add_rows_run(level, xt, out, PTR(p->o_bias), n, h, 0);
    add_rows_run(level, xt, x, out, n, h, h);
    rms_norm_run(level, xt, x, PTR(p->post_norm), hbuf, n, h, eps);
    if (gemv_run(wt, xt, PTR(p->gate_up_w), PTR(p->gate_up_scale), hbuf, gu, 2 * inter, h, p->gate_up_ldw, n, h,
                 2 * inter, threads, level))
        goto oom;
    if (p->gate_up_bias) add_rows_run(level, xt, gu, PTR(p->gate_up_bias), n, 2 * inter, 0);
    silu_mul_run(level, xt, gu, act, n, inter);
    if (gemv_run(wt, xt, PTR(p->down_w), PTR(p->down_scale), act, out, h, inter, p->down_ldw, n, inter, h, threads,
                 level))
        goto oom;
    missed = reduce(p, out, n, round, comm);
    if (missed >= 0) { status = 1 + missed; goto done; }
    if (p->down_bias) add_rows_run(level, xt, out, PTR(p->down_bias), n, h, 0);
    add_rows_run(level, xt, x, out, n, h, h);
    goto done;
oom:
    status = -1;
done:
    free(buf);
    return status;
}

static int plan_from(PyObject *obj, LayerPlan *plan) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return -1;
    const int ok = view.len == (Py_ssize_t)sizeof *plan;
    if (ok) memcpy(plan, view.buf, sizeof *plan);
    PyBuffer_Release(&view);
    if (!ok) PyErr_SetString(PyExc_ValueError, "layer plan: wrong size (pack it by layer_fields())");
    return ok ? 0 : -1;
}

static PyObject *py_layer_fields(PyObject *self, PyObject *args) {
    (void)self; (void)args;
    PyObject *out = PyTuple_New(N_LAYER_FIELDS);
    for (Py_ssize_t i = 0; out && i < N_LAYER_FIELDS; i++) {
        PyObject *name = PyUnicode_FromString(LAYER_FIELD_NAMES[i]);
        if (!name) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, i, name);
    }
    return out;
}

static PyObject *py_layer_problem(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    LayerPlan plan;
    if (!PyArg_ParseTuple(args, "O", &obj) || plan_from(obj, &plan) < 0) return NULL;
    const char *problem = layer_problem(&plan);
    if (problem) return PyUnicode_FromString(problem);
    Py_RETURN_NONE;
}

static PyObject *py_decode_layer(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    unsigned long long x, first, cos, sin;
    long long n, col, r0, round;
    int threads, level;
    LayerPlan p;
    if (!PyArg_ParseTuple(args, "OKLLKKKLiiL", &obj, &x, &n, &col, &first, &cos, &sin, &r0, &threads, &level, &round)
        || plan_from(obj, &p) < 0)
        return NULL;
    if (n < 1 || n > MAX_M || r0 < 0 || r0 + n > p.cache_rows || col < 0 || col >= p.cache_len || level < 0
        || level >= LEVELS || !supported[level] || layer_problem(&p)
        || (p.shm_size > 1 && n * p.hidden * (p.xtype ? 2 : 4) > p.shm_slot_bytes)) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: unsupported rows, column, level or plan");
        return NULL;
    }
    int64_t rounds = round;
    double comm = 0.0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_layer_run(&p, PTR(x), n, col, (const int64_t *)PTR(first), PTR(cos), PTR(sin), r0, threads, level,
                              &rounds, &comm);
    Py_END_ALLOW_THREADS
    if (status < 0) return PyErr_NoMemory();
    return Py_BuildValue("(id)", status - 1, comm);
}

/* ---------------------------------------------------------------- the plain read (the limit)
 * Each thread reads its share once with vector loads, summed so none is skipped, as `streams`
 * sequential streams at once (1: one pass front to back; more: the share cut in that many parts
 * read side by side, as a matrix-vector product reads several rows): the bench takes the faster. */
#define MAX_STREAMS 8
typedef struct { const uint8_t *p; int64_t bytes; int streams, level; uint64_t sums[MAX_THREADS]; } ReadTask;

#if X86
T512FN static uint64_t read_512(const uint8_t *p, int64_t per, int streams) {
    __m512i a = _mm512_setzero_si512(), b = a;
    int64_t i = 0;
    for (; i + 128 <= per; i += 128)
        for (int s = 0; s < streams; s++) {
            a = _mm512_add_epi64(a, _mm512_loadu_si512(p + s * per + i));
            b = _mm512_add_epi64(b, _mm512_loadu_si512(p + s * per + i + 64));
        }
    uint64_t sum = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a, b));
    for (int s = 0; s < streams; s++)
        for (int64_t t = i; t < per; t++) sum += p[s * per + t];
    return sum;
}

T256FN static uint64_t read_256(const uint8_t *p, int64_t per, int streams) {
    __m256i a = _mm256_setzero_si256(), b = a;
    int64_t i = 0;
    for (; i + 64 <= per; i += 64)
        for (int s = 0; s < streams; s++) {
            a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + s * per + i)));
            b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i *)(p + s * per + i + 32)));
        }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a, b));
    uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (int s = 0; s < streams; s++)
        for (int64_t t = i; t < per; t++) sum += p[s * per + t];
    return sum;
}
#endif

static uint64_t read_portable(const uint8_t *p, int64_t per, int streams) {
    uint64_t sum = 0, word;
    int64_t i = 0;
    for (; i + 8 <= per; i += 8)
        for (int s = 0; s < streams; s++) { memcpy(&word, p + s * per + i, 8); sum += word; }
    for (int s = 0; s < streams; s++)
        for (int64_t t = i; t < per; t++) sum += p[s * per + t];
    return sum;
}

static void read_part(void *arg, int i, int n) {
    ReadTask *t = (ReadTask *)arg;
    const int64_t share = (t->bytes / n) & ~(int64_t)4095;
    const int64_t start = i * share, len = i == n - 1 ? t->bytes - start : share;
    const int64_t per = len / t->streams;
    const uint8_t *p = t->p + start;
    uint64_t sum;
#if X86
    if (t->level >= AVX512) sum = read_512(p, per, t->streams);
    else if (t->level >= AVX2) sum = read_256(p, per, t->streams);
    else
#endif
    sum = read_portable(p, per, t->streams);
    for (int64_t b = per * t->streams; b < len; b++) sum += p[b];
    t->sums[i] = sum;
}

static PyObject *py_read(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long p;
    long long bytes;
    int threads, level, streams;
    if (!PyArg_ParseTuple(args, "KLiii", &p, &bytes, &threads, &level, &streams)) return NULL;
    if (level < 0 || level >= LEVELS || !supported[level] || bytes < 0 || streams < 1 || streams > MAX_STREAMS) {
        PyErr_SetString(PyExc_ValueError, "read: bad level, size or streams");
        return NULL;
    }
    ReadTask task = {(const uint8_t *)(uintptr_t)p, bytes, streams, level, {0}};
    int n = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    Py_BEGIN_ALLOW_THREADS
    parallel(read_part, &task, n);
    Py_END_ALLOW_THREADS
    uint64_t s = 0;
    for (int i = 0; i < MAX_THREADS; i++) s += task.sums[i];
    return PyLong_FromUnsignedLongLong(s);
}

static PyObject *py_levels(PyObject *self, PyObject *args) {
    (void)self; (void)args;
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < LEVELS; i++) {
        if (!supported[i]) continue;
        PyObject *name = PyUnicode_FromString(LEVEL_NAMES[i]);
        if (!name || PyList_Append(out, name) < 0) { Py_XDECREF(name); Py_DECREF(out); return NULL; }
        Py_DECREF(name);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"linear", py_linear, METH_VARARGS,
     "linear(wtype, xtype, w, scale, x, y, n, k, m, ldx, ldy, threads, level): y = x W^T (* scale), by pointers"},
    {"attend", py_attend, METH_VARARGS,
     "attend(xtype, qkv, cos, sin, k_cache, v_cache, first, out, n, heads, kv_heads, head_dim, cache_row, cache_head, "
     "col, scale, threads, level): one decode step's attention (rope, cache write, softmax(q k / scale) v)"},
    {"shm_all_reduce", py_shm_all_reduce, METH_VARARGS,
     "shm_all_reduce(xtype, t, numel, slots, slot_bytes, flags, flag_stride, size, rank, round, timeout) -> peer "
     "that missed the timeout or -1: one round of shm.ShmGroup.all_reduce"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(xtype, x, w, y, n, h, eps, level): y = x / rms(x) * w, HF's way"},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(xtype, x, q, s, k, m, ldx, level): x's rows as int8 weights meet them: int16 q [m, kpad], scales s [m, nblk]"},
    {"read", py_read, METH_VARARGS,
     "read(pointer, nbytes, threads, level, streams) -> checksum: read the bytes once (the sum of their 8-byte words)"},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(xtype, gate_up, out, n, inter, level): out = silu(gate) * up for rows [n, 2 inter] = (gate | up)"},
    {"layer_fields", py_layer_fields, METH_NOARGS, "the names of a layer plan's int64 fields, in order"},
    {"layer_problem", py_layer_problem, METH_VARARGS, "layer_problem(plan) -> what is wrong with a layer plan, or None"},
    {"decode_layer", py_decode_layer, METH_VARARGS,
     "decode_layer(plan, x, n, col, first, cos, sin, r0, threads, level, round) -> (peer that missed an all-reduce "
     "or -1, seconds in all-reduces): a decoder layer's decode step, x updated in place"},
    {"levels", py_levels, METH_NOARGS, "the kernel levels this CPU runs, slowest first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gemv", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__gemv(void) {
    detect();
    pthread_atfork(NULL, NULL, forget_workers);
    PyObject *mod = PyModule_Create(&module);
    if (mod && PyModule_AddIntConstant(mod, "QBLOCK", QBLOCK) < 0) Py_CLEAR(mod);
    return mod;
}
