//! Malformed and stray datagrams at a wire port: truncated, oversized, unsupported opcodes
//! and versions, payloads longer than the path MTU, wrong destination QPNs, bad ICRCs, stray
//! responses and random garbage are all dropped and counted; nothing panics, nothing is
//! written, and the connection keeps working.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op};
use softnic::wire::packet::{self, opcode, Bth, Flow, Packet, Reth, DEFAULT_PKEY};
use softnic::{Access, QpState, WireFaults};
use std::net::{Ipv4Addr, UdpSocket};
use std::time::Duration;
use wire_util::*;

#[test]
fn malformed_packets_are_dropped_and_counted() {
    let _s = serial();
    let mut p = wire_pair(
        wire_opts(),
        wire_opts(),
        1024,
        WireFaults::default(),
        WireFaults::default(),
    );
    let dst = p.b.buf(4096, ALL_REMOTE);
    let src = p.a.buf(4096, Access::NONE);
    src.fill(0x42);
    let to = p.b.dev.wire_addr().unwrap();
    let raw = UdpSocket::bind("127.0.0.1:0").unwrap();
    let flow = Flow {
        src: Ipv4Addr::LOCALHOST,
        dst: Ipv4Addr::LOCALHOST,
        sport: raw.local_addr().unwrap().port(),
        dport: to.port(),
    };
    let qpn = p.eb.qpn();
    let bth = |op: u8, qp: u32, psn: u32| Bth {
        opcode: op,
        pkey: DEFAULT_PKEY,
        dest_qp: qp,
        psn,
        ack_req: true,
        ..Bth::default()
    };
    // a WRITE ONLY that would be accepted (PSN expected, rkey valid) if it were well formed
    let good_write = |qp: u32, payload: &[u8]| -> Vec<u8> {
        let mut out = Vec::new();
        let pk = Packet {
            bth: bth(opcode::WRITE_ONLY, qp, wire_opts().rts.sq_psn),
            reth: Some(Reth {
                va: dst.addr(0),
                rkey: dst.rkey().0,
                len: payload.len() as u32,
            }),
            payload,
            ..Packet::default()
        };
        packet::encode(&pk, &flow, &mut out).unwrap();
        out
    };
    let sealed = |mut body: Vec<u8>| -> Vec<u8> {
        packet::seal(&flow, &mut body);
        body
    };
    let mut malformed: Vec<Vec<u8>> = vec![
        vec![],
        vec![0; 5],
        vec![opcode::SEND_ONLY; 15],
        vec![0; 5000],
    ];
    // truncated: headers the opcode needs are missing (valid ICRC over what is there)
    let w = good_write(qpn, b"data");
    malformed.push(sealed(w[..12].to_vec()));
    malformed.push(sealed(w[..20].to_vec()));
    // unsupported opcodes (UD SEND, reserved, CNP) and a non-zero transport version
    for op in [0x64u8, 0x1f, 0x81] {
        let mut b = bth(op, qpn, 0).to_bytes().to_vec();
        b.extend_from_slice(&[0; 16]);
        malformed.push(sealed(b));
    }
    let mut v1 = good_write(qpn, b"data");
    v1.truncate(v1.len() - 4);
    v1[1] |= 1;
    malformed.push(sealed(v1));
    // a pad count larger than the payload
    let mut pad = good_write(qpn, b"");
    pad.truncate(pad.len() - 4);
    pad[1] |= 0x30;
    malformed.push(sealed(pad));
    // a payload longer than the path MTU (1024)
    malformed.push(good_write(qpn, &[7; 2048]));
    // payload on an ACK
    let mut ack = Vec::new();
    packet::encode(
        &Packet {
            bth: bth(opcode::ACK, qpn, 0),
            aeth: Some(packet::Aeth {
                syndrome: 0x1f,
                msn: 0,
            }),
            ..Packet::default()
        },
        &flow,
        &mut ack,
    )
    .unwrap();
    ack.truncate(ack.len() - 4);
    ack.extend_from_slice(b"xxxx");
    malformed.push(sealed(ack));
    // wrong QPNs
    let unknown = vec![good_write(0xab_cdef, b"data"), good_write(0, b"data")];
    // bad ICRCs (one flipped bit anywhere after the BTH, or in the ICRC itself)
    let mut bad_icrc = Vec::new();
    for at in [12, 20, 30, 33] {
        let mut b = good_write(qpn, b"data");
        b[at] ^= 4;
        bad_icrc.push(b);
    }
    // a stray ACK to a QP that sent nothing
    let mut stray = Vec::new();
    packet::encode(
        &Packet {
            bth: bth(opcode::ACK, qpn, 5),
            aeth: Some(packet::Aeth {
                syndrome: 0x1f,
                msn: 0,
            }),
            ..Packet::default()
        },
        &flow,
        &mut stray,
    )
    .unwrap();
    // random garbage, half of it aimed at the QP
    let mut rng = Rng(0x6a7b);
    let mut garbage = Vec::new();
    for i in 0..500 {
        let n = rng.range(16, 4200) as usize;
        let mut b = rng.bytes(n);
        b[1] &= 0xf0; // version 0 so that the header parses as far as it can
        if i % 2 == 0 {
            b[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
        }
        garbage.push(b);
    }
    let before = p.b.dev.counters().wire;
    for d in malformed
        .iter()
        .chain(&unknown)
        .chain(&bad_icrc)
        .chain([&stray])
        .chain(&garbage)
    {
        raw.send_to(d, to).unwrap();
    }
    let sent = (malformed.len() + unknown.len() + bad_icrc.len() + 1 + garbage.len()) as u64;
    wait_for("every datagram counted", Duration::from_secs(10), || {
        p.b.dev.counters().wire.rx_packets - before.rx_packets >= sent
    });
    let c = p.b.dev.counters().wire;
    let d = |a: u64, b: u64| a - b;
    assert_eq!(d(c.rx_packets, before.rx_packets), sent);
    let dropped = d(c.rx_malformed, before.rx_malformed)
        + d(c.rx_bad_icrc, before.rx_bad_icrc)
        + d(c.rx_unknown_qp, before.rx_unknown_qp)
        + d(c.rx_unexpected, before.rx_unexpected);
    assert_eq!(dropped, sent, "{c:?}");
    assert_eq!(
        d(c.rx_malformed, before.rx_malformed) - garbage_malformed(&garbage, qpn),
        malformed.len() as u64
    );
    assert!(d(c.rx_unknown_qp, before.rx_unknown_qp) >= unknown.len() as u64);
    assert!(d(c.rx_bad_icrc, before.rx_bad_icrc) >= bad_icrc.len() as u64);
    assert_eq!(d(c.rx_unexpected, before.rx_unexpected), 1, "the stray ACK");
    assert_eq!(
        d(c.tx_packets, before.tx_packets),
        0,
        "answered a bad datagram"
    );
    assert!(
        dst.bytes().iter().all(|&b| b == 0),
        "a dropped datagram wrote memory"
    );
    assert_eq!(p.eb.qp.state(), QpState::Rts);
    // the connection still works
    let i = p.ea.go(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 4096)]),
            imm: None,
        },
        SIG,
    );
    p.ea.expect_req(0x08, i);
    assert_eq!(dst.bytes(), vec![0x42; 4096]);
}

/// Garbage datagrams rejected before the QP lookup (too long): counted as malformed.
fn garbage_malformed(garbage: &[Vec<u8>], _qpn: u32) -> u64 {
    garbage
        .iter()
        .filter(|g| g.len() > packet::MAX_DATAGRAM)
        .count() as u64
}
