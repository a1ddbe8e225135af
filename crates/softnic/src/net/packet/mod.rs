//! RoCEv2 packet formats: the base transport header (BTH), its extension headers, the RC
//! opcodes (and their UC class, [`uc`], their XRC class, [`xrc`], and the soft NIC's DC
//! class, [`dc`]), encoding, strict parsing, and the invariant CRC (ICRC).
//!
//! What travels in a UDP datagram (destination port 4791 by default) is
//! `BTH | extension headers | payload | pad to 4 bytes | ICRC`. Every multi-byte field is
//! big-endian; the ICRC is sent little-endian. The ICRC covers a pseudo header made of
//! 8 bytes of `0xFF` (standing for the InfiniBand LRH), the IPv4 header with TOS, TTL and
//! checksum set to all ones, the UDP header with its checksum set to all ones, the BTH with its
//! byte 4 (FECN/BECN/reserved) set to all ones, then everything after the BTH up to the ICRC.
//!
//! The soft NIC never sees the IP and UDP headers the kernel builds around its datagrams, so
//! it computes the ICRC over the headers the kernel *will* put on the wire
//! ([`ipv4_udp_headers_with_id`]): IPv4 with DF set, addresses from the endpoints' GIDs,
//! protocol UDP, the real lengths, and the identification Linux gives a DF datagram of an
//! unconnected socket with `IP_PMTUDISC_DO` (0; the n-th segment of a segmented send gets
//! n); UDP with the real source and destination ports. TOS, TTL and both checksums are masked
//! out of the ICRC. A receiver, which cannot see the identification either, accepts any
//! identification a segmented send produces ([`icrc_ip_id`]). The capture writer
//! ([`super::pcap`]) writes the same headers, so a captured frame's ICRC is the one an
//! IBTA-conformant receiver computes. The bottom of [`crate::net`]: it names no other module.

use std::net::Ipv4Addr;

/// The IANA port of RoCEv2.
pub const ROCE_PORT: u16 = 4791;
/// Bytes of the base transport header.
pub const BTH_LEN: usize = 12;
/// Bytes of the RDMA extended transport header.
pub const RETH_LEN: usize = 16;
/// Bytes of the ACK extended transport header.
pub const AETH_LEN: usize = 4;
/// Bytes of the atomic extended transport header.
pub const ATOMIC_ETH_LEN: usize = 28;
/// Bytes of the atomic-acknowledge extended transport header.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
/// Bytes of the masked-atomic extension header (soft NIC vendor opcodes).
pub const MASKED_ATOMIC_ETH_LEN: usize = 48;
/// Bytes of the immediate-data header.
pub const IMM_LEN: usize = 4;
/// Bytes of the invalidate extended transport header (the rkey to invalidate).
pub const IETH_LEN: usize = 4;
/// Bytes of the datagram extended transport header (UD: Q_Key, source QP).
pub const DETH_LEN: usize = 8;
/// Bytes of the soft NIC's DC extended transport header ([`Dceth`]).
pub const DCETH_LEN: usize = 24;
/// XRCETH: reserved (8 bits) | XRC SRQ number (24 bits).
pub const XRCETH_LEN: usize = 4;
/// Bytes of the invariant CRC.
pub const ICRC_LEN: usize = 4;
/// The largest path MTU (payload bytes per packet).
pub const MAX_MTU: usize = 4096;
/// The largest datagram a conforming sender produces: BTH, the largest header set (a DC
/// RDMA WRITE with immediate), a full MTU of payload (no pad: 4096 is a multiple of 4) and
/// the ICRC.
pub const MAX_DATAGRAM: usize = BTH_LEN + DCETH_LEN + RETH_LEN + IMM_LEN + MAX_MTU + ICRC_LEN;
/// The default partition key.
pub const DEFAULT_PKEY: u16 = 0xffff;
/// Mask of a 24-bit PSN or QPN.
pub const MASK24: u32 = 0xff_ffff;

/// RC opcodes (transport class 0b000) and the soft NIC's two vendor opcodes.
pub mod opcode {
    /// SEND first.
    pub const SEND_FIRST: u8 = 0x00;
    /// SEND middle.
    pub const SEND_MIDDLE: u8 = 0x01;
    /// SEND last.
    pub const SEND_LAST: u8 = 0x02;
    /// SEND last with immediate.
    pub const SEND_LAST_IMM: u8 = 0x03;
    /// SEND only.
    pub const SEND_ONLY: u8 = 0x04;
    /// SEND only with immediate.
    pub const SEND_ONLY_IMM: u8 = 0x05;
    /// RDMA WRITE first (RETH).
    pub const WRITE_FIRST: u8 = 0x06;
    /// RDMA WRITE middle.
    pub const WRITE_MIDDLE: u8 = 0x07;
    /// RDMA WRITE last.
    pub const WRITE_LAST: u8 = 0x08;
    /// RDMA WRITE last with immediate.
    pub const WRITE_LAST_IMM: u8 = 0x09;
    /// RDMA WRITE only (RETH).
    pub const WRITE_ONLY: u8 = 0x0a;
    /// RDMA WRITE only with immediate (RETH).
    pub const WRITE_ONLY_IMM: u8 = 0x0b;
    /// RDMA READ request (RETH).
    pub const READ_REQUEST: u8 = 0x0c;
    /// RDMA READ response first (AETH).
    pub const READ_RESPONSE_FIRST: u8 = 0x0d;
    /// RDMA READ response middle.
    pub const READ_RESPONSE_MIDDLE: u8 = 0x0e;
    /// RDMA READ response last (AETH).
    pub const READ_RESPONSE_LAST: u8 = 0x0f;
    /// RDMA READ response only (AETH).
    pub const READ_RESPONSE_ONLY: u8 = 0x10;
    /// ACK or NAK (AETH).
    pub const ACK: u8 = 0x11;
    /// Atomic acknowledge (AETH, AtomicAckETH).
    pub const ATOMIC_ACK: u8 = 0x12;
    /// Compare and swap (AtomicETH).
    pub const CMP_SWAP: u8 = 0x13;
    /// Fetch and add (AtomicETH).
    pub const FETCH_ADD: u8 = 0x14;
    /// SEND last with invalidate (IETH).
    pub const SEND_LAST_INV: u8 = 0x16;
    /// SEND only with invalidate (IETH).
    pub const SEND_ONLY_INV: u8 = 0x17;
    /// Masked compare and swap: a soft NIC extension in the manufacturer-specific opcode
    /// range (0xC0..=0xFF), carrying a [`super::MaskedAtomicEth`]. ConnectX runs masked atomics
    /// on InfiniBand only; the soft NIC carries them on its wire so that every WQE the
    /// in-process path runs also runs between processes.
    pub const MASKED_CMP_SWAP: u8 = 0xd3;
    /// Masked fetch and add (soft NIC extension, see [`MASKED_CMP_SWAP`]).
    pub const MASKED_FETCH_ADD: u8 = 0xd4;
    /// UD SEND only (transport class 0b011; DETH).
    pub const UD_SEND_ONLY: u8 = 0x64;
    /// UD SEND only with immediate (DETH, ImmDt).
    pub const UD_SEND_ONLY_IMM: u8 = 0x65;

    /// The IBTA name of an opcode, as tools print it.
    pub fn name(op: u8) -> &'static str {
        match op {
            SEND_FIRST => "SEND First",
            SEND_MIDDLE => "SEND Middle",
            SEND_LAST => "SEND Last",
            SEND_LAST_IMM => "SEND Last with Immediate",
            SEND_ONLY => "SEND Only",
            SEND_ONLY_IMM => "SEND Only with Immediate",
            WRITE_FIRST => "RDMA WRITE First",
            WRITE_MIDDLE => "RDMA WRITE Middle",
            WRITE_LAST => "RDMA WRITE Last",
            WRITE_LAST_IMM => "RDMA WRITE Last with Immediate",
            WRITE_ONLY => "RDMA WRITE Only",
            WRITE_ONLY_IMM => "RDMA WRITE Only with Immediate",
            READ_REQUEST => "RDMA READ Request",
            READ_RESPONSE_FIRST => "RDMA READ response First",
            READ_RESPONSE_MIDDLE => "RDMA READ response Middle",
            READ_RESPONSE_LAST => "RDMA READ response Last",
            READ_RESPONSE_ONLY => "RDMA READ response Only",
            ACK => "Acknowledge",
            ATOMIC_ACK => "ATOMIC Acknowledge",
            CMP_SWAP => "CmpSwap",
            FETCH_ADD => "FetchAdd",
            SEND_LAST_INV => "SEND Last with Invalidate",
            SEND_ONLY_INV => "SEND Only with Invalidate",
            MASKED_CMP_SWAP => "Masked CmpSwap (soft NIC)",
            MASKED_FETCH_ADD => "Masked FetchAdd (soft NIC)",
            UD_SEND_ONLY => "UD Send Only",
            UD_SEND_ONLY_IMM => "UD Send Only with Immediate",
            _ => "unknown",
        }
    }
}

/// The transport class of a packet: which QPs take it. Packets name the RC opcode they stand
/// for ([`Bth::opcode`]); the class says how it travels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Class {
    /// Reliable connected (and the UD opcodes, which carry a DETH).
    #[default]
    Rc,
    /// Unreliable connected (IBTA transport class 0b001: `0x20 | opcode` for SENDs and RDMA
    /// WRITEs): no ACK, no READ, no atomics.
    Uc,
    /// The soft NIC's DC class ([`dc`]).
    Dc,
    /// Extended reliable connected (IBTA transport class 0b101: `0xA0 | opcode`): RC's
    /// operations, every request with an XRCETH naming the target's XRC SRQ ([`xrc`]).
    Xrc,
}

impl Class {
    /// The class and RC opcode an opcode on the wire stands for.
    pub fn of(op: u8) -> (Self, u8) {
        if let Some(rc) = uc::from_uc(op) {
            (Self::Uc, rc)
        } else if let Some(rc) = xrc::from_xrc(op) {
            (Self::Xrc, rc)
        } else if let Some(rc) = dc::from_dc(op) {
            (Self::Dc, rc)
        } else {
            (Self::Rc, op)
        }
    }
    /// The opcode on the wire for RC opcode `op` in this class (`None`: the class has none).
    pub fn wire(self, op: u8) -> Option<u8> {
        match self {
            Self::Rc => Some(op),
            Self::Uc => uc::to_uc(op),
            Self::Xrc => xrc::to_xrc(op),
            Self::Dc => dc::to_dc(op),
        }
    }
}

/// UC opcodes (IBTA transport class 0b001): the SENDs and RDMA WRITEs of RC, 0x20 up.
pub mod uc {
    use super::opcode::WRITE_ONLY_IMM;

    /// The UC opcode of RC opcode `op` (SENDs and WRITEs only).
    pub fn to_uc(op: u8) -> Option<u8> {
        (op <= WRITE_ONLY_IMM).then_some(0x20 | op)
    }

    /// The RC opcode a UC opcode stands for; `None` outside UC's opcodes.
    pub fn from_uc(op: u8) -> Option<u8> {
        (0x20..=0x20 | WRITE_ONLY_IMM)
            .contains(&op)
            .then_some(op & 0x1f)
    }
}

/// XRC opcodes (IBTA transport class 0b101): RC's SENDs, RDMA WRITEs, READs, atomics and
/// their responses, 0xA0 up. Every request carries an XRCETH after the BTH; responses do not.
/// The soft NIC's masked atomics (vendor opcodes) have no XRC form.
pub mod xrc {
    use super::opcode::SEND_ONLY_INV;

    /// The XRC opcode of RC opcode `op`.
    pub fn to_xrc(op: u8) -> Option<u8> {
        (op <= SEND_ONLY_INV).then_some(0xa0 | op)
    }

    /// The RC opcode an XRC opcode stands for; `None` outside XRC's opcodes.
    pub fn from_xrc(op: u8) -> Option<u8> {
        (0xa0..=0xa0 | SEND_ONLY_INV)
            .contains(&op)
            .then_some(op & 0x1f)
    }
}

/// The soft NIC's DC transport on the wire (no public source describes a ConnectX's): the RC
/// opcodes moved into the manufacturer-specific class 0b111 (`0xE0 | opcode`; the masked
/// atomics, vendor opcodes already, at `0xF8` and `0xF9`), so that no RC QP takes a DC packet
/// nor a DC QP an RC one, and a [`Dceth`] after the BTH of every request. Responses carry no
/// DCETH. See docs/wire.md, "DC".
pub mod dc {
    use super::opcode::{MASKED_CMP_SWAP, MASKED_FETCH_ADD};

    /// The DC opcode of RC opcode `op` (`None` for one DC does not carry: UD, the vendor
    /// opcodes' neighbours).
    pub fn to_dc(op: u8) -> Option<u8> {
        match op {
            MASKED_CMP_SWAP => Some(0xf8),
            MASKED_FETCH_ADD => Some(0xf9),
            0x00..=0x17 => Some(0xe0 | op),
            _ => None,
        }
    }

    /// The RC opcode a DC opcode stands for; `None` for an opcode outside the DC class.
    pub fn from_dc(op: u8) -> Option<u8> {
        match op {
            0xf8 => Some(MASKED_CMP_SWAP),
            0xf9 => Some(MASKED_FETCH_ADD),
            0xe0..=0xf7 => Some(op & 0x1f),
            _ => None,
        }
    }
}

/// The soft NIC's DC extended transport header, after the BTH of a DC request:
/// `DC access key(8) | generation(4) | initiator QPN(4, 24 bits) | start PSN(4, 24 bits) |
/// reply UDP port(2) | reserved(2)`. The target checks the key; the initiator's QPN (at the
/// packet's source address and the reply port) is where its answers go; the generation counts
/// the initiator's moves between targets and the start PSN is the first PSN of this connection,
/// so a target learns where a connection starts from any of its packets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dceth {
    /// DC access key.
    pub key: u64,
    /// The initiator's connection generation.
    pub generation: u32,
    /// The initiator's QPN (24 bits).
    pub dci: u32,
    /// The first PSN of the connection (24 bits).
    pub start_psn: u32,
    /// The UDP port the initiator's device listens on (0: the RoCE v2 default).
    pub reply_port: u16,
}

/// AETH syndromes.
pub mod aeth {
    /// ACK with an unlimited credit count.
    pub const ACK: u8 = 0x1f;
    /// RNR NAK; the low 5 bits are the RNR timer.
    pub const RNR: u8 = 0x20;
    /// NAK: PSN sequence error.
    pub const NAK_SEQ: u8 = 0x60;
    /// NAK: invalid request.
    pub const NAK_INVALID: u8 = 0x61;
    /// NAK: remote access error.
    pub const NAK_ACCESS: u8 = 0x62;
    /// NAK: remote operational error.
    pub const NAK_OPERATIONAL: u8 = 0x63;
    /// The soft NIC's selective-repeat gap report: a NAK with a code IBTA reserves (0x1f),
    /// sent only to a requester that agreed on selective repeat. Its PSN is the first PSN
    /// missing behind packets the responder holds, its MSN field the number missing from
    /// there; it acknowledges nothing.
    pub const GAP_REPORT: u8 = 0x7f;
}

/// Which headers follow the BTH of an opcode, and whether it carries payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// RETH.
    pub reth: bool,
    /// AtomicETH.
    pub atomic: bool,
    /// Masked-atomic extension header.
    pub masked: bool,
    /// AETH.
    pub aeth: bool,
    /// AtomicAckETH.
    pub atomic_ack: bool,
    /// ImmDt.
    pub imm: bool,
    /// IETH.
    pub ieth: bool,
    /// DETH (UD).
    pub deth: bool,
    /// DCETH (a DC request).
    pub dceth: bool,
    /// XRCETH (an XRC request).
    pub xrceth: bool,
    /// Payload allowed.
    pub payload: bool,
}

impl Layout {
    /// Bytes of the extension headers.
    pub fn header_len(&self) -> usize {
        let f = |b: bool, n: usize| if b { n } else { 0 };
        f(self.reth, RETH_LEN)
            + f(self.atomic, ATOMIC_ETH_LEN)
            + f(self.masked, MASKED_ATOMIC_ETH_LEN)
            + f(self.aeth, AETH_LEN)
            + f(self.atomic_ack, ATOMIC_ACK_ETH_LEN)
            + f(self.imm, IMM_LEN)
            + f(self.ieth, IETH_LEN)
            + f(self.deth, DETH_LEN)
            + f(self.dceth, DCETH_LEN)
            + f(self.xrceth, XRCETH_LEN)
    }
}

/// The header layout of an opcode the soft NIC speaks; `None` for any other (UC, RD, UD
/// opcodes but SEND only, CNP, reserved). A DC opcode has its RC opcode's layout, and a DCETH
/// when it is a request.
pub fn layout(op: u8) -> Option<Layout> {
    use opcode::*;
    if let Some(rc) = dc::from_dc(op) {
        let l = layout(rc)?;
        return Some(Layout {
            dceth: is_request(rc),
            ..l
        });
    }
    if let Some(rc) = uc::from_uc(op) {
        return layout(rc);
    }
    if let Some(rc) = xrc::from_xrc(op) {
        let l = layout(rc)?;
        return Some(Layout {
            xrceth: is_request(rc),
            ..l
        });
    }
    let l = Layout::default();
    Some(match op {
        SEND_FIRST | SEND_MIDDLE | SEND_LAST | SEND_ONLY | WRITE_MIDDLE | WRITE_LAST => {
            Layout { payload: true, ..l }
        }
        SEND_LAST_IMM | SEND_ONLY_IMM | WRITE_LAST_IMM => Layout {
            imm: true,
            payload: true,
            ..l
        },
        SEND_LAST_INV | SEND_ONLY_INV => Layout {
            ieth: true,
            payload: true,
            ..l
        },
        WRITE_FIRST | WRITE_ONLY => Layout {
            reth: true,
            payload: true,
            ..l
        },
        WRITE_ONLY_IMM => Layout {
            reth: true,
            imm: true,
            payload: true,
            ..l
        },
        READ_REQUEST => Layout { reth: true, ..l },
        READ_RESPONSE_FIRST | READ_RESPONSE_LAST | READ_RESPONSE_ONLY => Layout {
            aeth: true,
            payload: true,
            ..l
        },
        READ_RESPONSE_MIDDLE => Layout { payload: true, ..l },
        ACK => Layout { aeth: true, ..l },
        ATOMIC_ACK => Layout {
            aeth: true,
            atomic_ack: true,
            ..l
        },
        CMP_SWAP | FETCH_ADD => Layout { atomic: true, ..l },
        MASKED_CMP_SWAP | MASKED_FETCH_ADD => Layout { masked: true, ..l },
        UD_SEND_ONLY => Layout {
            deth: true,
            payload: true,
            ..l
        },
        UD_SEND_ONLY_IMM => Layout {
            deth: true,
            imm: true,
            payload: true,
            ..l
        },
        _ => return None,
    })
}

/// Whether an opcode is a UD one (carries a DETH).
pub fn is_ud(op: u8) -> bool {
    matches!(op, opcode::UD_SEND_ONLY | opcode::UD_SEND_ONLY_IMM)
}

/// Whether an opcode is an RC request (travels requester → responder).
pub fn is_request(op: u8) -> bool {
    use opcode::*;
    op <= READ_REQUEST
        || matches!(
            op,
            CMP_SWAP
                | FETCH_ADD
                | SEND_LAST_INV
                | SEND_ONLY_INV
                | MASKED_CMP_SWAP
                | MASKED_FETCH_ADD
        )
}

/// Base transport header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bth {
    /// Opcode.
    pub opcode: u8,
    /// Solicited event.
    pub solicited: bool,
    /// Migration state (APM); the soft NIC sends 1, as rdma-core's providers do.
    pub mig_req: bool,
    /// Pad count (0..3): bytes of padding before the ICRC.
    pub pad: u8,
    /// Transport header version (must be 0).
    pub tver: u8,
    /// Partition key.
    pub pkey: u16,
    /// FECN / BECN / reserved byte (byte 4); congestion bits, masked out of the ICRC.
    pub byte4: u8,
    /// Destination QP (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

impl Bth {
    /// The 12 wire bytes.
    pub fn to_bytes(&self) -> [u8; BTH_LEN] {
        let mut b = [0u8; BTH_LEN];
        b[0] = self.opcode;
        b[1] = (self.solicited as u8) << 7
            | (self.mig_req as u8) << 6
            | (self.pad & 3) << 4
            | (self.tver & 0xf);
        b[2..4].copy_from_slice(&self.pkey.to_be_bytes());
        b[4..8]
            .copy_from_slice(&((self.byte4 as u32) << 24 | (self.dest_qp & MASK24)).to_be_bytes());
        b[8..12]
            .copy_from_slice(&((self.ack_req as u32) << 31 | (self.psn & MASK24)).to_be_bytes());
        b
    }

    /// Decodes 12 wire bytes.
    pub fn from_bytes(b: &[u8; BTH_LEN]) -> Self {
        let w1 = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
        let w2 = u32::from_be_bytes([b[8], b[9], b[10], b[11]]);
        Self {
            opcode: b[0],
            solicited: b[1] & 0x80 != 0,
            mig_req: b[1] & 0x40 != 0,
            pad: (b[1] >> 4) & 3,
            tver: b[1] & 0xf,
            pkey: u16::from_be_bytes([b[2], b[3]]),
            byte4: (w1 >> 24) as u8,
            dest_qp: w1 & MASK24,
            ack_req: w2 >> 31 != 0,
            psn: w2 & MASK24,
        }
    }
}

/// RDMA extended transport header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reth {
    /// Virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// DMA length of the whole message.
    pub len: u32,
}

/// Datagram extended transport header (UD).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Deth {
    /// Q_Key.
    pub qkey: u32,
    /// Source QP (24 bits).
    pub src_qp: u32,
}

/// ACK extended transport header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Aeth {
    /// Syndrome (see [`aeth`]).
    pub syndrome: u8,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

/// Atomic extended transport header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AtomicEth {
    /// Virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value (compare-and-swap) or addend (fetch-and-add).
    pub swap_add: u64,
    /// Compare value (compare-and-swap; 0 for fetch-and-add).
    pub compare: u64,
}

/// The soft NIC's masked-atomic header: `VA(8) rkey(4) size(1) reserved(3) swap_or_add(8)
/// compare_or_boundary(8) swap_mask(8) compare_mask(8)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaskedAtomicEth {
    /// Virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Operand size in bytes (4 or 8).
    pub size: u8,
    /// Swap value or addend.
    pub swap_add: u64,
    /// Compare value, or the field boundaries of a masked fetch-and-add.
    pub compare_boundary: u64,
    /// Swap mask (compare-and-swap).
    pub swap_mask: u64,
    /// Compare mask (compare-and-swap).
    pub compare_mask: u64,
}

/// One RoCEv2 packet (the UDP payload), decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Base transport header.
    pub bth: Bth,
    /// RETH.
    pub reth: Option<Reth>,
    /// AETH.
    pub aeth: Option<Aeth>,
    /// AtomicETH.
    pub atomic: Option<AtomicEth>,
    /// Masked-atomic header.
    pub masked: Option<MaskedAtomicEth>,
    /// AtomicAckETH: the original value.
    pub atomic_ack: Option<u64>,
    /// Immediate data (as the WQE carried it, host order of the big-endian field).
    pub imm: Option<u32>,
    /// IETH: the rkey the responder invalidates.
    pub ieth: Option<u32>,
    /// DETH (UD): Q_Key and source QP.
    pub deth: Option<Deth>,
    /// Its transport class: on the wire its opcode is the class's ([`Class::wire`]);
    /// `bth.opcode` holds the RC opcode it stands for.
    pub class: Class,
    /// DCETH (a DC request).
    pub dceth: Option<Dceth>,
    /// XRCETH (an XRC request): the XRC SRQ number (24 bits) at the target.
    pub xrceth: Option<u32>,
    /// Payload, without the pad.
    pub payload: &'a [u8],
}

/// Why a datagram is not a packet the soft NIC accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    /// Shorter than its headers and ICRC.
    #[error("truncated packet: {have} bytes, {need} needed")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Longer than any conforming packet.
    #[error("oversized packet: {0} bytes")]
    Oversized(usize),
    /// An opcode outside the RC set the soft NIC speaks.
    #[error("unsupported opcode {0:#04x}")]
    Opcode(u8),
    /// A transport header version other than 0.
    #[error("transport header version {0}")]
    Version(u8),
    /// Payload (or pad) on an opcode that carries none, or a pad longer than the payload.
    #[error("payload or pad where the opcode allows none")]
    Payload,
    /// The header fields required by the opcode were missing when encoding.
    #[error("missing extension header for opcode {0:#04x}")]
    MissingHeader(u8),
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}

/// Parses a UDP payload (BTH through ICRC). The ICRC is not checked here (see
/// [`icrc_matches`]); everything structural is.
pub fn parse(d: &[u8]) -> Result<Packet<'_>, PacketError> {
    if d.len() < BTH_LEN + ICRC_LEN {
        return Err(PacketError::Truncated {
            have: d.len(),
            need: BTH_LEN + ICRC_LEN,
        });
    }
    if d.len() > MAX_DATAGRAM {
        return Err(PacketError::Oversized(d.len()));
    }
    let bth = Bth::from_bytes(d[..BTH_LEN].try_into().expect("12 bytes"));
    if bth.tver != 0 {
        return Err(PacketError::Version(bth.tver));
    }
    let l = layout(bth.opcode).ok_or(PacketError::Opcode(bth.opcode))?;
    let (class, rc) = Class::of(bth.opcode);
    let need = BTH_LEN + l.header_len() + ICRC_LEN;
    if d.len() < need {
        return Err(PacketError::Truncated {
            have: d.len(),
            need,
        });
    }
    let body = &d[BTH_LEN..d.len() - ICRC_LEN];
    let mut at = 0usize;
    let mut p = Packet {
        bth: Bth { opcode: rc, ..bth },
        class,
        ..Packet::default()
    };
    if l.dceth {
        let h = &body[at..at + DCETH_LEN];
        p.dceth = Some(Dceth {
            key: be64(h),
            generation: be32(&h[8..]),
            dci: be32(&h[12..]) & MASK24,
            start_psn: be32(&h[16..]) & MASK24,
            reply_port: u16::from_be_bytes([h[20], h[21]]),
        });
        at += DCETH_LEN;
    }
    if l.xrceth {
        p.xrceth = Some(be32(&body[at..]) & MASK24);
        at += XRCETH_LEN;
    }
    if l.deth {
        let h = &body[at..at + DETH_LEN];
        p.deth = Some(Deth {
            qkey: be32(h),
            src_qp: be32(&h[4..]) & MASK24,
        });
        at += DETH_LEN;
    }
    if l.reth {
        let h = &body[at..at + RETH_LEN];
        p.reth = Some(Reth {
            va: be64(h),
            rkey: be32(&h[8..]),
            len: be32(&h[12..]),
        });
        at += RETH_LEN;
    }
    if l.atomic {
        let h = &body[at..at + ATOMIC_ETH_LEN];
        p.atomic = Some(AtomicEth {
            va: be64(h),
            rkey: be32(&h[8..]),
            swap_add: be64(&h[12..]),
            compare: be64(&h[20..]),
        });
        at += ATOMIC_ETH_LEN;
    }
    if l.masked {
        let h = &body[at..at + MASKED_ATOMIC_ETH_LEN];
        p.masked = Some(MaskedAtomicEth {
            va: be64(h),
            rkey: be32(&h[8..]),
            size: h[12],
            swap_add: be64(&h[16..]),
            compare_boundary: be64(&h[24..]),
            swap_mask: be64(&h[32..]),
            compare_mask: be64(&h[40..]),
        });
        at += MASKED_ATOMIC_ETH_LEN;
    }
    if l.aeth {
        let w = be32(&body[at..]);
        p.aeth = Some(Aeth {
            syndrome: (w >> 24) as u8,
            msn: w & MASK24,
        });
        at += AETH_LEN;
    }
    if l.atomic_ack {
        p.atomic_ack = Some(be64(&body[at..]));
        at += ATOMIC_ACK_ETH_LEN;
    }
    if l.imm {
        p.imm = Some(be32(&body[at..]));
        at += IMM_LEN;
    }
    if l.ieth {
        p.ieth = Some(be32(&body[at..]));
        at += IETH_LEN;
    }
    let rest = &body[at..];
    let pad = bth.pad as usize;
    if !l.payload && !rest.is_empty() {
        return Err(PacketError::Payload);
    }
    if rest.len() < pad || (rest.len() - pad) > MAX_MTU {
        return Err(PacketError::Payload);
    }
    p.payload = &rest[..rest.len() - pad];
    Ok(p)
}

/// Encodes `p` (its `bth.pad` is computed from the payload) into `out` (cleared first),
/// with the ICRC for `flow`.
pub fn encode(p: &Packet<'_>, flow: &Flow, out: &mut Vec<u8>) -> Result<(), PacketError> {
    out.clear();
    encode_at(p, flow, 0, out)
}

/// Appends `p`, encoded as [`encode`] does, to `out`, with the ICRC for `flow` and IPv4
/// identification `ip_id`; on an error `out` keeps its length.
pub fn encode_at(
    p: &Packet<'_>,
    flow: &Flow,
    ip_id: u16,
    out: &mut Vec<u8>,
) -> Result<(), PacketError> {
    let start = out.len();
    encode_headers(p, p.payload.len(), out)?;
    out.extend_from_slice(p.payload);
    finish_at(flow, ip_id, start, p.payload.len(), out);
    Ok(())
}

/// Appends the BTH (pad count for a payload of `payload_len` bytes) and the extension headers
/// of `p` to `out`; `p.payload` is ignored. Append the payload, then call [`finish`] (or
/// [`finish_at`]); on an error nothing is appended.
pub fn encode_headers(
    p: &Packet<'_>,
    payload_len: usize,
    out: &mut Vec<u8>,
) -> Result<(), PacketError> {
    let op = p
        .class
        .wire(p.bth.opcode)
        .ok_or(PacketError::Opcode(p.bth.opcode))?;
    let l = layout(op).ok_or(PacketError::Opcode(op))?;
    let missing = (l.reth && p.reth.is_none())
        || (l.dceth && p.dceth.is_none())
        || (l.xrceth && p.xrceth.is_none())
        || (l.atomic && p.atomic.is_none())
        || (l.masked && p.masked.is_none())
        || (l.aeth && p.aeth.is_none())
        || (l.atomic_ack && p.atomic_ack.is_none())
        || (l.imm && p.imm.is_none())
        || (l.ieth && p.ieth.is_none())
        || (l.deth && p.deth.is_none());
    if missing {
        return Err(PacketError::MissingHeader(op));
    }
    if (!l.payload && payload_len != 0) || payload_len > MAX_MTU {
        return Err(PacketError::Payload);
    }
    let mut bth = p.bth;
    bth.opcode = op;
    bth.pad = ((4 - payload_len % 4) % 4) as u8;
    out.extend_from_slice(&bth.to_bytes());
    if let (true, Some(d)) = (l.dceth, p.dceth) {
        out.extend_from_slice(&d.key.to_be_bytes());
        out.extend_from_slice(&d.generation.to_be_bytes());
        out.extend_from_slice(&(d.dci & MASK24).to_be_bytes());
        out.extend_from_slice(&(d.start_psn & MASK24).to_be_bytes());
        out.extend_from_slice(&d.reply_port.to_be_bytes());
        out.extend_from_slice(&[0, 0]);
    }
    if let (true, Some(x)) = (l.xrceth, p.xrceth) {
        out.extend_from_slice(&(x & MASK24).to_be_bytes());
    }
    if let (true, Some(d)) = (l.deth, p.deth) {
        out.extend_from_slice(&d.qkey.to_be_bytes());
        out.extend_from_slice(&(d.src_qp & MASK24).to_be_bytes());
    }
    if let (true, Some(r)) = (l.reth, p.reth) {
        out.extend_from_slice(&r.va.to_be_bytes());
        out.extend_from_slice(&r.rkey.to_be_bytes());
        out.extend_from_slice(&r.len.to_be_bytes());
    }
    if let (true, Some(a)) = (l.atomic, p.atomic) {
        out.extend_from_slice(&a.va.to_be_bytes());
        out.extend_from_slice(&a.rkey.to_be_bytes());
        out.extend_from_slice(&a.swap_add.to_be_bytes());
        out.extend_from_slice(&a.compare.to_be_bytes());
    }
    if let (true, Some(m)) = (l.masked, p.masked) {
        out.extend_from_slice(&m.va.to_be_bytes());
        out.extend_from_slice(&m.rkey.to_be_bytes());
        out.extend_from_slice(&[m.size, 0, 0, 0]);
        out.extend_from_slice(&m.swap_add.to_be_bytes());
        out.extend_from_slice(&m.compare_boundary.to_be_bytes());
        out.extend_from_slice(&m.swap_mask.to_be_bytes());
        out.extend_from_slice(&m.compare_mask.to_be_bytes());
    }
    if let (true, Some(a)) = (l.aeth, p.aeth) {
        out.extend_from_slice(&((a.syndrome as u32) << 24 | (a.msn & MASK24)).to_be_bytes());
    }
    if let (true, Some(v)) = (l.atomic_ack, p.atomic_ack) {
        out.extend_from_slice(&v.to_be_bytes());
    }
    if let (true, Some(i)) = (l.imm, p.imm) {
        out.extend_from_slice(&i.to_be_bytes());
    }
    if let (true, Some(k)) = (l.ieth, p.ieth) {
        out.extend_from_slice(&k.to_be_bytes());
    }
    Ok(())
}

/// Appends the pad of a `payload_len`-byte payload and the ICRC for `flow` to `out`
/// (headers and payload written by [`encode_headers`] and the caller, `out` holding only
/// that packet).
pub fn finish(flow: &Flow, payload_len: usize, out: &mut Vec<u8>) {
    finish_at(flow, 0, 0, payload_len, out);
}

/// [`finish`] for a packet that starts at `out[start]` (earlier packets before it), sealed
/// for IPv4 identification `ip_id`.
pub fn finish_at(flow: &Flow, ip_id: u16, start: usize, payload_len: usize, out: &mut Vec<u8>) {
    let pad = (4 - payload_len % 4) % 4;
    out.extend_from_slice(&[0u8; 3][..pad]);
    let crc = icrc_for_id(flow, ip_id, &out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Appends the ICRC of `out` (BTH through pad) for `flow`.
pub fn seal(flow: &Flow, out: &mut Vec<u8>) {
    let crc = icrc(flow, out);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// The addresses and ports of one datagram, from which its IPv4 and UDP headers are
/// synthesized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    /// Source IPv4 address (the sender's GID).
    pub src: Ipv4Addr,
    /// Destination IPv4 address (the receiver's GID).
    pub dst: Ipv4Addr,
    /// UDP source port.
    pub sport: u16,
    /// UDP destination port.
    pub dport: u16,
}

/// Synthesizes the IPv4 (20 bytes, with a correct header checksum) and UDP (8 bytes,
/// checksum 0) headers of a datagram carrying `udp_payload_len` bytes, with identification 0.
pub fn ipv4_udp_headers(flow: &Flow, udp_payload_len: usize) -> ([u8; 20], [u8; 8]) {
    ipv4_udp_headers_with_id(flow, 0, udp_payload_len)
}

/// [`ipv4_udp_headers`] with IPv4 identification `ip_id` (DF set, TTL 64).
pub fn ipv4_udp_headers_with_id(
    flow: &Flow,
    ip_id: u16,
    udp_payload_len: usize,
) -> ([u8; 20], [u8; 8]) {
    let udp_len = (8 + udp_payload_len) as u16;
    let total = 20u16.wrapping_add(udp_len);
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[4..6].copy_from_slice(&ip_id.to_be_bytes());
    // DF, fragment offset 0
    ip[6] = 0x40;
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&flow.src.octets());
    ip[16..20].copy_from_slice(&flow.dst.octets());
    let mut sum = 0u32;
    for c in ip.chunks(2) {
        sum += u16::from_be_bytes([c[0], c[1]]) as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    let mut udp = [0u8; 8];
    udp[0..2].copy_from_slice(&flow.sport.to_be_bytes());
    udp[2..4].copy_from_slice(&flow.dport.to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    (ip, udp)
}

/// The ICRC over given IPv4 and UDP headers (masked here) and `bth_to_pad`, the UDP payload
/// without its trailing ICRC.
pub fn icrc_with_headers(ip: &[u8; 20], udp: &[u8; 8], bth_to_pad: &[u8]) -> u32 {
    let mut ip = *ip;
    ip[1] = 0xff; // TOS
    ip[8] = 0xff; // TTL
    ip[10] = 0xff; // header checksum
    ip[11] = 0xff;
    let mut udp = *udp;
    udp[6] = 0xff;
    udp[7] = 0xff;
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xff; 8]);
    h.update(&ip);
    h.update(&udp);
    if bth_to_pad.len() >= BTH_LEN {
        h.update(&bth_to_pad[..4]);
        h.update(&[0xff]);
        h.update(&bth_to_pad[5..]);
    } else {
        h.update(bth_to_pad);
    }
    h.finalize()
}

/// The ICRC of a UDP payload without its trailing ICRC (`bth_to_pad`), for `flow` and IPv4
/// identification 0.
pub fn icrc(flow: &Flow, bth_to_pad: &[u8]) -> u32 {
    icrc_for_id(flow, 0, bth_to_pad)
}

/// [`icrc`] for IPv4 identification `ip_id`.
pub fn icrc_for_id(flow: &Flow, ip_id: u16, bth_to_pad: &[u8]) -> u32 {
    let (ip, udp) = ipv4_udp_headers_with_id(flow, ip_id, bth_to_pad.len() + ICRC_LEN);
    icrc_with_headers(&ip, &udp, bth_to_pad)
}

/// Whether the datagram's trailing ICRC is right for `flow` with IPv4 identification 0.
pub fn icrc_matches(flow: &Flow, datagram: &[u8]) -> bool {
    icrc_ip_id(flow, datagram, 0) == Some(0)
}

/// The identifications a segmented send gives its datagrams: 0 for the first (and for a
/// datagram sent alone), n for the n-th segment. A receiver accepts these.
pub const IP_IDS: u16 = 64;

/// The IPv4 identification in `0..IP_IDS` for which the datagram's trailing ICRC is right
/// for `flow`, trying `hint` first (the datagram's place in a coalesced run); `None` when
/// there is none (a corrupted datagram).
pub fn icrc_ip_id(flow: &Flow, datagram: &[u8], hint: u16) -> Option<u16> {
    let split = datagram.len().checked_sub(ICRC_LEN)?;
    let (body, tail) = datagram.split_at(split);
    let want = u32::from_le_bytes(tail.try_into().ok()?);
    let diff = icrc(flow, body) ^ want;
    if diff == 0 {
        return Some(0);
    }
    let shift = crc_shift(body.len());
    if hint != 0 && hint < IP_IDS && gf2_mul(crc_of_id(hint), shift) == diff {
        return Some(hint);
    }
    // The change of the ICRC is linear in the identification's bits: walk 1..IP_IDS in Gray
    // code order, one XOR per step.
    let basis: [u32; 6] = std::array::from_fn(|b| gf2_mul(crc_of_id(1 << b), shift));
    let mut acc = 0u32;
    for i in 1..IP_IDS {
        let bit = i.trailing_zeros() as usize;
        acc ^= basis[bit];
        if acc == diff {
            return Some(i ^ (i >> 1));
        }
    }
    None
}

/// Whether the datagram's trailing ICRC is right for `flow` and IPv4 identification `id`.
pub fn icrc_is_for_id(flow: &Flow, datagram: &[u8], id: u16) -> bool {
    let Some(split) = datagram.len().checked_sub(ICRC_LEN) else {
        return false;
    };
    let (body, tail) = datagram.split_at(split);
    icrc_for_id(flow, id, body).to_le_bytes() == tail
}

/// Changes the ICRC at the end of `datagram` (BTH through ICRC, sealed for identification
/// `a`) to the one for identification `b`.
pub fn reseal_ip_id(datagram: &mut [u8], a: u16, b: u16) {
    let Some(split) = datagram.len().checked_sub(ICRC_LEN) else {
        return;
    };
    if a == b {
        return;
    }
    let delta = gf2_mul(crc_of_id(a ^ b), crc_shift(split));
    let tail = &mut datagram[split..];
    let v = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]) ^ delta;
    tail.copy_from_slice(&v.to_le_bytes());
}

// CRC-32 arithmetic for changing the identification under a finished ICRC. A CRC is affine in
// its message: two messages of one length that differ in D have CRCs that differ in
// crc_raw(D), the register (zero start, no final inversion) after D. D is the changed
// identification followed by zeros, and a zero byte multiplies the register by x^8 modulo the
// polynomial. Polynomials are in the reflected order of zlib's CRC-32: bit 31 is x^0.

/// The reflected CRC-32 polynomial (IEEE 802.3).
const CRC_POLY: u32 = 0xedb8_8320;

/// `a * b` modulo the CRC polynomial (reflected representation).
fn gf2_mul(a: u32, mut b: u32) -> u32 {
    let mut p = 0u32;
    for i in 0..32 {
        if a & (0x8000_0000 >> i) != 0 {
            p ^= b;
        }
        // b *= x
        b = if b & 1 != 0 {
            (b >> 1) ^ CRC_POLY
        } else {
            b >> 1
        };
    }
    p
}

/// The register after the two bytes of a big-endian identification (zero start).
fn crc_of_id(id: u16) -> u32 {
    let mut c = 0u32;
    for byte in id.to_be_bytes() {
        c ^= byte as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ CRC_POLY
            } else {
                c >> 1
            };
        }
    }
    c
}

/// Bytes of the ICRC's message after the identification, besides the UDP payload: the rest
/// of the IPv4 header (14) and the UDP header (8).
const AFTER_ID: usize = 14 + 8;

/// x^(8n) modulo the polynomial, where n is the number of message bytes after the
/// identification for a UDP payload (without ICRC) of `body_len` bytes. Cached for every
/// length a datagram can have.
fn crc_shift(body_len: usize) -> u32 {
    static TABLE: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let x8 = 1u32 << (31 - 8);
        let mut v = Vec::with_capacity(MAX_DATAGRAM + 1);
        // x^(8 * AFTER_ID)
        let mut p = 1u32 << 31;
        for _ in 0..AFTER_ID {
            p = gf2_mul(p, x8);
        }
        for _ in 0..=MAX_DATAGRAM {
            v.push(p);
            p = gf2_mul(p, x8);
        }
        v
    });
    match t.get(body_len) {
        Some(&p) => p,
        None => {
            // longer than any datagram the soft NIC sends or accepts: computed here
            let x8 = 1u32 << (31 - 8);
            let mut p = 1u32 << 31;
            let (mut base, mut n) = (x8, body_len + AFTER_ID);
            while n > 0 {
                if n & 1 != 0 {
                    p = gf2_mul(p, base);
                }
                base = gf2_mul(base, base);
                n >>= 1;
            }
            p
        }
    }
}

#[cfg(test)]
mod tests;
