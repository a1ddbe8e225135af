// gpuverbs device API — cq.cuh (see qp.cuh for the layers).
//
// Completions: taking CQEs, retiring SQ space, reporting error CQEs with their syndrome
// (last_error, qp_error).
#ifndef GPUVERBS_CQ_CUH
#define GPUVERBS_CQ_CUH

#include "wqe.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

// ------------------------------------------------------------------------------------------
// Completions
// ------------------------------------------------------------------------------------------

// Blocks of the WQE whose first block is `idx` (read back from its ctrl segment).
__device__ __forceinline__ uint32_t wqe_blocks_at(const gpuverbs_qp* q, uint64_t idx) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(wqe_slot(q, idx));
    uint32_t ds = bswap32(w[1]) & 0x3f;
    return ds == 0 ? 1 : (ds * 16 + 63) / 64;
}

// ------------------------------------------------------------------------------------------
// Completion counters (software): a counted call names, in the descriptor's table, the
// counter its WQE moves (`count_at`, before the WQE is published); the poll path adds 1 to it
// when it takes that WQE's own CQE without an error (`count_done`). Entries carry the WQE's
// first block + 1 on the 64-bit SQ counter, so an entry of an earlier lap never matches.
// ------------------------------------------------------------------------------------------

// Whether the QP can count completions: it has a counter table (every export made since the
// table exists) and its send CQ is not collapsed (there a CQE may be overwritten before it is
// taken, and its counter would never move).
__device__ __forceinline__ bool counts(const gpuverbs_qp* q) {
    return q->sq_counters != 0 && !q->scq_collapsed;
}

// Names `counter` (an 8-byte word, in GPU memory) the counter of the WQE at `idx`.
__device__ __forceinline__ void count_at(const gpuverbs_qp* k, uint64_t idx, uint64_t* counter) {
    uint64_t* e = reinterpret_cast<uint64_t*>(k->sq_counters) + 2 * (idx & (k->sq_blocks - 1));
    *reinterpret_cast<ulonglong2*>(e) =
        make_ulonglong2(idx + 1, reinterpret_cast<unsigned long long>(counter));
}

// The counter-table entry of the WQE whose first block is `wqe`: {tag, counter address}.
// Loaded before the poller reads the WQE's ctrl segment from the ring, so both loads are in
// flight together.
__device__ __forceinline__ ulonglong2 count_entry(const gpuverbs_qp* q, uint64_t wqe) {
    const uint64_t* e =
        reinterpret_cast<const uint64_t*>(q->sq_counters) + 2 * (wqe & (q->sq_blocks - 1));
    ulonglong2 v;
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(e));
    return v;
}

// The WQE whose first block is `wqe` completed without an error: when its entry `v` names a
// counter, the counter moves by 1, with release at system scope (a thread that acquires the
// counter sees what the poller saw: the CQE, so the WQE's local data), and the entry is
// cleared (counted once).
__device__ __forceinline__ void count_done(const gpuverbs_qp* q, uint64_t wqe, ulonglong2 v) {
    if (v.x != wqe + 1) return;
    reinterpret_cast<uint64_t*>(q->sq_counters)[2 * (wqe & (q->sq_blocks - 1))] = 0;
    asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(v.y) : "memory");
}

// Takes one send-CQ entry if software owns it. Returns 1 if one was taken (and retires the SQ
// space it covers), 0 if none. Records the first error CQE in the descriptor.
// Caller holds the send-CQ lock (or owns the QP exclusively).
template <sharing S>
__device__ __forceinline__ int scq_poll_one(gpuverbs_qp* q) {
    uint64_t ci = q->scq_ci;
    uint32_t n = q->scq_ncqe;
    uint32_t slot = q->scq_collapsed ? 0u : (uint32_t)(ci & (n - 1));
    const uint8_t* cqe = reinterpret_cast<const uint8_t*>(q->scq_ring) + slot * 64;
    uint32_t tail = ld_acquire_sys(reinterpret_cast<const uint32_t*>(cqe + 60));
    uint32_t op_own = tail >> 24;
    uint32_t opcode = op_own >> 4;
    if (opcode == 15) return 0;
    if (q->scq_collapsed) {
        // Slot 0 holds the newest completion: take it when its last word changed (each WQE
        // has its own counter); in this mode scq_ci holds that word plus 1.
        if (ci == (uint64_t)tail + 1) return 0;
    } else if ((op_own & 1u) != (uint32_t)((ci / n) & 1u)) {
        return 0;
    }
    uint16_t counter = (uint16_t)(((tail & 0xffu) << 8) | ((tail >> 8) & 0xffu));
    uint64_t retired = q->sq_retired;
    if (opcode == 13 || opcode == 14) {
        uint32_t synd_word = *reinterpret_cast<const volatile uint32_t*>(cqe + 52);
        uint8_t vendor = (uint8_t)(synd_word >> 16);
        uint8_t syndrome = (uint8_t)(synd_word >> 24);
        if (q->sq_error == 0) {
            // The failed WQE is not retired yet: its first block is the first one at or after
            // `retired` whose low 16 bits are the CQE's counter; bits 47..16 of it go into the
            // record's upper half (one word: a field of its own put the register copy of an
            // exclusive owner on the stack).
            const uint64_t wqe = retired + (uint16_t)(counter - (uint16_t)retired);
            q->sq_error_info = (wqe >> 16) << 32 | (uint64_t)syndrome << 24 |
                               (uint64_t)vendor << 16 | counter;
            // Released after the record: qp_error acquires it and then reads the record.
            state_store<S>(&q->sq_error, ci + 1);
        }
    }
    // A WQE that completed without an error may move a counter: its entry is read now,
    // alongside the ctrl segment below.
    const bool counted = opcode != 13 && opcode != 14 && q->sq_counters;
    const uint64_t wqe = retired + (uint16_t)(counter - (uint16_t)retired);
    const ulonglong2 entry = counted ? count_entry(q, wqe) : make_ulonglong2(0, 0);
    uint32_t blocks = wqe_blocks_at(q, counter);
    uint16_t delta = (uint16_t)(counter + blocks - (uint16_t)retired);
    if (delta <= q->sq_blocks) {
        if (counted) count_done(q, wqe, entry);
        state_store<S>(&q->sq_retired, retired + delta);
    }
    ci = q->scq_collapsed ? (uint64_t)tail + 1 : ci + 1;
    q->scq_ci = ci;
    st_relaxed_sys32(reinterpret_cast<uint32_t*>(q->scq_dbrec), bswap32((uint32_t)(ci & 0xffffff)));
    return 1;
}

// The error the QP recorded (see qp_error), read with plain loads: for the thread that polled
// it, or after something that ordered the recording before (a status ERROR_CQE it returned).
// The failed WQE's 64-bit index is its recorded 48 bits placed at or below `sq_retired`, which
// passed it when its CQE was taken and stays within the SQ's size of it.
__device__ __forceinline__ error last_error(const gpuverbs_qp* q) {
    const uint64_t info = q->sq_error_info;
    const uint64_t low48 = (info >> 32) << 16 | (uint16_t)info;
    const uint64_t retired = q->sq_retired;
    const uint64_t wqe = q->sq_error ? retired - ((retired - low48) & 0xffffffffffffull) : 0;
    return error{(uint8_t)(info >> 24), (uint8_t)(info >> 16), (uint16_t)info, wqe};
}

// Which error put the QP in ERR for the device API, without polling the CQ: the first error
// CQE the send-CQ poll path recorded (whichever thread took it). OK when none is recorded
// (nothing written to `*out`); ERROR_CQE with `*out` = its syndrome, vendor syndrome, 16-bit
// WQE counter and the failed WQE's first block on the 64-bit SQ counter. The record word is
// read with acquire at the sharing mode's scope, so the fields after it are the recorder's.
// The record stays until the host resets the tracking (ExportedQp::recover or reset_tracking).
template <sharing S = sharing::gpu>
__device__ __forceinline__ status qp_error(const gpuverbs_qp* q, error* out) {
    if (state_load<S>(&q->sq_error) == 0) return OK;
    if (out) *out = last_error(q);
    return ERROR_CQE;
}

// Takes what the send CQ holds, under the CQ lock when shared. Never waits: when another
// thread holds the lock it returns at once (that thread is polling), and it takes at most one
// ring's worth of CQEs per call (a device that keeps completing cannot keep it here).
template <sharing S>
__device__ __forceinline__ status scq_progress(gpuverbs_qp* q) {
    if (q->checked_out) return BUSY;
    if constexpr (S != sharing::exclusive) {
        if (!try_lock<S>(&q->scq_lock)) return OK;  // someone else is polling
    }
    for (uint32_t i = 0; i < q->scq_ncqe && scq_poll_one<S>(q); ++i) {
    }
    if constexpr (S != sharing::exclusive) unlock<S>(&q->scq_lock);
    return q->sq_error ? ERROR_CQE : OK;
}

__device__ __forceinline__ bool sq_broken(const gpuverbs_qp* q) {
    return *reinterpret_cast<const volatile uint32_t*>(&q->sq_broken) != 0u;
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_CQ_CUH
