/* Decode-time matrix products at the memory-bandwidth limit: y[m, n] = x[m, :] . W[n, :] (* s[n])
 * for a few rows of x (m <= 8) and W in nn.Linear's [out, in] layout (rows `ldw` elements apart:
 * a column slice of a wider matrix is read in place), float32, bfloat16 or int8
 * with one float32 scale per output row; x and y are float32 or bfloat16. A decode step reads
 * every weight once, so the whole job is to stream W at the speed of memory: each pass reads a
 * block of W's rows once and multiplies it with all m vectors, which stay in L1/L2.
 *
 * Plain C with no torch headers: the Python side passes data pointers, so the package builds with
 * any C compiler and no torch. The instruction set is chosen at run time (CPUID): AVX-512 (with
 * AVX512_BF16 dot products for bfloat16 weights when present), AVX2 + FMA, or portable C. Rows
 * are split over a small pool of persistent threads (the caller is thread 0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define X86 1
#include <immintrin.h>
#else
#define X86 0
#endif

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2 };    /* weight dtypes */
enum { X_F32 = 0, X_BF16 = 1 };              /* activation (and output) dtypes */
enum { PORTABLE = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3, LEVELS = 4 };
static const char *LEVEL_NAMES[LEVELS] = {"portable", "avx2", "avx512", "avx512_bf16"};
#define MAX_M 8

typedef struct {
    int wtype, xtype;
    const void *w, *scale, *x;
    void *y;
    const float *xf;   /* x as float32 (every path but the bf16 dot products reads this) */
    int64_t n, k, m, ldx, ldy;
    int64_t ldw;       /* elements from one weight row to the next (>= k: a column slice of a wider matrix) */
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

/* ---------------------------------------------------------------- portable C */
INLINE float weight_at(const Job *j, int64_t row, int64_t i) {
    const int64_t at = row * j->ldw + i;
    switch (j->wtype) {
        case W_F32: return ((const float *)j->w)[at];
        case W_BF16: return bf16_to_f32(((const uint16_t *)j->w)[at]);
        default: return (float)((const int8_t *)j->w)[at];
    }
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

#if X86
/* ---------------------------------------------------------------- one tile: R rows x M vectors
 * The accumulators are named variables, not an array: GCC keeps an array of vectors in memory
 * and stores it back every iteration. R and M are constants after inlining, so the guarded
 * statements of unused rows and vectors vanish. Each ISA defines VEC, ZERO, W(r) (row r's next
 * weights, of type WVEC), X(b) (vector b's matching inputs), FMA, SUM and TAIL, then expands
 * TILE_STEP and TILE_STORE. */
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
#define TILE_STEP                                                              \
    {                                                                          \
        const WVEC w0 = W(0);                                                  \
        const WVEC w1 = R > 1 ? W(1) : w0, w2 = R > 2 ? W(2) : w0, w3 = R > 3 ? W(3) : w0; \
        const WVEC w4 = R > 4 ? W(4) : w0, w5 = R > 5 ? W(5) : w0, w6 = R > 6 ? W(6) : w0; \
        const WVEC w7 = R > 7 ? W(7) : w0;                                     \
        PREFETCH_NEXT                                                          \
        COL(0) COL(1) COL(2) COL(3) COL(4) COL(5) COL(6) COL(7)                \
    }
/* The next tile's rows, at the columns this step reads, once a cache line: rows of a few KiB are
 * too short for the hardware prefetchers to ramp up (int8 rows the most), and a tile's R rows
 * lie just before the next tile's, so this stays one tile ahead of the loads. */
#define PREFETCH_NEXT                                                          \
    if (((i * (int64_t)ESIZE) & 63) == 0) {                                    \
        const char *next = (const char *)j->w + ((row + R) * ldw + i) * (int64_t)ESIZE; \
        for (int r = 0; r < R; r++) _mm_prefetch(next + r * ldw * (int64_t)ESIZE, _MM_HINT_T0); \
    }
#define ESIZE (wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1)
#define OUT(b)                                                                 \
    if (M > b) {                                                               \
        store(j, b, row, SUM(a0##b) + TAIL(0, b));                             \
        if (R > 1) store(j, b, row + 1, SUM(a1##b) + TAIL(1, b));              \
        if (R > 2) store(j, b, row + 2, SUM(a2##b) + TAIL(2, b));              \
        if (R > 3) store(j, b, row + 3, SUM(a3##b) + TAIL(3, b));              \
        if (R > 4) store(j, b, row + 4, SUM(a4##b) + TAIL(4, b));              \
        if (R > 5) store(j, b, row + 5, SUM(a5##b) + TAIL(5, b));              \
        if (R > 6) store(j, b, row + 6, SUM(a6##b) + TAIL(6, b));              \
        if (R > 7) store(j, b, row + 7, SUM(a7##b) + TAIL(7, b));              \
    }
#define TILE_STORE OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) OUT(6) OUT(7)
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

/* The dot product of row `row` and vector b over [i, k), in scalar code (AVX2 row tails) */
INLINE float tail_dot(const Job *j, int64_t row, int64_t b, int64_t i) {
    float acc = 0.0f;
    for (; i < j->k; i++) acc += weight_at(j, row, i) * j->xf[b * j->k + i];
    return acc;
}

/* ---------------------------------------------------------------- AVX-512 */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), always_inline)) static inline
#define T512FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

/* 16 weights of a row as float32; `full` (a constant) or only the `mask` lanes (a row's tail).
 * Masked loads cost an extra vector uop on Intel cores, so the main loop has none. */
T512 __m512 load16_512(int wtype, const void *w, int64_t at, const int full, __mmask16 mask) {
    switch (wtype) {
        case W_F32: return full ? _mm512_loadu_ps((const float *)w + at) : _mm512_maskz_loadu_ps(mask, (const float *)w + at);
        case W_BF16: {
            __m256i h = full ? _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at))
                             : _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + at);
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
        default: {
            __m128i q = full ? _mm_loadu_si128((const __m128i *)((const int8_t *)w + at))
                             : _mm_maskz_loadu_epi8(mask, (const int8_t *)w + at);
            return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
        }
    }
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
    TILE_STORE
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
    TILE_STORE
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
T512FN static void rows_512_i8(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_512, W_I8); }
TBFFN static void rows_bf16dp(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_bf16dp, W_BF16); }

/* ---------------------------------------------------------------- AVX2 + FMA */
#define T256 __attribute__((target("avx2,fma"), always_inline)) static inline
#define T256FN __attribute__((target("avx2,fma")))

T256 __m256 load8_256(int wtype, const void *w, int64_t at) {
    switch (wtype) {
        case W_F32: return _mm256_loadu_ps((const float *)w + at);
        case W_BF16: {
            __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + at));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        default: {
            __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + at));
            return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
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
    TILE_STORE
}

/* 16 registers: fewer accumulators than AVX-512 */
#undef ROWS_FOR
#define ROWS_FOR(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)
T256FN static void rows_256_f32(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_256, W_F32); }
T256FN static void rows_256_bf16(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_256, W_BF16); }
T256FN static void rows_256_i8(const Job *j, int64_t r0, int64_t r1) { DISPATCH_M(block_256, W_I8); }
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
    supported[AVX512_BF16] = supported[AVX512] && __builtin_cpu_supports("avx512bf16");
#endif
}

static RowsFn pick(int level, int wtype, int xtype) {
#if X86
    if (level >= AVX512_BF16 && wtype == W_BF16 && xtype == X_BF16) return rows_bf16dp;
    if (level >= AVX512) return wtype == W_F32 ? rows_512_f32 : wtype == W_BF16 ? rows_512_bf16 : rows_512_i8;
    if (level >= AVX2) return wtype == W_F32 ? rows_256_f32 : wtype == W_BF16 ? rows_256_bf16 : rows_256_i8;
#endif
    (void)level; (void)wtype; (void)xtype;
    return rows_portable;
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

static PyObject *py_linear(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long w, scale, x, y;
    int wtype, xtype, threads, level;
    long long n, k, ldw, m, ldx, ldy;
    if (!PyArg_ParseTuple(args, "iiKKKKLLLLLLii", &wtype, &xtype, &w, &scale, &x, &y, &n, &k, &ldw, &m, &ldx, &ldy,
                          &threads, &level))
        return NULL;
    if (wtype < W_F32 || wtype > W_I8 || xtype < X_F32 || xtype > X_BF16 || m < 1 || m > MAX_M || n < 0 || k < 1
        || ldw < k || ldx < k || ldy < n || (wtype == W_I8 && !scale) || (wtype == W_F32 && xtype != X_F32)
        || (wtype == W_BF16 && xtype != X_BF16)) {
        PyErr_SetString(PyExc_ValueError, "linear: unsupported dtypes or shape");
        return NULL;
    }
    if (level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_Format(PyExc_ValueError, "linear: this CPU cannot run kernel level %d", level);
        return NULL;
    }
    Job job = {wtype, xtype, (const void *)(uintptr_t)w, (const void *)(uintptr_t)scale,
               (const void *)(uintptr_t)x, (void *)(uintptr_t)y, NULL, n, k, m, ldx, ldy, ldw};
    GemvTask task = {&job, pick(level, wtype, xtype)};
    /* Every kernel but the bf16 dot products reads x as float32, [m, k] contiguous. */
    const int dot_bf16 = X86 && level >= AVX512_BF16 && wtype == W_BF16;
    float *xf = NULL;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    if (!dot_bf16 && xtype == X_F32 && ldx == k) {
        job.xf = (const float *)job.x;
    } else if (!dot_bf16) {
        xf = (float *)malloc((size_t)(m * k) * sizeof(float));
        failed = xf == NULL;
        for (int64_t b = 0; xf && b < m; b++)
            for (int64_t i = 0; i < k; i++)
                xf[b * k + i] = xtype == X_F32 ? ((const float *)job.x)[b * ldx + i]
                                               : bf16_to_f32(((const uint16_t *)job.x)[b * ldx + i]);
        job.xf = xf;
    }
    if (!failed) {
        /* a thread per ~64K weights at least: below that, waking one costs more than it saves */
        const int64_t useful = (n * k) / 65536 + 1;
        int nt = threads < 1 ? 1 : threads;
        if (nt > useful) nt = (int)useful;
        parallel(gemv_part, &task, nt);
    }
    Py_END_ALLOW_THREADS
    free(xf);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
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
    {"read", py_read, METH_VARARGS,
     "read(pointer, nbytes, threads, level, streams) -> checksum: read the bytes once (the sum of their 8-byte words)"},
    {"levels", py_levels, METH_NOARGS, "the kernel levels this CPU runs, slowest first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gemv", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__gemv(void) {
    detect();
    pthread_atfork(NULL, NULL, forget_workers);
    return PyModule_Create(&module);
}
