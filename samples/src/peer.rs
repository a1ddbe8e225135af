//! The server/client roles: the TCP rendezvous ([`Peer::rendezvous`]), the [`Hello`] exchange,
//! the steps both sides take ([`Peer::step`], [`step`]), and the header lines and JSON fields
//! of a run with a peer.

use crate::args::CommonArgs;
use crate::report::{error_text, Header};
use anyhow::{bail, Context as _, Result};
use gpuverbs::bootstrap::{Bootstrap, Listener};
use gpuverbs::{Context, Endpoint};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;

/// What the server's "no limit" wait for a client is given (about a century).
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How much longer than `--timeout` a step waits for the peer's part of it (the peer's own
/// waits are bounded by `--timeout`; a peer that dies closes the connection at once).
pub const STEP_WAIT_FACTOR: u32 = 30;

/// What each side tells the other at the rendezvous.
#[derive(Serialize, Deserialize)]
pub struct Hello {
    /// The test (`put_bw`, `write_lat`).
    pub test: String,
    /// What both sides must agree on (sizes, iterations, ...).
    pub params: Value,
    /// This side's QPs, in order: QP k connects to the peer's QP k.
    pub endpoints: Vec<Endpoint>,
    /// Test-specific facts about this side the peer needs (not compared).
    pub facts: Value,
}

/// A step's outcome, as it travels.
#[derive(Serialize)]
struct StepOut<'a, T> {
    step: &'a str,
    outcome: Result<&'a T, String>,
}

#[derive(Deserialize)]
struct StepIn<T> {
    step: String,
    outcome: Result<T, String>,
}

/// The other process of the server/client roles, over the TCP bootstrap.
pub struct Peer {
    /// The bootstrap connection (rank 0: server, rank 1: client).
    pub bs: Bootstrap,
    /// The peer's TCP address.
    pub addr: SocketAddr,
    /// `"server"` or `"client"`: this side.
    pub role: &'static str,
    /// `"client"` or `"server"`: the other side.
    pub peer_role: &'static str,
}

impl Peer {
    /// Meets the peer over TCP on `-p`: the server listens (`-p 0`: on a port the system
    /// picks, which it prints) and waits for a client, without a limit unless `--timeout` is
    /// given; the client connects to the server (retrying until `--timeout`). Afterwards every
    /// frame waits at most `--timeout`.
    pub fn rendezvous(a: &CommonArgs, test: &str) -> Result<Self> {
        let mut bs = match &a.server {
            None => {
                let addr = format!("0.0.0.0:{}", a.port);
                let listener = Listener::bind(addr.as_str()).context("rendezvous (server)")?;
                let limit = match a.accept_wait() {
                    Some(t) => format!("--timeout {0}: gives up after {0} s", t.as_secs()),
                    None => "no time limit; --timeout S gives up after S seconds".to_string(),
                };
                eprintln!(
                    "{test}: server: waiting for a client on port {} ({limit})",
                    listener.local_addr().port()
                );
                listener
                    .accept(a.accept_wait().unwrap_or(FOREVER))
                    .context("rendezvous (server)")?
            }
            Some(_) if a.port == 0 => {
                bail!("-p 0: the client needs the server's port (the one the server printed)")
            }
            Some(host) => {
                let addr = if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]:{}", a.port)
                } else {
                    format!("{host}:{}", a.port)
                };
                eprintln!("{test}: client: connecting to {addr}");
                Bootstrap::client(addr.as_str(), a.wait()).context("rendezvous (client)")?
            }
        };
        bs.set_timeout(a.wait());
        let addr = bs
            .peer_addr(1 - bs.rank())
            .context("the bootstrap connection has no peer address")?;
        let (role, peer_role) = if bs.rank() == 0 {
            ("server", "client")
        } else {
            ("client", "server")
        };
        Ok(Self {
            bs,
            addr,
            role,
            peer_role,
        })
    }

    /// The side this process plays: 0 (A, the client: it sends first) or 1 (B, the server).
    pub fn side(&self) -> usize {
        if self.bs.rank() == 0 {
            1
        } else {
            0
        }
    }

    /// Exchanges [`Hello`]s and checks that both sides run `test` with the same `params`.
    /// Afterwards a step may wait [`STEP_WAIT_FACTOR`] × `--timeout` for the peer.
    pub fn hello(
        &mut self,
        a: &CommonArgs,
        test: &str,
        params: Value,
        endpoints: Vec<Endpoint>,
        facts: Value,
    ) -> Result<Hello> {
        let mine = Hello {
            test: test.to_string(),
            params,
            endpoints,
            facts,
        };
        let peer: Hello = self
            .bs
            .exchange(&mine)
            .context("exchange endpoints with the peer")?;
        if peer.test != test {
            bail!("the peer runs {}, not {test}", peer.test);
        }
        if peer.params != mine.params {
            bail!(
                "the peer's parameters differ: ours {}, theirs {}",
                mine.params,
                peer.params
            );
        }
        if peer.endpoints.len() != mine.endpoints.len() {
            bail!(
                "the peer has {} QPs, this side {}",
                peer.endpoints.len(),
                mine.endpoints.len()
            );
        }
        let qpns: Vec<String> = peer
            .endpoints
            .iter()
            .map(|e| format!("{:#x}", e.qpn()))
            .collect();
        let first = peer.endpoints.first();
        eprintln!(
            "{test}: {}: exchanged endpoints with the {} at {} (device {}, GID {}, QPN {}{})",
            self.role,
            self.peer_role,
            self.addr,
            first.map_or("?", |e| e.device()),
            first.map_or("?".into(), |e| e.gid().to_string()),
            qpns.join(", "),
            // A soft NIC's wire port; an rdma-core device's endpoint names none.
            first
                .filter(|e| e.udp_port().is_some())
                .and_then(Endpoint::udp_addr)
                .map_or(String::new(), |u| format!(", UDP {u}")),
        );
        self.bs
            .set_timeout(a.wait().saturating_mul(STEP_WAIT_FACTOR));
        Ok(peer)
    }

    /// One step both sides take: sends this side's outcome, receives the peer's. A failure on
    /// this side is returned (after the peer has been told); a failure the peer reports ends
    /// this side too, with the peer's reason. Both sides must name the same step.
    pub fn step<T: Serialize + DeserializeOwned>(
        &mut self,
        name: &str,
        mine: Result<T>,
    ) -> Result<T> {
        let out = StepOut {
            step: name,
            outcome: mine.as_ref().map_err(error_text),
        };
        let bytes = serde_json::to_vec(&out).context("encode a step")?;
        let theirs = if self.bs.rank() == 0 {
            self.bs.send(&bytes).and_then(|()| self.bs.recv())
        } else {
            self.bs
                .recv()
                .and_then(|t| self.bs.send(&bytes).map(|()| t))
        };
        // This side's failure first: it is the cause when both failed.
        mine.with_context(|| format!("{} ({name})", self.role))?;
        let theirs = theirs.with_context(|| {
            format!(
                "lost the {} during \"{name}\" (it stopped or failed)",
                self.peer_role
            )
        })?;
        let theirs: StepIn<T> = serde_json::from_slice(&theirs)
            .with_context(|| format!("decode the {}'s \"{name}\"", self.peer_role))?;
        if theirs.step != name {
            bail!(
                "protocol: this side is at \"{name}\", the {} at \"{}\"",
                self.peer_role,
                theirs.step
            );
        }
        theirs
            .outcome
            .map_err(|e| anyhow::anyhow!("the {} failed ({name}): {e}", self.peer_role))
    }
}

/// A step of a run that has a peer, or just this side's outcome in loopback.
pub fn step<T: Serialize + DeserializeOwned>(
    peer: &mut Option<Peer>,
    name: &str,
    mine: Result<T>,
) -> Result<Option<T>> {
    match peer {
        Some(p) => p.step(name, mine).map(Some),
        None => mine.map(|_| None),
    }
}

/// The header lines of the server/client roles: role, peer, wire, loss.
pub fn remote_header(
    h: &mut Header,
    a: &CommonArgs,
    peer: &Peer,
    ctx: &Context,
    remote: &Endpoint,
) {
    h.line(
        "Role",
        format!(
            "{} (the {} is at {} over TCP)",
            peer.role, peer.peer_role, peer.addr
        ),
    );
    let gids = format!(
        "GID {} -> {}",
        gpuverbs::endpoint::Gid::from(ctx.gid()),
        remote.gid()
    );
    match ctx.wire_addr() {
        Some(w) => h
            .line(
                "Wire",
                format!(
                    "RoCEv2 over UDP: {w} -> {} ({gids})",
                    remote.udp_addr().map_or("-".into(), |w| w.to_string())
                ),
            )
            .line(
                "Loss",
                match a.loss {
                    Some(p) if p > 0.0 => {
                        format!(
                            "{p}% of the datagrams this side sends are dropped (fault injection)"
                        )
                    }
                    _ => "none injected on this side".to_string(),
                },
            ),
        None => h
            .line(
                "Wire",
                format!("RoCE v2 from port 1 of {} ({gids})", ctx.selection().name),
            )
            .line("Loss", "none injected (fault injection is the soft NIC's)"),
    };
}

/// The JSON fields of the server/client roles: the role, both GIDs, and the soft NIC's wire
/// addresses and loss (`null` on an rdma-core device, which has neither).
pub fn remote_json(a: &CommonArgs, peer: &Peer, ctx: &Context, remote: &Endpoint) -> Value {
    let wire = ctx.wire_addr();
    json!({
        "role": peer.role,
        "gid": gpuverbs::endpoint::Gid::from(ctx.gid()).to_string(),
        "peer_gid": remote.gid().to_string(),
        "wire_addr": wire.map(|w| w.to_string()),
        "peer_wire_addr": wire.and(remote.udp_addr()).map(|w| w.to_string()),
        "loss_pct": wire.map(|_| a.loss.unwrap_or(0.0)),
    })
}
