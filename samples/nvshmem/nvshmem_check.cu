// NVSHMEM's device API through whatever remote transport NVSHMEM picked (run by
// samples/scripts/nvshmem_check.sh under `gpuverbs emu` with IBGDA asked for): two PEs, every byte
// and value checked on the receiving PE.
//
// usage: nvshmem_check RANK UID_FILE [check|bench]
//   RANK 0 writes NVSHMEM's unique id to UID_FILE, RANK 1 reads it (the two PEs meet through
//   NVSHMEM's UID bootstrap). `check` (default) prints `ok NAME` / `FAIL NAME: why` per case and
//   `nvshmem-check: N passed, M failed`; `bench` prints one JSON row per figure (PE 0).
//
// Cases: putmem at every power of two 8 B .. 1 MiB (both PEs at once, thread scope), the same
// sizes from a block (nvshmemx_putmem_block), 1024 threads' nvshmem_int_p + quiet, 32- and 64-bit
// fetch-add (one thread, then 256: the fetched values must be a permutation of the counter's
// states; then both sizes from 256 threads in one kernel, 10 rounds) and compare-swap (taken
// and not taken), putmem_signal + signal_wait_until as a ping-pong
// (8 B, 4 KiB: 100 rounds; 64 KiB: 10) with SET and once with ADD, and nvshmem_barrier_all on the device (each round's p
// visible after the barrier). Bench: put rate at 8 B, 4 KiB and 8 KiB (three shapes), and the
// putmem_signal ping-pong's round trip at 8 B and 4 KiB.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CUDA(x)                                                                  \
    do {                                                                         \
        cudaError_t e_ = (x);                                                    \
        if (e_ != cudaSuccess) {                                                 \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,            \
                    cudaGetErrorString(e_));                                     \
            exit(2);                                                             \
        }                                                                        \
    } while (0)

static constexpr size_t kMaxPut = 1 << 20;
static constexpr int kThreadsP = 1024;
static constexpr int kAtomicThreads = 256;
static constexpr int kPingRounds = 100;
static constexpr int kBarrierRounds = 50;

static int g_passed = 0, g_failed = 0;
static constexpr int kKernelBudgetSeconds = 20;

static void report(bool ok, const std::string &name, const std::string &why) {
    if (ok) {
        printf("ok   %s\n", name.c_str());
        g_passed++;
    } else {
        printf("FAIL %s: %s\n", name.c_str(), why.c_str());
        g_failed++;
    }
    fflush(stdout);
}

// Waits for the GPU's work so far within the budget; a kernel still running then is a FAIL of
// `what`, and the process ends (exit status 3) rather than hang: the emulation's counters are
// written at exit.
static void sync_or_fail(const std::string &what) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kKernelBudgetSeconds);
    cudaError_t e;
    while ((e = cudaStreamQuery(0)) == cudaErrorNotReady) {
        if (std::chrono::steady_clock::now() > deadline) {
            report(false, what, "the kernel did not finish within " +
                                    std::to_string(kKernelBudgetSeconds) + " s");
            printf("nvshmem-check: %d passed, %d failed\n", g_passed, g_failed);
            fflush(stdout);
            exit(3);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    CUDA(e);
}

// The byte PE `pe` puts at offset i of a message of `size` bytes.
__host__ __device__ static inline uint8_t pattern(int pe, size_t size, size_t i) {
    return (uint8_t)(i * 131 + size * 7 + pe * 59 + 1);
}

__global__ void fill(uint8_t *buf, size_t size, int pe) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < size; i += gridDim.x * blockDim.x)
        buf[i] = pattern(pe, size, i);
}

__global__ void put_thread(uint8_t *dst, const uint8_t *src, size_t size, int peer) {
    nvshmem_putmem(dst, src, size, peer);
    nvshmem_quiet();
}

__global__ void put_block(uint8_t *dst, const uint8_t *src, size_t size, int peer) {
    nvshmemx_putmem_block(dst, src, size, peer);
    if (threadIdx.x == 0) nvshmem_quiet();
}

__global__ void p_many(int *dst, int pe, int peer) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    nvshmem_int_p(&dst[t], t * 3 + pe * 100000 + 7, peer);
    nvshmem_quiet();
}

struct Atomics {
    int c32;
    long c64;
    int cas32;
    long cas64;
};

static constexpr long kAdd64 = 0x100000001LL;  // crosses the 32-bit boundary every time
static constexpr int kBase32 = 1000;
static constexpr long kBase64 = 0x500000003LL;
static constexpr int kCasOld32 = 7, kCasNew32 = 42;
static constexpr long kCasOld64 = (long)0x7eadbeef00000007ULL;
static constexpr long kCasNew64 = 0x1234567890abcdefLL;

__global__ void fetch_adds(Atomics *a, int *old32, long *old64, int peer, bool wide) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (wide)
        old64[t] = nvshmem_long_atomic_fetch_add(&a->c64, kAdd64, peer);
    else
        old32[t] = nvshmem_int_atomic_fetch_add(&a->c32, 1, peer);
}

// Both sizes from every thread in one kernel (what the first GPU run launched when it hung
// once, 2026-12-06; kept as a case of its own), `rounds` times.
__global__ void fetch_adds_mixed(Atomics *a, int *old32, long *old64, int peer, int rounds) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    for (int r = 0; r < rounds; r++) {
        old32[t] = nvshmem_int_atomic_fetch_add(&a->c32, 1, peer);
        old64[t] = nvshmem_long_atomic_fetch_add(&a->c64, kAdd64, peer);
    }
}

__global__ void compare_swaps(Atomics *a, long *got, int peer, bool wide) {
    if (wide) {
        got[2] = nvshmem_long_atomic_compare_swap(&a->cas64, kCasOld64 ^ 1, 99, peer);
        got[3] = nvshmem_long_atomic_compare_swap(&a->cas64, kCasOld64, kCasNew64, peer);
    } else {
        got[0] = nvshmem_int_atomic_compare_swap(&a->cas32, kCasOld32 + 1, 99, peer);  // not taken
        got[1] = nvshmem_int_atomic_compare_swap(&a->cas32, kCasOld32, kCasNew32, peer);
    }
    nvshmem_quiet();
}

// Whether the `size` bytes at `buf` are the peer's pattern shifted by `r` (one GPU thread).
__device__ static bool arrived(const uint8_t *buf, size_t size, int peer, int r) {
    for (size_t i = 0; i < size; i++)
        if (buf[i] != (uint8_t)(pattern(peer, size, i) + r)) return false;
    return true;
}

// Ping-pong: PE 0 starts. Each round a PE waits for the signal `round`, and answers in kind.
// With `touch`, every round's payload is the PE's pattern shifted by the round, written before
// the put and checked after the wait (the check); without, the payload is left as it is and
// the host checks the last one (the benchmark: only the network's time is in the loop).
__global__ void ping_pong(uint8_t *buf, uint8_t *src, uint64_t *sig, size_t size, int rounds,
                          int pe, int peer, bool touch, int *bad) {
    for (int r = 1; r <= rounds; r++) {
        bool my_turn_first = (pe == 0);
        if (!my_turn_first) {
            nvshmem_signal_wait_until(sig, NVSHMEM_CMP_EQ, (uint64_t)r);
            if (touch && !arrived(buf, size, peer, r)) atomicAdd(bad, 1);
        }
        if (touch)
            for (size_t i = 0; i < size; i++) src[i] = (uint8_t)(pattern(pe, size, i) + r);
        nvshmem_putmem_signal(buf, src, size, sig, (uint64_t)r, NVSHMEM_SIGNAL_SET, peer);
        if (my_turn_first) {
            nvshmem_signal_wait_until(sig, NVSHMEM_CMP_EQ, (uint64_t)r);
            if (touch && !arrived(buf, size, peer, r)) atomicAdd(bad, 1);
        }
    }
    nvshmem_quiet();
}

// One putmem_signal with ADD from each PE, each waits until its own signal reaches `expect`.
__global__ void signal_add(uint8_t *buf, const uint8_t *src, uint64_t *sig, size_t size,
                           uint64_t add, uint64_t expect, int peer) {
    nvshmem_putmem_signal(buf, src, size, sig, add, NVSHMEM_SIGNAL_ADD, peer);
    nvshmem_signal_wait_until(sig, NVSHMEM_CMP_EQ, expect);
    nvshmem_quiet();
}

__global__ void device_barrier(int *slot, int rounds, int peer, int *bad) {
    for (int r = 1; r <= rounds; r++) {
        nvshmem_int_p(slot, r, peer);
        nvshmem_barrier_all();
        if (*(volatile int *)slot != r) atomicAdd(bad, 1);
        nvshmem_barrier_all();
    }
}

// Message rate: every thread puts `iters` messages of `size` bytes (non-blocking), then quiet.
__global__ void put_rate(uint8_t *dst, const uint8_t *src, size_t size, int iters, int peer) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    size_t off = ((size_t)t * size) % (kMaxPut - size + 1);
    for (int i = 0; i < iters; i++) nvshmem_putmem_nbi(dst + off, src + off, size, peer);
    nvshmem_quiet();
}

static std::vector<uint8_t> to_host(const void *dev, size_t n) {
    std::vector<uint8_t> h(n);
    CUDA(cudaMemcpy(h.data(), dev, n, cudaMemcpyDeviceToHost));
    return h;
}

// Puts at every power of two, both PEs at once; `block` uses a block-scope put.
static void check_puts(uint8_t *dst, uint8_t *src, int pe, int peer, bool block) {
    for (size_t size = 8; size <= kMaxPut; size *= 2) {
        CUDA(cudaMemset(dst, 0xEE, kMaxPut));
        fill<<<64, 256>>>(src, size, pe);
        CUDA(cudaDeviceSynchronize());
        nvshmem_barrier_all();
        if (block)
            put_block<<<1, 128>>>(dst, src, size, peer);
        else
            put_thread<<<1, 1>>>(dst, src, size, peer);
        sync_or_fail(std::string(block ? "putmem_block " : "putmem ") + std::to_string(size) + " B");
        nvshmem_barrier_all();
        std::vector<uint8_t> h = to_host(dst, size + 64);
        size_t bad = size;
        for (size_t i = 0; i < size && bad == size; i++)
            if (h[i] != pattern(peer, size, i)) bad = i;
        bool spill = false;
        for (size_t i = size; i < size + 64 && size + 64 <= kMaxPut; i++) spill |= h[i] != 0xEE;
        char why[160];
        snprintf(why, sizeof why, "first wrong byte at %zu of %zu%s", bad, size,
                 spill ? "; bytes past the message were written" : "");
        report(bad == size && !spill,
               std::string(block ? "putmem_block " : "putmem ") + std::to_string(size) + " B",
               why);
    }
}

static void check_p(int *ibuf, int pe, int peer) {
    CUDA(cudaMemset(ibuf, 0, kThreadsP * sizeof(int)));
    nvshmem_barrier_all();
    p_many<<<kThreadsP / 256, 256>>>(ibuf, pe, peer);
    sync_or_fail("int_p from 1024 threads + quiet");
    nvshmem_barrier_all();
    std::vector<int> h(kThreadsP);
    CUDA(cudaMemcpy(h.data(), ibuf, kThreadsP * sizeof(int), cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int t = 0; t < kThreadsP; t++) wrong += h[t] != t * 3 + peer * 100000 + 7;
    report(wrong == 0, "int_p from 1024 threads + quiet",
           std::to_string(wrong) + " of 1024 values wrong");
}

// Each step alone (its own kernel, barriers around it), so that a step that fails or hangs is
// named: one thread's 32-bit then 64-bit fetch-add, compare-swaps, then 256 threads' of each.
static void check_atomics(Atomics *a, int peer) {
    Atomics init = {kBase32, kBase64, kCasOld32, kCasOld64};
    CUDA(cudaMemcpy(a, &init, sizeof init, cudaMemcpyHostToDevice));
    int *old32;
    long *old64, *got;
    CUDA(cudaMalloc(&old32, kAtomicThreads * sizeof(int)));
    CUDA(cudaMalloc(&old64, kAtomicThreads * sizeof(long)));
    CUDA(cudaMalloc(&got, 4 * sizeof(long)));
    std::vector<int> o32(kAtomicThreads);
    std::vector<long> o64(kAtomicThreads), g(4);
    auto step = [&](const std::string &name, auto launch) {
        nvshmem_barrier_all();
        launch();
        sync_or_fail(name);
        nvshmem_barrier_all();
        Atomics after;
        CUDA(cudaMemcpy(&after, a, sizeof after, cudaMemcpyDeviceToHost));
        CUDA(cudaMemcpy(o32.data(), old32, o32.size() * sizeof(int), cudaMemcpyDeviceToHost));
        CUDA(cudaMemcpy(o64.data(), old64, o64.size() * sizeof(long), cudaMemcpyDeviceToHost));
        CUDA(cudaMemcpy(g.data(), got, 4 * sizeof(long), cudaMemcpyDeviceToHost));
        return after;
    };

    Atomics after = step("int fetch_add x1", [&] { fetch_adds<<<1, 1>>>(a, old32, old64, peer, false); });
    report(after.c32 == kBase32 + 1 && o32[0] == kBase32, "int fetch_add x1",
           "counter " + std::to_string(after.c32) + ", fetched " + std::to_string(o32[0]));
    after = step("long fetch_add x1", [&] { fetch_adds<<<1, 1>>>(a, old32, old64, peer, true); });
    report(after.c64 == kBase64 + kAdd64 && o64[0] == kBase64, "long fetch_add x1 (+0x100000001)",
           "counter " + std::to_string(after.c64) + ", fetched " + std::to_string(o64[0]));
    after = step("int compare_swap", [&] { compare_swaps<<<1, 1>>>(a, got, peer, false); });
    report(g[0] == kCasOld32 && g[1] == kCasOld32 && after.cas32 == kCasNew32,
           "int compare_swap (not taken, taken)",
           "returned " + std::to_string(g[0]) + "," + std::to_string(g[1]) + " value " +
               std::to_string(after.cas32));
    after = step("long compare_swap", [&] { compare_swaps<<<1, 1>>>(a, got, peer, true); });
    report(g[2] == kCasOld64 && g[3] == kCasOld64 && after.cas64 == kCasNew64,
           "long compare_swap (not taken, taken)",
           "returned " + std::to_string(g[2]) + "," + std::to_string(g[3]) + " value " +
               std::to_string(after.cas64));

    after = step("int fetch_add x256", [&] {
        fetch_adds<<<kAtomicThreads / 128, 128>>>(a, old32, old64, peer, false);
    });
    std::sort(o32.begin(), o32.end());
    bool perm32 = true;
    for (int k = 0; k < kAtomicThreads; k++) perm32 &= o32[k] == kBase32 + 1 + k;
    report(after.c32 == kBase32 + 1 + kAtomicThreads && perm32, "int fetch_add x256",
           "counter " + std::to_string(after.c32) + (perm32 ? "" : ", fetched values not a permutation"));
    after = step("long fetch_add x256", [&] {
        fetch_adds<<<kAtomicThreads / 128, 128>>>(a, old32, old64, peer, true);
    });
    std::sort(o64.begin(), o64.end());
    bool perm64 = true;
    for (int k = 0; k < kAtomicThreads; k++) perm64 &= o64[k] == kBase64 + (1 + k) * kAdd64;
    report(after.c64 == kBase64 + (1 + kAtomicThreads) * kAdd64 && perm64,
           "long fetch_add x256 (+0x100000001)",
           "counter " + std::to_string(after.c64) + (perm64 ? "" : ", fetched values not a permutation"));
    const int rounds = 10;
    after = step("int and long fetch_add x256, mixed, 10 rounds", [&] {
        fetch_adds_mixed<<<kAtomicThreads / 128, 128>>>(a, old32, old64, peer, rounds);
    });
    long n = (long)kAtomicThreads * rounds;
    report(after.c32 == kBase32 + 1 + kAtomicThreads + n &&
               after.c64 == kBase64 + (1 + kAtomicThreads + n) * kAdd64,
           "int and long fetch_add x256, mixed, 10 rounds",
           "counters " + std::to_string(after.c32) + ", " + std::to_string(after.c64));
    CUDA(cudaFree(old32));
    CUDA(cudaFree(old64));
    CUDA(cudaFree(got));
}

// Runs the ping-pong; returns microseconds per round trip (PE 0's view), or -1 when a payload
// arrived wrong (each round's with `touch`, else the last one, checked here).
static double ping_pong_rtt(uint8_t *buf, uint8_t *src, uint64_t *sig, size_t size, int rounds,
                            int pe, int peer, bool touch, int *bad) {
    CUDA(cudaMemset(sig, 0, sizeof(uint64_t)));
    CUDA(cudaMemset(bad, 0, sizeof(int)));
    CUDA(cudaMemset(buf, 0xEE, size));
    if (!touch) fill<<<64, 256>>>(src, size, pe);
    CUDA(cudaDeviceSynchronize());
    nvshmem_barrier_all();
    auto t0 = std::chrono::steady_clock::now();
    ping_pong<<<1, 1>>>(buf, src, sig, size, rounds, pe, peer, touch, bad);
    sync_or_fail("putmem_signal ping-pong, " + std::to_string(size) + " B");
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                    .count();
    nvshmem_barrier_all();
    int h_bad;
    CUDA(cudaMemcpy(&h_bad, bad, sizeof h_bad, cudaMemcpyDeviceToHost));
    if (!touch) {
        std::vector<uint8_t> h = to_host(buf, size);
        for (size_t i = 0; i < size; i++) h_bad += h[i] != pattern(peer, size, i);
    }
    return h_bad ? -1 : us / rounds;
}

static void check_signals(uint8_t *buf, uint8_t *src, uint64_t *sig, int pe, int peer) {
    int *bad;
    CUDA(cudaMalloc(&bad, sizeof(int)));
    for (size_t size : {(size_t)8, (size_t)4096, (size_t)65536}) {
        int rounds = size > 4096 ? 10 : kPingRounds;  // one GPU thread checks each byte
        double rtt = ping_pong_rtt(buf, src, sig, size, rounds, pe, peer, true, bad);
        report(rtt >= 0,
               "putmem_signal SET + signal_wait_until, " + std::to_string(rounds) +
                   "-round ping-pong, " + std::to_string(size) + " B",
               "a round's payload arrived wrong");
    }
    CUDA(cudaMemset(sig, 0, sizeof(uint64_t)));
    fill<<<64, 256>>>(src, 4096, pe);
    CUDA(cudaMemset(buf, 0, 4096));
    CUDA(cudaDeviceSynchronize());
    nvshmem_barrier_all();
    signal_add<<<1, 1>>>(buf, src, sig, 4096, 0x100000000ULL + 5, 0x100000000ULL + 5, peer);
    sync_or_fail("putmem_signal ADD 4096 B");
    nvshmem_barrier_all();
    std::vector<uint8_t> h = to_host(buf, 4096);
    bool ok = true;
    for (size_t i = 0; i < 4096; i++) ok &= h[i] == pattern(peer, 4096, i);
    report(ok, "putmem_signal ADD 4096 B", "payload wrong");
    CUDA(cudaFree(bad));
}

static void check_device_barrier(int *slot, int peer) {
    int *bad;
    CUDA(cudaMalloc(&bad, sizeof(int)));
    CUDA(cudaMemset(bad, 0, sizeof(int)));
    CUDA(cudaMemset(slot, 0, sizeof(int)));
    nvshmem_barrier_all();
    int rounds = kBarrierRounds;
    void *args[] = {&slot, &rounds, &peer, &bad};
    int rc = nvshmemx_collective_launch((const void *)device_barrier, 1, 1, args, 0, 0);
    sync_or_fail("nvshmem_barrier_all on the device");
    nvshmem_barrier_all();
    int h_bad = -1;
    CUDA(cudaMemcpy(&h_bad, bad, sizeof h_bad, cudaMemcpyDeviceToHost));
    report(rc == 0 && h_bad == 0, "nvshmem_barrier_all on the device, 50 rounds",
           "launch rc " + std::to_string(rc) + ", " + std::to_string(h_bad) +
               " rounds saw the peer's p missing after the barrier");
    CUDA(cudaFree(bad));
}

static void bench(uint8_t *dst, uint8_t *src, uint64_t *sig, int pe, int peer) {
    struct Shape {
        int blocks, threads, iters;
    };
    const Shape shapes[] = {{1, 1, 2000}, {1, 32, 200}, {8, 32, 50}};
    fill<<<64, 256>>>(src, kMaxPut, pe);
    CUDA(cudaDeviceSynchronize());
    for (size_t size : {(size_t)8, (size_t)4096, (size_t)8192}) {
        for (const Shape &s : shapes) {
            CUDA(cudaMemset(dst, 0xEE, kMaxPut));
            CUDA(cudaDeviceSynchronize());
            nvshmem_barrier_all();
            double us = 0;
            if (pe == 0) {
                put_rate<<<s.blocks, s.threads>>>(dst, src, size, s.iters / 10, peer);  // warm-up
                sync_or_fail("put rate warm-up");
                auto t0 = std::chrono::steady_clock::now();
                put_rate<<<s.blocks, s.threads>>>(dst, src, size, s.iters, peer);
                sync_or_fail("put rate");
                us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() -
                                                               t0)
                         .count();
                long long msgs = (long long)s.blocks * s.threads * s.iters;
                // us_per_put: the time over the puts (all threads'), MB/s: their bytes over it
                printf("{\"bench\":\"nvshmem_put_rate\",\"size\":%zu,\"ctas\":%d,\"threads\":%d,"
                       "\"messages\":%lld,\"us\":%.1f,\"mpps\":%.4f,\"us_per_put\":%.3f,"
                       "\"mbps\":%.1f}\n",
                       size, s.blocks, s.threads, msgs, us, msgs / us, us / msgs,
                       msgs * (double)size / us);
                fflush(stdout);
            }
            nvshmem_barrier_all();
            if (pe == 1) {  // the target checks what every thread's puts left
                std::vector<uint8_t> h = to_host(dst, kMaxPut);
                bool ok = true;
                for (int t = 0; t < s.blocks * s.threads; t++) {
                    size_t off = ((size_t)t * size) % (kMaxPut - size + 1);
                    for (size_t i = 0; i < size; i++) ok &= h[off + i] == pattern(0, kMaxPut, off + i);
                }
                printf("{\"bench\":\"nvshmem_put_rate_target\",\"size\":%zu,\"ctas\":%d,"
                       "\"threads\":%d,\"validated\":%s}\n",
                       size, s.blocks, s.threads, ok ? "true" : "false");
                fflush(stdout);
            }
        }
    }
    int *bad;
    CUDA(cudaMalloc(&bad, sizeof(int)));
    for (size_t size : {(size_t)8, (size_t)4096}) {
        ping_pong_rtt(dst, src, sig, size, 20, pe, peer, false, bad);  // warm-up
        double rtt = ping_pong_rtt(dst, src, sig, size, 1000, pe, peer, false, bad);
        if (pe == 0)
            printf("{\"bench\":\"nvshmem_put_signal_rtt\",\"size\":%zu,\"rounds\":1000,"
                   "\"validated\":%s,\"rtt_us\":%.2f,\"half_rtt_us\":%.2f}\n",
                   size, rtt >= 0 ? "true" : "false", rtt, rtt / 2);
        fflush(stdout);
    }
    CUDA(cudaFree(bad));
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s RANK UID_FILE [check|bench]\n", argv[0]);
        return 2;
    }
    int rank = atoi(argv[1]);
    std::string uid_file = argv[2], mode = argc > 3 ? argv[3] : "check";
    CUDA(cudaSetDevice(0));

    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (rank == 0) {
        nvshmemx_get_uniqueid(&id);
        std::string tmp = uid_file + ".tmp";
        FILE *f = fopen(tmp.c_str(), "wb");
        if (!f || fwrite(&id, sizeof id, 1, f) != 1 || fclose(f) != 0 ||
            rename(tmp.c_str(), uid_file.c_str()) != 0) {
            perror("writing the unique id");
            return 2;
        }
    } else {
        FILE *f = nullptr;
        for (int i = 0; i < 600 && !(f = fopen(uid_file.c_str(), "rb")); i++)
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (!f || fread(&id, sizeof id, 1, f) != 1) {
            fprintf(stderr, "no unique id in %s after 60 s\n", uid_file.c_str());
            return 2;
        }
        fclose(f);
    }
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    nvshmemx_set_attr_uniqueid_args(rank, 2, &id, &attr);
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) {
        fprintf(stderr, "nvshmemx_init_attr failed\n");
        return 2;
    }
    int pe = nvshmem_my_pe(), peer = 1 - pe;
    if (nvshmem_n_pes() != 2) {
        fprintf(stderr, "expected 2 PEs, got %d\n", nvshmem_n_pes());
        return 2;
    }
    uint8_t *dst = (uint8_t *)nvshmem_malloc(kMaxPut + 64);
    uint8_t *src = (uint8_t *)nvshmem_malloc(kMaxPut);
    int *ibuf = (int *)nvshmem_malloc(kThreadsP * sizeof(int));
    Atomics *atom = (Atomics *)nvshmem_malloc(sizeof(Atomics));
    uint64_t *sig = (uint64_t *)nvshmem_malloc(sizeof(uint64_t));
    if (!dst || !src || !ibuf || !atom || !sig) {
        fprintf(stderr, "nvshmem_malloc failed\n");
        return 2;
    }
    printf("PE %d of %d (mode %s)\n", pe, nvshmem_n_pes(), mode.c_str());

    if (mode == "bench") {
        bench(dst, src, sig, pe, peer);
    } else {
        check_puts(dst, src, pe, peer, false);
        check_puts(dst, src, pe, peer, true);
        check_p(ibuf, pe, peer);
        check_atomics(atom, peer);
        check_signals(dst, src, sig, pe, peer);
        check_device_barrier(ibuf, peer);
        printf("nvshmem-check: %d passed, %d failed\n", g_passed, g_failed);
    }
    nvshmem_barrier_all();
    nvshmem_free(dst);
    nvshmem_free(src);
    nvshmem_free(ibuf);
    nvshmem_free(atom);
    nvshmem_free(sig);
    nvshmem_finalize();
    return g_failed ? 1 : 0;
}
