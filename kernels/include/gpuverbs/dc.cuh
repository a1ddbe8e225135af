// gpuverbs device API — dc.cuh (see qp.cuh for the layers).
//
// DC initiators: put, get and atomics at thread scope on a DC initiator's QP, each naming its
// target with the 48-byte address vector the host gives (`DcTarget::address_vector()`: the DC
// key, the target's number, its GID), which follows the control segment of every WQE. A DC WQE
// takes two blocks: control and address vector, then the operation's segments. Written against
// libmlx5's DC layout and run on the soft NIC's DC initiators.
#ifndef GPUVERBS_DC_CUH
#define GPUVERBS_DC_CUH

#include "onesided.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

/// A DC target's address vector as the host lays it out (48 bytes, three units).
struct dc_av {
    uint4 u[3];
};

// Two blocks of a DC WQE: control (ds counts the vector) and the vector, then `a`, `b`, `c`
// (the operation's segments; SEG_ZERO past its end), stored whole.
__device__ __forceinline__ void prep_dc(const gpuverbs_qp* q, uint64_t idx, uint8_t op,
                                        uint32_t ds, uint8_t flags, const dc_av& av, uint4 a,
                                        uint4 b, uint4 c) {
    store_block(q, idx, block{{seg_ctrl(op, 0, idx, q->qpn, ds, flags, 0), av.u[0], av.u[1],
                               av.u[2]}});
    store_block(q, idx + 1, block{{a, b, c, SEG_ZERO}});
}

// RDMA write of `len` bytes to the target `av` names.
template <sharing S = sharing::gpu>
__device__ status dc_put(gpuverbs_qp* q, const dc_av& av, uint64_t laddr, lkey lk,
                         uint64_t raddr, rkey rk, uint32_t len, bool signaled,
                         uint64_t budget_ns, bool do_ring = true) {
    return post1<S>(q, 2, signaled, do_ring, budget_ns,
                    [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
                        prep_dc(q, idx, OP_RDMA_WRITE, 6, f, av, seg_raddr(raddr, rk),
                                seg_data(laddr, len, lk), SEG_ZERO);
                    });
}

// RDMA read of `len` bytes from the target `av` names; complete once quiet() returns OK.
template <sharing S = sharing::gpu>
__device__ status dc_get(gpuverbs_qp* q, const dc_av& av, uint64_t laddr, lkey lk,
                         uint64_t raddr, rkey rk, uint32_t len, bool signaled,
                         uint64_t budget_ns) {
    return post1<S>(q, 2, signaled, true, budget_ns,
                    [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
                        prep_dc(q, idx, OP_RDMA_READ, 6, f, av, seg_raddr(raddr, rk),
                                seg_data(laddr, len, lk), SEG_ZERO);
                    });
}

// Fetch-and-add on an 8-byte word of the target `av` names; the old value lands at `result`
// after quiet().
template <sharing S = sharing::gpu>
__device__ status dc_atomic_fetch_add(gpuverbs_qp* q, const dc_av& av, uint64_t raddr, rkey rk,
                                      uint64_t add, uint64_t result, lkey result_key,
                                      uint64_t budget_ns) {
    return post1<S>(q, 2, true, true, budget_ns,
                    [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
                        prep_dc(q, idx, OP_ATOMIC_FA, 7, f, av, seg_raddr(raddr, rk),
                                seg_atomic(add, 0), seg_data(result, 8, result_key));
                    });
}

// Compare-and-swap on an 8-byte word of the target `av` names; the old value lands at
// `result` after quiet().
template <sharing S = sharing::gpu>
__device__ status dc_atomic_compare_swap(gpuverbs_qp* q, const dc_av& av, uint64_t raddr,
                                         rkey rk, uint64_t compare, uint64_t swap,
                                         uint64_t result, lkey result_key, uint64_t budget_ns) {
    return post1<S>(q, 2, true, true, budget_ns,
                    [&](const gpuverbs_qp* q, uint64_t idx, uint8_t f) {
                        prep_dc(q, idx, OP_ATOMIC_CS, 7, f, av, seg_raddr(raddr, rk),
                                seg_atomic(swap, compare), seg_data(result, 8, result_key));
                    });
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_DC_CUH
