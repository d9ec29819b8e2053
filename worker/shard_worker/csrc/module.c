/* The Python module `shard_worker._gemv`: each function checks its arguments, releases the GIL
 * and calls the job's C function (the pointers come from torch tensors' data_ptr()). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gemv.h"
#include "layer.h"

#define PTR(v) ((void *)(uintptr_t)(v))
static const char *LEVEL_NAMES[LEVELS] = {"portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"};

static PyObject *py_linear(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long w, scale, x, y;
    int wtype, xtype, threads, level;
    long long n, k, ldw, m, ldx, ldy;
    if (!PyArg_ParseTuple(args, "iiKKKKLLLLLLii", &wtype, &xtype, &w, &scale, &x, &y, &n, &k, &ldw, &m, &ldx, &ldy,
                          &threads, &level))
        return NULL;
    if (!gemv_valid(wtype, xtype, (const void *)(uintptr_t)scale, n, k, ldw, m, ldx, ldy)) {
        PyErr_SetString(PyExc_ValueError, "linear: unsupported dtypes or shape");
        return NULL;
    }
    if (level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_Format(PyExc_ValueError, "linear: this CPU cannot run kernel level %d", level);
        return NULL;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = gemv_run(wtype, xtype, (const void *)(uintptr_t)w, (const void *)(uintptr_t)scale,
                      (const void *)(uintptr_t)x, (void *)(uintptr_t)y, n, k, ldw, m, ldx, ldy, threads, level);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, q, s;
    int xtype, level;
    long long k, m, ldx;
    if (!PyArg_ParseTuple(args, "iKKKLLLi", &xtype, &x, &q, &s, &k, &m, &ldx, &level)) return NULL;
    if (xtype < X_F32 || xtype > X_BF16 || m < 1 || k < 1 || ldx < k || level < 0 || level >= LEVELS
        || !supported[level]) {
        PyErr_SetString(PyExc_ValueError, "quantize: unsupported dtype, shape or level");
        return NULL;
    }
    Job job = {.wtype = W_I8, .xtype = xtype, .x = (const void *)(uintptr_t)x, .k = k, .m = m, .ldx = ldx};
    job.nblk = (k + QBLOCK - 1) / QBLOCK;
    job.kpad = job.nblk * QBLOCK;
    Py_BEGIN_ALLOW_THREADS
    quantize_with(level, &job, (int16_t *)(uintptr_t)q, (float *)(uintptr_t)s);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
static PyObject *py_attend(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long qkv, cs, sn, kc, vc, first, out, slots, wslot, cols = 0, srow = 0;
    int xtype, threads, level;
    long long n, heads, kv_heads, hd, cache_row, cache_head, col, ld_slots;
    double scale;
    if (!PyArg_ParseTuple(args, "iKKKKKKKLLLLLLLKLKdii|KK", &xtype, &qkv, &cs, &sn, &kc, &vc, &first, &out, &n,
                          &heads, &kv_heads, &hd, &cache_row, &cache_head, &col, &slots, &ld_slots, &wslot, &scale,
                          &threads, &level, &cols, &srow))
        return NULL;
    Attn a = {.xtype = xtype, .qkv = PTR(qkv), .cos = PTR(cs), .sin = PTR(sn), .kc = PTR(kc), .vc = PTR(vc),
              .cache_row = cache_row, .cache_head = cache_head, .first = (const int64_t *)PTR(first), .col = col,
              .cols = (const int64_t *)PTR(cols), .srow = (const int64_t *)PTR(srow),
              .slots = (const int64_t *)PTR(slots), .ld_slots = ld_slots, .wslot = (const int64_t *)PTR(wslot),
              .out = PTR(out), .n = n, .heads = heads, .kv_heads = kv_heads, .hd = hd, .scale = (float)scale};
    if (!attend_valid(&a, n) || level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_SetString(PyExc_ValueError, "attend: unsupported dtype, shape or level");
        return NULL;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = attend_run(&a, threads, level);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, y;
    int xtype, level;
    long long n, h;
    double eps;
    if (!PyArg_ParseTuple(args, "iKKKLLdi", &xtype, &x, &w, &y, &n, &h, &eps, &level)) return NULL;
    if (xtype < X_F32 || xtype > X_BF16 || n < 1 || h < 1 || level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: unsupported dtype, shape or level");
        return NULL;
    }
    rms_norm_run(level, xtype, (const void *)(uintptr_t)x, (const void *)(uintptr_t)w, (void *)(uintptr_t)y, n, h,
                 (float)eps);
    Py_RETURN_NONE;
}

static PyObject *py_shm_all_reduce(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long t, slots, flags;
    int xtype, size, rank;
    long long numel, slot_bytes, flag_stride, round;
    double timeout;
    if (!PyArg_ParseTuple(args, "iKLKLKLiiLd", &xtype, &t, &numel, &slots, &slot_bytes, &flags, &flag_stride, &size,
                          &rank, &round, &timeout))
        return NULL;
    const int64_t esize = xtype == X_F32 ? 4 : 2;
    if (xtype < X_F32 || xtype > X_BF16 || numel < 0 || numel * esize > slot_bytes || size < 1 || rank < 0
        || rank >= size || flag_stride < 1 || round < 1) {
        PyErr_SetString(PyExc_ValueError, "shm_all_reduce: unsupported dtype, size or rank");
        return NULL;
    }
    int missed;
    Py_BEGIN_ALLOW_THREADS
    missed = shm_round(xtype, (void *)(uintptr_t)t, numel, (char *)(uintptr_t)slots, slot_bytes,
                       (int64_t *)(uintptr_t)flags, flag_stride, size, rank, round, timeout);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(missed);
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long gu, out;
    int xtype, level;
    long long n, inter;
    if (!PyArg_ParseTuple(args, "iKKLLi", &xtype, &gu, &out, &n, &inter, &level)) return NULL;
    if (xtype < X_F32 || xtype > X_BF16 || n < 0 || inter < 1 || level < 0 || level >= LEVELS || !supported[level]) {
        PyErr_SetString(PyExc_ValueError, "silu_mul: unsupported dtype, shape or level");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_run(level, xtype, (const void *)(uintptr_t)gu, (void *)(uintptr_t)out, n, inter);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static int plan_from(PyObject *obj, LayerPlan *plan) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return -1;
    const int ok = view.len == (Py_ssize_t)sizeof *plan;
    if (ok) memcpy(plan, view.buf, sizeof *plan);
    PyBuffer_Release(&view);
    if (!ok) PyErr_SetString(PyExc_ValueError, "layer plan: not the size of a LayerPlan (fused.LayerPlan mirrors it)");
    return ok ? 0 : -1;
}

static PyObject *py_layer_problem(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    LayerPlan plan;
    if (!PyArg_ParseTuple(args, "O", &obj) || plan_from(obj, &plan) < 0) return NULL;
    const char *problem = layer_problem(&plan);
    if (problem) return PyUnicode_FromString(problem);
    Py_RETURN_NONE;
}

static PyObject *py_decode_layer(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    unsigned long long x, first, cos, sin, slots, wslot, cols, srow, ends;
    long long n, col, r0, round, ld_slots;
    int threads, level, groups;
    LayerPlan p;
    if (!PyArg_ParseTuple(args, "OKLLKKKKLKLKKKiiiL", &obj, &x, &n, &col, &cols, &first, &cos, &sin, &r0, &slots,
                          &ld_slots, &srow, &wslot, &ends, &groups, &threads, &level, &round)
        || plan_from(obj, &p) < 0)
        return NULL;
    const int paged = slots != 0;  /* then the plan's cache is a pool of slots, and the slots say where rows are */
    const Attn a = {.xtype = (int)p.xtype, .first = (const int64_t *)PTR(first), .col = col,
                    .cols = (const int64_t *)PTR(cols), .srow = (const int64_t *)PTR(srow),
                    .slots = (const int64_t *)PTR(slots), .ld_slots = ld_slots, .wslot = (const int64_t *)PTR(wslot),
                    .cache_row = p.cache_row, .cache_head = p.cache_head,
                    .n = n, .heads = p.heads, .kv_heads = p.kv_heads, .hd = p.head_dim};
    if (n < 1 || n > MAX_TOKENS || r0 < 0 || col < 0 || level < 0 || level >= LEVELS || !supported[level]
        || layer_problem(&p) || (paged ? !wslot : r0 + n > p.cache_rows || col >= p.cache_len || cols || srow)
        || !attend_valid(&a, n) || (ends && !groups_valid((const int64_t *)PTR(ends), groups, n))
        || (p.shm_size > 1 && n * p.hidden * (p.xtype ? 2 : 4) > p.shm_slot_bytes)) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: unsupported tokens, columns, groups, level or plan");
        return NULL;
    }
    const LayerStep step = {.n = n, .col = col, .cols = a.cols, .first = a.first, .cos = PTR(cos), .sin = PTR(sin),
                            .r0 = r0, .slots = a.slots, .ld_slots = ld_slots, .srow = a.srow, .wslot = a.wslot,
                            .ends = (const int64_t *)PTR(ends), .groups = groups};
    int64_t rounds = round;
    double comm = 0.0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = layer_run(&p, PTR(x), &step, threads, level, &rounds, &comm);
    Py_END_ALLOW_THREADS
    if (status < 0) return PyErr_NoMemory();
    return Py_BuildValue("(id)", status - 1, comm);
}

static PyObject *py_read(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long p;
    long long bytes;
    int threads, level, streams;
    if (!PyArg_ParseTuple(args, "KLiii", &p, &bytes, &threads, &level, &streams)) return NULL;
    if (level < 0 || level >= LEVELS || !supported[level] || bytes < 0 || streams < 1 || streams > MAX_STREAMS) {
        PyErr_SetString(PyExc_ValueError, "read: bad level, size or streams");
        return NULL;
    }
    uint64_t s;
    Py_BEGIN_ALLOW_THREADS
    s = read_run((const uint8_t *)(uintptr_t)p, bytes, threads, level, streams);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(s);
}

static PyObject *py_levels(PyObject *self, PyObject *args) {
    (void)self; (void)args;
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < LEVELS; i++) {
        if (!supported[i]) continue;
        PyObject *name = PyUnicode_FromString(LEVEL_NAMES[i]);
        if (!name || PyList_Append(out, name) < 0) { Py_XDECREF(name); Py_DECREF(out); return NULL; }
        Py_DECREF(name);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"linear", py_linear, METH_VARARGS,
     "linear(wtype, xtype, w, scale, x, y, n, k, m, ldx, ldy, threads, level): y = x W^T (* scale), by pointers"},
    {"attend", py_attend, METH_VARARGS,
     "attend(xtype, qkv, cos, sin, k_cache, v_cache, first, out, n, heads, kv_heads, head_dim, cache_row, cache_head, "
     "col, slots, ld_slots, wslot, scale, threads, level[, cols, srow]): a step's attention (rope, cache write, "
     "softmax(q k / scale) v); slots 0: a contiguous cache, else a paged pool read through each row's slots; cols: "
     "each token's column (a chunk's), srow: each token's row of slots"},
    {"shm_all_reduce", py_shm_all_reduce, METH_VARARGS,
     "shm_all_reduce(xtype, t, numel, slots, slot_bytes, flags, flag_stride, size, rank, round, timeout) -> peer "
     "that missed the timeout or -1: one round of shm.ShmGroup.all_reduce"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(xtype, x, w, y, n, h, eps, level): y = x / rms(x) * w, HF's way"},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(xtype, x, q, s, k, m, ldx, level): x's rows as int8 weights meet them: int16 q [m, kpad], scales s [m, nblk]"},
    {"read", py_read, METH_VARARGS,
     "read(pointer, nbytes, threads, level, streams) -> checksum: read the bytes once (the sum of their 8-byte words)"},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(xtype, gate_up, out, n, inter, level): out = silu(gate) * up for rows [n, 2 inter] = (gate | up)"},
    {"layer_problem", py_layer_problem, METH_VARARGS, "layer_problem(plan) -> what is wrong with a layer plan, or None"},
    {"decode_layer", py_decode_layer, METH_VARARGS,
     "decode_layer(plan, x, n, col, cols, first, cos, sin, r0, slots, ld_slots, srow, wslot, ends, groups, threads, "
     "level, round) -> (peer that missed an all-reduce or -1, seconds in all-reduces): a decoder layer's step for n "
     "tokens (decode rows and chunk tokens), x updated in place"},
    {"levels", py_levels, METH_NOARGS, "the kernel levels this CPU runs, slowest first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gemv", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__gemv(void) {
    detect();
    pthread_atfork(NULL, NULL, forget_workers);
    PyObject *mod = PyModule_Create(&module);
    if (mod && (PyModule_AddIntConstant(mod, "QBLOCK", QBLOCK) < 0
                || PyModule_AddIntConstant(mod, "MAX_TOKENS", MAX_TOKENS) < 0
                || PyModule_AddIntConstant(mod, "LAYER_PLAN_SIZE", (long)sizeof(LayerPlan)) < 0))
        Py_CLEAR(mod);
    return mod;
}
