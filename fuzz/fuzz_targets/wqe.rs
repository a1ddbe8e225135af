//! The WQE path: any bytes as one send WQE (up to 16 blocks) in the SQ ring of a connected QP
//! pair (two soft NICs in process), rung with a doorbell. The oracle: the WQE completes (a CQE,
//! success or error) within a bound, or it is a WAIT whose CQ count is never reached (the SQ
//! stalls, as on a ConnectX); never a panic; nothing written outside the registered buffers
//! (guard memory on both sides of each; AddressSanitizer for the rest). The buffers are at
//! fixed addresses (`fixture.rs`), so seeds name them.
//!
//! Input: a control byte, then the WQE. Control bit 0 clear: the harness writes the WQE index
//! and the QPN into the control segment (so the WQE is not refused as stale); set: the bytes
//! stay as given. The control segment always asks for a CQE. The fixture is fresh for each
//! input, so keys, QPNs and addresses are the same in every run (the seeds name them).
//!
//! Bit 1: the bytes are B's receive WQE instead (its scatter list, over the receive the
//! fixture posted), and A sends a valid 64-byte SEND into it: both sides complete (the
//! receive with success or an error CQE) within the bound, guards intact. Bit 2: the
//! doorbells are forged: after the WQE is written, A's SQ producer (doorbell record and
//! register) and B's RQ head are set from the last four input bytes instead of the right
//! values, so the device meets producer jumps over stale or empty ring slots; the oracle is
//! then no panic, no hang (the devices stop within the fixture's drop), guards intact. Bit 3:
//! the bytes are the ring of an SRQ of 16 WQEs on B (next-WQE segments, scatter lists; its
//! doorbell counter from the last four input bytes) that B's QP takes receives from, and a
//! valid 64-byte SEND arrives: the sender completes (success, or the error the responder's
//! NAK names: RNR with no retries when the SRQ looks empty) within the bound, guards intact. Bit 4:
//! the bytes are a DC initiator's WQE (its address vector after the control segment) on A, and
//! B holds a DC target; bit 5 also writes the target's key, number and GID into the vector, so
//! the WQE reaches it. The WQE completes (success or error) within the bound, guards intact.
//! Bit 6: the bytes are an XRC initiator's WQE (its XRC segment after the control segment) on
//! A, connected to an XRC target on B whose domain holds an XRC SRQ with one receive posted;
//! bit 5 also writes that SRQ's number into the XRC segment, so the WQE reaches it. The WQE
//! completes (success or error) within the bound, guards intact.
#![no_main]

#[path = "../../crates/softnic/tests/common/mod.rs"]
mod common;
mod fixture;
#[path = "../../crates/softnic/tests/wire_util/mod.rs"]
mod wire_util;

use fixture::Fixture;
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use std::time::Duration;

/// A WQE that neither completes nor stalls on a WAIT within this is a hang.
const BOUND: Duration = Duration::from_secs(5);
/// How long a WAIT is given to complete before it counts as stalled.
const WAIT_BOUND: Duration = Duration::from_millis(50);
const MAX_BLOCKS: usize = 16;
const WAIT: u8 = 0x0f;

fuzz_target!(|d: &[u8]| {
    let Some((&ctl, body)) = d.split_first() else {
        return;
    };
    if ctl & 64 != 0 {
        return xrc_wqe(body, ctl & 32 != 0);
    }
    if ctl & 16 != 0 {
        return dc_wqe(body, ctl & 32 != 0);
    }
    if ctl & 8 != 0 {
        return srq_receive(body);
    }
    if ctl & 2 != 0 {
        return receive(body);
    }
    let blocks = body.len().div_ceil(64).clamp(1, MAX_BLOCKS);
    let mut w = vec![0u8; blocks * 64];
    let n = body.len().min(w.len());
    w[..n].copy_from_slice(&body[..n]);

    let mut f = Fixture::local();
    let p = &mut f.p;
    let idx = p.ea.ini.producer();
    if ctl & 1 == 0 {
        w[1..3].copy_from_slice(&idx.to_be_bytes());
        w[4..7].copy_from_slice(&p.ea.qpn().to_be_bytes()[1..]);
    }
    w[11] |= 0x08;
    let opcode = w[3];
    p.ea.post_raw(&w);
    if ctl & 4 != 0 {
        let tail = |i: usize| body.len().checked_sub(i).map_or(0, |k| body[k]);
        let sq_pi = u16::from_be_bytes([tail(4), tail(3)]);
        let rq_head = u16::from_be_bytes([tail(2), tail(1)]);
        forge_doorbells(&f, sq_pi, rq_head, &w);
        // whatever the device makes of it, within a bound: completions or nothing
        let _ = f.p.ea.ini.wait_send(WAIT_BOUND);
        f.finish();
        return;
    }
    p.ea.ini.ring();
    // a WAIT's CQ count may never be reached: it completes at once or stalls
    let bound = if opcode == WAIT { WAIT_BOUND } else { BOUND };
    if let Err(e) = p.ea.ini.wait_send(bound) {
        assert_eq!(opcode, WAIT, "no completion for opcode {opcode:#x}: {e:?}");
    }
    f.finish();
});

/// Writes `sq_pi` into A's doorbell record and rings A's doorbell register with it (the
/// first 8 bytes of the WQE, its index replaced), and `rq_head` into B's doorbell record.
fn forge_doorbells(f: &Fixture, sq_pi: u16, rq_head: u16, wqe: &[u8]) {
    use std::sync::atomic::Ordering::Release;
    let (a, b) = (&f.p.ea.qp, &f.p.eb.qp);
    a.ctrl_page()
        .atomic_u32(a.dbrec_offset() + 4)
        .store(u32::from(sq_pi).to_be(), Release);
    let mut db = [0u8; 8];
    db.copy_from_slice(&wqe[..8]);
    db[1..3].copy_from_slice(&sq_pi.to_be_bytes());
    a.uar()
        .atomic_u64(a.bf_offset())
        .store(u64::from_ne_bytes(db), Release);
    b.ctrl_page()
        .atomic_u32(b.dbrec_offset())
        .store(u32::from(rq_head).to_be(), Release);
}

/// `body` as B's receive WQE (over the one the fixture posted at slot 0), then a valid SEND
/// of 64 bytes from A's buffer 0 into it.
fn receive(body: &[u8]) {
    let mut f = Fixture::local();
    let stride = f.p.eb.qp.rq_stride() as usize;
    let mut w = vec![0u8; stride];
    let n = body.len().min(stride);
    w[..n].copy_from_slice(&body[..n]);
    f.p.eb.qp.rq_ring().write(0, &w);
    let sge = prm::wqe::Sge {
        addr: fixture::addr(0),
        len: 64,
        lkey: prm::Lkey(f.mrs[0].key),
    };
    let send = prm::wqe::Op::Send {
        local: prm::wqe::Local::Sges(&[sge]),
        imm: None,
    };
    f.p.ea.go(&send, common::SIG);
    // the sender completes (success, or the error the receiver's NAK names) ...
    let sent = f.p.ea.ini.wait_send(BOUND);
    assert!(sent.is_ok(), "no send completion: {sent:?}");
    // ... and so does the receive (its scatter succeeded or failed)
    let got = f.p.eb.ini.wait_recv(BOUND);
    assert!(got.is_ok(), "no receive completion: {got:?}");
    f.finish();
}

/// `body` as the ring of an SRQ on B (and, from its last four bytes, its doorbell counter),
/// B's QP on that SRQ, and a valid 64-byte SEND from A's buffer 0.
fn srq_receive(body: &[u8]) {
    use softnic::{Access, CqConfig, Modify, QpConfig, RtrAttr, RtsAttr, SrqConfig};
    let (a, b) = (common::Node::new(), common::Node::new());
    let m0 = fixture::register(&a.dev, a.pd, 0, Access::LOCAL_WRITE);
    fixture::register(&b.dev, b.pd, 3, Access::LOCAL_WRITE);
    let srq = b
        .dev
        .create_srq(SrqConfig::new(b.pd, 16, 2))
        .expect("an SRQ");
    let n = body.len().min(srq.ring().len());
    srq.ring().write(0, &body[..n]);
    let counter = match body.len() {
        k if k >= 4 => u32::from_be_bytes(body[k - 4..].try_into().expect("4 bytes")),
        _ => 1,
    };
    srq.dbrec()
        .atomic_u32(0)
        .store(counter.to_be(), std::sync::atomic::Ordering::Release);
    let cq = |d: &softnic::Device| {
        d.create_cq(CqConfig {
            ncqe: 64,
            ..Default::default()
        })
        .expect("a CQ")
    };
    let (ca, cb) = (cq(&a.dev), cq(&b.dev));
    let qa = a
        .dev
        .create_qp(QpConfig::new(a.pd, ca.clone(), ca))
        .expect("A's QP");
    let mut cfg = QpConfig::new(b.pd, cb.clone(), cb);
    cfg.rq_wqes = 0;
    let qb = b
        .dev
        .create_qp_on_srq(cfg, &srq)
        .expect("B's QP on the SRQ");
    let up = |q: &softnic::Qp, peer: &common::Node, peer_qpn: u32| {
        q.modify(Modify::Init {
            access: Access::REMOTE_WRITE,
        })
        .expect("INIT");
        q.modify(Modify::Rtr(RtrAttr {
            remote_gid: peer.dev.gid(),
            remote_qpn: peer_qpn,
            rq_psn: 0,
            mtu: 1024,
            min_rnr_timer: 1,
            selective_repeat: false,
        }))
        .expect("RTR");
        q.modify(Modify::Rts(RtsAttr {
            timeout: 1,
            retry_cnt: 0,
            rnr_retry: 0,
            ..Default::default()
        }))
        .expect("RTS");
    };
    up(&qa, &b, qb.qpn());
    up(&qb, &a, qa.qpn());
    let mut ini = <softnic::initiator::Initiator as softnic::SoftQpInitiator>::for_soft_qp(
        &a.dev,
        &qa,
        softnic::initiator::RingMode::RdmaCore,
    );
    let sge = prm::wqe::Sge {
        addr: fixture::addr(0),
        len: 64,
        lkey: prm::Lkey(m0.key),
    };
    let send = prm::wqe::Op::Send {
        local: prm::wqe::Local::Sges(&[sge]),
        imm: None,
    };
    ini.post_and_ring(&send, common::SIG).expect("post");
    let sent = ini.wait_send(BOUND);
    assert!(sent.is_ok(), "no send completion: {sent:?}");
    drop(ini);
    drop((qa, qb, srq, a, b));
    for i in [0, 3] {
        assert!(fixture::guards_intact(i), "a write outside buffer {i}");
    }
}

/// The DC target's access key.
const DC_KEY: u64 = 0x0dc0_ffee_1234_5678;

/// `body` as the WQE of a DC initiator on A (index and QPN written by the harness), with a DC
/// target on B over buffer 3; `aim`: the address vector names the target with its key.
/// An XRC initiator on A, in RTS, connected in process to an XRC target on B; B's domain
/// holds an XRC SRQ (its own CQ, one receive over buffer 3).
fn xrc_pair(a: &common::Node, b: &common::Node) -> (common::Ep, Arc<softnic::Qp>, common::SwSrq) {
    use softnic::{CqConfig, Modify, QpConfig, RtrAttr, RtsAttr, SrqConfig, XrcSrqConfig};
    let cq = |d: &softnic::Device| {
        d.create_cq(CqConfig {
            ncqe: 64,
            ..Default::default()
        })
        .expect("a CQ")
    };
    let xrcd = b.dev.alloc_xrcd();
    let srq = b
        .dev
        .create_xrc_srq(
            SrqConfig::new(b.pd, 16, 1),
            XrcSrqConfig {
                xrcd: xrcd.clone(),
                cq: cq(&b.dev),
                user_index: None,
            },
        )
        .expect("an XRC SRQ");
    let mut sw = common::SwSrq::new(srq);
    sw.post(fixture::addr(3), fixture::LEN as u32, fixture_key(b, 3));
    let tgt = b.dev.create_xrc_tgt(&xrcd).expect("an XRC target");
    let ca = cq(&a.dev);
    let ini = a
        .dev
        .create_xrc_ini(QpConfig::new(a.pd, ca.clone(), ca.clone()))
        .expect("an XRC initiator");
    let up = |q: &softnic::Qp, peer: &common::Node, qpn: u32, access| {
        q.modify(Modify::Init { access }).expect("INIT");
        q.modify(Modify::Rtr(RtrAttr {
            remote_gid: peer.dev.gid(),
            remote_qpn: qpn,
            rq_psn: 0,
            mtu: 1024,
            min_rnr_timer: 1,
            selective_repeat: false,
        }))
        .expect("RTR");
        q.modify(Modify::Rts(RtsAttr {
            timeout: 1,
            retry_cnt: 0,
            rnr_retry: 0,
            ..Default::default()
        }))
        .expect("RTS");
    };
    up(&tgt, a, ini.qpn(), wire_util::ALL_REMOTE);
    up(&ini, b, tgt.qpn(), softnic::Access::NONE);
    let i = <softnic::initiator::Initiator as softnic::SoftQpInitiator>::for_soft_qp(
        &a.dev,
        &ini,
        softnic::initiator::RingMode::RdmaCore,
    );
    let ep = common::Ep {
        ini: i,
        qp: ini,
        scq: ca.clone(),
        rcq: ca,
    };
    (ep, tgt, sw)
}

/// The lkey of fixture buffer `i` on node `n` (registered there).
fn fixture_key(n: &common::Node, i: usize) -> u32 {
    let all = wire_util::ALL_REMOTE;
    fixture::register(&n.dev, n.pd, i, all).key
}

/// Bit 6: the bytes as an XRC initiator's WQE (see the file's comment).
fn xrc_wqe(body: &[u8], aim: bool) {
    let (a, b) = (common::Node::new(), common::Node::new());
    fixture::register(&a.dev, a.pd, 0, wire_util::ALL_REMOTE);
    let (mut ep, tgt, srq) = xrc_pair(&a, &b);
    let blocks = body.len().div_ceil(64).clamp(1, MAX_BLOCKS);
    let mut w = vec![0u8; blocks * 64];
    let n = body.len().min(w.len());
    w[..n].copy_from_slice(&body[..n]);
    let idx = ep.ini.producer();
    w[1..3].copy_from_slice(&idx.to_be_bytes());
    w[4..7].copy_from_slice(&ep.qpn().to_be_bytes()[1..]);
    w[11] |= 0x08;
    if aim {
        w[16..20].copy_from_slice(&srq.srq.srqn().to_be_bytes());
    }
    let opcode = w[3];
    ep.post_raw(&w);
    ep.ini.ring();
    let bound = if opcode == WAIT { WAIT_BOUND } else { BOUND };
    if let Err(e) = ep.ini.wait_send(bound) {
        assert_eq!(
            opcode, WAIT,
            "no completion for XRC opcode {opcode:#x}: {e:?}"
        );
    }
    drop(ep);
    drop((tgt, srq, a, b));
    for i in [0, 3] {
        assert!(fixture::guards_intact(i), "a write outside buffer {i}");
    }
}

fn dc_wqe(body: &[u8], aim: bool) {
    use softnic::{Access, CqConfig, Modify, QpConfig, RtsAttr};
    let (a, b) = (common::Node::new(), common::Node::new());
    let all = Access(
        Access::LOCAL_WRITE.0
            | Access::REMOTE_WRITE.0
            | Access::REMOTE_READ.0
            | Access::REMOTE_ATOMIC.0,
    );
    fixture::register(&a.dev, a.pd, 0, all);
    fixture::register(&b.dev, b.pd, 3, all);
    let cq = |d: &softnic::Device| {
        d.create_cq(CqConfig {
            ncqe: 64,
            ..Default::default()
        })
        .expect("a CQ")
    };
    let dct = fixture::dc_target(&b, cq(&b.dev), DC_KEY);
    let rtr = Modify::RtrDc {
        mtu: 1024,
        min_rnr_timer: 1,
    };
    let ca = cq(&a.dev);
    let dci = a
        .dev
        .create_dci(QpConfig::new(a.pd, ca.clone(), ca.clone()))
        .expect("a DCI");
    dci.modify(Modify::Init {
        access: Access::NONE,
    })
    .expect("DCI INIT");
    dci.modify(rtr).expect("DCI RTR");
    dci.modify(Modify::Rts(RtsAttr {
        timeout: 1,
        retry_cnt: 0,
        rnr_retry: 0,
        ..Default::default()
    }))
    .expect("DCI RTS");
    let ini = <softnic::initiator::Initiator as softnic::SoftQpInitiator>::for_soft_qp(
        &a.dev,
        &dci,
        softnic::initiator::RingMode::RdmaCore,
    );
    let mut ep = common::Ep {
        ini,
        qp: dci,
        scq: ca.clone(),
        rcq: ca,
    };
    let blocks = body.len().div_ceil(64).clamp(1, MAX_BLOCKS);
    let mut w = vec![0u8; blocks * 64];
    let n = body.len().min(w.len());
    w[..n].copy_from_slice(&body[..n]);
    let idx = ep.ini.producer();
    w[1..3].copy_from_slice(&idx.to_be_bytes());
    w[4..7].copy_from_slice(&ep.qpn().to_be_bytes()[1..]);
    w[11] |= 0x08;
    if aim {
        // the address vector's key (0..8), DCT number (8..12) and GID (32..48)
        w[16..24].copy_from_slice(&DC_KEY.to_be_bytes());
        w[24..28].copy_from_slice(&(dct.qpn() | prm::wqe::EXTENDED_UD_AV).to_be_bytes());
        w[48..64].copy_from_slice(&b.dev.gid().0);
    }
    let opcode = w[3];
    ep.post_raw(&w);
    ep.ini.ring();
    let bound = if opcode == WAIT { WAIT_BOUND } else { BOUND };
    if let Err(e) = ep.ini.wait_send(bound) {
        assert_eq!(
            opcode, WAIT,
            "no completion for DC opcode {opcode:#x}: {e:?}"
        );
    }
    drop(ep);
    drop((dct, a, b));
    for i in [0, 3] {
        assert!(fixture::guards_intact(i), "a write outside buffer {i}");
    }
}
