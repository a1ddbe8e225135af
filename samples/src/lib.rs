//! Code shared by the perftest-style samples `put_bw` (RDMA WRITE bandwidth) and `write_lat`
//! (RDMA WRITE ping-pong latency).
//!
//! - [`CommonArgs`]: the options both samples take (roles, sizes, device, GPU, initiator,
//!   doorbell mode, ring and buffer placement, output), perftest's names where perftest has them.
//! - [`open_env`]: opens the device and decides the initiator (GPU when a GPU and the kernels are
//!   there, else the CPU, and why), [`check_placement`] refuses what the device cannot do.
//! - [`Header`]: the block above the table, with every choice as resolved.
//! - [`Peer`]: the server/client roles: rendezvous over TCP with
//!   [`gpuverbs::bootstrap::Bootstrap`], the device ([`open_env_remote`]: a soft NIC on the
//!   wire bound to the address that reaches the peer, or an rdma-core device such as `mlx5_0`
//!   as it is), the exchange of endpoints, parameters and memory
//!   ([`Peer::hello`], [`Peer::step`]), and the steps of each size, in which a failure on
//!   either side ends both with its reason.
//! - [`pattern`]: the payload pattern and its checks; [`LatStats`], [`Peak`], [`Units`]: the
//!   numbers; [`Progress`]: the progress line of long sweeps.
//! - [`BwJob`], [`LatSide`], [`GpuStatus`], [`Exports`]: what the kernels in
//!   `kernels/src/samples.cu` are given, and how their status comes back.

use anyhow::{bail, Context as _, Result};
use clap::{Args, ValueEnum};
use gpuverbs::bootstrap::{Bootstrap, Listener};
use gpuverbs::gpu::{DeviceMem, ExportedQp, Gpu};
use gpuverbs::proxy::{ProxyConfig, ProxyService, ProxyTarget};
use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, DeviceRequest, DoorbellMode, Endpoint, Pd, Qp,
    QpOptions, RingPlacement,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use softnic::initiator::RingMode;
use std::ffi::c_void;
use std::io::{IsTerminal as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// perftest's default TCP port.
pub const DEFAULT_PORT: u16 = 18515;
/// Seconds a wait may take when `--timeout` is not given.
pub const DEFAULT_TIMEOUT_S: u64 = 10;
/// What the server's "no limit" wait for a client is given (about a century).
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// Largest message size accepted by `-s`.
pub const MAX_SIZE: u64 = 1 << 30;
/// Sizes of `-a`: 2 B .. 8 MiB, powers of two (perftest's `-a`).
pub const ALL_SIZES: std::ops::RangeInclusive<u32> = 1..=23;
/// Largest SQ (blocks) a QP may have.
pub const MAX_TX_DEPTH: u32 = 32768;

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

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

/// Where rings or payload buffers live.
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
    #[arg(long, value_enum, default_value_t = Placement::Host)]
    pub rings: Placement,
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

/// perftest's one-number line of `--output` (`printf("%lf\n")`).
pub fn output_number(v: f64) -> String {
    format!("{v:.6}")
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

// ---------------------------------------------------------------------------------------------
// Device, GPU, initiator
// ---------------------------------------------------------------------------------------------

/// The device, the GPU and the initiator of a run, as resolved.
pub struct Env {
    /// The device (both sides of a loopback run share it).
    pub ctx: Context,
    /// The GPU, when one is used.
    pub gpu: Option<Arc<Gpu>>,
    /// What the header says about the GPU.
    pub gpu_line: String,
    /// Who posts.
    pub initiator: Initiator,
    /// Why that initiator.
    pub initiator_why: String,
}

/// The device `-d` asks for.
pub fn device_request(d: Option<&str>) -> DeviceRequest {
    match d {
        None => DeviceRequest::Auto,
        Some("soft") => DeviceRequest::Soft,
        Some(n) => DeviceRequest::Named(n.to_string()),
    }
}

/// Opens the device and resolves the initiator: `--initiator gpu` needs a GPU with the kernels;
/// without `--initiator`, the GPU is used when it opens, and otherwise the CPU, with the reason.
pub fn open_env(a: &CommonArgs) -> Result<Env> {
    let ctx = Context::open(device_request(a.device.as_deref())).context("open the RDMA device")?;
    resolve_env(a, ctx, None)
}

/// The server/client roles' device, as `-d` / GPUVERBS_DEVICE (or Auto) picks it, and the
/// initiator as [`open_env`] resolves it. `no_gpu`: why this test cannot use the GPU initiator
/// across processes (`--initiator gpu` is then an error, and the automatic choice the CPU).
///
/// - A soft NIC gets a wire port on the local IPv4 address that reaches the peer (the route's
///   source address) and `--wire-port` (GPUVERBS_SOFTNIC_ADDR overrides both), with `--loss`
///   applied to what it sends.
/// - An rdma-core device (the mlx5 backend) is used as it is: its QPs' endpoints carry the
///   RoCE v2 GID of its port, which the peer connects to. The soft NIC's options (`--wire-port`,
///   `--loss`, `--pcap`, GPUVERBS_SOFTNIC_ADDR) are refused ([`soft_nic_options`]).
///
/// Both sides then take the step "open the device": a side that failed (a device that is not
/// there, an option it cannot honour) ends both runs with its reason.
pub fn open_env_remote(a: &CommonArgs, peer: &mut Peer, no_gpu: Option<&str>) -> Result<Env> {
    let (env, mine) = match open_remote_device(a, peer).and_then(|c| resolve_env(a, c, no_gpu)) {
        Ok(env) => (Some(env), Ok(())),
        Err(e) => (None, Err(e)),
    };
    peer.step("open the device", mine)?;
    env.context("the device step succeeded without a device")
}

/// The soft-NIC-only settings of the server/client roles that this run gives: what an
/// rdma-core device cannot honour.
pub fn soft_nic_options(a: &CommonArgs) -> Vec<&'static str> {
    let mut v = Vec::new();
    if a.wire_port.is_some() {
        v.push("--wire-port");
    }
    if a.loss.is_some() {
        v.push("--loss");
    }
    if a.pcap.is_some() {
        v.push("--pcap");
    }
    if std::env::var(gpuverbs::device::SOFTNIC_ADDR_ENV).is_ok_and(|v| !v.trim().is_empty()) {
        v.push(gpuverbs::device::SOFTNIC_ADDR_ENV);
    }
    v
}

/// Opens the device of the server/client roles ([`open_env_remote`]).
fn open_remote_device(a: &CommonArgs, peer: &Peer) -> Result<Context> {
    let req = device_request(a.device.as_deref());
    // Where a soft NIC's wire port binds; an rdma-core device needs no address of ours.
    let bind =
        local_ip_towards(peer.addr.ip()).map(|ip| SocketAddr::from((ip, a.wire_port.unwrap_or(0))));
    let ctx = match &bind {
        Ok(b) => Context::open_wire(req, *b).with_context(|| {
            format!("open the RDMA device (a soft NIC gets a wire port on {b})")
        })?,
        // A soft NIC can still be given its address by GPUVERBS_SOFTNIC_ADDR.
        Err(_) => Context::open(req).context("open the RDMA device")?,
    };
    match ctx.selection().kind {
        gpuverbs::device::BackendKind::Mlx5 => {
            let soft = soft_nic_options(a);
            if !soft.is_empty() {
                bail!(
                    "{} {} the soft NIC (its UDP wire port, fault injection, capture), and this \
                     run uses the rdma-core device {} (mlx5 backend), which sends RoCE v2 from \
                     its own port (GID {}): leave {} out, or run on the soft NIC (-d soft)",
                    soft.join(", "),
                    if soft.len() == 1 {
                        "belongs to"
                    } else {
                        "belong to"
                    },
                    ctx.selection().name,
                    gpuverbs::endpoint::Gid::from(ctx.gid()),
                    if soft.len() == 1 { "it" } else { "them" },
                );
            }
        }
        gpuverbs::device::BackendKind::Soft => {
            let dev = ctx
                .soft_device()
                .context("a soft NIC context without its device")?;
            if ctx.wire_addr().is_none() {
                // No wire port: the peer's address gave none, and GPUVERBS_SOFTNIC_ADDR is unset.
                bind.with_context(|| format!("the device {} has no wire port", ctx.selection()))?;
                bail!("the device {} has no wire port", ctx.selection());
            }
            if let Some(pct) = a.loss.filter(|&p| p > 0.0) {
                // One decision sequence per role, the same every run.
                let seed = 0x5eed_0000 + u64::from(peer.bs.rank());
                dev.set_wire_faults(softnic::WireFaults::loss(pct / 100.0, seed))
                    .context("--loss: set the fault injection")?;
            }
        }
    }
    Ok(ctx)
}

/// The source address the kernel picks for packets to `peer`: the local address the peer can
/// answer to (127.0.0.1 for a peer on 127.0.0.1).
pub fn local_ip_towards(peer: IpAddr) -> Result<Ipv4Addr> {
    let v4 = match peer {
        IpAddr::V4(v) => v,
        IpAddr::V6(v) => v.to_ipv4_mapped().with_context(|| {
            format!(
                "the peer is at {v}, an IPv6 address, and the soft NIC's wire speaks IPv4 only: \
                 use its IPv4 address (or set GPUVERBS_SOFTNIC_ADDR)"
            )
        })?,
    };
    let probe = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).context("bind a UDP probe socket")?;
    // A connected UDP socket sends nothing; it only asks the kernel for the route.
    probe
        .connect((v4, 9))
        .with_context(|| format!("no route to the peer's address {v4}"))?;
    match probe
        .local_addr()
        .context("the route's source address")?
        .ip()
    {
        IpAddr::V4(ip) if !ip.is_unspecified() => Ok(ip),
        other => bail!("the route to {v4} has no IPv4 source address (got {other})"),
    }
}

/// Resolves the GPU and the initiator for an opened device.
fn resolve_env(a: &CommonArgs, ctx: Context, no_gpu: Option<&str>) -> Result<Env> {
    // The GPU initiator needs a GPU and gpuverbs' kernels (a build without nvcc has none).
    let open_gpu = || -> Result<Arc<Gpu>, gpuverbs::cuda::CudaError> {
        gpuverbs::cuda::fatbin()?;
        Gpu::open(a.gpu)
    };
    let (gpu, gpu_line, initiator, why) = match (a.initiator, no_gpu) {
        (Some(Initiator::Gpu), Some(why)) => bail!("--initiator gpu: {why}"),
        (None, Some(why)) => (
            None,
            "not used (the CPU posts across processes)".to_string(),
            Initiator::Cpu,
            format!("auto: {why}"),
        ),
        (i, _) => match i {
            Some(Initiator::Cpu) => (
                None,
                "not used (--initiator cpu)".to_string(),
                Initiator::Cpu,
                "requested".to_string(),
            ),
            Some(Initiator::Gpu) => {
                let g = open_gpu()
                    .with_context(|| format!("--initiator gpu: cannot use GPU {}", a.gpu))?;
                let line = g.info().to_string();
                (Some(g), line, Initiator::Gpu, "requested".to_string())
            }
            None => match open_gpu() {
                Ok(g) => {
                    let line = g.info().to_string();
                    let why = format!("auto: GPU {} and the gpuverbs kernels are available", a.gpu);
                    (Some(g), line, Initiator::Gpu, why)
                }
                Err(e) => (
                    None,
                    format!("none usable: {e}"),
                    Initiator::Cpu,
                    format!("auto: no usable GPU {} (see GPU), so the CPU posts", a.gpu),
                ),
            },
        },
    };
    Ok(Env {
        ctx,
        gpu,
        gpu_line,
        initiator,
        initiator_why: why,
    })
}

/// Refuses the placements this run cannot honour, with the reason. `--rings gpu` needs the
/// GPU initiator (the CPU initiator reads and writes the SQ/CQ rings from the host, so it cannot
/// drive rings in GPU memory). `--mem gpu` needs a GPU and the GPU initiator (the CPU
/// initiator reaches its buffers through host pointers).
pub fn check_placement(a: &CommonArgs, env: &Env) -> Result<()> {
    if a.rings == Placement::Gpu && (env.initiator != Initiator::Gpu || env.gpu.is_none()) {
        bail!(
            "--rings gpu: rings in GPU memory are driven by the GPU initiator only, and this run \
             uses the CPU ({}; GPU: {}); the CPU initiator cannot drive GPU-resident rings (use \
             --initiator gpu on a machine with a GPU, or --rings host)",
            env.initiator_why,
            env.gpu_line
        );
    }
    if a.mem == Placement::Host {
        return Ok(());
    }
    if env.gpu.is_none() || env.initiator != Initiator::Gpu {
        bail!(
            "--mem gpu: payload buffers in GPU memory need a GPU and the GPU initiator, and this \
             run has none ({}; initiator: {})",
            env.gpu_line,
            env.initiator_why
        );
    }
    Ok(())
}

/// A payload buffer: host memory, or GPU memory (`--mem gpu`) that the host fills and checks
/// by copying through [`DeviceMem::read`] / [`DeviceMem::write`].
pub enum Payload {
    /// Host memory.
    Host(gpuverbs::HostBuffer),
    /// GPU memory, registered with [`Pd::register_device_mem`].
    Gpu(DeviceMem),
}

impl Payload {
    /// `len` bytes where `mem` says (GPU memory needs `gpu`).
    pub fn new(mem: Placement, gpu: Option<&Arc<Gpu>>, len: usize) -> Result<Self> {
        Ok(match mem {
            Placement::Host => Payload::Host(gpuverbs::HostBuffer::new(len)),
            Placement::Gpu => {
                let gpu = gpu.context("--mem gpu: payload buffers in GPU memory need a GPU")?;
                Payload::Gpu(
                    gpu.alloc(len.max(1))
                        .with_context(|| format!("--mem gpu: allocate {len} B of GPU memory"))?,
                )
            }
        })
    }

    /// Registers it (host memory with `Pd::register_with`, GPU memory with
    /// `Pd::register_device_mem`).
    pub fn register(&self, pd: &Pd, access: Access) -> Result<gpuverbs::Mr> {
        Ok(match self {
            Payload::Host(b) => pd.register_with(b, access)?,
            Payload::Gpu(m) => pd
                .register_device_mem(m, access)
                .context("--mem gpu: register GPU memory")?,
        })
    }

    /// Registers it through the PD's registration cache (`Pd::register_cached`): the first
    /// time a miss (a registration), then a hit on the same region.
    pub fn register_cached(&self, pd: &Pd, access: Access) -> Result<gpuverbs::CachedMr> {
        Ok(match self {
            Payload::Host(b) => pd.register_cached(b, access)?,
            Payload::Gpu(m) => pd
                .register_cached(m, access)
                .context("--mem gpu: register GPU memory")?,
        })
    }

    /// Copies bytes in at `off`.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        match self {
            Payload::Host(b) => b.write(off, src),
            Payload::Gpu(m) => m.write(off, src).context("copy into GPU memory")?,
        }
        Ok(())
    }

    /// Copies bytes out from `off`.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        match self {
            Payload::Host(b) => b.read(off, dst),
            Payload::Gpu(m) => m.read(off, dst).context("copy out of GPU memory")?,
        }
        Ok(())
    }

    /// Sets `n` bytes at `off` to `byte`.
    pub fn fill(&self, off: usize, n: usize, byte: u8) -> Result<()> {
        match self {
            Payload::Host(b) => {
                b.fill(off, n, byte);
                Ok(())
            }
            Payload::Gpu(_) => self.write(off, &vec![byte; n]),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Payload::Host(b) => b.len(),
            Payload::Gpu(m) => m.len(),
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address a kernel on `gpu` uses: host memory mapped into the GPU
    /// ([`Gpu::map_host`]), GPU memory as it is ([`DeviceMem::ptr`]).
    pub fn gpu_addr(&self, gpu: &Gpu) -> Result<u64> {
        match self {
            Payload::Host(b) => Ok(gpu
                .map_host(b)
                .context("map a host payload buffer into the GPU")?),
            Payload::Gpu(m) => {
                if !std::ptr::eq(Arc::as_ptr(m.gpu()), gpu) {
                    bail!("--mem gpu: the payload buffer belongs to another GPU");
                }
                Ok(m.ptr())
            }
        }
    }

    /// The host buffer, when it is host memory (what the CPU initiator polls with atomics).
    pub fn host(&self) -> Option<&gpuverbs::HostBuffer> {
        match self {
            Payload::Host(b) => Some(b),
            Payload::Gpu(_) => None,
        }
    }
}

/// The doorbell convention a CPU initiator uses for a QP created with `db`, or why it cannot.
pub fn cpu_ring_mode(db: DbArg) -> Result<RingMode> {
    match db {
        // The device API rings with the DOCA convention; the CPU does the same.
        DbArg::Auto | DbArg::Gpu => Ok(RingMode::Doca),
        DbArg::Bf => Ok(RingMode::BlueFlame),
        DbArg::Proxy => bail!(
            "--db proxy: the CPU proxy rings doorbells for kernels; the CPU initiator rings its \
             own (use --initiator gpu, or --db auto|gpu|bf)"
        ),
    }
}

/// What the CPU initiator writes to ring a doorbell in `ring` mode (the header's and the
/// JSON's doorbell reason of a CPU run: the QP's own reason is about the GPU mapping, which a
/// CPU run does not use).
pub fn cpu_doorbell_reason(db: DbArg, ring: RingMode) -> String {
    let how = match ring {
        RingMode::RdmaCore => {
            "the doorbell record, then the first 8 bytes of the last WQE's ctrl segment to the \
             doorbell register (rdma-core convention)"
        }
        RingMode::Doca => {
            "the doorbell record, then {BE32(pi << 8), BE32(qpn << 8)} to the doorbell register \
             (DOCA convention)"
        }
        RingMode::BlueFlame => {
            "the doorbell record, then the whole WQE into the BlueFlame register"
        }
    };
    let db = match db {
        DbArg::Auto => "auto",
        DbArg::Gpu => "gpu",
        DbArg::Bf => "bf",
        DbArg::Proxy => "proxy",
    };
    format!("--db {db}: the CPU initiator writes {how}")
}

/// The doorbell line of the header: the QP's mode as resolved, why, and who rings (a CPU run
/// says what the CPU initiator writes, [`cpu_doorbell_reason`]).
pub fn doorbell_line(qp: &Qp, initiator: Initiator, ring: Option<RingMode>, db: DbArg) -> String {
    let (mode, why) = qp.doorbell();
    let name = doorbell_name(mode);
    match (initiator, ring) {
        (Initiator::Cpu, Some(r)) => format!("{name} ({})", cpu_doorbell_reason(db, r)),
        (Initiator::Gpu, _) if mode == DoorbellMode::CpuProxy => {
            format!("{name} ({why}); a host proxy thread rings for the kernels")
        }
        _ => format!("{name} ({why}); rung by the kernels"),
    }
}

/// Short name of a doorbell mode (JSON and header).
pub fn doorbell_name(m: DoorbellMode) -> &'static str {
    match m {
        DoorbellMode::Auto => "auto",
        DoorbellMode::GpuDoorbell => "gpu-doorbell",
        DoorbellMode::BlueFlame => "blueflame",
        DoorbellMode::CpuProxy => "cpu-proxy",
    }
}

// ---------------------------------------------------------------------------------------------
// Queues
// ---------------------------------------------------------------------------------------------

/// How the samples make QPs.
#[derive(Clone, Copy, Debug)]
pub struct QpSpec {
    /// SQ blocks (power of two); the QP's CQ gets as many entries (one CQE per block at most).
    pub tx_depth: u32,
    /// Ring placement.
    pub rings: Placement,
    /// Doorbell mode.
    pub db: DbArg,
}

/// An RC QP with a CQ of its own (send and receive), as `spec` says; rings in GPU memory
/// (`--rings gpu`) are allocated on `gpu` (`Context::create_cq_on` / `Pd::create_qp_on`).
pub fn create_qp(pd: &Pd, spec: QpSpec, gpu: Option<&Arc<Gpu>>) -> Result<Qp> {
    let placement = match spec.rings {
        Placement::Host => RingPlacement::HostMapped,
        Placement::Gpu => RingPlacement::Gpu,
    };
    let ctx = pd.context();
    let co = CqOptions {
        depth: spec.tx_depth.max(64),
        placement,
        ..Default::default()
    };
    let cq = match (spec.rings, gpu) {
        (Placement::Host, _) => ctx.create_cq(co),
        (Placement::Gpu, Some(g)) => ctx.create_cq_on(g, co),
        (Placement::Gpu, None) => bail!(
            "--rings gpu: rings in GPU memory need a GPU (and the GPU initiator; use --rings host)"
        ),
    }
    .with_context(|| format!("--rings {}: create a CQ", spec.rings.name()))?;
    let mut o = QpOptions::new(&cq, &cq);
    o.sq_blocks = spec.tx_depth;
    o.placement = placement;
    o.doorbell = spec.db.mode();
    match (spec.rings, gpu) {
        (Placement::Gpu, Some(g)) => pd.create_qp_on(g, o),
        _ => pd.create_qp(o),
    }
    .with_context(|| format!("--rings {}: create a QP", spec.rings.name()))
}

/// A capture of this side's soft NIC (`--pcap`), detached and flushed by [`Pcap::finish`] or
/// on drop (an early exit keeps what was captured).
pub struct Pcap {
    dev: Arc<softnic::Device>,
    writer: Arc<softnic::pcap::PcapWriter>,
    path: std::path::PathBuf,
}

/// Starts `--pcap` on the device of `ctx`: egress and ingress, the whole conversation.
pub fn start_pcap(a: &CommonArgs, ctx: &Context) -> Result<Option<Pcap>> {
    let Some(path) = &a.pcap else {
        return Ok(None);
    };
    let Some(dev) = ctx.soft_device() else {
        bail!(
            "--pcap needs the soft NIC (this run uses {})",
            ctx.selection().name
        );
    };
    let writer = softnic::pcap::PcapWriter::create(path)
        .with_context(|| format!("--pcap: create {}", path.display()))?;
    dev.set_capture(Some(softnic::Capture {
        writer: writer.clone(),
        ingress: true,
    }))
    .context("--pcap: the soft NIC has no wire port")?;
    Ok(Some(Pcap {
        dev: dev.clone(),
        writer,
        path: path.clone(),
    }))
}

impl Pcap {
    /// Stops capturing and writes the file out; says how many frames it holds (stderr).
    pub fn finish(self) -> Result<()> {
        let _ = self.dev.set_capture(None);
        self.writer
            .flush()
            .with_context(|| format!("--pcap: write {}", self.path.display()))?;
        eprintln!(
            "pcap: {} frames in {}",
            self.writer.packets(),
            self.path.display()
        );
        Ok(())
    }
}

impl Drop for Pcap {
    fn drop(&mut self) {
        let _ = self.dev.set_capture(None);
        let _ = self.writer.flush();
    }
}

/// `-m`: a path MTU of IBTA's (256..4096, a power of two).
fn parse_mtu(s: &str) -> std::result::Result<u32, String> {
    match s.parse::<u32>() {
        Ok(m @ (256 | 512 | 1024 | 2048 | 4096)) => Ok(m),
        _ => Err(format!("{s}: the MTU is one of 256, 512, 1024, 2048, 4096")),
    }
}

/// `ep` with its MTU lowered to `mtu` (`-m`), when given: what this side offers the peer, and
/// what it connects to.
pub fn with_mtu(ep: &Endpoint, mtu: Option<u32>) -> Endpoint {
    match mtu {
        Some(m) if m < ep.mtu() => {
            Endpoint::new(ep.gid(), ep.qpn(), ep.psn(), m, ep.device().to_string())
                .and_then(|e| e.with_udp_port(ep.udp_port()))
                .unwrap_or_else(|_| ep.clone())
        }
        _ => ep.clone(),
    }
}

/// Connects `q` to the peer's endpoint at no more than `mtu` (`-m`).
pub fn connect_mtu(q: &Qp, remote: &Endpoint, mtu: Option<u32>) -> Result<()> {
    q.connect(&with_mtu(remote, mtu), connect_options())?;
    Ok(())
}

/// What the samples' QPs allow their peers: writes and the atomics of `--signal`.
pub fn connect_options() -> ConnectOptions {
    ConnectOptions {
        access: Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        ..Default::default()
    }
}

/// Connects two QPs of this process to each other, at no more than `mtu` (`-m`).
pub fn connect_pair(a: &Qp, b: &Qp, mtu: Option<u32>) -> Result<()> {
    connect_mtu(a, &b.endpoint(), mtu).context("connect QP A")?;
    connect_mtu(b, &a.endpoint(), mtu).context("connect QP B")?;
    Ok(())
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
            std::net::SocketAddr::V4(to) => softnic::wire::route_mtu(from, *to.ip()).ok(),
            std::net::SocketAddr::V6(_) => None,
        });
    match route {
        Some(link) if softnic::wire::roce_mtu(link) < m => format!(
            "{}[B] (asked {m}; the route's link MTU is {link})",
            softnic::wire::roce_mtu(link)
        ),
        _ => format!("{m}[B]"),
    }
}

/// The SQ size a run needs: at least `min`, and more than the blocks the posters of one QP can
/// leave without a CQE (unsignaled, or published but not rung yet), so that a full SQ always
/// holds a rung, signaled WQE whose CQE frees space.
pub fn tx_depth_for(min: u32, unsignaled_blocks: u64) -> Result<u32> {
    let need = (unsignaled_blocks + 1).max(min as u64).next_power_of_two();
    if need > MAX_TX_DEPTH as u64 {
        bail!(
            "the posters of one QP may leave {unsignaled_blocks} blocks without a CQE, which needs \
             an SQ of {need} blocks (at most {MAX_TX_DEPTH}): lower --cq-mod or -l (--post_list), or use \
             fewer threads per QP"
        );
    }
    Ok(need as u32)
}

// ---------------------------------------------------------------------------------------------
// Header
// ---------------------------------------------------------------------------------------------

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
    let gid: Vec<String> = ep.gid().0.iter().map(|b| format!("{b:02}")).collect();
    format!(
        " {side} address: LID {lid:#04x} QPN {qpn:#06x} PSN {psn:#06x} RKey {rkey:#08x} VAddr \
         {vaddr:#016x}\n GID: {}",
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

// ---------------------------------------------------------------------------------------------
// Server / client roles
// ---------------------------------------------------------------------------------------------

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

/// What this side's wire port did between two counter snapshots (the JSON's `"wire"`):
/// datagrams each way, request packets sent again, timer expirations, sequence NAKs, datagrams
/// dropped on purpose; `null` without a soft NIC (an rdma-core device has no such counters).
pub fn wire_delta(
    before: &Option<softnic::WireCounters>,
    after: &Option<softnic::WireCounters>,
) -> Value {
    let (Some(before), Some(after)) = (before, after) else {
        return Value::Null;
    };
    let d = |a: u64, b: u64| a.saturating_sub(b);
    json!({
        "tx_packets": d(after.tx_packets, before.tx_packets),
        "rx_packets": d(after.rx_packets, before.rx_packets),
        "retransmits": d(after.retransmits, before.retransmits),
        "timeouts": d(after.timeouts, before.timeouts),
        "seq_naks_sent": d(after.seq_naks_sent, before.seq_naks_sent),
        "seq_naks_received": d(after.seq_naks_received, before.seq_naks_received),
        "injected_drops": d(after.injected_drops, before.injected_drops),
    })
}

/// The wire counters of a context's soft NIC (`None` without one).
pub fn wire_counters(ctx: &Context) -> Option<softnic::WireCounters> {
    ctx.soft_device().map(|d| d.counters().wire)
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

// ---------------------------------------------------------------------------------------------
// Payload pattern
// ---------------------------------------------------------------------------------------------

/// The payload pattern: 8 bytes at a time from a mix of (seed, slot, word index), so every
/// slot of every run has its own bytes, and a byte at the wrong place, from the wrong slot or
/// from an earlier run shows.
pub mod pattern {
    /// splitmix64's finaliser.
    pub fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The seed of a run (a size of a test).
    pub fn seed(test: u64, size: u64) -> u64 {
        mix(test.wrapping_mul(0x100_0000_01b3) ^ size)
    }

    /// Writes the `len` pattern bytes of `slot` into `out` (cleared first).
    pub fn fill(out: &mut Vec<u8>, seed: u64, slot: u64, len: usize) {
        out.clear();
        out.reserve(len);
        let base = mix(seed ^ slot.wrapping_mul(0xd6e8_feb8_6659_fd93));
        let mut k = 0u64;
        while out.len() < len {
            let w = mix(base ^ k).to_le_bytes();
            let n = (len - out.len()).min(8);
            out.extend_from_slice(&w[..n]);
            k += 1;
        }
    }

    /// The first offset where `got` differs from `want`.
    pub fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
        if got == want {
            return None;
        }
        got.iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .or(Some(got.len().min(want.len())))
    }
}

// ---------------------------------------------------------------------------------------------
// Numbers
// ---------------------------------------------------------------------------------------------

/// Bandwidth units: perftest's MB/sec (2^20 bytes) or, with `--report-gbits`, Gb/sec (10^9
/// bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Units {
    /// 2^20 bytes per second.
    MBytes,
    /// 10^9 bits per second.
    Gbits,
}

impl Units {
    /// The bandwidth of `bytes` in `secs`.
    pub fn bw(self, bytes: f64, secs: f64) -> f64 {
        if secs <= 0.0 {
            return 0.0;
        }
        match self {
            Self::MBytes => bytes / secs / (1u64 << 20) as f64,
            Self::Gbits => bytes * 8.0 / secs / 1e9,
        }
    }
    /// The label in the table header (`MB/sec` or `Gb/sec`).
    pub fn label(self) -> &'static str {
        match self {
            Self::MBytes => "MB/sec",
            Self::Gbits => "Gb/sec",
        }
    }
}

/// The completion timeline of a CPU run: after each polling pass that took completions, the
/// time and the number of messages completed so far. The peak rate is the best over windows of
/// at least `window` messages. One sample per pass (not per CQE) keeps a burst of CQEs taken at
/// once, after the thread was descheduled, from looking like an instant: it counts from the
/// previous pass, which saw none of them.
#[derive(Default)]
pub struct Peak {
    samples: Vec<(Instant, u64)>,
}

impl Peak {
    /// An empty timeline with room for `n` samples.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            samples: Vec::with_capacity(n),
        }
    }
    /// Records that `done` messages had completed when a pass ended at `t` (`done` does not
    /// decrease).
    pub fn record(&mut self, t: Instant, done: u64) {
        self.samples.push((t, done));
    }
    /// Forgets every sample.
    pub fn clear(&mut self) {
        self.samples.clear();
    }
    /// The best message rate (per second) over windows of at least `window` messages, if any
    /// window has a measurable duration.
    pub fn best_rate(&self, window: u64) -> Option<f64> {
        let s = &self.samples;
        let mut best: Option<f64> = None;
        let mut j = 0;
        for i in 1..s.len() {
            // The latest start that still leaves `window` messages.
            while j + 1 < i && s[i].1 - s[j + 1].1 >= window {
                j += 1;
            }
            let n = s[i].1 - s[j].1;
            if n >= window {
                let dt = s[i].0.saturating_duration_since(s[j].0).as_secs_f64();
                if dt > 0.0 {
                    let r = n as f64 / dt;
                    best = Some(best.map_or(r, |b: f64| b.max(r)));
                }
            }
        }
        best
    }
}

/// perftest's latency columns, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatStats {
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// Median.
    pub typical: f64,
    /// Mean.
    pub avg: f64,
    /// Standard deviation (population).
    pub stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl LatStats {
    /// The statistics of `us` (sorted in place). Empty input gives zeros.
    pub fn of(us: &mut [f64]) -> Self {
        if us.is_empty() {
            return Self::default();
        }
        us.sort_by(f64::total_cmp);
        let n = us.len();
        let avg = us.iter().sum::<f64>() / n as f64;
        let var = us.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n as f64;
        let pct = |p: f64| us[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self {
            min: us[0],
            max: us[n - 1],
            typical: us[n / 2],
            avg,
            stdev: var.sqrt(),
            p99: pct(0.99),
            p999: pct(0.999),
        }
    }
}

/// A progress line for sweeps that run longer than a couple of seconds: on stderr, and only when
/// stderr is a terminal, as one line rewritten in place (`\r`) that [`Progress::clear`] erases
/// before each table row and at the end (also when the run fails: on drop), so it never ends up
/// inside the table. Not on a terminal (a pipe, a file, a log) nothing is written.
pub struct Progress {
    test: &'static str,
    start: Instant,
    last: Instant,
    total: usize,
    /// Where the line goes (stderr on a terminal; `None`: nowhere).
    out: Option<Box<dyn std::io::Write>>,
    /// Quiet time before the first line.
    delay: Duration,
    shown: bool,
}

impl Progress {
    /// Progress of `total` sizes, on stderr when it is a terminal.
    pub fn new(test: &'static str, total: usize) -> Self {
        let tty = std::io::stderr().is_terminal();
        let out: Option<Box<dyn std::io::Write>> = if tty {
            Some(Box::new(std::io::stderr()))
        } else {
            None
        };
        Self::to(test, total, out, Duration::from_secs(2))
    }

    /// Progress of `total` sizes written to `out` (a terminal), the first line after `delay`.
    pub fn to(
        test: &'static str,
        total: usize,
        out: Option<Box<dyn std::io::Write>>,
        delay: Duration,
    ) -> Self {
        let now = Instant::now();
        Self {
            test,
            start: now,
            last: now,
            total,
            out,
            delay,
            shown: false,
        }
    }

    /// Says that `done` of the sizes are finished, the last one being `size` bytes.
    pub fn step(&mut self, done: usize, size: u64) {
        let Some(out) = self.out.as_mut() else {
            return;
        };
        if self.total < 2 || done >= self.total {
            return;
        }
        let now = Instant::now();
        let elapsed = now.duration_since(self.start);
        // Not before the delay; then at most every second.
        if elapsed < self.delay || (self.shown && now.duration_since(self.last).as_secs() < 1) {
            return;
        }
        self.last = now;
        self.shown = true;
        let _ = write!(
            out,
            "\r{}: {done}/{} sizes done (last {size} B), {:.1} s\x1b[K",
            self.test,
            self.total,
            elapsed.as_secs_f64()
        );
        let _ = out.flush();
    }

    /// Erases the line, if one is shown, before table output (or anything else) continues.
    pub fn clear(&mut self) {
        if let Some(out) = self.out.as_mut().filter(|_| self.shown) {
            let _ = write!(out, "\r\x1b[K");
            let _ = out.flush();
            self.shown = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.clear();
    }
}

// ---------------------------------------------------------------------------------------------
// Other processes' CPU
// ---------------------------------------------------------------------------------------------

/// CPU time of the whole machine and of this process at one moment (from `/proc/stat` and
/// `/proc/self/stat`), to tell how much of the machine other processes took during a
/// measurement: on a small machine the engine and the initiator each want a core.
#[derive(Clone, Copy, Debug)]
pub struct CpuSample {
    busy_ticks: u64,
    own_ticks: u64,
    at: Instant,
}

impl CpuSample {
    /// Shortest window [`CpuSample::others_since`] reports on (the counters tick every 10 ms).
    pub const MIN_WINDOW: Duration = Duration::from_millis(250);

    /// Now; `None` where `/proc` does not say (not Linux, or a malformed file).
    pub fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal (guest time is inside user)
        let busy_ticks = [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| cpu.get(i)).sum();
        let own = std::fs::read_to_string("/proc/self/stat").ok()?;
        let after = &own[own.rfind(')')? + 1..];
        let f: Vec<&str> = after.split_whitespace().collect();
        // fields 14 and 15 (utime, stime) are the 12th and 13th after the command name
        let own_ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        Some(Self {
            busy_ticks,
            own_ticks,
            at: Instant::now(),
        })
    }

    /// Cores used by other processes since `self` (USER_HZ is 100 on Linux); `None` for
    /// windows shorter than [`CpuSample::MIN_WINDOW`], too short for 10 ms ticks to say
    /// anything.
    pub fn others_since(self) -> Option<f64> {
        if self.at.elapsed() < Self::MIN_WINDOW {
            return None;
        }
        let now = Self::now()?;
        let other = now.busy_ticks.saturating_sub(self.busy_ticks) as f64
            - now.own_ticks.saturating_sub(self.own_ticks) as f64;
        Some((other / 100.0 / self.at.elapsed().as_secs_f64()).max(0.0))
    }
}

/// Cores other processes may use during a run of `put_bw` or `write_lat` before it warns that
/// its figures are low (the soft NIC's engine and the CPU initiator each want a core).
pub const OTHER_CPU_HIGH: f64 = 0.25;

/// How much CPU other processes use, around a run: a sample before the header, each timed
/// run's, and a warning after the table when any was above [`OTHER_CPU_HIGH`].
#[derive(Debug, Default)]
pub struct OtherCpu {
    /// Other processes' cores in the [`CpuSample::MIN_WINDOW`] before the run.
    pub before: Option<f64>,
    /// The most seen in a timed run.
    pub busiest: Option<f64>,
    /// Timed runs that were too short to measure.
    pub unmeasured: usize,
}

impl OtherCpu {
    /// Samples the machine for [`CpuSample::MIN_WINDOW`] (this process idle meanwhile).
    pub fn sample_before_run() -> Self {
        let s = CpuSample::now();
        std::thread::sleep(CpuSample::MIN_WINDOW);
        Self {
            before: s.and_then(CpuSample::others_since),
            ..Self::default()
        }
    }

    /// The header's line.
    pub fn header(&self, h: &mut Header) {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let v = match self.before {
            None => "not measured (no /proc/stat)".to_string(),
            Some(x) => format!(
                "{x:.2} of {cores} cores used by other processes in the {} ms before the run{} \
                 (each timed run's: other_cpu_cores in --json; a warning above {OTHER_CPU_HIGH})",
                CpuSample::MIN_WINDOW.as_millis(),
                if x > OTHER_CPU_HIGH {
                    " (HIGH: the figures will be low and vary between runs)"
                } else {
                    ""
                }
            ),
        };
        h.line("Other CPU", v);
    }

    /// Notes a timed run's figure (`None`: too short to measure); returns it for the JSON.
    pub fn record(&mut self, v: Option<f64>) -> Option<f64> {
        match v {
            Some(x) => self.busiest = Some(self.busiest.map_or(x, |b| b.max(x))),
            None => self.unmeasured += 1,
        }
        v
    }

    /// The warning to print after the table, if other processes used much CPU.
    pub fn warning(&self, test: &str) -> Option<String> {
        let high = |x: &Option<f64>| x.filter(|&x| x > OTHER_CPU_HIGH);
        match (high(&self.busiest), high(&self.before)) {
            (Some(b), _) => Some(format!(
                "{test}: warning: other processes used up to {b:.2} cores during a timed run \
                 (above {OTHER_CPU_HIGH}): the figures are low and vary between runs"
            )),
            (None, Some(b)) if self.busiest.is_none() => Some(format!(
                "{test}: warning: other processes used {b:.2} cores before the run (above \
                 {OTHER_CPU_HIGH}; the timed runs were too short to measure): the figures may \
                 be low"
            )),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GPU side
// ---------------------------------------------------------------------------------------------

/// One QP's share of a `put_bw` run, as `gv_sample_put_bw` reads it (`samples::bw_job`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BwJob {
    /// Exported descriptor (`gpuverbs_qp*`).
    pub qp: u64,
    /// NIC address of source slot 0.
    pub lbase: u64,
    /// Remote address of the job's destination slot 0.
    pub rbase: u64,
    /// lkey of the sources.
    pub lkey: u32,
    /// rkey of the destinations.
    pub rkey: u32,
    /// Threads that drive the QP.
    pub workers: u32,
    /// Destination slots (a multiple of `workers`).
    pub dst_slots: u32,
    /// Source slots.
    pub src_slots: u32,
    /// Iteration i reads source slot (i + src_shift) % src_slots.
    pub src_shift: u32,
}
const _: () = assert!(std::mem::size_of::<BwJob>() == 48);

/// One side of a `write_lat` ping-pong, as `gv_sample_write_lat` reads it (`samples::lat_side`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LatSide {
    /// Exported descriptor.
    pub qp: u64,
    /// NIC address of the outgoing payload.
    pub src_nic: u64,
    /// GPU address of the outgoing payload (the kernel writes its tail).
    pub src_dev: u64,
    /// Remote address the payload goes to.
    pub dst_remote: u64,
    /// GPU address of the aligned 8-byte word that ends the incoming payload.
    pub recv_dev: u64,
    /// The peer's signal word (remote address).
    pub sig_remote: u64,
    /// The own signal word (GPU address).
    pub sig_dev: u64,
    /// lkey of the payload.
    pub lkey: u32,
    /// rkey of the peer's receive buffer.
    pub rkey: u32,
    /// rkey of the peer's signal word.
    pub sig_rkey: u32,
    /// Zero.
    pub pad: u32,
}
const _: () = assert!(std::mem::size_of::<LatSide>() == 72);

/// A pointer to a kernel parameter.
pub fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// Copies plain values into new GPU memory.
pub fn upload<T: bytemuck::Pod>(gpu: &Arc<Gpu>, v: &[T]) -> Result<DeviceMem> {
    let bytes: &[u8] = bytemuck::cast_slice(v);
    let mem = gpu.alloc(bytes.len())?;
    mem.write(0, bytes)?;
    Ok(mem)
}

/// The status words the sample kernels report: [status, syndrome, vendor, wqe_counter, who].
pub struct GpuStatus {
    mem: DeviceMem,
}

impl GpuStatus {
    /// Zeroed status words.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self> {
        Ok(Self {
            mem: gpu.alloc(32)?,
        })
    }
    /// Device address for the kernel.
    pub fn ptr(&self) -> u64 {
        self.mem.ptr()
    }
    /// Clears the words before a launch.
    pub fn reset(&self) -> Result<()> {
        Ok(self.mem.write(0, &[0u8; 32])?)
    }
    /// Fails with the decoded status unless every thread reported OK. `qpn(who)` names the QP
    /// of job/side `who`.
    pub fn check(&self, what: &str, qpn: impl Fn(usize) -> u32) -> Result<()> {
        let mut b = [0u8; 32];
        self.mem.read(0, &mut b)?;
        let s: [i32; 8] = bytemuck::cast(b);
        match s[0] {
            0 => Ok(()),
            1 => {
                let e = prm::ErrorCqe {
                    responder: false,
                    syndrome: s[1] as u8,
                    vendor_syndrome: s[2] as u8,
                    wqe_opcode: prm::Opcode::RdmaWrite as u8,
                    qpn: qpn(s[4].max(0) as usize),
                    wqe_counter: s[3] as u16,
                };
                bail!("{what}: a completion carries an error: {e}")
            }
            2 => bail!(
                "{what}: a wait in the kernel ran out of its budget (TIMEOUT) on QP {:#x}: the \
                 device stopped answering",
                qpn(s[4].max(0) as usize)
            ),
            3 => bail!("{what}: the kernel refused an argument (INVALID)"),
            x => bail!("{what}: the kernel reported unknown status {x}"),
        }
    }
}

/// QPs exported to a GPU, and the proxy thread that rings for them in CPU-proxy mode.
pub struct Exports {
    /// One descriptor per QP, in the order given.
    pub qps: Vec<ExportedQp>,
    // Dropped after the descriptors: the proxy stops before the QPs go.
    _proxy: Option<ProxyService>,
}

impl Exports {
    /// Exports `qps` to `gpu`; starts a proxy thread when their doorbell mode is CPU proxy.
    pub fn new(gpu: &Arc<Gpu>, qps: &[&Qp]) -> Result<Self> {
        let mut out = Vec::with_capacity(qps.len());
        for q in qps {
            out.push(gpu.export_qp(q).context("export a QP to the GPU")?);
        }
        let proxied: Vec<&&Qp> = qps
            .iter()
            .filter(|q| q.doorbell().0 == DoorbellMode::CpuProxy)
            .collect();
        let proxy = if proxied.is_empty() {
            None
        } else {
            let svc = ProxyService::start(ProxyConfig::default()).context("start the CPU proxy")?;
            for q in proxied {
                // The service releases its targets when it is dropped.
                let _handle = svc.add(ProxyTarget::for_qp(q)?)?;
            }
            Some(svc)
        };
        Ok(Self {
            qps: out,
            _proxy: proxy,
        })
    }
}

/// Writes the header's common lines (device, GPU, initiator, doorbell, placements).
pub fn common_header(h: &mut Header, env: &Env, a: &CommonArgs, doorbell: String) {
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
            match a.rings {
                Placement::Host if gpu_posts => {
                    "host memory (mapped into the GPU when a kernel posts)"
                }
                Placement::Host => "host memory",
                Placement::Gpu => {
                    "GPU memory (SQ/RQ and CQ rings from Context::create_cq_on / \
                     Pd::create_qp_on; doorbell records in host memory)"
                }
            },
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
        "rings": a.rings.name(),
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

    #[test]
    fn latency_columns() {
        let mut v: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        let s = LatStats::of(&mut v);
        assert_eq!((s.min, s.max), (1.0, 1000.0));
        assert_eq!(s.typical, 501.0);
        assert_eq!(s.avg, 500.5);
        assert_eq!(s.p99, 990.0);
        assert_eq!(s.p999, 999.0);
        assert!((s.stdev - 288.675).abs() < 0.01, "{}", s.stdev);
        let one = LatStats::of(&mut [3.0]);
        assert_eq!((one.min, one.p999, one.stdev), (3.0, 3.0, 0.0));
        assert_eq!(LatStats::of(&mut []), LatStats::default());
    }

    #[test]
    fn peak_is_the_best_window() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut p = Peak::default();
        // 10 messages per ms for 10 ms, then 40 per ms for 2 ms.
        for i in 0..=10 {
            p.record(ms(i), 10 * i);
        }
        p.record(ms(11), 140);
        p.record(ms(12), 180);
        let best = p.best_rate(80).unwrap();
        assert!((best - 80.0 / 0.002).abs() < 1.0, "{best}");
        // A window longer than the run has no rate.
        assert_eq!(p.best_rate(1000), None);
        // Windows of at least 100 messages cannot pick the 2-ms burst alone.
        let wide = p.best_rate(100).unwrap();
        assert!(wide < best && (wide - 100.0 / 0.004).abs() < 1.0, "{wide}");
        // The whole run.
        assert!((p.best_rate(180).unwrap() - 180.0 / 0.012).abs() < 1.0);
    }

    #[test]
    fn pattern_differs_by_seed_slot_and_offset() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        pattern::fill(&mut a, 1, 0, 4099);
        assert_eq!(a.len(), 4099);
        pattern::fill(&mut b, 1, 1, 4099);
        assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 64);
        pattern::fill(&mut b, 2, 0, 4099);
        assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 64);
        pattern::fill(&mut b, 1, 0, 4099);
        assert_eq!(a, b);
        assert_eq!(pattern::first_difference(&a, &b), None);
        b[17] ^= 1;
        assert_eq!(pattern::first_difference(&a, &b), Some(17));
    }

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Shared(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn progress_is_one_line_rewritten_and_erased() {
        let buf = Shared::default();
        let mut p = Progress::to("t", 3, Some(Box::new(buf.clone())), Duration::ZERO);
        p.step(1, 2);
        let shown = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(
            shown.starts_with("\rt: 1/3 sizes done (last 2 B)"),
            "{shown:?}"
        );
        assert!(!shown.contains('\n'), "{shown:?}");
        p.clear();
        p.clear();
        let after = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(after, format!("{shown}\r\x1b[K"), "erased once");
        // Shown again, then erased on drop (a run that fails).
        p.step(2, 4);
        drop(p);
        let end = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(end.ends_with("\r\x1b[K") && end.contains("2/3"), "{end:?}");
        // Nowhere to write (not a terminal): nothing happens.
        let mut q = Progress::to("t", 3, None, Duration::ZERO);
        q.step(1, 2);
        q.clear();
    }

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

    #[test]
    fn tx_depth_covers_what_posters_leave_unsignaled() {
        assert_eq!(tx_depth_for(256, 80).unwrap(), 256);
        assert_eq!(tx_depth_for(16, 256).unwrap(), 512);
        assert_eq!(tx_depth_for(100, 10).unwrap(), 128);
        assert!(tx_depth_for(256, 40_000).is_err());
    }
}
