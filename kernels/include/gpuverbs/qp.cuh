// gpuverbs device API: drive an exported RC QP from CUDA kernels.
//
// Layers, low to high:
//   reserve  -> wqe slots (lock-free, back-pressure against the send CQ)
//   prepare  -> write one WQE of each kind into its slots (whole blocks, unused bytes zero)
//   publish  -> make WQEs visible in order
//   ring     -> tell the device (GPU doorbell, BlueFlame, or CPU-proxy producer word)
//               (ring_multi: several QPs at once, two fences in all)
//   poll     -> take CQEs, retire SQ space, report errors (last_error; qp_error without polling)
//   high level: put, put_imm, put_inline, put_value, put_signal, put_signal_set, signal,
//               signal_set, send, send_inline, get, get_wait, atomic_fetch_add,
//               atomic_compare_swap (8 bytes), atomic_fetch_add32, atomic_compare_swap32
//               (4 bytes; atomic_result32 reads their big-endian old value),
//               atomic_masked_fetch_add, atomic_masked_compare_swap (8 bytes),
//               atomic_masked_fetch_add32, atomic_masked_compare_swap32 (4 bytes);
//               wait_signal, wait_signal_rolling, read_signal, reset_signal (a local
//               signal word; the rolling wait is NCCL GIN's comparison modulo 2^bits);
//               counted calls (a local completion counter moved by the CQ poll path):
//               put_counted, get_counted, put_signal_counted, put_signal_set_counted, with
//               read_counter, wait_counter, wait_counter_rolling, reset_counter;
//               quiet, flush, flush_all (several QPs), wait_ticket, fence;
//               warp scope (`*_warp`) and block scope (`*_block`) of put, get, signal,
//               signal_set, put_signal, put_signal_set, every atomic above, the counted
//               calls, flush and get_wait.
//   receive side: post_recv, recv_wait.
//   DC initiators: dc_put, dc_get, dc_atomic_fetch_add, dc_atomic_compare_swap.
//
// Every wait takes a budget in nanoseconds (%globaltimer) and returns a status; nothing spins
// forever, and an error CQE is reported (with its syndrome) rather than waited past. A call's
// budget is its total: one deadline covers every wait inside it (reserve, publish, the doorbell
// lock, CQ polling), including retries of a lost CAS.
//
// Ordering: WQE bytes are released before the doorbell (or producer word) that announces them,
// at system scope when the rings live in host memory (ring_loc 0), at GPU scope otherwise. See
// docs/memory-ordering.md.
//
// The layers live in their own headers, each including the ones below it:
//   common.cuh   statuses, keys, byte order, the call clock, memory-ordering primitives
//   state.cuh    the QP's device-API state at the scope of the sharing mode
//   wqe.cuh      WQE formats and segment writers
//   cq.cuh       completions
//   sq.cuh       reserve, publish, ring; exclusive ownership in registers
//   onesided.cuh high-level operations at thread scope
//   recv.cuh     the receive side
//   scope.cuh    warp and block scope (warp_post, block_post and the calls made of them)
//   dc.cuh       DC initiators: put, get and atomics naming a DC target's address vector
//   counter.cuh  counters the NIC moves through a companion QP (put_counter, get_counter,
//                signal_counter, put_signal_counter at every scope; wait_counter of both)
// This header includes them all (as does <gpuverbs/gpuverbs.cuh>).
#ifndef GPUVERBS_QP_CUH
#define GPUVERBS_QP_CUH

#include "common.cuh"
#include "state.cuh"
#include "wqe.cuh"
#include "cq.cuh"
#include "sq.cuh"
#include "onesided.cuh"
#include "recv.cuh"
#include "scope.cuh"
#include "dc.cuh"
#include "counter.cuh"

#endif  // GPUVERBS_QP_CUH
