/* A step's attention, with its rope and KV-cache write, in one call: a decode step's rows (one
 * token each) and a prompt chunk's tokens (each at its own column, attending causally over its
 * sequence's cache up to it). Where torch took several operators (and its bfloat16 flash attention
 * ~120 us a layer at 34 cached columns, 7 ms at 2048).
 *
 * Every token's k and v are written first, then the tokens attend: a chunk's token reads the keys
 * of the tokens before it, written by this very call. The tokens of one sequence that follow one
 * another (a chunk's) attend as a span: each column of K and V is made float32 once for the span
 * and every query that reads it takes it, where each token alone read the whole context again; a
 * token's sums are the very ones it takes alone (same order, same roundings), so how tokens are
 * grouped into spans never changes a bit. GCC vector extensions (vec.h). */
#include "vec.h"

#define SPAN 8  /* tokens of a span, at most */

/* HF's rope (rotate_half: the halves (x1, x2) -> (-x2, x1)) of hd values at `at`, in float32 */
INLINE void rope(float *out, const Attn *a, int64_t b, int64_t at) {
    const int64_t half = a->hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = load1(a->xtype, a->qkv, at + i), x2 = load1(a->xtype, a->qkv, at + half + i);
        out[i] = x1 * load1(a->xtype, a->cos, b * a->hd + i) - x2 * load1(a->xtype, a->sin, b * a->hd + i);
        out[half + i] = x2 * load1(a->xtype, a->cos, b * a->hd + half + i) + x1 * load1(a->xtype, a->sin, b * a->hd + half + i);
    }
}

INLINE int64_t col_of(const Attn *a, int64_t t) { return a->cols ? a->cols[t] : a->col; }

/* where token t's KV head g starts in the cache, and (paged) its row of slots: column -> pool slot */
INLINE int64_t head_of(const Attn *a, int64_t t, int64_t g) {
    return a->slots ? g * a->cache_head : t * a->cache_row + g * a->cache_head;
}
INLINE const int64_t *slots_of(const Attn *a, int64_t t) {
    return a->slots ? a->slots + (a->srow ? a->srow[t] : t) * a->ld_slots : NULL;
}
INLINE int64_t at_col(const Attn *a, int64_t head, const int64_t *slot, int64_t c) {
    return head + (slot ? slot[c] * a->cache_row : c * a->hd);
}

/* Token t, KV head g: its k (rotated, through `k`: hd floats) and v into the cache */
INLINE void write_kv(const Attn *a, int64_t t, int64_t g, float *k) {
    const int64_t hd = a->hd, width = (a->heads + 2 * a->kv_heads) * hd, head = head_of(a, t, g);
    const int64_t at = a->slots ? head + a->wslot[t] * a->cache_row : head + a->col * hd;
    rope(k, a, t, t * width + (a->heads + g) * hd);
    for (int64_t i = 0; i < hd; i++) {
        store1(a->xtype, a->kc, at + i, k[i]);
        store1(a->xtype, a->vc, at + i, load1(a->xtype, a->qkv, t * width + (a->heads + a->kv_heads + g) * hd + i));
    }
}

INLINE void write_all(const Attn *a, float *k) {
    for (int64_t t = 0; t < a->n; t++)
        for (int64_t g = 0; g < a->kv_heads; g++) write_kv(a, t, g, k);
}

/* sc[0 : len] = softmax(sc), in place, in float32; a NaN score makes the row NaN */
INLINE void softmax(float *sc, int64_t len) {
    float top = sc[0], sum = 0.0f;
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

#define VB 16  /* V's columns made float32 at a time */

/* one query's scores over 8 columns from kt (hd x 8: column l's values in lane l): 4 chains */
INLINE f8 scores8(const float *q, const float *kt, int64_t hd) {
    f8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t d = 0;
    for (; d + 4 <= hd; d += 4) {
        s0 += q[d] * load8f(kt + d * 8);
        s1 += q[d + 1] * load8f(kt + (d + 1) * 8);
        s2 += q[d + 2] * load8f(kt + (d + 2) * 8);
        s3 += q[d + 3] * load8f(kt + (d + 3) * 8);
    }
    for (; d < hd; d++) s0 += q[d] * load8f(kt + d * 8);
    return (s0 + s1) + (s2 + s3);
}

/* acc[0 : hd] += p[c - p0] v[c - c0] for c in [from, to] (v: rows of hd floats), each lane summed
 * in column order; 64 lanes at a time in registers */
INLINE void add_columns(float *acc, const float *p, int64_t p0, const float *v, int64_t c0, int64_t from,
                        int64_t to, int64_t hd) {
    int64_t u = 0;
    for (; u + 64 <= hd; u += 64) {
        f8 a[8];
        for (int r = 0; r < 8; r++) a[r] = load8f(acc + u + 8 * r);
        for (int64_t c = from; c <= to; c++) {
            const float w = p[c - p0];
            const f8 pv = {w, w, w, w, w, w, w, w};
            const float *row = v + (c - c0) * hd + u;
            for (int r = 0; r < 8; r++) a[r] += pv * load8f(row + 8 * r);
        }
        for (int r = 0; r < 8; r++) memcpy(acc + u + 8 * r, &a[r], sizeof a[r]);
    }
    for (; u + 8 <= hd; u += 8) {
        f8 a = load8f(acc + u);
        for (int64_t c = from; c <= to; c++) {
            const float w = p[c - p0];
            const f8 pv = {w, w, w, w, w, w, w, w};
            a += pv * load8f(v + (c - c0) * hd + u);
        }
        memcpy(acc + u, &a, sizeof a);
    }
    for (; u < hd; u++)
        for (int64_t c = from; c <= to; c++) acc[u] += p[c - p0] * v[(c - c0) * hd + u];
}

/* Tokens [t0, t0 + G) (one sequence's, sharing its slots; or G = 1), KV head g: each token's
 * `group` query heads attend to its columns [first[t], col_t]: the scores of 8 columns at a time
 * (K's columns made float32 once for the span, laid side by side: each query's 8 scores are
 * vector products, no horizontal sums), their softmax in float32, then the values (VB columns of
 * V made float32 once for the span, each query's sums in registers). `work`: (2 G group + 8 +
 * VB) hd + G group `stride` floats, stride >= every token's column count. */
INLINE void attend_span(const Attn *a, int64_t t0, int64_t G, int64_t g, float *work, int64_t stride) {
    const int64_t hd = a->hd, group = a->heads / a->kv_heads, width = (a->heads + 2 * a->kv_heads) * hd;
    float *q = work, *acc = q + G * group * hd, *kt = acc + G * group * hd, *vb = kt + 8 * hd, *score = vb + VB * hd;
    const int64_t head = head_of(a, t0, g);
    const int64_t *slot = slots_of(a, t0);
    int64_t lo = a->first[t0], hi = col_of(a, t0);
    for (int64_t i = 0; i < G; i++) {
        const int64_t t = t0 + i;
        lo = a->first[t] < lo ? a->first[t] : lo;
        hi = col_of(a, t) > hi ? col_of(a, t) : hi;
        for (int64_t j = 0; j < group; j++) rope(q + (i * group + j) * hd, a, t, t * width + (g * group + j) * hd);
    }
    for (int64_t c = lo; c <= hi; c += 8) {
        const int64_t nc = hi + 1 - c < 8 ? hi + 1 - c : 8;
        for (int64_t l = 0; l < 8; l++) {
            if (l < nc) to_float(vb, a->xtype, a->kc, at_col(a, head, slot, c + l), hd);
            for (int64_t d = 0; d < hd; d++) kt[d * 8 + l] = l < nc ? vb[d] : 0.0f;
        }
        for (int64_t i = 0; i < G; i++) {
            const int64_t first = a->first[t0 + i], last = col_of(a, t0 + i);
            if (c + nc <= first || c > last) continue;
            for (int64_t j = 0; j < group; j++) {
                const f8 sc = scores8(q + (i * group + j) * hd, kt, hd) * a->scale;
                for (int64_t l = 0; l < nc; l++)
                    if (c + l >= first && c + l <= last) score[(i * group + j) * stride + c + l - first] = sc[l];
            }
        }
    }
    for (int64_t i = 0; i < G; i++)
        for (int64_t j = 0; j < group; j++)
            softmax(score + (i * group + j) * stride, col_of(a, t0 + i) + 1 - a->first[t0 + i]);
    memset(acc, 0, (size_t)(G * group * hd) * sizeof(float));
    for (int64_t c = lo; c <= hi; c += VB) {
        const int64_t nc = hi + 1 - c < VB ? hi + 1 - c : VB;
        for (int64_t l = 0; l < nc; l++) to_float(vb + l * hd, a->xtype, a->vc, at_col(a, head, slot, c + l), hd);
        for (int64_t i = 0; i < G; i++) {
            const int64_t first = a->first[t0 + i], last = col_of(a, t0 + i);
            const int64_t from = c > first ? c : first, to = c + nc - 1 < last ? c + nc - 1 : last;
            if (from > to) continue;
            for (int64_t j = 0; j < group; j++)
                add_columns(acc + (i * group + j) * hd, score + (i * group + j) * stride, first, vb, c, from, to, hd);
        }
    }
    for (int64_t i = 0; i < G; i++)
        for (int64_t j = 0; j < group; j++)
            for (int64_t d = 0; d < hd; d++)
                store1(a->xtype, a->out, (t0 + i) * a->heads * hd + (g * group + j) * hd + d,
                       acc[(i * group + j) * hd + d]);
}

typedef struct {
    const Attn *attn;
    int avx2;
    float *work;
    int64_t per_thread, stride, tasks;
    const int64_t *spans;  /* [spans + 1]: each span's first token, then n */
    int64_t next;          /* the next task to take (atomic): spans are as long as their contexts */
} AttnTask;

/* the task's tasks, (span, KV head) pairs, the longest spans' first, until none is left */
INLINE void take_tasks(AttnTask *t, float *work) {
    const Attn *a = t->attn;
    for (;;) {
        const int64_t i = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        if (i >= t->tasks) return;
        const int64_t task = t->tasks - 1 - i, s = task / a->kv_heads;  /* from the last: a chunk is last */
        attend_span(a, t->spans[s], t->spans[s + 1] - t->spans[s], task % a->kv_heads, work, t->stride);
    }
}

#if X86
T256FN static void take_256(AttnTask *t, float *work) { take_tasks(t, work); }
T256FN static void write_all_256(const Attn *a, float *k) { write_all(a, k); }
#endif
static void take_plain(AttnTask *t, float *work) { take_tasks(t, work); }
static void write_all_plain(const Attn *a, float *k) { write_all(a, k); }

static void attend_part(void *p, int i, int nt) {
    (void)nt;
    AttnTask *t = (AttnTask *)p;
    float *work = t->work + i * t->per_thread;
#if X86
    if (t->avx2) { take_256(t, work); return; }
#endif
    take_plain(t, work);
}

/* the shapes attend_run takes (`rows`: the rows of `slots`, when paged) */
int attend_valid(const Attn *a, int64_t n) {
    if (a->xtype < X_F32 || a->xtype > X_BF16 || n < 1 || a->kv_heads < 1 || a->heads % a->kv_heads
        || a->hd < 2 || a->hd % 2 || a->col < 0
        || (a->slots ? a->ld_slots <= a->col || !a->wslot || a->cache_row < a->hd || a->cache_head < a->hd
                     : a->cols || a->srow || a->cache_head < a->hd * (a->col + 1)
                       || a->cache_row < a->cache_head * a->kv_heads))
        return 0;
    for (int64_t t = 0; t < n; t++) {
        const int64_t c = col_of(a, t);
        if (c < 0 || c > a->col || a->first[t] < 0 || a->first[t] > c || (a->srow && a->srow[t] < 0)) return 0;
    }
    return 1;
}

/* A step's attention (see py_attend), split over `threads`; 0, or -1 when memory ran out */
int attend_run(const Attn *a, int threads, int level) {
    const int64_t group = a->heads / a->kv_heads, stride = a->col + 1;
    const int64_t per_thread = (2 * SPAN * group + 8 + VB) * a->hd + SPAN * group * stride;
    int64_t *spans = (int64_t *)malloc((size_t)(a->n + 1) * sizeof(int64_t)), count = 0;
    if (!spans) return -1;
    for (int64_t t = 0; t < a->n;) {  /* a sequence's consecutive tokens (`srow`), SPAN at most */
        const int64_t s = t++;
        while (t < a->n && a->srow && a->srow[t] == a->srow[s] && t - s < SPAN) t++;
        spans[count++] = s;
    }
    spans[count] = a->n;
    /* a thread per ~64K cached values read at least, as for the matrix products */
    const int64_t useful = (count * a->kv_heads * stride * a->hd) / 65536 + 1;
    int nt = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (nt > useful) nt = (int)useful;
    float *work = (float *)malloc((size_t)(nt * per_thread) * sizeof(float));
    if (!work) { free(spans); return -1; }
    AttnTask task = {a, X86 && level >= AVX2, work, per_thread, stride, count * a->kv_heads, spans, 0};
#if X86
    if (task.avx2) write_all_256(a, work);
    else
#endif
        write_all_plain(a, work);
    parallel(attend_part, &task, nt);
    free(work);
    free(spans);
    return 0;
}
