//! What a run prints: the [`Header`] and its common lines, table rows, perftest's address
//! lines and `--output` numbers, the JSON fields, and the error text and exit code.

use crate::args::{CommonArgs, Initiator, Placement};
use crate::qp::{cpu_doorbell_reason, cpu_ring_mode, doorbell_name, with_mtu};
use crate::resolved::Env;
use anyhow::Result;
use gpuverbs::{Context, Endpoint, Qp, RingPlacement};
use serde_json::{json, Value};
use std::io::Write as _;

/// The block above the table: one `name : value` line per choice.
#[derive(Default)]
pub struct Header {
    title: String,
    lines: Vec<(String, String)>,
}

/// The rule perftest draws around its header.
pub const RULE: &str =
    "---------------------------------------------------------------------------------------";

impl Header {
    /// A header titled `title`.
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            lines: Vec::new(),
        }
    }

    /// Adds a line.
    pub fn line(&mut self, name: &str, value: impl std::fmt::Display) -> &mut Self {
        self.lines.push((name.to_string(), value.to_string()));
        self
    }

    /// Prints it to stdout, or to stderr when stdout carries JSON.
    pub fn print(&self, json: bool) {
        let mut s = String::new();
        s.push_str(RULE);
        s.push('\n');
        s.push_str(&format!(
            "{:>width$}\n",
            self.title,
            width = 20 + self.title.len()
        ));
        for (n, v) in &self.lines {
            s.push_str(&format!(" {n:<16}: {v}\n"));
        }
        s.push_str(RULE);
        if json {
            eprintln!("{s}");
        } else {
            println!("{s}");
        }
    }
}

/// perftest's address lines of one QP (`ctx_print_pingpong_data` of an RDMA WRITE test):
/// ` local address: LID 0000 QPN 0x0011 PSN 0x3a2b1c RKey 0x000123 VAddr 0x007f0000001000`
/// and ` GID: 00:00:...:255:255:127:00:00:01` (the GID's bytes in decimal, as perftest prints
/// them). `side`: `local` or `remote`; `rkey`, `vaddr`: the buffer this QP's peer writes into
/// (or, on a side that receives nothing, its source buffer), as perftest exchanges them. The
/// LID is 0: RoCE has none.
pub fn address_lines(side: &str, ep: &Endpoint, rkey: u32, vaddr: u64) -> String {
    address_lines_of(AddrFormat::Rdma, side, ep, rkey, vaddr)
}

/// What perftest's address line of a test carries after `QPN ... PSN ...`: the RKey and VAddr
/// (RDMA WRITE), the outstanding reads and then those (`OUT 0x10`, RDMA READ), or nothing
/// (SEND, atomics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrFormat {
    /// ` RKey ... VAddr ...` (WRITE).
    Rdma,
    /// ` OUT 0x.. RKey ... VAddr ...` (READ), with `-o`.
    Read {
        /// The outstanding reads.
        outs: u32,
    },
    /// Nothing more (SEND, atomics).
    Basic,
}

/// [`address_lines`] in the format of a test's verb ([`AddrFormat`]).
pub fn address_lines_of(
    fmt: AddrFormat,
    side: &str,
    ep: &Endpoint,
    rkey: u32,
    vaddr: u64,
) -> String {
    let gid: Vec<String> = ep.gid().0.iter().map(|b| format!("{b:02}")).collect();
    let rdma = format!(" RKey {rkey:#08x} VAddr {vaddr:#016x}");
    let more = match fmt {
        AddrFormat::Rdma => rdma,
        AddrFormat::Read { outs } => format!(" OUT {outs:#04x}{rdma}"),
        AddrFormat::Basic => String::new(),
    };
    format!(
        " {side} address: LID {lid:#04x} QPN {qpn:#06x} PSN {psn:#06x}{more}\n GID: {}",
        gid.join(":"),
        lid = 0u16,
        qpn = ep.qpn(),
        psn = ep.psn(),
    )
    // C's `%#04x` of 0 is `0000` (no 0x for zero); Rust's `{:#04x}` writes `0x00`.
    .replacen("LID 0x00", "LID 0000", 1)
}

/// One line of a perftest-style table: each cell left-aligned in its width, one space between
/// (a width of 0: as wide as the cell).
pub fn table_row(cells: &[(String, usize)]) -> String {
    let mut s = String::new();
    for (c, w) in cells {
        s.push(' ');
        s.push_str(&format!("{c:<w$}"));
    }
    s.trim_end().to_string()
}

/// perftest's one-number line of `--output` (`printf("%lf\n")`).
pub fn output_number(v: f64) -> String {
    format!("{v:.6}")
}

/// The header's "Mtu": the path MTU the QPs were connected with (`-m`, the peer's, the
/// device's), and, over the soft NIC's wire (a context with a wire port), what the route's
/// link MTU leaves of it; an rdma-core device's port MTU already is its link's.
pub fn mtu_line(
    mtu: Option<u32>,
    ctx: &Context,
    local: &Endpoint,
    peer: Option<&Endpoint>,
) -> String {
    let mut m = with_mtu(local, mtu).mtu();
    if let Some(p) = peer {
        m = m.min(with_mtu(p, mtu).mtu());
    }
    let route = peer
        .filter(|_| ctx.wire_addr().is_some())
        .and_then(|p| p.udp_addr())
        .zip(local.gid().to_ipv4())
        .and_then(|(to, from)| match to {
            std::net::SocketAddr::V4(to) => gpuverbs::soft::route_mtu(from, *to.ip()).ok(),
            std::net::SocketAddr::V6(_) => None,
        });
    match route {
        Some(link) if gpuverbs::soft::roce_mtu(link) < m => format!(
            "{}[B] (asked {m}; the route's link MTU is {link})",
            gpuverbs::soft::roce_mtu(link)
        ),
        _ => format!("{m}[B]"),
    }
}

/// Writes the header's common lines (device, GPU, initiator, doorbell, placements).
///
/// With the CPU initiator the doorbell line names the register the CPU writes and says that the CPU
/// rings it (the QP's GPU-doorbell mapping is not used); `doorbell` is kept for kernels and
/// for a side that only answers.
pub fn common_header(h: &mut Header, env: &Env, a: &CommonArgs, qp: &Qp, doorbell: String) {
    use gpuverbs::post::RingMode;
    let doorbell = match (env.initiator, cpu_ring_mode(a.db)) {
        (Initiator::Cpu, Ok(ring)) if !doorbell.starts_with("none:") => format!(
            "{}, rung by the CPU initiator ({})",
            match ring {
                RingMode::BlueFlame => "blueflame register",
                RingMode::Doca | RingMode::RdmaCore => "doorbell register",
            },
            cpu_doorbell_reason(a.db, ring)
        ),
        _ => doorbell,
    };
    let gpu_posts = env.initiator == Initiator::Gpu;
    h.line("Device", env.ctx.selection())
        .line("GPU", &env.gpu_line)
        .line(
            "Initiator",
            format!("{} ({})", env.initiator.name(), env.initiator_why),
        )
        .line("Doorbell", doorbell)
        .line(
            "Rings",
            format!(
                "{} ({})",
                match qp.placement() {
                    RingPlacement::Gpu => {
                        "GPU memory (SQ/RQ and CQ rings; doorbell records in host memory)"
                    }
                    _ if gpu_posts => "host memory (mapped into the GPU when a kernel posts)",
                    _ => "host memory",
                },
                qp.placement_reason()
            ),
        )
        .line(
            "Buffers",
            match a.mem {
                Placement::Host => "host memory",
                Placement::Gpu => {
                    "GPU memory (registered with Pd::register_device_mem; the host fills and \
                     checks it by copying)"
                }
            },
        );
}

/// The JSON fields every result line carries (the header's choices).
pub fn common_json(env: &Env, a: &CommonArgs, qp: &Qp) -> Value {
    let (mode, why) = qp.doorbell();
    let why = match (env.initiator, cpu_ring_mode(a.db)) {
        (Initiator::Cpu, Ok(r)) => cpu_doorbell_reason(a.db, r),
        _ => why.to_string(),
    };
    json!({
        "device": env.ctx.selection().to_string(),
        "backend": match env.ctx.selection().kind {
            gpuverbs::device::BackendKind::Soft => "soft",
            gpuverbs::device::BackendKind::Mlx5 => "mlx5",
        },
        "gpu": env.gpu.as_ref().map(|g| g.info().to_string()),
        "initiator": env.initiator.name(),
        "initiator_reason": env.initiator_why,
        "doorbell": doorbell_name(mode),
        "doorbell_reason": why,
        "rings": match qp.placement() {
            RingPlacement::Gpu => "gpu",
            _ => "host",
        },
        "rings_reason": qp.placement_reason(),
        "mem": a.mem.name(),
    })
}

/// Merges the fields of `extra` into the object `base`.
pub fn merge(mut base: Value, extra: Value) -> Value {
    if let (Some(b), Value::Object(e)) = (base.as_object_mut(), extra) {
        b.extend(e);
    }
    base
}

/// Exit code of a run that failed (runtime error, validation failure, error completion).
pub const EXIT_FAILURE: u8 = 1;

/// An error with its causes, `outer: cause: ...`, each text once: a cause whose text an outer
/// message already shows (an error that prints its source, which is also its `source()`) is
/// left out.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut s = String::new();
    for cause in e.chain() {
        let m = cause.to_string();
        if m.is_empty() || s.contains(&m) {
            continue;
        }
        if !s.is_empty() {
            s.push_str(": ");
        }
        s.push_str(&m);
    }
    s
}

/// Maps the outcome of a run to the process exit code, printing an error once, as
/// `test: error: ...` with its causes ([`error_text`]).
pub fn exit_with(test: &str, r: Result<()>) -> std::process::ExitCode {
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("{test}: error: {}", error_text(&e));
            std::process::ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// The closing lines of a perftest-style run: the table's last rule, the end of the capture,
/// and `warning` (other processes used much CPU) on standard error.
pub fn finish_run(
    table: bool,
    pcap: Option<crate::Pcap>,
    warning: Option<String>,
) -> anyhow::Result<()> {
    if table {
        println!("{}", crate::RULE);
    }
    if let Some(p) = pcap {
        p.finish()?;
    }
    if let Some(w) = warning {
        let _ = std::io::Write::flush(&mut std::io::stdout());
        eprintln!("{w}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_names_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use");
        #[derive(Debug)]
        struct Bind(std::io::Error);
        impl std::fmt::Display for Bind {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "cannot listen on x: {}", self.0)
            }
        }
        impl std::error::Error for Bind {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = anyhow::Error::new(Bind(io)).context("rendezvous (server)");
        assert_eq!(
            error_text(&e),
            "rendezvous (server): cannot listen on x: Address already in use"
        );
        let e = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_text(&e), "outer: inner");
    }
}
