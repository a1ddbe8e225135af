/* A stand-in for libcuda.so.1 with the four entry points the emulation's preload wraps, for
 * machines without a GPU (CI): cuMemHostRegister refuses IOMEMORY as the real driver does for
 * memory that is no device BAR, and records the flags it was called with;
 * cuMemGetHandleForAddressRange hands out a memfd as its "dma-buf". */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_FOUND 500
#define IOMEMORY 0x04u

static unsigned last_flags = 0xffffffffu;

unsigned fake_last_host_register_flags(void) { return last_flags; }

int cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
    (void)p;
    (void)len;
    last_flags = flags;
    return (flags & IOMEMORY) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

int cuMemHostRegister(void *p, size_t len, unsigned flags) {
    return cuMemHostRegister_v2(p, len, flags);
}

int cuMemGetHandleForAddressRange(void *handle, uint64_t dptr, size_t size, int type,
                                  unsigned long long flags) {
    (void)dptr;
    (void)size;
    (void)flags;
    if (type != 1) return CUDA_ERROR_INVALID_VALUE;
    *(int *)handle = memfd_create("fake-dmabuf", MFD_CLOEXEC);
    return CUDA_SUCCESS;
}

int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                        int *status);

static void *lookup(const char *symbol) {
    if (!strcmp(symbol, "cuMemHostRegister")) return (void *)cuMemHostRegister_v2;
    if (!strcmp(symbol, "cuMemGetHandleForAddressRange"))
        return (void *)cuMemGetHandleForAddressRange;
    if (!strcmp(symbol, "cuGetProcAddress")) return (void *)cuGetProcAddress_v2;
    return 0;
}

int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                        int *status) {
    (void)version;
    (void)flags;
    *pfn = lookup(symbol);
    if (status) *status = *pfn ? 0 : 1;
    return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
