// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * The eBPF allocation guard, kernel side: uprobes on the CUDA driver API's allocation and free
 * entry points of one libcuda file (one inode: the host's, bind-mounted into every GPU container)
 * keep, per (cgroup id, device), the bytes allocated minus the bytes freed since the user side
 * last reset the count, and stop a caller whose allocation would take its cgroup past the
 * headroom the user side wrote for it.
 *
 * Owns: the count (`allocated`), the per-thread allocation in flight (`pending`), the size of
 * each live allocation (`sizes`, so a free subtracts what its allocation added), the events,
 * and the record of every stop it makes (`frozen`, read by the user-side thawer that resumes a
 * stop at its bound: see the block above `on_alloc`).
 * The user side owns `headroom` (its limit minus its usage at its last listing) and resets
 * `allocated` when it lists.
 *
 * Must not: decide anything beyond "this allocation would cross the headroom the user side
 * wrote". A cgroup without a headroom entry is not guarded and not counted (absent headroom is
 * no guard, never a freeze). The only action is SIGSTOP to the calling process, reversible by
 * SIGCONT, and only once the stop is recorded in `frozen` (a full map: the caller is not
 * stopped, the event is still sent); the decision to stop it for good stays in the enforcer.
 *
 * The device: an allocation's device is read, never guessed. cuMemCreate and cuMemPoolCreate say
 * it in their properties (location.id, counted only when location.type is a device); a pool
 * from cuDeviceGetDefaultMemPool/cuDeviceGetMemPool is that device's; everything else is on the
 * device of the calling thread's current context, tracked per thread like CUDA's own context
 * stack (cuCtxCreate_v2/v3/v4 push, cuCtxPushCurrent_v2/cuCtxPopCurrent_v2, cuCtxSetCurrent
 * replaces the top, cuCtxDestroy_v2 pops it when current) with each context's device recorded
 * per process when cuCtxCreate_* or cuDevicePrimaryCtxRetain returns it; cuMemAllocAsync uses
 * its stream's device (recorded at cuStreamCreate*, the context current then), the current
 * context's for the NULL, legacy and per-thread streams. A context, pool or stream the probes
 * did not see created (made before they attached, or through an entry point not probed) has no
 * device: its allocations are not counted and never stopped.
 *
 * Sizes: cuMemAllocPitch_v2 counts the pitch the call returned times the height; the CUDA
 * arrays (cuArrayCreate_v2, cuArray3DCreate_v2, cuMipmappedArrayCreate) count width x height x
 * depth x channels x the format's element size (each level halved, for mipmaps), without the
 * driver's alignment and padding, so a little under what the driver takes; a format this file
 * does not know counts 4 bytes an element.
 *
 * Process exit frees a process's memory without a free call: the last thread's exit subtracts
 * what the process still held from its cgroup's count (the per-process totals in `held`), and
 * the live allocations' entries are keyed by the process's start time as well as its tgid, so a
 * process that reuses the tgid never matches them (they age out of the LRU map).
 */
#include "vmlinux.h"
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#define SIGSTOP 19
#define MAX_DEVICES 16 /* devices a process exit looks up; an ordinal past it is not counted */
#define CTX_STACK 8    /* contexts kept per thread; deeper pushes make the current one unknown */
#define MIP_LEVELS 16
#define CU_MEM_LOCATION_TYPE_DEVICE 1

enum entry_point {
	ENTRY_MEM_ALLOC = 1,
	ENTRY_MEM_CREATE = 2,
	ENTRY_MEM_ALLOC_MANAGED = 3,
	ENTRY_MEM_ALLOC_PITCH = 4,
	ENTRY_MEM_ALLOC_ASYNC = 5,
	ENTRY_MEM_ALLOC_FROM_POOL_ASYNC = 6,
	ENTRY_ARRAY_CREATE = 7,
	ENTRY_ARRAY_3D_CREATE = 8,
	ENTRY_MIPMAPPED_ARRAY_CREATE = 9,
};

/* What a handle or pointer names: a free of one kind never matches an allocation of another. */
enum live_kind {
	LIVE_POINTER = 0,    /* cuMemAlloc*, freed by cuMemFree_v2 / cuMemFreeAsync */
	LIVE_VMM_HANDLE = 1, /* cuMemCreate, freed by cuMemRelease */
	LIVE_ARRAY = 2,      /* cuArrayCreate_v2 / cuArray3DCreate_v2, freed by cuArrayDestroy */
	LIVE_MIPMAP = 3,     /* cuMipmappedArrayCreate, freed by cuMipmappedArrayDestroy */
};

enum handle_kind {
	HANDLE_CONTEXT = 1,
	HANDLE_POOL = 2,
	HANDLE_STREAM = 3,
};

struct guard_key {
	__u64 cgroup_id;
	__u32 device;
	__u32 pad;
};

struct pending_alloc {
	struct guard_key key;
	__u32 kind; /* enum live_kind */
	__u32 pad;
	__u64 size;
	__u64 out;   /* user address the call writes the new pointer or handle to */
	__u64 pitch; /* cuMemAllocPitch_v2: user address of the pitch it returns, else 0 */
	__u64 height;
};

struct live_key {
	__u32 tgid;
	__u32 kind;
	__u64 start_ns; /* the process's start time: a reused tgid is another process */
	__u64 ptr;
};

/* A context, pool or stream of one process, and the device it is on. */
struct handle_key {
	__u32 tgid;
	__u32 kind;
	__u64 start_ns;
	__u64 handle;
};

/* A call that returns a new context, pool or stream through its first argument. */
struct pending_handle {
	__u64 out;
	__u32 kind;
	__u32 device;
	__u32 push; /* cuCtxCreate_*: the new context becomes current */
	__u32 pad;
};

/* CUDA's per-thread context stack, as far as the probes saw it. */
struct ctx_stack {
	__u64 ctx[CTX_STACK];
	__u32 depth; /* may exceed CTX_STACK: then the current context is unknown */
	__u32 pad;
};

/* What one process still holds on one device, to subtract when it exits without freeing. */
struct held_key {
	__u32 tgid;
	__u32 device;
	__u64 start_ns;
};

struct held_bytes {
	__u64 cgroup_id; /* the cgroup of its first counted allocation on the device */
	__s64 bytes;
};

struct live_alloc {
	struct guard_key key;
	__u64 size;
};

struct guard_event {
	__u32 pid;
	__u32 tgid;
	__u64 cgroup_id;
	__u64 size;
	__s64 allocated_bytes; /* the count before this allocation */
	__s64 headroom_bytes;
	__u32 entry;
	__u32 device;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct guard_key);
	__type(value, __s64);
} headroom SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct guard_key);
	__type(value, __s64);
} allocated SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct pending_alloc);
} pending SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct live_key);
	__type(value, struct live_alloc);
} sizes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct handle_key);
	__type(value, __u32);
} handles SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct pending_handle);
} pending_handles SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH); /* an entry per thread, deleted at its exit */
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct ctx_stack);
} contexts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct held_key);
	__type(value, struct held_bytes);
} held SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} events SEC(".maps");

/*
 * The freezes' bound. Every stop this program makes is written to `frozen` first (no entry, no
 * stop), one entry a stop: the key is (tgid, the stopping thread, the stop's CLOCK_BOOTTIME
 * time in ns, bpf_ktime_get_boot_ns), so whoever removes an entry removes exactly that stop and
 * never a later one of the same process. The value carries the process's start time (its group
 * leader's start_boottime, which /proc/<tgid>/stat's starttime is in clock ticks) for the
 * user-side thawer to check the pid still names the process that was stopped, and `owned`,
 * which only the user side writes (the enforcer took that stop over). The stopping thread's own
 * return from the call it was stopped in (it runs again: someone resumed it) removes its entry:
 * a process resumed by anyone is not the thawer's any more, so a tenant that resumes its own
 * process and later stops it itself is never resumed by the thawer. BPF cannot SIGCONT another
 * task, so the thaw itself is user side (thawer.py).
 */
struct frozen_key {
	__u32 tgid;
	__u32 tid;
	__u64 stopped_ns; /* CLOCK_BOOTTIME */
};

struct frozen_value {
	__u64 start_boottime_ns; /* the process's (group leader's) start */
	__u64 cgroup_id;
	__u32 owned; /* written by the user side only */
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH); /* never LRU: an evicted entry would be an unbounded stop */
	__uint(max_entries, 16384);
	__type(key, struct frozen_key);
	__type(value, struct frozen_value);
} frozen SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64); /* bpf_get_current_pid_tgid() of the stopped thread */
	__type(value, struct frozen_key);
} frozen_by_thread SEC(".maps");

/* 0 when the stop is recorded and may be made; otherwise the caller is not stopped. */
static __always_inline int frozen_record(__u64 cgroup_id)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct frozen_key k = {
		.tgid = id >> 32, .tid = (__u32)id, .stopped_ns = bpf_ktime_get_boot_ns(),
	};
	struct frozen_value v = {
		.start_boottime_ns = BPF_CORE_READ(task, group_leader, start_boottime),
		.cgroup_id = cgroup_id,
	};
	if (bpf_map_update_elem(&frozen, &k, &v, BPF_NOEXIST))
		return -1; /* full: a stop nobody would bound is not made */
	bpf_map_update_elem(&frozen_by_thread, &id, &k, BPF_ANY);
	return 0;
}

/* The current thread returns from an allocation call: if it was stopped in it, it runs again. */
static __always_inline void frozen_returned(void)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct frozen_key *k = bpf_map_lookup_elem(&frozen_by_thread, &id);
	if (!k)
		return;
	struct frozen_key done = *k;
	bpf_map_delete_elem(&frozen, &done);
	bpf_map_delete_elem(&frozen_by_thread, &id);
}

static __always_inline __u64 process_start_ns(void)
{
	struct task_struct *task = bpf_get_current_task_btf();
	return BPF_CORE_READ(task, group_leader, start_time);
}

/* The device of a context, pool or stream of this process; -1: not seen created. */
static __always_inline int handle_device(__u32 kind, __u64 handle)
{
	struct handle_key hk = {
		.tgid = bpf_get_current_pid_tgid() >> 32,
		.kind = kind,
		.start_ns = process_start_ns(),
		.handle = handle,
	};
	__u32 *device = bpf_map_lookup_elem(&handles, &hk);
	return device ? (int)*device : -1;
}

/* The device of the calling thread's current context; -1: none, or one not seen created. */
static __always_inline int current_device(void)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct ctx_stack *st = bpf_map_lookup_elem(&contexts, &id);
	if (!st || st->depth == 0 || st->depth > CTX_STACK)
		return -1;
	__u32 top = (st->depth - 1) & (CTX_STACK - 1);
	return handle_device(HANDLE_CONTEXT, st->ctx[top]);
}

static __always_inline int on_alloc(__u64 out, __u64 size, __u32 entry, __u32 kind, int device,
				    __u64 pitch, __u64 height)
{
	if (device < 0 || device >= MAX_DEVICES)
		return 0; /* no device known: not counted, never stopped */
	struct guard_key key = { .cgroup_id = bpf_get_current_cgroup_id(), .device = device };
	__s64 *limit = bpf_map_lookup_elem(&headroom, &key);
	if (!limit)
		return 0; /* not guarded: not counted, never stopped */
	__s64 *count = bpf_map_lookup_elem(&allocated, &key);
	if (!count) {
		__s64 zero = 0;
		bpf_map_update_elem(&allocated, &key, &zero, BPF_NOEXIST);
		count = bpf_map_lookup_elem(&allocated, &key);
		if (!count)
			return 0;
	}
	/* Reserve first, atomically: two threads of one cgroup cannot both slip under. */
	__s64 before = __sync_fetch_and_add(count, (__s64)size);
	__u64 id = bpf_get_current_pid_tgid();
	struct pending_alloc p = {
		.key = key, .kind = kind, .size = size, .out = out, .pitch = pitch,
		.height = height,
	};
	bpf_map_update_elem(&pending, &id, &p, BPF_ANY);
	if (before + (__s64)size > *limit) {
		/* Delivered on the return to user space: the task stops before the entry point's
		 * first instruction runs. */
		if (frozen_record(key.cgroup_id) == 0)
			bpf_send_signal(SIGSTOP);
		struct guard_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
		if (e) {
			e->pid = (__u32)id;
			e->tgid = id >> 32;
			e->cgroup_id = key.cgroup_id;
			e->size = size;
			e->allocated_bytes = before;
			e->headroom_bytes = *limit;
			e->entry = entry;
			e->device = key.device;
			bpf_ringbuf_submit(e, 0);
		}
	}
	return 0;
}

/* The process's own total on the device, subtracted from its cgroup's count if it exits
 * holding it (the driver frees it then, with no free call to see). */
static __always_inline void add_held(__u32 tgid, __u64 start_ns, struct guard_key *key,
				     __s64 bytes)
{
	struct held_key hk = { .tgid = tgid, .device = key->device, .start_ns = start_ns };
	struct held_bytes *h = bpf_map_lookup_elem(&held, &hk);
	if (!h) {
		struct held_bytes fresh = { .cgroup_id = key->cgroup_id };
		bpf_map_update_elem(&held, &hk, &fresh, BPF_NOEXIST);
		h = bpf_map_lookup_elem(&held, &hk);
		if (!h)
			return;
	}
	if (h->cgroup_id == key->cgroup_id) /* moved processes: the first cgroup's bytes only */
		__sync_fetch_and_add(&h->bytes, bytes);
}

static __always_inline int on_alloc_return(long rc)
{
	frozen_returned();
	__u64 id = bpf_get_current_pid_tgid();
	struct pending_alloc *p = bpf_map_lookup_elem(&pending, &id);
	if (!p)
		return 0;
	struct pending_alloc done = *p;
	bpf_map_delete_elem(&pending, &id);
	__s64 *count = bpf_map_lookup_elem(&allocated, &done.key);
	if (rc != 0) {
		if (count)
			__sync_fetch_and_add(count, -(__s64)done.size);
		return 0;
	}
	__u64 size = done.size;
	if (done.pitch) {
		__u64 pitch = 0;
		if (bpf_probe_read_user(&pitch, sizeof(pitch), (void *)done.pitch) == 0 &&
		    pitch * done.height > done.size) {
			if (count)
				__sync_fetch_and_add(count, (__s64)(pitch * done.height - done.size));
			size = pitch * done.height;
		}
	}
	struct live_key lk = {
		.tgid = id >> 32, .kind = done.kind, .start_ns = process_start_ns(),
	};
	add_held(lk.tgid, lk.start_ns, &done.key, (__s64)size);
	if (bpf_probe_read_user(&lk.ptr, sizeof(lk.ptr), (void *)done.out) != 0)
		return 0; /* the pointer is unknown: its free will not be subtracted */
	struct live_alloc la = { .key = done.key, .size = size };
	bpf_map_update_elem(&sizes, &lk, &la, BPF_ANY);
	return 0;
}

static __always_inline int on_free(__u64 ptr, __u32 kind)
{
	struct live_key lk = {
		.tgid = bpf_get_current_pid_tgid() >> 32,
		.kind = kind,
		.start_ns = process_start_ns(),
		.ptr = ptr,
	};
	struct live_alloc *la = bpf_map_lookup_elem(&sizes, &lk);
	if (!la)
		return 0; /* not allocated under a guard (or before the probe attached) */
	struct live_alloc gone = *la;
	bpf_map_delete_elem(&sizes, &lk);
	__s64 *count = bpf_map_lookup_elem(&allocated, &gone.key);
	if (count)
		__sync_fetch_and_add(count, -(__s64)gone.size);
	add_held(lk.tgid, lk.start_ns, &gone.key, -(__s64)gone.size);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc, __u64 dptr, __u64 size)
{
	return on_alloc(dptr, size, ENTRY_MEM_ALLOC, LIVE_POINTER, current_device(), 0, 0);
}

/* cuMemCreate(handle*, size, const CUmemAllocationProp *prop, flags): the device is the prop's
 * location (offset 8: type, 12: id, as in cuda.h), not the context's. */
SEC("uprobe")
int BPF_KPROBE(mem_create, __u64 handle, __u64 size, __u64 prop)
{
	__s32 location[2] = { 0, -1 };
	if (bpf_probe_read_user(location, sizeof(location), (void *)(prop + 8)) != 0 ||
	    location[0] != CU_MEM_LOCATION_TYPE_DEVICE)
		return 0; /* host memory, or a prop we cannot read: no device */
	return on_alloc(handle, size, ENTRY_MEM_CREATE, LIVE_VMM_HANDLE, location[1], 0, 0);
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc_managed, __u64 dptr, __u64 size)
{
	return on_alloc(dptr, size, ENTRY_MEM_ALLOC_MANAGED, LIVE_POINTER, current_device(), 0, 0);
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc_pitch, __u64 dptr, __u64 pitch, __u64 width, __u64 height)
{
	return on_alloc(dptr, width * height, ENTRY_MEM_ALLOC_PITCH, LIVE_POINTER,
			current_device(), pitch, height);
}

/* The stream's device; the NULL (0), legacy (1) and per-thread (2) streams are the current
 * context's. */
static __always_inline int stream_device(__u64 stream)
{
	if (stream <= 2)
		return current_device();
	return handle_device(HANDLE_STREAM, stream);
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc_async, __u64 dptr, __u64 size, __u64 stream)
{
	return on_alloc(dptr, size, ENTRY_MEM_ALLOC_ASYNC, LIVE_POINTER, stream_device(stream), 0,
			0);
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc_from_pool_async, __u64 dptr, __u64 size, __u64 pool)
{
	return on_alloc(dptr, size, ENTRY_MEM_ALLOC_FROM_POOL_ASYNC, LIVE_POINTER,
			handle_device(HANDLE_POOL, pool), 0, 0);
}

static __always_inline __u64 format_bytes(__u32 format)
{
	switch (format) {
	case 0x01: /* UNSIGNED_INT8 */
	case 0x08: /* SIGNED_INT8 */
		return 1;
	case 0x02: /* UNSIGNED_INT16 */
	case 0x09: /* SIGNED_INT16 */
	case 0x10: /* HALF */
		return 2;
	default: /* INT32, FLOAT, and any format not listed here */
		return 4;
	}
}

/* CUDA_ARRAY_DESCRIPTOR: Width (0), Height (8), Format (16), NumChannels (20). */
SEC("uprobe")
int BPF_KPROBE(array_create, __u64 handle, __u64 desc)
{
	struct { __u64 width, height; __u32 format, channels; } d;
	if (bpf_probe_read_user(&d, sizeof(d), (void *)desc) != 0)
		return 0;
	__u64 size = d.width * (d.height ? d.height : 1) * d.channels * format_bytes(d.format);
	return on_alloc(handle, size, ENTRY_ARRAY_CREATE, LIVE_ARRAY, current_device(), 0, 0);
}

struct array3d_descriptor {
	__u64 width, height, depth;
	__u32 format, channels, flags, pad;
};

static __always_inline __u64 array3d_bytes(struct array3d_descriptor *d)
{
	return d->width * (d->height ? d->height : 1) * (d->depth ? d->depth : 1) * d->channels *
	       format_bytes(d->format);
}

/* CUDA_ARRAY3D_DESCRIPTOR: Width (0), Height (8), Depth (16), Format (24), NumChannels (28). */
SEC("uprobe")
int BPF_KPROBE(array_3d_create, __u64 handle, __u64 desc)
{
	struct array3d_descriptor d;
	if (bpf_probe_read_user(&d, sizeof(d), (void *)desc) != 0)
		return 0;
	return on_alloc(handle, array3d_bytes(&d), ENTRY_ARRAY_3D_CREATE, LIVE_ARRAY,
			current_device(), 0, 0);
}

/* Each level halves every dimension (down to 1), as the driver's mipmap chain does. */
SEC("uprobe")
int BPF_KPROBE(mipmapped_array_create, __u64 handle, __u64 desc, __u32 levels)
{
	struct array3d_descriptor d;
	if (bpf_probe_read_user(&d, sizeof(d), (void *)desc) != 0)
		return 0;
	__u64 size = 0;
	for (__u32 i = 0; i < MIP_LEVELS && i < levels; i++) {
		size += array3d_bytes(&d);
		d.width = d.width > 1 ? d.width / 2 : 1;
		d.height = d.height > 1 ? d.height / 2 : d.height;
		d.depth = d.depth > 1 ? d.depth / 2 : d.depth;
	}
	return on_alloc(handle, size, ENTRY_MIPMAPPED_ARRAY_CREATE, LIVE_MIPMAP, current_device(),
			0, 0);
}

SEC("uretprobe")
int BPF_KRETPROBE(alloc_return, long rc)
{
	return on_alloc_return((int)rc);
}

SEC("uprobe")
int BPF_KPROBE(mem_free, __u64 ptr)
{
	return on_free(ptr, LIVE_POINTER);
}

SEC("uprobe")
int BPF_KPROBE(mem_release, __u64 handle)
{
	return on_free(handle, LIVE_VMM_HANDLE);
}

SEC("uprobe")
int BPF_KPROBE(array_destroy, __u64 handle)
{
	return on_free(handle, LIVE_ARRAY);
}

SEC("uprobe")
int BPF_KPROBE(mipmapped_array_destroy, __u64 handle)
{
	return on_free(handle, LIVE_MIPMAP);
}

/* --- Devices: contexts, pools and streams, recorded when the call that makes one returns. --- */

static __always_inline int expect_handle(__u64 out, __u32 kind, int device, __u32 push)
{
	if (device < 0 || device >= MAX_DEVICES)
		return 0;
	__u64 id = bpf_get_current_pid_tgid();
	struct pending_handle p = { .out = out, .kind = kind, .device = device, .push = push };
	bpf_map_update_elem(&pending_handles, &id, &p, BPF_ANY);
	return 0;
}

static __always_inline void push_context(__u64 ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct ctx_stack *st = bpf_map_lookup_elem(&contexts, &id);
	if (!st) {
		struct ctx_stack fresh = {};
		bpf_map_update_elem(&contexts, &id, &fresh, BPF_NOEXIST);
		st = bpf_map_lookup_elem(&contexts, &id);
		if (!st)
			return;
	}
	if (st->depth < CTX_STACK)
		st->ctx[st->depth & (CTX_STACK - 1)] = ctx;
	if (st->depth < 0xffff)
		st->depth++;
}

static __always_inline void pop_context(void)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct ctx_stack *st = bpf_map_lookup_elem(&contexts, &id);
	if (st && st->depth > 0)
		st->depth--;
}

SEC("uretprobe")
int BPF_KRETPROBE(handle_return, long rc)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct pending_handle *p = bpf_map_lookup_elem(&pending_handles, &id);
	if (!p)
		return 0;
	struct pending_handle done = *p;
	bpf_map_delete_elem(&pending_handles, &id);
	if ((int)rc != 0)
		return 0;
	struct handle_key hk = {
		.tgid = id >> 32, .kind = done.kind, .start_ns = process_start_ns(),
	};
	if (bpf_probe_read_user(&hk.handle, sizeof(hk.handle), (void *)done.out) != 0)
		return 0;
	bpf_map_update_elem(&handles, &hk, &done.device, BPF_ANY);
	if (done.push)
		push_context(hk.handle);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(ctx_create_v2, __u64 pctx, __u32 flags, __s32 dev)
{
	return expect_handle(pctx, HANDLE_CONTEXT, dev, 1);
}

SEC("uprobe")
int BPF_KPROBE(ctx_create_v3, __u64 pctx, __u64 params, __s32 n, __u32 flags, __s32 dev)
{
	return expect_handle(pctx, HANDLE_CONTEXT, dev, 1);
}

SEC("uprobe")
int BPF_KPROBE(ctx_create_v4, __u64 pctx, __u64 params, __u32 flags, __s32 dev)
{
	return expect_handle(pctx, HANDLE_CONTEXT, dev, 1);
}

/* cuDevicePrimaryCtxRetain(pctx, dev) and cuDeviceGet{Default,}MemPool(pool, dev). */
SEC("uprobe")
int BPF_KPROBE(primary_ctx_retain, __u64 pctx, __s32 dev)
{
	return expect_handle(pctx, HANDLE_CONTEXT, dev, 0);
}

SEC("uprobe")
int BPF_KPROBE(device_mem_pool, __u64 pool, __s32 dev)
{
	return expect_handle(pool, HANDLE_POOL, dev, 0);
}

/* cuMemPoolCreate(pool*, const CUmemPoolProps *props): location at offset 8, as in cuda.h. */
SEC("uprobe")
int BPF_KPROBE(mem_pool_create, __u64 pool, __u64 props)
{
	__s32 location[2] = { 0, -1 };
	if (bpf_probe_read_user(location, sizeof(location), (void *)(props + 8)) != 0 ||
	    location[0] != CU_MEM_LOCATION_TYPE_DEVICE)
		return 0;
	return expect_handle(pool, HANDLE_POOL, location[1], 0);
}

/* cuStreamCreate / cuStreamCreateWithPriority: the stream is on the current context's device. */
SEC("uprobe")
int BPF_KPROBE(stream_create, __u64 stream)
{
	return expect_handle(stream, HANDLE_STREAM, current_device(), 0);
}

/* The context calls below change the stack at their entry: they fail only on a context the
 * caller does not have, which no probe recorded a device for (it is then unknown, not wrong). */

SEC("uprobe")
int BPF_KPROBE(ctx_set_current, __u64 context)
{
	if (!context) {
		pop_context(); /* cuda.h: setting NULL pops the top */
		return 0;
	}
	__u64 id = bpf_get_current_pid_tgid();
	struct ctx_stack *st = bpf_map_lookup_elem(&contexts, &id);
	if (!st || st->depth == 0) {
		push_context(context);
		return 0;
	}
	if (st->depth <= CTX_STACK)
		st->ctx[(st->depth - 1) & (CTX_STACK - 1)] = context;
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(ctx_push_current, __u64 context)
{
	push_context(context);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(ctx_pop_current)
{
	pop_context();
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(ctx_destroy, __u64 context)
{
	struct handle_key hk = {
		.tgid = bpf_get_current_pid_tgid() >> 32,
		.kind = HANDLE_CONTEXT,
		.start_ns = process_start_ns(),
		.handle = context,
	};
	bpf_map_delete_elem(&handles, &hk);
	__u64 id = bpf_get_current_pid_tgid();
	struct ctx_stack *st = bpf_map_lookup_elem(&contexts, &id);
	if (st && st->depth > 0 && st->depth <= CTX_STACK &&
	    st->ctx[(st->depth - 1) & (CTX_STACK - 1)] == context)
		st->depth--; /* cuda.h: destroying the current context pops it */
	return 0;
}

/* --- Exit: a thread's context stack goes with it; the last thread's exit gives back what the
 * process still held (the driver frees it with the process). --- */

SEC("tp_btf/sched_process_exit")
int BPF_PROG(process_exit, struct task_struct *task)
{
	__u64 id = bpf_get_current_pid_tgid();
	bpf_map_delete_elem(&contexts, &id);
	/* Killed inside an allocation (stopped by this guard, then killed): what its entry
	 * reserved was never allocated. */
	struct pending_alloc *p = bpf_map_lookup_elem(&pending, &id);
	if (p) {
		__s64 *reserved = bpf_map_lookup_elem(&allocated, &p->key);
		if (reserved)
			__sync_fetch_and_add(reserved, -(__s64)p->size);
		bpf_map_delete_elem(&pending, &id);
	}
	bpf_map_delete_elem(&pending_handles, &id);
	if (BPF_CORE_READ(task, signal, live.counter) != 0)
		return 0; /* other threads live on: the process still holds its memory */
	struct held_key hk = { .tgid = id >> 32, .start_ns = process_start_ns() };
	for (__u32 d = 0; d < MAX_DEVICES; d++) {
		hk.device = d;
		struct held_bytes *h = bpf_map_lookup_elem(&held, &hk);
		if (!h)
			continue;
		struct guard_key key = { .cgroup_id = h->cgroup_id, .device = d };
		__s64 *count = bpf_map_lookup_elem(&allocated, &key);
		if (count)
			__sync_fetch_and_add(count, -h->bytes);
		bpf_map_delete_elem(&held, &hk);
	}
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
