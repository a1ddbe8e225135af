//! Teardown under a running device: what is freed, deregistered or destroyed is never touched
//! again by the device's threads (engines, the wire I/O thread, a peer's in-process
//! requester). Each test frees memory the moment the API says it may, while the device is
//! busy with it; under AddressSanitizer (`cargo xtask sanitize`) any later access is a
//! use-after-free report, and each test also checks, without a sanitizer, that the device did
//! nothing more with the object.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op, RemoteAddr};
use prm::{Rkey, Syndrome};
use softnic::initiator::Initiator;
use softnic::wire::packet::{self, opcode};
use softnic::*;
use std::alloc::Layout;
use std::net::{Ipv4Addr, UdpSocket};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wire_util::*;

/// Memory the test frees itself, as a verbs provider frees a QP's rings right after
/// DESTROY_QP returns.
struct Raw {
    p: NonNull<u8>,
    layout: Layout,
}

impl Raw {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size.
        let p = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).unwrap();
        Self { p, layout }
    }
    /// A device view of the memory, owning nothing.
    fn buf(&self) -> DmaBuf {
        // SAFETY: the memory is valid until `self` drops; every test destroys the object it
        // gave the view to (destroy_qp / destroy_cq, which fence the device) and drops every
        // initiator over it before dropping `self`.
        unsafe { DmaBuf::from_external(self.p, self.layout.size(), Box::new(())) }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.p.as_ptr(), self.layout) }
    }
}

/// A CQ whose ring and doorbell record are `Raw` memory.
fn raw_cq(n: &Node, ncqe: u32) -> (Arc<Cq>, Raw, Raw) {
    let (ring, rec) = (Raw::new(ncqe as usize * 64), Raw::new(4096));
    let cq = n
        .dev
        .create_cq(CqConfig {
            ncqe,
            ring: Some(ring.buf()),
            dbrec: Some(rec.buf()),
            ..Default::default()
        })
        .unwrap();
    (cq, ring, rec)
}

/// An RC QP whose rings, doorbell record and CQs are all `Raw` memory, with its initiator.
struct RawQp {
    ini: Initiator,
    qp: Arc<Qp>,
    cqs: [Arc<Cq>; 2],
    mem: Vec<Raw>,
}

impl Drop for RawQp {
    fn drop(&mut self) {
        // Not destroyed (a failing test unwinds): the device may still run the QP, so its
        // memory is leaked rather than freed under it.
        std::mem::forget(std::mem::take(&mut self.mem));
    }
}

impl RawQp {
    fn new(n: &Node, sq_blocks: u32, rq_wqes: u32) -> Self {
        // room for a flush CQE per WQE of a full ring
        let (scq, m1, m2) = raw_cq(n, sq_blocks.max(1024));
        let (rcq, m3, m4) = raw_cq(n, rq_wqes.max(1024));
        let (sq, rq, rec) = (
            Raw::new(sq_blocks as usize * 64),
            Raw::new(rq_wqes as usize * 16),
            Raw::new(4096),
        );
        let mut cfg = QpConfig::new(n.pd, scq.clone(), rcq.clone());
        cfg.sq_blocks = sq_blocks;
        cfg.rq_wqes = rq_wqes;
        cfg.sq_ring = Some(sq.buf());
        cfg.rq_ring = Some(rq.buf());
        cfg.dbrec = Some(rec.buf());
        let qp = n.dev.create_qp(cfg).unwrap();
        let ini = Initiator::for_soft_qp(&n.dev, &qp, softnic::initiator::RingMode::RdmaCore);
        Self {
            ini,
            qp,
            cqs: [scq, rcq],
            mem: vec![m1, m2, m3, m4, sq, rq, rec],
        }
    }

    /// Destroys the QP and its CQs, drops the initiator and frees every ring at once, as a
    /// provider does; returns the device's counters as they were when `destroy_qp` returned
    /// (read without taking any lock of the QP's, which would wait for its engine).
    fn destroy_and_free(mut self, n: &Node) -> (Arc<Qp>, CounterSnapshot) {
        let mem = std::mem::take(&mut self.mem);
        let qp = self.qp.clone();
        let cqs = self.cqs.clone();
        drop(self);
        n.dev.destroy_qp(&qp);
        let at = n.dev.counters();
        for cq in &cqs {
            n.dev.destroy_cq(cq).unwrap();
        }
        drop(mem);
        (qp, at)
    }
}

fn connect_raw(a: &RawQp, na: &Node, b: &Arc<Qp>, nb: &Node) {
    let o = Opts::default();
    for (q, peer, peer_node) in [(&a.qp, b, nb), (b, &a.qp, na)] {
        q.modify(Modify::Init { access: o.access }).unwrap();
        q.modify(Modify::Rtr(RtrAttr {
            remote_gid: peer_node.dev.gid(),
            remote_qpn: peer.qpn(),
            rq_psn: 0,
            mtu: 4096,
            min_rnr_timer: 1,
            selective_repeat: false,
        }))
        .unwrap();
        q.modify(Modify::Rts(o.rts)).unwrap();
    }
}

#[test]
fn destroy_qp_returns_only_when_the_engine_has_left_the_rings_it_was_running() {
    let (a, b) = (Node::new(), Node::new());
    let mut ra = RawQp::new(&a, 16384, 16);
    let eb = RawQp::new(&b, 64, 16);
    connect_raw(&ra, &a, &eb.qp, &b);
    let src = a.buf(4096, Access::NONE);
    let dst = b.buf(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    src.fill(0x5a);
    // a ring of 4 KiB writes, one CQE per 128: milliseconds of work for the engine
    let n = 16000u32;
    for i in 0..n {
        let op = Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 4096)]),
            imm: None,
        };
        ra.ini.post(&op, flags(i % 128 == 127)).unwrap();
    }
    ra.ini.ring();
    wait_until("the engine to start on the ring", || {
        ra.qp.sq_consumer() != 0
    });
    let (qa, at) = ra.destroy_and_free(&a);
    assert!(
        at.wqes_executed < n as u64,
        "the engine ran the whole ring before the destroy"
    );
    std::thread::sleep(Duration::from_millis(50));
    let now = a.dev.counters();
    assert_eq!(
        (now.wqes_executed, now.cqes_written),
        (at.wqes_executed, at.cqes_written),
        "the engine went on after destroy_qp"
    );
    assert!(qa.is_destroyed());
    // a destroyed QP takes no transition
    assert!(qa
        .modify(Modify::Init {
            access: Access::NONE
        })
        .is_err());
    assert_eq!(dst.read(0, 4096), vec![0x5a; 4096]);
    eb.destroy_and_free(&b);
}

#[test]
fn a_responder_destroyed_under_a_stream_of_sends_is_not_touched_again_and_its_peer_times_out() {
    let (a, b) = (Node::new(), Node::new());
    let mut ea = RawQp::new(&a, 4096, 16);
    let mut rb = RawQp::new(&b, 64, 1024);
    connect_raw(&ea, &a, &rb.qp, &b);
    let src = a.buf(64, Access::NONE);
    let dst = b.buf(64, Access::LOCAL_WRITE);
    for _ in 0..1023 {
        rb.ini.post_recv(&[dst.sge(0, 64)]).unwrap();
    }
    // more SENDs than receives: the stream is still running when the responder goes
    for i in 0..4000u32 {
        let op = Op::Send {
            local: Local::Sges(&[src.sge(0, 64)]),
            imm: None,
        };
        ea.ini.post(&op, flags(i % 128 == 127)).unwrap();
    }
    ea.ini.ring();
    wait_until("receives to be taken", || rb.qp.rq_consumer() != 0);
    let (qb, at) = rb.destroy_and_free(&b);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        b.dev.counters().cqes_written,
        at.cqes_written,
        "a receive completed after destroy_qp"
    );
    assert!(qb.is_destroyed());
    // the requester finds no answer any more: its transport timer ends the stream
    let deadline = Instant::now() + T;
    let failed = loop {
        match ea.ini.poll_send() {
            Some(prm::Completion::Error(e)) => break e,
            Some(_) => {}
            None => {
                assert!(Instant::now() < deadline, "no error completion");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    assert_eq!(failed.syndrome(), Some(Syndrome::TransportRetryExc));
    ea.destroy_and_free(&a);
}

/// A wire node, a UDP socket that never answers, a QP that sends to it and a 256-byte source
/// holding `fill`, whose WRITE the QP has posted (its index returned): the requester resends
/// it until its retries run out.
fn resending(fill: &[u8]) -> (Node, UdpSocket, Ep, Buf, u16) {
    let a = wire_node(WireFaults::default());
    let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
    peer.set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let mut ep = silent_peer_qp(&a, &peer);
    let src = a.buf(256, Access::NONE);
    src.write(0, fill);
    let i = ep.go(
        &Op::Write {
            remote: RemoteAddr {
                addr: 0x1000,
                rkey: Rkey(0x1234),
            },
            local: Local::Sges(&[src.sge(0, 256)]),
            imm: None,
        },
        SIG,
    );
    (a, peer, ep, src, i)
}

/// A wire node whose only QP sends to `peer`, a UDP socket that never answers.
fn silent_peer_qp(a: &Node, peer: &UdpSocket) -> Ep {
    let gid = Gid::from_ipv4(Ipv4Addr::LOCALHOST);
    a.dev.add_peer(gid, peer.local_addr().unwrap()).unwrap();
    let mut o = go_back_n_opts();
    // 16 ms ACK timeout, 7 retries: resends for about 130 ms
    o.rts.timeout = 12;
    o.rts.retry_cnt = 7;
    let ep = endpoint(a, &o);
    bring_up_to(&ep.qp, &o, gid, 0x77, 0, 1024);
    ep
}

/// The payload of the next WRITE_ONLY datagram at `peer`.
fn next_write(peer: &UdpSocket) -> Vec<u8> {
    let mut buf = [0u8; 2048];
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < Duration::from_secs(5), "no datagram");
        let Ok((n, _)) = peer.recv_from(&mut buf) else {
            continue;
        };
        let k = packet::parse(&buf[..n]).unwrap();
        if k.bth.opcode == opcode::WRITE_ONLY {
            return k.payload.to_vec();
        }
    }
}

#[test]
fn a_buffer_dropped_while_the_requester_resends_from_it_stays_the_devices_until_its_region_goes() {
    let _s = serial();
    let pattern: Vec<u8> = (0..256u32).map(|i| (i * 7 + 3) as u8).collect();
    let (a, peer, ep, src, _) = resending(&pattern);
    assert_eq!(next_write(&peer), pattern);
    // the test's handle goes; the region keeps the memory, and the resends read it
    drop(src);
    assert_eq!(next_write(&peer), pattern, "a resend after the drop");
    assert_eq!(next_write(&peer), pattern, "and another");
    a.dev.destroy_qp(&ep.qp);
}

#[test]
fn a_region_deregistered_under_resends_fails_its_wqe_with_a_local_protection_error() {
    let _s = serial();
    let (a, peer, mut ep, src, i) = resending(&[0x42; 256]);
    assert_eq!(next_write(&peer), vec![0x42; 256]);
    a.dev.dereg(src.mr.key).unwrap();
    // the next resend finds no region: the WQE fails as a ConnectX fails it
    match ep.send_cqe() {
        prm::Completion::Error(e) => {
            assert_eq!(e.syndrome(), Some(Syndrome::LocalProt), "{e}");
            assert_eq!((e.wqe_opcode, e.wqe_counter), (0x08, i));
        }
        c => panic!("{c:?}"),
    }
    assert_eq!(ep.qp.state(), QpState::Err);
    a.dev.destroy_qp(&ep.qp);
}
