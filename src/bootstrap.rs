//! Out-of-band rendezvous over TCP: find the peer process(es) and exchange small messages
//! (endpoints, memory descriptors) before any RDMA traffic can flow, in the style of perftest.
//!
//! # Two processes
//!
//! ```no_run
//! # use std::time::Duration;
//! # use gpuverbs::bootstrap::Bootstrap;
//! # fn main() -> Result<(), gpuverbs::bootstrap::BootstrapError> {
//! # let server = true;
//! # let my_endpoint = 0u32;
//! let timeout = Duration::from_secs(30);
//! let mut bs = if server {
//!     Bootstrap::server("0.0.0.0:18515", timeout)? // waits for one client
//! } else {
//!     Bootstrap::client("10.0.0.1:18515", timeout)? // retries until the server listens
//! };
//! let theirs: u32 = bs.exchange(&my_endpoint)?; // same call on both sides
//! bs.barrier()?;
//! # Ok(()) }
//! ```
//!
//! # Jobs of N processes
//!
//! [`Bootstrap::from_env`] reads the launcher's variables ([`JobConfig::from_env`]: torchrun's
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; Open MPI's `OMPI_COMM_WORLD_RANK` /
//! `OMPI_COMM_WORLD_SIZE`; PMI's `PMI_RANK` / `PMI_SIZE`) and builds a star: rank 0 listens on
//! `MASTER_ADDR:MASTER_PORT` and accepts the N−1 others, which announce their rank.
//! [`Bootstrap::all_gather`] and [`Bootstrap::barrier`] work over the star for any N; the
//! pairwise calls ([`Bootstrap::exchange`], [`Bootstrap::send`], [`Bootstrap::recv`]) need N = 2.
//!
//! # Wire protocol
//!
//! Everything is a frame: a big-endian `u32` payload length, then the payload. A frame longer
//! than the limit ([`DEFAULT_MAX_FRAME`], see [`Bootstrap::set_max_frame`]) is refused on both
//! ends; the receiver refuses it from the length alone, before allocating anything.
//!
//! - Handshake: the connecting rank sends a 16-byte hello, `b"GVBS"`, protocol version
//!   (`u16` BE, = 1), flags (`u16`, 0), its rank (`u32` BE), the world size (`u32` BE); rank 0
//!   checks it (rank in `1..N`, not seen before, same N) and answers with its own hello (rank 0).
//! - Typed messages are JSON (serde_json) in one frame.
//! - [`Bootstrap::exchange`]: rank 0 sends then receives, rank 1 receives then sends, so it
//!   cannot deadlock whatever the message size.
//! - [`Bootstrap::barrier`]: every rank sends an empty frame to rank 0; rank 0 answers each with
//!   an empty frame once all have arrived.
//! - [`Bootstrap::all_gather`]: every rank sends its frame to rank 0; rank 0 sends the N frames
//!   in rank order to every rank.
//!
//! # Timeouts and errors
//!
//! Connect (with retries: the server may start later), accept, and every frame read or write are
//! bounded by the bootstrap's timeout ([`Bootstrap::set_timeout`]); nothing blocks forever. Every
//! failure is a [`BootstrapError`] variant: timeouts, peer closed, truncated frame, oversized
//! frame, undecodable payload, handshake mismatch, bad environment (naming the variable). After a
//! failure in the middle of a frame the connection is out of step and later calls on it return
//! [`BootstrapError::Broken`]; a read timeout before any byte arrived leaves it usable.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Default largest frame payload: 1 MiB.
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;

/// Default timeout of connect/accept and of every frame read or write: 30 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Version of the bootstrap wire protocol (carried in the hello).
pub const PROTOCOL_VERSION: u16 = 1;

/// Environment variable (milliseconds) that overrides [`DEFAULT_TIMEOUT`] in
/// [`JobConfig::from_env`].
pub const TIMEOUT_ENV: &str = "GPUVERBS_BOOTSTRAP_TIMEOUT_MS";

const HELLO_MAGIC: [u8; 4] = *b"GVBS";
const HELLO_LEN: usize = 16;

/// Direction of a transfer, for errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Receiving from the peer.
    Read,
    /// Sending to the peer.
    Write,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Read => "reading from",
            Direction::Write => "writing to",
        })
    }
}

/// Which part of a frame was cut short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FramePart {
    /// The 4-byte length prefix.
    Header,
    /// The payload.
    Payload,
}

impl fmt::Display for FramePart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FramePart::Header => "header",
            FramePart::Payload => "payload",
        })
    }
}

/// Errors of the bootstrap.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// An address did not resolve.
    #[error("cannot resolve address {addr}: {source}")]
    Resolve {
        /// The address as given.
        addr: String,
        /// The resolver's error.
        #[source]
        source: io::Error,
    },
    /// Could not listen.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address as given.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Not every expected peer connected in time.
    #[error(
        "timed out after {timeout:?} waiting on {addr} for peers ({joined} of {expected} joined)"
    )]
    AcceptTimeout {
        /// The listening address.
        addr: SocketAddr,
        /// The timeout.
        timeout: Duration,
        /// Peers that completed the handshake.
        joined: u32,
        /// Peers expected.
        expected: u32,
    },
    /// Could not reach the server in time (it never listened, or was unreachable).
    #[error("could not connect to {addr} within {timeout:?}{}", last_error_suffix(.last_error))]
    ConnectTimeout {
        /// The server address as given.
        addr: String,
        /// The timeout.
        timeout: Duration,
        /// The error of the last attempt, if any attempt was made.
        last_error: Option<io::Error>,
    },
    /// A frame read or write did not complete in time.
    #[error("timed out after {timeout:?} {dir} rank {peer}")]
    Timeout {
        /// The peer's rank.
        peer: u32,
        /// Reading or writing.
        dir: Direction,
        /// The timeout.
        timeout: Duration,
    },
    /// The peer closed the connection (between frames, or reset it).
    #[error("rank {peer} closed the connection")]
    PeerClosed {
        /// The peer's rank.
        peer: u32,
    },
    /// The peer closed the connection in the middle of a frame.
    #[error(
        "truncated frame from rank {peer}: connection closed after {got} of {expected} {part} bytes"
    )]
    Truncated {
        /// The peer's rank.
        peer: u32,
        /// Header or payload.
        part: FramePart,
        /// Bytes received of that part.
        got: usize,
        /// Bytes the part should have.
        expected: usize,
    },
    /// A frame is longer than the limit (announced by the peer, or one we were asked to send).
    #[error("frame of {len} bytes {dir} rank {peer} exceeds the {limit}-byte limit")]
    FrameTooLarge {
        /// The peer's rank.
        peer: u32,
        /// Received (announced length) or to be sent.
        dir: Direction,
        /// The frame's payload length.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// A payload is not a valid encoding of the expected type.
    #[error("cannot decode the {len}-byte payload of rank {rank}: {source}")]
    Decode {
        /// The rank whose payload it is (for relayed all-gather data: its origin).
        rank: u32,
        /// Payload length.
        len: usize,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// A value could not be encoded.
    #[error("cannot encode the message: {0}")]
    Encode(#[source] serde_json::Error),
    /// The connecting side is not a gpuverbs bootstrap peer of this job.
    #[error("bootstrap handshake with {peer_addr} failed: {reason}")]
    Handshake {
        /// The peer's socket address.
        peer_addr: String,
        /// What did not match.
        reason: String,
    },
    /// The peer sent a frame this step does not expect (mismatched collective calls).
    #[error("protocol error with rank {peer}: {reason}")]
    Protocol {
        /// The peer's rank.
        peer: u32,
        /// What was wrong.
        reason: String,
    },
    /// Any other socket error during a transfer.
    #[error("I/O error {dir} rank {peer}: {source}")]
    Io {
        /// The peer's rank.
        peer: u32,
        /// Reading or writing.
        dir: Direction,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A socket operation outside a transfer (accept, socket options) failed.
    #[error("socket error while {op}: {source}")]
    Socket {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A required environment variable is not set.
    #[error("environment variable {var} is not set{hint}")]
    MissingEnv {
        /// The variable.
        var: &'static str,
        /// Extra advice (may be empty).
        hint: &'static str,
    },
    /// An environment variable does not parse or is out of range.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// Rank / world size do not describe a job.
    #[error("invalid job configuration: {0}")]
    InvalidConfig(String),
    /// A pairwise call on a job that is not two ranks.
    #[error("{op} needs a job of exactly two ranks; this one has {world_size}")]
    NotPairwise {
        /// The call.
        op: &'static str,
        /// The job's size.
        world_size: u32,
    },
    /// The connection is out of step after an earlier error.
    #[error("the connection to rank {peer} is unusable after an earlier error")]
    Broken {
        /// The peer's rank.
        peer: u32,
    },
}

fn last_error_suffix(e: &Option<io::Error>) -> String {
    match e {
        Some(e) => format!(" (last error: {e})"),
        None => String::new(),
    }
}

/// Result alias of this module.
pub type Result<T, E = BootstrapError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------------------------
// One connection
// ---------------------------------------------------------------------------------------------

/// How a bounded read or write stopped early.
enum Stop {
    Eof(usize),
    TimedOut(usize),
    Io(io::Error),
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    // A zero socket timeout means "none" to the OS; std rejects it. Treat < 1 ms as expired.
    (left >= Duration::from_millis(1)).then_some(left)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

fn read_full(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), Stop> {
    let mut got = 0;
    while got < buf.len() {
        let Some(left) = remaining(deadline) else {
            return Err(Stop::TimedOut(got));
        };
        s.set_read_timeout(Some(left)).map_err(Stop::Io)?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(Stop::Eof(got)),
            Ok(n) => got += n,
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_closed(&e) => return Err(Stop::Eof(got)),
            Err(e) => return Err(Stop::Io(e)),
        }
    }
    Ok(())
}

fn write_full(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> Result<(), Stop> {
    let mut done = 0;
    while done < buf.len() {
        let Some(left) = remaining(deadline) else {
            return Err(Stop::TimedOut(done));
        };
        s.set_write_timeout(Some(left)).map_err(Stop::Io)?;
        match s.write(&buf[done..]) {
            Ok(0) => return Err(Stop::Eof(done)),
            Ok(n) => done += n,
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_closed(&e) => return Err(Stop::Eof(done)),
            Err(e) => return Err(Stop::Io(e)),
        }
    }
    Ok(())
}

/// A framed connection to one peer rank.
#[derive(Debug)]
struct Link {
    stream: TcpStream,
    peer: u32,
    broken: bool,
}

impl Link {
    fn new(stream: TcpStream, peer: u32) -> Result<Self> {
        stream
            .set_nodelay(true)
            .map_err(|source| BootstrapError::Socket {
                op: "setting TCP_NODELAY",
                source,
            })?;
        Ok(Self {
            stream,
            peer,
            broken: false,
        })
    }

    fn check(&self) -> Result<()> {
        if self.broken {
            return Err(BootstrapError::Broken { peer: self.peer });
        }
        Ok(())
    }

    fn send(&mut self, payload: &[u8], limit: usize, timeout: Duration) -> Result<()> {
        self.check()?;
        let peer = self.peer;
        let len = match u32::try_from(payload.len()) {
            Ok(len) if payload.len() <= limit => len,
            _ => {
                return Err(BootstrapError::FrameTooLarge {
                    peer,
                    dir: Direction::Write,
                    len: payload.len() as u64,
                    limit,
                })
            }
        };
        let mut frame = Vec::with_capacity(4 + payload.len());
        frame.extend_from_slice(&len.to_be_bytes());
        frame.extend_from_slice(payload);
        let deadline = Instant::now() + timeout;
        write_full(&mut self.stream, &frame, deadline).map_err(|stop| {
            self.broken = true;
            match stop {
                Stop::Eof(_) => BootstrapError::PeerClosed { peer },
                Stop::TimedOut(_) => BootstrapError::Timeout {
                    peer,
                    dir: Direction::Write,
                    timeout,
                },
                Stop::Io(source) => BootstrapError::Io {
                    peer,
                    dir: Direction::Write,
                    source,
                },
            }
        })
    }

    fn recv(&mut self, limit: usize, timeout: Duration) -> Result<Vec<u8>> {
        self.check()?;
        let peer = self.peer;
        let deadline = Instant::now() + timeout;
        let mut header = [0u8; 4];
        if let Err(stop) = read_full(&mut self.stream, &mut header, deadline) {
            return Err(match stop {
                // Nothing consumed: the stream is still in step; the caller may try again.
                Stop::TimedOut(0) => BootstrapError::Timeout {
                    peer,
                    dir: Direction::Read,
                    timeout,
                },
                stop => {
                    self.broken = true;
                    self.stop_error(stop, FramePart::Header, 4, timeout)
                }
            });
        }
        let len = u32::from_be_bytes(header) as usize;
        if len > limit {
            self.broken = true;
            return Err(BootstrapError::FrameTooLarge {
                peer,
                dir: Direction::Read,
                len: len as u64,
                limit,
            });
        }
        let mut payload = vec![0u8; len];
        if let Err(stop) = read_full(&mut self.stream, &mut payload, deadline) {
            self.broken = true;
            return Err(self.stop_error(stop, FramePart::Payload, len, timeout));
        }
        Ok(payload)
    }

    fn stop_error(
        &self,
        stop: Stop,
        part: FramePart,
        expected: usize,
        timeout: Duration,
    ) -> BootstrapError {
        let peer = self.peer;
        match stop {
            Stop::Eof(0) if part == FramePart::Header => BootstrapError::PeerClosed { peer },
            Stop::Eof(got) => BootstrapError::Truncated {
                peer,
                part,
                got,
                expected,
            },
            Stop::TimedOut(_) => BootstrapError::Timeout {
                peer,
                dir: Direction::Read,
                timeout,
            },
            Stop::Io(source) => BootstrapError::Io {
                peer,
                dir: Direction::Read,
                source,
            },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------------------------

fn hello(rank: u32, world_size: u32) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..4].copy_from_slice(&HELLO_MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    h[8..12].copy_from_slice(&rank.to_be_bytes());
    h[12..16].copy_from_slice(&world_size.to_be_bytes());
    h
}

/// Parse a hello into (rank, world size).
fn parse_hello(frame: &[u8]) -> Result<(u32, u32), String> {
    if frame.len() != HELLO_LEN || frame[0..4] != HELLO_MAGIC {
        return Err(format!(
            "not a gpuverbs bootstrap hello ({} bytes: {:02x?})",
            frame.len(),
            &frame[..frame.len().min(16)]
        ));
    }
    let version = u16::from_be_bytes([frame[4], frame[5]]);
    if version != PROTOCOL_VERSION {
        return Err(format!(
            "peer speaks bootstrap protocol {version}, this build speaks {PROTOCOL_VERSION}"
        ));
    }
    let rank = u32::from_be_bytes(frame[8..12].try_into().expect("4 bytes"));
    let world = u32::from_be_bytes(frame[12..16].try_into().expect("4 bytes"));
    Ok((rank, world))
}

fn handshake_error(addr: impl fmt::Display, reason: impl Into<String>) -> BootstrapError {
    BootstrapError::Handshake {
        peer_addr: addr.to_string(),
        reason: reason.into(),
    }
}

/// Map a transfer error during the handshake to a handshake error that names the address.
fn during_handshake(addr: impl fmt::Display, e: BootstrapError) -> BootstrapError {
    match e {
        BootstrapError::PeerClosed { .. } | BootstrapError::Truncated { .. } => handshake_error(
            addr,
            "the peer closed the connection during the handshake (it rejected our rank or \
             world size, or is not a gpuverbs bootstrap peer; see its log)",
        ),
        BootstrapError::FrameTooLarge { len, .. } => handshake_error(
            addr,
            format!("the peer announced a {len}-byte frame: not a gpuverbs bootstrap peer"),
        ),
        BootstrapError::Io { source, .. } => {
            handshake_error(addr, format!("I/O error during the handshake: {source}"))
        }
        e => e,
    }
}

// ---------------------------------------------------------------------------------------------
// Listener
// ---------------------------------------------------------------------------------------------

/// The listening side before any peer has joined: bind first (possibly to port 0), learn the
/// address with [`Listener::local_addr`], then accept.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    addr: SocketAddr,
}

impl Listener {
    /// Listen on `addr` (e.g. `"0.0.0.0:18515"`, or port 0 for an ephemeral port).
    pub fn bind(addr: impl ToSocketAddrs + fmt::Display) -> Result<Self> {
        let inner = TcpListener::bind(&addr).map_err(|source| BootstrapError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        let local = inner
            .local_addr()
            .map_err(|source| BootstrapError::Socket {
                op: "reading the listening address",
                source,
            })?;
        Ok(Self { inner, addr: local })
    }

    /// The address actually bound (with the port the OS chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Accept one peer (rank 1 of a two-rank job) within `timeout`; the result is rank 0.
    pub fn accept(self, timeout: Duration) -> Result<Bootstrap> {
        self.accept_ranks(2, timeout)
    }

    /// As rank 0 of a job of `world_size` ranks, accept the `world_size - 1` others within
    /// `timeout` (in any order; each announces its rank in the handshake).
    pub fn accept_ranks(self, world_size: u32, timeout: Duration) -> Result<Bootstrap> {
        check_job(0, world_size)?;
        let expected = world_size - 1;
        let mut links: Vec<Option<Link>> = (0..world_size).map(|_| None).collect();
        let mut joined = 0u32;
        let deadline = Instant::now() + timeout;
        self.inner
            .set_nonblocking(true)
            .map_err(|source| BootstrapError::Socket {
                op: "making the listener non-blocking",
                source,
            })?;
        let mut nap = Duration::from_millis(1);
        while joined < expected {
            let (stream, peer_addr) = match self.inner.accept() {
                Ok(conn) => conn,
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted
                        || e.kind() == io::ErrorKind::ConnectionAborted =>
                {
                    let Some(left) = remaining(deadline) else {
                        return Err(BootstrapError::AcceptTimeout {
                            addr: self.addr,
                            timeout,
                            joined,
                            expected,
                        });
                    };
                    std::thread::sleep(nap.min(left));
                    nap = (nap * 2).min(Duration::from_millis(16));
                    continue;
                }
                Err(source) => {
                    return Err(BootstrapError::Socket {
                        op: "accepting a peer",
                        source,
                    })
                }
            };
            stream
                .set_nonblocking(false)
                .map_err(|source| BootstrapError::Socket {
                    op: "making an accepted socket blocking",
                    source,
                })?;
            // The rank is unknown until the hello arrives: errors name the address instead.
            let mut link = Link::new(stream, u32::MAX)?;
            let frame = link.recv(HELLO_LEN, timeout).map_err(|e| match e {
                BootstrapError::Timeout { timeout, .. } => handshake_error(
                    peer_addr,
                    format!("no hello within {timeout:?} after connecting"),
                ),
                e => during_handshake(peer_addr, e),
            })?;
            let (rank, world) = parse_hello(&frame).map_err(|r| handshake_error(peer_addr, r))?;
            if world != world_size {
                return Err(handshake_error(
                    peer_addr,
                    format!(
                        "peer rank {rank} says the world size is {world}, rank 0 says {world_size}"
                    ),
                ));
            }
            if rank == 0 || rank >= world_size {
                return Err(handshake_error(
                    peer_addr,
                    format!("peer announced rank {rank}, expected 1..{world_size}"),
                ));
            }
            if links[rank as usize].is_some() {
                return Err(handshake_error(
                    peer_addr,
                    format!("rank {rank} joined twice"),
                ));
            }
            link.peer = rank;
            link.send(&hello(0, world_size), HELLO_LEN, timeout)
                .map_err(|e| during_handshake(peer_addr, e))?;
            tracing::debug!(%peer_addr, rank, world_size, "bootstrap: rank joined");
            links[rank as usize] = Some(link);
            joined += 1;
        }
        tracing::info!(addr = %self.addr, world_size, "bootstrap: all ranks joined rank 0");
        Ok(Bootstrap {
            rank: 0,
            world_size,
            links,
            timeout,
            max_frame: DEFAULT_MAX_FRAME,
        })
    }
}

fn check_job(rank: u32, world_size: u32) -> Result<()> {
    if world_size == 0 {
        return Err(BootstrapError::InvalidConfig(
            "world size must be at least 1".into(),
        ));
    }
    if rank >= world_size {
        return Err(BootstrapError::InvalidConfig(format!(
            "rank {rank} is not below the world size {world_size}"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Bootstrap
// ---------------------------------------------------------------------------------------------

/// A connected bootstrap group: two ranks (server = rank 0, client = rank 1), or a star of N
/// ranks through rank 0.
///
/// The timeout given at creation bounds the connect/accept phase and, afterwards, every frame
/// read or write (change it with [`Bootstrap::set_timeout`]).
#[derive(Debug)]
pub struct Bootstrap {
    rank: u32,
    world_size: u32,
    /// Indexed by rank: rank 0 holds links to every other rank; other ranks hold only link 0.
    links: Vec<Option<Link>>,
    timeout: Duration,
    max_frame: usize,
}

impl Bootstrap {
    /// perftest-style server: listen on `bind_addr` and wait up to `timeout` for one client.
    /// This side is rank 0.
    pub fn server(bind_addr: impl ToSocketAddrs + fmt::Display, timeout: Duration) -> Result<Self> {
        Listener::bind(bind_addr)?.accept(timeout)
    }

    /// perftest-style client: connect to `server_addr`, retrying until `timeout` (the server may
    /// start later). This side is rank 1.
    pub fn client(
        server_addr: impl ToSocketAddrs + fmt::Display,
        timeout: Duration,
    ) -> Result<Self> {
        Self::join(server_addr, 1, 2, timeout)
    }

    /// Join a star as `rank` (1..`world_size`) by connecting to rank 0 at `root_addr`,
    /// retrying until `timeout`.
    pub fn join(
        root_addr: impl ToSocketAddrs + fmt::Display,
        rank: u32,
        world_size: u32,
        timeout: Duration,
    ) -> Result<Self> {
        check_job(rank, world_size)?;
        if rank == 0 {
            return Err(BootstrapError::InvalidConfig(
                "rank 0 listens (Listener::accept_ranks); it does not join".into(),
            ));
        }
        let stream = connect_retry(&root_addr, timeout)?;
        let peer_addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| root_addr.to_string());
        let mut link = Link::new(stream, 0)?;
        link.send(&hello(rank, world_size), HELLO_LEN, timeout)
            .map_err(|e| during_handshake(&peer_addr, e))?;
        let frame = link
            .recv(HELLO_LEN, timeout)
            .map_err(|e| during_handshake(&peer_addr, e))?;
        let (their_rank, world) =
            parse_hello(&frame).map_err(|r| handshake_error(&peer_addr, r))?;
        if their_rank != 0 || world != world_size {
            return Err(handshake_error(
                &peer_addr,
                format!(
                    "root answered as rank {their_rank} of {world}, expected rank 0 of {world_size}"
                ),
            ));
        }
        tracing::debug!(%peer_addr, rank, world_size, "bootstrap: joined rank 0");
        let mut links: Vec<Option<Link>> = (0..world_size).map(|_| None).collect();
        links[0] = Some(link);
        Ok(Self {
            rank,
            world_size,
            links,
            timeout,
            max_frame: DEFAULT_MAX_FRAME,
        })
    }

    /// Build the group a launcher describes in the environment ([`JobConfig::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::from_config(&JobConfig::from_env()?)
    }

    /// Build the group `config` describes: rank 0 listens on `master_addr:master_port` and
    /// accepts the others; every other rank connects to it. A job of one rank needs no socket.
    pub fn from_config(config: &JobConfig) -> Result<Self> {
        check_job(config.rank, config.world_size)?;
        let mut bs = if config.world_size == 1 {
            Self {
                rank: 0,
                world_size: 1,
                links: vec![None],
                timeout: config.timeout,
                max_frame: config.max_frame,
            }
        } else {
            let addr = config.master_socket_addr();
            if config.rank == 0 {
                Listener::bind(addr.as_str())?.accept_ranks(config.world_size, config.timeout)?
            } else {
                Self::join(
                    addr.as_str(),
                    config.rank,
                    config.world_size,
                    config.timeout,
                )?
            }
        };
        bs.max_frame = config.max_frame;
        Ok(bs)
    }

    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// The socket address of a directly connected rank (rank 0 sees all, others only rank 0).
    pub fn peer_addr(&self, rank: u32) -> Option<SocketAddr> {
        self.links
            .get(rank as usize)?
            .as_ref()?
            .stream
            .peer_addr()
            .ok()
    }

    /// The timeout of every frame read or write.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Set the timeout of every later frame read or write (a zero duration is raised to 1 ms).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout.max(Duration::from_millis(1));
    }

    /// The largest frame payload sent or accepted.
    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// Set the largest frame payload sent or accepted (default [`DEFAULT_MAX_FRAME`]; at most
    /// `u32::MAX`). All ranks should agree.
    pub fn set_max_frame(&mut self, limit: usize) {
        self.max_frame = limit.min(u32::MAX as usize);
    }

    fn link(&mut self, rank: u32) -> &mut Link {
        self.links[rank as usize]
            .as_mut()
            .expect("bootstrap: a star rank is connected to every rank it talks to")
    }

    fn send_to(&mut self, rank: u32, payload: &[u8]) -> Result<()> {
        let (limit, timeout) = (self.max_frame, self.timeout);
        self.link(rank).send(payload, limit, timeout)
    }

    fn recv_from(&mut self, rank: u32) -> Result<Vec<u8>> {
        let (limit, timeout) = (self.max_frame, self.timeout);
        self.link(rank).recv(limit, timeout)
    }

    fn pair_peer(&self, op: &'static str) -> Result<u32> {
        if self.world_size != 2 {
            return Err(BootstrapError::NotPairwise {
                op,
                world_size: self.world_size,
            });
        }
        Ok(1 - self.rank)
    }

    /// Send one raw frame to the peer (two-rank groups).
    pub fn send(&mut self, payload: &[u8]) -> Result<()> {
        let peer = self.pair_peer("send")?;
        self.send_to(peer, payload)
    }

    /// Receive one raw frame from the peer (two-rank groups).
    pub fn recv(&mut self) -> Result<Vec<u8>> {
        let peer = self.pair_peer("recv")?;
        self.recv_from(peer)
    }

    /// Send `mine` and return the peer's value (two-rank groups). Both sides call it; rank 0
    /// sends first and rank 1 receives first, so it never deadlocks. Both frames are moved
    /// before decoding, so a decode error on one side does not strand the other.
    pub fn exchange<T: Serialize + DeserializeOwned>(&mut self, mine: &T) -> Result<T> {
        let peer = self.pair_peer("exchange")?;
        let bytes = serde_json::to_vec(mine).map_err(BootstrapError::Encode)?;
        let theirs = if self.rank == 0 {
            self.send_to(peer, &bytes)?;
            self.recv_from(peer)?
        } else {
            let theirs = self.recv_from(peer)?;
            self.send_to(peer, &bytes)?;
            theirs
        };
        decode(peer, &theirs)
    }

    /// Wait until every rank has called `barrier`.
    pub fn barrier(&mut self) -> Result<()> {
        let expect_empty = |peer: u32, f: Vec<u8>| {
            if f.is_empty() {
                Ok(())
            } else {
                Err(BootstrapError::Protocol {
                    peer,
                    reason: format!(
                        "expected the empty frame of a barrier, got {} bytes \
                         (do all ranks make the same calls in the same order?)",
                        f.len()
                    ),
                })
            }
        };
        if self.rank == 0 {
            for r in 1..self.world_size {
                let f = self.recv_from(r)?;
                expect_empty(r, f)?;
            }
            for r in 1..self.world_size {
                self.send_to(r, &[])?;
            }
        } else {
            self.send_to(0, &[])?;
            let f = self.recv_from(0)?;
            expect_empty(0, f)?;
        }
        Ok(())
    }

    /// Gather every rank's value on every rank, in rank order (`result[r]` is rank r's value).
    /// Every rank's encoded value must fit in one frame.
    pub fn all_gather<T: Serialize + DeserializeOwned>(&mut self, mine: &T) -> Result<Vec<T>> {
        let bytes = serde_json::to_vec(mine).map_err(BootstrapError::Encode)?;
        let n = self.world_size;
        let frames: Vec<Vec<u8>> = if self.rank == 0 {
            if bytes.len() > self.max_frame {
                return Err(BootstrapError::FrameTooLarge {
                    peer: 0,
                    dir: Direction::Write,
                    len: bytes.len() as u64,
                    limit: self.max_frame,
                });
            }
            let mut frames = Vec::with_capacity(n as usize);
            frames.push(bytes);
            for r in 1..n {
                frames.push(self.recv_from(r)?);
            }
            for r in 1..n {
                for f in &frames {
                    let (limit, timeout) = (self.max_frame, self.timeout);
                    self.link(r).send(f, limit, timeout)?;
                }
            }
            frames
        } else {
            self.send_to(0, &bytes)?;
            (0..n).map(|_| self.recv_from(0)).collect::<Result<_>>()?
        };
        frames
            .iter()
            .enumerate()
            .map(|(r, f)| decode(r as u32, f))
            .collect()
    }
}

fn decode<T: DeserializeOwned>(rank: u32, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|source| BootstrapError::Decode {
        rank,
        len: bytes.len(),
        source,
    })
}

/// Connect to `addr`, retrying refused/unreachable attempts with backoff until `timeout`.
fn connect_retry(
    addr: &(impl ToSocketAddrs + fmt::Display),
    timeout: Duration,
) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    let mut nap = Duration::from_millis(5);
    loop {
        match addr.to_socket_addrs() {
            Ok(candidates) => {
                for sa in candidates {
                    let Some(left) = remaining(deadline) else {
                        break;
                    };
                    match TcpStream::connect_timeout(&sa, left) {
                        Ok(s) => {
                            tracing::debug!(%sa, "bootstrap: connected");
                            return Ok(s);
                        }
                        Err(e) => last_error = Some(e),
                    }
                }
            }
            // Name resolution may also come up late (containers); retry it too.
            Err(e) => last_error = Some(e),
        }
        let Some(left) = remaining(deadline) else {
            return Err(BootstrapError::ConnectTimeout {
                addr: addr.to_string(),
                timeout,
                last_error,
            });
        };
        std::thread::sleep(nap.min(left));
        nap = (nap * 2).min(Duration::from_millis(200));
    }
}

// ---------------------------------------------------------------------------------------------
// Job configuration
// ---------------------------------------------------------------------------------------------

/// Where a process sits in a multi-process job, as a launcher describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobConfig {
    /// This process's rank, `0..world_size`.
    pub rank: u32,
    /// Number of processes.
    pub world_size: u32,
    /// Host name or address of rank 0 (rank 0 listens on it).
    pub master_addr: String,
    /// Port rank 0 listens on.
    pub master_port: u16,
    /// Connect/accept and per-frame timeout.
    pub timeout: Duration,
    /// Largest frame payload.
    pub max_frame: usize,
}

/// (rank variable, size variable) of the launchers, in the order they are tried.
const LAUNCHER_VARS: [(&str, &str); 3] = [
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
];

impl JobConfig {
    /// Read the process environment; see [`JobConfig::from_lookup`].
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|var| std::env::var_os(var).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Build from variables given by `lookup` (the environment, or a map in tests):
    ///
    /// - rank and size from the first pair that has its rank variable set: `RANK`/`WORLD_SIZE`
    ///   (torchrun), `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE` (Open MPI),
    ///   `PMI_RANK`/`PMI_SIZE` (MPICH, Intel MPI, Slurm PMI);
    /// - `MASTER_ADDR` and `MASTER_PORT` (1..65535), required when the size is above 1;
    /// - optional [`TIMEOUT_ENV`] in milliseconds (default [`DEFAULT_TIMEOUT`]).
    ///
    /// Missing or invalid values are errors naming the variable.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |var: &'static str| lookup(var).map(|v| (var, v));
        let (rank_var, size_var, rank_val) = match LAUNCHER_VARS
            .iter()
            .find_map(|&(r, s)| get(r).map(|(_, v)| (r, s, v)))
        {
            Some(found) => found,
            None => {
                // A size without a rank names the missing rank variable of that launcher.
                let var = LAUNCHER_VARS
                    .iter()
                    .find(|(_, s)| lookup(s).is_some())
                    .map_or("RANK", |&(r, _)| r);
                return Err(BootstrapError::MissingEnv {
                    var,
                    hint: " (nor OMPI_COMM_WORLD_RANK or PMI_RANK): start the job with torchrun \
                           or mpirun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
                });
            }
        };
        let size_val = lookup(size_var).ok_or(BootstrapError::MissingEnv {
            var: size_var,
            hint: "",
        })?;
        let rank: u32 = parse_var(rank_var, &rank_val)?;
        let world_size: u32 = parse_var(size_var, &size_val)?;
        if world_size == 0 {
            return Err(invalid(
                size_var,
                &size_val,
                "the world size must be at least 1",
            ));
        }
        if rank >= world_size {
            return Err(invalid(
                rank_var,
                &rank_val,
                format!("rank must be below {size_var}={world_size}"),
            ));
        }
        let (master_addr, master_port) = if world_size > 1 {
            let addr = lookup("MASTER_ADDR").ok_or(BootstrapError::MissingEnv {
                var: "MASTER_ADDR",
                hint: " (host name or address of rank 0)",
            })?;
            let addr = addr.trim().to_string();
            if addr.is_empty() {
                return Err(invalid("MASTER_ADDR", &addr, "empty"));
            }
            let port_val = lookup("MASTER_PORT").ok_or(BootstrapError::MissingEnv {
                var: "MASTER_PORT",
                hint: " (TCP port rank 0 listens on)",
            })?;
            let port: u16 = parse_var("MASTER_PORT", &port_val)?;
            if port == 0 {
                return Err(invalid(
                    "MASTER_PORT",
                    &port_val,
                    "port 0 cannot be agreed on; pick a fixed port",
                ));
            }
            (addr, port)
        } else {
            (
                lookup("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                0,
            )
        };
        let timeout = match lookup(TIMEOUT_ENV) {
            None => DEFAULT_TIMEOUT,
            Some(v) => {
                let ms: u64 = parse_var(TIMEOUT_ENV, &v)?;
                if ms == 0 {
                    return Err(invalid(TIMEOUT_ENV, &v, "must be at least 1 ms"));
                }
                Duration::from_millis(ms)
            }
        };
        Ok(Self {
            rank,
            world_size,
            master_addr,
            master_port,
            timeout,
            max_frame: DEFAULT_MAX_FRAME,
        })
    }

    /// `master_addr:master_port`, with brackets around an IPv6 literal.
    pub fn master_socket_addr(&self) -> String {
        let a = self
            .master_addr
            .trim_start_matches('[')
            .trim_end_matches(']');
        if a.contains(':') {
            format!("[{a}]:{}", self.master_port)
        } else {
            format!("{a}:{}", self.master_port)
        }
    }
}

fn invalid(var: &'static str, value: &str, reason: impl Into<String>) -> BootstrapError {
    BootstrapError::InvalidEnv {
        var,
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn parse_var<T: std::str::FromStr>(var: &'static str, value: &str) -> Result<T>
where
    T::Err: fmt::Display,
{
    value
        .trim()
        .parse()
        .map_err(|e: T::Err| invalid(var, value, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trip() {
        assert_eq!(parse_hello(&hello(3, 8)), Ok((3, 8)));
        assert!(parse_hello(b"GET / HTTP/1.1\r\n").is_err());
        let mut h = hello(1, 2);
        h[5] = 9;
        assert!(parse_hello(&h).unwrap_err().contains("protocol 9"));
    }

    #[test]
    fn master_addr_formats() {
        let mut c = JobConfig {
            rank: 0,
            world_size: 2,
            master_addr: "::1".into(),
            master_port: 5,
            timeout: DEFAULT_TIMEOUT,
            max_frame: DEFAULT_MAX_FRAME,
        };
        assert_eq!(c.master_socket_addr(), "[::1]:5");
        c.master_addr = "node-0".into();
        assert_eq!(c.master_socket_addr(), "node-0:5");
    }
}
