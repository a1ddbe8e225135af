// gpu_bench's `gpunetio` series (issue 45 item 1): NVIDIA GPUNetIO's own device code posting the
// same 8-byte RDMA WRITEs as gpuverbs' gv_bench_post, on QPs that gpuverbs created and exported
// (described to GPUNetIO in its own `doca_gpu_dev_verbs_qp` layout by kernels/gpunetio/doca_qp.cuh),
// post only: the QPs are not in RTS, so the NIC executes nothing and only the device-side cost of
// building and announcing WQEs is timed. Built only with GPUNetIO's device headers (GPUNETIO_SRC
// at build time, see samples/build.rs; an input of the build, never part of this repository).
#if defined(GPUVERBS_WITH_GPUNETIO)

#include <doca_gpunetio_dev_verbs_onesided.cuh>
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

#include "doca_qp.cuh"

// The host allocates this many bytes per QP description.
static_assert(sizeof(doca_gpu_dev_verbs_qp) <= 512, "gpu_bench allocates 512 bytes per QP");

namespace gpunetio_bench {

// The kernel-side time stamps, as kernels/src/bench.cu's bench::stamp_start / stamp_end (the
// earliest start and the latest end of all threads, %globaltimer).
GPUVERBS_DEVICE void stamp_start(unsigned long long* t) {
    atomicMin(&t[0], (unsigned long long)gpuverbs::now_ns());
}

GPUVERBS_DEVICE void stamp_end(unsigned long long* t) {
    atomicMax(&t[1], (unsigned long long)gpuverbs::now_ns());
}

// `iters` calls of GPUNetIO's put (8 bytes laddr -> raddr) in resource-sharing mode M and
// execution scope E (thread: one WQE per call; warp: one WQE per lane per call, all 32 lanes),
// GPU doorbell (NIC handler GPU_SM_DB: its submit_db, which rings the doorbell register and
// updates the doorbell record on every call).
template <doca_gpu_dev_verbs_resource_sharing_mode M, doca_gpu_dev_verbs_exec_scope E>
GPUVERBS_DEVICE void puts(doca_gpu_dev_verbs_qp* q, doca_gpu_dev_verbs_addr r,
                          doca_gpu_dev_verbs_addr l, uint32_t iters) {
    for (uint32_t i = 0; i < iters; ++i) {
        doca_gpu_dev_verbs_put<M, DOCA_GPUNETIO_VERBS_NIC_HANDLER_GPU_SM_DB, E>(q, r, l, 8);
    }
}

}  // namespace gpunetio_bench

// Describes each of the `nqps` exported QPs (`qps`: descriptor pointers) in GPUNetIO's layout
// into dq[i], one thread per QP, before each timed run (not timed). The QPs are never posted to
// through gpuverbs, so every index is 0 again: each run starts on a fresh ring, as GPUNetIO's
// export leaves a QP, and GPUNetIO's slot check (which polls the send CQ once an index passes
// the ring's size) never waits, the ring holding the whole run.
GPUVERBS_KERNEL void gv_bench_gpunetio_describe(const uint64_t* qps, uint32_t nqps,
                                                doca_gpu_dev_verbs_qp* dq) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nqps) return;
    gv_gpunetio::doca_qp_of(reinterpret_cast<const gpuverbs_qp*>(qps[i]), &dq[i]);
}

// gv_bench_post's post-only run with GPUNetIO's device code: block b drives dq[b % nqps]; every
// thread (scope 0) or warp (scope 1) makes `iters` puts of 8 bytes. `share` 1: exclusive
// (DOCA_GPUNETIO_VERBS_RESOURCE_SHARING_MODE_EXCLUSIVE), else GPU sharing (..._MODE_GPU).
// GPUNetIO's put marks every WQE CQ_UPDATE (it has no unsignaled put); post only, no CQE comes.
GPUVERBS_KERNEL void gv_bench_gpunetio_put(doca_gpu_dev_verbs_qp* dq, uint32_t nqps,
                                           uint64_t laddr, uint32_t lk, uint64_t raddr,
                                           uint32_t rk, uint32_t iters, uint32_t scope,
                                           uint32_t share, unsigned long long* t) {
    using namespace gpunetio_bench;
    constexpr auto EXCL = DOCA_GPUNETIO_VERBS_RESOURCE_SHARING_MODE_EXCLUSIVE;
    constexpr auto GPU = DOCA_GPUNETIO_VERBS_RESOURCE_SHARING_MODE_GPU;
    constexpr auto THREAD = DOCA_GPUNETIO_VERBS_EXEC_SCOPE_THREAD;
    constexpr auto WARP = DOCA_GPUNETIO_VERBS_EXEC_SCOPE_WARP;
    doca_gpu_dev_verbs_qp* q = &dq[blockIdx.x % nqps];
    const doca_gpu_dev_verbs_addr r = gv_gpunetio::addr_key(raddr, rk);
    const doca_gpu_dev_verbs_addr l = gv_gpunetio::addr_key(laddr, lk);
    __syncthreads();
    stamp_start(t);
    if (share == 1) {
        if (scope == 1) {
            puts<EXCL, WARP>(q, r, l, iters);
        } else {
            puts<EXCL, THREAD>(q, r, l, iters);
        }
    } else if (scope == 1) {
        puts<GPU, WARP>(q, r, l, iters);
    } else {
        puts<GPU, THREAD>(q, r, l, iters);
    }
    stamp_end(t);
}

// After a run, one thread per QP: out[0] += WQEs posted (GPUNetIO's ready index), out[1] += 1
// for each QP whose reserved, ready and rung (doorbell producer) indices differ.
GPUVERBS_KERNEL void gv_bench_gpunetio_tally(const doca_gpu_dev_verbs_qp* dq, uint32_t nqps,
                                             unsigned long long* out) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nqps) return;
    const doca_gpu_dev_verbs_qp& q = dq[i];
    atomicAdd(&out[0], (unsigned long long)q.sq_ready_index);
    if (q.sq_rsvd_index != q.sq_ready_index || q.sq_wqe_pi != q.sq_ready_index) {
        atomicAdd(&out[1], 1ull);
    }
}

#endif  // GPUVERBS_WITH_GPUNETIO
