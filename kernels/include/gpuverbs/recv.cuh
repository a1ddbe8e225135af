// gpuverbs device API — recv.cuh (see qp.cuh for the layers).
//
// The receive side: post receive WQEs, take receive completions.
#ifndef GPUVERBS_RECV_CUH
#define GPUVERBS_RECV_CUH

#include "sq.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

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
        release_wqes(q->ring_loc == 0);
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

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_RECV_CUH
