/*
 * A stand-in for the driver API's libcuda.so.1: the allocation and free entry points the eBPF
 * allocation guard (gpuguard/adapters/allocguard/) attaches uprobes to, with the real names,
 * argument order and return type, so a test process calls them exactly as CUDA code would. No
 * GPU: an allocation returns a fresh address from a counter and adds its size to a total that
 * cuStubAllocatedBytes() reports; a free subtracts what the matching allocation took.
 *
 * Each entry point is exported, never inlined and does visible work, so the symbol has its own
 * code that a uprobe on its address sees on every call (noinline + a store the compiler keeps).
 * Not thread-safe beyond what a test needs: one mutex around the table.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define API __attribute__((visibility("default"), noinline, used))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define SLOTS 4096

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long next_address = 0x7f0000000000ULL;
static unsigned long long allocated_bytes;
static struct { unsigned long long address, size; } table[SLOTS];

static CUresult take(unsigned long long *out, size_t size) {
    if (out == NULL) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < SLOTS; i++) {
        if (table[i].address == 0) {
            table[i].address = next_address;
            table[i].size = size;
            *out = next_address;
            next_address += (size + 0xfffULL) & ~0xfffULL;
            next_address += 0x1000ULL; /* never 0, never reused while the run lasts */
            allocated_bytes += size;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

static CUresult give_back(unsigned long long address) {
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < SLOTS; i++) {
        if (address != 0 && table[i].address == address) {
            allocated_bytes -= table[i].size;
            table[i].address = 0;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

API CUresult cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return take(dptr, bytesize); }

API CUresult cuMemFree_v2(CUdeviceptr dptr) { return give_back(dptr); }

/* The VMM path (PyTorch's expandable segments): a handle, size in the second argument. */
API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const void *prop,
                         unsigned long long flags) {
    (void)prop;
    (void)flags;
    return take(handle, size);
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { return give_back(handle); }

API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    (void)flags;
    return take(dptr, bytesize);
}

/* Pitch = width rounded up to 512 bytes; takes pitch * height. */
API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width_bytes,
                                size_t height, unsigned int element_size_bytes) {
    (void)element_size_bytes;
    if (pitch == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pitch = (width_bytes + 511U) & ~(size_t)511U;
    return take(dptr, *pitch * height);
}

API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {
    (void)stream;
    return take(dptr, bytesize);
}

API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    (void)stream;
    return give_back(dptr);
}

/* Not CUDA: what the stand-in holds now, for the tests. */
API unsigned long long cuStubAllocatedBytes(void) {
    pthread_mutex_lock(&lock);
    unsigned long long held = allocated_bytes;
    pthread_mutex_unlock(&lock);
    return held;
}
