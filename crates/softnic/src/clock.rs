//! The device's free-running clock, which it stamps into every CQE it writes (as a ConnectX
//! stamps its internal timer): nanoseconds of the host's `CLOCK_MONOTONIC`, so it counts at
//! [`KHZ`] and never wraps within [`MASK`]. The emulation publishes the clock-info page that
//! turns these stamps into wall-clock time.

/// The clock's frequency in kHz (what `hca_core_clock` reports): one tick per nanosecond.
pub const KHZ: u64 = 1_000_000;

/// The bits a stamp uses (`completion_timestamp_mask`).
pub const MASK: u64 = (1 << 63) - 1;

/// Ticks of `clock_id` (a `CLOCK_*` id) in nanoseconds.
pub fn read(clock_id: libc::clockid_t) -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec the call writes; the clocks used here always exist.
    unsafe { libc::clock_gettime(clock_id, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The clock now.
pub fn now() -> u64 {
    read(libc::CLOCK_MONOTONIC) & MASK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_counts_nanoseconds_forward() {
        let a = now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = now();
        assert!(b > a && b - a >= 2_000_000, "{a} {b}");
        assert!(b - a < 10_000_000_000);
    }
}
