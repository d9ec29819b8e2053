/* The shared-memory all-reduce. One round of shm.ShmGroup.all_reduce in one call: this rank's part into its slot of the round's
 * slot set, then the round number published (a release store, after the slot), then every peer's
 * awaited (acquire loads; the GIL released; a sched_yield now and then for a peer that shares this
 * core), then the parts added in rank order in float32 into t: the same bits on every rank.
 * Returns the first peer that missed the timeout, or -1. */
#include "gemv.h"

double monotonic_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int shm_round(int xtype, void *t, int64_t numel, char *slots, int64_t slot_bytes, int64_t *flag,
                     int64_t flag_stride, int size, int rank, int64_t round, double timeout) {
    const int64_t esize = xtype == X_F32 ? 4 : 2;
    int missed = -1;
    char *set = slots + (round % 2) * size * slot_bytes;
    memcpy(set + rank * slot_bytes, t, (size_t)(numel * esize));
    __atomic_store_n(flag + rank * flag_stride, round, __ATOMIC_RELEASE);
    for (int p = 0; p < size && missed < 0; p++) {
        uint64_t spins = 0;
        double deadline = 0.0;
        while (__atomic_load_n(flag + p * flag_stride, __ATOMIC_ACQUIRE) < round) {
            relax();
            if (++spins % 1024 == 0) {
                sched_yield();
                const double now = monotonic_seconds();
                if (deadline == 0.0) deadline = now + timeout;
                else if (now > deadline) { missed = p; break; }
            }
        }
    }
    for (int64_t i = 0; missed < 0 && i < numel; i++) {
        float sum = load1(xtype, set, i);
        for (int p = 1; p < size; p++) sum += load1(xtype, set + p * slot_bytes, i);
        store1(xtype, t, i, sum);
    }
    return missed;
}
