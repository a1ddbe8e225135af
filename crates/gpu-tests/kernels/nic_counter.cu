// Counters the NIC moves (issue 46 item 2): put_counter, put_signal_counter, signal_counter and
// get_counter on an exported QP `q` and its companion `cp` (a cross-channel master connected to
// itself), at thread, warp and block scope, and wait_counter over both. The host checks the
// counters (DeviceMem::read_counter), the signal words and both buffers.
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

namespace nic_counter_tests {

// Records the first non-OK status (and its error) of any thread: out[0] status, out[1]
// syndrome, out[2] vendor syndrome, out[3] WQE counter.
GPUVERBS_DEVICE void report(int* out, gpuverbs::status s, const gpuverbs::error& e) {
    if (s != gpuverbs::OK && atomicCAS(out, 0, (int)s) == 0) {
        out[1] = e.syndrome;
        out[2] = e.vendor;
        out[3] = e.wqe_counter;
    }
}

}  // namespace nic_counter_tests

// One block of 64 threads; thread t takes part unless skip_mod && t % skip_mod == skip_mod - 1.
// Per participant t, each call adds 1 to a counter of its own kind (ctr: the 4 words' NIC
// address, key ck; ctr_dev: the same words for loads):
//   put_counter        16 bytes l+1024+16t -> r+1024+16t                    counter 0 (scope)
//   put_signal_counter 16 bytes l+2048+16t -> r+2048+16t, +(1 << t) on r+0  counter 1 (scope)
//   signal_counter     +(1 << t) on r+8                                      counter 2 (scope)
//   get_counter        16 bytes r+4096+16t -> l+4096+16t                    counter 3 (scope)
// `early` (the soft NIC, the QP's completions delayed): right after every post, thread 0 sums
// the four counters into vals[5] (0: none moved before its WQE's CQE). Then thread 0 waits for
// each to reach the number of participants (wait_counter: vals[0..4] what it saw) and checks
// the gets' bytes (vals[4]: the first wrong byte + 1, 0 none).
GPUVERBS_KERNEL void gv_test_nic_counters(gpuverbs_qp* q, gpuverbs_qp* cp, uint64_t l,
                                          uint32_t lk_, uint64_t r, uint32_t rk_, uint32_t scope,
                                          uint32_t skip_mod, uint64_t ctr, uint32_t ck_,
                                          uint64_t* ctr_dev, uint32_t early, uint64_t budget,
                                          int* out, uint64_t* vals) {
    using namespace gpuverbs;
    const uint32_t t = threadIdx.x;
    const bool part = skip_mod == 0 || t % skip_mod != skip_mod - 1;
    const lkey lk{lk_};
    const rkey rk{rk_};
    const rkey ck{ck_};
    const uint64_t bit = 1ull << t;
    status s = OK;
#define GV_AT_SCOPE(thread, warp, block)    \
    if (s == OK) {                          \
        if (scope == 2) {                   \
            s = block;                      \
        } else if (part) {                  \
            s = scope == 1 ? warp : thread; \
        }                                   \
    }
    const uint64_t a = 1024 + 16 * t, b = 2048 + 16 * t, g = 4096 + 16 * t;
    GV_AT_SCOPE(put_counter(q, l + a, lk, r + a, rk, 16, cp, ctr, ck, 1, budget),
                put_counter_warp(q, l + a, lk, r + a, rk, 16, cp, ctr, ck, 1, budget),
                put_counter_block(q, part, l + a, lk, r + a, rk, 16, cp, ctr, ck, 1, budget));
    GV_AT_SCOPE(put_signal_counter(q, l + b, lk, r + b, rk, 16, r, rk, bit, cp, ctr + 8, ck, 1,
                                   budget),
                put_signal_counter_warp(q, l + b, lk, r + b, rk, 16, r, rk, bit, cp, ctr + 8, ck,
                                        1, budget),
                put_signal_counter_block(q, part, l + b, lk, r + b, rk, 16, r, rk, bit, cp,
                                         ctr + 8, ck, 1, budget));
    GV_AT_SCOPE(signal_counter(q, r + 8, rk, bit, cp, ctr + 16, ck, 1, budget),
                signal_counter_warp(q, r + 8, rk, bit, cp, ctr + 16, ck, 1, budget),
                signal_counter_block(q, part, r + 8, rk, bit, cp, ctr + 16, ck, 1, budget));
    GV_AT_SCOPE(get_counter(q, l + g, lk, r + g, rk, 16, cp, ctr + 24, ck, 1, budget),
                get_counter_warp(q, l + g, lk, r + g, rk, 16, cp, ctr + 24, ck, 1, budget),
                get_counter_block(q, part, l + g, lk, r + g, rk, 16, cp, ctr + 24, ck, 1,
                                  budget));
#undef GV_AT_SCOPE
    error e{};
    if (s != OK) e = last_error(q);
    nic_counter_tests::report(out, s, e);
    __syncthreads();
    if (t != 0) return;
    if (early) {
        uint64_t sum = 0;
        for (uint32_t k = 0; k < 4; ++k) sum += read_counter(ctr_dev + k);
        vals[5] = sum;
    }
    uint64_t n = 0;
    for (uint32_t i = 0; i < blockDim.x; ++i) n += skip_mod == 0 || i % skip_mod != skip_mod - 1;
    s = OK;
    for (uint32_t k = 0; k < 4 && s == OK; ++k) {
        s = wait_counter(q, cp, ctr_dev + k, n, budget, &e, &vals[k]);
    }
    nic_counter_tests::report(out, s, e);
    vals[4] = 0;
    for (uint32_t i = 0; s == OK && i < blockDim.x && vals[4] == 0; ++i) {
        if (!(skip_mod == 0 || i % skip_mod != skip_mod - 1)) continue;
        const uint8_t* got = reinterpret_cast<const uint8_t*>(l + 4096 + 16 * i);
        for (uint32_t k = 0; k < 16; ++k) {
            const uint32_t at = 16 * i + k;
            if (__ldcv(got + k) != (uint8_t)(at * 11 + 1)) {
                vals[4] = at + 1;
                break;
            }
        }
    }
    __threadfence_system();
}

// A counted put that completes, then three into a forged rkey: vals[0] wait_counter's status
// for the first (OK), vals[1] its status for the second (ERROR_CQE), vals[2] the counter it saw
// then (1), vals[3] the syndrome (REMOTE_ACCESS 0x13), vals[4] the counter read last.
GPUVERBS_KERNEL void gv_test_nic_counter_error(gpuverbs_qp* q, gpuverbs_qp* cp, uint64_t l,
                                               uint32_t lk, uint64_t r, uint32_t rk, uint32_t bad,
                                               uint64_t ctr, uint32_t ck, uint64_t* ctr_dev,
                                               uint64_t budget, uint64_t* vals) {
    using namespace gpuverbs;
    if (threadIdx.x != 0) return;
    error e{};
    uint64_t seen = ~0ull;
    status s = put_counter(q, l, lkey{lk}, r, rkey{rk}, 64, cp, ctr, rkey{ck}, 1, budget);
    if (s == OK) s = wait_counter(q, cp, ctr_dev, 1, budget, &e, &seen);
    vals[0] = s;
    for (uint32_t i = 1; i < 4 && s == OK; ++i) {
        s = put_counter(q, l + 64 * i, lkey{lk}, r + 64 * i, rkey{bad}, 64, cp, ctr, rkey{ck}, 1,
                        budget);
    }
    if (s == OK) s = wait_counter(q, cp, ctr_dev, 2, budget, &e, &seen);
    vals[1] = s;
    vals[2] = seen;
    vals[3] = e.syndrome;
    vals[4] = read_counter(ctr_dev);
    __threadfence_system();
}
