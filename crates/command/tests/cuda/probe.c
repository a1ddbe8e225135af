/* Under `gpuverbs emu`, with the fake libcuda.so.1 of fake_libcuda.c first on the library path:
 * finds the driver as the CUDA runtime does (dlopen + dlsym of cuGetProcAddress_v2, then
 * cuGetProcAddress for cuGetProcAddress itself and for cuMemHostRegister / Unregister), and as a
 * program linked against it does (dlsym of cuMemHostRegister_v2 / cuMemHostUnregister), then
 * asks for an emulated UAR page (a DEVX UAR of mlx5_0) to be registered as I/O memory in two
 * parts, one doorbell register each (as NVSHMEM's IBGDA does; the driver takes BAR registrations
 * of parts of a page), unregisters them, and asks the same for a plain page; and checks that the
 * preload's dlsym keeps the program's dlsym(RTLD_NEXT, ...) starting after the program. Prints
 * one line per check and "probe ok"; exits 1 at the first wrong answer. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <infiniband/mlx5dv.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*gpa_v2_t)(const char *, void **, int, unsigned long long, int *);
typedef int (*reg_t)(void *, size_t, unsigned);
typedef int (*unreg_t)(void *);
typedef unsigned (*flags_t)(void);
typedef int (*count_t)(void);

#define IOMEMORY 0x04u
#define DEVICEMAP 0x02u

static int fail(const char *what) {
    fprintf(stderr, "probe: %s\n", what);
    return 1;
}

int main(void) {
    struct ibv_device **list = ibv_get_device_list(NULL);
    if (!list || !list[0]) return fail("no RDMA device");
    struct mlx5dv_context_attr attr = {.flags = MLX5DV_CONTEXT_FLAGS_DEVX};
    struct ibv_context *ctx = mlx5dv_open_device(list[0], &attr);
    if (!ctx) return fail("mlx5dv_open_device(DEVX)");
    struct mlx5dv_devx_uar *uar = mlx5dv_devx_alloc_uar(ctx, MLX5DV_UAR_ALLOC_TYPE_NC);
    if (!uar) return fail("mlx5dv_devx_alloc_uar");
    void *page = uar->base_addr;

    /* the preload defines dlsym: a lookup after the program must still start after it, where
     * the preload's own open is (what the default lookup finds too) */
    if (dlsym(RTLD_NEXT, "open") != dlsym(RTLD_DEFAULT, "open"))
        return fail("dlsym(RTLD_NEXT) from the program skipped the preload");
    printf("dlsym(RTLD_NEXT, \"open\") from the program finds the preload's open\n");

    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cuda) return fail(dlerror());
    flags_t last = (flags_t)dlsym(cuda, "fake_last_host_register_flags");
    count_t live = (count_t)dlsym(cuda, "fake_host_registrations");
    gpa_v2_t gpa = (gpa_v2_t)dlsym(cuda, "cuGetProcAddress_v2");
    if (!last || !live || !gpa) return fail("dlsym of the fake driver");
    gpa_v2_t gpa2 = 0;
    if (gpa("cuGetProcAddress", (void **)&gpa2, 13000, 0, 0) || !gpa2)
        return fail("cuGetProcAddress(cuGetProcAddress)");
    reg_t reg = 0;
    if (gpa2("cuMemHostRegister", (void **)&reg, 13000, 0, 0) || !reg)
        return fail("cuGetProcAddress(cuMemHostRegister)");
    unreg_t unreg = 0;
    if (gpa2("cuMemHostUnregister", (void **)&unreg, 13000, 0, 0) || !unreg)
        return fail("cuGetProcAddress(cuMemHostUnregister)");
    reg_t direct = (reg_t)dlsym(cuda, "cuMemHostRegister_v2");
    unreg_t direct_unreg = (unreg_t)dlsym(cuda, "cuMemHostUnregister");
    if (!direct || !direct_unreg) return fail("dlsym(cuMemHostRegister_v2 / Unregister)");

    reg_t ways[2] = {reg, direct};
    unreg_t unways[2] = {unreg, direct_unreg};
    char *db0 = (char *)page + 0x800, *db1 = (char *)page + 0xa00;
    for (int i = 0; i < 2; i++) {
        const char *how = i ? "dlsym" : "cuGetProcAddress";
        if (ways[i](db0, 512, IOMEMORY | DEVICEMAP) != 0)
            return fail("IOMEMORY of the UAR page's first register refused");
        if (last() & IOMEMORY || !(last() & DEVICEMAP))
            return fail("the driver saw IOMEMORY for the UAR page");
        if (ways[i](db1, 512, IOMEMORY | DEVICEMAP) != 0)
            return fail("IOMEMORY of the UAR page's second register refused");
        if (live() != 1) return fail("the UAR page is not registered once with the driver");
        printf("uar page as mapped host memory through %s: driver flags %#x\n", how, last());
        if (unways[i](db0) != 0 || live() != 1)
            return fail("unregistering the first register let the page go (or failed)");
        if (unways[i](db1) != 0 || live() != 0)
            return fail("unregistering the last register kept the page (or failed)");
        if (unways[i](db1) == 0) return fail("a second unregister of a register succeeded");
        printf("uar page unregistered with its last register through %s\n", how);
        void *plain = aligned_alloc(4096, 4096);
        if (ways[i](plain, 4096, IOMEMORY) == 0)
            return fail("IOMEMORY of a plain page accepted");
        if (last() != IOMEMORY) return fail("a plain page's flags were changed");
        if (ways[i](plain, 4096, DEVICEMAP) != 0 || ways[i](plain, 4096, DEVICEMAP) == 0)
            return fail("a plain page's second registration reached the driver as the first");
        if (unways[i](plain) != 0 || live() != 0) return fail("a plain page's unregister");
        printf("plain page passed through %s: driver flags %#x\n", how, last());
        free(plain);
    }
    mlx5dv_devx_free_uar(uar);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    printf("probe ok\n");
    return 0;
}
