//! Host buffers: page-aligned, zeroed host memory that the device and, once mapped
//! ([`Gpu::map_host`]), a GPU can address.

use crate::cuda::CudaError;
use crate::gpu::Gpu;
use crate::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use verbs::DmaBuf;

/// Page-aligned host memory that the device (and, once mapped, a GPU) can address.
///
/// Its length is what was asked for; the allocation behind it is rounded up to whole pages
/// (at least one), so no two buffers share a page (each can be pinned or mapped on its own).
#[derive(Clone, Debug)]
pub struct HostBuffer {
    pub(crate) buf: Arc<DmaBuf>,
    len: usize,
    /// The allocation's serial number ([`HostBuffer::allocation_id`]).
    serial: u64,
}

/// Serial numbers of host allocations (0 is never used).
static NEXT_ALLOCATION: AtomicU64 = AtomicU64::new(1);

/// A page-aligned, zeroed host allocation, freed when the buffer that wraps it is dropped.
struct PageAlloc {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is plain host memory owned by this value; it is only freed in `drop`
// and every access goes through the `DmaBuf` that wraps it.
unsafe impl Send for PageAlloc {}
// SAFETY: as above; `&PageAlloc` gives no access to the memory.
unsafe impl Sync for PageAlloc {}

impl Drop for PageAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `HostBuffer::try_new` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes (`len()` is `len`; 0 is an empty buffer).
    ///
    /// # Panics
    /// When the allocator cannot serve `len` bytes (see [`HostBuffer::try_new`]), with a
    /// message that says so.
    pub fn new(len: usize) -> Self {
        match Self::try_new(len) {
            Ok(b) => b,
            Err(e) => panic!("HostBuffer::new({len}): {e}"),
        }
    }

    /// Allocates `len` zeroed bytes, or [`Error::HostAlloc`] when `len` rounded up to whole
    /// pages does not fit in the address space or the allocator has no memory for it.
    pub fn try_new(len: usize) -> Result<Self, Error> {
        use verbs::buffer::PAGE;
        let refuse = |reason| Error::HostAlloc { len, reason };
        let bytes = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| refuse("larger than the address space"))?;
        let layout = std::alloc::Layout::from_size_align(bytes, PAGE)
            .map_err(|_| refuse("larger than the largest allocation (isize::MAX bytes)"))?;
        // SAFETY: the layout has a non-zero size (at least one page).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(nn) = std::ptr::NonNull::new(ptr) else {
            return Err(refuse("the allocator has no memory for it"));
        };
        let owner = PageAlloc { ptr, layout };
        // SAFETY: `ptr..ptr+bytes` is a fresh, page-aligned, zeroed allocation owned by
        // `owner`, which the buffer keeps until it is dropped; nothing else refers to it.
        let buf = unsafe { DmaBuf::from_external(nn, bytes, Box::new(owner)) };
        Ok(Self::wrap(buf, len))
    }

    fn wrap(buf: DmaBuf, len: usize) -> Self {
        Self {
            buf: Arc::new(buf),
            len,
            serial: NEXT_ALLOCATION.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A new buffer over the memory of `other` (same address, a new allocation identity),
    /// which it keeps alive: what an allocator that hands freed memory out again does.
    #[cfg(test)]
    pub(crate) fn alias_of(other: &HostBuffer) -> Self {
        let nn = std::ptr::NonNull::new(other.addr() as *mut u8).expect("a live buffer");
        // SAFETY: `other`'s whole allocation (page-aligned, `other.buf.len()` bytes), kept
        // alive by the owner; the new buffer gives the same raw access `other` gives.
        let buf = unsafe { DmaBuf::from_external(nn, other.buf.len(), Box::new(other.clone())) };
        Self::wrap(buf, other.len)
    }

    /// The identity of the allocation behind this buffer: a serial number unique within the
    /// process and never reused, shared by the buffer's clones. A buffer allocated after
    /// another was freed has a new identity even when it gets the same address (the
    /// registration cache keys on it, [`Pd::register_cached`](crate::Pd::register_cached)).
    pub fn allocation_id(&self) -> u64 {
        self.serial
    }

    /// Host address of the first byte.
    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }
    /// Length in bytes (what was asked for).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn check(&self, what: &str, off: usize, n: usize) {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "HostBuffer::{what}: {off}+{n} is beyond its {} bytes",
            self.len
        );
    }
    /// Copies bytes out.
    ///
    /// # Panics
    /// When `off + dst.len()` is beyond `len()`.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.check("read", off, dst.len());
        self.buf.read(off, dst)
    }
    /// Copies bytes in.
    ///
    /// # Panics
    /// When `off + src.len()` is beyond `len()`.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check("write", off, src.len());
        self.buf.write(off, src)
    }
    /// Fills a range with one byte.
    ///
    /// # Panics
    /// When `off + n` is beyond `len()`.
    pub fn fill(&self, off: usize, n: usize, byte: u8) {
        self.check("fill", off, n);
        self.buf.fill(off, n, byte)
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v);
        v
    }
    /// The 8-byte word at `off` as an atomic (for signal words).
    ///
    /// # Panics
    /// When the word is beyond `len()` or `off` is not 8-byte aligned.
    pub fn atomic_u64(&self, off: usize) -> &std::sync::atomic::AtomicU64 {
        self.check("atomic_u64", off, 8);
        self.buf.atomic_u64(off)
    }
}

impl Gpu {
    /// Maps a host buffer (payload, signal words) into the GPU; returns its device address.
    pub fn map_host(&self, buf: &HostBuffer) -> Result<u64, CudaError> {
        self.map_buf(&buf.buf, buf.buf.clone())
    }
}
