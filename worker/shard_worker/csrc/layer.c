/* A whole decoder layer: a step's layer in one call (a decode step's rows, a prompt chunk's
 * tokens, or both), the GIL released throughout: what
 * the Python layer does with the calls of module.c, in the same order and with the same roundings, so the bits are the same (the
 * tests compare them), without ~0.5 ms of Python and torch dispatch a layer (a fifth of a TP=2
 * rank's decode step in bfloat16):
 *   h = rms_norm(x); qkv = h Wqkv^T (+ b); a = attend(qkv); o = a Wo^T; all-reduce o (+ b); x += o;
 *   h = rms_norm(x); gu = h Wgu^T (+ b); m = silu(gate) up; d = m Wdown^T; all-reduce d (+ b); x += d.
 * The layer's fixed part (pointers, shapes, its KV cache, the shared-memory group) is a LayerPlan
 * (layer.h), which Python fills through its ctypes mirror. */
#include "layer.h"

/* What is wrong with a plan, or NULL */
const char *layer_problem(const LayerPlan *p) {
    const int64_t h = p->hidden, q = p->heads * p->head_dim, kv = p->kv_heads * p->head_dim, esize = p->xtype ? 2 : 4;
    const void *scales[4] = {p->qkv_scale, p->o_scale, p->gate_up_scale, p->down_scale};
    const int64_t ns[4] = {q + 2 * kv, h, 2 * p->inter, h}, ks[4] = {h, q, h, p->inter};
    const int64_t ldws[4] = {p->qkv_ldw, p->o_ldw, p->gate_up_ldw, p->down_ldw};
    const void *ws[4] = {p->qkv_w, p->o_w, p->gate_up_w, p->down_w};
    for (int i = 0; i < 4; i++)
        if (!ws[i] || !gemv_valid((int)p->wtype, (int)p->xtype, scales[i], ns[i], ks[i], ldws[i], 1, ks[i], ns[i]))
            return "a projection's dtype or shape is not one the matrix products take";
    if (h < 1 || p->heads < 1 || p->kv_heads < 1 || p->heads % p->kv_heads || p->head_dim < 2 || p->head_dim % 2
        || p->inter < 1)
        return "bad sizes";
    if (!p->in_norm || !p->post_norm || !p->k_cache || !p->v_cache) return "a norm weight or a cache is missing";
    if (p->cache_len == 0 ? p->cache_rows < 1 || p->cache_row < p->head_dim || p->cache_head < p->cache_row * p->cache_rows
                          : p->cache_rows < 1 || p->cache_len < 1 || p->cache_head < p->head_dim * p->cache_len
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
        missed = shm_round((int)p->xtype, y, n * p->hidden, p->shm_slots, p->shm_slot_bytes,
                           p->shm_flags, p->shm_flag_stride, (int)p->shm_size, (int)p->shm_rank,
                           ++*round, p->shm_timeout);
        *comm += monotonic_seconds() - start;
    }
    return missed;
}

/* x [n, hidden] (in place): the layer's step for the tokens of `s` (LayerStep: decode rows, a
 * chunk's tokens, or both; their K/V written before any attends). Returns 0; -1 when memory ran
 * out; or 1 + the peer that missed an all-reduce. */
int layer_run(const LayerPlan *p, void *x, const LayerStep *s, int threads, int level, int64_t *round,
              double *comm) {
    const int xt = (int)p->xtype, wt = (int)p->wtype;
    const int64_t n = s->n, h = p->hidden, hd = p->head_dim, q = p->heads * hd, kv = p->kv_heads * hd;
    const int64_t inter = p->inter, nqkv = q + 2 * kv, esize = xt == X_F32 ? 4 : 2;
    const float eps = (float)p->eps;
    int64_t by_size[MAX_TOKENS];
    const int64_t *ends = s->ends;
    int groups = s->groups;
    if (!ends) { groups = split_groups(n, by_size); ends = by_size; }
    char *buf = (char *)malloc((size_t)(n * (h + nqkv + q + 3 * inter) * esize));
    if (!buf) return -1;
    char *hbuf = buf, *qkv = hbuf + n * h * esize, *att = qkv + n * nqkv * esize, *gu = att + n * q * esize;
    char *act = gu + n * 2 * inter * esize;
    void *out = hbuf;  /* the o and down products reuse h's rows: h is read before each is written */
    int status = 0;
#define PRODUCT(name, in, y, rows, cols) \
    gemv_groups(wt, xt, p->name##_w, p->name##_scale, in, y, rows, cols, p->name##_ldw, n, cols, rows, ends, groups, \
                threads, level)
    rms_norm_run(level, xt, x, p->in_norm, hbuf, n, h, eps);
    if (PRODUCT(qkv, hbuf, qkv, nqkv, h)) goto oom;
    if (p->qkv_bias) add_rows_run(level, xt, qkv, p->qkv_bias, n, nqkv, 0);
    const int64_t from = s->slots ? 0 : s->r0 * p->cache_row * esize;  /* paged: the slots say where each row is */
    const Attn a = {.xtype = xt, .qkv = qkv, .cos = s->cos, .sin = s->sin, .kc = (char *)p->k_cache + from,
                    .vc = (char *)p->v_cache + from, .cache_row = p->cache_row, .cache_head = p->cache_head,
                    .first = s->first, .col = s->col, .cols = s->cols, .srow = s->srow, .slots = s->slots,
                    .ld_slots = s->ld_slots, .wslot = s->wslot, .out = att, .n = n, .heads = p->heads,
                    .kv_heads = p->kv_heads, .hd = hd, .scale = (float)(1.0 / __builtin_sqrt((double)hd))};
    if (attend_run(&a, threads, level)) goto oom;
    if (PRODUCT(o, att, out, h, q)) goto oom;
    int missed = reduce(p, out, n, round, comm);
    if (missed >= 0) { status = 1 + missed; goto done; }
    if (p->o_bias) add_rows_run(level, xt, out, p->o_bias, n, h, 0);
    add_rows_run(level, xt, x, out, n, h, h);
    rms_norm_run(level, xt, x, p->post_norm, hbuf, n, h, eps);
    if (PRODUCT(gate_up, hbuf, gu, 2 * inter, h)) goto oom;
    if (p->gate_up_bias) add_rows_run(level, xt, gu, p->gate_up_bias, n, 2 * inter, 0);
    silu_mul_run(level, xt, gu, act, n, inter);
    if (PRODUCT(down, act, out, h, inter)) goto oom;
#undef PRODUCT
    missed = reduce(p, out, n, round, comm);
    if (missed >= 0) { status = 1 + missed; goto done; }
    if (p->down_bias) add_rows_run(level, xt, out, p->down_bias, n, h, 0);
    add_rows_run(level, xt, x, out, n, h, h);
    goto done;
oom:
    status = -1;
done:
    free(buf);
    return status;
}
