// gpuverbs device API — scope.cuh (see qp.cuh for the layers).
//
// Warp and block scope: one reservation and one doorbell for many threads, partial participation
// allowed.
#ifndef GPUVERBS_SCOPE_CUH
#define GPUVERBS_SCOPE_CUH

#include "onesided.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

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
    uint64_t start = 0, published = 0;
    status s = OK;
    // Every lane takes the descriptor into registers when the call starts: its constants for
    // the WQE each lane builds (through `q` they would be loaded again after the leader's
    // reservation), and in exclusive mode the state the leader works on (stored back at the
    // end, see on_copy).
    gpuverbs_qp k = S == sharing::exclusive ? *q : consts_of(q);
    gpuverbs_qp* const st = S == sharing::exclusive ? &k : q;
    call_clock c(budget_ns);  // the leader's: one budget for its reserve, publish and ring
    if (lane == leader) {
        bool force = false;
        s = reserve<S>(st, count, c, &start, &force, &published);
        signaled = signaled || force;
        // A failed reservation may still have taken CQEs (its wait polls the CQ).
        if (S == sharing::exclusive && s != OK && !k.checked_out) store_state(q, k);
    }
    start = __shfl_sync(mask, start, leader);
    s = (status)__shfl_sync(mask, (int)s, leader);
    signaled = __shfl_sync(mask, signaled, leader);
    if (s != OK) return s;
    const bool last = rank == count - 1;
    const block b = build_write(&k, start + rank, laddr, lk, raddr, rk, len,
                                (signaled && last) ? CE_SIGNALED : 0);
    store_block(&k, start + rank, b);
    // A BlueFlame ring copies the last WQE from the leader's registers: the lane that built
    // it hands it over (other modes do not read it).
    block lastb = b;
    const bool bf = k.db_mode == GPUVERBS_DB_BLUEFLAME;
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
        s = publish_ring<S>(st, k, start, count, start + count - 1, signaled, published, true,
                            c, &lastb);
        if (S == sharing::exclusive && !k.checked_out) store_state(q, k);
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
    // The descriptor in registers, as in put_warp: constants for every thread, and in
    // exclusive mode the state thread 0 works on.
    gpuverbs_qp k = S == sharing::exclusive ? *q : consts_of(q);
    gpuverbs_qp* const on = S == sharing::exclusive ? &k : q;
    __syncthreads();
    uint32_t rank = participate ? atomicAdd(&count, 1u) : 0;
    __syncthreads();
    call_clock c(budget_ns);  // thread 0's: one budget for its reserve, publish and ring
    uint64_t published = 0;   // thread 0's
    if (tid == 0) {
        bool force = false;
        st = count ? reserve<S>(on, count, c, &start, &force, &published) : OK;
        sig = signaled || force;
    }
    __syncthreads();
    status s = (status)st;
    signaled = sig;
    if (s == OK && participate) {
        const bool last = rank == count - 1;
        const block b = build_write(&k, start + rank, laddr, lk, raddr, rk, len,
                                    (signaled && last) ? CE_SIGNALED : 0);
        store_block(&k, start + rank, b);
        if (last) lastb = b;
    }
    __syncthreads();
    if (tid == 0 && s == OK && count) {
        s = publish_ring<S>(on, k, start, count, start + count - 1, signaled, published, true,
                            c, &lastb);
        st = s;
    }
    if (S == sharing::exclusive && tid == 0 && !k.checked_out) store_state(q, k);
    __syncthreads();
    s = (status)st;
    __syncthreads();
    return s;
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_SCOPE_CUH
