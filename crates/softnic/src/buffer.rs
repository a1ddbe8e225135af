//! Device-visible memory for rings, doorbell records and UAR pages.
//!
//! A [`DmaBuf`] is a page-aligned byte range that both the device (engine threads) and its
//! initiators (CPU threads, GPU kernels through a host mapping) read and write concurrently. All
//! access goes through raw pointers and atomics, never through `&mut [u8]`, because the other
//! side may be writing at any time — just as with a real NIC.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// Owner of memory that was allocated elsewhere (e.g. CUDA pinned memory), kept alive with the
/// buffer.
pub trait ExternalMemory: Send + Sync {}
impl<T: Send + Sync> ExternalMemory for T {}

enum Backing {
    Owned(Layout),
    External(#[allow(dead_code)] Box<dyn ExternalMemory>),
}

/// A page-aligned, device-visible byte range.
pub struct DmaBuf {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: the buffer is plain memory shared with the device; every accessor is either atomic or
// a raw copy whose racing is part of the device contract (as with DMA), never a Rust reference.
unsafe impl Send for DmaBuf {}
// SAFETY: as above; no method hands out `&mut` to the contents.
unsafe impl Sync for DmaBuf {}

/// Alignment of every owned buffer.
pub const PAGE: usize = 4096;

impl DmaBuf {
    /// Allocates `len` zeroed bytes, page-aligned, in host memory. The length is rounded up to
    /// whole pages, so no two buffers share a page (each can be pinned or mapped on its own).
    pub fn alloc(len: usize) -> Self {
        let len = len.max(1).next_multiple_of(PAGE);
        let layout = Layout::from_size_align(len, PAGE).expect("buffer size overflows a Layout");
        // SAFETY: the layout has non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self {
            ptr,
            len,
            backing: Backing::Owned(layout),
        }
    }

    /// Wraps memory allocated elsewhere (CUDA host-pinned memory, a mapped page).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be readable and writable host memory, 64-byte aligned, that stays
    /// valid until `owner` is dropped, and nothing may hold a Rust reference into it.
    pub unsafe fn from_external(
        ptr: NonNull<u8>,
        len: usize,
        owner: Box<dyn ExternalMemory>,
    ) -> Self {
        Self {
            ptr,
            len,
            backing: Backing::External(owner),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never, for owned buffers).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, off: usize, n: usize) {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "DmaBuf access {off}+{n} beyond {}",
            self.len
        );
    }

    /// Copies `dst.len()` bytes from offset `off`.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len());
        // SAFETY: the range is inside the buffer (checked); the source may be concurrently
        // written by an initiator, which is the DMA contract: we copy whatever bytes are there.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }

    /// Copies `src` to offset `off`.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check(off, src.len());
        // SAFETY: the range is inside the buffer (checked) and `src` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
        }
    }

    /// Fills `n` bytes at `off` with `byte`.
    pub fn fill(&self, off: usize, n: usize, byte: u8) {
        self.check(off, n);
        // SAFETY: the range is inside the buffer (checked).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(off), byte, n) }
    }

    /// The 4-byte word at `off` (4-byte aligned) as an atomic.
    pub fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        self.check(off, 4);
        assert_eq!(off % 4, 0, "unaligned atomic u32 at {off}");
        // SAFETY: in bounds and aligned (the base is at least 64-byte aligned); AtomicU32 has
        // the layout of u32 and all access to this word goes through atomics or raw copies.
        unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU32) }
    }

    /// The 8-byte word at `off` (8-byte aligned) as an atomic.
    pub fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8);
        assert_eq!(off % 8, 0, "unaligned atomic u64 at {off}");
        // SAFETY: in bounds and aligned; see `atomic_u32`.
        unsafe { &*(self.ptr.as_ptr().add(off) as *const AtomicU64) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        if let Backing::Owned(layout) = self.backing {
            // SAFETY: allocated in `alloc` with exactly this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DmaBuf({:#x}, {} bytes)", self.addr(), self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn alloc_is_zeroed_aligned_and_usable() {
        let b = DmaBuf::alloc(8192);
        assert_eq!(b.addr() % PAGE as u64, 0);
        let mut x = [1u8; 16];
        b.read(100, &mut x);
        assert_eq!(x, [0; 16]);
        b.write(8, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            b.atomic_u64(8).load(Ordering::Relaxed),
            u64::from_ne_bytes([1, 2, 3, 4, 5, 6, 7, 8])
        );
        b.atomic_u32(16).store(7, Ordering::Relaxed);
        b.read(16, &mut x[..4]);
        assert_eq!(&x[..4], &7u32.to_ne_bytes());
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn out_of_bounds_is_caught() {
        // lengths round up to whole pages: straddle the real end
        let b = DmaBuf::alloc(64);
        b.write(b.len() - 4, &[0; 8]);
    }
}
