//! Device memory (GPU memory) behind a trait.
//!
//! The soft NIC is a host program: it can dereference host addresses, never a GPU's. Memory
//! regions and rings that live in device memory carry an [`DeviceMemory`] object, supplied by
//! whoever registered them (gpuverbs implements it with CUDA copies), and every byte the engine
//! moves to or from such memory goes through it. The crate itself knows nothing of CUDA.
//!
//! [`SimDeviceMemory`] is a simulated device memory (host bytes behind the trait, at addresses
//! that are not host addresses, with call counters and injectable failures) for tests.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A device-memory access that failed (a driver error, an address the memory does not hold).
/// The engine turns it into an error CQE, never a panic.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("device memory: {0}")]
pub struct DeviceMemoryError(pub String);

/// A part of a [`DeviceMemory::read_many`] that failed: the parts before it were read, it and
/// the parts after it hold no meaningful bytes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("part {part} of a batched read: {error}")]
pub struct ReadManyError {
    /// Index of the part that failed.
    pub part: usize,
    /// Why it failed.
    #[source]
    pub error: DeviceMemoryError,
}

/// Largest bounce buffer the provided methods (and the engine) use at once.
pub const BOUNCE: usize = 1 << 20;

/// Access to one kind of device memory by device address.
///
/// Contract, for every method but [`DeviceMemory::write_queued`] and
/// [`DeviceMemory::copy_queued`]:
/// - it is complete when it returns: written bytes are in device memory, where any later
///   access (a kernel's load, a later call from any thread) sees them, and read bytes are what
///   device memory held at some point during the call;
/// - calls made one after the other take effect in that order (the engine relies on it to write
///   a CQE's first 60 bytes before its last 4, as two calls);
/// - it never panics on a bad address or a driver failure: it returns the error.
///
/// Implementations may be called from any thread (the device's engine thread, its wire I/O
/// thread); a CUDA implementation binds its context to the calling thread first.
pub trait DeviceMemory: Send + Sync {
    /// Copies `dst.len()` bytes from device address `src` into `dst`.
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceMemoryError>;

    /// Copies `src` to device address `dst`.
    fn write(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError>;

    /// Copies `len` bytes from device address `src` to device address `dst` of this same
    /// memory. The soft NIC never calls it with overlapping ranges (it bounces those through
    /// the host).
    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError>;

    /// Queues a copy of `src` to device address `dst`: unlike every other method it need not
    /// be complete on return. It is complete once any later call on this memory other than
    /// `write_queued` or `copy_queued` returns (that call waits for it first),
    /// [`DeviceMemory::settle`] included, and takes effect before it. A queued write that
    /// fails after returning makes that later call fail, and every call after it. The
    /// provided version writes at once.
    fn write_queued(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        self.write(dst, src)
    }

    /// Queues a copy of `len` bytes from device address `src` to device address `dst` of this
    /// same memory (never overlapping, as for [`DeviceMemory::copy`]): the device-to-device
    /// counterpart of [`DeviceMemory::write_queued`], under the same contract. It need not be
    /// complete on return; it is complete once any later call on this memory other than
    /// `write_queued` or `copy_queued` returns, [`DeviceMemory::settle`] included, and takes
    /// effect in call order with the queued writes (a queued copy whose source a queued write
    /// wrote before it reads those bytes). One that fails after returning makes that later
    /// call fail, and every call after it. The provided version copies at once
    /// ([`DeviceMemory::copy`]).
    fn copy_queued(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        self.copy(dst, src, len)
    }

    /// Completes every queued write and copy ([`DeviceMemory::write_queued`],
    /// [`DeviceMemory::copy_queued`]); a failure among them is returned here.
    fn settle(&self) -> Result<(), DeviceMemoryError> {
        Ok(())
    }

    /// Writes each `(device address, bytes)` part in turn, complete on return: a reader that
    /// sees any byte of a later part sees every earlier part (a CQE's body, then the word
    /// holding its owner bit). The provided version makes one [`DeviceMemory::write`] per
    /// part; an implementation may queue them in order and wait once.
    fn write_ordered(&self, parts: &[(u64, &[u8])]) -> Result<(), DeviceMemoryError> {
        parts
            .iter()
            .try_for_each(|&(dst, src)| self.write(dst, src))
    }

    /// Reads each `(device address, buffer)` part, complete on return (each part's bytes are
    /// what device memory held at some point during the call). On a failure the error names
    /// the first part that failed; every part before it was read, the others hold nothing
    /// meaningful. The provided version makes one [`DeviceMemory::read`] per part; an
    /// implementation may queue them all and wait once (one round trip for many small reads).
    fn read_many(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), ReadManyError> {
        for (part, (src, dst)) in parts.iter_mut().enumerate() {
            self.read(*src, dst)
                .map_err(|error| ReadManyError { part, error })?;
        }
        Ok(())
    }

    /// Copies `len` bytes from device address `src` to host memory at `dst`. The provided
    /// version bounces through a host buffer and [`DeviceMemory::read`]; an implementation may
    /// copy directly (one copy less).
    ///
    /// # Safety
    /// `dst..dst+len` must be host memory writable for the duration of the call, covered by no
    /// Rust reference (other agents may access it concurrently, as with DMA).
    unsafe fn read_to_host(
        &self,
        src: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), DeviceMemoryError> {
        let mut buf = vec![0u8; len.min(BOUNCE)];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(BOUNCE);
            self.read(src + done as u64, &mut buf[..n])?;
            // SAFETY: `dst + done .. + n` lies inside the caller's writable range; `buf` is ours.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), dst.add(done), n) };
            done += n;
        }
        Ok(())
    }

    /// Copies `len` bytes from host memory at `src` to device address `dst`. The provided
    /// version bounces through a host buffer and [`DeviceMemory::write`].
    ///
    /// # Safety
    /// `src..src+len` must be host memory readable for the duration of the call, covered by no
    /// `&mut` reference.
    unsafe fn write_from_host(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceMemoryError> {
        let mut buf = vec![0u8; len.min(BOUNCE)];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(BOUNCE);
            // SAFETY: `src + done .. + n` lies inside the caller's readable range; `buf` is ours.
            unsafe { std::ptr::copy_nonoverlapping(src.add(done), buf.as_mut_ptr(), n) };
            self.write(dst + done as u64, &buf[..n])?;
            done += n;
        }
        Ok(())
    }
}

/// Whether two device memories are the same object (so [`DeviceMemory::copy`] may move bytes
/// between them).
pub fn same_memory(a: &Arc<dyn DeviceMemory>, b: &Arc<dyn DeviceMemory>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Calls a [`SimDeviceMemory`] has served (failed ones included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounts {
    /// `read` calls (the provided `read_to_host` makes one per bounce chunk), and `read_many`
    /// calls, each counted once whatever its parts (one wait).
    pub reads: u64,
    /// `write` calls.
    pub writes: u64,
    /// `copy` calls.
    pub copies: u64,
    /// Bytes read, written or copied.
    pub bytes: u64,
}

impl SimCounts {
    /// Every call.
    pub fn calls(&self) -> u64 {
        self.reads + self.writes + self.copies
    }
}

/// A simulated device memory for tests: `len` host bytes behind [`DeviceMemory`], at device
/// addresses `base()..base()+len` that are *not* host addresses (non-canonical on x86-64 and
/// AArch64), so any path that dereferenced them on the host would fault instead of passing.
/// It counts calls and fails, on demand, every access that touches a chosen range.
pub struct SimDeviceMemory {
    base: u64,
    bytes: Mutex<Vec<u8>>,
    reads: AtomicU64,
    writes: AtomicU64,
    copies: AtomicU64,
    moved: AtomicU64,
    failing: Mutex<Vec<Range<u64>>>,
}

static NEXT_SIM: AtomicU64 = AtomicU64::new(0);

impl SimDeviceMemory {
    /// `len` zeroed bytes at a fresh base address.
    pub fn new(len: usize) -> Arc<Self> {
        let k = NEXT_SIM.fetch_add(1, Ordering::Relaxed) % 0x1_0000;
        Arc::new(Self {
            // Non-canonical: bits 63..48 differ from bit 47; 16 Ki instances of up to 1 TiB.
            base: 0x5a00_0000_0000_0000 | k << 40,
            bytes: Mutex::new(vec![0; len]),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            failing: Mutex::new(Vec::new()),
        })
    }

    /// Device address of the first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the memory has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls served so far.
    pub fn counts(&self) -> SimCounts {
        SimCounts {
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            bytes: self.moved.load(Ordering::Relaxed),
        }
    }

    /// Makes every later access that touches `addr..addr+len` fail (as a driver error would).
    pub fn fail_range(&self, addr: u64, len: u64) {
        self.failing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(addr..addr + len);
    }

    /// Ends every injected failure.
    pub fn heal(&self) {
        self.failing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// The bytes at `addr..addr+len`, for checks (not counted, never failing; panics outside
    /// the memory).
    pub fn peek(&self, addr: u64, len: usize) -> Vec<u8> {
        let off = (addr - self.base) as usize;
        self.lock()[off..off + len].to_vec()
    }

    /// Stores `bytes` at `addr`, for setting up (not counted, never failing; panics outside
    /// the memory).
    pub fn poke(&self, addr: u64, bytes: &[u8]) {
        let off = (addr - self.base) as usize;
        self.lock()[off..off + bytes.len()].copy_from_slice(bytes);
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The offset of `addr..addr+len`, or why it cannot be accessed.
    fn span(&self, addr: u64, len: usize, have: usize) -> Result<usize, DeviceMemoryError> {
        let end = addr.checked_add(len as u64);
        let inside = addr >= self.base && end.is_some_and(|e| e <= self.base + have as u64);
        if !inside {
            return Err(DeviceMemoryError(format!(
                "{addr:#x}+{len} is not in simulated device memory {:#x}+{have}",
                self.base
            )));
        }
        let failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        if failing
            .iter()
            .any(|r| addr < r.end && addr + len as u64 > r.start)
        {
            return Err(DeviceMemoryError(format!(
                "injected failure at {addr:#x}+{len}"
            )));
        }
        Ok((addr - self.base) as usize)
    }
}

impl DeviceMemory for SimDeviceMemory {
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceMemoryError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let mem = self.lock();
        let off = self.span(src, dst.len(), mem.len())?;
        dst.copy_from_slice(&mem[off..off + dst.len()]);
        self.moved.fetch_add(dst.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn read_many(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), ReadManyError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let mem = self.lock();
        for (part, (src, dst)) in parts.iter_mut().enumerate() {
            let off = self
                .span(*src, dst.len(), mem.len())
                .map_err(|error| ReadManyError { part, error })?;
            dst.copy_from_slice(&mem[off..off + dst.len()]);
            self.moved.fetch_add(dst.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    fn write(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        let mut mem = self.lock();
        let off = self.span(dst, src.len(), mem.len())?;
        mem[off..off + src.len()].copy_from_slice(src);
        self.moved.fetch_add(src.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        let mut mem = self.lock();
        let have = mem.len();
        let s = self.span(src, len, have)?;
        let d = self.span(dst, len, have)?;
        mem.copy_within(s..s + len, d);
        self.moved.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl std::fmt::Debug for SimDeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDeviceMemory")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len())
            .field("counts", &self.counts())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_reads_writes_copies_counts_and_fails() {
        let m = SimDeviceMemory::new(4096);
        let b = m.base();
        m.write(b + 10, b"hello").unwrap();
        m.copy(b + 100, b + 10, 5).unwrap();
        let mut x = [0u8; 5];
        m.read(b + 100, &mut x).unwrap();
        assert_eq!(&x, b"hello");
        assert_eq!(
            m.counts(),
            SimCounts {
                reads: 1,
                writes: 1,
                copies: 1,
                bytes: 15
            }
        );
        assert!(m.read(b + 4094, &mut x).is_err(), "past the end");
        assert!(m.read(0x1000, &mut x).is_err(), "not device memory");
        m.fail_range(b + 102, 1);
        assert!(m.read(b + 100, &mut x).is_err());
        assert!(m.read(b + 101, &mut x[..2]).is_err());
        m.read(b + 103, &mut x[..2]).unwrap();
        m.read(b + 90, &mut x).unwrap();
        m.heal();
        m.read(b + 100, &mut x).unwrap();
        // the provided host paths bounce through read/write
        let mut host = [0u8; 5];
        // SAFETY: `host` is a local array of 5 bytes.
        unsafe { m.read_to_host(b + 100, host.as_mut_ptr(), 5) }.unwrap();
        assert_eq!(&host, b"hello");
        // SAFETY: as above.
        unsafe { m.write_from_host(b + 200, host.as_ptr(), 5) }.unwrap();
        assert_eq!(m.peek(b + 200, 5), b"hello");
    }

    /// A batched read is one call; a failing part names itself, the parts before it are read.
    #[test]
    fn sim_read_many_is_one_call_and_names_the_failing_part() {
        let m = SimDeviceMemory::new(4096);
        let b = m.base();
        m.poke(b, &(0..=255u8).collect::<Vec<_>>());
        let (mut x, mut y, mut z) = ([0u8; 4], [0u8; 8], [0u8; 2]);
        {
            let mut parts = [
                (b + 10, &mut x[..]),
                (b + 100, &mut y[..]),
                (b + 200, &mut z[..]),
            ];
            m.read_many(&mut parts).unwrap();
        }
        assert_eq!(x, [10, 11, 12, 13]);
        assert_eq!(y, [100, 101, 102, 103, 104, 105, 106, 107]);
        assert_eq!(z, [200, 201]);
        assert_eq!(m.counts().reads, 1);
        assert_eq!(m.counts().bytes, 14);
        m.fail_range(b + 104, 1);
        let (mut x, mut y, mut z) = ([0u8; 4], [0u8; 8], [0u8; 2]);
        let mut parts = [
            (b + 20, &mut x[..]),
            (b + 100, &mut y[..]),
            (b + 200, &mut z[..]),
        ];
        let e = m.read_many(&mut parts).unwrap_err();
        assert_eq!(e.part, 1);
        assert_eq!(
            parts[0].1,
            [20, 21, 22, 23],
            "the part before the failure was read"
        );
        assert_eq!(m.counts().reads, 2);
        // the provided version: a read per part, the same failing part
        struct Plain(Arc<SimDeviceMemory>);
        impl DeviceMemory for Plain {
            fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceMemoryError> {
                self.0.read(src, dst)
            }
            fn write(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
                self.0.write(dst, src)
            }
            fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
                self.0.copy(dst, src, len)
            }
        }
        let p = Plain(m.clone());
        let e = p.read_many(&mut parts).unwrap_err();
        assert_eq!(e.part, 1);
        assert_eq!(
            m.counts().reads,
            4,
            "two reads: the first part, the failing one"
        );
        let mut w = [0u8; 3];
        p.read_many(&mut [(b + 1, &mut w[..])]).unwrap();
        assert_eq!(w, [1, 2, 3]);
    }

    #[test]
    fn sim_bases_are_not_host_addresses() {
        let (a, b) = (SimDeviceMemory::new(1), SimDeviceMemory::new(1));
        assert_ne!(a.base(), b.base());
        // bits 63..47 not all equal: non-canonical
        let top = a.base() >> 47;
        assert!(top != 0 && top != 0x1_ffff);
    }
}
