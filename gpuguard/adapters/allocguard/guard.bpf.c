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
 * Phase 1 limits: the device is always 0 (the CUDA context's device is not read); the counted
 * size of cuMemAllocPitch_v2 is the pitch the call returned times the height.
 */
#include "vmlinux.h"
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#define SIGSTOP 19
#define DEVICE 0

enum entry_point {
	ENTRY_MEM_ALLOC = 1,
	ENTRY_MEM_CREATE = 2,
	ENTRY_MEM_ALLOC_MANAGED = 3,
	ENTRY_MEM_ALLOC_PITCH = 4,
	ENTRY_MEM_ALLOC_ASYNC = 5,
};

struct guard_key {
	__u64 cgroup_id;
	__u32 device;
	__u32 pad;
};

struct pending_alloc {
	struct guard_key key;
	__u64 size;
	__u64 out;   /* user address the call writes the new pointer or handle to */
	__u64 pitch; /* cuMemAllocPitch_v2: user address of the pitch it returns, else 0 */
	__u64 height;
};

struct live_key {
	__u32 tgid;
	__u32 pad;
	__u64 ptr;
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

static __always_inline int on_alloc(__u64 out, __u64 size, __u32 entry, __u64 pitch,
				    __u64 height)
{
	struct guard_key key = { .cgroup_id = bpf_get_current_cgroup_id(), .device = DEVICE };
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
		.key = key, .size = size, .out = out, .pitch = pitch, .height = height,
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
			e->device = DEVICE;
			bpf_ringbuf_submit(e, 0);
		}
	}
	return 0;
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
	struct live_key lk = { .tgid = id >> 32 };
	if (bpf_probe_read_user(&lk.ptr, sizeof(lk.ptr), (void *)done.out) != 0)
		return 0; /* the pointer is unknown: its free will not be subtracted */
	struct live_alloc la = { .key = done.key, .size = size };
	bpf_map_update_elem(&sizes, &lk, &la, BPF_ANY);
	return 0;
}

static __always_inline int on_free(__u64 ptr)
{
	struct live_key lk = { .tgid = bpf_get_current_pid_tgid() >> 32, .ptr = ptr };
	struct live_alloc *la = bpf_map_lookup_elem(&sizes, &lk);
	if (!la)
		return 0; /* not allocated under a guard (or before the probe attached) */
	__s64 *count = bpf_map_lookup_elem(&allocated, &la->key);
	if (count)
		__sync_fetch_and_add(count, -(__s64)la->size);
	bpf_map_delete_elem(&sizes, &lk);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc, __u64 dptr, __u64 size)
{
	return on_alloc(dptr, size, ENTRY_MEM_ALLOC, 0, 0);
}

SEC("uprobe")
int BPF_KPROBE(mem_create, __u64 handle, __u64 size)
{
	return on_alloc(handle, size, ENTRY_MEM_CREATE, 0, 0);
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc_managed, __u64 dptr, __u64 size)
{
	return on_alloc(dptr, size, ENTRY_MEM_ALLOC_MANAGED, 0, 0);
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc_pitch, __u64 dptr, __u64 pitch, __u64 width, __u64 height)
{
	return on_alloc(dptr, width * height, ENTRY_MEM_ALLOC_PITCH, pitch, height);
}

SEC("uprobe")
int BPF_KPROBE(mem_alloc_async, __u64 dptr, __u64 size)
{
	return on_alloc(dptr, size, ENTRY_MEM_ALLOC_ASYNC, 0, 0);
}

SEC("uretprobe")
int BPF_KRETPROBE(alloc_return, long rc)
{
	return on_alloc_return((int)rc);
}

SEC("uprobe")
int BPF_KPROBE(mem_free, __u64 ptr)
{
	return on_free(ptr);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
