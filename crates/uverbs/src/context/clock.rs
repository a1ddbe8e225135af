//! The clock-info page (`MLX5_IB_MMAP_CLOCK_INFO`, version 1): what libmlx5's
//! `mlx5dv_get_clock_info` reads to turn the device's CQE timestamps into wall-clock
//! nanoseconds (`mlx5dv_ts_to_ns`). The soft NIC's clock ticks once a nanosecond
//! ([`softnic::clock`]), so the page pairs one reading of it with `CLOCK_REALTIME` taken at the
//! same moment, at multiplier 1 and shift 0. It is written once, when the context is made: a
//! kernel refreshes its page as it adjusts the clock, so a later step of the system's
//! wall-clock time is not seen here.

use super::uar::Uars;
use crate::uaccess::Errno;
use bytemuck::{Pod, Zeroable};
use prm::doorbell::UAR_PAGE_SIZE;

/// The mmap command of the clock-info page (`MLX5_IB_MMAP_CLOCK_INFO`).
pub const MMAP_CMD: u64 = 7;
/// The layout version served (`MLX5_IB_CLOCK_INFO_V1`), as the mmap index and a bit of
/// GET_CONTEXT's `clock_info_versions`.
pub const V1: u64 = 0;

/// How long, in nanoseconds, a reader may use the page's values (`overflow_period`): the
/// clock does not wrap for centuries; an hour bounds the drift a wall-clock adjustment makes.
const VALID_NS: u64 = 3_600_000_000_000;

/// `struct mlx5_ib_clock_info`, host order.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
struct ClockInfo {
    sign: u32,
    resv: u32,
    nsec: u64,
    cycles: u64,
    frac: u64,
    mult: u32,
    shift: u32,
    mask: u64,
    overflow_period: u64,
}

/// A context's clock-info page.
pub(super) struct ClockPage(Uars);

impl ClockPage {
    pub(super) fn new() -> Result<Self, Errno> {
        let page = Uars::new(1)?;
        // the two readings as close together as the calls allow
        let cycles = softnic::clock::now();
        let nsec = softnic::clock::read(libc::CLOCK_REALTIME);
        let info = ClockInfo {
            sign: 0,
            resv: 0,
            nsec,
            cycles,
            frac: 0,
            mult: 1,
            shift: 0,
            mask: softnic::clock::MASK,
            overflow_period: VALID_NS,
        };
        page.pages[0].buf.write(0, bytemuck::bytes_of(&info));
        Ok(Self(page))
    }

    /// Maps the page for the application: read-only, one page (mlx5_ib: EPERM for a
    /// writable or executable mapping, EINVAL for another length).
    pub(super) fn map(
        &self,
        addr: usize,
        len: usize,
        prot: i32,
        flags: i32,
    ) -> Result<*mut libc::c_void, Errno> {
        if prot & (libc::PROT_WRITE | libc::PROT_EXEC) != 0 {
            return Err(Errno::EPERM);
        }
        if len != UAR_PAGE_SIZE {
            return Err(Errno::EINVAL);
        }
        self.0.map(addr, len, prot, flags, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_turns_a_stamp_into_wall_clock_time() {
        let p = ClockPage::new().unwrap();
        let mut b = [0u8; std::mem::size_of::<ClockInfo>()];
        p.0.pages[0].buf.read(0, &mut b);
        let ci: ClockInfo = bytemuck::pod_read_unaligned(&b);
        assert_eq!((ci.sign, ci.mult, ci.shift, ci.frac), (0, 1, 0, 0));
        // mlx5dv_ts_to_ns for a stamp taken now
        let stamp = softnic::clock::now();
        let ns = ci.nsec + ((stamp - ci.cycles) & ci.mask) * ci.mult as u64;
        let real = softnic::clock::read(libc::CLOCK_REALTIME);
        assert!(ns.abs_diff(real) < 1_000_000_000, "{ns} vs {real}");
        // a writable mapping is refused
        assert_eq!(
            p.map(
                0,
                UAR_PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED
            )
            .err(),
            Some(Errno::EPERM)
        );
    }
}
