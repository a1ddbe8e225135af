//! Command-line options of the samples: [`CommonArgs`] and its value types, the parsers of
//! sizes, loss and MTU, and the device `-d` asks for ([`device_request`]).

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use gpuverbs::{Context, DeviceRequest, DoorbellMode};
use std::time::Duration;

/// perftest's default TCP port.
pub const DEFAULT_PORT: u16 = 18515;
/// Seconds a wait may take when `--timeout` is not given.
pub const DEFAULT_TIMEOUT_S: u64 = 10;

/// Largest message size accepted by `-s`.
pub const MAX_SIZE: u64 = 1 << 30;
/// Sizes of `-a`: 2 B .. 8 MiB, powers of two (perftest's `-a`).
pub const ALL_SIZES: std::ops::RangeInclusive<u32> = 1..=23;
/// Largest SQ (blocks) a QP may have.
pub const MAX_TX_DEPTH: u32 = 32768;

/// Who posts the WQEs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Initiator {
    /// CUDA kernels build WQEs, ring doorbells and poll CQEs (the point of gpuverbs).
    Gpu,
    /// A host thread does the same through the same rings (softnic's CPU initiator).
    Cpu,
}

impl Initiator {
    /// `"gpu"` or `"cpu"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Cpu => "cpu",
        }
    }
}

/// Doorbell mode asked for with `--db`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DbArg {
    /// The best the platform allows (the device says which and why).
    Auto,
    /// DBREC + 8-byte doorbell register write.
    Gpu,
    /// BlueFlame: the whole WQE into the register.
    Bf,
    /// The kernel publishes its producer index; a host proxy thread rings.
    Proxy,
}

impl DbArg {
    /// The QP's doorbell mode.
    pub fn mode(self) -> DoorbellMode {
        match self {
            Self::Auto => DoorbellMode::Auto,
            Self::Gpu => DoorbellMode::GpuDoorbell,
            Self::Bf => DoorbellMode::BlueFlame,
            Self::Proxy => DoorbellMode::CpuProxy,
        }
    }
}

/// Where the SQ, RQ and CQ rings live (`--rings`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RingsArg {
    /// Where the device wants them for the initiator: GPU memory on a ConnectX driven by the
    /// GPU initiator, host memory otherwise (the header says what it chose and why).
    Auto,
    /// Host memory (mapped into the GPU when a kernel uses it).
    Host,
    /// GPU memory (the GPU initiator only).
    Gpu,
}

impl RingsArg {
    /// `"auto"`, `"host"` or `"gpu"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Host => "host",
            Self::Gpu => "gpu",
        }
    }

    /// The host API's placement.
    pub fn placement(self) -> gpuverbs::RingPlacement {
        match self {
            Self::Auto => gpuverbs::RingPlacement::Auto,
            Self::Host => gpuverbs::RingPlacement::HostMapped,
            Self::Gpu => gpuverbs::RingPlacement::Gpu,
        }
    }
}

/// Where payload buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Placement {
    /// Host memory (mapped into the GPU when a kernel uses it).
    Host,
    /// GPU memory.
    Gpu,
}

impl Placement {
    /// `"host"` or `"gpu"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Gpu => "gpu",
        }
    }
}

/// The roles of a sample that runs as one process or as a server/client pair and has no other
/// [`CommonArgs`] (echo, kv_transfer): flattened into its options.
#[derive(Args, Clone, Debug)]
pub struct RoleArgs {
    /// Server to connect to (client role). With -p and without it, this process is the server.
    #[arg(value_name = "SERVER", conflicts_with = "loopback")]
    pub server: Option<String>,
    /// TCP port of the rendezvous (server listens, client connects) [client's default: 18515].
    #[arg(short = 'p', long, conflicts_with = "loopback")]
    pub port: Option<u16>,
    /// Both sides in this process (the default when neither SERVER nor -p is given).
    #[arg(long)]
    pub loopback: bool,
    /// Roles: seconds a wait for the peer may take (the client's connect, each frame); a step
    /// waits up to 30 times this. The server waits for its client without a limit unless this
    /// is given [default: 10].
    #[arg(long, value_name = "SECONDS", conflicts_with = "loopback",
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout: Option<u64>,
    /// Roles: UDP port of this side's soft NIC (its wire port) [default: 0, the system picks].
    #[arg(long, value_name = "PORT", conflicts_with = "loopback")]
    pub wire_port: Option<u16>,
}

/// What a process of such a sample plays ([`RoleArgs::role`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Loopback,
    Server,
    Client,
}

impl RoleArgs {
    /// A SERVER makes a client, -p alone a server, neither (or --loopback) one process.
    pub fn role(&self) -> Role {
        match (&self.server, self.port) {
            (Some(_), _) => Role::Client,
            (None, Some(_)) if !self.loopback => Role::Server,
            _ => Role::Loopback,
        }
    }

    /// The [`CommonArgs`] these roles mean, parsed as put_bw would parse them, for
    /// [`crate::Peer`].
    pub fn common(&self, test: &str) -> Result<CommonArgs> {
        #[derive(clap::Parser)]
        struct Roles {
            #[command(flatten)]
            c: CommonArgs,
        }
        let mut v = vec![test.to_string()];
        v.extend(self.server.iter().cloned());
        v.extend(["-p".into(), self.port.unwrap_or(DEFAULT_PORT).to_string()]);
        if let Some(t) = self.timeout {
            v.extend(["--timeout".into(), t.to_string()]);
        }
        if let Some(w) = self.wire_port {
            v.extend(["--wire-port".into(), w.to_string()]);
        }
        use anyhow::Context as _;
        Ok(<Roles as clap::Parser>::try_parse_from(v)
            .context("the rendezvous options")?
            .c)
    }
}

/// The process's arguments parsed into `A` by `cmd`; on a usage error clap's message and exit.
pub fn parse_or_exit<A: clap::FromArgMatches>(cmd: &mut clap::Command) -> A {
    match A::from_arg_matches(&cmd.get_matches_mut()) {
        Ok(a) => a,
        Err(e) => e.format(cmd).exit(),
    }
}

/// Parses a loss percentage (`0` .. `100`, fractions allowed).
pub fn parse_loss(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("{s:?} is not a percentage"))?;
    if !(0.0..=100.0).contains(&v) {
        return Err(format!("loss must be 0 .. 100 (percent), not {v}"));
    }
    Ok(v)
}

/// Parses a size: bytes, or with a K/M/G suffix (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (bytes, or a number with K, M or G)"))?;
    let v = n
        .checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))?;
    if v == 0 || v > MAX_SIZE {
        return Err(format!("size must be 1 B .. 1 GiB, not {v}"));
    }
    Ok(v)
}

/// Options of both samples.
#[derive(Args, Clone, Debug)]
pub struct CommonArgs {
    /// Server to connect to (client role). Without it, and without --loopback, this process is
    /// the server and waits for a client.
    #[arg(value_name = "SERVER", conflicts_with = "loopback")]
    pub server: Option<String>,
    /// TCP port of the rendezvous (server listens, client connects).
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Run both sides in this process, over two QPs of one device (no TCP).
    #[arg(long)]
    pub loopback: bool,
    /// Message size in bytes (K, M, G suffixes: powers of 1024).
    #[arg(short = 's', long, value_parser = parse_size, conflicts_with = "all")]
    pub size: Option<u64>,
    /// Run every size from 2 B to 8 MiB (powers of two).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Timed iterations per size (default: depends on the size; see the header).
    #[arg(short = 'n', long, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: Option<u32>,
    /// Untimed warm-up iterations before the timed ones (default: about a tenth).
    #[arg(long)]
    pub warmup: Option<u32>,
    /// RDMA device: `soft`, `softnic<N>`, or a ConnectX name such as `mlx5_0` [default: the
    /// best available; GPUVERBS_DEVICE overrides].
    #[arg(short = 'd', long = "device", alias = "ib-dev")]
    pub device: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Who posts the WQEs [default: gpu when a GPU and the kernels are available, else cpu].
    #[arg(long, value_enum)]
    pub initiator: Option<Initiator>,
    /// Doorbell mode (as resolved by the device: the header says what it became and why).
    #[arg(long, value_enum, default_value_t = DbArg::Auto)]
    pub db: DbArg,
    /// Where the SQ/CQ rings live.
    #[arg(long, value_enum, default_value_t = RingsArg::Auto)]
    pub rings: RingsArg,
    /// Where the payload buffers live.
    #[arg(long, value_enum, default_value_t = Placement::Host)]
    pub mem: Placement,
    /// One WQE in this many asks for a CQE.
    #[arg(short = 'Q', long, default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub cq_mod: u32,
    /// SQ size per QP in 64-byte blocks (a minimum: raised when the posters need more).
    #[arg(short = 't', long, default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(16..=MAX_TX_DEPTH as i64))]
    pub tx_depth: u32,
    /// Seconds any single wait may take (completion, the client's connect) before the run
    /// fails; a step of the server/client roles waits up to 30 times this for the peer's part
    /// of it [default: 10]. The server waits for its client without a limit (as perftest's
    /// does) unless --timeout is given.
    #[arg(long, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout: Option<u64>,
    /// Server/client roles, soft NIC only: UDP port of this side's soft NIC (its wire port)
    /// [default: 0, the system picks one]. It binds the local IPv4 address that reaches the
    /// peer; the endpoints tell the peer where. GPUVERBS_SOFTNIC_ADDR=ip:port overrides the
    /// whole address. An rdma-core device (mlx5_0) refuses it: it sends from its own port.
    #[arg(long, value_name = "PORT", conflicts_with = "loopback")]
    pub wire_port: Option<u16>,
    /// Server/client roles, soft NIC only: drop this percentage of the datagrams this side's
    /// soft NIC sends (fault injection: data from a sender, ACKs from a receiver); give it to
    /// both sides for loss both ways. RC retransmission repairs it; every byte is still
    /// validated. An rdma-core device refuses it.
    #[arg(long, value_name = "PCT", value_parser = parse_loss, conflicts_with = "loopback")]
    pub loss: Option<f64>,
    /// Path MTU (256, 512, 1024, 2048 or 4096), as perftest's -m: the QPs use the smallest
    /// of this, the peer's and the device's (4096 on the soft NIC, the port's active MTU on
    /// an rdma-core device) [default: no limit of its own]. On the soft NIC's wire the route's
    /// link MTU lowers it further where a 4096-byte packet would not fit (1500: 1024).
    #[arg(short = 'm', long, value_parser = parse_mtu)]
    pub mtu: Option<u32>,
    /// Server/client roles, soft NIC only: the soft NIC captures every datagram this side
    /// sends and receives to FILE (pcap, raw IPv4: the headers its ICRC covers), for tshark or
    /// Wireshark (docs/wire.md shows how). An rdma-core device refuses it (capture its
    /// traffic with the host's tools).
    #[arg(long, value_name = "FILE", conflicts_with = "loopback")]
    pub pcap: Option<std::path::PathBuf>,
    /// One JSON object per size on stdout (the header goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// perftest's --output: print only this number of each size (perftest's `%lf`, one line
    /// per size), no header and no table: put_bw takes bandwidth (BW average) or
    /// message_rate (Mpps), write_lat latency (t_avg, microseconds).
    #[arg(long, value_enum, value_name = "UNITS", conflicts_with = "json")]
    pub output: Option<OutputArg>,
    /// perftest's -F (no warning when the CPU frequency is not at its maximum): accepted and
    /// ignored, as perftest's only concerns its cycle counter (gpuverbs times with the
    /// monotonic clock or the GPU's timers).
    #[arg(short = 'F', long = "CPU-freq")]
    pub cpu_freq: bool,
    /// perftest's -x: the GID index. gpuverbs uses the port's RoCE v2 GID (on the soft NIC
    /// index 0, its only one); another index is refused with the one in use.
    #[arg(short = 'x', long = "gid-index", value_name = "INDEX")]
    pub gid_index: Option<u8>,
    /// perftest's -i: the device port (perftest's default 1). gpuverbs drives port 1; another
    /// port is refused.
    #[arg(
        short = 'i',
        long = "ib-port",
        value_name = "PORT",
        default_value_t = 1
    )]
    pub ib_port: u8,
    /// perftest's -R (connect the QPs with rdma_cm): refused; gpuverbs exchanges its
    /// endpoints over its own TCP bootstrap.
    #[arg(short = 'R', long = "rdma_cm")]
    pub rdma_cm: bool,
    /// perftest's --use_cuda=N: payload buffers in the memory of GPU N (= --mem gpu --gpu N).
    #[arg(long = "use_cuda", value_name = "GPU", conflicts_with_all = ["gpu", "mem"])]
    pub use_cuda: Option<usize>,
    /// perftest's --use_cuda_dmabuf: register the GPU payload buffers through a dma-buf
    /// (needs --use_cuda or --mem gpu). On an rdma-core device (mlx5 backend) a region that
    /// came through another path (nvidia-peermem) fails the run; the soft NIC refuses it (its
    /// registrations take no dma-buf).
    #[arg(long = "use_cuda_dmabuf")]
    pub use_cuda_dmabuf: bool,
}

/// perftest's `--output` units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputArg {
    /// BW average (MB/sec, or Gb/sec with --report-gbits).
    Bandwidth,
    /// Message rate (Mpps).
    #[value(name = "message_rate")]
    MessageRate,
    /// t_avg (microseconds).
    Latency,
}

impl OutputArg {
    /// perftest's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bandwidth => "bandwidth",
            Self::MessageRate => "message_rate",
            Self::Latency => "latency",
        }
    }
}

impl CommonArgs {
    /// Applies the perftest spellings that stand for other options (`--use_cuda=N`: `--mem
    /// gpu --gpu N`), and refuses what cannot apply whatever the device (`-R`, `-i` other than
    /// 1, `--use_cuda_dmabuf` without GPU memory), with a one-line reason.
    pub fn resolve(&mut self) -> Result<()> {
        if self.rdma_cm {
            bail!(
                "-R (rdma_cm): not supported: gpuverbs connects its QPs itself, exchanging the \
                 endpoints over its TCP bootstrap (-p), as perftest does without -R"
            );
        }
        if self.ib_port != 1 {
            bail!(
                "-i {}: gpuverbs drives port 1 of the device only",
                self.ib_port
            );
        }
        if let Some(g) = self.use_cuda {
            self.mem = Placement::Gpu;
            self.gpu = g;
        }
        if self.use_cuda_dmabuf && self.mem != Placement::Gpu {
            bail!("--use_cuda_dmabuf: needs GPU payload buffers (--use_cuda=N or --mem gpu)");
        }
        Ok(())
    }

    /// Refuses `-x` and `--use_cuda_dmabuf` where the opened device cannot honour them.
    pub fn check_device(&self, ctx: &Context) -> Result<()> {
        if let Some(x) = self.gid_index {
            if x != ctx.gid_index() {
                bail!(
                    "-x {x}: gpuverbs uses the RoCE v2 GID of port 1, GID index {} of {} ({}); \
                     another index cannot be chosen",
                    ctx.gid_index(),
                    ctx.selection().name,
                    gpuverbs::endpoint::Gid::from(ctx.gid())
                );
            }
        }
        if self.use_cuda_dmabuf && ctx.selection().kind == gpuverbs::device::BackendKind::Soft {
            bail!(
                "--use_cuda_dmabuf: does not apply to the soft NIC {} (it reaches GPU memory \
                 without a dma-buf); use an rdma-core device such as mlx5_0",
                ctx.selection().name
            );
        }
        Ok(())
    }

    /// With `--use_cuda_dmabuf`, fails unless `mr` (a GPU payload region) was registered
    /// through a dma-buf (`Mr::gpu_path`).
    pub fn check_dmabuf(&self, mr: &gpuverbs::Mr, what: &str) -> Result<()> {
        if !self.use_cuda_dmabuf {
            return Ok(());
        }
        match mr.gpu_path() {
            Some(gpuverbs::GpuRegPath::DmaBuf) => Ok(()),
            other => bail!(
                "--use_cuda_dmabuf: the {what} buffer was registered {} (no dma-buf: the kernel \
                 or the GPU driver offers none for it)",
                match other {
                    Some(p) => format!("through {p:?}"),
                    None => "without a GPU path".to_string(),
                }
            ),
        }
    }

    /// The sizes to run.
    pub fn sizes(&self, default: u64) -> Vec<u64> {
        if self.all {
            ALL_SIZES.map(|e| 1u64 << e).collect()
        } else {
            vec![self.size.unwrap_or(default)]
        }
    }

    /// The per-wait timeout (`--timeout`, else [`DEFAULT_TIMEOUT_S`]).
    pub fn wait(&self) -> Duration {
        Duration::from_secs(self.timeout.unwrap_or(DEFAULT_TIMEOUT_S))
    }

    /// How long the server waits for a client: `--timeout` when given, else without a limit.
    pub fn accept_wait(&self) -> Option<Duration> {
        self.timeout.map(Duration::from_secs)
    }

    /// The role, for messages.
    pub fn role(&self) -> &'static str {
        if self.loopback {
            "loopback"
        } else if self.server.is_some() {
            "client"
        } else {
            "server"
        }
    }
}

/// The device `-d` asks for.
pub fn device_request(d: Option<&str>) -> DeviceRequest {
    match d {
        None => DeviceRequest::Auto,
        Some("soft") => DeviceRequest::Soft,
        Some(n) => DeviceRequest::Named(n.to_string()),
    }
}

/// `-m`: a path MTU of IBTA's (256..4096, a power of two).
fn parse_mtu(s: &str) -> std::result::Result<u32, String> {
    match s.parse::<u32>() {
        Ok(m @ (256 | 512 | 1024 | 2048 | 4096)) => Ok(m),
        _ => Err(format!("{s}: the MTU is one of 256, 512, 1024, 2048, 4096")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("8m"), Ok(8 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("2G").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }
}
