//! Code shared by the perftest-style samples: `put_bw`, `read_bw`, `send_bw`, `atomic_bw`
//! (bandwidth: [`bw`]) and `write_lat`, `read_lat`, `send_lat`, `atomic_lat` (latency:
//! [`lat`]), each binary one call of its harness with its [`bw::Verb`].
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
//!
//! One module per job; every public item is also re-exported at the crate root
//! (`gpuverbs_samples::CommonArgs` and `gpuverbs_samples::args::CommonArgs` are the same item):
//!
//! - [`bw`]: the bandwidth harness (ib_write_bw, ib_read_bw, ib_send_bw, ib_atomic_bw).
//! - [`lat`]: the latency harness (ib_write_lat, ib_read_lat, ib_send_lat, ib_atomic_lat).
//! - [`args`]: the command-line options and their parsers.
//! - [`env`](mod@env): the device, the GPU and the initiator of a run, and the checks on them.
//! - [`payload`]: payload buffers in host or GPU memory.
//! - [`qp`]: making and connecting QPs, the SQ size, the doorbell.
//! - [`pcap`]: `--pcap`, the capture of the soft NIC.
//! - [`peer`]: the server/client roles (bootstrap, exchange, steps) and their header and JSON.
//! - [`wire`]: the soft NIC's wire counters.
//! - [`report`]: the header, table rows, JSON fields, error text and exit code.
//! - [`resolved`]: what a run resolved to ([`Env`]: device, GPU, initiator), below `env` and
//!   `report`.
//! - [`stats`]: bandwidth units, peak rate, latency columns, the progress line.
//! - [`pattern`]: the payload pattern and its checks.
//! - [`cpu`]: other processes' CPU around a run.
//! - [`gpu`]: what the sample kernels are given, and their status.

pub mod args;
pub mod bw;
pub mod cpu;
pub mod env;
pub mod gpu;
pub mod lat;
pub mod pattern;
pub mod payload;
pub mod pcap;
pub mod peer;
pub mod qp;
pub mod report;
pub mod resolved;
pub mod stats;
pub mod wire;

pub use args::{
    device_request, parse_loss, parse_size, CommonArgs, DbArg, Initiator, OutputArg, Placement,
    RingsArg, Role, RoleArgs, ALL_SIZES, DEFAULT_PORT, DEFAULT_TIMEOUT_S, MAX_SIZE, MAX_TX_DEPTH,
};
pub use cpu::{CpuSample, OtherCpu, UserIdle, OTHER_CPU_HIGH};
pub use env::{
    check_placement, local_ip_towards, open_env, open_env_remote, soft_nic_options, Env,
};
pub use gpu::{arg, upload, BwJob, Exports, GpuStatus, LatSide};
pub use payload::Payload;
pub use pcap::{start_pcap, Pcap};
pub use peer::{remote_header, remote_json, step, Hello, Peer, STEP_WAIT_FACTOR};
pub use qp::{
    connect_mtu, connect_options, connect_pair, cpu_doorbell_reason, cpu_ring_mode, create_qp,
    create_qp_rq, doorbell_line, doorbell_name, tx_depth_for, with_mtu, QpSpec,
};
pub use report::{
    address_lines, address_lines_of, common_header, common_json, error_text, exit_with, merge,
    mtu_line, output_number, table_row, AddrFormat, Header, EXIT_FAILURE, RULE,
};
pub use stats::{LatStats, Peak, Progress, Units};
pub use wire::{wire_counters, wire_delta};
