//! The 64-byte completion-queue entry: layout, opcodes, syndromes, ownership, encode/decode.

use crate::endian::{Be16, Be32, Be64};
use crate::wqe::opcode_name;
use bytemuck::{Pod, Zeroable};

/// CQE opcodes (`op_own >> 4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CqeOpcode {
    /// Requester completion.
    Req = 0,
    /// Responder: RDMA write with immediate.
    RespWrImm = 1,
    /// Responder: send.
    RespSend = 2,
    /// Responder: send with immediate.
    RespSendImm = 3,
    /// Responder: send with invalidate.
    RespSendInv = 4,
    /// Requester error.
    ReqErr = 13,
    /// Responder error.
    RespErr = 14,
    /// Not yet written by the device.
    Invalid = 15,
}

impl CqeOpcode {
    /// Decodes the 4-bit opcode.
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Req,
            1 => Self::RespWrImm,
            2 => Self::RespSend,
            3 => Self::RespSendImm,
            4 => Self::RespSendInv,
            13 => Self::ReqErr,
            14 => Self::RespErr,
            15 => Self::Invalid,
            _ => return None,
        })
    }
}

/// Error CQE syndromes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Syndrome {
    /// Local length error.
    LocalLength = 0x01,
    /// Local QP operation error (malformed WQE).
    LocalQpOp = 0x02,
    /// Local protection error (bad lkey or local range).
    LocalProt = 0x04,
    /// Work request flushed (QP in error).
    WrFlush = 0x05,
    /// Memory window bind error.
    MwBind = 0x06,
    /// Bad response.
    BadResp = 0x10,
    /// Local access error.
    LocalAccess = 0x11,
    /// Remote invalid request.
    RemoteInvalReq = 0x12,
    /// Remote access error (bad rkey, range or right at the responder).
    RemoteAccess = 0x13,
    /// Remote operational error.
    RemoteOp = 0x14,
    /// Transport retry counter exceeded.
    TransportRetryExc = 0x15,
    /// RNR retry counter exceeded.
    RnrRetryExc = 0x16,
    /// Remote aborted.
    RemoteAborted = 0x22,
}

impl Syndrome {
    /// Every syndrome, in numeric order.
    pub const ALL: [Syndrome; 13] = [
        Self::LocalLength,
        Self::LocalQpOp,
        Self::LocalProt,
        Self::WrFlush,
        Self::MwBind,
        Self::BadResp,
        Self::LocalAccess,
        Self::RemoteInvalReq,
        Self::RemoteAccess,
        Self::RemoteOp,
        Self::TransportRetryExc,
        Self::RnrRetryExc,
        Self::RemoteAborted,
    ];

    /// Decodes a syndrome byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|s| *s as u8 == v)
    }

    /// The syndrome's name, as in rdma-core without the `MLX5_CQE_SYNDROME_` prefix and `_ERR`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::LocalLength => "LOCAL_LENGTH",
            Self::LocalQpOp => "LOCAL_QP_OP",
            Self::LocalProt => "LOCAL_PROT",
            Self::WrFlush => "WR_FLUSH",
            Self::MwBind => "MW_BIND",
            Self::BadResp => "BAD_RESP",
            Self::LocalAccess => "LOCAL_ACCESS",
            Self::RemoteInvalReq => "REMOTE_INVAL_REQ",
            Self::RemoteAccess => "REMOTE_ACCESS",
            Self::RemoteOp => "REMOTE_OP",
            Self::TransportRetryExc => "TRANSPORT_RETRY_EXC",
            Self::RnrRetryExc => "RNR_RETRY_EXC",
            Self::RemoteAborted => "REMOTE_ABORTED",
        }
    }
}

/// The 64-byte CQE, laid out as rdma-core's `struct mlx5_cqe64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Cqe64 {
    /// Reserved.
    pub rsvd0: [u8; 2],
    /// WQE id (striding RQ).
    pub wqe_id: Be16,
    /// Reserved.
    pub rsvd4: [u8; 13],
    /// Path bits.
    pub ml_path: u8,
    /// Reserved.
    pub rsvd20: [u8; 4],
    /// Source LID.
    pub slid: Be16,
    /// Flags (31:24) and remote QPN (23:0).
    pub flags_rqpn: Be32,
    /// Header data split / IP extension.
    pub hds_ip_ext: u8,
    /// L4 header type etc.
    pub l4_hdr_type_etc: u8,
    /// VLAN info.
    pub vlan_info: Be16,
    /// SRQ number or user index.
    pub srqn_uidx: Be32,
    /// Immediate (raw), invalidated rkey or P_Key.
    pub imm_inval_pkey: Be32,
    /// Application.
    pub app: u8,
    /// Application opcode.
    pub app_op: u8,
    /// Application info.
    pub app_info: Be16,
    /// Byte count.
    pub byte_cnt: Be32,
    /// Timestamp; in an error CQE bytes 54 and 55 are the vendor syndrome and syndrome.
    pub timestamp: Be64,
    /// WQE opcode (31:24) and QPN (23:0).
    pub sop_drop_qpn: Be32,
    /// Counter of the completed WQE (first block index on the SQ, WQE counter on the RQ).
    pub wqe_counter: Be16,
    /// Signature.
    pub signature: u8,
    /// CQE opcode (7:4), format (3:2), solicited (1), owner (0).
    pub op_own: u8,
}

impl Default for Cqe64 {
    fn default() -> Self {
        Self::zeroed()
    }
}

/// Byte offset of the vendor syndrome in an error CQE.
pub const ERR_VENDOR_SYNDROME_OFFSET: usize = 54;
/// Byte offset of the syndrome in an error CQE.
pub const ERR_SYNDROME_OFFSET: usize = 55;
/// Byte offset of the last 4 bytes (wqe_counter, signature, op_own) the device releases last.
pub const CQE_TAIL_OFFSET: usize = 60;
/// `op_own` of a never-written CQE as the mlx5 provider initialises it.
pub const OP_OWN_INVALID: u8 = 0xf0;
/// `op_own` of a never-written CQE as DOCA pre-fills it (owner bit set).
pub const OP_OWN_INVALID_OWNED: u8 = 0xf1;

/// Whether software owns the CQE at consumer index `index` of a ring of `ncqe` entries
/// (power of two): its opcode is not INVALID and its owner bit matches the lap parity.
pub const fn sw_owns(op_own: u8, index: u32, ncqe: u32) -> bool {
    (op_own >> 4) != CqeOpcode::Invalid as u8 && (op_own & 1) as u32 == (index / ncqe) & 1
}

/// The owner bit the device writes for producer index `index` of a ring of `ncqe` entries.
pub const fn owner_bit(index: u32, ncqe: u32) -> u8 {
    ((index / ncqe) & 1) as u8
}

/// `flags_rqpn` bits 29:28 non-zero: a GRH precedes the payload in the receive buffer
/// (libmlx5 sets `IBV_WC_GRH`).
pub const FLAGS_RQPN_GRH: u32 = 1 << 28;
/// `flags_rqpn` bits 25:24 of a RoCE receive: the packet was RoCEv2 over IPv4 (mlx5_ib reads
/// it as the network header type; `MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV4`).
pub const ROCE_L3_IPV4: u32 = 2 << 24;
/// `flags_rqpn` bits 25:24: RoCEv2 over IPv6.
pub const ROCE_L3_IPV6: u32 = 1 << 24;
/// `l4_hdr_type_etc` bits 3:2 = 2: an IPv4 L3 header (`MLX5_CQE_L3_HDR_TYPE_IPV4`).
pub const L3_HDR_TYPE_IPV4: u8 = 2 << 2;
/// `l4_hdr_type_etc` bits 3:2 = 1: an IPv6 L3 header.
pub const L3_HDR_TYPE_IPV6: u8 = 1 << 2;

/// The responder-side kind of a completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RespKind {
    /// SEND consumed a receive WQE.
    Send,
    /// SEND_IMM consumed a receive WQE.
    SendImm,
    /// RDMA_WRITE_IMM consumed a receive WQE.
    WriteImm,
    /// SEND_INVAL consumed a receive WQE and invalidated the rkey it carried (in the CQE's
    /// `imm_inval_pkey`).
    SendInv,
}

/// An error CQE, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorCqe {
    /// Requester (REQ_ERR) or responder (RESP_ERR).
    pub responder: bool,
    /// Syndrome byte (see [`Syndrome`]).
    pub syndrome: u8,
    /// Vendor syndrome byte.
    pub vendor_syndrome: u8,
    /// Opcode of the failed WQE.
    pub wqe_opcode: u8,
    /// QPN.
    pub qpn: u32,
    /// Counter of the failed WQE.
    pub wqe_counter: u16,
}

impl ErrorCqe {
    /// The syndrome, when it is a known one.
    pub fn syndrome(&self) -> Option<Syndrome> {
        Syndrome::from_u8(self.syndrome)
    }
}

impl core::fmt::Display for ErrorCqe {
    /// `REMOTE_ACCESS (0x13) on RDMA_WRITE, qpn 0x1a2, wqe 17`
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let name = self.syndrome().map_or("UNKNOWN_SYNDROME", Syndrome::name);
        let op = if self.responder {
            "RECV"
        } else {
            opcode_name(self.wqe_opcode)
        };
        write!(
            f,
            "{name} ({:#04x}) on {op}, qpn {:#x}, wqe {}",
            self.syndrome, self.qpn, self.wqe_counter
        )?;
        if self.vendor_syndrome != 0 {
            write!(f, ", vendor syndrome {:#04x}", self.vendor_syndrome)?;
        }
        Ok(())
    }
}

/// A decoded CQE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Successful requester completion.
    Req {
        /// Opcode of the completed WQE.
        wqe_opcode: u8,
        /// QPN.
        qpn: u32,
        /// First block index of the completed WQE.
        wqe_counter: u16,
        /// Bytes (meaningful for READ and atomics).
        byte_cnt: u32,
    },
    /// Successful responder completion.
    Resp {
        /// What arrived.
        kind: RespKind,
        /// QPN.
        qpn: u32,
        /// Receive WQE counter.
        wqe_counter: u16,
        /// Bytes received.
        byte_cnt: u32,
        /// Immediate, host order.
        imm: Option<u32>,
        /// Sender's QPN.
        remote_qpn: u32,
    },
    /// An error completion.
    Error(ErrorCqe),
    /// Not written yet (INVALID) or an opcode this project does not know.
    Invalid(u8),
}

impl Cqe64 {
    /// The CQE opcode.
    pub fn opcode(&self) -> u8 {
        self.op_own >> 4
    }

    /// The owner bit.
    pub fn owner(&self) -> u8 {
        self.op_own & 1
    }

    /// A never-written entry with the given initial `op_own` (0xF0 or 0xF1).
    pub fn invalid(op_own: u8) -> Self {
        Self {
            op_own,
            ..Self::zeroed()
        }
    }

    /// A successful requester CQE.
    pub fn requester(wqe_opcode: u8, qpn: u32, wqe_counter: u16, byte_cnt: u32, owner: u8) -> Self {
        Self {
            byte_cnt: Be32::new(byte_cnt),
            sop_drop_qpn: Be32::new((wqe_opcode as u32) << 24 | (qpn & 0xff_ffff)),
            wqe_counter: Be16::new(wqe_counter),
            op_own: (CqeOpcode::Req as u8) << 4 | (owner & 1),
            ..Self::zeroed()
        }
    }

    /// A successful responder CQE.
    pub fn responder(
        kind: RespKind,
        qpn: u32,
        remote_qpn: u32,
        wqe_counter: u16,
        byte_cnt: u32,
        imm: Option<u32>,
        owner: u8,
    ) -> Self {
        let op = match kind {
            RespKind::Send => CqeOpcode::RespSend,
            RespKind::SendImm => CqeOpcode::RespSendImm,
            RespKind::WriteImm => CqeOpcode::RespWrImm,
            RespKind::SendInv => CqeOpcode::RespSendInv,
        };
        Self {
            flags_rqpn: Be32::new(remote_qpn & 0xff_ffff),
            imm_inval_pkey: Be32::new(imm.unwrap_or(0)),
            byte_cnt: Be32::new(byte_cnt),
            sop_drop_qpn: Be32::new(qpn & 0xff_ffff),
            wqe_counter: Be16::new(wqe_counter),
            op_own: (op as u8) << 4 | (owner & 1),
            ..Self::zeroed()
        }
    }

    /// A successful responder CQE of a UD QP: `byte_cnt` counts the 40 GRH bytes, and
    /// `flags_rqpn` carries the source QPN, the GRH bit ([`FLAGS_RQPN_GRH`]) and the RoCE L3
    /// header type (bits 25:24: [`ROCE_L3_IPV4`] or [`ROCE_L3_IPV6`]), which
    /// `l4_hdr_type_etc` repeats in bits 3:2 ([`L3_HDR_TYPE_IPV4`], [`L3_HDR_TYPE_IPV6`]).
    #[allow(clippy::too_many_arguments)]
    pub fn responder_ud(
        kind: RespKind,
        qpn: u32,
        src_qpn: u32,
        wqe_counter: u16,
        byte_cnt: u32,
        imm: Option<u32>,
        ipv4: bool,
        owner: u8,
    ) -> Self {
        let mut c = Self::responder(kind, qpn, src_qpn, wqe_counter, byte_cnt, imm, owner);
        let (roce, l3) = if ipv4 {
            (ROCE_L3_IPV4, L3_HDR_TYPE_IPV4)
        } else {
            (ROCE_L3_IPV6, L3_HDR_TYPE_IPV6)
        };
        c.flags_rqpn = Be32::new(FLAGS_RQPN_GRH | roce | (src_qpn & 0xff_ffff));
        c.l4_hdr_type_etc = l3;
        c
    }

    /// An error CQE.
    pub fn error(e: &ErrorCqe, owner: u8) -> Self {
        let op = if e.responder {
            CqeOpcode::RespErr
        } else {
            CqeOpcode::ReqErr
        };
        let mut c = Self {
            sop_drop_qpn: Be32::new((e.wqe_opcode as u32) << 24 | (e.qpn & 0xff_ffff)),
            wqe_counter: Be16::new(e.wqe_counter),
            op_own: (op as u8) << 4 | (owner & 1),
            ..Self::zeroed()
        };
        let bytes = bytemuck::bytes_of_mut(&mut c);
        bytes[ERR_VENDOR_SYNDROME_OFFSET] = e.vendor_syndrome;
        bytes[ERR_SYNDROME_OFFSET] = e.syndrome;
        c
    }

    /// Decodes the entry.
    pub fn decode(&self) -> Completion {
        let bytes = bytemuck::bytes_of(self);
        let sop = self.sop_drop_qpn.get();
        let qpn = sop & 0xff_ffff;
        let wqe_counter = self.wqe_counter.get();
        let byte_cnt = self.byte_cnt.get();
        let resp = |kind, imm: bool| Completion::Resp {
            kind,
            qpn,
            wqe_counter,
            byte_cnt,
            imm: imm.then(|| self.imm_inval_pkey.get()),
            remote_qpn: self.flags_rqpn.get() & 0xff_ffff,
        };
        match CqeOpcode::from_u8(self.opcode()) {
            Some(CqeOpcode::Req) => Completion::Req {
                wqe_opcode: (sop >> 24) as u8,
                qpn,
                wqe_counter,
                byte_cnt,
            },
            Some(CqeOpcode::RespSend) => resp(RespKind::Send, false),
            Some(CqeOpcode::RespSendImm) => resp(RespKind::SendImm, true),
            Some(CqeOpcode::RespWrImm) => resp(RespKind::WriteImm, true),
            Some(CqeOpcode::RespSendInv) => resp(RespKind::SendInv, true),
            Some(op @ (CqeOpcode::ReqErr | CqeOpcode::RespErr)) => Completion::Error(ErrorCqe {
                responder: op == CqeOpcode::RespErr,
                syndrome: bytes[ERR_SYNDROME_OFFSET],
                vendor_syndrome: bytes[ERR_VENDOR_SYNDROME_OFFSET],
                wqe_opcode: (sop >> 24) as u8,
                qpn,
                wqe_counter,
            }),
            Some(CqeOpcode::Invalid) | None => Completion::Invalid(self.opcode()),
        }
    }

    /// The entry split as a device writes it: bytes 0..60 first, then the last 4 bytes
    /// (wqe_counter, signature, op_own) released with one store, as a native-endian `u32`
    /// whose in-memory bytes are bytes 60..64.
    pub fn split_for_release(&self) -> ([u8; CQE_TAIL_OFFSET], u32) {
        let b = bytemuck::bytes_of(self);
        let head = b[..CQE_TAIL_OFFSET].try_into().expect("60 bytes");
        let tail = u32::from_ne_bytes(b[CQE_TAIL_OFFSET..].try_into().expect("4 bytes"));
        (head, tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_cqe_round_trip_and_display() {
        let e = ErrorCqe {
            responder: false,
            syndrome: Syndrome::RemoteAccess as u8,
            vendor_syndrome: 0,
            wqe_opcode: 0x08,
            qpn: 0x1a2,
            wqe_counter: 17,
        };
        let c = Cqe64::error(&e, 1);
        assert_eq!(c.op_own, 0xd1);
        assert_eq!(bytemuck::bytes_of(&c)[55], 0x13);
        assert_eq!(c.decode(), Completion::Error(e));
        assert_eq!(
            std::format!("{e}"),
            "REMOTE_ACCESS (0x13) on RDMA_WRITE, qpn 0x1a2, wqe 17"
        );
    }

    #[test]
    fn requester_and_responder_round_trip() {
        let c = Cqe64::requester(0x10, 0x42, 0xfffe, 4096, 0);
        assert_eq!(
            c.decode(),
            Completion::Req {
                wqe_opcode: 0x10,
                qpn: 0x42,
                wqe_counter: 0xfffe,
                byte_cnt: 4096
            }
        );
        let r = Cqe64::responder(RespKind::WriteImm, 0x43, 0x42, 5, 64, Some(0xabcd), 1);
        assert_eq!(r.op_own, 0x11);
        assert_eq!(
            r.decode(),
            Completion::Resp {
                kind: RespKind::WriteImm,
                qpn: 0x43,
                wqe_counter: 5,
                byte_cnt: 64,
                imm: Some(0xabcd),
                remote_qpn: 0x42
            }
        );
        assert_eq!(Cqe64::invalid(0xf1).decode(), Completion::Invalid(15));
    }

    #[test]
    fn ownership_per_lap() {
        let n = 8;
        // lap 0: owner 0 owned by sw once written; INVALID never owned
        assert!(!sw_owns(OP_OWN_INVALID, 0, n));
        assert!(!sw_owns(OP_OWN_INVALID_OWNED, 8, n));
        assert!(sw_owns(owner_bit(3, n), 3, n));
        assert!(!sw_owns(owner_bit(3, n), 11, n), "stale entry of last lap");
        assert!(sw_owns(owner_bit(11, n), 11, n));
        assert_eq!(owner_bit(11, n), 1);
        let (head, tail) = Cqe64::requester(0, 1, 2, 3, 1).split_for_release();
        assert_eq!(head.len(), 60);
        assert_eq!(tail.to_ne_bytes(), [0, 2, 0, 1]);
    }
}
