// gpuverbs device API — state.cuh (see qp.cuh for the layers).
//
// The QP's device-API state (counters, locks) at the scope of the sharing mode, read from the
// exported descriptor.
#ifndef GPUVERBS_STATE_CUH
#define GPUVERBS_STATE_CUH

#include "common.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

// ------------------------------------------------------------------------------------------
// The QP's device-API state, at the scope of the sharing mode
// ------------------------------------------------------------------------------------------
//
// exclusive: one thread, plain loads and stores (also on a register copy, see checkout);
// cta: the threads of one block, acquire/release and atomics at CTA scope (the ordering stays in
//      the SM); gpu: any thread on the GPU, at GPU scope.

template <sharing S>
__device__ __forceinline__ uint64_t state_load(const uint64_t* p) {
    uint64_t v;
    if constexpr (S == sharing::exclusive) {
        v = *p;
    } else if constexpr (S == sharing::cta) {
        asm volatile("ld.acquire.cta.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    } else {
        v = ld_acquire_gpu64(p);
    }
    return v;
}

template <sharing S>
__device__ __forceinline__ void state_store(uint64_t* p, uint64_t v) {
    if constexpr (S == sharing::exclusive) {
        *p = v;
    } else if constexpr (S == sharing::cta) {
        asm volatile("st.release.cta.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    } else {
        st_release_gpu64(p, v);
    }
}

template <sharing S>
__device__ __forceinline__ uint64_t state_cas(uint64_t* p, uint64_t expect, uint64_t v) {
    auto* u = reinterpret_cast<unsigned long long*>(p);
    if constexpr (S == sharing::cta) return atomicCAS_block(u, expect, v);
    return atomicCAS(u, expect, v);
}

template <sharing S>
__device__ __forceinline__ bool try_lock(uint32_t* l) {
    const bool got = (S == sharing::cta ? atomicCAS_block(l, 0u, 1u) : atomicCAS(l, 0u, 1u)) == 0u;
    if (got) {
        if constexpr (S == sharing::cta) {
            asm volatile("fence.acq_rel.cta;" ::: "memory");
        } else {
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
        }
    }
    return got;
}

// A spin lock in GPU memory (descriptor fields), bounded by the call's clock.
template <sharing S>
__device__ __forceinline__ bool lock(uint32_t* l, call_clock& c) {
    while (!try_lock<S>(l)) {
        if (c.expired()) return false;
        __nanosleep(32);
    }
    return true;
}

template <sharing S>
__device__ __forceinline__ void unlock(uint32_t* l) {
    if constexpr (S == sharing::cta) {
        asm volatile("st.release.cta.global.u32 [%0], %1;" ::"l"(l), "r"(0u) : "memory");
    } else {
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(l), "r"(0u) : "memory");
    }
}

// Releases the ring writes before the doorbell record or register store that follows: system
// scope for host-resident rings (ring_loc 0) or when `sys` asks for it, GPU scope otherwise.
__device__ __forceinline__ void release_wqes(const gpuverbs_qp* q, bool sys = false) {
    if (sys || q->ring_loc == 0) {
        asm volatile("fence.release.sys;" ::: "memory");
    } else {
        asm volatile("fence.release.gpu;" ::: "memory");
    }
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_STATE_CUH
