//! Smoke test: two soft devices, one RC connection, a signaled RDMA_WRITE.

use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr, Sge};
use prm::{Completion, Lkey, Rkey};
use softnic::initiator::{Initiator, RingMode};
use softnic::*;
use std::time::Duration;

#[test]
fn write_between_two_devices() {
    let a = Device::open(DeviceConfig::default()).unwrap();
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
    let src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    // SAFETY: both buffers outlive the devices' use of them (devices dropped at the end).
    let (ma, mb) = unsafe {
        (
            a.reg_host(pa, src.as_ptr() as u64, 4096, Access::LOCAL_WRITE)
                .unwrap(),
            b.reg_host(
                pb,
                dst.as_mut_ptr() as u64,
                4096,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
            .unwrap(),
        )
    };
    for (q, peer, dev) in [(&qa, &qb, &b), (&qb, &qa, &a)] {
        q.modify(Modify::Init {
            access: Access::REMOTE_WRITE,
        })
        .unwrap();
        q.modify(Modify::Rtr(RtrAttr {
            remote_gid: dev.gid(),
            remote_qpn: peer.qpn(),
            rq_psn: 0,
            mtu: 4096,
            min_rnr_timer: 1,
            selective_repeat: false,
        }))
        .unwrap();
        q.modify(Modify::Rts(RtsAttr::default())).unwrap();
    }
    let mut ini = Initiator::for_soft_qp(&a, &qa, RingMode::RdmaCore);
    let op = Op::Write {
        remote: RemoteAddr {
            addr: dst.as_ptr() as u64,
            rkey: Rkey(mb.key),
        },
        local: Local::Sges(&[Sge {
            addr: src.as_ptr() as u64,
            len: 4096,
            lkey: Lkey(ma.key),
        }]),
        imm: None,
    };
    ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
    let c = ini.wait_send(Duration::from_secs(5)).unwrap();
    assert!(
        matches!(
            c,
            Completion::Req {
                wqe_opcode: 0x08,
                wqe_counter: 0,
                ..
            }
        ),
        "{c:?}"
    );
    assert!(dst.iter().all(|&x| x == 7));
    assert_eq!(a.counters().bytes_moved, 4096);
}
