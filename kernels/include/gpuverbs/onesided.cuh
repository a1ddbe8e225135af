// gpuverbs device API — onesided.cuh (see qp.cuh for the layers).
//
// High-level operations at thread scope: put, put_imm, put_inline, put_value, put_signal,
// put_signal_set, signal, signal_set, send, send_inline, get, get_wait, atomics; wait_signal,
// wait_signal_rolling, read_signal, reset_signal; counted calls (put_counted, get_counted,
// put_signal_counted, put_signal_set_counted) with read_counter, wait_counter,
// wait_counter_rolling, reset_counter; quiet, flush, flush_all, wait_ticket, fence.
#ifndef GPUVERBS_ONESIDED_CUH
#define GPUVERBS_ONESIDED_CUH

#include "sq.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

// ------------------------------------------------------------------------------------------
// High level (thread scope)
// ------------------------------------------------------------------------------------------

// quiet's first half: the ticket every WQE published so far completes at. When the last
// published WQE is unsignaled it first posts a signaled NOP (unsignaled WQEs complete only
// behind a signaled one); then it rings whatever was published without ringing (or the wait
// would be for work the device was never told about).
template <sharing S>
__device__ __forceinline__ status quiet_begin(gpuverbs_qp* q, call_clock& c, uint64_t* ticket,
                                              error* err) {
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
    *ticket = target;
    return ring<S>(q, c);
}

// Polls the send CQ until everything up to `ticket` has retired: OK, ERROR_CQE (with `*err`)
// once the ticket retired with an error recorded, TIMEOUT when the clock runs out.
template <sharing S>
__device__ __forceinline__ status poll_to(gpuverbs_qp* q, uint64_t ticket, call_clock& c,
                                          error* err) {
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

// Waits until every WQE published so far has completed. Posts a signaled NOP first when the
// last published WQE was unsignaled (unsignaled WQEs complete only behind a signaled one).
template <sharing S = sharing::gpu>
__device__ status quiet(gpuverbs_qp* qp, uint64_t budget_ns, error* err = nullptr) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
        call_clock c(budget_ns);
        c.start();
        uint64_t target = 0;
        const status s = quiet_begin<S>(q, c, &target, err);
        if (s != OK) return s;
        return poll_to<S>(q, target, c, err);
    });
}

// NCCL GIN's flush of one peer: every operation posted to this QP before the call has
// completed at its target (an RC completion: the responder acknowledged it; a READ's or an
// atomic's data is in local memory). The same call as quiet.
template <sharing S = sharing::gpu>
__device__ status flush(gpuverbs_qp* q, uint64_t budget_ns, error* err = nullptr) {
    return quiet<S>(q, budget_ns, err);
}

// flush of every QP in `qps[0..n)` under one budget: each QP's NOP (where one is needed) is
// posted and rung before any is waited for, so the QPs drain side by side, 16 at a time. OK
// when all have completed; otherwise the first failing QP's status, its index in `*failed`
// (when given) and its error in `*err`; the QPs after it are still flushed (their status is
// not reported).
template <sharing S = sharing::gpu>
__device__ status flush_all(gpuverbs_qp* const* qps, uint32_t n, uint64_t budget_ns,
                            error* err = nullptr, uint32_t* failed = nullptr) {
    constexpr uint32_t CHUNK = 16;
    call_clock c(budget_ns);
    c.start();
    status first = OK;
    const auto note = [&](status s, uint32_t i) {
        if (s != OK && first == OK) {
            first = s;
            if (failed) *failed = i;
        }
    };
    for (uint32_t base = 0; base < n; base += CHUNK) {
        const uint32_t m = n - base < CHUNK ? n - base : CHUNK;
        uint64_t ticket[CHUNK];
        status began[CHUNK];
        for (uint32_t j = 0; j < m; ++j) {
            error e{};
            began[j] = on_copy<S>(qps[base + j], [&](gpuverbs_qp* q) -> status {
                return quiet_begin<S>(q, c, &ticket[j], &e);
            });
            if (began[j] != OK && first == OK && err) *err = e;
            note(began[j], base + j);
        }
        for (uint32_t j = 0; j < m; ++j) {
            if (began[j] != OK) continue;
            error e{};
            const status s = on_copy<S>(qps[base + j], [&](gpuverbs_qp* q) -> status {
                return poll_to<S>(q, ticket[j], c, &e);
            });
            if (s != OK && first == OK && err) *err = e;
            note(s, base + j);
        }
    }
    return first;
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
        return poll_to<S>(q, ticket, c, err);
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

// Write then set a remote 8-byte signal word to `value` (a masked compare-and-swap that always
// swaps), ordered as put_signal's, one doorbell: 3 blocks (the WRITE, unsignaled; the set
// carries `signaled`).
template <sharing S = sharing::gpu>
__device__ status put_signal_set(gpuverbs_qp* qp, uint64_t laddr, lkey lk, uint64_t raddr,
                                 rkey rk, uint32_t len, uint64_t sig_addr, rkey sig_key,
                                 uint64_t value, bool signaled, uint64_t budget_ns,
                                 bool do_ring = true) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
        const gpuverbs_qp k = consts_of(q);
        uint64_t idx, published;
        bool force = false;
        call_clock c(budget_ns);
        status s = reserve<S>(q, 3, c, &idx, &force, &published);
        if (s != OK) return s;
        signaled = signaled || force;
        prep_write(&k, idx, laddr, lk, raddr, rk, len, 0);
        prep_masked_cs(&k, idx + 1, sig_addr, sig_key, 0, 0, value, ~0ull, k.scratch,
                       lkey{k.scratch_lkey}, signaled ? CE_SIGNALED : 0);
        return publish_ring<S>(q, k, idx, 3, idx + 1, signaled, published, do_ring, c, nullptr);
    });
}

// NCCL GIN's putValue: writes the low `bytes` (1, 2, 4 or 8) bytes of `value`, in the GPU's
// (little-endian) byte order, to `raddr`, carried in the WQE (an inline write: 1 block).
// INVALID for another size or when the QP takes no inline data of that size.
template <sharing S = sharing::gpu>
__device__ status put_value(gpuverbs_qp* q, uint64_t raddr, rkey rk, uint64_t value,
                            uint32_t bytes, bool signaled, uint64_t budget_ns,
                            bool do_ring = true) {
    if (bytes != 1 && bytes != 2 && bytes != 4 && bytes != 8) return INVALID;
    return put_inline<S>(q, &value, bytes, raddr, rk, signaled, budget_ns, do_ring);
}

// RDMA read of `len` bytes into local memory; complete once quiet() returns OK.
template <sharing S = sharing::gpu>
__device__ status get(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                      uint32_t len, bool signaled, uint64_t budget_ns) {
    return post_block<S>(q, signaled, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_read(q, idx, laddr, lk, raddr, rk, len, f);
    });
}

// RDMA read of `len` bytes whose call returns once they are in local memory (GPUNetIO's
// get_wait): posts the READ signaled and polls the send CQ until it has completed, all under
// one budget. OK: the bytes are there (load them past the L1, e.g. __ldcv, where they are in
// GPU memory the SM may have cached); ERROR_CQE (with `*err`) when an error CQE was recorded
// by then (this READ's or an earlier WQE's: the READ is then flushed); TIMEOUT when the budget
// ran out (the READ may still complete later).
template <sharing S = sharing::gpu>
__device__ status get_wait(gpuverbs_qp* qp, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                           uint32_t len, uint64_t budget_ns, error* err = nullptr) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
        const gpuverbs_qp k = consts_of(q);
        uint64_t idx, published;
        call_clock c(budget_ns);
        status s = reserve<S>(q, 1, c, &idx, nullptr, &published);
        if (s == ERROR_CQE && err) *err = last_error(q);
        if (s != OK) return s;
        const block b = build_read(&k, idx, laddr, lk, raddr, rk, len, CE_SIGNALED);
        store_block(&k, idx, b);
        s = publish_ring<S>(q, k, idx, 1, idx, true, published, true, c, &b);
        if (s != OK) return s;
        return poll_to<S>(q, idx + 1, c, err);
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

// Remote fetch-and-add on a 4-byte word split into fields: a set bit of `boundary` is the top
// bit of a field, and no carry crosses it (boundary 0: atomic_fetch_add32). The old value as
// atomic_fetch_add32's (big-endian at `result`: atomic_result32).
template <sharing S = sharing::gpu>
__device__ status atomic_masked_fetch_add32(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                            uint32_t add, uint32_t boundary, uint64_t result,
                                            lkey result_key, uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_atomic32(q, idx, OP_ATOMIC_MASKED_FA, raddr, rk, add, boundary, 0, 0, result,
                              result_key, f);
    });
}

// Remote compare-and-swap on a 4-byte word under masks: swaps when the bits of `compare_mask`
// equal `compare`'s, then sets the bits of `swap_mask` from `swap` and keeps the others (full
// masks: atomic_compare_swap32). The old value as atomic_fetch_add32's. 1 block.
template <sharing S = sharing::gpu>
__device__ status atomic_masked_compare_swap32(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                               uint32_t compare, uint32_t compare_mask,
                                               uint32_t swap, uint32_t swap_mask,
                                               uint64_t result, lkey result_key,
                                               uint64_t budget_ns) {
    return post_block<S>(q, true, true, budget_ns, [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
        return build_atomic32(q, idx, OP_ATOMIC_MASKED_CS, raddr, rk, swap, compare, swap_mask,
                              compare_mask, result, result_key, f);
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

// ------------------------------------------------------------------------------------------
// Counted calls: a local completion counter (NCCL GIN's local action, CounterInc), moved in
// software: the call's WQE is signaled and named in the descriptor's counter table, and the
// thread that takes its CQE (any poller of the send CQ: quiet, wait_counter, a reserve on a
// full ring) adds 1 to `counter` (an 8-byte word in GPU memory) once it completed without an
// error; a failed or flushed WQE never moves it. INVALID where the QP cannot count (a
// collapsed send CQ). The counter moves only when someone polls: wait_counter polls while it
// waits.
// ------------------------------------------------------------------------------------------

// put whose completion moves `counter` (its source may be reused once it moved). 1 block.
template <sharing S = sharing::gpu>
__device__ status put_counted(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                              uint32_t len, uint64_t* counter, uint64_t budget_ns,
                              bool do_ring = true) {
    if (!counts(q)) return INVALID;
    return post_block<S>(q, true, do_ring, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        count_at(k, idx, counter);
        return build_write(k, idx, laddr, lk, raddr, rk, len, f);
    });
}

// get whose completion moves `counter` (the bytes are in local memory once it moved). 1 block.
template <sharing S = sharing::gpu>
__device__ status get_counted(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                              uint32_t len, uint64_t* counter, uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return post_block<S>(q, true, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        count_at(k, idx, counter);
        return build_read(k, idx, laddr, lk, raddr, rk, len, f);
    });
}

// put_signal (`set` false) or put_signal_set (`set` true) whose completion moves `counter`:
// the signal's WQE is counted (the WRITE before it completes with it). 2 or 3 blocks.
template <sharing S>
__device__ __forceinline__ status put_signal_counted_op(gpuverbs_qp* qp, bool set, uint64_t laddr,
                                                        lkey lk, uint64_t raddr, rkey rk,
                                                        uint32_t len, uint64_t sig_addr,
                                                        rkey sig_key, uint64_t value,
                                                        uint64_t* counter, uint64_t budget_ns,
                                                        bool do_ring) {
    if (!counts(qp)) return INVALID;
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
        const gpuverbs_qp k = consts_of(q);
        const uint32_t n = set ? 3 : 2;
        uint64_t idx, published;
        call_clock c(budget_ns);
        status s = reserve<S>(q, n, c, &idx, nullptr, &published);
        if (s != OK) return s;
        prep_write(&k, idx, laddr, lk, raddr, rk, len, 0);
        count_at(&k, idx + 1, counter);
        if (set) {
            prep_masked_cs(&k, idx + 1, sig_addr, sig_key, 0, 0, value, ~0ull, k.scratch,
                           lkey{k.scratch_lkey}, CE_SIGNALED);
            return publish_ring<S>(q, k, idx, n, idx + 1, true, published, do_ring, c, nullptr);
        }
        const block sig = build_atomic(&k, idx + 1, OP_ATOMIC_FA, sig_addr, sig_key, value, 0,
                                       k.scratch, lkey{k.scratch_lkey}, CE_SIGNALED);
        store_block(&k, idx + 1, sig);
        return publish_ring<S>(q, k, idx, n, idx + 1, true, published, do_ring, c, &sig);
    });
}

template <sharing S = sharing::gpu>
__device__ status put_signal_counted(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr,
                                     rkey rk, uint32_t len, uint64_t sig_addr, rkey sig_key,
                                     uint64_t add, uint64_t* counter, uint64_t budget_ns,
                                     bool do_ring = true) {
    return put_signal_counted_op<S>(q, false, laddr, lk, raddr, rk, len, sig_addr, sig_key, add,
                                    counter, budget_ns, do_ring);
}

template <sharing S = sharing::gpu>
__device__ status put_signal_set_counted(gpuverbs_qp* q, uint64_t laddr, lkey lk,
                                         uint64_t raddr, rkey rk, uint32_t len,
                                         uint64_t sig_addr, rkey sig_key, uint64_t value,
                                         uint64_t* counter, uint64_t budget_ns,
                                         bool do_ring = true) {
    return put_signal_counted_op<S>(q, true, laddr, lk, raddr, rk, len, sig_addr, sig_key, value,
                                    counter, budget_ns, do_ring);
}

// The counter now (acquire, system scope: the data of the completions it counts is visible
// after it). NCCL GIN's readCounter.
__device__ __forceinline__ uint64_t read_counter(const uint64_t* counter) {
    return ld_acquire_sys64(counter);
}

// Its low `bits` bits (GIN's readCounter(counter, bits), whose default is COUNTER_BITS, 56).
__device__ __forceinline__ uint64_t read_counter(const uint64_t* counter, uint32_t bits) {
    return ld_acquire_sys64(counter) & rolling_mask(bits);
}

// Sets the counter to `value` (0: GIN's resetCounter), release at system scope. Reset it when
// no counted WQE naming it is in flight (the poll path's add and this store are not one
// atomic step).
__device__ __forceinline__ void reset_counter(uint64_t* counter, uint64_t value = 0) {
    st_release_sys64(counter, value);
}

// Waits until `counter` reaches `value`, polling the send CQ of `q` (the QP whose counted
// calls move it; WQEs posted without ringing are not rung here) meanwhile. OK (`*seen`: the
// value read), TIMEOUT, or ERROR_CQE (with `*err`) once the QP has recorded an error and the
// counter is still short: CQEs come in order, so every counted WQE before the failed one has
// already moved it, and the failed one and those after it never will.
// `wait_counter` with the condition `reached(v)` on the value read.
template <sharing S, typename Reached>
__device__ status wait_counter_until(gpuverbs_qp* qp, const uint64_t* counter, Reached reached,
                                     uint64_t budget_ns, error* err, uint64_t* seen) {
    return on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
        call_clock c(budget_ns);
        c.start();
        for (;;) {
            uint64_t v = ld_acquire_sys64(counter);
            if (!reached(v)) {
                const status s = scq_progress<S>(q);
                if (s == BUSY) return s;
                if (s == ERROR_CQE) v = ld_acquire_sys64(counter);  // moved by this poll?
                if (!reached(v) && s == ERROR_CQE) {
                    if (seen) *seen = v;
                    if (err) *err = last_error(q);
                    return ERROR_CQE;
                }
            }
            if (reached(v) || c.expired()) {
                if (seen) *seen = v;
                return reached(v) ? OK : TIMEOUT;
            }
        }
    });
}

template <sharing S = sharing::gpu>
__device__ status wait_counter(gpuverbs_qp* qp, const uint64_t* counter, uint64_t value,
                               uint64_t budget_ns, error* err = nullptr,
                               uint64_t* seen = nullptr) {
    return wait_counter_until<S>(
        qp, counter, [value](uint64_t v) { return v >= value; }, budget_ns, err, seen);
}

// `wait_counter` with NCCL GIN's rolling comparison of `bits` bits (its waitCounter(coop,
// counter, least, bits = 56)): waits until rolling_le(least, counter, bits), so a counter that
// wrapped past 2^bits still reaches `least`. `*seen`: the last value read, masked to `bits`.
// INVALID (nothing waited for) unless 1 <= bits <= 64.
template <sharing S = sharing::gpu>
__device__ status wait_counter_rolling(gpuverbs_qp* qp, const uint64_t* counter, uint64_t least,
                                       uint32_t bits, uint64_t budget_ns, error* err = nullptr,
                                       uint64_t* seen = nullptr) {
    if (!rolling_bits_ok(bits)) return INVALID;
    const status s = wait_counter_until<S>(
        qp, counter, [least, bits](uint64_t v) { return rolling_le(least, v, bits); },
        budget_ns, err, seen);
    if (seen) *seen &= rolling_mask(bits);
    return s;
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

// Waits (acquire, system scope) until `reached(*sig)`; `*seen` (when given) gets the last value
// read. OK or TIMEOUT.
template <typename Reached>
__device__ __forceinline__ status wait_signal_until(const uint64_t* sig, Reached reached,
                                                    uint64_t budget_ns, uint64_t* seen) {
    uint64_t deadline = now_ns() + budget_ns;
    uint64_t v;
    status s = OK;
    while (!reached(v = ld_acquire_sys64(sig))) {
        if (now_ns() > deadline) {
            s = TIMEOUT;
            break;
        }
    }
    if (seen) *seen = v;
    return s;
}

// Waits (acquire, system scope) until the local 8-byte signal word reaches `value`; `*seen`
// (when given) gets the last value read. OK or TIMEOUT.
__device__ __forceinline__ status wait_signal(const uint64_t* sig, uint64_t value,
                                              uint64_t budget_ns, uint64_t* seen = nullptr) {
    return wait_signal_until(sig, [value](uint64_t v) { return v >= value; }, budget_ns, seen);
}

// Waits until rolling_le(least, *sig, bits): NCCL GIN's waitSignal(coop, signal, least, bits),
// whose comparison is rolling (a word that wrapped past 2^bits still reaches `least`; bits
// above `bits` are ignored). `*seen`: the last value read, masked to `bits`. OK, TIMEOUT, or
// INVALID (nothing waited for) unless 1 <= bits <= 64.
__device__ __forceinline__ status wait_signal_rolling(const uint64_t* sig, uint64_t least,
                                                      uint32_t bits, uint64_t budget_ns,
                                                      uint64_t* seen = nullptr) {
    if (!rolling_bits_ok(bits)) return INVALID;
    const status s = wait_signal_until(
        sig, [least, bits](uint64_t v) { return rolling_le(least, v, bits); }, budget_ns, seen);
    if (seen) *seen &= rolling_mask(bits);
    return s;
}

// The local 8-byte signal word now (acquire, system scope: what the signal's sender wrote
// before it, and the NIC placed, is visible after it). NCCL GIN's readSignal.
__device__ __forceinline__ uint64_t read_signal(const uint64_t* sig) {
    return ld_acquire_sys64(sig);
}

// Its low `bits` bits: GIN's readSignal(signal, bits) ("all but bottom bits set to zero").
__device__ __forceinline__ uint64_t read_signal(const uint64_t* sig, uint32_t bits) {
    return ld_acquire_sys64(sig) & rolling_mask(bits);
}

// Sets the local 8-byte signal word to `value` (0: GIN's resetSignal) with a system-scope
// release store. Not atomic against a signal the NIC applies at the same moment (a store and
// a NIC atomic on the same word may lose either): reset a word once every signal counted in
// it has arrived (wait_signal), before its senders signal it again.
__device__ __forceinline__ void reset_signal(uint64_t* sig, uint64_t value = 0) {
    st_release_sys64(sig, value);
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_ONESIDED_CUH
