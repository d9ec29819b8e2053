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
typedef struct {
    const Job *job;
    RowsFn fn;
    const int64_t *ends;  /* the groups of x's rows (each at most MAX_M): where each ends */
    int groups;
    int64_t block;        /* W's rows a block: what stays in L2 while every group takes it */
} GemvTask;

/* The job for x's rows [b0, b1) alone (one group): x, its prepared forms and y from row b0 */
static Job group_job(const Job *j, int64_t b0, int64_t b1) {
    Job g = *j;
    const int64_t xs = j->xtype == X_F32 ? 4 : 2;
    g.m = b1 - b0;
    g.x = (const char *)j->x + b0 * j->ldx * xs;
    g.y = (char *)j->y + b0 * j->ldy * xs;
    if (j->xf) g.xf = j->xf + b0 * j->k;
    if (j->xq) { g.xq = j->xq + b0 * j->kpad; g.xs = j->xs + b0 * j->nblk; }
    return g;
}

/* A thread's rows of W; with several groups, a block of W's rows at a time, which every group
 * multiplies while it is in L2: W is read from memory once, whatever the groups. A row's sums
 * are those of its group alone (the kernels sum each row and vector on its own), so the split
 * into groups and blocks gives the bits of one call a group. */
static void gemv_part(void *p, int i, int n) {
    const GemvTask *t = (const GemvTask *)p;
    const int64_t rows = t->job->n, per = (rows + n - 1) / n;
    const int64_t r0 = i * per, r1 = r0 + per < rows ? r0 + per : rows;
    if (r0 >= r1) return;
    if (t->groups <= 1) { t->fn(t->job, r0, r1); return; }
    Job jobs[MAX_TOKENS];
    for (int g = 0; g < t->groups; g++) jobs[g] = group_job(t->job, g ? t->ends[g - 1] : 0, t->ends[g]);
    for (int64_t b = r0; b < r1; b += t->block) {
        const int64_t e = b + t->block < r1 ? b + t->block : r1;
        for (int g = 0; g < t->groups; g++) t->fn(&jobs[g], b, e);
    }
}

/* x's m rows in groups of MAX_M (the last one shorter): ends[] of each; returns the count. A
 * step of several parts (decode rows, a chunk's tokens) gives each part's groups on its own
 * (gemv_groups), so each part's rows get the bits of the call it makes alone. */
int split_groups(int64_t m, int64_t *ends) {
    int g = 0;
    for (int64_t b = MAX_M; b < m; b += MAX_M) ends[g++] = b;
    ends[g++] = m;
    return g;
}

/* whether ends[0 : groups] are groups of m rows of at most MAX_M each */
int groups_valid(const int64_t *ends, int groups, int64_t m) {
    if (groups < 1 || groups > MAX_TOKENS || ends[groups - 1] != m) return 0;
    for (int g = 0; g < groups; g++) {
        const int64_t size = ends[g] - (g ? ends[g - 1] : 0);
        if (size < 1 || size > MAX_M) return 0;
    }
    return 1;
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

/* y = x W^T (* scale) for m rows of x (at most MAX_TOKENS), in groups of x's rows ending at
 * ends[0 : groups] (each at most MAX_M rows), split over `threads`; 0, or -1 when memory ran
 * out. Runs without the GIL (the callers release it). */
int gemv_groups(int wtype, int xtype, const void *w, const void *scale, const void *x, void *y, int64_t n,
                int64_t k, int64_t ldw, int64_t m, int64_t ldx, int64_t ldy, const int64_t *ends, int groups,
                int threads, int level) {
    Job job = {wtype, xtype, w, scale, x, y, NULL, n, k, m, ldx, ldy, ldw, NULL, NULL, 0, 0};
    const int64_t wbytes = k * (wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1);
    /* blocks of ~128 KiB of W (whole tiles: multiples of 8 rows): in L2 for the groups after the first */
    const int64_t block = ((131072 / (wbytes > 0 ? wbytes : 1)) / 8 + 1) * 8;
    GemvTask task = {&job, pick(level, wtype, xtype), ends, groups, block};
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

/* y = x W^T (* scale) for m rows of x in groups of MAX_M (split_groups) */
int gemv_run(int wtype, int xtype, const void *w, const void *scale, const void *x, void *y, int64_t n,
             int64_t k, int64_t ldw, int64_t m, int64_t ldx, int64_t ldy, int threads, int level) {
    int64_t ends[MAX_TOKENS];
    const int groups = split_groups(m, ends);
    return gemv_groups(wtype, xtype, w, scale, x, y, n, k, ldw, m, ldx, ldy, ends, groups, threads, level);
}

/* the dtypes and shapes gemv_run takes */
int gemv_valid(int wtype, int xtype, const void *scale, int64_t n, int64_t k, int64_t ldw, int64_t m,
                      int64_t ldx, int64_t ldy) {
    return !(wtype < W_F32 || wtype > W_I8 || xtype < X_F32 || xtype > X_BF16 || m < 1 || m > MAX_TOKENS || n < 0
             || k < 1 || ldw < k || ldx < k || ldy < n || (wtype == W_I8 && !scale)
             || (wtype == W_F32 && xtype != X_F32) || (wtype == W_BF16 && xtype != X_BF16));
}
