/*
 * gpuguard.adapters.nvml._gate: the fast path's quiet gate (docs/design.md, Fast path).
 *
 * Owns one loop, run in the caller's thread with the GIL released: every `interval` seconds
 * on a fixed grid, nvmlDeviceGetCount_v2 and nvmlDeviceGetMemoryInfo of each handle, straight
 * through the function pointers the caller passes (the library nvidia-ml-py loaded), until a
 * read is worth Python's attention. It returns:
 *
 *   MOVED     a device's used memory moved by more than `step` bytes from its baseline
 *   FAILED    a call failed or the GPU count is not `count` (Python's own read reports it)
 *   DUE       the next read would be at or after `until` (a listing is due: returned at that
 *             grid instant without reading)
 *   WOKEN     a word of `flags` is not zero (the enforcer stops, NVML is being released, or a
 *             decision asks for listings): checked before every read
 *
 * Must not: decide anything about pods, keep state between calls, call Python while the GIL is
 * released, or read a handle after FAILED. It replaces only the sleep between two of Python's
 * fast reads: a read that returns here leads to the same Python read a sleep would have.
 *
 * `flags` is a writable buffer of at least 4 int64 words shared with Python (a ctypes array):
 *   [0] closed (set once, never cleared)   [1] release (NVML is being shut down)
 *   [2] wake (the decision changed)        [3] the CLOCK_MONOTONIC nanoseconds at which the
 *   NVML call in flight started, 0 when none: the watchdog's view of a call hung in the driver.
 * Inputs are bounded: at most GATE_MAX_HANDLES handles, an interval of 1 ms to 60 s.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <time.h>

#define GATE_MAX_HANDLES 256
#define GATE_FLAG_WORDS 4

enum { GATE_MOVED = 1, GATE_FAILED = 2, GATE_DUE = 3, GATE_WOKEN = 4 };

typedef struct {
    unsigned long long total, free, used; /* nvmlMemory_t (v1) */
} gate_memory;

typedef int (*count_fn)(unsigned int *);
typedef int (*memory_fn)(void *, gate_memory *);

typedef struct {
    count_fn count;
    memory_fn memory;
    unsigned int expected_count;
    Py_ssize_t n;
    void *handles[GATE_MAX_HANDLES];
    unsigned long long baseline[GATE_MAX_HANDLES];
    unsigned long long step;
    int64_t interval_ns, first_ns, until_ns;
    volatile int64_t *flags;
} gate_plan;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void sleep_until(int64_t at_ns) {
    struct timespec t = {.tv_sec = at_ns / 1000000000LL, .tv_nsec = at_ns % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
    }
}

static int woken(const gate_plan *p) {
    return __atomic_load_n(&p->flags[0], __ATOMIC_ACQUIRE) ||
           __atomic_load_n(&p->flags[1], __ATOMIC_ACQUIRE) ||
           __atomic_load_n(&p->flags[2], __ATOMIC_ACQUIRE);
}

/* One read of every handle: 0 when quiet, else why to return. */
static int read_once(gate_plan *p) {
    unsigned int count = 0;
    gate_memory m;
    int why = 0;
    __atomic_store_n(&p->flags[3], now_ns(), __ATOMIC_RELEASE);
    if (p->count(&count) != 0 || count != p->expected_count) {
        why = GATE_FAILED;
    }
    for (Py_ssize_t i = 0; i < p->n && !why; i++) {
        if (p->memory(p->handles[i], &m) != 0) {
            why = GATE_FAILED;
        } else if ((m.used > p->baseline[i] ? m.used - p->baseline[i]
                                             : p->baseline[i] - m.used) > p->step) {
            why = GATE_MOVED;
        }
    }
    __atomic_store_n(&p->flags[3], 0, __ATOMIC_RELEASE);
    return why;
}

static int run(gate_plan *p, long *reads) {
    int64_t next = p->first_ns;
    for (;;) {
        if (woken(p)) return GATE_WOKEN;
        if (next >= p->until_ns) {
            sleep_until(next);
            return woken(p) ? GATE_WOKEN : GATE_DUE;
        }
        sleep_until(next);
        if (woken(p)) return GATE_WOKEN;
        int why = read_once(p);
        ++*reads;
        if (why) return why;
        next += p->interval_ns;
        int64_t now = now_ns();
        if (next <= now) next = now + p->interval_ns; /* overran: no burst of catch-up reads */
    }
}

static int unsigned_of(PyObject *item, unsigned long long *out, const char *what) {
    *out = PyLong_AsUnsignedLongLong(item);
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "gate: %s must be a non-negative integer", what);
        return -1;
    }
    return 0;
}

static int seconds_to_ns(double seconds, int64_t *out) {
    if (!(seconds >= 0.0 && seconds < 9.0e9)) {
        PyErr_SetString(PyExc_ValueError, "gate: time out of range");
        return -1;
    }
    *out = (int64_t)(seconds * 1e9);
    return 0;
}

static int parse_handles(gate_plan *p, PyObject *handles, PyObject *baseline) {
    PyObject *h = PySequence_Fast(handles, "gate: handles must be a sequence");
    PyObject *b = h ? PySequence_Fast(baseline, "gate: baseline must be a sequence") : NULL;
    int rc = -1;
    if (!h || !b) goto out;
    p->n = PySequence_Fast_GET_SIZE(h);
    if (p->n < 1 || p->n > GATE_MAX_HANDLES || PySequence_Fast_GET_SIZE(b) != p->n) {
        PyErr_Format(PyExc_ValueError, "gate: 1 to %d handles, one baseline each",
                     GATE_MAX_HANDLES);
        goto out;
    }
    for (Py_ssize_t i = 0; i < p->n; i++) {
        unsigned long long address;
        if (unsigned_of(PySequence_Fast_GET_ITEM(h, i), &address, "a handle") < 0) goto out;
        if (address == 0) {
            PyErr_SetString(PyExc_ValueError, "gate: a handle is NULL");
            goto out;
        }
        p->handles[i] = (void *)(uintptr_t)address;
        if (unsigned_of(PySequence_Fast_GET_ITEM(b, i), &p->baseline[i], "a baseline") < 0)
            goto out;
    }
    rc = 0;
out:
    Py_XDECREF(h);
    Py_XDECREF(b);
    return rc;
}

PyDoc_STRVAR(wait_doc,
"wait(count_fn, memory_fn, handles, count, baseline, step, interval, first, until, flags)\n"
"--\n\n"
"Read memory every `interval` seconds from CLOCK_MONOTONIC `first` on, with the GIL\n"
"released, until a device moved more than `step` bytes from `baseline`, a call failed or\n"
"the count is not `count`, the next read falls at or after `until`, or a flag is set.\n"
"Returns (why, reads): why is MOVED, FAILED, DUE or WOKEN.");

static PyObject *gate_wait(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long count_address, memory_address, step;
    unsigned int expected;
    PyObject *handles, *baseline;
    double interval, first, until;
    Py_buffer flags;
    if (!PyArg_ParseTuple(args, "KKOIOKdddw*", &count_address, &memory_address, &handles,
                          &expected, &baseline, &step, &interval, &first, &until, &flags)) {
        return NULL;
    }
    gate_plan plan = {0};
    PyObject *result = NULL;
    if (count_address == 0 || memory_address == 0) {
        PyErr_SetString(PyExc_ValueError, "gate: an NVML function is NULL");
        goto out;
    }
    if (flags.len < (Py_ssize_t)(GATE_FLAG_WORDS * sizeof(int64_t)) ||
        ((uintptr_t)flags.buf % sizeof(int64_t)) != 0) {
        PyErr_SetString(PyExc_ValueError, "gate: flags must be 4 aligned int64 words");
        goto out;
    }
    if (!(interval >= 0.001 && interval <= 60.0)) {
        PyErr_SetString(PyExc_ValueError, "gate: interval must be 0.001 to 60 seconds");
        goto out;
    }
    if (parse_handles(&plan, handles, baseline) < 0 ||
        seconds_to_ns(first, &plan.first_ns) < 0 || seconds_to_ns(until, &plan.until_ns) < 0) {
        goto out;
    }
    plan.count = (count_fn)(uintptr_t)count_address;
    plan.memory = (memory_fn)(uintptr_t)memory_address;
    plan.expected_count = expected;
    plan.step = step;
    plan.interval_ns = (int64_t)(interval * 1e9);
    plan.flags = (volatile int64_t *)flags.buf;
    long reads = 0;
    int why;
    Py_BEGIN_ALLOW_THREADS
    why = run(&plan, &reads);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(il)", why, reads);
out:
    PyBuffer_Release(&flags);
    return result;
}

static PyMethodDef gate_methods[] = {
    {"wait", gate_wait, METH_VARARGS, wait_doc},
    {NULL, NULL, 0, NULL},
};

static int gate_exec(PyObject *module) {
    if (PyModule_AddIntConstant(module, "MOVED", GATE_MOVED) < 0 ||
        PyModule_AddIntConstant(module, "FAILED", GATE_FAILED) < 0 ||
        PyModule_AddIntConstant(module, "DUE", GATE_DUE) < 0 ||
        PyModule_AddIntConstant(module, "WOKEN", GATE_WOKEN) < 0 ||
        PyModule_AddIntConstant(module, "MAX_HANDLES", GATE_MAX_HANDLES) < 0 ||
        PyModule_AddIntConstant(module, "FLAG_WORDS", GATE_FLAG_WORDS) < 0) {
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot gate_slots[] = {
    {Py_mod_exec, gate_exec},
    {0, NULL},
};

static struct PyModuleDef gate_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gpuguard.adapters.nvml._gate",
    .m_doc = "The fast path's quiet gate: memory reads in C until one matters "
             "(docs/design.md, Fast path).",
    .m_size = 0,
    .m_methods = gate_methods,
    .m_slots = gate_slots,
};

PyMODINIT_FUNC PyInit__gate(void) { return PyModuleDef_Init(&gate_module); }
