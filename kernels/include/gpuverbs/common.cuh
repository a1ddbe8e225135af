// gpuverbs device API — common.cuh (see qp.cuh for the layers).
//
// Statuses, typed keys, byte order, the call clock (one budget per call) and the memory-ordering
// primitives every layer above uses.
#ifndef GPUVERBS_COMMON_CUH
#define GPUVERBS_COMMON_CUH

#include <stdint.h>
#include "desc.h"

// ------------------------------------------------------------------------------------------
// Rolling comparison (host and device: plain C++ outside nvcc too)
// ------------------------------------------------------------------------------------------

#if defined(__CUDACC__)
#define GPUVERBS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GPUVERBS_HOST_DEVICE inline
#endif

namespace gpuverbs {

// NCCL GIN's default widths (nccl_device/gin.h): signals compare all 64 bits, counters 56.
constexpr uint32_t SIGNAL_BITS = 64;
constexpr uint32_t COUNTER_BITS = 56;

// The low `bits` bits set (`bits` 1..64; 0 gives 0, more than 64 all).
GPUVERBS_HOST_DEVICE constexpr uint64_t rolling_mask(uint32_t bits) {
    return bits >= 64 ? ~0ull : (1ull << bits) - 1;
}

// Whether a width is one the rolling calls take (1..64).
GPUVERBS_HOST_DEVICE constexpr bool rolling_bits_ok(uint32_t bits) {
    return bits >= 1 && bits <= 64;
}

// `a <= b` on a counter of `bits` bits that may wrap: b is at most half the counter's range
// (2^(bits-1) - 1) ahead of a, modulo 2^bits, so x <= x + 1 holds across the wrap. NCCL GIN's
// rolling comparison (nccl_device/utility.h rollingLessEq, the rule stated in gin.h above
// readCounter): its waits end once the value they wait for is rolling-less-or-equal to the
// word. Bits above `bits` of either operand are ignored.
GPUVERBS_HOST_DEVICE constexpr bool rolling_le(uint64_t a, uint64_t b, uint32_t bits) {
    return ((b - a) & rolling_mask(bits)) <= (rolling_mask(bits) >> 1);
}

}  // namespace gpuverbs

#if defined(__CUDACC__)

namespace gpuverbs {

// ------------------------------------------------------------------------------------------
// Status, keys, byte order
// ------------------------------------------------------------------------------------------

enum status : int {
    OK = 0,
    ERROR_CQE = 1,   // an error completion arrived (see gpuverbs::error)
    TIMEOUT = 2,     // the budget ran out
    INVALID = 3,     // bad argument (size, inline length, alignment)
    BUSY = 4,        // the QP is checked out by a thread (checkout): use its copy, or wait
    FULL = 5,        // the receive queue is full: take receive completions first
    BROKEN = 6,      // the send queue has a hole: a reservation was never published (a shared
                     // publish gave up waiting for it); reset the QP and export it again
};

// The first error CQE a QP saw, decoded.
struct error {
    uint8_t syndrome;   // MLX5 CQE syndrome (0x13 REMOTE_ACCESS, 0x05 WR_FLUSH, ...)
    uint8_t vendor;     // vendor syndrome
    uint16_t wqe_counter;  // the CQE's 16-bit WQE counter
    uint64_t wqe;       // a send-side error: the failed WQE's first block on the 64-bit SQ
                        // counter (its low 16 bits are wqe_counter); 0 for a receive error
};

// Keys are host-order values with distinct types: an lkey cannot be passed as an rkey, and the
// byte swap to the wire order happens in exactly one place (the segment writers).
struct lkey { uint32_t v; };
struct rkey { uint32_t v; };

// Scope of a call: which threads cooperate on it.
enum class sharing { exclusive, cta, gpu };

__device__ __forceinline__ uint32_t bswap32(uint32_t x) { return __byte_perm(x, 0, 0x0123); }

__device__ __forceinline__ uint64_t now_ns();

// A call's budget: one deadline for the whole call. Posting calls start it lazily, the first
// time they have to wait (a call that never waits never reads the clock); waiting calls
// (quiet, wait_ticket, recv_wait, wait_signal) start it on entry.
struct call_clock {
    uint64_t budget_ns;
    uint64_t deadline;  // 0: not started
    __device__ explicit call_clock(uint64_t b) : budget_ns(b), deadline(0) {}
    __device__ void start();
    // Starts the clock if it has not started; true once the deadline has passed.
    __device__ bool expired();
};

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void call_clock::start() {
    if (deadline == 0) deadline = now_ns() + budget_ns + 1;
}

__device__ __forceinline__ bool call_clock::expired() {
    const uint64_t t = now_ns();
    if (deadline == 0) {
        deadline = t + budget_ns + 1;
        return false;
    }
    return t > deadline;
}

// ------------------------------------------------------------------------------------------
// Memory-ordering primitives
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_acquire_sys64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_acquire_gpu64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_gpu64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys32(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys64(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_COMMON_CUH
