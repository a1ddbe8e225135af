// Kernels of the device-side benchmarks (samples/src/bin/gpu_bench.rs). Each records the
// earliest start and latest end (%globaltimer, ns) of any thread in t[0] / t[1].
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

namespace bench {

GPUVERBS_DEVICE void stamp_start(unsigned long long* t) {
    atomicMin(&t[0], (unsigned long long)gpuverbs::now_ns());
}

GPUVERBS_DEVICE void stamp_end(unsigned long long* t) {
    atomicMax(&t[1], (unsigned long long)gpuverbs::now_ns());
}

}  // namespace bench

// One benchmark step: a write of 8 bytes in the given scope (3: thread scope, put_inline of the
// 8 bytes from registers). Thread scope rings once per `batch` WQEs; warp and block scope ring
// once per call.
template <gpuverbs::sharing S>
GPUVERBS_DEVICE gpuverbs::status bench_step(gpuverbs_qp* q, uint32_t scope, uint32_t i,
                                            uint32_t iters, uint32_t batch, bool sig,
                                            uint64_t laddr, uint32_t lk, uint64_t raddr,
                                            uint32_t rk, uint64_t budget) {
    using namespace gpuverbs;
    if (scope == 2) return put_block<S>(q, true, laddr, lkey{lk}, raddr, rkey{rk}, 8, sig, budget);
    if (scope == 1) return put_warp<S>(q, laddr, lkey{lk}, raddr, rkey{rk}, 8, sig, budget);
    bool ring_now = batch <= 1 || (i + 1) % batch == 0 || i + 1 == iters;
    if (scope == 3) {
        const uint64_t payload = 0x1111111100000000ull | i;
        return put_inline<S>(q, &payload, 8, raddr, rkey{rk}, sig, budget, ring_now);
    }
    return put<S>(q, laddr, lkey{lk}, raddr, rkey{rk}, 8, sig, budget, ring_now);
}

// The timed part of gv_bench_post in sharing mode S: `iters` steps, then (post and complete)
// quiet by thread 0. With `checkout`, exclusive thread scope works on a register copy of the
// descriptor (checkout / checkin); otherwise every call goes through the descriptor.
template <gpuverbs::sharing S>
GPUVERBS_DEVICE gpuverbs::status bench_run(gpuverbs_qp* q, uint64_t laddr, uint32_t lk,
                                           uint64_t raddr, uint32_t rk, uint32_t iters,
                                           uint32_t scope, uint32_t batch,
                                           uint32_t signal_every, uint64_t budget,
                                           bool use_checkout) {
    using namespace gpuverbs;
    // Each call site passes one fixed descriptor, so the register copy stays in registers.
    auto steps = [&](gpuverbs_qp* on) {
        status s = OK;
        for (uint32_t i = 0; i < iters && s == OK; ++i) {
            bool sig = signal_every && (i + 1) % signal_every == 0;
            s = bench_step<S>(on, scope, i, iters, batch, sig, laddr, lk, raddr, rk, budget);
        }
        return s;
    };
    if (S == sharing::exclusive && (scope == 0 || scope == 3) && use_checkout) {
        gpuverbs_qp mine;
        status s = checkout(q, &mine);
        if (s != OK) return s;
        s = steps(&mine);
        if (s == OK && signal_every) s = quiet<S>(&mine, budget);
        checkin(q, mine);
        return s;
    }
    status s = steps(q);
    if (signal_every) {
        __syncthreads();
        if (s == OK && threadIdx.x == 0) s = quiet<S>(q, budget);
    }
    return s;
}

// Posts `iters` 8-byte writes per thread (scope 0 thread, 1 warp, 2 block, 3 thread inline). Block b drives
// QP qps[b % nqps]. `share` is the sharing mode: 0 gpu, 1 exclusive (no atomics: one thread,
// or with warp scope one warp, drives each QP), 2 cta (the QP's users are one block's threads),
// 3 exclusive on a checked-out copy (thread scope).
// With `signal_every` 0 nothing is signaled and nothing is awaited: post-only, for QPs not in
// RTS (the device executes nothing, so only the device-side cost of building and announcing
// WQEs is timed; the ring must hold the whole run). Otherwise every `signal_every`-th WQE is
// signaled and the block ends with quiet (post and complete).
GPUVERBS_KERNEL void gv_bench_post(const uint64_t* qps, uint32_t nqps, uint64_t laddr,
                                   uint32_t lk, uint64_t raddr, uint32_t rk, uint32_t iters,
                                   uint32_t scope, uint32_t batch, uint32_t signal_every,
                                   uint32_t share, uint64_t budget, unsigned long long* t,
                                   int* st_out) {
    using namespace gpuverbs;
    gpuverbs_qp* q = reinterpret_cast<gpuverbs_qp*>(qps[blockIdx.x % nqps]);
    __syncthreads();
    bench::stamp_start(t);
    const status s =
        share == 1 || share == 3
            ? bench_run<sharing::exclusive>(q, laddr, lk, raddr, rk, iters, scope, batch,
                                            signal_every, budget, share == 3)
        : share == 2 ? bench_run<sharing::cta>(q, laddr, lk, raddr, rk, iters, scope, batch,
                                               signal_every, budget, false)
                     : bench_run<sharing::gpu>(q, laddr, lk, raddr, rk, iters, scope, batch,
                                               signal_every, budget, false);
    bench::stamp_end(t);
    if (s != OK) atomicCAS(st_out, 0, (int)s);
}

// Counted puts (gpu_bench's `counters` series): every thread posts `iters` 8-byte writes to its
// own 8 bytes on QP `q` (sharing::gpu), then thread 0 of each block waits until the block's are
// all done. `kind` 0: put + poll (every put signaled, the wait is quiet, which polls the send
// CQ); 1: put_counted (a software counter per block, moved by the poll path; the wait is
// wait_counter, which polls); 2: put_counter (a counter per block moved by the NIC through the
// companion `cp`; the wait is wait_counter over both QPs). `ctr`: the counters' NIC address
// (key `ck`), `ctr_d`: the same words for loads (block b's at index b, zero at launch).
GPUVERBS_KERNEL void gv_bench_counter(gpuverbs_qp* q, gpuverbs_qp* cp, uint64_t laddr,
                                      uint32_t lk, uint64_t raddr, uint32_t rk, uint32_t iters,
                                      uint32_t kind, uint64_t ctr, uint32_t ck, uint64_t* ctr_d,
                                      uint64_t budget, unsigned long long* t, int* st_out) {
    using namespace gpuverbs;
    const uint64_t off = 8ull * (threadIdx.x + blockIdx.x * blockDim.x);
    uint64_t* mine = ctr_d + blockIdx.x;
    __syncthreads();
    bench::stamp_start(t);
    status s = OK;
    for (uint32_t i = 0; i < iters && s == OK; ++i) {
        if (kind == 2) {
            s = put_counter(q, laddr + off, lkey{lk}, raddr + off, rkey{rk}, 8, cp,
                            ctr + 8ull * blockIdx.x, rkey{ck}, 1, budget);
        } else if (kind == 1) {
            s = put_counted(q, laddr + off, lkey{lk}, raddr + off, rkey{rk}, 8, mine, budget);
        } else {
            s = put(q, laddr + off, lkey{lk}, raddr + off, rkey{rk}, 8, true, budget);
        }
    }
    if (s != OK) atomicCAS(st_out, 0, (int)s);
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint64_t all = (uint64_t)iters * blockDim.x;
        s = kind == 2   ? wait_counter(q, cp, mine, all, budget)
            : kind == 1 ? wait_counter(q, mine, all, budget)
                        : quiet(q, budget);
        if (s != OK) atomicCAS(st_out, 0, (int)s);
    }
    bench::stamp_end(t);
}

// Post-only QPs are never executed (they are not in RTS): marks every block posted so far
// retired, so that the next round of gv_bench_post reuses the ring. One thread per QP, between
// rounds (no kernel is posting).
GPUVERBS_KERNEL void gv_bench_recycle(const uint64_t* qps, uint32_t nqps) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nqps) return;
    gpuverbs_qp* q = reinterpret_cast<gpuverbs_qp*>(qps[i]);
    q->sq_retired = q->sq_ready;
    q->sq_signaled_end = q->sq_ready;
}

// The floor of one doorbell: a system-scope release fence and an 8-byte store to host memory,
// `iters` times, one thread.
GPUVERBS_KERNEL void gv_bench_fence_store(uint64_t* host_word, uint32_t iters,
                                          unsigned long long* t) {
    bench::stamp_start(t);
    for (uint32_t i = 0; i < iters; ++i) {
        asm volatile("fence.release.sys;" ::: "memory");
        gpuverbs::st_relaxed_sys64(host_word, i);
    }
    bench::stamp_end(t);
}

// What a put's doorbell costs beyond the floor: per iteration `units` 16-byte stores into a
// 64-byte slot of mapped host memory (slots cycle over 64), fence.release.sys, a 4-byte store
// (the doorbell record's place) and an 8-byte store (the doorbell's), one thread: a put on a
// checked-out copy without the building and the state. With `polled` (non-zero, two blocks)
// block 1 meanwhile loads a word of host memory in a loop (ld.acquire.sys, as a kernel waiting
// for a message does) — single-GPU loopback has such a poller while the other side posts. It
// writes `polled` to the word after it (its start) and polls until the word itself holds
// `polled` (block 0's stop, after its timed loop) or 1 s has passed; block 0 waits at most
// 10 ms for the start. The words are the 16 bytes after the slots.
GPUVERBS_KERNEL void gv_bench_fence_units(uint8_t* host, uint32_t units, uint32_t iters,
                                          uint64_t polled, unsigned long long* t) {
    uint64_t* word = reinterpret_cast<uint64_t*>(host + 64 + 64 * 64);
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 1) {
        gpuverbs::st_relaxed_sys64(word + 1, polled);
        const uint64_t give_up = gpuverbs::now_ns() + 1000000000;
        while (gpuverbs::ld_acquire_sys64(word) != polled && gpuverbs::now_ns() < give_up) {
        }
        return;
    }
    if (polled != 0) {
        const uint64_t give_up = gpuverbs::now_ns() + 10000000;
        while (gpuverbs::ld_acquire_sys64(word + 1) != polled && gpuverbs::now_ns() < give_up) {
        }
    }
    bench::stamp_start(t);
    for (uint32_t i = 0; i < iters; ++i) {
        uint8_t* slot = host + 64 + (size_t)(i % 64) * 64;
        for (uint32_t u = 0; u < units && u < 4; ++u) {
            gpuverbs::st16(slot + 16 * u, make_uint4(i, u, 1, 2));
        }
        asm volatile("fence.release.sys;" ::: "memory");
        gpuverbs::st_relaxed_sys32(reinterpret_cast<uint32_t*>(host + 4), i);
        gpuverbs::st_relaxed_sys64(reinterpret_cast<uint64_t*>(host + 8), i);
    }
    bench::stamp_end(t);
    if (polled != 0) gpuverbs::st_relaxed_sys64(word, polled);
}

// The ceiling of host-resident rings: every thread writes 64-byte blocks (four 16-byte
// stores) into mapped host memory, `iters` blocks each, strided over `blocks_total` blocks.
GPUVERBS_KERNEL void gv_bench_store64(uint8_t* host, uint32_t blocks_total, uint32_t iters,
                                      unsigned long long* t) {
    __syncthreads();
    bench::stamp_start(t);
    const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t nthreads = gridDim.x * blockDim.x;
    for (uint32_t i = 0; i < iters; ++i) {
        uint32_t b = (tid + i * nthreads) % blocks_total;
        uint8_t* p = host + (size_t)b * 64;
        for (int k = 0; k < 4; ++k) gpuverbs::st16(p + 16 * k, make_uint4(i, tid, k, b));
    }
    asm volatile("fence.release.sys;" ::: "memory");
    bench::stamp_end(t);
}
