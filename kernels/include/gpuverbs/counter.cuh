// gpuverbs device API — counter.cuh (see qp.cuh for the layers).
//
// Completion counters the NIC moves, with no thread polling for them: put_counter,
// get_counter, signal_counter and put_signal_counter at thread, warp and block scope, and
// wait_counter over a QP and its companion. Each counted WQE on the QP `q` is signaled; then,
// on the companion QP `cp` (the host's `Pd::create_companion`: a cross-channel master connected
// to itself), a WAIT for that WQE's CQE on `q`'s send CQ and a fetch-add of `add` on the
// counter. The device executes the fetch-add only once the WAIT has seen the CQE, so the
// counter never moves before what it counts has completed; a WAIT whose CQE is an error CQE
// ends in error on the soft NIC (docs/softnic.md, "What WAIT waits for"), so the counter of a
// failed WQE never moves. The software counters of onesided.cuh (put_counted, moved by the CQ
// poll path) are the other kind: they need a poller, these do not.
#ifndef GPUVERBS_COUNTER_CUH
#define GPUVERBS_COUNTER_CUH

#include "scope.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

// Whether `cp` can count `q`'s WQEs: two distinct QPs, and `q`'s send CQ not collapsed (its CQE
// numbers, `sq_cqes`, are then not known). The companion must be a cross-channel master
// (`Pd::create_companion`); a WAIT posted on another QP fails with LOCAL_QP_OP.
__device__ __forceinline__ bool nic_counts(const gpuverbs_qp* q, const gpuverbs_qp* cp) {
    return q != nullptr && cp != nullptr && q != cp && !q->scq_collapsed;
}

// The companion's two WQEs for one counted WQE, at blocks `idx` and `idx + 1`: a WAIT for CQE
// number `cqe` of CQ `cqn` (stored into the ring), then a fetch-add of `add` on `counter`
// (the companion's loopback; the old value lands in its scratch word), returned in registers
// (the last WQE, for a BlueFlame ring) with `flags`.
__device__ __forceinline__ block build_count(const gpuverbs_qp* ck, uint64_t idx, uint32_t cqn,
                                             uint64_t cqe, uint64_t counter, rkey counter_key,
                                             uint64_t add, uint8_t flags) {
    store_block(ck, idx, build_wait(ck, idx, cqn, (uint32_t)cqe, 0));
    return build_atomic(ck, idx + 1, OP_ATOMIC_FA, counter, counter_key, add, 0, ck->scratch,
                        lkey{ck->scratch_lkey}, flags);
}

// The companion's half of a counted call at thread scope: reserve 2 blocks, WAIT + fetch-add,
// publish and ring. The fetch-add asks for a CQE only when the reservation says the ring needs
// one (selective signaling; the companion's space is retired through them).
template <sharing S>
__device__ __forceinline__ status companion_count(gpuverbs_qp* cp, uint32_t cqn, uint64_t cqe,
                                                  uint64_t counter, rkey counter_key,
                                                  uint64_t add, call_clock& c) {
    return on_copy<S>(cp, [&](gpuverbs_qp* q) -> status {
        const gpuverbs_qp k = consts_of(q);
        uint64_t idx, published;
        bool force = false;
        const status s = reserve<S>(q, 2, c, &idx, &force, &published);
        if (s != OK) return s;
        const block fa =
            build_count(&k, idx, cqn, cqe, counter, counter_key, add, force ? CE_SIGNALED : 0);
        store_block(&k, idx + 1, fa);
        return publish_ring<S>(q, k, idx, 2, idx + 1, force, published, true, c, &fa);
    });
}

// A counted call at thread scope: on `qp`, `blocks` blocks whose last WQE is the counted one
// (signaled), written by `build(k, idx)` (it stores all but the last block and returns the
// last, one block), published and rung; then the companion's WAIT + fetch-add. One budget for
// both. INVALID when `cp` cannot count `qp`'s WQEs (nic_counts). A companion step that fails
// (TIMEOUT, ERROR_CQE, BROKEN) leaves the WQE on `qp` posted and its counter unmoved.
template <sharing S, typename Build>
__device__ __forceinline__ status post_nic_counted(gpuverbs_qp* qp, gpuverbs_qp* cp,
                                                   uint32_t blocks, uint64_t counter,
                                                   rkey counter_key, uint64_t add,
                                                   uint64_t budget_ns, Build build) {
    if (!nic_counts(qp, cp)) return INVALID;
    call_clock c(budget_ns);
    uint64_t cqe = 0;
    const uint32_t cqn = qp->scq_cqn;
    const status s = on_copy<S>(qp, [&](gpuverbs_qp* q) -> status {
        const gpuverbs_qp k = consts_of(q);
        uint64_t idx, published;
        const status r = reserve<S>(q, blocks, c, &idx, nullptr, &published);
        if (r != OK) return r;
        const block b = build(&k, idx);
        store_block(&k, idx + blocks - 1, b);
        return publish_ring<S>(q, k, idx, blocks, idx + blocks - 1, true, published, true, c, &b,
                               1, &cqe);
    });
    if (s != OK) return s;
    return companion_count<S>(cp, cqn, cqe, counter, counter_key, add, c);
}

// RDMA write of `len` bytes; the NIC adds `add` to the 8-byte `counter` (registered with
// REMOTE_ATOMIC in the companion's PD, key `counter_key`) once the write has completed.
// GPUNetIO's put_counter, GIN's put with a CounterInc local action.
template <sharing S = sharing::gpu>
__device__ status put_counter(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                              uint32_t len, gpuverbs_qp* cp, uint64_t counter,
                              rkey counter_key, uint64_t add, uint64_t budget_ns) {
    return post_nic_counted<S>(q, cp, 1, counter, counter_key, add, budget_ns,
                               [&](const gpuverbs_qp* k, uint64_t idx) {
                                   return build_write(k, idx, laddr, lk, raddr, rk, len,
                                                      CE_SIGNALED);
                               });
}

// RDMA read of `len` bytes into local memory; the NIC moves the counter once they are there
// (a reader that sees the counter with acquire sees the bytes). GPUNetIO's get_counter.
template <sharing S = sharing::gpu>
__device__ status get_counter(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                              uint32_t len, gpuverbs_qp* cp, uint64_t counter,
                              rkey counter_key, uint64_t add, uint64_t budget_ns) {
    return post_nic_counted<S>(q, cp, 1, counter, counter_key, add, budget_ns,
                               [&](const gpuverbs_qp* k, uint64_t idx) {
                                   return build_read(k, idx, laddr, lk, raddr, rk, len,
                                                     CE_SIGNALED);
                               });
}

// Atomic add of `sig_add` on the peer's 8-byte signal word; the NIC moves the counter once
// the signal has been applied (acknowledged). GIN's signal with a counter.
template <sharing S = sharing::gpu>
__device__ status signal_counter(gpuverbs_qp* q, uint64_t sig_addr, rkey sig_key,
                                 uint64_t sig_add, gpuverbs_qp* cp, uint64_t counter,
                                 rkey counter_key, uint64_t add, uint64_t budget_ns) {
    return post_nic_counted<S>(q, cp, 1, counter, counter_key, add, budget_ns,
                               [&](const gpuverbs_qp* k, uint64_t idx) {
                                   return build_atomic(k, idx, OP_ATOMIC_FA, sig_addr, sig_key,
                                                       sig_add, 0, k->scratch,
                                                       lkey{k->scratch_lkey}, CE_SIGNALED);
                               });
}

// The two WQEs of a put with a signal at blocks `idx` and `idx + 1`: the write, unsignaled,
// stored into the ring; the signal (fetch-add of `sig_add`, signaled: the counted WQE),
// returned in registers.
__device__ __forceinline__ block build_write_signal(const gpuverbs_qp* k, uint64_t idx,
                                                    uint64_t laddr, lkey lk, uint64_t raddr,
                                                    rkey rk, uint32_t len, uint64_t sig_addr,
                                                    rkey sig_key, uint64_t sig_add) {
    prep_write(k, idx, laddr, lk, raddr, rk, len, 0);
    return build_atomic(k, idx + 1, OP_ATOMIC_FA, sig_addr, sig_key, sig_add, 0, k->scratch,
                        lkey{k->scratch_lkey}, CE_SIGNALED);
}

// RDMA write then a signal (add `sig_add`), counted on the signal: the counter moves once
// both are done (an RC responder applies them in order). GPUNetIO's put_signal_counter.
template <sharing S = sharing::gpu>
__device__ status put_signal_counter(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr,
                                     rkey rk, uint32_t len, uint64_t sig_addr, rkey sig_key,
                                     uint64_t sig_add, gpuverbs_qp* cp, uint64_t counter,
                                     rkey counter_key, uint64_t add, uint64_t budget_ns) {
    return post_nic_counted<S>(q, cp, 2, counter, counter_key, add, budget_ns,
                               [&](const gpuverbs_qp* k, uint64_t idx) {
                                   return build_write_signal(k, idx, laddr, lk, raddr, rk, len,
                                                             sig_addr, sig_key, sig_add);
                               });
}

// ------------------------------------------------------------------------------------------
// Warp and block scope: one reservation and one doorbell on the QP, then one reservation and
// one doorbell on the companion (every lane's WAIT + fetch-add), under one budget
// ------------------------------------------------------------------------------------------

// Every active lane posts `per_lane` blocks on `q` (its counted WQE last, signaled, built by
// `build(k, idx)`: it stores all but the last block and returns the last), then its WAIT +
// fetch-add on `cp` for its own counter (or the same one: it then moves once per lane).
template <sharing S, typename Build>
__device__ __forceinline__ status warp_nic_counted(gpuverbs_qp* q, gpuverbs_qp* cp,
                                                   uint32_t per_lane, uint64_t counter,
                                                   rkey counter_key, uint64_t add,
                                                   uint64_t budget_ns, Build build) {
    if (!nic_counts(q, cp)) return INVALID;
    const uint32_t mask = __activemask();
    const uint32_t rank = __popc(mask & ((1u << (threadIdx.x & 31u)) - 1u));
    const uint32_t cqn = q->scq_cqn;
    call_clock c(budget_ns);
    uint64_t first = 0;
    status s = warp_post_on<S>(
        q, per_lane, 1, true, c,
        [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
            const block b = build(k, idx);
            store_block(k, idx + per_lane - 1, b);
            return b;
        },
        1, &first);
    if (s != OK) return s;
    return warp_post_on<S>(cp, 2, 1, false, c, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block fa = build_count(k, idx, cqn, first + rank, counter, counter_key, add, f);
        store_block(k, idx + 1, fa);
        return fa;
    });
}

// As warp_nic_counted for the threads of a block with `participate` (a collective: every
// thread of the block calls it).
template <sharing S, typename Build>
__device__ __forceinline__ status block_nic_counted(gpuverbs_qp* q, gpuverbs_qp* cp,
                                                    bool participate, uint32_t per_thread,
                                                    uint64_t counter, rkey counter_key,
                                                    uint64_t add, uint64_t budget_ns,
                                                    Build build) {
    if (!nic_counts(q, cp)) return INVALID;
    const uint32_t cqn = q->scq_cqn;
    call_clock c(budget_ns);
    uint64_t first = 0;
    uint32_t rank = 0;
    status s = block_post_on<S>(
        q, participate, per_thread, 1, true, c,
        [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
            const block b = build(k, idx);
            store_block(k, idx + per_thread - 1, b);
            return b;
        },
        1, &first, &rank);
    if (s != OK) return s;
    return block_post_on<S>(cp, participate, 2, 1, false, c,
                            [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                                const block fa = build_count(k, idx, cqn, first + rank, counter,
                                                             counter_key, add, f);
                                store_block(k, idx + 1, fa);
                                return fa;
                            });
}

template <sharing S = sharing::gpu>
__device__ status put_counter_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr,
                                   rkey rk, uint32_t len, gpuverbs_qp* cp, uint64_t counter,
                                   rkey counter_key, uint64_t add, uint64_t budget_ns) {
    return warp_nic_counted<S>(q, cp, 1, counter, counter_key, add, budget_ns,
                               [&](const gpuverbs_qp* k, uint64_t idx) {
                                   return build_write(k, idx, laddr, lk, raddr, rk, len,
                                                      CE_SIGNALED);
                               });
}

template <sharing S = sharing::gpu>
__device__ status put_counter_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                                    uint64_t raddr, rkey rk, uint32_t len, gpuverbs_qp* cp,
                                    uint64_t counter, rkey counter_key, uint64_t add,
                                    uint64_t budget_ns) {
    return block_nic_counted<S>(q, cp, participate, 1, counter, counter_key, add, budget_ns,
                                [&](const gpuverbs_qp* k, uint64_t idx) {
                                    return build_write(k, idx, laddr, lk, raddr, rk, len,
                                                       CE_SIGNALED);
                                });
}

template <sharing S = sharing::gpu>
__device__ status get_counter_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr,
                                   rkey rk, uint32_t len, gpuverbs_qp* cp, uint64_t counter,
                                   rkey counter_key, uint64_t add, uint64_t budget_ns) {
    return warp_nic_counted<S>(q, cp, 1, counter, counter_key, add, budget_ns,
                               [&](const gpuverbs_qp* k, uint64_t idx) {
                                   return build_read(k, idx, laddr, lk, raddr, rk, len,
                                                     CE_SIGNALED);
                               });
}

template <sharing S = sharing::gpu>
__device__ status get_counter_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                                    uint64_t raddr, rkey rk, uint32_t len, gpuverbs_qp* cp,
                                    uint64_t counter, rkey counter_key, uint64_t add,
                                    uint64_t budget_ns) {
    return block_nic_counted<S>(q, cp, participate, 1, counter, counter_key, add, budget_ns,
                                [&](const gpuverbs_qp* k, uint64_t idx) {
                                    return build_read(k, idx, laddr, lk, raddr, rk, len,
                                                      CE_SIGNALED);
                                });
}

template <sharing S = sharing::gpu>
__device__ status signal_counter_warp(gpuverbs_qp* q, uint64_t sig_addr, rkey sig_key,
                                      uint64_t sig_add, gpuverbs_qp* cp, uint64_t counter,
                                      rkey counter_key, uint64_t add, uint64_t budget_ns) {
    return warp_nic_counted<S>(q, cp, 1, counter, counter_key, add, budget_ns,
                               [&](const gpuverbs_qp* k, uint64_t idx) {
                                   return build_atomic(k, idx, OP_ATOMIC_FA, sig_addr, sig_key,
                                                       sig_add, 0, k->scratch,
                                                       lkey{k->scratch_lkey}, CE_SIGNALED);
                               });
}

template <sharing S = sharing::gpu>
__device__ status signal_counter_block(gpuverbs_qp* q, bool participate, uint64_t sig_addr,
                                       rkey sig_key, uint64_t sig_add, gpuverbs_qp* cp,
                                       uint64_t counter, rkey counter_key, uint64_t add,
                                       uint64_t budget_ns) {
    return block_nic_counted<S>(q, cp, participate, 1, counter, counter_key, add, budget_ns,
                                [&](const gpuverbs_qp* k, uint64_t idx) {
                                    return build_atomic(k, idx, OP_ATOMIC_FA, sig_addr,
                                                        sig_key, sig_add, 0, k->scratch,
                                                        lkey{k->scratch_lkey}, CE_SIGNALED);
                                });
}

// Every active lane's write then signal (2 blocks each, only the signal signaled and counted)
// under one reservation and one doorbell on `q`, then every lane's WAIT + fetch-add on `cp`.
template <sharing S = sharing::gpu>
__device__ status put_signal_counter_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk,
                                          uint64_t raddr, rkey rk, uint32_t len,
                                          uint64_t sig_addr, rkey sig_key, uint64_t sig_add,
                                          gpuverbs_qp* cp, uint64_t counter, rkey counter_key,
                                          uint64_t add, uint64_t budget_ns) {
    return warp_nic_counted<S>(q, cp, 2, counter, counter_key, add, budget_ns,
                               [&](const gpuverbs_qp* k, uint64_t idx) {
                                   return build_write_signal(k, idx, laddr, lk, raddr, rk, len,
                                                             sig_addr, sig_key, sig_add);
                               });
}

// As put_signal_counter_warp for the participants of a block (a collective).
template <sharing S = sharing::gpu>
__device__ status put_signal_counter_block(gpuverbs_qp* q, bool participate, uint64_t laddr,
                                           lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                           uint64_t sig_addr, rkey sig_key, uint64_t sig_add,
                                           gpuverbs_qp* cp, uint64_t counter,
                                           rkey counter_key, uint64_t add,
                                           uint64_t budget_ns) {
    return block_nic_counted<S>(q, cp, participate, 2, counter, counter_key, add, budget_ns,
                                [&](const gpuverbs_qp* k, uint64_t idx) {
                                    return build_write_signal(k, idx, laddr, lk, raddr, rk, len,
                                                              sig_addr, sig_key, sig_add);
                                });
}

// ------------------------------------------------------------------------------------------
// Waiting for a counter the NIC moves
// ------------------------------------------------------------------------------------------

// Waits until `counter` reaches `value`, polling the send CQs of `q` (the QP whose counted WQEs
// it counts: retires its blocks, records its errors) and of its companion `cp` meanwhile. OK
// (`*seen`: the value read), TIMEOUT, or ERROR_CQE once `q` or `cp` has recorded an error and
// the counter is still short after the companion has stopped (it recorded an error too, or
// retired everything it was given) or the budget ran out: `*err` is `q`'s error when it has
// one (the counted WQE that failed), else the companion's. GIN's waitCounter. Read the counter
// alone with read_counter, set it with reset_counter (onesided.cuh).
template <sharing S, typename Reached>
__device__ status wait_counter_until(gpuverbs_qp* q, gpuverbs_qp* cp, const uint64_t* counter,
                                     Reached reached, uint64_t budget_ns, error* err,
                                     uint64_t* seen) {
    if (q == nullptr || cp == nullptr || q == cp) return INVALID;
    call_clock c(budget_ns);
    c.start();
    for (;;) {
        uint64_t v = ld_acquire_sys64(counter);
        if (reached(v)) {
            if (seen) *seen = v;
            return OK;
        }
        const status sq = on_copy<S>(q, [&](gpuverbs_qp* x) { return scq_progress<S>(x); });
        const status sc = on_copy<S>(cp, [&](gpuverbs_qp* x) { return scq_progress<S>(x); });
        if (sq == BUSY || sc == BUSY) return BUSY;
        const bool failed = sq == ERROR_CQE || sc == ERROR_CQE;
        // the companion has stopped: in error, or everything it was given has retired
        const bool stopped = sc == ERROR_CQE || state_load<S>(&cp->sq_retired) >=
                                                    state_load<S>(&cp->sq_ready);
        const bool out = c.expired();
        if (failed && (stopped || out)) {
            v = ld_acquire_sys64(counter);
            if (seen) *seen = v;
            if (reached(v)) return OK;
            if (err) *err = sq == ERROR_CQE ? last_error(q) : last_error(cp);
            return ERROR_CQE;
        }
        if (out) {
            if (seen) *seen = ld_acquire_sys64(counter);
            return TIMEOUT;
        }
    }
}

template <sharing S = sharing::gpu>
__device__ status wait_counter(gpuverbs_qp* q, gpuverbs_qp* cp, const uint64_t* counter,
                               uint64_t value, uint64_t budget_ns, error* err = nullptr,
                               uint64_t* seen = nullptr) {
    return wait_counter_until<S>(
        q, cp, counter, [value](uint64_t v) { return v >= value; }, budget_ns, err, seen);
}

// `wait_counter` of a NIC-moved counter with NCCL GIN's rolling comparison of `bits` bits
// (waitCounter(coop, counter, least, bits = 56)): waits until rolling_le(least, counter, bits).
// `*seen` is masked to `bits`. INVALID unless 1 <= bits <= 64.
template <sharing S = sharing::gpu>
__device__ status wait_counter_rolling(gpuverbs_qp* q, gpuverbs_qp* cp, const uint64_t* counter,
                                       uint64_t least, uint32_t bits, uint64_t budget_ns,
                                       error* err = nullptr, uint64_t* seen = nullptr) {
    if (!rolling_bits_ok(bits)) return INVALID;
    const status s = wait_counter_until<S>(
        q, cp, counter, [least, bits](uint64_t v) { return rolling_le(least, v, bits); },
        budget_ns, err, seen);
    if (seen) *seen &= rolling_mask(bits);
    return s;
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_COUNTER_CUH
