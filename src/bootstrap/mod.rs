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
//! # The exchange interface
//!
//! [`Exchange`] is the rendezvous as a trait (rank, world size, an all-gather of byte frames,
//! a barrier; [`ExchangeExt`] adds the typed `all_gather` and pairwise `exchange`), so code
//! that connects QPs can take `&mut dyn Exchange` and not care who started the job.
//! [`Bootstrap`] implements it over TCP; with the cargo feature `mpi`, `MpiExchange` implements
//! it over the launcher's MPI (`MPI_Allgather` / `MPI_Allgatherv`, `MPI_Barrier`), for jobs
//! started by `mpirun` or Slurm.
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

mod error;
mod exchange;
mod job;
mod link;
#[cfg(feature = "mpi")]
mod mpi;

#[cfg(feature = "mpi")]
pub use self::mpi::MpiExchange;
/// The rsmpi crate ([`mpi`](https://docs.rs/mpi) on crates.io) the MPI exchange is built on, for
/// [`MpiExchange::with_universe`] and [`MpiExchange::from_communicator`] (feature `mpi`).
#[cfg(feature = "mpi")]
pub use ::mpi as rsmpi;
pub use error::{BootstrapError, Direction, FramePart, Result};
use exchange::{decode, pair_peer};
pub use exchange::{Exchange, ExchangeExt};
pub use job::{JobConfig, DEFAULT_MAX_FRAME, DEFAULT_TIMEOUT, TIMEOUT_ENV};
pub use link::PROTOCOL_VERSION;
use link::{during_handshake, handshake_error, hello, parse_hello, remaining, Link, HELLO_LEN};

use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

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
        pair_peer(self.rank, self.world_size, op)
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
        let theirs = self.exchange_bytes(&bytes)?;
        decode(peer, &theirs)
    }

    /// [`Bootstrap::exchange`] of raw frames: send `mine`, return the peer's frame (two-rank
    /// groups; rank 0 sends first, rank 1 receives first).
    pub fn exchange_bytes(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
        let peer = self.pair_peer("exchange")?;
        if self.rank == 0 {
            self.send_to(peer, mine)?;
            self.recv_from(peer)
        } else {
            let theirs = self.recv_from(peer)?;
            self.send_to(peer, mine)?;
            Ok(theirs)
        }
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
        self.all_gather_bytes(&bytes)?
            .iter()
            .enumerate()
            .map(|(r, f)| decode(r as u32, f))
            .collect()
    }

    /// [`Bootstrap::all_gather`] of raw frames: `result[r]` is rank r's frame (any length up to
    /// [`Bootstrap::max_frame`], different on each rank).
    pub fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world_size;
        if self.rank == 0 {
            if mine.len() > self.max_frame {
                return Err(BootstrapError::FrameTooLarge {
                    peer: 0,
                    dir: Direction::Write,
                    len: mine.len() as u64,
                    limit: self.max_frame,
                });
            }
            let mut frames = Vec::with_capacity(n as usize);
            frames.push(mine.to_vec());
            for r in 1..n {
                frames.push(self.recv_from(r)?);
            }
            for r in 1..n {
                for f in &frames {
                    let (limit, timeout) = (self.max_frame, self.timeout);
                    self.link(r).send(f, limit, timeout)?;
                }
            }
            Ok(frames)
        } else {
            self.send_to(0, mine)?;
            (0..n).map(|_| self.recv_from(0)).collect()
        }
    }
}

/// The TCP bootstrap as an [`Exchange`]: its own [`Bootstrap::all_gather_bytes`],
/// [`Bootstrap::barrier`] and [`Bootstrap::exchange_bytes`], with its timeout and frame limit;
/// so [`ExchangeExt::exchange`] and [`Bootstrap::exchange`] move the same frames and one side
/// may call either.
impl Exchange for Bootstrap {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world_size
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Bootstrap::all_gather_bytes(self, mine)
    }

    fn barrier(&mut self) -> Result<()> {
        Bootstrap::barrier(self)
    }

    fn exchange_bytes(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
        Bootstrap::exchange_bytes(self, mine)
    }
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
