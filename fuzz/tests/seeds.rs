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

/// The target's seed folder, emptied of what this generator wrote before (the `libmlx5_*`
/// WQEs, recorded by `record_uverbs_seeds.sh`, and the `dc_*`, `uc_*` and `xrc_*` seeds, DC,
/// UC and XRC forms of RC seeds made by hand, stay).
fn corpus(target: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(&d).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().to_string();
        // libmlx5_*: recorded by record_uverbs_seeds.sh; dc_*, uc_*, xrc_*: DC, UC and XRC
        // forms of the RC seeds
        if !["libmlx5_", "dc_", "uc_", "xrc_"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
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
    let idx = f.p.ea.post(
        &Op::Wait {
            cqn,
            max_index: 0xff_ffff,
        },
        common::SIG,
    );
    let ring = f.p.ea.read_ring(idx, 1);
    put(&dir, "wait", &[&[0u8][..], &ring[..]].concat());
    f.finish();
    write_wqe_mode_seeds(&dir);

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

/// The bytes each side of a real two-rank bootstrap sends, through a recording TCP relay:
/// `f(rank 1, rank 0)` runs the calls on both sides; returns (what rank 1 sent, what rank 0
/// sent).
fn recorded(
    f: impl FnOnce(&mut gpuverbs::bootstrap::Bootstrap, &mut gpuverbs::bootstrap::Bootstrap) + Send,
) -> (Vec<u8>, Vec<u8>) {
    use gpuverbs::bootstrap::{Bootstrap, Listener};
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let pump = |mut from: TcpStream, mut to: TcpStream| {
        std::thread::spawn(move || {
            let (mut seen, mut buf) = (Vec::new(), [0u8; 4096]);
            while let Ok(n @ 1..) = from.read(&mut buf) {
                seen.extend_from_slice(&buf[..n]);
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(std::net::Shutdown::Write);
            seen
        })
    };
    let root = Listener::bind("127.0.0.1:0").unwrap();
    let root_addr = root.local_addr();
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let t = Duration::from_secs(5);
    std::thread::scope(|s| {
        let r0 = s.spawn(move || root.accept(t).unwrap());
        let r1 = s.spawn(move || Bootstrap::client(relay_addr, t).unwrap());
        let (down, _) = relay.accept().unwrap();
        let up = TcpStream::connect(root_addr).unwrap();
        let from_1 = pump(down.try_clone().unwrap(), up.try_clone().unwrap());
        let from_0 = pump(up, down);
        let (mut b0, mut b1) = (r0.join().unwrap(), r1.join().unwrap());
        f(&mut b1, &mut b0);
        drop((b0, b1));
        (from_1.join().unwrap(), from_0.join().unwrap())
    })
}

#[test]
#[ignore = "rewrites fuzz/corpus/bootstrap; cargo xtask fuzz --seeds runs it"]
fn write_bootstrap_seeds() {
    let dir = corpus("bootstrap");
    let ep = gpuverbs::Endpoint::new(
        std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
        0x100,
        0x1234,
        4096,
        "softnic",
    )
    .unwrap();
    let mem = gpuverbs::RemoteMemory::export_rkey(0x1000, 4096, 7).unwrap();
    // the call each control value runs (bootstrap.rs: 0 recv, 1 exchange, 2 barrier,
    // 3 all_gather); bit 2: the fuzzed side is rank 0 (what rank 0 sent)
    let calls: [(&str, u8); 4] = [
        ("recv", 0),
        ("exchange", 1),
        ("barrier", 2),
        ("all_gather", 3),
    ];
    for (name, ctl) in calls {
        let (ep, mem) = (ep.clone(), mem.clone());
        let (from_1, from_0) = recorded(move |b1, b0| {
            std::thread::scope(|s| {
                let one = s.spawn(|| match ctl {
                    0 => b1.send(&ep.to_bytes()).unwrap(),
                    1 => drop(b1.exchange(&ep).unwrap()),
                    2 => b1.barrier().unwrap(),
                    _ => drop(b1.all_gather(&mem).unwrap()),
                });
                match ctl {
                    0 => drop(b0.recv().unwrap()),
                    1 => drop(b0.exchange(&ep).unwrap()),
                    2 => b0.barrier().unwrap(),
                    _ => drop(b0.all_gather(&mem).unwrap()),
                }
                one.join().unwrap();
            })
        });
        put(
            &dir,
            &format!("{name}_from_rank1"),
            &[&[ctl][..], &from_1].concat(),
        );
        put(
            &dir,
            &format!("{name}_from_rank0"),
            &[&[ctl | 4][..], &from_0].concat(),
        );
    }
}

/// Seeds of the `wqe` target's receive and forged-doorbell modes, into `dir`.
fn write_wqe_mode_seeds(dir: &Path) {
    let probe = Fixture::local();
    let k = keys(&probe);
    let stride = probe.p.eb.qp.rq_stride() as usize;
    probe.finish();
    // receive WQEs (control bit 1): one data segment on B's receive buffer, two, and a short
    // one the 64-byte SEND overflows
    let seg = |addr: u64, len: u32, lkey: u32| {
        let mut s = Vec::with_capacity(16);
        s.extend_from_slice(&len.to_be_bytes());
        s.extend_from_slice(&lkey.to_be_bytes());
        s.extend_from_slice(&addr.to_be_bytes());
        s
    };
    let pad = |mut v: Vec<u8>| {
        v.resize(stride.max(v.len()), 0);
        v
    };
    let one = pad(seg(addr(3), LEN as u32, k[3]));
    let two = pad([seg(addr(3), 32, k[3]), seg(addr(3) + 512, 64, k[3])].concat());
    let short = pad(seg(addr(3), 16, k[3]));
    for (name, w) in [
        ("recv_one_sge", one),
        ("recv_two_sges", two),
        ("recv_short", short),
    ] {
        put(dir, name, &[&[2u8][..], &w].concat());
    }
    // SRQ rings (control bit 3): WQE 0 with one data segment on B's buffer 3 and its next
    // pointer to 1, the rest of the free list linked, counter 1 — as libmlx5 posts one receive
    let mut ring = vec![0u8; 16 * 64];
    for i in 0..16usize {
        ring[i * 64 + 2..i * 64 + 4].copy_from_slice(&((i as u16 + 1) % 16).to_be_bytes());
        // an empty scatter list: the terminator
        ring[i * 64 + 20..i * 64 + 24].copy_from_slice(&0x100u32.to_be_bytes());
    }
    ring[16..32].copy_from_slice(&seg(addr(3), LEN as u32, k[3]));
    ring[32 + 4..32 + 8].copy_from_slice(&0x100u32.to_be_bytes());
    let mut one = ring.clone();
    one.extend_from_slice(&1u32.to_be_bytes());
    put(dir, "srq_one", &[&[8u8][..], &one].concat());
    let mut empty = ring;
    empty.extend_from_slice(&0u32.to_be_bytes());
    put(dir, "srq_empty", &[&[8u8][..], &empty].concat());
    // forged doorbells (control bit 2): a NOP with producer jumps and RQ heads in the last
    // four bytes
    for (name, sq, rq) in [
        ("forged_db_ahead", 5u16, 3u16),
        ("forged_db_behind", 0xfff0, 0),
        ("forged_db_lap", 0x0101, 0x8000),
    ] {
        let mut w = vec![0u8; 64];
        w[7] = 1; // ds 1: a NOP's control segment
        w[60..62].copy_from_slice(&sq.to_be_bytes());
        w[62..64].copy_from_slice(&rq.to_be_bytes());
        put(dir, name, &[&[4u8][..], &w].concat());
    }
}
