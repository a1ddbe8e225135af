//! UC queue pairs, in process and over the wire: SENDs and RDMA WRITEs complete once they
//! have left, with no ACK; what the responder cannot take (no receive posted, a bad rkey) is
//! lost without an error on either side; READs and atomics are LOCAL_QP_OP; over a lossy wire
//! every message that arrives arrives whole (a message with a lost packet is dropped, the next
//! one starts afresh).

mod common;
mod wire_util;

use common::*;
use prm::cqe::RespKind;
use prm::wqe::{CtrlFlags, Local, Op};
use prm::{Completion, Syndrome};
use softnic::initiator::{Initiator, RingMode, SoftQpInitiator};
use softnic::outcome::vendor;
use softnic::{Access, CqConfig, Modify, Qp, QpConfig, QpState, RtrAttr, RtsAttr};
use std::sync::Arc;
use std::time::Duration;

const RW: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0);

/// A UC QP on `n`, with its CQ and initiator (not yet connected).
fn uc_qp(n: &Node) -> (Arc<Qp>, Initiator) {
    let cq = n
        .dev
        .create_cq(CqConfig {
            ncqe: 1024,
            ..Default::default()
        })
        .unwrap();
    let mut cfg = QpConfig::new(n.pd, cq.clone(), cq);
    cfg.rq_wqes = 512;
    cfg.max_recv_sge = 1;
    let q = n.dev.create_uc_qp(cfg, None).unwrap();
    let ini = Initiator::for_soft_qp(&n.dev, &q, RingMode::RdmaCore);
    (q, ini)
}

fn up(q: &Qp, peer: &Node, peer_qpn: u32, mtu: u32) {
    q.modify(Modify::Init { access: RW }).unwrap();
    q.modify(Modify::Rtr(RtrAttr {
        remote_gid: peer.dev.gid(),
        remote_qpn: peer_qpn,
        rq_psn: 0,
        mtu,
        min_rnr_timer: 1,
        selective_repeat: false,
    }))
    .unwrap();
    q.modify(Modify::Rts(RtsAttr::default())).unwrap();
}

/// A connected UC pair on `a` and `b`.
fn uc_pair(a: &Node, b: &Node, mtu: u32) -> ((Arc<Qp>, Initiator), (Arc<Qp>, Initiator)) {
    let (qa, ia) = uc_qp(a);
    let (qb, ib) = uc_qp(b);
    up(&qa, b, qb.qpn(), mtu);
    up(&qb, a, qa.qpn(), mtu);
    ((qa, ia), (qb, ib))
}

fn ok(ini: &mut Initiator) {
    match ini.wait_send(T).unwrap() {
        Completion::Req { .. } => {}
        c => panic!("expected a successful completion, got {c:?}"),
    }
}

#[test]
fn uc_sends_and_writes_without_acks_and_loses_what_the_peer_cannot_take() {
    let (a, b) = (Node::new(), Node::new());
    let ((qa, mut ia), (qb, mut ib)) = uc_pair(&a, &b, 4096);
    let src = a.buf(8192, RW);
    let dst = b.buf(8192, RW);
    src.write(0, &[0x5a; 4096]);
    // a WRITE lands
    ia.post_and_ring(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 4096)]),
            imm: None,
        },
        CtrlFlags::SIGNALED,
    )
    .unwrap();
    ok(&mut ia);
    assert_eq!(dst.read(0, 4096), vec![0x5a; 4096]);
    // a SEND with no receive posted: lost, no error anywhere
    src.write(0, b"nobody takes it");
    ia.post_and_ring(
        &Op::Send {
            local: Local::Sges(&[src.sge(0, 15)]),
            imm: None,
        },
        CtrlFlags::SIGNALED,
    )
    .unwrap();
    ok(&mut ia);
    // a bad rkey: lost too
    let mut bad = dst.remote(4096);
    bad.rkey.0 ^= 0x4400;
    ia.post_and_ring(
        &Op::Write {
            remote: bad,
            local: Local::Sges(&[src.sge(0, 64)]),
            imm: None,
        },
        CtrlFlags::SIGNALED,
    )
    .unwrap();
    ok(&mut ia);
    assert_eq!(dst.read(4096, 64), vec![0; 64]);
    assert_eq!((qa.state(), qb.state()), (QpState::Rts, QpState::Rts));
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(
        ib.poll_recv(),
        None,
        "a receive completed for a lost message"
    );
    // then a SEND into a posted receive arrives
    ib.post_recv(&[dst.sge(6000, 64)]).unwrap();
    src.write(0, b"uc send");
    ia.post_and_ring(
        &Op::Send {
            local: Local::Sges(&[src.sge(0, 7)]),
            imm: Some(9),
        },
        CtrlFlags::SIGNALED,
    )
    .unwrap();
    ok(&mut ia);
    match ib.wait_recv(T).unwrap() {
        Completion::Resp { kind, byte_cnt, .. } => {
            assert_eq!((kind, byte_cnt), (RespKind::SendImm, 7))
        }
        c => panic!("{c:?}"),
    }
    assert_eq!(dst.read(6000, 7), b"uc send");
    // READ and atomics are not UC operations
    ia.post_and_ring(
        &Op::Read {
            remote: dst.remote(0),
            local: &[src.sge(0, 8)],
        },
        CtrlFlags::SIGNALED,
    )
    .unwrap();
    match ia.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(
            (e.syndrome, e.vendor_syndrome),
            (Syndrome::LocalQpOp as u8, vendor::INVALID_REQUEST)
        ),
        c => panic!("{c:?}"),
    }
}

#[test]
fn over_a_lossy_wire_every_uc_message_arrives_whole_or_not_at_all() {
    let _serial = wire_util::serial();
    let f = |seed| wire_util::faults(seed, 0.05, 0.0, 0.0, 0.0);
    let (a, b) = (wire_util::wire_node(f(21)), wire_util::wire_node(f(22)));
    wire_util::link(&a, &b);
    let ((qa, mut ia), (qb, mut ib)) = uc_pair(&a, &b, 1024);
    let src = a.buf(1 << 16, RW);
    let dst = b.buf(1 << 18, RW);
    const N: usize = 60;
    const LEN: usize = 3000; // three packets at MTU 1024
    for i in 0..N {
        ib.post_recv(&[dst.sge(i * 4096, 4096)]).unwrap();
    }
    for i in 0..N {
        let msg = vec![(i + 1) as u8; LEN];
        src.write(0, &msg);
        ia.post_and_ring(
            &Op::Send {
                local: Local::Sges(&[src.sge(0, LEN as u32)]),
                imm: Some(i as u32),
            },
            CtrlFlags::SIGNALED,
        )
        .unwrap();
        ok(&mut ia);
    }
    // the receives that complete each hold one whole message, in order (taken until none
    // came for half a second: a loaded machine delivers late)
    let mut got = Vec::new();
    let mut quiet_since = std::time::Instant::now();
    while quiet_since.elapsed() < Duration::from_millis(500) {
        let Some(c) = ib.poll_recv() else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        quiet_since = std::time::Instant::now();
        match c {
            Completion::Resp {
                byte_cnt,
                imm: Some(i),
                wqe_counter,
                ..
            } => {
                assert_eq!(byte_cnt as usize, LEN);
                let at = (wqe_counter as usize % 512) * 4096;
                assert_eq!(dst.read(at, LEN), vec![(i + 1) as u8; LEN], "message {i}");
                got.push(i);
            }
            c => panic!("{c:?}"),
        }
    }
    assert!(
        !got.is_empty() && got.len() < N,
        "5% loss: some lost, some not ({got:?})"
    );
    assert!(got.windows(2).all(|w| w[0] < w[1]), "in order: {got:?}");
    assert!(b.dev.counters().wire.uc_dropped > 0);
    assert_eq!((qa.state(), qb.state()), (QpState::Rts, QpState::Rts));
}
