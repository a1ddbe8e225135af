//! The registration cache of a protection domain ([`Pd::register_cached`]).
//!
//! Registering memory is slow (a kernel call and page pinning on a ConnectX; a table update
//! and an allocation on the soft NIC), and applications that post from many buffers, or from
//! the same buffers again and again (a bandwidth loop, an allreduce over a pool), want to
//! register each once. The cache keeps regions registered after their users let go, and hands
//! the same region out again to the next request for the same memory:
//!
//! - **Key.** An entry is found by the *identity* of the allocation
//!   ([`HostBuffer::allocation_id`](crate::HostBuffer::allocation_id), a serial number; for GPU memory CUDA's buffer ID,
//!   [`DeviceMem::buffer_id`](crate::gpu::DeviceMem::buffer_id)), never by its address, so memory freed and allocated again at
//!   the same address is a new allocation and never hits an entry of the old one; by the
//!   *access rights*, exactly (a region with more rights is not handed out for fewer); and by
//!   the *range*: a request is rounded out to whole 4 KiB pages (clipped to the allocation),
//!   and an entry of the same allocation and rights whose range covers it is a hit.
//! - **Handles.** A hit or a miss returns a [`CachedMr`], which derefs to the [`Mr`] (lkey,
//!   rkey, SGEs, remote addresses, generation) and holds the entry in use. Its offsets are
//!   the region's: the region of a whole buffer starts at the buffer, the region of a range
//!   starts at the page that holds the range's first byte ([`Mr::addr`]).
//! - **Limits and eviction.** The cache holds at most [`RegCacheConfig::max_entries`] entries
//!   and [`RegCacheConfig::max_bytes`] registered bytes; past them, the least recently used
//!   entry that no handle holds is evicted. An entry in use (a live handle: its owner may have
//!   work in flight on it) is never evicted, so the cache exceeds its limits while every entry
//!   is in use, and comes back under them at the next miss or [`RegCache::trim`]. Eviction
//!   first stops new use (the entry leaves the index: a request for the same memory misses
//!   and registers anew), then waits, at most [`RegCacheConfig::drain_timeout`], for the WQEs
//!   posted before on the PD's QPs ([`Mr::deregister`]'s wait; for WQEs posted with a handle
//!   that was dropped too early), then deregisters. An entry whose memory nothing but the
//!   cache holds any more (every [`HostBuffer`](crate::HostBuffer) or [`DeviceMem`](crate::gpu::DeviceMem) of the allocation dropped) can
//!   never be asked for again: it is evicted first, at the next miss or trim, which also frees
//!   its memory (a cached region keeps its memory alive, as every region does).
//! - **Counters.** [`RegCache::stats`]: hits, misses, evictions (and those that found work
//!   still in flight when the wait ended), entries, bytes, entries in use, and a histogram of
//!   registration latencies (power-of-two buckets of nanoseconds).
//!
//! The cache registers with the PD's ordinary calls ([`Pd::register_with`],
//! [`Pd::register_device_mem`] and their range forms), so it works wherever they do: host
//! memory and GPU memory on both backends (on mlx5 through dma-buf or nvidia-peermem, as
//! [`Pd::register_device_mem`]). Registration runs outside the
//! cache's lock, so two threads that miss on the same memory at once may both register it (two
//! entries, both valid).

mod config;
mod source;

pub use config::{
    LatencyHistogram, RegCacheConfig, RegCacheStats, DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
};
pub use source::CacheableMemory;
#[cfg(test)]
use source::SimAlloc;
use source::{register, resolve, AllocId, Source};

use crate::memory::{Access, Mr, Pd};
use crate::Error;
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};
use verbs::buffer::PAGE;

/// An entry: one registration, and how it is found.
struct Entry {
    id: u64,
    key: (AllocId, u32),
    /// The registered range `[start, end)`.
    start: u64,
    end: u64,
    /// The allocation, weakly: dead when only the region holds it.
    owner: Option<Weak<dyn Any + Send + Sync>>,
    /// Set when evicted: how long its drop waits for WQEs in flight.
    drain: OnceLock<Duration>,
    counters: Arc<Counters>,
    mr: Mr,
}

impl Entry {
    /// Whether nothing but the region holds the allocation any more.
    fn dead(&self) -> bool {
        self.owner.as_ref().is_some_and(|w| w.strong_count() <= 1)
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let Some(&timeout) = self.drain.get() else {
            // the cache is going away: a plain drop (which warns about work in flight)
            return;
        };
        match self.mr.wait_idle(timeout) {
            Ok(()) => {}
            Err(report) if report.qps.iter().all(|q| q.blocks.is_none()) => {
                // the mlx5 backend cannot say; an idle entry has no handle, so its users
                // said they were done with it
            }
            Err(report) => {
                self.counters.forced.fetch_add(1, Relaxed);
                tracing::warn!(
                    error = %report,
                    "registration cache: evicting a region whose wait for WQEs in flight ran out"
                );
            }
        }
        self.mr.set_quiet();
    }
}

/// Counters updated outside the lock.
#[derive(Default)]
struct Counters {
    forced: AtomicU64,
}

/// An entry in the table.
struct Slot {
    entry: Arc<Entry>,
    users: usize,
    last_use: u64,
}

struct State {
    config: RegCacheConfig,
    slots: HashMap<u64, Slot>,
    index: HashMap<(AllocId, u32), Vec<u64>>,
    bytes: u64,
    clock: u64,
    next_id: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    latency: LatencyHistogram,
}

impl Default for State {
    fn default() -> Self {
        Self {
            config: RegCacheConfig::default(),
            slots: HashMap::new(),
            index: HashMap::new(),
            bytes: 0,
            clock: 0,
            next_id: 1,
            hits: 0,
            misses: 0,
            evictions: 0,
            latency: LatencyHistogram::default(),
        }
    }
}

impl State {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// An entry of `key` whose range covers `[start, end)`, taken for one more user.
    fn take(&mut self, key: (AllocId, u32), start: u64, end: u64) -> Option<Arc<Entry>> {
        let now = self.tick();
        let ids = self.index.get(&key)?;
        let id = *ids.iter().find(|id| {
            self.slots
                .get(id)
                .is_some_and(|s| s.entry.start <= start && end <= s.entry.end)
        })?;
        let slot = self.slots.get_mut(&id)?;
        slot.users += 1;
        slot.last_use = now;
        Some(slot.entry.clone())
    }

    /// Takes entry `id` out of the table (no new use), marked to wait `drain` when it drops.
    fn remove(&mut self, id: u64, drain: Duration) -> Option<Arc<Entry>> {
        let slot = self.slots.remove(&id)?;
        let e = slot.entry;
        if let Some(ids) = self.index.get_mut(&e.key) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                self.index.remove(&e.key);
            }
        }
        self.bytes -= e.end - e.start;
        self.evictions += 1;
        let _ = e.drain.set(drain);
        Some(e)
    }

    /// Takes out the entries to evict: every idle dead one, then the least recently used idle
    /// ones while over a limit (all idle ones with `all`).
    fn victims(&mut self, all: bool) -> Vec<Arc<Entry>> {
        let drain = self.config.drain_timeout;
        let dead: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, s)| s.users == 0 && (all || s.entry.dead()))
            .map(|(&id, _)| id)
            .collect();
        let mut out: Vec<Arc<Entry>> = dead
            .into_iter()
            .filter_map(|id| self.remove(id, drain))
            .collect();
        while self.slots.len() > self.config.max_entries || self.bytes > self.config.max_bytes {
            let lru = self
                .slots
                .iter()
                .filter(|(_, s)| s.users == 0)
                .min_by_key(|(_, s)| s.last_use)
                .map(|(&id, _)| id);
            match lru.and_then(|id| self.remove(id, drain)) {
                Some(e) => out.push(e),
                None => break,
            }
        }
        out
    }
}

struct Shared {
    state: Mutex<State>,
    counters: Arc<Counters>,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            state: Mutex::new(State::default()),
            counters: Arc::default(),
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The registration cache of a PD ([`Pd::reg_cache`]); clones of the PD share it.
#[derive(Clone, Default)]
pub struct RegCache {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RegCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("RegCache")
            .field("entries", &st.slots.len())
            .field("bytes", &st.bytes)
            .field("config", &st.config)
            .finish()
    }
}

impl RegCache {
    /// The limits in force.
    pub fn config(&self) -> RegCacheConfig {
        self.shared.lock().config
    }

    /// New limits; entries over them that no handle holds are evicted now.
    pub fn set_config(&self, config: RegCacheConfig) {
        self.shared.lock().config = config;
        self.trim();
    }

    /// Evicts the entries whose memory is gone, and the least recently used idle ones while
    /// the cache is over a limit (each eviction waits as [`RegCacheConfig::drain_timeout`]
    /// says before it deregisters).
    pub fn trim(&self) {
        let victims = self.shared.lock().victims(false);
        drop(victims);
    }

    /// Evicts every entry that no handle holds.
    pub fn clear(&self) {
        let victims = self.shared.lock().victims(true);
        drop(victims);
    }

    /// A copy of the counters.
    pub fn stats(&self) -> RegCacheStats {
        let st = self.shared.lock();
        RegCacheStats {
            hits: st.hits,
            misses: st.misses,
            evictions: st.evictions,
            forced_evictions: self.shared.counters.forced.load(Relaxed),
            entries: st.slots.len(),
            bytes: st.bytes,
            in_use: st.slots.values().filter(|s| s.users > 0).count(),
            registration: st.latency.clone(),
        }
    }

    fn get(
        &self,
        pd: &Pd,
        mem: &Source<'_>,
        off: u64,
        len: u64,
        access: Access,
    ) -> Result<CachedMr, Error> {
        let r = resolve(mem)?;
        if len == 0 {
            return Err(Error::InvalidArgument(
                "an empty range cannot be registered".into(),
            ));
        }
        if off.checked_add(len).is_none_or(|e| e > r.len) {
            return Err(Error::InvalidArgument(format!(
                "{off}+{len} is beyond the {} bytes of the memory",
                r.len
            )));
        }
        // Rounded out to whole pages, clipped to the allocation.
        let page = PAGE as u64;
        let first = r.base + off;
        let start = (first & !(page - 1)).max(r.base);
        let end = (first + len)
            .checked_next_multiple_of(page)
            .unwrap_or(u64::MAX)
            .min(r.base + r.len);
        let key = (r.id, access.0);
        {
            let mut st = self.shared.lock();
            if let Some(entry) = st.take(key, start, end) {
                st.hits += 1;
                return Ok(CachedMr {
                    entry,
                    cache: self.shared.clone(),
                });
            }
            st.misses += 1;
        }
        let t = Instant::now();
        let mr = register(pd, mem, start - r.base, end - start, access)?;
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let victims;
        let entry;
        {
            let mut st = self.shared.lock();
            st.latency.record(ns);
            let id = st.next_id;
            st.next_id += 1;
            entry = Arc::new(Entry {
                id,
                key,
                start,
                end,
                owner: r.owner,
                drain: OnceLock::new(),
                counters: self.shared.counters.clone(),
                mr,
            });
            let now = st.tick();
            st.slots.insert(
                id,
                Slot {
                    entry: entry.clone(),
                    users: 1,
                    last_use: now,
                },
            );
            st.index.entry(key).or_default().push(id);
            st.bytes += end - start;
            victims = st.victims(false);
        }
        // deregistered outside the lock (each waits for WQEs in flight, bounded)
        drop(victims);
        Ok(CachedMr {
            entry,
            cache: self.shared.clone(),
        })
    }
}

/// A region from the registration cache, held in use: it derefs to the [`Mr`] (lkey, rkey,
/// [`Mr::sge`], [`Mr::remote`], [`Mr::generation`]). While any handle of an entry lives, the
/// entry is never evicted: hold one for as long as WQEs that use the region may be in flight.
/// Clones hold the same entry.
pub struct CachedMr {
    entry: Arc<Entry>,
    cache: Arc<Shared>,
}

impl CachedMr {
    /// The region.
    pub fn mr(&self) -> &Mr {
        &self.entry.mr
    }
}

impl std::ops::Deref for CachedMr {
    type Target = Mr;
    fn deref(&self) -> &Mr {
        &self.entry.mr
    }
}

impl Clone for CachedMr {
    fn clone(&self) -> Self {
        let mut st = self.cache.lock();
        if let Some(s) = st.slots.get_mut(&self.entry.id) {
            s.users += 1;
        }
        drop(st);
        Self {
            entry: self.entry.clone(),
            cache: self.cache.clone(),
        }
    }
}

impl Drop for CachedMr {
    fn drop(&mut self) {
        let mut st = self.cache.lock();
        let now = st.tick();
        if let Some(s) = st.slots.get_mut(&self.entry.id) {
            s.users = s.users.saturating_sub(1);
            s.last_use = now;
        }
    }
}

impl std::fmt::Debug for CachedMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CachedMr").field(&self.entry.mr).finish()
    }
}

impl Pd {
    /// A region of all of `mem` ([`HostBuffer`](crate::HostBuffer) or [`DeviceMem`](crate::gpu::DeviceMem)) with rights `access`, from
    /// the PD's registration cache: the entry already registered for this allocation and
    /// these rights (a hit), or a new registration (a miss). See [`crate::regcache`].
    ///
    /// Errors: those of the registration ([`Pd::register_with`], [`Pd::register_device_mem`]),
    /// `Error::Cuda` when CUDA
    /// cannot say the GPU allocation's buffer ID, `Error::InvalidArgument` for empty memory.
    pub fn register_cached<M: CacheableMemory + ?Sized>(
        &self,
        mem: &M,
        access: Access,
    ) -> Result<CachedMr, Error> {
        let src = mem.source();
        let len = match &src {
            Source::Host(b) => b.len() as u64,
            Source::Device(m) => m.len() as u64,
            #[cfg(test)]
            Source::Sim(s) => s.len,
        };
        self.reg_cache().get(self, &src, 0, len, access)
    }

    /// A region that covers `off..off+len` of `mem`, from the registration cache: the range
    /// is rounded out to whole pages (clipped to the memory), and any entry of the same
    /// allocation and rights that covers those pages serves it. The region's offsets count
    /// from its first byte, [`Mr::addr`] (the start of the page that holds `off`, or of the
    /// memory), not from `mem`'s. `Error::InvalidArgument` for an empty range or one beyond
    /// the memory.
    pub fn register_cached_range<M: CacheableMemory + ?Sized>(
        &self,
        mem: &M,
        off: u64,
        len: u64,
        access: Access,
    ) -> Result<CachedMr, Error> {
        self.reg_cache().get(self, &mem.source(), off, len, access)
    }

    /// The PD's registration cache: limits, counters, trimming.
    pub fn reg_cache(&self) -> &RegCache {
        self.cache
            .get_or_init(|| Box::new(RegCache::default()))
            .downcast_ref()
            .expect("a PD's cache slot holds its RegCache")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostBuffer;
    use crate::testing::soft_pair;
    use crate::{Context, DeviceRequest};
    use prm::wqe::{CtrlFlags, Local, Op};
    use verbs::initiator::RingMode;
    use verbs::MemKind;
    use verbs::SimDeviceMemory;

    const T: Duration = Duration::from_secs(10);
    const LW: Access = Access::LOCAL_WRITE;

    fn soft() -> (Context, Pd) {
        let ctx = Context::open(DeviceRequest::Soft).unwrap();
        let pd = ctx.alloc_pd();
        (ctx, pd)
    }

    /// Whether `key` is a live region of `ctx`'s device.
    fn live(ctx: &Context, key: prm::Lkey) -> bool {
        ctx.soft_device().unwrap().mr(key.0).is_some()
    }

    fn limits(max_entries: usize, max_bytes: u64) -> RegCacheConfig {
        RegCacheConfig {
            max_entries,
            max_bytes,
            ..Default::default()
        }
    }

    #[test]
    fn the_second_registration_of_a_buffer_is_a_hit_on_the_same_region() {
        let (ctx, pd) = soft();
        let buf = HostBuffer::new(10_000);
        let cold = pd.register_cached(&buf, LW).unwrap();
        let st = pd.reg_cache().stats();
        assert_eq!((st.hits, st.misses, st.entries, st.in_use), (0, 1, 1, 1));
        assert_eq!(st.bytes, 10_000, "a whole buffer: its bytes, not more");
        assert_eq!(st.registration.count, 1);
        assert_eq!(st.registration.buckets.iter().sum::<u64>(), 1);
        let warm = pd.register_cached(&buf, LW).unwrap();
        let st = pd.reg_cache().stats();
        assert_eq!((st.hits, st.misses, st.entries), (1, 1, 1));
        assert_eq!(
            (warm.lkey(), warm.rkey(), warm.generation()),
            (cold.lkey(), cold.rkey(), cold.generation())
        );
        assert_eq!((warm.addr(), warm.len()), (buf.addr(), 10_000));
        assert_eq!(warm.sge(8, 16).addr, buf.addr() + 8);
        assert_eq!(warm.kind(), MemKind::Host);
        drop((cold, warm));
        // idle, the entry stays registered, and is found again
        assert_eq!(pd.reg_cache().stats().in_use, 0);
        let again = pd.register_cached(&buf, LW).unwrap();
        assert!(live(&ctx, again.lkey()));
        assert_eq!(pd.reg_cache().stats().hits, 2);
        // other rights are another entry
        let remote = pd.register_cached(&buf, LW | Access::REMOTE_READ).unwrap();
        assert_ne!(remote.lkey(), again.lkey());
        assert_eq!(remote.access(), LW | Access::REMOTE_READ);
        let st = pd.reg_cache().stats();
        assert_eq!((st.hits, st.misses, st.entries), (2, 2, 2));
        // a clone of the PD shares the cache
        let twin = pd.clone();
        assert_eq!(twin.register_cached(&buf, LW).unwrap().lkey(), again.lkey());
        // a clone of the buffer is the same allocation
        assert_eq!(
            pd.register_cached(&buf.clone(), LW).unwrap().lkey(),
            again.lkey()
        );
    }

    #[test]
    fn ranges_are_rounded_to_pages_and_served_by_an_entry_that_covers_them() {
        let (_ctx, pd) = soft();
        let buf = HostBuffer::new(4 * PAGE);
        let a = pd.register_cached_range(&buf, 100, 200, LW).unwrap();
        assert_eq!((a.addr(), a.len()), (buf.addr(), PAGE as u64));
        let b = pd.register_cached_range(&buf, 300, 50, LW).unwrap();
        assert_eq!(b.lkey(), a.lkey(), "the same page");
        assert_eq!(pd.reg_cache().stats().misses, 1);
        // straddling two pages: both
        let c = pd
            .register_cached_range(&buf, PAGE as u64 * 2 - 1, 2, LW)
            .unwrap();
        assert_eq!(
            (c.addr(), c.len()),
            (buf.addr() + PAGE as u64, 2 * PAGE as u64)
        );
        // the whole buffer is not inside page 0: a miss; then every range is inside it
        let all = pd.register_cached(&buf, LW).unwrap();
        assert_ne!(all.lkey(), a.lkey());
        assert_eq!(pd.reg_cache().stats().misses, 3);
        let d = pd
            .register_cached_range(&buf, 3 * PAGE as u64 + 5, 10, LW)
            .unwrap();
        assert_eq!(d.lkey(), all.lkey());
        // bad ranges are errors, not panics, and register nothing
        let bad = [(0, 0), (1, 4 * PAGE as u64), (u64::MAX, 2)];
        for (off, len) in bad {
            assert!(
                matches!(
                    pd.register_cached_range(&buf, off, len, LW),
                    Err(Error::InvalidArgument(_))
                ),
                "{off}+{len}"
            );
        }
        assert!(matches!(
            pd.register_cached(&HostBuffer::new(0), LW),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(pd.reg_cache().stats().misses, 3);
    }

    #[test]
    fn least_recently_used_idle_entries_go_first_and_entries_in_use_never() {
        let (ctx, pd) = soft();
        pd.reg_cache().set_config(limits(2, u64::MAX));
        let bufs: Vec<HostBuffer> = (0..4).map(|_| HostBuffer::new(64)).collect();
        let k0 = pd.register_cached(&bufs[0], LW).unwrap().lkey();
        let k1 = pd.register_cached(&bufs[1], LW).unwrap().lkey();
        // touch 0: 1 is now the least recently used
        drop(pd.register_cached(&bufs[0], LW).unwrap());
        let h2 = pd.register_cached(&bufs[2], LW).unwrap();
        let st = pd.reg_cache().stats();
        assert_eq!((st.entries, st.evictions, st.forced_evictions), (2, 1, 0));
        assert!(!live(&ctx, k1), "evicted: deregistered");
        assert!(live(&ctx, k0));
        // 1 misses again; 0 is the LRU idle one now (2 is in use)
        let h1 = pd.register_cached(&bufs[1], LW).unwrap();
        assert_ne!(h1.lkey(), k1, "a new registration");
        assert!(!live(&ctx, k0));
        // every entry in use: the cache goes over its limit rather than evict one
        let h3 = pd.register_cached(&bufs[3], LW).unwrap();
        let st = pd.reg_cache().stats();
        assert_eq!((st.entries, st.in_use, st.evictions), (3, 3, 2));
        for h in [&h1, &h2, &h3] {
            assert!(live(&ctx, h.lkey()));
        }
        // a clone holds the entry too
        let h3b = h3.clone();
        drop((h1, h3));
        pd.reg_cache().trim();
        let st = pd.reg_cache().stats();
        assert_eq!((st.entries, st.in_use), (2, 2), "1 was the idle one");
        drop((h2, h3b));
        pd.reg_cache().clear();
        let st = pd.reg_cache().stats();
        assert_eq!((st.entries, st.bytes, st.evictions), (0, 0, 5));
        assert_eq!((st.hits, st.misses), (1, 5));
    }

    #[test]
    fn the_byte_limit_evicts_too() {
        let (ctx, pd) = soft();
        pd.reg_cache().set_config(limits(100, 2 * PAGE as u64));
        let bufs: Vec<HostBuffer> = (0..3).map(|_| HostBuffer::new(PAGE)).collect();
        let keys: Vec<prm::Lkey> = bufs
            .iter()
            .map(|b| pd.register_cached(b, LW).unwrap().lkey())
            .collect();
        let st = pd.reg_cache().stats();
        assert_eq!(
            (st.entries, st.bytes, st.evictions),
            (2, 2 * PAGE as u64, 1)
        );
        assert!(!live(&ctx, keys[0]) && live(&ctx, keys[1]) && live(&ctx, keys[2]));
        // lower limits take effect at once
        pd.reg_cache().set_config(limits(1, u64::MAX));
        assert_eq!(pd.reg_cache().stats().entries, 1);
        assert!(!live(&ctx, keys[1]) && live(&ctx, keys[2]));
    }

    #[test]
    fn a_freed_and_reused_address_never_hits_the_old_entry() {
        let (ctx, pd) = soft();
        let rights = LW | Access::REMOTE_WRITE;
        // An allocator handing the same memory out again: the same address, a new allocation.
        let memory = HostBuffer::new(PAGE);
        let first = HostBuffer::alias_of(&memory);
        let old = pd.register_cached(&first, rights).unwrap();
        let (old_key, old_rkey, old_gen) = (old.lkey(), old.rkey(), old.generation());
        drop(old);
        drop(first); // freed: only the cache holds it now
        let second = HostBuffer::alias_of(&memory);
        assert_eq!(second.addr(), memory.addr());
        let new = pd.register_cached(&second, rights).unwrap();
        let st = pd.reg_cache().stats();
        assert_eq!(
            (st.hits, st.misses),
            (0, 2),
            "keyed by identity, not address"
        );
        assert_ne!(new.rkey(), old_rkey);
        assert_ne!(new.generation(), old_gen);
        // the dead entry (nobody can ask for it again) went at that miss
        assert_eq!((st.entries, st.evictions), (1, 1));
        assert!(!live(&ctx, old_key));
        drop(new);

        // The same with the real allocator, which may or may not reuse the address.
        let mut b = HostBuffer::new(PAGE);
        let mut last = pd.register_cached(&b, LW).unwrap().lkey();
        for _ in 0..8 {
            let addr = b.addr();
            drop(b);
            pd.reg_cache().trim(); // frees the memory of the dead entry
            b = HostBuffer::new(PAGE);
            let before = pd.reg_cache().stats();
            let h = pd.register_cached(&b, LW).unwrap();
            let after = pd.reg_cache().stats();
            assert_eq!(
                after.misses,
                before.misses + 1,
                "reused: {}",
                b.addr() == addr
            );
            assert_ne!(h.lkey(), last);
            last = h.lkey();
        }
    }

    #[test]
    fn eviction_stops_new_use_then_waits_for_work_in_flight_then_deregisters() {
        let t = soft_pair();
        let (a, pa, pb, qa) = (&t.a, &t.pa, &t.pb, &t.qa);
        let (src, dst) = (HostBuffer::new(PAGE), HostBuffer::new(PAGE));
        src.fill(0, 64, 0x3c);
        let dmr = pb.register_with(&dst, LW | Access::REMOTE_WRITE).unwrap();
        pa.reg_cache().set_config(RegCacheConfig {
            drain_timeout: Duration::from_secs(60),
            ..Default::default()
        });
        let h = pa.register_cached(&src, LW).unwrap();
        let key = h.lkey();
        // Posted while the QP is below RTS: it waits there.
        let mut ini = qa.cpu_initiator(RingMode::Doca);
        let op = Op::Write {
            remote: dmr.remote(0),
            local: Local::Sges(&[h.sge(0, 64)]),
            imm: None,
        };
        ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
        drop(h); // too early: the WQE has not run (what the eviction's wait is for)
        let cache = pa.reg_cache().clone();
        let evict = std::thread::spawn(move || cache.clear());
        // the entry leaves the index first...
        let deadline = Instant::now() + Duration::from_secs(60);
        while pa.reg_cache().stats().evictions == 0 {
            assert!(Instant::now() < deadline, "the eviction never started");
            std::thread::yield_now();
        }
        // ...so a new request registers anew, while the old region is still registered
        let fresh = pa.register_cached(&src, LW).unwrap();
        assert_ne!(fresh.lkey(), key);
        assert_eq!(pa.reg_cache().stats().misses, 2);
        assert!(live(a, key), "deregistered only once the WQE is done");
        t.connect(Access::REMOTE_WRITE);
        let c = ini.wait_send(T).unwrap();
        assert!(matches!(c, prm::Completion::Req { .. }), "{c:?}");
        evict.join().unwrap();
        assert!(!live(a, key));
        assert_eq!(dst.to_vec()[..64], [0x3c; 64]);
        assert_eq!(pa.reg_cache().stats().forced_evictions, 0);
    }

    #[test]
    fn an_eviction_whose_wait_runs_out_is_counted_and_the_wqe_fails() {
        let t = soft_pair();
        let (a, pa, pb, qa) = (&t.a, &t.pa, &t.pb, &t.qa);
        let (src, dst) = (HostBuffer::new(PAGE), HostBuffer::new(PAGE));
        let dmr = pb.register_with(&dst, LW | Access::REMOTE_WRITE).unwrap();
        pa.reg_cache().set_config(RegCacheConfig {
            drain_timeout: Duration::ZERO,
            ..Default::default()
        });
        let h = pa.register_cached(&src, LW).unwrap();
        let key = h.lkey();
        let mut ini = qa.cpu_initiator(RingMode::Doca);
        let op = Op::Write {
            remote: dmr.remote(0),
            local: Local::Sges(&[h.sge(0, 64)]),
            imm: None,
        };
        ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
        drop(h);
        pa.reg_cache().clear();
        let st = pa.reg_cache().stats();
        assert_eq!((st.evictions, st.forced_evictions), (1, 1));
        assert!(!live(a, key));
        t.connect(Access::REMOTE_WRITE);
        match ini.wait_send(T).unwrap() {
            prm::Completion::Error(e) => assert_eq!(e.syndrome(), Some(prm::Syndrome::LocalProt)),
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn gpu_memory_regions_are_cached_on_the_soft_backend() {
        let (ctx, pd) = soft();
        let gpu = SimDeviceMemory::new(1 << 20);
        let mem = SimAlloc {
            mem: gpu.clone(),
            base: gpu.base(),
            len: 1 << 16,
            id: 7,
        };
        let cold = pd.register_cached(&mem, LW).unwrap();
        assert_eq!(cold.kind(), MemKind::Device);
        assert_eq!((cold.addr(), cold.len()), (gpu.base(), 1 << 16));
        let warm = pd.register_cached(&mem, LW).unwrap();
        assert_eq!(warm.lkey(), cold.lkey());
        let part = pd.register_cached_range(&mem, 5000, 10, LW).unwrap();
        assert_eq!(
            part.lkey(),
            cold.lkey(),
            "inside the whole allocation's entry"
        );
        // another allocation at the same address (its buffer ID differs): a miss
        let other = SimAlloc {
            mem: gpu.clone(),
            base: gpu.base(),
            len: 1 << 16,
            id: 8,
        };
        let o = pd.register_cached(&other, LW).unwrap();
        assert_ne!(o.lkey(), cold.lkey());
        let st = pd.reg_cache().stats();
        assert_eq!((st.hits, st.misses), (2, 2));
        assert!(live(&ctx, o.lkey()));
    }

    #[test]
    fn latency_buckets_are_powers_of_two() {
        assert_eq!(LatencyHistogram::bucket_of(0), 0);
        assert_eq!(LatencyHistogram::bucket_of(1), 0);
        assert_eq!(LatencyHistogram::bucket_of(2), 1);
        assert_eq!(LatencyHistogram::bucket_of(1023), 9);
        assert_eq!(LatencyHistogram::bucket_of(1024), 10);
        assert_eq!(LatencyHistogram::bucket_of(u64::MAX), 63);
        assert_eq!(LatencyHistogram::bounds(0), (0, 2));
        assert_eq!(LatencyHistogram::bounds(10), (1024, 2048));
        assert_eq!(LatencyHistogram::bounds(63), (1 << 63, u64::MAX));
        let mut h = LatencyHistogram::default();
        assert_eq!((h.mean_ns(), h.quantile_upper_ns(0.5)), (None, None));
        for ns in [100, 200, 3000, 5000] {
            h.record(ns);
        }
        assert_eq!((h.count, h.sum_ns, h.max_ns), (4, 8300, 5000));
        assert_eq!(h.mean_ns(), Some(2075));
        assert_eq!(h.quantile_upper_ns(0.5), Some(256));
        assert_eq!(h.quantile_upper_ns(1.0), Some(8192));
    }
}
