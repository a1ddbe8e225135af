//! Sources in device memory of wire-bound WRITEs and SENDs announced together are read
//! together: when the engine takes the first, it reads the sources of the WQEs behind it too,
//! one batched read (`DeviceMemory::read_many`, one wait) per device memory, and each WQE
//! uses its bytes at its own turn. A failing part fails only its own WQE; a WQE whose keys no
//! longer hold at its turn fails on them; an index that comes round never meets old bytes.

mod common;
mod devmem_util;
mod wire_util;

use common::*;
use devmem_util::{Kind, Region, ALL};
use prm::wqe::{CtrlFlags, Fence, Local, Op, Opcode, Sge};
use prm::{Completion, Syndrome};
use softnic::devmem::SimDeviceMemory;
use softnic::outcome::vendor;
use softnic::{QpState, WireFaults};
use std::time::Duration;
use wire_util::{serial, wire_opts, wire_pair};

const MB: usize = 1 << 20;

fn pair(fb: WireFaults) -> Pair {
    wire_pair(wire_opts(), wire_opts(), 1024, WireFaults::default(), fb)
}

fn write_op<'a>(dst: &Region, at: usize, sges: &'a [Sge]) -> Op<'a> {
    Op::Write {
        remote: dst.remote(at),
        local: Local::Sges(sges),
        imm: None,
    }
}

/// Bytes unlike those of any other round or offset.
fn pattern(seed: u64, n: usize) -> Vec<u8> {
    Rng(seed).bytes(n)
}

/// `k` WRITEs from one device memory, announced by one doorbell, take one read of the
/// sources per 64 WQEs (not one per WQE), and every byte arrives.
#[test]
fn writes_announced_together_read_their_sources_together() {
    let _serial = serial();
    let g = SimDeviceMemory::new(MB);
    for (k, reads) in [(40usize, 1u64), (100, 2)] {
        let mut p = pair(WireFaults::default());
        let src = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 512 << 10, ALL);
        let dst = Region::new(&p.b, &Kind::Host, 512 << 10, ALL);
        let data = pattern(k as u64, 512 << 10);
        src.write(0, &data);
        let before = (g.counts().reads, p.a.dev.counters());
        let mut posted = Vec::new();
        for i in 0..k {
            let (off, len) = (i * 4096 + i % 7, 1000 + 30 * i as u32);
            let op = Op::Write {
                remote: dst.remote(off),
                local: Local::Sges(&[src.sge(off, len)]),
                imm: None,
            };
            posted.push((p.ea.post(&op, SIG), off, len as usize));
        }
        p.ea.ini.ring();
        for &(idx, _, len) in &posted {
            let n = p.ea.expect_req(Opcode::RdmaWrite as u8, idx);
            assert_eq!(n as usize, len);
        }
        assert_eq!(
            g.counts().reads - before.0,
            reads,
            "{k} WRITEs: source reads"
        );
        for &(_, off, len) in &posted {
            assert!(
                dst.read(off, len) == data[off..off + len],
                "{k} WRITEs: bytes at {off} differ"
            );
        }
        let c = p.a.dev.counters();
        assert_eq!(c.staged_batches - before.1.staged_batches, reads);
        assert_eq!(c.staged_wqes - before.1.staged_wqes, k as u64);
        assert_eq!(c.device_memory_errors, 0);
    }
}

/// The same for SENDs (gathers of two ranges each, one of them in host memory), each into
/// a receive of its own.
#[test]
fn sends_announced_together_read_their_sources_together() {
    let _serial = serial();
    let g = SimDeviceMemory::new(MB);
    let mut p = pair(WireFaults::default());
    let src = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 256 << 10, ALL);
    let host = Region::new(&p.a, &Kind::Host, 64 << 10, ALL);
    let rbuf = Region::new(&p.b, &Kind::Host, 256 << 10, ALL);
    let data = pattern(7, 256 << 10);
    let head = pattern(8, 64 << 10);
    src.write(0, &data);
    host.write(0, &head);
    let k = 60;
    for i in 0..k {
        p.eb.ini.post_recv(&[rbuf.sge(i * 4096, 4096)]).unwrap();
    }
    let before = g.counts().reads;
    let mut posted = Vec::new();
    for i in 0..k {
        let sges = [
            host.sge(i * 1000, 100),
            src.sge(i * 4096 + 3, 2000 + i as u32),
        ];
        let op = Op::Send {
            local: Local::Sges(&sges),
            imm: None,
        };
        posted.push(p.ea.post(&op, SIG));
    }
    p.ea.ini.ring();
    for (i, &idx) in posted.iter().enumerate() {
        p.ea.expect_req(Opcode::Send as u8, idx);
        assert!(matches!(p.eb.recv_cqe(), Completion::Resp { .. }));
        let mut want = head[i * 1000..i * 1000 + 100].to_vec();
        want.extend_from_slice(&data[i * 4096 + 3..i * 4096 + 3 + 2000 + i]);
        assert!(
            rbuf.read(i * 4096, want.len()) == want,
            "SEND {i}: bytes differ"
        );
    }
    assert_eq!(
        g.counts().reads - before,
        1,
        "one read for {k} SEND sources"
    );
}

/// The source of WQE `j` fails in the batched read: the WQEs before it complete with their
/// bytes, WQE `j` completes with the device-memory error a lone read's failure gives, and the
/// WQEs behind it flush (the QP is in error); nothing of them arrives.
#[test]
fn a_failing_part_fails_its_own_wqe_only() {
    let _serial = serial();
    let g = SimDeviceMemory::new(MB);
    let mut p = pair(WireFaults::default());
    let src = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 64 << 10, ALL);
    let dst = Region::new(&p.b, &Kind::Host, 64 << 10, ALL);
    let data = pattern(3, 64 << 10);
    src.write(0, &data);
    let (k, j) = (10, 4);
    src.fail(j * 4096 + 500, 1);
    let before = g.counts().reads;
    let posted: Vec<u16> = (0..k)
        .map(|i| {
            let op = Op::Write {
                remote: dst.remote(i * 4096),
                local: Local::Sges(&[src.sge(i * 4096, 3000)]),
                imm: None,
            };
            p.ea.post(&op, SIG)
        })
        .collect();
    p.ea.ini.ring();
    let w = Opcode::RdmaWrite as u8;
    for &idx in &posted[..j] {
        p.ea.expect_req(w, idx);
    }
    p.ea.expect_err(Syndrome::LocalProt, vendor::DEVICE_MEMORY, w, posted[j]);
    for &idx in &posted[j + 1..] {
        p.ea.expect_flush(w, idx);
    }
    assert_eq!(p.ea.qp.state(), QpState::Err);
    assert_eq!(p.eb.qp.state(), QpState::Rts);
    assert_eq!(g.counts().reads - before, 1, "one batched read");
    assert_eq!(p.a.dev.counters().device_memory_errors, 1);
    for i in 0..k {
        let got = dst.read(i * 4096, 3000);
        if i < j {
            assert!(
                got == data[i * 4096..i * 4096 + 3000],
                "WQE {i}: bytes differ"
            );
        } else {
            assert!(got.iter().all(|&b| b == 0), "WQE {i}: bytes arrived");
        }
    }
}

/// Three WRITEs behind one doorbell whose sources are read together; the second is fenced,
/// so it waits until the first is acknowledged, and the responder's egress holds that ACK for
/// 1.5 s: between the read and the second's turn the test may change what the second and
/// third would find.
struct Held {
    p: Pair,
    first: Region,
    second: Region,
    dst: Region,
    idx: [u16; 3],
}

fn held() -> Held {
    let g = SimDeviceMemory::new(MB);
    let stall = WireFaults {
        stall: Some((0, Duration::from_millis(1500))),
        ..WireFaults::default()
    };
    let mut p = pair(stall);
    let first = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 16 << 10, ALL);
    let second = Region::new(&p.a, &Kind::Dev(g.clone(), 0x10000), 16 << 10, ALL);
    let dst = Region::new(&p.b, &Kind::Host, 64 << 10, ALL);
    first.write(0, &pattern(1, 16 << 10));
    second.write(0, &pattern(2, 16 << 10));
    let fenced = CtrlFlags {
        fence: Fence::Small,
        ..SIG
    };
    let (s0, s1, s2) = (
        [first.sge(0, 4000)],
        [second.sge(0, 4000)],
        [first.sge(4096, 4000)],
    );
    let i0 = p.ea.post(&write_op(&dst, 0, &s0), SIG);
    let i1 = p.ea.post(&write_op(&dst, 8192, &s1), fenced);
    let i2 = p.ea.post(&write_op(&dst, 16384, &s2), SIG);
    let staged_before = p.a.dev.counters().staged_wqes;
    p.ea.ini.ring();
    wait_until("the three sources read together", || {
        p.a.dev.counters().staged_wqes >= staged_before + 3
    });
    Held {
        p,
        first,
        second,
        dst,
        idx: [i0, i1, i2],
    }
}

/// The first WRITE has not completed (else the change came too late to test anything).
fn still_held(h: &mut Held) {
    assert_eq!(
        h.p.ea.ini.poll_send(),
        None,
        "the first WRITE completed before the change: nothing tested"
    );
}

/// A WQE whose source was read with an earlier WQE's, and whose region is deregistered
/// before its turn, fails on its key: the bytes read ahead are not sent.
#[test]
fn a_region_gone_before_its_turn_fails_on_its_key() {
    let _serial = serial();
    let mut h = held();
    h.p.a.dev.dereg(h.second.key()).expect("deregister");
    still_held(&mut h);
    let w = Opcode::RdmaWrite as u8;
    h.p.ea.expect_req(w, h.idx[0]);
    h.p.ea
        .expect_err(Syndrome::LocalProt, vendor::LOCAL_KEY, w, h.idx[1]);
    h.p.ea.expect_flush(w, h.idx[2]);
    assert!(
        h.dst.read(8192, 4000).iter().all(|&b| b == 0),
        "the bytes read ahead were sent"
    );
    assert_eq!(h.p.a.dev.counters().device_memory_errors, 0);
}

/// A WQE rewritten in the ring after its source was read (which a program may not do: the
/// ring slot is the NIC's until the completion) runs as it reads at its turn: bytes read for
/// other ranges are not used for it, and the two WQEs deliver what their sources hold.
#[test]
fn bytes_read_for_other_ranges_are_not_used() {
    let _serial = serial();
    let mut h = held();
    let s2 = [h.first.sge(8192, 3000)];
    let qpn = h.p.ea.qpn();
    let w = write_op(&h.dst, 16384, &s2)
        .encode(h.idx[2], qpn, SIG)
        .unwrap();
    let bytes: Vec<u8> = (0..w.blocks()).flat_map(|i| w.block(i).to_vec()).collect();
    h.p.ea.overwrite_ring(h.idx[2], &bytes);
    still_held(&mut h);
    let op = Opcode::RdmaWrite as u8;
    for idx in h.idx {
        h.p.ea.expect_req(op, idx);
    }
    assert!(h.dst.read(8192, 4000) == h.second.read(0, 4000));
    assert!(
        h.dst.read(16384, 3000) == h.first.read(8192, 3000),
        "the bytes read for the WQE's first form were sent"
    );
    assert!(h.dst.read(16384 + 3000, 1000).iter().all(|&b| b == 0));
}

/// Batches behind one doorbell, round after round on a 64-block ring, until the 16-bit WQE
/// index has come round: every WRITE delivers its own round's bytes, never those read for an
/// earlier WQE at the same index.
#[test]
fn an_sq_index_coming_round_meets_no_old_bytes() {
    let _serial = serial();
    let g = SimDeviceMemory::new(MB);
    let opts = common::Opts {
        sq_blocks: 64,
        ..wire_opts()
    };
    let mut p = wire_pair(
        opts.clone(),
        opts,
        1024,
        Default::default(),
        Default::default(),
    );
    let src = Region::new(&p.a, &Kind::Dev(g.clone(), 0), 64 << 10, ALL);
    let dst = Region::new(&p.b, &Kind::Host, 64 << 10, ALL);
    let per = 48usize;
    let rounds = 0x1_0000 / per + 8;
    let mut last = 0u16;
    for r in 0..rounds {
        let data = pattern(r as u64 * 0x9e37, per * 64);
        src.write(0, &data);
        for i in 0..per {
            let op = Op::Write {
                remote: dst.remote(i * 64),
                local: Local::Sges(&[src.sge(i * 64, 64)]),
                imm: None,
            };
            last = p.ea.post(&op, flags(i + 1 == per));
        }
        p.ea.ini.ring();
        p.ea.expect_req(Opcode::RdmaWrite as u8, last);
        assert!(dst.read(0, per * 64) == data, "round {r}: stale bytes");
    }
    assert!((rounds * per) > 0x1_0000, "the index came round ({last})");
    assert!(p.a.dev.counters().staged_batches >= rounds as u64);
}

/// A send ring in device memory (as a GPU library places it): the WQEs behind the first are
/// found in the blocks read ahead of the ring, so 40 WRITEs cost one read of the ring and one
/// of their sources.
#[test]
fn wqes_read_ahead_from_a_device_ring_stage_their_sources_too() {
    use devmem_util::{Carver, GpuSide, Placement};
    use softnic::devmem::DeviceMemory;
    use std::sync::Arc;
    let _serial = serial();
    let (a, b) = (
        wire_util::wire_node(WireFaults::default()),
        wire_util::wire_node(WireFaults::default()),
    );
    wire_util::link(&a, &b);
    let mem = SimDeviceMemory::new(4 * MB);
    let dm: Arc<dyn DeviceMemory> = mem.clone();
    let mut c = Carver::new(mem.clone(), dm, 2 * MB as u64);
    let on_gpu = Placement {
        sq: true,
        rq: false,
        scq: false,
        rcq: false,
    };
    let (qa, sa, ra) = devmem_util::qp_on(&a, &mut c, on_gpu, 256, 256);
    let o = wire_opts();
    let eb = wire_util::endpoint(&b, &o);
    let psn = o.rts.sq_psn;
    wire_util::bring_up_to(&qa, &o, b.dev.gid(), eb.qpn(), psn, 1024);
    wire_util::bring_up_to(&eb.qp, &o, a.dev.gid(), qa.qpn(), psn, 1024);
    let src = Region::new(&a, &Kind::Dev(mem.clone(), 0), 256 << 10, ALL);
    let dst = Region::new(&b, &Kind::Host, 256 << 10, ALL);
    let data = pattern(11, 256 << 10);
    src.write(0, &data);
    let mut gpu = GpuSide::new(qa, sa, ra, mem.clone());
    let k = 40;
    let before = mem.counts().reads;
    let mut last = 0;
    for i in 0..k {
        let sges = [src.sge(i * 4096, 3000)];
        last = gpu.post(&write_op(&dst, i * 4096, &sges), flags(i + 1 == k));
    }
    gpu.ring(&a.dev);
    match gpu.wait_send() {
        Completion::Req { wqe_counter, .. } => assert_eq!(wqe_counter, last),
        c => panic!("{c:?}"),
    }
    assert_eq!(
        mem.counts().reads - before,
        2,
        "one read of the ring, one of the {k} sources"
    );
    for i in 0..k {
        assert!(dst.read(i * 4096, 3000) == data[i * 4096..i * 4096 + 3000]);
    }
}
