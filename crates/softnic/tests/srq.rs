//! Shared receive queues in the mlx5 format (next-WQE segment + data segments, the free list
//! software keeps, the BE32 doorbell counter), two QPs taking receives from one SRQ, the SRQ
//! WQE index in responder CQEs, the limit event, LAST_WQE_REACHED, and RESIZE of a CQ with
//! its RESIZE CQE and owner bits in the new ring. Also the CQ error / QP fatal events of an
//! overrun.

mod common;

use common::*;
use prm::cqe::{owner_bit, Cqe64, RespKind};
use prm::wqe::{CtrlFlags, Local, Op};
use prm::Completion;
use softnic::initiator::{Initiator, RingMode, SoftQpInitiator};
use softnic::{
    Access, AsyncEvent, CqConfig, CqMode, Modify, QpConfig, RtrAttr, RtsAttr, SrqConfig,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const RW: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0);

type Events = Arc<Mutex<Vec<AsyncEvent>>>;

fn recorder() -> (Events, softnic::EventHandler) {
    let ev: Events = Arc::default();
    let e = ev.clone();
    (ev, Arc::new(move |x| e.lock().unwrap().push(x)))
}

fn wait_for(ev: &Events, want: AsyncEvent) {
    let t = Instant::now();
    while !ev.lock().unwrap().contains(&want) {
        assert!(t.elapsed() < T, "no {want:?}: {:?}", ev.lock().unwrap());
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn up(q: &softnic::Qp, peer: &Node, peer_qpn: u32, rnr_retry: u8) {
    q.modify(Modify::Init {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ,
    })
    .unwrap();
    q.modify(Modify::Rtr(RtrAttr {
        remote_gid: peer.dev.gid(),
        remote_qpn: peer_qpn,
        rq_psn: 0,
        mtu: 1024,
        min_rnr_timer: 1,
        selective_repeat: false,
    }))
    .unwrap();
    q.modify(Modify::Rts(RtsAttr {
        rnr_retry,
        ..Default::default()
    }))
    .unwrap();
}

#[test]
fn two_qps_share_one_srq_with_its_free_list_limit_and_last_wqe_events() {
    let (a, b) = (Node::new(), Node::new());
    let src = a.buf(1 << 16, RW);
    let dst = b.buf(64 * 1024, RW);
    let srq = b.dev.create_srq(SrqConfig::new(b.pd, 16, 2)).expect("SRQ");
    assert_eq!((srq.stride(), srq.max_sge()), (64, 3));
    let (srq_ev, h) = recorder();
    srq.set_event_handler(Some(h));
    let mut sw = SwSrq::new(srq.clone());
    let rcq = b
        .dev
        .create_cq(CqConfig {
            ncqe: 64,
            ..Default::default()
        })
        .unwrap();
    let cq = || {
        a.dev
            .create_cq(CqConfig {
                ncqe: 64,
                ..Default::default()
            })
            .unwrap()
    };
    let mut reqs = Vec::new();
    let mut resps = Vec::new();
    let mut qp_ev = Vec::new();
    for _ in 0..2 {
        let c = cq();
        let qa = a.dev.create_qp(QpConfig::new(a.pd, c.clone(), c)).unwrap();
        let mut cfg = QpConfig::new(b.pd, rcq.clone(), rcq.clone());
        cfg.rq_wqes = 0;
        let qb = b.dev.create_qp_on_srq(cfg, &srq).unwrap();
        let (ev, h) = recorder();
        qb.set_event_handler(Some(h));
        qp_ev.push(ev);
        up(&qa, &b, qb.qpn(), 0);
        up(&qb, &a, qa.qpn(), 0);
        reqs.push(Initiator::for_soft_qp(&a.dev, &qa, RingMode::RdmaCore));
        resps.push(qb);
    }
    assert!(matches!(
        b.dev.destroy_srq(&srq),
        Err(softnic::Error::Busy(_))
    ));
    // 15 WQEs fit (libmlx5 keeps one slot as the list's tail)
    let mut owner = std::collections::HashMap::new();
    for k in 0..15u16 {
        let i = sw.post(dst.addr(k as usize * 1024), 1024, dst.lkey().0);
        owner.insert(i, k);
    }
    srq.set_limit(10).unwrap();
    let mut rng = Rng(5);
    let mut next_slot = 15usize;
    for m in 0..60usize {
        let n = rng.range(1, 1024) as usize;
        let data = rng.bytes(n);
        src.write(0, &data);
        let ini = &mut reqs[m % 2];
        let sge = [src.sge(0, n as u32)];
        ini.post_and_ring(
            &Op::Send {
                local: Local::Sges(&sge),
                imm: None,
            },
            CtrlFlags::SIGNALED,
        )
        .unwrap();
        assert!(matches!(ini.wait_send(T).unwrap(), Completion::Req { .. }));
        let t = Instant::now();
        while rcq.produced() <= m as u32 {
            assert!(t.elapsed() < T, "no receive CQE {m}");
            std::thread::yield_now();
        }
        let mut raw = [0u8; 64];
        rcq.ring().read((m % 64) * 64, &mut raw);
        let c: Cqe64 = bytemuck::cast(raw);
        let Completion::Resp {
            kind,
            qpn,
            wqe_counter,
            byte_cnt,
            ..
        } = c.decode()
        else {
            panic!("receive {m}: {:?}", c.decode())
        };
        assert_eq!(
            (kind, qpn, byte_cnt),
            (RespKind::Send, resps[m % 2].qpn(), n as u32)
        );
        let k = owner.remove(&wqe_counter).expect("a posted SRQ WQE");
        assert_eq!(dst.read(k as usize * 1024, n), data, "message {m}");
        if m == 5 {
            wait_for(&srq_ev, AsyncEvent::SrqLimitReached);
            assert_eq!(srq.limit(), 0, "disarmed");
        }
        // software frees the WQE and, once the limit fired, posts a new one (the list is
        // reused around the ring)
        sw.free(wqe_counter);
        if m < 8 {
            continue;
        }
        let slot = next_slot % 60;
        next_slot += 1;
        let i = sw.post(dst.addr(slot * 1024), 1024, dst.lkey().0);
        owner.insert(i, slot as u16);
    }
    assert_eq!(srq.taken(), 60);
    assert_eq!(srq.available(), 7);
    // one QP to ERR: LAST_WQE_REACHED for it only, the SRQ's WQEs stay
    resps[0].modify(Modify::Err).unwrap();
    wait_for(&qp_ev[0], AsyncEvent::LastWqeReached);
    assert!(qp_ev[1].lock().unwrap().is_empty());
    assert_eq!(srq.available(), 7);
    b.dev.destroy_qp(&resps[0]);
    b.dev.destroy_qp(&resps[1]);
    b.dev.destroy_srq(&srq).unwrap();
}

#[test]
fn resize_writes_a_resize_cqe_and_continues_in_the_new_ring() {
    let mut p = Pair::with(
        Opts {
            ncqe: 4,
            cq_mode: CqMode::OverrunDetect,
            ..Opts::default()
        },
        Opts::default(),
    );
    let src = p.a.buf(4096, RW);
    let dst = p.b.buf(4096, RW);
    let scq = p.ea.scq.clone();
    let write = |ini: &mut Initiator, i: usize| {
        let sge = [src.sge(i * 8, 8)];
        ini.post_and_ring(
            &Op::Write {
                remote: dst.remote(i * 8),
                local: Local::Sges(&sge),
                imm: None,
            },
            CtrlFlags::SIGNALED,
        )
        .unwrap();
    };
    for i in 0..2 {
        write(&mut p.ea.ini, i);
    }
    let t = Instant::now();
    while scq.produced() < 2 {
        assert!(t.elapsed() < T);
        std::thread::yield_now();
    }
    // too small for the two pending CQEs and the next: refused
    assert!(scq.resize(2, softnic::DmaBuf::alloc(2 * 64)).is_err());
    let ring = softnic::DmaBuf::alloc(16 * 64);
    let p0 = std::ptr::NonNull::new(ring.as_ptr()).unwrap();
    // SAFETY: a view of `ring`, which outlives the CQ's use of it (both live to the end of
    // the test; the device only writes through raw pointers).
    let view = unsafe { softnic::DmaBuf::from_external(p0, 16 * 64, Box::new(())) };
    scq.resize(16, view).unwrap();
    assert_eq!(scq.ncqe(), 16);
    let mut raw = [0u8; 64];
    scq.ring().read(2 * 64, &mut raw);
    let c: Cqe64 = bytemuck::cast(raw);
    assert_eq!(
        c.op_own,
        5 << 4 | owner_bit(2, 4),
        "RESIZE CQE in the old ring"
    );
    write(&mut p.ea.ini, 2);
    let t = Instant::now();
    while scq.produced() < 4 {
        assert!(t.elapsed() < T);
        std::thread::yield_now();
    }
    ring.read(3 * 64, &mut raw);
    let c: Cqe64 = bytemuck::cast(raw);
    assert_eq!(c.owner(), owner_bit(3, 16));
    assert!(
        matches!(c.decode(), Completion::Req { wqe_opcode: 8, .. }),
        "{:?}",
        c.decode()
    );
}

#[test]
fn cq_overrun_raises_cq_error_and_qp_fatal() {
    let p = Pair::with(
        Opts {
            ncqe: 2,
            cq_mode: CqMode::OverrunDetect,
            ..Opts::default()
        },
        Opts::default(),
    );
    let mut p = p;
    let (cq_ev, h) = recorder();
    p.ea.scq.set_event_handler(Some(h));
    let (qp_ev, h) = recorder();
    p.ea.qp.set_event_handler(Some(h));
    let src = p.a.buf(64, RW);
    let dst = p.b.buf(64, RW);
    for _ in 0..3 {
        let sge = [src.sge(0, 8)];
        p.ea.ini
            .post(
                &Op::Write {
                    remote: dst.remote(0),
                    local: Local::Sges(&sge),
                    imm: None,
                },
                CtrlFlags::SIGNALED,
            )
            .unwrap();
    }
    p.ea.ini.ring();
    wait_for(&cq_ev, AsyncEvent::CqError);
    wait_for(&qp_ev, AsyncEvent::QpFatal);
    assert_eq!(p.ea.qp.state(), softnic::QpState::Err);
}
