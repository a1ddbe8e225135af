/* Generated from src/desc.rs by gpuverbs (the single source of the layout).
 * Do not edit: GPUVERBS_WRITE_HEADER=1 cargo test -p gpuverbs desc rewrites it. */
#pragma once
#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
#define GPUVERBS_STATIC_ASSERT static_assert
#else
#define GPUVERBS_STATIC_ASSERT _Static_assert
#endif

typedef struct gpuverbs_qp {
    uint32_t version; /* The layout's version (`GPUVERBS_DESC_VERSION`), written by the host at export. */
    uint32_t size; /* `sizeof(gpuverbs_qp)`, written by the host at export. */
    uint64_t sq_ring; /* SQ ring (64-byte blocks). */
    uint64_t rq_ring; /* RQ ring. */
    uint64_t dbrec; /* 8-byte doorbell record (word 0 receive, word 1 send; big-endian). */
    uint64_t db_reg; /* Doorbell / BlueFlame register (two 256-byte halves); 0 in CPU-proxy mode. */
    uint64_t proxy_word; /* CPU-proxy producer word (u64, blocks, monotonic); 0 unless CPU-proxy mode. */
    uint64_t scq_ring; /* Send CQ ring (64-byte CQEs). */
    uint64_t scq_dbrec; /* Send CQ doorbell record (word 0: consumer index, big-endian). */
    uint64_t rcq_ring; /* Receive CQ ring. */
    uint64_t rcq_dbrec; /* Receive CQ doorbell record. */
    uint64_t scratch; /* 8 registered bytes where atomics whose old value nobody wants land. */
    uint32_t sq_blocks; /* SQ size in blocks (power of two). */
    uint32_t rq_wqes; /* RQ size in WQEs. */
    uint32_t rq_stride; /* Bytes per receive WQE. */
    uint32_t qpn; /* QP number. */
    uint32_t scq_ncqe; /* Send CQ entries. */
    uint32_t rcq_ncqe; /* Receive CQ entries. */
    uint32_t db_mode; /* Doorbell mode: 0 GPU doorbell, 1 BlueFlame, 2 CPU proxy, 3 no DBR (DBR-less register), 4 no DBR emulated (register + proxy word; a host thread keeps the record). */
    uint32_t ring_loc; /* Where rings and doorbells live: 0 host memory (system-scope ordering), 1 GPU memory. */
    uint32_t max_inline; /* Largest inline payload. */
    uint32_t scratch_lkey; /* lkey of `scratch`. */
    uint32_t scq_collapsed; /* Send CQ is collapsed (every CQE in slot 0). */
    uint32_t rcq_collapsed; /* Receive CQ is collapsed. */
    uint64_t sq_reserved; /* Device API state: blocks reserved so far. */
    uint64_t sq_ready; /* Device API state: blocks published in order (written and visible). */
    uint64_t sq_rung; /* Device API state: producer index last told to the device; `u64::MAX` while a thread rings a shared QP (it is the doorbell's lock too). */
    uint64_t sq_retired; /* Device API state: blocks completed (retired through CQEs). */
    uint64_t sq_signaled_end; /* Device API state: end of the last signaled WQE published. */
    uint64_t sq_last_start; /* Device API state: first block of the last WQE published. */
    uint64_t scq_ci; /* Device API state: send CQ consumer index. */
    uint64_t rcq_ci; /* Device API state: receive CQ consumer index. */
    uint64_t rq_posted; /* Device API state: receive WQEs posted. */
    uint64_t sq_error; /* Device API state: index of the first error CQE seen on the send CQ, plus 1 (0 none). */
    uint64_t sq_error_info; /* Device API state: the error CQE's syndrome << 24 | vendor << 16 | wqe_counter, and in bits 63..32 the failed WQE's first block (on the 64-bit SQ counter) >> 16. */
    uint32_t bf_half; /* Device API state: next BlueFlame half. */
    uint32_t scq_lock; /* Device API state: send CQ lock. */
    uint32_t checked_out; /* Device API state: 1 while one thread holds the QP's state in registers (`checkout`). */
    uint32_t rq_lock; /* Device API state: receive-posting lock. */
    uint32_t rcq_lock; /* Device API state: receive CQ lock. */
    uint32_t sq_broken; /* Device API state: 1 once a shared-mode publish gave up waiting for an earlier reservation (its thread never published): the send queue has a hole, and every later send-side call returns BROKEN. Reset the QP, connect it and export it again. */
    uint64_t sq_counters; /* The completion-counter table: `sq_blocks` entries of 16 bytes in GPU memory, one per SQ block ({the counted WQE's first block + 1, the counter's address}), written by the counted calls and read by the send-CQ poll path. */
    uint64_t sq_cqes; /* Device API state: the CQEs the send CQ will have written (counted from its creation, modulo 2^24 as the CQ counts) once every published WQE has completed: what a companion QP's WAIT names to wait for a WQE (`put_counter` and its kin). Set at export to the send CQ's consumer index; every publish adds its signaled WQEs. */
    uint32_t scq_cqn; /* The send CQ's number (what a companion's WAIT names). */
    uint32_t rcq_cqn; /* The receive CQ's number. */
} gpuverbs_qp;

GPUVERBS_STATIC_ASSERT(sizeof(gpuverbs_qp) == 272, "gpuverbs_qp size");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, version) == 0, "version");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, size) == 4, "size");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_ring) == 8, "sq_ring");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rq_ring) == 16, "rq_ring");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, dbrec) == 24, "dbrec");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, db_reg) == 32, "db_reg");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, proxy_word) == 40, "proxy_word");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scq_ring) == 48, "scq_ring");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scq_dbrec) == 56, "scq_dbrec");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rcq_ring) == 64, "rcq_ring");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rcq_dbrec) == 72, "rcq_dbrec");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scratch) == 80, "scratch");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_blocks) == 88, "sq_blocks");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rq_wqes) == 92, "rq_wqes");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rq_stride) == 96, "rq_stride");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, qpn) == 100, "qpn");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scq_ncqe) == 104, "scq_ncqe");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rcq_ncqe) == 108, "rcq_ncqe");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, db_mode) == 112, "db_mode");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, ring_loc) == 116, "ring_loc");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, max_inline) == 120, "max_inline");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scratch_lkey) == 124, "scratch_lkey");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scq_collapsed) == 128, "scq_collapsed");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rcq_collapsed) == 132, "rcq_collapsed");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_reserved) == 136, "sq_reserved");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_ready) == 144, "sq_ready");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_rung) == 152, "sq_rung");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_retired) == 160, "sq_retired");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_signaled_end) == 168, "sq_signaled_end");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_last_start) == 176, "sq_last_start");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scq_ci) == 184, "scq_ci");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rcq_ci) == 192, "rcq_ci");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rq_posted) == 200, "rq_posted");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_error) == 208, "sq_error");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_error_info) == 216, "sq_error_info");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, bf_half) == 224, "bf_half");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scq_lock) == 228, "scq_lock");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, checked_out) == 232, "checked_out");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rq_lock) == 236, "rq_lock");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rcq_lock) == 240, "rcq_lock");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_broken) == 244, "sq_broken");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_counters) == 248, "sq_counters");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, sq_cqes) == 256, "sq_cqes");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, scq_cqn) == 264, "scq_cqn");
GPUVERBS_STATIC_ASSERT(offsetof(gpuverbs_qp, rcq_cqn) == 268, "rcq_cqn");

/* The layout's version; a descriptor carries it in `version`. */
#define GPUVERBS_DESC_VERSION 0x4b30a12du
#define GPUVERBS_DB_GPU_DOORBELL 0u
#define GPUVERBS_DB_BLUEFLAME 1u
#define GPUVERBS_DB_CPU_PROXY 2u
#define GPUVERBS_DB_NO_DBR 3u
#define GPUVERBS_DB_NO_DBR_EMULATED 4u
