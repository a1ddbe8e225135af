// A gpuverbs-exported QP described in NVIDIA GPUNetIO's own device layout
// (`doca_gpu_dev_verbs_qp`), so that GPUNetIO's device code (`doca_gpu_dev_verbs_put`,
// `doca_gpu_dev_verbs_put_counter`, ...) can drive QPs that gpuverbs created and exported.
// Shared by the builds that run GPUNetIO's code next to gpuverbs': the GPU test suite
// (crates/gpu-tests/kernels/gpunetio_counter.cu) and gpu_bench's `gpunetio` series
// (samples/kernels/gpunetio_bench.cu). Not part of the device API (kernels/include/gpuverbs/):
// it needs GPUNetIO's device headers, an input of those builds (GPUNETIO_SRC), never part of
// this repository; each build puts this directory and GPUNetIO's include directories on the
// include path and defines GPUVERBS_WITH_GPUNETIO.
#pragma once

#include <doca_gpunetio_dev_verbs_qp.cuh>
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

namespace gv_gpunetio {

// GPUNetIO's description of a QP gpuverbs exported (GPU doorbell mode; a fresh QP: every
// index 0, as GPUNetIO's export sets them): the SQ ring and its size, the send doorbell record
// (word 1 of gpuverbs' record), the doorbell register, the send CQ with its number.
GPUVERBS_DEVICE void doca_qp_of(const gpuverbs_qp* d, doca_gpu_dev_verbs_qp* o) {
    doca_gpu_dev_verbs_qp q;
    memset(&q, 0, sizeof(q));
    q.sq_rsvd_index = d->sq_reserved;
    q.sq_ready_index = d->sq_ready;
    q.sq_wqe_pi = d->sq_rung;
    q.sq_num = d->qpn;
    q.sq_num_shift8 = d->qpn << 8;
    q.sq_num_shift8_be = gpuverbs::bswap32(d->qpn << 8);
    q.sq_num_shift8_be_1ds = gpuverbs::bswap32(d->qpn << 8 | 1);
    q.sq_num_shift8_be_2ds = gpuverbs::bswap32(d->qpn << 8 | 2);
    q.sq_num_shift8_be_3ds = gpuverbs::bswap32(d->qpn << 8 | 3);
    q.sq_num_shift8_be_4ds = gpuverbs::bswap32(d->qpn << 8 | 4);
    q.sq_num_shift8_be_5ds = gpuverbs::bswap32(d->qpn << 8 | 5);
    q.sq_wqe_num = (uint16_t)d->sq_blocks;
    q.sq_wqe_mask = (uint16_t)(d->sq_blocks - 1);
    q.sq_wqe_daddr = reinterpret_cast<uint8_t*>(d->sq_ring);
    q.sq_dbrec = reinterpret_cast<__be32*>(d->dbrec + 4);
    q.sq_db = reinterpret_cast<uint64_t*>(d->db_reg);
    q.cq_sq.cqe_daddr = reinterpret_cast<uint8_t*>(d->scq_ring);
    q.cq_sq.cq_num = d->scq_cqn;
    q.cq_sq.cqe_num = d->scq_ncqe;
    q.cq_sq.dbrec = reinterpret_cast<__be32*>(d->scq_dbrec);
    q.cq_sq.cqe_ci = d->scq_ci;
    q.cq_sq.cqe_mask = d->scq_ncqe - 1;
    q.cq_sq.cqe_size = 64;
    q.cq_sq.cqe_rsvd = 0;
    const doca_gpu_dev_verbs_mem_type mt =
        d->ring_loc ? DOCA_GPUNETIO_VERBS_MEM_TYPE_GPU : DOCA_GPUNETIO_VERBS_MEM_TYPE_HOST;
    q.cq_sq.mem_type = mt;
    q.nic_handler = DOCA_GPUNETIO_VERBS_NIC_HANDLER_GPU_SM_DB;
    q.mem_type = mt;
    *o = q;
}

// A GPUNetIO address: GPUNetIO takes keys big-endian (its headers are built with
// DOCA_GPUNETIO_VERBS_MKEY_SWAPPED: the key goes into the WQE as given), gpuverbs' keys are
// CPU-endian.
GPUVERBS_DEVICE doca_gpu_dev_verbs_addr addr_key(uint64_t addr, uint32_t key) {
    doca_gpu_dev_verbs_addr a;
    a.addr = addr;
    a.key = gpuverbs::bswap32(key);  // GPUNetIO takes keys big-endian (MKEY_SWAPPED)
    return a;
}

}  // namespace gv_gpunetio
