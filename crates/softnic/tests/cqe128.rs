//! QPs whose CQs have 128-byte entries (`CqeSize::B128`, what a CQ created with `cqe_sz` 1 or
//! mlx5dv's CQE_SIZE 128 is): every CQE the QPs produce — requester, responder, error and
//! flush — is the second half of its entry, with the owner bit of its lap; the first halves
//! (inline scatter, which the soft NIC does not do) are never written. The CPU initiator
//! polls 64-byte CQEs only, so WQEs are posted through one whose CQ pollers look at rings
//! of their own, and the 128-byte rings are read here.

mod common;

use common::*;
use prm::cqe::sw_owns;
use prm::wqe::{CtrlFlags, Local, Op};
use prm::{Cqe64, Syndrome};
use softnic::initiator::{CqGeometry, Initiator, RingMode, RqGeometry, SqGeometry};
use softnic::*;
use std::sync::Arc;

const NCQE: u32 = 4;
const SENTINEL: [u8; 64] = [0xab; 64];

struct Side {
    qp: Arc<Qp>,
    scq: Arc<Cq>,
    rcq: Arc<Cq>,
    ini: Initiator,
    /// The rings the initiator's (unused) pollers look at.
    _dummy: [DmaBuf; 2],
}

fn cq128(n: &Node) -> Arc<Cq> {
    let cq = n
        .dev
        .create_cq(CqConfig {
            ncqe: NCQE,
            cqe_size: CqeSize::B128,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(cq.cqe_size(), CqeSize::B128);
    for i in 0..NCQE as usize {
        cq.ring().write(i * 128, &SENTINEL);
    }
    cq
}

fn side(n: &Node) -> Side {
    let (scq, rcq) = (cq128(n), cq128(n));
    let qp = n
        .dev
        .create_qp(QpConfig::new(n.pd, scq.clone(), rcq.clone()))
        .unwrap();
    // the CPU initiator refuses 128-byte CQs (its pollers read 64-byte CQEs)
    assert!(Initiator::try_for_soft_qp(&n.dev, &qp, RingMode::RdmaCore).is_err());
    let dummy = [DmaBuf::alloc(4096), DmaBuf::alloc(4096)];
    for d in &dummy {
        for i in 0..64 {
            d.write(i * 64 + 63, &[0xf0]);
        }
    }
    let ctrl = qp.ctrl_page().as_ptr();
    // SAFETY: offsets inside the QP's own pages.
    let (dbrec, bf) = unsafe {
        (
            ctrl.add(qp.dbrec_offset()),
            qp.uar().as_ptr().add(prm::doorbell::BF_OFFSET),
        )
    };
    let cq_geom = |d: &DmaBuf| CqGeometry {
        ring: d.as_ptr(),
        ncqe: 64,
        dbrec: d.as_ptr().wrapping_add(4096 - 64),
        collapsed: false,
    };
    // SAFETY: the SQ, RQ and doorbell pointers are the QP's, kept alive by the Arc handed
    // over; the CQ geometries are the dummy rings, which the Side keeps alive as long as the
    // initiator; nobody else posts to this QP.
    let ini = unsafe {
        Initiator::from_geometry(
            SqGeometry {
                ring: qp.sq_ring().as_ptr(),
                blocks: qp.sq_blocks(),
                dbrec,
                bf_reg: bf,
                qpn: qp.qpn(),
            },
            RqGeometry {
                ring: qp.rq_ring().as_ptr(),
                wqes: qp.rq_wqes(),
                stride: qp.rq_stride(),
                dbrec,
            },
            cq_geom(&dummy[0]),
            cq_geom(&dummy[1]),
            RingMode::RdmaCore,
            qp.clone(),
            None,
        )
    };
    Side {
        qp,
        scq,
        rcq,
        ini,
        _dummy: dummy,
    }
}

fn up(q: &Qp, peer: &Node, peer_qpn: u32) {
    let all = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    q.modify(Modify::Init { access: all }).unwrap();
    q.modify(Modify::Rtr(RtrAttr {
        remote_gid: peer.dev.gid(),
        remote_qpn: peer_qpn,
        rq_psn: 0,
        mtu: 4096,
        min_rnr_timer: 1,
        selective_repeat: false,
    }))
    .unwrap();
    q.modify(Modify::Rts(RtsAttr {
        sq_psn: 0,
        timeout: 10,
        retry_cnt: 3,
        rnr_retry: 7,
    }))
    .unwrap();
}

/// Waits for CQE `i` of a 128-byte CQ and returns it, checking its entry: the CQE in the
/// second half with lap `i / NCQE`'s owner bit, the first half untouched.
fn cqe(n: &Node, cq: &Cq, i: u32) -> Cqe64 {
    n.dev.kick();
    wait_until("CQE", || cq.produced() > i);
    let slot = (i % NCQE) as usize;
    let mut e = [0u8; 128];
    cq.ring().read(slot * 128, &mut e);
    assert_eq!(e[..64], SENTINEL, "CQE {i}: first half written");
    let c: Cqe64 = bytemuck::pod_read_unaligned(&e[64..]);
    assert!(sw_owns(c.op_own, i, NCQE), "CQE {i}: owner {:#x}", c.op_own);
    assert_eq!(c.op_own & 0x0c, 0, "CQE {i}: inline-scatter bits");
    c
}

#[test]
fn every_cqe_of_a_qp_lands_in_the_second_half_of_its_128_byte_entry() {
    let (na, nb) = (Node::new(), Node::new());
    let (mut a, mut b) = (side(&na), side(&nb));
    up(&a.qp, &nb, b.qp.qpn());
    up(&b.qp, &na, a.qp.qpn());
    let src = na.buf(4096, Access::NONE);
    let dst = nb.buf(
        4096,
        Access::REMOTE_WRITE | Access::REMOTE_READ | Access::LOCAL_WRITE,
    );
    let sig = CtrlFlags::SIGNALED;
    // requester CQEs over more than two laps of the 4-entry ring
    for i in 0..10u32 {
        src.write(0, &[i as u8; 64]);
        let idx = a
            .ini
            .post_and_ring(
                &Op::Write {
                    remote: dst.remote(i as usize * 64),
                    local: Local::Sges(&[src.sge(0, 64)]),
                    imm: None,
                },
                sig,
            )
            .unwrap();
        let c = cqe(&na, &a.scq, i);
        assert_eq!(c.opcode(), 0, "CQE {i}");
        assert_eq!(c.wqe_counter.get(), idx);
        assert_eq!(c.sop_drop_qpn.get(), 0x08 << 24 | a.qp.qpn());
        assert_eq!(dst.read(i as usize * 64, 64), [i as u8; 64]);
    }
    // a responder CQE (SEND_IMM) in b's receive CQ
    let rq = b.ini.post_recv(&[dst.sge(0, 1024)]).unwrap();
    nb.dev.kick();
    a.ini
        .post_and_ring(
            &Op::Send {
                local: Local::Sges(&[src.sge(0, 100)]),
                imm: Some(0x1122_3344),
            },
            sig,
        )
        .unwrap();
    let c = cqe(&na, &a.scq, 10);
    assert_eq!(c.opcode(), 0);
    let r = cqe(&nb, &b.rcq, 0);
    assert_eq!(r.opcode(), 3, "RESP_SEND_IMM");
    assert_eq!(r.byte_cnt.get(), 100);
    assert_eq!(r.wqe_counter.get(), rq);
    assert_eq!(r.imm_inval_pkey.get(), 0x1122_3344);
    // an error CQE (bad lkey: LOCAL_PROT), then a flush of the next WQE, in later entries
    let bad = prm::Sge {
        lkey: prm::Lkey(src.lkey().0 ^ 0x100),
        ..src.sge(0, 64)
    };
    let e1 = a
        .ini
        .post(
            &Op::Write {
                remote: dst.remote(0),
                local: Local::Sges(&[bad]),
                imm: None,
            },
            sig,
        )
        .unwrap();
    let e2 = a.ini.post_and_ring(&Op::Nop, sig).unwrap();
    let c = cqe(&na, &a.scq, 11);
    assert_eq!(c.opcode(), 13, "REQ_ERR");
    let raw = bytemuck::bytes_of(&c);
    assert_eq!(raw[55], Syndrome::LocalProt as u8);
    assert_eq!(c.wqe_counter.get(), e1);
    let c = cqe(&na, &a.scq, 12);
    assert_eq!(c.opcode(), 13);
    assert_eq!(bytemuck::bytes_of(&c)[55], Syndrome::WrFlush as u8);
    assert_eq!(c.wqe_counter.get(), e2);
}
