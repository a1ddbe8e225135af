//! Device memory over the wire (RoCEv2 over UDP on 127.0.0.1): the same dispatch as the
//! in-process path. Every opcode with its buffers in two different simulated device memories
//! (two hosts' GPUs) gives the completions and bytes of host memory, also under loss,
//! duplication and reordering (retransmissions resend the source as it was read once, when the
//! WQE was taken; duplicate READs re-run);
//! every failing device access, requester or responder side, becomes the documented error CQE.

mod common;
mod devmem_util;
mod wire_util;

use common::*;
use devmem_util::{reference, req_err, script, Kind, Region, ALL, REGION};
use prm::wqe::{Local, Op, Opcode};
use prm::{Completion, ErrorCqe, Syndrome};
use softnic::devmem::SimDeviceMemory;
use softnic::outcome::vendor;
use softnic::{QpState, WireFaults};
use std::sync::Arc;
use wire_util::{faults, serial, wire_opts, wire_pair};

const MB: usize = 1 << 20;

fn pair(mtu: u32) -> Pair {
    wire_pair(
        wire_opts(),
        wire_opts(),
        mtu,
        WireFaults::default(),
        WireFaults::default(),
    )
}

#[test]
fn every_opcode_in_device_memory_over_the_wire() {
    let _serial = serial();
    let want = reference();
    let (g1, g2) = (SimDeviceMemory::new(MB), SimDeviceMemory::new(MB));
    let runs = [
        (256, WireFaults::default(), WireFaults::default()),
        (
            1024,
            faults(0xd1, 0.05, 0.05, 0.05, 0.02),
            faults(0xd2, 0.05, 0.05, 0.05, 0.02),
        ),
    ];
    for (i, (mtu, fa, fb)) in runs.into_iter().enumerate() {
        let mut p = wire_pair(wire_opts(), wire_opts(), mtu, fa, fb);
        let base = i as u64 * 0x40000;
        let l = Region::new(&p.a, &Kind::Dev(g1.clone(), base), REGION, ALL);
        let r = Region::new(&p.b, &Kind::Dev(g2.clone(), base), REGION, ALL);
        let v = Region::new(&p.b, &Kind::Dev(g2.clone(), base + 0x10000), REGION, ALL);
        let (c1, c2) = (g1.counts(), g2.counts());
        let got = script(&mut p, &l, &r, &v);
        let what = format!("MTU {mtu}, run {i}");
        assert_eq!(got.completions, want.completions, "{what}");
        assert!(got.local == want.local, "{what}: local bytes differ");
        assert!(got.remote == want.remote, "{what}: remote bytes differ");
        assert!(got.recv == want.recv, "{what}: receive bytes differ");
        assert!(
            g1.counts().calls() > c1.calls() + 8,
            "{what}: {:?}",
            g1.counts()
        );
        assert!(
            g2.counts().calls() > c2.calls() + 8,
            "{what}: {:?}",
            g2.counts()
        );
        assert!(p.a.dev.counters().wire.tx_packets > 10);
        assert_eq!(p.a.dev.counters().device_memory_errors, 0);
        assert_eq!(p.b.dev.counters().device_memory_errors, 0);
    }
}

/// A WRITE or SEND from device memory reads its source once, when the WQE is taken (a copy
/// per packet before, each a round trip through the driver; every range of it in one batched
/// read), also when packets are lost and sent again; the bytes arrive whole.
#[test]
fn a_device_source_is_read_once_per_message() {
    let _serial = serial();
    let g = SimDeviceMemory::new(MB);
    for (mtu, fa) in [
        (1024, WireFaults::default()),
        (256, faults(0x5e, 0.1, 0.0, 0.05, 0.0)),
    ] {
        let mut p = wire_pair(wire_opts(), wire_opts(), mtu, fa, WireFaults::default());
        let src = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 64 << 10, ALL);
        let dst = Region::new(&p.b, &Kind::Host, 64 << 10, ALL);
        let data: Vec<u8> = (0..64u32 << 10).map(|i| (i * 7 + i / 251) as u8).collect();
        src.write(0, &data);
        for (k, op) in [
            Op::Write {
                remote: dst.remote(0),
                local: Local::Sges(&[src.sge(0, 40_000), src.sge(40_000, 25_536)]),
                imm: None,
            },
            Op::Write {
                remote: dst.remote(1000),
                local: Local::Sges(&[src.sge(5, 9000)]),
                imm: Some(7),
            },
        ]
        .iter()
        .enumerate()
        {
            let before = g.counts().reads;
            if k == 1 {
                p.eb.ini.post_recv(&[]).unwrap();
            }
            p.ea.go(op, SIG);
            assert!(
                matches!(p.ea.send_cqe(), Completion::Req { .. }),
                "MTU {mtu}"
            );
            // one batched read for the message's ranges (one memory)
            assert_eq!(
                g.counts().reads - before,
                1,
                "MTU {mtu}: reads of the source"
            );
        }
        let mut want = data.clone();
        want[1000..10_000].copy_from_slice(&data[5..9005]);
        assert!(dst.read(0, 64 << 10) == want, "MTU {mtu}: bytes differ");
        assert!(matches!(p.eb.recv_cqe(), Completion::Resp { .. }));
    }
}

/// The middle of a WRITE into device memory may be left queued (a copy through the driver
/// per packet otherwise), but nothing acknowledges it before it has landed: when the
/// requester's completion arrives every byte is in memory, with loss and reordering too.
#[test]
fn queued_payloads_land_before_the_ack() {
    let _serial = serial();
    let g = SimDeviceMemory::new(MB);
    let deferred = devmem_util::Deferred::new(g.clone());
    for (mtu, fb) in [
        (256, WireFaults::default()),
        (256, faults(0x7a, 0.05, 0.02, 0.05, 0.0)),
    ] {
        let mut p = wire_pair(wire_opts(), wire_opts(), mtu, WireFaults::default(), fb);
        let src = Region::new(&p.a, &Kind::Host, 256 << 10, ALL);
        let dm: Arc<dyn softnic::devmem::DeviceMemory> = deferred.clone();
        let mr =
            p.b.dev
                .reg_device(p.b.pd, g.base(), 256 << 10, ALL, dm)
                .expect("register");
        for round in 0..4u32 {
            let data: Vec<u8> = (0..256u32 << 10)
                .map(|i| (i.wrapping_mul(31) ^ (round * 77)) as u8)
                .collect();
            src.write(0, &data);
            let before = deferred.queued.load(std::sync::atomic::Ordering::Relaxed);
            p.ea.go(
                &Op::Write {
                    remote: prm::RemoteAddr {
                        addr: mr.addr,
                        rkey: prm::Rkey(mr.key),
                    },
                    local: Local::Sges(&[src.sge(0, 256 << 10)]),
                    imm: None,
                },
                SIG,
            );
            assert!(matches!(p.ea.send_cqe(), Completion::Req { .. }));
            // straight from the memory, past the queue: what a GPU kernel would see now
            assert!(
                g.peek(mr.addr, 256 << 10) == data,
                "MTU {mtu}, round {round}: acknowledged before it landed"
            );
            let queued = deferred.queued.load(std::sync::atomic::Ordering::Relaxed) - before;
            assert!(queued > 100, "MTU {mtu}, round {round}: {queued} queued");
        }
        assert_eq!(p.b.dev.counters().device_memory_errors, 0);
    }
}

#[test]
fn failing_requester_memory_over_the_wire() {
    let _serial = serial();
    let g = SimDeviceMemory::new(MB);
    // the gather source
    let mut p = pair(256);
    let src = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 4096, ALL);
    let dst = Region::new(&p.b, &Kind::Host, 4096, ALL);
    src.fail(700, 1);
    let op = Op::Write {
        remote: dst.remote(0),
        local: Local::Sges(&[src.sge(0, 1000)]),
        imm: None,
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::LocalProt,
        vendor::DEVICE_MEMORY,
        Opcode::RdmaWrite as u8,
        idx,
    );
    assert_eq!(p.eb.qp.state(), QpState::Rts);
    assert_eq!(p.a.dev.counters().device_memory_errors, 1);
    g.heal();
    // the READ destination
    let mut p = pair(256);
    let mine = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 4096, ALL);
    let theirs = Region::new(&p.b, &Kind::Host, 4096, ALL);
    mine.fail(300, 1);
    let op = Op::Read {
        remote: theirs.remote(0),
        local: &[mine.sge(0, 1000)],
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::LocalProt,
        vendor::DEVICE_MEMORY,
        Opcode::RdmaRead as u8,
        idx,
    );
    g.heal();
    // the atomic result
    let mut p = pair(256);
    let mine = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 4096, ALL);
    let theirs = Region::new(&p.b, &Kind::Host, 4096, ALL);
    mine.fail(0, 8);
    let op = Op::FetchAdd {
        remote: theirs.remote(0),
        add: 1,
        result: mine.sge(0, 8),
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::LocalProt,
        vendor::DEVICE_MEMORY,
        Opcode::AtomicFa as u8,
        idx,
    );
    assert_eq!(theirs.u64_at(0), 1, "the remote side already happened");
}

#[test]
fn failing_responder_memory_over_the_wire() {
    let _serial = serial();
    let g = SimDeviceMemory::new(MB);
    let remote_op = |p: &mut Pair, opcode: Opcode, idx: u16| {
        p.ea.expect_err(Syndrome::RemoteOp, vendor::DEVICE_MEMORY, opcode as u8, idx);
        assert_eq!(p.eb.qp.state(), QpState::Err);
        assert_eq!(p.b.dev.counters().device_memory_errors, 1);
    };
    // a WRITE target failing at its third packet: the first two landed
    let mut p = pair(256);
    let src = Region::new(&p.a, &Kind::Host, 4096, ALL);
    let dst = Region::new(&p.b, &Kind::Dev(g.clone(), 0), 4096, ALL);
    src.write(0, &[0x77; 1000]);
    dst.fail(600, 1);
    let op = Op::Write {
        remote: dst.remote(0),
        local: Local::Sges(&[src.sge(0, 1000)]),
        imm: None,
    };
    let idx = p.ea.go(&op, SIG);
    remote_op(&mut p, Opcode::RdmaWrite, idx);
    assert_eq!(dst.read(0, 512), vec![0x77; 512]);
    g.heal();
    // a READ source failing at its third response packet
    let mut p = pair(256);
    let mine = Region::new(&p.a, &Kind::Host, 4096, ALL);
    let theirs = Region::new(&p.b, &Kind::Dev(g.clone(), 0), 4096, ALL);
    theirs.write(0, &[0x33; 1000]);
    theirs.fail(600, 1);
    let op = Op::Read {
        remote: theirs.remote(0),
        local: &[mine.sge(0, 1000)],
    };
    let idx = p.ea.go(&op, SIG);
    remote_op(&mut p, Opcode::RdmaRead, idx);
    g.heal();
    // an atomic target
    let mut p = pair(256);
    let mine = Region::new(&p.a, &Kind::Host, 4096, ALL);
    let theirs = Region::new(&p.b, &Kind::Dev(g.clone(), 0), 4096, ALL);
    theirs.fail(8, 8);
    let op = Op::CompareSwap {
        remote: theirs.remote(8),
        compare: 0,
        swap: 1,
        result: mine.sge(0, 8),
    };
    let idx = p.ea.go(&op, SIG);
    remote_op(&mut p, Opcode::AtomicCs, idx);
    g.heal();
    // a receive buffer: the receive completes with LOCAL_ACCESS
    let mut p = pair(256);
    let src = Region::new(&p.a, &Kind::Host, 4096, ALL);
    let rbuf = Region::new(&p.b, &Kind::Dev(g.clone(), 0), 4096, ALL);
    rbuf.fail(300, 1);
    p.eb.ini.post_recv(&[rbuf.sge(0, 2048)]).unwrap();
    let op = Op::Send {
        local: Local::Sges(&[src.sge(0, 1000)]),
        imm: None,
    };
    let idx = p.ea.go(&op, SIG);
    assert_eq!(
        p.ea.send_cqe(),
        req_err(
            p.ea.qpn(),
            Syndrome::RemoteOp,
            vendor::RECV_BUFFER,
            Opcode::Send as u8,
            idx
        )
    );
    assert_eq!(
        p.eb.recv_cqe(),
        Completion::Error(ErrorCqe {
            responder: true,
            syndrome: Syndrome::LocalAccess as u8,
            vendor_syndrome: vendor::DEVICE_MEMORY,
            wqe_opcode: 0,
            qpn: p.eb.qpn(),
            wqe_counter: 0,
        })
    );
    assert_eq!(p.eb.qp.state(), QpState::Err);
    let _keep: Arc<SimDeviceMemory> = g;
}
