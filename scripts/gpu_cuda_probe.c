// SPDX-License-Identifier: Apache-2.0
/*
 * The smallest real CUDA workload of the allocation guard's GPU run (scripts/gpu_allocguard.py):
 * it dlopen()s the driver's libcuda.so.1 (no CUDA toolkit needed to build it: `cc -O2 -o
 * gpu_cuda_probe gpu_cuda_probe.c -ldl`), makes a context on device 0 and, by mode:
 *
 *   addrs        for each allocation entry point the guard probes, the address dlsym() gives
 *                for the exported (versioned) symbol and the one cuGetProcAddress gives for its
 *                base name, as the CUDA runtime (and so PyTorch) resolves it, with both offsets
 *                in the library file: a uprobe on the exported symbol sees the runtime's calls
 *                only where the two are the same function.
 *   bench N B    N pairs of cuMemAlloc_v2(B) + cuMemFree_v2, each pair timed with
 *                CLOCK_MONOTONIC: p50, p99 and mean nanoseconds per pair.
 *   hold S K     prints {"ready": pid}, waits for a line on stdin, then K steps of
 *                cuMemAlloc_v2(S MiB); before each call a line with the step and
 *                CLOCK_MONOTONIC nanoseconds, after it one with the result; then it waits for
 *                its end (SIGKILL from the script that started it).
 *
 * Every line is one JSON object on stdout, flushed at once. Exit 2 when the driver cannot be
 * loaded or a call fails, with the reason.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static CUresult (*cu_init)(unsigned int);
static CUresult (*cu_device_get)(CUdevice *, int);
static CUresult (*cu_ctx_create)(CUcontext *, unsigned int, CUdevice);
static CUresult (*cu_mem_alloc)(CUdeviceptr *, size_t);
static CUresult (*cu_mem_free)(CUdeviceptr);
static CUresult (*cu_driver_version)(int *);
static CUresult (*cu_proc_v2)(const char *, void **, int, uint64_t, int *);
static CUresult (*cu_proc)(const char *, void **, int, uint64_t);

static void *lib;

static void fail(const char *what, long code)
{
	printf("{\"error\": \"%s\", \"code\": %ld}\n", what, code);
	fflush(stdout);
	exit(2);
}

static void *need(const char *name)
{
	void *p = dlsym(lib, name);
	if (!p)
		fail(name, -1);
	return p;
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void context(void)
{
	CUdevice dev;
	CUcontext ctx;
	CUresult rc;
	if ((rc = cu_init(0)) != 0)
		fail("cuInit", rc);
	if ((rc = cu_device_get(&dev, 0)) != 0)
		fail("cuDeviceGet", rc);
	if ((rc = cu_ctx_create(&ctx, 0, dev)) != 0)
		fail("cuCtxCreate_v2", rc);
}

/* The exported symbol the guard probes, and the base name the runtime asks cuGetProcAddress. */
static const char *const entries[][2] = {
	{ "cuMemAlloc_v2", "cuMemAlloc" },
	{ "cuMemFree_v2", "cuMemFree" },
	{ "cuMemAllocManaged", "cuMemAllocManaged" },
	{ "cuMemAllocPitch_v2", "cuMemAllocPitch" },
	{ "cuMemCreate", "cuMemCreate" },
	{ "cuMemRelease", "cuMemRelease" },
	{ "cuMemAllocAsync", "cuMemAllocAsync" },
	{ "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync" },
	{ "cuMemFreeAsync", "cuMemFreeAsync" },
	{ "cuCtxCreate_v2", "cuCtxCreate" },
	{ "cuCtxSetCurrent", "cuCtxSetCurrent" },
	{ "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain" },
};

static long offset_of(void *p)
{
	Dl_info info;
	if (!p || !dladdr(p, &info) || !info.dli_fbase)
		return -1;
	return (long)((char *)p - (char *)info.dli_fbase);
}

static void addrs(void)
{
	int version = 0;
	cu_driver_version(&version);
	Dl_info self;
	dladdr((void *)cu_init, &self);
	printf("{\"driver_version\": %d, \"library\": \"%s\"}\n", version,
	       self.dli_fname ? self.dli_fname : "");
	for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++) {
		for (int ptds = 0; ptds < 2; ptds++) {
			void *exported = dlsym(lib, entries[i][0]);
			void *resolved = NULL;
			CUresult rc;
			int status = -1;
			if (cu_proc_v2)
				rc = cu_proc_v2(entries[i][1], &resolved, version, (uint64_t)ptds, &status);
			else
				rc = cu_proc(entries[i][1], &resolved, version, (uint64_t)ptds);
			printf("{\"symbol\": \"%s\", \"name\": \"%s\", \"per_thread_stream\": %s, "
			       "\"exported_offset\": %ld, \"resolved_offset\": %ld, \"rc\": %d, "
			       "\"status\": %d, \"same\": %s}\n",
			       entries[i][0], entries[i][1], ptds ? "true" : "false", offset_of(exported),
			       offset_of(resolved), rc, status,
			       exported && exported == resolved ? "true" : "false");
		}
	}
	fflush(stdout);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static void bench(long n, size_t bytes)
{
	uint64_t *took = calloc((size_t)n, sizeof(*took));
	if (!took)
		fail("calloc", n);
	for (int warm = 0; warm < 100; warm++) {
		CUdeviceptr p;
		if (cu_mem_alloc(&p, bytes) == 0)
			cu_mem_free(p);
	}
	long failed = 0;
	for (long i = 0; i < n; i++) {
		CUdeviceptr p;
		uint64_t t0 = now_ns();
		CUresult rc = cu_mem_alloc(&p, bytes);
		if (rc == 0)
			cu_mem_free(p);
		else
			failed++;
		took[i] = now_ns() - t0;
	}
	double sum = 0;
	for (long i = 0; i < n; i++)
		sum += (double)took[i];
	qsort(took, (size_t)n, sizeof(*took), cmp_u64);
	printf("{\"pairs\": %ld, \"bytes\": %zu, \"failed\": %ld, \"p50_ns\": %llu, "
	       "\"p99_ns\": %llu, \"mean_ns\": %.1f}\n",
	       n, bytes, failed, (unsigned long long)took[n / 2],
	       (unsigned long long)took[(n * 99) / 100], sum / (double)n);
	fflush(stdout);
	free(took);
}

static void hold(size_t step_mib, long steps)
{
	printf("{\"ready\": %d}\n", (int)getpid());
	fflush(stdout);
	for (int c = getchar(); c != EOF && c != '\n'; c = getchar())
		;
	for (long i = 0; i < steps; i++) {
		CUdeviceptr p;
		printf("{\"step\": %ld, \"before_ns\": %llu}\n", i, (unsigned long long)now_ns());
		fflush(stdout);
		CUresult rc = cu_mem_alloc(&p, step_mib << 20);
		printf("{\"step\": %ld, \"rc\": %d, \"after_ns\": %llu}\n", i, rc,
		       (unsigned long long)now_ns());
		fflush(stdout);
		if (rc != 0)
			break;
	}
	printf("{\"holding\": true}\n");
	fflush(stdout);
	for (;;)
		pause();
}

int main(int argc, char **argv)
{
	if (argc < 2)
		fail("usage: gpu_cuda_probe addrs | bench N BYTES | hold STEP_MIB STEPS", 0);
	lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib)
		fail("dlopen libcuda.so.1", 0);
	cu_init = need("cuInit");
	cu_device_get = need("cuDeviceGet");
	cu_ctx_create = need("cuCtxCreate_v2");
	cu_mem_alloc = need("cuMemAlloc_v2");
	cu_mem_free = need("cuMemFree_v2");
	cu_driver_version = need("cuDriverGetVersion");
	cu_proc_v2 = dlsym(lib, "cuGetProcAddress_v2");
	cu_proc = dlsym(lib, "cuGetProcAddress");
	if (!cu_proc_v2 && !cu_proc)
		fail("cuGetProcAddress", -1);
	context();
	if (!strcmp(argv[1], "addrs")) {
		addrs();
	} else if (!strcmp(argv[1], "bench") && argc == 4) {
		bench(atol(argv[2]), (size_t)atol(argv[3]));
	} else if (!strcmp(argv[1], "hold") && argc == 4) {
		hold((size_t)atol(argv[2]), atol(argv[3]));
	} else {
		fail("unknown mode", 0);
	}
	return 0;
}
