/* The rest of a decode step. What a decode step does besides its matrix products and attention
 * (attend.c), for one token a row, in one call each where torch took several operators of a few
 * microseconds: RMSNorm, SwiGLU's silu(gate) * up, and the rows' sums. GCC vector extensions (8
 * floats, vec.h), compiled for AVX2 + FMA or plain x86-64 / C. */
#include "vec.h"

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

#if X86
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
static void rms_norm_plain(int xtype, const void *x, const void *w, void *y, int64_t n, int64_t h, float eps) {
    rms_norm_rows(xtype, x, w, y, n, h, eps);
}
static void silu_mul_plain(int xtype, const void *gu, void *out, int64_t n, int64_t inter) {
    silu_mul_rows(xtype, gu, out, n, inter);
}
static void add_rows_plain(int xtype, void *dst, const void *src, int64_t n, int64_t len, int64_t ld) {
    add_rows(xtype, dst, src, n, len, ld);
}
void silu_mul_run(int level, int xtype, const void *gu, void *out, int64_t n, int64_t inter) {
#if X86
    if (level >= AVX2) { silu_mul_256(xtype, gu, out, n, inter); return; }
#endif
    (void)level;
    silu_mul_plain(xtype, gu, out, n, inter);
}
void add_rows_run(int level, int xtype, void *dst, const void *src, int64_t n, int64_t len, int64_t ld) {
#if X86
    if (level >= AVX2) { add_rows_256(xtype, dst, src, n, len, ld); return; }
#endif
    (void)level;
    add_rows_plain(xtype, dst, src, n, len, ld);
}

void rms_norm_run(int level, int xtype, const void *x, const void *w, void *y, int64_t n, int64_t h, float eps) {
#if X86
    if (level >= AVX2) { rms_norm_256(xtype, x, w, y, n, h, eps); return; }
#endif
    (void)level;
    rms_norm_plain(xtype, x, w, y, n, h, eps);
}
