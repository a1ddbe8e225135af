//! UD queue pairs: datagrams, as a ConnectX sends and takes them.
//!
//! A UD send WQE (control segment, the 48-byte datagram segment, then data segments or inline
//! data; SEND or SEND_IMM) becomes one datagram: a message is never longer than the port MTU
//! ([`UD_MTU`], less on a route with a smaller link MTU), else the WQE fails with LOCAL_LENGTH.
//! The address vector's GID names the destination device: a soft device of this process
//! (found by GID: a function call, [`deliver`]) or, when the device has a wire port, the
//! peer-table entry of that GID or the GID's IPv4 address at the port's default UDP port (a
//! RoCEv2 packet: BTH, DETH, ImmDt, payload, ICRC). The send completes when the datagram has
//! left: no ACK, no retry; a datagram nobody takes is lost silently.
//!
//! At the receiving QP a datagram from any source is taken when the QP is in RTR or RTS, its
//! Q_Key matches and a receive WQE is posted; otherwise it is dropped and counted (UD has no
//! RNR). The receive buffer gets the 40-byte GRH first (for RoCEv2 over IPv4: 20 zero bytes,
//! then the IPv4 header), then the payload; the CQE's byte count includes the GRH. A buffer
//! too short completes the receive with LOCAL_LENGTH.

use crate::counters::Counters;
use crate::group::{self, MCAST_QPN};
use crate::mem::{copy_ranges, read_range, total, CopyError, MemRange};
use crate::net::packet::{self, opcode, Bth, Deth, Flow, Packet, DEFAULT_PKEY, MASK24};
use crate::net::socket::{Port, TxBatch};
use crate::outcome::{local_devmem_err, vendor, Done, Fail};
use crate::qp::{Qp, QpState, SqState};
use crate::responder::Resp;
use crate::shared::{lookup, Shared};
use crate::Gid;
use prm::cqe::{Cqe64, RespKind};
use prm::parse::{parse_ud_wqe, ParsedOp};
use prm::Syndrome;
use smallvec::SmallVec;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

/// The port MTU of a soft device: the largest UD message.
pub const UD_MTU: u32 = 4096;
/// Bytes of the GRH a UD receive buffer gets before the payload.
pub const GRH_LEN: usize = 40;
/// The high bit of a send WQE's Q_Key: send the QP's own Q_Key instead (IBTA).
const QKEY_FROM_QP: u32 = 0x8000_0000;

/// One datagram arriving at a UD QP.
pub(crate) struct Datagram<'a> {
    /// The GRH as the receive buffer gets it.
    pub grh: [u8; GRH_LEN],
    /// Whether it came over IPv4 (the CQE's L3 header type).
    pub ipv4: bool,
    /// Source QPN (DETH).
    pub src_qpn: u32,
    /// Q_Key (DETH).
    pub qkey: u32,
    /// Immediate (SEND_IMM).
    pub imm: Option<u32>,
    /// Payload.
    pub payload: &'a [u8],
}

/// The 40-byte GRH of a RoCEv2 datagram over IPv4: 20 zero bytes, then the IPv4 header (with
/// a valid checksum, which libibverbs' `ibv_init_ah_from_wc` checks to tell IPv4 from IPv6).
fn grh_ipv4(flow: &Flow, udp_payload_len: usize) -> [u8; GRH_LEN] {
    let (ip, _) = packet::ipv4_udp_headers(flow, udp_payload_len);
    let mut g = [0u8; GRH_LEN];
    g[20..].copy_from_slice(&ip);
    g
}

/// The 40-byte GRH (an IPv6 header) of a datagram between GIDs that are not IPv4-mapped.
fn grh_ipv6(src: Gid, dst: Gid, tclass: u8, flow_label: u32, hop: u8, udp_len: usize) -> [u8; 40] {
    let mut g = [0u8; GRH_LEN];
    let w = 6u32 << 28 | (tclass as u32) << 20 | (flow_label & 0xf_ffff);
    g[..4].copy_from_slice(&w.to_be_bytes());
    g[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    g[6] = 17; // UDP
    g[7] = hop;
    g[8..24].copy_from_slice(&src.0);
    g[24..].copy_from_slice(&dst.0);
    g
}

/// Bytes of a UD packet's UDP payload (BTH through ICRC) for `len` payload bytes.
fn udp_payload_len(len: usize, imm: bool) -> usize {
    packet::BTH_LEN
        + packet::DETH_LEN
        + if imm { packet::IMM_LEN } else { 0 }
        + len.div_ceil(4) * 4
        + packet::ICRC_LEN
}

/// The GRH a datagram from QP `src_qpn` of `dev` to GID `dst` gets in process (`av`: the
/// address vector's traffic class, flow label and hop limit), and whether it is IPv4's: both
/// GIDs IPv4-mapped, the IPv4 header of the packet the wire would carry; else an IPv6 header.
pub(crate) fn grh_between(
    dev: &Shared,
    src_qpn: u32,
    dst: Gid,
    (tclass, flow_label, hop_limit): (u8, u32, u8),
    payload: &[u8],
    imm: Option<u32>,
) -> ([u8; GRH_LEN], bool) {
    match (dev.gid.to_ipv4(), dst.to_ipv4()) {
        (Some(src), Some(dst)) => {
            let flow = Flow {
                src,
                dst,
                sport: 0xc000 | (src_qpn & 0x3fff) as u16,
                dport: packet::ROCE_PORT,
            };
            let n = udp_payload_len(payload.len(), imm.is_some());
            (grh_ipv4(&flow, n), true)
        }
        _ => {
            let n = 8 + udp_payload_len(payload.len(), imm.is_some());
            let hop = if hop_limit == 0 { 64 } else { hop_limit };
            (grh_ipv6(dev.gid, dst, tclass, flow_label, hop, n), false)
        }
    }
}

/// Where a datagram goes.
enum Dest {
    /// A soft device of this process.
    Local(std::sync::Arc<Shared>),
    /// Over the wire.
    Wire(&'static str, SocketAddrV4),
    /// A multicast group ([`crate::mcast`]).
    Group,
    /// Nowhere this device can reach: the datagram is lost.
    Nowhere,
}

fn dest(dev: &Shared, gid: &Gid) -> Dest {
    if dev.port().is_some() {
        if let Some(SocketAddr::V4(to)) = dev.peer_addr(gid) {
            return Dest::Wire("peer table", to);
        }
    }
    if let Some(d) = lookup(gid) {
        return Dest::Local(d);
    }
    match (dev.port(), gid.to_ipv4()) {
        (Some(port), Some(ip)) => {
            Dest::Wire("default port", SocketAddrV4::new(ip, port.cfg.default_port))
        }
        _ => Dest::Nowhere,
    }
}

/// Runs a WQE of a UD send queue (its blocks gathered in `bytes`): parses it, checks the
/// local side, sends the datagram. Returns how it ended and whether it was signaled.
pub(crate) fn execute(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    bytes: &[u8],
) -> Result<(Done, bool), Fail> {
    let (wqe, av) = parse_ud_wqe(bytes).map_err(|e| (e.syndrome(), vendor::MALFORMED_WQE))?;
    let signaled = wqe.flags.signaled;
    let (Some(av), ParsedOp::Send { local }) = (av, wqe.op) else {
        // a NOP
        return Ok((Done::Complete(0), signaled));
    };
    let gid = Gid(av.rgid);
    let to = if group::is_multicast(&gid) {
        Dest::Group
    } else {
        dest(dev, &gid)
    };
    let mtu = match (&to, dev.port()) {
        (Dest::Wire(_, a), Some(port)) => port.path_mtu(*a.ip()).map_or(UD_MTU, |m| m.min(UD_MTU)),
        // the route to a group from the port's address is the port's interface (the kernel
        // routes a multicast destination by the source address's device)
        (Dest::Group, Some(port)) => group::group_ipv4(&gid)
            .and_then(|g| port.path_mtu(g))
            .map_or(UD_MTU, |m| m.min(UD_MTU)),
        _ => UD_MTU,
    };
    // Local checks first (keys, PD, ranges), then the length, then the gather.
    let g = qp.mrs.read();
    let ranges = crate::gather::gather(&g, qp, &local)?;
    let len = local.len();
    if len > mtu as u64 {
        return Err((Syndrome::LocalLength, vendor::TOO_LONG));
    }
    let mut payload = vec![0u8; len as usize];
    let mut at = 0usize;
    for r in &ranges {
        let n = r.len as usize;
        // SAFETY: `r` was checked under `g`, still held, or is inline bytes of the WQE copy
        // `bytes`, borrowed for this call; the ranges add up to `len`.
        unsafe { read_range(r, 0, &mut payload[at..at + n]) }
            .map_err(|e| local_devmem_err(&dev.counters, &e))?;
        at += n;
    }
    drop(g);
    let qkey = if av.qkey & QKEY_FROM_QP != 0 {
        qp.qkey()
    } else {
        av.qkey
    };
    let imm = wqe.imm();
    Counters::add(&dev.counters.ud_sent, 1);
    Counters::add(&dev.counters.bytes, len);
    match to {
        Dest::Local(peer) => {
            let Some(pqp) = peer.qp(av.dest_qpn) else {
                Counters::add(&peer.counters.ud_unready_drops, 1);
                return Ok((Done::Complete(len as u32), signaled));
            };
            let hop = (av.tclass, av.flow_label, av.hop_limit);
            let (grh, ipv4) = grh_between(dev, qp.qpn, peer.gid, hop, &payload, imm);
            deliver(
                &pqp,
                &Datagram {
                    grh,
                    ipv4,
                    src_qpn: qp.qpn,
                    qkey,
                    imm,
                    payload: &payload,
                },
            );
        }
        Dest::Wire(why, to) => {
            if let Some(port) = dev.port() {
                tracing::trace!(qpn = qp.qpn, %to, why, "UD datagram on the wire");
                let w = WireSend {
                    dest_qpn: av.dest_qpn,
                    qkey,
                    imm,
                    solicited: wqe.flags.solicited,
                };
                send_wire(port, qp, sq, to, &w, &payload);
            }
        }
        Dest::Group => {
            let s = GroupSend {
                mgid: gid,
                qkey,
                imm,
                solicited: wqe.flags.solicited,
                tclass: av.tclass,
                flow_label: av.flow_label,
                hop_limit: av.hop_limit,
                payload: &payload,
            };
            send_group(dev, qp, sq, &s);
        }
        Dest::Nowhere => {
            tracing::debug!(qpn = qp.qpn, gid = ?gid, "UD datagram to an unreachable GID: lost");
        }
    }
    Ok((Done::Complete(len as u32), signaled))
}

/// A datagram's BTH and DETH fields that the send WQE gives.
#[derive(Clone, Copy)]
pub(crate) struct WireSend {
    pub dest_qpn: u32,
    pub qkey: u32,
    pub imm: Option<u32>,
    pub solicited: bool,
}

/// Sends one UD datagram on the wire.
pub(crate) fn send_wire(
    port: &Port,
    qp: &Qp,
    sq: &mut SqState,
    to: SocketAddrV4,
    w: &WireSend,
    payload: &[u8],
) {
    let WireSend {
        dest_qpn,
        qkey,
        imm,
        solicited,
    } = *w;
    let flow = Flow {
        src: port.ip,
        dst: *to.ip(),
        sport: port.source_port(dest_qpn ^ u32::from(*to.ip())),
        dport: to.port(),
    };
    let p = Packet {
        bth: Bth {
            opcode: if imm.is_some() {
                opcode::UD_SEND_ONLY_IMM
            } else {
                opcode::UD_SEND_ONLY
            },
            solicited,
            mig_req: true,
            pkey: DEFAULT_PKEY,
            dest_qp: dest_qpn & MASK24,
            psn: sq.ud_psn,
            ..Bth::default()
        },
        deth: Some(Deth {
            qkey,
            src_qp: qp.qpn,
        }),
        imm,
        payload,
        ..Packet::default()
    };
    sq.ud_psn = (sq.ud_psn + 1) & MASK24;
    let mut buf = Vec::with_capacity(udp_payload_len(payload.len(), imm.is_some()));
    if packet::encode(&p, &flow, &mut buf).is_ok() {
        let mut batch = TxBatch::default();
        port.send(&buf, SocketAddr::V4(to), &flow, &mut batch);
        port.flush(&mut batch);
    }
}

/// What a UD send to a multicast GID carries.
struct GroupSend<'a> {
    mgid: Gid,
    qkey: u32,
    imm: Option<u32>,
    solicited: bool,
    tclass: u8,
    flow_label: u32,
    hop_limit: u8,
    payload: &'a [u8],
}

/// Sends a datagram of UD QP `qp` of `dev` to its group ([`crate::mcast`]): on the wire once
/// (a device with a wire port, an IPv4 group), and by a function call to the attached QPs of
/// this process's devices that the wire does not reach (those without a wire port, or all of
/// them when the datagram does not go on the wire). The sending QP gets its own datagram
/// unless it blocks self-loopback.
fn send_group(dev: &Shared, qp: &Qp, sq: &mut SqState, s: &GroupSend<'_>) {
    let wire = match (dev.port(), group::group_ipv4(&s.mgid)) {
        (Some(port), Some(g)) => {
            group::enable_tx(port);
            let to = SocketAddrV4::new(g, packet::ROCE_PORT);
            tracing::trace!(qpn = qp.qpn, %to, "UD multicast datagram on the wire");
            let w = WireSend {
                dest_qpn: MCAST_QPN,
                qkey: s.qkey,
                imm: s.imm,
                solicited: s.solicited,
            };
            send_wire(port, qp, sq, to, &w, s.payload);
            true
        }
        _ => false,
    };
    let qps = group::members(&s.mgid, |m| !(m.block_self && m.qpn == qp.qpn && m.of(dev)));
    let qps: Vec<_> = qps
        .into_iter()
        .filter(|(d, _)| !(wire && d.port().is_some()))
        .collect();
    if qps.is_empty() && !wire {
        tracing::debug!(qpn = qp.qpn, mgid = %s.mgid, "multicast datagram to a group nobody joined");
        Counters::add(&dev.counters.ud_unready_drops, 1);
        return;
    }
    let hop = (s.tclass, s.flow_label, s.hop_limit);
    let (grh, ipv4) = grh_between(dev, qp.qpn, s.mgid, hop, s.payload, s.imm);
    for (_, q) in qps {
        let d = Datagram {
            grh,
            ipv4,
            src_qpn: qp.qpn,
            qkey: s.qkey,
            imm: s.imm,
            payload: s.payload,
        };
        deliver(&q, &d);
    }
}

/// Takes one datagram that arrived at device `dev`'s socket for IPv4 `group` from `from`:
/// checked as the wire checks UD packets (size, ICRC, format, P_Key, a UD opcode with a
/// DETH, destination QP 0xFFFFFF), then given to every QP of `dev` attached to the group
/// (but the sender itself when it came from this port and the sender blocks self-loopback).
/// Never panics; every drop is counted.
pub(crate) fn on_group_packet(dev: &Shared, group: Ipv4Addr, from: SocketAddr, d: &[u8]) {
    let wc = &dev.counters.wire;
    Counters::add(&wc.rx_packets, 1);
    Counters::add(&wc.rx_bytes, d.len() as u64);
    let SocketAddr::V4(from4) = from else {
        Counters::add(&wc.rx_malformed, 1);
        return;
    };
    let flow = Flow {
        src: *from4.ip(),
        dst: group,
        sport: from.port(),
        dport: packet::ROCE_PORT,
    };
    if let Some(port) = dev.port() {
        port.capture_rx(&flow, d, 0);
    }
    if d.len() < packet::BTH_LEN + packet::ICRC_LEN || d.len() > packet::MAX_DATAGRAM {
        Counters::add(&wc.rx_malformed, 1);
        return;
    }
    if packet::icrc_ip_id(&flow, d, 0).is_none() {
        Counters::add(&wc.rx_bad_icrc, 1);
        return;
    }
    let (p, deth) = match packet::parse(d) {
        Ok(p)
            if p.bth.pkey & 0x7fff == 0x7fff
                && packet::is_ud(p.bth.opcode)
                && p.bth.dest_qp == MCAST_QPN =>
        {
            match p.deth {
                Some(deth) => (p, deth),
                None => {
                    Counters::add(&wc.rx_malformed, 1);
                    return;
                }
            }
        }
        _ => {
            Counters::add(&wc.rx_malformed, 1);
            return;
        }
    };
    let own_port = dev.port().is_some_and(|port| port.ip == *from4.ip());
    let qps = group::members(&Gid::from_ipv4(group), |m| {
        m.of(dev) && !(own_port && m.block_self && m.qpn == deth.src_qp)
    });
    if qps.is_empty() {
        Counters::add(&wc.rx_unknown_qp, 1);
        return;
    }
    for (_, q) in qps {
        on_packet(dev, &q, &p, &flow, d.len());
    }
}

/// Takes a UD packet (parsed, ICRC checked) for UD QP `qp`: `flow` is the datagram's (source
/// address and port as received), `udp_len` the bytes of its UDP payload.
pub(crate) fn on_packet(dev: &Shared, qp: &Qp, pkt: &Packet<'_>, flow: &Flow, udp_len: usize) {
    let Some(deth) = pkt.deth else {
        Counters::add(&dev.counters.wire.rx_malformed, 1);
        return;
    };
    deliver(
        qp,
        &Datagram {
            grh: grh_ipv4(flow, udp_len),
            ipv4: true,
            src_qpn: deth.src_qp,
            qkey: deth.qkey,
            imm: pkt.imm,
            payload: pkt.payload,
        },
    );
}

/// Delivers a datagram to `qp` (of any device of this process): the checks of a UD
/// receiver, the scatter (GRH, then payload) and the receive CQE; a drop is counted on the
/// receiving device.
pub(crate) fn deliver(qp: &Qp, d: &Datagram<'_>) {
    let c = &qp.counters;
    if !qp.is_ud() || !matches!(qp.state(), QpState::Rtr | QpState::Rts) {
        Counters::add(&c.ud_unready_drops, 1);
        return;
    }
    if d.qkey != qp.qkey() {
        Counters::add(&c.ud_qkey_drops, 1);
        return;
    }
    let Some(mut r) = Resp::lock(qp) else {
        Counters::add(&c.ud_unready_drops, 1);
        return;
    };
    if !r.has_recv() {
        Counters::add(&c.ud_no_recv_drops, 1);
        return;
    }
    Counters::add(&c.ud_received, 1);
    // a receive WQE whose scatter list fails its checks completes in error (in `recv_ranges`)
    let Ok(dst) = r.recv_ranges() else { return };
    let n = GRH_LEN + d.payload.len();
    if total(&dst) < n as u64 {
        r.recv_too_small();
        return;
    }
    let mut src: SmallVec<[MemRange; 2]> = SmallVec::new();
    src.push(MemRange::host(d.grh.as_ptr() as u64, GRH_LEN as u64));
    if !d.payload.is_empty() {
        src.push(MemRange::host(
            d.payload.as_ptr() as u64,
            d.payload.len() as u64,
        ));
    }
    // SAFETY: `dst` was checked (LOCAL_WRITE) under `r.g`, still held; `src` are host
    // buffers borrowed for this call.
    match unsafe { copy_ranges(&dst, &src) } {
        Ok(_) => {}
        Err(CopyError::Dst(e)) => {
            r.recv_devmem_failed(&e);
            return;
        }
        Err(CopyError::Src(_)) => return,
    }
    let kind = if d.imm.is_some() {
        RespKind::SendImm
    } else {
        RespKind::Send
    };
    let (qpn, src_qpn, imm, ipv4) = (qp.qpn, d.src_qpn, d.imm, d.ipv4);
    r.recv_complete(|counter| {
        Cqe64::responder_ud(kind, qpn, src_qpn, counter, n as u32, imm, ipv4, 0)
    });
    Counters::add(&c.bytes, d.payload.len() as u64);
}
