/* The thread pool: persistent workers that spin briefly for the next job, then sleep; the caller
 * is thread 0. */
#include "gemv.h"

#define SPINS 4000  /* a worker polls this long for the next job (decode calls come back to back) */

typedef struct {
    pthread_mutex_t call;  /* one job at a time */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    int started;                    /* worker threads running (thread 0 is the caller) */
    volatile uint64_t generation;   /* bumped for each job */
    volatile int remaining;         /* workers still on the current job */
    int active;                     /* threads taking part in the current job */
    void (*task)(void *, int, int);
    void *arg;
} Pool;

static Pool pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                    PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL};

static void *worker_main(void *p) {
    const int id = (int)(intptr_t)p;
    uint64_t seen = 0;
    for (;;) {
        int spins = 0;
        while (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen && spins < SPINS) { relax(); spins++; }
        if (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen) {
            pthread_mutex_lock(&pool.mu);
            while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        if (id < pool.active) {
            pool.task(pool.arg, id, pool.active);
            if (__atomic_sub_fetch(&pool.remaining, 1, __ATOMIC_ACQ_REL) == 0) {
                pthread_mutex_lock(&pool.mu);
                pthread_cond_signal(&pool.done);
                pthread_mutex_unlock(&pool.mu);
            }
        }
    }
    return NULL;
}

/* A forked child has none of its parent's workers: it starts its own when it needs them. */
void forget_workers(void) {
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.generation = 0;
    pool.remaining = 0;
}

/* Run task(arg, i, n) for i in [0, n) on n threads, the caller being thread 0. */
void parallel(void (*task)(void *, int, int), void *arg, int n) {
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&pool.call);
    while (pool.started < n - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(pool.started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.started++;
    }
    if (n > pool.started + 1) n = pool.started + 1;
    if (n > 1) {
        pool.task = task;
        pool.arg = arg;
        pool.active = n;
        __atomic_store_n(&pool.remaining, n - 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&pool.mu);
        __atomic_add_fetch(&pool.generation, 1, __ATOMIC_ACQ_REL);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
    }
    task(arg, 0, n);
    if (n > 1) {
        int spins = 0;
        while (__atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE) && spins < SPINS) { relax(); spins++; }
        pthread_mutex_lock(&pool.mu);
        while (__atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE)) pthread_cond_wait(&pool.done, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
    }
    pthread_mutex_unlock(&pool.call);
}
