//! Doorbells: the doorbell record (DBREC) in memory, the doorbell register in the UAR page with
//! its BlueFlame halves, the 8-byte doorbell value in both conventions, and the CQ's record.

use crate::endian::Be32;
use bytemuck::{Pod, Zeroable};

/// Size of a UAR page.
pub const UAR_PAGE_SIZE: usize = 4096;
/// Offset of the first BlueFlame register (and of the send doorbell) in a UAR page.
pub const BF_OFFSET: usize = 0x800;
/// Size of one BlueFlame register half; writers alternate between `BF_OFFSET` and
/// `BF_OFFSET + BF_HALF_SIZE`.
pub const BF_HALF_SIZE: usize = 0x100;
/// Offset of the doorbell a QP without a send doorbell record rings (`send_dbr_mode`
/// NO_DBR_EXT, ConnectX-8): an 8-byte doorbell whose WQE index is the producer index (DOCA's
/// `DOCA_VERBS_UAR_DBR_LESS_DB_OFFSET`).
pub const DBR_LESS_OFFSET: usize = 0x600;
/// Offset of the CQ arm doorbell in a UAR page.
pub const CQ_DOORBELL_OFFSET: usize = 0x20;

/// Index of the receive word in the QP doorbell record.
pub const DBREC_RCV: usize = 0;
/// Index of the send word in the QP doorbell record.
pub const DBREC_SND: usize = 1;

/// The 8-byte QP doorbell record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DoorbellRecord {
    /// RQ head in WQEs, low 16 bits.
    pub rcv: Be32,
    /// SQ producer in blocks, low 16 bits.
    pub snd: Be32,
}

impl DoorbellRecord {
    /// The SQ producer index.
    pub fn sq_pi(&self) -> u16 {
        self.snd.get() as u16
    }
    /// The RQ head.
    pub fn rq_head(&self) -> u16 {
        self.rcv.get() as u16
    }
}

/// The 8-byte CQ doorbell record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct CqDoorbellRecord {
    /// Consumer index, low 24 bits.
    pub ci: Be32,
    /// Arm word.
    pub arm: Be32,
}

impl CqDoorbellRecord {
    /// The consumer index (24 bits).
    pub fn consumer_index(&self) -> u32 {
        self.ci.get() & 0xff_ffff
    }
}

/// The 8-byte value written to the doorbell register.
///
/// rdma-core writes the first 8 bytes of the last WQE's control segment (index of that WQE's
/// first block in bits 23:8 of word 0, QPN and ds in word 1); DOCA and UCX write
/// `{BE32(pi << 8), BE32(qpn << 8)}`. Both put a 16-bit index in bits 23:8 of word 0 and the
/// QPN in bits 31:8 of word 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DoorbellValue {
    /// `... | index << 8 | ...`
    pub word0: Be32,
    /// `qpn << 8 | ...`
    pub word1: Be32,
}

impl DoorbellValue {
    /// The DOCA/UCX convention: producer index and QPN.
    pub fn from_pi(pi: u16, qpn: u32) -> Self {
        Self {
            word0: Be32::new((pi as u32) << 8),
            word1: Be32::new(qpn << 8),
        }
    }
    /// The rdma-core convention: the first 8 bytes of a control segment.
    pub fn from_ctrl(ctrl: &crate::wqe::CtrlSeg) -> Self {
        Self {
            word0: ctrl.opmod_idx_opcode,
            word1: ctrl.qpn_ds,
        }
    }
    /// The 16-bit index carried in word 0.
    pub fn index(&self) -> u16 {
        (self.word0.get() >> 8) as u16
    }
    /// The QPN carried in word 1.
    pub fn qpn(&self) -> u32 {
        self.word1.get() >> 8
    }
    /// The low byte of word 1: `ds` in the rdma-core convention, 0 in the DOCA one.
    pub fn ds(&self) -> u8 {
        self.word1.get() as u8
    }
    /// As the 8 bytes stored, read as a native `u64` (what a single 8-byte store writes).
    pub fn to_u64(self) -> u64 {
        bytemuck::cast(self)
    }
    /// From the native `u64` an 8-byte store wrote.
    pub fn from_u64(v: u64) -> Self {
        bytemuck::cast(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wqe::{CtrlFlags, Op};

    #[test]
    fn both_conventions_carry_index_and_qpn() {
        let d = DoorbellValue::from_pi(0x1234, 0xabcdef);
        assert_eq!(
            bytemuck::bytes_of(&d),
            &[0, 0x12, 0x34, 0, 0xab, 0xcd, 0xef, 0]
        );
        assert_eq!((d.index(), d.qpn(), d.ds()), (0x1234, 0xabcdef, 0));
        assert_eq!(DoorbellValue::from_u64(d.to_u64()), d);
        let w = Op::Nop.encode(77, 0x55, CtrlFlags::default()).unwrap();
        let c = DoorbellValue::from_ctrl(&w.ctrl());
        assert_eq!((c.index(), c.qpn(), c.ds()), (77, 0x55, 1));
        assert_eq!(bytemuck::bytes_of(&c), &w.as_bytes()[..8]);
    }

    #[test]
    fn records() {
        let r: DoorbellRecord = bytemuck::cast([0u8, 0, 0, 3, 0, 1, 0, 2]);
        assert_eq!((r.rq_head(), r.sq_pi()), (3, 0x0100_0002u32 as u16));
        let c: CqDoorbellRecord = bytemuck::cast([0x12u8, 0x34, 0x56, 0x78, 0, 0, 0, 0]);
        assert_eq!(c.consumer_index(), 0x345678);
    }
}
