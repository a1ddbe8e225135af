// gpuverbs device API — scope.cuh (see qp.cuh for the layers).
//
// Warp and block scope: one reservation and one doorbell for many threads, partial participation
// allowed: put, get, signal (add and set), put with a signal (add and set), the atomics
// (8- and 4-byte fetch-add and compare-swap, plain and masked), and the
// counted put, get and put with a signal; flush and get_wait.
#ifndef GPUVERBS_SCOPE_CUH
#define GPUVERBS_SCOPE_CUH

#include "onesided.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

// ------------------------------------------------------------------------------------------
// Warp and block scope: one reservation, one doorbell, partial participation allowed
// ------------------------------------------------------------------------------------------

// The warp-scope post every warp-scope call is made of. Every active lane of the warp calls it
// (lanes that are not active, diverged or exited, simply do not take part); each lane posts
// `per_lane` blocks, its WQEs, written by `build(k, idx, flags)` from block `idx` on (from the
// descriptor's constants `k`; `flags` belong to the lane's last WQE: CE_SIGNALED on the last
// rank's when `signaled`). `build` returns the lane's last WQE when it is one block
// (`last_blocks` 1): a BlueFlame ring copies it from the registers of the lane that built it.
// A longer last WQE (`last_blocks` > 1) is read back from the ring. One reservation of
// `per_lane` blocks per active lane, one publish and one doorbell per call: the warp's blocks
// must fit in the SQ at once.
//
// `cqes_per_lane` (0: only the last rank's last WQE may be signaled, one CQE in all) says how
// many CQEs each lane's WQEs ask for when every lane's are signaled (the counted calls);
// `first_cqe` (optional) receives, in every lane, the CQE number of the first of them (the
// send CQ's count before the call's WQEs: `sq_cqes`), so lane `rank` has CQE number
// `first + rank * cqes_per_lane`. `c` is the call's clock (the leader's decides).
template <sharing S, typename Build>
__device__ __forceinline__ status warp_post_on(gpuverbs_qp* q, uint32_t per_lane,
                                               uint32_t last_blocks, bool signaled, call_clock& c,
                                               Build build, uint32_t cqes_per_lane = 0,
                                               uint64_t* first_cqe = nullptr) {
    const uint32_t mask = __activemask();
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t leader = __ffs(mask) - 1;
    const uint32_t count = __popc(mask);
    const uint32_t rank = __popc(mask & ((1u << lane) - 1u));
    const uint32_t n = count * per_lane;
    uint64_t start = 0, published = 0;
    status s = OK;
    // Every lane takes the descriptor into registers when the call starts: its constants for
    // the WQE each lane builds (through `q` they would be loaded again after the leader's
    // reservation), and in exclusive mode the state the leader works on (stored back at the
    // end, see on_copy).
    gpuverbs_qp k = S == sharing::exclusive ? *q : consts_of(q);
    gpuverbs_qp* const st = S == sharing::exclusive ? &k : q;
    uint64_t first = 0;
    if (lane == leader) {
        bool force = false;
        s = reserve<S>(st, n, c, &start, &force, &published);
        signaled = signaled || force;
        // A failed reservation may still have taken CQEs (its wait polls the CQ).
        if (S == sharing::exclusive && s != OK && !k.checked_out) store_state(q, k);
    }
    start = __shfl_sync(mask, start, leader);
    s = (status)__shfl_sync(mask, (int)s, leader);
    signaled = __shfl_sync(mask, signaled, leader);
    if (s != OK) return s;
    const bool last = rank == count - 1;
    const block b = build(static_cast<const gpuverbs_qp*>(&k), start + (uint64_t)rank * per_lane,
                          (signaled && last) ? CE_SIGNALED : 0);
    // A BlueFlame ring copies the last WQE from the leader's registers: the lane that built
    // it hands it over (other modes do not read it).
    block lastb = b;
    const bool bf = k.db_mode == GPUVERBS_DB_BLUEFLAME && last_blocks == 1;
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
        s = publish_ring<S>(st, k, start, n, start + n - last_blocks, signaled, published, true, c,
                            last_blocks == 1 ? &lastb : nullptr,
                            cqes_per_lane ? count * cqes_per_lane : CQES_OF_SIGNALED,
                            first_cqe ? &first : nullptr);
        if (S == sharing::exclusive && !k.checked_out) store_state(q, k);
    }
    // Orders the leader's descriptor stores before whichever lane leads the next call
    // (exclusive mode reads them with plain loads).
    __syncwarp(mask);
    if (first_cqe) *first_cqe = __shfl_sync(mask, first, leader);
    return (status)__shfl_sync(mask, (int)s, leader);
}

template <sharing S, typename Build>
__device__ __forceinline__ status warp_post(gpuverbs_qp* q, uint32_t per_lane, uint32_t last_blocks,
                                            bool signaled, uint64_t budget_ns, Build build,
                                            uint32_t cqes_per_lane = 0) {
    call_clock c(budget_ns);  // the leader's: one budget for its reserve, publish and ring
    return warp_post_on<S>(q, per_lane, last_blocks, signaled, c, build, cqes_per_lane);
}

// The block-scope post every block-scope call is made of: every thread of the block calls it
// (a collective: it synchronises the block); threads with `participate == false` post nothing.
// Participants take ranks in arrival order; each posts `per_thread` blocks written by `build`
// (as in warp_post), thread 0 reserves for all and publishes and rings once. Every thread gets
// the same status; with no participant it is OK and nothing is posted. `cqes_per_lane`,
// `first_cqe` and `c` as in warp_post_on (per participant; thread 0's clock decides);
// `rank_out` (optional) receives the participant's rank.
template <sharing S, typename Build>
__device__ __forceinline__ status block_post_on(gpuverbs_qp* q, bool participate,
                                                uint32_t per_thread, uint32_t last_blocks,
                                                bool signaled, call_clock& c, Build build,
                                                uint32_t cqes_per_lane = 0,
                                                uint64_t* first_cqe = nullptr,
                                                uint32_t* rank_out = nullptr) {
    __shared__ uint32_t count;
    __shared__ uint64_t start;
    __shared__ uint64_t first;
    __shared__ int st;
    __shared__ bool sig;
    __shared__ block lastb;  // the last WQE, for a BlueFlame ring
    const uint32_t tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    if (tid == 0) count = 0;
    // The descriptor in registers, as in warp_post: constants for every thread, and in
    // exclusive mode the state thread 0 works on.
    gpuverbs_qp k = S == sharing::exclusive ? *q : consts_of(q);
    gpuverbs_qp* const on = S == sharing::exclusive ? &k : q;
    __syncthreads();
    uint32_t rank = participate ? atomicAdd(&count, 1u) : 0;
    if (rank_out) *rank_out = rank;
    __syncthreads();
    const uint32_t n = count * per_thread;
    uint64_t published = 0;  // thread 0's
    if (tid == 0) {
        bool force = false;
        st = count ? reserve<S>(on, n, c, &start, &force, &published) : OK;
        sig = signaled || force;
    }
    __syncthreads();
    status s = (status)st;
    signaled = sig;
    if (s == OK && participate) {
        const bool last = rank == count - 1;
        const block b = build(static_cast<const gpuverbs_qp*>(&k),
                              start + (uint64_t)rank * per_thread,
                              (signaled && last) ? CE_SIGNALED : 0);
        if (last && last_blocks == 1) lastb = b;
    }
    __syncthreads();
    if (tid == 0 && s == OK && count) {
        uint64_t f = 0;
        s = publish_ring<S>(on, k, start, n, start + n - last_blocks, signaled, published, true, c,
                            last_blocks == 1 ? &lastb : nullptr,
                            cqes_per_lane ? count * cqes_per_lane : CQES_OF_SIGNALED,
                            first_cqe ? &f : nullptr);
        first = f;
        st = s;
    }
    if (S == sharing::exclusive && tid == 0 && !k.checked_out) store_state(q, k);
    __syncthreads();
    s = (status)st;
    if (first_cqe) *first_cqe = first;
    __syncthreads();
    return s;
}

template <sharing S, typename Build>
__device__ __forceinline__ status block_post(gpuverbs_qp* q, bool participate, uint32_t per_thread,
                                             uint32_t last_blocks, bool signaled,
                                             uint64_t budget_ns, Build build,
                                             uint32_t cqes_per_lane = 0) {
    call_clock c(budget_ns);  // thread 0's: one budget for its reserve, publish and ring
    return block_post_on<S>(q, participate, per_thread, last_blocks, signaled, c, build,
                            cqes_per_lane);
}

// ------------------------------------------------------------------------------------------
// put, get
// ------------------------------------------------------------------------------------------

// Every active lane of the warp calls it with its own buffers; lanes that are not active
// (diverged, exited) simply do not take part. One reservation and one doorbell per call.
template <sharing S = sharing::gpu>
__device__ status put_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                           uint32_t len, bool signaled, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, signaled, budget_ns,
                        [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                            const block b = build_write(k, idx, laddr, lk, raddr, rk, len, f);
                            store_block(k, idx, b);
                            return b;
                        });
}

// Every thread of the block calls it (a collective: it synchronises the block); threads with
// `participate == false` post nothing. One reservation and one doorbell for the block.
template <sharing S = sharing::gpu>
__device__ status put_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                            uint64_t raddr, rkey rk, uint32_t len, bool signaled,
                            uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, signaled, budget_ns,
                         [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                             const block b = build_write(k, idx, laddr, lk, raddr, rk, len, f);
                             store_block(k, idx, b);
                             return b;
                         });
}

// RDMA read of `len` bytes into each lane's local buffer (warp scope); complete once a CQE
// covering it is in (quiet).
template <sharing S = sharing::gpu>
__device__ status get_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                           uint32_t len, bool signaled, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, signaled, budget_ns,
                        [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                            const block b = build_read(k, idx, laddr, lk, raddr, rk, len, f);
                            store_block(k, idx, b);
                            return b;
                        });
}

// get_warp at block scope (a collective, as put_block).
template <sharing S = sharing::gpu>
__device__ status get_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                            uint64_t raddr, rkey rk, uint32_t len, bool signaled,
                            uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, signaled, budget_ns,
                         [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                             const block b = build_read(k, idx, laddr, lk, raddr, rk, len, f);
                             store_block(k, idx, b);
                             return b;
                         });
}

// ------------------------------------------------------------------------------------------
// Signals: add (fetch-add, old value discarded), set (masked compare-swap that always swaps),
// and a put followed by either. Per lane / thread: signal 1 block, signal_set 2, put_signal 2
// (WRITE + fetch-add), put_signal_set 3 (WRITE + masked compare-swap). The WRITE is unsignaled;
// the signal carries the flags. Each lane's signal follows its own WRITE (an RC responder
// executes them in order).
// ------------------------------------------------------------------------------------------

// One lane's or thread's signal WQEs at `idx` (`set`: a set of `value`, else an add).
__device__ __forceinline__ block build_signal_at(const gpuverbs_qp* k, uint64_t idx, bool set,
                                                 uint64_t sig_addr, rkey sig_key, uint64_t value,
                                                 uint8_t f) {
    if (set) {
        prep_masked_cs(k, idx, sig_addr, sig_key, 0, 0, value, ~0ull, k->scratch,
                       lkey{k->scratch_lkey}, f);
        return block{};
    }
    const block b = build_atomic(k, idx, OP_ATOMIC_FA, sig_addr, sig_key, value, 0, k->scratch,
                                 lkey{k->scratch_lkey}, f);
    store_block(k, idx, b);
    return b;
}

template <sharing S = sharing::gpu>
__device__ status signal_warp(gpuverbs_qp* q, uint64_t sig_addr, rkey sig_key, uint64_t add,
                              bool signaled, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, signaled, budget_ns,
                        [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                            return build_signal_at(k, idx, false, sig_addr, sig_key, add, f);
                        });
}

template <sharing S = sharing::gpu>
__device__ status signal_block(gpuverbs_qp* q, bool participate, uint64_t sig_addr,
                               rkey sig_key, uint64_t add, bool signaled, uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, signaled, budget_ns,
                         [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                             return build_signal_at(k, idx, false, sig_addr, sig_key, add, f);
                         });
}

template <sharing S = sharing::gpu>
__device__ status signal_set_warp(gpuverbs_qp* q, uint64_t sig_addr, rkey sig_key,
                                  uint64_t value, bool signaled, uint64_t budget_ns) {
    return warp_post<S>(q, 2, 2, signaled, budget_ns,
                        [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                            return build_signal_at(k, idx, true, sig_addr, sig_key, value, f);
                        });
}

template <sharing S = sharing::gpu>
__device__ status signal_set_block(gpuverbs_qp* q, bool participate, uint64_t sig_addr,
                                   rkey sig_key, uint64_t value, bool signaled,
                                   uint64_t budget_ns) {
    return block_post<S>(q, participate, 2, 2, signaled, budget_ns,
                         [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                             return build_signal_at(k, idx, true, sig_addr, sig_key, value, f);
                         });
}

template <sharing S = sharing::gpu>
__device__ status put_signal_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr,
                                  rkey rk, uint32_t len, uint64_t sig_addr, rkey sig_key,
                                  uint64_t add, bool signaled, uint64_t budget_ns) {
    return warp_post<S>(q, 2, 1, signaled, budget_ns,
                        [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                            prep_write(k, idx, laddr, lk, raddr, rk, len, 0);
                            return build_signal_at(k, idx + 1, false, sig_addr, sig_key, add, f);
                        });
}

template <sharing S = sharing::gpu>
__device__ status put_signal_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                                   uint64_t raddr, rkey rk, uint32_t len, uint64_t sig_addr,
                                   rkey sig_key, uint64_t add, bool signaled,
                                   uint64_t budget_ns) {
    return block_post<S>(q, participate, 2, 1, signaled, budget_ns,
                         [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                             prep_write(k, idx, laddr, lk, raddr, rk, len, 0);
                             return build_signal_at(k, idx + 1, false, sig_addr, sig_key, add,
                                                    f);
                         });
}

template <sharing S = sharing::gpu>
__device__ status put_signal_set_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr,
                                      rkey rk, uint32_t len, uint64_t sig_addr, rkey sig_key,
                                      uint64_t value, bool signaled, uint64_t budget_ns) {
    return warp_post<S>(q, 3, 2, signaled, budget_ns,
                        [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                            prep_write(k, idx, laddr, lk, raddr, rk, len, 0);
                            return build_signal_at(k, idx + 1, true, sig_addr, sig_key, value, f);
                        });
}

template <sharing S = sharing::gpu>
__device__ status put_signal_set_block(gpuverbs_qp* q, bool participate, uint64_t laddr,
                                       lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                       uint64_t sig_addr, rkey sig_key, uint64_t value,
                                       bool signaled, uint64_t budget_ns) {
    return block_post<S>(q, participate, 3, 2, signaled, budget_ns,
                         [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                             prep_write(k, idx, laddr, lk, raddr, rk, len, 0);
                             return build_signal_at(k, idx + 1, true, sig_addr, sig_key, value,
                                                    f);
                         });
}

// ------------------------------------------------------------------------------------------
// Atomics: each lane / thread its own target and result (as the thread-scope calls); the
// last rank's WQE is signaled, so a quiet after the call covers every lane's result.
// ------------------------------------------------------------------------------------------

template <sharing S = sharing::gpu>
__device__ status atomic_fetch_add_warp(gpuverbs_qp* q, uint64_t raddr, rkey rk, uint64_t add,
                                        uint64_t result, lkey result_key, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic(k, idx, OP_ATOMIC_FA, raddr, rk, add, 0, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_fetch_add_block(gpuverbs_qp* q, bool participate, uint64_t raddr,
                                         rkey rk, uint64_t add, uint64_t result,
                                         lkey result_key, uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic(k, idx, OP_ATOMIC_FA, raddr, rk, add, 0, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_compare_swap_warp(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                           uint64_t compare, uint64_t swap, uint64_t result,
                                           lkey result_key, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic(k, idx, OP_ATOMIC_CS, raddr, rk, swap, compare, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_compare_swap_block(gpuverbs_qp* q, bool participate, uint64_t raddr,
                                            rkey rk, uint64_t compare, uint64_t swap,
                                            uint64_t result, lkey result_key,
                                            uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic(k, idx, OP_ATOMIC_CS, raddr, rk, swap, compare, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

// 4-byte: the old value lands big-endian at `result` (atomic_result32), as at thread scope.
template <sharing S = sharing::gpu>
__device__ status atomic_fetch_add32_warp(gpuverbs_qp* q, uint64_t raddr, rkey rk, uint32_t add,
                                          uint64_t result, lkey result_key, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic32(k, idx, OP_ATOMIC_MASKED_FA, raddr, rk, add, 0, 0, 0, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_fetch_add32_block(gpuverbs_qp* q, bool participate, uint64_t raddr,
                                           rkey rk, uint32_t add, uint64_t result,
                                           lkey result_key, uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic32(k, idx, OP_ATOMIC_MASKED_FA, raddr, rk, add, 0, 0, 0, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_compare_swap32_warp(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                             uint32_t compare, uint32_t swap, uint64_t result,
                                             lkey result_key, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic32(k, idx, OP_ATOMIC_MASKED_CS, raddr, rk, swap, compare,
                                       0xffffffffu, 0xffffffffu, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_compare_swap32_block(gpuverbs_qp* q, bool participate, uint64_t raddr,
                                              rkey rk, uint32_t compare, uint32_t swap,
                                              uint64_t result, lkey result_key,
                                              uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic32(k, idx, OP_ATOMIC_MASKED_CS, raddr, rk, swap, compare,
                                       0xffffffffu, 0xffffffffu, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_masked_fetch_add32_warp(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                                 uint32_t add, uint32_t boundary, uint64_t result,
                                                 lkey result_key, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic32(k, idx, OP_ATOMIC_MASKED_FA, raddr, rk, add, boundary, 0, 0, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_masked_fetch_add32_block(gpuverbs_qp* q, bool participate,
                                                  uint64_t raddr, rkey rk, uint32_t add,
                                                  uint32_t boundary, uint64_t result,
                                                  lkey result_key, uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic32(k, idx, OP_ATOMIC_MASKED_FA, raddr, rk, add, boundary, 0, 0, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_masked_compare_swap32_warp(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                                    uint32_t compare, uint32_t compare_mask,
                                                    uint32_t swap, uint32_t swap_mask,
                                                    uint64_t result, lkey result_key,
                                                    uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic32(k, idx, OP_ATOMIC_MASKED_CS, raddr, rk, swap, compare,
                                       swap_mask, compare_mask, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_masked_compare_swap32_block(gpuverbs_qp* q, bool participate,
                                                     uint64_t raddr, rkey rk, uint32_t compare,
                                                     uint32_t compare_mask, uint32_t swap,
                                                     uint32_t swap_mask, uint64_t result,
                                                     lkey result_key, uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_atomic32(k, idx, OP_ATOMIC_MASKED_CS, raddr, rk, swap, compare,
                                       swap_mask, compare_mask, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_masked_fetch_add_warp(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                               uint64_t add, uint64_t boundary, uint64_t result,
                                               lkey result_key, uint64_t budget_ns) {
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_masked_fa(k, idx, raddr, rk, add, boundary, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_masked_fetch_add_block(gpuverbs_qp* q, bool participate, uint64_t raddr,
                                                rkey rk, uint64_t add, uint64_t boundary,
                                                uint64_t result, lkey result_key,
                                                uint64_t budget_ns) {
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        const block b = build_masked_fa(k, idx, raddr, rk, add, boundary, result, result_key, f);
        store_block(k, idx, b);
        return b;
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_masked_compare_swap_warp(gpuverbs_qp* q, uint64_t raddr, rkey rk,
                                                  uint64_t compare, uint64_t compare_mask,
                                                  uint64_t swap, uint64_t swap_mask,
                                                  uint64_t result, lkey result_key,
                                                  uint64_t budget_ns) {
    return warp_post<S>(q, 2, 2, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        prep_masked_cs(k, idx, raddr, rk, compare, compare_mask, swap, swap_mask, result,
                       result_key, f);
        return block{};
    });
}

template <sharing S = sharing::gpu>
__device__ status atomic_masked_compare_swap_block(gpuverbs_qp* q, bool participate,
                                                   uint64_t raddr, rkey rk, uint64_t compare,
                                                   uint64_t compare_mask, uint64_t swap,
                                                   uint64_t swap_mask, uint64_t result,
                                                   lkey result_key, uint64_t budget_ns) {
    return block_post<S>(q, participate, 2, 2, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        prep_masked_cs(k, idx, raddr, rk, compare, compare_mask, swap, swap_mask, result,
                       result_key, f);
        return block{};
    });
}

// ------------------------------------------------------------------------------------------
// Counted calls (see onesided.cuh): every lane's counted WQE is signaled and named in the
// counter table; each lane names its own counter (or the same one: it then moves once per
// lane). INVALID, for every lane, where the QP cannot count.
// ------------------------------------------------------------------------------------------

template <sharing S = sharing::gpu>
__device__ status put_counted_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr,
                                   rkey rk, uint32_t len, uint64_t* counter,
                                   uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
        count_at(k, idx, counter);
        const block b = build_write(k, idx, laddr, lk, raddr, rk, len, CE_SIGNALED);
        store_block(k, idx, b);
        return b;
    }, 1);
}

template <sharing S = sharing::gpu>
__device__ status put_counted_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                                    uint64_t raddr, rkey rk, uint32_t len, uint64_t* counter,
                                    uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
        count_at(k, idx, counter);
        const block b = build_write(k, idx, laddr, lk, raddr, rk, len, CE_SIGNALED);
        store_block(k, idx, b);
        return b;
    }, 1);
}

template <sharing S = sharing::gpu>
__device__ status get_counted_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr,
                                   rkey rk, uint32_t len, uint64_t* counter,
                                   uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
        count_at(k, idx, counter);
        const block b = build_read(k, idx, laddr, lk, raddr, rk, len, CE_SIGNALED);
        store_block(k, idx, b);
        return b;
    }, 1);
}

template <sharing S = sharing::gpu>
__device__ status get_counted_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                                    uint64_t raddr, rkey rk, uint32_t len, uint64_t* counter,
                                    uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return block_post<S>(q, participate, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
        count_at(k, idx, counter);
        const block b = build_read(k, idx, laddr, lk, raddr, rk, len, CE_SIGNALED);
        store_block(k, idx, b);
        return b;
    }, 1);
}

// A lane's put_signal (set: put_signal_set) counted on its signal's WQE.
__device__ __forceinline__ block build_put_signal_counted(const gpuverbs_qp* k, uint64_t idx,
                                                          bool set, uint64_t laddr, lkey lk,
                                                          uint64_t raddr, rkey rk, uint32_t len,
                                                          uint64_t sig_addr, rkey sig_key,
                                                          uint64_t value, uint64_t* counter) {
    prep_write(k, idx, laddr, lk, raddr, rk, len, 0);
    count_at(k, idx + 1, counter);
    return build_signal_at(k, idx + 1, set, sig_addr, sig_key, value, CE_SIGNALED);
}

template <sharing S = sharing::gpu>
__device__ status put_signal_counted_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk,
                                          uint64_t raddr, rkey rk, uint32_t len,
                                          uint64_t sig_addr, rkey sig_key, uint64_t add,
                                          uint64_t* counter, uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return warp_post<S>(q, 2, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
        return build_put_signal_counted(k, idx, false, laddr, lk, raddr, rk, len, sig_addr,
                                        sig_key, add, counter);
    }, 1);
}

template <sharing S = sharing::gpu>
__device__ status put_signal_counted_block(gpuverbs_qp* q, bool participate, uint64_t laddr,
                                           lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                           uint64_t sig_addr, rkey sig_key, uint64_t add,
                                           uint64_t* counter, uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return block_post<S>(q, participate, 2, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
        return build_put_signal_counted(k, idx, false, laddr, lk, raddr, rk, len, sig_addr,
                                        sig_key, add, counter);
    }, 1);
}

template <sharing S = sharing::gpu>
__device__ status put_signal_set_counted_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk,
                                              uint64_t raddr, rkey rk, uint32_t len,
                                              uint64_t sig_addr, rkey sig_key, uint64_t value,
                                              uint64_t* counter, uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return warp_post<S>(q, 3, 2, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
        return build_put_signal_counted(k, idx, true, laddr, lk, raddr, rk, len, sig_addr,
                                        sig_key, value, counter);
    }, 1);
}

template <sharing S = sharing::gpu>
__device__ status put_signal_set_counted_block(gpuverbs_qp* q, bool participate, uint64_t laddr,
                                               lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                               uint64_t sig_addr, rkey sig_key, uint64_t value,
                                               uint64_t* counter, uint64_t budget_ns) {
    if (!counts(q)) return INVALID;
    return block_post<S>(q, participate, 3, 2, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t) {
        return build_put_signal_counted(k, idx, true, laddr, lk, raddr, rk, len, sig_addr,
                                        sig_key, value, counter);
    }, 1);
}

// ------------------------------------------------------------------------------------------
// flush and get_wait at warp and block scope
// ------------------------------------------------------------------------------------------

// flush (= quiet) at warp scope: every active lane calls it; once every lane has arrived (so
// every lane's earlier posts are published), the lowest active lane quiets the QP, and every
// lane returns its status (and, on ERROR_CQE, the QP's recorded error in its `*err`). Every
// operation the warp posted to the QP before the call has then completed.
template <sharing S = sharing::gpu>
__device__ status flush_warp(gpuverbs_qp* q, uint64_t budget_ns, error* err = nullptr) {
    const uint32_t mask = __activemask();
    const uint32_t leader = __ffs(mask) - 1;
    __syncwarp(mask);  // every lane's posts before the leader's quiet
    status s = OK;
    if ((threadIdx.x & 31u) == leader) s = quiet<S>(q, budget_ns);
    // Orders the leader's descriptor stores (and the completions it acquired) before the lanes.
    __syncwarp(mask);
    s = (status)__shfl_sync(mask, (int)s, leader);
    if (s == ERROR_CQE && err) *err = last_error(q);
    return s;
}

// flush at block scope (a collective: every thread of the block calls it): after a block-wide
// barrier thread 0 quiets the QP; every thread returns its status (and error, as flush_warp).
template <sharing S = sharing::gpu>
__device__ status flush_block(gpuverbs_qp* q, uint64_t budget_ns, error* err = nullptr) {
    __shared__ int st;
    const uint32_t tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    __syncthreads();  // every thread's posts before thread 0's quiet
    if (tid == 0) st = quiet<S>(q, budget_ns);
    __syncthreads();
    const status s = (status)st;
    __syncthreads();  // `st` read by all before a later call writes it again
    if (s == ERROR_CQE && err) *err = last_error(q);
    return s;
}

// get_wait at warp scope: every active lane reads `len` bytes (its own addresses) with one
// reservation and one doorbell (as get_warp), the last lane's READ signaled; the lowest active
// lane then polls the send CQ until that READ has completed (RC completes a QP's WQEs in order:
// every lane's READ is done), all under one budget from the call's start. Every lane returns
// the status: OK (its bytes are in local memory: load them past the L1, as after get_wait),
// ERROR_CQE (with the QP's recorded error in `*err`), TIMEOUT.
template <sharing S = sharing::gpu>
__device__ status get_wait_warp(gpuverbs_qp* q, uint64_t laddr, lkey lk, uint64_t raddr, rkey rk,
                                uint32_t len, uint64_t budget_ns, error* err = nullptr) {
    const uint32_t mask = __activemask();
    const uint32_t leader = __ffs(mask) - 1;
    call_clock c(budget_ns);
    c.start();
    uint64_t end = 0;  // the signaled (last) READ's end, on the lane that built it
    status s = warp_post<S>(q, 1, 1, true, budget_ns, [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
        if (f & CE_SIGNALED) end = idx + 1;
        const block b = build_read(k, idx, laddr, lk, raddr, rk, len, f);
        store_block(k, idx, b);
        return b;
    });
    if (s == ERROR_CQE && err) *err = last_error(q);
    if (s != OK) return s;
    // The last rank is the highest active lane; its READ is the signaled one.
    end = __shfl_sync(mask, end, 31u - __clz(mask));
    if ((threadIdx.x & 31u) == leader) {
        s = on_copy<S>(q, [&](gpuverbs_qp* m) -> status { return poll_to<S>(m, end, c, nullptr); });
    }
    __syncwarp(mask);  // the leader's acquire of the CQE (and its state stores) before the lanes
    s = (status)__shfl_sync(mask, (int)s, leader);
    if (s == ERROR_CQE && err) *err = last_error(q);
    return s;
}

// get_wait at block scope (a collective, as get_block): participants read with one reservation
// and one doorbell, the last one's READ signaled; thread 0 polls until it has completed; every
// thread returns the status (OK with no participant). As get_wait_warp otherwise.
template <sharing S = sharing::gpu>
__device__ status get_wait_block(gpuverbs_qp* q, bool participate, uint64_t laddr, lkey lk,
                                 uint64_t raddr, rkey rk, uint32_t len, uint64_t budget_ns,
                                 error* err = nullptr) {
    __shared__ uint64_t end;  // the signaled (last) READ's end; 0: nothing posted
    __shared__ int st;
    const uint32_t tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    call_clock c(budget_ns);
    c.start();
    if (tid == 0) end = 0;  // ordered before the build by block_post's first barrier
    status s = block_post<S>(q, participate, 1, 1, true, budget_ns,
                             [&](const gpuverbs_qp* k, uint64_t idx, uint8_t f) {
                                 if (f & CE_SIGNALED) end = idx + 1;
                                 const block b = build_read(k, idx, laddr, lk, raddr, rk, len, f);
                                 store_block(k, idx, b);
                                 return b;
                             });
    if (s == ERROR_CQE && err) *err = last_error(q);
    if (s != OK) return s;  // every thread got the same status from block_post
    if (tid == 0) {
        st = end == 0 ? OK
                      : on_copy<S>(q, [&](gpuverbs_qp* m) -> status {
                            return poll_to<S>(m, end, c, nullptr);
                        });
    }
    __syncthreads();
    s = (status)st;
    __syncthreads();  // `st` read by all before a later call writes it again
    if (s == ERROR_CQE && err) *err = last_error(q);
    return s;
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_SCOPE_CUH
