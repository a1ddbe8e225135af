// The suite's own kernels (compiled by crates/gpu-tests/build.rs into the gpu-test binary, not
// into the library's fatbin, which every gpuverbs user embeds): signals, put-with-signal, get
// and the atomics at warp and block scope; the GIN-style calls at thread scope; the per-QP
// error without polling; the counted calls. Each drives exported QPs through the public device
// API and reports statuses the host checks (payloads are verified on the host).
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

namespace gin_tests {

// Records the first non-OK status (and its error) of any thread: out[0] status, out[1]
// syndrome, out[2] vendor syndrome, out[3] WQE counter.
GPUVERBS_DEVICE void report(int* out, gpuverbs::status s, const gpuverbs::error& e) {
    if (s != gpuverbs::OK && atomicCAS(out, 0, (int)s) == 0) {
        out[1] = e.syndrome;
        out[2] = e.vendor;
        out[3] = e.wqe_counter;
    }
}

}  // namespace gin_tests

// Signals, put-with-signal, get and the atomics at warp (scope 1) or block (scope 2) scope, one
// block of 64 threads; thread t takes part unless skip_mod && t % skip_mod == skip_mod - 1.
// (Their thread-scope calls are gv_test_ops' and gv_test_gin's: one call site per call and
// scope keeps the kernels' code, all of it inlined, within the bundle's size.)
// Offsets into the remote (r) and local (l) buffers, per thread t:
//   signal        +(1 << t) on r+0                      (the word ends as the participants' mask)
//   signal_set    r+64+8t := 0x5157_0000_0000_0000 | t
//   put_signal    16 bytes l+1024+16t -> r+1024+16t, then +(1 << t) on r+8
//   put_signal_set 16 bytes l+2048+16t -> r+2048+16t, then r+3072+8t := 0xc0de_0000_0000_005a | t << 8
//   get           16 bytes r+3584+16t -> l+3584+16t
//   fetch-add     r+4608+8t += t + 1, old value to l+4608+8t
//   compare-swap  r+5120+8t: compare (t even: its initial 2000 + t; odd: 1), swap 0xc5000 + t;
//                 old value to l+5120+8t
//   fetch-add32   r+5632+4t += 7, old value (big-endian) to l+5632+4t
//   compare-swap32 r+5888+4t: compare (t % 3: 400 + t, else 0), swap 0xab00 + t; old value to
//                 l+5888+4t
//   masked fetch-add r+6144+8t += 0x1_0000_0010 with boundaries at bits 31 and 63; old to l+6144+8t
//   masked compare-swap r+6656+8t: compare bits 47..32 with 0x2222 (t even) or 0x9999 (t odd),
//                 swap bits 31..16 from 0xcccc; old value to l+6656+8t
//   masked fetch-add32 r+7168+4t += 0x0101_0110 with byte fields (boundaries 0x8080_8080); old
//                 value (big-endian) to l+7168+4t
//   masked compare-swap32 r+7424+4t: compare bits 15..8 with t (t even) or 0xee (t odd), swap
//                 bits 31..16 from 0xa5a5; old value (big-endian) to l+7424+4t
// then every thread syncs and thread 0 quiets.
GPUVERBS_KERNEL void gv_test_scopes(gpuverbs_qp* q, uint64_t l, uint32_t lk_, uint64_t r,
                                    uint32_t rk_, uint32_t scope, uint32_t skip_mod,
                                    uint64_t budget, int* out) {
    using namespace gpuverbs;
    const uint32_t t = threadIdx.x;
    const bool part = skip_mod == 0 || t % skip_mod != skip_mod - 1;
    const lkey lk{lk_};
    const rkey rk{rk_};
    const uint64_t bit = 1ull << t;
    const uint64_t cs_cmp = t % 2 == 0 ? 2000 + t : 1;
    const uint32_t cs32_cmp = t % 3 ? 400 + t : 0;
    const uint64_t mcs_cmp = t % 2 == 0 ? 0x0000222200000000ull : 0x0000999900000000ull;
    status s = OK;
// One operation at the kernel's scope: `block` is the block-scope call (every thread calls it,
// `part` says who posts), `warp` the warp-scope one (participants only).
#define GV_AT_SCOPE(warp, block) \
    if (s == OK) {               \
        if (scope == 2) {        \
            s = block;           \
        } else if (part) {       \
            s = warp;            \
        }                        \
    }
    GV_AT_SCOPE(signal_warp(q, r + 0, rk, bit, false, budget),
                signal_block(q, part, r + 0, rk, bit, false, budget));
    const uint64_t set = 0x5157000000000000ull | t;
    GV_AT_SCOPE(signal_set_warp(q, r + 64 + 8 * t, rk, set, false, budget),
                signal_set_block(q, part, r + 64 + 8 * t, rk, set, false, budget));
    const uint64_t ps = 1024 + 16 * t;
    GV_AT_SCOPE(put_signal_warp(q, l + ps, lk, r + ps, rk, 16, r + 8, rk, bit, false, budget),
                put_signal_block(q, part, l + ps, lk, r + ps, rk, 16, r + 8, rk, bit, false,
                                 budget));
    const uint64_t pss = 2048 + 16 * t, pss_sig = 3072 + 8 * t;
    const uint64_t pss_val = 0xc0de00000000005aull | (uint64_t)t << 8;
    GV_AT_SCOPE(put_signal_set_warp(q, l + pss, lk, r + pss, rk, 16, r + pss_sig, rk, pss_val,
                                    false, budget),
                put_signal_set_block(q, part, l + pss, lk, r + pss, rk, 16, r + pss_sig, rk,
                                     pss_val, false, budget));
    const uint64_t g = 3584 + 16 * t;
    GV_AT_SCOPE(get_warp(q, l + g, lk, r + g, rk, 16, false, budget),
                get_block(q, part, l + g, lk, r + g, rk, 16, false, budget));
    const uint64_t fa = 4608 + 8 * t;
    GV_AT_SCOPE(atomic_fetch_add_warp(q, r + fa, rk, t + 1, l + fa, lk, budget),
                atomic_fetch_add_block(q, part, r + fa, rk, t + 1, l + fa, lk, budget));
    const uint64_t cs = 5120 + 8 * t;
    GV_AT_SCOPE(atomic_compare_swap_warp(q, r + cs, rk, cs_cmp, 0xc5000 + t, l + cs, lk, budget),
                atomic_compare_swap_block(q, part, r + cs, rk, cs_cmp, 0xc5000 + t, l + cs, lk,
                                          budget));
    const uint64_t fa32 = 5632 + 4 * t;
    GV_AT_SCOPE(atomic_fetch_add32_warp(q, r + fa32, rk, 7, l + fa32, lk, budget),
                atomic_fetch_add32_block(q, part, r + fa32, rk, 7, l + fa32, lk, budget));
    const uint64_t cs32 = 5888 + 4 * t;
    GV_AT_SCOPE(atomic_compare_swap32_warp(q, r + cs32, rk, cs32_cmp, 0xab00 + t, l + cs32, lk,
                                           budget),
                atomic_compare_swap32_block(q, part, r + cs32, rk, cs32_cmp, 0xab00 + t, l + cs32,
                                            lk, budget));
    const uint64_t mfa = 6144 + 8 * t, mfa_add = 0x0000000100000010ull;
    const uint64_t bounds = 0x8000000080000000ull;
    GV_AT_SCOPE(atomic_masked_fetch_add_warp(q, r + mfa, rk, mfa_add, bounds, l + mfa, lk, budget),
                atomic_masked_fetch_add_block(q, part, r + mfa, rk, mfa_add, bounds, l + mfa, lk,
                                              budget));
    const uint64_t mcs = 6656 + 8 * t;
    const uint64_t cmask = 0x0000ffff00000000ull, sw = 0xaaaabbbbccccddddull,
                   smask = 0x00000000ffff0000ull;
    GV_AT_SCOPE(atomic_masked_compare_swap_warp(q, r + mcs, rk, mcs_cmp, cmask, sw, smask,
                                                l + mcs, lk, budget),
                atomic_masked_compare_swap_block(q, part, r + mcs, rk, mcs_cmp, cmask, sw, smask,
                                                 l + mcs, lk, budget));
    const uint64_t mfa32 = 7168 + 4 * t;
    const uint32_t b32 = 0x80808080u, add32 = 0x01010110u;
    GV_AT_SCOPE(atomic_masked_fetch_add32_warp(q, r + mfa32, rk, add32, b32, l + mfa32, lk, budget),
                atomic_masked_fetch_add32_block(q, part, r + mfa32, rk, add32, b32, l + mfa32, lk,
                                                budget));
    const uint64_t mcs32 = 7424 + 4 * t;
    const uint32_t cmp32 = t % 2 == 0 ? t << 8 : 0xee00u;
    GV_AT_SCOPE(atomic_masked_compare_swap32_warp(q, r + mcs32, rk, cmp32, 0x0000ff00u,
                                                  0xa5a5a5a5u, 0xffff0000u, l + mcs32, lk, budget),
                atomic_masked_compare_swap32_block(q, part, r + mcs32, rk, cmp32, 0x0000ff00u,
                                                   0xa5a5a5a5u, 0xffff0000u, l + mcs32, lk,
                                                   budget));
#undef GV_AT_SCOPE
    error e{};
    if (s != OK) e = last_error(q);
    gin_tests::report(out, s, e);
    __syncthreads();
    if (t == 0) {
        s = quiet(q, budget, &e);
        gin_tests::report(out, s, e);
    }
}

// The GIN-style calls at thread scope, one thread, on two QPs (q: local l -> remote r; q2:
// l2 -> r2); `rw` is the remote buffer of q as this kernel loads it (its signal words).
// vals[]: what the host checks besides the bytes.
//  1. put_signal_set: 64 bytes l+0 -> r+0, then r+4096 := 0x1234_5678_9abc_def0.
//  2. put_value: 8 bytes 0x0102_0304_0506_0708 to r+4104, 4 bytes 0xa1b2_c3d4 to r+4112,
//     2 bytes 0xbeef to r+4116, 1 byte 0x7f to r+4118; 3 bytes: INVALID (vals[0]).
//  3. get_wait: 64 bytes r+256 -> l+512; on OK the kernel checks them at once against
//     (i * 7 + 3) & 0xff, which the host wrote there (vals[1]: index + 1 of a mismatch, 0 none).
//  4. signal +5 on r+4200; wait_signal for 5 (vals[2]: seen); read_signal (vals[3]);
//     reset_signal; read_signal (vals[4]); signal_set 9, wait_signal for 9 (vals[5]); signal
//     +1, wait_signal for 10 (vals[6]); wait_signal for 11 with 1 ms: status (vals[7]) and seen
//     (vals[8]).
//  5. flush_all over {q, q2}: 256 bytes l+1024 -> r+1024 on q (unsignaled), 512 bytes l2+0 ->
//     r2+0 and 64 bytes l2+1024 -> r2+1024 on q2 (unsignaled, the second published but not
//     rung); vals[9]: its status, vals[10]: the failed index (0xffff none).
//  6. flush of q: 64 bytes l+2048 -> r+2048, unsignaled; vals[11]: its status.
GPUVERBS_KERNEL void gv_test_gin(gpuverbs_qp* q, gpuverbs_qp* q2, uint64_t l, uint32_t lk_,
                                 uint64_t r, uint32_t rk_, uint64_t l2, uint32_t lk2_,
                                 uint64_t r2, uint32_t rk2_, uint64_t* rw, uint64_t budget,
                                 int* out, uint64_t* vals) {
    using namespace gpuverbs;
    if (threadIdx.x != 0) return;
    const lkey lk{lk_}, lk2{lk2_};
    const rkey rk{rk_}, rk2{rk2_};
    error e{};
    status s = put_signal_set(q, l, lk, r, rk, 64, r + 4096, rk, 0x123456789abcdef0ull, false,
                              budget);
    if (s == OK) s = put_value(q, r + 4104, rk, 0x0102030405060708ull, 8, false, budget);
    if (s == OK) s = put_value(q, r + 4112, rk, 0xa1b2c3d4u, 4, false, budget);
    if (s == OK) s = put_value(q, r + 4116, rk, 0xbeefu, 2, false, budget);
    if (s == OK) s = put_value(q, r + 4118, rk, 0x7fu, 1, false, budget);
    if (s == OK) vals[0] = put_value(q, r + 4120, rk, 0x112233u, 3, false, budget);
    if (s == OK) {
        s = get_wait(q, l + 512, lk, r + 256, rk, 64, budget, &e);
        if (s == OK) {
            const uint32_t* got = reinterpret_cast<const uint32_t*>(l + 512);
            vals[1] = 0;
            for (uint32_t w = 0; w < 16 && vals[1] == 0; ++w) {
                const uint32_t v = __ldcv(got + w);
                for (uint32_t b = 0; b < 4; ++b) {
                    const uint32_t i = 4 * w + b;
                    if (((v >> (8 * b)) & 0xffu) != ((i * 7 + 3) & 0xffu)) {
                        vals[1] = i + 1;
                        break;
                    }
                }
            }
        }
    }
    uint64_t* const word = rw + 4200 / 8;
    uint64_t seen = 0;
    if (s == OK) s = signal(q, r + 4200, rk, 5, false, budget);
    if (s == OK) s = wait_signal(word, 5, budget, &seen);
    if (s == OK) {
        vals[2] = seen;
        vals[3] = read_signal(word);
        reset_signal(word);
        vals[4] = read_signal(word);
        s = signal_set(q, r + 4200, rk, 9, false, budget);
    }
    if (s == OK) s = wait_signal(word, 9, budget, &seen);
    if (s == OK) {
        vals[5] = seen;
        s = signal(q, r + 4200, rk, 1, false, budget);
    }
    if (s == OK) s = wait_signal(word, 10, budget, &seen);
    if (s == OK) {
        vals[6] = seen;
        vals[7] = wait_signal(word, 11, 1000000, &seen);
        vals[8] = seen;
        s = put(q, l + 1024, lk, r + 1024, rk, 256, false, budget);
    }
    if (s == OK) s = put(q2, l2, lk2, r2, rk2, 512, false, budget);
    if (s == OK) s = put(q2, l2 + 1024, lk2, r2 + 1024, rk2, 64, false, budget, false);
    if (s == OK) {
        gpuverbs_qp* const both[2] = {q, q2};
        uint32_t failed = 0xffff;
        s = flush_all(both, 2, budget, &e, &failed);
        vals[9] = s;
        vals[10] = failed;
    }
    if (s == OK) s = put(q, l + 2048, lk, r + 2048, rk, 64, false, budget);
    if (s == OK) {
        s = flush(q, budget, &e);
        vals[11] = s;
    }
    if (s != OK && e.syndrome == 0) e = last_error(q);
    __threadfence_system();
    gin_tests::report(out, s, e);
}

// Which error put the QP in ERR, asked without polling the CQ (qp_error): out[0] = its status
// (OK: none recorded; ERROR_CQE), out[1] = syndrome, out[2] = vendor syndrome, out[3] = the
// CQE's 16-bit WQE counter, out[4] = the failed WQE's first block on the 64-bit SQ counter;
// out[5] = the send CQ consumer index before and out[6] after the call (unchanged: no poll).
GPUVERBS_KERNEL void gv_test_qp_error(gpuverbs_qp* q, uint64_t* out) {
    using namespace gpuverbs;
    if (threadIdx.x != 0) return;
    out[5] = ld_acquire_gpu64(&q->scq_ci);
    error e{};
    out[0] = (uint64_t)qp_error(q, &e);
    out[6] = ld_acquire_gpu64(&q->scq_ci);
    out[1] = e.syndrome;
    out[2] = e.vendor;
    out[3] = e.wqe_counter;
    out[4] = e.wqe;
}

// Counted calls at one scope (0 thread, 1 warp, 2 block), one block of 64 threads; thread t
// takes part unless skip_mod && t % skip_mod == skip_mod - 1. Per participating thread t:
//   put_counted            16 bytes l+1024+16t -> r+1024+16t, counter ctr[0]
//   put_signal_counted     16 bytes l+2048+16t -> r+2048+16t, +(1 << t) on r+0, counter ctr[1]
//   put_signal_set_counted 16 bytes l+3072+16t -> r+3072+16t, r+64+8t := 0xc0c0_0000_0000_0000 | t,
//                          counter ctr[2]
//   get_counted            16 bytes r+4096+16t -> l+4096+16t, counter ctr[3]
// Then thread 0 waits for every counter to reach the number of participants (wait_counter,
// polling the CQ: no quiet) and records what it saw in vals[0..3]; checks at once the bytes
// the gets brought against (i * 11 + 1) & 0xff at r+4096+i, which the host wrote (vals[4]:
// index + 1 of the first mismatch, 0 none); reset_counter(ctr[0]) and read_counter (vals[5]);
// read_counter(ctr[1]) (vals[6]).
GPUVERBS_KERNEL void gv_test_counters(gpuverbs_qp* q, uint64_t l, uint32_t lk_, uint64_t r,
                                      uint32_t rk_, uint32_t scope, uint32_t skip_mod,
                                      uint64_t* ctr, uint64_t budget, int* out, uint64_t* vals) {
    using namespace gpuverbs;
    const uint32_t t = threadIdx.x;
    const bool part = skip_mod == 0 || t % skip_mod != skip_mod - 1;
    const lkey lk{lk_};
    const rkey rk{rk_};
    const uint64_t bit = 1ull << t;
    status s = OK;
#define GV_AT_SCOPE(thread, warp, block) \
    if (s == OK) {                       \
        if (scope == 2) {                \
            s = block;                   \
        } else if (part) {               \
            s = scope == 1 ? warp : thread; \
        }                                \
    }
    const uint64_t a = 1024 + 16 * t, b = 2048 + 16 * t, c = 3072 + 16 * t, g = 4096 + 16 * t;
    const uint64_t set = 0xc0c0000000000000ull | t;
    GV_AT_SCOPE(put_counted(q, l + a, lk, r + a, rk, 16, ctr, budget),
                put_counted_warp(q, l + a, lk, r + a, rk, 16, ctr, budget),
                put_counted_block(q, part, l + a, lk, r + a, rk, 16, ctr, budget));
    GV_AT_SCOPE(put_signal_counted(q, l + b, lk, r + b, rk, 16, r, rk, bit, ctr + 1, budget),
                put_signal_counted_warp(q, l + b, lk, r + b, rk, 16, r, rk, bit, ctr + 1, budget),
                put_signal_counted_block(q, part, l + b, lk, r + b, rk, 16, r, rk, bit, ctr + 1,
                                         budget));
    GV_AT_SCOPE(put_signal_set_counted(q, l + c, lk, r + c, rk, 16, r + 64 + 8 * t, rk, set,
                                       ctr + 2, budget),
                put_signal_set_counted_warp(q, l + c, lk, r + c, rk, 16, r + 64 + 8 * t, rk, set,
                                            ctr + 2, budget),
                put_signal_set_counted_block(q, part, l + c, lk, r + c, rk, 16, r + 64 + 8 * t,
                                             rk, set, ctr + 2, budget));
    GV_AT_SCOPE(get_counted(q, l + g, lk, r + g, rk, 16, ctr + 3, budget),
                get_counted_warp(q, l + g, lk, r + g, rk, 16, ctr + 3, budget),
                get_counted_block(q, part, l + g, lk, r + g, rk, 16, ctr + 3, budget));
#undef GV_AT_SCOPE
    error e{};
    if (s != OK) e = last_error(q);
    gin_tests::report(out, s, e);
    __syncthreads();
    if (t != 0) return;
    uint64_t n = 0;
    for (uint32_t i = 0; i < blockDim.x; ++i) n += skip_mod == 0 || i % skip_mod != skip_mod - 1;
    s = OK;
    for (uint32_t k = 0; k < 4 && s == OK; ++k) s = wait_counter(q, ctr + k, n, budget, &e, &vals[k]);
    if (s == OK) {
        vals[4] = 0;
        for (uint32_t i = 0; i < blockDim.x && vals[4] == 0; ++i) {
            if (!(skip_mod == 0 || i % skip_mod != skip_mod - 1)) continue;
            const uint32_t* got = reinterpret_cast<const uint32_t*>(l + 4096 + 16 * i);
            for (uint32_t w = 0; w < 4 && vals[4] == 0; ++w) {
                const uint32_t v = __ldcv(got + w);
                for (uint32_t k = 0; k < 4; ++k) {
                    const uint32_t at = 16 * i + 4 * w + k;
                    if (((v >> (8 * k)) & 0xffu) != ((at * 11 + 1) & 0xffu)) {
                        vals[4] = at + 1;
                        break;
                    }
                }
            }
        }
        reset_counter(ctr);
        vals[5] = read_counter(ctr);
        vals[6] = read_counter(ctr + 1);
        s = quiet(q, budget, &e);
    }
    __threadfence_system();
    gin_tests::report(out, s, e);
}

// A counted put that fails (a forged rkey `bad`): three put_counted on ctr, then
// wait_counter for 1. vals[0] = its status (ERROR_CQE expected), vals[1] = the counter it saw
// (0: a failed or flushed WQE never moves it), vals[2] = the error's syndrome.
GPUVERBS_KERNEL void gv_test_counter_error(gpuverbs_qp* q, uint64_t l, uint32_t lk, uint64_t r,
                                           uint32_t bad, uint64_t* ctr, uint64_t budget,
                                           uint64_t* vals) {
    using namespace gpuverbs;
    if (threadIdx.x != 0) return;
    status s = OK;
    for (uint32_t i = 0; i < 3 && s == OK; ++i) {
        s = put_counted(q, l + 64 * i, lkey{lk}, r + 64 * i, rkey{bad}, 64, ctr, budget);
    }
    error e{};
    uint64_t seen = ~0ull;
    if (s == OK) s = wait_counter(q, ctr, 1, budget, &e, &seen);
    vals[0] = s;
    vals[1] = seen;
    vals[2] = e.syndrome;
    __threadfence_system();
}

// The multi-QP doorbell (ring_multi), one block of 64 threads on n QPs (2..RING_MULTI_MAX),
// `rounds` rounds. In round r every thread t puts `size` bytes at offset (r * 64 + t) * size
// on every QP i (l[i] -> r[i], signaled, not rung) unless ring_multi_skips(r, i), which leaves
// QP i with nothing to ring that round; then thread 0 checks that no QP was rung yet
// (sq_rung < sq_ready where it posted, else INVALID), rings them all with one ring_multi
// (each QP's status must be OK), checks that each QP's doorbell now stands at its published
// end, and waits for every QP's completions up to that end (wait_ticket: every put is
// signaled). Statuses as gv_test_scopes'; bytes and the descriptors are checked on the host.
GPUVERBS_DEVICE bool ring_multi_skips(uint32_t r, uint32_t i, uint32_t n) {
    return r % 2 == 1 && i == (r / 2) % n;
}

GPUVERBS_KERNEL void gv_test_ring_multi(gpuverbs_qp* const* qps, const uint64_t* l,
                                        const uint32_t* lk, const uint64_t* r, const uint32_t* rk,
                                        uint32_t n, uint32_t size, uint32_t rounds,
                                        uint64_t budget, int* out) {
    using namespace gpuverbs;
    const uint32_t t = threadIdx.x;
    status s = OK;
    error e{};
    for (uint32_t round = 0; round < rounds; ++round) {
        const uint64_t off = (uint64_t)(round * blockDim.x + t) * size;
        for (uint32_t i = 0; i < n && s == OK; ++i) {
            if (ring_multi_skips(round, i, n)) continue;
            s = put(qps[i], l[i] + off, lkey{lk[i]}, r[i] + off, rkey{rk[i]}, size, true, budget,
                    false);
        }
        __syncthreads();
        if (t == 0 && s == OK) {
            for (uint32_t i = 0; i < n && s == OK; ++i) {
                const volatile gpuverbs_qp* v = qps[i];
                if (!ring_multi_skips(round, i, n) && v->sq_rung >= v->sq_ready) s = INVALID;
            }
            status each[RING_MULTI_MAX];
            if (s == OK) s = ring_multi(qps, n, budget, each);
            for (uint32_t i = 0; i < n && s == OK; ++i) {
                if (each[i] != OK) s = each[i];
            }
            for (uint32_t i = 0; i < n && s == OK; ++i) {
                const volatile gpuverbs_qp* v = qps[i];
                const uint64_t end = v->sq_ready;
                if (v->sq_rung != end) s = INVALID;
                if (s == OK) s = wait_ticket(qps[i], end, budget, &e);
            }
        }
        __syncthreads();
    }
    __threadfence_system();
    gin_tests::report(out, s, e);
}

// flush and get_wait at warp (scope 1) or block (scope 2) scope, one block of 64 threads;
// thread t takes part unless skip_mod && t % skip_mod == skip_mod - 1. Per participant t:
//   put      16 bytes l+16t -> r+16t (unsignaled, rung), then the scope's flush (every thread
//            at block scope); after OK the QP's retired counter must have reached the end the
//            thread saw after its put (INVALID otherwise)
//   get_wait 16 bytes r+1024+16t -> l+1024+16t at the scope; after OK the thread loads them
//            (__ldcv) and stores them at l+2048+16t (the host compares both copies with r)
GPUVERBS_KERNEL void gv_test_scope_waits(gpuverbs_qp* q, uint64_t l, uint32_t lk_, uint64_t r,
                                         uint32_t rk_, uint32_t scope, uint32_t skip_mod,
                                         uint64_t budget, int* out) {
    using namespace gpuverbs;
    const uint32_t t = threadIdx.x;
    const bool part = skip_mod == 0 || t % skip_mod != skip_mod - 1;
    const lkey lk{lk_};
    const rkey rk{rk_};
    status s = OK;
    error e{};
    uint64_t mine = 0;
    if (part) {
        s = put(q, l + 16 * t, lk, r + 16 * t, rk, 16, false, budget);
        mine = reinterpret_cast<volatile gpuverbs_qp*>(q)->sq_ready;
    }
    if (scope == 2) {
        const status f = flush_block(q, budget, &e);
        if (s == OK) s = f;
    } else if (part && s == OK) {
        s = flush_warp(q, budget, &e);
    }
    if (part && s == OK && reinterpret_cast<volatile gpuverbs_qp*>(q)->sq_retired < mine) {
        s = INVALID;
    }
    const uint64_t g = 1024 + 16 * t;
    if (scope == 2) {
        const status w = get_wait_block(q, part && s == OK, l + g, lk, r + g, rk, 16, budget, &e);
        if (s == OK) s = w;
    } else if (part && s == OK) {
        s = get_wait_warp(q, l + g, lk, r + g, rk, 16, budget, &e);
    }
    if (part && s == OK) {
        const uint4 v = __ldcv(reinterpret_cast<const uint4*>(l + g));
        *reinterpret_cast<uint4*>(l + 2048 + 16 * t) = v;
    }
    __threadfence_system();
    gin_tests::report(out, s, e);
}

// NCCL GIN's rolling comparison on the device: cmp[i] = rolling_le(a[i], b[i], bits[i]) for
// i < n (thread i), then thread 0 waits on two local words across a wrap: `w` holds a counter
// that wrapped (the host stores 3), `hi` one whose bits above 56 are set (the host stores
// 0xab00_0000_0000_0003). out[k] (8 bytes each): 0/1 status and seen of
// wait_signal_rolling(w, 2^56 - 2, 56) (OK); 2/3 wait_signal_rolling(w, 2^64 - 2, 64) (OK);
// 4/5 wait_signal_rolling(w, 4, 56) with `short_ns` (TIMEOUT); 6 wait_signal_rolling(w, 0, 0)
// (INVALID); 7 wait_signal_rolling(w, 0, 65) (INVALID); 8/9 wait_signal_rolling(hi, 2^56 - 2,
// 56) (OK: the bits above 56 are ignored); 10 read_signal(hi, 56); 11 read_counter(hi, 8);
// 12/13 wait_counter_rolling(q, w, 2^56 - 2, COUNTER_BITS) (OK, `q` polled, nothing posted);
// 14/15 wait_counter_rolling(q, w, 4, 56) with `short_ns` (TIMEOUT).
GPUVERBS_KERNEL void gv_test_rolling(gpuverbs_qp* q, const uint64_t* a, const uint64_t* b,
                                     const uint32_t* bits, uint32_t n, uint32_t* cmp,
                                     const uint64_t* w, const uint64_t* hi, uint64_t budget,
                                     uint64_t short_ns, uint64_t* out) {
    using namespace gpuverbs;
    const uint32_t t = threadIdx.x;
    if (t < n) cmp[t] = rolling_le(a[t], b[t], bits[t]) ? 1u : 0u;
    if (t != 0) return;
    const uint64_t top56 = (1ull << 56) - 2;
    uint64_t seen = 0;
    out[0] = wait_signal_rolling(w, top56, 56, budget, &seen);
    out[1] = seen;
    out[2] = wait_signal_rolling(w, ~0ull - 1, 64, budget, &seen);
    out[3] = seen;
    out[4] = wait_signal_rolling(w, 4, 56, short_ns, &seen);
    out[5] = seen;
    out[6] = wait_signal_rolling(w, 0, 0, budget);
    out[7] = wait_signal_rolling(w, 0, 65, budget);
    out[8] = wait_signal_rolling(hi, top56, 56, budget, &seen);
    out[9] = seen;
    out[10] = read_signal(hi, 56);
    out[11] = read_counter(hi, 8);
    error e{};
    out[12] = wait_counter_rolling(q, w, top56, COUNTER_BITS, budget, &e, &seen);
    out[13] = seen;
    out[14] = wait_counter_rolling(q, w, 4, 56, short_ns, &e, &seen);
    out[15] = seen;
}
