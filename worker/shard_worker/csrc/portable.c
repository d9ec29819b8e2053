/* The portable C kernels, and x quantized for int8 weights (every path computes these bits). */
#include "gemv.h"

/* x's rows as int8 weights meet them: xq [m, kpad] (zero beyond k) and xs [m, nblk] */
void quantize_x(const Job *j, int16_t *xq, float *xs) {
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



void rows_portable(const Job *j, int64_t r0, int64_t r1) {
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
void rows_portable_i8(const Job *j, int64_t r0, int64_t r1) {
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
