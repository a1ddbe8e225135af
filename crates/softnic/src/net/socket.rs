//! The wire port of a device: its UDP sockets (the bound one, and the entropy-port ones that
//! requesters send from), the egress path (fault injection, capture, batching with UDP
//! segmentation offload) and the ingress path: waiting for readable sockets and receiving
//! datagrams (with UDP receive coalescing), which the transport's I/O thread drives.
//!
//! Batching: consecutive packets of one sender to one destination that have the same size
//! (the last may be shorter) leave in one `sendmsg` with `UDP_SEGMENT`: the kernel cuts them
//! into ordinary datagrams, one RoCEv2 packet each, exactly as if each had been sent alone.
//! The receiving socket asks for `UDP_GRO` and splits what it gets back into the original
//! datagrams. Kernels without either fall back to one system call per packet.
//!
//! Part of [`crate::net`], below the QP: it moves datagrams and holds no QP state; the RC
//! transport ([`crate::wire`]) and UD ([`crate::ud`]) send through it.

use super::ip_ids::IpIds;
use super::packet::{self, Flow};
use super::{Capture, WireConfig, WireError, WireFaults};
use crate::counters::Counters;
use crate::sched::Spinner;
use parking_lot::Mutex;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long the I/O thread blocks in one receive while fault injection holds a reordered
/// datagram back: the longest it is held when nothing else is sent.
const HELD_TIMEOUT: Duration = Duration::from_millis(1);
/// How long it blocks otherwise (the device's drop wakes it; timers run in the engine).
const IDLE_TIMEOUT: Duration = Duration::from_millis(100);
/// The largest UDP payload of one IPv4 datagram, and so of one segmented send.
const MAX_UDP: usize = 65507;
/// Segments one segmented send may carry (the kernel's `UDP_MAX_SEGMENTS`).
const MAX_SEGMENTS: usize = 64;
/// Sockets bound to entropy source ports (RoCE's 0xC000..=0xFFFF) from which requesters send:
/// a QP sends from one of them (chosen by its peer's QPN and address), so that flows of
/// different QPs spread over ECMP paths as they do from a RoCE NIC. Their answers come back
/// to them.
const ENTROPY_SOCKETS: usize = 8;
/// The RoCE entropy source-port range.
pub(crate) const ENTROPY_PORTS: std::ops::RangeInclusive<u16> = 0xC000..=0xFFFF;
/// Datagrams the I/O thread takes from one ready socket before it looks at the others.
pub(crate) const RX_BURST: usize = 64;

struct FaultState {
    f: WireFaults,
    rng: u64,
    held: Option<(Vec<u8>, SocketAddr, Flow)>,
    /// Datagrams through the faults since they were set (`WireFaults::stall` counts them).
    sent: u64,
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
    /// Index of the socket (in [`Port::socks`]) it leaves from.
    sock: usize,
    /// Where a packet is built while fault injection is on (it decides per datagram, so the
    /// packet is handed over on its own, as [`Port::send`] takes it), and whether the packet
    /// being built is there.
    spare: Vec<u8>,
    in_spare: bool,
    /// The batch's sender may hold plain ACKs back ([`Port::flush_or_hold`]): the wire I/O
    /// thread's, while it watches for the answer to what it delivers.
    pub(crate) hold_acks: bool,
}

impl TxBatch {
    /// Where the next packet is built: in place at the end of the batch's buffer (`in_place`,
    /// the port without fault injection), else alone in the spare buffer. Returns its offset
    /// and the IPv4 identification to seal it for (its place in the batch; 0 alone).
    pub(crate) fn slot(&mut self, in_place: bool) -> (usize, u16) {
        self.in_spare = !in_place;
        if in_place {
            (self.buf.len(), self.count as u16)
        } else {
            self.spare.clear();
            (0, 0)
        }
    }

    /// The buffer to build the next packet into (appended at [`TxBatch::slot`]'s offset).
    pub(crate) fn buf(&mut self) -> &mut Vec<u8> {
        if self.in_spare {
            &mut self.spare
        } else {
            &mut self.buf
        }
    }

    /// Drops what was appended after offset `start` (a packet that could not be built).
    pub(crate) fn cut(&mut self, start: usize) {
        if self.in_spare {
            self.spare.clear();
        } else {
            self.buf.truncate(start);
        }
    }
}

/// One UDP socket of a port.
pub(crate) struct Sock {
    pub sock: UdpSocket,
    /// Its bound port.
    pub port: u16,
    /// Segmented sends work on this socket (cleared at the first failure).
    gso: AtomicBool,
}

/// A device's UDP endpoint: the bound socket (where peers send requests, and from which
/// answers leave) and the entropy-port sockets that requesters send from.
pub(crate) struct Port {
    /// `socks[0]` is the bound socket, the rest bound to entropy ports.
    pub socks: Vec<Sock>,
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
    /// RoCE path MTUs of the routes to peers found so far.
    path_mtus: Mutex<Vec<(Ipv4Addr, u32)>>,
    /// The real IPv4 identifications of received datagrams, from a raw socket opened at the
    /// first need ([`Port::real_ip_id`]); `Err` once refused.
    ip_ids: Mutex<Option<Result<IpIds, ()>>>,
    /// Plain ACKs held back by the I/O thread ([`Port::flush_or_hold`]) until the device's next
    /// packet leaves, or the I/O thread lets them go; `acks_held` says whether any may wait.
    acks: Mutex<TxBatch>,
    acks_held: AtomicBool,
    /// The receive buffers; whoever holds them receives (the I/O thread, or a thread that
    /// polls the device inline: [`crate::wire::transport::poll_inline`]), so datagrams are
    /// handled one at a time, in the order they arrived.
    pub(crate) rx: Mutex<RxBufs>,
}

/// What receiving needs: room for any datagram or coalesced run, a reply's scratch space and
/// the batch replies leave in.
pub(crate) struct RxBufs {
    pub buf: Vec<u8>,
    pub scratch: Vec<u8>,
    pub batch: TxBatch,
}

impl RxBufs {
    fn new() -> Self {
        Self {
            // Large enough for any UDP datagram and any coalesced run, so an oversized
            // datagram is seen whole (and dropped as such) rather than silently truncated
            // into one that parses.
            buf: vec![0u8; 1 << 17],
            scratch: Vec::with_capacity(packet::MAX_DATAGRAM + packet::ICRC_LEN),
            batch: TxBatch::default(),
        }
    }
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

/// Bytes a RoCEv2 packet adds to its payload in an IPv4 datagram, at most: IPv4 20, UDP 8,
/// BTH 12, RETH 16 and ImmDt 4 (a WRITE ONLY with immediate), ICRC 4.
pub const ROCE_OVERHEAD: u32 = 20 + 8 + 12 + 16 + 4 + 4;

/// The RoCE path MTU for a link MTU: the largest of 256, 512, 1024, 2048 and 4096 whose
/// packets fit in one IPv4 datagram of the link (256 when none does).
pub fn roce_mtu(link_mtu: u32) -> u32 {
    [4096, 2048, 1024, 512]
        .into_iter()
        .find(|m| m + ROCE_OVERHEAD <= link_mtu)
        .unwrap_or(256)
}

/// The link MTU of the route from `local` to `peer`, as the kernel has it (`IP_MTU` of a UDP
/// socket connected there; connecting sends nothing). Needs no privilege.
pub fn route_mtu(local: Ipv4Addr, peer: Ipv4Addr) -> std::io::Result<u32> {
    let sock = UdpSocket::bind(SocketAddrV4::new(local, 0))?;
    sock.connect(SocketAddrV4::new(peer, super::packet::ROCE_PORT))?;
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the fd is an open socket owned by `sock` for the duration of the call; `v` and
    // `len` are live locals and `len` is the size of `v`.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU,
            &mut v as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 || v <= 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v as u32)
}

/// Sets up a bound socket: DF with identification 0, buffers, receive coalescing. Sends
/// block; receives do not (the I/O thread polls).
fn setup(sock: UdpSocket, cfg: &WireConfig) -> Result<Sock, WireError> {
    // RoCEv2 is never fragmented, and its ICRC covers the IPv4 identification and flags.
    // With IP_PMTUDISC_DO, Linux sets DF on every datagram of an unconnected socket, never
    // fragments it (a datagram over the path MTU fails with EMSGSIZE) and gives it
    // identification 0 (the n-th segment of a segmented send: n), the headers the ICRC is
    // computed over ([`super::packet::icrc_for_id`]). Without it the kernel picks hashed
    // identifications no receiver could check.
    if !setsockopt_int(
        &sock,
        libc::IPPROTO_IP,
        libc::IP_MTU_DISCOVER,
        libc::IP_PMTUDISC_DO,
    ) {
        return Err(WireError::Socket(std::io::Error::last_os_error()));
    }
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
    // coalesced receives where the kernel has them (a control message gives the segment size)
    setsockopt_int(&sock, libc::SOL_UDP, libc::UDP_GRO, 1);
    // A RoCE NIC drops IPv4 packets with options or fragments; a UDP socket sees neither
    // unless it asks: the options come as a control message, and so does the largest
    // fragment's size of a datagram the kernel reassembled (Linux 4.10 on). Where refused,
    // such datagrams are taken as any other (the ICRC, computed over a 20-byte header,
    // fails for those with options).
    let ip_checks = setsockopt_int(&sock, libc::IPPROTO_IP, libc::IP_RECVOPTS, 1)
        & setsockopt_int(&sock, libc::IPPROTO_IP, libc::IP_RECVFRAGSIZE, 1);
    if !ip_checks {
        tracing::debug!(
            "IP_RECVOPTS / IP_RECVFRAGSIZE refused: IPv4 options and fragments not seen"
        );
    }
    let port = sock.local_addr().map_err(WireError::Socket)?.port();
    Ok(Sock {
        sock,
        port,
        gso: AtomicBool::new(true),
    })
}

/// Binds up to `n` sockets on `ip` at random ports of [`ENTROPY_PORTS`] (ports in use are
/// skipped; fewer, or none, when the range is crowded).
fn entropy_socks(ip: Ipv4Addr, n: usize, cfg: &WireConfig) -> Vec<Sock> {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    let mut seed = h.finish();
    let span = (*ENTROPY_PORTS.end() - *ENTROPY_PORTS.start()) as u64 + 1;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n * 16 {
        if out.len() == n {
            break;
        }
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let port = *ENTROPY_PORTS.start() + ((seed >> 33) % span) as u16;
        if let Ok(sock) = UdpSocket::bind(SocketAddrV4::new(ip, port)) {
            if let Ok(s) = setup(sock, cfg) {
                out.push(s);
            }
        }
    }
    out
}

impl Port {
    pub fn open(cfg: WireConfig, ip: Ipv4Addr, counters: Arc<Counters>) -> Result<Self, WireError> {
        let SocketAddr::V4(bind4) = cfg.bind else {
            return Err(WireError::NotIpv4(cfg.bind));
        };
        let sock = UdpSocket::bind(cfg.bind).map_err(|source| WireError::Bind {
            addr: cfg.bind,
            source,
        })?;
        let local = sock.local_addr().map_err(WireError::Socket)?;
        let mut socks = vec![setup(sock, &cfg)?];
        socks.extend(entropy_socks(*bind4.ip(), ENTROPY_SOCKETS, &cfg));
        let faults = cfg.faults;
        Ok(Self {
            socks,
            local,
            ip,
            counters,
            faulty: AtomicBool::new(!faults.is_clean()),
            faults: Mutex::new(FaultState {
                f: faults,
                rng: faults.seed,
                held: None,
                sent: 0,
            }),
            capturing: AtomicBool::new(false),
            capture: Mutex::new(None),
            path_mtus: Mutex::new(Vec::new()),
            ip_ids: Mutex::new(None),
            acks: Mutex::new(TxBatch::default()),
            acks_held: AtomicBool::new(false),
            rx: Mutex::new(RxBufs::new()),
            cfg,
        })
    }

    /// The source port of a requester flow (`key`: its peer's QPN and address): one of the
    /// entropy ports, or the bound port when none could be bound.
    pub fn source_port(&self, key: u32) -> u16 {
        match self.socks.len() {
            0 | 1 => self.local.port(),
            n => self.socks[1 + key as usize % (n - 1)].port,
        }
    }

    /// The RoCE path MTU to `peer` ([`roce_mtu`] of the route's link MTU); `None` when the
    /// kernel has no route there. Looked up once per peer address.
    pub fn path_mtu(&self, peer: Ipv4Addr) -> Option<u32> {
        if let Some(&(_, m)) = self.path_mtus.lock().iter().find(|(a, _)| *a == peer) {
            return Some(m);
        }
        let local = match self.local {
            SocketAddr::V4(a) => *a.ip(),
            SocketAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
        };
        let m = roce_mtu(route_mtu(local, peer).ok()?);
        let mut g = self.path_mtus.lock();
        if g.len() >= 1024 {
            g.clear();
        }
        g.push((peer, m));
        Some(m)
    }

    /// The socket bound to source port `sport` (the bound one when none is).
    fn sock_of(&self, sport: u16) -> usize {
        self.socks.iter().position(|s| s.port == sport).unwrap_or(0)
    }

    pub fn set_faults(&self, f: WireFaults) {
        let held = {
            let mut s = self.faults.lock();
            s.f = f;
            s.rng = f.seed;
            s.sent = 0;
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

    /// Captures a received datagram when ingress capture is on, with the IPv4 identification
    /// its ICRC was computed over (0 when none fits).
    pub fn capture_rx(&self, flow: &Flow, d: &[u8], id_hint: u16) {
        if self.capturing.load(Ordering::Acquire) {
            if let Some(c) = self.capture.lock().as_ref().filter(|c| c.ingress) {
                let id = packet::icrc_ip_id(flow, d, id_hint).unwrap_or(0);
                c.writer.write_udp_with_id(flow, id, d);
            }
        }
    }

    /// Puts one datagram (sealed for IPv4 identification 0) on its way: resealed for the
    /// identification it will leave with, captured now, sent at the next flush.
    fn emit(&self, d: &[u8], to: SocketAddr, flow: &Flow, b: &mut TxBatch) {
        let sock = self.sock_of(flow.sport);
        let fits = b.count > 0
            && b.to == Some(to)
            && b.sock == sock
            && !b.closed
            && d.len() <= b.seg
            && b.count < MAX_SEGMENTS
            && b.buf.len() + d.len() <= MAX_UDP;
        if !fits {
            self.flush(b);
            b.seg = d.len();
            b.to = Some(to);
            b.sock = sock;
        }
        // The kernel gives the n-th segment of a segmented send identification n.
        let id = b.count as u16;
        let start = b.buf.len();
        b.buf.extend_from_slice(d);
        packet::reseal_ip_id(&mut b.buf[start..], 0, id);
        if self.capturing.load(Ordering::Acquire) {
            if let Some(c) = self.capture.lock().as_ref() {
                c.writer.write_udp_with_id(flow, id, &b.buf[start..]);
            }
        }
        b.count += 1;
        b.closed = d.len() < b.seg;
        if !self.socks[b.sock].gso.load(Ordering::Relaxed) {
            self.flush(b);
        }
    }

    /// Whether fault injection is on (packets are then built alone, see [`TxBatch::slot`]).
    pub fn is_faulty(&self) -> bool {
        self.faulty.load(Ordering::Acquire)
    }

    /// Sends the packet built at [`TxBatch::slot`]'s place (sealed for the identification it
    /// gave) to `to`; `flow` names its synthesized headers. Built in place, it joins the batch
    /// when it fits; otherwise the batch before it leaves first and it starts the next one
    /// (moved to the front, resealed for identification 0). Built alone (fault injection on),
    /// it takes the path of [`Port::send`].
    pub fn send_built(&self, b: &mut TxBatch, start: usize, to: SocketAddr, flow: &Flow) {
        if b.in_spare {
            let d = std::mem::take(&mut b.spare);
            self.send(&d, to, flow, b);
            b.spare = d;
            return;
        }
        let id = b.count as u16;
        let len = b.buf.len() - start;
        let sock = self.sock_of(flow.sport);
        let fits = b.count > 0
            && b.to == Some(to)
            && b.sock == sock
            && !b.closed
            && len <= b.seg
            && b.count < MAX_SEGMENTS
            && b.buf.len() <= MAX_UDP;
        if !fits {
            if b.count > 0 {
                self.send_prefix(b, start);
                packet::reseal_ip_id(&mut b.buf, id, 0);
            }
            b.seg = len;
            b.to = Some(to);
            b.sock = sock;
        }
        let (start, id) = (b.buf.len() - len, b.count as u16);
        if self.capturing.load(Ordering::Acquire) {
            if let Some(c) = self.capture.lock().as_ref() {
                c.writer.write_udp_with_id(flow, id, &b.buf[start..]);
            }
        }
        b.count += 1;
        b.closed = len < b.seg;
        if !self.socks[b.sock].gso.load(Ordering::Relaxed) {
            self.flush(b);
        }
    }

    /// Sends what `b` holds: one datagram, or several in one segmented send.
    pub fn flush(&self, b: &mut TxBatch) {
        let end = b.buf.len();
        self.send_prefix(b, end);
    }

    /// Sends the batch's `b.count` datagrams, `b.buf[..end]`, and removes them (what follows
    /// `end`, a packet built in place, moves to the front).
    fn send_prefix(&self, b: &mut TxBatch, end: usize) {
        if b.to.is_none() || b.count == 0 {
            return;
        }
        // ACKs held back leave ahead of anything the device sends after them
        self.release_acks();
        self.send_prefix_now(b, end);
    }

    /// [`Port::send_prefix`] without the ACKs held back.
    fn send_prefix_now(&self, b: &mut TxBatch, end: usize) {
        let Some(to) = b.to else { return };
        if b.count == 0 {
            return;
        }
        let s = &self.socks[b.sock.min(self.socks.len() - 1)];
        let ok = if b.count == 1 {
            send_one(&s.sock, &b.buf[..end], to)
        } else {
            match send_segmented(&s.sock, &b.buf[..end], b.seg, to) {
                Ok(()) => true,
                Err(_) => {
                    // no segmentation offload here: one datagram at a time from now on
                    s.gso.store(false, Ordering::Relaxed);
                    let mut ok = true;
                    for (i, d) in b.buf[..end].chunks_mut(b.seg).enumerate() {
                        // alone, each leaves with identification 0
                        packet::reseal_ip_id(d, i as u16, 0);
                        ok &= send_one(&s.sock, d, to);
                    }
                    ok
                }
            }
        };
        let w = &self.counters.wire;
        if ok {
            Counters::add(&w.tx_packets, b.count as u64);
            Counters::add(&w.tx_bytes, end as u64);
        } else {
            Counters::add(&w.tx_errors, b.count as u64);
        }
        b.buf.drain(..end);
        b.count = 0;
        b.closed = false;
    }
}

/// Whether every packet `b` holds is a plain ACK: opcode ACKNOWLEDGE (of any class), AETH
/// syndrome ACK (not an RNR NAK or a NAK).
fn only_plain_acks(b: &TxBatch) -> bool {
    const AETH_AT: usize = packet::BTH_LEN;
    b.seg > 0
        && b.buf.chunks(b.seg).all(|d| {
            d.len() > AETH_AT && d[0] & 0x1f == packet::opcode::ACK && d[AETH_AT] & 0xe0 == 0
        })
}

fn send_one(sock: &UdpSocket, d: &[u8], to: SocketAddr) -> bool {
    sock.send_to(d, to).is_ok()
}

/// One `sendmsg` with `UDP_SEGMENT`: the kernel cuts `data` into `seg`-byte datagrams.
fn send_segmented(
    sock: &UdpSocket,
    data: &[u8],
    seg: usize,
    to: SocketAddr,
) -> std::io::Result<()> {
    {
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
            libc::sendmsg(sock.as_raw_fd(), &msg, 0)
        };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}

impl Port {
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
        s.sent += 1;
        if let Some((_, t)) = f.stall.filter(|&(n, _)| s.sent == n + 1) {
            std::thread::sleep(t);
        }
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

    /// How long the I/O thread may block in `poll`: briefly while a reordered datagram is
    /// held back, which only a later send or [`Port::flush_held`] lets go.
    pub(crate) fn recv_timeout(&self) -> Duration {
        if self.faulty.load(Ordering::Acquire) && self.faults.lock().held.is_some() {
            HELD_TIMEOUT
        } else {
            IDLE_TIMEOUT
        }
    }

    /// Sends what `b` holds ([`Port::flush`]), unless `b` may hold ACKs back
    /// ([`TxBatch::hold_acks`]) and all it holds are plain ACKs (no NAK, no RNR NAK, no
    /// response carrying data): those wait until the device's next packet leaves (they leave
    /// first) or [`Port::release_acks`]; ACKs held before them leave now. A responder
    /// may delay and coalesce its ACKs (IBTA 9.7.5.1.1); the wire I/O thread holds them only
    /// while it watches for the answer to what it delivered, tens of microseconds, far below
    /// any requester's timeout, so that the answer and the ACK reach the peer together and
    /// its I/O thread wakes once for both, not once for the ACK in the middle of the round
    /// trip. Their order on the wire stays the one a NIC gives them: before the answer.
    pub(crate) fn flush_or_hold(&self, b: &mut TxBatch) {
        if !b.hold_acks || b.count == 0 || !only_plain_acks(b) {
            self.flush(b);
            return;
        }
        let mut held = self.acks.lock();
        if held.count > 0 {
            // those held before leave now (moving them in would renumber their IPv4
            // identifications)
            let end = held.buf.len();
            self.send_prefix_now(&mut held, end);
        }
        std::mem::swap(&mut *held, b);
        b.hold_acks = held.hold_acks;
        self.acks_held.store(true, Ordering::Release);
    }

    /// Sends the ACKs [`Port::flush_or_hold`] held back, if any.
    pub(crate) fn release_acks(&self) {
        if !self.acks_held.load(Ordering::Acquire) || !self.acks_held.swap(false, Ordering::AcqRel)
        {
            return;
        }
        let mut held = self.acks.lock();
        let end = held.buf.len();
        self.send_prefix_now(&mut held, end);
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

    /// The IPv4 identification of the packet that carried the datagram (or began the
    /// coalesced run) from `src:sport` to `dport` with BTH `bth`, where a raw socket shows it
    /// (opened at the first call: datagrams before it are not seen). `None` where the
    /// process may not open one, or the raw socket did not see it.
    pub fn real_ip_id(&self, src: Ipv4Addr, sport: u16, dport: u16, bth: &[u8]) -> Option<u16> {
        let mut g = self.ip_ids.lock();
        let ids = g.get_or_insert_with(|| {
            let ports: Vec<u16> = self.socks.iter().map(|s| s.port).collect();
            let r = IpIds::open(self.ip, &ports).ok_or(());
            match &r {
                Ok(_) => tracing::debug!("raw socket open: IPv4 identifications seen"),
                Err(()) => {
                    tracing::debug!("no raw socket: only identifications 0..63 pass the ICRC check")
                }
            }
            r
        });
        ids.as_mut().ok()?.lookup(src, sport, dport, bth)
    }

    /// Wakes the I/O thread (an empty datagram to ourselves).
    pub fn wake(&self) {
        let mut to = self.local;
        if to.ip().is_unspecified() {
            to.set_ip(Ipv4Addr::LOCALHOST.into());
        }
        let _ = self.socks[0].sock.send_to(&[], to);
    }

    /// Receives one datagram, or a coalesced run of them, from socket `i` without waiting.
    pub(crate) fn recv(&self, i: usize, buf: &mut [u8]) -> std::io::Result<Received> {
        let s = &self.socks[i];
        // SAFETY: zeroed sockaddr_in and msghdr are valid; every pointer put in the msghdr
        // points to a live local (or `buf`) with its length, for the duration of recvmsg.
        // Control messages are read only within msg_controllen, through the CMSG macros.
        unsafe {
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr() as *mut libc::c_void,
                iov_len: buf.len(),
            };
            // room for UDP_GRO, IP_RECVFRAGSIZE and up to 40 bytes of IPv4 options
            let mut cbuf = [0u64; 16];
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_name = &mut addr as *mut libc::sockaddr_in as *mut libc::c_void;
            msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
            let n = libc::recvmsg(s.sock.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT);
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut seg = None;
            let mut not_plain = false;
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                match ((*c).cmsg_level, (*c).cmsg_type) {
                    (libc::SOL_UDP, libc::UDP_GRO) => {
                        let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                        seg = (v > 0).then_some(v as usize);
                    }
                    // sent only for a datagram with options, or reassembled from fragments
                    (libc::IPPROTO_IP, libc::IP_RECVOPTS | libc::IP_RECVFRAGSIZE) => {
                        not_plain = true;
                    }
                    _ => {}
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
            let from = SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
                u16::from_be(addr.sin_port),
            ));
            Ok(Received {
                len: n as usize,
                from,
                seg,
                truncated: msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0,
                not_plain,
            })
        }
    }
}

/// What one `recvmsg` of a port's socket brought.
pub(crate) struct Received {
    /// Bytes received.
    pub len: usize,
    /// The source address.
    pub from: SocketAddr,
    /// The segment size, when the kernel coalesced a run of datagrams (`UDP_GRO`).
    pub seg: Option<usize>,
    /// The datagram (or its control messages) did not fit.
    pub truncated: bool,
    /// The IPv4 packet had options or came in fragments: no RoCE packet does.
    pub not_plain: bool,
}

/// How long the I/O thread keeps looking (without sleeping) for the next datagram after one
/// came, before it sleeps in `poll`: waking a sleeping thread costs more than this on a busy
/// or virtual machine, and while data flows the next datagram is rarely further away.
const SPIN: Duration = Duration::from_micros(50);

fn poll_once(fds: &mut [libc::pollfd], ready: &mut [bool], timeout: Duration) -> bool {
    for p in fds.iter_mut() {
        p.revents = 0;
    }
    // microseconds count (an I/O thread's look for an answer's doorbell: crate::sched)
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `fds` is a live slice of pollfds of open sockets (owned by the port, which the
    // caller holds), its length passed along; `ts` is a live timespec; no signal mask.
    let n = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    let mut any = false;
    for (r, p) in ready.iter_mut().zip(fds.iter()) {
        *r = n > 0 && p.revents != 0;
        any |= *r;
    }
    any
}

/// Waits at most `timeout` for datagrams on any of the sockets `fds`; marks the ready ones in
/// `ready`. Returns whether any is. With a `spin` (datagrams came in the last pass): it first
/// looks for [`SPIN`] without sleeping, giving the core away between looks, unless a look
/// finds the core shared with a busy task (then a sleeper is woken sooner: [`Spinner`]).
pub(crate) fn wait_readable(
    fds: &mut [libc::pollfd],
    ready: &mut [bool],
    spin: Option<&mut Spinner>,
    timeout: Duration,
) -> bool {
    if let Some(spinner) = spin {
        let start = std::time::Instant::now();
        loop {
            if poll_once(fds, ready, Duration::ZERO) {
                return true;
            }
            let now = std::time::Instant::now();
            if now.duration_since(start) >= SPIN || !spinner.may_spin(now) {
                break;
            }
            spinner.yield_now();
        }
    }
    poll_once(fds, ready, timeout)
}

impl Port {
    /// One `pollfd` per socket, in socket order (for [`wait_readable`]).
    pub(crate) fn pollfds(&self) -> Vec<libc::pollfd> {
        self.socks
            .iter()
            .map(|s| libc::pollfd {
                fd: s.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect()
    }

    /// The local UDP port of socket `i`.
    pub(crate) fn sock_port(&self, i: usize) -> u16 {
        self.socks[i].port
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::packet::{aeth, opcode, Aeth, Bth, Packet, DEFAULT_PKEY};

    /// An ACK or NAK (`syndrome`) for `psn`, encoded for `flow`.
    fn answer(syndrome: u8, psn: u32, flow: &Flow) -> Vec<u8> {
        let p = Packet {
            bth: Bth {
                opcode: opcode::ACK,
                pkey: DEFAULT_PKEY,
                dest_qp: 0x12,
                psn,
                ..Bth::default()
            },
            aeth: Some(Aeth { syndrome, msn: 1 }),
            ..Packet::default()
        };
        let mut out = Vec::new();
        packet::encode(&p, flow, &mut out).unwrap();
        out
    }

    /// The next datagram `peer` receives: its PSN and AETH syndrome, or `None` within 50 ms.
    fn next(peer: &UdpSocket) -> Option<(u32, u8)> {
        let mut buf = [0u8; 256];
        let n = peer.recv(&mut buf).ok()?;
        let p = packet::parse(&buf[..n]).unwrap();
        Some((p.bth.psn, p.aeth.unwrap().syndrome))
    }

    #[test]
    fn held_acks_leave_ahead_of_the_next_packet_and_a_nak_is_never_held() {
        let port = Port::open(
            WireConfig::loopback(),
            Ipv4Addr::LOCALHOST,
            Arc::new(Counters::default()),
        )
        .unwrap();
        let peer = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        peer.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let to = peer.local_addr().unwrap();
        let flow = Flow {
            src: Ipv4Addr::LOCALHOST,
            dst: Ipv4Addr::LOCALHOST,
            sport: port.local.port(),
            dport: to.port(),
        };
        let mut b = TxBatch {
            hold_acks: true,
            ..TxBatch::default()
        };
        // a plain ACK waits; the next one sends it (as it was sealed) and waits in its place
        port.send(&answer(aeth::ACK, 5, &flow), to, &flow, &mut b);
        port.flush_or_hold(&mut b);
        assert_eq!(next(&peer), None);
        port.send(&answer(aeth::ACK, 6, &flow), to, &flow, &mut b);
        port.flush_or_hold(&mut b);
        assert_eq!(next(&peer), Some((5, aeth::ACK)));
        assert_eq!(next(&peer), None);
        // a NAK leaves at once, after it
        port.send(&answer(aeth::NAK_SEQ, 7, &flow), to, &flow, &mut b);
        port.flush_or_hold(&mut b);
        assert_eq!(next(&peer), Some((6, aeth::ACK)));
        assert_eq!(next(&peer), Some((7, aeth::NAK_SEQ)));
        // so does an RNR NAK
        port.send(&answer(aeth::RNR | 3, 8, &flow), to, &flow, &mut b);
        port.flush_or_hold(&mut b);
        assert_eq!(next(&peer), Some((8, aeth::RNR | 3)));
        // a held ACK leaves ahead of another sender's packet (a requester's batch)
        port.send(&answer(aeth::ACK, 9, &flow), to, &flow, &mut b);
        port.flush_or_hold(&mut b);
        let mut other = TxBatch::default();
        port.send(&answer(aeth::NAK_ACCESS, 10, &flow), to, &flow, &mut other);
        port.flush(&mut other);
        assert_eq!(next(&peer), Some((9, aeth::ACK)));
        assert_eq!(next(&peer), Some((10, aeth::NAK_ACCESS)));
        // or when let go
        port.send(&answer(aeth::ACK, 11, &flow), to, &flow, &mut b);
        port.flush_or_hold(&mut b);
        assert_eq!(next(&peer), None);
        port.release_acks();
        assert_eq!(next(&peer), Some((11, aeth::ACK)));
        // a batch that may not hold sends at once
        b.hold_acks = false;
        port.send(&answer(aeth::ACK, 12, &flow), to, &flow, &mut b);
        port.flush_or_hold(&mut b);
        assert_eq!(next(&peer), Some((12, aeth::ACK)));
        assert_eq!(next(&peer), None);
    }
}
