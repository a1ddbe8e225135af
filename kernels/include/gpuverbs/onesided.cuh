// gpuverbs device API — onesided.cuh (see qp.cuh for the layers).
//
// High-level operations at thread scope: put, put_imm, put_inline, put_signal, signal, send,
// send_inline, get, atomics, wait_signal, quiet, fence.
#ifndef GPUVERBS_ONESIDED_CUH
#define GPUVERBS_ONESIDED_CUH

#include "sq.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

// ------------------------------------------------------------------------------------------
// High level (thread scope)
// ------------------------------------------------------------------------------------------

// Waits until every WQE published so far has completed. Posts a signaled NOP first when the
// last published WQE was unsignaled (unsignaled WQEs complete only behind a signaled one).
template <sharing S = sharing::gpu>
__device__ status quiet(gpuverbs_qp* qp, uint64_t budget_ns, error* err = nullptr) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
    call_clock c(budget_ns);
    c.start();
    uint64_t target = state_load<S>(&q->sq_ready);
    if (q->sq_signaled_end < target) {
        const gpuverbs_qp k = consts_of(q);
        uint64_t idx, published;
        status s = reserve<S>(q, 1, c, &idx, nullptr, &published);
        if (s == ERROR_CQE && err) *err = last_error(q);
        if (s != OK) return s;
        const block nop = build_nop(&k, idx, CE_SIGNALED);
        store_block(&k, idx, nop);
        s = publish_ring<S>(q, k, idx, 1, idx, true, published, true, c, &nop);
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
    });
}

// Waits until everything up to block `ticket` has completed: a ticket is the end of a WQE (its
// first block from `reserve` plus its blocks, or `sq_ready` read after publishing). Only
// signaled completions retire space, so a signaled WQE must end at or after the ticket (`quiet`
// is the variant that posts one when needed). Returns ERROR_CQE (with the first error) when an
// error completion was seen, TIMEOUT when the budget ran out.
template <sharing S = sharing::gpu>
__device__ status wait_ticket(gpuverbs_qp* qp, uint64_t ticket, uint64_t budget_ns,
                              error* err = nullptr) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
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
    });
}

// One WQE of `blocks` blocks: reserve, prepare (`prep(k, idx, flags)`, given the final
// signaled flag and the descriptor's constants, consts_of), publish, ring.
template <sharing S, typename Prep>
__device__ __forceinline__ status post1(gpuverbs_qp* qp, uint32_t blocks, bool signaled,
                                        bool do_ring, uint64_t budget_ns, Prep prep) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
        const gpuverbs_qp k = consts_of(q);
        uint64_t idx, published;
        bool force = false;
        call_clock c(budget_ns);
        status s = reserve<S>(q, blocks, c, &idx, &force, &published);
        if (s != OK) return s;
        const bool sig = signaled || force;
        prep(&k, idx, sig ? CE_SIGNALED : 0);
        return publish_ring<S>(q, k, idx, blocks, idx, sig, published, do_ring, c, nullptr);
    });
}

// One one-block WQE built in registers (`build(k, idx, flags)` returns it, from the
// descriptor's constants): reserve, store, publish, ring (a BlueFlame ring copies it from the
// registers).
template <sharing S, typename Build>
__device__ __forceinline__ status post_block(gpuverbs_qp* qp, bool signaled, bool do_ring,
                                             uint64_t budget_ns, Build build) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
        const gpuverbs_qp k = consts_of(q);
        uint64_t idx, published;
        bool force = false;
        call_clock c(budget_ns);
        status s = reserve<S>(q, 1, c, &idx, &force, &published);
        if (s != OK) return s;
        const bool sig = signaled || force;
        const block b = build(&k, idx, sig ? CE_SIGNALED : 0);
        store_block(&k, idx, b);
        return publish_ring<S>(q, k, idx, 1, idx, sig, published, do_ring, c, &b);
    });
}

// RDMA write of `len` bytes.
template <sharing S = sharing::gpu>
__device__ status put(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                      uint32_t len, bool signaled, uint64_t budget_ns, bool do_ring = true) {
    return post_block<S>(q, signaled, do_ring, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_write(q, idx, laddr, lk, raddr, rk, len, f);
    });
}

// RDMA write of `len` bytes with a 32-bit immediate: the responder consumes a receive WQE and
// reports `imm` in its receive completion (recv_wait).
template <sharing S = sharing::gpu>
__device__ status put_imm(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                          uint32_t len, uint32_t imm, bool signaled, uint64_t budget_ns,
                          bool do_ring = true) {
    return post_block<S>(q, signaled, do_ring, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_write(q, idx, laddr, lk, raddr, rk, len, f, true, imm);
    });
}

// SEND of `len` bytes into the responder's next receive buffer; with `with_imm`, SEND_IMM
// carrying `imm`.
template <sharing S = sharing::gpu>
__device__ status send(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint32_t len, bool with_imm,
                       uint32_t imm, bool signaled, uint64_t budget_ns, bool do_ring = true) {
    return post_block<S>(q, signaled, do_ring, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_send(q, idx, laddr, lk, len, f, with_imm, imm);
    });
}

// RDMA write with the payload in the WQE (len <= max_inline; `src` is the kernel's own
// memory, reusable when the call returns).
template <sharing S = sharing::gpu>
__device__ status put_inline(gpuverbs_qp* q, const void* src, uint32_t len, uint64_t raddr,
                             rkey rk, bool signaled, uint64_t budget_ns, bool do_ring = true) {
    if (len > q->max_inline) return INVALID;
    return post1<S>(q, inline_write_blocks(len), signaled, do_ring, budget_ns,
                    [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
                        prep_write_inline(q, idx, src, len, raddr, rk, f);
                    });
}

// SEND with the payload in the WQE (len <= max_inline; `src` as put_inline's); with
// `with_imm`, SEND_IMM carrying `imm`.
template <sharing S = sharing::gpu>
__device__ status send_inline(gpuverbs_qp* q, const void* src, uint32_t len, bool with_imm,
                              uint32_t imm, bool signaled, uint64_t budget_ns,
                              bool do_ring = true) {
    if (len > q->max_inline) return INVALID;
    return post1<S>(q, inline_send_blocks(len), signaled, do_ring, budget_ns,
                    [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
                        prep_send_inline(q, idx, src, len, f, with_imm, imm);
                    });
}

// Atomic add of `add` on a remote 8-byte signal word (old value discarded).
template <sharing S = sharing::gpu>
__device__ status signal(gpuverbs_qp* q, uint64_t sig_addr, rkey sig_key, uint64_t add,
                         bool signaled, uint64_t budget_ns, bool do_ring = true) {
    return post_block<S>(q, signaled, do_ring, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_atomic(q, idx, OP_ATOMIC_FA, sig_addr, sig_key, add, 0, q->scratch,
                            lkey{q->scratch_lkey}, f);
    });
}

// Write then signal, ordered (the RC responder executes them in order), one doorbell.
template <sharing S = sharing::gpu>
__device__ status put_signal(gpuverbs_qp* qp, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                             uint32_t len, uint64_t sig_addr, rkey sig_key, uint64_t add,
                             bool signaled, uint64_t budget_ns, bool do_ring = true) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
    const gpuverbs_qp k = consts_of(q);
    uint64_t idx, published;
    bool force = false;
    call_clock c(budget_ns);
    status s = reserve<S>(q, 2, c, &idx, &force, &published);
    if (s != OK) return s;
    signaled = signaled || force;
    prep_write(&k, idx, laddr, lk, raddr, rk, len, 0);
    const block sig = build_atomic(&k, idx + 1, OP_ATOMIC_FA, sig_addr, sig_key, add, 0,
                                   k.scratch, lkey{k.scratch_lkey}, signaled ? CE_SIGNALED : 0);
    store_block(&k, idx + 1, sig);
    return publish_ring<S>(q, k, idx, 2, idx + 1, signaled, published, do_ring, c, &sig);
    });
}

// RDMA read of `len` bytes into local memory; complete once quiet() returns OK.
template <sharing S = sharing::gpu>
__device__ status get(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                      uint32_t len, bool signaled, uint64_t budget_ns) {
    return post_block<S>(q, signaled, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_read(q, idx, laddr, lk, raddr, rk, len, f);
    });
}

// Remote fetch-and-add; the old value lands at `result` (8 registered bytes) after quiet().
template <sharing S = sharing::gpu>
__device__ status atomic_fetch_add(gpuverbs_qp* q, uint64_t raddr, rkey rk, uint64_t add,
                                   uint64_t result, lkey result_key, uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_atomic(q, idx, OP_ATOMIC_FA, raddr, rk, add, 0, result, result_key, f);
    });
}

// Remote compare-and-swap; the old value lands at `result` after quiet().
template <sharing S = sharing::gpu>
__device__ status atomic_compare_swap(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                      uint64_t compare, uint64_t swap, uint64_t result,
                                      lkey result_key, uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_atomic(q, idx, OP_ATOMIC_CS, raddr, rk, swap, compare, result, result_key,
                            f);
    });
}

// Remote fetch-and-add on a 4-byte word (a masked atomic on a 4-byte operand, boundary 0: a
// plain 32-bit add); the old value lands at `result` (4 registered bytes) big-endian, as a
// ConnectX writes it: read it with atomic_result32 after quiet().
template <sharing S = sharing::gpu>
__device__ status atomic_fetch_add32(gpuverbs_qp* q, uint64_t raddr, rkey rk, uint32_t add,
                                     uint64_t result, lkey result_key, uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_atomic32(q, idx, OP_ATOMIC_MASKED_FA, raddr, rk, add, 0, 0, 0, result,
                              result_key, f);
    });
}

// Remote compare-and-swap on a 4-byte word (full masks); the old value as atomic_fetch_add32.
template <sharing S = sharing::gpu>
__device__ status atomic_compare_swap32(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                        uint32_t compare, uint32_t swap, uint64_t result,
                                        lkey result_key, uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_atomic32(q, idx, OP_ATOMIC_MASKED_CS, raddr, rk, swap, compare,
                              0xffffffffu, 0xffffffffu, result, result_key, f);
    });
}

// Remote fetch-and-add on an 8-byte word split into fields: a set bit of `boundary` is the top
// bit of a field, and no carry crosses it (boundary 0: a plain add). The old value lands at
// `result` (8 bytes, host order) after quiet().
template <sharing S = sharing::gpu>
__device__ status atomic_masked_fetch_add(gpuverbs_qp* q, uint64_t raddr, rkey rk, uint64_t add,
                                          uint64_t boundary, uint64_t result, lkey result_key,
                                          uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_masked_fa(q, idx, raddr, rk, add, boundary, result, result_key, f);
    });
}

// Remote compare-and-swap on an 8-byte word under masks: the swap happens when the bits of
// `compare_mask` equal `compare`'s; it then sets the bits of `swap_mask` from `swap` and keeps
// the others. The old value lands at `result` (8 bytes, host order) after quiet(). 2 blocks.
template <sharing S = sharing::gpu>
__device__ status atomic_masked_compare_swap(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                             uint64_t compare, uint64_t compare_mask,
                                             uint64_t swap, uint64_t swap_mask, uint64_t result,
                                             lkey result_key, uint64_t budget_ns) {
    return post1<S>(q, 2, true, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        prep_masked_cs(q, idx, raddr, rk, compare, compare_mask, swap, swap_mask, result,
                       result_key, f);
    });
}

// Sets a remote 8-byte signal word to `value` in one atomic step (a masked compare-and-swap
// that always swaps: NCCL GIN's signal "set", where `signal` is its "add"); old value
// discarded. 2 blocks.
template <sharing S = sharing::gpu>
__device__ status signal_set(gpuverbs_qp* q, uint64_t sig_addr, rkey sig_key, uint64_t value,
                             bool signaled, uint64_t budget_ns, bool do_ring = true) {
    return post1<S>(q, 2, signaled, do_ring, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        prep_masked_cs(q, idx, sig_addr, sig_key, 0, 0, value, ~0ull, q->scratch,
                       lkey{q->scratch_lkey}, f);
    });
}

// The old value a 4-byte atomic left at `result` (big-endian there), in host order.
__device__ __forceinline__ uint32_t atomic_result32(const void* result) {
    return bswap32(*(const volatile uint32_t*)result);
}

// Orders later WQEs after earlier ones: the next WQE carries a strong fence.
template <sharing S = sharing::gpu>
__device__ status fence(gpuverbs_qp* q, uint64_t budget_ns) {
    return post_block<S>(q, false, false, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
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

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_ONESIDED_CUH
