//! Event files: a completion channel's fd and a context's async event fd. Each is a real
//! eventfd (so `poll`, `select` and `epoll` on it work unchanged) whose counter holds one token
//! per queued event; `read()` on it is answered here with one `ib_uverbs_*_event_desc`, as the
//! kernel's uverbs event files do. Events of a destroyed object are dropped unread.
//!
//! Every operation on these fds goes through raw system calls: the emulation's own `read` and
//! `write` hooks would otherwise be called again for its own fds.

use crate::uaccess::{copy_to_user, Errno};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

struct Entry {
    desc: [u8; 16],
    len: usize,
    owner: u64,
    dead: bool,
    /// Counts the event when it is read (the kernel's `comp_events_reported`).
    counter: Option<Arc<AtomicU32>>,
}

/// One event file.
pub struct EventQueue {
    fd: RawFd,
    /// Size of one event: 8 (completion) or 16 (async).
    event_size: usize,
    q: Mutex<VecDeque<Entry>>,
}

impl EventQueue {
    /// A new event file for events of `event_size` bytes.
    pub fn new(event_size: usize) -> Result<Arc<Self>, Errno> {
        // SAFETY: plain system call; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return Err(Errno(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EMFILE),
            ));
        }
        Ok(Arc::new(Self {
            fd,
            event_size,
            q: Mutex::new(VecDeque::new()),
        }))
    }

    /// The file descriptor the application sees.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Queues an event for `owner` (an object key), counted on `counter` when read.
    pub fn push(&self, desc: &[u8], owner: u64, counter: Option<Arc<AtomicU32>>) {
        let mut e = Entry {
            desc: [0; 16],
            len: desc.len().min(16),
            owner,
            dead: false,
            counter,
        };
        e.desc[..e.len].copy_from_slice(&desc[..e.len]);
        self.q.lock().push_back(e);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from `one` to our own eventfd.
        unsafe { libc::syscall(libc::SYS_write, self.fd, &one as *const u64, 8usize) };
    }

    /// Drops the queued events of `owner` (its object was destroyed).
    pub fn purge(&self, owner: u64) {
        for e in self.q.lock().iter_mut().filter(|e| e.owner == owner) {
            e.dead = true;
        }
    }

    /// `read(fd, buf, len)`: one event, blocking unless the fd is non-blocking.
    pub fn read(&self, buf: u64, len: usize) -> Result<usize, Errno> {
        if len < self.event_size {
            return Err(Errno::EINVAL);
        }
        loop {
            let mut token = 0u64;
            // SAFETY: reads 8 bytes into `token` from our own eventfd (blocking or not as the
            // application set the fd).
            let n =
                unsafe { libc::syscall(libc::SYS_read, self.fd, &mut token as *mut u64, 8usize) };
            if n < 0 {
                return Err(Errno(
                    std::io::Error::last_os_error()
                        .raw_os_error()
                        .unwrap_or(libc::EIO),
                ));
            }
            let Some(e) = self.q.lock().pop_front() else {
                continue;
            };
            if e.dead {
                continue;
            }
            copy_to_user(buf, &e.desc[..self.event_size])?;
            if let Some(c) = &e.counter {
                c.fetch_add(1, Ordering::AcqRel);
            }
            return Ok(self.event_size);
        }
    }
}

impl Drop for EventQueue {
    fn drop(&mut self) {
        // SAFETY: closes the eventfd this queue owns; nothing else closes it.
        unsafe { libc::syscall(libc::SYS_close, self.fd) };
    }
}
