//! The bytes on the wire: traffic between two soft NICs is captured by the kernel (an
//! AF_PACKET socket of the test) on a loopback and on a veth pair between two network
//! namespaces (link MTU 9000 and 1500; QPs asking for path MTU 4096), and every frame is checked with an ICRC the test computes itself from the IBTA
//! rule over the headers Linux actually sent (identification, flags, lengths), with DF set
//! and no IP fragment. The kernel is made to segment segmented sends before the capture point
//! (`gso_max_segs 1`), so the capture holds the datagrams a wire would carry. Needs root
//! (network namespaces): skipped with a note elsewhere, a failure under CI.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op};
use softnic::wire::packet::opcode;
use softnic::{Access, Device, DeviceConfig, WireConfig, WireFaults};
use std::collections::BTreeMap;
use wire_util::netns::{self, Netns, Sniffer};
use wire_util::*;

/// What the frames of a capture showed.
#[derive(Debug, Default)]
struct Checked {
    frames: usize,
    /// RoCEv2 frames per BTH opcode.
    opcodes: BTreeMap<u8, usize>,
    /// Distinct IPv4 identifications seen.
    ids: std::collections::BTreeSet<u16>,
    largest: usize,
}

/// Checks every captured UDP frame: IPv4 without options, DF, not a fragment, at most
/// `link_mtu` bytes, and (RoCEv2 ones: port 4791 or a non-empty payload) a valid ICRC.
fn check_frames(frames: &[netns::Frame], link_mtu: usize) -> Checked {
    let mut c = Checked::default();
    for (n, f) in frames.iter().enumerate() {
        let ip = &f.ip;
        if ip.len() < 28 || ip[0] >> 4 != 4 || ip[9] != 17 {
            continue;
        }
        let udp_len = u16::from_be_bytes([ip[24], ip[25]]) as usize;
        if udp_len <= 8 {
            continue; // the I/O threads' wake-up datagrams
        }
        c.frames += 1;
        let flags = u16::from_be_bytes([ip[6], ip[7]]);
        assert_eq!(ip[0], 0x45, "frame {n}: IPv4 header with options");
        assert!(
            flags & 0x4000 != 0,
            "frame {n}: DF not set: {:02x?}",
            &ip[..28]
        );
        assert_eq!(
            flags & 0x3fff,
            0,
            "frame {n}: an IP fragment (MF or offset): {:02x?}",
            &ip[..28]
        );
        let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        assert_eq!(total, ip.len(), "frame {n}: IP length");
        assert_eq!(udp_len + 20, total, "frame {n}: UDP length");
        assert!(
            total <= link_mtu,
            "frame {n}: {total} bytes on a link of MTU {link_mtu}"
        );
        c.largest = c.largest.max(total);
        let (want, got) = netns::wire_icrc(ip).expect("a RoCEv2 frame");
        let id = u16::from_be_bytes([ip[4], ip[5]]);
        assert_eq!(
            want,
            got,
            "frame {n} ({} bytes, IP ID {id}, opcode {:#04x}, {}): ICRC computed over the \
             headers on the wire {want:#010x}, carried {got:#010x}",
            total,
            ip[28],
            if f.outgoing { "outgoing" } else { "incoming" }
        );
        c.ids.insert(id);
        *c.opcodes.entry(ip[28]).or_default() += 1;
    }
    c
}

/// A workload with every kind of packet: WRITEs of 1 MiB (segmented sends) and small ones,
/// a multi-packet READ (segmented responses), an atomic, a SEND, at 1% loss on both sides
/// (NAKs, retransmissions).
fn workload(p: &mut Pair) {
    const SIZE: usize = 4 << 20;
    let src = p.a.buf(SIZE, Access::NONE);
    fill_random(&src, 0x1c2c);
    let dst = p.b.buf(SIZE, ALL_REMOTE);
    bulk_write(p, &src, &dst, 1 << 20, 4);
    assert!(dst.bytes() == src.bytes(), "bytes differ");
    let small = p.a.buf(4096, Access::LOCAL_WRITE);
    let rbuf = p.b.buf(8192, Access::LOCAL_WRITE);
    for _ in 0..2 {
        p.eb.ini.post_recv(&[rbuf.sge(0, 8192)]).unwrap();
    }
    let i = p.ea.go(
        &Op::Write {
            remote: dst.remote(100),
            local: Local::Sges(&[src.sge(0, 333)]),
            imm: Some(7),
        },
        SIG,
    );
    p.ea.expect_req(0x09, i);
    let _ = p.eb.recv_cqe();
    let back = p.a.buf(256 << 10, Access::LOCAL_WRITE);
    let i = p.ea.go(
        &Op::Read {
            remote: dst.remote(0),
            local: &[back.sge(0, 256 << 10)],
        },
        SIG,
    );
    p.ea.expect_req(0x10, i);
    assert!(back.bytes() == dst.read(0, 256 << 10));
    let i = p.ea.go(
        &Op::FetchAdd {
            remote: dst.remote(8),
            add: 3,
            result: small.sge(0, 8),
        },
        SIG,
    );
    p.ea.expect_req(0x12, i);
    let i = p.ea.go(
        &Op::Send {
            local: Local::Sges(&[src.sge(0, 6000)]),
            imm: None,
        },
        SIG,
    );
    p.ea.expect_req(0x0a, i);
    let _ = p.eb.recv_cqe();
}

fn lossy(seed: u64) -> WireFaults {
    WireFaults::loss(0.01, seed)
}

#[test]
fn loopback_frames_carry_a_valid_icrc() {
    let _s = serial();
    if !netns::privileged("loopback_frames_carry_a_valid_icrc") {
        return;
    }
    let ns = Netns::single().expect("namespace");
    ns.segment_in_software(0, "lo").expect("gso_max_segs");
    let frames = ns.run(0, || {
        let sniff = Sniffer::start("lo");
        let mut p = wire_pair(wire_opts(), wire_opts(), 4096, lossy(1), lossy(2));
        workload(&mut p);
        drop(p);
        sniff.finish()
    });
    let c = check_frames(&frames, 65536);
    eprintln!("loopback: {} frames checked: {c:?}", frames.len());
    assert_ok(&c);
    drop(ns);
}

/// Every kind of packet was seen, and segmented sends (identifications past 0).
fn assert_ok(c: &Checked) {
    for op in [
        opcode::WRITE_FIRST,
        opcode::WRITE_MIDDLE,
        opcode::WRITE_LAST,
        opcode::WRITE_ONLY_IMM,
        opcode::READ_REQUEST,
        opcode::READ_RESPONSE_FIRST,
        opcode::READ_RESPONSE_MIDDLE,
        opcode::READ_RESPONSE_LAST,
        opcode::FETCH_ADD,
        opcode::ATOMIC_ACK,
        opcode::SEND_FIRST,
        opcode::SEND_LAST,
        opcode::ACK,
    ] {
        assert!(c.opcodes.contains_key(&op), "no {op:#04x} frame: {c:?}");
    }
    assert!(c.frames > 1000, "{c:?}");
    assert!(c.ids.contains(&0) && c.ids.len() > 1, "{:?}", c.ids);
}

/// Two namespaces joined by a veth pair of link MTU `mtu`, a soft NIC in each at port 4791;
/// QPs set up for path MTU 4096 (RTR), as perftest's default asks. Returns the checked
/// capture taken on the first namespace's veth (both directions).
fn over_veth(sub: u8, mtu: u32) -> Option<Checked> {
    let test = format!("over_veth_mtu_{mtu}");
    if !netns::privileged(&test) {
        return None;
    }
    let ns = Netns::pair(sub, mtu).expect("namespaces");
    for i in 0..2 {
        ns.segment_in_software(i, "veth0").expect("gso_max_segs");
    }
    let open = |i: usize, host: u8| {
        ns.run(i, || {
            let dev = Device::open(DeviceConfig {
                wire: Some(WireConfig {
                    faults: lossy(host as u64),
                    ..WireConfig::new((Netns::addr(sub, host), 4791).into())
                }),
                ..Default::default()
            })
            .unwrap();
            let pd = dev.alloc_pd();
            Node { dev, pd }
        })
    };
    let (a, b) = (open(0, 1), open(1, 2));
    for (x, y, host) in [(&a, &b, 2), (&b, &a, 1)] {
        x.dev
            .add_peer(y.dev.gid(), (Netns::addr(sub, host), 4791).into())
            .unwrap();
    }
    let sniff = ns.run(0, || Sniffer::start("veth0"));
    let (ea, eb) = connect_mtu(&a, &wire_opts(), &b, &wire_opts(), 4096);
    let mut p = Pair { a, b, ea, eb };
    workload(&mut p);
    drop(p);
    let frames = sniff.finish();
    let c = check_frames(&frames, mtu as usize);
    eprintln!("veth MTU {mtu}: {c:?}");
    assert_ok(&c);
    drop(ns);
    Some(c)
}

#[test]
fn veth_mtu_9000_frames_carry_a_valid_icrc() {
    let _s = serial();
    if let Some(c) = over_veth(1, 9000) {
        // path MTU 4096: the largest frame is 4096 bytes of payload with its headers
        assert!(c.largest > 4096 && c.largest <= 4096 + 64, "{c:?}");
    }
}

#[test]
fn veth_mtu_1500_frames_carry_a_valid_icrc_and_no_fragment() {
    let _s = serial();
    if let Some(c) = over_veth(2, 1500) {
        // path MTU 1024 (RTR asked for 4096): the largest frame is 1024 bytes of payload
        // with its headers
        assert!(c.largest > 1024 && c.largest <= 1024 + 64, "{c:?}");
    }
}

#[test]
fn path_mtu_from_the_link() {
    use softnic::wire::{roce_mtu, route_mtu};
    assert_eq!(roce_mtu(65536), 4096);
    assert_eq!(roce_mtu(9000), 4096);
    assert_eq!(roce_mtu(4160), 4096);
    assert_eq!(roce_mtu(4159), 2048);
    assert_eq!(roce_mtu(1500), 1024);
    assert_eq!(roce_mtu(1280), 1024);
    assert_eq!(roce_mtu(576), 512);
    assert_eq!(roce_mtu(300), 256);
    let lo = std::net::Ipv4Addr::LOCALHOST;
    assert_eq!(route_mtu(lo, lo).map(roce_mtu).unwrap(), 4096);
}
