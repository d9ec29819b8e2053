/* The rest of a decode step. What a decode step does besides its matrix products, for one token a row, in one call each
 * where torch took several operators of a few microseconds (and its bfloat16 flash attention
 * ~120 us a layer at 34 cached columns, 7 ms at 2048): RMSNorm, and attention with its rope and
 * KV-cache write. GCC vector extensions (8 floats), compiled for AVX2 + FMA or plain x86-64 / C. */
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

/* four sums side by side: one chain of dependent FMAs waited on each one's latency */
INLINE float dot(const float *a, const float *b, int64_t len) {
    f8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        s0 += load8f(a + i) * load8f(b + i);
        s1 += load8f(a + i + 8) * load8f(b + i + 8);
        s2 += load8f(a + i + 16) * load8f(b + i + 16);
        s3 += load8f(a + i + 24) * load8f(b + i + 24);
    }
    for (; i + 8 <= len; i += 8) s0 += load8f(a + i) * load8f(b + i);
    const f8 acc = (s0 + s1) + (s2 + s3);
    float sum = HSUM8(acc);
    for (; i < len; i++) sum += a[i] * b[i];
    return sum;
}

/* acc += p * v */
INLINE void add_scaled(float *acc, float p, const float *v, int64_t len) {
    const f8 pv = {p, p, p, p, p, p, p, p};
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        const f8 a = load8f(acc + i) + pv * load8f(v + i);
        memcpy(acc + i, &a, sizeof a);
    }
    for (; i < len; i++) acc[i] += p * v[i];
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


/* HF's rope (rotate_half: the halves (x1, x2) -> (-x2, x1)) of hd values at `at`, in float32 */
INLINE void rope(float *out, const Attn *a, int64_t b, int64_t at) {
    const int64_t half = a->hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = load1(a->xtype, a->qkv, at + i), x2 = load1(a->xtype, a->qkv, at + half + i);
        out[i] = x1 * load1(a->xtype, a->cos, b * a->hd + i) - x2 * load1(a->xtype, a->sin, b * a->hd + i);
        out[half + i] = x2 * load1(a->xtype, a->cos, b * a->hd + half + i) + x1 * load1(a->xtype, a->sin, b * a->hd + half + i);
    }
}

/* Row b, KV head g: write its k (rotated) and v into the cache, then its `group` query heads
 * attend to columns [first[b], col]: the scores of every column (each column of K made float32
 * once for the group), their softmax in float32, then the values (each column of V made float32
 * once). `work`: 2 (group + 1) hd + group (col + 1) floats. */
INLINE void attend_one(const Attn *a, int64_t b, int64_t g, float *work) {
    const int64_t hd = a->hd, group = a->heads / a->kv_heads, width = (a->heads + 2 * a->kv_heads) * hd;
    const int64_t first = a->first[b], len = a->col + 1 - first;
    float *q = work, *acc = q + group * hd, *k = acc + group * hd, *v = k + hd, *score = v + hd;
    const int64_t head = a->slots ? g * a->cache_head : b * a->cache_row + g * a->cache_head;
    const int64_t *slot = a->slots ? a->slots + b * a->ld_slots : NULL;  /* paged: column -> pool slot */
    const int64_t at = a->slots ? head + a->wslot[b] * a->cache_row : head + a->col * hd;
    rope(k, a, b, b * width + (a->heads + g) * hd);
    for (int64_t i = 0; i < hd; i++) {
        store1(a->xtype, a->kc, at + i, k[i]);
        store1(a->xtype, a->vc, at + i, load1(a->xtype, a->qkv, b * width + (a->heads + a->kv_heads + g) * hd + i));
    }
    for (int64_t j = 0; j < group; j++) rope(q + j * hd, a, b, b * width + (g * group + j) * hd);
    for (int64_t c = 0; c < len; c++) {
        to_float(k, a->xtype, a->kc, head + (slot ? slot[first + c] * a->cache_row : (first + c) * hd), hd);
        for (int64_t j = 0; j < group; j++) score[j * len + c] = dot(q + j * hd, k, hd) * a->scale;
    }
    for (int64_t j = 0; j < group; j++) {  /* softmax, in place; a NaN score makes the head's output NaN */
        float *sc = score + j * len, top = sc[0], sum = 0.0f;
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
    memset(acc, 0, (size_t)(group * hd) * sizeof(float));
    for (int64_t c = 0; c < len; c++) {
        to_float(v, a->xtype, a->vc, head + (slot ? slot[first + c] * a->cache_row : (first + c) * hd), hd);
        for (int64_t j = 0; j < group; j++) add_scaled(acc + j * hd, score[j * len + c], v, hd);
    }
    for (int64_t j = 0; j < group; j++)
        for (int64_t i = 0; i < hd; i++) store1(a->xtype, a->out, b * a->heads * hd + (g * group + j) * hd + i, acc[j * hd + i]);
}

typedef struct { const Attn *attn; int avx2; float *work; int64_t per_thread; } AttnTask;

#if X86
T256FN static void attend_rows_256(const Attn *a, int64_t t0, int64_t t1, float *work) {
    for (int64_t t = t0; t < t1; t++) attend_one(a, t / a->kv_heads, t % a->kv_heads, work);
}
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
static void attend_rows(const Attn *a, int64_t t0, int64_t t1, float *work) {
    for (int64_t t = t0; t < t1; t++) attend_one(a, t / a->kv_heads, t % a->kv_heads, work);
}
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

static void attend_part(void *p, int i, int nt) {  /* (row, KV head) pairs, split over the threads */
    const AttnTask *t = (const AttnTask *)p;
    const int64_t tasks = t->attn->n * t->attn->kv_heads, per = (tasks + nt - 1) / nt;
    const int64_t t0 = i * per, t1 = t0 + per < tasks ? t0 + per : tasks;
    float *work = t->work + i * t->per_thread;
#if X86
    if (t->avx2) { if (t0 < t1) attend_rows_256(t->attn, t0, t1, work); return; }
#endif
    if (t0 < t1) attend_rows(t->attn, t0, t1, work);
}

/* the shapes attend_run takes */
int attend_valid(const Attn *a, int64_t n) {
    return !(a->xtype < X_F32 || a->xtype > X_BF16 || n < 1 || a->kv_heads < 1 || a->heads % a->kv_heads
             || a->hd < 2 || a->hd % 2 || a->col < 0
             || (a->slots ? a->ld_slots <= a->col || !a->wslot || a->cache_row < a->hd || a->cache_head < a->hd
                          : a->cache_head < a->hd * (a->col + 1) || a->cache_row < a->cache_head * a->kv_heads));
}

/* One decode step's attention (see py_attend), split over `threads`; 0, or -1 when memory ran out */
int attend_run(const Attn *a, int threads, int level) {
    const int64_t group = a->heads / a->kv_heads, per_thread = 2 * (group + 1) * a->hd + group * (a->col + 1);
    /* a thread per ~64K cached values read at least, as for the matrix products */
    const int64_t useful = (a->n * a->kv_heads * (a->col + 1) * a->hd) / 65536 + 1;
    int nt = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (nt > useful) nt = (int)useful;
    float *work = (float *)malloc((size_t)(nt * per_thread) * sizeof(float));
    if (!work) return -1;
    AttnTask task = {a, X86 && level >= AVX2, work, per_thread};
    parallel(attend_part, &task, nt);
    free(work);
    return 0;
}


void rms_norm_run(int level, int xtype, const void *x, const void *w, void *y, int64_t n, int64_t h, float eps) {
#if X86
    if (level >= AVX2) { rms_norm_256(xtype, x, w, y, n, h, eps); return; }
#endif
    (void)level;
    rms_norm_plain(xtype, x, w, y, n, h, eps);
}
