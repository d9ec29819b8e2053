/* The matrix products: which kernel (CPUID), x prepared as it reads it, rows split over threads. */
#include "gemv.h"

int supported[LEVELS];

void detect(void) {
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

/* ---------------------------------------------------------------- matrix products */
typedef struct { const Job *job; RowsFn fn; } GemvTask;

static void gemv_part(void *p, int i, int n) {
    const GemvTask *t = (const GemvTask *)p;
    const int64_t rows = t->job->n, per = (rows + n - 1) / n;
    const int64_t r0 = i * per, r1 = r0 + per < rows ? r0 + per : rows;
    if (r0 < r1) t->fn(t->job, r0, r1);
}

void quantize_with(int level, const Job *j, int16_t *xq, float *xs) {
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
int gemv_run(int wtype, int xtype, const void *w, const void *scale, const void *x, void *y, int64_t n,
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
int gemv_valid(int wtype, int xtype, const void *scale, int64_t n, int64_t k, int64_t ldw, int64_t m,
                      int64_t ldx, int64_t ldy) {
    return !(wtype < W_F32 || wtype > W_I8 || xtype < X_F32 || xtype > X_BF16 || m < 1 || m > MAX_M || n < 0
             || k < 1 || ldw < k || ldx < k || ldy < n || (wtype == W_I8 && !scale)
             || (wtype == W_F32 && xtype != X_F32) || (wtype == W_BF16 && xtype != X_BF16));
}
