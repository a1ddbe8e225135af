//! mlx5 command mailboxes (the PRM's control path): the bit fields of the commands a DEVX
//! user sends through `mlx5dv_devx_obj_create` / `_modify` / `_query` / `general_cmd`, and of
//! the answers. Every field is a [`Field`]: a bit offset from the start of its structure in the
//! PRM's numbering (bit 0 is the most significant bit of the first big-endian dword) and a
//! width, as `mlx5_ifc.h` lays them out. [`get`] and [`set`] read and write one in a mailbox.
//!
//! The tables are checked against rdma-core's own description of these structures
//! (`tests/mlx5_prm_structs.py`) by a test of the emulation; [`ALL`] lists them for it.

mod layout;
#[cfg(test)]
mod tests;

pub use layout::*;

/// One bit field of a PRM structure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// Bit offset from the structure's first bit (MSB-first numbering).
    pub bit: u32,
    /// Width in bits (1..=64, or a multiple of 8 for byte arrays).
    pub width: u32,
}

impl Field {
    /// A field at bit `bit`, `width` bits wide.
    pub const fn new(bit: u32, width: u32) -> Self {
        Self { bit, width }
    }

    /// The same field inside a structure that starts `byte` bytes into another.
    pub const fn at(self, byte: u32) -> Self {
        Self {
            bit: self.bit + byte * 8,
            width: self.width,
        }
    }

    /// Byte offset of a byte-aligned field.
    pub const fn byte(self) -> usize {
        (self.bit / 8) as usize
    }

    /// Bytes a mailbox needs to hold the field.
    pub const fn end(self) -> usize {
        (self.bit + self.width).div_ceil(8) as usize
    }
}

/// The value of `f` in `buf` (0 for bits past its end: a short mailbox reads as zero-filled,
/// as the firmware sees a command shorter than its layout).
pub fn get(buf: &[u8], f: Field) -> u64 {
    debug_assert!(f.width <= 64);
    let mut v = 0u64;
    for i in 0..f.width {
        let bit = f.bit + i;
        let byte = buf.get((bit / 8) as usize).copied().unwrap_or(0);
        v = v << 1 | u64::from(byte >> (7 - bit % 8) & 1);
    }
    v
}

/// Writes `v` (its low `f.width` bits) into `f` in `buf`; bits past the buffer's end are
/// dropped.
pub fn set(buf: &mut [u8], f: Field, v: u64) {
    debug_assert!(f.width <= 64);
    for i in 0..f.width {
        let bit = f.bit + i;
        let one = v >> (f.width - 1 - i) & 1 == 1;
        if let Some(b) = buf.get_mut((bit / 8) as usize) {
            let m = 1u8 << (7 - bit % 8);
            *b = if one { *b | m } else { *b & !m };
        }
    }
}

/// The bytes of a byte-aligned field (an address, a GID), cut to what `buf` holds.
pub fn bytes(buf: &[u8], f: Field) -> &[u8] {
    let start = f.byte().min(buf.len());
    let end = (f.byte() + (f.width / 8) as usize).min(buf.len());
    &buf[start..end]
}

/// Command opcodes (`MLX5_CMD_OP_*`).
pub mod op {
    #![allow(missing_docs)]
    pub const QUERY_HCA_CAP: u16 = 0x100;
    pub const QUERY_ADAPTER: u16 = 0x101;
    pub const QUERY_ISSI: u16 = 0x10a;
    pub const NOP: u16 = 0x10d;
    pub const CREATE_MKEY: u16 = 0x200;
    pub const CREATE_EQ: u16 = 0x301;
    pub const CREATE_CQ: u16 = 0x400;
    pub const DESTROY_CQ: u16 = 0x401;
    pub const QUERY_CQ: u16 = 0x402;
    pub const MODIFY_CQ: u16 = 0x403;
    pub const CREATE_QP: u16 = 0x500;
    pub const DESTROY_QP: u16 = 0x501;
    pub const RST2INIT_QP: u16 = 0x502;
    pub const INIT2RTR_QP: u16 = 0x503;
    pub const RTR2RTS_QP: u16 = 0x504;
    pub const RTS2RTS_QP: u16 = 0x505;
    pub const SQERR2RTS_QP: u16 = 0x506;
    pub const QP_2ERR: u16 = 0x507;
    pub const QP_2RST: u16 = 0x50a;
    pub const QUERY_QP: u16 = 0x50b;
    pub const SQD_RTS_QP: u16 = 0x50c;
    pub const INIT2INIT_QP: u16 = 0x50e;
    pub const CREATE_SRQ: u16 = 0x700;
    pub const CREATE_DCT: u16 = 0x710;
    pub const DESTROY_DCT: u16 = 0x711;
    pub const DRAIN_DCT: u16 = 0x712;
    pub const QUERY_DCT: u16 = 0x713;
    pub const ARM_DCT_FOR_KEY_VIOLATION: u16 = 0x714;
    pub const QUERY_VPORT_STATE: u16 = 0x750;
    pub const QUERY_NIC_VPORT_CONTEXT: u16 = 0x754;
    pub const QUERY_ROCE_ADDRESS: u16 = 0x760;
    pub const QUERY_HCA_VPORT_CONTEXT: u16 = 0x762;
    pub const QUERY_HCA_VPORT_GID: u16 = 0x764;
    pub const ALLOC_PD: u16 = 0x800;
    pub const QUERY_LAG: u16 = 0x842;
    pub const CREATE_RMP: u16 = 0x90c;
    pub const CREATE_GENERAL_OBJECT: u16 = 0xa00;
}

/// Command completion status (out-mailbox byte 0, `MLX5_CMD_STAT_*`).
pub mod status {
    #![allow(missing_docs)]
    pub const OK: u8 = 0x0;
    pub const INT_ERR: u8 = 0x1;
    pub const BAD_OP: u8 = 0x2;
    pub const BAD_PARAM: u8 = 0x3;
    pub const BAD_SYS_STATE: u8 = 0x4;
    pub const BAD_RES: u8 = 0x5;
    pub const RES_BUSY: u8 = 0x6;
    pub const LIM: u8 = 0x8;
    pub const BAD_RES_STATE: u8 = 0x9;
    pub const IX: u8 = 0xa;
    pub const NO_RES: u8 = 0xf;
    pub const BAD_QP_STATE: u8 = 0x10;
    pub const BAD_INP_LEN: u8 = 0x50;
    pub const BAD_OUTP_LEN: u8 = 0x51;
}

/// `op_mod` of QUERY_HCA_CAP: `cap_type << 1 | current`.
pub mod cap {
    #![allow(missing_docs)]
    pub const GENERAL: u16 = 0x0;
    pub const ODP: u16 = 0x2;
    pub const ATOMIC: u16 = 0x3;
    pub const ROCE: u16 = 0x4;
    /// NIC receive and transmit flow tables (`flow_table_nic_cap`).
    pub const NIC_FLOW_TABLE: u16 = 0x7;
    /// Quality of service (`qos_cap`).
    pub const QOS: u16 = 0xc;
    /// Device memory, MEMIC (`device_mem_cap`).
    pub const DEVICE_MEMORY: u16 = 0xf;
    /// Crypto engines (`crypto_cap`).
    pub const CRYPTO: u16 = 0x1a;
    pub const GENERAL_2: u16 = 0x20;
    /// The low bit of `op_mod`: the current values (else the maximum ones).
    pub const CURRENT: u16 = 0x1;
}

/// QP context `st` (service type).
pub mod st {
    #![allow(missing_docs)]
    pub const RC: u8 = 0x0;
    pub const UC: u8 = 0x1;
    pub const UD: u8 = 0x2;
    pub const XRC: u8 = 0x3;
    pub const DCI: u8 = 0x5;
    pub const QP0: u8 = 0x7;
    pub const QP1: u8 = 0x8;
    pub const RAW: u8 = 0x9;
}

/// QP context `state`.
pub mod qp_state {
    #![allow(missing_docs)]
    pub const RST: u8 = 0x0;
    pub const INIT: u8 = 0x1;
    pub const RTR: u8 = 0x2;
    pub const RTS: u8 = 0x3;
    pub const SQER: u8 = 0x4;
    pub const SQD: u8 = 0x5;
    pub const ERR: u8 = 0x6;
}

/// QP context `rq_type`.
pub mod rq_type {
    #![allow(missing_docs)]
    pub const REGULAR: u8 = 0x0;
    pub const SRQ: u8 = 0x1;
    pub const ZERO_SIZE: u8 = 0x3;
}
