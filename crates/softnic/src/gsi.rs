//! QP1, the general services interface, on the wire: management datagrams (MADs) as a RoCEv2
//! ConnectX sends and takes them. A GSI datagram is a UD SEND to destination QP 1 with a DETH
//! naming source QP 1 and the GSI Q_Key 0x80010000, its payload one 256-byte MAD (IBTA
//! 13.4.6.2; RoCEv2 carries it in BTH + DETH over UDP 4791 like any UD packet).
//!
//! The soft NIC does not interpret MADs: a program above it (the uverbs emulation's connection
//! manager) installs a handler per device ([`set_handler`], `Device::set_gsi_handler`), which
//! gets every well-formed GSI datagram the device's wire port receives, and sends its own with
//! [`send`] (`Device::send_gsi`). A device without a handler drops GSI datagrams (counted as
//! `rx_unknown_qp`, as before this module). Datagrams are checked as UD packets are (ICRC by
//! the I/O thread, then format, P_Key, Q_Key here); nothing here panics on any input.

use crate::counters::Counters;
use crate::net::packet::{self, opcode, Bth, Deth, Flow, Packet, DEFAULT_PKEY, MASK24};
use crate::net::socket::TxBatch;
use crate::net::WireError;
use crate::shared::Shared;
use crate::Gid;
use parking_lot::RwLock;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

/// The GSI's QP number.
pub const QPN: u32 = 1;
/// The GSI's well-known Q_Key (IBTA 13.4.6.2: QP1 takes only this one).
pub const QKEY: u32 = 0x8001_0000;
/// Bytes of a MAD.
pub const MAD_LEN: usize = 256;

/// One GSI datagram as the handler gets it.
#[derive(Debug)]
pub struct GsiDatagram<'a> {
    /// The sender's address (its RoCEv2 GID is `::ffff:<this>`).
    pub from: Ipv4Addr,
    /// The source QP of the DETH (1 from a GSI).
    pub src_qp: u32,
    /// The BTH's P_Key.
    pub pkey: u16,
    /// The payload: the MAD.
    pub mad: &'a [u8],
}

/// What a program installs to take a device's GSI datagrams. It runs on the device's wire I/O
/// thread (or a thread carrying the device): it must not wait long.
pub type GsiHandler = Arc<dyn Fn(&GsiDatagram<'_>) + Send + Sync>;

/// The handlers, by device (a device's handler goes with the device).
static HANDLERS: RwLock<Vec<(Weak<Shared>, GsiHandler)>> = RwLock::new(Vec::new());
/// The PSNs of GSI sends (UD: any; a counter, as a QP's).
static PSN: AtomicU32 = AtomicU32::new(0);

/// Installs (or, with `None`, removes) the GSI handler of `dev`.
pub(crate) fn set_handler(dev: &Arc<Shared>, h: Option<GsiHandler>) {
    let mut hs = HANDLERS.write();
    hs.retain(|(w, _)| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(dev)));
    if let Some(h) = h {
        hs.push((Arc::downgrade(dev), h));
    }
}

fn handler(dev: &Shared) -> Option<GsiHandler> {
    HANDLERS
        .read()
        .iter()
        .find(|(w, _)| std::ptr::eq(w.as_ptr(), dev))
        .map(|(_, h)| h.clone())
}

/// Takes a datagram for QP 1 whose ICRC was checked: a UD SEND with the GSI's Q_Key goes to
/// the device's handler; anything else is counted as malformed (or, without a handler, as a
/// datagram for an unknown QP) and dropped.
pub(crate) fn on_packet(dev: &Shared, d: &[u8], flow: &Flow) {
    let wc = &dev.counters.wire;
    let Some(h) = handler(dev) else {
        Counters::add(&wc.rx_unknown_qp, 1);
        return;
    };
    match packet::parse(d) {
        Ok(Packet {
            bth,
            deth: Some(deth),
            imm: None,
            payload,
            ..
        }) if bth.opcode == opcode::UD_SEND_ONLY
            && bth.pkey & 0x7fff == 0x7fff
            && deth.qkey == QKEY =>
        {
            h(&GsiDatagram {
                from: flow.src,
                src_qp: deth.src_qp,
                pkey: bth.pkey,
                mad: payload,
            });
        }
        _ => Counters::add(&wc.rx_malformed, 1),
    }
}

/// Sends `mad` from QP 1 of `dev` to QP 1 of the device with GID `to`: the peer-table entry of
/// that GID, else the GID's IPv4 address at the port's default UDP port (the RoCEv2 port).
pub(crate) fn send(dev: &Shared, to: &Gid, mad: &[u8]) -> Result<(), WireError> {
    let port = dev.port().ok_or(WireError::NoPort)?;
    let addr = match dev.peer_addr(to) {
        Some(SocketAddr::V4(a)) => a,
        _ => SocketAddrV4::new(
            to.to_ipv4().ok_or(WireError::GidNotIpv4(*to))?,
            port.cfg.default_port,
        ),
    };
    let flow = Flow {
        src: port.ip,
        dst: *addr.ip(),
        sport: port.source_port(QPN ^ u32::from(*addr.ip())),
        dport: addr.port(),
    };
    let p = Packet {
        bth: Bth {
            opcode: opcode::UD_SEND_ONLY,
            mig_req: true,
            pkey: DEFAULT_PKEY,
            dest_qp: QPN,
            psn: PSN.fetch_add(1, Ordering::Relaxed) & MASK24,
            ..Bth::default()
        },
        deth: Some(Deth {
            qkey: QKEY,
            src_qp: QPN,
        }),
        payload: mad,
        ..Packet::default()
    };
    let mut buf = Vec::with_capacity(packet::BTH_LEN + packet::DETH_LEN + mad.len() + 4);
    if packet::encode(&p, &flow, &mut buf).is_ok() {
        let mut batch = TxBatch::default();
        port.send(&buf, SocketAddr::V4(addr), &flow, &mut batch);
        port.flush(&mut batch);
    }
    Ok(())
}
