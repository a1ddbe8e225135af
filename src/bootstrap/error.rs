//! What can go wrong in a bootstrap: [`BootstrapError`], with the direction and frame part
//! of a transfer that failed.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

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
    /// The launcher's MPI could not serve the rendezvous (`MpiExchange`, feature `mpi`): MPI
    /// initialised or finalised already, a rank or size it reports that is not a job, frames
    /// too large for its counts. (MPI's own failures abort the job, as its default error
    /// handler does.)
    #[error("MPI: {0}")]
    Mpi(String),
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
