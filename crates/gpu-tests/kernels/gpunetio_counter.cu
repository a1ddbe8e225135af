// NVIDIA's GPUNetIO counter call next to gpuverbs' (issue 46 item 2): built only with the
// GPUNetIO device headers (GPUNETIO_SRC at build time, see build.rs; they are an input of the
// build, never part of this repository). `doca_gpu_dev_verbs_put_counter`, NVIDIA's own device
// code, drives QPs that gpuverbs created and exported (a main QP and its companion: their
// rings, doorbell records, doorbell registers and send CQs, described to it in its own
// `doca_gpu_dev_verbs_qp` layout), and gpuverbs' put_counter drives a second such pair with the
// same puts; the host compares what both did.
#if defined(GPUVERBS_WITH_GPUNETIO)

#include <doca_gpunetio_dev_verbs_counter.cuh>
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

// doca_qp_of (a gpuverbs QP in GPUNetIO's layout) and addr_key (a big-endian key), shared
// with gpu_bench's `gpunetio` series: kernels/gpunetio/ (on the include path with GPUNETIO_SRC).
#include "doca_qp.cuh"

// One block of n threads (n <= 32: no ring of 64 blocks wraps). Thread t puts `size` bytes
// src + t*size -> dst + t*size (pair V: from src_v, lkey lk_v) and counts it: on pair G (gq, gcp) with GPUNetIO's put_counter
// (counter ctr_g, key ck_g; its old value into the companion's scratch word), on pair V (vq,
// vcp) with gpuverbs' put_counter (ctr_v, ck_v). Thread 0 then waits (bounded) for both
// counters: vals[0] counter G, vals[1] counter V (as last read), vals[2] gpuverbs' status (its
// put_counter's, then wait_counter's), vals[3] 1 when counter G did not reach n in time.
// `dq`: room for two doca_gpu_dev_verbs_qp (G's main QP and companion), in GPU memory.
GPUVERBS_KERNEL void gv_test_gpunetio_counter(gpuverbs_qp* gq, gpuverbs_qp* gcp, gpuverbs_qp* vq,
                                              gpuverbs_qp* vcp, doca_gpu_dev_verbs_qp* dq,
                                              uint64_t src, uint32_t lk, uint64_t src_v,
                                              uint32_t lk_v, uint64_t dst_g,
                                              uint32_t rk_g, uint64_t dst_v, uint32_t rk_v,
                                              uint64_t ctr_g, uint32_t ck_g, uint64_t* ctr_g_d,
                                              uint64_t ctr_v, uint32_t ck_v, uint64_t* ctr_v_d,
                                              uint32_t size, uint64_t budget, uint64_t* vals) {
    using namespace gpuverbs;
    using namespace gv_gpunetio;
    const uint32_t t = threadIdx.x;
    if (t == 0) {
        doca_qp_of(gq, &dq[0]);
        doca_qp_of(gcp, &dq[1]);
        __threadfence();
    }
    __syncthreads();
    const uint64_t off = (uint64_t)t * size;
    doca_gpu_dev_verbs_put_counter(&dq[0], addr_key(dst_g + off, rk_g), addr_key(src + off, lk),
                                   size, &dq[1], addr_key(ctr_g, ck_g),
                                   addr_key(gcp->scratch, gcp->scratch_lkey), 1);
    status s = put_counter(vq, src_v + off, lkey{lk_v}, dst_v + off, rkey{rk_v}, size, vcp, ctr_v,
                           rkey{ck_v}, 1, budget);
    if (s != OK) atomicCAS(reinterpret_cast<unsigned long long*>(&vals[2]), 0ull, (unsigned long long)s);
    __syncthreads();
    if (t != 0) return;
    const uint64_t n = blockDim.x;
    const uint64_t deadline = now_ns() + budget;
    uint64_t g;
    while ((g = read_counter(ctr_g_d)) < n && now_ns() < deadline) {
    }
    vals[0] = g;
    vals[3] = g < n;
    uint64_t v = 0;
    error e{};
    s = wait_counter(vq, vcp, ctr_v_d, n, budget, &e, &v);
    vals[1] = v;
    if (vals[2] == 0) vals[2] = s;
    __threadfence_system();
}

#endif  // GPUVERBS_WITH_GPUNETIO
