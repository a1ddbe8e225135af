//! QPs that ring one doorbell register with their doorbell records in device memory: every
//! DEVX QP of a context rings the context's non-cached UAR page at 0x800 (gpuverbs' mlx5
//! backend, GPUNetIO's and NVSHMEM's DEVX QPs), and with its rings in GPU memory its record
//! is GPU memory too. On a ConnectX each doorbell is its own MMIO write; in the soft NIC the
//! register is a word of memory the engine looks at now and then, so one QP's doorbell can
//! replace another's before the engine has seen it. Such a QP must then find its producer in
//! its record, in device memory as well as in host memory, or its WQEs never run: the
//! gpu-test case `nic_counter_gpuall_warp_gpudb` under `gpuverbs emu` (a warp's WRITEs rung
//! on the main QP, then its WAITs and fetch-adds rung on the companion, both DEVX QPs of one
//! context) timed out so, its counters short.

mod common;
mod devmem_util;

use common::*;
use devmem_util::*;
use prm::doorbell::{DoorbellValue, BF_OFFSET, UAR_PAGE_SIZE};
use prm::wqe::{Local, Op};
use prm::Completion;
use softnic::qp::{UarRegister, MAX_REGISTERS};
use softnic::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MB: usize = 1 << 20;

/// A QP of `n` whose rings, doorbell record and CQs (rings and records) are in device memory
/// (`c`), rung at the shared register of `page` (page + 0x800, both registers watched, as the
/// emulation makes a DEVX QP).
fn on_shared_page(
    n: &Node,
    c: &mut Carver,
    page: &Arc<DmaBuf>,
    sq_blocks: u32,
    ncqe: u32,
    cross_channel: bool,
) -> (Arc<Qp>, Arc<Cq>, Arc<Cq>) {
    let mut cq = || {
        n.dev
            .create_cq(CqConfig {
                ncqe,
                ring: Some(c.ring(ncqe as usize * 64)),
                dbrec: Some(c.ring(8)),
                ..Default::default()
            })
            .unwrap()
    };
    let (scq, rcq) = (cq(), cq());
    let mut cfg = QpConfig::new(n.pd, scq.clone(), rcq.clone());
    cfg.sq_blocks = sq_blocks;
    cfg.rq_wqes = 64;
    cfg.max_recv_sge = 4;
    cfg.sq_ring = Some(c.ring(sq_blocks as usize * prm::WQEBB));
    cfg.rq_ring = Some(c.ring(64 * 64));
    cfg.dbrec = Some(c.ring(8));
    cfg.uar = Some(UarRegister {
        page: page.clone(),
        offset: BF_OFFSET,
        registers: MAX_REGISTERS,
    });
    cfg.cross_channel = cross_channel;
    let qp = n.dev.create_qp(cfg).unwrap();
    assert!(!qp.dbrec_page().is_host());
    (qp, scq, rcq)
}

/// The main QP `a` (on node A, to a host-memory QP of node B) and its companion `c` (a
/// cross-channel master connected to itself), both on one shared register with everything in
/// device memory; a destination on B, a counter and a result word on A. `a` is left in RTR
/// when `main_rts` is false.
struct Counting {
    a: Node,
    _b: Node,
    page: Arc<DmaBuf>,
    ga: GpuSide,
    gc: GpuSide,
    dst: Region,
    ctr: Region,
    res: Region,
}

impl Counting {
    fn new(main_blocks: u32, main_cqes: u32, comp_blocks: u32, main_rts: bool) -> Self {
        let g = SimDeviceMemory::new(16 * MB);
        let (a, b) = (Node::new(), Node::new());
        let page = Arc::new(DmaBuf::alloc(UAR_PAGE_SIZE));
        let mut carver = Carver::new(g.clone(), g.clone(), 0);
        let (qa, sa, ra) = on_shared_page(&a, &mut carver, &page, main_blocks, main_cqes, false);
        let (qc, sc, rc) = on_shared_page(&a, &mut carver, &page, comp_blocks, 64, true);
        let host = Placement {
            sq: false,
            rq: false,
            scq: false,
            rcq: false,
        };
        let mut hc = Carver::new(g.clone(), g.clone(), 8 * MB as u64);
        let (qb, _sb, _rb) = qp_on(&b, &mut hc, host, 64, 64);
        devmem_util::bring_up(&qb, &a, qa.qpn());
        devmem_util::bring_up(&qc, &a, qc.qpn());
        if main_rts {
            devmem_util::bring_up(&qa, &b, qb.qpn());
        } else {
            up_to_rtr(&qa, &b, qb.qpn());
        }
        let dst = Region::new(&b, &Kind::Host, 8 * main_blocks as usize, ALL);
        let ctr = Region::new(&a, &Kind::Host, 64, ALL);
        let res = Region::new(&a, &Kind::Host, 64, ALL);
        Self {
            ga: GpuSide::new(qa, sa, ra, g.clone()),
            gc: GpuSide::new(qc, sc, rc, g),
            a,
            _b: b,
            page,
            dst,
            ctr,
            res,
        }
    }

    /// An 8-byte inline WRITE of `i + 1` to the destination's word `i`, signaled (not rung).
    fn post_write(&mut self, i: u64) {
        let v = (i + 1).to_le_bytes();
        let op = Op::Write {
            remote: self.dst.remote(8 * i as usize),
            local: Local::Inline(&v),
            imm: None,
        };
        self.ga.post(&op, SIG);
    }

    /// On the companion: a WAIT for CQE number `cqe` of the main QP's send CQ, then a
    /// fetch-add of 1 on the counter (signaled when `signaled`), not rung.
    fn post_count(&mut self, cqe: u32, signaled: bool) {
        let wait = Op::Wait {
            cqn: self.ga.scq.cqn(),
            max_index: cqe,
        };
        let fa = Op::FetchAdd {
            remote: self.ctr.remote(0),
            add: 1,
            result: self.res.sge(0, 8),
        };
        self.gc.post(&wait, UNSIG);
        self.gc.post(&fa, if signaled { SIG } else { UNSIG });
    }

    /// The value the shared register holds now.
    fn register(&self) -> u64 {
        self.page.atomic_u64(BF_OFFSET).load(Ordering::Acquire)
    }

    /// Waits (10 s at most) for the counter to reach `n`; panics naming what ran.
    fn wait_counter(&self, n: u64) {
        let t = Instant::now();
        while self.ctr.u64_at(0) < n {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "counter {} of {n}: the main QP's send CQ wrote {} CQEs of {} WRITEs posted",
                self.ctr.u64_at(0),
                self.ga.scq.produced(),
                self.ga.pi
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The interleaving a GPU makes at random, made certain: the main QP's counted WRITE is rung
/// (record, then register) while the main QP is still in RTR, so the engine first looks at
/// its register after the companion's doorbell (its WAIT for that WRITE's CQE) has replaced
/// the main QP's. The main QP's producer is then only in its record, in device memory: it is
/// read, the WRITE runs, the WAIT ends and the counter moves. (Without the read the WRITE
/// never ran and the counter stayed 0.)
#[test]
fn a_doorbell_replaced_by_another_qp_s_is_found_in_the_record_in_device_memory() {
    let mut k = Counting::new(64, 64, 64, false);
    k.post_write(0);
    k.ga.ring(&k.a.dev);
    k.post_count(0, true);
    k.gc.ring(&k.a.dev);
    let comp = DoorbellValue::from_pi(k.gc.pi, k.gc.qp.qpn()).to_u64();
    assert_eq!(
        k.register(),
        comp,
        "the companion's doorbell replaced the main QP's"
    );
    k.ga.qp
        .modify(Modify::Rts(RtsAttr {
            sq_psn: 0,
            timeout: 10,
            retry_cnt: 3,
            rnr_retry: 7,
        }))
        .unwrap();
    k.a.dev.kick();
    k.wait_counter(1);
    assert!(matches!(
        k.ga.wait_send(),
        Completion::Req { wqe_counter: 0, .. }
    ));
    assert!(matches!(k.gc.wait_send(), Completion::Req { .. }));
    assert_eq!(k.dst.u64_at(0), 1);
    assert_eq!(k.res.u64_at(0), 0, "the fetch-add's old value");
    assert_eq!(k.a.dev.counters().device_memory_errors, 0);
}

/// The warp pattern of `put_counter_warp` and kin, as fast as the test thread can write: per
/// round, 32 counted WRITEs on the main QP under one doorbell, then at once their 32 WAITs and
/// fetch-adds on the companion under one doorbell of the same register. Every WRITE runs and
/// the counter reaches one per WRITE, whichever doorbells the engine saw.
#[test]
fn warp_batches_on_two_qps_of_one_register_all_run() {
    const ROUNDS: u64 = 16;
    const LANES: u64 = 32;
    let mut k = Counting::new(1024, 1024, 2048, true);
    for r in 0..ROUNDS {
        for l in 0..LANES {
            k.post_write(r * LANES + l);
        }
        k.ga.ring(&k.a.dev);
        for l in 0..LANES {
            k.post_count((r * LANES + l) as u32, l + 1 == LANES);
        }
        k.gc.ring(&k.a.dev);
    }
    k.wait_counter(ROUNDS * LANES);
    for i in 0..ROUNDS * LANES {
        assert_eq!(k.dst.u64_at(8 * i as usize), i + 1, "WRITE {i}");
    }
    assert_eq!(k.a.dev.counters().device_memory_errors, 0);
}
