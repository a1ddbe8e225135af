// A user kernel built outside gpuverbs (by gpuverbs-kernel-build, from this crate's build.rs)
// against the public device API.
//
// Each thread of one block fills its chunk of the local buffer, RDMA-writes it to the same offset
// of the remote buffer with gpuverbs::put, and the block's thread 0 waits for every write with
// gpuverbs::quiet. The host checks the remote bytes afterwards.
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

namespace user_put_cu {

// The byte at index `i` of the buffer (the host checks the same formula).
GPUVERBS_DEVICE uint8_t pattern(uint32_t seed, uint32_t i) {
    return (uint8_t)(seed + i * 7u + (i >> 8));
}

// Records the first non-OK status: out = {status, syndrome, vendor, wqe_counter}.
GPUVERBS_DEVICE void report(int* out, gpuverbs::status s, gpuverbs::error e) {
    if (s != gpuverbs::OK && atomicCAS(out, 0, (int)s) == 0) {
        out[1] = e.syndrome;
        out[2] = e.vendor;
        out[3] = e.wqe_counter;
    }
}

}  // namespace user_put_cu

// q:      the exported QP descriptor (gpuverbs::gpu::ExportedQp::ptr)
// lbuf:   the local buffer as the GPU addresses it (Gpu::map_host), written here
// laddr:  the same buffer as the NIC addresses it (Mr::addr), with lkey `lk`
// raddr:  the remote buffer (remote Mr::addr), with rkey `rk`
// chunk:  bytes per thread; seed: pattern seed; budget_ns: bound of every wait
// out:    4 ints of status (device memory, zero on entry)
GPUVERBS_KERNEL void user_put(gpuverbs_qp* q, uint8_t* lbuf, uint64_t laddr, uint32_t lk,
                              uint64_t raddr, uint32_t rk, uint32_t chunk, uint32_t seed,
                              uint64_t budget_ns, int* out) {
    using namespace gpuverbs;
    const uint32_t t = threadIdx.x;
    const uint64_t off = (uint64_t)t * chunk;
    for (uint32_t i = 0; i < chunk; ++i) {
        lbuf[off + i] = user_put_cu::pattern(seed, (uint32_t)(off + i));
    }

    // put releases this thread's payload stores (system scope: the rings live in host memory)
    // before the doorbell that announces the WQE.
    status s = put(q, laddr + off, lkey{lk}, raddr + off, rkey{rk}, chunk, /*signaled=*/false,
                   budget_ns);
    user_put_cu::report(out, s, s == OK ? error{} : last_error(q));

    // Every thread has published its WQE; one thread waits for all of them. quiet posts a
    // signaled NOP (the puts were unsignaled) and returns once every CQE is in.
    __syncthreads();
    if (t == 0) {
        error e{};
        s = quiet(q, budget_ns, &e);
        user_put_cu::report(out, s, e);
    }
}
