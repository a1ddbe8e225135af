//! Unit tests of the RoCEv2 formats and the ICRC.

use super::*;

/// A CNP frame captured on a ConnectX-4 Lx (published with scapy's RoCE tests): its ICRC
/// bytes on the wire are `82 fd 00 2a`.
#[test]
fn icrc_of_a_frame_captured_on_connectx4() {
    let frame: [u8; 64] = [
        0x45, 0xc2, 0x00, 0x3c, 0x71, 0x8c, 0x40, 0x00, 0x40, 0x11, 0x91, 0x61, 0x0a, 0x00, 0x11,
        0x01, 0x0a, 0x00, 0x12, 0x01, // IPv4
        0x00, 0x00, 0x12, 0xb7, 0x00, 0x28, 0x00, 0x00, // UDP
        0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0x00, 0x00, 0x00, 0x00, // BTH
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // CNP padding
        0x82, 0xfd, 0x00, 0x2a, // ICRC
        0, 0, 0, 0, // (unused)
    ];
    let ip: [u8; 20] = frame[..20].try_into().unwrap();
    let udp: [u8; 8] = frame[20..28].try_into().unwrap();
    let crc = icrc_with_headers(&ip, &udp, &frame[28..56]);
    assert_eq!(crc.to_le_bytes(), [0x82, 0xfd, 0x00, 0x2a]);
}

#[test]
fn icrc_follows_the_ip_id() {
    let flow = Flow {
        src: Ipv4Addr::new(10, 1, 0, 1),
        dst: Ipv4Addr::new(10, 1, 0, 2),
        sport: 0xc123,
        dport: ROCE_PORT,
    };
    for len in [0usize, 3, 100, 1024, 4096] {
        let payload = vec![0x5au8; len];
        let p = Packet {
            bth: Bth {
                opcode: opcode::SEND_ONLY,
                pkey: DEFAULT_PKEY,
                dest_qp: 0x11,
                psn: 7,
                ..Bth::default()
            },
            payload: &payload,
            ..Packet::default()
        };
        let mut d = Vec::new();
        encode(&p, &flow, &mut d).unwrap();
        assert_eq!(icrc_ip_id(&flow, &d, 0), Some(0));
        for id in [1u16, 2, 5, 31, 62, 63] {
            let mut e = d.clone();
            reseal_ip_id(&mut e, 0, id);
            let body = &e[..e.len() - ICRC_LEN];
            // the resealed ICRC is the one computed from scratch over that identification
            assert_eq!(
                icrc_for_id(&flow, id, body).to_le_bytes(),
                e[e.len() - ICRC_LEN..],
                "len {len} id {id}"
            );
            assert_eq!(icrc_ip_id(&flow, &e, 0), Some(id));
            assert_eq!(icrc_ip_id(&flow, &e, id), Some(id));
            assert_eq!(icrc_ip_id(&flow, &e, 9), Some(id));
            assert!(!icrc_matches(&flow, &e));
            reseal_ip_id(&mut e, id, 0);
            assert_eq!(e, d);
        }
        // an identification outside the accepted range, or a flipped bit, is rejected
        let mut far = d.clone();
        reseal_ip_id(&mut far, 0, 1000);
        assert_eq!(icrc_ip_id(&flow, &far, 0), None);
        let mut bad = d.clone();
        bad[BTH_LEN] ^= 1;
        assert_eq!(icrc_ip_id(&flow, &bad, 0), None);
    }
    assert_eq!(icrc_ip_id(&flow, &[1, 2, 3], 0), None);
}

#[test]
fn synthesized_ipv4_checksum_verifies() {
    let f = Flow {
        src: Ipv4Addr::new(127, 0, 0, 1),
        dst: Ipv4Addr::new(10, 1, 2, 3),
        sport: 5000,
        dport: ROCE_PORT,
    };
    let (ip, udp) = ipv4_udp_headers(&f, 100);
    let mut sum = 0u32;
    for c in ip.chunks(2) {
        sum += u16::from_be_bytes([c[0], c[1]]) as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    assert_eq!(sum, 0xffff);
    assert_eq!(u16::from_be_bytes([ip[2], ip[3]]), 128);
    assert_eq!(u16::from_be_bytes([udp[4], udp[5]]), 108);
}

#[test]
fn encode_parse_round_trip_every_opcode() {
    let flow = Flow {
        src: Ipv4Addr::LOCALHOST,
        dst: Ipv4Addr::LOCALHOST,
        sport: 1,
        dport: 2,
    };
    let payload = [7u8; 13];
    let mut out = Vec::new();
    for op in 0..=255u8 {
        let Some(l) = layout(op) else { continue };
        // a DC opcode stands for an RC one: the packet names that, marked DC
        let (class, rc) = Class::of(op);
        let p = Packet {
            bth: Bth {
                opcode: rc,
                pkey: DEFAULT_PKEY,
                dest_qp: 0x12_3456,
                psn: 0xff_fffe,
                ack_req: true,
                mig_req: true,
                ..Bth::default()
            },
            reth: l.reth.then_some(Reth {
                va: 0x1122_3344_5566_7788,
                rkey: 0xabcd_ef01,
                len: 13,
            }),
            aeth: l.aeth.then_some(Aeth {
                syndrome: aeth::ACK,
                msn: 0x00_0102,
            }),
            atomic: l.atomic.then_some(AtomicEth {
                va: 8,
                rkey: 9,
                swap_add: 10,
                compare: 11,
            }),
            masked: l.masked.then_some(MaskedAtomicEth {
                va: 16,
                rkey: 1,
                size: 4,
                swap_add: 2,
                compare_boundary: 3,
                swap_mask: 4,
                compare_mask: 5,
            }),
            atomic_ack: l.atomic_ack.then_some(0xdead_beef),
            imm: l.imm.then_some(0x0102_0304),
            ieth: l.ieth.then_some(0x0a0b_0c0d),
            deth: l.deth.then_some(Deth {
                qkey: 0x8000_0011,
                src_qp: 0x00_0203,
            }),
            class,
            dceth: l.dceth.then_some(Dceth {
                key: 0x0102_0304_0506_0708,
                generation: 0xfeed_0001,
                dci: 0x45_6789,
                start_psn: 0xff_fff0,
                reply_port: 40_123,
            }),
            xrceth: l.xrceth.then_some(0x00ab_cdef),
            payload: if l.payload { &payload } else { &[] },
        };
        encode(&p, &flow, &mut out).unwrap();
        assert_eq!(out[0], op, "the wire opcode");
        assert_eq!(out.len() % 4, 0, "{op:#x}");
        assert_eq!(l.dceth, class == Class::Dc && is_request(rc), "{op:#x}");
        assert_eq!(l.xrceth, class == Class::Xrc && is_request(rc), "{op:#x}");
        assert!(icrc_matches(&flow, &out));
        let q = parse(&out).unwrap();
        let mut want = p;
        want.bth.pad = if l.payload { 3 } else { 0 };
        assert_eq!(q, want, "{op:#x}");
        // any flipped bit past the BTH is caught by the ICRC
        let mut bad = out.clone();
        let last = bad.len() - 5;
        bad[last] ^= 0x10;
        assert!(!icrc_matches(&flow, &bad));
        // the congestion byte is not covered
        let mut ecn = out.clone();
        ecn[4] = 0xc0;
        assert!(icrc_matches(&flow, &ecn));
        // truncations never panic and never parse
        for n in 0..BTH_LEN + l.header_len() + ICRC_LEN {
            assert!(parse(&out[..n]).is_err(), "{op:#x} truncated to {n}");
        }
    }
    let mut ud = [0u8; 40];
    ud[0] = 0x66; // UD, but not a SEND only
    assert_eq!(parse(&ud), Err(PacketError::Opcode(0x66)));
    ud[0] = 0x04;
    ud[1] = 0x01;
    assert_eq!(parse(&ud), Err(PacketError::Version(1)));
    assert!(matches!(
        parse(&vec![0u8; MAX_DATAGRAM + 1]),
        Err(PacketError::Oversized(_))
    ));
}

#[test]
fn ud_send_carries_a_deth_before_the_immediate() {
    let flow = Flow {
        src: Ipv4Addr::new(127, 0, 140, 1),
        dst: Ipv4Addr::new(127, 0, 140, 2),
        sport: 0xc001,
        dport: ROCE_PORT,
    };
    let payload = [7u8; 5];
    let p = Packet {
        bth: Bth {
            opcode: opcode::UD_SEND_ONLY_IMM,
            pkey: DEFAULT_PKEY,
            dest_qp: 0x12_3456,
            psn: 9,
            ..Bth::default()
        },
        deth: Some(Deth {
            qkey: 0x1111_2222,
            src_qp: 0xab_cdef,
        }),
        imm: Some(0xdead_beef),
        payload: &payload,
        ..Packet::default()
    };
    let mut d = Vec::new();
    encode(&p, &flow, &mut d).unwrap();
    // BTH 12, DETH 8 (Q_Key, reserved byte, source QP), ImmDt 4, 5 bytes + 3 pad, ICRC 4
    assert_eq!(d.len(), 12 + 8 + 4 + 8 + 4);
    assert_eq!(d[0], 0x65);
    assert_eq!(
        &d[12..20],
        &[0x11, 0x11, 0x22, 0x22, 0x00, 0xab, 0xcd, 0xef]
    );
    assert_eq!(&d[20..24], &[0xde, 0xad, 0xbe, 0xef]);
    assert!(icrc_matches(&flow, &d));
    let q = parse(&d).unwrap();
    assert_eq!(q.deth, p.deth);
    assert_eq!(q.imm, Some(0xdead_beef));
    assert_eq!(q.payload, &payload);
    assert!(is_ud(q.bth.opcode) && !is_request(q.bth.opcode));
    // without the immediate
    let p2 = Packet {
        bth: Bth {
            opcode: opcode::UD_SEND_ONLY,
            ..p.bth
        },
        imm: None,
        ..p
    };
    encode(&p2, &flow, &mut d).unwrap();
    let q = parse(&d).unwrap();
    assert_eq!((q.deth, q.imm, q.payload), (p.deth, None, &payload[..]));
    // a DETH is required to encode; a truncated one does not parse
    let bare = Packet { deth: None, ..p2 };
    assert_eq!(
        encode(&bare, &flow, &mut d),
        Err(PacketError::MissingHeader(opcode::UD_SEND_ONLY))
    );
    let mut short = vec![0x64, 0, 0xff, 0xff, 0, 0, 0, 1, 0, 0, 0, 1];
    short.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
    assert!(matches!(parse(&short), Err(PacketError::Truncated { .. })));
    // other UD opcodes (RDMA on UD does not exist; CNP etc.) are not spoken
    let mut other = [0u8; 40];
    other[0] = 0x66;
    assert_eq!(parse(&other), Err(PacketError::Opcode(0x66)));
}

#[test]
fn ud_parser_never_panics() {
    let mut x = 0x9e37_79b9u32;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    for _ in 0..50_000 {
        let len = (next() % 80) as usize;
        let mut d: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if let Some(b) = d.first_mut() {
            *b = 0x64 + (next() % 3) as u8;
        }
        if d.len() > 1 {
            d[1] &= 0xf0;
        }
        if let Ok(p) = parse(&d) {
            assert!(p.deth.is_some());
        }
    }
}
