//! Device-visible memory for rings, doorbell records and UAR pages.
//!
//! A [`DmaBuf`] is a page-aligned byte range that both the device (engine threads) and its
//! initiators (CPU threads, GPU kernels through a host mapping) read and write concurrently. All
//! access goes through raw pointers and atomics, never through `&mut [u8]`, because the other
//! side may be writing at any time — just as with a real NIC.
//!
//! A buffer is either host memory (owned, or allocated elsewhere and wrapped) or device memory
//! ([`DmaBuf::from_device`]): a GPU-resident ring that the engine reaches only through its
//! [`DeviceMemory`]. The fallible accessors ([`DmaBuf::try_read`], [`DmaBuf::try_write`],
//! [`DmaBuf::store_u32_release`], [`DmaBuf::load_u32_acquire`]) work on both and are what the
//! engine uses on rings; atomics and raw pointers exist for host memory only.

use crate::devmem::{DeviceMemory, DeviceMemoryError};
use std::alloc::Layout;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Owner of memory that was allocated elsewhere (e.g. CUDA pinned memory), kept alive with the
/// buffer.
pub trait ExternalMemory: Send + Sync {}
impl<T: Send + Sync> ExternalMemory for T {}

enum Backing {
    Owned(Layout),
    External(#[allow(dead_code)] Box<dyn ExternalMemory>),
    Device {
        mem: Arc<dyn DeviceMemory>,
        _owner: Box<dyn ExternalMemory>,
    },
}

/// A page-aligned, device-visible byte range, in host or device memory.
pub struct DmaBuf {
    /// Host address (host backings) or device address (device backing).
    addr: u64,
    len: usize,
    backing: Backing,
}

/// Alignment of every owned buffer.
pub const PAGE: usize = 4096;

impl DmaBuf {
    /// Allocates `len` zeroed bytes, page-aligned, in host memory. The length is rounded up to
    /// whole pages, so no two buffers share a page (each can be pinned or mapped on its own).
    ///
    /// # Panics
    /// When `len` rounded up to whole pages overflows or is not a valid allocation size.
    pub fn alloc(len: usize) -> Self {
        let Some(len) = len.max(1).checked_next_multiple_of(PAGE) else {
            panic!("DmaBuf::alloc({len}): larger than the address space");
        };
        let layout = Layout::from_size_align(len, PAGE).expect("buffer size overflows a Layout");
        // SAFETY: the layout has non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Self {
            addr: p as u64,
            len,
            backing: Backing::Owned(layout),
        }
    }

    /// Wraps memory allocated elsewhere (CUDA host-pinned memory, a mapped page).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be readable and writable host memory, 64-byte aligned, and nothing
    /// may hold a Rust reference into it. It must stay valid until `owner` is dropped, or, for
    /// a buffer given to a QP or CQ as a ring or doorbell record, until that object is
    /// destroyed (the soft NIC's `destroy_qp` / `destroy_cq`, or its device dropped): those
    /// return only when no device thread touches the object's memory again,
    /// which lets an owner that is not `owner` (a verbs provider's allocation) free it then,
    /// even while handles to the object live on.
    pub unsafe fn from_external(
        ptr: std::ptr::NonNull<u8>,
        len: usize,
        owner: Box<dyn ExternalMemory>,
    ) -> Self {
        Self {
            addr: ptr.as_ptr() as u64,
            len,
            backing: Backing::External(owner),
        }
    }

    /// Wraps device memory (e.g. a GPU allocation) at device address `addr`, reached only
    /// through `mem`; `owner` (the allocation) is kept alive with the buffer. The engine never
    /// dereferences `addr` on the host, so this is safe: a wrong address makes `mem` fail, and
    /// the failure becomes an error CQE.
    pub fn from_device(
        addr: u64,
        len: usize,
        mem: Arc<dyn DeviceMemory>,
        owner: Box<dyn ExternalMemory>,
    ) -> Self {
        Self {
            addr,
            len,
            backing: Backing::Device { mem, _owner: owner },
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

    /// Address of the first byte: a host address, or a device address for device memory.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The device memory the buffer lives in, `None` for host memory.
    pub fn device_memory(&self) -> Option<&Arc<dyn DeviceMemory>> {
        match &self.backing {
            Backing::Device { mem, .. } => Some(mem),
            _ => None,
        }
    }

    /// Whether the buffer is host memory (pointers and atomics allowed).
    pub fn is_host(&self) -> bool {
        self.device_memory().is_none()
    }

    fn host_only(&self, what: &str) {
        assert!(
            self.is_host(),
            "DmaBuf {:#x} is device memory: {what} needs host memory",
            self.addr
        );
    }

    /// Raw pointer to the first byte (host memory only).
    ///
    /// # Panics
    /// For a buffer in device memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.host_only("a host pointer");
        self.addr as *mut u8
    }

    fn check(&self, off: usize, n: usize) {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "DmaBuf access {off}+{n} beyond {}",
            self.len
        );
    }

    /// Starts loading the cache line at offset `off` of a host buffer (nothing for device
    /// memory): see [`prefetch`].
    pub fn prefetch(&self, off: usize) {
        if self.is_host() && off < self.len {
            prefetch(self.addr + off as u64, false);
        }
    }

    /// Copies `dst.len()` bytes from offset `off`, from host or device memory.
    ///
    /// # Panics
    /// Out of bounds (a bug of the caller).
    pub fn try_read(&self, off: usize, dst: &mut [u8]) -> Result<(), DeviceMemoryError> {
        self.check(off, dst.len());
        match &self.backing {
            Backing::Device { mem, .. } => mem.read(self.addr + off as u64, dst),
            _ => {
                // SAFETY: the range is inside the host buffer (checked); the source may be
                // concurrently written by an initiator, which is the DMA contract: we copy
                // whatever bytes are there.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (self.addr as *const u8).add(off),
                        dst.as_mut_ptr(),
                        dst.len(),
                    )
                };
                Ok(())
            }
        }
    }

    /// Copies `src` to offset `off`, in host or device memory.
    ///
    /// # Panics
    /// Out of bounds (a bug of the caller).
    pub fn try_write(&self, off: usize, src: &[u8]) -> Result<(), DeviceMemoryError> {
        self.check(off, src.len());
        match &self.backing {
            Backing::Device { mem, .. } => mem.write(self.addr + off as u64, src),
            _ => {
                // SAFETY: the range is inside the host buffer (checked) and `src` is a
                // distinct Rust slice.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        (self.addr as *mut u8).add(off),
                        src.len(),
                    )
                };
                Ok(())
            }
        }
    }

    /// Copies `dst.len()` bytes from offset `off`.
    ///
    /// # Panics
    /// Out of bounds, or when device memory fails (use [`DmaBuf::try_read`] where that can
    /// happen).
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        if let Err(e) = self.try_read(off, dst) {
            panic!("DmaBuf::read: {e}");
        }
    }

    /// Copies `src` to offset `off`.
    ///
    /// # Panics
    /// Out of bounds, or when device memory fails (use [`DmaBuf::try_write`]).
    pub fn write(&self, off: usize, src: &[u8]) {
        if let Err(e) = self.try_write(off, src) {
            panic!("DmaBuf::write: {e}");
        }
    }

    /// Fills `n` bytes at `off` with `byte`.
    ///
    /// # Panics
    /// Out of bounds, or when device memory fails.
    pub fn fill(&self, off: usize, n: usize, byte: u8) {
        self.check(off, n);
        if self.is_host() {
            // SAFETY: the range is inside the host buffer (checked).
            unsafe { std::ptr::write_bytes((self.addr as *mut u8).add(off), byte, n) }
        } else {
            self.write(off, &vec![byte; n]);
        }
    }

    /// Stores the 4-byte word at `off` (4-byte aligned) after every earlier store of this
    /// thread: a release store in host memory, a write that follows the earlier (completed)
    /// writes in device memory.
    pub fn store_u32_release(&self, off: usize, v: u32) -> Result<(), DeviceMemoryError> {
        match &self.backing {
            Backing::Device { .. } => {
                assert_eq!(off % 4, 0, "unaligned u32 at {off}");
                self.try_write(off, &v.to_ne_bytes())
            }
            _ => {
                self.atomic_u32(off).store(v, Ordering::Release);
                Ok(())
            }
        }
    }

    /// Writes `head` at `off`, then stores the 4-byte word `tail` at `tail_off` (4-byte
    /// aligned) after it, as [`DmaBuf::try_write`] and [`DmaBuf::store_u32_release`] would one
    /// after the other; in device memory both go to [`DeviceMemory::write_ordered`] (one
    /// round trip where the memory can queue them).
    pub fn write_then_release(
        &self,
        off: usize,
        head: &[u8],
        tail_off: usize,
        tail: u32,
    ) -> Result<(), DeviceMemoryError> {
        match &self.backing {
            Backing::Device { mem, .. } => {
                self.check(off, head.len());
                self.check(tail_off, 4);
                assert_eq!(tail_off % 4, 0, "unaligned u32 at {tail_off}");
                let tail = tail.to_ne_bytes();
                mem.write_ordered(&[
                    (self.addr + off as u64, head),
                    (self.addr + tail_off as u64, &tail),
                ])
            }
            _ => {
                self.try_write(off, head)?;
                self.store_u32_release(tail_off, tail)
            }
        }
    }

    /// Loads the 4-byte word at `off` (4-byte aligned) with acquire ordering (a completed read
    /// in device memory).
    pub fn load_u32_acquire(&self, off: usize) -> Result<u32, DeviceMemoryError> {
        match &self.backing {
            Backing::Device { .. } => {
                assert_eq!(off % 4, 0, "unaligned u32 at {off}");
                let mut b = [0u8; 4];
                self.try_read(off, &mut b)?;
                Ok(u32::from_ne_bytes(b))
            }
            _ => Ok(self.atomic_u32(off).load(Ordering::Acquire)),
        }
    }

    /// The 4-byte word at `off` (4-byte aligned) as an atomic (host memory only).
    ///
    /// # Panics
    /// Out of bounds, unaligned, or for a buffer in device memory.
    pub fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        self.host_only("an atomic");
        self.check(off, 4);
        assert_eq!(off % 4, 0, "unaligned atomic u32 at {off}");
        // SAFETY: host memory, in bounds and aligned (the base is at least 64-byte aligned);
        // AtomicU32 has the layout of u32 and all access to this word goes through atomics or
        // raw copies.
        unsafe { &*((self.addr as *const u8).add(off) as *const AtomicU32) }
    }

    /// The 8-byte word at `off` (8-byte aligned) as an atomic (host memory only).
    ///
    /// # Panics
    /// Out of bounds, unaligned, or for a buffer in device memory.
    pub fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        self.host_only("an atomic");
        self.check(off, 8);
        assert_eq!(off % 8, 0, "unaligned atomic u64 at {off}");
        // SAFETY: host memory, in bounds and aligned; see `atomic_u32`.
        unsafe { &*((self.addr as *const u8).add(off) as *const AtomicU64) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        if let Backing::Owned(layout) = self.backing {
            // SAFETY: allocated in `alloc` with exactly this layout.
            unsafe { std::alloc::dealloc(self.addr as *mut u8, layout) }
        }
    }
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_host() { "host" } else { "device" };
        write!(f, "DmaBuf({:#x}, {} bytes, {kind})", self.addr, self.len)
    }
}

/// Asks the CPU to start loading the cache line that holds host address `addr` (`write`: to
/// own it for a store), so that a later access does not wait for it. A hint: it reads and
/// writes nothing the program can see, and any address, one not mapped or not host memory
/// included, is allowed (the CPU drops what it cannot reach).
#[inline(always)]
pub fn prefetch(addr: u64, write: bool) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 and PREFETCHW raise no exception for any address and change no
    // memory or register (CPUs without PREFETCHW execute its encoding as a no-op).
    unsafe {
        if write {
            std::arch::asm!("prefetchw [{0}]", in(reg) addr, options(nostack, preserves_flags, readonly));
        } else {
            std::arch::asm!("prefetcht0 [{0}]", in(reg) addr, options(nostack, preserves_flags, readonly));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (addr, write);
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
    fn device_backed_buffers_go_through_the_trait() {
        let m = crate::devmem::SimDeviceMemory::new(8192);
        let b = DmaBuf::from_device(m.base() + 4096, 4096, m.clone(), Box::new(()));
        assert!(!b.is_host());
        b.try_write(8, b"ring").unwrap();
        assert_eq!(m.peek(m.base() + 4104, 4), b"ring");
        b.store_u32_release(60, 0xdead_beef).unwrap();
        assert_eq!(b.load_u32_acquire(60).unwrap(), 0xdead_beef);
        let mut x = [0u8; 4];
        b.try_read(8, &mut x).unwrap();
        assert_eq!(&x, b"ring");
        b.fill(0, 4, 7);
        assert_eq!(m.peek(m.base() + 4096, 4), [7; 4]);
        m.fail_range(m.base() + 4096, 1);
        assert!(b.try_read(0, &mut x).is_err());
        assert!(b.store_u32_release(0, 1).is_err());
        assert_eq!(m.counts().calls(), 7);
    }

    #[test]
    #[should_panic(expected = "device memory")]
    fn no_atomics_on_device_memory() {
        let m = crate::devmem::SimDeviceMemory::new(64);
        let b = DmaBuf::from_device(m.base(), 64, m, Box::new(()));
        b.atomic_u32(0);
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn out_of_bounds_is_caught() {
        // lengths round up to whole pages: straddle the real end
        let b = DmaBuf::alloc(64);
        b.write(b.len() - 4, &[0; 8]);
    }

    #[test]
    fn prefetch_takes_any_address() {
        // A hint never faults: not on null, unmapped, kernel-half or freed addresses.
        let freed = {
            let b = DmaBuf::alloc(4096);
            b.addr()
        };
        for a in [0, 8, freed, 0xffff_8000_0000_0000, u64::MAX] {
            prefetch(a, false);
            prefetch(a, true);
        }
        // and changes nothing
        let b = DmaBuf::alloc(128);
        b.write(0, &[7; 128]);
        b.prefetch(0);
        b.prefetch(64);
        b.prefetch(1 << 20); // past the end: ignored
        prefetch(b.addr(), true);
        let mut back = [0u8; 128];
        b.read(0, &mut back);
        assert_eq!(back, [7; 128]);
    }
}
