// Kernels of the perftest-style samples (the harnesses samples/src/bw.rs and lat.rs: put_bw,
// read_bw, send_bw, atomic_bw; write_lat, read_lat, send_lat, atomic_lat). Each drives
// exported QPs through the public device API only and reports a status the host decodes; the
// host validates every payload byte.
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

namespace samples {

// One QP's share of a put_bw run. Mirrors `gpuverbs_samples::BwJob` (56 bytes, checked on both
// sides).
struct bw_job {
    gpuverbs_qp* qp;     // exported descriptor
    uint64_t lbase;      // NIC address of source slot 0 (the sources are shared by all jobs)
    uint64_t rbase;      // remote address of this job's destination slot 0
    uint32_t lkey;
    uint32_t rkey;
    uint32_t workers;    // threads that drive this QP (CTAs of the job x threads per CTA)
    uint32_t dst_slots;  // destination slots of the job (a multiple of `workers`)
    uint32_t src_slots;  // source slots (not dividing dst_slots: consecutive writes of a slot differ)
    uint32_t src_shift;  // iteration i of the job reads source slot (i + src_shift) % src_slots
    const uint8_t* src_dev;  // source slot 0 as the GPU sees it (inline WQEs copy from it)
};
static_assert(sizeof(bw_job) == 56, "bw_job layout");

// -D (a run of a duration, not a count): ctl[0] is the highest iteration index any thread has
// started, with bit 63 set once the duration is over (from then on it no longer moves);
// ctl[1] the run's start (%globaltimer, set by the first thread). Every thread asks before
// each of its iterations; an iteration runs when the duration is not over or its index is at
// most the frozen highest, so every job runs iterations 0 ..= the frozen highest, the same
// count for all (the host reads it). With `ctl` null, every iteration below `iters` runs.
struct duration_ctl {
    unsigned long long* ctl;
    uint64_t duration_ns;
    uint64_t start;
    uint32_t iters;

    __device__ __forceinline__ duration_ctl(unsigned long long* c, uint64_t d, uint32_t n)
        : ctl(c), duration_ns(d), start(0), iters(n) {
        if (ctl != nullptr) {
            const uint64_t t = gpuverbs::now_ns();
            const unsigned long long was = atomicCAS(&ctl[1], 0ull, (unsigned long long)t);
            start = was == 0 ? t : was;
        }
    }

    // Whether iteration `i` runs.
    __device__ __forceinline__ bool go(uint64_t i) const {
        if (ctl == nullptr) return i < iters;
        constexpr unsigned long long STOP = 1ull << 63;
        if (i >= iters) {
            // The count's limit: the run ends as if the duration were over.
            atomicOr(&ctl[0], STOP);
            return false;
        }
        const unsigned long long old = atomicMax(&ctl[0], (unsigned long long)i);
        if (old & STOP) return i <= (old & ~STOP);
        if (gpuverbs::now_ns() - start >= duration_ns) atomicOr(&ctl[0], STOP);
        return true;
    }
};

// One side of a write_lat ping-pong. Mirrors `gpuverbs_samples::LatSide` (72 bytes).
struct lat_side {
    gpuverbs_qp* qp;
    uint64_t src_nic;    // NIC address of the outgoing payload
    uint64_t src_dev;    // the same bytes as the GPU sees them (the kernel writes the tail)
    uint64_t dst_remote; // remote address the payload goes to
    uint64_t recv_dev;   // GPU address of the aligned 8-byte word that ends the incoming payload
    uint64_t sig_remote; // peer's signal word (remote address)
    uint64_t sig_dev;    // own signal word (GPU address)
    uint32_t lkey;
    uint32_t rkey;
    uint32_t sig_rkey;
    uint32_t src_stride; // WRITE, SEND: from the payload's first copy to its second
};
static_assert(sizeof(lat_side) == 72, "lat_side layout");

// The largest inline message of the latency kernel (the samples' -I limit).
constexpr uint32_t MAX_LAT_INLINE = 256;

// One end of a WRITE or SEND ping-pong as the thread that drives it holds it.
struct lat_end {
    lat_side side;
    gpuverbs_qp q;           // the register copy of side.qp (checkout)
    int id;                  // 0: side A, 1: side B
    uint64_t sent = 0;
    uint8_t* stage = nullptr;  // inline messages: the payload's copy in shared memory
    gpuverbs::released ahead;  // what the release of its prepared message covered

    __device__ __forceinline__ lat_end(const lat_side& s, int i) : side(s), q{}, id(i) {}
};

// Status words: [status, syndrome, vendor, wqe_counter, job/side, 0, 0, 0]; the first non-OK
// status of any thread wins.
GPUVERBS_DEVICE void report(int* out, gpuverbs::status s, const gpuverbs::error& e, int who) {
    if (s != gpuverbs::OK && atomicCAS(out, 0, (int)s) == 0) {
        out[1] = e.syndrome;
        out[2] = e.vendor;
        out[3] = e.wqe_counter;
        out[4] = who;
    }
}

// -D in the latency tests: after `warmup` counted iterations a timed part runs until
// `duration_ns` has passed on this side's clock, and the waits for the peer end there (the
// peer stops on its own clock; the counts say who sent what). Without a duration: `warmup` is
// the whole count.
struct lat_clock {
    uint64_t duration_ns;
    uint64_t warmup;
    uint64_t start = 0;
    uint64_t deadline = ~0ull;
    uint64_t last = 0;

    __device__ __forceinline__ lat_clock(uint64_t d, uint64_t w) : duration_ns(d), warmup(w) {}

    // Whether iteration k starts.
    __device__ __forceinline__ bool go(uint64_t k) {
        if (k < warmup) return true;
        if (duration_ns == 0) return false;
        if (k == warmup) {
            start = gpuverbs::now_ns();
            last = start;
            deadline = start + duration_ns;
        }
        return gpuverbs::now_ns() < deadline;
    }
    // The budget of a wait for the peer.
    __device__ __forceinline__ uint64_t wait(uint64_t budget) const {
        if (deadline == ~0ull) return budget;
        const uint64_t t = gpuverbs::now_ns();
        const uint64_t left = t < deadline ? deadline - t : 0;
        return left < budget ? left : budget;
    }
    // Whether a wait's status `s` is the duration's end (TIMEOUT once it has passed).
    __device__ __forceinline__ bool ended(gpuverbs::status s) const {
        return s == gpuverbs::TIMEOUT && deadline != ~0ull && gpuverbs::now_ns() >= deadline;
    }
    // Iteration k completed: counted when it was timed.
    __device__ __forceinline__ void done(uint64_t k, uint64_t* timed) {
        if (duration_ns != 0 && k >= warmup) {
            *timed += 1;
            last = gpuverbs::now_ns();
        }
    }
    __device__ __forceinline__ uint64_t span() const { return last - start; }
};

// The tail of the payload of iteration k (k+1, little-endian, the last `n` <= 8 bytes).
GPUVERBS_DEVICE uint64_t tail_mask(uint32_t n) {
    return n >= 8 ? ~0ull : ((1ull << (8 * n)) - 1);
}

template <gpuverbs::sharing S>
GPUVERBS_DEVICE gpuverbs::status bw_loop(gpuverbs_qp* q, const bw_job& job, uint32_t w,
                                         uint32_t size, const duration_ctl& d, uint32_t scope,
                                         uint32_t batch, uint32_t sig_calls, bool inl,
                                         uint64_t budget) {
    using namespace gpuverbs;
    const uint32_t W = job.workers;
    status s = OK;
    for (uint64_t r = 0;; ++r) {
        const uint64_t i = r * W + w;
        const bool part = d.go(i);
        const uint64_t src = ((i + job.src_shift) % job.src_slots) * size;
        const uint64_t raddr = job.rbase + (i % job.dst_slots) * size;
        const bool sig = (r + 1) % sig_calls == 0;
        if (scope == 2) {
            // Collective: every thread of the block takes part in every round some thread of
            // it runs.
            if (!__syncthreads_or(part)) break;
            s = put_block<S>(q, part, job.lbase + src, lkey{job.lkey}, raddr, rkey{job.rkey},
                             size, sig, budget);
        } else if (!part) {
            break;
        } else if (scope == 1) {
            s = put_warp<S>(q, job.lbase + src, lkey{job.lkey}, raddr, rkey{job.rkey}, size, sig,
                            budget);
        } else {
            // Thread scope: `batch` WQEs per doorbell; a thread's last WQE of a counted run
            // always rings (after a run of a duration, the final quiet rings what is left).
            const bool last = d.ctl == nullptr && i + W >= d.iters;
            const bool ring_now = last || (r + 1) % batch == 0;
            s = inl ? put_inline<S>(q, job.src_dev + src, size, raddr, rkey{job.rkey}, sig, budget,
                                    ring_now)
                    : put<S>(q, job.lbase + src, lkey{job.lkey}, raddr, rkey{job.rkey}, size, sig,
                             budget, ring_now);
        }
        if (s != OK) break;
    }
    return s;
}

}  // namespace samples

// put_bw: every thread of the grid is a worker of one job (QP). CTA c drives job c % njobs;
// worker w of a job posts the job's iterations w, w + W, w + 2W, ... (W = job.workers), each an
// RDMA WRITE of `size` bytes from source slot (i + shift) % src_slots to destination slot
// i % dst_slots. Scope 0 (thread): put() with `batch` WQEs per doorbell; 1 (warp): put_warp, one
// doorbell per warp call; 2 (block): put_block, one doorbell per block call. One WQE in about
// `sig_calls` calls of each poster asks for a CQE. `inl` (thread scope): put_inline from the
// source slot at `src_dev`. With `ctl` (-D, see duration_ctl) the run lasts `duration_ns`
// instead of `iters` iterations. After the loop one thread per CTA calls quiet. `times[2c]`,
// `times[2c+1]`: %globaltimer at the CTA's start and after its quiet.
GPUVERBS_KERNEL void gv_sample_put_bw(const samples::bw_job* jobs, uint32_t njobs, uint32_t size,
                                      uint32_t iters, uint32_t scope, uint32_t batch,
                                      uint32_t sig_calls, uint32_t inl,
                                      unsigned long long* ctl, uint64_t duration_ns,
                                      uint64_t budget, int* out, uint64_t* times) {
    using namespace gpuverbs;
    const uint32_t j = blockIdx.x % njobs;
    const samples::bw_job job = jobs[j];
    gpuverbs_qp* q = job.qp;
    const uint32_t w = (blockIdx.x / njobs) * blockDim.x + threadIdx.x;
    // One thread alone on its QP owns it: no atomics needed.
    const bool exclusive = job.workers == 1;
    if (batch == 0) batch = 1;
    if (sig_calls == 0) sig_calls = 1;
    __syncthreads();
    if (threadIdx.x == 0) times[2 * blockIdx.x] = now_ns();
    const samples::duration_ctl d(ctl, duration_ns, iters);
    const bool in = inl != 0 && scope == 0;
    status s = exclusive ? samples::bw_loop<sharing::exclusive>(q, job, w, size, d, scope, batch,
                                                                sig_calls, in, budget)
                         : samples::bw_loop<sharing::gpu>(q, job, w, size, d, scope, batch,
                                                          sig_calls, in, budget);
    error e{};
    if (s != OK) e = last_error(q);
    samples::report(out, s, e, (int)j);
    __syncthreads();
    if (threadIdx.x == 0) {
        s = exclusive ? quiet<sharing::exclusive>(q, budget, &e) : quiet<sharing::gpu>(q, budget, &e);
        samples::report(out, s, e, (int)j);
        times[2 * blockIdx.x + 1] = now_ns();
    }
}

namespace samples {
// The word atomic job `j` starts from (`gpuverbs_samples::bw::atomic_base`).
GPUVERBS_DEVICE uint64_t atomic_base(uint64_t j) {
    return 0x0123456700000000ull ^ ((j + 1) << 40);
}
// Most `outs` gv_sample_verb_bw takes (the tickets of the WQEs in flight, one per slot).
constexpr uint32_t MAX_OUTS = 256;
}  // namespace samples

namespace samples {
// One warp call of the warp-scope verb loop: this lane's WQE of iteration `i` (READ 1, FETCH_AND_ADD
// 3, CMP_AND_SWAP 4, as gv_sample_verb_bw's thread loop posts them), signaled.
GPUVERBS_DEVICE gpuverbs::status verb_warp_call(gpuverbs_qp* q, const bw_job& job, uint32_t verb,
                                                uint32_t size, uint64_t i, uint64_t base,
                                                uint64_t budget) {
    using namespace gpuverbs;
    const uint64_t src = ((i + job.src_shift) % job.src_slots) * size;
    const uint64_t dst = (i % job.dst_slots) * size;
    const uint64_t result = job.lbase + i % job.dst_slots * 8;
    switch (verb) {
        case 1:
            return get_warp(q, job.lbase + dst, lkey{job.lkey}, job.rbase + src, rkey{job.rkey},
                            size, true, budget);
        case 3:
            return atomic_fetch_add_warp(q, job.rbase, rkey{job.rkey}, 1, result, lkey{job.lkey},
                                         budget);
        case 4:
            return atomic_compare_swap_warp(q, job.rbase, rkey{job.rkey}, base + i, base + i + 1,
                                            result, lkey{job.lkey}, budget);
        default:
            return INVALID;
    }
}

// The warp-scope verb loop (READ and atomics): lane l posts iterations 32 r + l in call r, the
// lanes' WQEs in lane order under one reservation, one release and one doorbell, the last one
// signaled (so one CQE per call). `outs` counts WQEs in flight in whole calls: before call r the
// warp waits until call r - ceil(outs / 32) has completed (lane 0, whose iteration is the
// call's first, is in every call and keeps the tickets).
GPUVERBS_DEVICE gpuverbs::status verb_warp_loop(gpuverbs_qp* q, const bw_job& job, uint32_t verb,
                                                uint32_t size, const duration_ctl& d,
                                                uint32_t outs, uint64_t budget,
                                                gpuverbs::error* e) {
    using namespace gpuverbs;
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t calls_out = (outs + 31) / 32;
    uint64_t tickets[MAX_OUTS / 32];
    const uint64_t base = atomic_base(job.src_shift);
    status s = OK;
    for (uint64_t r = 0;; ++r) {
        const uint64_t i = r * 32 + lane;
        if (!d.go(i)) break;
        const uint32_t mask = __activemask();
        if (lane == 0 && calls_out != 0 && r >= calls_out) {
            s = wait_ticket(q, tickets[r % calls_out], budget, e);
        }
        s = (status)__shfl_sync(mask, (int)s, 0);
        if (s != OK) break;
        s = verb_warp_call(q, job, verb, size, i, base, budget);
        if (lane == 0 && calls_out != 0) tickets[r % calls_out] = state_load<sharing::gpu>(&q->sq_ready);
        if (s != OK) break;
    }
    return s;
}
}  // namespace samples

// read_bw, send_bw, atomic_bw: one thread (CTA `j`, thread 0) per job `j`, exclusive on its QP.
// `verb`: 1 READ (iteration i reads source slot (i + shift) % src_slots of the target, at
// `rbase`, into destination slot i % dst_slots at `lbase`), 2 SEND (source slot (i + shift) %
// src_slots at `lbase`; the receives are posted by the host), 3 FETCH_AND_ADD of 1 and 4
// CMP_AND_SWAP of atomic_base(shift) + i for + i + 1 on the target's word at `rbase`, the old
// value into result slot i % dst_slots (8 bytes each) at `lbase`. One WQE in `sig_calls` asks
// for a CQE (atomics: every one, as the device API posts them), and the last. `outs` (READ and
// atomics; 0: none): at most that many WQEs in flight; before WQE i the thread waits until WQE
// i - outs has completed (its ticket: `sq_ready` after its publish; sig_calls <= outs, so a
// signaled WQE at or after it is posted). `inl` (SEND): send_inline from the source slot at
// `src_dev`. `ctl`, `duration_ns` as gv_sample_put_bw's. `times[2j]`, `times[2j+1]`:
// %globaltimer at the start and after the final quiet. Every wait is bounded by `budget` ns.
// With 32 threads per CTA (warp scope; READ and atomics), the CTA's warp posts instead
// (samples::verb_warp_loop) and its lane 0 quiets.
GPUVERBS_KERNEL void gv_sample_verb_bw(const samples::bw_job* jobs, uint32_t njobs, uint32_t verb,
                                       uint32_t size, uint32_t iters, uint32_t sig_calls,
                                       uint32_t outs, uint32_t inl, unsigned long long* ctl,
                                       uint64_t duration_ns, uint64_t budget, int* out,
                                       uint64_t* times) {
    using namespace gpuverbs;
    if (blockIdx.x >= njobs) return;
    if (blockDim.x == 32) {
        const uint32_t j = blockIdx.x;
        if (threadIdx.x == 0) times[2 * j] = now_ns();
        __syncwarp();
        const samples::duration_ctl d(ctl, duration_ns, iters);
        error e{};
        status s = samples::verb_warp_loop(jobs[j].qp, jobs[j], verb, size, d,
                                           outs > samples::MAX_OUTS ? samples::MAX_OUTS : outs,
                                           budget, &e);
        if (s == ERROR_CQE) e = last_error(jobs[j].qp);
        samples::report(out, s, e, (int)j);
        __syncwarp();
        if (threadIdx.x == 0) {
            s = quiet(jobs[j].qp, budget, &e);
            samples::report(out, s, e, (int)j);
            times[2 * j + 1] = now_ns();
        }
        return;
    }
    if (threadIdx.x != 0) return;
    const uint32_t j = blockIdx.x;
    const samples::bw_job job = jobs[j];
    gpuverbs_qp* q = job.qp;
    if (sig_calls == 0) sig_calls = 1;
    if (outs > samples::MAX_OUTS) outs = samples::MAX_OUTS;
    uint64_t tickets[samples::MAX_OUTS];
    const uint64_t base = samples::atomic_base(job.src_shift);
    times[2 * j] = now_ns();
    const samples::duration_ctl d(ctl, duration_ns, iters);
    status s = OK;
    error e{};
    for (uint32_t i = 0; s == OK && d.go(i); ++i) {
        if (outs != 0 && i >= outs) {
            s = wait_ticket<sharing::exclusive>(q, tickets[i % outs], budget, &e);
            if (s != OK) break;
        }
        const bool sig = (i + 1) % sig_calls == 0 || i + 1 == iters;
        const uint64_t src = ((uint64_t)(i + job.src_shift) % job.src_slots) * size;
        const uint64_t dst = ((uint64_t)i % job.dst_slots) * size;
        switch (verb) {
            case 1:
                s = get<sharing::exclusive>(q, job.lbase + dst, lkey{job.lkey}, job.rbase + src,
                                            rkey{job.rkey}, size, sig, budget);
                break;
            case 2:
                s = inl ? send_inline<sharing::exclusive>(q, job.src_dev + src, size, false, 0,
                                                          sig, budget)
                        : send<sharing::exclusive>(q, job.lbase + src, lkey{job.lkey}, size,
                                                   false, 0, sig, budget);
                break;
            case 3:
                s = atomic_fetch_add<sharing::exclusive>(q, job.rbase, rkey{job.rkey}, 1,
                                                         job.lbase + (uint64_t)i % job.dst_slots * 8,
                                                         lkey{job.lkey}, budget);
                break;
            case 4:
                s = atomic_compare_swap<sharing::exclusive>(
                    q, job.rbase, rkey{job.rkey}, base + i, base + i + 1,
                    job.lbase + (uint64_t)i % job.dst_slots * 8, lkey{job.lkey}, budget);
                break;
            default:
                s = INVALID;
        }
        if (outs != 0) tickets[i % outs] = state_load<sharing::exclusive>(&q->sq_ready);
    }
    if (s == ERROR_CQE) e = last_error(q);
    samples::report(out, s, e, (int)j);
    s = quiet<sharing::exclusive>(q, budget, &e);
    samples::report(out, s, e, (int)j);
    times[2 * j + 1] = now_ns();
}

// write_lat, read_lat, send_lat, atomic_lat. WRITE and SEND: in loopback (`in_turn`, one
// block, first 0) one thread drives both sides in turn — A sends, B takes and answers, A takes —
// as the CPU initiator's one thread does, so nothing else on this GPU polls while a side posts;
// across processes one block per process drives its own side (first: its side). READ and
// atomics: one block, side A's (side B's NIC answers). Each side's QP is exclusive to its
// thread. `verb` as gv_sample_verb_bw's, 0 WRITE. The lat_side fields mean, per verb:
// - 0 WRITE (both sides): write `size` bytes from `src_nic` (lkey; the kernel writes the tail
//   k+1 into the last `tail_len` bytes at `src_dev` first) to the peer's `dst_remote` (rkey);
//   the peer waits until the word at its `recv_dev` (the aligned 8 bytes that end its receive
//   buffer) shows the tail, or with `use_signal` until its signal word at `sig_dev` reaches
//   k+1 (each write then followed by an add of 1 on the peer's `sig_remote`, sig_rkey), and
//   answers the same way;
// - 1 READ (side A only): READ `size` bytes from `dst_remote` (rkey) into `src_nic` (lkey);
// - 2 SEND (both sides): SEND `size` bytes from `src_nic` (lkey; tail as WRITE's), receives
//   into `dst_remote` (its NIC address) with `rkey` (its lkey); each side posts one receive
//   ahead and, after taking a receive, the next (none after the last);
// - 3 FETCH_AND_ADD of 1 / 4 CMP_AND_SWAP of atomic_base(0) + k for + k + 1 (side A only) on
//   the peer's word `sig_remote` (sig_rkey); the old value lands in `dst_remote` (lkey `rkey`),
//   which the kernel reads at `recv_dev` after the completion and compares with
//   atomic_base(0) + k.
// With `use_inline` a WRITE or SEND carries its payload in the WQE (put_inline / send_inline
// from a copy of the `size` <= MAX_LAT_INLINE bytes at `src_dev` in shared memory, taken at the
// start; the tails are written there). WRITE and SEND with a count (no -D): each end
// prepares its next message before it waits for the peer's — tail, WQEs posted without a ring,
// `release_ahead` — and rings once the peer's message is in, so a round trip holds two
// doorbells, two NIC passes and two waits, as a ping-pong whose messages are known in advance
// can be run; with -D each message is prepared after the wait (see `ahead`). A times each
// iteration with %globaltimer into rtt[k]: WRITE and SEND from its doorbell to the answer (its
// bytes, signal or receive completion), READ and atomics from the post to the completion
// (quiet). out[5]: receives with a wrong byte count or fetched values
// that differ; out[6]: the first such iteration. One WRITE or SEND in `cq_mod` asks for a CQE
// (and the last). Every wait is bounded by `budget` ns.
// With `duration_ns` (-D) `iters` is the warm-up: after it a timed part runs until
// `duration_ns` has passed on this side's clock (lat_clock), rtt[] is not written, and
// counts[4i ..] get side i's messages sent (WRITEs or SENDs, one-sided operations), timed
// round trips and their span in ns (i: the side's index in `sides`).
GPUVERBS_KERNEL void gv_sample_verb_lat(const samples::lat_side* sides, uint32_t first,
                                        uint32_t in_turn, uint32_t verb, uint32_t size,
                                        uint32_t tail_len, uint32_t iters, uint32_t cq_mod,
                                        uint32_t use_signal, uint32_t use_inline,
                                        uint64_t duration_ns, unsigned long long* counts,
                                        uint64_t budget, int* out, uint64_t* rtt) {
    using namespace gpuverbs;
    const int me = (int)(blockIdx.x + first);
    if (threadIdx.x != 0 || me > 1) return;
    const bool both = verb == 0 || verb == 2;
    if (!both && me != 0) return;
    if (in_turn && !(both && me == 0 && gridDim.x == 1)) {
        samples::report(out, INVALID, error{}, me);
        return;
    }
    // The ends this thread drives: `a` (side `me`) and, in turn, `b` (side B). Each works on
    // a register copy of its descriptor (checkout), stored back when the kernel ends
    // (checkin), the fastest path for a loop that owns its QP.
    samples::lat_end a(sides[blockIdx.x], me);
    samples::lat_end b(sides[in_turn ? 1 : blockIdx.x], 1);
    status s = checkout(a.side.qp, &a.q);
    if (s == OK && in_turn) {
        s = checkout(b.side.qp, &b.q);
        if (s != OK) checkin(a.side.qp, a.q);
    }
    if (s != OK) {
        samples::report(out, s, error{}, me);
        return;
    }
    if (cq_mod == 0) cq_mod = 1;
    samples::lat_clock clk(duration_ns, iters);
    uint64_t timed = 0;
    error e{};
    int bad = 0;
    int first_bad = -1;
    int who = me;  // the side whose call returned the status that ends the loop
    auto mismatch = [&](uint32_t k) {
        if (bad == 0) first_bad = (int)k;
        bad += 1;
    };
    // Inline messages are built from a copy of the payload in shared memory, taken once: the
    // kernel writes each message's tail there, and the WQE's bytes come from there, not back
    // across PCIe from a host-memory source (which the NIC does not read for them).
    __shared__ uint4 stage_words[2][samples::MAX_LAT_INLINE / 16];
    if (both && use_inline) {
        if (size > samples::MAX_LAT_INLINE) s = INVALID;
        a.stage = reinterpret_cast<uint8_t*>(stage_words[0]);
        b.stage = reinterpret_cast<uint8_t*>(stage_words[1]);
        for (uint32_t i = 0; s == OK && i < size; ++i) {
            a.stage[i] = reinterpret_cast<const uint8_t*>(a.side.src_dev)[i];
            if (in_turn) b.stage[i] = reinterpret_cast<const uint8_t*>(b.side.src_dev)[i];
        }
    }
    if (both) {
        const uint64_t mask = samples::tail_mask(tail_len);
        const uint32_t shift = 64 - 8 * tail_len;  // the tail is the top bytes of the word
        // End x waits for its peer's message k+1 (with -D at most until the duration ends).
        auto take = [&](samples::lat_end& x, uint64_t k1) -> status {
            who = x.id;
            const uint64_t wb = clk.wait(budget);
            if (verb == 0 && use_signal) {
                return wait_signal(reinterpret_cast<const uint64_t*>(x.side.sig_dev), k1, wb);
            }
            if (verb == 0) {
                const uint64_t* recv_word = reinterpret_cast<const uint64_t*>(x.side.recv_dev);
                const uint64_t want = k1 & mask;
                const uint64_t deadline = now_ns() + wb;
                while (((ld_acquire_sys64(recv_word) >> shift) & mask) != want) {
                    if (now_ns() > deadline) return TIMEOUT;
                }
                return OK;
            }
            recv_completion rc;
            status r = recv_wait<sharing::exclusive>(&x.q, &rc, wb, &e);
            if (r != OK) return r;
            if (rc.byte_count != size) mismatch((uint32_t)k1 - 1);
            if (duration_ns != 0 || k1 < iters) {
                r = post_recv<sharing::exclusive>(&x.q, x.side.dst_remote, lkey{x.side.rkey},
                                                  size, budget);
            }
            return r;
        };
        // End x posts message k+1: writes its tail and posts it; with `now` it rings, else it
        // releases it to the NIC's scope (release_ahead: the fence a ring would make), so that
        // sending it later (`fire`) is the doorbell stores alone.
        auto post_msg = [&](samples::lat_end& x, uint64_t k1, bool now) -> status {
            who = x.id;
            // Message k+1 goes from copy (k+1) % 2 of the source: the NIC may still be reading
            // message k's when its WQE is prepared (the peer's answer to k-1 says only that
            // k-1's copy is free). Inline payloads go into the WQE at once.
            const uint64_t copy = (k1 & 1) ? x.side.src_stride : 0;
            uint8_t* const payload =
                use_inline ? x.stage : reinterpret_cast<uint8_t*>(x.side.src_dev + copy);
            const uint64_t src_nic = x.side.src_nic + copy;
            uint8_t* tail_dst = payload + size - tail_len;
            for (uint32_t i = 0; i < tail_len; ++i) tail_dst[i] = (uint8_t)(k1 >> (8 * i));
            // The ring's release (or release_ahead's) orders the tail for the NIC only when it
            // is at system scope; with GPU-resident rings it is GPU-scope, and a source in host
            // memory needs its own.
            if (!use_inline && !sys_release(x.q)) __threadfence_system();
            const bool sig = k1 % cq_mod == 0 || k1 == iters;
            const samples::lat_side& d = x.side;
            gpuverbs_qp* const q = &x.q;
            status r;
            if (verb == 2) {
                r = use_inline ? send_inline<sharing::exclusive>(q, payload, size, false, 0, sig,
                                                                 budget, now)
                               : send<sharing::exclusive>(q, src_nic, lkey{d.lkey}, size, false, 0,
                                                          sig, budget, now);
            } else if (use_inline) {
                r = put_inline<sharing::exclusive>(q, payload, size, d.dst_remote, rkey{d.rkey},
                                                   sig && !use_signal, budget, now);
                if (r == OK && use_signal) {
                    r = signal<sharing::exclusive>(q, d.sig_remote, rkey{d.sig_rkey}, 1, sig,
                                                   budget, now);
                }
            } else if (use_signal) {
                r = put_signal<sharing::exclusive>(q, src_nic, lkey{d.lkey}, d.dst_remote,
                                                   rkey{d.rkey}, size, d.sig_remote,
                                                   rkey{d.sig_rkey}, 1, sig, budget, now);
            } else {
                r = put<sharing::exclusive>(q, src_nic, lkey{d.lkey}, d.dst_remote,
                                            rkey{d.rkey}, size, sig, budget, now);
            }
            if (r == OK && now) x.sent += 1;
            // The tail's stores (a source in host or GPU memory the NIC reads) and the WQEs.
            if (r == OK && !now) r = release_ahead<sharing::exclusive>(q, &x.ahead);
            return r;
        };
        // End x sends its prepared message.
        auto fire = [&](samples::lat_end& x) -> status {
            who = x.id;
            const status r = ring<sharing::exclusive>(&x.q, budget, x.ahead);
            if (r == OK) x.sent += 1;
            return r;
        };
        // With a count (no -D) every message is known to be sent, so each end prepares its
        // next one before it waits for the peer's (off the round trip, which then holds the
        // doorbell alone); with -D an end learns only after its wait whether it answers, so
        // it prepares then (a prepared message would otherwise go out after the test).
        // BlueFlame: the doorbell copies the WQE and fences itself, so releasing ahead saves
        // nothing there, and a ring after it would read the WQE back from the ring.
        const bool ahead = duration_ns == 0 && a.q.db_mode != GPUVERBS_DB_BLUEFLAME;
        auto prepare = [&](samples::lat_end& x, uint64_t k1) { return post_msg(x, k1, false); };
        auto answer = [&](samples::lat_end& x, uint64_t k1) {
            return ahead ? fire(x) : post_msg(x, k1, true);
        };
        if (verb == 2 && iters > 0) {
            s = post_recv<sharing::exclusive>(&a.q, a.side.dst_remote, lkey{a.side.rkey}, size,
                                              budget);
            if (s == OK && in_turn) {
                s = post_recv<sharing::exclusive>(&b.q, b.side.dst_remote, lkey{b.side.rkey},
                                                  size, budget);
            }
        }
        if (s == OK && ahead && me == 0 && iters > 0) s = prepare(a, 1);
        for (uint64_t k = 0; s == OK && clk.go(k); ++k) {
            const uint64_t k1 = k + 1;
            if (me == 0) {
                const uint64_t t0 = now_ns();
                s = answer(a, k1);
                if (s == OK && in_turn && ahead) s = prepare(b, k1);
                if (s == OK && in_turn) s = take(b, k1);
                if (s == OK && in_turn) s = answer(b, k1);
                if (s == OK && ahead && k1 < iters) s = prepare(a, k1 + 1);
                if (s == OK) s = take(a, k1);
                if (clk.ended(s)) {
                    s = OK;  // the duration is over: this iteration is not counted
                    break;
                }
                clk.done(k, &timed);
                if (k < iters && duration_ns == 0) rtt[k] = now_ns() - t0;
            } else {
                if (ahead) s = prepare(a, k1);
                if (s == OK) s = take(a, k1);
                if (clk.ended(s)) {
                    s = OK;  // the duration is over: this iteration is not counted
                    break;
                }
                if (s == OK) s = answer(a, k1);
            }
        }
    } else {
        const uint64_t base = samples::atomic_base(0);
        const uint64_t* fetched = reinterpret_cast<const uint64_t*>(a.side.recv_dev);
        gpuverbs_qp* const q = &a.q;
        const samples::lat_side& d = a.side;
        for (uint64_t k = 0; s == OK && clk.go(k); ++k) {
            const uint64_t t0 = now_ns();
            switch (verb) {
                case 1:
                    s = get<sharing::exclusive>(q, d.src_nic, lkey{d.lkey}, d.dst_remote,
                                                rkey{d.rkey}, size, true, budget);
                    break;
                case 3:
                    s = atomic_fetch_add<sharing::exclusive>(q, d.sig_remote, rkey{d.sig_rkey}, 1,
                                                             d.dst_remote, lkey{d.rkey}, budget);
                    break;
                case 4:
                    s = atomic_compare_swap<sharing::exclusive>(
                        q, d.sig_remote, rkey{d.sig_rkey}, base + k, base + k + 1, d.dst_remote,
                        lkey{d.rkey}, budget);
                    break;
                default:
                    s = INVALID;
            }
            if (s == OK) a.sent += 1;
            if (s == OK) s = quiet<sharing::exclusive>(q, budget, &e);
            if (s == OK) clk.done(k, &timed);
            if (k < iters && duration_ns == 0) rtt[k] = now_ns() - t0;
            if (s == OK && verb != 1 && ld_acquire_sys64(fetched) != base + k) {
                mismatch((uint32_t)k);
            }
        }
    }
    if (duration_ns != 0) {
        counts[4 * blockIdx.x] = a.sent;
        counts[4 * blockIdx.x + 1] = timed;
        counts[4 * blockIdx.x + 2] = clk.span();
        if (in_turn) counts[4] = b.sent;
    }
    // The status that ended the loop names the side whose call returned it; then each end
    // waits for its WQEs and hands its QP back.
    if (s == ERROR_CQE) e = last_error(who == a.id ? &a.q : &b.q);
    samples::report(out, s, e, who);
    s = quiet<sharing::exclusive>(&a.q, budget, &e);
    checkin(a.side.qp, a.q);
    samples::report(out, s, e, me);
    if (in_turn) {
        s = quiet<sharing::exclusive>(&b.q, budget, &e);
        checkin(b.side.qp, b.q);
        samples::report(out, s, e, 1);
    }
    if (bad != 0) {
        atomicAdd(&out[5], bad);
        atomicCAS(&out[6], 0, first_bad);
    }
}

// echo: a persistent kernel (one thread, exclusive) that answers every message it receives
// with the same bytes, without the CPU: `slots` receive buffers of `slot` bytes each (slot i at
// `buf_nic + i * slot`), one receive posted per buffer; each receive completion (SEND, SEND_IMM or WRITE_IMM of the peer) is answered by
// a SEND of the bytes the buffer holds (for a WRITE_IMM, `byte_count` bytes of the slot the
// immediate names), whose completion is taken before the buffer is posted again. Runs until
// `*stop` is non-zero; the wait for a message is bounded by `budget` ns (running out only
// makes the loop look at `*stop` again), every other call by `op_budget` ns. out[0]: messages echoed; out[1]: bytes echoed; out[2]: the
// status that ended the loop (0 when stopped); out[3..5]: an error CQE's syndrome, vendor
// syndrome and WQE counter. `ready` (may be null) is set to 1 once every receive is posted
// (the two-process server tells its client to start only then).
GPUVERBS_DEVICE void echo_serve(gpuverbs_qp* q, uint64_t buf_nic, uint32_t lk, uint32_t slot,
                                uint32_t slots, const volatile uint32_t* stop, uint64_t budget,
                                uint64_t op_budget, unsigned long long* out,
                                unsigned long long* ready) {
    using namespace gpuverbs;
    status s = OK;
    error e{};
    for (uint32_t i = 0; i < slots && s == OK; ++i) {
        s = post_recv<sharing::exclusive>(q, buf_nic + (uint64_t)i * slot, lkey{lk}, slot,
                                          op_budget);
    }
    if (s == OK && ready != nullptr) {
        __threadfence_system();
        *reinterpret_cast<volatile unsigned long long*>(ready) = 1;
        __threadfence_system();
    }
    unsigned long long n = 0, bytes = 0;
    uint64_t posted = slots;  // receives posted so far; receive k used slot k % slots
    uint64_t taken = 0;
    while (s == OK && *stop == 0) {
        recv_completion rc;
        const status r = recv_wait<sharing::exclusive>(q, &rc, budget, &e);
        if (r == TIMEOUT) continue;
        if (r != OK) {
            s = r;
            break;
        }
        const uint32_t i = (uint32_t)(rc.opcode == CQE_RESP_WR_IMM ? rc.imm % slots : taken % slots);
        taken += 1;
        const uint32_t len = rc.byte_count < slot ? rc.byte_count : slot;
        s = send<sharing::exclusive>(q, buf_nic + (uint64_t)i * slot, lkey{lk}, len, false, 0,
                                     true, op_budget);
        if (s == OK) s = quiet<sharing::exclusive>(q, op_budget, &e);
        if (s == OK) {
            s = post_recv<sharing::exclusive>(q, buf_nic + (uint64_t)(posted % slots) * slot,
                                              lkey{lk}, slot, op_budget);
            posted += 1;
        }
        if (s == OK) {
            n += 1;
            bytes += len;
            reinterpret_cast<volatile unsigned long long*>(out)[0] = n;
            reinterpret_cast<volatile unsigned long long*>(out)[1] = bytes;
        }
    }
    if (s == ERROR_CQE) e = last_error(q);
    out[2] = (unsigned long long)s;
    out[3] = e.syndrome;
    out[4] = e.vendor;
    out[5] = e.wqe_counter;
    __threadfence_system();
}

GPUVERBS_KERNEL void gv_sample_echo(gpuverbs_qp* q, uint64_t buf_nic, uint32_t lk, uint32_t slot,
                                    uint32_t slots, const volatile uint32_t* stop,
                                    uint64_t budget, uint64_t op_budget,
                                    unsigned long long* out, unsigned long long* ready) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    echo_serve(q, buf_nic, lk, slot, slots, stop, budget, op_budget, out, ready);
}

// echo with a GPU client: block 0 (thread 0) serves as gv_sample_echo does; block 1 is the
// client, exclusive on the client QP: its threads write each message's pattern into `src`
// (byte i of message k is (i * 31 ^ k * 2654435761) | 1) and zero `back`, eight bytes a store
// and a warp's stores side by side, then thread 0 posts a receive at `back`, SENDs `size`
// bytes from `src`, waits for the answer, records the round trip in rtt[k] (%globaltimer, from
// the send's post to the receive completion) and takes its send's completion, each call within
// `client_budget` ns; then every thread checks its part of the answer. After `iters` messages
// (or the first failure) thread 0 sets *stop. out[6]: the client's status, out[7]: bytes that
// differed, out[8]: an error CQE's syndrome. Launch with two blocks; the blocks may have any
// number of threads (the buffers are page aligned).
// Byte i of the GPU client's message k.
GPUVERBS_DEVICE uint8_t echo_byte(uint32_t i, uint32_t k) {
    return (uint8_t)((i * 31u ^ k * 2654435761u) | 1u);
}

// Eight pattern bytes of message k from byte i on.
GPUVERBS_DEVICE uint64_t echo_word(uint32_t i, uint32_t k) {
    uint64_t v = 0;
    for (uint32_t b = 0; b < 8; ++b) v |= (uint64_t)echo_byte(i + b, k) << (8 * b);
    return v;
}

// The GPU client of echo (one block, exclusive on `qc`), as the comment above says: `iters`
// messages, each answered and checked. cout[0]: its status, cout[1]: bytes that differed,
// cout[2]: an error CQE's syndrome. Sets *stop afterwards when `stop` is not null.
GPUVERBS_DEVICE void echo_client(gpuverbs_qp* qc, uint64_t src_nic, uint8_t* src_dev,
                                 uint32_t src_lk, uint64_t back_nic, const uint8_t* back_dev,
                                 uint32_t back_lk, uint32_t size, uint32_t iters,
                                 volatile uint32_t* stop, uint64_t client_budget,
                                 unsigned long long* cout, uint64_t* rtt) {
    using namespace gpuverbs;
    __shared__ int shared_status;
    __shared__ unsigned long long bad;
    __shared__ error e;
    const uint32_t t = threadIdx.x, n = blockDim.x;
    if (t == 0) {
        shared_status = OK;
        bad = 0;
        e = error{};
    }
    __syncthreads();
    volatile uint8_t* back = const_cast<volatile uint8_t*>(back_dev);
    const uint32_t words = size / 8;
    for (uint32_t k = 0; k < iters; ++k) {
        if (shared_status != OK) break;
        for (uint32_t w = t; w < words; w += n) {
            reinterpret_cast<uint64_t*>(src_dev)[w] = echo_word(8 * w, k);
            reinterpret_cast<volatile uint64_t*>(back)[w] = 0;
        }
        if (t == 0) {
            for (uint32_t b = 8 * words; b < size; ++b) {
                src_dev[b] = echo_byte(b, k);
                back[b] = 0;
            }
        }
        __syncthreads();
        if (t == 0) {
            status s = post_recv<sharing::exclusive>(qc, back_nic, lkey{back_lk}, size,
                                                     client_budget);
            const uint64_t t0 = now_ns();
            if (s == OK) {
                s = send<sharing::exclusive>(qc, src_nic, lkey{src_lk}, size, false, 0, true,
                                             client_budget);
            }
            recv_completion rc;
            if (s == OK) s = recv_wait<sharing::exclusive>(qc, &rc, client_budget, &e);
            rtt[k] = now_ns() - t0;
            if (s == OK) s = quiet<sharing::exclusive>(qc, client_budget, &e);
            shared_status = s;
        }
        __syncthreads();
        if (shared_status != OK) break;
        unsigned long long mine = 0;
        for (uint32_t w = t; w < words; w += n) {
            const uint64_t got = reinterpret_cast<const volatile uint64_t*>(back)[w];
            const uint64_t want = echo_word(8 * w, k);
            for (uint32_t b = 0; b < 8; ++b) {
                mine += ((got >> (8 * b)) & 0xff) != ((want >> (8 * b)) & 0xff);
            }
        }
        if (t == 0) {
            for (uint32_t b = 8 * words; b < size; ++b) mine += back[b] != echo_byte(b, k);
        }
        if (mine != 0) atomicAdd(&bad, mine);
        // the next message's stores must not overtake this message's checks
        __syncthreads();
    }
    __syncthreads();
    if (t != 0) return;
    status s = (status)shared_status;
    if (s == ERROR_CQE) e = last_error(qc);
    cout[0] = (unsigned long long)s;
    cout[1] = bad;
    cout[2] = e.syndrome;
    __threadfence_system();
    if (stop != nullptr) {
        *stop = 1;
        __threadfence_system();
    }
}

GPUVERBS_KERNEL void gv_sample_echo_gpu(gpuverbs_qp* qs, uint64_t sbuf_nic, uint32_t slk,
                                        uint32_t slot, uint32_t slots, gpuverbs_qp* qc,
                                        uint64_t src_nic, uint8_t* src_dev, uint32_t src_lk,
                                        uint64_t back_nic, const uint8_t* back_dev,
                                        uint32_t back_lk, uint32_t size, uint32_t iters,
                                        volatile uint32_t* stop, uint64_t budget,
                                        uint64_t client_budget, unsigned long long* out,
                                        uint64_t* rtt) {
    if (blockIdx.x > 1) return;
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0) {
            echo_serve(qs, sbuf_nic, slk, slot, slots, stop, budget, client_budget, out,
                       nullptr);
        }
        return;
    }
    echo_client(qc, src_nic, src_dev, src_lk, back_nic, back_dev, back_lk, size, iters, stop,
                client_budget, out + 6, rtt);
}

// echo's client alone (two processes: the server's kernel is in the other one): one block,
// any number of threads; out[0..2] as echo_client's cout. The host tells the server to stop.
GPUVERBS_KERNEL void gv_sample_echo_client(gpuverbs_qp* qc, uint64_t src_nic, uint8_t* src_dev,
                                           uint32_t src_lk, uint64_t back_nic,
                                           const uint8_t* back_dev, uint32_t back_lk,
                                           uint32_t size, uint32_t iters,
                                           uint64_t client_budget, unsigned long long* out,
                                           uint64_t* rtt) {
    if (blockIdx.x != 0) return;
    echo_client(qc, src_nic, src_dev, src_lk, back_nic, back_dev, back_lk, size, iters, nullptr,
                client_budget, out, rtt);
}

// kv_transfer: block 0 (one thread, exclusive) sends a list of KV-cache blocks to the peer,
// `batch` blocks at a time: block j of the list goes from source block src_idx[j]
// (`src_nic + src_idx[j] * bsize`) to destination block dst_idx[j] (`dst_remote + dst_idx[j] *
// bsize`, non-contiguous), unsignaled puts, then one signal per batch (a fetch-add of 1 on the
// receiver's signal word; the RC responder runs it after the batch's writes). Block 1 (one
// thread) is the receiver: for batch b it waits until the signal word reaches b + 1, then
// checks every 8-byte word of the batch's destination blocks against the pattern the host
// wrote into the sources (word w of source block s holds `kv_word(s, w)`). Every wait is bounded
// by `budget` ns. out[0]: the sender's status, out[1]: the receiver's, out[2]: words that
// differ, out[3]: the first batch that did, out[4], out[5]: the sender's start and end
// (%globaltimer), out[6]: the receiver's end.
GPUVERBS_DEVICE uint64_t kv_word(uint32_t block, uint32_t word) {
    return ((uint64_t)block << 32 | word) * 0x9E3779B97F4A7C15ull;
}

// One side of kv_transfer: `role` 0 sends (block 0's part), 1 receives (block 1's part).
GPUVERBS_DEVICE void kv_side(uint32_t role, gpuverbs_qp* q, uint64_t src_nic, uint32_t lk,
                             uint64_t dst_remote, uint32_t rk, uint64_t sig_remote,
                             uint32_t sig_rk, const uint64_t* sig_dev, const uint64_t* dst_dev,
                             const uint32_t* src_idx, const uint32_t* dst_idx, uint32_t nblocks,
                             uint32_t bsize, uint32_t batch, uint64_t budget,
                             unsigned long long* out) {
    using namespace gpuverbs;
    const uint32_t batches = (nblocks + batch - 1) / batch;
    if (role == 0) {
        status s = OK;
        out[4] = now_ns();
        for (uint32_t b = 0; b < batches && s == OK; ++b) {
            const uint32_t end = (b + 1) * batch < nblocks ? (b + 1) * batch : nblocks;
            for (uint32_t j = b * batch; j < end && s == OK; ++j) {
                s = put<sharing::exclusive>(q, src_nic + (uint64_t)src_idx[j] * bsize, lkey{lk},
                                            dst_remote + (uint64_t)dst_idx[j] * bsize,
                                            rkey{rk}, bsize, false, budget);
            }
            if (s == OK) {
                s = signal<sharing::exclusive>(q, sig_remote, rkey{sig_rk}, 1, true, budget);
            }
        }
        if (s == OK) s = quiet<sharing::exclusive>(q, budget);
        out[5] = now_ns();
        out[0] = (unsigned long long)s;
    } else {
        status s = OK;
        unsigned long long bad = 0, first_bad = ~0ull;
        const uint32_t words = bsize / 8;
        for (uint32_t b = 0; b < batches && s == OK; ++b) {
            s = wait_signal(sig_dev, (uint64_t)b + 1, budget);
            if (s != OK) break;
            const uint32_t end = (b + 1) * batch < nblocks ? (b + 1) * batch : nblocks;
            for (uint32_t j = b * batch; j < end; ++j) {
                const volatile uint64_t* d = dst_dev + (uint64_t)dst_idx[j] * words;
                for (uint32_t w = 0; w < words; ++w) {
                    if (d[w] != kv_word(src_idx[j], w)) {
                        bad += 1;
                        if (first_bad == ~0ull) first_bad = b;
                    }
                }
            }
        }
        out[6] = now_ns();
        out[1] = (unsigned long long)s;
        out[2] = bad;
        out[3] = first_bad;
    }
    __threadfence_system();
}

GPUVERBS_KERNEL void gv_sample_kv_transfer(gpuverbs_qp* q, uint64_t src_nic, uint32_t lk,
                                           uint64_t dst_remote, uint32_t rk, uint64_t sig_remote,
                                           uint32_t sig_rk, const uint64_t* sig_dev,
                                           const uint64_t* dst_dev, const uint32_t* src_idx,
                                           const uint32_t* dst_idx, uint32_t nblocks,
                                           uint32_t bsize, uint32_t batch, uint64_t budget,
                                           unsigned long long* out) {
    if (threadIdx.x != 0 || blockIdx.x > 1) return;
    kv_side(blockIdx.x, q, src_nic, lk, dst_remote, rk, sig_remote, sig_rk, sig_dev, dst_dev,
            src_idx, dst_idx, nblocks, bsize, batch, budget, out);
}

// kv_transfer as two processes: one side per launch (one block, one thread), `role` 0 the
// sender (q, src_nic, lk, dst_remote, rk, sig_remote, sig_rk used), 1 the receiver (sig_dev,
// dst_dev used); the index lists and out[] as gv_sample_kv_transfer's.
GPUVERBS_KERNEL void gv_sample_kv_one(gpuverbs_qp* q, uint64_t src_nic, uint32_t lk,
                                      uint64_t dst_remote, uint32_t rk, uint64_t sig_remote,
                                      uint32_t sig_rk, const uint64_t* sig_dev,
                                      const uint64_t* dst_dev, const uint32_t* src_idx,
                                      const uint32_t* dst_idx, uint32_t nblocks, uint32_t bsize,
                                      uint32_t batch, uint64_t budget, unsigned long long* out,
                                      uint32_t role) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    kv_side(role, q, src_nic, lk, dst_remote, rk, sig_remote, sig_rk, sig_dev, dst_dev, src_idx,
            dst_idx, nblocks, bsize, batch, budget, out);
}
