//! One connection of a bootstrap: bounded reads and writes, length-prefixed frames, and the
//! handshake that opens it (magic, protocol version, rank, job size).

use super::error::{BootstrapError, Direction, FramePart, Result};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Version of the bootstrap wire protocol (carried in the hello).
pub const PROTOCOL_VERSION: u16 = 1;

const HELLO_MAGIC: [u8; 4] = *b"GVBS";
pub(super) const HELLO_LEN: usize = 16;

// ---------------------------------------------------------------------------------------------
// One connection
// ---------------------------------------------------------------------------------------------

/// How a bounded read or write stopped early.
enum Stop {
    Eof(usize),
    TimedOut(usize),
    Io(io::Error),
}

pub(super) fn remaining(deadline: Instant) -> Option<Duration> {
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
pub(super) struct Link {
    pub(super) stream: TcpStream,
    pub(super) peer: u32,
    broken: bool,
}

impl Link {
    pub(super) fn new(stream: TcpStream, peer: u32) -> Result<Self> {
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

    pub(super) fn check(&self) -> Result<()> {
        if self.broken {
            return Err(BootstrapError::Broken { peer: self.peer });
        }
        Ok(())
    }

    pub(super) fn send(&mut self, payload: &[u8], limit: usize, timeout: Duration) -> Result<()> {
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

    pub(super) fn recv(&mut self, limit: usize, timeout: Duration) -> Result<Vec<u8>> {
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

pub(super) fn hello(rank: u32, world_size: u32) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..4].copy_from_slice(&HELLO_MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    h[8..12].copy_from_slice(&rank.to_be_bytes());
    h[12..16].copy_from_slice(&world_size.to_be_bytes());
    h
}

/// Parse a hello into (rank, world size).
pub(super) fn parse_hello(frame: &[u8]) -> Result<(u32, u32), String> {
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

pub(super) fn handshake_error(
    addr: impl fmt::Display,
    reason: impl Into<String>,
) -> BootstrapError {
    BootstrapError::Handshake {
        peer_addr: addr.to_string(),
        reason: reason.into(),
    }
}

/// Map a transfer error during the handshake to a handshake error that names the address.
pub(super) fn during_handshake(addr: impl fmt::Display, e: BootstrapError) -> BootstrapError {
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
