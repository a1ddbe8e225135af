/* A stand-in for libcuda.so.1 with the entry points the emulation's preload wraps, for
 * machines without a GPU (CI): cuMemHostRegister refuses IOMEMORY as the real driver does for
 * memory that is no device BAR, registers host memory by whole pages once (a range touching a
 * registered page: HOST_MEMORY_ALREADY_REGISTERED) and records the flags it was called with;
 * cuMemHostUnregister takes only an address registered (else HOST_MEMORY_NOT_REGISTERED);
 * cuMemGetHandleForAddressRange hands out a memfd as its "dma-buf". */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712
#define CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED 713
#define IOMEMORY 0x04u
#define PAGE 4096u
#define MAX_REGS 64

static unsigned last_flags = 0xffffffffu;
static struct {
    uintptr_t p, start, end; /* the address registered; its pages */
} regs[MAX_REGS];
static int nregs;

unsigned fake_last_host_register_flags(void) { return last_flags; }
int fake_host_registrations(void) { return nregs; }

int cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
    last_flags = flags;
    if (flags & IOMEMORY) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t start = (uintptr_t)p & ~(uintptr_t)(PAGE - 1);
    uintptr_t end = ((uintptr_t)p + len + PAGE - 1) & ~(uintptr_t)(PAGE - 1);
    for (int i = 0; i < nregs; i++)
        if (start < regs[i].end && regs[i].start < end)
            return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (nregs == MAX_REGS) return CUDA_ERROR_INVALID_VALUE;
    regs[nregs].p = (uintptr_t)p;
    regs[nregs].start = start;
    regs[nregs].end = end;
    nregs++;
    return CUDA_SUCCESS;
}

int cuMemHostUnregister(void *p) {
    for (int i = 0; i < nregs; i++)
        if (regs[i].p == (uintptr_t)p) {
            regs[i] = regs[--nregs];
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
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
    if (!strcmp(symbol, "cuMemHostUnregister")) return (void *)cuMemHostUnregister;
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
