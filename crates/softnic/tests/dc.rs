//! Dynamically connected transport in process: one DC initiator reaching two DC targets on
//! other devices, message by message (RDMA WRITE and READ, 8-byte and masked 4-byte atomics,
//! SEND into a target's SRQ with the initiator's QPN in the receive CQE), and the errors a
//! ConnectX gives: a wrong DC key or a DCT number nobody holds (the target stays silent: the
//! initiator's transport timer ends it with TRANSPORT_RETRY_EXC), an RC QP named as a target
//! and an RC QP connected to a DCT (neither transport accepts the other), a bad rkey (the
//! initiator gets REMOTE_ACCESS, the target serves the next initiator), and no receive
//! posted (RNR). The same over the wire (RoCEv2 over UDP, with packet losses, duplicates and
//! reordering): two targets behind one port, multi-packet messages, the wrong key, and an RC
//! QP aimed at a target's number.

mod common;
mod wire_util;

use common::*;
use prm::cqe::RespKind;
use prm::wqe::{AtomicSize, CtrlFlags, DatagramSeg, Local, Op, Opcode};
use prm::{Completion, Syndrome};
use softnic::initiator::{Initiator, RingMode, SoftQpInitiator};
use softnic::outcome::vendor;
use softnic::{
    Access, Cq, CqConfig, DctConfig, Modify, Qp, QpConfig, QpState, RtrAttr, RtsAttr, SrqConfig,
};
use std::sync::Arc;

const KEY: u64 = 0x0123_4567_89ab_cdef;
const RIGHTS: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

fn cq(n: &Node) -> Arc<Cq> {
    n.dev
        .create_cq(CqConfig {
            ncqe: 256,
            ..Default::default()
        })
        .unwrap()
}

/// A DC initiator on `n`, in RTS (ACK timeout 1 ms), with the CPU initiator that drives it.
fn dci(n: &Node, retry_cnt: u8, rnr_retry: u8) -> (Arc<Qp>, Initiator) {
    dci_with(
        n,
        RtsAttr {
            timeout: 8,
            retry_cnt,
            rnr_retry,
            ..Default::default()
        },
    )
}

fn dci_with(n: &Node, rts: RtsAttr) -> (Arc<Qp>, Initiator) {
    let c = cq(n);
    let q = n.dev.create_dci(QpConfig::new(n.pd, c.clone(), c)).unwrap();
    q.modify(Modify::Init {
        access: Access::NONE,
    })
    .unwrap();
    q.modify(Modify::RtrDc {
        mtu: 4096,
        min_rnr_timer: 1,
    })
    .unwrap();
    q.modify(Modify::Rts(rts)).unwrap();
    let ini = Initiator::for_soft_qp(&n.dev, &q, RingMode::RdmaCore);
    (q, ini)
}

/// A DC target on `n` with `key`, in RTR, its SRQ (software side) and a poller of its CQ.
struct Target {
    dct: Arc<Qp>,
    srq: SwSrq,
    ini: Initiator,
}

fn dct(n: &Node, key: u64) -> Target {
    let srq = n.dev.create_srq(SrqConfig::new(n.pd, 16, 1)).unwrap();
    let dct = n
        .dev
        .create_dct(DctConfig {
            pd: n.pd,
            cq: cq(n),
            srq: srq.clone(),
            key,
            user_index: None,
        })
        .unwrap();
    dct.modify(Modify::Init { access: RIGHTS }).unwrap();
    dct.modify(Modify::RtrDc {
        mtu: 4096,
        min_rnr_timer: 1,
    })
    .unwrap();
    // a DC target stays in RTR: it has no send queue
    assert!(dct.modify(Modify::Rts(RtsAttr::default())).is_err());
    assert!(dct
        .modify(Modify::Rtr(RtrAttr {
            remote_gid: n.dev.gid(),
            remote_qpn: 1,
            rq_psn: 0,
            mtu: 4096,
            min_rnr_timer: 1,
            selective_repeat: false,
        }))
        .is_err());
    let ini = Initiator::for_soft_qp(&n.dev, &dct, RingMode::RdmaCore);
    Target {
        dct,
        srq: SwSrq::new(srq),
        ini,
    }
}

fn av(n: &Node, t: &Target, key: u64) -> DatagramSeg {
    DatagramSeg::dc(t.dct.qpn(), key, n.dev.gid().0)
}

fn post(ini: &mut Initiator, op: Op<'_>, to: &DatagramSeg) -> u16 {
    let i = ini.post_with_av(&op, CtrlFlags::SIGNALED, to).unwrap();
    ini.ring();
    i
}

fn expect_ok(ini: &mut Initiator, qpn: u32, opcode: Opcode, idx: u16) -> u32 {
    match ini.wait_send(T).unwrap() {
        Completion::Req {
            wqe_opcode,
            qpn: q,
            wqe_counter,
            byte_cnt,
        } if (wqe_opcode, q, wqe_counter) == (opcode as u8, qpn, idx) => byte_cnt,
        c => panic!("expected {opcode:?} #{idx} to complete, got {c:?}"),
    }
}

fn expect_err(ini: &mut Initiator, syndrome: Syndrome, vendor: u8, idx: u16) {
    match ini.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(
            (e.syndrome, e.vendor_syndrome, e.wqe_counter, e.responder),
            (syndrome as u8, vendor, idx, false),
            "{e:?}"
        ),
        c => panic!("expected an error CQE, got {c:?}"),
    }
}

#[test]
fn one_initiator_reaches_two_targets_message_by_message() {
    let (a, b, c) = (Node::new(), Node::new(), Node::new());
    let (q, mut ini) = dci(&a, 3, 3);
    let (mut tb, tc) = (dct(&b, KEY), dct(&c, !KEY));
    let (to_b, to_c) = (av(&b, &tb, KEY), av(&c, &tc, !KEY));
    let src = a.buf(8192, RIGHTS);
    let (mb, mc) = (b.buf(8192, RIGHTS), c.buf(8192, RIGHTS));
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 1) as u8).collect();
    src.write(0, &pattern);
    mc.write(0, &pattern.iter().rev().copied().collect::<Vec<_>>());
    mb.set_u64(4096, 40);
    mc.set_u32(4096, 0x00ff_0001);

    // posted back to back: b, c, b, c — each waits for the previous target's answers
    let w = post(
        &mut ini,
        Op::Write {
            remote: mb.remote(0),
            local: Local::Sges(&[src.sge(0, 4096)]),
            imm: None,
        },
        &to_b,
    );
    let r = post(
        &mut ini,
        Op::Read {
            remote: mc.remote(0),
            local: &[src.sge(4096, 4096)],
        },
        &to_c,
    );
    let fa = post(
        &mut ini,
        Op::FetchAdd {
            remote: mb.remote(4096),
            add: 2,
            result: src.sge(0, 8),
        },
        &to_b,
    );
    let mfa = post(
        &mut ini,
        Op::MaskedFetchAdd {
            size: AtomicSize::B4,
            remote: mc.remote(4096),
            add: 0x0001_0001,
            field_boundary: 0x0000_8000,
            result: src.sge(16, 4),
        },
        &to_c,
    );
    let qpn = q.qpn();
    assert_eq!(expect_ok(&mut ini, qpn, Opcode::RdmaWrite, w), 4096);
    assert_eq!(expect_ok(&mut ini, qpn, Opcode::RdmaRead, r), 4096);
    assert_eq!(expect_ok(&mut ini, qpn, Opcode::AtomicFa, fa), 8);
    expect_ok(&mut ini, qpn, Opcode::AtomicMaskedFa, mfa);
    assert_eq!(mb.read(0, 4096), pattern);
    let back: Vec<u8> = pattern.iter().rev().copied().collect();
    assert_eq!(src.read(4096, 4096), back);
    assert_eq!((src.u64_at(0), mb.u64_at(4096)), (40, 42));
    // two 16-bit fields: the carry out of the low one does not cross the boundary; a 4-byte
    // original value lands big-endian (as a ConnectX writes it), the target stays host-endian
    let old = u32::from_be_bytes(src.read(16, 4).try_into().unwrap());
    assert_eq!((old, mc.u32_at(4096)), (0x00ff_0001, 0x0100_0002));

    // SEND into b's SRQ: the receive CQE names the initiator
    let slot = tb.srq.post(mb.addr(0), 256, mb.lkey().0);
    src.write(0, b"hello, dc target");
    let s = post(
        &mut ini,
        Op::Send {
            local: Local::Sges(&[src.sge(0, 16)]),
            imm: Some(0xd0d0),
        },
        &to_b,
    );
    expect_ok(&mut ini, qpn, Opcode::SendImm, s);
    match tb.ini.wait_recv(T).unwrap() {
        Completion::Resp {
            kind,
            qpn: q,
            wqe_counter,
            byte_cnt,
            imm,
            remote_qpn,
        } => assert_eq!(
            (kind, q, wqe_counter, byte_cnt, imm, remote_qpn),
            (RespKind::SendImm, tb.dct.qpn(), slot, 16, Some(0xd0d0), qpn)
        ),
        c => panic!("{c:?}"),
    }
    assert_eq!(mb.read(0, 16), b"hello, dc target");
    assert!(src.guards_intact() && mb.guards_intact() && mc.guards_intact());
    assert_eq!(q.state(), QpState::Rts);
    drop((ini, tb, tc));
}

#[test]
fn a_wrong_key_or_no_such_target_times_out_and_the_target_serves_on() {
    let (a, b) = (Node::new(), Node::new());
    let t = dct(&b, KEY);
    let src = a.buf(4096, RIGHTS);
    let mb = b.buf(4096, RIGHTS);
    let write = |ini: &mut Initiator, to: &DatagramSeg| {
        post(
            ini,
            Op::Write {
                remote: mb.remote(0),
                local: Local::Sges(&[src.sge(0, 64)]),
                imm: None,
            },
            to,
        )
    };
    // the wrong key: dropped and counted at the target; the initiator's timer ends it
    let (q, mut ini) = dci(&a, 0, 0);
    let i = write(&mut ini, &av(&b, &t, KEY ^ 1));
    expect_err(&mut ini, Syndrome::TransportRetryExc, vendor::NO_PEER, i);
    assert_eq!(q.state(), QpState::Err);
    assert!(b.dev.counters().dc_key_violations >= 1);
    // a DCT number nobody holds
    let (_, mut ini) = dci(&a, 0, 0);
    let i = write(&mut ini, &DatagramSeg::dc(0xab_cdef, KEY, b.dev.gid().0));
    expect_err(&mut ini, Syndrome::TransportRetryExc, vendor::NO_PEER, i);
    // an RC QP's number: an RC QP takes no DC request
    let p = Pair::new();
    let (_, mut ini) = dci(&p.a, 0, 0);
    let (pa, pb) = (p.a.buf(64, RIGHTS), p.b.buf(64, RIGHTS));
    let i = post(
        &mut ini,
        Op::Write {
            remote: pb.remote(0),
            local: Local::Sges(&[pa.sge(0, 64)]),
            imm: None,
        },
        &DatagramSeg::dc(p.eb.qpn(), KEY, p.b.dev.gid().0),
    );
    expect_err(&mut ini, Syndrome::TransportRetryExc, vendor::NO_PEER, i);
    // a bad rkey: REMOTE_ACCESS for this initiator; the target stays up for the next one
    let (q, mut ini) = dci(&a, 0, 0);
    let mut bad = mb.remote(0);
    bad.rkey.0 ^= 0xff00;
    let i = post(
        &mut ini,
        Op::Write {
            remote: bad,
            local: Local::Sges(&[src.sge(0, 64)]),
            imm: None,
        },
        &av(&b, &t, KEY),
    );
    expect_err(&mut ini, Syndrome::RemoteAccess, vendor::REMOTE_KEY, i);
    assert_eq!((q.state(), t.dct.state()), (QpState::Err, QpState::Rtr));
    let (q, mut ini) = dci(&a, 0, 0);
    src.fill(0x5a);
    let i = write(&mut ini, &av(&b, &t, KEY));
    assert_eq!(expect_ok(&mut ini, q.qpn(), Opcode::RdmaWrite, i), 64);
    assert_eq!(mb.read(0, 64), vec![0x5a; 64]);
    // a SEND with no receive posted: RNR, retried rnr_retry times
    let s = post(
        &mut ini,
        Op::Send {
            local: Local::Sges(&[src.sge(0, 8)]),
            imm: None,
        },
        &av(&b, &t, KEY),
    );
    expect_err(&mut ini, Syndrome::RnrRetryExc, vendor::RNR, s);
    assert_eq!(t.dct.state(), QpState::Rtr);
}

/// An RC QP on `a` connected to QP (or DCT) `qpn` of `b`, with its initiator; then one
/// 64-byte WRITE from `src` to `dst`, which nobody answers.
fn rc_write_gets_no_answer(a: &Node, b: &Node, qpn: u32, src: &Buf, dst: &Buf) {
    let c = cq(a);
    let q = a.dev.create_qp(QpConfig::new(a.pd, c.clone(), c)).unwrap();
    q.modify(Modify::Init { access: RIGHTS }).unwrap();
    q.modify(Modify::Rtr(RtrAttr {
        remote_gid: b.dev.gid(),
        remote_qpn: qpn,
        rq_psn: 0,
        mtu: 4096,
        min_rnr_timer: 1,
        selective_repeat: false,
    }))
    .unwrap();
    q.modify(Modify::Rts(RtsAttr {
        timeout: 8,
        ..Default::default()
    }))
    .unwrap();
    let mut ini = Initiator::for_soft_qp(&a.dev, &q, RingMode::RdmaCore);
    let i = ini
        .post_and_ring(
            &Op::Write {
                remote: dst.remote(0),
                local: Local::Sges(&[src.sge(0, 64)]),
                imm: None,
            },
            CtrlFlags::SIGNALED,
        )
        .unwrap();
    expect_err(&mut ini, Syndrome::TransportRetryExc, vendor::NO_PEER, i);
}

#[test]
fn an_rc_qp_connected_to_a_dct_number_gets_no_answer() {
    let (a, b) = (Node::new(), Node::new());
    let t = dct(&b, KEY);
    let src = a.buf(64, RIGHTS);
    let mb = b.buf(64, RIGHTS);
    rc_write_gets_no_answer(&a, &b, t.dct.qpn(), &src, &mb);
    // nor does an RC WQE (no address vector) leave a DC initiator as anything but an error
    let (_, mut ini) = dci(&a, 0, 0);
    let i = ini
        .post_and_ring(
            &Op::Write {
                remote: mb.remote(0),
                local: Local::Sges(&[src.sge(0, 64)]),
                imm: None,
            },
            CtrlFlags::SIGNALED,
        )
        .unwrap();
    match ini.wait_send(T).unwrap() {
        Completion::Error(e) => {
            assert_eq!((e.syndrome, e.wqe_counter), (Syndrome::LocalQpOp as u8, i))
        }
        c => panic!("{c:?}"),
    }
    assert_eq!(mb.read(0, 64), vec![0; 64]);
}

#[test]
fn dc_over_the_wire_with_faults() {
    let _serial = wire_util::serial();
    let f = |seed| wire_util::faults(seed, 0.03, 0.03, 0.03, 0.02);
    let (a, b) = (wire_util::wire_node(f(11)), wire_util::wire_node(f(12)));
    wire_util::link(&a, &b);
    let lossy = RtsAttr {
        sq_psn: 0x00ff_fff0,
        timeout: 16,
        retry_cnt: 7,
        rnr_retry: 7,
    };
    let (q, mut ini) = dci_with(&a, lossy);
    let (mut t1, t2) = (dct(&b, KEY), dct(&b, KEY ^ 0xff));
    let (to1, to2) = (av(&b, &t1, KEY), av(&b, &t2, KEY ^ 0xff));
    let src = a.buf(1 << 17, RIGHTS);
    let (m1, m2) = (b.buf(1 << 17, RIGHTS), b.buf(1 << 17, RIGHTS));
    let mut rng = Rng(7);
    src.write(0, &rng.bytes(1 << 16));
    m2.write(0, &rng.bytes(1 << 16));
    m1.set_u64(1 << 16, 5);
    let qpn = q.qpn();
    for round in 0..3u64 {
        // a 64 KiB WRITE to one target, a 48 KiB READ from the other, an atomic on the first
        let w = post(
            &mut ini,
            Op::Write {
                remote: m1.remote(0),
                local: Local::Sges(&[src.sge(0, 1 << 16)]),
                imm: None,
            },
            &to1,
        );
        let r = post(
            &mut ini,
            Op::Read {
                remote: m2.remote(0),
                local: &[src.sge(1 << 16, 48 << 10)],
            },
            &to2,
        );
        let fa = post(
            &mut ini,
            Op::FetchAdd {
                remote: m1.remote(1 << 16),
                add: 10,
                result: src.sge((1 << 17) - 8, 8),
            },
            &to1,
        );
        assert_eq!(expect_ok(&mut ini, qpn, Opcode::RdmaWrite, w), 1 << 16);
        assert_eq!(expect_ok(&mut ini, qpn, Opcode::RdmaRead, r), 48 << 10);
        assert_eq!(expect_ok(&mut ini, qpn, Opcode::AtomicFa, fa), 8);
        assert_eq!(m1.read(0, 1 << 16), src.read(0, 1 << 16));
        assert_eq!(src.read(1 << 16, 48 << 10), m2.read(0, 48 << 10));
        assert_eq!(src.u64_at((1 << 17) - 8), 5 + 10 * round);
    }
    // a 10 KiB SEND into the first target's SRQ: three packets, one receive
    let slot = t1.srq.post(m1.addr(0), 16 << 10, m1.lkey().0);
    let s = post(
        &mut ini,
        Op::Send {
            local: Local::Sges(&[src.sge(100, 10 << 10)]),
            imm: None,
        },
        &to1,
    );
    expect_ok(&mut ini, qpn, Opcode::Send, s);
    match t1.ini.wait_recv(T).unwrap() {
        Completion::Resp {
            qpn: d,
            wqe_counter,
            byte_cnt,
            remote_qpn,
            ..
        } => assert_eq!(
            (d, wqe_counter, byte_cnt, remote_qpn),
            (t1.dct.qpn(), slot, 10 << 10, qpn)
        ),
        c => panic!("{c:?}"),
    }
    assert_eq!(m1.read(0, 10 << 10), src.read(100, 10 << 10));
    assert!(b.dev.counters().wire.rx_packets > 0, "the wire carried it");

    // the wrong key over the wire: dropped at the target, the initiator times out
    let (_, mut bad) = dci(&a, 1, 0);
    let i = post(
        &mut bad,
        Op::Write {
            remote: m1.remote(0),
            local: Local::Sges(&[src.sge(0, 64)]),
            imm: None,
        },
        &av(&b, &t1, !KEY),
    );
    expect_err(&mut bad, Syndrome::TransportRetryExc, vendor::NO_PEER, i);
    assert!(b.dev.counters().dc_key_violations >= 1);
    assert_eq!(t1.dct.state(), QpState::Rtr);
    // an RC QP aimed at the target's number: its RC packets are not the target's to take
    let before = b.dev.counters().wire.rx_malformed;
    rc_write_gets_no_answer(&a, &b, t1.dct.qpn(), &src, &m1);
    assert!(b.dev.counters().wire.rx_malformed > before);
    drop((ini, t1, t2));
}
