/* The 8-float vectors (GCC vector extensions) of a step's operators besides its matrix products,
 * shared by step.c (RMSNorm, SwiGLU, sums) and attend.c (attention): loads and stores in the
 * activation dtype with its roundings, e^x. Compiled for AVX2 + FMA or plain x86-64 / C
 * by the functions that inline them. */
#ifndef SHARD_GEMV_VEC_H
#define SHARD_GEMV_VEC_H
#include "gemv.h"

#pragma GCC diagnostic ignored "-Wpsabi"  /* 32-byte vectors pass only between inlined functions */
typedef float f8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
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


#endif
