// What a put's system-scope release costs while something else touches host memory (H200 figures:
// docs/benchmarks.md, "Why: another CTA's loads of host memory slow a system-scope release").
//
// One thread of CTA 0 loops over what a put stores around its fence (gpu_bench's `fence_units`
// with 4 units): four 16-byte stores into a 64-byte slot of mapped host memory, fence.release.sys,
// a 4-byte store (the doorbell record's place) and an 8-byte store (the doorbell's). Meanwhile:
// nothing; a thread of CTA 1 loading a host word in a loop (ld.acquire.sys, or ld.relaxed.sys);
// that, with a CPU thread writing the word; or a CPU thread reading the lines the GPU writes.
// Prints ns per iteration (%globaltimer), three repetitions of each. A benchmark: it asserts
// nothing, and needs no soft NIC.
//
//   nvcc -std=c++17 -arch=sm_90 -O2 -L $CUDA_LIB -o fence_polled samples/bench/fence_polled.cu
//   ./fence_polled           (CUDA_LIB: where libcudart_static.a is, e.g. the nvidia-cuda-runtime
//                             wheel's lib/ that `cargo xtask setup-cuda` unpacks into .cuda)
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#define CHECK(x)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                 \
            std::exit(1);                                                                 \
        }                                                                                 \
    } while (0)

__device__ __forceinline__ uint64_t globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// poll: 0 none (one CTA is launched), 1 ld.acquire.sys, 2 ld.relaxed.sys. CTA 1 polls until CTA 0
// sets `stop` (GPU memory); the sum of what it read lands in out[1] so the loads stay.
__global__ void fence_polled(uint8_t* host, const uint64_t* word, volatile int* stop, int poll,
                             uint32_t iters, unsigned long long* out) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 1) {
        uint64_t sum = 0;
        while (!*stop) {
            uint64_t v;
            if (poll == 1) {
                asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(word) : "memory");
            } else {
                asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(word) : "memory");
            }
            sum += v;
        }
        out[1] = sum;
        return;
    }
    const uint64_t warm = globaltimer();
    while (globaltimer() - warm < 20000) {
    }  // the poller gets going
    const uint64_t t0 = globaltimer();
    for (uint32_t i = 0; i < iters; ++i) {
        uint8_t* slot = host + 64 + (size_t)(i % 64) * 64;
        for (int u = 0; u < 4; ++u) *reinterpret_cast<uint4*>(slot + 16 * u) = make_uint4(i, u, 1, 2);
        asm volatile("fence.release.sys;" ::: "memory");
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(host + 4), "r"(i) : "memory");
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(host + 8), "l"((uint64_t)i) : "memory");
    }
    out[0] = globaltimer() - t0;
    *stop = 1;
}

int main() {
    uint8_t* host;
    uint64_t* word;
    uint8_t* host_d;
    uint64_t* word_d;
    int* stop;
    unsigned long long* out;
    CHECK(cudaHostAlloc(&host, 1 << 16, cudaHostAllocMapped));
    CHECK(cudaHostAlloc(&word, 4096, cudaHostAllocMapped));
    CHECK(cudaHostGetDevicePointer(&host_d, host, 0));
    CHECK(cudaHostGetDevicePointer(&word_d, word, 0));
    CHECK(cudaMalloc(&stop, sizeof(int)));
    CHECK(cudaMallocManaged(&out, 2 * sizeof(unsigned long long)));
    const uint32_t iters = 20000;
    enum { ALONE, POLL_ACQUIRE, POLL_RELAXED, CPU_READS, POLL_CPU_WRITES, CASES };
    const char* names[CASES] = {"nothing", "a CTA polling (ld.acquire.sys)",
                                "a CTA polling (ld.relaxed.sys)",
                                "a CPU thread reading the written lines",
                                "a CTA polling a word a CPU thread writes"};
    for (int rep = 0; rep < 3; ++rep) {
        for (int c = 0; c < CASES; ++c) {
            CHECK(cudaMemset(stop, 0, sizeof(int)));
            std::atomic<bool> run{true};
            std::thread cpu;
            if (c == CPU_READS) {
                cpu = std::thread([&] {
                    volatile uint64_t* a = reinterpret_cast<volatile uint64_t*>(host + 8);
                    volatile uint64_t* b = reinterpret_cast<volatile uint64_t*>(host + 64);
                    uint64_t s = 0;
                    while (run) s += *a + *b;
                    (void)s;
                });
            } else if (c == POLL_CPU_WRITES) {
                cpu = std::thread([&] {
                    volatile uint64_t* a = word;
                    for (uint64_t i = 1; run; ++i) {
                        *a = i;
                        for (int j = 0; j < 200; ++j) asm volatile("pause");
                    }
                });
            }
            const int poll = c == POLL_RELAXED ? 2 : (c == POLL_ACQUIRE || c == POLL_CPU_WRITES ? 1 : 0);
            fence_polled<<<poll ? 2 : 1, 32>>>(host_d, word_d, stop, poll, iters, out);
            const cudaError_t e = cudaGetLastError();
            const cudaError_t s = cudaDeviceSynchronize();
            run = false;
            if (cpu.joinable()) cpu.join();
            CHECK(e);
            CHECK(s);
            std::printf("rep %d, meanwhile %-42s %7.1f ns per iteration\n", rep, names[c],
                        (double)out[0] / iters);
        }
    }
    return 0;
}
