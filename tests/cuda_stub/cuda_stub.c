/*
 * A stand-in for the driver API's libcuda.so.1: the allocation and free entry points the eBPF
 * allocation guard (gpuguard/adapters/allocguard/) attaches uprobes to, with the real names,
 * argument order and return type, so a test process calls them exactly as CUDA code would. No
 * GPU: an allocation returns a fresh address from a counter and adds its size to a total that
 * cuStubAllocatedBytes() reports; a free subtracts what the matching allocation took.
 *
 * Contexts, pools and streams are handles from the same counter; a context's device and a
 * pool's location are kept only so a wrong argument fails as the driver would (the stand-in has
 * no devices, any ordinal 0..15 is valid). The arrays take width x height x depth x channels x
 * element size, as the guard counts them.
 *
 * Each entry point is exported, never inlined and does visible work, so the symbol has its own
 * code that a uprobe on its address sees on every call (noinline + a store the compiler keeps).
 * Not thread-safe beyond what a test needs: one mutex around the table.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define API __attribute__((visibility("default"), noinline, used))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;
typedef void *CUcontext;
typedef void *CUmemoryPool;
typedef void *CUarray;
typedef void *CUmipmappedArray;
typedef int CUdevice;

typedef struct {
    int type; /* CUmemLocationType: 1 device */
    int id;
} CUmemLocation;

typedef struct { /* CUmemAllocationProp: the fields before location, then location */
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;

typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

typedef struct {
    size_t Width, Height;
    unsigned int Format, NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct {
    size_t Width, Height, Depth;
    unsigned int Format, NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define SLOTS 4096
#define DEVICES 16

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

API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                     CUstream stream) {
    (void)stream;
    if (pool == NULL) return CUDA_ERROR_INVALID_VALUE;
    return take(dptr, bytesize);
}

/* The per-thread-default-stream twins (cuda.h's CUDA_API_PER_THREAD_DEFAULT_STREAM). */
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {
    (void)stream;
    return take(dptr, bytesize);
}

API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
    (void)stream;
    return give_back(dptr);
}

API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                          CUstream stream) {
    (void)stream;
    if (pool == NULL) return CUDA_ERROR_INVALID_VALUE;
    return take(dptr, bytesize);
}

/* Handles: a fresh address, never freed (contexts, pools, streams hold no memory here). */
static unsigned long long next_handle = 0x5500000000ULL;

static CUresult new_handle(void **out) {
    if (out == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    next_handle += 0x100ULL;
    *out = (void *)(uintptr_t)next_handle;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

static CUresult device_handle(void **out, CUdevice dev) {
    if (dev < 0 || dev >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
    return new_handle(out);
}

/* The context stack is the guard's business, not the stand-in's: these record nothing. */
API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return device_handle(pctx, dev);
}

API CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags,
                            CUdevice dev) {
    (void)paramsArray;
    (void)numParams;
    (void)flags;
    return device_handle(pctx, dev);
}

API CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags,
                            CUdevice dev) {
    (void)ctxCreateParams;
    (void)flags;
    return device_handle(pctx, dev);
}

static CUcontext primary[DEVICES];

/* The same context for a device every time, as the driver's primary context is. */
API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
    if (primary[dev] == NULL && new_handle(&primary[dev]) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = primary[dev];
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    return dev >= 0 && dev < DEVICES ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static volatile CUcontext last_context; /* a store the compiler keeps: the bodies differ */

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    last_context = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    if (ctx == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    last_context = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    if (pctx != NULL) *pctx = last_context;
    return CUDA_SUCCESS;
}

API CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (ctx == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    last_context = NULL;
    return CUDA_SUCCESS;
}

API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    if (props == NULL || props->location.type != 1) return CUDA_ERROR_INVALID_VALUE;
    return device_handle(pool, props->location.id);
}

API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    return device_handle(pool, dev);
}

API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    return device_handle(pool, dev);
}

API CUresult cuStreamCreate(CUstream *stream, unsigned int flags) {
    (void)flags;
    return new_handle(stream);
}

API CUresult cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority) {
    (void)flags;
    (void)priority;
    return new_handle(stream);
}

static size_t element_bytes(unsigned int format) {
    switch (format) {
    case 0x01:
    case 0x08:
        return 1;
    case 0x02:
    case 0x09:
    case 0x10:
        return 2;
    default:
        return 4;
    }
}

static size_t array3d_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d) {
    return d->Width * (d->Height ? d->Height : 1) * (d->Depth ? d->Depth : 1) * d->NumChannels *
           element_bytes(d->Format);
}

API CUresult cuArrayCreate_v2(CUarray *handle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    if (desc == NULL) return CUDA_ERROR_INVALID_VALUE;
    return take((unsigned long long *)handle, desc->Width * (desc->Height ? desc->Height : 1) *
                                                  desc->NumChannels * element_bytes(desc->Format));
}

API CUresult cuArray3DCreate_v2(CUarray *handle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    if (desc == NULL) return CUDA_ERROR_INVALID_VALUE;
    return take((unsigned long long *)handle, array3d_bytes(desc));
}

API CUresult cuMipmappedArrayCreate(CUmipmappedArray *handle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                    unsigned int levels) {
    if (desc == NULL || levels == 0) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR level = *desc;
    size_t total = 0;
    for (unsigned int i = 0; i < levels && i < 16; i++) {
        total += array3d_bytes(&level);
        level.Width = level.Width > 1 ? level.Width / 2 : 1;
        level.Height = level.Height > 1 ? level.Height / 2 : level.Height;
        level.Depth = level.Depth > 1 ? level.Depth / 2 : level.Depth;
    }
    return take((unsigned long long *)handle, total);
}

API CUresult cuArrayDestroy(CUarray handle) { return give_back((unsigned long long)(uintptr_t)handle); }

API CUresult cuMipmappedArrayDestroy(CUmipmappedArray handle) {
    return give_back((unsigned long long)(uintptr_t)handle);
}

/* Not CUDA: what the stand-in holds now, for the tests. */
API unsigned long long cuStubAllocatedBytes(void) {
    pthread_mutex_lock(&lock);
    unsigned long long held = allocated_bytes;
    pthread_mutex_unlock(&lock);
    return held;
}

/* ---- What a CUDA program asks before it allocates: the device, the driver's version, and the
 * entry points by base name (how the CUDA runtime resolves them; scripts/gpu_cuda_probe.c
 * compares them with the exported symbols the guard probes). ---- */

API CUresult cuDeviceGet(int *device, int ordinal) {
    if (device == NULL || ordinal < 0) return CUDA_ERROR_INVALID_VALUE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *version) {
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = 13000;
    return CUDA_SUCCESS;
}

/* The base name → this stand-in's versioned entry point (the driver's table does the same). */
static const struct {
    const char *name;
    void *fn;
} proc_table[] = {
    {"cuMemAlloc", (void *)cuMemAlloc_v2},
    {"cuMemFree", (void *)cuMemFree_v2},
    {"cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuCtxCreate", (void *)cuCtxCreate_v2},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
};

API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
                                 unsigned long long flags, int *status) {
    (void)cuda_version;
    (void)flags;
    if (symbol == NULL || pfn == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof(proc_table) / sizeof(proc_table[0]); i++) {
        if (strcmp(proc_table[i].name, symbol) == 0) {
            *pfn = proc_table[i].fn;
            if (status) *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
            return CUDA_SUCCESS;
        }
    }
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return 500;              /* CUDA_ERROR_NOT_FOUND */
}
