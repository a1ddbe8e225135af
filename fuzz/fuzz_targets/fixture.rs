//! What the soft NIC targets and the seed generator share: buffers at fixed addresses (so the
//! addresses a seed names are the fuzzed fixture's in every run), each registered range with
//! unregistered guard memory around it, and the fresh QP pairs the targets drive.
#![allow(dead_code)]

use crate::common::{Opts, Pair};
use crate::wire_util::{wire_opts, wire_pair, ALL_REMOTE};
use softnic::{Access, Device, MrInfo, PdId, RtsAttr, WireFaults};
use std::sync::OnceLock;

/// Where the buffers live: inside the application range AddressSanitizer leaves to programs
/// on x86-64 (and above its shadow), far from where the system maps anything.
const BASE: usize = 0x6000_0000_0000;
/// One slot per buffer: 4 KiB of guard, the 4 KiB registered range, 8 KiB of guard.
const SLOT: usize = 0x4000;
const GUARD: usize = 0x1000;
pub const LEN: usize = 0x1000;
const SLOTS: usize = 4;
const GUARD_BYTE: u8 = 0xEE;

/// The fixed mapping, made once per process.
fn base() -> usize {
    static MAP: OnceLock<usize> = OnceLock::new();
    *MAP.get_or_init(|| {
        // SAFETY: an anonymous private mapping at an address nobody uses
        // (MAP_FIXED_NOREPLACE fails rather than replace anything); it lives until exit.
        let p = unsafe {
            libc::mmap(
                BASE as *mut libc::c_void,
                SLOT * SLOTS,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(p as usize, BASE, "the fixed buffer mapping is taken");
        BASE
    })
}

/// Buffer `i`'s slot as bytes.
fn slot(i: usize) -> &'static mut [u8] {
    assert!(i < SLOTS);
    // SAFETY: the mapping is SLOT * SLOTS bytes, never unmapped; one fixture at a time (the
    // fuzzer is single-threaded) and no device touches a slot between fixtures.
    unsafe { std::slice::from_raw_parts_mut((base() + i * SLOT) as *mut u8, SLOT) }
}

/// The registered range of buffer `i`: its first address.
pub fn addr(i: usize) -> u64 {
    (base() + i * SLOT + GUARD) as u64
}

/// Fills buffer `i` with `byte` and its guards with the guard byte.
pub fn reset(i: usize, byte: u8) {
    let s = slot(i);
    s.fill(GUARD_BYTE);
    s[GUARD..GUARD + LEN].fill(byte);
}

/// Whether buffer `i`'s guards are untouched.
pub fn guards_intact(i: usize) -> bool {
    let s = slot(i);
    s[..GUARD].iter().all(|&b| b == GUARD_BYTE) && s[GUARD + LEN..].iter().all(|&b| b == GUARD_BYTE)
}

/// Whether buffer `i`'s registered range still holds what [`register`] filled it with.
pub fn untouched(i: usize) -> bool {
    slot(i)[GUARD..GUARD + LEN]
        .iter()
        .all(|&b| b == 0x10 + i as u8)
}

/// Registers buffer `i` on `dev`.
pub fn register(dev: &Device, pd: PdId, i: usize, access: Access) -> MrInfo {
    reset(i, 0x10 + i as u8);
    // SAFETY: the range is in the fixed mapping, which outlives every device (it is never
    // unmapped); the fixture drops its devices before the next one resets the slots.
    unsafe { dev.reg_host(pd, addr(i), LEN as u64, access) }.expect("register a fixed buffer")
}

/// A fresh pair and its buffers: 0 on A (every right), 1 on B (every right), 2 on A (result,
/// local write), 3 on B (receive buffer, local write); B has one receive posted on buffer 3.
pub struct Fixture {
    pub p: Pair,
    pub mrs: [MrInfo; 4],
}

const ALL: Access = Access(ALL_REMOTE.0 | Access::MW_BIND.0);

impl Fixture {
    fn with(p: Pair) -> Self {
        let mrs = [
            register(&p.a.dev, p.a.pd, 0, ALL),
            register(&p.b.dev, p.b.pd, 1, ALL),
            register(&p.a.dev, p.a.pd, 2, Access::LOCAL_WRITE),
            register(&p.b.dev, p.b.pd, 3, Access::LOCAL_WRITE),
        ];
        let mut f = Self { p, mrs };
        let sge = prm::wqe::Sge {
            addr: addr(3),
            len: LEN as u32,
            lkey: prm::Lkey(f.mrs[3].key),
        };
        f.p.eb.ini.post_recv(&[sge]).expect("post a receive");
        f
    }

    /// Two soft NICs in process (the WQE path): no retries, so nothing waits for long. The QPs
    /// are cross-channel masters, so that WAIT WQEs run (a ConnectX runs them only there).
    pub fn local() -> Self {
        let quick = Opts {
            rts: RtsAttr {
                sq_psn: 0,
                timeout: 1,
                retry_cnt: 0,
                rnr_retry: 0,
            },
            cross_channel: true,
            ..Opts::default()
        };
        Self::with(Pair::with(quick.clone(), quick))
    }

    /// Two soft NICs over RoCEv2 on 127.0.0.1, path MTU 1024.
    pub fn wire(selective_repeat: bool) -> Self {
        let o = Opts {
            selective_repeat,
            ..wire_opts()
        };
        Self::with(wire_pair(
            o.clone(),
            o,
            1024,
            WireFaults::default(),
            WireFaults::default(),
        ))
    }

    /// Drops the devices (their threads end), then checks every guard.
    pub fn finish(self) {
        drop(self.p);
        for i in 0..SLOTS {
            assert!(guards_intact(i), "a write outside registered buffer {i}");
        }
    }
}

/// A DC target on `n` over an SRQ of its own, every remote right, key `key`, completing on
/// `cq`, in RTR.
pub fn dc_target(
    n: &crate::common::Node,
    cq: std::sync::Arc<softnic::Cq>,
    key: u64,
) -> std::sync::Arc<softnic::Qp> {
    use softnic::{DctConfig, Modify, SrqConfig};
    let srq = n
        .dev
        .create_srq(SrqConfig::new(n.pd, 16, 1))
        .expect("an SRQ");
    let t = n
        .dev
        .create_dct(DctConfig {
            pd: n.pd,
            cq,
            srq,
            key,
            user_index: None,
        })
        .expect("a DCT");
    t.modify(Modify::Init { access: ALL_REMOTE })
        .expect("DCT INIT");
    t.modify(Modify::RtrDc {
        mtu: 1024,
        min_rnr_timer: 1,
    })
    .expect("DCT RTR");
    t
}
