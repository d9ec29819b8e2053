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
 *
 * The files, one job each, share this header: portable.c, avx2.c, avx2_i8.c, avx512.c,
 * avx512_bf16.c and avx512_i8.c (the matrix-vector kernels per instruction set: each writes its
 * register tile as inline functions of its own loads and products; tile.h holds what the tiles
 * share, the prefetch and the rows split into tiles), matmul.c (which kernel, x prepared, rows
 * split over threads), pool.c (the thread pool), step.c (RMSNorm, SwiGLU, attention), shm_reduce.c (the shared-memory
 * all-reduce), layer.c (a whole decoder layer; its plan in layer.h), read.c (the plain read, the
 * limit) and module.c (the Python glue). Functions shared between files are hidden from other
 * extension modules.
 */
#ifndef SHARD_GEMV_H
#define SHARD_GEMV_H

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
#define MAX_M 8
/* x rows one call takes (a decode step's rows and a prompt chunk's tokens together): groups of at
 * most MAX_M, each multiplied with a block of W's rows while that block is in L2 (gemv_groups) */
#define MAX_TOKENS 64
/* int8 weights: x's columns share a scale by blocks of QBLOCK (a multiple of 32: a block is
 * whole vectors but in its last one); its values are int16 in [-QMAX, QMAX] */
#define QBLOCK 128  /* the int8 tiles unroll a block: 4 x 32 (AVX-512) and 8 x 16 (AVX2) columns */
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

#define MAX_THREADS 64
#define MAX_STREAMS 8

#pragma GCC visibility push(hidden)

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

/* row b of x */
INLINE const void *x_row(const Job *j, int64_t b) {
    return j->xtype == X_F32 ? (const void *)((const float *)j->x + b * j->ldx)
                             : (const void *)((const uint16_t *)j->x + b * j->ldx);
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


/* ---------------------------------------------------------------- weights and the small helpers
 * of every kernel */
INLINE float weight_at(const Job *j, int64_t row, int64_t i) {
    const int64_t at = row * j->ldw + i;
    return j->wtype == W_F32 ? ((const float *)j->w)[at] : bf16_to_f32(((const uint16_t *)j->w)[at]);
}

INLINE float load1(int xtype, const void *p, int64_t at) {
    return xtype == X_F32 ? ((const float *)p)[at] : bf16_to_f32(((const uint16_t *)p)[at]);
}

INLINE void store1(int xtype, void *p, int64_t at, float v) {
    if (xtype == X_F32) ((float *)p)[at] = v;
    else ((uint16_t *)p)[at] = f32_to_bf16(v);
}

INLINE void relax(void) {  /* a spinning thread's pause */
#if X86
    _mm_pause();
#endif
}

/* Each instruction set's functions: inlined (T...) or called (T...FN) */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), always_inline)) static inline
#define T512FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TBF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"), always_inline)) static inline
#define TBFFN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma"), always_inline)) static inline
#define TVNNIFN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define T256 __attribute__((target("avx2,fma"), always_inline)) static inline
#define T256FN __attribute__((target("avx2,fma")))

/* ---------------------------------------------------------------- the kernels (rows [r0, r1) of a Job) */
void quantize_x(const Job *j, int16_t *xq, float *xs);
void rows_portable(const Job *j, int64_t r0, int64_t r1);
void rows_portable_i8(const Job *j, int64_t r0, int64_t r1);
#if X86
T512FN void rows_512_f32(const Job *j, int64_t r0, int64_t r1);
T512FN void rows_512_bf16(const Job *j, int64_t r0, int64_t r1);
T512FN void quantize_x_512(const Job *j, int16_t *xq, float *xs);
TBFFN void rows_bf16dp(const Job *j, int64_t r0, int64_t r1);
T512FN void rows_512_i8(const Job *j, int64_t r0, int64_t r1);
TVNNIFN void rows_vnni_i8(const Job *j, int64_t r0, int64_t r1);
T256FN void rows_256_f32(const Job *j, int64_t r0, int64_t r1);
T256FN void rows_256_bf16(const Job *j, int64_t r0, int64_t r1);
T256FN void quantize_x_256(const Job *j, int16_t *xq, float *xs);
T256FN void rows_256_i8(const Job *j, int64_t r0, int64_t r1);
#endif

/* ---------------------------------------------------------------- pool.c */
void parallel(void (*task)(void *, int, int), void *arg, int n);
void forget_workers(void);

/* ---------------------------------------------------------------- matmul.c */
extern int supported[LEVELS];
void detect(void);
void quantize_with(int level, const Job *j, int16_t *xq, float *xs);
int gemv_run(int wtype, int xtype, const void *w, const void *scale, const void *x, void *y, int64_t n, int64_t k,
             int64_t ldw, int64_t m, int64_t ldx, int64_t ldy, int threads, int level);
int gemv_groups(int wtype, int xtype, const void *w, const void *scale, const void *x, void *y, int64_t n,
                int64_t k, int64_t ldw, int64_t m, int64_t ldx, int64_t ldy, const int64_t *ends, int groups,
                int threads, int level);
int split_groups(int64_t m, int64_t *ends);
int groups_valid(const int64_t *ends, int groups, int64_t m);
int gemv_valid(int wtype, int xtype, const void *scale, int64_t n, int64_t k, int64_t ldw, int64_t m, int64_t ldx,
               int64_t ldy);

/* ---------------------------------------------------------------- step.c */
typedef struct {
    int xtype;
    const void *qkv;              /* [n, (heads + 2 kv_heads) * hd]: q, k, v of each row */
    const void *cos, *sin;        /* [n, hd]: the rope of each row's position, in the dtype */
    void *kc, *vc;                /* the layer's cache from row r0: [rows, kv_heads, max_len, hd]; or, with
                                   * `slots`, the layer's paged pool [kv_heads, slots, hd] */
    int64_t cache_row, cache_head; /* their strides, in elements (a column is hd; paged: a slot is cache_row) */
    const int64_t *first;         /* [n]: the first column each row attends to */
    int64_t col;                  /* the step's column: its k and v are written there (with `cols`: the largest) */
    const int64_t *cols;          /* paged (or NULL: `col` for all): [n], each token's own column, the last
                                   * it attends to (a prompt chunk's tokens, each at its position) */
    const int64_t *srow;          /* paged (or NULL: its own): [n], each token's row of `slots` (a chunk's
                                   * tokens share their sequence's) */
    const int64_t *slots;         /* paged (or NULL): [rows, ld_slots], the pool slot of each of a row's columns */
    int64_t ld_slots;             /* (its block table, expanded once a step for every layer) */
    const int64_t *wslot;         /* paged: [n], the slot each token's k and v are written to */
    void *out;                    /* [n, heads * hd] */
    int64_t n, heads, kv_heads, hd;
    float scale;
} Attn;

int attend_valid(const Attn *a, int64_t n);
int attend_run(const Attn *a, int threads, int level);
void rms_norm_run(int level, int xtype, const void *x, const void *w, void *y, int64_t n, int64_t h, float eps);
void silu_mul_run(int level, int xtype, const void *gu, void *out, int64_t n, int64_t inter);
void add_rows_run(int level, int xtype, void *dst, const void *src, int64_t n, int64_t len, int64_t ld);

/* ---------------------------------------------------------------- shm_reduce.c */
double monotonic_seconds(void);
int shm_round(int xtype, void *t, int64_t numel, char *slots, int64_t slot_bytes, int64_t *flag, int64_t flag_stride,
              int size, int rank, int64_t round, double timeout);

/* ---------------------------------------------------------------- read.c */
uint64_t read_run(const uint8_t *p, int64_t bytes, int threads, int level, int streams);

#pragma GCC visibility pop
#endif
