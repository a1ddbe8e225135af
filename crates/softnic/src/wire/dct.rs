//! A DC target on the wire: it takes requests from any initiator that presents its DC access
//! key, with one responder state per initiator ([`crate::rc_state::DcConns`]), and answers each
//! initiator at its address. The checks and outcomes are the RC responder's
//! ([`super::responder`]), run with the initiator's state in place of the target's own.

use super::responder::{self, Reply};
use crate::counters::Counters;
use crate::net::packet::{Flow, Packet};
use crate::net::socket::{Port, TxBatch};
use crate::qp::{Qp, QpState};
use crate::shared::Shared;
use crate::Gid;
use std::net::{SocketAddr, SocketAddrV4};

/// Takes one DC request `pkt` (its DCETH present, its ICRC checked) that arrived at target
/// `qp` from `from`; answers are built in `scratch` and leave in `batch`.
pub(super) fn on_request(
    dev: &Shared,
    port: &Port,
    qp: &Qp,
    (pkt, raw): (&Packet<'_>, &[u8]),
    from: SocketAddrV4,
    (scratch, batch): (&mut Vec<u8>, &mut TxBatch),
) {
    let wc = &dev.counters.wire;
    let (Some(e), Some(key)) = (pkt.dceth, qp.dct_key()) else {
        Counters::add(&wc.rx_malformed, 1);
        return;
    };
    if e.key != key {
        // dropped, as a ConnectX's DCT drops it: the initiator's timer runs out
        Counters::add(&qp.counters.dc_key_violations, 1);
        return;
    }
    if !matches!(qp.state(), QpState::Rtr) {
        Counters::add(&wc.rx_unknown_qp, 1);
        return;
    }
    let mtu = qp.lock_sq().mtu;
    let ip = *from.ip();
    let mut conns = qp.dc_conns.lock();
    let Some(conn) = conns.conn(ip, &e, mtu) else {
        Counters::add(&wc.duplicates, 1);
        return;
    };
    // answers go to the initiator's address at the port its DCETH names, else its GID's
    // peer-table entry, else the default port (the key, not the source address, is what
    // admits a request to a DC target)
    let to = match (e.reply_port, dev.peer_addr(&Gid::from_ipv4(ip))) {
        (0, Some(SocketAddr::V4(a))) => a,
        (0, _) => SocketAddrV4::new(ip, port.cfg.default_port),
        (p, _) => SocketAddrV4::new(ip, p),
    };
    let mut reply = Reply {
        port,
        to: SocketAddr::V4(to),
        flow: Flow {
            src: port.ip,
            dst: ip,
            sport: port.local.port(),
            dport: to.port(),
        },
        dest_qp: e.dci,
        class: crate::net::packet::Class::Dc,
        buf: scratch,
        batch,
    };
    let swap = |conn: &mut crate::rc_state::DcConn| {
        let mut rq = qp.lock_rq();
        std::mem::swap(&mut rq.wire, &mut conn.wire);
        std::mem::swap(&mut rq.srq_wqe, &mut conn.srq_wqe);
    };
    swap(conn);
    responder::on_request(dev, qp, pkt, raw, from.port(), &mut reply);
    swap(conn);
}
