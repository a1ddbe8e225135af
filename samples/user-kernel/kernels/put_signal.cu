#include <gpuverbs/gpuverbs.cuh>

// One thread writes `len` bytes into the peer's buffer, then adds 1 to the peer's signal word.
// The RC QP runs them in order, so a peer that sees the signal sees the bytes. Every call
// returns a status within its budget: none spins forever, and an error CQE is reported.
GPUVERBS_KERNEL void put_signal(gpuverbs_qp* qp, uint64_t laddr, uint32_t lk, uint64_t raddr,
                                uint32_t rk, uint32_t len, uint64_t sig_addr, uint32_t sig_rk,
                                int* out) {
    using namespace gpuverbs;
    const uint64_t budget_ns = 1000000000;  // 1 s per call
    status s = put(qp, laddr, lkey{lk}, raddr, rkey{rk}, len, /*signaled=*/false, budget_ns);
    if (s == OK) s = signal(qp, sig_addr, rkey{sig_rk}, 1, /*signaled=*/false, budget_ns);
    if (s == OK) s = quiet(qp, budget_ns);  // a signaled NOP, then polls the CQ until all done
    out[0] = s;                             // OK, ERROR_CQE, TIMEOUT, ...
    out[1] = s == ERROR_CQE ? last_error(qp).syndrome : 0;  // e.g. 0x13: REMOTE_ACCESS
}

// The peer's side: wait (acquire, system scope) until the signal word reaches 1.
GPUVERBS_KERNEL void wait_put(const uint64_t* sig, int* out) {
    out[0] = gpuverbs::wait_signal(sig, 1, 1000000000);
}
