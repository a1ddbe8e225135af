// gpuverbs device API — wqe.cuh (see qp.cuh for the layers).
//
// WQE formats: segment writers (16 bytes each, one vector store) and one WQE of each kind
// written into its reserved blocks.
#ifndef GPUVERBS_WQE_CUH
#define GPUVERBS_WQE_CUH

#include "state.cuh"

#if defined(__CUDACC__)

namespace gpuverbs {

// ------------------------------------------------------------------------------------------
// WQE formats (see MLX5-FACTS): segment writers, 16 bytes each, one vector store
// ------------------------------------------------------------------------------------------

enum opcode : uint8_t {
    OP_NOP = 0x00,
    OP_RDMA_WRITE = 0x08,
    OP_RDMA_WRITE_IMM = 0x09,
    OP_SEND = 0x0a,
    OP_SEND_IMM = 0x0b,
    OP_RDMA_READ = 0x10,
    OP_ATOMIC_CS = 0x11,
    OP_ATOMIC_FA = 0x12,
    OP_ATOMIC_MASKED_CS = 0x14,
    OP_ATOMIC_MASKED_FA = 0x15,
    OP_WAIT = 0x0f,
};

// fm_ce_se bits
constexpr uint8_t CE_SIGNALED = 0x08;
constexpr uint8_t FENCE_SMALL = 0x20;
constexpr uint8_t FENCE_STRONG = 0x80;

__device__ __forceinline__ uint8_t* wqe_slot(const gpuverbs_qp* q, uint64_t block) {
    return reinterpret_cast<uint8_t*>(q->sq_ring) + ((block & (q->sq_blocks - 1)) << 6);
}

__device__ __forceinline__ uint4 seg_ctrl(uint8_t op, uint8_t opmod, uint64_t idx, uint32_t qpn,
                                          uint32_t ds, uint8_t fm_ce_se, uint32_t imm) {
    return make_uint4(bswap32((uint32_t)opmod << 24 | ((uint32_t)idx & 0xffffu) << 8 | op),
                      bswap32(qpn << 8 | ds), (uint32_t)fm_ce_se << 24, bswap32(imm));
}

__device__ __forceinline__ uint4 seg_raddr(uint64_t addr, rkey k) {
    return make_uint4(bswap32((uint32_t)(addr >> 32)), bswap32((uint32_t)addr), bswap32(k.v), 0);
}

__device__ __forceinline__ uint4 seg_data(uint64_t addr, uint32_t len, lkey k) {
    return make_uint4(bswap32(len), bswap32(k.v), bswap32((uint32_t)(addr >> 32)),
                      bswap32((uint32_t)addr));
}

__device__ __forceinline__ uint4 seg_atomic(uint64_t swap_add, uint64_t compare) {
    return make_uint4(bswap32((uint32_t)(swap_add >> 32)), bswap32((uint32_t)swap_add),
                      bswap32((uint32_t)(compare >> 32)), bswap32((uint32_t)compare));
}

constexpr uint4 SEG_ZERO = {0, 0, 0, 0};

// One 64-byte block of a WQE, built in registers: the one-block kinds are built whole and
// stored with one call, and the BlueFlame copy is taken from the registers, not read back.
struct block {
    uint4 u[4];
};

// Stores a one-block WQE whole: all four units, also those past its ds (zero). A whole 64-byte
// line reaches host memory as one full write; storing only the ds units (48 bytes for a WRITE,
// as GPUNetIO does) left partial lines, and many warps posting into host rings then ran 20-30%
// slower (docs/benchmarks.md, "Whole blocks").
__device__ __forceinline__ void store_block(const gpuverbs_qp* q, uint64_t idx, const block& b) {
    uint8_t* p = wqe_slot(q, idx);
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) st16(p + 16 * i, b.u[i]);
}

// Block `i` of a WQE whose first block is `idx` (multi-block WQEs wrap at the ring's end).
__device__ __forceinline__ uint8_t* wqe_unit(const gpuverbs_qp* q, uint64_t idx, uint32_t unit) {
    return wqe_slot(q, idx + unit / 4) + (unit % 4) * 16;
}

// Zero-fills units [from, 4*blocks) of a WQE so no stale bytes remain in its last block.
__device__ __forceinline__ void zero_tail(const gpuverbs_qp* q, uint64_t idx, uint32_t from,
                                          uint32_t blocks) {
    for (uint32_t u = from; u < blocks * 4; ++u) st16(wqe_unit(q, idx, u), SEG_ZERO);
}

// --- prepare: one function per WQE kind; each writes its blocks at idx ---------------------

// RDMA_WRITE (or WRITE_IMM when imm is given): 1 block.
__device__ __forceinline__ block build_write(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                             lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                             uint8_t flags, bool with_imm = false,
                                             uint32_t imm = 0) {
    return block{{seg_ctrl(with_imm ? OP_RDMA_WRITE_IMM : OP_RDMA_WRITE, 0, idx, q->qpn, 3,
                           flags, imm),
                  seg_raddr(raddr, rk), seg_data(laddr, len, lk), SEG_ZERO}};
}
__device__ __forceinline__ void prep_write(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                           lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                           uint8_t flags, bool with_imm = false,
                                           uint32_t imm = 0) {
    store_block(q, idx, build_write(q, idx, laddr, lk, raddr, rk, len, flags, with_imm, imm));
}

// Units (16 bytes) an inline data segment of `len` bytes takes: a 4-byte header (the byte
// count with bit 31 set), then the payload, padded to a unit.
__device__ __forceinline__ uint32_t inline_units(uint32_t len) { return (4 + len + 15) / 16; }

// Blocks an inline write of `len` bytes takes: ctrl + raddr + the inline segment.
__device__ __forceinline__ uint32_t inline_write_blocks(uint32_t len) {
    return (2 + inline_units(len) + 3) / 4;
}

// Blocks an inline send of `len` bytes takes: ctrl + the inline segment.
__device__ __forceinline__ uint32_t inline_send_blocks(uint32_t len) {
    return (1 + inline_units(len) + 3) / 4;
}

// The payload word that starts at byte `off` < `len` of `src` and is cut by its end (the bytes
// past `len` zero), byte by byte: at most one per payload when `src` is 4-byte aligned.
static __device__ __noinline__ uint32_t inline_tail_word(const uint8_t* src, uint32_t off, uint32_t len) {
    uint32_t v = 0;
    for (uint32_t b = 0; b < 4 && off + b < len; ++b) v |= (uint32_t)src[off + b] << (8 * b);
    return v;
}

// The inline data segment of `len` bytes from `src`, from unit `first` of the WQE at `idx` to
// the end of its `blocks` blocks (zeros past the payload; units may wrap at the ring's end).
// Block by block, all of a block's source words are loaded before any is stored, so a block
// costs one trip to the source (which may be host memory across PCIe), not one per word. Whole
// words of a 4-byte aligned source are single loads; a word the payload's end cuts, and every
// word of an unaligned source, is gathered byte by byte (kept out of line: a few instructions
// per word here, not a branch per byte).
__device__ __forceinline__ void store_inline(const gpuverbs_qp* q, uint64_t idx, uint32_t first,
                                             uint32_t blocks, const void* src, uint32_t len) {
    const uint8_t* s = static_cast<const uint8_t*>(src);
    const bool aligned = (reinterpret_cast<uintptr_t>(src) & 3u) == 0;
    const uint32_t whole = aligned ? len / 4 : 0;  // payload words loaded as words
    const uint32_t hdr = bswap32(len | 0x80000000u);
    for (uint32_t base = first & ~3u; base < blocks * 4; base += 4) {
        uint32_t w[16];
#pragma unroll
        for (uint32_t j = 0; j < 16; ++j) {
            const uint32_t u = base + j / 4;
            // Word of the segment: the header, then payload word k = word - 1.
            const uint32_t word = (u - first) * 4 + j % 4;
            const uint32_t k = word - 1;
            w[j] = u < first        ? 0
                   : word == 0      ? hdr
                   : k < whole      ? *reinterpret_cast<const uint32_t*>(s + 4 * k)
                   : 4 * k < len    ? inline_tail_word(s, 4 * k, len)
                                    : 0;
        }
        uint8_t* const p = wqe_slot(q, idx + base / 4);
#pragma unroll
        for (uint32_t j = 0; j < 4; ++j) {
            if (base + j >= first) {
                st16(p + 16 * j, make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]));
            }
        }
    }
}

// RDMA_WRITE with the payload carried in the WQE.
__device__ __forceinline__ void prep_write_inline(const gpuverbs_qp* q, uint64_t idx,
                                                  const void* src, uint32_t len, uint64_t raddr,
                                                  rkey rk, uint8_t flags) {
    const uint32_t ds = 2 + inline_units(len);
    st16(wqe_unit(q, idx, 0), seg_ctrl(OP_RDMA_WRITE, 0, idx, q->qpn, ds, flags, 0));
    st16(wqe_unit(q, idx, 1), seg_raddr(raddr, rk));
    store_inline(q, idx, 2, inline_write_blocks(len), src, len);
}

// SEND (or SEND_IMM when imm is given) with the payload carried in the WQE.
__device__ __forceinline__ void prep_send_inline(const gpuverbs_qp* q, uint64_t idx,
                                                 const void* src, uint32_t len, uint8_t flags,
                                                 bool with_imm = false, uint32_t imm = 0) {
    const uint32_t ds = 1 + inline_units(len);
    st16(wqe_unit(q, idx, 0),
         seg_ctrl(with_imm ? OP_SEND_IMM : OP_SEND, 0, idx, q->qpn, ds, flags, imm));
    store_inline(q, idx, 1, inline_send_blocks(len), src, len);
}

// RDMA_READ into local memory: 1 block.
__device__ __forceinline__ block build_read(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                            lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                            uint8_t flags) {
    return block{{seg_ctrl(OP_RDMA_READ, 0, idx, q->qpn, 3, flags, 0), seg_raddr(raddr, rk),
                  seg_data(laddr, len, lk), SEG_ZERO}};
}
__device__ __forceinline__ void prep_read(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                          lkey lk, uint64_t raddr, rkey rk, uint32_t len,
                                          uint8_t flags) {
    store_block(q, idx, build_read(q, idx, laddr, lk, raddr, rk, len, flags));
}

// SEND (or SEND_IMM when imm is given) from local memory: 1 block.
__device__ __forceinline__ block build_send(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                            lkey lk, uint32_t len, uint8_t flags,
                                            bool with_imm = false, uint32_t imm = 0) {
    return block{{seg_ctrl(with_imm ? OP_SEND_IMM : OP_SEND, 0, idx, q->qpn, 2, flags, imm),
                  seg_data(laddr, len, lk), SEG_ZERO, SEG_ZERO}};
}
__device__ __forceinline__ void prep_send(const gpuverbs_qp* q, uint64_t idx, uint64_t laddr,
                                          lkey lk, uint32_t len, uint8_t flags,
                                          bool with_imm = false, uint32_t imm = 0) {
    store_block(q, idx, build_send(q, idx, laddr, lk, len, flags, with_imm, imm));
}

// ATOMIC_FA / ATOMIC_CS on an 8-byte remote word; the old value lands at `result`: 1 block.
__device__ __forceinline__ block build_atomic(const gpuverbs_qp* q, uint64_t idx, uint8_t op,
                                              uint64_t raddr, rkey rk, uint64_t swap_add,
                                              uint64_t compare, uint64_t result,
                                              lkey result_key, uint8_t flags) {
    return block{{seg_ctrl(op, 0, idx, q->qpn, 4, flags, 0), seg_raddr(raddr, rk),
                  seg_atomic(swap_add, compare), seg_data(result, 8, result_key)}};
}
__device__ __forceinline__ void prep_atomic(const gpuverbs_qp* q, uint64_t idx, uint8_t op,
                                            uint64_t raddr, rkey rk, uint64_t swap_add,
                                            uint64_t compare, uint64_t result, lkey result_key,
                                            uint8_t flags) {
    store_block(q, idx,
                build_atomic(q, idx, op, raddr, rk, swap_add, compare, result, result_key, flags));
}

// Masked atomics on 4-byte operands (opmod 0x08), one block: `op` OP_ATOMIC_MASKED_FA with
// (add, field boundary, 0, 0) or OP_ATOMIC_MASKED_CS with (swap, compare, swap mask, compare
// mask); the old value lands at `result` as 4 big-endian bytes (see atomic_result32).
__device__ __forceinline__ block build_atomic32(const gpuverbs_qp* q, uint64_t idx, uint8_t op,
                                                uint64_t raddr, rkey rk, uint32_t a, uint32_t b,
                                                uint32_t c, uint32_t d, uint64_t result,
                                                lkey result_key, uint8_t flags) {
    return block{{seg_ctrl(op, 0x08, idx, q->qpn, 4, flags, 0), seg_raddr(raddr, rk),
                  make_uint4(bswap32(a), bswap32(b), bswap32(c), bswap32(d)),
                  seg_data(result, 4, result_key)}};
}

// A masked fetch-and-add on an 8-byte operand (opmod 0x09), one block.
__device__ __forceinline__ block build_masked_fa(const gpuverbs_qp* q, uint64_t idx,
                                                 uint64_t raddr, rkey rk, uint64_t add,
                                                 uint64_t boundary, uint64_t result,
                                                 lkey result_key, uint8_t flags) {
    return block{{seg_ctrl(OP_ATOMIC_MASKED_FA, 0x09, idx, q->qpn, 4, flags, 0),
                  seg_raddr(raddr, rk), seg_atomic(add, boundary),
                  seg_data(result, 8, result_key)}};
}

// Masked atomics on 8-byte operands (opmod 0x09). FA: 1 block; CS: 2 blocks.
__device__ __forceinline__ uint32_t prep_masked_fa(const gpuverbs_qp* q, uint64_t idx,
                                                   uint64_t raddr, rkey rk, uint64_t add,
                                                   uint64_t boundary, uint64_t result,
                                                   lkey result_key, uint8_t flags) {
    store_block(q, idx, build_masked_fa(q, idx, raddr, rk, add, boundary, result, result_key,
                                        flags));
    return 1;
}

__device__ __forceinline__ uint32_t prep_masked_cs(const gpuverbs_qp* q, uint64_t idx,
                                                   uint64_t raddr, rkey rk, uint64_t compare,
                                                   uint64_t compare_mask, uint64_t swap,
                                                   uint64_t swap_mask, uint64_t result,
                                                   lkey result_key, uint8_t flags) {
    st16(wqe_unit(q, idx, 0), seg_ctrl(OP_ATOMIC_MASKED_CS, 0x09, idx, q->qpn, 5, flags, 0));
    st16(wqe_unit(q, idx, 1), seg_raddr(raddr, rk));
    st16(wqe_unit(q, idx, 2), seg_atomic(swap, compare));
    st16(wqe_unit(q, idx, 3), seg_atomic(swap_mask, compare_mask));
    st16(wqe_unit(q, idx, 4), seg_data(result, 8, result_key));
    zero_tail(q, idx, 5, 2);
    return 2;
}

// NOP: 1 block.
__device__ __forceinline__ block build_nop(const gpuverbs_qp* q, uint64_t idx, uint8_t flags) {
    return block{{seg_ctrl(OP_NOP, 0, idx, q->qpn, 1, flags, 0), SEG_ZERO, SEG_ZERO, SEG_ZERO}};
}
__device__ __forceinline__ void prep_nop(const gpuverbs_qp* q, uint64_t idx, uint8_t flags) {
    store_block(q, idx, build_nop(q, idx, flags));
}

// Cross-channel WAIT (ds 2, one block; the QP must be a cross-channel master, a companion):
// the device executes nothing behind it on this QP until CQ `cqn` has written CQE number
// `max_index` (counted from 0 since the CQ was made, modulo 2^24). The wait segment: 8 bytes
// reserved, BE32 max_index, BE32 cqn.
__device__ __forceinline__ block build_wait(const gpuverbs_qp* q, uint64_t idx, uint32_t cqn,
                                            uint32_t max_index, uint8_t flags) {
    return block{{seg_ctrl(OP_WAIT, 0, idx, q->qpn, 2, flags, 0),
                  make_uint4(0, 0, bswap32(max_index & 0xffffffu), bswap32(cqn)), SEG_ZERO,
                  SEG_ZERO}};
}

}  // namespace gpuverbs

#endif  // __CUDACC__
#endif  // GPUVERBS_WQE_CUH
