//! The emulated kernel's command decoders: any sequence of uverbs `write()` commands and
//! ioctls (DEVX mailboxes included) on an open emulated device file, then its close. The
//! oracle: every command gets an answer (a result or an errno), the process never crashes
//! or hangs, and closing the file frees whatever the commands made.
//!
//! Input: records of a kind byte (bit 1 set: a `write()` command on an rdma_cm file, the
//! connection manager's ucma commands, opened non-blocking so that GET_EVENT never waits;
//! else even: a `write()` command; odd: an ioctl, the bytes being its header and attributes),
//! a 2-byte big-endian length and the bytes — the stream
//! `GPUVERBS_EMU_RECORD` writes, so the seeds are what perftest, ibv_rc_pingpong and pyverbs
//! sent. The commands' user pointers are the recorded process's, or anything: the harness
//! maps every 8-byte word that looks like a user address (0x1000 ..= 2^47) into a scratch
//! arena at a fixed address, surrounded by inaccessible pages, so whatever the emulation
//! reads or writes for a command stays inside memory the harness owns (an emulated kernel
//! writes wherever a program's pointer says, as the real one does).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use uverbs::abi::ioctl::RDMA_VERBS_IOCTL;

const ARENA: usize = 0x5000_0000_0000;
/// Commands are copied here.
const CMD_LEN: usize = 1 << 16;
/// What pointers are mapped into.
const DATA_LEN: usize = 1 << 20;
/// Inaccessible pages on each side.
const GUARD: usize = 1 << 16;
const MAX_RECORDS: usize = 256;
const USER_LIMIT: u64 = 1 << 47;

fn emulation() -> &'static uverbs::Emulation {
    static ARENA_MAP: OnceLock<()> = OnceLock::new();
    ARENA_MAP.get_or_init(|| {
        let total = GUARD + CMD_LEN + DATA_LEN + GUARD;
        // SAFETY: an anonymous mapping at an address nobody uses (MAP_FIXED_NOREPLACE
        // fails rather than replace anything), never unmapped; then the middle is opened.
        unsafe {
            let p = libc::mmap(
                (ARENA - GUARD) as *mut libc::c_void,
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            );
            assert_eq!(p as usize, ARENA - GUARD, "the arena's address is taken");
            let rc = libc::mprotect(
                ARENA as *mut libc::c_void,
                CMD_LEN + DATA_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
            );
            assert_eq!(rc, 0);
        }
        // one emulated device at an address of its own
        std::env::set_var(uverbs::config::ENV_IP, "127.0.93.1");
    });
    uverbs::emulation().expect("the emulation starts")
}

/// The process's open file descriptors.
fn open_fds() -> Vec<i32> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fuzz_target!(|d: &[u8]| {
    let emu = emulation();
    let before = open_fds();
    let fd = match emu.open(b"/dev/infiniband/uverbs0", libc::O_RDWR | libc::O_CLOEXEC) {
        Some(Ok(fd)) => fd,
        other => panic!("opening the emulated device: {other:?}"),
    };
    let mut cm_fd = None;
    let mut rest = d;
    let mut n = 0;
    while rest.len() >= 3 && n < MAX_RECORDS {
        let kind = rest[0];
        let len = (u16::from_be_bytes([rest[1], rest[2]]) as usize).min(rest.len() - 3);
        let mut cmd = rest[3..3 + len].to_vec();
        rest = &rest[3 + len..];
        n += 1;
        for w in cmd.chunks_exact_mut(8) {
            let v = u64::from_le_bytes(w.try_into().unwrap());
            if (0x1000..=USER_LIMIT).contains(&v) {
                let p = (ARENA + CMD_LEN) as u64 + v % DATA_LEN as u64;
                w.copy_from_slice(&p.to_le_bytes());
            }
        }
        // SAFETY: the arena's command area is CMD_LEN writable bytes and a command is at most
        // 65,535; nothing else uses it while the call runs.
        unsafe { std::ptr::copy_nonoverlapping(cmd.as_ptr(), ARENA as *mut u8, cmd.len()) };
        if kind & 2 != 0 {
            let f = *cm_fd.get_or_insert_with(|| {
                match emu.open(
                    b"/dev/infiniband/rdma_cm",
                    libc::O_RDWR | libc::O_CLOEXEC | libc::O_NONBLOCK,
                ) {
                    Some(Ok(f)) => f,
                    other => panic!("opening the emulated rdma_cm: {other:?}"),
                }
            });
            let _ = emu.write(f, ARENA as u64, cmd.len());
        } else if kind & 1 == 0 {
            let _ = emu.write(fd, ARENA as u64, cmd.len());
        } else {
            let _ = emu.ioctl(fd, RDMA_VERBS_IOCTL, ARENA as u64);
        }
    }
    // the device file (and the rdma_cm file), then whatever the commands opened (completion
    // channels, the async event file), as a program's exit closes them
    if let Some(f) = cm_fd {
        if emu.close(f) {
            // SAFETY: closes the fd this input opened.
            unsafe { libc::close(f) };
        }
    }
    for fd in std::iter::once(fd).chain(
        open_fds()
            .into_iter()
            .filter(|f| !before.contains(f) && *f != fd),
    ) {
        if emu.close(fd) {
            // SAFETY: an fd this input's commands made (the emulation forgot it, or it is
            // not the emulation's: a directory listing's own fd, already closed); closing it
            // is what the program's close() would do.
            unsafe { libc::close(fd) };
        }
    }
});
