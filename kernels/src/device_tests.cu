// Kernels the GPU test suite launches: each drives an exported QP through the public device
// API and reports a status the host checks (payloads are verified on the host).
#include <gpuverbs/gpuverbs.cuh>
#include <gpuverbs/qp.cuh>

namespace device_tests {

// Records the first non-OK status (and its error) of any thread.
GPUVERBS_DEVICE void report(int* out, gpuverbs::status s, const gpuverbs::error& e) {
    if (s != gpuverbs::OK && atomicCAS(out, 0, (int)s) == 0) {
        out[1] = e.syndrome;
        out[2] = e.vendor;
        out[3] = e.wqe_counter;
    }
}

}  // namespace device_tests

// Scope codes: 0 thread, 1 warp, 2 block.
// Each participating thread writes `iters` messages of `size` bytes from its slice of the local
// buffer to the same slice of the remote buffer; the last thread of each block calls quiet.
// `skip_mod`: threads with (thread index % skip_mod == skip_mod - 1) do not take part (partial
// warps and blocks); 0 = everyone takes part.
GPUVERBS_KERNEL void gv_test_put(gpuverbs_qp* q, uint64_t lbase, uint32_t lk, uint64_t rbase,
                                 uint32_t rk, uint32_t size, uint32_t iters, uint32_t scope,
                                 uint32_t skip_mod, uint32_t signal_every, uint64_t budget,
                                 int* out) {
    using namespace gpuverbs;
    const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    const bool part = skip_mod == 0 || (threadIdx.x % skip_mod) != skip_mod - 1;
    status s = OK;
    for (uint32_t i = 0; i < iters && s == OK; ++i) {
        uint64_t off = ((uint64_t)tid * iters + i) * size;
        bool sig = signal_every && ((i + 1) % signal_every == 0);
        if (scope == 2) {
            s = put_block(q, part, lbase + off, lkey{lk}, rbase + off, rkey{rk}, size, sig, budget);
        } else if (!part) {
            break;
        } else if (scope == 1) {
            s = put_warp(q, lbase + off, lkey{lk}, rbase + off, rkey{rk}, size, sig, budget);
        } else {
            s = put(q, lbase + off, lkey{lk}, rbase + off, rkey{rk}, size, sig, budget);
        }
    }
    error e{};
    if (s != OK) e = last_error(q);
    device_tests::report(out, s, e);
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) {
        s = quiet(q, budget, &e);
        device_tests::report(out, s, e);
    }
}

// Same as gv_test_put with thread scope and exclusive sharing (one thread in the grid), on the
// QP's state checked out into registers and checked in at the end. While it is checked out, a
// second checkout and calls through `q` must return BUSY (else the kernel reports INVALID with
// out[4] = 1). Some writes are released ahead (release_ahead) and rung with its token, with
// nothing posted in between (a ring without a fence) and with one more write posted in between
// (the token does not cover it: that ring fences).
GPUVERBS_KERNEL void gv_test_put_exclusive(gpuverbs_qp* q, uint64_t lbase, uint32_t lk,
                                           uint64_t rbase, uint32_t rk, uint32_t size,
                                           uint32_t iters, uint32_t signal_every,
                                           uint64_t budget, int* out) {
    using namespace gpuverbs;
    gpuverbs_qp mine;
    status s = checkout(q, &mine);
    error e{};
    if (s != OK) {
        device_tests::report(out, s, e);
        return;
    }
    gpuverbs_qp other;
    if (checkout(q, &other) != BUSY ||
        put<sharing::gpu>(q, lbase, lkey{lk}, rbase, rkey{rk}, size, true, budget) != BUSY ||
        quiet<sharing::gpu>(q, budget) != BUSY || ring<sharing::gpu>(q, budget) != BUSY) {
        out[4] = 1;
        s = INVALID;
    }
    released early;
    if (s == OK && release_ahead<sharing::exclusive>(q, &early) != BUSY) {
        out[4] = 1;
        s = INVALID;
    }
    for (uint32_t i = 0; i < iters && s == OK; ++i) {
        uint64_t off = (uint64_t)i * size;
        bool sig = signal_every && ((i + 1) % signal_every == 0);
        // i % 4: 0 a put that rings; 1 posted, released ahead and rung with the token (the
        // ring without a fence); 2 posted and released ahead; 3 posted, then one ring with the
        // token of 2, which does not cover 3 (it fences). The last write rings in any case.
        const uint32_t step = i + 1 == iters ? 0 : i % 4;
        s = put<sharing::exclusive>(&mine, lbase + off, lkey{lk}, rbase + off, rkey{rk}, size,
                                    sig, budget, step == 0);
        if (s == OK && (step == 1 || step == 2)) {
            s = release_ahead<sharing::exclusive>(&mine, &early);
        }
        if (s == OK && (step == 1 || step == 3)) s = ring<sharing::exclusive>(&mine, budget, early);
    }
    if (s == OK) s = quiet<sharing::exclusive>(&mine, budget, &e);
    else if (s == ERROR_CQE) e = last_error(&mine);
    checkin(q, mine);
    device_tests::report(out, s, e);
}

// The other high-level operations, one thread:
//  put_inline of 40 bytes to remote+0 (and of 37 bytes from an unaligned source, payload+1, to
//  remote+600, and of 6 from payload+4 to remote+700: the words a payload's end cuts), put_signal of 64 bytes to remote+64 with +1 on sig,
//  signal +5 on sig, get of 64 bytes from remote+256 into local+512, fetch-add +7 on
//  remote word at remote+1024 with the old value to local+1024, compare-swap on remote+1032
//  (compare 11, swap 22) with the old value to local+1032; 4-byte: fetch-add +3 on remote+1040
//  (old value, big-endian, to local+1040), compare-swap on remote+1044 (compare 55, swap 66;
//  old value to local+1044); a masked 8-byte fetch-add of 1 on remote+1048 with a field
//  boundary at bit 31 (old value to local+1048); a masked compare-swap on remote+1056 (compare
//  bits 47..32 with 0x2222, swap bits 31..16 from 0xcccc; old value to local+1064); signal_set
//  of 0x77 on remote+1072; a masked 4-byte fetch-add of 0x0001_0001 on remote+1080 with byte
//  fields (boundaries 0x8080_8080; old value, big-endian, to local+1080); a masked 4-byte
//  compare-swap on remote+1084 (compare bits 15..8 with 0x56, swap bits 31..16 from 0xabcd;
//  old value to local+1084); then quiet, and the two 4-byte old values of the plain 4-byte
//  atomics read with atomic_result32 into local+1056 and local+1060 (host order).
GPUVERBS_KERNEL void gv_test_ops(gpuverbs_qp* q, uint64_t lbase, uint32_t lk, uint64_t rbase,
                                 uint32_t rk, uint64_t sig, uint32_t sig_key, uint64_t budget,
                                 int* out) {
    using namespace gpuverbs;
    uint8_t payload[40];
    for (int i = 0; i < 40; ++i) payload[i] = (uint8_t)(0xA0 + i);
    error e{};
    status s = put_inline(q, payload, 40, rbase, rkey{rk}, false, budget);
    if (s == OK) s = put_inline(q, payload + 1, 37, rbase + 600, rkey{rk}, false, budget);
    if (s == OK) s = put_inline(q, payload + 4, 6, rbase + 700, rkey{rk}, false, budget);
    if (s == OK) s = put_signal(q, lbase + 64, lkey{lk}, rbase + 64, rkey{rk}, 64, sig,
                                rkey{sig_key}, 1, false, budget);
    if (s == OK) s = signal(q, sig, rkey{sig_key}, 5, false, budget);
    if (s == OK) s = get(q, lbase + 512, lkey{lk}, rbase + 256, rkey{rk}, 64, false, budget);
    if (s == OK) s = atomic_fetch_add(q, rbase + 1024, rkey{rk}, 7, lbase + 1024, lkey{lk}, budget);
    if (s == OK) s = atomic_compare_swap(q, rbase + 1032, rkey{rk}, 11, 22, lbase + 1032,
                                         lkey{lk}, budget);
    if (s == OK)
        s = atomic_fetch_add32(q, rbase + 1040, rkey{rk}, 3, lbase + 1040, lkey{lk}, budget);
    if (s == OK)
        s = atomic_compare_swap32(q, rbase + 1044, rkey{rk}, 55, 66, lbase + 1044, lkey{lk},
                                  budget);
    if (s == OK)
        s = atomic_masked_fetch_add(q, rbase + 1048, rkey{rk}, 1, 0x8000000080000000ull,
                                    lbase + 1048, lkey{lk}, budget);
    if (s == OK)
        s = atomic_masked_compare_swap(q, rbase + 1056, rkey{rk}, 0x0000222200000000ull,
                                       0x0000ffff00000000ull, 0xaaaabbbbccccddddull,
                                       0x00000000ffff0000ull, lbase + 1064, lkey{lk}, budget);
    if (s == OK) s = signal_set(q, rbase + 1072, rkey{rk}, 0x77, false, budget);
    if (s == OK)
        s = atomic_masked_fetch_add32(q, rbase + 1080, rkey{rk}, 0x00010001u, 0x80808080u,
                                      lbase + 1080, lkey{lk}, budget);
    if (s == OK)
        s = atomic_masked_compare_swap32(q, rbase + 1084, rkey{rk}, 0x00005600u, 0x0000ff00u,
                                         0xabcdef01u, 0xffff0000u, lbase + 1084, lkey{lk},
                                         budget);
    if (s == OK) s = quiet(q, budget, &e);
    else e = last_error(q);
    if (s == OK) {
        uint32_t* host_order = reinterpret_cast<uint32_t*>(lbase + 1056);
        host_order[0] = atomic_result32(reinterpret_cast<const void*>(lbase + 1040));
        host_order[1] = atomic_result32(reinterpret_cast<const void*>(lbase + 1044));
        __threadfence_system();
    }
    device_tests::report(out, s, e);
}

// DC from one thread, on a DC initiator, to the target whose address vector is av0..av2:
// dc_put of 64 bytes local+0 -> remote+0, dc_get of 64 bytes remote+256 -> local+512,
// dc_atomic_fetch_add +7 on remote+1024 (old value to local+1024), dc_atomic_compare_swap on
// remote+1032 (compare 11, swap 22; old value to local+1032), then quiet.
GPUVERBS_KERNEL void gv_test_dc(gpuverbs_qp* q, uint4 av0, uint4 av1, uint4 av2, uint64_t lbase,
                                uint32_t lk, uint64_t rbase, uint32_t rk, uint64_t budget,
                                int* out) {
    using namespace gpuverbs;
    const dc_av av{{av0, av1, av2}};
    error e{};
    status s = dc_put(q, av, lbase, lkey{lk}, rbase, rkey{rk}, 64, false, budget);
    if (s == OK) s = dc_get(q, av, lbase + 512, lkey{lk}, rbase + 256, rkey{rk}, 64, false, budget);
    if (s == OK)
        s = dc_atomic_fetch_add(q, av, rbase + 1024, rkey{rk}, 7, lbase + 1024, lkey{lk}, budget);
    if (s == OK)
        s = dc_atomic_compare_swap(q, av, rbase + 1032, rkey{rk}, 11, 22, lbase + 1032, lkey{lk},
                                   budget);
    if (s == OK) s = quiet(q, budget, &e);
    else e = last_error(q);
    device_tests::report(out, s, e);
}

// Waits on a local signal word until it reaches `value`; reports the status (TIMEOUT expected
// when nobody signals).
GPUVERBS_KERNEL void gv_test_wait_signal(const uint64_t* sig, uint64_t value, uint64_t budget,
                                         int* out) {
    gpuverbs::error e{};
    device_tests::report(out, gpuverbs::wait_signal(sig, value, budget), e);
    if (out[0] == 0) out[4] = 1;  // reached
}

// Payload in GPU memory, produced and consumed by the kernel: the block fills `n` bytes
// (n % 4 == 0) at `local` (device memory, registered with lkey `lk`) with
// gpuverbs_selftest_value(seed, word); thread 0 puts them to `remote`, quiets, gets them back
// into `local + n`, quiets; then the block checks every word it got back, loading them past
// the L1 (the device wrote them with copies the SMs did not see). out[4] = index + 1 of a
// mismatching word (status INVALID), 0 when all match.
GPUVERBS_KERNEL void gv_test_gpumem_roundtrip(gpuverbs_qp* q, uint64_t local, uint32_t lk,
                                              uint64_t remote, uint32_t rk, uint32_t n,
                                              uint32_t seed, uint64_t budget, int* out) {
    using namespace gpuverbs;
    uint32_t* words = reinterpret_cast<uint32_t*>(local);
    const uint32_t count = n / 4;
    for (uint32_t i = threadIdx.x; i < count; i += blockDim.x) {
        words[i] = gpuverbs_selftest_value(seed, i);
    }
    __syncthreads();
    __shared__ int st;
    if (threadIdx.x == 0) {
        error e{};
        status s = put(q, local, lkey{lk}, remote, rkey{rk}, n, false, budget);
        if (s == OK) s = quiet(q, budget, &e);
        if (s == OK) s = get(q, local + n, lkey{lk}, remote, rkey{rk}, n, false, budget);
        if (s == OK) s = quiet(q, budget, &e);
        if (s != OK && e.syndrome == 0) e = last_error(q);
        device_tests::report(out, s, e);
        st = s;
    }
    __syncthreads();
    if (st != OK) return;
    for (uint32_t i = threadIdx.x; i < count; i += blockDim.x) {
        if (__ldcv(words + count + i) != gpuverbs_selftest_value(seed, i)) {
            if (atomicCAS(&out[4], 0, (int)i + 1) == 0) atomicCAS(out, 0, (int)INVALID);
        }
    }
}

// Many CTAs, each with a private QP (CTA sharing): block b drives QP qps[b] and writes `iters`
// messages of `size` bytes per thread from its pair's source to the same slice of its
// destination (every 4th signaled, so each thread's last WQE is); the last thread of each block
// then waits for the block's last ticket with wait_ticket.
GPUVERBS_KERNEL void gv_test_put_private(const uint64_t* qps, const uint64_t* lbases,
                                         const uint32_t* lks, const uint64_t* rbases,
                                         const uint32_t* rks, uint32_t size, uint32_t iters,
                                         uint64_t budget, int* out) {
    using namespace gpuverbs;
    gpuverbs_qp* q = reinterpret_cast<gpuverbs_qp*>(qps[blockIdx.x]);
    const uint64_t lbase = lbases[blockIdx.x], rbase = rbases[blockIdx.x];
    const lkey lk{lks[blockIdx.x]};
    const rkey rk{rks[blockIdx.x]};
    status s = OK;
    for (uint32_t i = 0; i < iters && s == OK; ++i) {
        uint64_t off = ((uint64_t)threadIdx.x * iters + i) * size;
        s = put<sharing::cta>(q, lbase + off, lk, rbase + off, rk, size, (i + 1) % 4 == 0, budget);
    }
    error e{};
    if (s != OK) e = last_error(q);
    device_tests::report(out, s, e);
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) {
        s = wait_ticket<sharing::cta>(q, ld_acquire_gpu64(&q->sq_ready), budget, &e);
        device_tests::report(out, s, e);
    }
}

// Receive side, two QPs of one connection, one thread each. Block 0 is the receiver on `rq`:
// it posts n_imm + n_send receive buffers of `rsize` bytes (at rbuf + k * rsize, lkey rlk),
// raises *ready, then takes n_imm + n_send receive completions into comps[4k..4k+3] =
// {opcode, imm, byte_count, wqe_counter}, reporting into out_recv. Block 1 is the sender on
// `sq`: once *ready, it writes n_imm messages of `size` bytes from src + k * size to
// dst + k * size with immediate 0x1000 + k, then sends n_send messages from
// src + (n_imm + k) * size (SEND_IMM with 0x2000 + k for odd k), then quiets, reporting into
// out_send. With `src_dev` (the source as the GPU sees it; 0: none) the sends are send_inline
// calls copying from src_dev + (n_imm + k) * size.
GPUVERBS_KERNEL void gv_test_recv(gpuverbs_qp* sq, gpuverbs_qp* rq, uint64_t src, uint32_t slk,
                                  const uint8_t* src_dev, uint64_t dst, uint32_t drk,
                                  uint32_t size, uint32_t n_imm, uint32_t n_send, uint64_t rbuf,
                                  uint32_t rlk, uint32_t rsize, uint32_t* ready, uint32_t* comps,
                                  uint64_t budget, int* out_recv, int* out_send) {
    using namespace gpuverbs;
    if (threadIdx.x != 0) return;
    error e{};
    status s = OK;
    if (blockIdx.x == 0) {
        for (uint32_t k = 0; k < n_imm + n_send && s == OK; ++k) {
            s = post_recv<sharing::exclusive>(rq, rbuf + (uint64_t)k * rsize, lkey{rlk}, rsize,
                                              budget);
        }
        atomicExch(ready, 1u);
        for (uint32_t k = 0; k < n_imm + n_send && s == OK; ++k) {
            recv_completion c{};
            s = recv_wait<sharing::exclusive>(rq, &c, budget, &e);
            if (s == OK) {
                comps[4 * k] = c.opcode;
                comps[4 * k + 1] = c.imm;
                comps[4 * k + 2] = c.byte_count;
                comps[4 * k + 3] = c.wqe_counter;
            }
        }
        device_tests::report(out_recv, s, e);
        return;
    }
    const uint64_t deadline = now_ns() + budget;
    while (atomicAdd(ready, 0u) == 0u) {
        if (now_ns() > deadline) {
            device_tests::report(out_send, TIMEOUT, e);
            return;
        }
    }
    for (uint32_t k = 0; k < n_imm && s == OK; ++k) {
        const uint64_t off = (uint64_t)k * size;
        s = put_imm<sharing::exclusive>(sq, src + off, lkey{slk}, dst + off, rkey{drk}, size,
                                        0x1000u + k, false, budget);
    }
    for (uint32_t k = 0; k < n_send && s == OK; ++k) {
        const uint64_t off = (uint64_t)(n_imm + k) * size;
        s = src_dev != nullptr
                ? send_inline<sharing::exclusive>(sq, src_dev + off, size, k % 2 == 1,
                                                  0x2000u + k, false, budget)
                : send<sharing::exclusive>(sq, src + off, lkey{slk}, size, k % 2 == 1,
                                           0x2000u + k, false, budget);
    }
    if (s == OK) {
        s = quiet<sharing::exclusive>(sq, budget, &e);
    } else if (s == ERROR_CQE) {
        e = last_error(sq);
    }
    device_tests::report(out_send, s, e);
}

// One status path of the device API, measured: out[0] = the status the call returned, out[1] =
// how long that call took (ns, %globaltimer), out[2] = the status of a follow-up call (case 5),
// out[3] = how many calls returned OK first (case 0, 4). One thread unless the case says so.
//   0 reserve TIMEOUT: unsignaled puts never rung fill the SQ; the next put waits its budget.
//   1 doorbell TIMEOUT (the host holds the doorbell: sq_rung = RUNG_HELD): a put's ring waits
//     its budget.
//   2 receive-lock TIMEOUT (the host set rq_lock): post_recv waits its budget.
//   3 recv_wait TIMEOUT: nothing arrives.
//   4 wait_ticket TIMEOUT: a ticket past everything posted.
//   5 shared publish TIMEOUT, then BROKEN: two threads; thread 0 reserves one block and never
//     publishes it; thread 1's put times out in publish (its budget), and its next put is BROKEN.
//   6 post_recv FULL: one more receive than the RQ holds.
//   7 put_inline INVALID: more inline bytes than the QP takes.
//   8 quiet TIMEOUT (the host holds the doorbell): one budget for the NOP's reserve, publish, ring
//     and the poll.
GPUVERBS_KERNEL void gv_test_status(gpuverbs_qp* q, uint32_t which, uint64_t budget,
                                    uint64_t laddr, uint32_t lk, uint64_t raddr, uint32_t rk,
                                    uint64_t* out) {
    using namespace gpuverbs;
    status s = OK;
    uint64_t t0 = 0, t1 = 0;
    if (which == 5) {
        __shared__ int step;
        if (threadIdx.x == 0) {
            uint64_t start;
            step = (int)reserve<sharing::gpu>(q, 1, budget, &start);
        }
        __syncthreads();
        if (threadIdx.x == 1) {
            if (step != OK) {
                out[0] = 100 + step;
                return;
            }
            t0 = now_ns();
            s = put(q, laddr, lkey{lk}, raddr, rkey{rk}, 8, true, budget);
            t1 = now_ns();
            out[2] = (uint64_t)put(q, laddr, lkey{lk}, raddr, rkey{rk}, 8, true, budget);
            out[0] = (uint64_t)s;
            out[1] = t1 - t0;
        }
        return;
    }
    if (threadIdx.x != 0) return;
    uint64_t ok = 0;
    switch (which) {
        case 0:
            for (;;) {
                t0 = now_ns();
                s = put(q, laddr, lkey{lk}, raddr, rkey{rk}, 8, false, budget, false);
                t1 = now_ns();
                if (s != OK || ok > 1u << 20) break;
                ++ok;
            }
            break;
        case 1:
            t0 = now_ns();
            s = put(q, laddr, lkey{lk}, raddr, rkey{rk}, 8, true, budget);
            t1 = now_ns();
            break;
        case 2:
            t0 = now_ns();
            s = post_recv(q, laddr, lkey{lk}, 64, budget);
            t1 = now_ns();
            break;
        case 3: {
            recv_completion rc{};
            t0 = now_ns();
            s = recv_wait(q, &rc, budget);
            t1 = now_ns();
            break;
        }
        case 4:
            t0 = now_ns();
            s = wait_ticket(q, state_load<sharing::gpu>(&q->sq_ready) + 100, budget);
            t1 = now_ns();
            break;
        case 6:
            for (uint32_t i = 0; i <= q->rq_wqes; ++i) {
                t0 = now_ns();
                s = post_recv(q, laddr, lkey{lk}, 64, budget);
                t1 = now_ns();
                if (s != OK) break;
                ++ok;
            }
            break;
        case 7: {
            uint8_t bytes[16] = {};
            t0 = now_ns();
            s = put_inline(q, bytes, q->max_inline + 1, raddr, rkey{rk}, true, budget);
            t1 = now_ns();
            break;
        }
        case 8:
            // an unsignaled WQE written and published, not rung: quiet must post a NOP
            s = put(q, laddr, lkey{lk}, raddr, rkey{rk}, 8, false, budget, false);
            if (s != OK) break;
            t0 = now_ns();
            s = quiet(q, budget);
            t1 = now_ns();
            break;
        default:
            s = INVALID;
    }
    out[0] = (uint64_t)s;
    out[1] = t1 - t0;
    out[3] = ok;
}
