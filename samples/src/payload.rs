//! Payload buffers in host or GPU memory ([`Payload`]).

use crate::args::Placement;
use anyhow::{bail, Context as _, Result};
use gpuverbs::gpu::{DeviceMem, Gpu};
use gpuverbs::{Access, Pd};
use std::sync::Arc;

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
