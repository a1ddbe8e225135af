//! XRC: domains, XRC SRQs bound to a domain and a CQ, XRC initiators whose WQEs name the
//! target's XRC SRQ, XRC targets with no queues of their own. In process and over the wire:
//! SENDs land in the SRQ they name and complete on its CQ (stamped with the target's QPN and
//! the SRQ's user index); RDMA WRITE, READ and atomics run against the SRQ's PD; an SRQ of
//! another domain is refused (REMOTE_INVAL_REQ at the initiator, the target to ERR); RC and XRC
//! never take each other's requests.

mod common;
mod wire_util;

use common::*;
use prm::cqe::RespKind;
use prm::wqe::{CtrlFlags, Local, Op};
use prm::{Completion, Syndrome};
use softnic::initiator::{CqGeometry, CqPoller, Initiator, RingMode, SoftQpInitiator};
use softnic::{
    Access, Cq, CqConfig, Modify, Qp, QpConfig, QpState, RtrAttr, RtsAttr, Srq, SrqConfig,
    XrcSrqConfig, Xrcd,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ALL: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

fn cq(n: &Node) -> Arc<Cq> {
    n.dev
        .create_cq(CqConfig {
            ncqe: 64,
            ..Default::default()
        })
        .unwrap()
}

/// A CPU poller of `cq`.
fn poller(cq: &Arc<Cq>) -> CqPoller {
    let g = CqGeometry {
        ring: cq.ring().as_ptr(),
        ncqe: cq.ncqe(),
        dbrec: cq.dbrec().as_ptr(),
        collapsed: false,
    };
    // SAFETY: the CQ's ring and doorbell record live as long as the CQ, which every test keeps
    // until its pollers are gone.
    unsafe { CqPoller::new(g) }
}

fn wait_cqe(p: &mut CqPoller) -> Completion {
    let t = Instant::now();
    loop {
        if let Some(c) = p.poll() {
            return c.decode();
        }
        assert!(t.elapsed() < T, "no CQE");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// An XRC SRQ of `xrcd` on `n` with user index `uidx`, its own CQ and a poller of it.
struct XSrq {
    srq: SwSrq,
    cq: Arc<Cq>,
    poll: CqPoller,
}

fn xsrq(n: &Node, xrcd: &Arc<Xrcd>, uidx: Option<u32>) -> XSrq {
    let cq = cq(n);
    let srq: Arc<Srq> = n
        .dev
        .create_xrc_srq(
            // two data segments: room for SwSrq's terminator after the one it posts
            SrqConfig::new(n.pd, 16, 2),
            XrcSrqConfig {
                xrcd: xrcd.clone(),
                cq: cq.clone(),
                user_index: uidx,
            },
        )
        .unwrap();
    XSrq {
        srq: SwSrq::new(srq),
        poll: poller(&cq),
        cq,
    }
}

fn up(q: &Qp, peer: &Node, peer_qpn: u32, access: Access) {
    q.modify(Modify::Init { access }).unwrap();
    q.modify(Modify::Rtr(RtrAttr {
        remote_gid: peer.dev.gid(),
        remote_qpn: peer_qpn,
        rq_psn: 0,
        mtu: 1024,
        min_rnr_timer: 1,
        selective_repeat: false,
    }))
    .unwrap();
    // 67 ms ACK timeout: a loaded machine leaves threads unscheduled for milliseconds
    q.modify(Modify::Rts(RtsAttr {
        timeout: 14,
        retry_cnt: 2,
        rnr_retry: 7,
        ..Default::default()
    }))
    .unwrap();
}

/// An XRC initiator on `a` connected to an XRC target of `xrcd` on `b`.
fn xrc_pair(a: &Node, b: &Node, xrcd: &Arc<Xrcd>) -> (Arc<Qp>, Initiator, Arc<Qp>) {
    let scq = cq(a);
    let ini = a
        .dev
        .create_xrc_ini(QpConfig::new(a.pd, scq.clone(), scq))
        .unwrap();
    let tgt = b.dev.create_xrc_tgt(xrcd).unwrap();
    up(&ini, b, tgt.qpn(), Access::NONE);
    up(&tgt, a, ini.qpn(), ALL);
    let i = Initiator::for_soft_qp(&a.dev, &ini, RingMode::RdmaCore);
    (ini, i, tgt)
}

fn post(i: &mut Initiator, op: Op<'_>, srqn: u32) -> u16 {
    let idx = i.post_with_xrc(&op, CtrlFlags::SIGNALED, srqn).unwrap();
    i.ring();
    idx
}

fn ok(i: &mut Initiator) -> u32 {
    match i.wait_send(T).unwrap() {
        Completion::Req { byte_cnt, .. } => byte_cnt,
        c => panic!("expected a successful completion, got {c:?}"),
    }
}

/// SENDs to two XRC SRQs of one domain through one target, then WRITE, READ and an atomic
/// against memory of the SRQs' PD.
fn sends_land_in_the_srq_they_name(a: &Node, b: &Node) {
    let xrcd = b.dev.alloc_xrcd();
    let (mut s1, mut s2) = (xsrq(b, &xrcd, Some(0x1234)), xsrq(b, &xrcd, None));
    assert_eq!(xrcd.srq_count(), 2);
    let (_ini, mut i, tgt) = xrc_pair(a, b, &xrcd);
    let src = a.buf(8192, ALL);
    let dst = b.buf(8192, ALL);
    s1.srq.post(dst.addr(0), 4096, dst.lkey().0);
    s2.srq.post(dst.addr(4096), 4096, dst.lkey().0);
    src.write(0, &[0x11; 3000]);
    let n1 = s1.srq.srq.srqn();
    post(
        &mut i,
        Op::Send {
            local: Local::Sges(&[src.sge(0, 3000)]),
            imm: Some(7),
        },
        n1,
    );
    assert_eq!(ok(&mut i), 3000);
    match wait_cqe(&mut s1.poll) {
        Completion::Resp {
            kind,
            qpn,
            byte_cnt,
            imm,
            ..
        } => assert_eq!(
            (kind, qpn, byte_cnt, imm),
            (RespKind::SendImm, tgt.qpn(), 3000, Some(7))
        ),
        c => panic!("{c:?}"),
    }
    assert_eq!(dst.read(0, 3000), vec![0x11; 3000]);
    src.write(0, b"to the second SRQ");
    post(
        &mut i,
        Op::Send {
            local: Local::Sges(&[src.sge(0, 17)]),
            imm: None,
        },
        s2.srq.srq.srqn(),
    );
    ok(&mut i);
    assert!(matches!(
        wait_cqe(&mut s2.poll),
        Completion::Resp { byte_cnt: 17, .. }
    ));
    assert_eq!(dst.read(4096, 17), b"to the second SRQ");
    assert!(
        s1.poll.poll().is_none(),
        "the first SRQ's CQ took a second CQE"
    );
    // RDMA WRITE, READ, atomic: checked against the named SRQ's PD
    src.write(0, &[0x22; 64]);
    let w = Op::Write {
        remote: dst.remote(100),
        local: Local::Sges(&[src.sge(0, 64)]),
        imm: None,
    };
    post(&mut i, w, n1);
    ok(&mut i);
    assert_eq!(dst.read(100, 64), vec![0x22; 64]);
    let r = Op::Read {
        remote: dst.remote(0),
        local: &[src.sge(1000, 16)],
    };
    post(&mut i, r, n1);
    ok(&mut i);
    assert_eq!(src.read(1000, 16), vec![0x11; 16]);
    dst.set_u64(2048, 40);
    let fa = Op::FetchAdd {
        remote: dst.remote(2048),
        add: 2,
        result: src.sge(4000, 8),
    };
    post(&mut i, fa, n1);
    ok(&mut i);
    assert_eq!((dst.u64_at(2048), src.u64_at(4000)), (42, 40));
    // the CQE carries the SRQ's user index (libmlx5 finds the SRQ by it)
    s1.srq.post(dst.addr(0), 64, dst.lkey().0);
    post(
        &mut i,
        Op::Send {
            local: Local::Sges(&[src.sge(0, 8)]),
            imm: None,
        },
        n1,
    );
    ok(&mut i);
    let raw = loop {
        if let Some(c) = s1.poll.poll() {
            break c;
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    assert_eq!(raw.srqn_uidx.get() & 0xff_ffff, 0x1234);
    drop(s1.cq);
}

#[test]
fn in_process_xrc_sends_land_in_the_srq_they_name() {
    let (a, b) = (Node::new(), Node::new());
    sends_land_in_the_srq_they_name(&a, &b);
}

#[test]
fn over_the_wire_xrc_sends_land_in_the_srq_they_name() {
    let _serial = wire_util::serial();
    let f = wire_util::faults(0, 0.0, 0.0, 0.0, 0.0);
    let (a, b) = (wire_util::wire_node(f), wire_util::wire_node(f));
    wire_util::link(&a, &b);
    sends_land_in_the_srq_they_name(&a, &b);
    assert!(a.dev.counters().wire.tx_packets > 0);
    assert!(b.dev.counters().wire.tx_packets > 0);
}

/// An SRQ of another domain (or none at all) is an invalid request.
fn foreign_srq_is_refused(a: &Node, b: &Node) {
    let (x1, x2) = (b.dev.alloc_xrcd(), b.dev.alloc_xrcd());
    let mut other = xsrq(b, &x2, None);
    let (_ini, mut i, tgt) = xrc_pair(a, b, &x1);
    let src = a.buf(4096, ALL);
    let dst = b.buf(4096, ALL);
    other.srq.post(dst.addr(0), 4096, dst.lkey().0);
    post(
        &mut i,
        Op::Send {
            local: Local::Sges(&[src.sge(0, 8)]),
            imm: None,
        },
        other.srq.srq.srqn(),
    );
    match i.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome, Syndrome::RemoteInvalReq as u8),
        c => panic!("{c:?}"),
    }
    wait_until("the target in ERR", || tgt.state() == QpState::Err);
    assert!(other.poll.poll().is_none());
    assert_eq!(b.dev.counters().xrc_bad_srq, 1);
}

#[test]
fn an_srq_of_another_domain_is_refused() {
    let (a, b) = (Node::new(), Node::new());
    foreign_srq_is_refused(&a, &b);
}

#[test]
fn over_the_wire_an_srq_of_another_domain_is_refused() {
    let _serial = wire_util::serial();
    let f = wire_util::faults(0, 0.0, 0.0, 0.0, 0.0);
    let (a, b) = (wire_util::wire_node(f), wire_util::wire_node(f));
    wire_util::link(&a, &b);
    foreign_srq_is_refused(&a, &b);
}

/// RC and XRC never take each other's requests: an RC QP aimed at an XRC target, and an XRC
/// initiator aimed at an RC QP, get no answer (transport retries exceeded); nothing lands.
fn rc_and_xrc_do_not_mix(a: &Node, b: &Node) {
    let xrcd = b.dev.alloc_xrcd();
    let tgt = b.dev.create_xrc_tgt(&xrcd).unwrap();
    let mut s = xsrq(b, &xrcd, None);
    let rcq = cq(b);
    let rc_b = b
        .dev
        .create_qp(QpConfig::new(b.pd, rcq.clone(), rcq.clone()))
        .unwrap();
    let dst = b.buf(4096, ALL);
    s.srq.post(dst.addr(0), 4096, dst.lkey().0);
    // an RC requester to the XRC target
    let acq = cq(a);
    let rc_a = a
        .dev
        .create_qp(QpConfig::new(a.pd, acq.clone(), acq.clone()))
        .unwrap();
    up(&rc_a, b, tgt.qpn(), ALL);
    up(&tgt, a, rc_a.qpn(), ALL);
    let src = a.buf(4096, ALL);
    let mut i = Initiator::for_soft_qp(&a.dev, &rc_a, RingMode::RdmaCore);
    i.post_and_ring(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 8)]),
            imm: None,
        },
        CtrlFlags::SIGNALED,
    )
    .unwrap();
    match i.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome, Syndrome::TransportRetryExc as u8),
        c => panic!("{c:?}"),
    }
    // an XRC initiator to the RC QP
    let scq = cq(a);
    let ini = a
        .dev
        .create_xrc_ini(QpConfig::new(a.pd, scq.clone(), scq))
        .unwrap();
    up(&ini, b, rc_b.qpn(), Access::NONE);
    up(&rc_b, a, ini.qpn(), ALL);
    let mut x = Initiator::for_soft_qp(&a.dev, &ini, RingMode::RdmaCore);
    let w = Op::Write {
        remote: dst.remote(0),
        local: Local::Sges(&[src.sge(0, 8)]),
        imm: None,
    };
    post(&mut x, w, s.srq.srq.srqn());
    match x.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome, Syndrome::TransportRetryExc as u8),
        c => panic!("{c:?}"),
    }
    assert_eq!(dst.read(0, 8), vec![0; 8]);
    assert!(s.poll.poll().is_none());
    assert_eq!((tgt.state(), rc_b.state()), (QpState::Rts, QpState::Rts));
}

#[test]
fn rc_and_xrc_do_not_take_each_others_requests() {
    let (a, b) = (Node::new(), Node::new());
    rc_and_xrc_do_not_mix(&a, &b);
}

#[test]
fn over_the_wire_rc_and_xrc_do_not_take_each_others_packets() {
    let _serial = wire_util::serial();
    let f = wire_util::faults(0, 0.0, 0.0, 0.0, 0.0);
    let (a, b) = (wire_util::wire_node(f), wire_util::wire_node(f));
    wire_util::link(&a, &b);
    rc_and_xrc_do_not_mix(&a, &b);
    assert!(b.dev.counters().wire.rx_malformed > 0);
}

#[test]
fn over_a_lossy_wire_every_xrc_send_arrives_once_and_whole() {
    let _serial = wire_util::serial();
    let f = |seed| wire_util::faults(seed, 0.05, 0.02, 0.02, 0.0);
    let (a, b) = (wire_util::wire_node(f(31)), wire_util::wire_node(f(32)));
    wire_util::link(&a, &b);
    let xrcd = b.dev.alloc_xrcd();
    let mut s = xsrq(&b, &xrcd, None);
    let (ini, mut i, tgt) = xrc_pair(&a, &b, &xrcd);
    // losses are repaired by NAKs and retransmission: more retries than `up` gives
    ini.modify(Modify::Rts(RtsAttr {
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        ..Default::default()
    }))
    .unwrap();
    let src = a.buf(1 << 14, ALL);
    let dst = b.buf(16 * 4096, ALL);
    const N: usize = 30;
    const LEN: usize = 3000; // three packets at MTU 1024
    for k in 0..N {
        let slot = k % 16;
        s.srq.post(dst.addr(slot * 4096), 4096, dst.lkey().0);
        src.write(0, &vec![(k + 1) as u8; LEN]);
        let op = Op::Send {
            local: Local::Sges(&[src.sge(0, LEN as u32)]),
            imm: Some(k as u32),
        };
        post(&mut i, op, s.srq.srq.srqn());
        assert_eq!(ok(&mut i), LEN as u32);
        match wait_cqe(&mut s.poll) {
            Completion::Resp {
                byte_cnt,
                imm: Some(got),
                qpn,
                wqe_counter,
                ..
            } => {
                assert_eq!((byte_cnt as usize, got, qpn), (LEN, k as u32, tgt.qpn()));
                let at = wqe_counter as usize * 4096;
                let got = dst.read(at, LEN);
                let want = (k + 1) as u8;
                let bad = got.iter().position(|&x| x != want);
                assert!(
                    bad.is_none(),
                    "message {k} at WQE {wqe_counter}: byte {bad:?} is {:?}",
                    bad.map(|b| got[b])
                );
                s.srq.free(wqe_counter);
            }
            c => panic!("{c:?}"),
        }
    }
    assert!(s.poll.poll().is_none(), "a message arrived twice");
    assert!(a.dev.counters().wire.retransmits > 0 || b.dev.counters().wire.duplicates > 0);
    assert_eq!((ini.state(), tgt.state()), (QpState::Rts, QpState::Rts));
}

#[test]
fn an_xrc_target_has_no_send_queue() {
    let (a, b) = (Node::new(), Node::new());
    let xrcd = b.dev.alloc_xrcd();
    let (_ini, _i, tgt) = xrc_pair(&a, &b, &xrcd);
    let mut t = Initiator::for_soft_qp(&b.dev, &tgt, RingMode::RdmaCore);
    t.post_and_ring(&Op::Nop, CtrlFlags::SIGNALED).unwrap();
    match t.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome, Syndrome::LocalQpOp as u8),
        c => panic!("{c:?}"),
    }
    // a target takes no UD or DC attributes
    let other = b.dev.create_xrc_tgt(&xrcd).unwrap();
    assert!(other.modify(Modify::InitUd { qkey: 1 }).is_err());
}
