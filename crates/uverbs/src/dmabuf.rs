//! dma-bufs as the emulated kernel meets them: whether an fd is one, its size, and which GPU
//! range it exports. A kernel with a ConnectX maps a dma-buf's pages through the exporter (the
//! GPU driver); the emulated kernel lives in the application's process and cannot, so the
//! preload tells it, at `cuMemGetHandleForAddressRange`, which GPU range each dma-buf exports
//! ([`exported`]). The record follows the open file, not the fd number: it is keyed by the
//! file's inode (a dma-buf's inode is unique to it), so dups of the fd find it and a closed
//! fd's number reused by another file does not.

use crate::Errno;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::os::fd::RawFd;

/// Whether `fd` is a dma-buf (what `/proc/self/fd` names it: `/dmabuf:...` or
/// `anon_inode:dmabuf`); EBADF when it is no open fd.
pub fn is_dmabuf(fd: RawFd) -> Result<bool, Errno> {
    let target = std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|_| Errno::EBADF)?;
    let t = target.to_string_lossy();
    Ok(t.starts_with("/dmabuf:") || t.starts_with("anon_inode:dmabuf"))
}

/// A dma-buf's size (dma-bufs answer `lseek(fd, 0, SEEK_END)` with it), `None` when it does not
/// say. The file position is left at 0, where it was.
pub fn dmabuf_size(fd: RawFd) -> Option<u64> {
    // SAFETY: lseek on an fd has no memory effects; a dma-buf's position carries no state.
    let end = unsafe { libc::lseek(fd, 0, libc::SEEK_END) };
    // SAFETY: as above.
    unsafe { libc::lseek(fd, 0, libc::SEEK_SET) };
    u64::try_from(end).ok()
}

/// The identity of the open file behind `fd` (device and inode), `None` for no open fd.
fn identity(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: fstat writes only into the zeroed struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the result is checked.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

/// A GPU range a dma-buf exports: its first byte's device address and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuRange {
    pub addr: u64,
    pub len: u64,
}

/// How many exports are remembered (the oldest go first: a process keeps few dma-bufs open).
const KEPT: usize = 4096;

/// The exports seen, by file identity, oldest first.
static EXPORTS: Mutex<VecDeque<((u64, u64), GpuRange)>> = Mutex::new(VecDeque::new());

/// The CUDA driver made `fd` a dma-buf of GPU memory `addr..addr+len`
/// (`cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`).
pub fn exported(fd: RawFd, addr: u64, len: u64) {
    let Some(id) = identity(fd) else { return };
    let mut all = EXPORTS.lock();
    all.retain(|(i, _)| *i != id);
    if all.len() == KEPT {
        all.pop_front();
    }
    all.push_back((id, GpuRange { addr, len }));
    crate::CUDA_SEEN
        .dmabuf_exports
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The GPU range the open file behind `fd` exports, when the driver said so in this process.
pub fn gpu_range(fd: RawFd) -> Option<GpuRange> {
    let id = identity(fd)?;
    EXPORTS
        .lock()
        .iter()
        .rev()
        .find(|(i, _)| *i == id)
        .map(|(_, r)| *r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> RawFd {
        // SAFETY: plain system call with a static name; checked.
        let fd = unsafe { libc::memfd_create(c"dmabuf-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        fd
    }

    #[test]
    fn an_export_follows_its_file_through_dups_and_not_its_number() {
        let a = memfd();
        exported(a, 0x7f00_0000_0000, 1 << 20);
        let want = GpuRange {
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
        };
        assert_eq!(gpu_range(a), Some(want));
        // SAFETY: dup of our own fd; checked.
        let d = unsafe { libc::dup(a) };
        assert!(d >= 0);
        assert_eq!(gpu_range(d), Some(want), "a dup is the same file");
        // SAFETY: closes our own fds.
        unsafe {
            libc::close(a);
            libc::close(d);
        }
        // another file, likely with a's number: not the export
        let b = memfd();
        assert_eq!(gpu_range(b), None);
        assert_eq!(gpu_range(-1), None);
        // SAFETY: closes our own fd.
        unsafe { libc::close(b) };
    }

    #[test]
    fn a_memfd_is_no_dma_buf() {
        let a = memfd();
        assert_eq!(is_dmabuf(a), Ok(false));
        assert_eq!(is_dmabuf(-1), Err(Errno::EBADF));
        // SAFETY: closes our own fd.
        unsafe { libc::close(a) };
    }
}
