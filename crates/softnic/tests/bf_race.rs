//! BlueFlame writers far ahead of the engine: a register half the engine is copying may be
//! rewritten under it. The copy must never mix two WQEs (every write lands where it belongs).

use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr, Sge};
use prm::{Completion, Lkey, Rkey};
use softnic::initiator::{Initiator, RingMode};
use softnic::*;
use std::time::Duration;

#[test]
fn blueflame_copies_are_never_torn() {
    let a = Device::open(DeviceConfig::default()).unwrap();
    let b = Device::open(DeviceConfig::default()).unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cqa = a
        .create_cq(CqConfig {
            ncqe: 1024,
            ..Default::default()
        })
        .unwrap();
    let cqb = b
        .create_cq(CqConfig {
            ncqe: 64,
            ..Default::default()
        })
        .unwrap();
    let mut cfg = QpConfig::new(pa, cqa.clone(), cqa);
    cfg.sq_blocks = 1024;
    cfg.doorbell = DoorbellMode::BlueFlame;
    let qa = a.create_qp(cfg).unwrap();
    let qb = b.create_qp(QpConfig::new(pb, cqb.clone(), cqb)).unwrap();
    const N: usize = 20_000;
    const SLOTS: usize = 512;
    let src: Vec<u64> = (0..N as u64).map(|i| i * 0x1_0001 + 1).collect();
    let dst = vec![0u64; SLOTS];
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    // SAFETY: both vectors outlive the devices' use of them (the test waits for every CQE).
    let (ma, mb) = unsafe {
        (
            a.reg_host(pa, src.as_ptr() as u64, (N * 8) as u64, Access::NONE)
                .unwrap(),
            b.reg_host(pb, dst.as_ptr() as u64, (SLOTS * 8) as u64, all)
                .unwrap(),
        )
    };
    for (q, peer, dev) in [(&qa, &qb, &b), (&qb, &qa, &a)] {
        q.modify(Modify::Init { access: all }).unwrap();
        let rtr = RtrAttr {
            remote_gid: dev.gid(),
            remote_qpn: peer.qpn(),
            rq_psn: 0,
            mtu: 4096,
            min_rnr_timer: 1,
            selective_repeat: false,
        };
        q.modify(Modify::Rtr(rtr)).unwrap();
        q.modify(Modify::Rts(RtsAttr::default())).unwrap();
    }
    let mut ini = Initiator::for_soft_qp(&a, &qa, RingMode::BlueFlame);
    let mut done = 0;
    for i in 0..N {
        let op = Op::Write {
            remote: RemoteAddr {
                addr: dst.as_ptr() as u64 + ((i % SLOTS) * 8) as u64,
                rkey: Rkey(mb.key),
            },
            local: Local::Sges(&[Sge {
                addr: src.as_ptr() as u64 + (i * 8) as u64,
                len: 8,
                lkey: Lkey(ma.key),
            }]),
            imm: None,
        };
        let flags = if i % 16 == 15 || i + 1 == N {
            CtrlFlags::SIGNALED
        } else {
            CtrlFlags::default()
        };
        // Ring after every WQE: each ring is a BlueFlame write, alternating halves.
        while ini.post_and_ring(&op, flags).is_err() {
            let c = ini.wait_send(Duration::from_secs(10)).unwrap();
            assert!(matches!(c, Completion::Req { .. }), "{c:?}");
            done += 1;
        }
    }
    while ini.outstanding() > 0 {
        let c = ini.wait_send(Duration::from_secs(10)).unwrap();
        assert!(matches!(c, Completion::Req { .. }), "{c:?}");
        done += 1;
    }
    assert!(done > 0);
    for (slot, &v) in dst.iter().enumerate() {
        let last = (N - 1 - slot) / SLOTS * SLOTS + slot;
        // The device is done: every WQE completed.
        assert_eq!(
            v, src[last],
            "slot {slot} holds a value other than its last write's"
        );
    }
    let c = a.counters();
    assert!(c.errors.is_empty(), "{c:?}");
    eprintln!(
        "WQEs run from register copies: {}, torn copies dropped: {}",
        c.bf_run, c.bf_torn
    );
}
