/*
 * gpuguard.adapters.allocguard._loader: the user side of the eBPF allocation guard over libbpf
 * (guard.bpf.c is the kernel side).
 *
 * Owns one loaded guard: opening and loading the compiled BPF object, attaching its uprobes to
 * the allocation and free entry points of one library file, the headroom and count maps' reads
 * and writes, and draining the event ring buffer. Why a C extension over libbpf and not a Python
 * library: libbpf is the kernel's own loader (CO-RE relocation against /sys/kernel/btf/vmlinux,
 * uprobes by symbol name, ring buffers), linked statically so nothing new is needed at run time
 * but libelf and zlib; the Python options on PyPI either carry LLVM into the process and compile
 * at run time (bcc) or are thin, little-kept wrappers. Same shape as the quiet gate
 * (gpuguard/adapters/nvml/_gate.c).
 *
 * Must not: decide anything, signal anything (the BPF program stops; the enforcer decides and
 * resumes), or call Python while the GIL is released (poll copies raw events into a bounded
 * buffer first).
 *
 * Guard(object_path, library_path) -> loaded and attached, or OSError with libbpf's errno.
 *   set_headroom(cgroup_id, device, bytes)   the cgroup is guarded with that headroom
 *   clear_headroom(cgroup_id, device)        not guarded any more (absent is no guard)
 *   reset(cgroup_id, device)                 the count since the last listing back to 0
 *   allocated(cgroup_id, device) -> int|None the count (None: nothing counted since the reset)
 *   poll(timeout_ms) -> list of (pid, tgid, cgroup_id, size, allocated, headroom, entry, device)
 *   map_ids() -> {name: id}                 the kernel's id of each map (for the privilege test)
 *   close()                                  detach everything (also on garbage collection)
 *   forget(tgid) -> int                      mark that process's recorded stops as the
 *                                            enforcer's (the thawer leaves them while it lives)
 *   frozen_fd                                the `frozen` map's fd (close-on-exec, as every bpf
 *                                            fd: the guard passes it to the thawer explicitly)
 * Module functions on a `frozen` map fd, for the thawer (a process without the guard object,
 * so that it holds no probe link): frozen_entries(fd) -> list of (tgid, tid, stopped_ns,
 * start_boottime_ns, cgroup_id, owned); frozen_delete(fd, tgid, tid, stopped_ns) -> bool (False:
 * gone already); frozen_insert(fd, tgid, tid, stopped_ns, start_boottime_ns, cgroup_id) for the
 * tests' crafted entries (a stale pid's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#define EVENTS_PER_POLL 256
#define FROZEN_MAX_ENTRIES 16384 /* `frozen`'s max_entries in guard.bpf.c */

struct guard_key {
    uint64_t cgroup_id;
    uint32_t device;
    uint32_t pad;
};

struct frozen_key {
    uint32_t tgid;
    uint32_t tid;
    uint64_t stopped_ns;
};

struct frozen_value {
    uint64_t start_boottime_ns;
    uint64_t cgroup_id;
    uint32_t owned;
    uint32_t pad;
};

struct guard_event {
    uint32_t pid;
    uint32_t tgid;
    uint64_t cgroup_id;
    uint64_t size;
    int64_t allocated_bytes;
    int64_t headroom_bytes;
    uint32_t entry;
    uint32_t device;
};

/* program name in guard.bpf.c, the symbol it attaches to, whether on return, and whether the
 * symbol may be missing (entry points newer drivers added: an older libcuda lacks them) */
static const struct {
    const char *program, *symbol;
    int retprobe, optional;
} PROBES[] = {
    {"mem_alloc", "cuMemAlloc_v2", 0, 0},
    {"mem_create", "cuMemCreate", 0, 0},
    {"mem_alloc_managed", "cuMemAllocManaged", 0, 0},
    {"mem_alloc_pitch", "cuMemAllocPitch_v2", 0, 0},
    {"mem_alloc_async", "cuMemAllocAsync", 0, 0},
    {"alloc_return", "cuMemAlloc_v2", 1, 0},
    {"alloc_return", "cuMemCreate", 1, 0},
    {"alloc_return", "cuMemAllocManaged", 1, 0},
    {"alloc_return", "cuMemAllocPitch_v2", 1, 0},
    {"alloc_return", "cuMemAllocAsync", 1, 0},
    {"mem_free", "cuMemFree_v2", 0, 0},
    {"mem_free", "cuMemFreeAsync", 0, 0},
    {"mem_release", "cuMemRelease", 0, 0},
    /* the stream-ordered entry points' per-thread-default-stream twins (cuda.h's
     * CUDA_API_PER_THREAD_DEFAULT_STREAM) */
    {"mem_alloc_async", "cuMemAllocAsync_ptsz", 0, 1},
    {"alloc_return", "cuMemAllocAsync_ptsz", 1, 1},
    {"mem_free", "cuMemFreeAsync_ptsz", 0, 1},
    {"mem_alloc_from_pool_async", "cuMemAllocFromPoolAsync_ptsz", 0, 1},
    {"alloc_return", "cuMemAllocFromPoolAsync_ptsz", 1, 1},
    /* pools, arrays, mipmapped arrays */
    {"mem_alloc_from_pool_async", "cuMemAllocFromPoolAsync", 0, 0},
    {"alloc_return", "cuMemAllocFromPoolAsync", 1, 0},
    {"array_create", "cuArrayCreate_v2", 0, 0},
    {"alloc_return", "cuArrayCreate_v2", 1, 0},
    {"array_3d_create", "cuArray3DCreate_v2", 0, 0},
    {"alloc_return", "cuArray3DCreate_v2", 1, 0},
    {"mipmapped_array_create", "cuMipmappedArrayCreate", 0, 0},
    {"alloc_return", "cuMipmappedArrayCreate", 1, 0},
    {"array_destroy", "cuArrayDestroy", 0, 0},
    {"mipmapped_array_destroy", "cuMipmappedArrayDestroy", 0, 0},
    /* devices: contexts, pools and streams */
    {"ctx_create_v2", "cuCtxCreate_v2", 0, 0},
    {"handle_return", "cuCtxCreate_v2", 1, 0},
    {"ctx_create_v3", "cuCtxCreate_v3", 0, 1},
    {"handle_return", "cuCtxCreate_v3", 1, 1},
    {"ctx_create_v4", "cuCtxCreate_v4", 0, 1},
    {"handle_return", "cuCtxCreate_v4", 1, 1},
    {"primary_ctx_retain", "cuDevicePrimaryCtxRetain", 0, 0},
    {"handle_return", "cuDevicePrimaryCtxRetain", 1, 0},
    {"ctx_set_current", "cuCtxSetCurrent", 0, 0},
    {"ctx_push_current", "cuCtxPushCurrent_v2", 0, 0},
    {"ctx_pop_current", "cuCtxPopCurrent_v2", 0, 0},
    {"ctx_destroy", "cuCtxDestroy_v2", 0, 0},
    {"mem_pool_create", "cuMemPoolCreate", 0, 0},
    {"handle_return", "cuMemPoolCreate", 1, 0},
    {"device_mem_pool", "cuDeviceGetDefaultMemPool", 0, 0},
    {"handle_return", "cuDeviceGetDefaultMemPool", 1, 0},
    {"device_mem_pool", "cuDeviceGetMemPool", 0, 0},
    {"handle_return", "cuDeviceGetMemPool", 1, 0},
    {"stream_create", "cuStreamCreate", 0, 0},
    {"handle_return", "cuStreamCreate", 1, 0},
    {"stream_create", "cuStreamCreateWithPriority", 0, 0},
    {"handle_return", "cuStreamCreateWithPriority", 1, 0},
};
#define N_PROBES (sizeof(PROBES) / sizeof(PROBES[0]))

typedef struct {
    PyObject_HEAD
    struct bpf_object *obj;
    struct bpf_link *links[N_PROBES];
    struct bpf_link *exit_link; /* sched_process_exit: what an exiting process held */
    struct ring_buffer *rb;
    int headroom_fd, allocated_fd;
    int frozen_fd;
    struct guard_event buffered[EVENTS_PER_POLL];
    int n_buffered;
    long long dropped;
} Guard;

static void guard_release(Guard *g) {
    if (g->rb) ring_buffer__free(g->rb);
    g->rb = NULL;
    if (g->exit_link) bpf_link__destroy(g->exit_link);
    g->exit_link = NULL;
    for (size_t i = 0; i < N_PROBES; i++) {
        if (g->links[i]) bpf_link__destroy(g->links[i]);
        g->links[i] = NULL;
    }
    if (g->obj) bpf_object__close(g->obj);
    g->obj = NULL;
}

static int on_event(void *ctx, void *data, size_t size) {
    Guard *g = ctx;
    if (size < sizeof(struct guard_event)) return 0;
    if (g->n_buffered >= EVENTS_PER_POLL) {
        g->dropped++; /* the next poll would have them; bounded memory first */
        return 0;
    }
    memcpy(&g->buffered[g->n_buffered++], data, sizeof(struct guard_event));
    return 0;
}

static PyObject *errno_error(int err, const char *what) {
    errno = err < 0 ? -err : err;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError, what);
}

static int Guard_init(Guard *g, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"object_path", "library_path", NULL};
    const char *object_path, *library_path;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ss", kwlist, &object_path, &library_path))
        return -1;
    guard_release(g);
    g->obj = bpf_object__open_file(object_path, NULL);
    int err = libbpf_get_error(g->obj);
    if (err) {
        g->obj = NULL;
        errno_error(err, object_path);
        return -1;
    }
    err = bpf_object__load(g->obj);
    if (err) {
        guard_release(g);
        errno_error(err, "bpf_object__load");
        return -1;
    }
    for (size_t i = 0; i < N_PROBES; i++) {
        struct bpf_program *prog = bpf_object__find_program_by_name(g->obj, PROBES[i].program);
        if (!prog) {
            guard_release(g);
            errno_error(ENOENT, PROBES[i].program);
            return -1;
        }
        LIBBPF_OPTS(bpf_uprobe_opts, opts, .func_name = PROBES[i].symbol,
                    .retprobe = PROBES[i].retprobe != 0);
        /* pid -1: every process that maps this file (the probe is on the inode). */
        g->links[i] = bpf_program__attach_uprobe_opts(prog, -1, library_path, 0, &opts);
        err = libbpf_get_error(g->links[i]);
        if (err && PROBES[i].optional && err == -ENOENT) {
            g->links[i] = NULL; /* this library has no such entry point */
            continue;
        }
        if (err) {
            g->links[i] = NULL;
            guard_release(g);
            errno_error(err, PROBES[i].symbol);
            return -1;
        }
    }
    struct bpf_program *exit_prog = bpf_object__find_program_by_name(g->obj, "process_exit");
    g->exit_link = exit_prog ? bpf_program__attach(exit_prog) : NULL;
    err = exit_prog ? libbpf_get_error(g->exit_link) : -ENOENT;
    if (err) {
        g->exit_link = NULL;
        guard_release(g);
        errno_error(err, "sched_process_exit");
        return -1;
    }
    g->headroom_fd = bpf_object__find_map_fd_by_name(g->obj, "headroom");
    g->allocated_fd = bpf_object__find_map_fd_by_name(g->obj, "allocated");
    g->frozen_fd = bpf_object__find_map_fd_by_name(g->obj, "frozen");
    int events_fd = bpf_object__find_map_fd_by_name(g->obj, "events");
    if (g->headroom_fd < 0 || g->allocated_fd < 0 || g->frozen_fd < 0 || events_fd < 0) {
        guard_release(g);
        errno_error(ENOENT, "maps");
        return -1;
    }
    g->rb = ring_buffer__new(events_fd, on_event, g, NULL);
    if (!g->rb) {
        int e = errno;
        guard_release(g);
        errno_error(e, "ring_buffer__new");
        return -1;
    }
    return 0;
}

static void Guard_dealloc(Guard *g) {
    guard_release(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static int guard_open(Guard *g) {
    if (g->obj) return 1;
    PyErr_SetString(PyExc_ValueError, "the guard is closed");
    return 0;
}

static int parse_key(PyObject *args, struct guard_key *key, long long *bytes) {
    unsigned long long cgroup_id;
    unsigned int device;
    memset(key, 0, sizeof(*key));
    if (bytes) {
        if (!PyArg_ParseTuple(args, "KIL", &cgroup_id, &device, bytes)) return 0;
    } else if (!PyArg_ParseTuple(args, "KI", &cgroup_id, &device)) {
        return 0;
    }
    key->cgroup_id = cgroup_id;
    key->device = device;
    return 1;
}

static PyObject *Guard_set_headroom(Guard *g, PyObject *args) {
    struct guard_key key;
    long long bytes;
    if (!guard_open(g) || !parse_key(args, &key, &bytes)) return NULL;
    int64_t value = bytes;
    if (bpf_map_update_elem(g->headroom_fd, &key, &value, BPF_ANY))
        return errno_error(errno, "headroom");
    Py_RETURN_NONE;
}

static PyObject *Guard_clear_headroom(Guard *g, PyObject *args) {
    struct guard_key key;
    if (!guard_open(g) || !parse_key(args, &key, NULL)) return NULL;
    if (bpf_map_delete_elem(g->headroom_fd, &key) && errno != ENOENT)
        return errno_error(errno, "headroom");
    Py_RETURN_NONE;
}

static PyObject *Guard_reset(Guard *g, PyObject *args) {
    struct guard_key key;
    if (!guard_open(g) || !parse_key(args, &key, NULL)) return NULL;
    int64_t zero = 0;
    if (bpf_map_update_elem(g->allocated_fd, &key, &zero, BPF_ANY))
        return errno_error(errno, "allocated");
    Py_RETURN_NONE;
}

static PyObject *Guard_allocated(Guard *g, PyObject *args) {
    struct guard_key key;
    if (!guard_open(g) || !parse_key(args, &key, NULL)) return NULL;
    int64_t value;
    if (bpf_map_lookup_elem(g->allocated_fd, &key, &value)) {
        if (errno == ENOENT) Py_RETURN_NONE;
        return errno_error(errno, "allocated");
    }
    return PyLong_FromLongLong(value);
}

static PyObject *Guard_poll(Guard *g, PyObject *args) {
    int timeout_ms;
    if (!guard_open(g) || !PyArg_ParseTuple(args, "i", &timeout_ms)) return NULL;
    if (timeout_ms < 0 || timeout_ms > 60000) {
        PyErr_SetString(PyExc_ValueError, "timeout_ms must be 0..60000");
        return NULL;
    }
    int rc;
    g->n_buffered = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = ring_buffer__poll(g->rb, timeout_ms);
    Py_END_ALLOW_THREADS
    if (rc < 0 && rc != -EINTR) return errno_error(rc, "ring_buffer__poll");
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int i = 0; i < g->n_buffered; i++) {
        const struct guard_event *e = &g->buffered[i];
        PyObject *t = Py_BuildValue("(IIKKLLII)", e->pid, e->tgid, (unsigned long long)e->cgroup_id,
                                    (unsigned long long)e->size, (long long)e->allocated_bytes,
                                    (long long)e->headroom_bytes, e->entry, e->device);
        if (!t || PyList_Append(out, t)) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(t);
    }
    return out;
}

/* ---- the freezes' bound: the `frozen` map (guard.bpf.c says what an entry is) ---- */

/* The keys of `frozen` into *keys (PyMem, the caller frees it; grown as needed: the thawer
 * walks the map 20 times a second, mostly empty), at most FROZEN_MAX_ENTRIES: a walk that
 * entries vanish under (a hash map's next key after a deleted one starts over) still ends.
 * Returns the count, or -errno with *keys NULL. */
static int frozen_keys(int fd, struct frozen_key **keys) {
    struct frozen_key cur, next;
    int n = 0, room = 0, err = 0;
    void *prev = NULL;
    *keys = NULL;
    while (n < FROZEN_MAX_ENTRIES) {
        if (bpf_map_get_next_key(fd, prev, &next)) {
            if (errno != ENOENT) err = -errno;
            break;
        }
        if (n == room) {
            room = room ? room * 2 : 16;
            struct frozen_key *grown = PyMem_Realloc(*keys, sizeof(**keys) * room);
            if (!grown) {
                err = -ENOMEM;
                break;
            }
            *keys = grown;
        }
        (*keys)[n++] = next;
        cur = next;
        prev = &cur;
    }
    if (err) {
        PyMem_Free(*keys);
        *keys = NULL;
        return err;
    }
    return n;
}

static PyObject *Guard_forget(Guard *g, PyObject *args) {
    unsigned int tgid;
    if (!guard_open(g) || !PyArg_ParseTuple(args, "I", &tgid)) return NULL;
    struct frozen_key *keys;
    int n = frozen_keys(g->frozen_fd, &keys), marked = 0;
    for (int i = 0; i < n; i++) {
        struct frozen_value v;
        if (keys[i].tgid != tgid || bpf_map_lookup_elem(g->frozen_fd, &keys[i], &v)) continue;
        v.owned = 1;
        /* BPF_EXIST: an entry removed meanwhile (its thread returned, the thawer resumed it)
         * is not written back. */
        if (bpf_map_update_elem(g->frozen_fd, &keys[i], &v, BPF_EXIST) == 0) marked++;
    }
    PyMem_Free(keys);
    if (n < 0) return errno_error(n, "frozen");
    return PyLong_FromLong(marked);
}

static PyObject *Guard_frozen_fd(Guard *g, void *Py_UNUSED(closure)) {
    if (!guard_open(g)) return NULL;
    return PyLong_FromLong(g->frozen_fd);
}

static PyObject *frozen_entries(PyObject *Py_UNUSED(module), PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    struct frozen_key *keys;
    int n = frozen_keys(fd, &keys);
    if (n < 0) return errno_error(n, "frozen");
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < n; i++) {
        struct frozen_value v;
        if (bpf_map_lookup_elem(fd, &keys[i], &v)) continue; /* removed meanwhile */
        PyObject *t = Py_BuildValue("(IIKKKI)", keys[i].tgid, keys[i].tid,
                                    (unsigned long long)keys[i].stopped_ns,
                                    (unsigned long long)v.start_boottime_ns,
                                    (unsigned long long)v.cgroup_id, v.owned);
        if (!t || PyList_Append(out, t)) Py_CLEAR(out);
        Py_XDECREF(t);
    }
    PyMem_Free(keys);
    return out;
}

static int parse_frozen_key(PyObject *args, int *fd, struct frozen_key *k, struct frozen_value *v) {
    unsigned int tgid, tid;
    unsigned long long stopped_ns, start_ns = 0, cgroup_id = 0;
    memset(k, 0, sizeof(*k));
    if (v) {
        memset(v, 0, sizeof(*v));
        if (!PyArg_ParseTuple(args, "iIIKKK", fd, &tgid, &tid, &stopped_ns, &start_ns, &cgroup_id))
            return 0;
        v->start_boottime_ns = start_ns;
        v->cgroup_id = cgroup_id;
    } else if (!PyArg_ParseTuple(args, "iIIK", fd, &tgid, &tid, &stopped_ns)) {
        return 0;
    }
    k->tgid = tgid;
    k->tid = tid;
    k->stopped_ns = stopped_ns;
    return 1;
}

static PyObject *frozen_delete(PyObject *Py_UNUSED(module), PyObject *args) {
    int fd;
    struct frozen_key k;
    if (!parse_frozen_key(args, &fd, &k, NULL)) return NULL;
    if (bpf_map_delete_elem(fd, &k) == 0) Py_RETURN_TRUE;
    if (errno == ENOENT) Py_RETURN_FALSE;
    return errno_error(errno, "frozen");
}

static PyObject *frozen_insert(PyObject *Py_UNUSED(module), PyObject *args) {
    int fd;
    struct frozen_key k;
    struct frozen_value v;
    if (!parse_frozen_key(args, &fd, &k, &v)) return NULL;
    if (bpf_map_update_elem(fd, &k, &v, BPF_NOEXIST)) return errno_error(errno, "frozen");
    Py_RETURN_NONE;
}

static PyObject *Guard_map_ids(Guard *g, PyObject *Py_UNUSED(ignored)) {
    if (!guard_open(g)) return NULL;
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    struct bpf_map *map;
    bpf_object__for_each_map(map, g->obj) {
        struct bpf_map_info info;
        uint32_t len = sizeof(info);
        memset(&info, 0, sizeof(info));
        if (bpf_obj_get_info_by_fd(bpf_map__fd(map), &info, &len)) {
            Py_DECREF(out);
            return errno_error(errno, bpf_map__name(map));
        }
        PyObject *id = PyLong_FromUnsignedLong(info.id);
        if (!id || PyDict_SetItemString(out, bpf_map__name(map), id)) {
            Py_XDECREF(id);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(id);
    }
    return out;
}

static PyObject *Guard_close(Guard *g, PyObject *Py_UNUSED(ignored)) {
    guard_release(g);
    Py_RETURN_NONE;
}

static PyObject *Guard_dropped(Guard *g, void *Py_UNUSED(closure)) {
    return PyLong_FromLongLong(g->dropped);
}

static PyMethodDef Guard_methods[] = {
    {"set_headroom", (PyCFunction)Guard_set_headroom, METH_VARARGS, NULL},
    {"clear_headroom", (PyCFunction)Guard_clear_headroom, METH_VARARGS, NULL},
    {"reset", (PyCFunction)Guard_reset, METH_VARARGS, NULL},
    {"allocated", (PyCFunction)Guard_allocated, METH_VARARGS, NULL},
    {"poll", (PyCFunction)Guard_poll, METH_VARARGS, NULL},
    {"map_ids", (PyCFunction)Guard_map_ids, METH_NOARGS, NULL},
    {"close", (PyCFunction)Guard_close, METH_NOARGS, NULL},
    {"forget", (PyCFunction)Guard_forget, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Guard_getset[] = {
    {"dropped", (getter)Guard_dropped, NULL, "events dropped by full poll buffers", NULL},
    {"frozen_fd", (getter)Guard_frozen_fd, NULL, "the frozen map's fd (close-on-exec)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GuardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuguard.adapters.allocguard._loader.Guard",
    .tp_basicsize = sizeof(Guard),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Guard_init,
    .tp_dealloc = (destructor)Guard_dealloc,
    .tp_methods = Guard_methods,
    .tp_getset = Guard_getset,
};

static int quiet_print(enum libbpf_print_level level, const char *fmt, va_list ap) {
    (void)level;
    (void)fmt;
    (void)ap;
    return 0; /* errors come back as OSError; libbpf's stderr chatter is not a log */
}

static PyMethodDef module_functions[] = {
    {"frozen_entries", frozen_entries, METH_VARARGS, NULL},
    {"frozen_delete", frozen_delete, METH_VARARGS, NULL},
    {"frozen_insert", frozen_insert, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_loader",
    .m_doc = "The eBPF allocation guard's loader over libbpf.",
    .m_size = -1,
    .m_methods = module_functions,
};

PyMODINIT_FUNC PyInit__loader(void) {
    if (PyType_Ready(&GuardType) < 0) return NULL;
    libbpf_set_print(quiet_print);
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&GuardType);
    if (PyModule_AddObject(m, "Guard", (PyObject *)&GuardType) < 0) {
        Py_DECREF(&GuardType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
