//! The CPU proxy service: its one job is to ring doorbells on behalf of GPU kernels that cannot
//! map the doorbell page.
//!
//! A kernel writes its WQEs into the SQ ring and then stores its monotonic 64-bit producer index
//! (in WQE blocks, never wrapped to 16 bits) into a host-pinned *proxy word* with a system-scope
//! release. A proxy thread notices each change and, for that QP:
//!
//! 1. acquires the new value (a relaxed load followed, only when the value changed, by an acquire
//!    fence — so an idle QP costs exactly one plain load of its word per scan);
//! 2. stores the doorbell record's send word, `BE32(pi & 0xffff)`, with release ordering (the
//!    WQE bytes the kernel released are visible before it);
//! 3. stores the 8-byte doorbell register value in the DOCA convention
//!    `{BE32(pi << 8), BE32(qpn << 8)}` with release ordering (the DBREC is visible before it),
//!    followed by a full fence that also flushes a write-combining UAR mapping;
//! 4. calls the target's `wake` callback (what an MMIO write does to a NIC).
//!
//! # Sanity rule for producer values
//!
//! Each target remembers the last producer index it forwarded, `last` (initially
//! [`ProxyTarget::start`], 0 unless set). A newly observed value `v` is forwarded only when
//! `last < v <= last + max_jump`, where `max_jump` is the SQ size for soft-NIC QPs and
//! [`MAX_JUMP`] (32768 blocks, the largest mlx5 SQ) otherwise: a producer can never be more than
//! one ring ahead of the consumer, which is never ahead of the last doorbell. A value that goes
//! backwards or jumps further is counted once in [`ProxyCounters::bad_producers`] (once per
//! observed change of the word, not once per scan) and not forwarded; `last` stays where it
//! was, so the QP resumes as soon as the word again holds a sane value. A value equal to `last`
//! is ignored. The proxy never forwards a partial or clamped value.
//!
//! # Threads, scanning and parking
//!
//! Targets are partitioned across `threads` proxy threads (each new target goes to the thread
//! with the fewest). A thread scans its targets in a loop over an immutable snapshot (an
//! `Arc<Vec<_>>` replaced on add/remove and picked up through a generation counter), so the
//! steady state takes no lock and allocates nothing. While any of its words change it keeps
//! scanning; after `spin` without a change it parks with growing timeouts (`min_park`, doubling,
//! up to `max_park`), because a GPU store cannot wake a thread: `max_park` bounds the latency a
//! kernel sees after a long idle period.
//!
//! [`ProxyService::remove`] waits until the owning thread has dropped its snapshot holding the
//! target, forwards a last time any sane value already published (nothing published before
//! `remove` is lost), and only then returns: the QP's memory is never touched afterwards.

use prm::doorbell::{DoorbellValue, DBREC_SND};
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// Largest producer advance forwarded in one step by default (the largest mlx5 SQ, in blocks).
pub const MAX_JUMP: u64 = 32768;

/// A wake callback: called after each forwarded doorbell.
pub type Wake = Arc<dyn Fn() + Send + Sync>;

/// Errors of the CPU proxy service.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The configuration is out of range.
    #[error("invalid proxy configuration: {0}")]
    InvalidConfig(&'static str),
    /// A target's pointers or QPN are unusable.
    #[error("invalid proxy target: {0}")]
    InvalidTarget(&'static str),
    /// The service has been shut down.
    #[error("the proxy service is shut down")]
    ShutDown,
    /// The handle belongs to another service (or its target is already gone).
    #[error("the handle does not name a target of this proxy service")]
    UnknownHandle,
    /// `remove` was called from a proxy thread (a wake callback); it would wait for itself.
    #[error("remove called from a proxy thread of the same service")]
    FromProxyThread,
    /// A proxy thread could not be started.
    #[error("could not start a proxy thread: {0}")]
    Spawn(#[from] std::io::Error),
    /// Proxy threads ended by panicking.
    #[error("{0} proxy thread(s) panicked")]
    ThreadPanicked(usize),
}

/// One QP as the proxy sees it: where its producer word, doorbell record and doorbell register
/// are, its QPN, and how to wake its device. Device-agnostic.
pub struct ProxyTarget {
    producer: *const AtomicU64,
    dbrec: *mut u8,
    doorbell: *mut u8,
    qpn: u32,
    start: u64,
    max_jump: u64,
    wake: Option<Wake>,
    keep: Arc<dyn Any + Send + Sync>,
}

// SAFETY: the raw pointers are only dereferenced as atomics, under the contract of
// `ProxyTarget::new` (valid while `keep` lives, which the target owns); `wake` and `keep` are
// Send + Sync.
unsafe impl Send for ProxyTarget {}
// SAFETY: as above; `&ProxyTarget` gives no non-atomic access to the pointed-to memory.
unsafe impl Sync for ProxyTarget {}

impl ProxyTarget {
    /// A target from raw addresses.
    ///
    /// - `producer`: the 8-byte proxy word the kernel stores its 64-bit producer index into;
    /// - `dbrec`: the QP's 8-byte doorbell record (the proxy writes word 1, the send word);
    /// - `doorbell`: the 8-byte doorbell register (a UAR register or its emulation);
    /// - `qpn`: the QP number (24 bits), carried in the doorbell value;
    /// - `wake`: called after each doorbell (e.g. to wake a software device);
    /// - `keep`: owns the memory behind the three pointers; dropped after the last access.
    ///
    /// # Safety
    /// Until `keep` is dropped: `producer` must point to a live, 8-byte aligned word that every
    /// party accesses only with atomic (or whole 8-byte device) operations; `dbrec` to a live,
    /// 4-byte aligned, writable 8-byte doorbell record whose send word is accessed only
    /// atomically and written by no one but this proxy while the target is registered; and
    /// `doorbell` to a live, 8-byte aligned, writable 8-byte register accessed only atomically
    /// (or as device memory). None of them may be covered by a Rust `&mut` reference.
    pub unsafe fn new(
        producer: *const AtomicU64,
        dbrec: *mut u8,
        doorbell: *mut u8,
        qpn: u32,
        wake: Option<Wake>,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Result<Self, ProxyError> {
        if producer.is_null() || dbrec.is_null() || doorbell.is_null() {
            return Err(ProxyError::InvalidTarget("null pointer"));
        }
        if (producer as usize) % 8 != 0 {
            return Err(ProxyError::InvalidTarget(
                "proxy word is not 8-byte aligned",
            ));
        }
        if (dbrec as usize) % 4 != 0 {
            return Err(ProxyError::InvalidTarget(
                "doorbell record is not 4-byte aligned",
            ));
        }
        if (doorbell as usize) % 8 != 0 {
            return Err(ProxyError::InvalidTarget(
                "doorbell register is not 8-byte aligned",
            ));
        }
        if qpn > 0x00ff_ffff {
            return Err(ProxyError::InvalidTarget("QPN does not fit in 24 bits"));
        }
        Ok(Self {
            producer,
            dbrec,
            doorbell,
            qpn,
            start: 0,
            max_jump: MAX_JUMP,
            wake,
            keep,
        })
    }

    /// The target for a QP of the host API, on any backend: its CPU-proxy word, doorbell
    /// record and doorbell register from the QP's geometry, a wake for a software device, and
    /// forwarded advances limited to the SQ's size. It holds the QP as its CPU-proxy poster
    /// ([`crate::queue::Poster`]) until the target is removed (or its service dropped), and
    /// starts at the queue's producer index (the CPU-proxy word when its low 16 bits agree
    /// with the doorbell record, else the record's 16 bits), so it continues after an earlier
    /// poster. [`crate::Error::PosterBusy`] while a CPU initiator or another proxy target
    /// holds the QP; a GPU export may hold it too (the kernel writes the WQEs, the proxy rings
    /// for it). [`crate::Error::Unsupported`] for a [`verbs::DoorbellMode::NoDbr`] QP (the
    /// proxy writes the send doorbell record such a QP never has written). A
    /// [`verbs::DoorbellMode::NoDbrEmulated`] QP is what the target is for: the kernel rings
    /// the register itself and publishes its producer in the word, and the proxy keeps the
    /// record and rings again (a doorbell the device lost is recovered from the record).
    pub fn for_qp(qp: &crate::Qp) -> Result<Self, crate::Error> {
        if qp.doorbell().0 == verbs::DoorbellMode::NoDbr {
            // the proxy writes the send doorbell record, which a no-DBR QP never has written
            return Err(crate::Error::Unsupported(format!(
                "QP {:#x} is rung without a send doorbell record (DoorbellMode::NoDbr); the \
                 CPU proxy writes that record (create the QP with DoorbellMode::CpuProxy)",
                qp.qpn()
            )));
        }
        let g = qp.geometry();
        let word = g.proxy_word.as_ref().ok_or_else(|| {
            crate::Error::InvalidArgument(format!("QP {:#x} has no CPU-proxy word", g.qpn))
        })?;
        let (Some(producer), Some(doorbell)) = (word.host(), g.db_reg.host()) else {
            return Err(crate::Error::InvalidArgument(format!(
                "QP {:#x}: its CPU-proxy word or doorbell register is not host memory",
                g.qpn
            )));
        };
        let dbrec = g.dbrec.host().ok_or_else(|| {
            crate::Error::InvalidArgument(format!(
                "QP {:#x} keeps its doorbell record in GPU memory, which the CPU proxy cannot \
                 write (create it with DoorbellMode::CpuProxy: its record is then host memory)",
                g.qpn
            ))
        })?;
        let claim = qp.posters.claim(crate::queue::Poster::Proxy)?;
        let start = qp.queue_state().sq_pi;
        if !qp.posters.holds(crate::queue::Poster::GpuExport) {
            // No kernel writes the word now: it starts where the queue is, not behind it.
            word.store_u64(start);
        }
        let keep: Arc<dyn Any + Send + Sync> = Arc::new((g.keep.clone(), claim));
        // SAFETY: the proxy word, the doorbell record and the register are the QP's (its
        // control and UAR pages, or the provider's record and BlueFlame register and the host
        // API's word), all host memory (checked above) kept alive by `keep`; the device, the
        // GPU and this proxy access them atomically, and while the target is registered only
        // the proxy writes the record's send word and the register (the CPU-proxy mode).
        let t = unsafe {
            Self::new(
                producer as *const AtomicU64,
                dbrec,
                doorbell,
                g.qpn,
                g.kick.clone(),
                keep,
            )
        }
        .map_err(|e| crate::Error::InvalidArgument(e.to_string()))?;
        Ok(t.with_max_jump(g.sq_blocks).with_start(start))
    }

    /// Sets the producer index the doorbell already covers (default 0): a word holding a
    /// larger sane value when the target is added is forwarded at once.
    pub fn with_start(mut self, start: u64) -> Self {
        self.start = start;
        self
    }

    /// Sets the largest advance forwarded in one step, in blocks (clamped to 1..=[`MAX_JUMP`]).
    pub fn with_max_jump(mut self, blocks: u32) -> Self {
        self.max_jump = u64::from(blocks).clamp(1, MAX_JUMP);
        self
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    /// The producer index the doorbell covered when the target was made.
    pub fn start(&self) -> u64 {
        self.start
    }
    /// The largest advance forwarded in one step.
    pub fn max_jump(&self) -> u64 {
        self.max_jump
    }
    /// The owner of the memory behind the target's pointers.
    pub fn keep(&self) -> &Arc<dyn Any + Send + Sync> {
        &self.keep
    }
    /// The proxy word (what a kernel, or a test acting as one, stores its producer into).
    pub fn producer_word(&self) -> &AtomicU64 {
        // SAFETY: live and aligned while `self.keep` lives (contract of `new`).
        unsafe { &*self.producer }
    }

    /// Writes the DBREC send word and the doorbell register for producer `pi`, then wakes the
    /// device. Returns false when the wake callback panicked.
    fn ring(&self, pi: u64) -> bool {
        let pi16 = pi as u16;
        // SAFETY: `dbrec` is a live, 4-byte aligned 8-byte record (contract of `new`); word
        // `DBREC_SND` is at byte 4 and only accessed atomically.
        let snd = unsafe { &*self.dbrec.add(DBREC_SND * 4).cast::<AtomicU32>() };
        snd.store(u32::from(pi16).to_be(), Ordering::Release);
        let value = DoorbellValue::from_pi(pi16, self.qpn).to_u64();
        // SAFETY: `doorbell` is a live, 8-byte aligned register (contract of `new`).
        let reg = unsafe { &*self.doorbell.cast::<AtomicU64>() };
        reg.store(value, Ordering::Release);
        // Orders the doorbell before anything later and flushes a write-combining mapping
        // (rdma-core's mmio_flush_writes).
        fence(Ordering::SeqCst);
        match &self.wake {
            Some(w) => catch_unwind(AssertUnwindSafe(|| w())).is_ok(),
            None => true,
        }
    }
}

impl std::fmt::Debug for ProxyTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyTarget")
            .field("qpn", &self.qpn)
            .field("producer", &self.producer)
            .field("dbrec", &self.dbrec)
            .field("doorbell", &self.doorbell)
            .field("start", &self.start)
            .field("max_jump", &self.max_jump)
            .finish_non_exhaustive()
    }
}

/// Parameters of a [`ProxyService`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProxyConfig {
    /// Proxy threads (1..=64); targets are partitioned across them.
    pub threads: usize,
    /// How long a thread keeps scanning without seeing a change before it starts to park.
    pub spin: Duration,
    /// First park timeout after spinning (doubles on each idle park).
    pub min_park: Duration,
    /// Longest park timeout: the worst-case delay before an idle thread notices a GPU write.
    pub max_park: Duration,
}

impl Default for ProxyConfig {
    /// One thread, 100 µs of spinning, parks of 10 µs growing to 250 µs.
    fn default() -> Self {
        Self {
            threads: 1,
            spin: Duration::from_micros(100),
            min_park: Duration::from_micros(10),
            max_park: Duration::from_micros(250),
        }
    }
}

impl ProxyConfig {
    fn validate(&self) -> Result<(), ProxyError> {
        if self.threads == 0 || self.threads > 64 {
            return Err(ProxyError::InvalidConfig("threads must be 1..=64"));
        }
        if self.min_park.is_zero() || self.min_park > self.max_park {
            return Err(ProxyError::InvalidConfig(
                "park timeouts must satisfy 0 < min_park <= max_park",
            ));
        }
        Ok(())
    }
}

/// The service's counters (sums over its threads, or one thread's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyCounters {
    /// Doorbells forwarded (DBREC + register writes).
    pub doorbells: u64,
    /// Scans over a thread's targets.
    pub scans: u64,
    /// Parks (sleeps) of idle threads.
    pub parks: u64,
    /// Time spent parked.
    pub idle: Duration,
    /// Producer values not forwarded by the sanity rule (backwards or too far ahead).
    pub bad_producers: u64,
    /// Wake callbacks that panicked (the panic is caught; the doorbell was written).
    pub wake_panics: u64,
    /// Targets registered now.
    pub targets: usize,
}

/// Names a registered target; give it back to [`ProxyService::remove`]. Dropping it leaves the
/// target registered until the service is dropped.
#[derive(Debug)]
#[must_use = "a target can only be removed through its handle"]
pub struct ProxyHandle {
    service: u64,
    thread: usize,
    id: u64,
    qpn: u32,
}

impl ProxyHandle {
    /// The target's QPN.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    /// Index of the proxy thread that serves the target.
    pub fn thread(&self) -> usize {
        self.thread
    }
}

/// A registered target with the proxy's state for it.
struct Entry {
    id: u64,
    target: ProxyTarget,
    /// Last raw value observed in the word.
    seen: AtomicU64,
    /// Last producer index forwarded.
    forwarded: AtomicU64,
}

impl Entry {
    /// One scan step: one load of the word; the rest only when it changed. Returns whether it
    /// changed.
    #[inline]
    fn poll(&self, c: &ThreadCounters) -> bool {
        let v = self.target.producer_word().load(Ordering::Relaxed);
        if v == self.seen.load(Ordering::Relaxed) {
            return false;
        }
        self.seen.store(v, Ordering::Relaxed);
        // Synchronises with the kernel's release store of `v`: its WQE bytes are visible here,
        // and through the release stores below, to the device.
        fence(Ordering::Acquire);
        self.judge(v, c);
        true
    }

    /// Applies the sanity rule to a newly observed value and forwards it if sane.
    fn judge(&self, v: u64, c: &ThreadCounters) {
        let last = self.forwarded.load(Ordering::Relaxed);
        if v == last {
            return;
        }
        if v < last || v - last > self.target.max_jump {
            c.bad_producers.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                qpn = self.target.qpn,
                producer = v,
                last,
                "proxy: insane producer index not forwarded"
            );
            return;
        }
        // Counted before the ring, so that whoever sees the completion it causes also sees the
        // count (the device may finish the WQE before this thread runs again).
        self.forwarded.store(v, Ordering::Relaxed);
        c.doorbells.fetch_add(1, Ordering::Relaxed);
        if !self.target.ring(v) {
            c.wake_panics.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The last look at the word before the target leaves (no thread holds it any more).
    fn flush(&self, c: &ThreadCounters) -> u64 {
        let v = self.target.producer_word().load(Ordering::Acquire);
        if v != self.seen.load(Ordering::Relaxed) {
            self.seen.store(v, Ordering::Relaxed);
            self.judge(v, c);
        }
        self.forwarded.load(Ordering::Relaxed)
    }
}

/// Counters of one thread, on their own cache lines. `scans`, `parks` and `idle_ns` have one
/// writer (the thread); the others are also written by `remove`'s flush.
#[derive(Default)]
#[repr(align(128))]
struct ThreadCounters {
    doorbells: AtomicU64,
    scans: AtomicU64,
    parks: AtomicU64,
    idle_ns: AtomicU64,
    bad_producers: AtomicU64,
    wake_panics: AtomicU64,
}

impl ThreadCounters {
    /// Adds to a counter that only the owning thread writes (no locked instruction).
    fn bump(c: &AtomicU64, n: u64) {
        c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }
    fn snapshot(&self) -> ProxyCounters {
        ProxyCounters {
            doorbells: self.doorbells.load(Ordering::Relaxed),
            scans: self.scans.load(Ordering::Relaxed),
            parks: self.parks.load(Ordering::Relaxed),
            idle: Duration::from_nanos(self.idle_ns.load(Ordering::Relaxed)),
            bad_producers: self.bad_producers.load(Ordering::Relaxed),
            wake_panics: self.wake_panics.load(Ordering::Relaxed),
            targets: 0,
        }
    }
}

/// The target list of one thread, as published.
#[derive(Default)]
struct Published {
    generation: u64,
    entries: Arc<Vec<Arc<Entry>>>,
}

/// One proxy thread's share of the service.
#[derive(Default)]
struct Shard {
    /// Hint: the generation of `list`, read once per scan.
    generation: AtomicU64,
    list: Mutex<Published>,
    /// Generation of the snapshot the thread scans (`u64::MAX` once it has exited).
    acked: Mutex<u64>,
    acked_cv: Condvar,
    thread: OnceLock<Thread>,
    counters: ThreadCounters,
}

impl Shard {
    fn ack(&self, g: u64) {
        let mut a = lock(&self.acked);
        *a = (*a).max(g);
        self.acked_cv.notify_all();
    }

    /// Waits until the thread scans generation `g` or later (or has exited).
    fn wait_ack(&self, g: u64) {
        let mut a = lock(&self.acked);
        while *a < g {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
            a = self
                .acked_cv
                .wait_timeout(a, Duration::from_millis(1))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn unpark(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

struct Inner {
    id: u64,
    cfg: ProxyConfig,
    shards: Vec<Shard>,
    shutdown: AtomicBool,
    next_id: AtomicU64,
}

static NEXT_SERVICE: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The CPU proxy service: threads that turn proxy-word changes into doorbells.
pub struct ProxyService {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl ProxyService {
    /// Starts `cfg.threads` proxy threads with no targets.
    pub fn start(cfg: ProxyConfig) -> Result<Self, ProxyError> {
        cfg.validate()?;
        let inner = Arc::new(Inner {
            id: NEXT_SERVICE.fetch_add(1, Ordering::Relaxed),
            cfg,
            shards: (0..cfg.threads).map(|_| Shard::default()).collect(),
            shutdown: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
        });
        let svc = Self {
            inner,
            threads: Mutex::new(Vec::with_capacity(cfg.threads)),
        };
        for i in 0..cfg.threads {
            let inner = svc.inner.clone();
            let h = std::thread::Builder::new()
                .name(format!("gpuverbs-proxy-{i}"))
                .spawn(move || run(&inner, i))?; // on error, Drop stops the started threads
            let _ = svc.inner.shards[i].thread.set(h.thread().clone());
            lock(&svc.threads).push(h);
        }
        tracing::debug!(threads = cfg.threads, ?cfg, "CPU proxy service started");
        Ok(svc)
    }

    /// The configuration.
    pub fn config(&self) -> ProxyConfig {
        self.inner.cfg
    }

    /// Registers a target with the thread that has the fewest. It is scanned from the thread's
    /// next pass on (the thread is woken).
    pub fn add(&self, target: ProxyTarget) -> Result<ProxyHandle, ProxyError> {
        if self.inner.shutdown.load(Ordering::Acquire) {
            return Err(ProxyError::ShutDown);
        }
        let (thread, _) = self
            .inner
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (i, lock(&s.list).entries.len()))
            .min_by_key(|&(i, n)| (n, i))
            .ok_or(ProxyError::ShutDown)?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let qpn = target.qpn;
        let entry = Arc::new(Entry {
            id,
            seen: AtomicU64::new(target.start),
            forwarded: AtomicU64::new(target.start),
            target,
        });
        let shard = &self.inner.shards[thread];
        {
            let mut p = lock(&shard.list);
            let mut v = Vec::with_capacity(p.entries.len() + 1);
            v.extend(p.entries.iter().cloned());
            v.push(entry);
            p.entries = Arc::new(v);
            p.generation += 1;
            shard.generation.store(p.generation, Ordering::Release);
        }
        shard.unpark();
        Ok(ProxyHandle {
            service: self.inner.id,
            thread,
            id,
            qpn,
        })
    }

    /// Unregisters a target. Waits until its thread no longer holds it, forwards a last time any
    /// sane producer index already published, and drops the target (its `keep`) here. Returns
    /// the last producer index forwarded (pass it to [`ProxyTarget::with_start`] to add the QP
    /// again). Works after shutdown too. Must not be called from a wake callback.
    pub fn remove(&self, handle: ProxyHandle) -> Result<u64, ProxyError> {
        if handle.service != self.inner.id {
            return Err(ProxyError::UnknownHandle);
        }
        if self.is_proxy_thread() {
            return Err(ProxyError::FromProxyThread);
        }
        let shard = self
            .inner
            .shards
            .get(handle.thread)
            .ok_or(ProxyError::UnknownHandle)?;
        let (entry, g) = {
            let mut p = lock(&shard.list);
            let pos = p
                .entries
                .iter()
                .position(|e| e.id == handle.id)
                .ok_or(ProxyError::UnknownHandle)?;
            let mut v: Vec<Arc<Entry>> = p.entries.as_ref().clone();
            let entry = v.remove(pos);
            p.entries = Arc::new(v);
            p.generation += 1;
            shard.generation.store(p.generation, Ordering::Release);
            (entry, p.generation)
        };
        shard.wait_ack(g);
        let last = entry.flush(&shard.counters);
        drop(entry);
        Ok(last)
    }

    /// Counters summed over the threads.
    pub fn counters(&self) -> ProxyCounters {
        self.thread_counters()
            .into_iter()
            .fold(ProxyCounters::default(), |a, c| ProxyCounters {
                doorbells: a.doorbells + c.doorbells,
                scans: a.scans + c.scans,
                parks: a.parks + c.parks,
                idle: a.idle + c.idle,
                bad_producers: a.bad_producers + c.bad_producers,
                wake_panics: a.wake_panics + c.wake_panics,
                targets: a.targets + c.targets,
            })
    }

    /// Counters of each thread.
    pub fn thread_counters(&self) -> Vec<ProxyCounters> {
        self.inner
            .shards
            .iter()
            .map(|s| ProxyCounters {
                targets: lock(&s.list).entries.len(),
                ..s.counters.snapshot()
            })
            .collect()
    }

    /// Whether the threads are (still) running.
    pub fn is_running(&self) -> bool {
        !self.inner.shutdown.load(Ordering::Acquire)
    }

    /// Stops and joins the threads (idempotent). Targets stay registered (and can still be
    /// removed) but are no longer scanned.
    pub fn shutdown(&self) -> Result<(), ProxyError> {
        self.inner.shutdown.store(true, Ordering::Release);
        for s in &self.inner.shards {
            s.unpark();
        }
        let handles = std::mem::take(&mut *lock(&self.threads));
        let me = std::thread::current().id();
        let mut panicked = 0;
        for h in handles {
            if h.thread().id() == me {
                // Called from a wake callback: this thread exits when the callback returns.
                continue;
            }
            if h.join().is_err() {
                panicked += 1;
            }
        }
        if panicked > 0 {
            return Err(ProxyError::ThreadPanicked(panicked));
        }
        Ok(())
    }

    fn is_proxy_thread(&self) -> bool {
        let me = std::thread::current().id();
        self.inner
            .shards
            .iter()
            .any(|s| s.thread.get().is_some_and(|t| t.id() == me))
    }
}

impl Drop for ProxyService {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!("CPU proxy shutdown: {e}");
        }
    }
}

impl std::fmt::Debug for ProxyService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyService")
            .field("id", &self.inner.id)
            .field("config", &self.inner.cfg)
            .field("running", &self.is_running())
            .finish_non_exhaustive()
    }
}

/// Marks the thread gone (releasing any `remove` waiting on it) when it ends, even by panic.
struct ExitGuard<'a>(&'a Shard);

impl Drop for ExitGuard<'_> {
    fn drop(&mut self) {
        self.0.ack(u64::MAX);
    }
}

/// Scans between two clock reads while spinning.
const CLOCK_EVERY: u32 = 16;

/// The body of proxy thread `idx`.
fn run(inner: &Inner, idx: usize) {
    let shard = &inner.shards[idx];
    let cfg = inner.cfg;
    let _exit = ExitGuard(shard);
    let c = &shard.counters;
    // Declared after the guard, so dropped before it acknowledges the exit.
    let mut entries: Arc<Vec<Arc<Entry>>> = Arc::default();
    let mut generation = u64::MAX;
    let mut idle_scans = 0u32;
    let mut idle_since = Instant::now();
    let mut parking = false;
    let mut park = cfg.min_park;
    while !inner.shutdown.load(Ordering::Acquire) {
        if shard.generation.load(Ordering::Acquire) != generation {
            let (g, list) = {
                let p = lock(&shard.list);
                (p.generation, p.entries.clone())
            };
            entries = list;
            generation = g;
            shard.ack(g);
        }
        let mut active = false;
        for e in entries.iter() {
            active |= e.poll(c);
        }
        ThreadCounters::bump(&c.scans, 1);
        if active {
            idle_scans = 0;
            parking = false;
            park = cfg.min_park;
            continue;
        }
        if !parking {
            if idle_scans == 0 {
                idle_since = Instant::now();
            }
            idle_scans = idle_scans.wrapping_add(1);
            parking = cfg.spin.is_zero()
                || (idle_scans % CLOCK_EVERY == 0 && idle_since.elapsed() >= cfg.spin);
            if !parking {
                std::hint::spin_loop();
                continue;
            }
        }
        let t0 = Instant::now();
        std::thread::park_timeout(park);
        let slept = t0.elapsed();
        ThreadCounters::bump(&c.parks, 1);
        ThreadCounters::bump(
            &c.idle_ns,
            u64::try_from(slept.as_nanos()).unwrap_or(u64::MAX),
        );
        park = (park * 2).min(cfg.max_park);
    }
}
