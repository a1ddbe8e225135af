// Pipeline self-test: proves that build.rs compiled the kernels, the fatbin loads on this GPU, a kernel
// launches with arguments, and the host reads back exactly what the device wrote.
#include <gpuverbs/gpuverbs.cuh>

/// Writes `out[i] = seed ^ (i * 2654435761u)` for every `i < n` (grid-stride loop: any launch shape
/// covers every element exactly once; the 64-bit index cannot wrap for any `n`).
GPUVERBS_KERNEL void gpuverbs_selftest_fill(uint32_t *out, uint32_t n, uint32_t seed) {
    const uint64_t stride = (uint64_t)blockDim.x * gridDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = gpuverbs_selftest_value(seed, (uint32_t)i);
    }
}
