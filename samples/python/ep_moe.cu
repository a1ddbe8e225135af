// Expert-parallel dispatch and combine over gpuverbs, driven by the GPU (samples/python/ep_moe.py
// builds this file with nvcc against gpuverbs.include_dir() and launches it through CuPy).
//
// Every rank holds one registered window in GPU memory, laid out the same on every rank:
//   disp  [N][T] packed rows   tokens rank s dispatched to this rank, in rank s's send order
//   comb  [N][T] hidden rows   what rank d combined for the tokens this rank sent it
//   cnt   [N] u64              how many rows rank s dispatched here (its count)
//   dsig  [N] u64              rank s's dispatch signal: +1 per round
//   csig  [N] u64              rank d's combine signal: +1 per round
// A packed row is the token's H bf16 values, then its top-k expert ids (i32) and weights (f32),
// padded to 16 bytes. Rows go out as RDMA writes (one per token and destination), then the
// count (an inline write) and the signal (an atomic add) on the same RC QP, so the receiver that
// sees the signal sees the rows. A rank's own rows are copied in place, signalled by a store.
#include <gpuverbs/gpuverbs.cuh>
#include <cuda_bf16.h>

namespace ep {

using namespace gpuverbs;

struct Args {
    const uint64_t* qp;      // [N] exported QP descriptors (0 for this rank)
    const uint64_t* rbase;   // [N] every rank's window address
    const uint32_t* rkey;    // [N] every rank's window rkey
    uint8_t* win;            // this rank's window (GPU memory)
    uint64_t send_addr;      // packed rows of this rank's tokens [T] (registered)
    const uint8_t* send;     // the same, as the GPU addresses it
    uint32_t send_lkey;
    uint64_t cout_addr;      // combine rows going out [N][T] (registered)
    uint8_t* cout;
    uint32_t cout_lkey;
    uint64_t pack_addr;      // dispatch rows gathered per destination [N][T] (registered)
    uint8_t* pack;
    uint32_t pack_lkey;
    uint32_t chunk_rows;     // rows per put of the chunked kernels
    const int32_t* send_idx; // [N][T] token of each send slot, per destination
    const int32_t* send_cnt; // [N]
    const int32_t* slot_of;  // [N][T] send slot of token t at destination d, or -1
    uint32_t rank, nranks, tokens, hidden, topk, experts_per_rank;
    uint32_t row_bytes;      // packed row
    uint64_t off_comb, off_cnt, off_dsig, off_csig;
    uint64_t budget_ns;
    uint32_t* done;          // [2][N] blocks finished per destination, dispatch and combine
                             // (zeroed before each round)
    int* status;             // {status, syndrome, vendor, wqe_counter, stage}
    float* out;              // [T][H] combined tokens
};

GPUVERBS_DEVICE void report(int* st, int stage, status s, error e) {
    if (s != OK && atomicCAS(st, 0, (int)s) == 0) {
        st[1] = e.syndrome;
        st[2] = e.vendor;
        st[3] = e.wqe_counter;
        st[4] = stage;
    }
}

GPUVERBS_DEVICE error err_of(uint64_t q, status s) {
    return s == ERROR_CQE ? last_error((gpuverbs_qp*)q) : error{};
}

GPUVERBS_DEVICE uint64_t* word(const Args& a, uint64_t off, uint32_t i) {
    return (uint64_t*)(a.win + off + 8ull * i);
}

// Expert e scales a token by 2^((e % 3) - 1): exact in bf16 and f32, so the host's reference
// matches bit for bit.
GPUVERBS_DEVICE float expert_scale(int32_t e) {
    const int m = e % 3;
    return m == 0 ? 0.5f : (m == 1 ? 1.0f : 2.0f);
}

// After a block's last row: the last block of destination `d` sends the count and the signal
// (remote) or stores them (local), then waits for every WQE of the QP to complete.
GPUVERBS_DEVICE void finish(const Args& a, uint32_t d, uint64_t off_sig, uint64_t count,
                            bool with_count, int stage) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    __threadfence();
    uint32_t* done = a.done + (with_count ? 0 : a.nranks);
    if (atomicAdd(&done[d], 1u) != gridDim.y - 1) return;
    const uint64_t q = a.qp[d];
    const uint32_t me = a.rank;
    if (q == 0) {
        if (with_count) *word(a, a.off_cnt, me) = count;
        __threadfence_system();
        atomicAdd((unsigned long long*)word(a, off_sig, me), 1ull);
        return;
    }
    gpuverbs_qp* qp = (gpuverbs_qp*)q;
    const rkey rk{a.rkey[d]};
    status s = OK;
    if (with_count) {
        s = put_inline(qp, &count, 8, a.rbase[d] + a.off_cnt + 8ull * me, rk, false,
                       a.budget_ns);
    }
    if (s == OK) s = signal(qp, a.rbase[d] + off_sig + 8ull * me, rk, 1, false, a.budget_ns);
    error e{};
    if (s == OK) s = quiet(qp, a.budget_ns, &e);
    else e = err_of(q, s);
    report(a.status, stage, s, e);
}

// Row `i` of the rows bound to destination `d`: where it goes in `d`'s window.
GPUVERBS_DEVICE uint64_t disp_off(const Args& a, uint32_t i) {
    return (uint64_t)(a.rank * a.tokens + i) * a.row_bytes;
}

// A rank's own row `i`: copied into its window in place.
GPUVERBS_DEVICE void copy_own_row(const Args& a, uint32_t d, uint32_t i) {
    const int32_t t = a.send_idx[d * a.tokens + i];
    const uint4* src = (const uint4*)(a.send + (uint64_t)t * a.row_bytes);
    uint4* dst = (uint4*)(a.win + disp_off(a, i));
    for (uint32_t w = 0; w < a.row_bytes / 16; ++w) dst[w] = src[w];
}

// The rows [lo, hi) of the `n` bound to one destination (or from one source) that block
// blockIdx.y of gridDim.y takes in the chunked kernels: contiguous shares.
GPUVERBS_DEVICE void block_share(uint64_t n, uint64_t* lo, uint64_t* hi) {
    const uint64_t per = (n + gridDim.y - 1) / gridDim.y;
    *lo = min(n, (uint64_t)blockIdx.y * per);
    *hi = min(n, *lo + per);
}

// The combine of row `i` from source `s_rank` (this rank's experts, weighted), by the block's
// threads, into `y`.
GPUVERBS_DEVICE void combine_row(const Args& a, uint32_t s_rank, uint32_t i, __nv_bfloat16* y) {
    const uint8_t* row = a.win + (uint64_t)(s_rank * a.tokens + i) * a.row_bytes;
    const __nv_bfloat16* x = (const __nv_bfloat16*)row;
    const uint32_t hrow = a.hidden * 2;
    const int32_t* ids = (const int32_t*)(row + hrow);
    const float* wts = (const float*)(row + hrow + 4 * a.topk);
    for (uint32_t h = threadIdx.x; h < a.hidden; h += blockDim.x) {
        const float xv = __bfloat162float(x[h]);
        float acc = 0.0f;
        for (uint32_t j = 0; j < a.topk; ++j) {
            if ((uint32_t)ids[j] / a.experts_per_rank == a.rank) {
                acc += wts[j] * expert_scale(ids[j]) * xv;
            }
        }
        y[h] = __float2bfloat16_rn(acc);
    }
}

// Thread 0: waits for rank `s_rank`'s dispatch of this round; every thread learns whether it
// came.
GPUVERBS_DEVICE bool wait_rows(const Args& a, uint32_t s_rank, uint64_t round) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        status s = wait_signal(word(a, a.off_dsig, s_rank), round, a.budget_ns);
        report(a.status, 3, s, error{});
        ok = s == OK;
    }
    __syncthreads();
    return ok;
}

// A combine block's start: waits for rank `s_rank`'s dispatch of this round and reads how many
// rows it sent (`n`); false (and a status reported) when it did not come.
GPUVERBS_DEVICE bool rows_from(const Args& a, uint32_t s_rank, uint64_t round, uint64_t* n) {
    if (!wait_rows(a, s_rank, round)) return false;
    *n = *(volatile uint64_t*)word(a, a.off_cnt, s_rank);
    return true;
}

}  // namespace ep

// grid (N, B): blockIdx.x is the destination rank; each of its B blocks writes a share of the
// rows bound there, one thread per row (a WQE and a doorbell each).
GPUVERBS_KERNEL void ep_dispatch(const ep::Args* ap) {
    using namespace gpuverbs;
    const ep::Args a = *ap;
    const uint32_t d = blockIdx.x;
    const int32_t n = a.send_cnt[d];
    const uint32_t stride = gridDim.y * blockDim.x;
    const uint64_t q = a.qp[d];
    for (uint32_t i = blockIdx.y * blockDim.x + threadIdx.x; i < (uint32_t)n; i += stride) {
        if (q == 0) {
            ep::copy_own_row(a, d, i);
            continue;
        }
        const int32_t t = a.send_idx[d * a.tokens + i];
        status s = put((gpuverbs_qp*)q, a.send_addr + (uint64_t)t * a.row_bytes,
                       lkey{a.send_lkey}, a.rbase[d] + ep::disp_off(a, i), rkey{a.rkey[d]},
                       a.row_bytes, false, a.budget_ns);
        ep::report(a.status, 1, s, ep::err_of(q, s));
    }
    ep::finish(a, d, a.off_dsig, (uint64_t)n, true, 2);
}

// The same as users of warp-scope posting write it: each warp takes 32 rows bound to `d` and
// posts them with one put_warp (the lanes' WQEs prepared together, one reservation and one
// doorbell per 32 rows); the count and the signal per destination at the end, as above.
// blockDim a multiple of 32.
GPUVERBS_KERNEL void ep_dispatch_warp(const ep::Args* ap) {
    using namespace gpuverbs;
    const ep::Args a = *ap;
    const uint32_t d = blockIdx.x;
    const uint32_t n = (uint32_t)a.send_cnt[d];
    const uint64_t q = a.qp[d];
    const uint32_t warps = blockDim.x / 32, lane = threadIdx.x % 32;
    const uint32_t stride = gridDim.y * warps * 32;
    for (uint32_t base = (blockIdx.y * warps + threadIdx.x / 32) * 32; base < n; base += stride) {
        const uint32_t i = base + lane;
        if (i >= n) continue;
        if (q == 0) {
            ep::copy_own_row(a, d, i);
            continue;
        }
        const int32_t t = a.send_idx[d * a.tokens + i];
        status s = put_warp((gpuverbs_qp*)q, a.send_addr + (uint64_t)t * a.row_bytes,
                            lkey{a.send_lkey}, a.rbase[d] + ep::disp_off(a, i), rkey{a.rkey[d]},
                            a.row_bytes, false, a.budget_ns);
        ep::report(a.status, 1, s, ep::err_of(q, s));
    }
    ep::finish(a, d, a.off_dsig, (uint64_t)n, true, 2);
}

// The same as high-throughput MoE kernels send: the rows bound to `d` land in `d`'s window in
// send order, so a block gathers a contiguous share of them, chunk by chunk, into the pack
// buffer (this rank's own rows straight into its window) and thread 0 writes each chunk with
// one put; the count and the signal per destination at the end, as above.
GPUVERBS_KERNEL void ep_dispatch_chunk(const ep::Args* ap) {
    using namespace gpuverbs;
    const ep::Args a = *ap;
    const uint32_t d = blockIdx.x;
    const uint64_t n = (uint64_t)a.send_cnt[d];
    const uint64_t q = a.qp[d];
    const uint32_t words = a.row_bytes / 16;
    uint64_t lo, hi;
    ep::block_share(n, &lo, &hi);
    for (uint64_t c0 = lo; c0 < hi; c0 += a.chunk_rows) {
        const uint64_t c1 = min(hi, c0 + a.chunk_rows);
        const uint64_t packed = (uint64_t)(d * a.tokens + c0) * a.row_bytes;
        uint4* dst = (uint4*)(q == 0 ? a.win + ep::disp_off(a, (uint32_t)c0) : a.pack + packed);
        for (uint64_t w = threadIdx.x; w < (c1 - c0) * words; w += blockDim.x) {
            const int32_t t = a.send_idx[d * a.tokens + c0 + w / words];
            dst[w] = ((const uint4*)(a.send + (uint64_t)t * a.row_bytes))[w % words];
        }
        __syncthreads();
        if (q != 0 && threadIdx.x == 0) {
            // the chunk's stores (this block's threads) before the write that carries them
            __threadfence_system();
            status s = put((gpuverbs_qp*)q, a.pack_addr + packed, lkey{a.pack_lkey},
                           a.rbase[d] + ep::disp_off(a, (uint32_t)c0), rkey{a.rkey[d]},
                           (uint32_t)((c1 - c0) * a.row_bytes), false, a.budget_ns);
            ep::report(a.status, 1, s, ep::err_of(q, s));
        }
    }
    ep::finish(a, d, a.off_dsig, n, true, 2);
}

// grid 1, N threads: thread s waits for rank s's dispatch of this round.
GPUVERBS_KERNEL void ep_wait_dispatch(const ep::Args* ap, uint64_t round) {
    using namespace gpuverbs;
    const ep::Args& a = *ap;
    if (threadIdx.x < a.nranks) {
        status s = wait_signal(ep::word(a, a.off_dsig, threadIdx.x), round, a.budget_ns);
        ep::report(a.status, 3, s, error{});
    }
}

// grid (N, B): blockIdx.x is the source rank s. Waits for s's rows, runs this rank's experts on
// each (the weighted sum over the token's experts that live here) and writes the result back to
// slot i of s's combine area for this rank, a put per row by thread 0.
GPUVERBS_KERNEL void ep_combine(const ep::Args* ap, uint64_t round) {
    using namespace gpuverbs;
    const ep::Args a = *ap;
    const uint32_t s_rank = blockIdx.x;
    uint64_t n;
    if (!ep::rows_from(a, s_rank, round, &n)) return;
    const uint32_t hrow = a.hidden * 2;
    const uint64_t q = a.qp[s_rank];
    for (uint32_t i = blockIdx.y; i < n; i += gridDim.y) {
        const uint64_t slot = (uint64_t)s_rank * a.tokens + i;
        const uint64_t back = a.off_comb + (uint64_t)(a.rank * a.tokens + i) * hrow;
        // local: straight into our own combine area (slot i of rank s == us)
        ep::combine_row(a, s_rank, i,
                        (__nv_bfloat16*)(q == 0 ? a.win + back : a.cout + slot * hrow));
        __syncthreads();
        if (q != 0 && threadIdx.x == 0) {
            // the row's stores (this block's threads) before the write that carries them
            __threadfence_system();
            status s = put((gpuverbs_qp*)q, a.cout_addr + slot * hrow, lkey{a.cout_lkey},
                           a.rbase[s_rank] + back, rkey{a.rkey[s_rank]}, hrow, false,
                           a.budget_ns);
            ep::report(a.status, 4, s, ep::err_of(q, s));
        }
    }
    ep::finish(a, s_rank, a.off_csig, 0, false, 5);
}

// The same with warp-scope posting: a block combines up to 32 of its rows, then its first warp
// puts them with one put_warp (lane j the batch's row j: one doorbell per 32 rows).
GPUVERBS_KERNEL void ep_combine_warp(const ep::Args* ap, uint64_t round) {
    using namespace gpuverbs;
    const ep::Args a = *ap;
    const uint32_t s_rank = blockIdx.x;
    uint64_t n;
    if (!ep::rows_from(a, s_rank, round, &n)) return;
    const uint32_t hrow = a.hidden * 2;
    const uint64_t q = a.qp[s_rank];
    const uint64_t step = 32ull * gridDim.y;
    for (uint64_t first = blockIdx.y; first < n; first += step) {
        // rows first, first + B, ..., first + 31 B of this block
        for (uint32_t j = 0; j < 32 && first + j * gridDim.y < n; ++j) {
            const uint64_t i = first + j * gridDim.y;
            const uint64_t slot = (uint64_t)s_rank * a.tokens + i;
            const uint64_t back = a.off_comb + (uint64_t)(a.rank * a.tokens + i) * hrow;
            ep::combine_row(a, s_rank, (uint32_t)i,
                            (__nv_bfloat16*)(q == 0 ? a.win + back : a.cout + slot * hrow));
        }
        __syncthreads();
        const uint64_t i = first + (uint64_t)threadIdx.x * gridDim.y;
        if (q != 0 && threadIdx.x < 32 && i < n) {
            // the rows' stores (this block's threads) before the writes that carry them
            __threadfence_system();
            const uint64_t slot = (uint64_t)s_rank * a.tokens + i;
            status s = put_warp((gpuverbs_qp*)q, a.cout_addr + slot * hrow, lkey{a.cout_lkey},
                                a.rbase[s_rank] + a.off_comb + (uint64_t)(a.rank * a.tokens + i) * hrow,
                                rkey{a.rkey[s_rank]}, hrow, false, a.budget_ns);
            ep::report(a.status, 4, s, ep::err_of(q, s));
        }
        __syncthreads();
    }
    ep::finish(a, s_rank, a.off_csig, 0, false, 5);
}

// The same, chunked: a block combines a contiguous share of `s`'s rows, chunk by chunk, and
// thread 0 writes each chunk back with one put (the rows are contiguous at both ends).
GPUVERBS_KERNEL void ep_combine_chunk(const ep::Args* ap, uint64_t round) {
    using namespace gpuverbs;
    const ep::Args a = *ap;
    const uint32_t s_rank = blockIdx.x;
    uint64_t n;
    if (!ep::rows_from(a, s_rank, round, &n)) return;
    const uint32_t hrow = a.hidden * 2;
    const uint64_t q = a.qp[s_rank];
    uint64_t lo, hi;
    ep::block_share(n, &lo, &hi);
    for (uint64_t c0 = lo; c0 < hi; c0 += a.chunk_rows) {
        const uint64_t c1 = min(hi, c0 + a.chunk_rows);
        const uint64_t back = a.off_comb + (uint64_t)(a.rank * a.tokens + c0) * hrow;
        const uint64_t slot = (uint64_t)s_rank * a.tokens + c0;
        for (uint64_t i = c0; i < c1; ++i) {
            ep::combine_row(a, s_rank, (uint32_t)i,
                            (__nv_bfloat16*)(q == 0 ? a.win + back + (i - c0) * hrow
                                                    : a.cout + (slot + i - c0) * hrow));
        }
        __syncthreads();
        if (q != 0 && threadIdx.x == 0) {
            __threadfence_system();
            status s = put((gpuverbs_qp*)q, a.cout_addr + slot * hrow, lkey{a.cout_lkey},
                           a.rbase[s_rank] + back, rkey{a.rkey[s_rank]},
                           (uint32_t)((c1 - c0) * hrow), false, a.budget_ns);
            ep::report(a.status, 4, s, ep::err_of(q, s));
        }
    }
    ep::finish(a, s_rank, a.off_csig, 0, false, 5);
}

// grid T: token t waits for every destination's combine, then sums their rows in rank order.
GPUVERBS_KERNEL void ep_reduce(const ep::Args* ap, uint64_t round) {
    using namespace gpuverbs;
    const ep::Args a = *ap;
    const uint32_t t = blockIdx.x;
    __shared__ int ok;
    if (threadIdx.x == 0) {
        status s = OK;
        for (uint32_t d = 0; d < a.nranks && s == OK; ++d) {
            if (a.slot_of[d * a.tokens + t] >= 0) {
                s = wait_signal(ep::word(a, a.off_csig, d), round, a.budget_ns);
            }
        }
        ep::report(a.status, 6, s, error{});
        ok = s == OK;
    }
    __syncthreads();
    if (!ok) return;
    const uint32_t hrow = a.hidden * 2;
    for (uint32_t h = threadIdx.x; h < a.hidden; h += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t d = 0; d < a.nranks; ++d) {
            const int32_t slot = a.slot_of[d * a.tokens + t];
            if (slot < 0) continue;
            const __nv_bfloat16* y =
                (const __nv_bfloat16*)(a.win + a.off_comb + (uint64_t)(d * a.tokens + slot) * hrow);
            acc += __bfloat162float(y[h]);
        }
        a.out[(uint64_t)t * a.hidden + h] = acc;
    }
}

// What this file was built with: {GPUVERBS_DESC_VERSION (for Qp.export's header_version),
// sizeof(ep::Args) (the host lays the struct out with ctypes and checks it)}.
GPUVERBS_KERNEL void ep_build_info(uint32_t* out) {
    out[0] = GPUVERBS_DESC_VERSION;
    out[1] = sizeof(ep::Args);
}
