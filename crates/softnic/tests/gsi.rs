//! QP1 on the wire (`softnic::gsi`): a management datagram one device sends reaches the other's
//! handler with its source and payload; a device without a handler, or a QP1 datagram that is
//! not a GSI SEND (another Q_Key), drops it and counts it; a device without a wire port cannot
//! send one.

use softnic::net::packet::{self, opcode, Bth, Deth, Flow, Packet};
use softnic::*;
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Got = Arc<Mutex<Vec<(std::net::Ipv4Addr, u32, u16, Vec<u8>)>>>;

fn wire_dev() -> Device {
    Device::open(DeviceConfig {
        wire: Some(WireConfig::loopback()),
        ..Default::default()
    })
    .unwrap()
}

fn collect(dev: &Device) -> Got {
    let got: Got = Arc::default();
    let g = got.clone();
    dev.set_gsi_handler(Some(Arc::new(move |d: &gsi::GsiDatagram<'_>| {
        g.lock()
            .unwrap()
            .push((d.from, d.src_qp, d.pkey, d.mad.to_vec()))
    })));
    got
}

fn wait(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_mad_reaches_the_peers_handler_and_strangers_are_counted() {
    let (a, b) = (wire_dev(), wire_dev());
    // both on 127.0.0.1: each finds the other through its peer table
    a.add_peer(b.gid(), b.wire_addr().unwrap()).unwrap();
    b.add_peer(a.gid(), a.wire_addr().unwrap()).unwrap();
    let got = collect(&b);
    let mad: Vec<u8> = (0..gsi::MAD_LEN).map(|i| i as u8).collect();
    a.send_gsi(&b.gid(), &mad).unwrap();
    wait("the MAD arrives", || got.lock().unwrap().len() == 1);
    let (from, src_qp, pkey, bytes) = got.lock().unwrap()[0].clone();
    assert_eq!(from, std::net::Ipv4Addr::LOCALHOST);
    assert_eq!((src_qp, pkey), (gsi::QPN, 0xffff));
    assert_eq!(bytes, mad);

    // no handler on a: dropped, counted as a datagram for an unknown QP
    let before = a.counters().wire.rx_unknown_qp;
    b.send_gsi(&a.gid(), &mad).unwrap();
    wait("a counts it", || {
        a.counters().wire.rx_unknown_qp == before + 1
    });

    // a UD SEND to QP1 with another Q_Key: not a GSI datagram (malformed, handler not called)
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let (SocketAddr::V4(me), Some(SocketAddr::V4(to))) = (s.local_addr().unwrap(), b.wire_addr())
    else {
        panic!("IPv4 expected")
    };
    let flow = Flow {
        src: *me.ip(),
        dst: *to.ip(),
        sport: me.port(),
        dport: to.port(),
    };
    let p = Packet {
        bth: Bth {
            opcode: opcode::UD_SEND_ONLY,
            pkey: 0xffff,
            dest_qp: gsi::QPN,
            ..Bth::default()
        },
        deth: Some(Deth {
            qkey: 0x1234,
            src_qp: 1,
        }),
        payload: &mad,
        ..Packet::default()
    };
    let mut d = Vec::new();
    packet::encode(&p, &flow, &mut d).unwrap();
    let malformed = b.counters().wire.rx_malformed;
    s.send_to(&d, to).unwrap();
    wait("b counts it", || {
        b.counters().wire.rx_malformed == malformed + 1
    });
    assert_eq!(
        got.lock().unwrap().len(),
        1,
        "the handler saw only the GSI datagram"
    );
    b.set_gsi_handler(None);
}

#[test]
fn a_device_without_a_wire_port_sends_no_mad() {
    let d = Device::open(DeviceConfig::default()).unwrap();
    assert!(matches!(
        d.send_gsi(&d.gid(), &[0; gsi::MAD_LEN]),
        Err(Error::Wire(WireError::NoPort))
    ));
}
