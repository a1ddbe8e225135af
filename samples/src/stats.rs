//! The numbers: bandwidth [`Units`], the peak rate ([`Peak`]), the latency columns
//! ([`LatStats`]), and the [`Progress`] line of long sweeps.

use serde::{Deserialize, Serialize};
use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

/// Bandwidth units: perftest's MB/sec (2^20 bytes) or, with `--report-gbits`, Gb/sec (10^9
/// bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Units {
    /// 2^20 bytes per second.
    MBytes,
    /// 10^9 bits per second.
    Gbits,
}

impl Units {
    /// The bandwidth of `bytes` in `secs`.
    pub fn bw(self, bytes: f64, secs: f64) -> f64 {
        if secs <= 0.0 {
            return 0.0;
        }
        match self {
            Self::MBytes => bytes / secs / (1u64 << 20) as f64,
            Self::Gbits => bytes * 8.0 / secs / 1e9,
        }
    }
    /// The label in the table header (`MB/sec` or `Gb/sec`).
    pub fn label(self) -> &'static str {
        match self {
            Self::MBytes => "MB/sec",
            Self::Gbits => "Gb/sec",
        }
    }
}

/// The completion timeline of a CPU run: after each polling pass that took completions, the
/// time and the number of messages completed so far. The peak rate is the best over windows of
/// at least `window` messages. One sample per pass (not per CQE) keeps a burst of CQEs taken at
/// once, after the thread was descheduled, from looking like an instant: it counts from the
/// previous pass, which saw none of them.
#[derive(Default)]
pub struct Peak {
    samples: Vec<(Instant, u64)>,
}

impl Peak {
    /// An empty timeline with room for `n` samples.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            samples: Vec::with_capacity(n),
        }
    }
    /// Records that `done` messages had completed when a pass ended at `t` (`done` does not
    /// decrease).
    pub fn record(&mut self, t: Instant, done: u64) {
        self.samples.push((t, done));
    }
    /// Forgets every sample.
    pub fn clear(&mut self) {
        self.samples.clear();
    }
    /// The best message rate (per second) over windows of at least `window` messages, if any
    /// window has a measurable duration.
    pub fn best_rate(&self, window: u64) -> Option<f64> {
        let s = &self.samples;
        let mut best: Option<f64> = None;
        let mut j = 0;
        for i in 1..s.len() {
            // The latest start that still leaves `window` messages.
            while j + 1 < i && s[i].1 - s[j + 1].1 >= window {
                j += 1;
            }
            let n = s[i].1 - s[j].1;
            if n >= window {
                let dt = s[i].0.saturating_duration_since(s[j].0).as_secs_f64();
                if dt > 0.0 {
                    let r = n as f64 / dt;
                    best = Some(best.map_or(r, |b: f64| b.max(r)));
                }
            }
        }
        best
    }
}

/// perftest's latency columns, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatStats {
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// Median.
    pub typical: f64,
    /// Mean.
    pub avg: f64,
    /// Standard deviation (population).
    pub stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl LatStats {
    /// The statistics of `us` (sorted in place). Empty input gives zeros.
    pub fn of(us: &mut [f64]) -> Self {
        if us.is_empty() {
            return Self::default();
        }
        us.sort_by(f64::total_cmp);
        let n = us.len();
        let avg = us.iter().sum::<f64>() / n as f64;
        let var = us.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n as f64;
        let pct = |p: f64| us[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self {
            min: us[0],
            max: us[n - 1],
            typical: us[n / 2],
            avg,
            stdev: var.sqrt(),
            p99: pct(0.99),
            p999: pct(0.999),
        }
    }
}

/// A progress line for sweeps that run longer than a couple of seconds: on stderr, and only when
/// stderr is a terminal, as one line rewritten in place (`\r`) that [`Progress::clear`] erases
/// before each table row and at the end (also when the run fails: on drop), so it never ends up
/// inside the table. Not on a terminal (a pipe, a file, a log) nothing is written.
pub struct Progress {
    test: &'static str,
    start: Instant,
    last: Instant,
    total: usize,
    /// Where the line goes (stderr on a terminal; `None`: nowhere).
    out: Option<Box<dyn std::io::Write>>,
    /// Quiet time before the first line.
    delay: Duration,
    shown: bool,
}

impl Progress {
    /// Progress of `total` sizes, on stderr when it is a terminal.
    pub fn new(test: &'static str, total: usize) -> Self {
        let tty = std::io::stderr().is_terminal();
        let out: Option<Box<dyn std::io::Write>> = if tty {
            Some(Box::new(std::io::stderr()))
        } else {
            None
        };
        Self::to(test, total, out, Duration::from_secs(2))
    }

    /// Progress of `total` sizes written to `out` (a terminal), the first line after `delay`.
    pub fn to(
        test: &'static str,
        total: usize,
        out: Option<Box<dyn std::io::Write>>,
        delay: Duration,
    ) -> Self {
        let now = Instant::now();
        Self {
            test,
            start: now,
            last: now,
            total,
            out,
            delay,
            shown: false,
        }
    }

    /// Says that `done` of the sizes are finished, the last one being `size` bytes.
    pub fn step(&mut self, done: usize, size: u64) {
        let Some(out) = self.out.as_mut() else {
            return;
        };
        if self.total < 2 || done >= self.total {
            return;
        }
        let now = Instant::now();
        let elapsed = now.duration_since(self.start);
        // Not before the delay; then at most every second.
        if elapsed < self.delay || (self.shown && now.duration_since(self.last).as_secs() < 1) {
            return;
        }
        self.last = now;
        self.shown = true;
        let _ = write!(
            out,
            "\r{}: {done}/{} sizes done (last {size} B), {:.1} s\x1b[K",
            self.test,
            self.total,
            elapsed.as_secs_f64()
        );
        let _ = out.flush();
    }

    /// Erases the line, if one is shown, before table output (or anything else) continues.
    pub fn clear(&mut self) {
        if let Some(out) = self.out.as_mut().filter(|_| self.shown) {
            let _ = write!(out, "\r\x1b[K");
            let _ = out.flush();
            self.shown = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn latency_columns() {
        let mut v: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        let s = LatStats::of(&mut v);
        assert_eq!((s.min, s.max), (1.0, 1000.0));
        assert_eq!(s.typical, 501.0);
        assert_eq!(s.avg, 500.5);
        assert_eq!(s.p99, 990.0);
        assert_eq!(s.p999, 999.0);
        assert!((s.stdev - 288.675).abs() < 0.01, "{}", s.stdev);
        let one = LatStats::of(&mut [3.0]);
        assert_eq!((one.min, one.p999, one.stdev), (3.0, 3.0, 0.0));
        assert_eq!(LatStats::of(&mut []), LatStats::default());
    }

    #[test]
    fn peak_is_the_best_window() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut p = Peak::default();
        // 10 messages per ms for 10 ms, then 40 per ms for 2 ms.
        for i in 0..=10 {
            p.record(ms(i), 10 * i);
        }
        p.record(ms(11), 140);
        p.record(ms(12), 180);
        let best = p.best_rate(80).unwrap();
        assert!((best - 80.0 / 0.002).abs() < 1.0, "{best}");
        // A window longer than the run has no rate.
        assert_eq!(p.best_rate(1000), None);
        // Windows of at least 100 messages cannot pick the 2-ms burst alone.
        let wide = p.best_rate(100).unwrap();
        assert!(wide < best && (wide - 100.0 / 0.004).abs() < 1.0, "{wide}");
        // The whole run.
        assert!((p.best_rate(180).unwrap() - 180.0 / 0.012).abs() < 1.0);
    }

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Shared(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn progress_is_one_line_rewritten_and_erased() {
        let buf = Shared::default();
        let mut p = Progress::to("t", 3, Some(Box::new(buf.clone())), Duration::ZERO);
        p.step(1, 2);
        let shown = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(
            shown.starts_with("\rt: 1/3 sizes done (last 2 B)"),
            "{shown:?}"
        );
        assert!(!shown.contains('\n'), "{shown:?}");
        p.clear();
        p.clear();
        let after = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(after, format!("{shown}\r\x1b[K"), "erased once");
        // Shown again, then erased on drop (a run that fails).
        p.step(2, 4);
        drop(p);
        let end = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(end.ends_with("\r\x1b[K") && end.contains("2/3"), "{end:?}");
        // Nowhere to write (not a terminal): nothing happens.
        let mut q = Progress::to("t", 3, None, Duration::ZERO);
        q.step(1, 2);
        q.clear();
    }
}
