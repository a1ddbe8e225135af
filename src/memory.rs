//! Protection domains, host buffers and memory regions.
//!
//! Regions hold their PD (and so the device) alive; a region keeps its buffer alive, and its
//! drop deregisters it, waiting for any device copy in flight (the device never touches freed
//! memory). Access rights default to the minimum: local write only; remote rights only when
//! asked.

use crate::device::{Backend, Context};
use crate::Error;
use softnic::DmaBuf;
use std::sync::Arc;

pub use softnic::Access;

/// A protection domain.
#[derive(Clone, Debug)]
pub struct Pd {
    pub(crate) ctx: Context,
    pub(crate) id: softnic::PdId,
}

impl Context {
    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Pd {
        let id = match &self.inner.backend {
            Backend::Soft(d) => d.alloc_pd(),
        };
        Pd {
            ctx: self.clone(),
            id,
        }
    }
}

/// Page-aligned host memory that the device (and, once mapped, a GPU) can address.
#[derive(Clone, Debug)]
pub struct HostBuffer {
    pub(crate) buf: Arc<DmaBuf>,
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes.
    pub fn new(len: usize) -> Self {
        Self {
            buf: Arc::new(DmaBuf::alloc(len)),
        }
    }
    /// Host address of the first byte.
    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    /// Copies bytes out.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.buf.read(off, dst)
    }
    /// Copies bytes in.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.buf.write(off, src)
    }
    /// Fills a range with one byte.
    pub fn fill(&self, off: usize, n: usize, byte: u8) {
        self.buf.fill(off, n, byte)
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v);
        v
    }
    /// The 8-byte word at `off` as an atomic (for signal words).
    pub fn atomic_u64(&self, off: usize) -> &std::sync::atomic::AtomicU64 {
        self.buf.atomic_u64(off)
    }
}

/// A registered memory region.
#[derive(Debug)]
pub struct Mr {
    pd: Pd,
    info: softnic::MrInfo,
    _buf: Option<HostBuffer>,
}

impl Mr {
    /// The local key.
    pub fn lkey(&self) -> prm::Lkey {
        prm::Lkey(self.info.key)
    }
    /// The remote key (a capability: hand it out only on purpose).
    pub fn rkey(&self) -> prm::Rkey {
        prm::Rkey(self.info.key)
    }
    /// First byte.
    pub fn addr(&self) -> u64 {
        self.info.addr
    }
    /// Length.
    pub fn len(&self) -> u64 {
        self.info.len
    }
    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }
    /// Rights.
    pub fn access(&self) -> Access {
        self.info.access
    }
    /// An SGE over `off..off+len` of this region.
    pub fn sge(&self, off: u64, len: u32) -> prm::Sge {
        prm::Sge {
            addr: self.info.addr + off,
            len,
            lkey: self.lkey(),
        }
    }
    /// The remote address of `off` in this region, with its rkey.
    pub fn remote(&self, off: u64) -> prm::RemoteAddr {
        prm::RemoteAddr {
            addr: self.info.addr + off,
            rkey: self.rkey(),
        }
    }
}

impl Pd {
    /// Registers a host buffer with local write access only.
    pub fn register(&self, buf: &HostBuffer) -> Result<Mr, Error> {
        self.register_with(buf, Access::LOCAL_WRITE)
    }

    /// Registers a host buffer with the given rights.
    pub fn register_with(&self, buf: &HostBuffer, access: Access) -> Result<Mr, Error> {
        // SAFETY: the region keeps a clone of the buffer, so the memory outlives the
        // registration (which ends in `Mr::drop`).
        let mut mr = unsafe { self.register_raw(buf.addr(), buf.len() as u64, access)? };
        mr._buf = Some(buf.clone());
        Ok(mr)
    }

    /// Registers raw host memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid host memory until the returned region is dropped.
    pub unsafe fn register_raw(&self, addr: u64, len: u64, access: Access) -> Result<Mr, Error> {
        let info = match &self.ctx.inner.backend {
            // SAFETY: forwarded contract.
            Backend::Soft(d) => unsafe { d.reg_host(self.id, addr, len, access)? },
        };
        Ok(Mr {
            pd: self.clone(),
            info,
            _buf: None,
        })
    }

    /// Registers GPU memory (a device pointer and length).
    pub fn register_gpu(&self, _dptr: u64, _len: u64, _access: Access) -> Result<Mr, Error> {
        match &self.ctx.inner.backend {
            Backend::Soft(_) => Err(Error::Unsupported(
                "the soft NIC registers host memory only; use a HostBuffer mapped into the GPU"
                    .into(),
            )),
        }
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        match &self.pd.ctx.inner.backend {
            Backend::Soft(d) => {
                if let Err(e) = d.dereg(self.info.key) {
                    tracing::warn!(key = self.info.key, error = %e, "deregistration failed");
                }
            }
        }
    }
}
