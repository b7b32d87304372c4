/*
 * nvml_stub.c: a stand-in libnvidia-ml.so.1 for gpuguard's tests.
 *
 * Owns: the NVML C ABI that nvidia-ml-py (pynvml) and gpuguard call at init and during a poll,
 * answered from a JSON scenario file. Must not: depend on anything but libc, or pretend to be a
 * complete NVML (unknown symbols stay missing, so pynvml raises FunctionNotFound as it would on an
 * old driver).
 *
 * The scenario file is named by the environment variable NVML_STUB_SCENARIO and re-read
 * whenever its path, inode, size or mtime changes (tests rewrite it atomically with rename(2)).
 * A call learns that nothing changed from one non-blocking read(2) of an inotify watch on the
 * file's directory (see "Scenario change watch" below) instead of stat(2)-ing the file, so
 * benchmarks measure the code under test, not the stand-in.
 * Format: see README.md next to this file. Every reload resets the error/delay rule counters.
 *
 * Struct layouts follow nvml.h (CUDA 13 header) and pynvml 13.x:
 *   nvmlProcessInfo_v1_t  {uint pid; u64 usedGpuMemory;}                       16 bytes
 *   nvmlProcessInfo_t(v2/v3) {uint pid; u64 usedGpuMemory; uint gi; uint ci;}  24 bytes
 *   nvmlMemory_t          {u64 total, free, used;}
 *   nvmlMemory_v2_t       {uint version; u64 total, reserved, free, used;}  version 0x02000028
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_VALUE_NOT_AVAILABLE_U64 0xFFFFFFFFFFFFFFFFULL
#define NVML_INSTANCE_NONE 0xFFFFFFFFu
#define NVML_MEMORY_V2_VERSION 0x02000028u

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "v2/v3 process info is 24 bytes");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "v1 process info is 16 bytes");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t is 40 bytes (0x28)");

/* ------------------------------------------------------------------------------------------ */
/* A small JSON reader: objects, arrays, strings (with \" \\ \/ \n \t \uXXXX as '?'), numbers,
 * true, false, null. Enough for scenario files; not a general-purpose parser. */

enum jtype { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };

struct jv {
    enum jtype t;
    int b;
    int is_int;
    int neg;
    unsigned long long u; /* magnitude of an integer */
    double d;
    char *s;
    size_t n;
    struct jv **items;
    char **keys;
};

struct jparser {
    const char *p;
    const char *end;
    char err[160];
};

static void jfree(struct jv *v) {
    size_t i;
    if (v == NULL) return;
    for (i = 0; i < v->n; i++) {
        jfree(v->items[i]);
        if (v->keys != NULL) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->s);
    free(v);
}

static void jskip(struct jparser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t'))
        ps->p++;
}

static struct jv *jnew(enum jtype t) {
    struct jv *v = calloc(1, sizeof(*v));
    if (v != NULL) v->t = t;
    return v;
}

static struct jv *jparse_value(struct jparser *ps, int depth);

static char *jparse_string_raw(struct jparser *ps) {
    size_t cap = 16, len = 0;
    char *out;
    if (ps->p >= ps->end || *ps->p != '"') {
        snprintf(ps->err, sizeof(ps->err), "expected string");
        return NULL;
    }
    ps->p++;
    out = malloc(cap);
    if (out == NULL) return NULL;
    while (ps->p < ps->end && *ps->p != '"') {
        char c = *ps->p++;
        if (c == '\\') {
            if (ps->p >= ps->end) break;
            c = *ps->p++;
            switch (c) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u':
                if (ps->end - ps->p < 4) {
                    snprintf(ps->err, sizeof(ps->err), "bad \\u escape");
                    free(out);
                    return NULL;
                }
                ps->p += 4;
                c = '?';
                break;
            default: break; /* \" \\ \/ */
            }
        }
        if (len + 2 > cap) {
            char *bigger;
            cap *= 2;
            bigger = realloc(out, cap);
            if (bigger == NULL) {
                free(out);
                return NULL;
            }
            out = bigger;
        }
        out[len++] = c;
    }
    if (ps->p >= ps->end) {
        snprintf(ps->err, sizeof(ps->err), "unterminated string");
        free(out);
        return NULL;
    }
    ps->p++; /* closing quote */
    out[len] = '\0';
    return out;
}

static int jappend(struct jv *v, struct jv *item, char *key) {
    struct jv **items = realloc(v->items, (v->n + 1) * sizeof(*items));
    if (items == NULL) return -1;
    v->items = items;
    if (v->t == J_OBJ) {
        char **keys = realloc(v->keys, (v->n + 1) * sizeof(*keys));
        if (keys == NULL) return -1;
        v->keys = keys;
        v->keys[v->n] = key;
    }
    v->items[v->n++] = item;
    return 0;
}

static struct jv *jparse_container(struct jparser *ps, int depth, int is_obj) {
    struct jv *v = jnew(is_obj ? J_OBJ : J_ARR);
    char close = is_obj ? '}' : ']';
    if (v == NULL) return NULL;
    ps->p++; /* [ or { */
    jskip(ps);
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        return v;
    }
    for (;;) {
        char *key = NULL;
        struct jv *item;
        jskip(ps);
        if (is_obj) {
            key = jparse_string_raw(ps);
            if (key == NULL) goto fail;
            jskip(ps);
            if (ps->p >= ps->end || *ps->p != ':') {
                snprintf(ps->err, sizeof(ps->err), "expected ':' after key \"%s\"", key);
                free(key);
                goto fail;
            }
            ps->p++;
        }
        item = jparse_value(ps, depth + 1);
        if (item == NULL || jappend(v, item, key) != 0) {
            free(key);
            jfree(item);
            goto fail;
        }
        jskip(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            return v;
        }
        snprintf(ps->err, sizeof(ps->err), "expected ',' or '%c'", close);
        goto fail;
    }
fail:
    jfree(v);
    return NULL;
}

static struct jv *jparse_number(struct jparser *ps) {
    const char *start = ps->p;
    int only_digits = 1;
    char buf[64];
    size_t len;
    struct jv *v;
    if (ps->p < ps->end && (*ps->p == '-' || *ps->p == '+')) ps->p++;
    while (ps->p < ps->end && strchr("0123456789.eE+-", *ps->p) != NULL) {
        if (*ps->p < '0' || *ps->p > '9') only_digits = 0;
        ps->p++;
    }
    len = (size_t)(ps->p - start);
    if (len == 0 || len >= sizeof(buf)) {
        snprintf(ps->err, sizeof(ps->err), "bad number");
        return NULL;
    }
    memcpy(buf, start, len);
    buf[len] = '\0';
    v = jnew(J_NUM);
    if (v == NULL) return NULL;
    v->d = strtod(buf, NULL);
    if (only_digits) {
        const char *digits = buf;
        v->is_int = 1;
        if (*digits == '-' || *digits == '+') {
            v->neg = (*digits == '-');
            digits++;
        }
        errno = 0;
        v->u = strtoull(digits, NULL, 10);
        if (errno != 0) {
            snprintf(ps->err, sizeof(ps->err), "integer out of range: %s", buf);
            jfree(v);
            return NULL;
        }
    }
    return v;
}

static int jliteral(struct jparser *ps, const char *word) {
    size_t len = strlen(word);
    if ((size_t)(ps->end - ps->p) >= len && strncmp(ps->p, word, len) == 0) {
        ps->p += len;
        return 1;
    }
    return 0;
}

static struct jv *jparse_value(struct jparser *ps, int depth) {
    struct jv *v;
    if (depth > 64) {
        snprintf(ps->err, sizeof(ps->err), "nested too deep");
        return NULL;
    }
    jskip(ps);
    if (ps->p >= ps->end) {
        snprintf(ps->err, sizeof(ps->err), "unexpected end of input");
        return NULL;
    }
    switch (*ps->p) {
    case '{': return jparse_container(ps, depth, 1);
    case '[': return jparse_container(ps, depth, 0);
    case '"':
        v = jnew(J_STR);
        if (v == NULL) return NULL;
        v->s = jparse_string_raw(ps);
        if (v->s == NULL) {
            jfree(v);
            return NULL;
        }
        return v;
    default: break;
    }
    if (jliteral(ps, "true") || jliteral(ps, "false")) {
        v = jnew(J_BOOL);
        if (v != NULL) v->b = (ps->p[-1] == 'e' && ps->p[-2] == 'u');
        return v;
    }
    if (jliteral(ps, "null")) return jnew(J_NULL);
    return jparse_number(ps);
}

static const struct jv *jget(const struct jv *obj, const char *key) {
    size_t i;
    if (obj == NULL || obj->t != J_OBJ) return NULL;
    for (i = 0; i < obj->n; i++)
        if (strcmp(obj->keys[i], key) == 0) return obj->items[i];
    return NULL;
}

static unsigned long long jget_u64(const struct jv *obj, const char *key, unsigned long long dflt) {
    const struct jv *v = jget(obj, key);
    if (v == NULL || v->t != J_NUM) return dflt;
    if (v->is_int) return v->neg ? dflt : v->u;
    return v->d < 0 ? dflt : (unsigned long long)v->d;
}

static long long jget_i64(const struct jv *obj, const char *key, long long dflt) {
    const struct jv *v = jget(obj, key);
    if (v == NULL || v->t != J_NUM) return dflt;
    if (v->is_int) return v->neg ? -(long long)v->u : (long long)v->u;
    return (long long)v->d;
}

static int jget_bool(const struct jv *obj, const char *key, int dflt) {
    const struct jv *v = jget(obj, key);
    if (v == NULL) return dflt;
    if (v->t == J_BOOL) return v->b;
    if (v->t == J_NUM) return v->u != 0;
    return dflt;
}

static const char *jget_str(const struct jv *obj, const char *key, const char *dflt) {
    const struct jv *v = jget(obj, key);
    return (v != NULL && v->t == J_STR) ? v->s : dflt;
}

/* ------------------------------------------------------------------------------------------ */
/* Scenario state */

#define MAX_GPUS 64
#define MAX_MIG 16
#define MAX_RULES 64
#define NAME_LEN 96

enum { LIST_COMPUTE = 0, LIST_GRAPHICS = 1, LIST_MPS = 2, LIST_KINDS = 3 };
static const char *const LIST_KEYS[LIST_KINDS] = {"processes", "graphics_processes",
                                                  "mps_processes"};

struct proc {
    unsigned int pid;
    unsigned long long used;
};

struct plist {
    struct proc *items;
    unsigned int n;
};

struct unit {
    char uuid[NAME_LEN];
    char name[NAME_LEN];
    unsigned long long total;
    unsigned long long used; /* device-level used; defaults to the sum of known process memory */
    struct plist lists[LIST_KINDS];
};

struct mig {
    int present;
    unsigned int parent;
    unsigned int gi;
    unsigned int ci;
    int has_placement; /* the scenario gave profile_id: nvmlGpuInstanceGetInfo answers */
    unsigned int profile_id;
    unsigned int placement_start;
    unsigned int placement_size;
    struct unit u;
};

/* nvmlGpuInstance_t handles: which GPU's which MIG slot (its GPU instance). */
struct gi_handle {
    unsigned int parent;
    unsigned int slot;
};

struct gpu {
    unsigned int index;
    int lost;
    int mig_capable;
    unsigned int mig_current;
    unsigned int mig_pending;
    unsigned int max_mig;
    struct unit u;
};

struct rule {
    char call[NAME_LEN];
    long long device; /* -1: any device (or a call without a device) */
    long long mig_slot; /* -1: any handle; else only that MIG slot's handle */
    int code;
    unsigned long long delay_ms;
    long long after; /* the first `after` matching calls pass */
    long long times; /* then it fires this many times; -1 = forever */
    long long seen;
    long long fired;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct gpu g_gpus[MAX_GPUS];
static struct mig g_migs[MAX_GPUS][MAX_MIG];
static struct gi_handle g_gi_handles[MAX_GPUS][MAX_MIG];
static unsigned int g_ngpus;
static struct rule g_rules[MAX_RULES];
static unsigned int g_nrules;
static int g_init_error;
static int g_bad_scenario;
static char g_driver_version[NAME_LEN] = "580.159.04";
static int g_init_count;
static unsigned long long g_calls_total;
static int g_parent_aggregate_permission = 1;

/* "handle_lost" (README): NVML's handle going bad under a long-running process (NVIDIA container
 * toolkit #48, #1227: after `systemctl daemon-reload` a container's device access is reset and
 * every NVML call answers NVML_ERROR_UNKNOWN). The trigger is the scenario's (a reload re-arms
 * it); the break itself is the library's state and outlives reloads until a fresh nvmlInit. */
#define MAX_EXCEPT 8
static struct {
    int armed;
    long long after;           /* calls that still answer before the break */
    long long seen;
    int code;                  /* what every call answers while broken */
    long long reinit_failures; /* fresh nvmlInit calls that fail with `code` first; -1 = all */
    char except[MAX_EXCEPT][NAME_LEN];
    unsigned int nexcept;      /* calls that keep answering while broken */
} g_hl;
static int g_hl_broken;
static int g_hl_code;
static long long g_hl_reinit_left;

static char g_path[4096];
static struct stat g_stat;
static int g_loaded;

static const struct {
    const char *name;
    int code;
} ERROR_NAMES[] = {
    {"SUCCESS", NVML_SUCCESS},
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED},
    {"NO_PERMISSION", NVML_ERROR_NO_PERMISSION},
    {"ALREADY_INITIALIZED", NVML_ERROR_ALREADY_INITIALIZED},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND},
    {"INSUFFICIENT_SIZE", NVML_ERROR_INSUFFICIENT_SIZE},
    {"INSUFFICIENT_POWER", NVML_ERROR_INSUFFICIENT_POWER},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED},
    {"TIMEOUT", NVML_ERROR_TIMEOUT},
    {"IRQ_ISSUE", NVML_ERROR_IRQ_ISSUE},
    {"LIBRARY_NOT_FOUND", NVML_ERROR_LIBRARY_NOT_FOUND},
    {"FUNCTION_NOT_FOUND", NVML_ERROR_FUNCTION_NOT_FOUND},
    {"CORRUPTED_INFOROM", NVML_ERROR_CORRUPTED_INFOROM},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST},
    {"RESET_REQUIRED", NVML_ERROR_RESET_REQUIRED},
    {"OPERATING_SYSTEM", NVML_ERROR_OPERATING_SYSTEM},
    {"LIB_RM_VERSION_MISMATCH", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"IN_USE", NVML_ERROR_IN_USE},
    {"MEMORY", NVML_ERROR_MEMORY},
    {"NO_DATA", NVML_ERROR_NO_DATA},
    {"ARGUMENT_VERSION_MISMATCH", NVML_ERROR_ARGUMENT_VERSION_MISMATCH},
    {"UNKNOWN", NVML_ERROR_UNKNOWN},
};

static int error_code(const struct jv *v) {
    size_t i;
    if (v == NULL) return NVML_ERROR_UNKNOWN;
    if (v->t == J_NUM) return (int)v->u;
    if (v->t == J_STR) {
        const char *name = v->s;
        if (strncmp(name, "NVML_ERROR_", 11) == 0) name += 11;
        for (i = 0; i < sizeof(ERROR_NAMES) / sizeof(ERROR_NAMES[0]); i++)
            if (strcmp(ERROR_NAMES[i].name, name) == 0) return ERROR_NAMES[i].code;
    }
    return NVML_ERROR_UNKNOWN;
}

static void unit_clear(struct unit *u) {
    int k;
    for (k = 0; k < LIST_KINDS; k++) free(u->lists[k].items);
    memset(u, 0, sizeof(*u));
}

static void state_clear(void) {
    unsigned int i, j;
    for (i = 0; i < MAX_GPUS; i++) {
        unit_clear(&g_gpus[i].u);
        memset(&g_gpus[i], 0, sizeof(g_gpus[i]));
        for (j = 0; j < MAX_MIG; j++) {
            unit_clear(&g_migs[i][j].u);
            memset(&g_migs[i][j], 0, sizeof(g_migs[i][j]));
        }
    }
    g_ngpus = 0;
    g_nrules = 0;
    g_init_error = NVML_SUCCESS;
    g_parent_aggregate_permission = 1;
    memset(&g_hl, 0, sizeof(g_hl));
    snprintf(g_driver_version, sizeof(g_driver_version), "580.159.04");
}

static int load_plist(struct plist *pl, const struct jv *arr, unsigned long long *known_sum) {
    size_t i;
    if (arr == NULL || arr->t != J_ARR || arr->n == 0) return 0;
    pl->items = calloc(arr->n, sizeof(*pl->items));
    if (pl->items == NULL) return -1;
    for (i = 0; i < arr->n; i++) {
        const struct jv *p = arr->items[i];
        const struct jv *used = jget(p, "used_bytes");
        pl->items[i].pid = (unsigned int)jget_u64(p, "pid", 0);
        if (used == NULL || used->t == J_NULL || used->t == J_STR)
            pl->items[i].used = NVML_VALUE_NOT_AVAILABLE_U64; /* "NA" */
        else
            pl->items[i].used = jget_u64(p, "used_bytes", 0);
        if (pl->items[i].used != NVML_VALUE_NOT_AVAILABLE_U64) *known_sum += pl->items[i].used;
    }
    pl->n = (unsigned int)arr->n;
    return 0;
}

static int load_unit(struct unit *u, const struct jv *obj, const char *dflt_name) {
    int k;
    unsigned long long sum = 0, compute_sum = 0;
    snprintf(u->uuid, sizeof(u->uuid), "%s", jget_str(obj, "uuid", "GPU-00000000-0000-0000-0000-000000000000"));
    snprintf(u->name, sizeof(u->name), "%s", jget_str(obj, "name", dflt_name));
    u->total = jget_u64(obj, "total_bytes", 0);
    for (k = 0; k < LIST_KINDS; k++) {
        if (load_plist(&u->lists[k], jget(obj, LIST_KEYS[k]), &sum) != 0) return -1;
        if (k == LIST_COMPUTE) compute_sum = sum;
    }
    u->used = jget_u64(obj, "used_bytes", compute_sum);
    return 0;
}

/* "handle_lost": true (break at the next call) or {"after", "code", "reinit_failures",
 * "except"}; absent, null or false: no break armed. */
static void load_handle_lost(const struct jv *hl) {
    const struct jv *except;
    size_t i;
    if (hl == NULL || hl->t == J_NULL || (hl->t == J_BOOL && !hl->b)) return;
    g_hl.armed = 1;
    g_hl.code = NVML_ERROR_UNKNOWN;
    if (hl->t != J_OBJ) return;
    g_hl.after = jget_i64(hl, "after", 0);
    if (jget(hl, "code") != NULL) g_hl.code = error_code(jget(hl, "code"));
    g_hl.reinit_failures = jget_i64(hl, "reinit_failures", 0);
    except = jget(hl, "except");
    if (except == NULL || except->t != J_ARR) return;
    for (i = 0; i < except->n && g_hl.nexcept < MAX_EXCEPT; i++)
        if (except->items[i]->t == J_STR)
            snprintf(g_hl.except[g_hl.nexcept++], NAME_LEN, "%s", except->items[i]->s);
}

static int load_scenario(const struct jv *root) {
    const struct jv *devs = jget(root, "devices");
    const struct jv *rules = jget(root, "errors");
    const struct jv *delays = jget(root, "delays");
    const struct jv *init_err = jget(root, "init_error");
    size_t i, j;

    if (root == NULL || root->t != J_OBJ) return -1;
    snprintf(g_driver_version, sizeof(g_driver_version), "%s",
             jget_str(root, "driver_version", "580.159.04"));
    if (init_err != NULL && init_err->t != J_NULL) g_init_error = error_code(init_err);
    g_parent_aggregate_permission = jget_bool(root, "parent_aggregate_permission", 1);
    load_handle_lost(jget(root, "handle_lost"));

    if (devs != NULL && devs->t == J_ARR) {
        for (i = 0; i < devs->n && i < MAX_GPUS; i++) {
            const struct jv *d = devs->items[i];
            const struct jv *migs = jget(d, "mig_instances");
            const struct jv *mode = jget(d, "mig_mode");
            struct gpu *g = &g_gpus[i];
            g->index = (unsigned int)i;
            g->lost = jget_bool(d, "lost", 0);
            if (load_unit(&g->u, d, "NVIDIA H200") != 0) return -1;
            /* mig_mode: absent/null = not MIG capable; "disabled"/false/0; "enabled"/true/1. */
            g->mig_capable = (mode != NULL && mode->t != J_NULL);
            g->mig_current = jget_bool(d, "mig_mode", 0) ||
                             (mode != NULL && mode->t == J_STR && strcmp(mode->s, "enabled") == 0);
            g->mig_pending = (unsigned int)jget_bool(d, "mig_pending", (int)g->mig_current);
            g->max_mig = g->mig_capable ? (unsigned int)jget_u64(d, "max_mig_devices", 7) : 0;
            if (g->max_mig > MAX_MIG) g->max_mig = MAX_MIG;
            if (migs != NULL && migs->t == J_ARR) {
                for (j = 0; j < migs->n; j++) {
                    const struct jv *m = migs->items[j];
                    unsigned long long slot = jget_u64(m, "slot", j);
                    struct mig *mg;
                    if (slot >= MAX_MIG) continue;
                    mg = &g_migs[i][slot];
                    mg->present = 1;
                    mg->parent = (unsigned int)i;
                    mg->gi = (unsigned int)jget_u64(m, "gi", slot + 1);
                    mg->ci = (unsigned int)jget_u64(m, "ci", 0);
                    mg->has_placement = jget(m, "profile_id") != NULL;
                    mg->profile_id = (unsigned int)jget_u64(m, "profile_id", 0);
                    mg->placement_start = (unsigned int)jget_u64(m, "placement_start", 0);
                    mg->placement_size = (unsigned int)jget_u64(m, "placement_size", 1);
                    if (load_unit(&mg->u, m, "NVIDIA H200 MIG 1g.18gb") != 0) return -1;
                }
            }
        }
        g_ngpus = (unsigned int)(devs->n < MAX_GPUS ? devs->n : MAX_GPUS);
    }

    for (j = 0; j < 2; j++) {
        const struct jv *arr = j == 0 ? rules : delays;
        if (arr == NULL || arr->t != J_ARR) continue;
        for (i = 0; i < arr->n && g_nrules < MAX_RULES; i++) {
            const struct jv *r = arr->items[i];
            struct rule *rule = &g_rules[g_nrules++];
            memset(rule, 0, sizeof(*rule));
            snprintf(rule->call, sizeof(rule->call), "%s", jget_str(r, "call", "*"));
            rule->device = jget_i64(r, "device", -1);
            rule->mig_slot = jget_i64(r, "mig_slot", -1);
            rule->code = j == 0 ? error_code(jget(r, "code")) : NVML_SUCCESS;
            rule->delay_ms = j == 1 ? jget_u64(r, "ms", 0) : 0;
            rule->after = jget_i64(r, "after", 0);
            rule->times = jget_i64(r, "times", -1);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Scenario change watch.
 *
 * Owns: proving, with one non-blocking read(2) per call, that the scenario file has not changed
 * since the last check. Must not: decide what a change means (refresh() still stat(2)s and
 * compares path, inode, size and mtime), or ever answer "unchanged" without that proof.
 *
 * An inotify instance watches the scenario's directory. The kernel queues an event inside the
 * rename/write/close/unlink system call itself, so once a writer's os.replace() has returned,
 * any later read of the queue, from any thread, returns it: EAGAIN proves "unchanged". Events
 * on other names in the directory (the writer's temp file) are drained and ignored. Anything
 * that breaks the proof makes the call take the stat path: queue overflow, the directory itself
 * deleted or moved (the watch is re-armed on the next call), and for good, for that path, a
 * relative path (the cwd may move), a directory reached through a symlink, a scenario that is
 * itself a symlink (its target changes elsewhere), a file system whose changes may come from
 * elsewhere (not a local one below), or no inotify at all. Not seen: an ancestor of the
 * directory renamed or re-pointed after the watch is armed (no test does that).
 *
 * A forked child shares the parent's inotify instance (the same open file description), so
 * each would steal the other's events: the child closes its copy and arms its own (atfork). */

enum watch_state {
    WATCH_NONE,  /* no watch yet, or it broke: try to arm one on the next call */
    WATCH_ON,    /* g_watch_fd watches g_watch_path's directory */
    WATCH_NEVER, /* g_watch_path cannot be watched: stat on every call */
};

static enum watch_state g_watch_state = WATCH_NONE;
static int g_watch_fd = -1;
static char g_watch_path[4096];     /* the NVML_STUB_SCENARIO value the state is for */
static const char *g_watch_name;    /* its last component, inside g_watch_path */

/* A watch is only trusted where every change comes through this kernel. */
static int local_file_system(const char *dir) {
    static const unsigned long LOCAL[] = {
        0x01021994UL, /* tmpfs */
        0x0000EF53UL, /* ext2/3/4 */
        0x58465342UL, /* xfs */
        0x9123683EUL, /* btrfs */
        0x794C7630UL, /* overlayfs */
        0xF2F52010UL, /* f2fs */
    };
    struct statfs fs;
    size_t i;
    if (statfs(dir, &fs) != 0) return 0;
    for (i = 0; i < sizeof(LOCAL) / sizeof(LOCAL[0]); i++)
        if ((unsigned long)fs.f_type == LOCAL[i]) return 1;
    return 0;
}

static void watch_close(void) {
    if (g_watch_fd >= 0) close(g_watch_fd);
    g_watch_fd = -1;
    g_watch_state = WATCH_NONE;
}

/* Arms a watch for `path` (or records why it cannot be). Called with g_lock held; the caller
 * then takes the stat path, which covers every change made before the watch existed. */
static void watch_arm(const char *path) {
    char dir[sizeof(g_watch_path)];
    char real[PATH_MAX];
    char *slash;
    int retry = 0;

    watch_close();
    g_watch_state = WATCH_NEVER;
    if (strlen(path) >= sizeof(g_watch_path)) {
        g_watch_path[0] = '\0';
        return;
    }
    snprintf(g_watch_path, sizeof(g_watch_path), "%s", path);
    slash = strrchr(g_watch_path, '/');
    if (path[0] != '/' || slash == NULL) return;
    g_watch_name = slash + 1;
    if (strcmp(g_watch_name, "") == 0 || strcmp(g_watch_name, ".") == 0 ||
        strcmp(g_watch_name, "..") == 0)
        return; /* no event ever carries such a name */
    snprintf(dir, sizeof(dir), "%.*s", (int)(slash - g_watch_path), g_watch_path);
    if (dir[0] == '\0') snprintf(dir, sizeof(dir), "/");
    if (realpath(dir, real) == NULL) {
        g_watch_state = WATCH_NONE; /* the directory may appear later */
        return;
    }
    if (strcmp(real, dir) != 0 || !local_file_system(dir)) return;
    g_watch_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (g_watch_fd < 0) return;
    if (inotify_add_watch(g_watch_fd, dir,
                          IN_ONLYDIR | IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_DELETE |
                              IN_CLOSE_WRITE | IN_MODIFY | IN_ATTRIB | IN_DELETE_SELF |
                              IN_MOVE_SELF) < 0) {
        retry = (errno == ENOENT || errno == ENOTDIR);
        watch_close();
        g_watch_state = retry ? WATCH_NONE : WATCH_NEVER;
        return;
    }
    g_watch_state = WATCH_ON;
}

enum watch_news { WATCH_QUIET, WATCH_TOUCHED, WATCH_LOST };

/* Drains the queue: QUIET if nothing happened to the scenario's name, TOUCHED if something may
 * have (refresh() stats to see what), LOST if the watch no longer covers the path. */
static enum watch_news watch_drain(void) {
    static char buf[16384] __attribute__((aligned(__alignof__(struct inotify_event))));
    const size_t biggest = sizeof(struct inotify_event) + NAME_MAX + 1;
    enum watch_news news = WATCH_QUIET;
    for (;;) {
        ssize_t n = read(g_watch_fd, buf, sizeof(buf));
        const char *p = buf;
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return news;
        if (n <= 0) return WATCH_LOST;
        while (p < buf + n) {
            const struct inotify_event *ev = (const struct inotify_event *)(const void *)p;
            if (ev->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT)) return WATCH_LOST;
            if ((ev->mask & IN_Q_OVERFLOW) || (ev->len > 0 && strcmp(ev->name, g_watch_name) == 0))
                news = WATCH_TOUCHED;
            p += sizeof(*ev) + ev->len;
        }
        /* A read that left room for the biggest event found the queue empty. */
        if ((size_t)n + biggest <= sizeof(buf)) return news;
    }
}

/* 0 only when the watch proves the scenario at `path` unchanged since the last check. Called
 * with g_lock held. */
static int scenario_may_have_changed(const char *path) {
    if (strcmp(path, g_watch_path) == 0) {
        if (g_watch_state == WATCH_NEVER) return 1;
        if (g_watch_state == WATCH_ON) {
            enum watch_news news = watch_drain();
            if (news == WATCH_QUIET) return 0;
            if (news == WATCH_TOUCHED) return 1;
        }
    }
    watch_arm(path);
    return 1;
}

/* stat(2) of the scenario; while watched, it must not be a symlink (its target would change
 * where the watch does not look). Called with g_lock held. */
static int stat_scenario(const char *path, struct stat *st) {
    if (g_watch_state == WATCH_ON) {
        if (lstat(path, st) != 0) return -1;
        if (!S_ISLNK(st->st_mode)) return 0;
        watch_close();
        g_watch_state = WATCH_NEVER;
    }
    return stat(path, st);
}

static void atfork_prepare(void) { pthread_mutex_lock(&g_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_lock); }

static void atfork_child(void) {
    watch_close(); /* the parent's instance: drop this copy, arm our own on the next call */
    g_watch_path[0] = '\0';
    pthread_mutex_unlock(&g_lock);
}

__attribute__((constructor)) static void stub_loaded(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

__attribute__((destructor)) static void stub_unloaded(void) { watch_close(); }

/* Re-read the scenario if the file changed. Called with g_lock held. */
static void refresh(void) {
    const char *path = getenv("NVML_STUB_SCENARIO");
    struct stat st;
    FILE *f;
    char *text;
    long size;
    struct jparser ps;
    struct jv *root;

    if (path == NULL || *path == '\0') {
        watch_close();
        g_watch_path[0] = '\0';
        if (g_loaded || g_path[0] != '\0') {
            state_clear();
            g_hl_broken = 0;
            g_path[0] = '\0';
            g_bad_scenario = 0;
        }
        g_loaded = 0;
        return;
    }
    if (!scenario_may_have_changed(path)) return;
    if (stat_scenario(path, &st) != 0) {
        if (g_loaded || strcmp(path, g_path) != 0) fprintf(stderr, "nvml_stub: cannot stat %s\n", path);
        state_clear();
        snprintf(g_path, sizeof(g_path), "%s", path);
        g_loaded = 0;
        g_bad_scenario = 1;
        return;
    }
    if (g_loaded && strcmp(path, g_path) == 0 && st.st_ino == g_stat.st_ino &&
        st.st_size == g_stat.st_size && st.st_mtim.tv_sec == g_stat.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == g_stat.st_mtim.tv_nsec)
        return;

    if (strcmp(path, g_path) != 0) g_hl_broken = 0; /* another scenario: another world */
    state_clear();
    snprintf(g_path, sizeof(g_path), "%s", path);
    g_stat = st;
    g_loaded = 1;
    g_bad_scenario = 1;
    f = fopen(path, "rb");
    if (f == NULL) return;
    fseek(f, 0, SEEK_END);
    size = ftell(f);
    fseek(f, 0, SEEK_SET);
    text = malloc((size_t)size + 1);
    if (text == NULL || fread(text, 1, (size_t)size, f) != (size_t)size) {
        fclose(f);
        free(text);
        return;
    }
    fclose(f);
    text[size] = '\0';
    ps.p = text;
    ps.end = text + size;
    ps.err[0] = '\0';
    root = jparse_value(&ps, 0);
    if (root == NULL) {
        fprintf(stderr, "nvml_stub: %s: %s at offset %ld\n", path, ps.err, (long)(ps.p - text));
    } else if (load_scenario(root) != 0) {
        fprintf(stderr, "nvml_stub: %s: not a valid scenario\n", path);
        state_clear();
    } else {
        g_bad_scenario = 0;
    }
    jfree(root);
    free(text);
}

/* ------------------------------------------------------------------------------------------ */
/* Handles: pointers into the static arrays, so they stay valid across reloads (like NVML's). */

static struct gpu *as_gpu(nvmlDevice_t h) {
    const char *p = (const char *)h, *base = (const char *)g_gpus;
    size_t off;
    if (p < base || p >= base + sizeof(g_gpus)) return NULL;
    off = (size_t)(p - base);
    if (off % sizeof(struct gpu) != 0 || off / sizeof(struct gpu) >= g_ngpus) return NULL;
    return (struct gpu *)h;
}

static struct mig *as_mig(nvmlDevice_t h) {
    const char *p = (const char *)h, *base = (const char *)g_migs;
    size_t off;
    struct mig *m;
    if (p < base || p >= base + sizeof(g_migs)) return NULL;
    off = (size_t)(p - base);
    if (off % sizeof(struct mig) != 0) return NULL;
    m = (struct mig *)h;
    if (!m->present || m->parent >= g_ngpus || !g_gpus[m->parent].mig_current) return NULL;
    return m;
}

/* Whether `call` is broken now (arming the break when its call comes). nvmlShutdown always
 * answers: it is how a caller gets out. Called with g_lock held. */
static int handle_lost_hits(const char *call) {
    unsigned int i;
    if (strcmp(call, "nvmlShutdown") == 0) return 0;
    for (i = 0; i < g_hl.nexcept; i++)
        if (strcmp(g_hl.except[i], call) == 0) return 0;
    if (!g_hl_broken && g_hl.armed && g_hl.seen++ >= g_hl.after) {
        g_hl_broken = 1;
        g_hl.armed = 0;
        g_hl_code = g_hl.code;
        g_hl_reinit_left = g_hl.reinit_failures;
    }
    return g_hl_broken;
}

static long long handle_device(nvmlDevice_t h, long long *slot) {
    struct gpu *g = as_gpu(h);
    struct mig *m;
    *slot = -1;
    if (g != NULL) return g->index;
    m = as_mig(h);
    if (m != NULL) {
        *slot = (long long)(m - g_migs[m->parent]);
        return m->parent;
    }
    return -1;
}

/* Takes the lock, reloads the scenario, applies error and delay rules. The lock is held on
 * return whatever the result; callers release it with leave(). */
static nvmlReturn_t enter(const char *call, nvmlDevice_t h, int needs_init) {
    unsigned int i;
    unsigned long long delay_ms = 0;
    nvmlReturn_t err = NVML_SUCCESS;
    long long dev = -1, slot = -1;

    pthread_mutex_lock(&g_lock);
    refresh();
    g_calls_total++;
    if (needs_init && g_init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (g_bad_scenario) return NVML_ERROR_UNKNOWN;
    if (needs_init && handle_lost_hits(call)) return g_hl_code;
    if (h != NULL) dev = handle_device(h, &slot);
    for (i = 0; i < g_nrules; i++) {
        struct rule *r = &g_rules[i];
        if (strcmp(r->call, call) != 0 && strcmp(r->call, "*") != 0) continue;
        if (r->device >= 0 && r->device != dev) continue;
        if (r->mig_slot >= 0 && r->mig_slot != slot) continue;
        r->seen++;
        if (r->seen <= r->after) continue;
        if (r->times >= 0 && r->fired >= r->times) continue;
        r->fired++;
        if (r->delay_ms > delay_ms) delay_ms = r->delay_ms;
        if (r->code != NVML_SUCCESS && err == NVML_SUCCESS) err = r->code;
    }
    if (delay_ms > 0) {
        /* Sleep without the lock: other threads' calls proceed, as on a driver where one GPU
         * hangs. A call that must hang everything is modelled by a delay rule on "*". */
        struct timespec ts;
        ts.tv_sec = (time_t)(delay_ms / 1000);
        ts.tv_nsec = (long)(delay_ms % 1000) * 1000000L;
        pthread_mutex_unlock(&g_lock);
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
        pthread_mutex_lock(&g_lock);
    }
    if (err != NVML_SUCCESS) return err;
    if (dev >= 0 && dev < (long long)g_ngpus && g_gpus[dev].lost) return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

static nvmlReturn_t leave(nvmlReturn_t ret) {
    pthread_mutex_unlock(&g_lock);
    return ret;
}

#define ENTER(call, h)                                   \
    do {                                                 \
        nvmlReturn_t enter_ret_ = enter((call), (h), 1); \
        if (enter_ret_ != NVML_SUCCESS) return leave(enter_ret_); \
    } while (0)

/* The unit (full GPU or MIG instance) behind a handle, or NULL. */
static struct unit *unit_of(nvmlDevice_t h) {
    struct gpu *g = as_gpu(h);
    struct mig *m;
    if (g != NULL) return &g->u;
    m = as_mig(h);
    return m != NULL ? &m->u : NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Init, errors, system */

static nvmlReturn_t do_init(const char *call) {
    nvmlReturn_t ret = enter(call, NULL, 0);
    if (ret == NVML_SUCCESS && g_init_error != NVML_SUCCESS) ret = g_init_error;
    if (ret == NVML_SUCCESS && g_hl_broken && g_init_count <= 0) {
        /* A fresh init (not another reference on a live one) re-opens the devices: the handle
         * is good again, unless the scenario says re-initialising fails for a while (or for
         * good: the container really lost its device access). */
        if (g_hl_reinit_left != 0) {
            if (g_hl_reinit_left > 0) g_hl_reinit_left--;
            ret = g_hl_code;
        } else {
            g_hl_broken = 0;
        }
    }
    if (ret == NVML_SUCCESS) g_init_count++;
    return leave(ret);
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return do_init("nvmlInit_v2"); }
EXPORT nvmlReturn_t nvmlInit(void) { return do_init("nvmlInit"); }

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init("nvmlInitWithFlags");
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t ret = enter("nvmlShutdown", NULL, 1);
    if (ret == NVML_SUCCESS) g_init_count--;
    return leave(ret);
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER("nvmlSystemGetDriverVersion", NULL);
    if (version == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (strlen(g_driver_version) + 1 > length) return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    snprintf(version, length, "%s", g_driver_version);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    ENTER("nvmlSystemGetNVMLVersion", NULL);
    if (version == NULL || length < 16) return leave(NVML_ERROR_INVALID_ARGUMENT);
    snprintf(version, length, "13.%s", g_driver_version);
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------------ */
/* Devices */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER("nvmlDeviceGetCount_v2", NULL);
    if (count == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = g_ngpus;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER("nvmlDeviceGetHandleByIndex_v2", NULL);
    if (device == NULL || index >= g_ngpus) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *device = &g_gpus[index];
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    unsigned int i, j;
    ENTER("nvmlDeviceGetHandleByUUID", NULL);
    if (uuid == NULL || device == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (i = 0; i < g_ngpus; i++) {
        if (strcmp(g_gpus[i].u.uuid, uuid) == 0) {
            *device = &g_gpus[i];
            return leave(NVML_SUCCESS);
        }
        for (j = 0; j < MAX_MIG; j++) {
            if (g_migs[i][j].present && g_gpus[i].mig_current &&
                strcmp(g_migs[i][j].u.uuid, uuid) == 0) {
                *device = &g_migs[i][j];
                return leave(NVML_SUCCESS);
            }
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

static nvmlReturn_t copy_str(const char *src, char *dst, unsigned int length) {
    if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(dst, length, "%s", src);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    struct unit *u;
    ENTER("nvmlDeviceGetUUID", device);
    u = unit_of(device);
    if (u == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    return leave(copy_str(u->uuid, uuid, length));
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    struct unit *u;
    ENTER("nvmlDeviceGetName", device);
    u = unit_of(device);
    if (u == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    return leave(copy_str(u->name, name, length));
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    struct gpu *g;
    ENTER("nvmlDeviceGetIndex", device);
    g = as_gpu(device);
    if (g == NULL || index == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = g->index;
    return leave(NVML_SUCCESS);
}

static unsigned long long unit_used(const struct gpu *g, const struct unit *u) {
    unsigned int j;
    unsigned long long sum = 0;
    if (g == NULL || !g->mig_current) return u->used;
    for (j = 0; j < MAX_MIG; j++)
        if (g_migs[g->index][j].present) sum += g_migs[g->index][j].u.used;
    return sum;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct unit *u;
    unsigned long long used;
    ENTER("nvmlDeviceGetMemoryInfo", device);
    u = unit_of(device);
    if (u == NULL || memory == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    used = unit_used(as_gpu(device), u);
    memory->total = u->total;
    memory->used = used;
    memory->free = used <= u->total ? u->total - used : 0;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    struct unit *u;
    unsigned long long used;
    ENTER("nvmlDeviceGetMemoryInfo_v2", device);
    u = unit_of(device);
    if (u == NULL || memory == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != NVML_MEMORY_V2_VERSION) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    used = unit_used(as_gpu(device), u);
    memory->total = u->total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = used <= u->total ? u->total - used : 0;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------------ */
/* Process lists */

struct entry {
    unsigned int pid;
    unsigned long long used;
    unsigned int gi;
    unsigned int ci;
};

/* Append one list's processes to items[*n], each tagged with its GPU and compute instance. */
static void append_entries(struct entry *items, unsigned int *n, const struct plist *pl,
                           unsigned int gi, unsigned int ci) {
    unsigned int i;
    for (i = 0; i < pl->n; i++) {
        items[*n].pid = pl->items[i].pid;
        items[*n].used = pl->items[i].used;
        items[*n].gi = gi;
        items[*n].ci = ci;
        (*n)++;
    }
}

/* The entries a handle lists for one kind: its own, or on a MIG-mode parent the aggregate of
 * its instances (NVML: "only if the caller has appropriate privileges"). */
static nvmlReturn_t collect(nvmlDevice_t h, int kind, unsigned int *n_out, struct entry **out) {
    struct gpu *g = as_gpu(h);
    struct mig *m = as_mig(h);
    unsigned int n = 0, j, cap = 0;
    struct entry *items;

    *out = NULL;
    *n_out = 0;
    if (g == NULL && m == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (m != NULL) {
        cap = m->u.lists[kind].n;
    } else if (g->mig_current) {
        if (!g_parent_aggregate_permission) return NVML_ERROR_NO_PERMISSION;
        for (j = 0; j < MAX_MIG; j++)
            if (g_migs[g->index][j].present) cap += g_migs[g->index][j].u.lists[kind].n;
    } else {
        cap = g->u.lists[kind].n;
    }
    if (cap == 0) return NVML_SUCCESS;
    items = calloc(cap, sizeof(*items));
    if (items == NULL) return NVML_ERROR_MEMORY;
    if (m != NULL) {
        append_entries(items, &n, &m->u.lists[kind], m->gi, m->ci);
    } else if (g->mig_current) {
        for (j = 0; j < MAX_MIG; j++) {
            const struct mig *mm = &g_migs[g->index][j];
            if (mm->present) append_entries(items, &n, &mm->u.lists[kind], mm->gi, mm->ci);
        }
    } else {
        append_entries(items, &n, &g->u.lists[kind], NVML_INSTANCE_NONE, NVML_INSTANCE_NONE);
    }
    *out = items;
    *n_out = n;
    return NVML_SUCCESS;
}

/* NVML's contract: infoCount in = capacity, out = entries (or entries needed with
 * INSUFFICIENT_SIZE); infos may be NULL when the capacity is 0. */
static nvmlReturn_t list_procs(const char *call, nvmlDevice_t h, int kind, unsigned int *count,
                               void *infos, int v1) {
    struct entry *items;
    unsigned int n, i;
    nvmlReturn_t ret;
    ENTER(call, h);
    if (count == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    ret = collect(h, kind, &n, &items);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (*count < n || (n > 0 && infos == NULL)) {
        *count = n;
        free(items);
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (i = 0; i < n; i++) {
        if (v1) {
            nvmlProcessInfo_v1_t *e = &((nvmlProcessInfo_v1_t *)infos)[i];
            e->pid = items[i].pid;
            e->usedGpuMemory = items[i].used;
        } else {
            nvmlProcessInfo_t *e = &((nvmlProcessInfo_t *)infos)[i];
            e->pid = items[i].pid;
            e->usedGpuMemory = items[i].used;
            e->gpuInstanceId = items[i].gi;
            e->computeInstanceId = items[i].ci;
        }
    }
    *count = n;
    free(items);
    return leave(NVML_SUCCESS);
}

#define PROC_FN(sym, kind, v1)                                                              \
    EXPORT nvmlReturn_t sym(nvmlDevice_t device, unsigned int *infoCount, void *infos) {   \
        return list_procs(#sym, device, (kind), infoCount, infos, (v1));                   \
    }

PROC_FN(nvmlDeviceGetComputeRunningProcesses_v3, LIST_COMPUTE, 0)
PROC_FN(nvmlDeviceGetComputeRunningProcesses_v2, LIST_COMPUTE, 0)
PROC_FN(nvmlDeviceGetComputeRunningProcesses, LIST_COMPUTE, 1)
PROC_FN(nvmlDeviceGetGraphicsRunningProcesses_v3, LIST_GRAPHICS, 0)
PROC_FN(nvmlDeviceGetGraphicsRunningProcesses_v2, LIST_GRAPHICS, 0)
PROC_FN(nvmlDeviceGetGraphicsRunningProcesses, LIST_GRAPHICS, 1)
PROC_FN(nvmlDeviceGetMPSComputeRunningProcesses_v3, LIST_MPS, 0)
PROC_FN(nvmlDeviceGetMPSComputeRunningProcesses_v2, LIST_MPS, 0)
PROC_FN(nvmlDeviceGetMPSComputeRunningProcesses, LIST_MPS, 1)

/* ------------------------------------------------------------------------------------------ */
/* MIG */

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                         unsigned int *pendingMode) {
    struct gpu *g;
    ENTER("nvmlDeviceGetMigMode", device);
    g = as_gpu(device);
    if (g == NULL || currentMode == NULL || pendingMode == NULL)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->mig_capable) return leave(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = g->mig_current;
    *pendingMode = g->mig_pending;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    struct gpu *g;
    ENTER("nvmlDeviceGetMaxMigDeviceCount", device);
    g = as_gpu(device);
    if (g == NULL || count == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = g->mig_current ? g->max_mig : 0;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice) {
    struct gpu *g;
    ENTER("nvmlDeviceGetMigDeviceHandleByIndex", device);
    g = as_gpu(device);
    if (g == NULL || migDevice == NULL || !g->mig_current || index >= g->max_mig)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g_migs[g->index][index].present) return leave(NVML_ERROR_NOT_FOUND);
    *migDevice = &g_migs[g->index][index];
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    ENTER("nvmlDeviceIsMigDeviceHandle", device);
    if (isMigDevice == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (as_mig(device) != NULL) {
        *isMigDevice = 1;
    } else if (as_gpu(device) != NULL) {
        *isMigDevice = 0;
    } else {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    return leave(NVML_SUCCESS);
}

/* A MIG device's GPU (compute == 0) or compute instance id; NOT_SUPPORTED on a whole GPU. */
static nvmlReturn_t instance_id(const char *call, nvmlDevice_t device, unsigned int *id,
                                int compute) {
    struct mig *m;
    ENTER(call, device);
    m = as_mig(device);
    if (id == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (m == NULL) return leave(as_gpu(device) != NULL ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT);
    *id = compute ? m->ci : m->gi;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    return instance_id("nvmlDeviceGetGpuInstanceId", device, id, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    return instance_id("nvmlDeviceGetComputeInstanceId", device, id, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                 nvmlDevice_t *device) {
    struct mig *m;
    ENTER("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice);
    m = as_mig(migDevice);
    if (m == NULL || device == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *device = &g_gpus[m->parent];
    return leave(NVML_SUCCESS);
}

/* GPU instances: nvmlDeviceGetGpuInstanceById on the full GPU's handle, then nvmlGpuInstanceGetInfo
 * (nvml.h: nvmlGpuInstanceInfo_t {nvmlDevice_t device; uint id, profileId;
 * nvmlGpuInstancePlacement_t {uint start, size} placement;}). An instance whose scenario gives
 * no profile_id answers NOT_SUPPORTED, as a driver that does not say. */
typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    unsigned int start;
    unsigned int size;
} nvmlGpuInstanceInfo_t;

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                 void **gpuInstance) {
    struct gpu *g;
    unsigned int j;
    ENTER("nvmlDeviceGetGpuInstanceById", device);
    g = as_gpu(device);
    if (g == NULL || gpuInstance == NULL) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->mig_current) return leave(NVML_ERROR_NOT_SUPPORTED);
    for (j = 0; j < g->max_mig; j++) {
        if (g_migs[g->index][j].present && g_migs[g->index][j].gi == id) {
            g_gi_handles[g->index][j].parent = g->index;
            g_gi_handles[g->index][j].slot = j;
            *gpuInstance = &g_gi_handles[g->index][j];
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(void *gpuInstance, nvmlGpuInstanceInfo_t *info) {
    const char *p = (const char *)gpuInstance, *base = (const char *)g_gi_handles;
    const struct gi_handle *h;
    const struct mig *m;
    ENTER("nvmlGpuInstanceGetInfo", NULL);
    if (info == NULL || p < base || p >= base + sizeof(g_gi_handles) ||
        (size_t)(p - base) % sizeof(struct gi_handle) != 0)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    h = (const struct gi_handle *)gpuInstance;
    if (h->parent >= g_ngpus || h->slot >= MAX_MIG) return leave(NVML_ERROR_INVALID_ARGUMENT);
    m = &g_migs[h->parent][h->slot];
    if (!m->present || !g_gpus[h->parent].mig_current) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!m->has_placement) return leave(NVML_ERROR_NOT_SUPPORTED);
    info->device = &g_gpus[h->parent];
    info->id = m->gi;
    info->profileId = m->profile_id;
    info->start = m->placement_start;
    info->size = m->placement_size;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------------ */
/* Test introspection (not NVML symbols): how many nvmlInit minus nvmlShutdown are live, whether
 * the handle is broken ("handle_lost"), and how many calls the library has answered. Tests read
 * them through ctypes. */

EXPORT int gpuguardStubInitCount(void) {
    int n;
    pthread_mutex_lock(&g_lock);
    n = g_init_count;
    pthread_mutex_unlock(&g_lock);
    return n;
}

EXPORT int gpuguardStubHandleLost(void) {
    int broken;
    pthread_mutex_lock(&g_lock);
    broken = g_hl_broken;
    pthread_mutex_unlock(&g_lock);
    return broken;
}

EXPORT unsigned long long gpuguardStubCallCount(void) {
    unsigned long long n;
    pthread_mutex_lock(&g_lock);
    n = g_calls_total;
    pthread_mutex_unlock(&g_lock);
    return n;
}
