//! Memory regions and rings in device (GPU) memory, on simulated device memory
//! (`SimDeviceMemory`: host bytes behind the `DeviceMemory` trait at non-canonical addresses,
//! so a path that dereferenced a device address on the host would crash the test instead of
//! passing, and every access is counted).
//!
//! - Every opcode, with its local and remote buffers in host memory, one device memory, or two
//!   different device memories, gives exactly the completions and bytes of host memory, and
//!   the device bytes moved through the trait.
//! - Every failing device access becomes the documented error CQE (never a panic).
//! - Rings (SQ, RQ, CQ) in device memory work as host rings do; CQEs are written head first,
//!   tail last; a failing WQE fetch or CQE write is an error, not a hang or a panic.

mod common;
mod devmem_util;

use common::*;
use devmem_util::*;
use prm::cqe::RespKind;
use prm::wqe::{Local, Op, Opcode};
use prm::{Completion, Syndrome};
use softnic::devmem::{DeviceMemory, SimDeviceMemory};
use softnic::initiator::{Initiator, RingMode};
use softnic::outcome::vendor;
use softnic::*;
use std::sync::Arc;

const MB: usize = 1 << 20;

#[test]
fn every_opcode_on_every_placement_matches_host_memory() {
    let want = reference();
    let g1 = SimDeviceMemory::new(MB);
    let g2 = SimDeviceMemory::new(MB);
    let host = Kind::Host;
    let d = |m: &Arc<SimDeviceMemory>, k: u64| Kind::Dev(m.clone(), k * 0x10000);
    // (local on A, remote on B, receive buffer on B)
    let cases = [
        ("device -> host", d(&g1, 0), host.clone(), host.clone()),
        ("host -> device", host.clone(), d(&g1, 0), d(&g1, 1)),
        (
            "device -> device, one memory",
            d(&g1, 0),
            d(&g1, 1),
            d(&g1, 2),
        ),
        (
            "device -> device, two memories",
            d(&g1, 0),
            d(&g2, 0),
            d(&g2, 1),
        ),
        ("mixed", d(&g2, 2), d(&g1, 3), host.clone()),
    ];
    for (what, lk, rk, vk) in cases {
        let (c1, c2) = (g1.counts(), g2.counts());
        let mut p = Pair::new();
        let l = Region::new(&p.a, &lk, REGION, ALL);
        let r = Region::new(&p.b, &rk, REGION, ALL);
        let v = Region::new(&p.b, &vk, REGION, ALL);
        let got = script(&mut p, &l, &r, &v);
        assert_eq!(got.completions, want.completions, "{what}: completions");
        assert!(got.local == want.local, "{what}: local bytes differ");
        assert!(got.remote == want.remote, "{what}: remote bytes differ");
        assert!(got.recv == want.recv, "{what}: receive bytes differ");
        let used = g1.counts().calls() - c1.calls() + g2.counts().calls() - c2.calls();
        assert!(used >= 9, "{what}: only {used} device-memory calls");
        assert_eq!(p.a.dev.counters().device_memory_errors, 0);
        assert_eq!(p.b.dev.counters().device_memory_errors, 0);
    }
    // within one memory the device copies device to device (no host bounce)
    assert!(g1.counts().copies >= 4, "{:?}", g1.counts());
}

#[test]
fn each_direction_uses_the_trait_as_it_should() {
    let g = SimDeviceMemory::new(MB);
    let mut p = Pair::new();
    let hsrc = Region::new(&p.a, &Kind::Host, 4096, ALL);
    let dsrc = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 4096, ALL);
    let hdst = Region::new(&p.b, &Kind::Host, 4096, ALL);
    let ddst = Region::new(&p.b, &Kind::Dev(g.clone(), 0x10000), 4096, ALL);
    hsrc.write(0, &[0x11; 4096]);
    dsrc.write(0, &[0x22; 4096]);
    let mut step = |src: &Region, dst: &Region, len: u32| {
        let before = g.counts();
        let op = Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, len)]),
            imm: None,
        };
        p.ea.go(&op, SIG);
        assert!(matches!(p.ea.send_cqe(), Completion::Req { .. }));
        let after = g.counts();
        (
            after.reads - before.reads,
            after.writes - before.writes,
            after.copies - before.copies,
        )
    };
    // host -> host: the device memory is not touched
    assert_eq!(step(&hsrc, &hdst, 100), (0, 0, 0));
    // host -> device: writes only; device -> host: reads only; device -> device: one copy
    let (r, w, c) = step(&hsrc, &ddst, 100);
    assert!(r == 0 && w >= 1 && c == 0);
    let (r, w, c) = step(&dsrc, &hdst, 100);
    assert!(r >= 1 && w == 0 && c == 0);
    assert_eq!(step(&dsrc, &ddst, 4096), (0, 0, 1));
    assert_eq!(ddst.read(0, 4096), vec![0x22; 4096]);
    assert_eq!(hdst.read(0, 100), vec![0x22; 100]);
    // large messages bounce in chunks, and arrive whole
    let big = SimDeviceMemory::new(8 * MB);
    let (a, b) = (
        Region::new(&p.a, &Kind::Dev(big.clone(), 0), 3 * MB + 5, ALL),
        Region::new(&p.b, &Kind::Host, 3 * MB + 5, ALL),
    );
    let mut rng = Rng(7);
    let bytes = rng.bytes(3 * MB + 5);
    a.write(0, &bytes);
    let op = Op::Write {
        remote: b.remote(0),
        local: Local::Sges(&[a.sge(0, bytes.len() as u32)]),
        imm: None,
    };
    p.ea.go(&op, SIG);
    assert!(matches!(p.ea.send_cqe(), Completion::Req { .. }));
    assert!(b.bytes() == bytes, "3 MiB from device memory differs");
}

#[test]
fn a_region_moved_onto_itself_is_a_memmove() {
    // The same device bytes registered on both devices (one GPU reached by two NICs): a WRITE
    // whose source and target overlap must behave as memmove, both ways.
    let g = SimDeviceMemory::new(4 * MB);
    let mut p = Pair::new();
    let n = 2 * MB + 100;
    let a = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 3 * MB, ALL);
    let b = Region::new(&p.b, &Kind::Dev(g.clone(), 0), 3 * MB, ALL);
    let pat: Vec<u8> = (0..3 * MB).map(|i| (i % 253) as u8).collect();
    for (from, to) in [(0usize, 1000usize), (1000, 0)] {
        a.write(0, &pat);
        let op = Op::Write {
            remote: b.remote(to),
            local: Local::Sges(&[a.sge(from, n as u32)]),
            imm: None,
        };
        p.ea.go(&op, SIG);
        assert!(matches!(p.ea.send_cqe(), Completion::Req { .. }));
        let mut want = pat.clone();
        want.copy_within(from..from + n, to);
        assert!(a.bytes() == want, "overlapping move {from} -> {to}");
    }
}

/// A device memory whose reads take a while (a driver round trip), so that two engines'
/// read-modify-writes overlap unless the device serialises them.
struct Slow(Arc<SimDeviceMemory>);

impl DeviceMemory for Slow {
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), softnic::DeviceMemoryError> {
        let r = self.0.read(src, dst);
        std::thread::sleep(std::time::Duration::from_micros(50));
        r
    }
    fn write(&self, dst: u64, src: &[u8]) -> Result<(), softnic::DeviceMemoryError> {
        self.0.write(dst, src)
    }
    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), softnic::DeviceMemoryError> {
        self.0.copy(dst, src, len)
    }
}

#[test]
fn atomics_on_device_memory_are_atomic_among_the_nic_s_own() {
    // Two requester devices hammer one device-memory word of a third, 10 atomics per
    // doorbell: every add lands.
    let g = SimDeviceMemory::new(MB);
    let slow: Arc<dyn DeviceMemory> = Arc::new(Slow(g.clone()));
    let target = Node::new();
    let mr = target
        .dev
        .reg_device(target.pd, g.base(), 64, ALL, slow)
        .unwrap();
    let remote = prm::wqe::RemoteAddr {
        addr: mr.addr,
        rkey: prm::Rkey(mr.key),
    };
    let go = Arc::new(std::sync::Barrier::new(2));
    let mut threads = Vec::new();
    for t in 0..2u64 {
        let (a, oa) = (Node::new(), Opts::default());
        let (mut ea, eb) = connect(&a, &oa, &target, &Opts::default());
        let res = Region::new(&a, &Kind::Dev(g.clone(), 0x10000 * (t + 1)), 64, ALL);
        let result = res.sge(0, 8);
        let go = go.clone();
        threads.push(std::thread::spawn(move || {
            go.wait();
            for _ in 0..20 {
                for _ in 0..10 {
                    let op = Op::FetchAdd {
                        remote,
                        add: 1,
                        result,
                    };
                    ea.post(&op, SIG);
                }
                ea.ini.ring();
                for _ in 0..10 {
                    assert!(matches!(ea.send_cqe(), Completion::Req { .. }));
                }
            }
            (a, ea, eb, res)
        }));
    }
    let kept: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        u64::from_ne_bytes(g.peek(g.base(), 8).try_into().unwrap()),
        400
    );
    drop(kept);
}

// ------------------------------------------------------------------------------ failures

fn two_regions(p: &Pair, g: &Arc<SimDeviceMemory>) -> (Region, Region) {
    (
        Region::new(&p.a, &Kind::Dev(g.clone(), 0), 4096, ALL),
        Region::new(&p.b, &Kind::Dev(g.clone(), 0x10000), 4096, ALL),
    )
}

#[test]
fn failing_source_is_local_prot_and_leaves_the_responder_alone() {
    let g = SimDeviceMemory::new(MB);
    for target in [Kind::Dev(g.clone(), 0x10000), Kind::Host] {
        let mut p = Pair::new();
        let src = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 4096, ALL);
        let dst = Region::new(&p.b, &target, 4096, ALL);
        src.fail(0, 16);
        let op = Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 64)]),
            imm: None,
        };
        let idx = p.ea.go(&op, SIG);
        p.ea.expect_err(
            Syndrome::LocalProt,
            vendor::DEVICE_MEMORY,
            Opcode::RdmaWrite as u8,
            idx,
        );
        assert_eq!(p.ea.qp.state(), QpState::Err);
        assert_eq!(p.eb.qp.state(), QpState::Rts, "responder untouched");
        let c = p.a.dev.counters();
        assert_eq!(
            (
                c.device_memory_errors,
                c.errors_of(Syndrome::LocalProt),
                p.b.dev.counters().device_memory_errors
            ),
            (1, 1, 0)
        );
        p.ea.expect_flushes_after(3);
        g.heal();
    }
}

#[test]
fn failing_write_target_is_remote_op_and_both_sides_fail() {
    let g = SimDeviceMemory::new(MB);
    let mut p = Pair::new();
    let (src, dst) = two_regions(&p, &g);
    let hsrc = Region::new(&p.a, &Kind::Host, 4096, ALL);
    dst.fail(100, 1);
    let op = Op::Write {
        remote: dst.remote(64),
        local: Local::Sges(&[hsrc.sge(0, 64)]),
        imm: None,
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::RemoteOp,
        vendor::DEVICE_MEMORY,
        Opcode::RdmaWrite as u8,
        idx,
    );
    assert_eq!(p.ea.qp.state(), QpState::Err);
    assert_eq!(p.eb.qp.state(), QpState::Err);
    assert_eq!(p.b.dev.counters().device_memory_errors, 1);
    drop(src);
}

#[test]
fn failing_read_source_or_destination() {
    let g = SimDeviceMemory::new(MB);
    // the responder's source fails: REMOTE_OP, both in ERR (within one memory too: a failed
    // device-to-device copy is retried through the host to find the failing side)
    for here in [Kind::Host, Kind::Dev(g.clone(), 0)] {
        let mut p = Pair::new();
        let theirs = Region::new(&p.b, &Kind::Dev(g.clone(), 0x10000), 4096, ALL);
        let mine = Region::new(&p.a, &here, 4096, ALL);
        theirs.fail(0, 1);
        let op = Op::Read {
            remote: theirs.remote(0),
            local: &[mine.sge(0, 64)],
        };
        let idx = p.ea.go(&op, SIG);
        p.ea.expect_err(
            Syndrome::RemoteOp,
            vendor::DEVICE_MEMORY,
            Opcode::RdmaRead as u8,
            idx,
        );
        assert_eq!(p.eb.qp.state(), QpState::Err);
        assert_eq!(p.b.dev.counters().device_memory_errors, 1);
        g.heal();
    }
    // the requester's destination fails: LOCAL_PROT, responder untouched
    let mut p = Pair::new();
    let (mine, _) = two_regions(&p, &g);
    let theirs = Region::new(&p.b, &Kind::Host, 4096, ALL);
    mine.fail(32, 1);
    let op = Op::Read {
        remote: theirs.remote(0),
        local: &[mine.sge(0, 64)],
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::LocalProt,
        vendor::DEVICE_MEMORY,
        Opcode::RdmaRead as u8,
        idx,
    );
    assert_eq!(p.eb.qp.state(), QpState::Rts);
    assert_eq!(p.a.dev.counters().device_memory_errors, 1);
    // one memory, device to device, our side failing
    g.heal();
    let mut p = Pair::new();
    let (mine, theirs) = two_regions(&p, &g);
    mine.fail(0, 1);
    let op = Op::Read {
        remote: theirs.remote(0),
        local: &[mine.sge(0, 64)],
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::LocalProt,
        vendor::DEVICE_MEMORY,
        Opcode::RdmaRead as u8,
        idx,
    );
}

#[test]
fn failing_atomic_target_or_result() {
    let g = SimDeviceMemory::new(MB);
    let mut p = Pair::new();
    let (mine, theirs) = two_regions(&p, &g);
    theirs.fail(0, 8);
    let op = Op::FetchAdd {
        remote: theirs.remote(0),
        add: 1,
        result: mine.sge(0, 8),
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::RemoteOp,
        vendor::DEVICE_MEMORY,
        Opcode::AtomicFa as u8,
        idx,
    );
    assert_eq!(p.eb.qp.state(), QpState::Err);
    g.heal();
    let mut p = Pair::new();
    let (mine, theirs) = two_regions(&p, &g);
    theirs.set_u64(0, 41);
    mine.fail(8, 8);
    let op = Op::CompareSwap {
        remote: theirs.remote(0),
        compare: 41,
        swap: 42,
        result: mine.sge(8, 8),
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::LocalProt,
        vendor::DEVICE_MEMORY,
        Opcode::AtomicCs as u8,
        idx,
    );
    // as on hardware, the remote side of the atomic already happened
    assert_eq!(theirs.u64_at(0), 42);
    assert_eq!(p.eb.qp.state(), QpState::Rts);
}

#[test]
fn failing_receive_buffer_is_local_access_at_the_responder() {
    let g = SimDeviceMemory::new(MB);
    let mut p = Pair::new();
    let (_, rbuf) = two_regions(&p, &g);
    let src = Region::new(&p.a, &Kind::Host, 4096, ALL);
    rbuf.fail(200, 1);
    p.eb.ini.post_recv(&[rbuf.sge(0, 1000)]).unwrap();
    let op = Op::Send {
        local: Local::Sges(&[src.sge(0, 300)]),
        imm: None,
    };
    let idx = p.ea.go(&op, SIG);
    p.ea.expect_err(
        Syndrome::RemoteOp,
        vendor::DEVICE_MEMORY,
        Opcode::Send as u8,
        idx,
    );
    p.eb.expect_recv_err(Syndrome::LocalAccess, vendor::DEVICE_MEMORY, 0);
    assert_eq!(p.eb.qp.state(), QpState::Err);
    let c = p.b.dev.counters();
    assert_eq!(
        (c.device_memory_errors, c.errors_of(Syndrome::LocalAccess)),
        (1, 1)
    );
}

// ------------------------------------------------------------------------------ rings

/// A (rings as `at`, in device memory `g`, driven as a kernel would) connected to B (host
/// rings, CPU initiator).
fn ring_pair(
    g: &Arc<SimDeviceMemory>,
    dm: Arc<dyn DeviceMemory>,
    at: Placement,
    sq_blocks: u32,
) -> (Node, GpuSide, Node, Ep) {
    let (a, b) = (Node::new(), Node::new());
    let mut carver = Carver::new(g.clone(), dm, 0x80_000);
    let (qa, sa, ra) = qp_on(&a, &mut carver, at, sq_blocks, 64);
    let ob = Opts::default();
    let (qb, sb, rb) = {
        let mut nocarve = Carver::new(g.clone(), g.clone(), 0);
        let none = Placement {
            sq: false,
            rq: false,
            scq: false,
            rcq: false,
        };
        qp_on(&b, &mut nocarve, none, ob.sq_blocks, ob.ncqe)
    };
    bring_up(&qa, &b, qb.qpn());
    bring_up(&qb, &a, qa.qpn());
    let eb = Ep {
        ini: Initiator::for_soft_qp(&b.dev, &qb, RingMode::Doca),
        qp: qb,
        scq: sb,
        rcq: rb,
    };
    (a, GpuSide::new(qa, sa, ra, g.clone()), b, eb)
}

#[test]
fn rings_in_device_memory_run_every_kind_of_work() {
    let g = SimDeviceMemory::new(4 * MB);
    let (a, mut ga, b, mut eb) = ring_pair(&g, g.clone(), Placement::ALL, 16);
    assert!(!ga.qp.sq_ring().is_host() && !ga.scq.ring().is_host());
    let src = Region::new(&a, &Kind::Dev(g.clone(), 0), 8192, ALL);
    let dst = Region::new(&b, &Kind::Host, 8192, ALL);
    let mut rng = Rng(11);
    src.write(0, &rng.bytes(8192));
    let qpn = ga.qp.qpn();
    let before = g.counts();
    // Enough WQEs to go round the 16-block SQ several times, multi-block inline WRITEs
    // wrapping at the ring's end included.
    let inline: Vec<u8> = (0..200).map(|i| i as u8).collect();
    let mut n = 0;
    for round in 0..12usize {
        let off = round * 300;
        let i1 = ga.go(
            &a.dev,
            &Op::Write {
                remote: dst.remote(off),
                local: Local::Sges(&[src.sge(off, 250)]),
                imm: None,
            },
            SIG,
        );
        let i2 = ga.go(
            &a.dev,
            &Op::Write {
                remote: dst.remote(4000 + round * 200),
                local: Local::Inline(&inline[..150 + round]),
                imm: None,
            },
            SIG,
        );
        for (idx, op, len) in [
            (i1, Opcode::RdmaWrite, 250),
            (i2, Opcode::RdmaWrite, 150 + round),
        ] {
            assert_eq!(
                ga.wait_send(),
                Completion::Req {
                    wqe_opcode: op as u8,
                    qpn,
                    wqe_counter: idx,
                    byte_cnt: len as u32
                }
            );
            n += 1;
        }
        assert_eq!(dst.read(off, 250), src.read(off, 250));
        assert_eq!(
            dst.read(4000 + round * 200, 150 + round),
            inline[..150 + round]
        );
    }
    assert!(
        ga.pi as u32 > 3 * 16,
        "the SQ went round {} blocks only",
        ga.pi
    );
    // READ into device memory, atomics with results in device memory
    dst.set_u64(7000, 5);
    let i = ga.go(
        &a.dev,
        &Op::Read {
            remote: dst.remote(0),
            local: &[src.sge(6000, 512)],
        },
        SIG,
    );
    assert!(matches!(ga.wait_send(), Completion::Req { wqe_counter, .. } if wqe_counter == i));
    assert_eq!(src.read(6000, 512), dst.read(0, 512));
    ga.go(
        &a.dev,
        &Op::FetchAdd {
            remote: dst.remote(7000),
            add: 3,
            result: src.sge(7000, 8),
        },
        SIG,
    );
    assert!(matches!(
        ga.wait_send(),
        Completion::Req { byte_cnt: 8, .. }
    ));
    assert_eq!((dst.u64_at(7000), src.u64_at(7000)), (8, 5));
    // B sends to A: the receive WQE is read from A's RQ ring in device memory and the
    // responder CQE lands in A's receive CQ in device memory
    let rbuf = Region::new(&a, &Kind::Dev(g.clone(), 0x10000), 4096, ALL);
    ga.post_recv(&[rbuf.sge(0, 100), rbuf.sge(1000, 100)]);
    let hsrc = Region::new(&b, &Kind::Host, 4096, ALL);
    hsrc.write(0, &[0x5a; 150]);
    eb.go(
        &Op::Send {
            local: Local::Sges(&[hsrc.sge(0, 150)]),
            imm: Some(0x1234),
        },
        SIG,
    );
    assert!(matches!(eb.send_cqe(), Completion::Req { .. }));
    assert_eq!(
        ga.wait_recv(),
        Completion::Resp {
            kind: RespKind::SendImm,
            qpn,
            wqe_counter: 0,
            byte_cnt: 150,
            imm: Some(0x1234),
            remote_qpn: eb.qpn(),
        }
    );
    assert_eq!(rbuf.read(0, 100), vec![0x5a; 100]);
    assert_eq!(rbuf.read(1000, 50), vec![0x5a; 50]);
    ga.quiet();
    let used = g.counts();
    // every WQE was fetched from device memory, every CQE written into it (2 writes each)
    assert!(used.reads - before.reads >= n + 2, "{used:?}");
    assert!(used.writes - before.writes >= 2 * (n + 3), "{used:?}");
    assert_eq!(a.dev.counters().device_memory_errors, 0);
    assert!(a.dev.counters().errors.is_empty());
    drop(b);
}

/// Rings and doorbell records all in device memory (what GPUNetIO and NVSHMEM IBGDA make with
/// DEVX): the SQ producer comes from the doorbells (the record is not read), the RQ head and the
/// CQ consumer indexes are read from device memory. The send CQ detects overrun: 24 signaled
/// WRITEs through a 16-entry CQ go through only because the consumer index the poller stores
/// in device memory is read; a 17th CQE without polling is an overrun.
/// A QP of node A with every ring and doorbell record in device memory (reached through
/// `dm`), driven as a kernel drives it, connected to a host-memory QP of node B (returned with
/// its CQs).
#[allow(clippy::type_complexity)]
fn doorbells_in_device_memory(
    g: &Arc<SimDeviceMemory>,
    dm: Arc<dyn DeviceMemory>,
    sq_blocks: u32,
    ncqe: u32,
) -> (Node, GpuSide, Node, (Arc<Qp>, Arc<Cq>, Arc<Cq>)) {
    let (a, b) = (Node::new(), Node::new());
    let mut carver = Carver::new(g.clone(), dm, 0x80_000);
    let (qa, sa, ra) = qp_all_on(&a, &mut carver, sq_blocks, ncqe);
    assert!(!qa.dbrec_page().is_host() && !sa.dbrec().is_host() && !ra.dbrec().is_host());
    let ob = Opts::default();
    let (qb, sb, rb) = qp_on(
        &b,
        &mut Carver::new(g.clone(), g.clone(), 0),
        Placement {
            sq: false,
            rq: false,
            scq: false,
            rcq: false,
        },
        ob.sq_blocks,
        ob.ncqe,
    );
    bring_up(&qa, &b, qb.qpn());
    bring_up(&qb, &a, qa.qpn());
    let ga = GpuSide::new(qa, sa, ra, g.clone());
    (a, ga, b, (qb, sb, rb))
}

#[test]
fn doorbell_records_in_device_memory_are_read_as_a_device_reads_them() {
    let g = SimDeviceMemory::new(4 * MB);
    let (a, mut ga, b, (qb, sb, rb)) = doorbells_in_device_memory(&g, g.clone(), 64, 16);
    let mut eb = Ep {
        ini: Initiator::for_soft_qp(&b.dev, &qb, RingMode::Doca),
        qp: qb,
        scq: sb,
        rcq: rb,
    };
    let src = Region::new(&a, &Kind::Host, 4096, ALL);
    let dst = Region::new(&b, &Kind::Host, 4096, ALL);
    src.write(0, &Rng(5).bytes(4096));
    let write = |ga: &mut GpuSide, i: usize| {
        let sge = [src.sge(i * 64, 64)];
        let op = Op::Write {
            remote: dst.remote(i * 64),
            local: Local::Sges(&sge),
            imm: None,
        };
        ga.go(&a.dev, &op, SIG);
    };
    for batch in [0..12usize, 12..24] {
        for i in batch.clone() {
            write(&mut ga, i);
        }
        for _ in batch {
            assert!(matches!(
                ga.wait_send(),
                Completion::Req { byte_cnt: 64, .. }
            ));
        }
    }
    assert_eq!(dst.read(0, 24 * 64), src.read(0, 24 * 64));
    // a receive announced in the device-memory record takes B's SEND
    let rbuf = Region::new(&a, &Kind::Host, 4096, ALL);
    ga.post_recv(&[rbuf.sge(0, 256)]);
    let hsrc = Region::new(&b, &Kind::Host, 4096, ALL);
    hsrc.write(0, &[0x3c; 100]);
    eb.go(
        &Op::Send {
            local: Local::Sges(&[hsrc.sge(0, 100)]),
            imm: None,
        },
        SIG,
    );
    assert!(matches!(eb.send_cqe(), Completion::Req { .. }));
    assert!(matches!(
        ga.wait_recv(),
        Completion::Resp { byte_cnt: 100, .. }
    ));
    assert_eq!(rbuf.read(0, 100), vec![0x3c; 100]);
    // 17 signaled WRITEs without polling: the 17th CQE would overwrite one not taken
    for i in 0..17 {
        write(&mut ga, i);
    }
    let t = std::time::Instant::now();
    while a.dev.counters().cq_overruns == 0 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "no CQ overrun"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(a.dev.counters().device_memory_errors, 0);
}

#[test]
fn cqes_in_device_memory_are_written_head_then_tail() {
    let g = SimDeviceMemory::new(4 * MB);
    let rec = Recording::new(g.clone());
    let (a, mut ga, b, _eb) = ring_pair(&g, rec.clone(), Placement::ALL, 64);
    let ring = ga.scq.ring().addr();
    let dst = Region::new(&b, &Kind::Host, 4096, ALL);
    // creating the CQ filled its ring with one write
    assert!(rec.log().contains(&(ring, 64 * 64)));
    let start = rec.log().len();
    for i in 0..70u16 {
        ga.go(
            &a.dev,
            &Op::Write {
                remote: dst.remote(0),
                local: Local::Inline(b"x"),
                imm: None,
            },
            SIG,
        );
        assert!(matches!(ga.wait_send(), Completion::Req { wqe_counter, .. } if wqe_counter == i));
    }
    let log: Vec<_> = rec.log()[start..]
        .iter()
        .copied()
        .filter(|&(addr, _)| addr >= ring && addr < ring + 64 * 64)
        .collect();
    assert_eq!(log.len(), 140);
    for (i, pair) in log.chunks(2).enumerate() {
        let slot = ring + (i as u64 % 64) * 64;
        assert_eq!(pair, [(slot, 60), (slot + 60, 4)], "CQE {i}");
    }
    // each CQE is one ordered group (a CUDA memory queues both copies and waits once)
    let groups: Vec<_> = rec
        .ordered_log()
        .into_iter()
        .filter(|g| g[0].0 >= ring && g[0].0 < ring + 64 * 64)
        .collect();
    assert_eq!(groups.len(), 70);
    for (i, g) in groups.iter().enumerate() {
        let slot = ring + (i as u64 % 64) * 64;
        assert_eq!(g, &[(slot, 60), (slot + 60, 4)], "CQE {i}");
    }
}

/// The consumer index of a CQ in device memory is read when the ring might be full, not at
/// every CQE (each read is a copy): 200 CQEs on a 64-entry ring polled as they come take a
/// handful of reads; an overrun is still found (the record is read again before it is
/// declared).
#[test]
fn the_cq_consumer_index_is_read_only_when_the_ring_may_be_full() {
    let g = SimDeviceMemory::new(4 * MB);
    let rec = Recording::new(g.clone());
    let (a, mut ga, b, _) = doorbells_in_device_memory(&g, rec.clone(), 128, 64);
    assert!(!ga.scq.dbrec().is_host());
    let dbrec = ga.scq.dbrec().addr();
    let dst = Region::new(&b, &Kind::Host, 4096, ALL);
    let write = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(b"x"),
        imm: None,
    };
    let reads = || rec.read_log().iter().filter(|r| r.0 == dbrec).count();
    let before = reads();
    for i in 0..200u16 {
        ga.go(&a.dev, &write, SIG);
        assert!(matches!(ga.wait_send(), Completion::Req { wqe_counter, .. } if wqe_counter == i));
    }
    let n = reads() - before;
    assert!(
        (1..=8).contains(&n),
        "{n} reads of the CQ's doorbell record"
    );
    // 65 CQEs without polling: the 65th finds the ring full
    for _ in 0..65 {
        ga.go(&a.dev, &write, SIG);
    }
    let t = std::time::Instant::now();
    while a.dev.counters().cq_overruns == 0 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "no CQ overrun"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// WQEs announced together are read from a send ring in device memory together (each read is
/// a copy): 100 one-block WRITEs behind one doorbell on a 256-block ring take at most one read
/// per 64 blocks, every one lands, in order; a ring that wraps under them is read in two
/// spans; and a WQE rewritten after it ran (the producer reusing its blocks on the next lap) is
/// read anew, not taken from the earlier read.
#[test]
fn wqes_announced_together_are_read_together() {
    let g = SimDeviceMemory::new(4 * MB);
    let rec = Recording::new(g.clone());
    let at = Placement {
        sq: true,
        rq: false,
        scq: false,
        rcq: false,
    };
    let (a, mut ga, b, _eb) = ring_pair(&g, rec.clone(), at, 256);
    let ring = ga.qp.sq_ring().addr();
    let ring_reads = || {
        rec.read_log()
            .iter()
            .filter(|r| (ring..ring + 256 * 64).contains(&r.0))
            .count()
    };
    let dst = Region::new(&b, &Kind::Host, 8 * 256, ALL);
    let lap = |ga: &mut GpuSide, from: u64, n: u64| {
        let before = ring_reads();
        let values: Vec<[u8; 8]> = (from..from + n).map(|i| (i + 1).to_le_bytes()).collect();
        for (i, v) in (from..from + n).zip(&values) {
            let op = Op::Write {
                remote: dst.remote(8 * (i % 256) as usize),
                local: Local::Inline(v),
                imm: None,
            };
            ga.post(&op, if i + 1 == from + n { SIG } else { UNSIG });
        }
        ga.ring(&a.dev);
        assert!(matches!(ga.wait_send(), Completion::Req { .. }));
        for i in from..from + n {
            assert_eq!(dst.u64_at(8 * (i % 256) as usize), i + 1, "WRITE {i}");
        }
        ring_reads() - before
    };
    // blocks 0..100: two reads at most (64 + 36)
    let n = lap(&mut ga, 0, 100);
    assert!((1..=2).contains(&n), "{n} reads for 100 WQEs");
    // blocks 100..300: wraps at 256; 200 blocks in at most 5 reads (spans of 64, one split)
    let n = lap(&mut ga, 100, 200);
    assert!(
        (3..=5).contains(&n),
        "{n} reads for 200 WQEs across the wrap"
    );
    // the next lap rewrites every block with other values: each lands as rewritten
    let n = lap(&mut ga, 300, 256);
    assert!((4..=6).contains(&n), "{n} reads for a whole lap");
}

#[test]
fn a_failing_wqe_fetch_is_an_error_cqe() {
    let g = SimDeviceMemory::new(4 * MB);
    let at = Placement {
        sq: true,
        rq: false,
        scq: false,
        rcq: false,
    };
    let (a, mut ga, b, _eb) = ring_pair(&g, g.clone(), at, 16);
    let dst = Region::new(&b, &Kind::Host, 4096, ALL);
    let w = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(b"fine"),
        imm: None,
    };
    ga.go(&a.dev, &w, SIG);
    assert!(matches!(ga.wait_send(), Completion::Req { .. }));
    // the ring's second block stops answering
    g.fail_range(ga.qp.sq_ring().addr() + 64, 64);
    let idx = ga.go(&a.dev, &w, SIG);
    assert_eq!(idx, 1);
    assert_eq!(
        ga.wait_send(),
        req_err(
            ga.qp.qpn(),
            Syndrome::LocalQpOp,
            vendor::DEVICE_MEMORY,
            0,
            1
        )
    );
    assert_eq!(ga.qp.state(), QpState::Err);
    assert_eq!(a.dev.counters().device_memory_errors, 1);
    // later WQEs flush, one CQE each
    g.heal();
    let i2 = ga.go(&a.dev, &w, SIG);
    assert_eq!(
        ga.wait_send(),
        req_err(
            ga.qp.qpn(),
            Syndrome::WrFlush,
            0,
            Opcode::RdmaWrite as u8,
            i2
        )
    );
}

#[test]
fn a_failing_cqe_write_puts_the_cq_in_error() {
    let g = SimDeviceMemory::new(4 * MB);
    let at = Placement {
        sq: false,
        rq: false,
        scq: true,
        rcq: false,
    };
    let (a, mut ga, b, _eb) = ring_pair(&g, g.clone(), at, 16);
    let dst = Region::new(&b, &Kind::Host, 4096, ALL);
    let w = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(b"abc"),
        imm: None,
    };
    ga.go(&a.dev, &w, SIG);
    assert!(matches!(ga.wait_send(), Completion::Req { .. }));
    g.fail_range(ga.scq.ring().addr() + 64 + 60, 4);
    ga.go(&a.dev, &w, SIG);
    wait_until("the QP fails", || ga.qp.state() == QpState::Err);
    assert!(ga.scq.is_failed());
    assert_eq!(a.dev.counters().device_memory_errors, 1);
    // the data moved; the CQE head may be there, but never its tail
    assert_eq!(dst.read(0, 3), b"abc");
    g.heal();
    ga.go(&a.dev, &w, SIG);
    ga.quiet();
    assert_eq!(
        a.dev.counters().device_memory_errors,
        1,
        "nothing more is written"
    );
}

#[test]
fn a_failing_receive_wqe_read() {
    let g = SimDeviceMemory::new(4 * MB);
    let at = Placement {
        sq: false,
        rq: true,
        scq: false,
        rcq: false,
    };
    let (a, mut ga, b, mut eb) = ring_pair(&g, g.clone(), at, 16);
    let rbuf = Region::new(&a, &Kind::Host, 4096, ALL);
    ga.post_recv(&[rbuf.sge(0, 100)]);
    g.fail_range(ga.qp.rq_ring().addr(), 16);
    let src = Region::new(&b, &Kind::Host, 64, ALL);
    let idx = eb.go(
        &Op::Send {
            local: Local::Sges(&[src.sge(0, 10)]),
            imm: None,
        },
        SIG,
    );
    eb.expect_err(
        Syndrome::RemoteOp,
        vendor::DEVICE_MEMORY,
        Opcode::Send as u8,
        idx,
    );
    assert_eq!(
        ga.wait_recv(),
        Completion::Error(prm::ErrorCqe {
            responder: true,
            syndrome: Syndrome::LocalAccess as u8,
            vendor_syndrome: vendor::DEVICE_MEMORY,
            wqe_opcode: 0,
            qpn: ga.qp.qpn(),
            wqe_counter: 0,
        })
    );
    assert_eq!(ga.qp.state(), QpState::Err);
}

#[test]
fn the_cpu_initiator_refuses_device_rings() {
    let g = SimDeviceMemory::new(4 * MB);
    for at in [
        Placement {
            sq: true,
            rq: false,
            scq: false,
            rcq: false,
        },
        Placement {
            sq: false,
            rq: false,
            scq: false,
            rcq: true,
        },
    ] {
        let n = Node::new();
        let mut c = Carver::new(g.clone(), g.clone(), 0);
        let (qp, _, _) = qp_on(&n, &mut c, at, 16, 64);
        let e = Initiator::try_for_soft_qp(&n.dev, &qp, RingMode::Doca).err();
        assert!(
            matches!(e, Some(Error::InvalidArgument(m)) if m.contains("device memory")),
            "{at:?}"
        );
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Initiator::for_soft_qp(&n.dev, &qp, RingMode::Doca)
        }));
        assert!(caught.is_err());
    }
}

#[test]
fn device_ring_memory_too_small_or_failing_at_creation() {
    let g = SimDeviceMemory::new(MB);
    let dev = Device::open(DeviceConfig::default()).unwrap();
    let dm: Arc<dyn DeviceMemory> = g.clone();
    let small = DmaBuf::from_device(g.base(), 64 * 63, dm.clone(), Box::new(()));
    assert!(matches!(
        dev.create_cq(CqConfig {
            ncqe: 64,
            ring: Some(small),
            ..Default::default()
        }),
        Err(Error::InvalidArgument(_))
    ));
    g.fail_range(g.base(), 1);
    let bad = DmaBuf::from_device(g.base(), 64 * 64, dm, Box::new(()));
    assert!(matches!(
        dev.create_cq(CqConfig {
            ncqe: 64,
            ring: Some(bad),
            ..Default::default()
        }),
        Err(Error::DeviceMemory(_))
    ));
}

#[test]
fn registration_of_device_memory_checks_like_host_memory() {
    let g = SimDeviceMemory::new(MB);
    let dev = Device::open(DeviceConfig::default()).unwrap();
    let pd = dev.alloc_pd();
    let dm: Arc<dyn DeviceMemory> = g.clone();
    assert!(dev
        .reg_device(pd, g.base(), 0, Access::LOCAL_WRITE, dm.clone())
        .is_err());
    assert!(dev
        .reg_device(pd, g.base(), 64, Access::REMOTE_WRITE, dm.clone())
        .is_err());
    let mr = dev
        .reg_device(pd, g.base(), 64, Access::LOCAL_WRITE, dm)
        .unwrap();
    assert_eq!(dev.mr(mr.key).map(|m| m.kind), Some(MemKind::Device));
    dev.dereg(mr.key).unwrap();
    assert!(dev.mr(mr.key).is_none());
}
