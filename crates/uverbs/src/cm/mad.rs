//! The communication manager's messages (IBTA vol. 1 chapter 12) as MADs of class 0x07: REQ,
//! MRA, REJ, REP, RTU, DREQ, DREP, SIDR_REQ and SIDR_REP, each a 24-byte MAD header and a
//! 232-byte message whose fields sit at the bit positions the specification gives (offsets
//! below are from the end of the MAD header, bits counted from a byte's most significant).
//! Each message's fields are one table (its `Layout`), which [`encode`] walks to write them and
//! [`parse`] to read them.
//!
//! [`parse`] takes any bytes (a datagram from the wire) and never panics; [`encode`] writes
//! exactly 256 bytes. The fuzz target `cm_mad` runs [`parse`] and checks that what it accepts
//! encodes back to the same fields.

use bytemuck::Zeroable;

/// Bytes of a MAD.
pub const MAD_LEN: usize = 256;
/// Bytes of the common MAD header.
pub const HDR_LEN: usize = 24;
/// Bytes of a CM message after the header.
pub const MSG_LEN: usize = MAD_LEN - HDR_LEN;
/// Management class of the communication manager.
pub const CLASS_CM: u8 = 0x07;
/// The CM class version ConnectX hosts send (Linux's `IB_CM_CLASS_VERSION`).
pub const CLASS_VERSION: u8 = 2;
/// Method SEND (every CM message is one).
pub const METHOD_SEND: u8 = 0x03;

/// Attribute IDs.
pub mod attr {
    /// ClassPortInfo.
    pub const CLASS_PORT_INFO: u16 = 0x0001;
    /// Connection request.
    pub const REQ: u16 = 0x0010;
    /// Message receipt acknowledgement.
    pub const MRA: u16 = 0x0011;
    /// Reject.
    pub const REJ: u16 = 0x0012;
    /// Reply to a request.
    pub const REP: u16 = 0x0013;
    /// Ready to use.
    pub const RTU: u16 = 0x0014;
    /// Disconnect request.
    pub const DREQ: u16 = 0x0015;
    /// Disconnect reply.
    pub const DREP: u16 = 0x0016;
    /// Service ID resolution request (UD).
    pub const SIDR_REQ: u16 = 0x0017;
    /// Service ID resolution reply.
    pub const SIDR_REP: u16 = 0x0018;
}

/// Private data bytes each message carries.
pub mod private_len {
    /// REQ.
    pub const REQ: usize = 92;
    /// MRA.
    pub const MRA: usize = 222;
    /// REJ.
    pub const REJ: usize = 148;
    /// REP.
    pub const REP: usize = 196;
    /// RTU.
    pub const RTU: usize = 224;
    /// DREQ.
    pub const DREQ: usize = 220;
    /// DREP.
    pub const DREP: usize = 224;
    /// SIDR_REQ.
    pub const SIDR_REQ: usize = 216;
    /// SIDR_REP.
    pub const SIDR_REP: usize = 136;
}

/// Why bytes are not a CM message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MadError {
    /// Fewer bytes than a MAD.
    #[error("{0} bytes: shorter than a 256-byte MAD")]
    Short(usize),
    /// Another management class or version.
    #[error("management class {class:#04x} version {version}, base version {base}: not the CM's")]
    NotCm {
        /// Base version.
        base: u8,
        /// Class.
        class: u8,
        /// Class version.
        version: u8,
    },
    /// Not a SEND.
    #[error("method {0:#04x}: the CM sends only SEND")]
    Method(u8),
    /// An attribute this CM does not take (LAP, APR, ClassPortInfo, unknown).
    #[error("attribute {0:#06x} not served")]
    Attr(u16),
}

/// The primary path of a REQ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Zeroable)]
pub struct Path {
    /// Local port LID (0xffff, permissive, on RoCE).
    pub local_lid: u16,
    /// Remote port LID.
    pub remote_lid: u16,
    /// The requester's GID.
    pub local_gid: [u8; 16],
    /// The responder's GID.
    pub remote_gid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Packet rate (6 bits).
    pub packet_rate: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// Subnet local.
    pub subnet_local: bool,
    /// Local ACK timeout (5 bits).
    pub local_ack_timeout: u8,
}

/// A connection request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Req {
    /// The requester's communication ID.
    pub local_comm_id: u32,
    /// Service ID.
    pub service_id: u64,
    /// The requester's CA GUID.
    pub local_ca_guid: u64,
    /// Q_Key (UD/RD only).
    pub local_qkey: u32,
    /// The requester's QPN (24 bits).
    pub local_qpn: u32,
    /// RDMA READ / atomic requests the requester accepts.
    pub responder_resources: u8,
    /// RDMA READ / atomic requests the requester sends.
    pub initiator_depth: u8,
    /// Remote CM response timeout (5 bits).
    pub remote_cm_response_timeout: u8,
    /// Transport service type (0 RC, 1 UC, 3 XRC with the extended type).
    pub transport: u8,
    /// End-to-end flow control.
    pub flow_control: bool,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Local CM response timeout (5 bits).
    pub local_cm_response_timeout: u8,
    /// Retry count (3 bits).
    pub retry_count: u8,
    /// P_Key.
    pub pkey: u16,
    /// Path MTU code (4 bits).
    pub mtu: u8,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// Max CM retries (4 bits).
    pub max_cm_retries: u8,
    /// The requester's QP uses an SRQ.
    pub srq: bool,
    /// The primary path.
    pub path: Path,
    /// Private data.
    pub private_data: [u8; private_len::REQ],
}

/// A message receipt acknowledgement.
#[derive(Clone, Debug, PartialEq, Eq, Zeroable)]
pub struct Mra {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID.
    pub remote_comm_id: u32,
    /// Which message: 0 REQ, 1 REP, 2 LAP.
    pub message_mraed: u8,
    /// Service timeout (5 bits).
    pub service_timeout: u8,
}

/// A reject.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rej {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID (0 when unknown).
    pub remote_comm_id: u32,
    /// Which message is rejected: 0 REQ, 1 REP, 2 none (2 bits).
    pub message_rejected: u8,
    /// Reason (IBTA table 112; 28 consumer defined).
    pub reason: u16,
    /// Private data.
    pub private_data: [u8; private_len::REJ],
}

/// A reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rep {
    /// The responder's communication ID.
    pub local_comm_id: u32,
    /// The requester's communication ID.
    pub remote_comm_id: u32,
    /// Q_Key.
    pub local_qkey: u32,
    /// The responder's QPN (24 bits).
    pub local_qpn: u32,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Target ACK delay (5 bits).
    pub target_ack_delay: u8,
    /// Failover accepted (2 bits).
    pub failover_accepted: u8,
    /// End-to-end flow control.
    pub flow_control: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// SRQ.
    pub srq: bool,
    /// The responder's CA GUID.
    pub local_ca_guid: u64,
    /// Private data.
    pub private_data: [u8; private_len::REP],
}

/// Ready to use, a disconnect reply: IDs and private data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ids224 {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID.
    pub remote_comm_id: u32,
    /// Private data.
    pub private_data: [u8; 224],
}

/// A disconnect request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dreq {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID.
    pub remote_comm_id: u32,
    /// The receiver's QPN (24 bits).
    pub remote_qpn: u32,
    /// Private data.
    pub private_data: [u8; private_len::DREQ],
}

/// A service ID resolution request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SidrReq {
    /// Request ID.
    pub request_id: u32,
    /// P_Key.
    pub pkey: u16,
    /// Service ID.
    pub service_id: u64,
    /// Private data.
    pub private_data: [u8; private_len::SIDR_REQ],
}

/// A service ID resolution reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SidrRep {
    /// Request ID.
    pub request_id: u32,
    /// Status (0 valid, 1 service ID not supported, 2 rejected, 3 no QP, ...).
    pub status: u8,
    /// QPN (24 bits).
    pub qpn: u32,
    /// Service ID.
    pub service_id: u64,
    /// Q_Key.
    pub qkey: u32,
    /// Private data.
    pub private_data: [u8; private_len::SIDR_REP],
}

/// One CM message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// REQ.
    Req(Box<Req>),
    /// MRA.
    Mra(Mra),
    /// REJ.
    Rej(Box<Rej>),
    /// REP.
    Rep(Box<Rep>),
    /// RTU.
    Rtu(Box<Ids224>),
    /// DREQ.
    Dreq(Box<Dreq>),
    /// DREP.
    Drep(Box<Ids224>),
    /// SIDR_REQ.
    SidrReq(Box<SidrReq>),
    /// SIDR_REP.
    SidrRep(Box<SidrRep>),
}

impl Msg {
    /// The attribute ID it is sent with.
    pub fn attr_id(&self) -> u16 {
        match self {
            Msg::Req(_) => attr::REQ,
            Msg::Mra(_) => attr::MRA,
            Msg::Rej(_) => attr::REJ,
            Msg::Rep(_) => attr::REP,
            Msg::Rtu(_) => attr::RTU,
            Msg::Dreq(_) => attr::DREQ,
            Msg::Drep(_) => attr::DREP,
            Msg::SidrReq(_) => attr::SIDR_REQ,
            Msg::SidrRep(_) => attr::SIDR_REP,
        }
    }
}

/// A CM MAD: the transaction ID and the message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mad {
    /// Transaction ID.
    pub tid: u64,
    /// The message.
    pub msg: Msg,
}

// SAFETY: every field of these messages is an integer, a bool, a byte array or a `Path`
// (itself `Zeroable`): all-zero bytes are a value of each. (bytemuck derives `Zeroable` only
// for arrays of at most 32 bytes without its `min_const_generics` feature.)
unsafe impl Zeroable for Req {}
// SAFETY: as above.
unsafe impl Zeroable for Rej {}
// SAFETY: as above.
unsafe impl Zeroable for Rep {}
// SAFETY: as above.
unsafe impl Zeroable for Ids224 {}
// SAFETY: as above.
unsafe impl Zeroable for Dreq {}
// SAFETY: as above.
unsafe impl Zeroable for SidrReq {}
// SAFETY: as above.
unsafe impl Zeroable for SidrRep {}

/// The message bytes (padded so that an 8-byte window at any field offset stays inside), and
/// the way a message's field table moves values: into them (encoding) or out of them.
struct Wire {
    b: [u8; MSG_LEN + 8],
    encoding: bool,
}

/// A field's value as bits of the wire.
trait Field {
    /// Its width when it fills whole bytes.
    const BITS: u32;
    fn to_bits(&self) -> u64;
    fn from_bits(v: u64) -> Self;
}

macro_rules! int_field {
    ($($t:ty),*) => {$(
        impl Field for $t {
            const BITS: u32 = <$t>::BITS;
            fn to_bits(&self) -> u64 {
                *self as u64
            }
            fn from_bits(v: u64) -> Self {
                v as $t
            }
        }
    )*};
}
int_field!(u8, u16, u32, u64);

impl Field for bool {
    const BITS: u32 = 1;
    fn to_bits(&self) -> u64 {
        *self as u64
    }
    fn from_bits(v: u64) -> Self {
        v != 0
    }
}

impl Wire {
    fn new(encoding: bool) -> Self {
        Self {
            b: [0; MSG_LEN + 8],
            encoding,
        }
    }

    /// The field `v`: `n` bits (1 to 64) from bit `bit` (counted from the MSB) of byte `at`.
    fn bits<T: Field>(&mut self, at: usize, bit: u32, n: u32, v: &mut T) {
        let window = &mut self.b[at..at + 8];
        let w = u64::from_be_bytes(window.try_into().expect("8 bytes"));
        let mask = u64::MAX >> (64 - n);
        let sh = 64 - bit - n;
        if self.encoding {
            let w = (w & !(mask << sh)) | ((v.to_bits() & mask) << sh);
            window.copy_from_slice(&w.to_be_bytes());
        } else {
            *v = T::from_bits(w >> sh & mask);
        }
    }

    /// The field `v`, whole bytes of its type, at byte `at`.
    fn at<T: Field>(&mut self, at: usize, v: &mut T) {
        self.bits(at, 0, T::BITS, v);
    }

    /// The bytes `v` (a GID, private data) at byte `at`.
    fn bytes<const N: usize>(&mut self, at: usize, v: &mut [u8; N]) {
        let w = &mut self.b[at..at + N];
        if self.encoding {
            w.copy_from_slice(v);
        } else {
            v.copy_from_slice(w);
        }
    }
}

/// A message's field table: each field at the offset the specification gives it (its byte
/// after the MAD header, then first bit and width for a field that does not fill whole bytes of
/// its type), walked one way to encode and the other to decode.
trait Layout {
    fn fields(&mut self, w: &mut Wire);
}

/// REQ (Linux's `struct cm_req_msg`).
impl Layout for Req {
    fn fields(&mut self, w: &mut Wire) {
        w.at(0, &mut self.local_comm_id);
        w.at(8, &mut self.service_id);
        w.at(16, &mut self.local_ca_guid);
        w.at(28, &mut self.local_qkey);
        w.bits(32, 0, 24, &mut self.local_qpn);
        w.at(35, &mut self.responder_resources);
        w.at(39, &mut self.initiator_depth);
        w.bits(43, 0, 5, &mut self.remote_cm_response_timeout);
        w.bits(43, 5, 2, &mut self.transport);
        w.bits(43, 7, 1, &mut self.flow_control);
        w.bits(44, 0, 24, &mut self.starting_psn);
        w.bits(47, 0, 5, &mut self.local_cm_response_timeout);
        w.bits(47, 5, 3, &mut self.retry_count);
        w.at(48, &mut self.pkey);
        w.bits(50, 0, 4, &mut self.mtu);
        w.bits(50, 5, 3, &mut self.rnr_retry_count);
        w.bits(51, 0, 4, &mut self.max_cm_retries);
        w.bits(51, 4, 1, &mut self.srq);
        let p = &mut self.path;
        w.at(52, &mut p.local_lid);
        w.at(54, &mut p.remote_lid);
        w.bytes(56, &mut p.local_gid);
        w.bytes(72, &mut p.remote_gid);
        w.bits(88, 0, 20, &mut p.flow_label);
        w.bits(91, 2, 6, &mut p.packet_rate);
        w.at(92, &mut p.traffic_class);
        w.at(93, &mut p.hop_limit);
        w.bits(94, 0, 4, &mut p.sl);
        w.bits(94, 4, 1, &mut p.subnet_local);
        w.bits(95, 0, 5, &mut p.local_ack_timeout);
        w.bytes(140, &mut self.private_data);
    }
}

/// MRA (`struct cm_mra_msg`).
impl Layout for Mra {
    fn fields(&mut self, w: &mut Wire) {
        w.at(0, &mut self.local_comm_id);
        w.at(4, &mut self.remote_comm_id);
        w.bits(8, 0, 2, &mut self.message_mraed);
        w.bits(9, 0, 5, &mut self.service_timeout);
    }
}

/// REJ (`struct cm_rej_msg`).
impl Layout for Rej {
    fn fields(&mut self, w: &mut Wire) {
        w.at(0, &mut self.local_comm_id);
        w.at(4, &mut self.remote_comm_id);
        w.bits(8, 0, 2, &mut self.message_rejected);
        w.at(10, &mut self.reason);
        w.bytes(84, &mut self.private_data);
    }
}

/// REP (`struct cm_rep_msg`).
impl Layout for Rep {
    fn fields(&mut self, w: &mut Wire) {
        w.at(0, &mut self.local_comm_id);
        w.at(4, &mut self.remote_comm_id);
        w.at(8, &mut self.local_qkey);
        w.bits(12, 0, 24, &mut self.local_qpn);
        w.bits(20, 0, 24, &mut self.starting_psn);
        w.at(24, &mut self.responder_resources);
        w.at(25, &mut self.initiator_depth);
        w.bits(26, 0, 5, &mut self.target_ack_delay);
        w.bits(26, 5, 2, &mut self.failover_accepted);
        w.bits(26, 7, 1, &mut self.flow_control);
        w.bits(27, 0, 3, &mut self.rnr_retry_count);
        w.bits(27, 3, 1, &mut self.srq);
        w.at(28, &mut self.local_ca_guid);
        w.bytes(36, &mut self.private_data);
    }
}

/// RTU and DREP (`struct cm_rtu_msg`, `struct cm_drep_msg`).
impl Layout for Ids224 {
    fn fields(&mut self, w: &mut Wire) {
        w.at(0, &mut self.local_comm_id);
        w.at(4, &mut self.remote_comm_id);
        w.bytes(8, &mut self.private_data);
    }
}

/// DREQ (`struct cm_dreq_msg`).
impl Layout for Dreq {
    fn fields(&mut self, w: &mut Wire) {
        w.at(0, &mut self.local_comm_id);
        w.at(4, &mut self.remote_comm_id);
        w.bits(8, 0, 24, &mut self.remote_qpn);
        w.bytes(12, &mut self.private_data);
    }
}

/// SIDR_REQ (`struct cm_sidr_req_msg`).
impl Layout for SidrReq {
    fn fields(&mut self, w: &mut Wire) {
        w.at(0, &mut self.request_id);
        w.at(4, &mut self.pkey);
        w.at(8, &mut self.service_id);
        w.bytes(16, &mut self.private_data);
    }
}

/// SIDR_REP (`struct cm_sidr_rep_msg`).
impl Layout for SidrRep {
    fn fields(&mut self, w: &mut Wire) {
        w.at(0, &mut self.request_id);
        w.at(4, &mut self.status);
        w.bits(8, 0, 24, &mut self.qpn);
        w.at(12, &mut self.service_id);
        w.at(20, &mut self.qkey);
        w.bytes(96, &mut self.private_data);
    }
}

impl Msg {
    /// A message of attribute `attr` with every field 0 (None: one this CM does not take).
    fn zeroed(attr: u16) -> Option<Msg> {
        fn z<T: Zeroable>() -> Box<T> {
            Box::new(T::zeroed())
        }
        Some(match attr {
            attr::REQ => Msg::Req(z()),
            attr::MRA => Msg::Mra(Mra::zeroed()),
            attr::REJ => Msg::Rej(z()),
            attr::REP => Msg::Rep(z()),
            attr::RTU => Msg::Rtu(z()),
            attr::DREQ => Msg::Dreq(z()),
            attr::DREP => Msg::Drep(z()),
            attr::SIDR_REQ => Msg::SidrReq(z()),
            attr::SIDR_REP => Msg::SidrRep(z()),
            _ => return None,
        })
    }

    /// The message's field table.
    fn layout(&mut self) -> &mut dyn Layout {
        match self {
            Msg::Req(m) => &mut **m,
            Msg::Mra(m) => m,
            Msg::Rej(m) => &mut **m,
            Msg::Rep(m) => &mut **m,
            Msg::Rtu(m) | Msg::Drep(m) => &mut **m,
            Msg::Dreq(m) => &mut **m,
            Msg::SidrReq(m) => &mut **m,
            Msg::SidrRep(m) => &mut **m,
        }
    }
}

/// Parses a CM MAD. Any bytes are taken without panicking; a datagram longer than a MAD is
/// read to its first 256 bytes.
pub fn parse(b: &[u8]) -> Result<Mad, MadError> {
    if b.len() < MAD_LEN {
        return Err(MadError::Short(b.len()));
    }
    let (base, class, version, method) = (b[0], b[1], b[2], b[3]);
    if base != 1 || class != CLASS_CM || version != CLASS_VERSION {
        return Err(MadError::NotCm {
            base,
            class,
            version,
        });
    }
    if method != METHOD_SEND {
        return Err(MadError::Method(method));
    }
    let mut tid = [0u8; 8];
    tid.copy_from_slice(&b[8..16]);
    let attr_id = u16::from_be_bytes([b[16], b[17]]);
    let mut msg = Msg::zeroed(attr_id).ok_or(MadError::Attr(attr_id))?;
    let mut w = Wire::new(false);
    w.b[..MSG_LEN].copy_from_slice(&b[HDR_LEN..MAD_LEN]);
    msg.layout().fields(&mut w);
    Ok(Mad {
        tid: u64::from_be_bytes(tid),
        msg,
    })
}

/// The 256 bytes of `mad` (a SEND of class CM, version 2).
pub fn encode(mad: &Mad) -> [u8; MAD_LEN] {
    let mut w = Wire::new(true);
    mad.msg.clone().layout().fields(&mut w);
    let mut out = [0u8; MAD_LEN];
    out[0] = 1; // base version
    out[1] = CLASS_CM;
    out[2] = CLASS_VERSION;
    out[3] = METHOD_SEND;
    out[8..16].copy_from_slice(&mad.tid.to_be_bytes());
    out[16..18].copy_from_slice(&mad.msg.attr_id().to_be_bytes());
    out[HDR_LEN..].copy_from_slice(&w.b[..MSG_LEN]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> Req {
        Req {
            local_comm_id: 0x1122_3344,
            service_id: 0x0000_0000_0106_1c06,
            local_ca_guid: 0x0202_c9ff_fe00_0001,
            local_qkey: 0,
            local_qpn: 0x00ab_cdef,
            responder_resources: 16,
            initiator_depth: 15,
            remote_cm_response_timeout: 20,
            transport: 0,
            flow_control: true,
            starting_psn: 0x0012_3456,
            local_cm_response_timeout: 20,
            retry_count: 7,
            pkey: 0xffff,
            mtu: 5,
            rnr_retry_count: 6,
            max_cm_retries: 15,
            srq: true,
            path: Path {
                local_lid: 0xffff,
                remote_lid: 0xffff,
                local_gid: [9; 16],
                remote_gid: [7; 16],
                flow_label: 0xa_bcde,
                packet_rate: 0x2a,
                traffic_class: 0x10,
                hop_limit: 64,
                sl: 3,
                subnet_local: false,
                local_ack_timeout: 18,
            },
            private_data: [0x5a; 92],
        }
    }

    #[test]
    fn a_req_lands_at_the_specifications_offsets_and_reads_back() {
        let mad = Mad {
            tid: 0x0102_0304_0506_0708,
            msg: Msg::Req(Box::new(req())),
        };
        let b = encode(&mad);
        assert_eq!(&b[..4], &[1, 7, 2, 3]);
        assert_eq!(&b[16..18], &[0, 0x10]);
        let m = &b[HDR_LEN..];
        assert_eq!(
            &m[32..36],
            &[0xab, 0xcd, 0xef, 16],
            "QPN then responder resources"
        );
        assert_eq!(m[43], 20 << 3 | 1, "timeout, RC, flow control");
        assert_eq!(&m[44..48], &[0x12, 0x34, 0x56, 20 << 3 | 7]);
        assert_eq!(m[50], 5 << 4 | 6);
        assert_eq!(m[51], 15 << 4 | 1 << 3);
        assert_eq!(&m[88..92], &[0xab, 0xcd, 0xe0, 0x2a]);
        assert_eq!(m[95], 18 << 3);
        assert_eq!(parse(&b), Ok(mad));
    }

    #[test]
    fn every_message_round_trips() {
        let msgs = [
            Msg::Mra(Mra {
                local_comm_id: 1,
                remote_comm_id: 2,
                message_mraed: 1,
                service_timeout: 23,
            }),
            Msg::Rej(Box::new(Rej {
                local_comm_id: 3,
                remote_comm_id: 4,
                message_rejected: 0,
                reason: 28,
                private_data: [1; 148],
            })),
            Msg::Rep(Box::new(Rep {
                local_comm_id: 5,
                remote_comm_id: 6,
                local_qkey: 0,
                local_qpn: 0x12_3456,
                starting_psn: 0xff_fff0,
                responder_resources: 4,
                initiator_depth: 3,
                target_ack_delay: 16,
                failover_accepted: 1,
                flow_control: true,
                rnr_retry_count: 7,
                srq: false,
                local_ca_guid: 42,
                private_data: [2; 196],
            })),
            Msg::Rtu(Box::new(Ids224 {
                local_comm_id: 7,
                remote_comm_id: 8,
                private_data: [3; 224],
            })),
            Msg::Dreq(Box::new(Dreq {
                local_comm_id: 9,
                remote_comm_id: 10,
                remote_qpn: 0x77,
                private_data: [4; 220],
            })),
            Msg::Drep(Box::new(Ids224 {
                local_comm_id: 11,
                remote_comm_id: 12,
                private_data: [5; 224],
            })),
            Msg::SidrReq(Box::new(SidrReq {
                request_id: 13,
                pkey: 0xffff,
                service_id: 0x0111_0000,
                private_data: [6; 216],
            })),
            Msg::SidrRep(Box::new(SidrRep {
                request_id: 14,
                status: 0,
                qpn: 0x4242,
                service_id: 0x0111_0000,
                qkey: 0x0123_4567,
                private_data: [7; 136],
            })),
        ];
        for msg in msgs {
            let mad = Mad { tid: 99, msg };
            assert_eq!(parse(&encode(&mad)), Ok(mad));
        }
    }

    /// Private data whose every byte tells where it sits (and in which message).
    fn pd<const N: usize>(seed: u8) -> [u8; N] {
        std::array::from_fn(|i| seed ^ (i as u8).wrapping_mul(7))
    }

    /// Every message with distinctive values: bit fields at their widest, no two fields
    /// alike, so a field moved, narrowed or widened changes the bytes.
    fn distinctive() -> Vec<(&'static str, Msg)> {
        let mut r = req();
        r.local_qkey = 0x5eed_0bad;
        r.transport = 3;
        r.remote_cm_response_timeout = 0x15;
        r.local_cm_response_timeout = 0x0b;
        r.retry_count = 5;
        r.pkey = 0x8001;
        r.mtu = 0xa;
        r.rnr_retry_count = 3;
        r.max_cm_retries = 0x9;
        r.path.local_lid = 0x1357;
        r.path.remote_lid = 0x2468;
        r.path.local_gid = pd(0x11);
        r.path.remote_gid = pd(0x22);
        r.path.flow_label = 0xf_1234;
        r.path.sl = 0xd;
        r.path.subnet_local = true;
        r.path.local_ack_timeout = 0x1f;
        r.private_data = pd(0x33);
        let ids = |seed| Ids224 {
            local_comm_id: 0xa1a2_a3a4 ^ seed as u32,
            remote_comm_id: 0xb1b2_b3b4 ^ seed as u32,
            private_data: pd(seed),
        };
        vec![
            ("REQ", Msg::Req(Box::new(r))),
            (
                "MRA",
                Msg::Mra(Mra {
                    local_comm_id: 0x0102_0304,
                    remote_comm_id: 0x0506_0708,
                    message_mraed: 2,
                    service_timeout: 0x1d,
                }),
            ),
            (
                "REJ",
                Msg::Rej(Box::new(Rej {
                    local_comm_id: 0x1112_1314,
                    remote_comm_id: 0x1516_1718,
                    message_rejected: 3,
                    reason: 0x9abc,
                    private_data: pd(0x44),
                })),
            ),
            (
                "REP",
                Msg::Rep(Box::new(Rep {
                    local_comm_id: 0x2122_2324,
                    remote_comm_id: 0x2526_2728,
                    local_qkey: 0x292a_2b2c,
                    local_qpn: 0x00c0_ffee,
                    starting_psn: 0x00fa_ce01,
                    responder_resources: 0xe1,
                    initiator_depth: 0xd2,
                    target_ack_delay: 0x13,
                    failover_accepted: 2,
                    flow_control: true,
                    rnr_retry_count: 5,
                    srq: true,
                    local_ca_guid: 0x3132_3334_3536_3738,
                    private_data: pd(0x55),
                })),
            ),
            ("RTU", Msg::Rtu(Box::new(ids(0x66)))),
            (
                "DREQ",
                Msg::Dreq(Box::new(Dreq {
                    local_comm_id: 0x4142_4344,
                    remote_comm_id: 0x4546_4748,
                    remote_qpn: 0x00ab_0123,
                    private_data: pd(0x77),
                })),
            ),
            ("DREP", Msg::Drep(Box::new(ids(0x88)))),
            (
                "SIDR_REQ",
                Msg::SidrReq(Box::new(SidrReq {
                    request_id: 0x5152_5354,
                    pkey: 0x7fee,
                    service_id: 0x5556_5758_595a_5b5c,
                    private_data: pd(0x99),
                })),
            ),
            (
                "SIDR_REP",
                Msg::SidrRep(Box::new(SidrRep {
                    request_id: 0x6162_6364,
                    status: 0xc3,
                    qpn: 0x0065_6667,
                    service_id: 0x6869_6a6b_6c6d_6e6f,
                    qkey: 0x7071_7273,
                    private_data: pd(0xaa),
                })),
            ),
        ]
    }

    /// The golden bytes: one line a message, its name then the 256 bytes in hex, as the
    /// encoder wrote them before its fields were folded into tables (then the decoder's
    /// view of noise, below).
    const GOLDEN: &str = include_str!("mad_golden.txt");

    fn golden(name: &str) -> Vec<u8> {
        let line = GOLDEN
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no golden line {name}"));
        (0..line.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&line[i..i + 2], 16).unwrap())
            .collect()
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn every_message_encodes_to_its_golden_bytes_and_reads_back() {
        for (i, (name, msg)) in distinctive().into_iter().enumerate() {
            let mad = Mad {
                tid: 0xf0e1_d2c3_b4a5_9687 ^ i as u64,
                msg,
            };
            let b = encode(&mad);
            if std::env::var_os("CM_MAD_GOLDEN_PRINT").is_some() {
                println!("{name} {}", hex(&b));
                continue;
            }
            assert_eq!(hex(&b), hex(&golden(name)), "{name}");
            assert_eq!(parse(&b), Ok(mad), "{name}");
        }
    }

    /// What the decoder takes from noise: a header of each attribute over pseudo-random
    /// message bytes, parsed and encoded again (the bits no field covers come back zero).
    #[test]
    fn noise_decodes_to_its_golden_fields() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for (name, msg) in distinctive() {
            let mut b = encode(&Mad { tid: 5, msg });
            for v in &mut b[HDR_LEN..] {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *v = x as u8;
            }
            let m = parse(&b).expect(name);
            let again = encode(&m);
            let key = format!("noise-{name}");
            if std::env::var_os("CM_MAD_GOLDEN_PRINT").is_some() {
                println!("{key} {}", hex(&again));
                continue;
            }
            assert_eq!(hex(&again), hex(&golden(&key)), "{key}");
            assert_eq!(parse(&again), Ok(m), "{key}");
        }
    }

    #[test]
    fn other_bytes_are_refused_without_a_panic() {
        assert_eq!(parse(&[0; 10]), Err(MadError::Short(10)));
        let mut b = encode(&Mad {
            tid: 1,
            msg: Msg::Req(Box::new(req())),
        });
        b[1] = 0x03; // SA
        assert!(matches!(parse(&b), Err(MadError::NotCm { .. })));
        b[1] = CLASS_CM;
        b[3] = 0x81;
        assert_eq!(parse(&b), Err(MadError::Method(0x81)));
        b[3] = METHOD_SEND;
        b[17] = 0x19; // LAP
        assert_eq!(parse(&b), Err(MadError::Attr(0x19)));
        for n in 0..300 {
            let _ = parse(&vec![0xff; n]);
        }
    }
}
