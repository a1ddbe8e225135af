//! Every operation over the wire, checked against the in-process path: the same scripted
//! workload (every opcode, inline and gather lists, lengths across several MTUs, signaled and
//! unsignaled WQEs, several WQEs per doorbell) runs on an in-process pair and on pairs of
//! devices talking RoCEv2 over UDP on 127.0.0.1 (path MTUs 256 to 4096, with and without
//! packet faults); the completions (requester and responder) and every byte of memory must be
//! identical.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op};
use softnic::WireFaults;
use wire_util::*;

const BATCHES: usize = 40;

#[test]
fn every_operation_matches_the_in_process_path() {
    let _serial = serial();
    let seed = 0x77_0001;
    let mut reference = local_pair(wire_opts(), wire_opts());
    let want = run_script(&mut reference, seed, BATCHES);
    assert!(want.a_send.len() > BATCHES, "script too thin");
    for mtu in [256, 1024, 4096] {
        let mut p = wire_pair(
            wire_opts(),
            wire_opts(),
            mtu,
            WireFaults::default(),
            WireFaults::default(),
        );
        let got = run_script(&mut p, seed, BATCHES);
        assert_same(&want, &got, &format!("wire, MTU {mtu}"));
        let (ca, cb) = (p.a.dev.counters(), p.b.dev.counters());
        assert!(ca.wire.tx_packets > 0 && cb.wire.rx_packets > 0);
        assert_eq!(ca.wire.rx_bad_icrc + cb.wire.rx_bad_icrc, 0);
        assert_eq!(ca.wire.rx_malformed + cb.wire.rx_malformed, 0);
        assert_eq!(ca.wqes_executed, reference.a.dev.counters().wqes_executed);
    }
}

#[test]
fn every_operation_under_loss_duplication_reordering_and_corruption() {
    let _serial = serial();
    let seed = 0x77_0002;
    let mut reference = local_pair(wire_opts(), wire_opts());
    let want = run_script(&mut reference, seed, BATCHES);
    for (i, mtu) in [512u32, 2048].into_iter().enumerate() {
        let f = |s| faults(s, 0.03, 0.03, 0.03, 0.02);
        let mut p = wire_pair(
            wire_opts(),
            wire_opts(),
            mtu,
            f(i as u64 + 1),
            f(i as u64 + 100),
        );
        let got = run_script(&mut p, seed, BATCHES);
        assert_same(&want, &got, &format!("faulty wire, MTU {mtu}"));
        let (ca, cb) = (p.a.dev.counters(), p.b.dev.counters());
        assert!(ca.wire.injected_drops > 0 && cb.wire.injected_drops > 0);
        assert!(ca.wire.retransmits > 0, "{:?}", ca.wire);
        assert!(cb.wire.duplicates > 0, "{:?}", cb.wire);
        assert!(ca.wire.rx_bad_icrc + cb.wire.rx_bad_icrc > 0);
    }
}

#[test]
fn unsignaled_and_nops_complete_in_order_behind_the_wire() {
    let _serial = serial();
    let mut p = wire_pair(
        wire_opts(),
        wire_opts(),
        1024,
        WireFaults::default(),
        WireFaults::default(),
    );
    let src = p.a.buf(64 << 10, softnic::Access::NONE);
    src.write(0, &Rng(5).bytes(64 << 10));
    let dst = p.b.buf(64 << 10, ALL_REMOTE);
    // a long unsignaled write, a signaled NOP behind it, a short signaled write
    let w = Op::Write {
        remote: dst.remote(0),
        local: Local::Sges(&[src.sge(0, 60 << 10)]),
        imm: None,
    };
    p.ea.post(&w, UNSIG);
    let nop = p.ea.post(&Op::Nop, SIG);
    let w2 = Op::Write {
        remote: dst.remote(61 << 10),
        local: Local::Inline(b"tail"),
        imm: None,
    };
    let i2 = p.ea.post(&w2, SIG);
    p.ea.ini.ring();
    assert_eq!(p.ea.expect_req(0x00, nop), 0);
    // the NOP's CQE came after the long write finished
    assert_eq!(dst.read(0, 60 << 10), src.read(0, 60 << 10));
    assert_eq!(p.ea.expect_req(0x08, i2), 4);
    assert_eq!(dst.read(61 << 10, 4), b"tail");
    p.ea.expect_quiet(std::time::Duration::from_millis(2));
}

#[test]
fn peers_found_by_gid_alone_at_the_default_port() {
    let _serial = serial();
    // Neither device has a peer table: A's default port is B's port, B's is A's. Both have
    // the GID ::ffff:127.0.0.1, which therefore names no single in-process device: A's QP
    // finds B at the GID's address and its default port, and B answers there too (to the
    // peer's address, not to the source port of the requests, which is an entropy port).
    let a_port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dev = softnic::Device::open(softnic::DeviceConfig {
        wire: Some(softnic::WireConfig {
            default_port: a_port,
            ..softnic::WireConfig::loopback()
        }),
        ..Default::default()
    })
    .unwrap();
    let pd = dev.alloc_pd();
    let b = Node { dev, pd };
    let port = b.dev.wire_addr().unwrap().port();
    let dev = softnic::Device::open(softnic::DeviceConfig {
        wire: Some(softnic::WireConfig {
            default_port: port,
            ..softnic::WireConfig::new(([127, 0, 0, 1], a_port).into())
        }),
        ..Default::default()
    })
    .unwrap();
    let pd = dev.alloc_pd();
    let a = Node { dev, pd };
    assert_eq!(a.dev.gid(), b.dev.gid());
    let (mut ea, _eb) = connect_mtu(&a, &wire_opts(), &b, &wire_opts(), 2048);
    let src = a.buf(10_000, softnic::Access::NONE);
    src.write(0, &Rng(9).bytes(10_000));
    let dst = b.buf(10_000, ALL_REMOTE);
    let i = ea.go(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 10_000)]),
            imm: None,
        },
        SIG,
    );
    ea.expect_req(0x08, i);
    assert_eq!(dst.bytes(), src.bytes());
    assert!(a.dev.counters().wire.tx_packets >= 5);
    // B counts its ACK after the send call returns, which may be after A saw it
    wait_for("B's ACK counted", std::time::Duration::from_secs(5), || {
        b.dev.counters().wire.tx_packets >= 1
    });
}

#[test]
fn zero_length_rdma_ignores_key_and_address_on_the_wire() {
    let _serial = serial();
    // IBTA C9-88 over the wire, both ways of recovering: a zero-length WRITE, WRITE_IMM and
    // READ with rkey 0 / VA 0 (as UCX sends them) and with a made-up key complete.
    for o in [wire_opts(), go_back_n_opts()] {
        let mut p = wire_pair(
            o.clone(),
            o,
            1024,
            WireFaults::default(),
            WireFaults::default(),
        );
        let rbuf = p.b.buf(64, softnic::Access::LOCAL_WRITE);
        for (addr, rkey) in [(0, 0), (0xdead_beef_0000, 0x00de_ad00)] {
            let remote = prm::wqe::RemoteAddr {
                addr,
                rkey: prm::Rkey(rkey),
            };
            let i = p.ea.go(
                &Op::Write {
                    remote,
                    local: Local::Sges(&[]),
                    imm: None,
                },
                SIG,
            );
            assert_eq!(p.ea.expect_req(0x08, i), 0);
            let i = p.ea.go(&Op::Read { remote, local: &[] }, SIG);
            assert_eq!(p.ea.expect_req(0x10, i), 0);
            let r = p.eb.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
            let i = p.ea.go(
                &Op::Write {
                    remote,
                    local: Local::Sges(&[]),
                    imm: Some(9),
                },
                SIG,
            );
            assert_eq!(p.ea.expect_req(0x09, i), 0);
            match p.eb.recv_cqe() {
                prm::Completion::Resp {
                    wqe_counter,
                    byte_cnt,
                    imm,
                    ..
                } => assert_eq!((wqe_counter, byte_cnt, imm), (r, 0, Some(9))),
                c => panic!("expected the WRITE_IMM's receive completion, got {c:?}"),
            }
        }
        assert_eq!(p.ea.qp.state(), softnic::QpState::Rts);
        assert_eq!(p.eb.qp.state(), softnic::QpState::Rts);
    }
}

/// What NVSHMEM's IBGDA posts for a warp's fetching atomics: a run of unsignaled 4-byte masked
/// fetch-adds (their old values big-endian) and 8-byte fetch-adds, each into its own result
/// slot, closed by a signaled DUMP with a strong fence whose CQE says they are all done. Over
/// the wire with selective repeat, with go-back-N, and with packets dropped, duplicated,
/// reordered and corrupted (a replayed atomic must answer from the responder's record, not
/// run twice), 30 rounds: every DUMP completes in order, and after it every old value of its
/// round is in place (the targets' final values and the old values, a permutation of the
/// counter's states, checked).
#[test]
fn fetching_atomics_closed_by_a_fenced_dump_as_nvshmem_posts_them() {
    let _serial = serial();
    const ROUNDS: usize = 30;
    const PER: usize = 16;
    let clean = || (WireFaults::default(), WireFaults::default());
    let faulty = || {
        let f = |s| faults(s, 0.03, 0.03, 0.03, 0.02);
        (f(7), f(70))
    };
    for (opts, (fa, fb), lossy) in [
        (wire_opts(), clean(), false),
        (go_back_n_opts(), clean(), false),
        (wire_opts(), faulty(), true),
    ] {
        let mut p = wire_pair(opts.clone(), opts, 1024, fa, fb);
        let tgt = p.b.buf(64, ALL_REMOTE);
        tgt.write(0, &1000u32.to_ne_bytes());
        tgt.set_u64(8, 0x5_0000_0003);
        let res = p.a.buf(ROUNDS * PER * 2 * 8, softnic::Access::LOCAL_WRITE);
        let fenced = prm::wqe::CtrlFlags {
            signaled: true,
            solicited: false,
            fence: prm::Fence::Strong,
        };
        let (mut old32, mut old64) = (Vec::new(), Vec::new());
        for r in 0..ROUNDS {
            let slot = |k: usize| (r * PER * 2 + k) * 8;
            for k in 0..PER {
                p.ea.post(
                    &Op::MaskedFetchAdd {
                        size: prm::wqe::AtomicSize::B4,
                        remote: tgt.remote(0),
                        add: 1,
                        field_boundary: 0,
                        result: res.sge(slot(k), 4),
                    },
                    UNSIG,
                );
                p.ea.post(
                    &Op::FetchAdd {
                        remote: tgt.remote(8),
                        add: 0x1_0000_0001,
                        result: res.sge(slot(PER + k), 8),
                    },
                    UNSIG,
                );
            }
            let dump = p.ea.post(
                &Op::Dump {
                    local: res.sge(0, 1),
                },
                fenced,
            );
            p.ea.ini.ring();
            assert_eq!(p.ea.expect_req(0x23, dump), 1, "round {r}");
            for k in 0..PER {
                let b = res.read(slot(k), 4);
                old32.push(u32::from_be_bytes(b.try_into().unwrap()));
                old64.push(res.u64_at(slot(PER + k)));
            }
        }
        let n = (ROUNDS * PER) as u64;
        assert_eq!(tgt.u32_at(0) as u64, 1000 + n);
        assert_eq!(tgt.u64_at(8), 0x5_0000_0003 + n * 0x1_0000_0001);
        old32.sort_unstable();
        old64.sort_unstable();
        assert!(old32.iter().enumerate().all(|(i, &v)| v == 1000 + i as u32));
        assert!(old64
            .iter()
            .enumerate()
            .all(|(i, &v)| v == 0x5_0000_0003 + i as u64 * 0x1_0000_0001));
        p.ea.expect_quiet(std::time::Duration::from_millis(2));
        let (ca, cb) = (p.a.dev.counters(), p.b.dev.counters());
        assert_eq!(
            lossy,
            ca.wire.injected_drops + cb.wire.injected_drops > 0,
            "{:?} {:?}",
            ca.wire,
            cb.wire
        );
    }
}
