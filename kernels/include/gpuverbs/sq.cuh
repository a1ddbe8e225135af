// gpuverbs device API — sq.cuh (see qp.cuh for the layers).
//
// The send queue: reserve WQE blocks (lock-free, back-pressure against the send CQ), publish
// them in order, ring the doorbell (GPU doorbell, BlueFlame, CPU-proxy producer word); exclusive
// ownership in registers (checkout / checkin).
#ifndef GPUVERBS_SQ_CUH
#define GPUVERBS_SQ_CUH

#include "cq.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

// ------------------------------------------------------------------------------------------
// Reserve, publish, ring
// ------------------------------------------------------------------------------------------

// Reserves `n` blocks; waits (polling the CQ) while the SQ is full. Lock-free (CAS), so a
// timeout leaves no hole in the ring. The clock is read only once it has to wait.
//
// `force_signal` (optional) is set when the reserved WQEs must ask for a CQE whatever the
// caller wanted: selective signaling must never starve the ring, and only signaled
// completions retire space, so a WQE is signaled when no signaled WQE covers the last half
// ring. (The check uses values loaded with the reservation, so it costs no extra round trip.)
//
// `published` (optional) receives the in-order publish counter as it was before the CAS: when
// it equals `*start`, every earlier reservation is published and `publish` need not wait for it.
//
// Every word it needs is loaded before it looks at any (the error, checkout and broken words,
// the reservation, the signaled end, the retired and published counts), relaxed, then one
// acquire fence, so a call costs one trip to memory before its CAS. The reservation is a
// relaxed guess the CAS confirms; `sq_retired` needs acquire (the blocks it frees were read by
// the device before), `sq_ready` too (the WQEs before it are ordered before this caller's).
template <sharing S>
__device__ __forceinline__ status reserve(gpuverbs_qp* q, uint32_t n, call_clock& c, uint64_t* start,
                                          bool* force_signal = nullptr,
                                          uint64_t* published = nullptr) {
    const uint32_t blocks = q->sq_blocks;  // a constant: loaded once, with the state below
    for (;;) {
        const uint64_t error = q->sq_error;
        const uint32_t held = q->checked_out;
        const bool broken = S != sharing::exclusive && sq_broken(q);
        uint64_t r = state_load<S, false>(&q->sq_reserved);
        uint64_t covered = S == sharing::exclusive
                               ? q->sq_signaled_end
                               : *reinterpret_cast<volatile uint64_t*>(&q->sq_signaled_end);
        uint64_t retired = state_load<S, false>(&q->sq_retired);
        uint64_t ready = published ? state_load<S, false>(&q->sq_ready) : 0;
        state_acquire<S>();
        if (error) return ERROR_CQE;  // the QP is in error: nothing new would execute
        if (held) return BUSY;
        if (broken) return BROKEN;
        if (r + n - retired <= blocks) {
            if (force_signal) *force_signal = r + n - covered >= (blocks >> 1);
            if (published) *published = ready;
            if (S == sharing::exclusive) {
                q->sq_reserved = r + n;
                *start = r;
                return OK;
            }
            if (state_cas<S>(&q->sq_reserved, r, r + n) == r) {
                *start = r;
                return OK;
            }
            // Lost the race: retry, but within the call's budget (lock-free, and bounded).
            if (c.expired()) return TIMEOUT;
            continue;
        }
        const status p = scq_progress<S>(q);
        if (p != OK) return p;
        if (c.expired()) return TIMEOUT;
    }
}

template <sharing S>
__device__ __forceinline__ status reserve(gpuverbs_qp* q, uint32_t n, uint64_t budget_ns,
                                          uint64_t* start, bool* force_signal = nullptr) {
    call_clock c(budget_ns);
    return reserve<S>(q, n, c, start, force_signal);
}

// Shared modes: waits until every reservation before `start` is published (the in-order
// publish counter reaches it). A wait that gives up (an earlier reservation's thread never
// published it, or not within this call's budget) leaves a hole no later WQE can pass: it marks
// the send queue broken (sq_broken) and returns TIMEOUT; every later send-side call, the late
// publisher's included, returns BROKEN. The host resets the QP, connects it and exports it again.
template <sharing S>
__device__ __forceinline__ status publish_turn(gpuverbs_qp* q, uint64_t start, call_clock& c) {
    while (state_load<S>(&q->sq_ready) != start) {
        if (sq_broken(q)) return BROKEN;
        if (c.expired()) {
            atomicExch(&q->sq_broken, 1u);
            __threadfence();
            return TIMEOUT;
        }
    }
    return OK;
}

// How many CQEs a published range asks for: `cqes` when given, else one when its last WQE is
// signaled (the one-signal-per-range rule of every call that does not pass `cqes`).
constexpr uint32_t CQES_OF_SIGNALED = ~0u;
__device__ __forceinline__ uint32_t cqes_of(bool signaled, uint32_t cqes) {
    return cqes != CQES_OF_SIGNALED ? cqes : (signaled ? 1u : 0u);
}

// Counts the range's CQEs into `sq_cqes` (the CQE number the next signaled WQE gets, what a
// companion's WAIT names): by the in-order publisher, before its release of `sq_ready`, so the
// next publisher, which acquires `sq_ready`, continues from it. `*first` (optional) gets the
// range's first. A range that asks for no CQE and no number touches nothing (no load on the
// path of unsignaled posts).
template <sharing S>
__device__ __forceinline__ void count_cqes(gpuverbs_qp* q, uint32_t cqes, uint64_t* first) {
    if (cqes == 0 && first == nullptr) return;
    volatile uint64_t* p = reinterpret_cast<volatile uint64_t*>(&q->sq_cqes);
    const uint64_t f = S == sharing::exclusive ? q->sq_cqes : *p;
    if (cqes) {
        if (S == sharing::exclusive) q->sq_cqes = f + cqes;
        else *p = f + cqes;
    }
    if (first) *first = f;
}

// Publishes blocks [start, start+n) after every earlier reservation. The ready counter is
// released at GPU scope; the system-scope release of the WQE bytes happens in `ring`, whose
// fence is cumulative over every WQE published before it. `signaled` records that the last
// WQE asks for a CQE; `cqes` (when given) is how many WQEs of the range ask for one, and
// `first_cqe` (optional) receives the CQE number the first of them gets (`sq_cqes`).
template <sharing S>
__device__ __forceinline__ status publish(gpuverbs_qp* q, uint64_t start, uint32_t n,
                                          uint64_t last_start, bool signaled, call_clock& c,
                                          uint32_t cqes = CQES_OF_SIGNALED,
                                          uint64_t* first_cqe = nullptr) {
    if (S != sharing::exclusive) {
        const status s = publish_turn<S>(q, start, c);
        if (s != OK) return s;
    }
    q->sq_last_start = last_start;
    if (signaled) q->sq_signaled_end = start + n;
    count_cqes<S>(q, cqes_of(signaled, cqes), first_cqe);
    state_store<S>(&q->sq_ready, start + n);
    return OK;
}

template <sharing S>
__device__ __forceinline__ status publish(gpuverbs_qp* q, uint64_t start, uint32_t n,
                                          uint64_t last_start, bool signaled,
                                          uint64_t budget_ns) {
    call_clock c(budget_ns);
    return publish<S>(q, start, n, last_start, signaled, c);
}

// `sq_rung` is the doorbell's lock as well as the producer index last rung: while a thread
// rings a shared QP it holds RUNG_HELD there, so one exchange takes the doorbell and reads the
// index, and the store that gives it back writes the new index (release: the next ringer's
// doorbell stores come after this one's, so the doorbell record never goes back).
constexpr uint64_t RUNG_HELD = ~0ull;

template <sharing S>
__device__ __forceinline__ bool take_rung(gpuverbs_qp* q, call_clock& c, uint64_t* rung) {
    if constexpr (S == sharing::exclusive) {
        *rung = q->sq_rung;
        return true;
    } else {
        for (;;) {
            const uint64_t old = state_exchange<S>(&q->sq_rung, RUNG_HELD);
            if (old != RUNG_HELD) {
                *rung = old;
                return true;
            }
            if (c.expired()) return false;
            __nanosleep(32);
        }
    }
}

template <sharing S>
__device__ __forceinline__ void give_rung(gpuverbs_qp* q, uint64_t rung) {
    state_store<S>(&q->sq_rung, rung);
}

// The doorbell stores for producer index `pi`, in the QP's doorbell mode (constants from `k`).
// The caller holds the doorbell (take_rung) and has ordered every WQE before `pi` ahead of
// these stores (release_wqes). The doorbell value carries the producer index itself
// ({BE32(pi << 8), BE32(qpn << 8)}), so the device never depends on the order in which the
// doorbell record and the doorbell land.
//
// BlueFlame: the last WQE (up to 4 blocks, first block `at`) goes into the register half as
// well, seqlock style: the half was cleared by the previous ring (its first 8 bytes are 0,
// ordered before this ring's bytes by the release fence, system scope in this mode), bytes 8..
// are written, a second fence, then the first 8 bytes; then the other half is cleared for the
// next ring. `last` is the caller's newest WQE when it built it in registers (one block): it
// is copied from there when it is the WQE at `at`, which its ctrl segment's index says;
// otherwise the WQE is read back from the ring.
//
// `doorbell` is `doorbell_record` then `doorbell_register`; `ring_multi` splits them to write
// every QP's record before any QP's register.

// The send word of the doorbell record gets the producer index (GPU doorbell and BlueFlame
// modes; nothing in CPU-proxy mode, whose host thread writes the record itself, nor in no-DBR
// mode: a QP made with send_dbr_mode NO_DBR_EXT has no send doorbell record, its device takes
// the producer index from the doorbell value alone, as GPUNetIO's
// doca_gpu_dev_verbs_submit_db_no_dbr does; nor in emulated no-DBR mode, an ordinary QP whose
// record a host proxy thread keeps from the producer word, GPUNetIO's
// SEND_DBR_MODE_EXT_NO_DBR_SW_EMULATED).
__device__ __forceinline__ bool has_record(uint32_t mode) {
    return mode != GPUVERBS_DB_CPU_PROXY && mode != GPUVERBS_DB_NO_DBR &&
           mode != GPUVERBS_DB_NO_DBR_EMULATED;
}

__device__ __forceinline__ void doorbell_record(const gpuverbs_qp& k, uint64_t pi) {
    if (!has_record(k.db_mode)) return;
    st_relaxed_sys32(reinterpret_cast<uint32_t*>(k.dbrec) + 1, bswap32((uint32_t)(pi & 0xffff)));
}

// The doorbell proper: the register store (GPU doorbell; no DBR, where `db_reg` is the
// page's DBR-less register, UAR + 0x600, and the value's producer index is all the device
// gets), the BlueFlame copy, or the CPU-proxy producer word. Emulated no DBR: the producer
// word first (the host proxy thread that reads it writes the record, a fence and the doorbell
// again, so a doorbell the device lost is recovered from the record), then the 8-byte
// doorbell to the ordinary register, never the record.
__device__ __forceinline__ void doorbell_register(gpuverbs_qp* q, const gpuverbs_qp& k,
                                                  uint64_t pi, uint64_t at, const block* last) {
    if (k.db_mode == GPUVERBS_DB_CPU_PROXY || k.db_mode == GPUVERBS_DB_NO_DBR_EMULATED) {
        st_relaxed_sys64(reinterpret_cast<uint64_t*>(k.proxy_word), pi);
        if (k.db_mode == GPUVERBS_DB_CPU_PROXY) return;
    }
    uint8_t* const halves = reinterpret_cast<uint8_t*>(k.db_reg);
    // DOCA convention: {BE32(pi << 8), BE32(qpn << 8)}.
    uint64_t value = (uint64_t)bswap32(k.qpn << 8) << 32 | bswap32(((uint32_t)pi & 0xffffu) << 8);
    if (k.db_mode != GPUVERBS_DB_BLUEFLAME) {
        st_relaxed_sys64(reinterpret_cast<uint64_t*>(halves), value);
        return;
    }
    uint8_t* reg = halves + (q->bf_half & 1u) * 256;
    const bool held = last && ((bswap32(last->u[0].x) >> 8) & 0xffffu) == (uint32_t)(at & 0xffffu);
    const uint32_t blocks = held ? 1u : wqe_blocks_at(&k, at);
    if (at + blocks == pi && blocks <= 4) {
        uint4 first;
        if (held) {
            first = last->u[0];
            for (int u = 1; u < 4; ++u) st16(reg + u * 16, last->u[u]);
        } else {
            first = *reinterpret_cast<const uint4*>(wqe_unit(&k, at, 0));
            for (uint32_t u = 1; u < blocks * 4; ++u) {
                st16(reg + u * 16, *reinterpret_cast<const uint4*>(wqe_unit(&k, at, u)));
            }
        }
        st_relaxed_sys64(reinterpret_cast<uint64_t*>(reg + 8), (uint64_t)first.w << 32 | first.z);
        value = (uint64_t)first.y << 32 | first.x;
        asm volatile("fence.release.sys;" ::: "memory");
    }
    st_relaxed_sys64(reinterpret_cast<uint64_t*>(reg), value);
    q->bf_half ^= 1u;
    st_relaxed_sys64(reinterpret_cast<uint64_t*>(halves + (q->bf_half & 1u) * 256), 0);
}

__device__ __forceinline__ void doorbell(gpuverbs_qp* q, const gpuverbs_qp& k, uint64_t pi,
                                         uint64_t at, const block* last) {
    doorbell_record(k, pi);
    doorbell_register(q, k, pi, at, last);
}

// Whether the release before a doorbell must be at system scope: host-resident rings, and
// BlueFlame, where it also orders the previous ring's clear of this half (host memory) before
// this ring's copy.
__device__ __forceinline__ bool sys_release(const gpuverbs_qp& k) {
    return k.ring_loc == 0 || k.db_mode == GPUVERBS_DB_BLUEFLAME;
}

// What one thread released to the device's scope ahead of its doorbell (`release_ahead`):
// the producer index its fence covered. It holds for that thread only: a ring by another
// thread would have no release of its own before its doorbell stores.
struct released {
    uint64_t upto = 0;
};

// Tells the device about every published WQE, in the QP's doorbell mode: one release fence
// (system scope for host-resident rings, GPU scope otherwise) orders every published WQE
// before the doorbell record and the doorbell (see `doorbell`), unless this thread's
// `release_ahead` already covered them all (`ahead.upto`, exclusive mode only). `last`: see
// `doorbell`.
template <sharing S>
__device__ __forceinline__ status ring(gpuverbs_qp* q, call_clock& c, const block* last = nullptr,
                                       released ahead = {}) {
    // The descriptor's constants are loaded with the checks, before the doorbell is taken and
    // the fence (after the fence they would be loaded again: one more trip to memory).
    const uint32_t held = q->checked_out;
    const bool broken = S != sharing::exclusive && sq_broken(q);
    const gpuverbs_qp k = consts_of(q);
    if (held) return BUSY;
    if (broken) return BROKEN;
    uint64_t rung;
    if (!take_rung<S>(q, c, &rung)) return TIMEOUT;
    const uint64_t ready = state_load<S>(&q->sq_ready);
    if (ready > rung) {
        // Only an exclusive caller's own token may skip the fence (see `released`).
        const uint64_t covered = S == sharing::exclusive ? ahead.upto : 0;
        if (ready > covered) release_wqes(sys_release(k));
        doorbell(q, k, ready, k.db_mode == GPUVERBS_DB_BLUEFLAME ? q->sq_last_start : 0, last);
        rung = ready;
    }
    give_rung<S>(q, rung);
    return OK;
}

template <sharing S>
__device__ __forceinline__ status ring(gpuverbs_qp* q, uint64_t budget_ns,
                                       const block* last = nullptr) {
    call_clock c(budget_ns);
    return ring<S>(q, c, last);
}

// ------------------------------------------------------------------------------------------
// Ringing several QPs at once (GPUNetIO's submit_db_multi_qps)
// ------------------------------------------------------------------------------------------

// The most QPs one `ring_multi` call rings (its per-QP state stays in registers).
constexpr uint32_t RING_MULTI_MAX = 8;

// Rings every WQE published on each QP of `qps[0..n)` (posted with `do_ring = false`, or by
// reserve / prepare / publish), under one budget, with two fences in all instead of one or two
// per QP:
//
//   1. per QP: the checks `ring` makes (BUSY, BROKEN), the doorbell taken (take_rung, bounded by
//      the budget) and the published end read. A QP that fails here is not rung; its status
//      goes to `each[i]` (when given) and the first one is returned; the others are still rung.
//   2. one release fence, for every QP: it orders every published WQE (and the payloads and
//      earlier publishes it covers cumulatively) before every doorbell record, register and
//      proxy word stored below. A fence orders all of this thread's earlier memory operations
//      (and, cumulatively, what it has observed: the WQEs other threads published, seen through
//      its acquire of `sq_ready`) before all of its later stores, whatever their address, so one
//      serves every QP. Scope: system when any QP to ring has its rings in host memory or rings
//      by BlueFlame (as `ring`: the NIC or the soft NIC's CPU engine reads them over the system;
//      BlueFlame also orders the previous ring's clear of the half before this copy); GPU scope
//      when all of them have their rings in GPU memory (the NIC reads those only after the
//      doorbell).
//   3. per QP: the doorbell record (send word = producer index). The record must come after
//      the WQEs (step 2): a device may take the producer from it at any time.
//   4. one fence again, for every QP: it orders every record before every doorbell. Why the
//      record before the doorbell: the doorbell value carries its own QP's producer index, but a
//      device does not always see every doorbell value. Doorbells of QPs that share a register
//      (or a UAR page) overwrite one another, a ConnectX's doorbell recovery path reads the
//      records (GPUNetIO: "in case the recovery path is triggered"), and the soft NIC, on any
//      doorbell on a shared register, takes the producer of every QP from its record (of its own
//      doorbell, the larger of value and record). So when any doorbell of this call arrives, every
//      record of this call must already be readable: all records, one fence, all doorbells. Same
//      scope as step 2 (the records are in host memory either way; GPUNetIO makes this second
//      fence at most GPU scope). Skipped when every QP to ring is in CPU-proxy or no-DBR
//      mode. A no-DBR QP (send_dbr_mode NO_DBR_EXT) has no record to write (step 3 skips it)
//      and no recovery path reading one: its device takes the producer from the doorbell
//      value, so for it the DB -> DBR -> fence -> DB sequence degenerates to one doorbell
//      after step 2's fence.
//   5. per QP: the doorbell in its mode, as `doorbell_register`: the 8-byte register store, the
//      BlueFlame copy (with its own seqlock fence per QP), or for a CPU-proxy QP the producer
//      word. A CPU-proxy QP has no record from the GPU (step 3 skips it): its host thread sees
//      the word change and writes the record, then the register, itself; only step 2's fence
//      matters for it (its WQEs before the word).
//   6. per QP: the doorbell given back with the new producer index (release: the next ringer's
//      stores come after these).
//
// GPUNetIO's submit_db_multi_qps rings each QP twice (fence, early doorbell; then record, fence,
// doorbell again: 2 fences per QP); gpuverbs' doorbell values carry the producer index, so one
// doorbell per QP after its record is enough. Shared modes: the doorbells are taken in the
// order of `qps`, each held until step 6, so threads that ring overlapping sets should list
// them in one order (a thread waiting for a doorbell another holds spends its budget, then that
// QP is TIMEOUT and not rung: ring it again). Returns INVALID (nothing rung) when n exceeds
// RING_MULTI_MAX or a pointer is null.
template <sharing S>
__device__ __forceinline__ status ring_multi(gpuverbs_qp* const* qps, uint32_t n, call_clock& c,
                                             status* each = nullptr) {
    if (n > RING_MULTI_MAX) return INVALID;
    for (uint32_t i = 0; i < n; ++i) {
        if (!qps[i]) return INVALID;
    }
    uint64_t rung[RING_MULTI_MAX];
    uint64_t ready[RING_MULTI_MAX];
    uint32_t taken = 0;  // bit i: QP i's doorbell is held
    uint32_t due = 0;    // bit i: QP i has published WQEs past its last ring
    bool sys = false;    // step 2's and step 4's scope
    bool records = false;  // some QP to ring has a doorbell record to write (not CPU proxy,
                           // not no DBR)
    status first = OK;
    // 1. checks, doorbells taken, published ends read
    for (uint32_t i = 0; i < n; ++i) {
        gpuverbs_qp* const q = qps[i];
        const uint32_t held = q->checked_out;
        const bool broken = S != sharing::exclusive && sq_broken(q);
        const uint32_t mode = q->db_mode;
        const uint32_t loc = q->ring_loc;
        status s = held ? BUSY : broken ? BROKEN : OK;
        if (s == OK && !take_rung<S>(q, c, &rung[i])) s = TIMEOUT;
        if (s == OK) {
            taken |= 1u << i;
            ready[i] = state_load<S>(&q->sq_ready);
            if (ready[i] > rung[i]) {
                due |= 1u << i;
                sys |= loc == 0 || mode == GPUVERBS_DB_BLUEFLAME;
                records |= has_record(mode);
            }
        }
        if (each) each[i] = s;
        if (s != OK && first == OK) first = s;
    }
    if (due) {
        // 2. one fence: every QP's WQEs before any record, doorbell or proxy word
        release_wqes(sys);
        // 3. every QP's doorbell record
        for (uint32_t i = 0; i < n; ++i) {
            if (due & (1u << i)) doorbell_record(consts_of(qps[i]), ready[i]);
        }
        // 4. one fence: every record before any doorbell
        if (records) release_wqes(sys);
        // 5. every QP's doorbell (register, BlueFlame copy or proxy word)
        for (uint32_t i = 0; i < n; ++i) {
            if (!(due & (1u << i))) continue;
            gpuverbs_qp* const q = qps[i];
            const gpuverbs_qp k = consts_of(q);
            doorbell_register(q, k, ready[i],
                              k.db_mode == GPUVERBS_DB_BLUEFLAME ? q->sq_last_start : 0, nullptr);
            rung[i] = ready[i];
        }
    }
    // 6. the doorbells given back with the index rung
    for (uint32_t i = 0; i < n; ++i) {
        if (taken & (1u << i)) give_rung<S>(qps[i], rung[i]);
    }
    return first;
}

template <sharing S = sharing::gpu>
__device__ status ring_multi(gpuverbs_qp* const* qps, uint32_t n, uint64_t budget_ns,
                             status* each = nullptr) {
    call_clock c(budget_ns);
    return ring_multi<S>(qps, n, c, each);
}

// Exclusive mode: releases every WQE published so far, and every store this thread made before
// the call (a payload the WQEs read), to the device's scope now, with the fence that `ring`
// would make, and returns in `*r` what it covered. A later `ring(q, budget, *r)` by the same
// thread is then the doorbell stores alone as long as nothing was published after this call
// (else it fences as usual). For a loop that knows its next message before it may send it (a
// ping-pong's answer): post it with `do_ring = false`, `release_ahead`, wait for the peer, ring.
// Stores made after the call are not covered: a payload changed later needs a ring that fences.
template <sharing S>
__device__ __forceinline__ status release_ahead(gpuverbs_qp* q, released* r) {
    static_assert(S == sharing::exclusive,
                  "release_ahead: only the thread that owns the QP may ring without a fence");
    const uint32_t held = q->checked_out;
    const uint64_t ready = q->sq_ready;
    const bool sys = sys_release(consts_of(q));
    if (held) return BUSY;
    release_wqes(sys);
    r->upto = ready;
    return OK;
}

// The ring after `release_ahead` (exclusive mode): no fence when `ahead` covers every
// published WQE. Returns what `ring` returns.
template <sharing S>
__device__ __forceinline__ status ring(gpuverbs_qp* q, uint64_t budget_ns, released ahead,
                                       const block* last = nullptr) {
    static_assert(S == sharing::exclusive,
                  "ring after release_ahead: only the thread that released may skip the fence");
    call_clock c(budget_ns);
    return ring<S>(q, c, last, ahead);
}

// Publishes blocks [start, start+n) the caller has just written (its last WQE at `last_start`,
// `last` as in `doorbell`), then, with `do_ring`, rings the doorbell up to their end: what a
// post does after `reserve` (`published` is what reserve returned: when it equals `start`,
// every earlier reservation is published and the wait for the turn is skipped).
// Exclusive: publish, then ring. Shared: once the turn to publish has come, one release fence
// at the doorbell's scope orders the WQEs (this caller's, and cumulatively those published
// before) ahead of the publish counter and the doorbell both; the doorbell is taken with one
// exchange and rung to this caller's end unless a later ring already covered it (without
// BlueFlame, whose ring fences after taking the doorbell, see `doorbell`).
// `cqes` and `first_cqe` as in `publish`.
template <sharing S>
__device__ __forceinline__ status publish_ring(gpuverbs_qp* q, const gpuverbs_qp& k,
                                               uint64_t start, uint32_t n, uint64_t last_start,
                                               bool signaled, uint64_t published, bool do_ring,
                                               call_clock& c, const block* last,
                                               uint32_t cqes = CQES_OF_SIGNALED,
                                               uint64_t* first_cqe = nullptr) {
    if constexpr (S == sharing::exclusive) {
        const status s = publish<S>(q, start, n, last_start, signaled, c, cqes, first_cqe);
        if (s != OK || !do_ring) return s;
        return ring<S>(q, c, last);
    } else {
        if (published != start) {
            const status s = publish_turn<S>(q, start, c);
            if (s != OK) return s;
        }
        const uint64_t end = start + n;
        q->sq_last_start = last_start;
        if (signaled) q->sq_signaled_end = end;
        count_cqes<S>(q, cqes_of(signaled, cqes), first_cqe);
        const bool bf = k.db_mode == GPUVERBS_DB_BLUEFLAME;
        if (!do_ring || bf) {
            state_store<S>(&q->sq_ready, end);
            if (!do_ring) return OK;
        } else {
            release_wqes(k.ring_loc == 0);
            state_store_relaxed<S>(&q->sq_ready, end);
        }
        uint64_t rung;
        if (!take_rung<S>(q, c, &rung)) return TIMEOUT;
        if (end > rung) {
            if (bf) release_wqes(true);
            doorbell(q, k, end, last_start, last);
            rung = end;
        }
        give_rung<S>(q, rung);
        return OK;
    }
}

// ------------------------------------------------------------------------------------------
// Exclusive ownership in registers
// ------------------------------------------------------------------------------------------

// A thread that alone drives a QP for a stretch of work (sharing::exclusive) can take its state
// into registers, call the exclusive-mode functions on the copy, and hand the state back:
//
//     gpuverbs_qp mine;
//     if (gpuverbs::checkout(q, &mine) != gpuverbs::OK) ...;   // BUSY: someone holds it
//     ... put<sharing::exclusive>(&mine, ...); quiet<sharing::exclusive>(&mine, ...); ...
//     gpuverbs::checkin(q, mine);
//
// Inside the stretch a WQE costs no descriptor loads or stores (through `q` every put reloads
// the state it stored, from L2). While the QP is checked out, every call through `q` (reserve,
// ring, CQ polling, and so every high-level call) returns BUSY and changes nothing, and a second
// checkout returns BUSY. Everything posted through the copy is on the rings and announced to the
// device; only `checkin` makes `q` usable again. checkout does not wait for calls already in
// progress through `q`: take a QP nobody is using at that moment (BUSY guards later calls).
__device__ __forceinline__ status checkout(gpuverbs_qp* q, gpuverbs_qp* mine) {
    if (atomicCAS(&q->checked_out, 0u, 1u) != 0u) return BUSY;
    // Acquire: the state the previous holder released (checkin or st.release.gpu) is visible.
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    *mine = *q;
    mine->checked_out = 0;  // the copy itself is not checked out
    return OK;
}

// Stores the device-API state of a register copy back into the descriptor (plain stores).
__device__ __forceinline__ void store_state(gpuverbs_qp* q, const gpuverbs_qp& mine) {
    q->sq_reserved = mine.sq_reserved;
    q->sq_ready = mine.sq_ready;
    q->sq_rung = mine.sq_rung;
    q->sq_retired = mine.sq_retired;
    q->sq_signaled_end = mine.sq_signaled_end;
    q->sq_last_start = mine.sq_last_start;
    q->sq_cqes = mine.sq_cqes;
    q->scq_ci = mine.scq_ci;
    q->rcq_ci = mine.rcq_ci;
    q->rq_posted = mine.rq_posted;
    q->sq_error = mine.sq_error;
    q->sq_error_info = mine.sq_error_info;
    q->bf_half = mine.bf_half;
}

__device__ __forceinline__ void checkin(gpuverbs_qp* q, const gpuverbs_qp& mine) {
    store_state(q, mine);
    // Release: the state above before the QP is free again.
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(&q->checked_out), "r"(0u) : "memory");
}

// An exclusive-mode call through `q` runs on a register copy too, for the length of the call:
// `on_copy<S>(q, f)` loads the descriptor once, runs `f` on the copy and stores the state back.
// Through `q` itself every store into the ring (which the compiler cannot tell apart from the
// descriptor) would make the state and the ring's addresses be loaded again, a trip to L2
// each. Nothing is stored back when the QP is checked out (the call returned BUSY and changed
// nothing). Shared modes run `f` on `q`: other threads change its state meanwhile.
template <sharing S, typename F>
__device__ __forceinline__ status on_copy(gpuverbs_qp* q, F&& f) {
    if constexpr (S == sharing::exclusive) {
        gpuverbs_qp mine = *q;
        const status s = f(&mine);
        if (!mine.checked_out) store_state(q, mine);
        return s;
    } else {
        return f(q);
    }
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_SQ_CUH
