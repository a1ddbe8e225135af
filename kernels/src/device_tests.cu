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
    device_tests::report(out, s, e);
    __syncthreads();
    if (t == 0) {
        s = quiet(q, budget, &e);
        device_tests::report(out, s, e);
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
    device_tests::report(out, s, e);
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
    device_tests::report(out, s, e);
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
    device_tests::report(out, s, e);
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
