//! The connection protocol of the emulated CM: the messages each side sends and takes (IBTA
//! 12.6, as Linux's `ib_cm` and the CMA above it use them on RoCE), their retransmission, and
//! the QP attributes each side's QP gets.
//!
//! Active side: CONNECT sends a REQ (the CMA header with both addresses, then the program's
//! private data); a REP makes a CONNECT_RESPONSE event, on which librdmacm moves its QP to
//! RTR and RTS and ACCEPTs, which sends the RTU. Passive side: a REQ for a listener's service
//! ID makes a new id and a CONNECT_REQUEST event; ACCEPT sends the REP; the RTU makes
//! ESTABLISHED. DISCONNECT sends a DREQ (or, after one came, the DREP); a DREQ or DREP makes
//! DISCONNECTED. REJECT sends a REJ, which makes REJECTED. A REQ, REP or DREQ without an
//! answer is sent again after the CM response timeout (2^20 × 4.096 µs ≈ 4 s), at most 15
//! times; then UNREACHABLE (or, for a DREQ, DISCONNECTED with -ETIMEDOUT). A REQ or REP taken
//! is acknowledged with an MRA while the program handles it (as the CMA does), and an MRA
//! taken pushes the deadline back. The starting PSN of both directions is the REQ's, as the
//! Linux CMA uses it.

use super::abi::{self, ConnParam, EventResp, QpAttr};
use super::addr::{self, Addr};
use super::mad::{self, Mad, Msg};
use super::{plain_event, Cm, Id, St, State};
use crate::abi::{access, qp_attr};
use crate::uaccess::Errno;
use std::sync::Arc;
use std::time::Duration;

/// `IBV_QPT_RC`.
pub(super) const QPT_RC: u8 = 2;
/// `IBV_QPT_UD`.
pub(super) const QPT_UD: u8 = 4;
/// The Q_Key of the CMA's UD ids (`RDMA_UDP_QKEY`).
pub(super) const UDP_QKEY: u32 = 0x0123_4567;
/// The CM response timeout the CMA asks for (`CMA_CM_RESPONSE_TIMEOUT`).
const RESPONSE_TIMEOUT: u8 = 20;
/// Retries of a message without an answer (`CMA_MAX_CM_RETRIES`).
const MAX_RETRIES: u8 = 15;
/// The path's packet lifetime (`CMA_IBOE_PACKET_LIFETIME`) and the local ACK timeout it gives.
pub(super) const PACKET_LIFETIME: u8 = 16;
const ACK_TIMEOUT: u8 = PACKET_LIFETIME + 2;
/// Path MTU code: 4096 (the soft NIC's port MTU).
pub(super) const MTU_4096: u8 = 5;
/// Hop limit of the route (an IPv4 route's).
pub(super) const HOP_LIMIT: u8 = 64;
/// The service timeout of the CMA's MRAs (`CMA_CM_MRA_SETTING`: 2^22 × 4.096 µs ≈ 17 s).
const MRA_SERVICE_TIMEOUT: u8 = RESPONSE_TIMEOUT + 2;
/// `IB_CM_REJ_INVALID_SERVICE_ID`.
const REJ_INVALID_SERVICE_ID: u16 = 8;
/// `IB_CM_REJ_TIMEOUT`.
const REJ_TIMEOUT: u16 = 1;
/// `IB_CM_REJ_CONSUMER_DEFINED`.
pub(super) const REJ_CONSUMER_DEFINED: u16 = 28;
/// `-ETIMEDOUT` as an event status.
const ETIMEDOUT: i32 = -libc::ETIMEDOUT;

/// Where a connection stands (the IB CM's states, those the emulation uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CmSt {
    ReqSent,
    RepRcvd,
    ReqRcvd,
    RepSent,
    Established,
    DreqSent,
    DreqRcvd,
    Timewait,
    Closed,
    SidrReqSent,
    SidrReqRcvd,
}

/// The connection of an id.
pub(super) struct Conn {
    cm: CmSt,
    /// The device (index) it runs on.
    dev: u32,
    local_comm_id: u32,
    remote_comm_id: u32,
    remote_gid: [u8; 16],
    remote_qpn: u32,
    sq_psn: u32,
    rq_psn: u32,
    /// READs / atomics this side takes (RTR's max_dest_rd_atomic) and sends (RTS's
    /// max_rd_atomic).
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    flow_label: u32,
    /// The connection's path MTU (IB enum): the requester's route's, which its REQ carries.
    path_mtu: u8,
    tid: u64,
    /// The message to send again when no answer comes, and when.
    last: Option<Box<[u8; mad::MAD_LEN]>>,
    deadline_ms: u64,
    retries: u8,
    /// DISCONNECTED was reported.
    disconnected: bool,
}

impl Conn {
    fn new(dev: u32, local_comm_id: u32, remote_gid: [u8; 16], cm: CmSt) -> Self {
        Self {
            cm,
            dev,
            local_comm_id,
            remote_comm_id: 0,
            remote_gid,
            remote_qpn: 0,
            sq_psn: 0,
            rq_psn: 0,
            responder_resources: 0,
            initiator_depth: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            flow_label: 0,
            path_mtu: MTU_4096,
            tid: 0,
            last: None,
            deadline_ms: 0,
            retries: 0,
            disconnected: false,
        }
    }

    /// Takes the peer's end of the connection from its REQ or REP: its comm ID, QPN and
    /// starting PSN, its RDMA resources turned round (what it sends, this side takes) and its
    /// RNR retry count.
    fn take_peer(
        &mut self,
        comm_id: u32,
        qpn: u32,
        psn: u32,
        (responder_resources, initiator_depth): (u8, u8),
        rnr_retry_count: u8,
    ) {
        self.remote_comm_id = comm_id;
        self.remote_qpn = qpn;
        self.rq_psn = psn;
        self.responder_resources = initiator_depth;
        self.initiator_depth = responder_resources;
        self.rnr_retry_count = rnr_retry_count;
    }
}

/// A pseudo-random 32-bit value (comm IDs, PSNs, transaction IDs): no two processes that
/// start together should pick the same ones.
fn random() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish() as u32
}

/// The CM response timeout in milliseconds (4.096 µs × 2^t).
fn timeout_ms(t: u8) -> u64 {
    1u64 << t.saturating_sub(8).min(31)
}

/// An event's private data: `private`, cut to what the event carries, and its length.
fn event_private(private: &[u8]) -> ([u8; 256], u8) {
    let mut b = [0u8; 256];
    let n = private.len().min(b.len());
    b[..n].copy_from_slice(&private[..n]);
    (b, n as u8)
}

/// Connection parameters that carry only `private` (a REJ's).
fn private_param(private: &[u8]) -> ConnParam {
    let mut p: ConnParam = bytemuck::Zeroable::zeroed();
    (p.private_data, p.private_data_len) = event_private(private);
    p
}

/// The connection parameters of a request or reply as the program sees them: the peer's QPN,
/// the resources and retry counts of this side's QP, and the peer's private data.
fn conn_param(c: &Conn, private: &[u8], flow_control: bool, srq: bool) -> ConnParam {
    let mut p = private_param(private);
    p.qp_num = c.remote_qpn;
    p.responder_resources = c.responder_resources;
    p.initiator_depth = c.initiator_depth;
    p.flow_control = flow_control.into();
    p.retry_count = c.retry_count;
    p.rnr_retry_count = c.rnr_retry_count;
    p.srq = srq.into();
    p
}

fn conn_event(event: u32, status: i32, p: &ConnParam) -> EventResp {
    let mut e = plain_event(event, status);
    e.set_conn(p);
    e
}

/// UD parameters that carry `private` (the rest 0).
fn ud_param(private: &[u8]) -> abi::UdParam {
    let mut u: abi::UdParam = bytemuck::Zeroable::zeroed();
    (u.private_data, u.private_data_len) = event_private(private);
    u
}

fn ud_event(event: u32, status: i32, u: &abi::UdParam) -> EventResp {
    let mut e = plain_event(event, status);
    e.set_ud(u);
    e
}

/// The IDs of an RTU or a DREP, without private data.
fn ids(local_comm_id: u32, remote_comm_id: u32) -> Box<mad::Ids224> {
    Box::new(mad::Ids224 {
        local_comm_id,
        remote_comm_id,
        private_data: [0; 224],
    })
}

/// A DREQ of connection `c`, without private data.
fn dreq(c: &Conn) -> Msg {
    Msg::Dreq(Box::new(mad::Dreq {
        local_comm_id: c.local_comm_id,
        remote_comm_id: c.remote_comm_id,
        remote_qpn: c.remote_qpn,
        private_data: [0; mad::private_len::DREQ],
    }))
}

/// A REJ of message `which` (0 REQ, 1 REP, 2 none).
fn rej(
    (local_comm_id, remote_comm_id): (u32, u32),
    which: u8,
    reason: u16,
    private_data: [u8; mad::private_len::REJ],
) -> Msg {
    Msg::Rej(Box::new(mad::Rej {
        local_comm_id,
        remote_comm_id,
        message_rejected: which,
        reason,
        private_data,
    }))
}

/// A SIDR_REP that refuses request `request_id` with `status` (no QP, no Q_Key).
fn sidr_refusal(
    request_id: u32,
    status: u8,
    service_id: u64,
    private_data: [u8; mad::private_len::SIDR_REP],
) -> Msg {
    Msg::SidrRep(Box::new(mad::SidrRep {
        request_id,
        status,
        qpn: 0,
        service_id,
        qkey: 0,
        private_data,
    }))
}

/// Copies `src` into a private-data field, refusing what does not fit (EINVAL).
fn private<const N: usize>(src: &[u8], len: u8, at: usize) -> Result<[u8; N], Errno> {
    let len = len as usize;
    if at + len > N || len > src.len() {
        return Err(Errno::EINVAL);
    }
    let mut p = [0u8; N];
    p[at..at + len].copy_from_slice(&src[..len]);
    Ok(p)
}

impl Cm {
    /// Installs the QP1 handler of device `dev` (starting its soft NIC).
    pub(super) fn ensure_agent(&'static self, st: &mut State, dev: u32) -> Result<(), Errno> {
        if st.agents.contains(&dev) {
            return Ok(());
        }
        let d = self.devices.get(dev).ok_or(Errno::ENODEV)?;
        let soft = d.soft()?;
        soft.set_gsi_handler(Some(Arc::new(move |g: &softnic::gsi::GsiDatagram<'_>| {
            if let Some(cm) = super::CM.get() {
                cm.on_mad(dev, g);
            }
        })));
        st.agents.push(dev);
        self.timer.get_or_init(|| {
            let _ = std::thread::Builder::new()
                .name("gpuverbs-emu-cm".into())
                .spawn(move || loop {
                    std::thread::sleep(Duration::from_millis(100));
                    self.tick();
                });
        });
        Ok(())
    }

    /// Sends `msg` from device `dev`'s QP1 to the GID's; returns the bytes (to send again).
    fn send(&self, dev: u32, to: &[u8; 16], tid: u64, msg: Msg) -> Box<[u8; mad::MAD_LEN]> {
        let bytes = Box::new(mad::encode(&Mad { tid, msg }));
        self.resend(dev, to, &bytes);
        bytes
    }

    /// Sends `msg` to the peer of connection `c` in its transaction.
    fn send_conn(&self, c: &Conn, msg: Msg) -> Box<[u8; mad::MAD_LEN]> {
        self.send(c.dev, &c.remote_gid, c.tid, msg)
    }

    fn resend(&self, dev: u32, to: &[u8; 16], bytes: &[u8; mad::MAD_LEN]) {
        if crate::tracing() {
            crate::complain(format_args!(
                "rdma_cm: {:#06x} to {} from device {dev}",
                u16::from_be_bytes([bytes[16], bytes[17]]),
                verbs::Gid(*to)
            ));
        }
        let sent = self
            .devices
            .get(dev)
            .and_then(|d| d.started())
            .map(|s| s.send_gsi(&verbs::Gid(*to), bytes));
        if let Some(Err(e)) = sent {
            crate::complain(format_args!("rdma_cm: a CM message could not be sent: {e}"));
        }
    }

    fn arm(&self, c: &mut Conn, bytes: Box<[u8; mad::MAD_LEN]>) {
        c.last = Some(bytes);
        c.retries = 0;
        c.deadline_ms = self.now_ms() + timeout_ms(RESPONSE_TIMEOUT);
    }

    /// CONNECT of an id whose route is resolved: a REQ (RC) or SIDR_REQ (UD).
    pub(super) fn connect(
        &'static self,
        st: &mut State,
        h: u32,
        p: &ConnParam,
    ) -> Result<(), Errno> {
        let id = st.ids.get_mut(&h).ok_or(Errno::ENOENT)?;
        let dev = id.dev.ok_or(Errno::EINVAL)?;
        if id.st != St::RouteResolved {
            return Err(Errno::EINVAL);
        }
        let local_comm_id = random();
        let tid = (random() as u64) << 32 | local_comm_id as u64;
        let hdr = addr::cma_hdr(&id.src, &id.dst);
        let sid = (id.ps as u64) << 16 | id.dst.port as u64;
        let mut c = Conn::new(dev, local_comm_id, id.dst.gid(), CmSt::ReqSent);
        c.tid = tid;
        c.path_mtu = self.path_mtu(dev);
        if id.is_ud() {
            let mut pd: [u8; mad::private_len::SIDR_REQ] =
                private(&p.private_data, p.private_data_len, addr::CMA_HDR_LEN)?;
            pd[..addr::CMA_HDR_LEN].copy_from_slice(&hdr);
            c.cm = CmSt::SidrReqSent;
            let msg = Msg::SidrReq(Box::new(mad::SidrReq {
                request_id: local_comm_id,
                pkey: 0xffff,
                service_id: sid,
                private_data: pd,
            }));
            let bytes = self.send(dev, &c.remote_gid, tid, msg);
            self.arm(&mut c, bytes);
            id.conn = Some(c);
            id.st = St::Connect;
            return Ok(());
        }
        let mut pd: [u8; mad::private_len::REQ] =
            private(&p.private_data, p.private_data_len, addr::CMA_HDR_LEN)?;
        pd[..addr::CMA_HDR_LEN].copy_from_slice(&hdr);
        c.sq_psn = random() & 0xff_ffff;
        c.responder_resources = p.responder_resources;
        c.initiator_depth = p.initiator_depth;
        c.retry_count = p.retry_count.min(7);
        c.rnr_retry_count = p.rnr_retry_count.min(7);
        c.flow_label = (id.src.port as u32 * 31 + id.dst.port as u32) & 0xf_ffff;
        let req = mad::Req {
            local_comm_id,
            service_id: sid,
            local_ca_guid: self.guid(dev),
            local_qkey: 0,
            local_qpn: p.qp_num & 0xff_ffff,
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            remote_cm_response_timeout: RESPONSE_TIMEOUT,
            transport: 0,
            flow_control: p.flow_control != 0,
            starting_psn: c.sq_psn,
            local_cm_response_timeout: RESPONSE_TIMEOUT,
            retry_count: c.retry_count,
            pkey: 0xffff,
            mtu: c.path_mtu,
            rnr_retry_count: c.rnr_retry_count,
            max_cm_retries: MAX_RETRIES,
            srq: p.srq != 0,
            path: mad::Path {
                local_lid: 0xffff,
                remote_lid: 0xffff,
                local_gid: id.src.gid(),
                remote_gid: c.remote_gid,
                flow_label: c.flow_label,
                packet_rate: 0,
                traffic_class: id.tos,
                hop_limit: HOP_LIMIT,
                sl: 0,
                subnet_local: false,
                local_ack_timeout: ACK_TIMEOUT,
            },
            private_data: pd,
        };
        let bytes = self.send(dev, &c.remote_gid, tid, Msg::Req(Box::new(req)));
        self.arm(&mut c, bytes);
        id.conn = Some(c);
        id.st = St::Connect;
        Ok(())
    }

    /// The node GUID of device `dev` as the wire carries it.
    fn guid(&self, dev: u32) -> u64 {
        self.devices.get(dev).map_or(0, |d| d.id.node_guid)
    }

    /// The path MTU of device `dev`'s routes: its port's active MTU, which follows its netdev's
    /// MTU (the kernel's `cma_resolve_iboe_route` takes `iboe_get_mtu` of the netdev's).
    pub(super) fn path_mtu(&self, dev: u32) -> u8 {
        self.devices
            .get(dev)
            .map_or(MTU_4096, |d| d.port().active_mtu)
    }

    /// ACCEPT: on the passive side (with parameters) the REP or SIDR_REP; on the active side
    /// (after CONNECT_RESPONSE, without) the RTU.
    pub(super) fn accept(
        &'static self,
        st: &mut State,
        h: u32,
        a: &abi::Accept,
    ) -> Result<(), Errno> {
        let id = st.ids.get_mut(&h).ok_or(Errno::ENOENT)?;
        let ud = id.is_ud();
        let c = id.conn.as_mut().ok_or(Errno::EINVAL)?;
        let p = &a.conn_param;
        match (c.cm, p.valid != 0) {
            (CmSt::RepRcvd, _) => {
                self.send_conn(c, Msg::Rtu(ids(c.local_comm_id, c.remote_comm_id)));
                c.cm = CmSt::Established;
                c.last = None;
                Ok(())
            }
            (CmSt::SidrReqRcvd, true) if ud => {
                let pd = private(&p.private_data, p.private_data_len, 0)?;
                let msg = Msg::SidrRep(Box::new(mad::SidrRep {
                    request_id: c.remote_comm_id,
                    status: 0,
                    qpn: p.qp_num & 0xff_ffff,
                    service_id: (id.ps as u64) << 16 | id.src.port as u64,
                    qkey: if p.qkey != 0 { p.qkey } else { UDP_QKEY },
                    private_data: pd,
                }));
                self.send_conn(c, msg);
                c.cm = CmSt::Closed;
                id.uid = a.uid;
                Ok(())
            }
            (CmSt::ReqRcvd, true) => {
                let pd = private(&p.private_data, p.private_data_len, 0)?;
                c.responder_resources = p.responder_resources;
                c.initiator_depth = p.initiator_depth;
                c.rnr_retry_count = p.rnr_retry_count.min(7);
                let rep = mad::Rep {
                    local_comm_id: c.local_comm_id,
                    remote_comm_id: c.remote_comm_id,
                    local_qkey: 0,
                    local_qpn: p.qp_num & 0xff_ffff,
                    starting_psn: c.sq_psn,
                    responder_resources: p.responder_resources,
                    initiator_depth: p.initiator_depth,
                    target_ack_delay: 16,
                    failover_accepted: 0,
                    flow_control: p.flow_control != 0,
                    rnr_retry_count: c.rnr_retry_count,
                    srq: p.srq != 0,
                    local_ca_guid: self.guid(c.dev),
                    private_data: pd,
                };
                let bytes = self.send_conn(c, Msg::Rep(Box::new(rep)));
                self.arm(c, bytes);
                c.cm = CmSt::RepSent;
                id.uid = a.uid;
                Ok(())
            }
            _ => Err(Errno::EINVAL),
        }
    }

    /// REJECT of a connection request (or a reply).
    pub(super) fn reject(
        &'static self,
        st: &mut State,
        h: u32,
        r: &abi::Reject,
    ) -> Result<(), Errno> {
        let reason = match r.reason {
            0 => REJ_CONSUMER_DEFINED,
            28 | 35 => r.reason as u16,
            _ => return Err(Errno::EINVAL),
        };
        let id = st.ids.get_mut(&h).ok_or(Errno::ENOENT)?;
        let ud = id.is_ud();
        let c = id.conn.as_mut().ok_or(Errno::EINVAL)?;
        match c.cm {
            CmSt::SidrReqRcvd if ud => {
                let pd = private(&r.private_data, r.private_data_len, 0)?;
                // IB_SIDR_REJECT
                self.send_conn(c, sidr_refusal(c.remote_comm_id, 2, 0, pd));
            }
            CmSt::ReqRcvd | CmSt::RepRcvd => {
                let pd = private(&r.private_data, r.private_data_len, 0)?;
                let which = if c.cm == CmSt::ReqRcvd { 0 } else { 1 };
                let ids = (c.local_comm_id, c.remote_comm_id);
                self.send_conn(c, rej(ids, which, reason, pd));
            }
            _ => return Err(Errno::EINVAL),
        }
        c.cm = CmSt::Closed;
        c.last = None;
        Ok(())
    }

    /// DISCONNECT: a DREQ on an established connection, the DREP after one came; otherwise
    /// nothing (as the kernel, which answers 0 then).
    pub(super) fn disconnect(&'static self, st: &mut State, h: u32) -> Result<(), Errno> {
        let id = st.ids.get_mut(&h).ok_or(Errno::ENOENT)?;
        let c = id.conn.as_mut().ok_or(Errno::EINVAL)?;
        match c.cm {
            CmSt::Established | CmSt::RepSent => {
                let tid = (random() as u64) << 32 | c.local_comm_id as u64;
                c.tid = tid;
                let bytes = self.send_conn(c, dreq(c));
                c.cm = CmSt::DreqSent;
                self.arm(c, bytes);
            }
            CmSt::DreqRcvd => {
                self.send_drep(c);
                c.cm = CmSt::Timewait;
            }
            _ => {}
        }
        Ok(())
    }

    /// An MRA of the message `which` (0 REQ, 1 REP) with the CMA's service timeout.
    fn send_mra(&self, c: &Conn, which: u8) {
        let msg = Msg::Mra(mad::Mra {
            local_comm_id: c.local_comm_id,
            remote_comm_id: c.remote_comm_id,
            message_mraed: which,
            service_timeout: MRA_SERVICE_TIMEOUT,
        });
        self.send_conn(c, msg);
    }

    fn send_drep(&self, c: &Conn) {
        self.send_conn(c, Msg::Drep(ids(c.local_comm_id, c.remote_comm_id)));
    }

    /// NOTIFY: IB_EVENT_COMM_EST (data arrived before the RTU) establishes a connection
    /// waiting for its RTU; other events change nothing.
    pub(super) fn notify(&'static self, st: &mut State, h: u32, event: u32) -> Result<(), Errno> {
        let id = st.ids.get_mut(&h).ok_or(Errno::ENOENT)?;
        if id.conn.is_none() {
            return Err(Errno::EINVAL);
        }
        // IB_EVENT_COMM_EST (the QP saw the peer's first packet before the RTU): the passive
        // side takes the connection as made, as the kernel's ib_cm_notify does
        const IB_EVENT_COMM_EST: u32 = 4;
        if event == IB_EVENT_COMM_EST && transition(id, CmSt::RepSent, CmSt::Established) {
            id.event(plain_event(abi::event::ESTABLISHED, 0), None);
        }
        Ok(())
    }

    /// What destroying an id does to its connection: a REJ for one not yet made, a DREQ for
    /// an established one, the DREP for one whose peer asked.
    pub(super) fn conn_gone(&self, id: &Id) {
        let Some(c) = &id.conn else { return };
        let reject = |reason: u16, which: u8| {
            let ids = (c.local_comm_id, c.remote_comm_id);
            self.send_conn(c, rej(ids, which, reason, [0; mad::private_len::REJ]));
        };
        match c.cm {
            CmSt::ReqSent => reject(REJ_TIMEOUT, 0),
            CmSt::ReqRcvd => reject(REJ_CONSUMER_DEFINED, 0),
            CmSt::RepRcvd => reject(REJ_CONSUMER_DEFINED, 1),
            CmSt::RepSent => reject(REJ_CONSUMER_DEFINED, 2),
            CmSt::Established => {
                self.send_conn(c, dreq(c));
            }
            CmSt::DreqRcvd => self.send_drep(c),
            _ => {}
        }
    }

    /// INIT_QP_ATTR: the attributes the id's QP takes to `state` (INIT, RTR, RTS), as the
    /// kernel's CM gives them (`cm_init_qp_*_attr`, the CMA's before a connection exists).
    pub(super) fn init_qp_attr(&self, id: &Id, state: u32) -> Result<QpAttr, Errno> {
        let mut a: QpAttr = bytemuck::Zeroable::zeroed();
        a.qp_state = state;
        if id.dev.is_none() {
            return Err(Errno::EINVAL);
        }
        let c = match &id.conn {
            Some(c) if !id.is_ud() => c,
            _ => {
                // before a connection (or UD): the CMA's own INIT attributes
                a.qp_attr_mask = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT;
                a.port_num = 1;
                if id.is_ud() {
                    a.qkey = UDP_QKEY;
                    a.qp_attr_mask |= qp_attr::QKEY;
                } else {
                    a.qp_attr_mask |= qp_attr::ACCESS_FLAGS;
                }
                return Ok(a);
            }
        };
        match state {
            1 => {
                a.qp_attr_mask =
                    qp_attr::STATE | qp_attr::ACCESS_FLAGS | qp_attr::PKEY_INDEX | qp_attr::PORT;
                // REMOTE_WRITE, and READ + ATOMIC when this side takes them
                a.qp_access_flags = access::REMOTE_WRITE
                    | if c.responder_resources > 0 {
                        access::REMOTE_READ | access::REMOTE_ATOMIC
                    } else {
                        0
                    };
                a.port_num = 1;
            }
            2 => {
                a.qp_attr_mask = qp_attr::STATE
                    | qp_attr::AV
                    | qp_attr::PATH_MTU
                    | qp_attr::DEST_QPN
                    | qp_attr::RQ_PSN
                    | qp_attr::MAX_DEST_RD_ATOMIC
                    | qp_attr::MIN_RNR_TIMER;
                a.ah_attr.dgid = c.remote_gid;
                a.ah_attr.flow_label = c.flow_label;
                a.ah_attr.hop_limit = HOP_LIMIT;
                a.ah_attr.traffic_class = id.tos;
                a.ah_attr.is_global = 1;
                a.ah_attr.port_num = 1;
                a.path_mtu = c.path_mtu as u32;
                a.dest_qp_num = c.remote_qpn;
                a.rq_psn = c.rq_psn;
                a.max_dest_rd_atomic = c.responder_resources;
                a.port_num = 1;
            }
            3 => {
                a.qp_attr_mask = qp_attr::STATE
                    | qp_attr::SQ_PSN
                    | qp_attr::TIMEOUT
                    | qp_attr::RETRY_CNT
                    | qp_attr::RNR_RETRY
                    | qp_attr::MAX_QP_RD_ATOMIC;
                a.sq_psn = c.sq_psn;
                a.timeout = id.ack_timeout.unwrap_or(ACK_TIMEOUT);
                a.retry_cnt = c.retry_count;
                a.rnr_retry = c.rnr_retry_count;
                a.max_rd_atomic = c.initiator_depth;
            }
            _ => return Err(Errno::EINVAL),
        }
        Ok(a)
    }
}

// ------------------------------------------------------------------ messages that arrive

impl Cm {
    /// A datagram for QP1 of device `dev`: one CM message, handled as the kernel's CM does.
    pub(super) fn on_mad(&'static self, dev: u32, g: &softnic::gsi::GsiDatagram<'_>) {
        let Ok(m) = mad::parse(g.mad) else {
            return;
        };
        if crate::tracing() {
            crate::complain(format_args!(
                "rdma_cm: {:#06x} from {} on device {dev}",
                m.msg.attr_id(),
                g.from
            ));
        }
        let from = verbs::Gid::from_ipv4(g.from).0;
        let mut st = self.st.lock();
        match m.msg {
            Msg::Req(r) => self.on_req(&mut st, dev, m.tid, &r),
            Msg::SidrReq(r) => self.on_sidr_req(&mut st, dev, m.tid, &r, from),
            Msg::SidrRep(r) => on_sidr_rep(&mut st, &r),
            Msg::Rep(r) => self.on_rep(&mut st, &r),
            Msg::Rtu(r) => {
                if let Some(id) = by_comm_id(&mut st, r.remote_comm_id) {
                    if transition(id, CmSt::RepSent, CmSt::Established) {
                        id.event(plain_event(abi::event::ESTABLISHED, 0), None);
                    }
                }
            }
            Msg::Rej(r) => on_rej(&mut st, &r),
            Msg::Mra(r) => {
                let now = self.now_ms();
                if let Some(c) = by_comm_id(&mut st, r.remote_comm_id).and_then(|i| i.conn.as_mut())
                {
                    // the peer's service timeout, plus a packet's round trip (the kernel's
                    // cm_mra_handler)
                    if c.last.is_some() {
                        c.deadline_ms =
                            now + timeout_ms(r.service_timeout) + timeout_ms(ACK_TIMEOUT);
                    }
                }
            }
            Msg::Dreq(r) => self.on_dreq(&mut st, dev, m.tid, &r, from),
            Msg::Drep(r) => {
                if let Some(id) = by_comm_id(&mut st, r.remote_comm_id) {
                    if transition(id, CmSt::DreqSent, CmSt::Timewait) {
                        disconnected(id, 0);
                    }
                }
            }
        }
    }

    fn on_req(&'static self, st: &mut State, dev: u32, tid: u64, r: &mad::Req) {
        // a REQ sent again: the REP again if it went, else the MRA again (the program has
        // the request)
        if let Some(c) = st
            .ids
            .values_mut()
            .filter_map(|i| i.conn.as_mut())
            .find(|c| c.remote_comm_id == r.local_comm_id && c.remote_gid == r.path.local_gid)
        {
            match (c.cm, c.last.as_ref()) {
                (CmSt::RepSent, Some(b)) => self.resend(c.dev, &c.remote_gid, b),
                (CmSt::ReqRcvd, _) => self.send_mra(c, 0),
                _ => {}
            }
            return;
        }
        let ps = (r.service_id >> 16) as u16;
        let port = r.service_id as u16;
        let addrs = addr::parse_cma_hdr(&r.private_data, port);
        let listener = (r.service_id >> 32 == 0 && r.transport == 0)
            .then(|| find_listener(st, dev, ps, port, addrs.map(|a| a.1), QPT_RC))
            .flatten();
        let reject = |reason| {
            let msg = rej((0, r.local_comm_id), 0, reason, [0; mad::private_len::REJ]);
            self.send(dev, &r.path.local_gid, tid, msg);
        };
        let Some(lh) = listener else {
            reject(REJ_INVALID_SERVICE_ID);
            return;
        };
        let Some(mut id) = child_of(st, lh, dev, QPT_RC) else {
            reject(REJ_CONSUMER_DEFINED);
            return;
        };
        id.tos = r.path.traffic_class;
        let (src, dst) = addrs.unwrap_or_default();
        let me = self.devices.get(dev).map(|d| d.id.ip);
        id.src = Addr::v4(
            if dst.ip.is_unspecified() {
                me.unwrap_or(dst.ip)
            } else {
                dst.ip
            },
            port,
        );
        id.dst = src;
        let mut c = Conn::new(dev, random(), r.path.local_gid, CmSt::ReqRcvd);
        let resources = (r.responder_resources, r.initiator_depth);
        c.take_peer(
            r.local_comm_id,
            r.local_qpn,
            r.starting_psn,
            resources,
            r.rnr_retry_count,
        );
        c.sq_psn = r.starting_psn;
        c.retry_count = r.retry_count;
        c.flow_label = r.path.flow_label;
        // the passive side takes the REQ's path, as the kernel's CM does (an MTU outside the
        // IB enum: this device's route's)
        c.path_mtu = if (1..=MTU_4096).contains(&r.mtu) {
            r.mtu
        } else {
            self.path_mtu(dev)
        };
        c.tid = tid;
        let pd = &r.private_data[addr::CMA_HDR_LEN..];
        let p = conn_param(&c, pd, r.flow_control, r.srq);
        // the program takes its time to accept: an MRA keeps the requester from sending the
        // REQ again meanwhile (the CMA's, after its handler)
        self.send_mra(&c, 0);
        id.conn = Some(c);
        offer(st, lh, id, conn_event(abi::event::CONNECT_REQUEST, 0, &p));
    }

    fn on_sidr_req(
        &'static self,
        st: &mut State,
        dev: u32,
        tid: u64,
        r: &mad::SidrReq,
        from: [u8; 16],
    ) {
        let ps = (r.service_id >> 16) as u16;
        let port = r.service_id as u16;
        let addrs = addr::parse_cma_hdr(&r.private_data, port);
        let Some(lh) = find_listener(st, dev, ps, port, addrs.map(|a| a.1), QPT_UD) else {
            let pd = [0; mad::private_len::SIDR_REP];
            // IB_SIDR_UNSUPPORTED
            self.send(
                dev,
                &from,
                tid,
                sidr_refusal(r.request_id, 1, r.service_id, pd),
            );
            return;
        };
        let Some(mut id) = child_of(st, lh, dev, QPT_UD) else {
            return;
        };
        let (src, dst) = addrs.unwrap_or_default();
        id.src = Addr::v4(dst.ip, port);
        id.dst = src;
        let mut c = Conn::new(dev, random(), from, CmSt::SidrReqRcvd);
        c.remote_comm_id = r.request_id;
        c.tid = tid;
        id.conn = Some(c);
        let mut u = ud_param(&r.private_data[addr::CMA_HDR_LEN..]);
        u.ah_attr = ah_attr(from, 0);
        offer(st, lh, id, ud_event(abi::event::CONNECT_REQUEST, 0, &u));
    }

    fn on_rep(&'static self, st: &mut State, r: &mad::Rep) {
        let Some(id) = by_comm_id(st, r.remote_comm_id) else {
            return;
        };
        let Some(c) = id.conn.as_mut() else { return };
        match c.cm {
            CmSt::ReqSent => {
                let resources = (r.responder_resources, r.initiator_depth);
                c.take_peer(
                    r.local_comm_id,
                    r.local_qpn,
                    r.starting_psn,
                    resources,
                    r.rnr_retry_count,
                );
                c.cm = CmSt::RepRcvd;
                c.last = None;
                self.send_mra(c, 1);
                let p = conn_param(c, &r.private_data, r.flow_control, r.srq);
                id.event(conn_event(abi::event::CONNECT_RESPONSE, 0, &p), None);
            }
            // a REP sent again while the program moves its QP: the MRA again
            CmSt::RepRcvd if c.remote_comm_id == r.local_comm_id => self.send_mra(c, 1),
            // a REP sent again: its RTU went missing
            CmSt::Established if c.remote_comm_id == r.local_comm_id => {
                self.send_conn(c, Msg::Rtu(ids(c.local_comm_id, c.remote_comm_id)));
            }
            _ => {}
        }
    }

    fn on_dreq(&'static self, st: &mut State, dev: u32, tid: u64, r: &mad::Dreq, from: [u8; 16]) {
        let Some(c) = by_comm_id(st, r.remote_comm_id).and_then(|i| i.conn.as_mut()) else {
            // a connection this side no longer has: the DREP all the same (the kernel's
            // cm_issue_drep), so the peer's DREQ ends
            let msg = Msg::Drep(ids(r.remote_comm_id, r.local_comm_id));
            self.send(dev, &from, tid, msg);
            return;
        };
        c.tid = tid;
        match c.cm {
            CmSt::Established | CmSt::RepSent => {
                c.cm = CmSt::DreqRcvd;
                c.last = None;
            }
            CmSt::DreqSent => {
                // both sides asked at once
                self.send_drep(c);
                c.cm = CmSt::Timewait;
                c.last = None;
            }
            CmSt::Timewait => {
                self.send_drep(c);
                return;
            }
            _ => return,
        }
        if let Some(id) = by_comm_id(st, r.remote_comm_id) {
            disconnected(id, 0);
        }
    }

    /// Sends again what got no answer, and gives up after [`MAX_RETRIES`].
    fn tick(&'static self) {
        let now = self.now_ms();
        let mut st = self.st.lock();
        for id in st.ids.values_mut() {
            let Some(c) = id.conn.as_mut() else { continue };
            let Some(bytes) = c.last.as_ref() else {
                continue;
            };
            if now < c.deadline_ms {
                continue;
            }
            if c.retries < MAX_RETRIES {
                c.retries += 1;
                c.deadline_ms = now + timeout_ms(RESPONSE_TIMEOUT);
                self.resend(c.dev, &c.remote_gid, bytes);
                continue;
            }
            c.last = None;
            match c.cm {
                CmSt::DreqSent => {
                    c.cm = CmSt::Timewait;
                    disconnected(id, ETIMEDOUT);
                }
                _ => {
                    c.cm = CmSt::Closed;
                    id.event(plain_event(abi::event::UNREACHABLE, ETIMEDOUT), None);
                }
            }
        }
    }
}

/// Moves the connection of `id` from state `from` to `to`, the answer it waited for come (it
/// sends nothing again); false when it is not in `from`.
fn transition(id: &mut Id, from: CmSt, to: CmSt) -> bool {
    let Some(c) = id.conn.as_mut().filter(|c| c.cm == from) else {
        return false;
    };
    c.cm = to;
    c.last = None;
    true
}

/// Reports DISCONNECTED once.
fn disconnected(id: &mut Id, status: i32) {
    let Some(c) = id.conn.as_mut() else { return };
    if c.disconnected {
        return;
    }
    c.disconnected = true;
    id.st = St::Disconnect;
    id.event(plain_event(abi::event::DISCONNECTED, status), None);
}

/// The id whose connection has local comm ID `comm`.
fn by_comm_id(st: &mut State, comm: u32) -> Option<&mut Id> {
    st.ids
        .values_mut()
        .find(|i| i.conn.as_ref().is_some_and(|c| c.local_comm_id == comm))
}

/// A listener for service `ps`:`port` on device `dev` at address `to`.
fn find_listener(
    st: &State,
    dev: u32,
    ps: u16,
    port: u16,
    to: Option<Addr>,
    qp_type: u8,
) -> Option<u32> {
    st.ids
        .values()
        .find(|l| {
            l.st == St::Listen
                && l.ps == ps
                && l.src.port == port
                && (l.qp_type == qp_type || l.ps == abi::ps::IB)
                && l.dev.is_none_or(|d| d == dev)
                // bound to no device: any address (or a loopback one, which the CMA takes for any)
                && (l.dev.is_none() || to.is_none_or(|t| t.ip == l.src.ip))
        })
        .map(|l| l.handle)
}

/// A new id for a request to listener `lh` on device `dev`, hidden until its CONNECT_REQUEST
/// is read; None when the listener's backlog is full.
fn child_of(st: &mut State, lh: u32, dev: u32, qp_type: u8) -> Option<Id> {
    let child = st.next_id;
    let l = st.ids.get_mut(&lh)?;
    if l.pending >= l.backlog {
        return None;
    }
    l.pending += 1;
    st.next_id = st.next_id.wrapping_add(1);
    let mut id = Id::new(child, l.file.clone(), 0, l.ps, qp_type);
    id.st = St::Connect;
    id.dev = Some(dev);
    id.listener = Some(lh);
    id.visible = false;
    Some(id)
}

/// Queues the CONNECT_REQUEST `e` of the new id `id` on its listener `lh`.
fn offer(st: &mut State, lh: u32, id: Id, mut e: EventResp) {
    let child = id.handle;
    e.id = child;
    st.ids.insert(child, id);
    if let Some(l) = st.ids.get(&lh) {
        l.event(e, Some(child));
    }
}

fn on_rej(st: &mut State, r: &mad::Rej) {
    let Some(id) = by_comm_id(st, r.remote_comm_id) else {
        return;
    };
    let Some(c) = id.conn.as_mut() else { return };
    if matches!(
        c.cm,
        CmSt::ReqSent | CmSt::RepRcvd | CmSt::RepSent | CmSt::ReqRcvd
    ) {
        c.cm = CmSt::Closed;
        c.last = None;
        let p = private_param(&r.private_data);
        id.event(conn_event(abi::event::REJECTED, r.reason as i32, &p), None);
    }
}

fn on_sidr_rep(st: &mut State, r: &mad::SidrRep) {
    let Some(id) = by_comm_id(st, r.request_id) else {
        return;
    };
    let Some(c) = id.conn.as_mut() else { return };
    if c.cm != CmSt::SidrReqSent {
        return;
    }
    c.cm = CmSt::Closed;
    c.last = None;
    let mut u = ud_param(&r.private_data);
    if r.status != 0 {
        id.event(ud_event(abi::event::UNREACHABLE, r.status as i32, &u), None);
        return;
    }
    u.qp_num = r.qpn;
    u.qkey = r.qkey;
    u.ah_attr = ah_attr(c.remote_gid, id.tos);
    id.event(ud_event(abi::event::ESTABLISHED, 0, &u), None);
}

/// The address vector to a peer's GID over port 1.
pub(super) fn ah_attr(gid: [u8; 16], tos: u8) -> crate::abi::AhAttr {
    crate::abi::AhAttr {
        dgid: gid,
        hop_limit: HOP_LIMIT,
        traffic_class: tos,
        is_global: 1,
        port_num: 1,
        ..Default::default()
    }
}
