//! The soft NIC's access to GPU memory through the CUDA driver: [`CudaMemory`], a
//! [`DeviceMemory`] made of CUDA copies, and [`device_allocation`], which tells whether an
//! address is GPU memory and which allocation holds it. The host API uses it for the regions
//! and rings it places in GPU memory; the uverbs emulation for GPU addresses an application
//! registers (as nvidia-peermem lets a kernel resolve them). The driver is loaded at run time:
//! without it, [`driver_available`] is false and nothing here calls into it.

use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext};
use std::ffi::c_void;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};
use verbs::devmem::{DeviceMemory, DeviceMemoryError, ReadManyError};

/// A driver call that failed, with what was being done.
#[derive(Debug, thiserror::Error)]
#[error("CUDA driver call failed: {op}: {source}")]
pub struct CudaMemError {
    /// The call.
    pub op: &'static str,
    /// The driver's error code.
    #[source]
    pub source: DriverError,
}

fn drv(op: &'static str) -> impl FnOnce(DriverError) -> CudaMemError {
    move |source| CudaMemError { op, source }
}

/// Whether the CUDA driver library (`libcuda`) can be loaded. Probed once, then cached.
pub fn driver_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names of libcuda and
        // closes what it opened; loading libcuda runs its initialisers, which is what using
        // CUDA means.
        panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    })
}

/// Runs `f`, which calls the driver through cudarc; a panic there (a missing symbol in an old
/// driver) comes back as its message.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".to_string())
    })
}

/// A device-memory allocation (`cuMemAlloc` and friends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// The GPU that holds it.
    pub ordinal: usize,
    /// First address.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Allocation {
    /// Whether `addr..addr+len` lies inside.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
    }
}

/// The device-memory allocation holding `addr`, or `None` when `addr` is not GPU device
/// memory (host memory, unknown to CUDA, or no driver).
pub fn device_allocation(addr: u64) -> Option<Allocation> {
    if !driver_available() {
        return None;
    }
    let query = || -> Option<Allocation> {
        // SAFETY: cuInit may be called any number of times.
        unsafe { sys::cuInit(0) }.result().ok()?;
        let attr = |a: sys::CUpointer_attribute, out: *mut c_void| {
            // SAFETY: `out` points at a value of the attribute's size (4 bytes for the memory
            // type and the ordinal, 8 for the range start and size); any address may be
            // queried (an unknown one is an error, not a fault).
            unsafe { sys::cuPointerGetAttribute(out, a, addr) }
                .result()
                .ok()
        };
        let mut kind: u32 = 0;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            (&mut kind as *mut u32).cast(),
        )?;
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return None;
        }
        let mut ordinal: i32 = -1;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            (&mut ordinal as *mut i32).cast(),
        )?;
        let (mut base, mut len): (u64, u64) = (0, 0);
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            (&mut base as *mut u64).cast(),
        )?;
        attr(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            (&mut len as *mut u64).cast(),
        )?;
        Some(Allocation {
            ordinal: usize::try_from(ordinal).ok()?,
            base,
            len,
        })
    };
    catch_panic(query).ok().flatten()
}

/// Bytes of pinned host memory a [`CudaMemory`] stages its copies through.
const STAGING: usize = 1 << 20;
/// The staging buffer's slots: a copy longer than one slot is pipelined, the driver filling
/// (or draining) one slot while the host drains (or fills) another.
const SLOTS: usize = 4;
/// Bytes of one slot.
const SLOT: usize = STAGING / SLOTS;

/// The soft NIC's access to one GPU's memory: CUDA copies
/// (`cuMemcpy{DtoH,HtoD,DtoD}Async`, UVA addresses, so host-registered memory with a device
/// address works too), staged through pinned host memory, on a non-blocking stream (no
/// implicit synchronisation with the default stream, where kernels that wait for the very
/// copies may be running), each complete before it returns, as [`DeviceMemory`] requires.
/// Host memory the driver has pinned (see `pinned_host`) is copied directly from 64 KiB on.
/// A copy longer than a staging slot is pipelined over the slots (an event per slot says
/// when the driver is done with it); ordered writes are queued together and waited for once,
/// and so are the parts of a batched read (`read_many`) that fit the staging buffer together;
/// queued writes that continue one another are one copy (see `Queue`), and queued
/// device-to-device copies (`copy_queued`) go on the same stream behind them, waited for at
/// the next other call or `settle`. The context is bound to whichever thread calls (the soft
/// NIC's engine or wire thread). One
/// copy at a time per GPU (a mutex).
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    io: Mutex<Io>,
}

struct Io {
    stream: sys::CUstream,
    staging: *mut u8,
    /// Recorded on the stream after the copy that last used each slot.
    events: [sys::CUevent; SLOTS],
    /// Writes and copies queued and not waited for ([`DeviceMemory::write_queued`],
    /// [`DeviceMemory::copy_queued`]).
    queue: Queue,
    /// Set when a queued write or copy turned out to have failed: every later call fails with it
    /// (as a CUDA context does after an asynchronous fault), so nothing is reported done that
    /// depended on the lost bytes.
    poisoned: Option<String>,
}

/// Where queued writes stand: they are staged one after the other through the slots; a slot
/// is taken again only after its event (recorded after its last copy) has fired. Writes that
/// continue one another (the packets of one message, in order) are copied as one: the run
/// grows while each write lands right after the last, in device memory and in the slot, and
/// is handed to the driver when one does not, when it would leave its slot, or at the wait.
#[derive(Default)]
struct Queue {
    /// Next free byte of the staging buffer.
    cursor: usize,
    /// Slots holding bytes of queued copies since the last wait.
    used: [bool; SLOTS],
    /// Whether anything is queued (staged writes or device-to-device copies).
    pending: bool,
    /// Staged bytes not yet handed to the driver: device address, staging offset, length.
    run: Option<(u64, usize, usize)>,
}

impl Io {
    /// Slot `k % SLOTS` of the staging buffer.
    fn slot(&self, k: usize) -> *mut u8 {
        // SAFETY: `(k % SLOTS) * SLOT < STAGING`: inside the staging allocation.
        unsafe { self.staging.add((k % SLOTS) * SLOT) }
    }

    /// Records slot `k`'s event after the copies queued so far.
    fn mark(&self, k: usize) -> Result<(), DriverError> {
        // SAFETY: the event and the stream are live (destroyed only in drop).
        unsafe { sys::cuEventRecord(self.events[k % SLOTS], self.stream) }.result()
    }

    /// Waits until the driver is done with slot `k` (its last recorded copy has completed).
    fn wait(&self, k: usize) -> Result<(), DriverError> {
        // SAFETY: the event is live.
        unsafe { sys::cuEventSynchronize(self.events[k % SLOTS]) }.result()
    }

    /// Waits for everything queued (after a failure too, so that no queued copy still
    /// touches the staging buffer once the mutex is released).
    fn drain(&self) -> Result<(), DriverError> {
        // SAFETY: the stream is live.
        unsafe { sys::cuStreamSynchronize(self.stream) }.result()
    }

    /// Completes the queued writes and copies, if any; a failure poisons the memory.
    fn settle(&mut self) -> Result<(), String> {
        if !self.queue.pending {
            return Ok(());
        }
        let issued = self.issue_run();
        self.queue = Queue::default();
        // drained after a failure too: no copy may still read the staging buffer
        let drained = self.drain();
        issued.and(drained).map_err(|e| {
            let why = format!("a queued write or copy in GPU memory failed: {e}");
            self.poisoned = Some(why.clone());
            why
        })
    }

    /// Queues a copy of `src` to device address `dst` (at most a slot long) through the
    /// staging buffer, without waiting for it.
    fn queue_write(&mut self, dst: u64, src: &[u8]) -> Result<(), DriverError> {
        let n = src.len();
        let mut at = self.queue.cursor;
        if at % SLOT + n > SLOT || at >= STAGING {
            // the next slot, once the driver is done with what it last copied from it
            self.issue_run()?;
            at = (at.div_ceil(SLOT) * SLOT) % STAGING;
        }
        let k = at / SLOT;
        if at % SLOT == 0 && self.queue.used[k] {
            self.issue_run()?;
            self.wait(k)?;
            self.queue.used[k] = false;
        }
        // SAFETY: `at + n` stays inside slot `k` of the staging buffer, which no queued copy
        // reads any more (its last one completed, or it was not used since the last wait), and
        // no staged run covers (a run ends at the cursor, at or before `at`).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.staging.add(at), n) };
        match &mut self.queue.run {
            // right after the run, in device memory and in the same slot: it grows
            Some((d, a, len)) if *d + *len as u64 == dst && *a + *len == at && *a / SLOT == k => {
                *len += n;
            }
            _ => {
                self.issue_run()?;
                self.queue.run = Some((dst, at, n));
            }
        }
        self.queue.used[k] = true;
        self.queue.pending = true;
        self.queue.cursor = at + n;
        Ok(())
    }

    /// Queues a device-to-device copy on the stream without waiting for it. The staged run,
    /// if any, is handed to the driver first, so the copy runs after every write queued
    /// before it (one stream: copies run in the order they were issued) and sees their bytes.
    fn queue_copy(&mut self, dst: u64, src: u64, len: usize) -> Result<(), DriverError> {
        if let Err(e) = self.issue_run() {
            // the staged writes are lost: no later call may report them done (the caller of
            // this copy may well copy another way and succeed)
            self.poisoned = Some(format!("queued writes to GPU memory were refused: {e}"));
            return Err(e);
        }
        // SAFETY: both are device addresses the soft NIC checked against regions (a bad one is
        // an error, never taken for a host pointer: the direction is named); no host buffer
        // is involved, and the device memory stays allocated until the wait: a region's
        // deregistration settles its memory first, and so does this memory's drop.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream) }.result()?;
        self.queue.pending = true;
        Ok(())
    }

    /// Hands the staged run, if any, to the driver, with its slot's event after it.
    fn issue_run(&mut self) -> Result<(), DriverError> {
        let Some((dst, at, n)) = self.queue.run.take() else {
            return Ok(());
        };
        // SAFETY: the device side is a range the soft NIC checked (each write of the run
        // was, and they are contiguous); the `n` staged bytes at `at`, inside one slot, stay
        // put until that slot's event fires.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, self.staging.add(at) as *const c_void, n, self.stream)
        }
        .result()?;
        self.mark(at / SLOT)
    }
}

// SAFETY: the stream and the pinned buffer are used only under the mutex, with the context
// bound to the calling thread; CUDA handles may be used from any thread.
unsafe impl Send for Io {}

impl CudaMemory {
    /// Sets up copies for the GPU of `ctx`: a non-blocking stream and the staging buffer.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaMemError> {
        use cudarc::driver::result::stream;
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let stream =
            stream::create(stream::StreamKind::NonBlocking).map_err(drv("cuStreamCreate"))?;
        // SAFETY: a plain pinned allocation, freed in `drop`.
        let staging = match unsafe { cudarc::driver::result::malloc_host(STAGING, 0) } {
            Ok(p) => p.cast::<u8>(),
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { stream::destroy(stream) };
                return Err(drv("cuMemHostAlloc")(e));
            }
        };
        let mut events = [std::ptr::null_mut(); SLOTS];
        for i in 0..SLOTS {
            // SAFETY: `events[i]` is a valid out-pointer; timing is off (cheaper to record).
            let made = unsafe {
                sys::cuEventCreate(
                    &mut events[i],
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            }
            .result();
            if let Err(e) = made {
                // SAFETY: each made above, destroyed once; the stream and buffer likewise.
                unsafe {
                    for ev in &events[..i] {
                        let _ = sys::cuEventDestroy_v2(*ev);
                    }
                    let _ = stream::destroy(stream);
                    let _ = cudarc::driver::result::free_host(staging.cast());
                }
                return Err(drv("cuEventCreate")(e));
            }
        }
        Ok(Self {
            ctx: ctx.clone(),
            io: Mutex::new(Io {
                stream,
                staging,
                events,
                queue: Queue::default(),
                poisoned: None,
            }),
        })
    }

    /// Runs `f` under the mutex with the context bound (driver panics caught), after the
    /// queued writes have completed unless `f` queues one itself; a failure names the call and
    /// the range.
    fn with_io(
        &self,
        what: &'static str,
        addr: u64,
        len: usize,
        f: impl FnOnce(&mut Io) -> Result<(), DriverError>,
    ) -> Result<(), DeviceMemoryError> {
        self.with_io_queued(what, addr, len, false, f)
    }

    /// [`CudaMemory::with_io`], leaving queued writes queued when `queued`.
    fn with_io_queued(
        &self,
        what: &'static str,
        addr: u64,
        len: usize,
        queued: bool,
        f: impl FnOnce(&mut Io) -> Result<(), DriverError>,
    ) -> Result<(), DeviceMemoryError> {
        let mut io = self.io.lock().unwrap_or_else(|e| e.into_inner());
        let run = || -> Result<(), String> {
            if let Some(why) = &io.poisoned {
                return Err(why.clone());
            }
            self.ctx
                .bind_to_thread()
                .map_err(|e| drv("cuCtxSetCurrent")(e).to_string())?;
            if !queued {
                io.settle()?;
            }
            f(&mut io).map_err(|e| drv(what)(e).to_string())
        };
        let r = match catch_panic(run) {
            Ok(r) => r,
            Err(panic) => Err(format!(
                "the CUDA driver bindings panicked during {what}: {panic}"
            )),
        };
        r.map_err(|e| DeviceMemoryError(format!("{e} (GPU address {addr:#x}, {len} bytes)")))
    }
}

impl CudaMemory {
    /// Reads parts whose total fits the staging buffer: every copy queued on the stream, each
    /// into its own place of the staging buffer, one wait, then each copied out. A copy the
    /// driver refuses names its part; a failure found at the wait (asynchronous: the driver
    /// does not say which copy) is pinned down by reading the parts again one by one.
    fn read_staged(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), ReadManyError> {
        let total: usize = parts.iter().map(|p| p.1.len()).sum();
        let first = parts.first().map_or(0, |p| p.0);
        // the part whose copy the driver refused; `parts.len()`: the wait failed
        let mut refused = parts.len();
        let r = self.with_io(
            "cuMemcpyAsync (device to host, batched)",
            first,
            total,
            |io| {
                let mut at = 0;
                for (i, (src, dst)) in parts.iter().enumerate() {
                    // SAFETY: the device side is an address the soft NIC checked (a bad one is an
                    // error, never taken for a host pointer: the direction is named); the host
                    // side is `dst.len()` bytes of the pinned staging buffer at `at` (the parts
                    // fit it together), ours under the mutex, read by nothing else and not freed
                    // before the wait below returns (on every path: a refused copy drains first).
                    let queued = unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            io.staging.add(at).cast::<c_void>(),
                            *src,
                            dst.len(),
                            io.stream,
                        )
                    }
                    .result();
                    if let Err(e) = queued {
                        refused = i;
                        let _ = io.drain();
                        return Err(e);
                    }
                    at += dst.len();
                }
                io.drain()?;
                let mut at = 0;
                for (_, dst) in parts.iter_mut() {
                    // SAFETY: the copies into the staging buffer completed (the wait above); `at
                    // .. at + dst.len()` is this part's place in it.
                    let staged =
                        unsafe { std::slice::from_raw_parts(io.staging.add(at), dst.len()) };
                    dst.copy_from_slice(staged);
                    at += dst.len();
                }
                Ok(())
            },
        );
        match r {
            Ok(()) => Ok(()),
            Err(error) if refused < parts.len() => Err(ReadManyError {
                part: refused,
                error,
            }),
            Err(_) => {
                for (part, (src, dst)) in parts.iter_mut().enumerate() {
                    self.read(*src, dst)
                        .map_err(|error| ReadManyError { part, error })?;
                }
                Ok(())
            }
        }
    }
}

impl DeviceMemory for CudaMemory {
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceMemoryError> {
        // SAFETY: `dst` is a live, exclusively borrowed slice of `dst.len()` bytes.
        unsafe { self.read_to_host(src, dst.as_mut_ptr(), dst.len()) }
    }

    fn write(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        // SAFETY: `src` is a live slice of `src.len()` bytes.
        unsafe { self.write_from_host(dst, src.as_ptr(), src.len()) }
    }

    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        self.with_io("cuMemcpyAsync (device to device)", dst, len, |io| {
            // SAFETY: both are addresses the soft NIC checked against regions (a bad one is
            // an error, never taken for a host pointer: the direction is named).
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, io.stream) }.result()?;
            io.drain()
        })
    }

    fn write_queued(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        if src.len() > SLOT {
            return self.write(dst, src);
        }
        self.with_io_queued(
            "cuMemcpyAsync (host to device, queued)",
            dst,
            src.len(),
            true,
            |io| io.queue_write(dst, src),
        )
    }

    fn copy_queued(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        self.with_io_queued(
            "cuMemcpyAsync (device to device, queued)",
            dst,
            len,
            true,
            |io| io.queue_copy(dst, src, len),
        )
    }

    fn settle(&self) -> Result<(), DeviceMemoryError> {
        self.with_io("cuStreamSynchronize", 0, 0, |_| Ok(()))
    }

    fn write_ordered(&self, parts: &[(u64, &[u8])]) -> Result<(), DeviceMemoryError> {
        let total: usize = parts.iter().map(|p| p.1.len()).sum();
        let Some(&(first, _)) = parts.first() else {
            return Ok(());
        };
        if total > STAGING {
            return parts
                .iter()
                .try_for_each(|&(dst, src)| self.write(dst, src));
        }
        // every part staged at its own place, copied in order on the one stream (a copy starts
        // after the one before it has completed), one wait for all
        self.with_io("cuMemcpyAsync (host to device)", first, total, |io| {
            let queued = queue_ordered(io, parts);
            let drained = io.drain();
            queued.and(drained)
        })
    }

    fn read_many(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), ReadManyError> {
        let mut start = 0;
        while start < parts.len() {
            // the parts from `start` on that fit the staging buffer together
            let mut end = start;
            let mut total = 0;
            while end < parts.len() && total + parts[end].1.len() <= STAGING {
                total += parts[end].1.len();
                end += 1;
            }
            if end == start {
                // one part larger than the staging buffer: the pipelined read
                let (src, dst) = &mut parts[start];
                self.read(*src, dst)
                    .map_err(|error| ReadManyError { part: start, error })?;
                start += 1;
                continue;
            }
            self.read_staged(&mut parts[start..end])
                .map_err(|e| ReadManyError {
                    part: start + e.part,
                    error: e.error,
                })?;
            start = end;
        }
        Ok(())
    }

    unsafe fn read_to_host(
        &self,
        src: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), DeviceMemoryError> {
        self.with_io("cuMemcpyAsync (device to host)", src, len, |io| {
            if len >= DIRECT_MIN && pinned_host(dst as u64, len) {
                // SAFETY: the caller's contract: `dst..dst+len` is writable host memory, which
                // the driver knows as pinned (a DMA target); the device side is an address the
                // soft NIC checked. The wait below returns after the copy completed.
                let r =
                    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, len, io.stream) }
                        .result();
                let drained = io.drain();
                return r.and(drained);
            }
            // SAFETY: the caller's contract: `dst..dst+len` is writable host memory.
            let r = unsafe { read_pipelined(io, src, dst, len) };
            // on success every chunk was waited for before it was copied out; after a
            // failure nothing queued may still fill a slot
            r.inspect_err(|_| {
                let _ = io.drain();
            })
        })
    }

    unsafe fn write_from_host(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceMemoryError> {
        self.with_io("cuMemcpyAsync (host to device)", dst, len, |io| {
            let r = if len >= DIRECT_MIN && pinned_host(src as u64, len) {
                // SAFETY: the caller's contract: `src..src+len` is readable host memory, which
                // the driver knows as pinned; the device side is an address the soft NIC
                // checked. The wait below returns after the copy completed.
                unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), len, io.stream) }
                    .result()
            } else {
                // SAFETY: the caller's contract: `src..src+len` is readable host memory.
                unsafe { write_pipelined(io, dst, src, len) }
            };
            let drained = io.drain();
            r.and(drained)
        })
    }
}

/// Copies between GPU memory and host memory the driver has pinned, at least this long, go
/// directly (one DMA, as a ConnectX reads and writes an MR's pinned pages) instead of through
/// the staging slots and a CPU copy; shorter ones cost the same either way.
const DIRECT_MIN: usize = 64 << 10;

/// Whether the driver knows `addr..addr+len` as pinned host memory (`cuMemHostAlloc`,
/// `cuMemHostRegister`, by this process or a library in it): its first and last byte are host
/// memory to CUDA. A copy that still meets pageable pages in between is staged by the driver
/// itself (correct, slower). Called with the context bound.
fn pinned_host(addr: u64, len: usize) -> bool {
    let host = |a: u64| {
        let mut kind: u32 = 0;
        // SAFETY: `kind` is the 4-byte value the attribute names; any address may be queried
        // (memory unknown to CUDA is an error, not a fault).
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut kind as *mut u32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                a,
            )
        };
        r.result().is_ok() && kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
    };
    len > 0 && host(addr) && host(addr + len as u64 - 1)
}

/// The `n` bytes of chunk `k` of a `len`-byte copy cut into slots.
fn chunk(len: usize, k: usize) -> usize {
    (len - k * SLOT).min(SLOT)
}

/// Device memory at `src` to host memory at `dst`, chunk by chunk through the slots: the
/// first `SLOTS` chunks are queued, then each is copied out once its event fired and the slot
/// refilled with the chunk `SLOTS` further on.
///
/// # Safety
/// `dst..dst+len` is host memory writable for the call.
unsafe fn read_pipelined(io: &Io, src: u64, dst: *mut u8, len: usize) -> Result<(), DriverError> {
    let chunks = len.div_ceil(SLOT);
    let fill = |k: usize| -> Result<(), DriverError> {
        // SAFETY: the device side is an address the soft NIC checked (a bad one is an
        // error); slot `k` holds `SLOT >= chunk` bytes and no earlier queued copy still
        // fills it (its event was waited for and it was drained before this refill).
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                io.slot(k).cast::<c_void>(),
                src + (k * SLOT) as u64,
                chunk(len, k),
                io.stream,
            )
        }
        .result()?;
        // one chunk: the caller's wait is the only one needed
        if chunks > 1 {
            io.mark(k)?;
        }
        Ok(())
    };
    if chunks == 1 {
        fill(0)?;
        io.drain()?;
        // SAFETY: the slot holds the whole copy, complete; `dst` has `len` writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(io.slot(0), dst, len) };
        return Ok(());
    }
    for k in 0..chunks.min(SLOTS) {
        fill(k)?;
    }
    for k in 0..chunks {
        io.wait(k)?;
        // SAFETY: the slot holds chunk `k`, complete (its event fired); the destination
        // range is inside the caller's writable range.
        unsafe { std::ptr::copy_nonoverlapping(io.slot(k), dst.add(k * SLOT), chunk(len, k)) };
        if k + SLOTS < chunks {
            fill(k + SLOTS)?;
        }
    }
    Ok(())
}

/// Host memory at `src` to device memory at `dst`, chunk by chunk through the slots: a slot
/// is filled once the copy that last read it has completed, then queued.
///
/// # Safety
/// `src..src+len` is host memory readable for the call.
unsafe fn write_pipelined(
    io: &Io,
    dst: u64,
    src: *const u8,
    len: usize,
) -> Result<(), DriverError> {
    let chunks = len.div_ceil(SLOT);
    for k in 0..chunks {
        if k >= SLOTS {
            io.wait(k)?;
        }
        let n = chunk(len, k);
        // SAFETY: inside the caller's readable range; the slot is free (first use, or its
        // last copy completed) and holds `SLOT >= n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.add(k * SLOT), io.slot(k), n) };
        // SAFETY: the device side is an address the soft NIC checked; the slot's `n` bytes
        // stay put until its event fires.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst + (k * SLOT) as u64,
                io.slot(k) as *const c_void,
                n,
                io.stream,
            )
        }
        .result()?;
        // a slot is waited for only when it is reused
        if k + SLOTS < chunks {
            io.mark(k)?;
        }
    }
    Ok(())
}

/// Queues the parts of an ordered write on the stream, each staged at its own place (their
/// total fits the staging buffer); a copy on the stream starts after the one before it has
/// completed.
fn queue_ordered(io: &Io, parts: &[(u64, &[u8])]) -> Result<(), DriverError> {
    let mut at = 0;
    for &(dst, src) in parts {
        // SAFETY: the caller checked that the parts fit the staging buffer together; it is
        // ours under the mutex and no queued copy reads this range yet.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), io.staging.add(at), src.len()) };
        // SAFETY: the device side is an address the soft NIC checked; the host side
        // `src.len()` staged bytes that stay put until the wait below.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                io.staging.add(at) as *const c_void,
                src.len(),
                io.stream,
            )
        }
        .result()?;
        at += src.len();
    }
    Ok(())
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        let io = self.io.get_mut().unwrap_or_else(|e| e.into_inner());
        if self.ctx.bind_to_thread().is_ok() {
            // the queued writes land, and no copy reads the staging buffer once it is freed
            let _ = io.settle();
            // SAFETY: created in `new`, each destroyed once, here; nothing uses them after.
            unsafe {
                let _ = cudarc::driver::result::stream::destroy(io.stream);
                for ev in io.events {
                    let _ = sys::cuEventDestroy_v2(ev);
                }
                let _ = cudarc::driver::result::free_host(io.staging.cast());
            }
        }
    }
}
