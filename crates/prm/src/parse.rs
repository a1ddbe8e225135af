//! Raw WQE bytes → a typed operation, or a typed error carrying the CQE syndrome a ConnectX
//! reports for it. This is the soft NIC's sanitizer front end: it checks everything that can be
//! checked from the WQE alone (opcode, opmod, `ds` against the opcode's shape, inline and atomic
//! lengths). Keys, ranges and rights are the device's business.

use crate::cqe::Syndrome;
use crate::endian::Be32;
use crate::wqe::{
    AtomicSeg, AtomicSize, CtrlFlags, CtrlSeg, DataSeg, KlmSeg, MaskedCs32Seg, MaskedCs64Seg,
    MaskedFa32Seg, MaskedFa64Seg, MkeyContextSeg, Opcode, RaddrSeg, RemoteAddr, Sge, UmrCtrlSeg,
    WaitSeg, INLINE_SEG, MKEY_FREE, OPMOD_MASKED_ATOMIC_4B, OPMOD_MASKED_ATOMIC_8B,
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
}

impl ParsedLocal<'_> {
    /// Total bytes the local side describes (a zero byte count is 2 GiB).
    pub fn len(&self) -> u64 {
        match self {
            Self::Sges(s) => s.iter().map(|d| sge_of(d).len as u64).sum(),
            Self::Inline(b) => b.len() as u64,
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
    /// UMR on a memory window: bind it to a range of a region, or free it.
    Window(MwOp),
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

/// Reads the local part of a WRITE/SEND from units `from..ds`.
fn local(bytes: &[u8], from: usize, ds: usize) -> Result<ParsedLocal<'_>, WqeError> {
    let body = &bytes[from * DS_UNIT..ds * DS_UNIT];
    if let Some(hdr) = body.get(..4) {
        let bc = Be32::from_bytes(hdr.try_into().expect("4 bytes")).get();
        if bc & INLINE_SEG != 0 {
            let len = bc & !INLINE_SEG;
            let units = (ds - from) as u8;
            if (4 + len as usize).div_ceil(DS_UNIT) != units as usize {
                return Err(WqeError::InlineLength { len, units });
            }
            return Ok(ParsedLocal::Inline(&body[4..4 + len as usize]));
        }
    }
    Ok(ParsedLocal::Sges(bytemuck::cast_slice(body)))
}

/// Reads the memory-window operation of a UMR WQE of `n` units: UMR control segment at unit
/// 1, mkey context at unit 4 and, for a bind, one inline KLM at unit 8 (padded to 64 bytes).
/// `None` when the units do not hold that shape.
fn window(bytes: &[u8], n: usize, key: u32) -> Option<MwOp> {
    if n < 8 {
        return None;
    }
    let umr: UmrCtrlSeg = seg(bytes, 1);
    let mkey: MkeyContextSeg = seg(bytes, 4);
    let free = mkey.free & MKEY_FREE != 0;
    let mask = umr.mkey_mask.get();
    let bind = if free {
        None
    } else {
        if n < 12 || umr.flags & UMR_FLAG_INLINE == 0 || mask & UMR_MASK_LEN == 0 {
            return None;
        }
        let klm: KlmSeg = seg(bytes, 8);
        let len = mkey.len.get();
        if klm.byte_count.get() as u64 != len {
            return None;
        }
        Some(MwBind {
            start: mkey.start_addr.get(),
            len,
            access: mkey.access_flags,
            mr_key: klm.mkey.get(),
            mr_addr: klm.address.get(),
        })
    };
    let qpn_mkey = mkey.qpn_mkey.get();
    Some(MwOp {
        key,
        variant: qpn_mkey as u8,
        qpn: qpn_mkey >> 8,
        bind,
        check_free: umr.flags & UMR_FLAG_CHECK_FREE != 0,
        check_qpn: umr.flags & UMR_FLAG_CHECK_QPN != 0,
    })
}

/// Parses the WQE at the start of `bytes` (the WQE's blocks, already gathered in order).
pub fn parse_wqe(bytes: &[u8]) -> Result<ParsedWqe<'_>, WqeError> {
    if bytes.len() < DS_UNIT {
        return Err(WqeError::Truncated {
            have: bytes.len(),
            need: DS_UNIT,
        });
    }
    let ctrl: CtrlSeg = seg(bytes, 0);
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
    let shape = WqeError::BadShape { opcode: raw_op, ds };
    let op = match opcode {
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
                ParsedLocal::Inline(_) => {
                    return Err(WqeError::InlineNotAllowed { opcode: raw_op })
                }
            }
        }
        Opcode::AtomicCs | Opcode::AtomicFa | Opcode::AtomicMaskedCs | Opcode::AtomicMaskedFa => {
            let size = if opmod == OPMOD_MASKED_ATOMIC_4B {
                AtomicSize::B4
            } else {
                AtomicSize::B8
            };
            let (kind, units) = match opcode {
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
            };
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
            ParsedOp::Atomic {
                remote: remote(seg(bytes, 1)),
                kind,
                result,
            }
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
        Opcode::Umr => ParsedOp::Window(window(bytes, n, ctrl.imm.get()).ok_or(shape)?),
    };
    Ok(ParsedWqe {
        opcode,
        opmod,
        wqe_index: ctrl.wqe_index(),
        qpn: ctrl.qpn(),
        ds,
        flags: CtrlFlags::from_fm_ce_se(ctrl.fm_ce_se),
        imm: ctrl.imm,
        op,
    })
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::endian::{Lkey, Rkey};
    use crate::wqe::{Local, Op};
    use std::vec::Vec;

    const R: RemoteAddr = RemoteAddr {
        addr: 0x7000_0000,
        rkey: Rkey(0xabc),
    };

    fn sge(addr: u64, len: u32) -> Sge {
        Sge {
            addr,
            len,
            lkey: Lkey(9),
        }
    }

    fn round_trip(op: Op<'_>) {
        let flags = CtrlFlags::SIGNALED;
        let w = op.encode(0x1234, 0x1a2, flags).unwrap();
        let p = parse_wqe(w.as_bytes()).unwrap();
        assert_eq!((p.opcode, p.opmod), op.opcode());
        assert_eq!(p.wqe_index, 0x1234);
        assert_eq!(p.qpn, 0x1a2);
        assert_eq!(p.flags, flags);
        assert_eq!(p.ds, w.ds());
        let same_local = |a: &Local<'_>, b: &ParsedLocal<'_>| match (a, b) {
            (Local::Inline(x), ParsedLocal::Inline(y)) => x == y,
            (Local::Sges(x), ParsedLocal::Sges(y)) => {
                x.len() == y.len() && x.iter().zip(y.iter()).all(|(s, d)| *s == d.sge())
            }
            _ => false,
        };
        match (op, p.op) {
            (Op::Nop, ParsedOp::Nop) => {}
            (
                Op::Write { remote, local, imm },
                ParsedOp::Write {
                    remote: r2,
                    local: l2,
                },
            ) => {
                assert_eq!(remote, r2);
                assert!(same_local(&local, &l2));
                assert_eq!(imm, p.imm());
            }
            (Op::Send { local, imm }, ParsedOp::Send { local: l2 }) => {
                assert!(same_local(&local, &l2));
                assert_eq!(imm, p.imm());
            }
            (
                Op::Read { remote, local },
                ParsedOp::Read {
                    remote: r2,
                    local: l2,
                },
            ) => {
                assert_eq!(remote, r2);
                assert!(same_local(&Local::Sges(local), &ParsedLocal::Sges(l2)));
            }
            (
                Op::FetchAdd {
                    remote,
                    add,
                    result,
                },
                ParsedOp::Atomic {
                    remote: r2,
                    kind,
                    result: s2,
                },
            ) => {
                assert_eq!((remote, result), (r2, s2));
                assert_eq!(kind, AtomicKind::FetchAdd { add });
            }
            (
                Op::CompareSwap {
                    remote,
                    compare,
                    swap,
                    result,
                },
                ParsedOp::Atomic {
                    remote: r2,
                    kind,
                    result: s2,
                },
            ) => {
                assert_eq!((remote, result), (r2, s2));
                assert_eq!(kind, AtomicKind::CompareSwap { compare, swap });
            }
            (
                Op::MaskedFetchAdd {
                    size,
                    remote,
                    add,
                    field_boundary,
                    result,
                },
                ParsedOp::Atomic {
                    remote: r2,
                    kind,
                    result: s2,
                },
            ) => {
                assert_eq!((remote, result), (r2, s2));
                assert_eq!(
                    kind,
                    AtomicKind::MaskedFetchAdd {
                        size,
                        add,
                        field_boundary
                    }
                );
            }
            (
                Op::MaskedCompareSwap {
                    size,
                    remote,
                    compare,
                    compare_mask,
                    swap,
                    swap_mask,
                    result,
                },
                ParsedOp::Atomic {
                    remote: r2,
                    kind,
                    result: s2,
                },
            ) => {
                assert_eq!((remote, result), (r2, s2));
                assert_eq!(
                    kind,
                    AtomicKind::MaskedCompareSwap {
                        size,
                        compare,
                        compare_mask,
                        swap,
                        swap_mask
                    }
                );
            }
            (
                Op::Wait { cqn, max_index },
                ParsedOp::Wait {
                    cqn: c2,
                    max_index: m2,
                },
            ) => {
                assert_eq!((cqn, max_index), (c2, m2));
            }
            (Op::Dump { local }, ParsedOp::Dump { local: l2 }) => assert_eq!(local, l2),
            (a, b) => panic!("{a:?} parsed as {b:?}"),
        }
    }

    #[test]
    fn every_op_round_trips() {
        let sges = [sge(0x10, 3), sge(0x20, 4), sge(0x30, 5), sge(0x40, 6)];
        let payload = [7u8; 100];
        for n in 0..=4 {
            for imm in [None, Some(0xfeed)] {
                round_trip(Op::Write {
                    remote: R,
                    local: Local::Sges(&sges[..n]),
                    imm,
                });
                round_trip(Op::Send {
                    local: Local::Sges(&sges[..n]),
                    imm,
                });
            }
            round_trip(Op::Read {
                remote: R,
                local: &sges[..n],
            });
        }
        for len in [0, 1, 12, 13, 60, 100] {
            round_trip(Op::Write {
                remote: R,
                local: Local::Inline(&payload[..len]),
                imm: None,
            });
            round_trip(Op::Send {
                local: Local::Inline(&payload[..len]),
                imm: Some(1),
            });
        }
        round_trip(Op::Nop);
        let r8 = sge(0x80, 8);
        round_trip(Op::FetchAdd {
            remote: R,
            add: 5,
            result: r8,
        });
        round_trip(Op::CompareSwap {
            remote: R,
            compare: 1,
            swap: 2,
            result: r8,
        });
        for (size, result) in [(AtomicSize::B4, sge(0x80, 4)), (AtomicSize::B8, r8)] {
            round_trip(Op::MaskedFetchAdd {
                size,
                remote: R,
                add: 0x0101,
                field_boundary: 0x8080,
                result,
            });
            round_trip(Op::MaskedCompareSwap {
                size,
                remote: R,
                compare: 3,
                compare_mask: 0xff,
                swap: 4,
                swap_mask: 0xf0,
                result,
            });
        }
        round_trip(Op::Wait {
            cqn: 7,
            max_index: 99,
        });
        round_trip(Op::Dump {
            local: Sge {
                addr: 0x1000,
                len: 64,
                lkey: Lkey(0x1234),
            },
        });
    }

    #[test]
    fn dump_is_ctrl_plus_one_data_segment() {
        let local = Sge {
            addr: 0x1122_3344_5566_7788,
            len: 4096,
            lkey: Lkey(0xabcd),
        };
        let w = Op::Dump { local }
            .encode(5, 0x42, CtrlFlags::SIGNALED)
            .unwrap();
        let b = w.as_bytes();
        assert_eq!(w.ds(), 2);
        assert_eq!(&b[0..4], &(5u32 << 8 | 0x23).to_be_bytes());
        assert_eq!(&b[4..8], &(0x42u32 << 8 | 2).to_be_bytes());
        assert_eq!(&b[16..20], &4096u32.to_be_bytes());
        assert_eq!(&b[20..24], &0xabcdu32.to_be_bytes());
        assert_eq!(&b[24..32], &0x1122_3344_5566_7788u64.to_be_bytes());
        // wrong sizes and inline data are malformed
        let mut three = [0u8; 128];
        three[..32].copy_from_slice(&b[..32]);
        three[7] = 3;
        assert!(matches!(
            parse_wqe(&three),
            Err(WqeError::BadShape {
                opcode: 0x23,
                ds: 3
            })
        ));
        let mut inl = [0u8; 128];
        inl[..32].copy_from_slice(&b[..32]);
        inl[16..20].copy_from_slice(&(0x8000_0008u32).to_be_bytes());
        assert!(matches!(
            parse_wqe(&inl),
            Err(WqeError::InlineNotAllowed { opcode: 0x23 })
        ));
    }

    fn raw(opcode: u32, opmod: u32, ds: u32) -> [u8; 128] {
        let mut b = [0u8; 128];
        b[0..4].copy_from_slice(&(opmod << 24 | opcode).to_be_bytes());
        b[4..8].copy_from_slice(&(0x55 << 8 | ds).to_be_bytes());
        b
    }

    #[test]
    fn malformed_wqes_map_to_syndromes() {
        let cases: [([u8; 128], WqeError); 6] = [
            (raw(0x08, 0, 0), WqeError::ZeroDs),
            (raw(0x1b, 0, 1), WqeError::UnknownOpcode(0x1b)),
            (
                raw(0x08, 3, 2),
                WqeError::BadOpmod {
                    opcode: 8,
                    opmod: 3,
                },
            ),
            (
                raw(0x14, 0, 4),
                WqeError::BadOpmod {
                    opcode: 0x14,
                    opmod: 0,
                },
            ),
            (raw(0x08, 0, 1), WqeError::BadShape { opcode: 8, ds: 1 }),
            (
                raw(0x12, 0, 3),
                WqeError::BadShape {
                    opcode: 0x12,
                    ds: 3,
                },
            ),
        ];
        for (bytes, err) in cases {
            assert_eq!(parse_wqe(&bytes), Err(err));
            assert_eq!(err.syndrome(), Syndrome::LocalQpOp);
        }
        // inline count that disagrees with ds
        let mut b = raw(0x0a, 0, 2);
        b[16..20].copy_from_slice(&(40u32 | INLINE_SEG).to_be_bytes());
        let e = parse_wqe(&b).unwrap_err();
        assert_eq!(e, WqeError::InlineLength { len: 40, units: 1 });
        assert_eq!(e.syndrome(), Syndrome::LocalLength);
        // atomic with a 4-byte result buffer
        let w = Op::FetchAdd {
            remote: R,
            add: 1,
            result: sge(0, 4),
        }
        .encode(0, 1, CtrlFlags::default())
        .unwrap();
        assert_eq!(
            parse_wqe(w.as_bytes()).unwrap_err(),
            WqeError::AtomicLength { len: 4, size: 8 }
        );
        // ds longer than the bytes given
        assert!(matches!(
            parse_wqe(&raw(0x08, 0, 9)),
            Err(WqeError::Truncated { .. })
        ));
    }

    #[test]
    fn zero_byte_count_means_two_gib() {
        let w = Op::Send {
            local: Local::Sges(&[sge(0, 0)]),
            imm: None,
        }
        .encode(0, 1, CtrlFlags::default())
        .unwrap();
        let p = parse_wqe(w.as_bytes()).unwrap();
        let ParsedOp::Send { local } = p.op else {
            panic!()
        };
        assert_eq!(local.len(), ZERO_BYTE_COUNT_LEN as u64);
    }

    /// A UMR WQE laid out as libmlx5's `set_bind_wr` writes it: control, UMR control, mkey
    /// context and (for a bind) one inline KLM padded to 64 bytes.
    fn umr_bytes(key: u32, qpn_mkey: u32, bind: Option<(u64, u64, u32)>, flags: u8) -> Vec<u8> {
        use crate::wqe::{KlmSeg, MkeyContextSeg, UmrCtrlSeg, MKEY_ACCESS_REMOTE_WRITE};
        let units = if bind.is_some() { 12u32 } else { 8 };
        let ctrl = CtrlSeg {
            opmod_idx_opcode: Be32::new(7 << 8 | Opcode::Umr as u32),
            qpn_ds: Be32::new(0x1a2 << 8 | units),
            imm: Be32::new(key),
            ..CtrlSeg::default()
        };
        let mut umr = UmrCtrlSeg {
            flags: flags | UMR_FLAG_INLINE,
            ..UmrCtrlSeg::default()
        };
        let mut mkey = MkeyContextSeg {
            qpn_mkey: Be32::new(qpn_mkey),
            ..MkeyContextSeg::default()
        };
        let mut out = bytemuck::bytes_of(&ctrl).to_vec();
        match bind {
            Some((addr, len, lkey)) => {
                umr.mkey_mask = crate::endian::Be64::new(UMR_MASK_LEN);
                mkey.access_flags = MKEY_ACCESS_REMOTE_WRITE;
                mkey.start_addr = crate::endian::Be64::new(addr);
                mkey.len = crate::endian::Be64::new(len);
                out.extend_from_slice(bytemuck::bytes_of(&umr));
                out.extend_from_slice(bytemuck::bytes_of(&mkey));
                let klm = KlmSeg {
                    byte_count: Be32::new(len as u32),
                    mkey: Be32::new(lkey),
                    address: crate::endian::Be64::new(addr),
                };
                out.extend_from_slice(bytemuck::bytes_of(&klm));
                out.resize(out.len() + 48, 0);
            }
            None => {
                mkey.free = MKEY_FREE;
                out.extend_from_slice(bytemuck::bytes_of(&umr));
                out.extend_from_slice(bytemuck::bytes_of(&mkey));
            }
        }
        assert_eq!(out.len(), units as usize * DS_UNIT);
        out
    }

    #[test]
    fn memory_window_binds_and_frees() {
        let b = umr_bytes(
            0x300,
            0x1a2 << 8 | 0x05,
            Some((0x9000, 256, 0x201)),
            UMR_FLAG_CHECK_FREE,
        );
        let p = parse_wqe(&b).unwrap();
        assert_eq!(p.opcode, Opcode::Umr);
        assert_eq!(
            p.op,
            ParsedOp::Window(MwOp {
                key: 0x300,
                variant: 0x05,
                qpn: 0x1a2,
                bind: Some(MwBind {
                    start: 0x9000,
                    len: 256,
                    access: crate::wqe::MKEY_ACCESS_REMOTE_WRITE,
                    mr_key: 0x201,
                    mr_addr: 0x9000,
                }),
                check_free: true,
                check_qpn: false,
            })
        );
        let inv = umr_bytes(0x305, 0xffff_ff00, None, UMR_FLAG_CHECK_QPN);
        match parse_wqe(&inv).unwrap().op {
            ParsedOp::Window(w) => {
                assert_eq!(
                    (w.key, w.qpn, w.bind, w.check_qpn),
                    (0x305, 0xff_ffff, None, true)
                )
            }
            other => panic!("{other:?}"),
        }
        // a bind whose units stop before the KLM, or whose KLM disagrees with the length
        let mut short = b.clone();
        short[7] = 8;
        assert!(matches!(
            parse_wqe(&short[..128]),
            Err(WqeError::BadShape { .. })
        ));
        let mut odd = b.clone();
        odd[8 * DS_UNIT + 3] ^= 1;
        assert!(matches!(parse_wqe(&odd), Err(WqeError::BadShape { .. })));
    }

    #[test]
    fn send_with_invalidate_carries_the_rkey() {
        let mut w = Op::Send {
            local: Local::Sges(&[sge(0x1000, 8)]),
            imm: None,
        }
        .encode(3, 0x1a2, CtrlFlags::SIGNALED)
        .unwrap()
        .as_bytes()
        .to_vec();
        w[0..4].copy_from_slice(&(3u32 << 8 | Opcode::SendInval as u32).to_be_bytes());
        w[12..16].copy_from_slice(&0x4242u32.to_be_bytes());
        let p = parse_wqe(&w).unwrap();
        assert_eq!((p.invalidate(), p.imm()), (Some(0x4242), None));
        assert!(matches!(p.op, ParsedOp::Send { .. }));
    }

    #[test]
    fn window_ops_encode_as_libmlx5_writes_them() {
        use crate::wqe::{WindowBind, MKEY_ACCESS_REMOTE_READ};
        let bind = WindowBind {
            window: 0x300,
            variant: 0x05,
            qpn: Some(0x1a2),
            region: sge(0x9000, 256),
            start: 0x9000,
            access: MKEY_ACCESS_REMOTE_READ,
        };
        let w = Op::BindWindow(bind)
            .encode(7, 0x1a2, CtrlFlags::SIGNALED)
            .unwrap();
        // the same bytes as the hand-made layout, but for the rights and the lkey
        let mine = umr_bytes(
            0x300,
            0x1a2 << 8 | 0x05,
            Some((0x9000, 256, 9)),
            UMR_FLAG_CHECK_FREE,
        );
        let p = parse_wqe(w.as_bytes()).unwrap();
        let q = parse_wqe(&mine).unwrap();
        match (p.op, q.op) {
            (ParsedOp::Window(a), ParsedOp::Window(b)) => {
                assert_eq!(a.bind.unwrap().access, MKEY_ACCESS_REMOTE_READ);
                let same = MwOp {
                    bind: a.bind.map(|x| MwBind {
                        access: crate::wqe::MKEY_ACCESS_REMOTE_WRITE,
                        ..x
                    }),
                    ..a
                };
                assert_eq!(same, b);
            }
            other => panic!("{other:?}"),
        }
        let inv = Op::LocalInvalidate { rkey: 0x305 }
            .encode(9, 0x1a2, CtrlFlags::SIGNALED)
            .unwrap();
        match parse_wqe(inv.as_bytes()).unwrap().op {
            ParsedOp::Window(m) => assert_eq!(
                (m.key, m.bind, m.check_qpn, m.check_free),
                (0x305, None, true, false)
            ),
            other => panic!("{other:?}"),
        }
        let unbind = Op::BindWindow(WindowBind {
            qpn: None,
            region: sge(0x9000, 0),
            ..bind
        })
        .encode(9, 0x1a2, CtrlFlags::SIGNALED)
        .unwrap();
        match parse_wqe(unbind.as_bytes()).unwrap().op {
            ParsedOp::Window(m) => assert_eq!(
                (m.key, m.qpn, m.bind, m.check_qpn, m.check_free),
                (0x300, 0xff_ffff, None, false, false)
            ),
            other => panic!("{other:?}"),
        }
        let s = Op::SendInvalidate {
            local: Local::Sges(&[sge(0x1000, 8)]),
            rkey: 0x4242,
        }
        .encode(1, 0x1a2, CtrlFlags::SIGNALED)
        .unwrap();
        assert_eq!(parse_wqe(s.as_bytes()).unwrap().invalidate(), Some(0x4242));
    }
}
