//! `gpu-test`: the GPU test suite, run on the GPU machine (which has no cargo: `cargo xtask gpu-test`
//! builds this binary and prints how to run it there).
//!
//! Output: one line per case, `PASS name (details)` or `FAIL name: error`, then exactly one summary
//! line `gpu-test: N passed, M failed`, then one line naming the GPU, driver and date. The exit status
//! is non-zero when a case failed or no GPU is present.
//!
//! Usage: `gpu-test [--list] [--ordinal N] [--backend soft|mlx5] [--in-process] [NAME...]` (names
//! select cases; default: all).
//!
//! Each case runs in a child process of its own (the same binary with `--child`), watched: a
//! case that has not reported after [`WATCHDOG`] (a kernel that outlived every budget, a hung
//! driver call) is killed and fails, and the suite goes on. `--in-process` runs the cases in
//! this process, one after the other, without the watchdog.
//!
//! Kernels: the library's `kernels/src/device_tests.cu` (in gpuverbs' embedded fatbin) and the
//! suite's own `crates/gpu-tests/kernels/` (the scope, GIN-style, per-QP error and counter
//! cases: built by this crate's build script and launched with `dataplane::launch_own`, so the
//! library's fatbin, which its users and the `gpuverbs` command embed, does not carry them).

use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use gpuverbs::cuda;

/// Per-run settings every case gets.
struct Ctx {
    ordinal: usize,
}

/// A named GPU test case; `Ok` carries the details printed after `PASS name`.
struct Case {
    name: &'static str,
    run: fn(&Ctx) -> Result<String>,
}

mod dataplane;
mod devmem;

use dataplane::{Mem, PutArgs, PutCase, RecvCase};
use gpuverbs::DoorbellMode::{Auto, BlueFlame, CpuProxy, GpuDoorbell, NoDbr, NoDbrEmulated};
use gpuverbs::RingPlacement::{self, Gpu as GpuRings, HostMapped};

macro_rules! put_cases {
    ($($name:ident: $mode:expr, grid $grid:expr, block $block:expr, scope $scope:expr, skip $skip:expr,
       size $size:expr, iters $iters:expr, signal $sig:expr, sq $sq:expr
       $(, mem $mem:expr, rings $rings:expr)?;)*) => {
        $(fn $name(ctx: &Ctx) -> Result<String> {
            #[allow(unused_mut, unused_assignments)]
            let (mut mem, mut rings) = (Mem::Host, HostMapped);
            $((mem, rings) = ($mem, $rings);)?
            dataplane::put_case(ctx.ordinal, &PutCase {
                mode: $mode,
                sq_blocks: $sq,
                args: PutArgs {
                    grid: $grid, block: $block, scope: $scope, skip_mod: $skip, size: $size,
                    iters: $iters, signal_every: $sig, budget_ns: dataplane::BUDGET_NS,
                },
                mem,
                rings,
            })
        })*
    };
}

put_cases! {
    put_thread_gpudb: GpuDoorbell, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256;
    put_thread_bf: BlueFlame, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256;
    put_warp_gpudb: GpuDoorbell, grid 2, block 64, scope 1, skip 0, size 128, iters 8, signal 1, sq 256;
    put_warp_partial_bf: BlueFlame, grid 2, block 64, scope 1, skip 3, size 128, iters 8, signal 1, sq 256;
    put_block_gpudb: GpuDoorbell, grid 3, block 96, scope 2, skip 0, size 32, iters 4, signal 1, sq 512;
    put_block_partial_gpudb: GpuDoorbell, grid 3, block 96, scope 2, skip 4, size 32, iters 4, signal 1, sq 512;
    put_many_ctas_shared: GpuDoorbell, grid 32, block 128, scope 0, skip 0, size 16, iters 4, signal 2, sq 256;
    put_thread_proxy: CpuProxy, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256;
    put_warp_partial_proxy: CpuProxy, grid 2, block 64, scope 1, skip 3, size 128, iters 8, signal 1, sq 256;
    put_block_proxy: CpuProxy, grid 3, block 96, scope 2, skip 0, size 32, iters 4, signal 1, sq 512;
    put_many_ctas_bf: BlueFlame, grid 32, block 128, scope 0, skip 0, size 16, iters 4, signal 2, sq 256;
    put_many_ctas_proxy: CpuProxy, grid 32, block 128, scope 0, skip 0, size 16, iters 4, signal 2, sq 256;
    // payload in GPU memory (registered device memory; the soft NIC copies with CUDA)
    put_gpumem_thread_gpudb: GpuDoorbell, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256, mem Mem::Gpu, rings HostMapped;
    put_gpumem_warp_partial_proxy: CpuProxy, grid 2, block 64, scope 1, skip 3, size 128, iters 8, signal 1, sq 256, mem Mem::Gpu, rings HostMapped;
    put_gpumem_block_bf: BlueFlame, grid 3, block 96, scope 2, skip 0, size 32, iters 4, signal 1, sq 512, mem Mem::Gpu, rings HostMapped;
    // SQ, RQ and CQ rings in GPU memory (descriptor ring_loc 1)
    put_gpurings_thread_gpudb: GpuDoorbell, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256, mem Mem::Host, rings GpuRings;
    put_gpurings_thread_proxy: CpuProxy, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256, mem Mem::Host, rings GpuRings;
    put_gpurings_warp_partial_bf: BlueFlame, grid 2, block 64, scope 1, skip 3, size 128, iters 8, signal 1, sq 256, mem Mem::Host, rings GpuRings;
    put_gpurings_block_gpudb: GpuDoorbell, grid 3, block 96, scope 2, skip 0, size 32, iters 4, signal 1, sq 512, mem Mem::Host, rings GpuRings;
    put_gpurings_many_ctas_gpudb: GpuDoorbell, grid 8, block 128, scope 0, skip 0, size 16, iters 2, signal 2, sq 256, mem Mem::Host, rings GpuRings;
    // RingPlacement::Auto: GPU rings on a ConnectX, host rings on the soft NIC
    put_autorings_thread_gpudb: GpuDoorbell, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256, mem Mem::Host, rings RingPlacement::Auto;
    put_autorings_warp_partial_bf: BlueFlame, grid 2, block 64, scope 1, skip 3, size 128, iters 8, signal 1, sq 256, mem Mem::Host, rings RingPlacement::Auto;
    // DoorbellMode::Auto: BlueFlame for GPU rings on the soft NIC, a GPU doorbell otherwise
    put_gpurings_warp_partial_autodb: Auto, grid 2, block 64, scope 1, skip 3, size 128, iters 8, signal 1, sq 256, mem Mem::Host, rings GpuRings;
    put_gpurings_thread_autodb: Auto, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256, mem Mem::Host, rings GpuRings;
    put_autorings_block_autodb: Auto, grid 3, block 96, scope 2, skip 0, size 32, iters 4, signal 1, sq 512, mem Mem::Host, rings RingPlacement::Auto;
    // both
    put_gpuall_thread_gpudb: GpuDoorbell, grid 4, block 64, scope 0, skip 0, size 64, iters 8, signal 4, sq 256, mem Mem::Gpu, rings GpuRings;
    put_gpuall_block_proxy: CpuProxy, grid 3, block 96, scope 2, skip 0, size 32, iters 4, signal 1, sq 512, mem Mem::Gpu, rings GpuRings;
}

fn private_qps_gpudb(ctx: &Ctx) -> Result<String> {
    dataplane::private_qps(ctx.ordinal, GpuDoorbell)
}
fn private_qps_proxy(ctx: &Ctx) -> Result<String> {
    dataplane::private_qps(ctx.ordinal, CpuProxy)
}
fn private_qps_bf(ctx: &Ctx) -> Result<String> {
    dataplane::private_qps(ctx.ordinal, BlueFlame)
}
fn recv_gpudb(ctx: &Ctx) -> Result<String> {
    dataplane::recv(ctx.ordinal, GpuDoorbell, HostMapped, RecvCase::Gather)
}
fn recv_proxy_gpurings(ctx: &Ctx) -> Result<String> {
    dataplane::recv(ctx.ordinal, CpuProxy, GpuRings, RecvCase::Gather)
}
fn recv_too_small_bf(ctx: &Ctx) -> Result<String> {
    dataplane::recv(ctx.ordinal, BlueFlame, HostMapped, RecvCase::TooSmall)
}
fn recv_inline_bf(ctx: &Ctx) -> Result<String> {
    dataplane::recv(ctx.ordinal, BlueFlame, HostMapped, RecvCase::InlineSends)
}
fn collapsed_cq(ctx: &Ctx) -> Result<String> {
    dataplane::collapsed_cq(ctx.ordinal)
}
fn exclusive_wrap(ctx: &Ctx) -> Result<String> {
    dataplane::exclusive_wrap(ctx.ordinal, GpuDoorbell, HostMapped)
}
fn poster_handover(ctx: &Ctx) -> Result<String> {
    dataplane::poster_handover(ctx.ordinal)
}
fn exclusive_wrap_bf(ctx: &Ctx) -> Result<String> {
    dataplane::exclusive_wrap(ctx.ordinal, BlueFlame, HostMapped)
}
fn exclusive_wrap_gpurings(ctx: &Ctx) -> Result<String> {
    dataplane::exclusive_wrap(ctx.ordinal, GpuDoorbell, GpuRings)
}

macro_rules! ops_cases {
    ($($name:ident: $mode:expr, $mem:expr, $rings:expr;)*) => {
        $(fn $name(ctx: &Ctx) -> Result<String> {
            dataplane::ops(ctx.ordinal, $mode, $mem, $rings)
        })*
    };
}

ops_cases! {
    ops_gpudb: GpuDoorbell, Mem::Host, HostMapped;
    ops_bf: BlueFlame, Mem::Host, HostMapped;
    ops_proxy: CpuProxy, Mem::Host, HostMapped;
    ops_gpumem_gpudb: GpuDoorbell, Mem::Gpu, HostMapped;
    ops_gpumem_proxy: CpuProxy, Mem::Gpu, HostMapped;
    ops_gpurings_gpudb: GpuDoorbell, Mem::Host, GpuRings;
    ops_gpurings_proxy: CpuProxy, Mem::Host, GpuRings;
    ops_gpuall_bf: BlueFlame, Mem::Gpu, GpuRings;
}

macro_rules! scopes_cases {
    ($($name:ident: $mode:expr, $mem:expr, $rings:expr, scope $scope:expr, skip $skip:expr;)*) => {
        $(fn $name(ctx: &Ctx) -> Result<String> {
            dataplane::scopes(ctx.ordinal, $mode, $mem, $rings, $scope, $skip)
        })*
    };
}

// signals, put-with-signal, get and the atomics at warp (1) and block (2) scope
scopes_cases! {
    scopes_warp_gpudb: GpuDoorbell, Mem::Host, HostMapped, scope 1, skip 0;
    scopes_warp_partial_bf: BlueFlame, Mem::Host, HostMapped, scope 1, skip 3;
    scopes_warp_partial_proxy: CpuProxy, Mem::Host, HostMapped, scope 1, skip 3;
    scopes_block_gpudb: GpuDoorbell, Mem::Host, HostMapped, scope 2, skip 0;
    scopes_block_partial_bf: BlueFlame, Mem::Host, HostMapped, scope 2, skip 4;
    scopes_block_partial_proxy: CpuProxy, Mem::Host, HostMapped, scope 2, skip 4;
    scopes_gpuall_warp_gpudb: GpuDoorbell, Mem::Gpu, GpuRings, scope 1, skip 3;
    scopes_gpuall_block_bf: BlueFlame, Mem::Gpu, GpuRings, scope 2, skip 0;
}

macro_rules! scope_waits_cases {
    ($($name:ident: $mode:expr, $mem:expr, $rings:expr, scope $scope:expr, skip $skip:expr;)*) => {
        $(fn $name(ctx: &Ctx) -> Result<String> {
            dataplane::scope_waits(ctx.ordinal, $mode, $mem, $rings, $scope, $skip)
        })*
    };
}

// flush and get_wait at warp (1) and block (2) scope
scope_waits_cases! {
    waits_warp_gpudb: GpuDoorbell, Mem::Host, HostMapped, scope 1, skip 0;
    waits_warp_partial_bf: BlueFlame, Mem::Host, HostMapped, scope 1, skip 3;
    waits_block_partial_proxy: CpuProxy, Mem::Host, HostMapped, scope 2, skip 4;
    waits_gpuall_warp_partial_proxy: CpuProxy, Mem::Gpu, GpuRings, scope 1, skip 5;
    waits_gpuall_block_gpudb: GpuDoorbell, Mem::Gpu, GpuRings, scope 2, skip 0;
}

macro_rules! gin_cases {
    ($($name:ident: $mode:expr, $mem:expr, $rings:expr;)*) => {
        $(fn $name(ctx: &Ctx) -> Result<String> {
            dataplane::gin(ctx.ordinal, $mode, $mem, $rings)
        })*
    };
}

// put_signal_set, put_value, get_wait, signal word read / wait / reset, flush, flush_all
gin_cases! {
    gin_gpudb: GpuDoorbell, Mem::Host, HostMapped;
    gin_bf: BlueFlame, Mem::Host, HostMapped;
    gin_proxy: CpuProxy, Mem::Host, HostMapped;
    gin_gpumem_gpudb: GpuDoorbell, Mem::Gpu, HostMapped;
    gin_gpuall_proxy: CpuProxy, Mem::Gpu, GpuRings;
}

macro_rules! counted_cases {
    ($($name:ident: $mode:expr, $mem:expr, $rings:expr, scope $scope:expr, skip $skip:expr;)*) => {
        $(fn $name(ctx: &Ctx) -> Result<String> {
            dataplane::counted(ctx.ordinal, $mode, $mem, $rings, $scope, $skip)
        })*
    };
}

// the counted calls (a local completion counter) at thread, warp and block scope
counted_cases! {
    counted_thread_gpudb: GpuDoorbell, Mem::Host, HostMapped, scope 0, skip 5;
    counted_warp_partial_bf: BlueFlame, Mem::Host, HostMapped, scope 1, skip 3;
    counted_block_proxy: CpuProxy, Mem::Host, HostMapped, scope 2, skip 0;
    counted_gpuall_warp_gpudb: GpuDoorbell, Mem::Gpu, GpuRings, scope 1, skip 0;
    counted_gpuall_block_bf: BlueFlame, Mem::Gpu, GpuRings, scope 2, skip 4;
}

macro_rules! nic_counter_cases {
    ($($name:ident: $mode:expr, $mem:expr, $rings:expr, scope $scope:expr, skip $skip:expr;)*) => {
        $(fn $name(ctx: &Ctx) -> Result<String> {
            dataplane::nic_counters(ctx.ordinal, $mode, $mem, $rings, $scope, $skip)
        })*
    };
}

// counters the NIC moves through a companion QP, at thread, warp and block scope
nic_counter_cases! {
    nic_counter_thread_gpudb: GpuDoorbell, Mem::Host, HostMapped, scope 0, skip 5;
    nic_counter_warp_partial_bf: BlueFlame, Mem::Host, HostMapped, scope 1, skip 3;
    nic_counter_block_proxy: CpuProxy, Mem::Host, HostMapped, scope 2, skip 0;
    nic_counter_gpuall_warp_gpudb: GpuDoorbell, Mem::Gpu, GpuRings, scope 1, skip 0;
    nic_counter_gpuall_block_partial_bf: BlueFlame, Mem::Gpu, GpuRings, scope 2, skip 4;
    // put_signal_counter_warp / _block (every warp and block case runs them beside the others)
    nic_counter_warp_gpudb: GpuDoorbell, Mem::Host, HostMapped, scope 1, skip 0;
    nic_counter_block_partial_gpudb: GpuDoorbell, Mem::Host, HostMapped, scope 2, skip 3;
}

fn nic_counter_error(ctx: &Ctx) -> Result<String> {
    dataplane::nic_counter_error(ctx.ordinal)
}

// NVIDIA's GPUNetIO put_counter beside gpuverbs' (built with GPUNETIO_SRC; else skipped)
fn gpunetio_counter(ctx: &Ctx) -> Result<String> {
    dataplane::gpunetio_counter(ctx.ordinal)
}

// the multi-QP doorbell: 2..4 QPs (modes mixed in one call) rung by one ring_multi
fn ring_multi_2_gpudb(ctx: &Ctx) -> Result<String> {
    dataplane::ring_multi(ctx.ordinal, &[GpuDoorbell; 2], Mem::Host, HostMapped)
}
fn ring_multi_3_bf(ctx: &Ctx) -> Result<String> {
    dataplane::ring_multi(ctx.ordinal, &[BlueFlame; 3], Mem::Host, HostMapped)
}
fn ring_multi_2_proxy(ctx: &Ctx) -> Result<String> {
    dataplane::ring_multi(ctx.ordinal, &[CpuProxy; 2], Mem::Host, HostMapped)
}
fn ring_multi_4_mixed(ctx: &Ctx) -> Result<String> {
    let modes = [GpuDoorbell, BlueFlame, CpuProxy, GpuDoorbell];
    dataplane::ring_multi(ctx.ordinal, &modes, Mem::Host, HostMapped)
}
fn ring_multi_gpuall_4_mixed(ctx: &Ctx) -> Result<String> {
    let modes = [GpuDoorbell, CpuProxy, GpuDoorbell, BlueFlame];
    dataplane::ring_multi(ctx.ordinal, &modes, Mem::Gpu, GpuRings)
}

// no-DBR QPs (a ConnectX-8's send_dbr_mode NO_DBR_EXT): their rings on the GPU (an rdma-core
// provider QP cannot be no-DBR), alone and in a ring_multi beside the other modes
fn put_nodbr_gpurings_thread(ctx: &Ctx) -> Result<String> {
    dataplane::put_no_dbr(ctx.ordinal, NoDbr, GpuRings, 0, 0)
}
fn put_nodbr_gpurings_warp_partial(ctx: &Ctx) -> Result<String> {
    dataplane::put_no_dbr(ctx.ordinal, NoDbr, GpuRings, 1, 3)
}
fn put_nodbr_gpurings_block(ctx: &Ctx) -> Result<String> {
    dataplane::put_no_dbr(ctx.ordinal, NoDbr, GpuRings, 2, 0)
}
fn ring_multi_gpuall_4_nodbr_mixed(ctx: &Ctx) -> Result<String> {
    let modes = [NoDbr, GpuDoorbell, NoDbr, CpuProxy];
    dataplane::ring_multi(ctx.ordinal, &modes, Mem::Gpu, GpuRings)
}

// emulated no-DBR QPs (GPUNetIO's NO_DBR_SW_EMULATED, for NICs without NO_DBR_EXT): ordinary
// QPs rung at their ordinary register without the record, a proxy thread keeping the record;
// host rings too (on mlx5 a provider QP may be one)
fn put_nodbr_emu_thread(ctx: &Ctx) -> Result<String> {
    dataplane::put_no_dbr(ctx.ordinal, NoDbrEmulated, HostMapped, 0, 0)
}
fn put_nodbr_emu_gpurings_thread(ctx: &Ctx) -> Result<String> {
    dataplane::put_no_dbr(ctx.ordinal, NoDbrEmulated, GpuRings, 0, 0)
}
fn put_nodbr_emu_gpurings_warp_partial(ctx: &Ctx) -> Result<String> {
    dataplane::put_no_dbr(ctx.ordinal, NoDbrEmulated, GpuRings, 1, 3)
}
fn put_nodbr_emu_gpurings_block(ctx: &Ctx) -> Result<String> {
    dataplane::put_no_dbr(ctx.ordinal, NoDbrEmulated, GpuRings, 2, 0)
}
fn ring_multi_gpuall_4_nodbr_emu_mixed(ctx: &Ctx) -> Result<String> {
    let modes = [NoDbrEmulated, GpuDoorbell, NoDbr, NoDbrEmulated];
    dataplane::ring_multi(ctx.ordinal, &modes, Mem::Gpu, GpuRings)
}

// NCCL GIN's rolling comparison of signals and counters (no traffic: the waits on words the
// host set across a wrap)
fn gin_rolling(ctx: &Ctx) -> Result<String> {
    dataplane::rolling(ctx.ordinal)
}

fn counter_error(ctx: &Ctx) -> Result<String> {
    dataplane::counter_error(ctx.ordinal)
}

fn dc_ops_gpudb(ctx: &Ctx) -> Result<String> {
    dataplane::dc_ops(ctx.ordinal, GpuDoorbell, Mem::Host, HostMapped)
}
fn dc_ops_proxy(ctx: &Ctx) -> Result<String> {
    dataplane::dc_ops(ctx.ordinal, CpuProxy, Mem::Host, HostMapped)
}
fn dc_ops_gpumem_gpudb(ctx: &Ctx) -> Result<String> {
    dataplane::dc_ops(ctx.ordinal, GpuDoorbell, Mem::Gpu, HostMapped)
}
fn dc_ops_gpurings_gpudb(ctx: &Ctx) -> Result<String> {
    dataplane::dc_ops(ctx.ordinal, GpuDoorbell, Mem::Host, GpuRings)
}

fn bad_rkey(ctx: &Ctx) -> Result<String> {
    dataplane::bad_rkey(ctx.ordinal, HostMapped)
}
fn bad_rkey_gpurings(ctx: &Ctx) -> Result<String> {
    dataplane::bad_rkey(ctx.ordinal, GpuRings)
}
fn recover_after_error(ctx: &Ctx) -> Result<String> {
    dataplane::recover_after_error(ctx.ordinal)
}
fn recover_in_place(ctx: &Ctx) -> Result<String> {
    dataplane::recover_in_place(ctx.ordinal)
}

fn roundtrip(ctx: &Ctx, mode: gpuverbs::DoorbellMode, rings: RingPlacement) -> Result<String> {
    devmem::gpumem_roundtrip(ctx.ordinal, mode, rings)
}
fn gpumem_roundtrip_gpudb(ctx: &Ctx) -> Result<String> {
    roundtrip(ctx, GpuDoorbell, HostMapped)
}
fn gpumem_roundtrip_proxy(ctx: &Ctx) -> Result<String> {
    roundtrip(ctx, CpuProxy, HostMapped)
}
fn gpumem_roundtrip_gpurings_gpudb(ctx: &Ctx) -> Result<String> {
    roundtrip(ctx, GpuDoorbell, GpuRings)
}
fn gpumem_roundtrip_gpurings_proxy(ctx: &Ctx) -> Result<String> {
    roundtrip(ctx, CpuProxy, GpuRings)
}
fn cpu_initiator_gpumem(ctx: &Ctx) -> Result<String> {
    devmem::cpu_initiator_gpumem(ctx.ordinal)
}
fn reg_cache_gpumem(ctx: &Ctx) -> Result<String> {
    devmem::reg_cache_gpumem(ctx.ordinal)
}
fn devmem_queued_runs(ctx: &Ctx) -> Result<String> {
    devmem::devmem_queued_runs(ctx.ordinal)
}
fn devmem_queued_copies(ctx: &Ctx) -> Result<String> {
    devmem::devmem_queued_copies(ctx.ordinal)
}
fn devmem_words(ctx: &Ctx) -> Result<String> {
    devmem::devmem_words(ctx.ordinal)
}
fn dropped_doorbell_timeout(ctx: &Ctx) -> Result<String> {
    dataplane::dropped_doorbell_timeout(ctx.ordinal)
}
fn wait_signal(ctx: &Ctx) -> Result<String> {
    dataplane::wait_signal(ctx.ordinal)
}

/// The descriptor carries the layout's version and size; an export for headers of another
/// version is refused with `Error::DescVersion` (and claims nothing: the QP's export stands).
fn export_header_version(ctx: &Ctx) -> Result<String> {
    use gpuverbs::export::{QpDesc, DESC_VERSION};
    let p = dataplane::Pair::new(ctx.ordinal, GpuDoorbell, 64, 16)?;
    let d = p.export.read()?;
    anyhow::ensure!(
        d.version == DESC_VERSION,
        "descriptor version {:#x}",
        d.version
    );
    anyhow::ensure!(
        d.size as usize == core::mem::size_of::<QpDesc>(),
        "size {}",
        d.size
    );
    match p.gpu.export_qp_for(&p.qb, DESC_VERSION ^ 0x10) {
        Err(gpuverbs::Error::DescVersion { header, library }) => {
            anyhow::ensure!(header == DESC_VERSION ^ 0x10 && library == DESC_VERSION);
        }
        Err(e) => anyhow::bail!("expected DescVersion, got {e}"),
        Ok(_) => anyhow::bail!("an export for headers of another version was made"),
    }
    // the refusal claimed nothing: QP B's poster is still free
    let ini = p.qb.try_cpu_initiator(gpuverbs::post::RingMode::RdmaCore)?;
    drop(ini);
    Ok(format!(
        "version {DESC_VERSION:#010x} and size {} in the descriptor; {:#010x} refused",
        d.size,
        DESC_VERSION ^ 0x10
    ))
}

fn status_paths(ctx: &Ctx) -> Result<String> {
    dataplane::status_paths(ctx.ordinal)
}

macro_rules! cases {
    ($($name:ident),* $(,)?) => { &[$(Case { name: stringify!($name), run: $name }),*] };
}

const CASES: &[Case] = cases![
    pipeline,
    put_thread_gpudb,
    put_thread_bf,
    put_warp_gpudb,
    put_warp_partial_bf,
    put_block_gpudb,
    put_block_partial_gpudb,
    put_many_ctas_shared,
    put_thread_proxy,
    put_warp_partial_proxy,
    put_block_proxy,
    put_many_ctas_bf,
    put_many_ctas_proxy,
    private_qps_gpudb,
    private_qps_proxy,
    private_qps_bf,
    collapsed_cq,
    recv_gpudb,
    recv_proxy_gpurings,
    recv_too_small_bf,
    recv_inline_bf,
    exclusive_wrap,
    exclusive_wrap_bf,
    poster_handover,
    ops_gpudb,
    ops_bf,
    ops_proxy,
    scopes_warp_gpudb,
    scopes_warp_partial_bf,
    scopes_warp_partial_proxy,
    scopes_block_gpudb,
    scopes_block_partial_bf,
    scopes_block_partial_proxy,
    gin_gpudb,
    gin_rolling,
    gin_bf,
    gin_proxy,
    counted_thread_gpudb,
    counted_warp_partial_bf,
    counted_block_proxy,
    counter_error,
    nic_counter_thread_gpudb,
    nic_counter_warp_partial_bf,
    nic_counter_block_proxy,
    nic_counter_error,
    nic_counter_warp_gpudb,
    nic_counter_block_partial_gpudb,
    gpunetio_counter,
    dc_ops_gpudb,
    dc_ops_proxy,
    dc_ops_gpumem_gpudb,
    dc_ops_gpurings_gpudb,
    bad_rkey,
    recover_after_error,
    recover_in_place,
    dropped_doorbell_timeout,
    wait_signal,
    status_paths,
    export_header_version,
    // GPU memory: regions, rings, both
    cpu_initiator_gpumem,
    reg_cache_gpumem,
    devmem_queued_runs,
    devmem_queued_copies,
    devmem_words,
    put_gpumem_thread_gpudb,
    put_gpumem_warp_partial_proxy,
    put_gpumem_block_bf,
    ops_gpumem_gpudb,
    ops_gpumem_proxy,
    gpumem_roundtrip_gpudb,
    gpumem_roundtrip_proxy,
    put_gpurings_thread_gpudb,
    put_gpurings_thread_proxy,
    put_gpurings_warp_partial_bf,
    put_gpurings_block_gpudb,
    put_gpurings_many_ctas_gpudb,
    exclusive_wrap_gpurings,
    ops_gpurings_gpudb,
    ops_gpurings_proxy,
    bad_rkey_gpurings,
    put_autorings_thread_gpudb,
    put_autorings_warp_partial_bf,
    put_gpurings_warp_partial_autodb,
    put_gpurings_thread_autodb,
    put_autorings_block_autodb,
    put_gpuall_thread_gpudb,
    put_gpuall_block_proxy,
    ops_gpuall_bf,
    scopes_gpuall_warp_gpudb,
    scopes_gpuall_block_bf,
    gin_gpumem_gpudb,
    gin_gpuall_proxy,
    ring_multi_2_gpudb,
    ring_multi_3_bf,
    ring_multi_2_proxy,
    ring_multi_4_mixed,
    ring_multi_gpuall_4_mixed,
    put_nodbr_gpurings_thread,
    put_nodbr_gpurings_warp_partial,
    put_nodbr_gpurings_block,
    ring_multi_gpuall_4_nodbr_mixed,
    put_nodbr_emu_thread,
    put_nodbr_emu_gpurings_thread,
    put_nodbr_emu_gpurings_warp_partial,
    put_nodbr_emu_gpurings_block,
    ring_multi_gpuall_4_nodbr_emu_mixed,
    waits_warp_gpudb,
    waits_warp_partial_bf,
    waits_block_partial_proxy,
    waits_gpuall_warp_partial_proxy,
    waits_gpuall_block_gpudb,
    counted_gpuall_warp_gpudb,
    counted_gpuall_block_bf,
    nic_counter_gpuall_warp_gpudb,
    nic_counter_gpuall_block_partial_bf,
    gpumem_roundtrip_gpurings_gpudb,
    gpumem_roundtrip_gpurings_proxy,
];

/// The embedded kernels load on this GPU, launch, and write exactly what the host expects.
fn pipeline(ctx: &Ctx) -> Result<String> {
    let report = cuda::pipeline_check(ctx.ordinal)?;
    Ok(report.to_string())
}

/// How long one case may run before the watchdog fails it.
const WATCHDOG: std::time::Duration = std::time::Duration::from_secs(120);

struct Args {
    list: bool,
    child: bool,
    in_process: bool,
    ordinal: usize,
    backend: dataplane::Backend,
    names: Vec<String>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        list: false,
        child: false,
        in_process: false,
        ordinal: 0,
        backend: dataplane::Backend::Soft,
        names: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--list" => args.list = true,
            "--child" => args.child = true,
            "--in-process" => args.in_process = true,
            "--ordinal" => {
                let v = it.next().context("--ordinal needs a value")?;
                args.ordinal = v.parse().with_context(|| format!("bad --ordinal {v:?}"))?;
            }
            "--backend" => {
                args.backend = match it.next().as_deref() {
                    Some("soft") => dataplane::Backend::Soft,
                    Some("mlx5") => dataplane::Backend::Mlx5,
                    v => bail!("--backend soft|mlx5, not {v:?}"),
                };
            }
            "-h" | "--help" => {
                println!(
                    "usage: gpu-test [--list] [--ordinal N] [--backend soft|mlx5] [NAME...]\n\
                     (--backend mlx5 drives mlx5_0 and mlx5_1 through rdma-core: run it under \
                     `gpuverbs emu --devices 2`)"
                );
                std::process::exit(0);
            }
            s if s.starts_with('-') => bail!("unknown option {s:?} (try --help)"),
            _ => args.names.push(arg),
        }
    }
    for name in &args.names {
        if !CASES.iter().any(|c| c.name == name) {
            let known: Vec<_> = CASES.iter().map(|c| c.name).collect();
            bail!("unknown case {name:?}; cases: {}", known.join(", "));
        }
    }
    Ok(args)
}

/// Runs one case here and returns its PASS / SKIP / FAIL line.
fn case_line(case: &Case, ctx: &Ctx) -> String {
    let start = Instant::now();
    match run_case(case, ctx) {
        Ok(details) => format!("PASS {} ({details}; {:.1?})", case.name, start.elapsed()),
        Err(e) if e.downcast_ref::<dataplane::Skip>().is_some() => {
            format!("SKIP {} ({e})", case.name)
        }
        Err(e) => format!("FAIL {}: {e:#}", case.name),
    }
}

/// Runs one case in a child process under the watchdog and returns its line.
fn watched(case: &Case, args: &Args) -> String {
    use std::io::Read as _;
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return format!("FAIL {}: cannot find this executable: {e}", case.name),
    };
    let backend = match args.backend {
        dataplane::Backend::Soft => "soft",
        dataplane::Backend::Mlx5 => "mlx5",
    };
    let child = std::process::Command::new(exe)
        .args([
            "--child",
            "--ordinal",
            &args.ordinal.to_string(),
            "--backend",
            backend,
        ])
        .arg(case.name)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return format!("FAIL {}: cannot start the case's process: {e}", case.name),
    };
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                if let Some(mut o) = child.stdout.take() {
                    let _ = o.read_to_string(&mut out);
                }
                return out
                    .lines()
                    .find(|l| {
                        let w = l
                            .split_whitespace()
                            .nth(1)
                            .unwrap_or("")
                            .trim_end_matches(':');
                        w == case.name
                            && (l.starts_with("PASS")
                                || l.starts_with("SKIP")
                                || l.starts_with("FAIL"))
                    })
                    .map(str::to_string)
                    .unwrap_or_else(|| {
                        format!(
                            "FAIL {}: the case's process ended ({status}) without a result",
                            case.name
                        )
                    });
            }
            Ok(None) if t0.elapsed() > WATCHDOG => {
                let _ = child.kill();
                let _ = child.wait();
                return format!(
                    "FAIL {}: watchdog: no result after {WATCHDOG:?} (a kernel outlived its budgets or a call hung); killed",
                    case.name
                );
            }
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(5)),
            Err(e) => return format!("FAIL {}: waiting for the case's process: {e}", case.name),
        }
    }
}

/// Runs one case, turning a panic into a failure.
fn run_case(case: &Case, ctx: &Ctx) -> Result<String> {
    match panic::catch_unwind(AssertUnwindSafe(|| (case.run)(ctx))) {
        Ok(result) => result,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            bail!("panicked: {msg}")
        }
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu-test: {e:#}");
            return ExitCode::from(2);
        }
    };
    if args.list {
        for c in CASES {
            println!("{}", c.name);
        }
        return ExitCode::SUCCESS;
    }

    let _ = dataplane::BACKEND.set(args.backend);
    let ctx = Ctx {
        ordinal: args.ordinal,
    };
    let selected = CASES
        .iter()
        .filter(|c| args.names.is_empty() || args.names.iter().any(|n| n == c.name));

    let (mut passed, mut failed, mut skipped) = (0usize, 0usize, 0usize);
    for case in selected {
        let line = if args.child || args.in_process {
            case_line(case, &ctx)
        } else {
            watched(case, &args)
        };
        println!("{line}");
        if args.child {
            // the parent reads this one line; the summary below is its job
            return ExitCode::SUCCESS;
        }
        match line.split_whitespace().next() {
            Some("PASS") => passed += 1,
            Some("SKIP") => skipped += 1,
            _ => failed += 1,
        }
    }

    // The GPU line: also decides whether a GPU is present at all.
    let gpu = cuda::device_info(args.ordinal);
    if skipped > 0 {
        println!("gpu-test: {passed} passed, {failed} failed, {skipped} skipped");
    } else {
        println!("gpu-test: {passed} passed, {failed} failed");
    }
    println!("backend: {:?}", args.backend);
    match &gpu {
        Ok(info) => println!("gpu: {info}; date {}", utc_now()),
        Err(e) => println!("gpu: none ({e}); date {}", utc_now()),
    }

    if failed == 0 && gpu.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ` (no date crate needed).
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day) (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn case_names_are_unique() {
        let mut names: Vec<_> = CASES.iter().map(|c| c.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CASES.len());
    }

    #[test]
    fn panicking_case_is_a_failure() {
        fn boom(_: &Ctx) -> Result<String> {
            panic!("boom")
        }
        let case = Case {
            name: "boom",
            run: boom,
        };
        let err = run_case(&case, &Ctx { ordinal: 0 }).unwrap_err();
        assert!(err.to_string().contains("boom"));
    }
}
