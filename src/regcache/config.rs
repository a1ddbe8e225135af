//! The registration cache's limits ([`RegCacheConfig`]) and counters ([`RegCacheStats`],
//! [`LatencyHistogram`]).

use std::time::Duration;

/// Default [`RegCacheConfig::max_entries`].
pub const DEFAULT_MAX_ENTRIES: usize = 1024;
/// Default [`RegCacheConfig::max_bytes`]: 16 GiB.
pub const DEFAULT_MAX_BYTES: u64 = 16 << 30;
/// Default [`RegCacheConfig::drain_timeout`].
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_millis(100);

/// Limits of a registration cache ([`RegCache::set_config`](crate::RegCache::set_config)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegCacheConfig {
    /// Most registered bytes (of whole entries) the cache keeps.
    pub max_bytes: u64,
    /// Most entries the cache keeps (0: none outlives its last handle for long).
    pub max_entries: usize,
    /// How long an eviction waits for WQEs posted before on the PD's QPs before it
    /// deregisters anyway ([`Mr::deregister`](crate::Mr::deregister)).
    pub drain_timeout: Duration,
}

impl Default for RegCacheConfig {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_BYTES,
            max_entries: DEFAULT_MAX_ENTRIES,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        }
    }
}

/// Registration latencies in power-of-two buckets of nanoseconds: `buckets[i]` counts the
/// registrations that took `2^i ..< 2^(i+1)` ns (bucket 0 also counts 0 ns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LatencyHistogram {
    /// Counts per bucket.
    pub buckets: [u64; 64],
    /// Registrations counted.
    pub count: u64,
    /// Their total time, in ns (saturating).
    pub sum_ns: u64,
    /// The longest, in ns (0 when none).
    pub max_ns: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            buckets: [0; 64],
            count: 0,
            sum_ns: 0,
            max_ns: 0,
        }
    }
}

impl LatencyHistogram {
    /// The bucket of a latency.
    pub fn bucket_of(ns: u64) -> usize {
        63 - ns.max(1).leading_zeros() as usize
    }
    /// The range of bucket `i`, `[low, high)` in ns (`high` saturates at `u64::MAX`).
    pub fn bounds(i: usize) -> (u64, u64) {
        let i = i.min(63) as u32;
        let low = if i == 0 { 0 } else { 1u64 << i };
        (low, 1u64.checked_shl(i + 1).unwrap_or(u64::MAX))
    }
    /// Counts one latency.
    pub fn record(&mut self, ns: u64) {
        self.buckets[Self::bucket_of(ns)] += 1;
        self.count += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.max_ns = self.max_ns.max(ns);
    }
    /// The mean, in ns (`None` when empty).
    pub fn mean_ns(&self) -> Option<u64> {
        self.sum_ns.checked_div(self.count)
    }
    /// The upper bound of the bucket that holds quantile `q` (0..=1), in ns (`None` when
    /// empty).
    pub fn quantile_upper_ns(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(Self::bounds(i).1);
            }
        }
        Some(self.max_ns)
    }
}

/// A copy of a cache's counters ([`RegCache::stats`](crate::RegCache::stats)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegCacheStats {
    /// Requests served by an entry already registered.
    pub hits: u64,
    /// Requests that registered (successfully or not).
    pub misses: u64,
    /// Entries evicted (over a limit, dead, [`RegCache::clear`](crate::RegCache::clear)).
    pub evictions: u64,
    /// Evictions whose wait for WQEs in flight ran out ([`RegCacheConfig::drain_timeout`]),
    /// so the region was deregistered under them (they complete with error CQEs).
    pub forced_evictions: u64,
    /// Entries now.
    pub entries: usize,
    /// Registered bytes of those entries.
    pub bytes: u64,
    /// Entries held by at least one handle.
    pub in_use: usize,
    /// Latencies of the registrations the misses made.
    pub registration: LatencyHistogram,
}
