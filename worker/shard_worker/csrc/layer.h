/* A whole decoder layer's step in one call (layer.c): its fixed part, the plan. Python
 * mirrors this struct field for field (fused.LayerPlan, a ctypes.Structure); every field is 8
 * bytes, so the two agree without padding, and module.c exports its size for the mirror to check. */
#ifndef SHARD_GEMV_LAYER_H
#define SHARD_GEMV_LAYER_H
#include "gemv.h"

#pragma GCC visibility push(hidden)

typedef struct {
    int64_t xtype, wtype;                   /* the activations' and the projections' dtypes */
    int64_t hidden, heads, kv_heads, head_dim, inter;
    double eps;                             /* the norms' */
    const void *in_norm, *post_norm;        /* [hidden] in the activation dtype */
    /* each projection: its weight (rows ldw elements apart), float32 scales (int8) and bias, or NULL */
    const void *qkv_w; int64_t qkv_ldw; const void *qkv_scale, *qkv_bias;
    const void *o_w; int64_t o_ldw; const void *o_scale, *o_bias;
    const void *gate_up_w; int64_t gate_up_ldw; const void *gate_up_scale, *gate_up_bias;
    const void *down_w; int64_t down_ldw; const void *down_scale, *down_bias;
    /* the layer's KV cache [rows, kv_heads, len, head_dim]: its strides in elements; or (cache_len 0)
     * its paged pool [kv_heads, cache_rows slots, head_dim]: cache_row a slot's stride, cache_head a head's */
    void *k_cache, *v_cache;
    int64_t cache_rows, cache_row, cache_head, cache_len;
    /* the TP ranks' shared-memory group (shm.ShmGroup); shm_size 1: none */
    char *shm_slots; int64_t shm_slot_bytes;
    int64_t *shm_flags; int64_t shm_flag_stride, shm_size, shm_rank;
    double shm_timeout;                     /* seconds */
} LayerPlan;

/* What one call computes: n tokens (x's rows) -- a decode step's rows, a prompt chunk's tokens,
 * or both -- each with its rope, its first and last cache columns, and where its K/V row lives */
typedef struct {
    int64_t n;                    /* tokens */
    int64_t col;                  /* the largest column a token attends to */
    const int64_t *cols;          /* paged (or NULL: `col` for all): [n] each token's own column */
    const int64_t *first;         /* [n] the first column each token attends to */
    const void *cos, *sin;        /* [n, head_dim] each token's rope, in the dtype */
    int64_t r0;                   /* unpaged: the cache row of the first token (one token a row) */
    const int64_t *slots;         /* paged (or NULL): [rows, ld_slots] the pool slot of each row's columns */
    int64_t ld_slots;
    const int64_t *srow;          /* paged (or NULL: its own): [n] each token's row of `slots` */
    const int64_t *wslot;         /* paged: [n] each token's write slot */
    const int64_t *ends;          /* the matrix products' groups of tokens (gemv_groups), or NULL: by MAX_M */
    int groups;
} LayerStep;

const char *layer_problem(const LayerPlan *p);
int layer_run(const LayerPlan *p, void *x, const LayerStep *s, int threads, int level, int64_t *round,
              double *comm);

#pragma GCC visibility pop
#endif
