//! Writes the committed seed corpora, `fuzz/corpus/<target>/`, from real traffic of the
//! targets' own fixtures: the WQEs the soft NIC's CPU initiator (the host API's encoder)
//! writes for each operation, the RoCEv2 datagrams two soft NICs exchange for them, and
//! encoded endpoints and memory descriptors. Run by `cargo xtask fuzz --seeds` (ignored
//! otherwise: it rewrites files of the repository).

#[path = "../../crates/softnic/tests/common/mod.rs"]
mod common;
#[path = "../fuzz_targets/fixture.rs"]
mod fixture;
#[path = "../../crates/softnic/tests/wire_util/mod.rs"]
mod wire_util;

use fixture::{addr, Fixture, LEN};
use prm::wqe::{AtomicSize, Local, Op, RemoteAddr, Sge};
use prm::{Lkey, Rkey};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn corpus(target: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).unwrap();
}

/// Every operation of the RC data path, naming the fixture's buffers (`keys`: the keys of
/// buffers 0..4).
fn with_ops(keys: [u32; 4], mut f: impl FnMut(&str, &Op<'_>)) {
    let sge = |i: usize, off: u64, len: u32| Sge {
        addr: addr(i) + off,
        len,
        lkey: Lkey(keys[i]),
    };
    let remote = |off: u64| RemoteAddr {
        addr: addr(1) + off,
        rkey: Rkey(keys[1]),
    };
    let two = [sge(0, 0, 100), sge(0, 512, 1000)];
    let big = [sge(0, 0, LEN as u32)];
    let res = sge(2, 0, 8);
    f("nop", &Op::Nop);
    f(
        "write",
        &Op::Write {
            remote: remote(8),
            local: Local::Sges(&two),
            imm: None,
        },
    );
    f(
        "write_4k",
        &Op::Write {
            remote: remote(0),
            local: Local::Sges(&big),
            imm: None,
        },
    );
    f(
        "write_inline",
        &Op::Write {
            remote: remote(64),
            local: Local::Inline(b"inline bytes of a small write"),
            imm: None,
        },
    );
    f(
        "write_imm",
        &Op::Write {
            remote: remote(128),
            local: Local::Sges(&two),
            imm: Some(0x1234_5678),
        },
    );
    f(
        "write_zero",
        &Op::Write {
            remote: RemoteAddr {
                addr: 0,
                rkey: Rkey(0),
            },
            local: Local::Sges(&[]),
            imm: None,
        },
    );
    f(
        "send",
        &Op::Send {
            local: Local::Sges(&two),
            imm: None,
        },
    );
    f(
        "send_imm_inline",
        &Op::Send {
            local: Local::Inline(b"a send"),
            imm: Some(7),
        },
    );
    f(
        "read",
        &Op::Read {
            remote: remote(256),
            local: &[sge(0, 1024, 2048)],
        },
    );
    f(
        "fetch_add",
        &Op::FetchAdd {
            remote: remote(0),
            add: 5,
            result: res,
        },
    );
    f(
        "compare_swap",
        &Op::CompareSwap {
            remote: remote(8),
            compare: 0x1111_1111_1111_1111,
            swap: 9,
            result: res,
        },
    );
    f(
        "masked_fetch_add",
        &Op::MaskedFetchAdd {
            size: AtomicSize::B8,
            remote: remote(16),
            add: 0x0101,
            field_boundary: 0x8080,
            result: res,
        },
    );
    f(
        "masked_compare_swap",
        &Op::MaskedCompareSwap {
            size: AtomicSize::B4,
            remote: remote(24),
            compare: 1,
            compare_mask: 0xff,
            swap: 2,
            swap_mask: 0xff,
            result: sge(2, 0, 4),
        },
    );
    f(
        "dump",
        &Op::Dump {
            local: sge(0, 0, 64),
        },
    );
    f(
        "send_invalidate",
        &Op::SendInvalidate {
            local: Local::Sges(&two),
            rkey: keys[1],
        },
    );
    f("local_invalidate", &Op::LocalInvalidate { rkey: keys[0] });
}

fn keys(f: &Fixture) -> [u32; 4] {
    f.mrs.map(|m| m.key)
}

#[test]
#[ignore = "rewrites fuzz/corpus; cargo xtask fuzz --seeds runs it"]
fn write_seed_corpora() {
    // WQEs, as the initiator writes them into the ring (control byte 0: the harness
    // re-stamps index and QPN, which are the same anyway)
    let dir = corpus("wqe");
    let probe = Fixture::local();
    let k = keys(&probe);
    probe.finish();
    with_ops(k, |name, op| {
        let mut f = Fixture::local();
        let idx = f.p.ea.post(op, common::SIG);
        let ring = f.p.ea.read_ring(idx, 16);
        let blocks = softnic::initiator::wqe_blocks(ring[7] & 0x3f);
        put(&dir, name, &[&[0u8][..], &ring[..blocks * 64]].concat());
        f.finish();
    });
    // a WAIT on the QP's own send CQ, already satisfied
    let f = Fixture::local();
    let cqn = f.p.ea.scq.cqn();
    f.finish();
    let mut f = Fixture::local();
    let idx = f.p.ea.post(&Op::Wait { cqn, max_index: 0 }, common::SIG);
    let ring = f.p.ea.read_ring(idx, 1);
    put(&dir, "wait", &[&[0u8][..], &ring[..]].concat());
    f.finish();

    // datagrams: each operation between two fresh wire fixtures, as B saw them
    let (wire, packets) = (corpus("wire_rx"), corpus("packet"));
    let probe = Fixture::wire(false);
    let k = keys(&probe);
    probe.finish();
    let mut n = 0;
    with_ops(k, |name, op| {
        if matches!(op, Op::Nop | Op::Dump { .. } | Op::LocalInvalidate { .. }) {
            return;
        }
        let mut f = Fixture::wire(false);
        let (a_port, b_port) = (
            f.p.a.dev.wire_addr().unwrap().port(),
            f.p.b.dev.wire_addr().unwrap().port(),
        );
        let frames = wire_util::captured(&f.p.b.dev, || {
            f.p.ea.go(op, common::SIG);
            let _ = f.p.ea.ini.wait_send(Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(20));
        });
        let framed = |dport: u16, ctl: u8| {
            let mut v = vec![ctl];
            for (_, _, g) in frames.iter().filter(|(_, d, _)| *d == dport).take(8) {
                v.extend_from_slice(&(g.len() as u16).to_be_bytes());
                v.extend_from_slice(g);
            }
            v
        };
        put(&wire, &format!("{name}_gbn"), &framed(b_port, 0));
        put(&wire, &format!("{name}_sr"), &framed(b_port, 1));
        put(&wire, &format!("{name}_answers"), &framed(a_port, 8));
        for (_, _, g) in &frames {
            put(&packets, &format!("{n:03}_{name}"), g);
            n += 1;
        }
        f.finish();
    });

    let dir = corpus("endpoint");
    let ep = gpuverbs::Endpoint::new(
        std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped(),
        0x123,
        0x456,
        4096,
        "mlx5_0",
    )
    .unwrap();
    put(&dir, "endpoint", &ep.to_bytes());
    let ep = ep.with_udp_port(Some(4791)).unwrap();
    put(&dir, "endpoint_udp", &ep.to_bytes());
    let m = gpuverbs::RemoteMemory::export_rkey(0x7f00_0000_0000, 1 << 20, 0x1234).unwrap();
    put(&dir, "remote_memory", &m.to_bytes());
}
