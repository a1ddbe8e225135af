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

// A load at the sharing mode's scope: with acquire, or (`acquire` false) relaxed — strong but
// unordered, for a value a CAS confirms.
template <sharing S, bool acquire = true>
__device__ __forceinline__ uint64_t state_load(const uint64_t* p) {
    uint64_t v;
    if constexpr (S == sharing::exclusive) {
        v = *p;
    } else if constexpr (S == sharing::cta && acquire) {
        asm volatile("ld.acquire.cta.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    } else if constexpr (S == sharing::cta) {
        asm volatile("ld.relaxed.cta.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    } else if constexpr (acquire) {
        v = ld_acquire_gpu64(p);
    } else {
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    }
    return v;
}

// The descriptor's constants (what the export writes once: ring addresses, sizes, QPN, doorbell
// mode and placement), loaded together; the device-API state is left zero. A call that builds
// WQEs from this copy loads them once, at its start, instead of after each store or atomic
// that the compiler cannot tell apart from the descriptor.
__device__ __forceinline__ gpuverbs_qp consts_of(const gpuverbs_qp* q) {
    gpuverbs_qp k = {};
    k.sq_ring = q->sq_ring;
    k.rq_ring = q->rq_ring;
    k.dbrec = q->dbrec;
    k.db_reg = q->db_reg;
    k.proxy_word = q->proxy_word;
    k.scq_ring = q->scq_ring;
    k.scq_dbrec = q->scq_dbrec;
    k.rcq_ring = q->rcq_ring;
    k.rcq_dbrec = q->rcq_dbrec;
    k.scratch = q->scratch;
    k.sq_counters = q->sq_counters;
    k.sq_blocks = q->sq_blocks;
    k.rq_wqes = q->rq_wqes;
    k.rq_stride = q->rq_stride;
    k.qpn = q->qpn;
    k.scq_ncqe = q->scq_ncqe;
    k.rcq_ncqe = q->rcq_ncqe;
    k.db_mode = q->db_mode;
    k.ring_loc = q->ring_loc;
    k.max_inline = q->max_inline;
    k.scratch_lkey = q->scratch_lkey;
    k.scq_collapsed = q->scq_collapsed;
    k.rcq_collapsed = q->rcq_collapsed;
    k.scq_cqn = q->scq_cqn;
    k.rcq_cqn = q->rcq_cqn;
    return k;
}

// Makes the relaxed state loads before it acquire loads (an acquire fence at the mode's scope:
// one L1 invalidation after all of them, where an acquire load each would wait for each).
template <sharing S>
__device__ __forceinline__ void state_acquire() {
    if constexpr (S == sharing::cta) {
        asm volatile("fence.acquire.cta;" ::: "memory");
    } else if constexpr (S == sharing::gpu) {
        asm volatile("fence.acquire.gpu;" ::: "memory");
    }
}

// A relaxed store at the mode's scope: for a value a release fence before it already orders.
template <sharing S>
__device__ __forceinline__ void state_store_relaxed(uint64_t* p, uint64_t v) {
    if constexpr (S == sharing::exclusive) {
        *p = v;
    } else if constexpr (S == sharing::cta) {
        asm volatile("st.relaxed.cta.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    } else {
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    }
}

// An exchange with acquire semantics at the mode's scope; returns the old value.
template <sharing S>
__device__ __forceinline__ uint64_t state_exchange(uint64_t* p, uint64_t v) {
    uint64_t old;
    if constexpr (S == sharing::cta) {
        asm volatile("atom.acquire.cta.global.exch.b64 %0, [%1], %2;"
                     : "=l"(old) : "l"(p), "l"(v) : "memory");
    } else {
        asm volatile("atom.acquire.gpu.global.exch.b64 %0, [%1], %2;"
                     : "=l"(old) : "l"(p), "l"(v) : "memory");
    }
    return old;
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
