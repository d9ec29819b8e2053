/* The plain read (the limit). Each thread reads its share once with vector loads, summed so none is skipped, as `streams`
 * sequential streams at once (1: one pass front to back; more: the share cut in that many parts
 * read side by side, as a matrix-vector product reads several rows): the bench takes the faster. */
#include "gemv.h"

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


/* Read `bytes` at p once over `threads`; returns the checksum (see py_read). Runs without the GIL. */
uint64_t read_run(const uint8_t *p, int64_t bytes, int threads, int level, int streams) {
    ReadTask task = {p, bytes, streams, level, {0}};
    const int n = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    parallel(read_part, &task, n);
    uint64_t s = 0;
    for (int i = 0; i < MAX_THREADS; i++) s += task.sums[i];
    return s;
}
