//! The wire port of a device: its UDP socket, the egress path (fault injection, capture,
//! batching with UDP segmentation offload) and the I/O thread that receives datagrams (with
//! UDP receive coalescing) and hands them to the transport one RoCEv2 packet at a time.
//!
//! Batching: consecutive packets of one sender to one destination that have the same size
//! (the last may be shorter) leave in one `sendmsg` with `UDP_SEGMENT`: the kernel cuts them
//! into ordinary datagrams, one RoCEv2 packet each, exactly as if each had been sent alone.
//! The receiving socket asks for `UDP_GRO` and splits what it gets back into the original
//! datagrams. Kernels without either fall back to one system call per packet.

use super::packet::{Flow, ICRC_LEN, MAX_DATAGRAM};
use super::{Capture, WireConfig, WireError, WireFaults};
use crate::counters::Counters;
use crate::device::Shared;
use parking_lot::Mutex;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long the I/O thread blocks in one receive: the longest a reordered datagram is held
/// back when nothing else is sent.
const RECV_TIMEOUT: Duration = Duration::from_millis(1);
/// The largest UDP payload of one IPv4 datagram, and so of one segmented send.
const MAX_UDP: usize = 65507;
/// Segments one segmented send may carry (the kernel's `UDP_MAX_SEGMENTS`).
const MAX_SEGMENTS: usize = 64;

struct FaultState {
    f: WireFaults,
    rng: u64,
    held: Option<(Vec<u8>, SocketAddr, Flow)>,
}

impl FaultState {
    /// splitmix64, in `0.0..1.0`.
    fn roll(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Packets on their way out, gathered by one sender (a pump, a responder reply) so that
/// packets of one size leave in one segmented send. Flushed with [`Port::flush`].
#[derive(Default)]
pub(crate) struct TxBatch {
    buf: Vec<u8>,
    seg: usize,
    count: usize,
    /// The last segment is shorter than `seg`: nothing may follow it.
    closed: bool,
    to: Option<SocketAddr>,
}

/// A device's UDP endpoint.
pub(crate) struct Port {
    pub sock: UdpSocket,
    /// The bound address.
    pub local: SocketAddr,
    /// The device's own IPv4 address (from its GID), as put in synthesized headers.
    pub ip: Ipv4Addr,
    pub cfg: WireConfig,
    counters: Arc<Counters>,
    faulty: AtomicBool,
    faults: Mutex<FaultState>,
    capturing: AtomicBool,
    capture: Mutex<Option<Capture>>,
    /// Segmented sends work on this socket (cleared at the first failure).
    gso: AtomicBool,
    /// The socket coalesces received datagrams.
    pub gro: bool,
}

fn setsockopt_int(sock: &UdpSocket, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> bool {
    // SAFETY: the fd is an open socket owned by `sock` for the duration of the call; the
    // option value is a live c_int whose size is passed along.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

fn set_buffer(sock: &UdpSocket, force: libc::c_int, plain: libc::c_int, bytes: usize) {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    // Not privileged: the kernel caps the plain option at net.core.[rw]mem_max.
    if !setsockopt_int(sock, libc::SOL_SOCKET, force, v) {
        setsockopt_int(sock, libc::SOL_SOCKET, plain, v);
    }
}

fn sockaddr_in(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

impl Port {
    pub fn open(cfg: WireConfig, ip: Ipv4Addr, counters: Arc<Counters>) -> Result<Self, WireError> {
        if !cfg.bind.is_ipv4() {
            return Err(WireError::NotIpv4(cfg.bind));
        }
        let sock = UdpSocket::bind(cfg.bind).map_err(|source| WireError::Bind {
            addr: cfg.bind,
            source,
        })?;
        set_buffer(
            &sock,
            libc::SO_RCVBUFFORCE,
            libc::SO_RCVBUF,
            cfg.socket_buffer,
        );
        set_buffer(
            &sock,
            libc::SO_SNDBUFFORCE,
            libc::SO_SNDBUF,
            cfg.socket_buffer,
        );
        let gro = setsockopt_int(&sock, libc::SOL_UDP, libc::UDP_GRO, 1);
        sock.set_read_timeout(Some(RECV_TIMEOUT))
            .map_err(WireError::Socket)?;
        let local = sock.local_addr().map_err(WireError::Socket)?;
        let faults = cfg.faults;
        Ok(Self {
            sock,
            local,
            ip,
            counters,
            faulty: AtomicBool::new(!faults.is_clean()),
            faults: Mutex::new(FaultState {
                f: faults,
                rng: faults.seed,
                held: None,
            }),
            capturing: AtomicBool::new(false),
            capture: Mutex::new(None),
            gso: AtomicBool::new(true),
            gro,
            cfg,
        })
    }

    pub fn set_faults(&self, f: WireFaults) {
        let held = {
            let mut s = self.faults.lock();
            s.f = f;
            s.rng = f.seed;
            self.faulty.store(!f.is_clean(), Ordering::Release);
            s.held.take()
        };
        if let Some((d, to, flow)) = held {
            let mut b = TxBatch::default();
            self.emit(&d, to, &flow, &mut b);
            self.flush(&mut b);
        }
    }

    pub fn set_capture(&self, c: Option<Capture>) {
        let mut g = self.capture.lock();
        self.capturing.store(c.is_some(), Ordering::Release);
        *g = c;
    }

    /// Captures a received datagram when ingress capture is on.
    pub fn capture_rx(&self, flow: &Flow, d: &[u8]) {
        if self.capturing.load(Ordering::Acquire) {
            if let Some(c) = self.capture.lock().as_ref().filter(|c| c.ingress) {
                c.writer.write_udp(flow, d);
            }
        }
    }

    /// Puts one datagram on its way (captured now, sent at the next flush).
    fn emit(&self, d: &[u8], to: SocketAddr, flow: &Flow, b: &mut TxBatch) {
        if self.capturing.load(Ordering::Acquire) {
            if let Some(c) = self.capture.lock().as_ref() {
                c.writer.write_udp(flow, d);
            }
        }
        let fits = b.count > 0
            && b.to == Some(to)
            && !b.closed
            && d.len() <= b.seg
            && b.count < MAX_SEGMENTS
            && b.buf.len() + d.len() <= MAX_UDP;
        if !fits {
            self.flush(b);
            b.seg = d.len();
            b.to = Some(to);
        }
        b.buf.extend_from_slice(d);
        b.count += 1;
        b.closed = d.len() < b.seg;
        if !self.gso.load(Ordering::Relaxed) {
            self.flush(b);
        }
    }

    /// Sends what `b` holds: one datagram, or several in one segmented send.
    pub fn flush(&self, b: &mut TxBatch) {
        let Some(to) = b.to else { return };
        if b.count == 0 {
            return;
        }
        let ok = if b.count == 1 {
            self.sock.send_to(&b.buf, to).is_ok()
        } else {
            match self.send_segmented(&b.buf, b.seg, to) {
                Ok(()) => true,
                Err(_) => {
                    // no segmentation offload here: one datagram at a time from now on
                    self.gso.store(false, Ordering::Relaxed);
                    let mut ok = true;
                    for d in b.buf.chunks(b.seg) {
                        ok &= self.sock.send_to(d, to).is_ok();
                    }
                    ok
                }
            }
        };
        let w = &self.counters.wire;
        if ok {
            Counters::add(&w.tx_packets, b.count as u64);
            Counters::add(&w.tx_bytes, b.buf.len() as u64);
        } else {
            Counters::add(&w.tx_errors, b.count as u64);
        }
        b.buf.clear();
        b.count = 0;
        b.closed = false;
    }

    /// One `sendmsg` with `UDP_SEGMENT`: the kernel cuts `data` into `seg`-byte datagrams.
    fn send_segmented(&self, data: &[u8], seg: usize, to: SocketAddr) -> std::io::Result<()> {
        let SocketAddr::V4(to) = to else {
            return Err(std::io::ErrorKind::Unsupported.into());
        };
        let mut addr = sockaddr_in(to);
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        let mut cbuf = [0u64; 4];
        // SAFETY: msghdr is plain data; every pointer put in it (address, iovec, control
        // buffer) points to a live local that outlives the sendmsg call, with its length.
        // The control buffer (32 bytes, 8-aligned) holds one cmsg with a u16 payload, whose
        // CMSG_SPACE is 24 bytes on Linux.
        let r = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_name = &mut addr as *mut libc::sockaddr_in as *mut libc::c_void;
            msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = libc::CMSG_SPACE(2) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = libc::UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(2) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, seg as u16);
            libc::sendmsg(self.sock.as_raw_fd(), &msg, 0)
        };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Sends one datagram (BTH through ICRC) to `to` through batch `b` (flush it when done);
    /// `flow` names its synthesized headers. Fault injection decides here.
    pub fn send(&self, d: &[u8], to: SocketAddr, flow: &Flow, b: &mut TxBatch) {
        if !self.faulty.load(Ordering::Acquire) {
            self.emit(d, to, flow, b);
            return;
        }
        let w = &self.counters.wire;
        let mut s = self.faults.lock();
        let f = s.f;
        if s.roll() < f.drop {
            Counters::add(&w.injected_drops, 1);
            return;
        }
        let corrupted = if s.roll() < f.corrupt && d.len() > 12 {
            let mut c = d.to_vec();
            let at = 12 + ((s.roll() * (c.len() - 12) as f64) as usize).min(c.len() - 13);
            let bit = (s.roll() * 8.0) as u32 % 8;
            c[at] ^= 1 << bit;
            Counters::add(&w.injected_corruptions, 1);
            Some(c)
        } else {
            None
        };
        let d: &[u8] = corrupted.as_deref().unwrap_or(d);
        let dup = s.roll() < f.duplicate;
        if s.roll() < f.reorder && s.held.is_none() {
            Counters::add(&w.injected_reorders, 1);
            s.held = Some((d.to_vec(), to, *flow));
            if dup {
                Counters::add(&w.injected_duplicates, 1);
                self.emit(d, to, flow, b);
            }
            return;
        }
        self.emit(d, to, flow, b);
        if dup {
            Counters::add(&w.injected_duplicates, 1);
            self.emit(d, to, flow, b);
        }
        if let Some((h, hto, hflow)) = s.held.take() {
            self.emit(&h, hto, &hflow, b);
        }
    }

    /// Sends a datagram held back by reordering, if any.
    pub fn flush_held(&self) {
        if !self.faulty.load(Ordering::Acquire) {
            return;
        }
        let held = self.faults.lock().held.take();
        if let Some((h, to, flow)) = held {
            let mut b = TxBatch::default();
            self.emit(&h, to, &flow, &mut b);
            self.flush(&mut b);
        }
    }

    /// Wakes the I/O thread (an empty datagram to ourselves).
    pub fn wake(&self) {
        let mut to = self.local;
        if to.ip().is_unspecified() {
            to.set_ip(Ipv4Addr::LOCALHOST.into());
        }
        let _ = self.sock.send_to(&[], to);
    }

    /// Receives one datagram, or a coalesced run of them. Returns (bytes, source, segment
    /// size when coalesced, truncated).
    fn recv(&self, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr, Option<usize>, bool)> {
        if !self.gro {
            let (n, from) = self.sock.recv_from(buf)?;
            return Ok((n, from, None, false));
        }
        // SAFETY: zeroed sockaddr_in and msghdr are valid; every pointer put in the msghdr
        // points to a live local (or `buf`) with its length, for the duration of recvmsg.
        // Control messages are read only within msg_controllen, through the CMSG macros.
        unsafe {
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr() as *mut libc::c_void,
                iov_len: buf.len(),
            };
            let mut cbuf = [0u64; 8];
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_name = &mut addr as *mut libc::sockaddr_in as *mut libc::c_void;
            msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
            let n = libc::recvmsg(self.sock.as_raw_fd(), &mut msg, 0);
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut seg = None;
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                    let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                    seg = (v > 0).then_some(v as usize);
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
            let from = SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
                u16::from_be(addr.sin_port),
            ));
            Ok((n as usize, from, seg, msg.msg_flags & libc::MSG_TRUNC != 0))
        }
    }
}

/// The I/O thread: receives datagrams until the device shuts down.
pub(crate) fn run(dev: Arc<Shared>, port: Arc<Port>) {
    // Large enough for any UDP datagram and any coalesced run, so an oversized datagram is
    // seen whole (and dropped as such) rather than silently truncated into one that parses.
    let mut buf = vec![0u8; 1 << 17];
    let mut scratch = Vec::with_capacity(MAX_DATAGRAM + ICRC_LEN);
    let mut batch = TxBatch::default();
    while !dev.shutdown.load(Ordering::Acquire) {
        match port.recv(&mut buf) {
            Ok((n, from, seg, truncated)) => {
                if dev.shutdown.load(Ordering::Acquire) {
                    break;
                }
                if truncated {
                    Counters::add(&dev.counters.wire.rx_packets, 1);
                    Counters::add(&dev.counters.wire.rx_malformed, 1);
                    continue;
                }
                let data = &buf[..n];
                match seg {
                    Some(s) if s > 0 && n > s => {
                        for d in data.chunks(s) {
                            super::transport::receive(
                                &dev,
                                &port,
                                d,
                                from,
                                &mut scratch,
                                &mut batch,
                            );
                        }
                    }
                    _ => {
                        super::transport::receive(&dev, &port, data, from, &mut scratch, &mut batch)
                    }
                }
                port.flush(&mut batch);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                port.flush_held();
            }
            // ICMP errors reported on the socket and the like: nothing to do but go on.
            Err(_) => {}
        }
    }
}
