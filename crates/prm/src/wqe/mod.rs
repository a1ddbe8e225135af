//! Send-queue WQE segments, opcodes and typed builders.
//!
//! A WQE is a control segment followed by opcode-specific segments, `ds` 16-byte units in all,
//! spanning `ceil(ds / 4)` 64-byte blocks. [`Op`] describes one operation; [`Op::encode`] turns it
//! into a [`WqeBuf`] of whole blocks with every reserved byte zero; [`WqeBuf::copy_to_ring`]
//! places the blocks in a ring, wrapping at its end as the hardware reads them.

use crate::endian::{Be16, Be32, Be64, BeLkey, BeRkey, Lkey, Rkey};
use crate::{DS_UNIT, MAX_DS, MAX_WQE_BBS, WQEBB};
use bytemuck::{Pod, Zeroable};

/// WQE opcodes (the low byte of `opmod_idx_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// No operation; completes like any other WQE.
    Nop = 0x00,
    /// RDMA write.
    RdmaWrite = 0x08,
    /// RDMA write with immediate (consumes a receive WQE at the responder).
    RdmaWriteImm = 0x09,
    /// Send.
    Send = 0x0a,
    /// Send with immediate.
    SendImm = 0x0b,
    /// Send with invalidate: the responder invalidates the rkey in the immediate field (a
    /// type 2 memory window bound to its QP) when the message arrives.
    SendInval = 0x01,
    /// Wait until a CQ reaches an index (cross-channel WAIT).
    Wait = 0x0f,
    /// RDMA read.
    RdmaRead = 0x10,
    /// 8-byte atomic compare-and-swap.
    AtomicCs = 0x11,
    /// 8-byte atomic fetch-and-add.
    AtomicFa = 0x12,
    /// Masked compare-and-swap (4 or 8 bytes, per opmod).
    AtomicMaskedCs = 0x14,
    /// Masked fetch-and-add (4 or 8 bytes, per opmod).
    AtomicMaskedFa = 0x15,
    /// Local read of one data segment (lkey-checked) that completes with a CQE; DOCA GPUNetIO
    /// posts it after a READ to flush GPUDirect writes on GPUs without write ordering.
    Dump = 0x23,
    /// User-mode memory registration: here, binding or invalidating a memory window
    /// (`ibv_bind_mw`, `IBV_WR_BIND_MW`, `IBV_WR_LOCAL_INV`).
    Umr = 0x25,
}

impl Opcode {
    /// Decodes an opcode byte; `None` for opcodes this device does not implement.
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0x00 => Self::Nop,
            0x08 => Self::RdmaWrite,
            0x09 => Self::RdmaWriteImm,
            0x0a => Self::Send,
            0x0b => Self::SendImm,
            0x01 => Self::SendInval,
            0x0f => Self::Wait,
            0x10 => Self::RdmaRead,
            0x11 => Self::AtomicCs,
            0x12 => Self::AtomicFa,
            0x14 => Self::AtomicMaskedCs,
            0x15 => Self::AtomicMaskedFa,
            0x23 => Self::Dump,
            0x25 => Self::Umr,
            _ => return None,
        })
    }

    /// The name used in error messages (rdma-core style).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Nop => "NOP",
            Self::RdmaWrite => "RDMA_WRITE",
            Self::RdmaWriteImm => "RDMA_WRITE_IMM",
            Self::Send => "SEND",
            Self::SendImm => "SEND_IMM",
            Self::SendInval => "SEND_INVAL",
            Self::Wait => "WAIT",
            Self::RdmaRead => "RDMA_READ",
            Self::AtomicCs => "ATOMIC_CS",
            Self::AtomicFa => "ATOMIC_FA",
            Self::AtomicMaskedCs => "ATOMIC_MASKED_CS",
            Self::AtomicMaskedFa => "ATOMIC_MASKED_FA",
            Self::Dump => "DUMP",
            Self::Umr => "UMR",
        }
    }
}

/// Name of a raw WQE opcode byte, `"UNKNOWN"` when it is not one of [`Opcode`].
pub fn opcode_name(v: u8) -> &'static str {
    Opcode::from_u8(v).map_or("UNKNOWN", Opcode::name)
}

/// `opmod` of a masked atomic on 4-byte operands.
pub const OPMOD_MASKED_ATOMIC_4B: u8 = 0x08;
/// `opmod` of a masked atomic on 8-byte operands.
pub const OPMOD_MASKED_ATOMIC_8B: u8 = 0x09;

/// `fm_ce_se`: CQE always (CQ update = 2 in bits 3:2).
pub const FM_CE_SE_CQ_UPDATE: u8 = 2 << 2;
/// `fm_ce_se`: solicited event.
pub const FM_CE_SE_SOLICITED: u8 = 1 << 1;
/// `fm_ce_se`: strong fence (wait for all earlier WQEs), fence mode 4.
pub const FM_CE_SE_FENCE: u8 = 4 << 5;
/// `fm_ce_se`: initiator small fence, fence mode 1.
pub const FM_CE_SE_SMALL_FENCE: u8 = 1 << 5;

/// Top bit of an inline segment's byte count.
pub const INLINE_SEG: u32 = 0x8000_0000;
/// The lkey of the receive-list terminator.
pub const INVALID_LKEY: u32 = 0x100;

/// Control segment, the first 16 bytes of every send WQE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct CtrlSeg {
    /// `opmod << 24 | wqe_index << 8 | opcode`.
    pub opmod_idx_opcode: Be32,
    /// `qpn << 8 | ds`.
    pub qpn_ds: Be32,
    /// Signature (unused, zero).
    pub signature: u8,
    /// DCI stream channel id (0 for RC).
    pub dci_stream_channel_id: Be16,
    /// Fence mode (7:5), CQ update (3:2), solicited (1).
    pub fm_ce_se: u8,
    /// Immediate data, raw.
    pub imm: Be32,
}

impl CtrlSeg {
    /// The opcode byte.
    pub fn opcode(&self) -> u8 {
        self.opmod_idx_opcode.get() as u8
    }
    /// The opcode modifier.
    pub fn opmod(&self) -> u8 {
        (self.opmod_idx_opcode.get() >> 24) as u8
    }
    /// The 16-bit WQE index of the first block.
    pub fn wqe_index(&self) -> u16 {
        (self.opmod_idx_opcode.get() >> 8) as u16
    }
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn_ds.get() >> 8
    }
    /// The WQE length in 16-byte units (low 6 bits).
    pub fn ds(&self) -> u8 {
        (self.qpn_ds.get() & 0x3f) as u8
    }
    /// Number of 64-byte blocks the WQE spans (at least 1).
    pub fn blocks(&self) -> usize {
        blocks_for_ds(self.ds().max(1))
    }
}

/// Number of 64-byte blocks a WQE of `ds` units spans.
pub const fn blocks_for_ds(ds: u8) -> usize {
    (ds as usize * DS_UNIT).div_ceil(WQEBB)
}

/// Remote address segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RaddrSeg {
    /// Remote virtual address.
    pub raddr: Be64,
    /// Remote key.
    pub rkey: BeRkey,
    /// Reserved, zero.
    pub reserved: [u8; 4],
}

/// Data (scatter/gather) segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DataSeg {
    /// Byte count.
    pub byte_count: Be32,
    /// Local key.
    pub lkey: BeLkey,
    /// Local address.
    pub addr: Be64,
}

impl DataSeg {
    /// A data segment for `sge`.
    pub fn new(sge: Sge) -> Self {
        Self {
            byte_count: Be32::new(sge.len),
            lkey: BeLkey::new(sge.lkey),
            addr: Be64::new(sge.addr),
        }
    }
    /// The terminator that ends a short receive list.
    pub fn terminator() -> Self {
        Self {
            byte_count: Be32::new(0),
            lkey: BeLkey::new(Lkey(INVALID_LKEY)),
            addr: Be64::new(0),
        }
    }
    /// Whether this is the receive-list terminator.
    pub fn is_terminator(&self) -> bool {
        self.lkey.get().0 == INVALID_LKEY && self.byte_count.get() == 0
    }
    /// As a host-order [`Sge`].
    pub fn sge(&self) -> Sge {
        Sge {
            addr: self.addr.get(),
            len: self.byte_count.get(),
            lkey: self.lkey.get(),
        }
    }
}

/// Datagram segment of a UD send WQE (`struct mlx5_wqe_datagram_seg`, the 48-byte
/// `mlx5_wqe_av`), right after the control segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DatagramSeg {
    /// Q_Key (the high bit set: use the QP's own Q_Key).
    pub qkey: Be32,
    /// Reserved (DC key's low half for DC).
    pub reserved: [u8; 4],
    /// Destination QPN (23:0) and the extended-AV bit (31).
    pub dqp_dct: Be32,
    /// Static rate (7:4) and SL.
    pub stat_rate_sl: u8,
    /// Flow label / MLID bits (InfiniBand).
    pub fl_mlid: u8,
    /// Remote LID (InfiniBand); RoCE: the UDP source port libmlx5 may set.
    pub rlid: Be16,
    /// Reserved.
    pub reserved0: [u8; 4],
    /// Destination MAC (RoCE).
    pub rmac: [u8; 6],
    /// Traffic class.
    pub tclass: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// GRH bit (30, InfiniBand), source GID index (27:20), flow label (19:0).
    pub grh_gid_fl: Be32,
    /// Destination GID.
    pub rgid: [u8; 16],
}

impl DatagramSeg {
    /// The address vector of a DC initiator's WQE: the target's DCT number and GID and the DC
    /// access key it must present (the key big-endian in the first 8 bytes, where a UD WQE
    /// has its Q_Key), the extended-AV bit set as libmlx5 sets it.
    pub fn dc(dctn: u32, key: u64, rgid: [u8; 16]) -> Self {
        Self {
            qkey: Be32::new((key >> 32) as u32),
            reserved: (key as u32).to_be_bytes(),
            dqp_dct: Be32::new(dctn & 0xff_ffff | EXTENDED_UD_AV),
            hop_limit: 64,
            rgid,
            ..Default::default()
        }
    }
}

/// Units (16 bytes) of a [`DatagramSeg`].
pub const DATAGRAM_UNITS: usize = 3;
/// The extended-AV bit of [`DatagramSeg::dqp_dct`].
pub const EXTENDED_UD_AV: u32 = 0x8000_0000;

/// Atomic segment of ATOMIC_CS / ATOMIC_FA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct AtomicSeg {
    /// Swap value (CS) or addend (FA).
    pub swap_add: Be64,
    /// Compare value (CS), zero for FA.
    pub compare: Be64,
}

/// Masked atomic segment on 8-byte operands, compare-and-swap form (32 bytes, 2 units).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct MaskedCs64Seg {
    /// Swap value.
    pub swap: Be64,
    /// Compare value.
    pub compare: Be64,
    /// Bits of the target that the swap replaces.
    pub swap_mask: Be64,
    /// Bits of the target that take part in the compare.
    pub compare_mask: Be64,
}

/// Masked atomic segment on 8-byte operands, fetch-and-add form (16 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct MaskedFa64Seg {
    /// Addend.
    pub add: Be64,
    /// Field boundary: a set bit ends a field (carries do not cross it).
    pub field_boundary: Be64,
}

/// Masked atomic segment on 4-byte operands, compare-and-swap form (16 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct MaskedCs32Seg {
    /// Swap value.
    pub swap: Be32,
    /// Compare value.
    pub compare: Be32,
    /// Swap mask.
    pub swap_mask: Be32,
    /// Compare mask.
    pub compare_mask: Be32,
}

/// Masked atomic segment on 4-byte operands, fetch-and-add form (16 bytes, last 8 reserved).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct MaskedFa32Seg {
    /// Addend.
    pub add: Be32,
    /// Field boundary.
    pub field_boundary: Be32,
    /// Reserved, zero.
    pub reserved: [u8; 8],
}

/// WAIT segment: hold this SQ until CQ `cqn` has produced CQE number `max_index`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct WaitSeg {
    /// Reserved, zero.
    pub reserved: [u8; 8],
    /// The CQE index (producer count) to wait for.
    pub max_index: Be32,
    /// The CQ number to watch.
    pub cqn: Be32,
}

/// UMR control segment (48 bytes), after the control segment of a UMR WQE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct UmrCtrlSeg {
    /// `UMR_FLAG_*`.
    pub flags: u8,
    /// Reserved.
    pub rsvd0: [u8; 3],
    /// Translation entries (KLMs) that follow, in 16-byte units.
    pub klm_octowords: Be16,
    /// Translation offset.
    pub translation_offset: Be16,
    /// Which mkey context fields the UMR changes (`UMR_MASK_*`).
    pub mkey_mask: Be64,
    /// Reserved.
    pub rsvd1: [u8; 32],
}

/// UMR flag: the translation entries are inline in the WQE.
pub const UMR_FLAG_INLINE: u8 = 1 << 7;
/// UMR flag: fail unless the mkey is free (binding a type 2 window).
pub const UMR_FLAG_CHECK_FREE: u8 = 1 << 5;
/// UMR flag: a translation offset is given.
pub const UMR_FLAG_TRANSLATION_OFFSET: u8 = 1 << 4;
/// UMR flag: fail unless the mkey belongs to the posting QP (invalidating a type 2 window).
pub const UMR_FLAG_CHECK_QPN: u8 = 1 << 3;
/// mkey mask: length.
pub const UMR_MASK_LEN: u64 = 1 << 0;
/// mkey mask: start address.
pub const UMR_MASK_START_ADDR: u64 = 1 << 6;
/// mkey mask: the key's variant byte.
pub const UMR_MASK_MKEY: u64 = 1 << 13;
/// mkey mask: the QPN the mkey is bound to.
pub const UMR_MASK_QPN: u64 = 1 << 14;
/// mkey mask: the access rights (local write, remote read, remote write, atomic).
pub const UMR_MASK_ACCESS: u64 = 0xf << 18;
/// mkey mask: the free bit.
pub const UMR_MASK_FREE: u64 = 1 << 29;

/// Memory key context segment (64 bytes) of a UMR WQE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct MkeyContextSeg {
    /// [`MKEY_FREE`] when the UMR frees (unbinds, invalidates) the mkey.
    pub free: u8,
    /// Reserved.
    pub reserved1: u8,
    /// `MKEY_ACCESS_*`.
    pub access_flags: u8,
    /// Reserved.
    pub sf: u8,
    /// `qpn << 8 | variant`: the bound QP (0xffffff: none, type 1) and the key's new low byte.
    pub qpn_mkey: Be32,
    /// Reserved.
    pub reserved2: Be32,
    /// Flags and PD.
    pub flags_pd: Be32,
    /// First virtual address of the window (0 for a zero-based window).
    pub start_addr: Be64,
    /// Length.
    pub len: Be64,
    /// Reserved.
    pub bsf_octword_size: Be32,
    /// Reserved.
    pub reserved3: [Be32; 4],
    /// Translation size.
    pub translations_octword_size: Be32,
    /// Reserved.
    pub reserved4: [u8; 3],
    /// Page size (log 2).
    pub log_page_size: u8,
    /// Reserved.
    pub reserved: Be32,
}

/// mkey context: the mkey is free.
pub const MKEY_FREE: u8 = 1 << 6;
/// mkey context access: atomics.
pub const MKEY_ACCESS_ATOMIC: u8 = 1 << 6;
/// mkey context access: remote write.
pub const MKEY_ACCESS_REMOTE_WRITE: u8 = 1 << 5;
/// mkey context access: remote read.
pub const MKEY_ACCESS_REMOTE_READ: u8 = 1 << 4;
/// mkey context access: local write.
pub const MKEY_ACCESS_LOCAL_WRITE: u8 = 1 << 3;

/// One KLM translation entry (16 bytes; inline entries are padded to 64 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct KlmSeg {
    /// Bytes (at most 2 GiB).
    pub byte_count: Be32,
    /// The memory region's lkey.
    pub mkey: Be32,
    /// Its address.
    pub address: Be64,
}

/// The header of a repeated-block translation (16 bytes; `mlx5dv_wr_mr_interleaved`): the
/// entries that follow describe one block, repeated `repeat_count` times, each entry advancing
/// by its stride at each repetition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RepeatBlockSeg {
    /// Bytes of one block (the sum of the entries' byte counts).
    pub byte_count: Be32,
    /// [`REPEAT_BLOCK_OP`].
    pub op: Be32,
    /// How many times the block repeats.
    pub repeat_count: Be32,
    /// Reserved.
    pub reserved: Be16,
    /// Entries that follow.
    pub num_ent: Be16,
}

/// The `op` of a repeated-block header (a KLM list has an mkey in that place).
pub const REPEAT_BLOCK_OP: u32 = 0x400;

/// One entry of a repeated block (16 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RepeatEntSeg {
    /// Bytes between this entry's starts in consecutive blocks.
    pub stride: Be16,
    /// Bytes this entry gives each block.
    pub byte_count: Be16,
    /// The key of the memory it addresses.
    pub memkey: Be32,
    /// Its address in the first block.
    pub va: Be64,
}

const _: () = assert!(core::mem::size_of::<RepeatBlockSeg>() == 16);
const _: () = assert!(core::mem::size_of::<RepeatEntSeg>() == 16);
const _: () = assert!(core::mem::size_of::<UmrCtrlSeg>() == 48);
const _: () = assert!(core::mem::size_of::<MkeyContextSeg>() == 64);
const _: () = assert!(core::mem::size_of::<KlmSeg>() == 16);

/// A local buffer in host order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    /// Address (host or GPU virtual address, as registered).
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Key of the region that holds it.
    pub lkey: Lkey,
}

/// A remote buffer: address and rkey.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteAddr {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key.
    pub rkey: Rkey,
}

/// Where the local bytes of a WRITE or SEND come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Local<'a> {
    /// Gather from registered memory.
    Sges(&'a [Sge]),
    /// Carried inside the WQE.
    Inline(&'a [u8]),
}

/// Operand size of a masked atomic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicSize {
    /// 4-byte operands (opmod 0x08).
    B4,
    /// 8-byte operands (opmod 0x09).
    B8,
}

impl AtomicSize {
    /// Operand size in bytes.
    pub const fn bytes(self) -> u32 {
        match self {
            Self::B4 => 4,
            Self::B8 => 8,
        }
    }
    const fn opmod(self) -> u8 {
        match self {
            Self::B4 => OPMOD_MASKED_ATOMIC_4B,
            Self::B8 => OPMOD_MASKED_ATOMIC_8B,
        }
    }
}

/// One send-queue operation, host order, before encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op<'a> {
    /// NOP.
    Nop,
    /// RDMA write, with immediate when `imm` is set.
    Write {
        /// Target.
        remote: RemoteAddr,
        /// Source.
        local: Local<'a>,
        /// Immediate (makes it RDMA_WRITE_IMM).
        imm: Option<u32>,
    },
    /// Send, with immediate when `imm` is set.
    Send {
        /// Source.
        local: Local<'a>,
        /// Immediate (makes it SEND_IMM).
        imm: Option<u32>,
    },
    /// RDMA read into `local`.
    Read {
        /// Source at the peer.
        remote: RemoteAddr,
        /// Destination buffers.
        local: &'a [Sge],
    },
    /// 8-byte fetch-and-add; the old value lands in `result`.
    FetchAdd {
        /// Target word (8-byte aligned).
        remote: RemoteAddr,
        /// Addend.
        add: u64,
        /// 8-byte buffer for the old value.
        result: Sge,
    },
    /// 8-byte compare-and-swap; the old value lands in `result`.
    CompareSwap {
        /// Target word (8-byte aligned).
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
        /// 8-byte buffer for the old value.
        result: Sge,
    },
    /// Masked fetch-and-add on 4- or 8-byte operands.
    MaskedFetchAdd {
        /// Operand size.
        size: AtomicSize,
        /// Target word.
        remote: RemoteAddr,
        /// Addend.
        add: u64,
        /// Field boundaries (a set bit ends a field).
        field_boundary: u64,
        /// Buffer for the old value (`size` bytes).
        result: Sge,
    },
    /// Masked compare-and-swap on 4- or 8-byte operands.
    MaskedCompareSwap {
        /// Operand size.
        size: AtomicSize,
        /// Target word.
        remote: RemoteAddr,
        /// Expected value (under `compare_mask`).
        compare: u64,
        /// Compare mask.
        compare_mask: u64,
        /// New value (under `swap_mask`).
        swap: u64,
        /// Swap mask.
        swap_mask: u64,
        /// Buffer for the old value (`size` bytes).
        result: Sge,
    },
    /// Wait until CQ `cqn` has produced CQE number `max_index`.
    Wait {
        /// CQ number.
        cqn: u32,
        /// CQE index to wait for.
        max_index: u32,
    },
    /// DUMP: ctrl + one data segment (ds 2); the device reads `local` (lkey-checked) and
    /// completes.
    Dump {
        /// The local range read.
        local: Sge,
    },
    /// SEND with invalidate: the responder invalidates `rkey` (a type 2 memory window bound to
    /// its QP) when the message arrives.
    SendInvalidate {
        /// Source.
        local: Local<'a>,
        /// The rkey to invalidate.
        rkey: u32,
    },
    /// Binds a memory window (a UMR WQE, as libmlx5 writes for `IBV_WR_BIND_MW` and
    /// `ibv_bind_mw`); with `region.len` 0 it unbinds (frees) a type 1 window.
    BindWindow(WindowBind),
    /// LOCAL_INV: invalidates `rkey`, a type 2 window bound to the posting QP (UMR WQE).
    LocalInvalidate {
        /// The window's key.
        rkey: u32,
    },
}

/// What [`Op::BindWindow`] binds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowBind {
    /// The window's key as allocated or last bound.
    pub window: u32,
    /// The low byte of its key after the bind (`ibv_inc_rkey`).
    pub variant: u8,
    /// Type 2: the QPN the window is bound to (the posting QP); type 1: `None`.
    pub qpn: Option<u32>,
    /// The region range it covers (lkey, address, length; at most 2 GiB).
    pub region: Sge,
    /// The window's first address as peers name it (`region.addr`, or 0 for zero-based).
    pub start: u64,
    /// Rights, `MKEY_ACCESS_*` bits.
    pub access: u8,
}

/// Fence mode of a WQE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fence {
    /// No fence.
    #[default]
    None,
    /// Initiator small fence: wait for earlier RDMA READs and atomics.
    Small,
    /// Strong fence: wait for every earlier WQE to complete.
    Strong,
}

/// Per-WQE flags of the control segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtrlFlags {
    /// Ask for a CQE on success (CQ update = always).
    pub signaled: bool,
    /// Solicited event bit.
    pub solicited: bool,
    /// Fence mode.
    pub fence: Fence,
}

impl CtrlFlags {
    /// A signaled WQE without fence.
    pub const SIGNALED: Self = Self {
        signaled: true,
        solicited: false,
        fence: Fence::None,
    };

    /// The `fm_ce_se` byte.
    pub const fn fm_ce_se(self) -> u8 {
        let mut v = 0;
        if self.signaled {
            v |= FM_CE_SE_CQ_UPDATE;
        }
        if self.solicited {
            v |= FM_CE_SE_SOLICITED;
        }
        v | match self.fence {
            Fence::None => 0,
            Fence::Small => FM_CE_SE_SMALL_FENCE,
            Fence::Strong => FM_CE_SE_FENCE,
        }
    }

    /// Decodes a `fm_ce_se` byte (any non-zero fence mode other than 1 is a strong fence;
    /// CQ update values with bit 3 set ask for a CQE).
    pub const fn from_fm_ce_se(v: u8) -> Self {
        Self {
            signaled: v & 0x08 != 0,
            solicited: v & FM_CE_SE_SOLICITED != 0,
            fence: match v >> 5 {
                0 => Fence::None,
                1 => Fence::Small,
                _ => Fence::Strong,
            },
        }
    }
}

/// Why an [`Op`] cannot be encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuildError {
    /// More than 63 units: too many segments or too much inline data.
    TooLarge {
        /// Units the WQE would need.
        ds: usize,
    },
    /// The ring is not a power of two number of blocks, or is too small for the WQE.
    BadRing {
        /// Ring size in blocks.
        blocks: usize,
    },
    /// The QPN does not fit in 24 bits.
    BadQpn(u32),
}

impl core::fmt::Display for BuildError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::TooLarge { ds } => write!(f, "WQE needs {ds} units, at most {MAX_DS} fit"),
            Self::BadRing { blocks } => {
                write!(
                    f,
                    "ring of {blocks} blocks is not a power of two large enough for the WQE"
                )
            }
            Self::BadQpn(q) => write!(f, "QPN {q:#x} does not fit in 24 bits"),
        }
    }
}

/// An encoded WQE: whole 64-byte blocks, reserved bytes zero.
#[derive(Clone, Debug)]
pub struct WqeBuf {
    bytes: [u8; MAX_WQE_BBS * WQEBB],
    ds: u8,
}

impl WqeBuf {
    /// Length in 16-byte units.
    pub fn ds(&self) -> u8 {
        self.ds
    }
    /// Number of 64-byte blocks.
    pub fn blocks(&self) -> usize {
        blocks_for_ds(self.ds)
    }
    /// The bytes of all blocks (a multiple of 64).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.blocks() * WQEBB]
    }
    /// The control segment.
    pub fn ctrl(&self) -> CtrlSeg {
        bytemuck::pod_read_unaligned(&self.bytes[..16])
    }
    /// Block `i` of the WQE.
    pub fn block(&self, i: usize) -> &[u8; WQEBB] {
        self.bytes[i * WQEBB..(i + 1) * WQEBB]
            .try_into()
            .expect("a block is 64 bytes")
    }
    /// Copies the blocks into `ring` (a power of two number of 64-byte blocks) starting at the
    /// WQE's own index, wrapping at the ring's end. Returns the index after the WQE.
    pub fn copy_to_ring(&self, ring: &mut [u8]) -> Result<u16, BuildError> {
        let nblocks = ring.len() / WQEBB;
        if ring.len() % WQEBB != 0 || !nblocks.is_power_of_two() || nblocks < self.blocks() {
            return Err(BuildError::BadRing { blocks: nblocks });
        }
        let idx = self.ctrl().wqe_index();
        for i in 0..self.blocks() {
            let slot = (idx as usize + i) & (nblocks - 1);
            ring[slot * WQEBB..(slot + 1) * WQEBB].copy_from_slice(self.block(i));
        }
        Ok(idx.wrapping_add(self.blocks() as u16))
    }
}

impl WqeBuf {
    /// This WQE (an encoded SEND or SEND_IMM, or any other for a test of what a UD QP
    /// refuses) with the datagram segment `av` inserted after its control segment, as a UD
    /// send queue takes it; `ds` grows by 3.
    pub fn with_datagram(&self, av: &DatagramSeg) -> Result<WqeBuf, BuildError> {
        let ds = self.ds as usize + DATAGRAM_UNITS;
        if ds > MAX_DS as usize {
            return Err(BuildError::TooLarge { ds });
        }
        let mut out = WqeBuf {
            bytes: [0; MAX_WQE_BBS * WQEBB],
            ds: ds as u8,
        };
        let n = self.ds as usize * DS_UNIT;
        out.bytes[..DS_UNIT].copy_from_slice(&self.bytes[..DS_UNIT]);
        out.bytes[DS_UNIT..4 * DS_UNIT].copy_from_slice(bytemuck::bytes_of(av));
        out.bytes[4 * DS_UNIT..n + 3 * DS_UNIT].copy_from_slice(&self.bytes[DS_UNIT..n]);
        // qpn_ds: bytes 4..8, ds in the low 6 bits of byte 7
        out.bytes[7] = (out.bytes[7] & !0x3f) | ds as u8;
        Ok(out)
    }
}

impl WqeBuf {
    /// This WQE with the XRC segment (`struct mlx5_wqe_xrc_seg`: BE32 `xrc_srqn`, 12 reserved
    /// bytes) naming remote XRC SRQ `srqn` inserted after its control segment, as an XRC
    /// initiator's send queue takes it; `ds` grows by 1.
    pub fn with_xrc(&self, srqn: u32) -> Result<WqeBuf, BuildError> {
        let ds = self.ds as usize + 1;
        if ds > MAX_DS as usize {
            return Err(BuildError::TooLarge { ds });
        }
        let mut out = WqeBuf {
            bytes: [0; MAX_WQE_BBS * WQEBB],
            ds: ds as u8,
        };
        let n = self.ds as usize * DS_UNIT;
        out.bytes[..DS_UNIT].copy_from_slice(&self.bytes[..DS_UNIT]);
        out.bytes[DS_UNIT..DS_UNIT + 4].copy_from_slice(&(srqn & 0xff_ffff).to_be_bytes());
        out.bytes[2 * DS_UNIT..n + DS_UNIT].copy_from_slice(&self.bytes[DS_UNIT..n]);
        out.bytes[7] = (out.bytes[7] & !0x3f) | ds as u8;
        Ok(out)
    }
}

/// Incremental writer of 16-byte units into a [`WqeBuf`].
struct Units {
    buf: WqeBuf,
    at: usize,
}

impl Units {
    fn push<T: Pod>(&mut self, seg: &T) -> Result<(), BuildError> {
        let b = bytemuck::bytes_of(seg);
        self.push_bytes(b)
    }
    /// Appends bytes, padded to a 16-byte unit with zeros.
    fn push_bytes(&mut self, b: &[u8]) -> Result<(), BuildError> {
        let units = b.len().div_ceil(DS_UNIT);
        let end = self.at + units * DS_UNIT;
        if end > MAX_DS as usize * DS_UNIT {
            return Err(BuildError::TooLarge { ds: end / DS_UNIT });
        }
        self.buf.bytes[self.at..self.at + b.len()].copy_from_slice(b);
        self.at = end;
        Ok(())
    }
    fn push_local(&mut self, local: &Local<'_>) -> Result<(), BuildError> {
        match local {
            Local::Sges(sges) => sges.iter().try_for_each(|s| self.push(&DataSeg::new(*s))),
            Local::Inline(data) => {
                let need = (4 + data.len()).div_ceil(DS_UNIT) * DS_UNIT + self.at;
                if need > MAX_DS as usize * DS_UNIT || data.len() > 0x7fff_ffff {
                    return Err(BuildError::TooLarge { ds: need / DS_UNIT });
                }
                let hdr = Be32::new(data.len() as u32 | INLINE_SEG).to_bytes();
                self.buf.bytes[self.at..self.at + 4].copy_from_slice(&hdr);
                self.buf.bytes[self.at + 4..self.at + 4 + data.len()].copy_from_slice(data);
                self.at = need;
                Ok(())
            }
        }
    }
}

/// The UMR control segment, mkey context and (for a bind of a non-empty range) the inline KLM
/// of a memory-window WQE, laid out as libmlx5's `set_bind_wr` does. `qpn` is `Some` for a
/// type 2 window (for an invalidation the value is not used); `bind` `None` is LOCAL_INV.
fn push_umr(
    u: &mut Units,
    variant: u8,
    qpn: Option<u32>,
    bind: Option<&WindowBind>,
) -> Result<(), BuildError> {
    let len = bind.map_or(0, |b| b.region.len);
    let mut flags = UMR_FLAG_TRANSLATION_OFFSET | UMR_FLAG_INLINE;
    let mut mask = UMR_MASK_FREE | UMR_MASK_MKEY;
    if qpn.is_some() {
        mask |= UMR_MASK_QPN;
        flags |= if len != 0 {
            UMR_FLAG_CHECK_FREE
        } else {
            UMR_FLAG_CHECK_QPN
        };
    }
    if len != 0 {
        mask |= UMR_MASK_LEN | UMR_MASK_START_ADDR | UMR_MASK_ACCESS;
    }
    // one KLM, padded to 64 bytes (libmlx5's `get_klm_octo(1)`), or none
    let octowords = if len != 0 { 4 } else { 0 };
    u.push(&UmrCtrlSeg {
        flags,
        klm_octowords: Be16::new(octowords),
        mkey_mask: Be64::new(mask),
        ..UmrCtrlSeg::default()
    })?;
    let owner = match qpn {
        Some(q) if len != 0 => q << 8,
        _ => 0xffff_ff00,
    };
    let mut mkey = MkeyContextSeg {
        qpn_mkey: Be32::new(owner | variant as u32),
        ..MkeyContextSeg::default()
    };
    match bind {
        Some(b) if len != 0 => {
            mkey.access_flags = b.access;
            mkey.start_addr = Be64::new(b.start);
            mkey.len = Be64::new(len as u64);
            u.push(&mkey)?;
            u.push(&KlmSeg {
                byte_count: Be32::new(len),
                mkey: Be32::new(b.region.lkey.0),
                address: Be64::new(b.region.addr),
            })?;
            // the inline KLM is padded to 64 bytes
            u.push_bytes(&[0; 48])
        }
        _ => {
            mkey.free = MKEY_FREE;
            u.push(&mkey)
        }
    }
}

fn raddr(r: RemoteAddr) -> RaddrSeg {
    RaddrSeg {
        raddr: Be64::new(r.addr),
        rkey: BeRkey::new(r.rkey),
        reserved: [0; 4],
    }
}

impl Op<'_> {
    /// The opcode and opmod this operation encodes to.
    pub fn opcode(&self) -> (Opcode, u8) {
        match self {
            Op::Nop => (Opcode::Nop, 0),
            Op::Write { imm: None, .. } => (Opcode::RdmaWrite, 0),
            Op::Write { imm: Some(_), .. } => (Opcode::RdmaWriteImm, 0),
            Op::Send { imm: None, .. } => (Opcode::Send, 0),
            Op::Send { imm: Some(_), .. } => (Opcode::SendImm, 0),
            Op::Read { .. } => (Opcode::RdmaRead, 0),
            Op::FetchAdd { .. } => (Opcode::AtomicFa, 0),
            Op::CompareSwap { .. } => (Opcode::AtomicCs, 0),
            Op::MaskedFetchAdd { size, .. } => (Opcode::AtomicMaskedFa, size.opmod()),
            Op::MaskedCompareSwap { size, .. } => (Opcode::AtomicMaskedCs, size.opmod()),
            Op::Wait { .. } => (Opcode::Wait, 0),
            Op::Dump { .. } => (Opcode::Dump, 0),
            Op::SendInvalidate { .. } => (Opcode::SendInval, 0),
            Op::BindWindow(_) | Op::LocalInvalidate { .. } => (Opcode::Umr, 0),
        }
    }

    /// Encodes the WQE whose first block has 16-bit index `idx`, for QP `qpn`.
    pub fn encode(&self, idx: u16, qpn: u32, flags: CtrlFlags) -> Result<WqeBuf, BuildError> {
        if qpn > 0x00ff_ffff {
            return Err(BuildError::BadQpn(qpn));
        }
        let mut u = Units {
            buf: WqeBuf {
                bytes: [0; MAX_WQE_BBS * WQEBB],
                ds: 0,
            },
            at: DS_UNIT,
        };
        let mut imm = 0u32;
        match *self {
            Op::Nop => {}
            Op::Write {
                remote,
                local,
                imm: i,
            } => {
                imm = i.unwrap_or(0);
                u.push(&raddr(remote))?;
                u.push_local(&local)?;
            }
            Op::Send { local, imm: i } => {
                imm = i.unwrap_or(0);
                u.push_local(&local)?;
            }
            Op::Read { remote, local } => {
                u.push(&raddr(remote))?;
                u.push_local(&Local::Sges(local))?;
            }
            Op::FetchAdd {
                remote,
                add,
                result,
            } => {
                u.push(&raddr(remote))?;
                u.push(&AtomicSeg {
                    swap_add: Be64::new(add),
                    compare: Be64::new(0),
                })?;
                u.push(&DataSeg::new(result))?;
            }
            Op::CompareSwap {
                remote,
                compare,
                swap,
                result,
            } => {
                u.push(&raddr(remote))?;
                u.push(&AtomicSeg {
                    swap_add: Be64::new(swap),
                    compare: Be64::new(compare),
                })?;
                u.push(&DataSeg::new(result))?;
            }
            Op::MaskedFetchAdd {
                size,
                remote,
                add,
                field_boundary,
                result,
            } => {
                u.push(&raddr(remote))?;
                match size {
                    AtomicSize::B4 => u.push(&MaskedFa32Seg {
                        add: Be32::new(add as u32),
                        field_boundary: Be32::new(field_boundary as u32),
                        reserved: [0; 8],
                    })?,
                    AtomicSize::B8 => u.push(&MaskedFa64Seg {
                        add: Be64::new(add),
                        field_boundary: Be64::new(field_boundary),
                    })?,
                }
                u.push(&DataSeg::new(result))?;
            }
            Op::MaskedCompareSwap {
                size,
                remote,
                compare,
                compare_mask,
                swap,
                swap_mask,
                result,
            } => {
                u.push(&raddr(remote))?;
                match size {
                    AtomicSize::B4 => u.push(&MaskedCs32Seg {
                        swap: Be32::new(swap as u32),
                        compare: Be32::new(compare as u32),
                        swap_mask: Be32::new(swap_mask as u32),
                        compare_mask: Be32::new(compare_mask as u32),
                    })?,
                    AtomicSize::B8 => u.push(&MaskedCs64Seg {
                        swap: Be64::new(swap),
                        compare: Be64::new(compare),
                        swap_mask: Be64::new(swap_mask),
                        compare_mask: Be64::new(compare_mask),
                    })?,
                }
                u.push(&DataSeg::new(result))?;
            }
            Op::Wait { cqn, max_index } => u.push(&WaitSeg {
                reserved: [0; 8],
                max_index: Be32::new(max_index),
                cqn: Be32::new(cqn),
            })?,
            Op::Dump { local } => u.push(&DataSeg::new(local))?,
            Op::SendInvalidate { local, rkey } => {
                imm = rkey;
                u.push_local(&local)?;
            }
            Op::BindWindow(b) => {
                imm = b.window;
                push_umr(&mut u, b.variant, b.qpn, Some(&b))?;
            }
            Op::LocalInvalidate { rkey } => {
                imm = rkey;
                push_umr(&mut u, 0, Some(0), None)?;
            }
        }
        let ds = (u.at / DS_UNIT) as u8;
        let (opcode, opmod) = self.opcode();
        let ctrl = CtrlSeg {
            opmod_idx_opcode: Be32::new((opmod as u32) << 24 | (idx as u32) << 8 | opcode as u32),
            qpn_ds: Be32::new(qpn << 8 | ds as u32),
            signature: 0,
            dci_stream_channel_id: Be16::new(0),
            fm_ce_se: flags.fm_ce_se(),
            imm: Be32::new(imm),
        };
        u.buf.bytes[..DS_UNIT].copy_from_slice(bytemuck::bytes_of(&ctrl));
        u.buf.ds = ds;
        Ok(u.buf)
    }
}

/// Largest inline payload a WRITE can carry in one WQE (ctrl + raddr + inline header).
pub const MAX_INLINE_WRITE: usize = (MAX_DS as usize - 2) * DS_UNIT - 4;
/// Largest inline payload a SEND can carry in one WQE.
pub const MAX_INLINE_SEND: usize = (MAX_DS as usize - 1) * DS_UNIT - 4;

#[cfg(test)]
mod tests;
