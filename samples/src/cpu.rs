//! Other processes' CPU around a run ([`CpuSample`], [`OtherCpu`]) and perftest's `--cpu_util`
//! figure ([`UserIdle`]).

use crate::report::Header;
use std::time::{Duration, Instant};

/// CPU time of the whole machine and of this process at one moment (from `/proc/stat` and
/// `/proc/self/stat`), to tell how much of the machine other processes took during a
/// measurement: on a small machine the engine and the initiator each want a core.
#[derive(Clone, Copy, Debug)]
pub struct CpuSample {
    busy_ticks: u64,
    own_ticks: u64,
    at: Instant,
}

impl CpuSample {
    /// Shortest window [`CpuSample::others_since`] reports on (the counters tick every 10 ms).
    pub const MIN_WINDOW: Duration = Duration::from_millis(250);

    /// Now; `None` where `/proc` does not say (not Linux, or a malformed file).
    pub fn now() -> Option<Self> {
        let cpu = machine_ticks()?;
        // user nice system idle iowait irq softirq steal (guest time is inside user)
        let busy_ticks = [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| cpu.get(i)).sum();
        let own = std::fs::read_to_string("/proc/self/stat").ok()?;
        let after = &own[own.rfind(')')? + 1..];
        let f: Vec<&str> = after.split_whitespace().collect();
        // fields 14 and 15 (utime, stime) are the 12th and 13th after the command name
        let own_ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        Some(Self {
            busy_ticks,
            own_ticks,
            at: Instant::now(),
        })
    }

    /// Cores used by other processes since `self` (USER_HZ is 100 on Linux); `None` for
    /// windows shorter than [`CpuSample::MIN_WINDOW`], too short for 10 ms ticks to say
    /// anything.
    pub fn others_since(self) -> Option<f64> {
        if self.at.elapsed() < Self::MIN_WINDOW {
            return None;
        }
        let now = Self::now()?;
        let other = now.busy_ticks.saturating_sub(self.busy_ticks) as f64
            - now.own_ticks.saturating_sub(self.own_ticks) as f64;
        Some((other / 100.0 / self.at.elapsed().as_secs_f64()).max(0.0))
    }
}

/// Cores other processes may use during a run of `put_bw` or `write_lat` before it warns that
/// its figures are low (the soft NIC's engine and the CPU initiator each want a core).
pub const OTHER_CPU_HIGH: f64 = 0.25;

/// How much CPU other processes use, around a run: a sample before the header, each timed
/// run's, and a warning after the table when any was above [`OTHER_CPU_HIGH`].
#[derive(Debug, Default)]
pub struct OtherCpu {
    /// Other processes' cores in the [`CpuSample::MIN_WINDOW`] before the run.
    pub before: Option<f64>,
    /// The most seen in a timed run.
    pub busiest: Option<f64>,
    /// Timed runs that were too short to measure.
    pub unmeasured: usize,
}

impl OtherCpu {
    /// Samples the machine for [`CpuSample::MIN_WINDOW`] (this process idle meanwhile).
    pub fn sample_before_run() -> Self {
        let s = CpuSample::now();
        std::thread::sleep(CpuSample::MIN_WINDOW);
        Self {
            before: s.and_then(CpuSample::others_since),
            ..Self::default()
        }
    }

    /// The header's line.
    pub fn header(&self, h: &mut Header) {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let v = match self.before {
            None => "not measured (no /proc/stat)".to_string(),
            Some(x) => format!(
                "{x:.2} of {cores} cores used by other processes in the {} ms before the run{} \
                 (each timed run's: other_cpu_cores in --json; a warning above {OTHER_CPU_HIGH})",
                CpuSample::MIN_WINDOW.as_millis(),
                if x > OTHER_CPU_HIGH {
                    " (HIGH: the figures will be low and vary between runs)"
                } else {
                    ""
                }
            ),
        };
        h.line("Other CPU", v);
    }

    /// Notes a timed run's figure (`None`: too short to measure); returns it for the JSON.
    pub fn record(&mut self, v: Option<f64>) -> Option<f64> {
        match v {
            Some(x) => self.busiest = Some(self.busiest.map_or(x, |b| b.max(x))),
            None => self.unmeasured += 1,
        }
        v
    }

    /// The warning to print after the table, if other processes used much CPU.
    pub fn warning(&self, test: &str) -> Option<String> {
        let high = |x: &Option<f64>| x.filter(|&x| x > OTHER_CPU_HIGH);
        match (high(&self.busiest), high(&self.before)) {
            (Some(b), _) => Some(format!(
                "{test}: warning: other processes used up to {b:.2} cores during a timed run \
                 (above {OTHER_CPU_HIGH}): the figures are low and vary between runs"
            )),
            (None, Some(b)) if self.busiest.is_none() => Some(format!(
                "{test}: warning: other processes used {b:.2} cores before the run (above \
                 {OTHER_CPU_HIGH}; the timed runs were too short to measure): the figures may \
                 be low"
            )),
            _ => None,
        }
    }
}

/// The machine's user and idle ticks (the first and fourth numbers of `/proc/stat`'s `cpu`
/// line), as perftest's `--cpu_util` reads them.
#[derive(Clone, Copy, Debug)]
pub struct UserIdle {
    user: u64,
    idle: u64,
}

impl UserIdle {
    /// The ticks now (`None` where `/proc/stat` cannot be read).
    pub fn now() -> Option<Self> {
        let f = machine_ticks()?;
        Some(Self {
            user: *f.first()?,
            idle: *f.get(3)?,
        })
    }

    /// perftest's figure: user ticks over user + idle ticks since `self`, in percent.
    pub fn util_to(self, end: Self) -> f64 {
        let u = end.user.saturating_sub(self.user) as f64;
        let i = end.idle.saturating_sub(self.idle) as f64;
        if u + i > 0.0 {
            100.0 * u / (u + i)
        } else {
            0.0
        }
    }
}

/// The numbers of `/proc/stat`'s first (`cpu`) line: the whole machine's ticks per kind
/// (user nice system idle iowait irq softirq steal ...); `None` where it cannot be read.
fn machine_ticks() -> Option<Vec<u64>> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    Some(
        line.split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_line_is_read_once_for_both_samples() {
        let t = machine_ticks().expect("/proc/stat on Linux");
        assert!(
            t.len() >= 8,
            "user nice system idle iowait irq softirq steal: {t:?}"
        );
        let (a, c) = (UserIdle::now().unwrap(), CpuSample::now().unwrap());
        // the counters only grow, and both were read after `t`
        assert!(a.user >= t[0] && a.idle >= t[3]);
        assert!(c.busy_ticks >= t[0]);
    }

    #[test]
    fn cpu_util_is_user_over_user_and_idle() {
        let a = UserIdle {
            user: 100,
            idle: 1000,
        };
        let b = UserIdle {
            user: 130,
            idle: 1090,
        };
        assert!((a.util_to(b) - 25.0).abs() < 1e-9);
        assert_eq!(a.util_to(a), 0.0);
    }
}
