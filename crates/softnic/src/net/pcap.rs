//! A pcap writer for the soft NIC's wire: every captured datagram is written as a raw IPv4
//! frame (link type 101, `LINKTYPE_RAW`) with the IPv4 and UDP headers synthesized around the
//! RoCEv2 packet exactly as its ICRC was computed
//! ([`crate::net::packet::ipv4_udp_headers_with_id`]: DF, the identification it leaves with),
//! so Wireshark and tshark dissect it as RoCEv2 (on port 4791 without options; on another
//! port with `-d udp.port==PORT,infiniband`). Part of [`crate::net`] (also published as
//! `softnic::pcap`): the port's egress and ingress hand it what they send and receive.

use crate::net::packet::{ipv4_udp_headers_with_id, Flow};
use parking_lot::Mutex;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// pcap link type of raw IPv4/IPv6 frames.
pub const LINKTYPE_RAW: u32 = 101;

struct Inner {
    out: BufWriter<File>,
    packets: u64,
    error: Option<std::io::Error>,
}

/// A pcap file being written. Shared by any number of devices (each frame is written whole
/// under a lock); frames are flushed to the file on [`PcapWriter::flush`] and on drop.
pub struct PcapWriter {
    inner: Mutex<Inner>,
}

impl PcapWriter {
    /// Creates (truncates) `path` and writes the pcap global header.
    pub fn create(path: impl AsRef<Path>) -> std::io::Result<Arc<Self>> {
        let mut out = BufWriter::new(File::create(path)?);
        out.write_all(&0xa1b2_c3d4u32.to_le_bytes())?;
        out.write_all(&2u16.to_le_bytes())?;
        out.write_all(&4u16.to_le_bytes())?;
        out.write_all(&0i32.to_le_bytes())?; // thiszone
        out.write_all(&0u32.to_le_bytes())?; // sigfigs
        out.write_all(&65535u32.to_le_bytes())?; // snaplen
        out.write_all(&LINKTYPE_RAW.to_le_bytes())?;
        Ok(Arc::new(Self {
            inner: Mutex::new(Inner {
                out,
                packets: 0,
                error: None,
            }),
        }))
    }

    /// Writes one datagram (`udp_payload` = BTH through ICRC) with synthesized headers.
    /// Errors are kept and reported by [`PcapWriter::flush`]; capturing never disturbs the
    /// data path.
    pub fn write_udp(&self, flow: &Flow, udp_payload: &[u8]) {
        self.write_udp_with_id(flow, 0, udp_payload)
    }

    /// [`PcapWriter::write_udp`] with IPv4 identification `ip_id` (the one the datagram
    /// leaves with, and its ICRC covers).
    pub fn write_udp_with_id(&self, flow: &Flow, ip_id: u16, udp_payload: &[u8]) {
        let (ip, udp) = ipv4_udp_headers_with_id(flow, ip_id, udp_payload.len());
        let len = (ip.len() + udp.len() + udp_payload.len()) as u32;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let mut g = self.inner.lock();
        if g.error.is_some() {
            return;
        }
        let r = (|| {
            g.out.write_all(&(now.as_secs() as u32).to_le_bytes())?;
            g.out.write_all(&now.subsec_micros().to_le_bytes())?;
            g.out.write_all(&len.to_le_bytes())?;
            g.out.write_all(&len.to_le_bytes())?;
            g.out.write_all(&ip)?;
            g.out.write_all(&udp)?;
            g.out.write_all(udp_payload)
        })();
        match r {
            Ok(()) => g.packets += 1,
            Err(e) => g.error = Some(e),
        }
    }

    /// Frames written so far.
    pub fn packets(&self) -> u64 {
        self.inner.lock().packets
    }

    /// Flushes buffered frames to the file; reports the first write error, if any.
    pub fn flush(&self) -> std::io::Result<()> {
        let mut g = self.inner.lock();
        if let Some(e) = g.error.take() {
            return Err(e);
        }
        g.out.flush()
    }
}

impl Drop for PcapWriter {
    fn drop(&mut self) {
        let _ = self.inner.get_mut().out.flush();
    }
}

impl std::fmt::Debug for PcapWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PcapWriter")
            .field("packets", &self.packets())
            .finish()
    }
}
