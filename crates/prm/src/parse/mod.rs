//! Raw WQE bytes → a typed operation, or a typed error carrying the CQE syndrome a ConnectX
//! reports for it. This is the soft NIC's sanitizer front end: it checks everything that can be
//! checked from the WQE alone (opcode, opmod, `ds` against the opcode's shape, inline and atomic
//! lengths). Keys, ranges and rights are the device's business.

use crate::cqe::Syndrome;
use crate::endian::Be32;
use crate::wqe::{
    AtomicSeg, AtomicSize, CtrlFlags, CtrlSeg, DataSeg, DatagramSeg, KlmSeg, MaskedCs32Seg,
    MaskedCs64Seg, MaskedFa32Seg, MaskedFa64Seg, MkeyContextSeg, Opcode, RaddrSeg, RemoteAddr,
    RepeatBlockSeg, RepeatEntSeg, Sge, UmrCtrlSeg, WaitSeg, DATAGRAM_UNITS, EXTENDED_UD_AV,
    INLINE_SEG, MKEY_FREE, OPMOD_MASKED_ATOMIC_4B, OPMOD_MASKED_ATOMIC_8B, REPEAT_BLOCK_OP,
    UMR_FLAG_CHECK_FREE, UMR_FLAG_CHECK_QPN, UMR_FLAG_INLINE, UMR_MASK_LEN,
};
use crate::DS_UNIT;
use bytemuck::Pod;

/// A data segment's byte count of 0 means 2 GiB to the hardware.
pub const ZERO_BYTE_COUNT_LEN: u32 = 0x8000_0000;

/// The local side of a parsed WRITE or SEND.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParsedLocal<'a> {
    /// Gather list, as stored (big-endian).
    Sges(&'a [DataSeg]),
    /// Inline payload.
    Inline(&'a [u8]),
    /// Inline and pointer data segments mixed, in WQE order (the units as stored, already
    /// checked to hold whole segments): a ConnectX gathers them in order. UCX posts an inline
    /// header followed by pointer segments this way. [`ParsedLocal::segments`] walks them.
    Mixed(&'a [u8]),
}

/// One data segment of a WRITE's or SEND's local side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalSeg<'a> {
    /// Inline bytes.
    Inline(&'a [u8]),
    /// A pointer segment (host order, byte count 0 read as 2 GiB).
    Sge(Sge),
}

/// The segments of a [`ParsedLocal`], in order.
pub struct Segments<'a> {
    local: ParsedLocal<'a>,
    pos: usize,
}

impl<'a> Iterator for Segments<'a> {
    type Item = LocalSeg<'a>;
    fn next(&mut self) -> Option<LocalSeg<'a>> {
        match self.local {
            ParsedLocal::Sges(list) => {
                let d = list.get(self.pos)?;
                self.pos += 1;
                Some(LocalSeg::Sge(sge_of(d)))
            }
            ParsedLocal::Inline(b) => {
                if self.pos > 0 {
                    return None;
                }
                self.pos = 1;
                Some(LocalSeg::Inline(b))
            }
            ParsedLocal::Mixed(body) => {
                let at = self.pos;
                let hdr: [u8; 4] = body.get(at..at + 4)?.try_into().ok()?;
                let bc = Be32::from_bytes(hdr).get();
                if bc & INLINE_SEG != 0 {
                    let len = (bc & !INLINE_SEG) as usize;
                    let b = body.get(at + 4..at + 4 + len)?;
                    self.pos = at + (4 + len).div_ceil(DS_UNIT) * DS_UNIT;
                    Some(LocalSeg::Inline(b))
                } else {
                    let d: DataSeg = bytemuck::pod_read_unaligned(body.get(at..at + DS_UNIT)?);
                    self.pos = at + DS_UNIT;
                    Some(LocalSeg::Sge(sge_of(&d)))
                }
            }
        }
    }
}

impl<'a> ParsedLocal<'a> {
    /// The data segments, in the order the device gathers them.
    pub fn segments(&self) -> Segments<'a> {
        Segments {
            local: *self,
            pos: 0,
        }
    }
    /// Bytes of inline data.
    pub fn inline_len(&self) -> u64 {
        self.segments()
            .map(|s| match s {
                LocalSeg::Inline(b) => b.len() as u64,
                LocalSeg::Sge(_) => 0,
            })
            .sum()
    }
    /// Total bytes the local side describes (a zero byte count is 2 GiB).
    pub fn len(&self) -> u64 {
        match self {
            Self::Sges(s) => s.iter().map(|d| sge_of(d).len as u64).sum(),
            Self::Inline(b) => b.len() as u64,
            Self::Mixed(_) => self
                .segments()
                .map(|s| match s {
                    LocalSeg::Inline(b) => b.len() as u64,
                    LocalSeg::Sge(g) => g.len as u64,
                })
                .sum(),
        }
    }
    /// Whether no bytes are described.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Host-order SGE of a stored data segment, with byte count 0 read as 2 GiB.
pub fn sge_of(d: &DataSeg) -> Sge {
    let mut s = d.sge();
    if s.len == 0 {
        s.len = ZERO_BYTE_COUNT_LEN;
    }
    s
}

/// The operation part of an atomic WQE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicKind {
    /// 8-byte fetch-and-add.
    FetchAdd {
        /// Addend.
        add: u64,
    },
    /// 8-byte compare-and-swap.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Masked fetch-and-add.
    MaskedFetchAdd {
        /// Operand size.
        size: AtomicSize,
        /// Addend.
        add: u64,
        /// Field boundaries.
        field_boundary: u64,
    },
    /// Masked compare-and-swap.
    MaskedCompareSwap {
        /// Operand size.
        size: AtomicSize,
        /// Expected value.
        compare: u64,
        /// Compare mask.
        compare_mask: u64,
        /// New value.
        swap: u64,
        /// Swap mask.
        swap_mask: u64,
    },
}

impl AtomicKind {
    /// Operand size in bytes.
    pub fn size(&self) -> u32 {
        match self {
            Self::FetchAdd { .. } | Self::CompareSwap { .. } => 8,
            Self::MaskedFetchAdd { size, .. } | Self::MaskedCompareSwap { size, .. } => {
                size.bytes()
            }
        }
    }
}

/// A parsed operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParsedOp<'a> {
    /// NOP (any length).
    Nop,
    /// RDMA_WRITE or RDMA_WRITE_IMM.
    Write {
        /// Target.
        remote: RemoteAddr,
        /// Source.
        local: ParsedLocal<'a>,
    },
    /// SEND or SEND_IMM.
    Send {
        /// Source.
        local: ParsedLocal<'a>,
    },
    /// RDMA_READ.
    Read {
        /// Source at the peer.
        remote: RemoteAddr,
        /// Destination list.
        local: &'a [DataSeg],
    },
    /// Any atomic.
    Atomic {
        /// Target word.
        remote: RemoteAddr,
        /// The operation.
        kind: AtomicKind,
        /// Buffer for the old value.
        result: Sge,
    },
    /// WAIT on a CQ index.
    Wait {
        /// CQ number.
        cqn: u32,
        /// CQE index to wait for.
        max_index: u32,
    },
    /// DUMP: a local read of one data segment.
    Dump {
        /// The range (byte count 0 read as 2 GiB).
        local: Sge,
    },
    /// UMR: changes an mkey (a memory window's binding, an indirect mkey's layout) or frees
    /// it. Which of these it is depends on the mkey it names, which only the device knows.
    Umr(UmrOp<'a>),
}

/// A UMR WQE as the device reads it: the control segment's mkey, the UMR control segment's
/// flags and mask, the mkey context, and the inline translation entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UmrOp<'a> {
    /// The mkey as the poster knows it (the control segment's immediate).
    pub key: u32,
    /// `UMR_FLAG_*`.
    pub flags: u8,
    /// Which mkey context fields change (`UMR_MASK_*`).
    pub mask: u64,
    /// The mkey context.
    pub ctx: MkeyContextSeg,
    /// The inline translation entries (`klm_octowords` × 16 bytes, padding included); empty
    /// when there are none.
    pub xlat: &'a [u8],
}

/// The translation of an indirect mkey, as a UMR carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout<'a> {
    /// A list of (key, address, length) entries, in the mkey's address order (padding
    /// entries included: the mkey's length says where the list ends).
    List(&'a [KlmSeg]),
    /// A block of strided entries, repeated.
    Repeat {
        /// How many times the block repeats.
        count: u32,
        /// Bytes of one block, as the header states it.
        block_len: u32,
        /// The block's entries.
        entries: &'a [RepeatEntSeg],
    },
}

impl<'a> UmrOp<'a> {
    /// Whether the UMR frees the mkey (the context's free bit, with the free bit in the mask).
    pub fn frees(&self) -> bool {
        self.ctx.free & MKEY_FREE != 0
    }

    /// Whether the mkey must be free (`UMR_FLAG_CHECK_FREE`).
    pub fn check_free(&self) -> bool {
        self.flags & UMR_FLAG_CHECK_FREE != 0
    }

    /// Whether the mkey must belong to the posting QP (`UMR_FLAG_CHECK_QPN`).
    pub fn check_qpn(&self) -> bool {
        self.flags & UMR_FLAG_CHECK_QPN != 0
    }

    /// The UMR read as a memory-window operation (what libmlx5 writes for `IBV_WR_BIND_MW`,
    /// `ibv_bind_mw` and `IBV_WR_LOCAL_INV`): a bind carries one inline KLM whose byte count
    /// is the window's length. `None` when the WQE does not have that shape.
    pub fn window(&self) -> Option<MwOp> {
        let bind = if self.frees() {
            None
        } else {
            if self.flags & UMR_FLAG_INLINE == 0
                || self.mask & UMR_MASK_LEN == 0
                || self.xlat.len() < 16
            {
                return None;
            }
            let klm: KlmSeg = bytemuck::pod_read_unaligned(&self.xlat[..16]);
            let len = self.ctx.len.get();
            if klm.byte_count.get() as u64 != len {
                return None;
            }
            Some(MwBind {
                start: self.ctx.start_addr.get(),
                len,
                access: self.ctx.access_flags,
                mr_key: klm.mkey.get(),
                mr_addr: klm.address.get(),
            })
        };
        let qpn_mkey = self.ctx.qpn_mkey.get();
        Some(MwOp {
            key: self.key,
            variant: qpn_mkey as u8,
            qpn: qpn_mkey >> 8,
            bind,
            check_free: self.check_free(),
            check_qpn: self.check_qpn(),
        })
    }

    /// The translation the UMR gives an indirect mkey: a repeated block when the entries
    /// start with a header whose `op` is [`REPEAT_BLOCK_OP`], else a KLM list. `None` when the
    /// UMR carries no inline entries, or a header names more entries than follow.
    pub fn layout(&self) -> Option<Layout<'a>> {
        if self.flags & UMR_FLAG_INLINE == 0 || self.xlat.len() < 16 {
            return None;
        }
        let head: RepeatBlockSeg = bytemuck::pod_read_unaligned(&self.xlat[..16]);
        if head.op.get() != REPEAT_BLOCK_OP {
            return Some(Layout::List(bytemuck::cast_slice(self.xlat)));
        }
        let n = head.num_ent.get() as usize;
        let entries = self.xlat.get(16..16 + n * 16)?;
        Some(Layout::Repeat {
            count: head.repeat_count.get(),
            block_len: head.byte_count.get(),
            entries: bytemuck::cast_slice(entries),
        })
    }
}

/// A memory-window operation, as a UMR WQE carries it (what libmlx5 writes for
/// `IBV_WR_BIND_MW`, `ibv_bind_mw` and `IBV_WR_LOCAL_INV`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MwOp {
    /// The window's key as the poster knows it (the control segment's immediate).
    pub key: u32,
    /// The low byte the key has after a bind.
    pub variant: u8,
    /// The QPN the window is bound to; `0xff_ffff` for none (type 1 windows, frees).
    pub qpn: u32,
    /// The range bound, or `None` to free (unbind, invalidate) the window.
    pub bind: Option<MwBind>,
    /// Fail unless the window is free (binding a type 2 window).
    pub check_free: bool,
    /// Fail unless the window is bound to the posting QP (invalidating a type 2 window).
    pub check_qpn: bool,
}

/// The range a window is bound to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MwBind {
    /// The window's first address as peers name it (0 for a zero-based window).
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// Rights, as `MKEY_ACCESS_*` bits.
    pub access: u8,
    /// The region's lkey (the KLM's mkey).
    pub mr_key: u32,
    /// The region address `start` maps to.
    pub mr_addr: u64,
}

/// A WQE as the device sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParsedWqe<'a> {
    /// Opcode.
    pub opcode: Opcode,
    /// Opcode modifier.
    pub opmod: u8,
    /// 16-bit index of the first block, from the control segment.
    pub wqe_index: u16,
    /// QPN from the control segment.
    pub qpn: u32,
    /// Length in 16-byte units.
    pub ds: u8,
    /// Signaled / solicited / fence.
    pub flags: CtrlFlags,
    /// Immediate, raw as stored (meaningful for the `_IMM` opcodes).
    pub imm: Be32,
    /// The operation.
    pub op: ParsedOp<'a>,
}

impl ParsedWqe<'_> {
    /// The immediate in host order, for RDMA_WRITE_IMM and SEND_IMM.
    pub fn imm(&self) -> Option<u32> {
        matches!(self.opcode, Opcode::RdmaWriteImm | Opcode::SendImm).then(|| self.imm.get())
    }

    /// The rkey the responder invalidates, for SEND_INVAL.
    pub fn invalidate(&self) -> Option<u32> {
        (self.opcode == Opcode::SendInval).then(|| self.imm.get())
    }
}

/// Why a WQE is malformed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WqeError {
    /// Fewer bytes than the control segment, or than `ds` says.
    Truncated {
        /// Bytes given.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
    /// `ds` is zero.
    ZeroDs,
    /// An opcode the device does not implement.
    UnknownOpcode(u8),
    /// An opmod that does not belong to the opcode.
    BadOpmod {
        /// Opcode byte.
        opcode: u8,
        /// Opmod byte.
        opmod: u8,
    },
    /// `ds` does not fit the opcode's segment layout.
    BadShape {
        /// Opcode byte.
        opcode: u8,
        /// `ds` found.
        ds: u8,
    },
    /// Inline data where the opcode does not allow it (RDMA_READ).
    InlineNotAllowed {
        /// Opcode byte.
        opcode: u8,
    },
    /// The inline byte count does not match the units the WQE spends on it.
    InlineLength {
        /// Inline length stored.
        len: u32,
        /// Units left for it.
        units: u8,
    },
    /// An opcode a UD QP does not execute (RDMA, atomics, UMR, ...).
    NotOnUd {
        /// Opcode byte.
        opcode: u8,
    },
    /// An opcode a DC initiator does not execute (UMR, SEND with invalidate).
    NotOnDci {
        /// Opcode byte.
        opcode: u8,
    },
    /// The result buffer of an atomic is not the operand size.
    AtomicLength {
        /// Byte count stored.
        len: u32,
        /// Operand size.
        size: u32,
    },
}

impl WqeError {
    /// The CQE syndrome a ConnectX reports for this error.
    pub fn syndrome(&self) -> Syndrome {
        match self {
            Self::InlineLength { .. } | Self::AtomicLength { .. } => Syndrome::LocalLength,
            _ => Syndrome::LocalQpOp,
        }
    }
}

impl core::fmt::Display for WqeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Truncated { have, need } => write!(f, "WQE truncated: {have} of {need} bytes"),
            Self::ZeroDs => f.write_str("WQE with ds 0"),
            Self::UnknownOpcode(o) => write!(f, "unknown WQE opcode {o:#04x}"),
            Self::BadOpmod { opcode, opmod } => write!(
                f,
                "opmod {opmod:#04x} invalid for {}",
                crate::wqe::opcode_name(*opcode)
            ),
            Self::BadShape { opcode, ds } => write!(
                f,
                "ds {ds} does not fit the segments of {}",
                crate::wqe::opcode_name(*opcode)
            ),
            Self::InlineNotAllowed { opcode } => {
                write!(f, "inline data in {}", crate::wqe::opcode_name(*opcode))
            }
            Self::InlineLength { len, units } => {
                write!(f, "inline length {len} does not fit {units} units")
            }
            Self::AtomicLength { len, size } => {
                write!(f, "atomic result buffer of {len} bytes, operand is {size}")
            }
            Self::NotOnUd { opcode } => write!(
                f,
                "{} on a UD QP (SEND and SEND_IMM only)",
                crate::wqe::opcode_name(*opcode)
            ),
            Self::NotOnDci { opcode } => {
                write!(f, "{} on a DC initiator", crate::wqe::opcode_name(*opcode))
            }
        }
    }
}

/// Reads one segment from a unit offset.
fn seg<T: Pod>(units: &[u8], at: usize) -> T {
    bytemuck::pod_read_unaligned(&units[at * DS_UNIT..at * DS_UNIT + core::mem::size_of::<T>()])
}

fn remote(r: RaddrSeg) -> RemoteAddr {
    RemoteAddr {
        addr: r.raddr.get(),
        rkey: r.rkey.get(),
    }
}

/// Reads the local part of a WRITE/SEND from units `from..ds`: data segments in order, each
/// a 16-byte pointer segment or an inline segment (byte count with the inline bit, then the
/// bytes, padded to whole units). An inline segment that runs past `ds` is
/// [`WqeError::InlineLength`].
fn local(bytes: &[u8], from: usize, ds: usize) -> Result<ParsedLocal<'_>, WqeError> {
    let body = &bytes[from * DS_UNIT..ds * DS_UNIT];
    let mut at = 0;
    let mut inline = false;
    while at < body.len() {
        let hdr: [u8; 4] = body[at..at + 4].try_into().expect("4 bytes");
        let bc = Be32::from_bytes(hdr).get();
        if bc & INLINE_SEG == 0 {
            at += DS_UNIT;
            continue;
        }
        let len = bc & !INLINE_SEG;
        let left = (body.len() - at) / DS_UNIT;
        let units = (4 + len as usize).div_ceil(DS_UNIT);
        if units > left {
            return Err(WqeError::InlineLength {
                len,
                units: left as u8,
            });
        }
        if at == 0 && units == left {
            return Ok(ParsedLocal::Inline(&body[4..4 + len as usize]));
        }
        inline = true;
        at += units * DS_UNIT;
    }
    if inline {
        Ok(ParsedLocal::Mixed(body))
    } else {
        Ok(ParsedLocal::Sges(bytemuck::cast_slice(body)))
    }
}

/// Reads a UMR WQE of `n` units: UMR control segment at unit 1, mkey context at unit 4, and
/// `klm_octowords` units of inline translation entries from unit 8. `None` when the units do
/// not hold them.
fn umr(bytes: &[u8], n: usize, key: u32) -> Option<UmrOp<'_>> {
    if n < 8 {
        return None;
    }
    let u: UmrCtrlSeg = seg(bytes, 1);
    let octo = u.klm_octowords.get() as usize;
    if octo > 0 && (u.flags & UMR_FLAG_INLINE == 0 || 8 + octo > n) {
        return None;
    }
    Some(UmrOp {
        key,
        flags: u.flags,
        mask: u.mkey_mask.get(),
        ctx: seg(bytes, 4),
        xlat: &bytes[8 * DS_UNIT..(8 + octo) * DS_UNIT],
    })
}

/// Parses the WQE at the start of `bytes` (the WQE's blocks, already gathered in order).
pub fn parse_wqe(bytes: &[u8]) -> Result<ParsedWqe<'_>, WqeError> {
    let ctrl = ctrl_of(bytes)?;
    let (opcode, opmod) = opcode_of(&ctrl)?;
    let op = parse_op(bytes, &ctrl, ctrl.ds() as usize, opcode, opmod)?;
    Ok(parsed(&ctrl, opcode, opmod, op))
}

/// The control segment of the WQE at the start of `bytes`, once `bytes` holds the `ds` units
/// it names (at least one).
fn ctrl_of(bytes: &[u8]) -> Result<CtrlSeg, WqeError> {
    if bytes.len() < DS_UNIT {
        return Err(WqeError::Truncated {
            have: bytes.len(),
            need: DS_UNIT,
        });
    }
    let ctrl: CtrlSeg = seg(bytes, 0);
    let n = ctrl.ds() as usize;
    if n == 0 {
        return Err(WqeError::ZeroDs);
    }
    if bytes.len() < n * DS_UNIT {
        return Err(WqeError::Truncated {
            have: bytes.len(),
            need: n * DS_UNIT,
        });
    }
    Ok(ctrl)
}

/// A parsed WQE from its checked control segment and operation.
fn parsed<'a>(ctrl: &CtrlSeg, opcode: Opcode, opmod: u8, op: ParsedOp<'a>) -> ParsedWqe<'a> {
    ParsedWqe {
        opcode,
        opmod,
        wqe_index: ctrl.wqe_index(),
        qpn: ctrl.qpn(),
        ds: ctrl.ds(),
        flags: CtrlFlags::from_fm_ce_se(ctrl.fm_ce_se),
        imm: ctrl.imm,
        op,
    }
}

/// The opcode and opmod of a control segment, checked: a known opcode, and an opmod that fits
/// it (a masked atomic's operand size, else 0).
fn opcode_of(ctrl: &CtrlSeg) -> Result<(Opcode, u8), WqeError> {
    let raw_op = ctrl.opcode();
    let opmod = ctrl.opmod();
    let opcode = Opcode::from_u8(raw_op).ok_or(WqeError::UnknownOpcode(raw_op))?;
    let masked = matches!(opcode, Opcode::AtomicMaskedCs | Opcode::AtomicMaskedFa);
    let opmod_ok = if masked {
        opmod == OPMOD_MASKED_ATOMIC_4B || opmod == OPMOD_MASKED_ATOMIC_8B
    } else {
        opmod == 0
    };
    if !opmod_ok {
        return Err(WqeError::BadOpmod {
            opcode: raw_op,
            opmod,
        });
    }
    Ok((opcode, opmod))
}

/// The operation of a WQE whose control segment checked out: its segments read for `opcode`
/// (`n` data units in all), each kind's shape checked.
fn parse_op<'a>(
    bytes: &'a [u8],
    ctrl: &CtrlSeg,
    n: usize,
    opcode: Opcode,
    opmod: u8,
) -> Result<ParsedOp<'a>, WqeError> {
    let raw_op = ctrl.opcode();
    let shape = WqeError::BadShape {
        opcode: raw_op,
        ds: ctrl.ds(),
    };
    Ok(match opcode {
        Opcode::Nop => ParsedOp::Nop,
        Opcode::RdmaWrite | Opcode::RdmaWriteImm => {
            if n < 2 {
                return Err(shape);
            }
            ParsedOp::Write {
                remote: remote(seg(bytes, 1)),
                local: local(bytes, 2, n)?,
            }
        }
        Opcode::Send | Opcode::SendImm | Opcode::SendInval => ParsedOp::Send {
            local: local(bytes, 1, n)?,
        },
        Opcode::RdmaRead => {
            if n < 2 {
                return Err(shape);
            }
            match local(bytes, 2, n)? {
                ParsedLocal::Sges(list) => ParsedOp::Read {
                    remote: remote(seg(bytes, 1)),
                    local: list,
                },
                ParsedLocal::Inline(_) | ParsedLocal::Mixed(_) => {
                    return Err(WqeError::InlineNotAllowed { opcode: raw_op })
                }
            }
        }
        Opcode::AtomicCs | Opcode::AtomicFa | Opcode::AtomicMaskedCs | Opcode::AtomicMaskedFa => {
            atomic(bytes, n, opcode, opmod, shape)?
        }
        Opcode::Wait => {
            if n != 2 {
                return Err(shape);
            }
            let w: WaitSeg = seg(bytes, 1);
            ParsedOp::Wait {
                cqn: w.cqn.get(),
                max_index: w.max_index.get(),
            }
        }
        Opcode::Dump => {
            if n != 2 {
                return Err(shape);
            }
            let d: DataSeg = seg(bytes, 1);
            if d.byte_count.get() & INLINE_SEG != 0 {
                return Err(WqeError::InlineNotAllowed { opcode: raw_op });
            }
            ParsedOp::Dump { local: sge_of(&d) }
        }
        Opcode::Umr => ParsedOp::Umr(umr(bytes, n, ctrl.imm.get()).ok_or(shape)?),
    })
}

/// An atomic WQE (`n` data units): its remote address, the operation its AtomicSeg or masked
/// segment names, and its result segment (a pointer of exactly the operand's size).
fn atomic(
    bytes: &[u8],
    n: usize,
    opcode: Opcode,
    opmod: u8,
    shape: WqeError,
) -> Result<ParsedOp<'_>, WqeError> {
    let raw_op = opcode as u8; // the byte it was read from
                               // control, remote address, at least one unit of operands, the result segment: nothing is
                               // read past the WQE's `ds` (a DC WQE's segments are a view that ends there)
    if n < 4 {
        return Err(shape);
    }
    let size = if opmod == OPMOD_MASKED_ATOMIC_4B {
        AtomicSize::B4
    } else {
        AtomicSize::B8
    };
    let (kind, units) = atomic_kind(bytes, n, opcode, size, shape)?;
    if n != 2 + units + 1 {
        return Err(shape);
    }
    let d: DataSeg = seg(bytes, 2 + units);
    if d.byte_count.get() & INLINE_SEG != 0 {
        return Err(WqeError::InlineNotAllowed { opcode: raw_op });
    }
    let result = sge_of(&d);
    if result.len != kind.size() {
        return Err(WqeError::AtomicLength {
            len: result.len,
            size: kind.size(),
        });
    }
    Ok(ParsedOp::Atomic {
        remote: remote(seg(bytes, 1)),
        kind,
        result,
    })
}

/// The operation of an atomic of `size` (4 or 8 bytes) and the data units its segment takes
/// (2 for a masked 8-byte compare-and-swap, which needs `n` of at least 5).
fn atomic_kind(
    bytes: &[u8],
    n: usize,
    opcode: Opcode,
    size: AtomicSize,
    shape: WqeError,
) -> Result<(AtomicKind, usize), WqeError> {
    Ok(match opcode {
        Opcode::AtomicFa | Opcode::AtomicCs => {
            let a: AtomicSeg = seg(bytes, 2);
            let kind = if opcode == Opcode::AtomicFa {
                AtomicKind::FetchAdd {
                    add: a.swap_add.get(),
                }
            } else {
                AtomicKind::CompareSwap {
                    compare: a.compare.get(),
                    swap: a.swap_add.get(),
                }
            };
            (kind, 1)
        }
        Opcode::AtomicMaskedFa if size == AtomicSize::B4 => {
            let a: MaskedFa32Seg = seg(bytes, 2);
            let kind = AtomicKind::MaskedFetchAdd {
                size,
                add: a.add.get() as u64,
                field_boundary: a.field_boundary.get() as u64,
            };
            (kind, 1)
        }
        Opcode::AtomicMaskedFa => {
            let a: MaskedFa64Seg = seg(bytes, 2);
            let kind = AtomicKind::MaskedFetchAdd {
                size,
                add: a.add.get(),
                field_boundary: a.field_boundary.get(),
            };
            (kind, 1)
        }
        _ if size == AtomicSize::B4 => {
            let a: MaskedCs32Seg = seg(bytes, 2);
            let kind = AtomicKind::MaskedCompareSwap {
                size,
                compare: a.compare.get() as u64,
                compare_mask: a.compare_mask.get() as u64,
                swap: a.swap.get() as u64,
                swap_mask: a.swap_mask.get() as u64,
            };
            (kind, 1)
        }
        _ => {
            if n < 5 {
                return Err(shape);
            }
            let a: MaskedCs64Seg = seg(bytes, 2);
            let kind = AtomicKind::MaskedCompareSwap {
                size,
                compare: a.compare.get(),
                compare_mask: a.compare_mask.get(),
                swap: a.swap.get(),
                swap_mask: a.swap_mask.get(),
            };
            (kind, 2)
        }
    })
}

/// The address vector of a UD send WQE, in host order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Datagram {
    /// Q_Key as posted (the high bit set: the sending QP's own Q_Key is sent).
    pub qkey: u32,
    /// Destination QPN.
    pub dest_qpn: u32,
    /// The extended-AV bit (libmlx5 always sets it).
    pub extended: bool,
    /// Destination MAC (RoCE).
    pub rmac: [u8; 6],
    /// Traffic class.
    pub tclass: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Source GID index.
    pub sgid_index: u8,
    /// Flow label.
    pub flow_label: u32,
    /// Destination GID.
    pub rgid: [u8; 16],
}

impl From<DatagramSeg> for Datagram {
    fn from(a: DatagramSeg) -> Self {
        let dqp = a.dqp_dct.get();
        let fl = a.grh_gid_fl.get();
        Self {
            qkey: a.qkey.get(),
            dest_qpn: dqp & 0xff_ffff,
            extended: dqp & EXTENDED_UD_AV != 0,
            rmac: a.rmac,
            tclass: a.tclass,
            hop_limit: a.hop_limit,
            sgid_index: (fl >> 20) as u8,
            flow_label: fl & 0xf_ffff,
            rgid: a.rgid,
        }
    }
}

/// Parses a WQE of a UD send queue: NOP, or SEND / SEND_IMM made of the control segment, the
/// 48-byte datagram segment and then data segments or inline data (the layout libmlx5's
/// `set_datagram_seg` writes). Any other opcode is [`WqeError::NotOnUd`] (LOCAL_QP_OP, as a
/// ConnectX completes an RDMA or atomic WQE on a UD QP). The address vector is `None` for a NOP.
pub fn parse_ud_wqe(bytes: &[u8]) -> Result<(ParsedWqe<'_>, Option<Datagram>), WqeError> {
    if bytes.len() < DS_UNIT {
        return Err(WqeError::Truncated {
            have: bytes.len(),
            need: DS_UNIT,
        });
    }
    let ctrl: CtrlSeg = seg(bytes, 0);
    let raw_op = ctrl.opcode();
    let opcode = Opcode::from_u8(raw_op).ok_or(WqeError::UnknownOpcode(raw_op))?;
    match opcode {
        Opcode::Nop => return parse_wqe(bytes).map(|w| (w, None)),
        Opcode::Send | Opcode::SendImm => {}
        _ => return Err(WqeError::NotOnUd { opcode: raw_op }),
    }
    let ds = ctrl.ds();
    let n = ds as usize;
    if n == 0 {
        return Err(WqeError::ZeroDs);
    }
    if bytes.len() < n * DS_UNIT {
        return Err(WqeError::Truncated {
            have: bytes.len(),
            need: n * DS_UNIT,
        });
    }
    if ctrl.opmod() != 0 {
        return Err(WqeError::BadOpmod {
            opcode: raw_op,
            opmod: ctrl.opmod(),
        });
    }
    if n < 1 + DATAGRAM_UNITS {
        return Err(WqeError::BadShape { opcode: raw_op, ds });
    }
    let av: DatagramSeg = seg(bytes, 1);
    let local = local(bytes, 1 + DATAGRAM_UNITS, n)?;
    let wqe = ParsedWqe {
        opcode,
        opmod: 0,
        wqe_index: ctrl.wqe_index(),
        qpn: ctrl.qpn(),
        ds,
        flags: CtrlFlags::from_fm_ce_se(ctrl.fm_ce_se),
        imm: ctrl.imm,
        op: ParsedOp::Send { local },
    };
    Ok((wqe, Some(av.into())))
}

/// The address vector of a DC initiator's WQE, in host order: which DC target the message
/// goes to and the key it presents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DcAddress {
    /// The DC access key (the AV's first 8 bytes, where a UD WQE has its Q_Key).
    pub key: u64,
    /// The DC target's number (DCTN).
    pub dctn: u32,
    /// Source GID index.
    pub sgid_index: u8,
    /// Traffic class.
    pub tclass: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Flow label.
    pub flow_label: u32,
    /// The target's GID.
    pub rgid: [u8; 16],
}

impl From<DatagramSeg> for DcAddress {
    fn from(a: DatagramSeg) -> Self {
        let hi = a.qkey.get() as u64;
        let lo = u32::from_be_bytes(a.reserved) as u64;
        let fl = a.grh_gid_fl.get();
        Self {
            key: hi << 32 | lo,
            dctn: a.dqp_dct.get() & 0xff_ffff,
            sgid_index: (fl >> 20) as u8,
            tclass: a.tclass,
            hop_limit: a.hop_limit,
            flow_label: fl & 0xf_ffff,
            rgid: a.rgid,
        }
    }
}

/// Parses a WQE of a DC initiator's send queue: the control segment, the 48-byte address
/// vector (the DC key, the DCT number and the target's GID: libmlx5's
/// `mlx5dv_wr_set_dc_addr`), then the segments of the operation as on RC (remote address,
/// atomic, data). NOP, WAIT and DUMP are local and carry no address vector (`None`). UMR and
/// SEND with invalidate are [`WqeError::NotOnDci`] (LOCAL_QP_OP).
pub fn parse_dc_wqe(bytes: &[u8]) -> Result<(ParsedWqe<'_>, Option<DcAddress>), WqeError> {
    let ctrl = ctrl_of(bytes)?;
    let (opcode, opmod) = opcode_of(&ctrl)?;
    let n = ctrl.ds() as usize;
    let (op, av) = match opcode {
        Opcode::Nop | Opcode::Wait | Opcode::Dump => {
            (parse_op(bytes, &ctrl, n, opcode, opmod)?, None)
        }
        Opcode::Umr | Opcode::SendInval => {
            return Err(WqeError::NotOnDci {
                opcode: opcode as u8,
            })
        }
        _ if n < 1 + DATAGRAM_UNITS => {
            return Err(WqeError::BadShape {
                opcode: ctrl.opcode(),
                ds: ctrl.ds(),
            })
        }
        _ => {
            let av: DatagramSeg = seg(bytes, 1);
            // The operation's segments follow the address vector: they read as an RC WQE's
            // from a view whose unit 0 is the vector's last unit (the parser never reads
            // unit 0).
            let shifted = &bytes[DATAGRAM_UNITS * DS_UNIT..];
            let op = parse_op(shifted, &ctrl, n - DATAGRAM_UNITS, opcode, opmod)?;
            (op, Some(av.into()))
        }
    };
    Ok((parsed(&ctrl, opcode, opmod, op), av))
}

/// 16-byte units of the XRC segment (`struct mlx5_wqe_xrc_seg`: BE32 `xrc_srqn`, 12 reserved
/// bytes) after the control segment of an XRC initiator's WQE.
pub const XRC_UNITS: usize = 1;

/// Parses a WQE of an XRC initiator (XRC_SEND QP): the control segment, the XRC segment naming
/// the remote XRC SRQ (low 24 bits of its first word), then the operation's segments as on RC.
/// Local WQEs (NOP, WAIT, DUMP, UMR: libmlx5 writes no XRC segment for BIND_MW and LOCAL_INV)
/// carry none (`None`).
pub fn parse_xrc_wqe(bytes: &[u8]) -> Result<(ParsedWqe<'_>, Option<u32>), WqeError> {
    let ctrl = ctrl_of(bytes)?;
    let (opcode, opmod) = opcode_of(&ctrl)?;
    let n = ctrl.ds() as usize;
    let (op, srqn) = match opcode {
        Opcode::Nop | Opcode::Wait | Opcode::Dump | Opcode::Umr => {
            (parse_op(bytes, &ctrl, n, opcode, opmod)?, None)
        }
        _ if n < 1 + XRC_UNITS => {
            return Err(WqeError::BadShape {
                opcode: ctrl.opcode(),
                ds: ctrl.ds(),
            })
        }
        _ => {
            let srqn = u32::from_be_bytes(
                bytes[DS_UNIT..DS_UNIT + 4]
                    .try_into()
                    .expect("4 bytes of a checked unit"),
            ) & 0xff_ffff;
            // as for DC: the operation reads from a view whose unit 0 is the XRC segment
            let shifted = &bytes[XRC_UNITS * DS_UNIT..];
            let op = parse_op(shifted, &ctrl, n - XRC_UNITS, opcode, opmod)?;
            (op, Some(srqn))
        }
    };
    Ok((parsed(&ctrl, opcode, opmod, op), srqn))
}

#[cfg(test)]
mod tests;
