//! The bench's options ([`Args`]): the doorbell ([`Ring`]), the tests to run ([`Test`]), and how
//! long a measurement lasts ([`Stop`]).

use clap::{Parser, ValueEnum};
use gpuverbs::post::RingMode;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Ring {
    /// DBREC, then the first 8 bytes of the last WQE to the register (alternating halves).
    RdmaCore,
    /// DBREC, then {BE32(pi << 8), BE32(qpn << 8)} to the register.
    Doca,
    /// DBREC, then the whole last WQE into the BlueFlame register.
    Bf,
}

impl Ring {
    pub(super) fn mode(self) -> RingMode {
        match self {
            Ring::RdmaCore => RingMode::RdmaCore,
            Ring::Doca => RingMode::Doca,
            Ring::Bf => RingMode::BlueFlame,
        }
    }
    pub(super) fn name(self) -> &'static str {
        match self {
            Ring::RdmaCore => "rdma-core",
            Ring::Doca => "doca",
            Ring::Bf => "bf",
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Soft NIC loopback benchmark (CPU initiator, host memory)")]
pub(super) struct Args {
    /// Doorbell convention of the initiator.
    #[arg(long, value_enum, default_value_t = Ring::RdmaCore)]
    pub(super) ring: Ring,
    /// WQEs posted per doorbell in the message-rate test.
    #[arg(long, default_value_t = 32)]
    pub(super) batch: u32,
    /// One WQE in this many asks for a CQE (selective signaling).
    #[arg(long, default_value_t = 64)]
    pub(super) signal: u32,
    /// SQ size in 64-byte blocks (one 8-byte write WQE is one block).
    #[arg(long, default_value_t = 1024)]
    pub(super) sq_blocks: u32,
    /// Carry the 8-byte payload inline in the WQE instead of gathering it through an lkey.
    #[arg(long)]
    pub(super) inline: bool,
    /// Message size of the bandwidth test.
    #[arg(long, default_value_t = 1 << 20)]
    pub(super) size: usize,
    /// Bandwidth-test writes in flight per round.
    #[arg(long, default_value_t = 8)]
    pub(super) depth: usize,
    /// Wall-clock seconds per measurement (warm-up and checks not counted in the result).
    #[arg(long, default_value_t = 2.0)]
    pub(super) seconds: f64,
    /// Timed operations per measurement instead of a duration (messages, or bandwidth writes).
    #[arg(long)]
    pub(super) iters: Option<u64>,
    /// Warm-up seconds before each measurement.
    #[arg(long, default_value_t = 0.3)]
    pub(super) warmup: f64,
    /// Which measurements to run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![Test::Rate, Test::Burst, Test::Bw, Test::Latency])]
    pub(super) tests: Vec<Test>,
    /// Samples per latency measurement.
    #[arg(long, default_value_t = 200)]
    pub(super) latency_samples: usize,
    /// One JSON object per measurement on stdout instead of a table.
    #[arg(long)]
    pub(super) json: bool,
    /// Make the first WQE of each test fail (fault injection), to show the abort path.
    #[arg(long)]
    pub(super) inject_fault: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Test {
    /// 8-byte write rate, SQ kept full.
    Rate,
    /// 8-byte write rate, SQ written first and rung once (engine only).
    Burst,
    /// Large-write bandwidth next to memcpy.
    Bw,
    /// Doorbell-to-CQE time of single 8-byte writes: engine spinning, engine asleep and woken
    /// by the initiator, engine asleep and finding the doorbell by polling (as a GPU's).
    Latency,
    /// CPU time of idle soft NICs (connected QPs, no traffic), per engine thread.
    Idle,
}

impl std::fmt::Display for Test {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Test::Rate => "rate",
            Test::Burst => "burst",
            Test::Bw => "bw",
            Test::Latency => "latency",
            Test::Idle => "idle",
        })
    }
}

/// When a measurement stops: after a duration or a number of operations.
#[derive(Clone, Copy)]
pub(super) enum Stop {
    After(Duration),
    Count(u64),
}

impl Stop {
    pub(super) fn done(self, start: Instant, ops: u64) -> bool {
        match self {
            Stop::After(d) => start.elapsed() >= d,
            Stop::Count(n) => ops >= n,
        }
    }
}
