//! Memory windows: type 1 and type 2 windows bound by UMR WQEs (as libmlx5 writes them), used
//! by peers in place of a region's rkey, invalidated locally (LOCAL_INV, a zero-length bind)
//! and remotely (SEND_WITH_INV), deallocated; every refusal a ConnectX makes (MW_BIND_ERR for
//! a bind, REMOTE_ACCESS for an access, REMOTE_INVAL_REQ for an invalidation). The same checks
//! run on the in-process path and over the wire.

mod common;
mod wire_util;

use common::*;
use prm::cqe::RespKind;
use prm::wqe::{Local, Op, Opcode, WindowBind, MKEY_ACCESS_REMOTE_READ, MKEY_ACCESS_REMOTE_WRITE};
use prm::{Completion, RemoteAddr, Rkey, Syndrome};
use softnic::outcome::vendor;
use softnic::*;
use wire_util::*;

const WINDOWED: Access = Access(ALL_REMOTE.0 | Access::MW_BIND.0);
const RW: u8 = MKEY_ACCESS_REMOTE_WRITE | MKEY_ACCESS_REMOTE_READ;
const UMR: u8 = Opcode::Umr as u8;

/// A type 2 bind of `len` bytes at `off` of `buf` on `ep`'s QP.
fn bind2(
    ep: &Ep,
    window: u32,
    variant: u8,
    buf: &Buf,
    off: usize,
    len: u32,
    access: u8,
) -> Op<'static> {
    Op::BindWindow(WindowBind {
        window,
        variant,
        qpn: Some(ep.qpn()),
        region: buf.sge(off, len),
        start: buf.addr(off),
        access,
    })
}

fn key_with(window: u32, variant: u8) -> u32 {
    (window & !0xff) | variant as u32
}

fn write_to(key: u32, addr: u64, data: &'static [u8]) -> Op<'static> {
    Op::Write {
        remote: RemoteAddr {
            addr,
            rkey: Rkey(key),
        },
        local: Local::Inline(data),
        imm: None,
    }
}

/// Binds, writes and reads through a type 2 window, invalidates it with SEND_WITH_INV and
/// checks that its key is dead afterwards. Runs on `p` (in-process or wire).
fn type2_round_trip(p: &mut Pair) {
    let target = p.b.buf(8192, WINDOWED);
    let src = p.a.buf(8192, ALL_REMOTE);
    let mw = p.b.dev.alloc_mw(p.b.pd, MwType::Two);
    let idx =
        p.eb.go(&bind2(&p.eb, mw, 0x11, &target, 1024, 4096, RW), SIG);
    assert_eq!(p.eb.expect_req(UMR, idx), 0);
    let key = key_with(mw, 0x11);
    assert_eq!(p.b.dev.mw(mw).unwrap().key, key);
    // WRITE through the window lands at its place in the region
    let idx = p.ea.go(
        &write_to(key, target.addr(1024 + 100), b"through the window"),
        SIG,
    );
    p.ea.expect_req(Opcode::RdmaWrite as u8, idx);
    assert_eq!(target.read(1124, 18), b"through the window");
    // a multi-packet READ through it
    target.write(2048, &[0x5a; 3000]);
    let read = Op::Read {
        remote: RemoteAddr {
            addr: target.addr(2048),
            rkey: Rkey(key),
        },
        local: &[src.sge(0, 3000)],
    };
    let idx = p.ea.go(&read, SIG);
    p.ea.expect_req(Opcode::RdmaRead as u8, idx);
    assert_eq!(src.read(0, 3000), vec![0x5a; 3000]);
    // SEND_WITH_INV: the receive completes as SEND_INV carrying the key, the window is free
    let rbuf = p.b.buf(64, Access::LOCAL_WRITE);
    p.eb.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
    src.write(0, b"invalidate!");
    let inv = Op::SendInvalidate {
        local: Local::Sges(&[src.sge(0, 11)]),
        rkey: key,
    };
    let idx = p.ea.go(&inv, SIG);
    p.ea.expect_req(Opcode::SendInval as u8, idx);
    match p.eb.recv_cqe() {
        Completion::Resp {
            kind,
            imm,
            byte_cnt,
            ..
        } => assert_eq!((kind, imm, byte_cnt), (RespKind::SendInv, Some(key), 11)),
        c => panic!("{c:?}"),
    }
    assert_eq!(rbuf.read(0, 11), b"invalidate!");
    assert_eq!(p.b.dev.mw(mw).unwrap().bound, None);
    // the key is dead now
    let idx = p.ea.go(&write_to(key, target.addr(1024), b"late"), SIG);
    p.ea.expect_err(
        Syndrome::RemoteAccess,
        vendor::REMOTE_KEY,
        Opcode::RdmaWrite as u8,
        idx,
    );
    assert_eq!(target.read(1024, 4), [0; 4]);
    assert!(target.guards_intact() && src.guards_intact());
}

#[test]
fn type2_window_in_process() {
    type2_round_trip(&mut Pair::new());
}

#[test]
fn type2_window_over_the_wire() {
    let _serial = serial();
    for mtu in [1024, 4096] {
        let mut p = wire_pair(
            wire_opts(),
            wire_opts(),
            mtu,
            WireFaults::default(),
            WireFaults::default(),
        );
        type2_round_trip(&mut p);
        let (ca, cb) = (p.a.dev.counters(), p.b.dev.counters());
        assert!(ca.wire.tx_packets > 0 && cb.wire.rx_packets > 0);
        assert_eq!(ca.wire.rx_malformed + cb.wire.rx_malformed, 0);
    }
}

/// Accesses a window refuses: outside its range, a right it was not given, through another
/// QP than the one it is bound to.
#[test]
fn window_checks_range_rights_and_qp() {
    let mut p = Pair::new();
    let target = p.b.buf(8192, WINDOWED);
    let mw = p.b.dev.alloc_mw(p.b.pd, MwType::Two);
    let idx = p.eb.go(
        &bind2(&p.eb, mw, 1, &target, 0, 256, MKEY_ACCESS_REMOTE_READ),
        SIG,
    );
    p.eb.expect_req(UMR, idx);
    let key = key_with(mw, 1);
    // a write through a read-only window
    let idx = p.ea.go(&write_to(key, target.addr(0), b"no"), SIG);
    p.ea.expect_err(
        Syndrome::RemoteAccess,
        vendor::REMOTE_KEY,
        Opcode::RdmaWrite as u8,
        idx,
    );

    // past its end (the region goes on)
    let mut p = Pair::new();
    let target = p.b.buf(8192, WINDOWED);
    let mw = p.b.dev.alloc_mw(p.b.pd, MwType::Two);
    let idx = p.eb.go(&bind2(&p.eb, mw, 1, &target, 0, 256, RW), SIG);
    p.eb.expect_req(UMR, idx);
    let idx = p.ea.go(
        &write_to(key_with(mw, 1), target.addr(250), b"too far"),
        SIG,
    );
    p.ea.expect_err(
        Syndrome::RemoteAccess,
        vendor::REMOTE_KEY,
        Opcode::RdmaWrite as u8,
        idx,
    );
    assert_eq!(target.read(250, 7), [0; 7]);

    // the window's old variant is not its key
    let mut p = Pair::new();
    let target = p.b.buf(8192, WINDOWED);
    let mw = p.b.dev.alloc_mw(p.b.pd, MwType::Two);
    let idx = p.eb.go(&bind2(&p.eb, mw, 7, &target, 0, 256, RW), SIG);
    p.eb.expect_req(UMR, idx);
    let idx =
        p.ea.go(&write_to(key_with(mw, 6), target.addr(0), b"old"), SIG);
    p.ea.expect_err(
        Syndrome::RemoteAccess,
        vendor::REMOTE_KEY,
        Opcode::RdmaWrite as u8,
        idx,
    );

    // a type 2 window is usable only through the QP it is bound to: a second connection
    // to the same device cannot use it
    let a = Node::new();
    let b = Node::new();
    let (mut ea, mut eb) = connect(&a, &Opts::default(), &b, &Opts::default());
    let (mut ea2, _eb2) = connect(&a, &Opts::default(), &b, &Opts::default());
    let target = b.buf(4096, WINDOWED);
    let mw = b.dev.alloc_mw(b.pd, MwType::Two);
    let idx = eb.go(&bind2(&eb, mw, 2, &target, 0, 4096, RW), SIG);
    eb.expect_req(UMR, idx);
    let key = key_with(mw, 2);
    let idx = ea.go(&write_to(key, target.addr(8), b"mine"), SIG);
    ea.expect_req(Opcode::RdmaWrite as u8, idx);
    let idx = ea2.go(&write_to(key, target.addr(16), b"not mine"), SIG);
    ea2.expect_err(
        Syndrome::RemoteAccess,
        vendor::REMOTE_KEY,
        Opcode::RdmaWrite as u8,
        idx,
    );
    assert_eq!(target.read(8, 4), b"mine");
    assert_eq!(target.read(16, 8), [0; 8]);
}

/// A type 1 window: bound without a QP, usable through any QP of its PD, unbound by a
/// zero-length bind; a deallocated window's key is dead.
#[test]
fn type1_window_bind_unbind_and_dealloc() {
    let a = Node::new();
    let b = Node::new();
    let (mut ea, mut eb) = connect(&a, &Opts::default(), &b, &Opts::default());
    let (mut ea2, mut eb2) = connect(&a, &Opts::default(), &b, &Opts::default());
    let target = b.buf(4096, WINDOWED);
    let mw = b.dev.alloc_mw(b.pd, MwType::One);
    let bind = |variant, len| {
        Op::BindWindow(WindowBind {
            window: mw,
            variant,
            qpn: None,
            region: target.sge(0, len),
            start: 0, // zero-based
            access: RW,
        })
    };
    let idx = eb.go(&bind(3, 1024), SIG);
    eb.expect_req(UMR, idx);
    let key = key_with(mw, 3);
    // zero-based: peers name offsets; and any QP of the PD may use it
    let idx = ea.go(&write_to(key, 100, b"offset 100"), SIG);
    ea.expect_req(Opcode::RdmaWrite as u8, idx);
    let idx = ea2.go(&write_to(key, 200, b"offset 200"), SIG);
    ea2.expect_req(Opcode::RdmaWrite as u8, idx);
    assert_eq!(target.read(100, 10), b"offset 100");
    assert_eq!(target.read(200, 10), b"offset 200");
    // unbind with a zero-length bind (the key moves on to variant 4)
    let idx = eb.go(&bind(4, 0), SIG);
    eb.expect_req(UMR, idx);
    assert_eq!(b.dev.mw(mw).unwrap().key, key_with(mw, 4));
    let idx = ea.go(&write_to(key, 300, b"gone"), SIG);
    ea.expect_err(
        Syndrome::RemoteAccess,
        vendor::REMOTE_KEY,
        Opcode::RdmaWrite as u8,
        idx,
    );
    // (the responder QP of that access is in ERR now, as on a ConnectX) bound again through
    // the other QP of the PD, then deallocated: dead
    assert_eq!(eb.qp.state(), QpState::Err);
    let idx = eb2.go(&bind(5, 1024), SIG);
    eb2.expect_req(UMR, idx);
    b.dev.dealloc_mw(mw).unwrap();
    assert!(b.dev.mw(mw).is_none());
    let idx = ea2.go(&write_to(key_with(mw, 5), 400, b"dead"), SIG);
    ea2.expect_err(
        Syndrome::RemoteAccess,
        vendor::REMOTE_KEY,
        Opcode::RdmaWrite as u8,
        idx,
    );
    assert_eq!(target.read(300, 104), vec![0; 104]);
    assert!(matches!(b.dev.dealloc_mw(mw), Err(Error::NoSuchMw(_))));
}

/// Every bind a ConnectX refuses completes with MW_BIND_ERR and moves the QP to ERR.
#[test]
fn refused_binds_are_mw_bind_errors() {
    type Case = fn(&Node, &Ep, u32) -> (Op<'static>, Option<Buf>);
    let cases: [(&str, MwType, Case); 6] = [
        ("region without MW_BIND", MwType::Two, |b, ep, mw| {
            let buf = b.buf(4096, ALL_REMOTE);
            (bind2(ep, mw, 1, &buf, 0, 64, RW), Some(buf))
        }),
        ("range past the region", MwType::Two, |b, ep, mw| {
            let buf = b.buf(4096, WINDOWED);
            (bind2(ep, mw, 1, &buf, 4000, 200, RW), Some(buf))
        }),
        (
            "remote write without local write",
            MwType::Two,
            |b, ep, mw| {
                let buf = b.buf(4096, Access(Access::REMOTE_READ.0 | Access::MW_BIND.0));
                (bind2(ep, mw, 1, &buf, 0, 64, RW), Some(buf))
            },
        ),
        (
            "a type 1 window bound as type 2",
            MwType::One,
            |b, ep, mw| {
                let buf = b.buf(4096, WINDOWED);
                (bind2(ep, mw, 1, &buf, 0, 64, RW), Some(buf))
            },
        ),
        ("a window of another PD", MwType::Two, |b, ep, _| {
            let other = b.dev.alloc_pd();
            let mw = b.dev.alloc_mw(other, MwType::Two);
            let buf = b.buf(4096, WINDOWED);
            (bind2(ep, mw, 1, &buf, 0, 64, RW), Some(buf))
        }),
        ("LOCAL_INV of a free window", MwType::Two, |_, _, mw| {
            (Op::LocalInvalidate { rkey: mw }, None)
        }),
    ];
    for (what, kind, make) in cases {
        let mut p = Pair::new();
        let mw = p.b.dev.alloc_mw(p.b.pd, kind);
        let (op, _keep) = make(&p.b, &p.eb, mw);
        let idx = p.eb.go(&op, SIG);
        match p.eb.send_cqe() {
            Completion::Error(e) => assert_eq!(
                (e.syndrome, e.vendor_syndrome, e.wqe_opcode, e.wqe_counter),
                (Syndrome::MwBind as u8, vendor::MEMORY_WINDOW, UMR, idx),
                "{what}"
            ),
            c => panic!("{what}: {c:?}"),
        }
        assert_eq!(p.eb.qp.state(), QpState::Err, "{what}");
        assert!(p.b.dev.mw(mw).is_none_or(|w| w.bound.is_none()), "{what}");
    }
    // a type 2 window bound already cannot be bound again before it is invalidated
    let mut p = Pair::new();
    let buf = p.b.buf(4096, WINDOWED);
    let mw = p.b.dev.alloc_mw(p.b.pd, MwType::Two);
    let idx = p.eb.go(&bind2(&p.eb, mw, 1, &buf, 0, 64, RW), SIG);
    p.eb.expect_req(UMR, idx);
    let idx = p.eb.go(&bind2(&p.eb, mw, 2, &buf, 0, 64, RW), SIG);
    p.eb.expect_err(Syndrome::MwBind, vendor::MEMORY_WINDOW, UMR, idx);
    // ... while LOCAL_INV first makes that legal
    let mut p = Pair::new();
    let buf = p.b.buf(4096, WINDOWED);
    let mw = p.b.dev.alloc_mw(p.b.pd, MwType::Two);
    for v in 1..4u8 {
        let idx = p.eb.go(&bind2(&p.eb, mw, v, &buf, 0, 64, RW), SIG);
        p.eb.expect_req(UMR, idx);
        let idx = p.eb.go(
            &Op::LocalInvalidate {
                rkey: key_with(mw, v),
            },
            SIG,
        );
        p.eb.expect_req(UMR, idx);
    }
}

/// SEND_WITH_INV naming a key the responder cannot invalidate: the receive completes with
/// LOCAL_PROT, the requester with REMOTE_INVAL_REQ.
#[test]
fn send_with_invalidate_of_a_foreign_key() {
    for wire in [false, true] {
        let _serial = serial();
        let mut p = if wire {
            wire_pair(
                wire_opts(),
                wire_opts(),
                1024,
                WireFaults::default(),
                WireFaults::default(),
            )
        } else {
            Pair::new()
        };
        let region = p.b.buf(4096, WINDOWED);
        let rbuf = p.b.buf(64, Access::LOCAL_WRITE);
        let ridx = p.eb.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
        // a region's key is not a window's
        let op = Op::SendInvalidate {
            local: Local::Inline(b"x"),
            rkey: region.mr.key,
        };
        let idx = p.ea.go(&op, SIG);
        // (a NAK carries no vendor syndrome: over the wire the requester names its own)
        match p.ea.send_cqe() {
            Completion::Error(e) => {
                assert_eq!(
                    (e.syndrome, e.wqe_opcode, e.wqe_counter),
                    (Syndrome::RemoteInvalReq as u8, Opcode::SendInval as u8, idx)
                );
                assert!(wire || e.vendor_syndrome == vendor::MEMORY_WINDOW);
            }
            c => panic!("{c:?}"),
        }
        p.eb.expect_recv_err(Syndrome::LocalProt, vendor::MEMORY_WINDOW, ridx);
        assert_eq!(p.eb.qp.state(), QpState::Err);
    }
}
