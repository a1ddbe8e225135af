// gpuverbs device API: drive an exported RC QP from CUDA kernels.
//
// Layers, low to high:
//   reserve  -> wqe slots (lock-free, back-pressure against the send CQ)
//   prepare  -> write one WQE of each kind into its slots (whole blocks, reserved bytes zero)
//   publish  -> make WQEs visible in order
//   ring     -> tell the device (GPU doorbell, BlueFlame, or CPU-proxy producer word)
//   poll     -> take CQEs, retire SQ space, report errors
//   high level: put, put_imm, put_inline, put_signal, signal, send, get, atomic_fetch_add,
//               atomic_compare_swap, wait_signal, quiet, fence; warp- and block-scope put.
//   receive side: post_recv, recv_wait.
//
// Every wait takes a budget in nanoseconds (%globaltimer) and returns a status; nothing spins
// forever, and an error CQE is reported (with its syndrome) rather than waited past. A call's
// budget is its total: one deadline covers every wait inside it (reserve, publish, the doorbell
// lock, CQ polling), including retries of a lost CAS.
//
// Ordering: WQE bytes are released before the doorbell (or producer word) that announces them,
// at system scope when the rings live in host memory (ring_loc 0), at GPU scope otherwise. See
// docs/memory-ordering.md.
#ifndef GPUVERBS_QP_CUH
#define GPUVERBS_QP_CUH

#include <stdint.h>
#include "desc.h"

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
    uint16_t wqe_counter;
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

// ------------------------------------------------------------------------------------------
// WQE formats (see MLX5-FACTS): segment writers, 16 bytes each, one vector store
// ------------------------------------------------------------------------------------------

enum opcode : uint8_t {
    OP_NOP = 0x00,
    OP_RDMA_WRITE = 0x08,
    OP_RDMA_WRITE_IMM = 0x09,
    OP_SEND = 0x0a,
    OP_SEND_IMM = 0x0b,
    OP_RDMA_READ = 0x10,
    OP_ATOMIC_CS = 0x11,
    OP_ATOMIC_FA = 0x12,
    OP_ATOMIC_MASKED_CS = 0x14,
    OP_ATOMIC_MASKED_FA = 0x15,
};

// fm_ce_se bits
constexpr uint8_t CE_SIGNALED = 0x08;
constexpr uint8_t FENCE_SMALL = 0x20;
constexpr uint8_t FENCE_STRONG = 0x80;

__device__ __forceinline__ uint8_t* wqe_slot(const gpuverbs_qp* q, uint64_t block) {
    return reinterpret_cast<uint8_t*>(q->sq_ring) + ((block & (q->sq_blocks - 1)) << 6);
}

__device__ __forceinline__ uint4 seg_ctrl(uint8_t op, uint8_t opmod, uint64_t idx, uint32_t qpn,
                                          uint32_t ds, uint8_t fm_ce_se, uint32_t imm) {
    return make_uint4(bswap32((uint32_t)opmod << 24 | ((uint32_t)idx & 0xffffu) << 8 | op),
                      bswap32(qpn << 8 | ds), (uint32_t)fm_ce_se << 24, bswap32(imm));
}

__device__ __forceinline__ uint4 seg_raddr(uint64_t addr, rkey k) {
    return make_uint4(bswap32((uint32_t)(addr >> 32)), bswap32((uint32_t)addr), bswap32(k.v), 0);
}

__device__ __forceinline__ uint4 seg_data(uint64_t addr, uint32_t len, lkey k) {
    return make_uint4(bswap32(len), bswap32(k.v), bswap32((uint32_t)(addr >> 32)),
                      bswap32((uint32_t)addr));
}

__device__ __forceinline__ uint4 seg_atomic(uint64_t swap_add, uint64_t compare) {
    return make_uint4(bswap32((uint32_t)(swap_add >> 32)), bswap32((uint32_t)swap_add),
                      bswap32((uint32_t)(compare >> 32)), bswap32((uint32_t)compare));
}

constexpr uint4 SEG_ZERO = {0, 0, 0, 0};

// One 64-byte block of a WQE, built in registers: the one-block kinds are built whole and
// stored with one call, and the BlueFlame copy is taken from the registers, not read back.
struct block {
    uint4 u[4];
};

__device__ __forceinline__ void store_block(const gpuverbs_qp* q, uint64_t idx, const block& b) {
    uint8_t* p = wqe_slot(q, idx);
    for (int i = 0; i < 4; ++i) st16(p + 16 * i, b.u[i]);
}

// Block `i` of a WQE whose first block is `idx` (multi-block WQEs wrap at the ring's end).
__device__ __forceinline__ uint8_t* wqe_unit(const gpuverbs_qp* q, uint64_t idx, uint32_t unit) {
    return wqe_slot(q, idx + unit / 4) + (unit % 4) * 16;
}

// Zero-fills units [from, 4*blocks) of a WQE so no stale bytes remain in its last block.
__device__ __forceinline__ void zero_tail(const gpuverbs_qp* q, uint64_t idx, uint32_t from,
                                          uint32_t blocks) {
    for (uint32_t u = from; u < blocks * 4; ++u) st16(wqe_unit(q, idx, u), SEG_ZERO);
}

// --- prepare: one function per WQE kind; each writes whole blocks at idx ---------------------

// RDMA_WRITE (or WRITE_IMM when imm is given): 1 block.
__device__ __forceinline__ block build_write(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                             lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                             uint8_t flags, bool with_imm = false,
                                             uint32_t imm = 0) {
    return block{{seg_ctrl(with_imm ? OP_RDMA_WRITE_IMM : OP_RDMA_WRITE, 0, idx, q->qpn, 3,
                           flags, imm),
                  seg_raddr(raddr, rk), seg_data(laddr, len, lk), SEG_ZERO}};
}
__device__ __forceinline__ void prep_write(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                           lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                           uint8_t flags, bool with_imm = false,
                                           uint32_t imm = 0) {
    store_block(q, idx, build_write(q, idx, laddr, lk, raddr, rk, len, flags, with_imm, imm));
}

// Blocks an inline write of `len` bytes takes: ctrl + raddr + align(4 + len, 16).
__device__ __forceinline__ uint32_t inline_write_blocks(uint32_t len) {
    uint32_t ds = 2 + (4 + len + 15) / 16;
    return (ds + 3) / 4;
}

// RDMA_WRITE with the payload carried in the WQE.
__device__ __forceinline__ void prep_write_inline(const gpuverbs_qp* q, uint64_t idx,
                                                  const void* src, uint32_t len, uint64_t raddr,
                                                  rkey rk, uint8_t flags) {
    uint32_t ds = 2 + (4 + len + 15) / 16;
    uint32_t blocks = (ds + 3) / 4;
    st16(wqe_unit(q, idx, 0), seg_ctrl(OP_RDMA_WRITE, 0, idx, q->qpn, ds, flags, 0));
    st16(wqe_unit(q, idx, 1), seg_raddr(raddr, rk));
    // Inline bytes: a 4-byte header then the payload, unit by unit (units may wrap blocks).
    const uint8_t* s = static_cast<const uint8_t*>(src);
    for (uint32_t u = 2; u < blocks * 4; ++u) {
        uint32_t w[4];
        for (int k = 0; k < 4; ++k) {
            uint32_t v = 0;
            for (int b = 0; b < 4; ++b) {
                int off = (int)((u - 2) * 16 + k * 4 + b) - 4;  // payload offset
                uint8_t byte = 0;
                if (off < 0) {
                    uint32_t hdr = bswap32(len | 0x80000000u);
                    byte = (uint8_t)(hdr >> (8 * (off + 4)));
                } else if ((uint32_t)off < len) {
                    byte = s[off];
                }
                v |= (uint32_t)byte << (8 * b);
            }
            w[k] = v;
        }
        st16(wqe_unit(q, idx, u), make_uint4(w[0], w[1], w[2], w[3]));
    }
}

// RDMA_READ into local memory: 1 block.
__device__ __forceinline__ block build_read(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                            lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                            uint8_t flags) {
    return block{{seg_ctrl(OP_RDMA_READ, 0, idx, q->qpn, 3, flags, 0), seg_raddr(raddr, rk),
                  seg_data(laddr, len, lk), SEG_ZERO}};
}
__device__ __forceinline__ void prep_read(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                          lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                          uint8_t flags) {
    store_block(q, idx, build_read(q, idx, laddr, lk, raddr, rk, len, flags));
}

// SEND (or SEND_IMM when imm is given) from local memory: 1 block.
__device__ __forceinline__ block build_send(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                            lkey lk, uint32_t len, uint8_t flags,
                                            bool with_imm = false, uint32_t imm = 0) {
    return block{{seg_ctrl(with_imm ? OP_SEND_IMM : OP_SEND, 0, idx, q->qpn, 2, flags, imm),
                  seg_data(laddr, len, lk), SEG_ZERO, SEG_ZERO}};
}
__device__ __forceinline__ void prep_send(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                          lkey lk, uint32_t len, uint8_t flags,
                                          bool with_imm = false, uint32_t imm = 0) {
    store_block(q, idx, build_send(q, idx, laddr, lk, len, flags, with_imm, imm));
}

// ATOMIC_FA / ATOMIC_CS on an 8-byte remote word; the old value lands at `result`: 1 block.
__device__ __forceinline__ block build_atomic(const gpuverbs_qp* q, uint64_t idx, uint8_t op,
                                              uint64_t raddr, rkey rk, uint64_t swap_add,
                                              uint64_t compare, uint64_t result,
                                              lkey result_key, uint8_t flags) {
    return block{{seg_ctrl(op, 0, idx, q->qpn, 4, flags, 0), seg_raddr(raddr, rk),
                  seg_atomic(swap_add, compare), seg_data(result, 8, result_key)}};
}
__device__ __forceinline__ void prep_atomic(const gpuverbs_qp* q, uint64_t idx, uint8_t op,
                                            uint64_t raddr, rkey rk, uint64_t swap_add,
                                            uint64_t compare, uint64_t result, lkey result_key,
                                            uint8_t flags) {
    store_block(q, idx,
                build_atomic(q, idx, op, raddr, rk, swap_add, compare, result, result_key, flags));
}

// Masked atomics on 8-byte operands (opmod 0x09). FA: 1 block; CS: 2 blocks.
__device__ __forceinline__ uint32_t prep_masked_fa(const gpuverbs_qp* q, uint64_t idx,
                                                   uint64_t raddr, rkey rk, uint64_t add,
                                                   uint64_t boundary, uint64_t result,
                                                   lkey result_key, uint8_t flags) {
    store_block(q, idx,
                block{{seg_ctrl(OP_ATOMIC_MASKED_FA, 0x09, idx, q->qpn, 4, flags, 0),
                       seg_raddr(raddr, rk), seg_atomic(add, boundary),
                       seg_data(result, 8, result_key)}});
    return 1;
}

__device__ __forceinline__ uint32_t prep_masked_cs(const gpuverbs_qp* q, uint64_t idx,
                                                   uint64_t raddr, rkey rk, uint64_t compare,
                                                   uint64_t compare_mask, uint64_t swap,
                                                   uint64_t swap_mask, uint64_t result,
                                                   lkey result_key, uint8_t flags) {
    st16(wqe_unit(q, idx, 0), seg_ctrl(OP_ATOMIC_MASKED_CS, 0x09, idx, q->qpn, 5, flags, 0));
    st16(wqe_unit(q, idx, 1), seg_raddr(raddr, rk));
    st16(wqe_unit(q, idx, 2), seg_atomic(swap, compare));
    st16(wqe_unit(q, idx, 3), seg_atomic(swap_mask, compare_mask));
    st16(wqe_unit(q, idx, 4), seg_data(result, 8, result_key));
    zero_tail(q, idx, 5, 2);
    return 2;
}

// NOP: 1 block.
__device__ __forceinline__ block build_nop(const gpuverbs_qp* q, uint64_t idx, uint8_t flags) {
    return block{{seg_ctrl(OP_NOP, 0, idx, q->qpn, 1, flags, 0), SEG_ZERO, SEG_ZERO, SEG_ZERO}};
}
__device__ __forceinline__ void prep_nop(const gpuverbs_qp* q, uint64_t idx, uint8_t flags) {
    store_block(q, idx, build_nop(q, idx, flags));
}

// ------------------------------------------------------------------------------------------
// Completions
// ------------------------------------------------------------------------------------------

// Blocks of the WQE whose first block is `idx` (read back from its ctrl segment).
__device__ __forceinline__ uint32_t wqe_blocks_at(const gpuverbs_qp* q, uint64_t idx) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(wqe_slot(q, idx));
    uint32_t ds = bswap32(w[1]) & 0x3f;
    return ds == 0 ? 1 : (ds * 16 + 63) / 64;
}

// Takes one send-CQ entry if software owns it. Returns 1 if one was taken (and retires the SQ
// space it covers), 0 if none. Records the first error CQE in the descriptor.
// Caller holds the send-CQ lock (or owns the QP exclusively).
template <sharing S>
__device__ __forceinline__ int scq_poll_one(gpuverbs_qp* q) {
    uint64_t ci = q->scq_ci;
    uint32_t n = q->scq_ncqe;
    uint32_t slot = q->scq_collapsed ? 0u : (uint32_t)(ci & (n - 1));
    const uint8_t* cqe = reinterpret_cast<const uint8_t*>(q->scq_ring) + slot * 64;
    uint32_t tail = ld_acquire_sys(reinterpret_cast<const uint32_t*>(cqe + 60));
    uint32_t op_own = tail >> 24;
    uint32_t opcode = op_own >> 4;
    if (opcode == 15) return 0;
    if (q->scq_collapsed) {
        // Slot 0 holds the newest completion: take it when its last word changed (each WQE
        // has its own counter); in this mode scq_ci holds that word plus 1.
        if (ci == (uint64_t)tail + 1) return 0;
    } else if ((op_own & 1u) != (uint32_t)((ci / n) & 1u)) {
        return 0;
    }
    uint16_t counter = (uint16_t)(((tail & 0xffu) << 8) | ((tail >> 8) & 0xffu));
    if (opcode == 13 || opcode == 14) {
        uint32_t synd_word = *reinterpret_cast<const volatile uint32_t*>(cqe + 52);
        uint8_t vendor = (uint8_t)(synd_word >> 16);
        uint8_t syndrome = (uint8_t)(synd_word >> 24);
        if (q->sq_error == 0) {
            q->sq_error_info = (uint64_t)syndrome << 24 | (uint64_t)vendor << 16 | counter;
            q->sq_error = ci + 1;
        }
    }
    uint32_t blocks = wqe_blocks_at(q, counter);
    uint64_t retired = q->sq_retired;
    uint16_t delta = (uint16_t)(counter + blocks - (uint16_t)retired);
    if (delta <= q->sq_blocks) state_store<S>(&q->sq_retired, retired + delta);
    ci = q->scq_collapsed ? (uint64_t)tail + 1 : ci + 1;
    q->scq_ci = ci;
    st_relaxed_sys32(reinterpret_cast<uint32_t*>(q->scq_dbrec), bswap32((uint32_t)(ci & 0xffffff)));
    return 1;
}

__device__ __forceinline__ error last_error(const gpuverbs_qp* q) {
    uint64_t info = q->sq_error_info;
    return error{(uint8_t)(info >> 24), (uint8_t)(info >> 16), (uint16_t)info};
}

// Takes what the send CQ holds, under the CQ lock when shared. Never waits: when another
// thread holds the lock it returns at once (that thread is polling), and it takes at most one
// ring's worth of CQEs per call (a device that keeps completing cannot keep it here).
template <sharing S>
__device__ __forceinline__ status scq_progress(gpuverbs_qp* q) {
    if (q->checked_out) return BUSY;
    if constexpr (S != sharing::exclusive) {
        if (!try_lock<S>(&q->scq_lock)) return OK;  // someone else is polling
    }
    for (uint32_t i = 0; i < q->scq_ncqe && scq_poll_one<S>(q); ++i) {
    }
    if constexpr (S != sharing::exclusive) unlock<S>(&q->scq_lock);
    return q->sq_error ? ERROR_CQE : OK;
}

__device__ __forceinline__ bool sq_broken(const gpuverbs_qp* q) {
    return *reinterpret_cast<const volatile uint32_t*>(&q->sq_broken) != 0u;
}

// ------------------------------------------------------------------------------------------
// Reserve, publish, ring
// ------------------------------------------------------------------------------------------

// Reserves `n` blocks; waits (polling the CQ) while the SQ is full. Lock-free (CAS), so a
// timeout leaves no hole in the ring. The clock is read only once it has to wait.
//
// `force_signal` (optional) is set when the reserved WQEs must ask for a CQE whatever the
// caller wanted: selective signaling must never starve the ring, and only signaled
// completions retire space, so a WQE is signaled when no signaled WQE covers the last half
// ring. (The check uses values loaded with the reservation, so it costs no extra round trip.)
template <sharing S>
__device__ __forceinline__ status reserve(gpuverbs_qp* q, uint32_t n, call_clock& c, uint64_t* start,
                                          bool* force_signal = nullptr) {
    if (q->sq_error) return ERROR_CQE;  // the QP is in error: nothing new would execute
    if (q->checked_out) return BUSY;
    if (S != sharing::exclusive && sq_broken(q)) return BROKEN;
    for (;;) {
        uint64_t r = state_load<S>(&q->sq_reserved);
        uint64_t retired = state_load<S>(&q->sq_retired);
        uint64_t covered = S == sharing::exclusive
                               ? q->sq_signaled_end
                               : *reinterpret_cast<volatile uint64_t*>(&q->sq_signaled_end);
        if (r + n - retired <= q->sq_blocks) {
            if (force_signal) *force_signal = r + n - covered >= (q->sq_blocks >> 1);
            if (S == sharing::exclusive) {
                q->sq_reserved = r + n;
                *start = r;
                return OK;
            }
            if (state_cas<S>(&q->sq_reserved, r, r + n) == r) {
                *start = r;
                return OK;
            }
            // Lost the race: retry, but within the call's budget (lock-free, and bounded).
            if (c.expired()) return TIMEOUT;
            continue;
        }
        const status p = scq_progress<S>(q);
        if (p != OK) return p;
        if (c.expired()) return TIMEOUT;
    }
}

template <sharing S>
__device__ __forceinline__ status reserve(gpuverbs_qp* q, uint32_t n, uint64_t budget_ns,
                                          uint64_t* start, bool* force_signal = nullptr) {
    call_clock c(budget_ns);
    return reserve<S>(q, n, c, start, force_signal);
}

// Publishes blocks [start, start+n) after every earlier reservation. The ready counter is
// released at GPU scope; the system-scope release of the WQE bytes happens in `ring`, whose
// fence is cumulative over every WQE published before it. `signaled` records that the last
// WQE asks for a CQE.
//
// Shared modes: a publish that gives up waiting for an earlier reservation (its thread never
// published it, or not within this call's budget) leaves a hole no later WQE can pass. It marks
// the send queue broken (sq_broken) and returns TIMEOUT; every later send-side call, the late
// publisher's included, returns BROKEN. The host resets the QP, connects it and exports it again.
template <sharing S>
__device__ __forceinline__ status publish(gpuverbs_qp* q, uint64_t start, uint32_t n,
                                          uint64_t last_start, bool signaled, call_clock& c) {
    if (S != sharing::exclusive) {
        while (state_load<S>(&q->sq_ready) != start) {
            if (sq_broken(q)) return BROKEN;
            if (c.expired()) {
                atomicExch(&q->sq_broken, 1u);
                __threadfence();
                return TIMEOUT;
            }
        }
    }
    q->sq_last_start = last_start;
    if (signaled) q->sq_signaled_end = start + n;
    state_store<S>(&q->sq_ready, start + n);
    return OK;
}

template <sharing S>
__device__ __forceinline__ status publish(gpuverbs_qp* q, uint64_t start, uint32_t n,
                                          uint64_t last_start, bool signaled,
                                          uint64_t budget_ns) {
    call_clock c(budget_ns);
    return publish<S>(q, start, n, last_start, signaled, c);
}

// Tells the device about every published WQE, in the QP's doorbell mode: one release fence
// (system scope for host-resident rings, GPU scope otherwise) orders every published WQE
// before the doorbell record and the doorbell. The doorbell value carries the producer index
// itself ({BE32(pi << 8), BE32(qpn << 8)}), so the device never depends on the order in which
// the doorbell record and the doorbell land.
//
// BlueFlame: the last WQE (up to 4 blocks) goes into the register half as well, seqlock style:
// the half was cleared by the previous ring (its first 8 bytes are 0, ordered before this
// ring's bytes by the release fence, system scope in this mode), bytes 8.. are written, a
// second fence, then the first 8 bytes; then the other half is cleared for the next ring.
// `last` is the caller's newest WQE when it built it in registers (one block): it is copied
// from there when it is the last published WQE, which its ctrl segment's index says;
// otherwise the last WQE is read back from the ring.
template <sharing S>
__device__ __forceinline__ status ring(gpuverbs_qp* q, call_clock& c, const block* last = nullptr) {
    if (q->checked_out) return BUSY;
    if (S != sharing::exclusive && sq_broken(q)) return BROKEN;
    if (S != sharing::exclusive && !lock<S>(&q->ring_lock, c)) return TIMEOUT;
    uint64_t ready = state_load<S>(&q->sq_ready);
    if (ready != q->sq_rung) {
        // System scope also in BlueFlame mode, where it orders the previous ring's clear of
        // this half (host memory) before this ring's copy.
        release_wqes(q, q->db_mode == GPUVERBS_DB_BLUEFLAME);
        if (q->db_mode == GPUVERBS_DB_CPU_PROXY) {
            st_relaxed_sys64(reinterpret_cast<uint64_t*>(q->proxy_word), ready);
        } else {
            uint32_t* dbrec = reinterpret_cast<uint32_t*>(q->dbrec);
            st_relaxed_sys32(dbrec + 1, bswap32((uint32_t)(ready & 0xffff)));
            uint8_t* const halves = reinterpret_cast<uint8_t*>(q->db_reg);
            uint8_t* reg = halves + (q->bf_half & 1u) * 256;
            // DOCA convention: {BE32(pi << 8), BE32(qpn << 8)}.
            uint64_t value = (uint64_t)bswap32(q->qpn << 8) << 32 |
                             bswap32(((uint32_t)ready & 0xffffu) << 8);
            if (q->db_mode == GPUVERBS_DB_BLUEFLAME) {
                // `last` stands for the last published WQE only if its ctrl segment names the
                // same index (in shared modes another thread may have published after it).
                const uint64_t at = q->sq_last_start;
                const bool held = last && ((bswap32(last->u[0].x) >> 8) & 0xffffu) ==
                                              (uint32_t)(at & 0xffffu);
                const uint32_t blocks = held ? 1u : wqe_blocks_at(q, at);
                if (at + blocks == ready && blocks <= 4) {
                    uint4 first;
                    if (held) {
                        first = last->u[0];
                        for (int u = 1; u < 4; ++u) st16(reg + u * 16, last->u[u]);
                    } else {
                        first = *reinterpret_cast<const uint4*>(wqe_unit(q, at, 0));
                        for (uint32_t u = 1; u < blocks * 4; ++u) {
                            st16(reg + u * 16, *reinterpret_cast<const uint4*>(wqe_unit(q, at, u)));
                        }
                    }
                    st_relaxed_sys64(reinterpret_cast<uint64_t*>(reg + 8),
                                     (uint64_t)first.w << 32 | first.z);
                    value = (uint64_t)first.y << 32 | first.x;
                    asm volatile("fence.release.sys;" ::: "memory");
                }
            }
            st_relaxed_sys64(reinterpret_cast<uint64_t*>(reg), value);
            if (q->db_mode == GPUVERBS_DB_BLUEFLAME) {
                q->bf_half ^= 1u;
                st_relaxed_sys64(reinterpret_cast<uint64_t*>(halves + (q->bf_half & 1u) * 256), 0);
            }
        }
        q->sq_rung = ready;
    }
    if (S != sharing::exclusive) unlock<S>(&q->ring_lock);
    return OK;
}

template <sharing S>
__device__ __forceinline__ status ring(gpuverbs_qp* q, uint64_t budget_ns,
                                       const block* last = nullptr) {
    call_clock c(budget_ns);
    return ring<S>(q, c, last);
}

// ------------------------------------------------------------------------------------------
// Exclusive ownership in registers
// ------------------------------------------------------------------------------------------

// A thread that alone drives a QP for a stretch of work (sharing::exclusive) can take its state
// into registers, call the exclusive-mode functions on the copy, and hand the state back:
//
//     gpuverbs_qp mine;
//     if (gpuverbs::checkout(q, &mine) != gpuverbs::OK) ...;   // BUSY: someone holds it
//     ... put<sharing::exclusive>(&mine, ...); quiet<sharing::exclusive>(&mine, ...); ...
//     gpuverbs::checkin(q, mine);
//
// Inside the stretch a WQE costs no descriptor loads or stores (through `q` every put reloads
// the state it stored, from L2). While the QP is checked out, every call through `q` (reserve,
// ring, CQ polling, and so every high-level call) returns BUSY and changes nothing, and a second
// checkout returns BUSY. Everything posted through the copy is on the rings and announced to the
// device; only `checkin` makes `q` usable again. checkout does not wait for calls already in
// progress through `q`: take a QP nobody is using at that moment (BUSY guards later calls).
__device__ __forceinline__ status checkout(gpuverbs_qp* q, gpuverbs_qp* mine) {
    if (atomicCAS(&q->checked_out, 0u, 1u) != 0u) return BUSY;
    // Acquire: the state the previous holder released (checkin or st.release.gpu) is visible.
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    *mine = *q;
    mine->checked_out = 0;  // the copy itself is not checked out
    return OK;
}

__device__ __forceinline__ void checkin(gpuverbs_qp* q, const gpuverbs_qp& mine) {
    q->sq_reserved = mine.sq_reserved;
    q->sq_ready = mine.sq_ready;
    q->sq_rung = mine.sq_rung;
    q->sq_retired = mine.sq_retired;
    q->sq_signaled_end = mine.sq_signaled_end;
    q->sq_last_start = mine.sq_last_start;
    q->scq_ci = mine.scq_ci;
    q->rcq_ci = mine.rcq_ci;
    q->rq_posted = mine.rq_posted;
    q->sq_error = mine.sq_error;
    q->sq_error_info = mine.sq_error_info;
    q->bf_half = mine.bf_half;
    // Release: the state above before the QP is free again.
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(&q->checked_out), "r"(0u) : "memory");
}

// ------------------------------------------------------------------------------------------
// High level (thread scope)
// ------------------------------------------------------------------------------------------

// Waits until every WQE published so far has completed. Posts a signaled NOP first when the
// last published WQE was unsignaled (unsignaled WQEs complete only behind a signaled one).
template <sharing S = sharing::gpu>
__device__ status quiet(gpuverbs_qp* q, uint64_t budget_ns, error* err = nullptr) {
    call_clock c(budget_ns);
    c.start();
    uint64_t target = state_load<S>(&q->sq_ready);
    if (q->sq_signaled_end < target) {
        uint64_t idx;
        status s = reserve<S>(q, 1, c, &idx);
        if (s == ERROR_CQE && err) *err = last_error(q);
        if (s != OK) return s;
        const block nop = build_nop(q, idx, CE_SIGNALED);
        store_block(q, idx, nop);
        s = publish<S>(q, idx, 1, idx, true, c);
        if (s != OK) return s;
        s = ring<S>(q, c, &nop);
        if (s != OK) return s;
        target = idx + 1;
    }
    // WQEs posted without ringing are announced now; otherwise quiet would wait for work the
    // device was never told about.
    status rs = ring<S>(q, c);
    if (rs != OK) return rs;
    for (;;) {
        status s = scq_progress<S>(q);
        if (s == BUSY) return s;
        uint64_t retired = state_load<S>(&q->sq_retired);
        if (retired >= target) {
            if (s == ERROR_CQE && err) *err = last_error(q);
            return s;
        }
        if (c.expired()) return TIMEOUT;
    }
}

// Waits until everything up to block `ticket` has completed: a ticket is the end of a WQE (its
// first block from `reserve` plus its blocks, or `sq_ready` read after publishing). Only
// signaled completions retire space, so a signaled WQE must end at or after the ticket (`quiet`
// is the variant that posts one when needed). Returns ERROR_CQE (with the first error) when an
// error completion was seen, TIMEOUT when the budget ran out.
template <sharing S = sharing::gpu>
__device__ status wait_ticket(gpuverbs_qp* q, uint64_t ticket, uint64_t budget_ns,
                              error* err = nullptr) {
    call_clock c(budget_ns);
    c.start();
    for (;;) {
        status s = scq_progress<S>(q);
        if (s == BUSY) return s;
        uint64_t retired = state_load<S>(&q->sq_retired);
        if (retired >= ticket) {
            if (s == ERROR_CQE && err) *err = last_error(q);
            return s;
        }
        if (c.expired()) return TIMEOUT;
    }
}

// One WQE of `blocks` blocks: reserve, prepare (the callable, given the final signaled flag),
// publish, ring.
template <sharing S, typename Prep>
__device__ __forceinline__ status post1(gpuverbs_qp* q, uint32_t blocks, bool signaled,
                                        bool do_ring, uint64_t budget_ns, Prep prep) {
    uint64_t idx;
    bool force = false;
    call_clock c(budget_ns);
    status s = reserve<S>(q, blocks, c, &idx, &force);
    if (s != OK) return s;
    signaled = signaled || force;
    prep(idx, signaled ? CE_SIGNALED : 0);
    s = publish<S>(q, idx, blocks, idx, signaled, c);
    if (s != OK || !do_ring) return s;
    return ring<S>(q, c);
}

// One one-block WQE built in registers (`build(idx, flags)` returns it): reserve, store,
// publish, ring (a BlueFlame ring copies it from the registers).
template <sharing S, typename Build>
__device__ __forceinline__ status post_block(gpuverbs_qp* q, bool signaled, bool do_ring,
                                             uint64_t budget_ns, Build build) {
    uint64_t idx;
    bool force = false;
    call_clock c(budget_ns);
    status s = reserve<S>(q, 1, c, &idx, &force);
    if (s != OK) return s;
    signaled = signaled || force;
    const block b = build(idx, signaled ? CE_SIGNALED : 0);
    store_block(q, idx, b);
    s = publish<S>(q, idx, 1, idx, signaled, c);
    if (s != OK || !do_ring) return s;
    return ring<S>(q, c, &b);
}

// RDMA write of `len` bytes.
template <sharing S = sharing::gpu>
__device__ status put(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                      uint32_t len, bool signaled, uint64_t budget_ns, bool do_ring = true) {
    return post_block<S>(q, signaled, do_ring, budget_ns, [&](uint64_t idx, uint8_t f) {
        return build_write(q, idx, laddr, lk, raddr, rk, len, f);
    });
}

// RDMA write of `len` bytes with a 32-bit immediate: the responder consumes a receive WQE and
// reports `imm` in its receive completion (recv_wait).
template <sharing S = sharing::gpu>
__device__ status put_imm(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                          uint32_t len, uint32_t imm, bool signaled, uint64_t budget_ns,
                          bool do_ring = true) {
    return post_block<S>(q, signaled, do_ring, budget_ns, [&](uint64_t idx, uint8_t f) {
        return build_write(q, idx, laddr, lk, raddr, rk, len, f, true, imm);
    });
}

// SEND of `len` bytes into the responder's next receive buffer; with `with_imm`, SEND_IMM
// carrying `imm`.
template <sharing S = sharing::gpu>
__device__ status send(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint32_t len, bool with_imm,
                       uint32_t imm, bool signaled, uint64_t budget_ns, bool do_ring = true) {
    return post_block<S>(q, signaled, do_ring, budget_ns, [&](uint64_t idx, uint8_t f) {
        return build_send(q, idx, laddr, lk, len, f, with_imm, imm);
    });
}

// RDMA write with the payload in the WQE (len <= max_inline).
template <sharing S = sharing::gpu>
__device__ status put_inline(gpuverbs_qp* q, const void* src, uint32_t len, uint64_t raddr,
                             rkey rk, bool signaled, uint64_t budget_ns) {
    if (len > q->max_inline) return INVALID;
    return post1<S>(q, inline_write_blocks(len), signaled, true, budget_ns,
                    [&](uint64_t idx, uint8_t f) {
                        prep_write_inline(q, idx, src, len, raddr, rk, f);
                    });
}

// Atomic add of `add` on a remote 8-byte signal word (old value discarded).
template <sharing S = sharing::gpu>
__device__ status signal(gpuverbs_qp* q, uint64_t sig_addr, rkey sig_key, uint64_t add,
                         bool signaled, uint64_t budget_ns, bool do_ring = true) {
    return post_block<S>(q, signaled, do_ring, budget_ns, [&](uint64_t idx, uint8_t f) {
        return build_atomic(q, idx, OP_ATOMIC_FA, sig_addr, sig_key, add, 0, q->scratch,
                            lkey{q->scratch_lkey}, f);
    });
}

// Write then signal, ordered (the RC responder executes them in order), one doorbell.
template <sharing S = sharing::gpu>
__device__ status put_signal(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                             uint32_t len, uint64_t sig_addr, rkey sig_key, uint64_t add,
                             bool signaled, uint64_t budget_ns) {
    uint64_t idx;
    bool force = false;
    call_clock c(budget_ns);
    status s = reserve<S>(q, 2, c, &idx, &force);
    if (s != OK) return s;
    signaled = signaled || force;
    prep_write(q, idx, laddr, lk, raddr, rk, len, 0);
    const block sig = build_atomic(q, idx + 1, OP_ATOMIC_FA, sig_addr, sig_key, add, 0,
                                   q->scratch, lkey{q->scratch_lkey}, signaled ? CE_SIGNALED : 0);
    store_block(q, idx + 1, sig);
    s = publish<S>(q, idx, 2, idx + 1, signaled, c);
    if (s != OK) return s;
    return ring<S>(q, c, &sig);
}

// RDMA read of `len` bytes into local memory; complete once quiet() returns OK.
template <sharing S = sharing::gpu>
__device__ status get(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                      uint32_t len, bool signaled, uint64_t budget_ns) {
    return post_block<S>(q, signaled, true, budget_ns, [&](uint64_t idx, uint8_t f) {
        return build_read(q, idx, laddr, lk, raddr, rk, len, f);
    });
}

// Remote fetch-and-add; the old value lands at `result` (8 registered bytes) after quiet().
template <sharing S = sharing::gpu>
__device__ status atomic_fetch_add(gpuverbs_qp* q, uint64_t raddr, rkey rk, uint64_t add,
                                   uint64_t result, lkey result_key, uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](uint64_t idx, uint8_t f) {
        return build_atomic(q, idx, OP_ATOMIC_FA, raddr, rk, add, 0, result, result_key, f);
    });
}

// Remote compare-and-swap; the old value lands at `result` after quiet().
template <sharing S = sharing::gpu>
__device__ status atomic_compare_swap(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                      uint64_t compare, uint64_t swap, uint64_t result,
                                      lkey result_key, uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](uint64_t idx, uint8_t f) {
        return build_atomic(q, idx, OP_ATOMIC_CS, raddr, rk, swap, compare, result, result_key,
                            f);
    });
}

// Orders later WQEs after earlier ones: the next WQE carries a strong fence.
template <sharing S = sharing::gpu>
__device__ status fence(gpuverbs_qp* q, uint64_t budget_ns) {
    return post_block<S>(q, false, false, budget_ns, [&](uint64_t idx, uint8_t f) {
        return build_nop(q, idx, FENCE_STRONG | f);
    });
}

// Waits (acquire, system scope) until the local 8-byte signal word reaches `value`.
__device__ __forceinline__ status wait_signal(const uint64_t* sig, uint64_t value,
                                              uint64_t budget_ns) {
    uint64_t deadline = now_ns() + budget_ns;
    while (ld_acquire_sys64(sig) < value) {
        if (now_ns() > deadline) return TIMEOUT;
    }
    return OK;
}

// ------------------------------------------------------------------------------------------
// Receive side: post receive WQEs, take receive completions
// ------------------------------------------------------------------------------------------
//
// A QP that receives (SEND, SEND_IMM, WRITE_IMM from its peer) needs a receive CQ of its own
// (not its send CQ) in the non-collapsed mode: both calls return INVALID otherwise.

// Receive-CQE opcodes (recv_completion::opcode).
constexpr uint8_t CQE_RESP_WR_IMM = 1;
constexpr uint8_t CQE_RESP_SEND = 2;
constexpr uint8_t CQE_RESP_SEND_IMM = 3;

// One receive completion, decoded.
struct recv_completion {
    uint8_t opcode;        // CQE_RESP_WR_IMM, CQE_RESP_SEND or CQE_RESP_SEND_IMM
    uint32_t imm;          // the sender's immediate (host order); 0 for a plain SEND
    uint32_t byte_count;   // bytes received (for WRITE_IMM: the write's length)
    uint16_t wqe_counter;  // the receive WQE it consumed (receive WQEs complete in order)
};

__device__ __forceinline__ bool can_receive(const gpuverbs_qp* q) {
    return q->rq_wqes != 0 && q->rcq_ring != q->scq_ring && !q->rcq_collapsed;
}

// Posts one receive WQE of one buffer (`len` bytes at `laddr`, lkey `lk`; a terminator follows
// when the RQ stride has room) and announces it in the doorbell record's receive word, after a
// release fence (system scope for host-resident rings). FULL when every RQ slot holds a
// receive not completed yet (take completions with recv_wait first).
template <sharing S = sharing::gpu>
__device__ status post_recv(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint32_t len,
                            uint64_t budget_ns) {
    if (q->checked_out) return BUSY;
    if (!can_receive(q)) return INVALID;
    call_clock c(budget_ns);
    if (S != sharing::exclusive && !lock<S>(&q->rq_lock, c)) return TIMEOUT;
    const uint64_t posted = state_load<S>(&q->rq_posted);
    status s = FULL;
    if (posted - state_load<S>(&q->rcq_ci) < q->rq_wqes) {
        uint8_t* p = reinterpret_cast<uint8_t*>(q->rq_ring) +
                     (posted & (q->rq_wqes - 1)) * (uint64_t)q->rq_stride;
        st16(p, seg_data(laddr, len, lk));
        if (q->rq_stride >= 32) st16(p + 16, seg_data(0, 0, lkey{0x100}));  // terminator
        release_wqes(q);
        st_relaxed_sys32(reinterpret_cast<uint32_t*>(q->dbrec),
                         bswap32((uint32_t)((posted + 1) & 0xffff)));
        state_store<S>(&q->rq_posted, posted + 1);
        s = OK;
    }
    if (S != sharing::exclusive) unlock<S>(&q->rq_lock);
    return s;
}

// Takes the receive CQE at rcq_ci if software owns it: 1 (a completion, in *out), -1 (an error
// CQE, in *err), 0 (none). Caller holds the receive-CQ lock (or owns the QP exclusively).
template <sharing S>
__device__ __forceinline__ int rcq_take(gpuverbs_qp* q, recv_completion* out, error* err) {
    const uint64_t ci = state_load<S>(&q->rcq_ci);
    const uint32_t n = q->rcq_ncqe;
    const uint8_t* cqe = reinterpret_cast<const uint8_t*>(q->rcq_ring) + (ci & (n - 1)) * 64;
    const uint32_t tail = ld_acquire_sys(reinterpret_cast<const uint32_t*>(cqe + 60));
    const uint32_t op_own = tail >> 24;
    const uint32_t opcode = op_own >> 4;
    if (opcode == 15 || (op_own & 1u) != (uint32_t)((ci / n) & 1u)) return 0;
    const uint16_t counter = (uint16_t)(((tail & 0xffu) << 8) | ((tail >> 8) & 0xffu));
    int r;
    if (opcode == 13 || opcode == 14) {
        const uint32_t synd = *reinterpret_cast<const volatile uint32_t*>(cqe + 52);
        if (err) *err = error{(uint8_t)(synd >> 24), (uint8_t)(synd >> 16), counter};
        r = -1;
    } else {
        out->opcode = (uint8_t)opcode;
        out->imm = opcode == CQE_RESP_SEND
                       ? 0u
                       : bswap32(*reinterpret_cast<const volatile uint32_t*>(cqe + 36));
        out->byte_count = bswap32(*reinterpret_cast<const volatile uint32_t*>(cqe + 44));
        out->wqe_counter = counter;
        r = 1;
    }
    state_store<S>(&q->rcq_ci, ci + 1);
    st_relaxed_sys32(reinterpret_cast<uint32_t*>(q->rcq_dbrec),
                     bswap32((uint32_t)((ci + 1) & 0xffffff)));
    return r;
}

// Waits for the next receive completion: OK (in *out), ERROR_CQE (a receive that failed, e.g.
// LOCAL_LENGTH for a message larger than its buffer, or WR_FLUSH once the QP is in error; in
// *err), TIMEOUT when none came within the budget (a budget of 0 looks once).
template <sharing S = sharing::gpu>
__device__ status recv_wait(gpuverbs_qp* q, recv_completion* out, uint64_t budget_ns,
                            error* err = nullptr) {
    if (q->checked_out) return BUSY;
    if (!can_receive(q)) return INVALID;
    call_clock c(budget_ns);
    c.start();
    for (;;) {
        if (S == sharing::exclusive || try_lock<S>(&q->rcq_lock)) {
            const int r = rcq_take<S>(q, out, err);
            if (S != sharing::exclusive) unlock<S>(&q->rcq_lock);
            if (r != 0) return r > 0 ? OK : ERROR_CQE;
        }
        if (c.expired()) return TIMEOUT;
    }
}

// ------------------------------------------------------------------------------------------
// Warp and block scope: one reservation, one doorbell, partial participation allowed
// ------------------------------------------------------------------------------------------

// Every active lane of the warp calls it with its own buffers; lanes that are not active
// (diverged, exited) simply do not take part. One reservation and one doorbell per call.
template <sharing S = sharing::gpu>
__device__ status put_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                           uint32_t len, bool signaled, uint64_t budget_ns) {
    const uint32_t mask = __activemask();
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t leader = __ffs(mask) - 1;
    const uint32_t count = __popc(mask);
    const uint32_t rank = __popc(mask & ((1u << lane) - 1u));
    uint64_t start = 0;
    status s = OK;
    call_clock c(budget_ns);  // the leader's: one budget for its reserve, publish and ring
    if (lane == leader) {
        bool force = false;
        s = reserve<S>(q, count, c, &start, &force);
        signaled = signaled || force;
    }
    start = __shfl_sync(mask, start, leader);
    s = (status)__shfl_sync(mask, (int)s, leader);
    signaled = __shfl_sync(mask, signaled, leader);
    if (s != OK) return s;
    const bool last = rank == count - 1;
    const block b = build_write(q, start + rank, laddr, lk, raddr, rk, len,
                                (signaled && last) ? CE_SIGNALED : 0);
    store_block(q, start + rank, b);
    // A BlueFlame ring copies the last WQE from the leader's registers: the lane that built
    // it hands it over (other modes do not read it).
    block lastb = b;
    const bool bf = q->db_mode == GPUVERBS_DB_BLUEFLAME;
    if (bf) {
        const uint32_t owner = 31u - __clz(mask);
        for (int i = 0; i < 4; ++i) {
            lastb.u[i].x = __shfl_sync(mask, b.u[i].x, owner);
            lastb.u[i].y = __shfl_sync(mask, b.u[i].y, owner);
            lastb.u[i].z = __shfl_sync(mask, b.u[i].z, owner);
            lastb.u[i].w = __shfl_sync(mask, b.u[i].w, owner);
        }
    }
    __syncwarp(mask);
    if (lane == leader) {
        s = publish<S>(q, start, count, start + count - 1, signaled, c);
        if (s == OK) s = ring<S>(q, c, &lastb);
    }
    // Orders the leader's descriptor stores before whichever lane leads the next call
    // (exclusive mode reads them with plain loads).
    __syncwarp(mask);
    return (status)__shfl_sync(mask, (int)s, leader);
}

// Every thread of the block calls it (a collective: it synchronises the block); threads with
// `participate == false` post nothing. One reservation and one doorbell for the block.
template <sharing S = sharing::gpu>
__device__ status put_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                            uint64_t raddr, rkey rk, uint32_t len, bool signaled,
                            uint64_t budget_ns) {
    __shared__ uint32_t count;
    __shared__ uint64_t start;
    __shared__ int st;
    __shared__ bool sig;
    __shared__ block lastb;  // the last WQE, for a BlueFlame ring
    const uint32_t tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    if (tid == 0) count = 0;
    __syncthreads();
    uint32_t rank = participate ? atomicAdd(&count, 1u) : 0;
    __syncthreads();
    call_clock c(budget_ns);  // thread 0's: one budget for its reserve, publish and ring
    if (tid == 0) {
        bool force = false;
        st = count ? reserve<S>(q, count, c, &start, &force) : OK;
        sig = signaled || force;
    }
    __syncthreads();
    status s = (status)st;
    signaled = sig;
    if (s == OK && participate) {
        const bool last = rank == count - 1;
        const block b = build_write(q, start + rank, laddr, lk, raddr, rk, len,
                                    (signaled && last) ? CE_SIGNALED : 0);
        store_block(q, start + rank, b);
        if (last) lastb = b;
    }
    __syncthreads();
    if (tid == 0 && s == OK && count) {
        s = publish<S>(q, start, count, start + count - 1, signaled, c);
        if (s == OK) s = ring<S>(q, c, &lastb);
        st = s;
    }
    __syncthreads();
    s = (status)st;
    __syncthreads();
    return s;
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_QP_CUH
