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

// A relaxed (strong, unordered) load at the sharing mode's scope: for a value a CAS confirms.
template <sharing S>
__device__ __forceinline__ uint64_t state_load_relaxed(const uint64_t* p) {
    uint64_t v;
    if constexpr (S == sharing::exclusive) {
        v = *p;
    } else if constexpr (S == sharing::cta) {
        asm volatile("ld.relaxed.cta.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    } else {
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
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

// One attempt at a spin lock: a CAS with acquire semantics at the mode's scope (what the
// previous holder released is visible once it succeeds; no separate fence).
template <sharing S>
__device__ __forceinline__ bool try_lock(uint32_t* l) {
    uint32_t old;
    if constexpr (S == sharing::cta) {
        asm volatile("atom.acquire.cta.global.cas.b32 %0, [%1], %2, %3;"
                     : "=r"(old) : "l"(l), "r"(0u), "r"(1u) : "memory");
    } else {
        asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], %2, %3;"
                     : "=r"(old) : "l"(l), "r"(0u), "r"(1u) : "memory");
    }
    return old == 0u;
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
// scope when `sys` (host-resident rings, ring_loc 0, or BlueFlame), GPU scope otherwise.
__device__ __forceinline__ void release_wqes(bool sys) {
    if (sys) {
        asm volatile("fence.release.sys;" ::: "memory");
    } else {
        asm volatile("fence.release.gpu;" ::: "memory");
    }
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_STATE_CUH
