//! A context's UAR pages: the memfd-backed doorbell pages the application maps with `mmap`
//! on the device fd and the soft NIC watches. Static pages come with the context (older
//! kernels, [`Uars`]); dynamic ones are allocated one at a time with the UAR ioctl
//! ([`DynUar`]: ALLOC / DESTROY, for verbs QPs and CQs in dynamic mode and for DEVX), each with
//! an mmap offset of its own and a page id that CQ and QP contexts name (`uar_page`).

use crate::uaccess::Errno;
use prm::doorbell::UAR_PAGE_SIZE;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use verbs::DmaBuf;

/// The name of the memfds behind UAR pages (`/proc/self/maps` shows `/memfd:<name> (deleted)`).
const MEMFD_NAME: &std::ffi::CStr = c"gpuverbs-uar";

/// Whether `addr..addr+len` (non-empty) lies in mappings of emulated UAR pages (what a
/// ConnectX's UAR, BAR space, is on hardware: the CUDA driver registers such a page as I/O
/// memory). Read from `/proc/self/maps`: only mappings of the emulation's UAR memfds count.
pub fn is_emulated_uar(addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len).filter(|_| len > 0) else {
        return false;
    };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let name = format!("/memfd:{}", MEMFD_NAME.to_string_lossy());
    // every page of the range in a UAR mapping (adjacent mappings may cover it together)
    let mut covered_to = addr;
    let mut spans: Vec<(u64, u64)> = maps
        .lines()
        .filter(|l| l.split_whitespace().nth(5).is_some_and(|p| p == name))
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect();
    spans.sort_unstable();
    for (a, b) in spans {
        if a <= covered_to && b > covered_to {
            covered_to = b;
        }
    }
    covered_to >= end
}

/// A UAR page shared by the application's mapping and the soft NIC's.
pub(super) struct UarPage {
    pub(super) buf: Arc<DmaBuf>,
}

/// The memory behind a context's UAR pages: one memfd, mapped once for the device; the
/// application maps the same pages with `mmap` on the device fd.
pub struct Uars {
    memfd: RawFd,
    pub(super) pages: Vec<UarPage>,
}

impl Uars {
    pub(super) fn new(n: usize) -> Result<Self, Errno> {
        let os = || {
            Errno(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::ENOMEM),
            )
        };
        // SAFETY: plain system call with a static NUL-terminated name; the result is checked.
        let memfd = unsafe { libc::memfd_create(MEMFD_NAME.as_ptr(), libc::MFD_CLOEXEC) };
        if memfd < 0 {
            return Err(os());
        }
        let len = n * UAR_PAGE_SIZE;
        // SAFETY: resizes the memfd we just created.
        if unsafe { libc::ftruncate(memfd, len as libc::off_t) } != 0 {
            let e = os();
            // SAFETY: closes our own fd.
            unsafe { libc::syscall(libc::SYS_close, memfd) };
            return Err(e);
        }
        let mut pages = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: maps page i of our memfd, shared, read-write; the result is checked.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    UAR_PAGE_SIZE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    memfd,
                    (i * UAR_PAGE_SIZE) as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                let e = os();
                // SAFETY: closes our own fd (mappings made so far go with `pages`).
                unsafe { libc::syscall(libc::SYS_close, memfd) };
                return Err(e);
            }
            struct Unmap(usize);
            impl Drop for Unmap {
                fn drop(&mut self) {
                    // SAFETY: unmaps the one page this owner mapped.
                    unsafe { libc::munmap(self.0 as *mut libc::c_void, UAR_PAGE_SIZE) };
                }
            }
            let ptr = NonNull::new(p.cast::<u8>()).ok_or(Errno::ENOMEM)?;
            // SAFETY: a fresh page-aligned shared mapping of 4 KiB, alive until `Unmap` drops
            // with the buffer; only raw-pointer and atomic access.
            let buf =
                unsafe { DmaBuf::from_external(ptr, UAR_PAGE_SIZE, Box::new(Unmap(p as usize))) };
            pages.push(UarPage { buf: Arc::new(buf) });
        }
        Ok(Self { memfd, pages })
    }

    /// Maps UAR page `index` for the application (the device fd's `mmap`).
    pub fn map(
        &self,
        addr: usize,
        len: usize,
        prot: i32,
        flags: i32,
        index: usize,
    ) -> Result<*mut libc::c_void, Errno> {
        if index >= self.pages.len() || len != UAR_PAGE_SIZE || flags & libc::MAP_SHARED == 0 {
            return Err(Errno::EINVAL);
        }
        // SAFETY: maps one page of our memfd where the application asked; the kernel checks
        // `addr`/`flags` exactly as for any mmap.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                prot,
                flags,
                self.memfd,
                (index * UAR_PAGE_SIZE) as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Errno(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::ENOMEM),
            ));
        }
        Ok(p)
    }

    /// The device's view of page 0 (the CQ arm doorbell lives there).
    pub fn page0(&self) -> Option<Arc<DmaBuf>> {
        self.pages.first().map(|p| p.buf.clone())
    }
}

/// The mmap command of dynamically allocated UAR pages in the device file's offsets
/// (`offset / 4096 = (entry >> 8) << 16 | DYN_MMAP_CMD << 8 | (entry & 0xff)`, as mlx5_ib numbers
/// its mmap entries); commands 0..=8 are the legacy ones.
pub const DYN_MMAP_CMD: u64 = 9;

/// The mmap offset (in pages) of dynamic mmap entry `entry`.
pub fn dyn_mmap_pgoff(entry: u32) -> u64 {
    let e = u64::from(entry);
    (e >> 8) << 16 | DYN_MMAP_CMD << 8 | (e & 0xff)
}

/// The dynamic mmap entry at page offset `pgoff`, if it is one.
pub fn dyn_mmap_entry(pgoff: u64) -> Option<u32> {
    ((pgoff >> 8) & 0xff >= DYN_MMAP_CMD).then_some(((pgoff >> 16) << 8 | (pgoff & 0xff)) as u32)
}

/// A UAR page allocated with the UAR ioctl.
pub struct DynUar {
    /// The page id CQ and QP contexts use (`uar_page`).
    pub page_id: u32,
    /// A BlueFlame page (else non-cached: doorbells only).
    pub bf: bool,
    /// Its mmap entry.
    pub entry: u32,
    pub(super) mem: Uars,
}

impl DynUar {
    pub(super) fn new(page_id: u32, bf: bool, entry: u32) -> Result<Self, Errno> {
        Ok(Self {
            page_id,
            bf,
            entry,
            mem: Uars::new(1)?,
        })
    }

    /// The device's view of the page.
    pub fn page(&self) -> Arc<DmaBuf> {
        self.mem.pages[0].buf.clone()
    }

    /// Maps the page for the application.
    pub fn map(
        &self,
        addr: usize,
        len: usize,
        prot: i32,
        flags: i32,
    ) -> Result<*mut libc::c_void, Errno> {
        self.mem.map(addr, len, prot, flags, 0)
    }
}

impl Drop for Uars {
    fn drop(&mut self) {
        // SAFETY: closes the memfd this context owns.
        unsafe { libc::syscall(libc::SYS_close, self.memfd) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_emulations_uar_pages_are_uar_pages() {
        let uars = Uars::new(1).unwrap();
        let page = uars.pages[0].buf.addr();
        assert!(is_emulated_uar(page, UAR_PAGE_SIZE as u64));
        assert!(is_emulated_uar(page + 8, 8));
        assert!(!is_emulated_uar(page, 0), "an empty range is no page");
        assert!(
            !is_emulated_uar(page, 2 * UAR_PAGE_SIZE as u64) || {
                // the next page happens to be another UAR mapping of this process
                is_emulated_uar(page + UAR_PAGE_SIZE as u64, 1)
            }
        );
        let plain = vec![0u8; 2 * UAR_PAGE_SIZE];
        assert!(!is_emulated_uar(plain.as_ptr() as u64, 64));
        assert!(!is_emulated_uar(u64::MAX - 4, 8));
    }
}
