// gpuverbs: public CUDA device API (header-only).
//
// User kernels include this header (`#include <gpuverbs/gpuverbs.cuh>`, with gpuverbs'
// `kernels/include` on the include path): the version macros, the calling conventions, and the
// whole device API (`qp.cuh`, which includes its layers: common, state, wqe, cq, sq, onesided,
// recv, scope). A layer header may also be included alone.
//
// Conventions:
// - Kernels the host launches by name are declared with `GPUVERBS_KERNEL` (`extern "C" __global__`):
//   their symbols are not C++-mangled, so the host looks them up by their plain name.
// - Device helpers are `GPUVERBS_DEVICE` (`static __device__ __forceinline__`): including this header
//   from several translation units never produces duplicate symbols.
// - Every kernels/src/*.cu of gpuverbs is compiled into ONE translation unit (build.rs generates a
//   unity file that includes them all): file-local helpers there must be `static` or live in a
//   namespace named after their file.
// - The version macros (and, later, shared plain-data layouts) are usable from host C/C++ too; the
//   device parts are compiled only by nvcc.
#ifndef GPUVERBS_GPUVERBS_CUH
#define GPUVERBS_GPUVERBS_CUH

#include <stdint.h>

#define GPUVERBS_VERSION_MAJOR 0
#define GPUVERBS_VERSION_MINOR 1
#define GPUVERBS_VERSION_PATCH 0
/// One comparable number: major * 10000 + minor * 100 + patch.
#define GPUVERBS_VERSION \
    (GPUVERBS_VERSION_MAJOR * 10000 + GPUVERBS_VERSION_MINOR * 100 + GPUVERBS_VERSION_PATCH)

#if defined(__CUDACC__)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the gpuverbs device API needs sm_80 or newer"
#endif

/// A kernel launched by name from the host: unmangled symbol.
#define GPUVERBS_KERNEL extern "C" __global__
/// A device helper: internal linkage, always inlined.
#define GPUVERBS_DEVICE static __device__ __forceinline__

/// The value `gpuverbs_selftest_fill` stores at index `i`. The host checks it with the same expression
/// in wrapping u32 arithmetic (`gpuverbs::cuda::selftest_value`).
GPUVERBS_DEVICE uint32_t gpuverbs_selftest_value(uint32_t seed, uint32_t i) {
    return seed ^ (i * 2654435761u);
}

#endif  // __CUDACC__

#include "qp.cuh"

#endif  // GPUVERBS_GPUVERBS_CUH
