//! The backend the host-API tests run on: the chosen one (`DeviceRequest::Auto`). Here and in
//! CI's `cargo test` that is the soft NIC; under `gpuverbs emu --devices 2` (CI runs these
//! tests again that way) it is the mlx5 backend on `mlx5_0`, through the real libibverbs and
//! libmlx5, and the peer of a connection is on `mlx5_1`.
//!
//! A test that needs a soft-NIC-only feature asserts what the mlx5 backend documents instead
//! (an error, a refusal) where there is something to assert, and says on stderr what it
//! skipped ([`skipped_on_mlx5`]); it never passes silently.

#![allow(dead_code)] // each test binary uses its own part

use gpuverbs::device::BackendKind;
use gpuverbs::{Context, DeviceRequest, Error};

/// A context on the chosen backend (`DeviceRequest::Auto`: an rdma-core device when rdma-core
/// lists one, else a soft NIC).
pub fn open() -> Context {
    Context::open(DeviceRequest::Auto).expect("Context::open(Auto)")
}

/// A context for the other end of a connection, on the same backend as [`open`]: another soft
/// NIC, or on rdma-core `mlx5_1` (the second device of `gpuverbs emu --devices 2`) when it is
/// listed and is not the chosen device, else another context on the chosen device.
pub fn open_peer() -> Context {
    let first = open();
    if !is_mlx5(&first) {
        return first;
    }
    let second = "mlx5_1";
    if first.selection().name != second {
        match Context::open(DeviceRequest::Named(second.into())) {
            Ok(c) => return c,
            Err(Error::NoSuchDevice(_)) => {}
            Err(e) => panic!("Context::open({second}): {e}"),
        }
    }
    first
}

/// Whether `ctx` is on the mlx5 (rdma-core) backend.
pub fn is_mlx5(ctx: &Context) -> bool {
    ctx.selection().kind == BackendKind::Mlx5
}

/// On the mlx5 backend: prints `skipped on mlx5: <test>: <why>` and returns true, for the part
/// of a test that needs a soft-NIC-only feature (the caller has asserted, before, whatever the
/// mlx5 backend documents for it). On the soft NIC: false.
pub fn skipped_on_mlx5(ctx: &Context, test: &str, why: &str) -> bool {
    let skip = is_mlx5(ctx);
    if skip {
        eprintln!("skipped on mlx5: {test}: {why}");
    }
    skip
}
