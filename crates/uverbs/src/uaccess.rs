//! Copies between the emulated "kernel" and the application's memory, with the kernel's
//! answer for a bad pointer (EFAULT) instead of a crash: every copy goes through
//! `process_vm_readv`/`process_vm_writev` on the process itself, which the kernel checks.

/// An errno value the emulated kernel returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    pub const EPERM: Self = Self(libc::EPERM);
    pub const ENOENT: Self = Self(libc::ENOENT);
    pub const EBADF: Self = Self(libc::EBADF);
    pub const EAGAIN: Self = Self(libc::EAGAIN);
    pub const ENOMEM: Self = Self(libc::ENOMEM);
    pub const ENODEV: Self = Self(libc::ENODEV);
    pub const EEXIST: Self = Self(libc::EEXIST);
    pub const EFAULT: Self = Self(libc::EFAULT);
    pub const EBUSY: Self = Self(libc::EBUSY);
    pub const EINVAL: Self = Self(libc::EINVAL);
    pub const ENOSPC: Self = Self(libc::ENOSPC);
    pub const ENOSYS: Self = Self(libc::ENOSYS);
    pub const ENOTTY: Self = Self(libc::ENOTTY);
    pub const EOPNOTSUPP: Self = Self(libc::EOPNOTSUPP);
    pub const EPROTONOSUPPORT: Self = Self(libc::EPROTONOSUPPORT);
    pub const EREMOTEIO: Self = Self(libc::EREMOTEIO);
}

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EFAULT)
}

/// Copies `dst.len()` bytes from the application's address `addr`.
pub fn copy_from_user(addr: u64, dst: &mut [u8]) -> Result<(), Errno> {
    if dst.is_empty() {
        return Ok(());
    }
    if addr == 0 || addr.checked_add(dst.len() as u64).is_none() {
        return Err(Errno::EFAULT);
    }
    let local = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: dst.len(),
    };
    // SAFETY: `local` describes `dst`, which we own exclusively for the call; the kernel checks
    // `remote` against this process's mappings and fails with EFAULT instead of faulting.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    match n {
        n if n == dst.len() as isize => Ok(()),
        n if n >= 0 => Err(Errno::EFAULT),
        _ => Err(Errno(match last_errno() {
            libc::EFAULT | libc::ESRCH | libc::ENOMEM => libc::EFAULT,
            e => e,
        })),
    }
}

/// Copies `src` to the application's address `addr`.
pub fn copy_to_user(addr: u64, src: &[u8]) -> Result<(), Errno> {
    if src.is_empty() {
        return Ok(());
    }
    if addr == 0 || addr.checked_add(src.len() as u64).is_none() {
        return Err(Errno::EFAULT);
    }
    let local = libc::iovec {
        iov_base: src.as_ptr() as *mut libc::c_void,
        iov_len: src.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: src.len(),
    };
    // SAFETY: `local` describes `src`, only read by the kernel; `remote` is checked by the
    // kernel against this process's writable mappings (EFAULT otherwise).
    let n = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
    match n {
        n if n == src.len() as isize => Ok(()),
        n if n >= 0 => Err(Errno::EFAULT),
        _ => Err(Errno(match last_errno() {
            libc::EFAULT | libc::ESRCH | libc::ENOMEM => libc::EFAULT,
            e => e,
        })),
    }
}

/// Reads a plain-old-data value from the application (zero-extended when `avail` is short).
pub fn read_struct<T: bytemuck::Pod>(addr: u64, avail: usize) -> Result<T, Errno> {
    let mut v = T::zeroed();
    let bytes = bytemuck::bytes_of_mut(&mut v);
    let n = bytes.len().min(avail);
    copy_from_user(addr, &mut bytes[..n])?;
    Ok(v)
}

/// Checks that `addr..addr+len` is mapped and readable, page by page (what pinning the pages
/// asks of the kernel): EFAULT otherwise. Each page is probed with a one-byte read.
pub fn check_mapped(addr: u64, len: u64) -> Result<(), Errno> {
    if len == 0 {
        return Ok(());
    }
    let end = addr.checked_add(len).ok_or(Errno::EFAULT)?;
    let page = 4096u64;
    let mut p = addr & !(page - 1);
    while p < end {
        let mut b = [0u8; 1];
        copy_from_user(p.max(addr), &mut b)?;
        p += page;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_faults() {
        let src = [1u8, 2, 3, 4];
        let mut dst = [0u8; 4];
        copy_from_user(src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(dst, src);
        let mut out = [0u8; 4];
        copy_to_user(out.as_mut_ptr() as u64, &src).unwrap();
        assert_eq!(out, src);
        assert_eq!(copy_from_user(8, &mut dst), Err(Errno::EFAULT));
        assert_eq!(copy_to_user(0, &src), Err(Errno::EFAULT));
        assert_eq!(copy_from_user(u64::MAX - 1, &mut dst), Err(Errno::EFAULT));
        assert_eq!(check_mapped(16, 8), Err(Errno::EFAULT));
        check_mapped(out.as_ptr() as u64, 4).unwrap();
    }
}
