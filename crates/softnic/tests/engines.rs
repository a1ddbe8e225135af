//! Several engine threads per device (`DeviceConfig::engine_threads`): QPs are divided between
//! them by QPN and run at once. Eight QP pairs between two devices of four engine threads each,
//! every pair driven by its own CPU thread: every WRITE's bytes and completion checked, every
//! READ's, and fetch-adds from all pairs on one shared word (executed by different engine
//! threads at once) add up exactly. The engine turn a CPU initiator watches moves on each
//! engine thread.

mod common;

use common::*;
use prm::wqe::{Local, Op, Opcode};
use prm::RemoteAddr;
use softnic::{Access, Device, DeviceConfig};
use std::sync::Arc;

const PAIRS: usize = 8;
const WRITES: usize = 300;
const ADDS: u64 = 200;

fn node(engines: u32) -> Node {
    let dev = Device::open(DeviceConfig {
        engine_threads: engines,
        ..Default::default()
    })
    .unwrap();
    let pd = dev.alloc_pd();
    Node { dev, pd }
}

#[test]
fn qps_on_four_engine_threads_run_at_once_and_correctly() {
    let (a, b) = (Arc::new(node(4)), Arc::new(node(4)));
    let counter = Arc::new(b.buf(64, Access(Access::LOCAL_WRITE.0 | Access::REMOTE_ATOMIC.0)));
    let counter_remote = counter.remote(0);
    let mut eps = Vec::new();
    for _ in 0..PAIRS {
        eps.push(connect(&a, &Opts::default(), &b, &Opts::default()));
    }
    // the QPNs spread over every engine thread
    let threads: std::collections::HashSet<u32> = eps.iter().map(|(e, _)| e.qpn() % 4).collect();
    assert_eq!(
        threads.len(),
        4,
        "QPNs {:?}",
        eps.iter().map(|(e, _)| e.qpn()).collect::<Vec<_>>()
    );
    std::thread::scope(|s| {
        for (p, (ea, _eb)) in eps.iter_mut().enumerate() {
            let (a, b) = (a.clone(), b.clone());
            s.spawn(move || {
                let src = a.buf(8 * WRITES, Access::LOCAL_WRITE);
                let dst = b.buf(
                    8 * WRITES,
                    Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0),
                );
                let back = a.buf(8 * WRITES, Access::LOCAL_WRITE);
                let res = a.buf(8, Access::LOCAL_WRITE);
                for i in 0..WRITES {
                    let v = ((p as u64) << 32 | i as u64).to_ne_bytes();
                    src.write(8 * i, &v);
                    let w = Op::Write {
                        remote: dst.remote(8 * i),
                        local: Local::Sges(&[src.sge(8 * i, 8)]),
                        imm: None,
                    };
                    let idx = ea.go(&w, SIG);
                    ea.expect_req(Opcode::RdmaWrite as u8, idx);
                    assert_eq!(dst.read(8 * i, 8), v, "pair {p} write {i}");
                }
                let r = Op::Read {
                    remote: dst.remote(0),
                    local: &[back.sge(0, (8 * WRITES) as u32)],
                };
                let idx = ea.go(&r, SIG);
                ea.expect_req(Opcode::RdmaRead as u8, idx);
                assert_eq!(back.bytes(), src.bytes(), "pair {p}: READ back");
                for _ in 0..ADDS {
                    let fa = Op::FetchAdd {
                        remote: RemoteAddr {
                            addr: counter_remote.addr,
                            rkey: counter_remote.rkey,
                        },
                        add: 1,
                        result: res.sge(0, 8),
                    };
                    let idx = ea.go(&fa, SIG);
                    ea.expect_req(Opcode::AtomicFa as u8, idx);
                }
                assert!(src.guards_intact() && dst.guards_intact() && back.guards_intact());
            });
        }
    });
    assert_eq!(
        counter.u64_at(0),
        PAIRS as u64 * ADDS,
        "lost or doubled atomics"
    );
    let c = a.dev.counters();
    assert!(c.errors.is_empty(), "{:?}", c.errors);
    assert_eq!(
        c.wqes_executed,
        (PAIRS * (WRITES + 1) + PAIRS * ADDS as usize) as u64
    );
}

#[test]
fn zero_engine_threads_means_one() {
    let n = node(0);
    let m = node(1);
    let (mut ea, _eb) = connect(&n, &Opts::default(), &m, &Opts::default());
    let dst = m.buf(64, Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0));
    let idx = ea.go(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Inline(b"one engine"),
            imm: None,
        },
        SIG,
    );
    ea.expect_req(Opcode::RdmaWrite as u8, idx);
    assert_eq!(dst.read(0, 10), b"one engine");
}

#[test]
fn the_engine_turn_of_a_cpu_initiators_qp_moves_while_its_engine_runs() {
    // A CPU initiator's waits stop spinning when the QP's engine turn stands still (the engine
    // waits for a core): the turn must move while the engine runs, idle or not, on each of a
    // device's engine threads.
    let n = node(2);
    let m = node(1);
    for _ in 0..2 {
        let (ea, _eb) = connect(&n, &Opts::default(), &m, &Opts::default());
        let t0 = ea
            .ini
            .engine_turn()
            .expect("a soft-NIC QP has an engine turn");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ea.ini.engine_turn() == Some(t0) {
            assert!(
                std::time::Instant::now() < deadline,
                "the engine turn stood still for 5 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
