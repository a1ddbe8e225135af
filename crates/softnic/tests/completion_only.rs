//! Completion-only mode: every WQE is checked and completed, no payload moves.

use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr, Sge};
use prm::{Completion, Lkey, Rkey, Syndrome};
use softnic::initiator::{Initiator, RingMode};
use softnic::*;
use std::time::Duration;

#[test]
fn completes_without_moving_bytes_and_still_checks_keys() {
    let cfg = DeviceConfig {
        completion_only: true,
        ..Default::default()
    };
    let a = Device::open(cfg).unwrap();
    let b = Device::open(DeviceConfig::default()).unwrap();
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let mk = |d: &Device, pd| {
        let cq = d
            .create_cq(CqConfig {
                ncqe: 64,
                ..Default::default()
            })
            .unwrap();
        d.create_qp(QpConfig::new(pd, cq.clone(), cq)).unwrap()
    };
    let (qa, qb) = (mk(&a, pa), mk(&b, pb));
    let src = [7u8; 64];
    let mut dst = [0u8; 64];
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    // SAFETY: both buffers outlive the devices (dropped at the end of the test).
    let (ma, mb) = unsafe {
        (
            a.reg_host(pa, src.as_ptr() as u64, 64, Access::NONE)
                .unwrap(),
            b.reg_host(pb, dst.as_mut_ptr() as u64, 64, all).unwrap(),
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
    let mut ini = Initiator::for_soft_qp(&a, &qa, RingMode::Doca);
    let local = [Sge {
        addr: src.as_ptr() as u64,
        len: 64,
        lkey: Lkey(ma.key),
    }];
    let remote = RemoteAddr {
        addr: dst.as_ptr() as u64,
        rkey: Rkey(mb.key),
    };
    let w = Op::Write {
        remote,
        local: Local::Sges(&local),
        imm: None,
    };
    ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
    let fa = Op::FetchAdd {
        remote,
        add: 1,
        result: Sge {
            addr: src.as_ptr() as u64,
            len: 8,
            lkey: Lkey(ma.key),
        },
    };
    let c = ini.wait_send(Duration::from_secs(5)).unwrap();
    assert!(
        matches!(
            c,
            Completion::Req {
                wqe_opcode: 0x08,
                ..
            }
        ),
        "{c:?}"
    );
    assert!(dst.iter().all(|&x| x == 0), "completion-only moved bytes");
    // An atomic needs LOCAL_WRITE on its result buffer: the check still happens.
    ini.post_and_ring(&fa, CtrlFlags::SIGNALED).unwrap();
    match ini.wait_send(Duration::from_secs(5)).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome(), Some(Syndrome::LocalProt)),
        c => panic!("{c:?}"),
    }
    assert!(dst.iter().all(|&x| x == 0));
}
