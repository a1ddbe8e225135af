//! What the registration cache takes ([`CacheableMemory`]: host buffers and device memory),
//! the identity of an allocation (its key), and registering a range of it with the PD's
//! ordinary calls.

use crate::gpu::DeviceMem;
use crate::memory::{Access, HostBuffer, Keep, Mr, Pd};
use crate::Error;
use std::any::Any;
use std::sync::{Arc, Weak};

/// The identity of an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum AllocId {
    /// [`HostBuffer::allocation_id`].
    Host(u64),
    /// [`DeviceMem::buffer_id`].
    Cuda(u64),
    /// Test memory.
    #[cfg(test)]
    Sim(u64),
}

mod sealed {
    use super::{DeviceMem, HostBuffer};

    /// What a cacheable allocation is, for the cache.
    pub enum Source<'a> {
        Host(&'a HostBuffer),
        Device(&'a DeviceMem),
        #[cfg(test)]
        Sim(&'a SimAlloc),
    }

    /// Device memory without a GPU (tests): reached through `mem`, identified by `id`.
    #[cfg(test)]
    pub struct SimAlloc {
        pub mem: std::sync::Arc<dyn verbs::devmem::DeviceMemory>,
        pub base: u64,
        pub len: u64,
        pub id: u64,
    }

    pub trait Sealed {
        fn source(&self) -> Source<'_>;
    }
}

#[cfg(test)]
pub(super) use sealed::SimAlloc;
pub(super) use sealed::Source;

/// Memory the registration cache takes: [`HostBuffer`] and [`DeviceMem`] (sealed).
pub trait CacheableMemory: sealed::Sealed {}

impl sealed::Sealed for HostBuffer {
    fn source(&self) -> Source<'_> {
        Source::Host(self)
    }
}
impl CacheableMemory for HostBuffer {}

impl sealed::Sealed for DeviceMem {
    fn source(&self) -> Source<'_> {
        Source::Device(self)
    }
}
impl CacheableMemory for DeviceMem {}

#[cfg(test)]
impl sealed::Sealed for SimAlloc {
    fn source(&self) -> Source<'_> {
        Source::Sim(self)
    }
}
#[cfg(test)]
impl CacheableMemory for SimAlloc {}

/// What a source is: its identity, its bytes, and what tells whether anyone still holds it.
pub(super) struct Resolved {
    pub(super) id: AllocId,
    pub(super) base: u64,
    pub(super) len: u64,
    pub(super) owner: Option<Weak<dyn Any + Send + Sync>>,
}

pub(super) fn resolve(src: &Source<'_>) -> Result<Resolved, Error> {
    Ok(match src {
        Source::Host(b) => {
            let owner: Weak<dyn Any + Send + Sync> = Arc::downgrade(&b.buf) as _;
            Resolved {
                id: AllocId::Host(b.allocation_id()),
                base: b.addr(),
                len: b.len() as u64,
                owner: Some(owner),
            }
        }
        Source::Device(m) => {
            let owner: Weak<dyn Any + Send + Sync> = m.downgrade() as _;
            Resolved {
                id: AllocId::Cuda(m.buffer_id()?),
                base: m.ptr(),
                len: m.len() as u64,
                owner: Some(owner),
            }
        }
        #[cfg(test)]
        Source::Sim(s) => Resolved {
            id: AllocId::Sim(s.id),
            base: s.base,
            len: s.len,
            owner: None,
        },
    })
}

/// Registers `off..off+len` of `src` with the PD's ordinary calls.
pub(super) fn register(
    pd: &Pd,
    src: &Source<'_>,
    off: u64,
    len: u64,
    access: Access,
) -> Result<Mr, Error> {
    match src {
        Source::Host(b) if off == 0 && len == b.len() as u64 => pd.register_with(b, access),
        Source::Host(b) => pd.register_host_range(b, off, len, access),
        Source::Device(m) if off == 0 && len == m.len() as u64 => pd.register_device_mem(m, access),
        Source::Device(m) => pd.register_on_gpu(
            m.gpu(),
            m.ptr() + off,
            len,
            access,
            Keep::Device((*m).clone()),
        ),
        #[cfg(test)]
        Source::Sim(s) => {
            pd.register_device(s.mem.clone(), s.base + off, len, access, Keep::Nothing)
        }
    }
}
