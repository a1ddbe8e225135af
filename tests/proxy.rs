//! The CPU proxy service: end to end on soft NICs (a CPU thread plays the GPU kernel: it writes
//! WQEs into the SQ ring and only bumps the proxy word), and its rules on plain memory.

use gpuverbs::proxy::{ProxyConfig, ProxyError, ProxyService, ProxyTarget, Wake, MAX_JUMP};
use gpuverbs::soft::raw::{
    Access, CqConfig, CqMode, DmaBuf, Modify, PdId, Qp, QpConfig, QpState, RtrAttr, RtsAttr,
};
use gpuverbs::soft::raw::{CqGeometry, CqPoller};
use gpuverbs::soft::{Device, DeviceConfig};
use prm::doorbell::{DoorbellValue, BF_OFFSET};
use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr, Sge};
use prm::{Completion, Lkey, Rkey, WQEBB};
use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The proxy's target for a raw soft-NIC QP: its control page's proxy word and doorbell
/// record, the doorbell register at [`BF_OFFSET`] of its UAR page, and a wake that kicks the
/// device's engine (a no-op once the device is dropped). Forwarded advances are limited to
/// the QP's SQ size.
fn soft_target(dev: &Arc<Device>, qp: &Arc<Qp>) -> ProxyTarget {
    let ctrl = qp.ctrl_page();
    let producer: *const AtomicU64 = ctrl.atomic_u64(qp.proxy_offset());
    let dbrec: *const AtomicU64 = ctrl.atomic_u64(qp.dbrec_offset());
    let doorbell: *const AtomicU64 = qp.uar().atomic_u64(BF_OFFSET);
    let dev = Arc::downgrade(dev);
    let wake: Wake = Arc::new(move || {
        if let Some(d) = dev.upgrade() {
            d.kick();
        }
    });
    let keep: Arc<dyn Any + Send + Sync> = qp.clone();
    // SAFETY: the three words live in the QP's control and UAR pages (bounds and alignment
    // checked by `atomic_u64`), which the `Arc<Qp>` in `keep` keeps alive; the soft NIC and
    // its initiators access them only atomically; the tests let the proxy own the send word.
    let t = unsafe {
        ProxyTarget::new(
            producer,
            dbrec.cast::<u8>().cast_mut(),
            doorbell.cast::<u8>().cast_mut(),
            qp.qpn(),
            Some(wake),
            keep,
        )
    };
    t.expect("a soft QP's 24-bit QPN and aligned words")
        .with_max_jump(qp.sq_blocks())
}

const TIMEOUT: Duration = Duration::from_secs(20);
const CHUNK: usize = 64;

fn cfg(threads: usize) -> ProxyConfig {
    ProxyConfig {
        threads,
        spin: Duration::from_micros(50),
        min_park: Duration::from_micros(5),
        max_park: Duration::from_micros(200),
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < TIMEOUT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Two soft devices; QPs on A, their peers on B.
struct Net {
    a: Arc<Device>,
    b: Arc<Device>,
    pa: PdId,
    pb: PdId,
}

impl Net {
    fn new() -> Self {
        let a = Arc::new(Device::open(DeviceConfig::default()).unwrap());
        let b = Arc::new(Device::open(DeviceConfig::default()).unwrap());
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        Self { a, b, pa, pb }
    }

    fn make(d: &Device, pd: PdId) -> Arc<Qp> {
        let cq = d
            .create_cq(CqConfig {
                ncqe: 256,
                ..Default::default()
            })
            .unwrap();
        d.create_qp(QpConfig::new(pd, cq.clone(), cq)).unwrap()
    }

    /// An unconnected QP on A (stays in RESET).
    fn idle_qp(&self) -> Arc<Qp> {
        Self::make(&self.a, self.pa)
    }

    /// A QP on A connected to a new QP on B, and a kernel that writes through it.
    fn kernel(&self, salt: u8, wqes: usize) -> Kernel {
        let (qa, qb) = (self.idle_qp(), Self::make(&self.b, self.pb));
        for (q, peer, dev) in [(&qa, &qb, &self.b), (&qb, &qa, &self.a)] {
            q.modify(Modify::Init {
                access: Access::REMOTE_WRITE,
            })
            .unwrap();
            q.modify(Modify::Rtr(RtrAttr {
                remote_gid: dev.gid(),
                remote_qpn: peer.qpn(),
                rq_psn: 0,
                mtu: 4096,
                min_rnr_timer: 1,
                selective_repeat: false,
            }))
            .unwrap();
            q.modify(Modify::Rts(RtsAttr::default())).unwrap();
        }
        let bytes = wqes * CHUNK;
        let src = DmaBuf::alloc(bytes);
        for k in 0..wqes {
            src.fill(
                k * CHUNK,
                CHUNK,
                (k as u8).wrapping_mul(31).wrapping_add(salt),
            );
        }
        let dst = DmaBuf::alloc(bytes);
        // SAFETY: both buffers live in the kernel, which outlives every WQE that names them
        // (each test waits for all completions before dropping it).
        let (ms, md) = unsafe {
            (
                self.a
                    .reg_host(self.pa, src.addr(), bytes as u64, Access::LOCAL_WRITE)
                    .unwrap(),
                self.b
                    .reg_host(
                        self.pb,
                        dst.addr(),
                        bytes as u64,
                        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                    )
                    .unwrap(),
            )
        };
        let cq = qa.send_cq();
        // SAFETY: the CQ is kept alive by the QP the kernel holds; nobody else polls it.
        let poller = unsafe {
            CqPoller::new(CqGeometry {
                ring: cq.ring().as_ptr(),
                ncqe: cq.ncqe(),
                dbrec: cq.dbrec().as_ptr(),
                collapsed: cq.mode() == CqMode::Collapsed,
            })
        };
        Kernel {
            qp: qa,
            _peer: qb,
            pi: 0,
            next: 0,
            completed: 0,
            cq: poller,
            src,
            dst,
            lkey: Lkey(ms.key),
            rkey: Rkey(md.key),
            wqes,
        }
    }
}

/// A CPU thread acting as a GPU kernel: WQEs into the ring, then only a store of the 64-bit
/// producer into the proxy word (no doorbell of its own).
struct Kernel {
    qp: Arc<Qp>,
    _peer: Arc<Qp>,
    /// 64-bit producer index (blocks).
    pi: u64,
    /// Next chunk (= WQEs posted so far).
    next: usize,
    completed: usize,
    cq: CqPoller,
    src: DmaBuf,
    dst: DmaBuf,
    lkey: Lkey,
    rkey: Rkey,
    wqes: usize,
}

impl Kernel {
    fn word(&self) -> &AtomicU64 {
        self.qp.ctrl_page().atomic_u64(self.qp.proxy_offset())
    }

    /// Starts the 64-bit producer at `base` (low 16 bits must be 0: the ring starts at 0).
    fn with_base(mut self, base: u64) -> Self {
        assert_eq!(base & 0xffff, 0);
        self.pi = base;
        self.word().store(base, Ordering::Release);
        self
    }

    fn post(&mut self) {
        let k = self.next;
        assert!(k < self.wqes, "kernel out of chunks");
        let off = (k * CHUNK) as u64;
        let sges = [Sge {
            addr: self.src.addr() + off,
            len: CHUNK as u32,
            lkey: self.lkey,
        }];
        let op = Op::Write {
            remote: RemoteAddr {
                addr: self.dst.addr() + off,
                rkey: self.rkey,
            },
            local: Local::Sges(&sges),
            imm: None,
        };
        let w = op
            .encode(self.pi as u16, self.qp.qpn(), CtrlFlags::SIGNALED)
            .unwrap();
        let ring_len = self.qp.sq_blocks() as usize * WQEBB;
        // SAFETY: the ring is live (the QP is held) and `ring_len` bytes long. The slots
        // written lie past the producer published so far, which the device never reads until
        // the proxy rings for them; the device reads the ring only through raw copies.
        let ring = unsafe { std::slice::from_raw_parts_mut(self.qp.sq_ring().as_ptr(), ring_len) };
        let after = w.copy_to_ring(ring).unwrap();
        self.pi += w.blocks() as u64;
        assert_eq!(after, self.pi as u16);
        self.next += 1;
    }

    fn publish(&self) {
        self.word().store(self.pi, Ordering::Release);
    }

    /// Waits until at most `left` WQEs are outstanding.
    fn drain_to(&mut self, left: usize) {
        let t0 = Instant::now();
        while self.next - self.completed > left {
            match self.cq.poll() {
                Some(c) => {
                    let c = c.decode();
                    assert!(
                        matches!(
                            c,
                            Completion::Req {
                                wqe_opcode: 0x08,
                                ..
                            }
                        ),
                        "QP {:#x}: {c:?}",
                        self.qp.qpn()
                    );
                    self.completed += 1;
                }
                None => {
                    assert!(
                        t0.elapsed() < TIMEOUT,
                        "QP {:#x}: {} WQEs never completed (proxy did not ring?)",
                        self.qp.qpn(),
                        self.next - self.completed
                    );
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Posts `n` WRITEs, publishing every `batch`, and waits for all of them.
    fn run(&mut self, n: usize, batch: usize) {
        let mut done = 0;
        while done < n {
            let b = batch.min(n - done);
            for _ in 0..b {
                self.post();
            }
            done += b;
            self.publish();
            self.drain_to(64);
        }
        self.drain_to(0);
    }

    /// Every chunk written so far arrived intact.
    fn verify(&self) {
        let n = self.next * CHUNK;
        let (mut s, mut d) = (vec![0u8; n], vec![0u8; n]);
        self.src.read(0, &mut s);
        self.dst.read(0, &mut d);
        assert!(s == d, "payload mismatch on QP {:#x}", self.qp.qpn());
        assert!(d.iter().any(|&x| x != 0));
    }
}

fn dbrec_snd(qp: &Qp) -> u32 {
    let raw = qp
        .ctrl_page()
        .atomic_u64(qp.dbrec_offset())
        .load(Ordering::Acquire);
    u32::from_be_bytes(raw.to_ne_bytes()[4..8].try_into().unwrap())
}

fn register(qp: &Qp) -> DoorbellValue {
    DoorbellValue::from_u64(qp.uar().atomic_u64(BF_OFFSET).load(Ordering::Acquire))
}

#[test]
fn proxy_rings_for_a_cpu_kernel_and_rejects_bad_producers() {
    let net = Net::new();
    // A 64-bit producer far past 16 bits: the DBREC and the doorbell carry its low 16 bits.
    let base = 3u64 << 32;
    let mut k = net.kernel(1, 300).with_base(base);
    let svc = ProxyService::start(cfg(1)).unwrap();
    let h = svc
        .add(soft_target(&net.a, &k.qp).with_start(base))
        .unwrap();
    let mut k = std::thread::spawn(move || {
        k.run(200, 5);
        k
    })
    .join()
    .unwrap();
    k.verify();
    let c = svc.counters();
    assert!((1..=40).contains(&c.doorbells), "{c:?}");
    assert_eq!((c.bad_producers, c.targets), (0, 1));
    assert!(c.scans > 0);
    assert_eq!(dbrec_snd(&k.qp), k.pi as u16 as u32);
    assert_eq!(
        register(&k.qp),
        DoorbellValue::from_pi(k.pi as u16, k.qp.qpn())
    );
    let dev = net.a.counters();
    assert_eq!(dev.bad_doorbells, 0);
    assert_eq!(dev.wqes_executed, 200);

    // Backwards: counted, not forwarded; the QP is untouched.
    let before = svc.counters().doorbells;
    k.word().store(k.pi - 5, Ordering::Release);
    wait_until("backwards producer counted", || {
        svc.counters().bad_producers == 1
    });
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(
        svc.counters().bad_producers,
        1,
        "counted once, not per scan"
    );
    assert_eq!(svc.counters().doorbells, before);
    assert_eq!(dbrec_snd(&k.qp), k.pi as u16 as u32);
    assert_eq!(k.qp.state(), QpState::Rts);
    assert_eq!(net.a.counters().bad_doorbells, 0);

    // Too far ahead (more than the 256-block SQ): counted, not forwarded.
    k.word().store(k.pi + 257, Ordering::Release);
    wait_until("jump counted", || svc.counters().bad_producers == 2);
    assert_eq!(dbrec_snd(&k.qp), k.pi as u16 as u32);

    // A sane value again: the QP resumes.
    k.run(20, 4);
    k.verify();
    assert_eq!(net.a.counters().wqes_executed, 220);
    assert_eq!(net.a.counters().bad_doorbells, 0);
    assert_eq!(svc.counters().bad_producers, 2);
    assert_eq!(svc.remove(h).unwrap(), k.pi);
    assert_eq!(svc.counters().targets, 0);
}

#[test]
fn many_qps_two_threads_few_active() {
    let net = Net::new();
    let svc = ProxyService::start(cfg(2)).unwrap();
    let active_at = [0usize, 1, 37, 62];
    let mut kernels = Vec::new();
    let mut idle = Vec::new();
    let mut handles = Vec::new();
    for i in 0..64 {
        let qp = if active_at.contains(&i) {
            let k = net.kernel(i as u8, 200);
            let qp = k.qp.clone();
            kernels.push(k);
            qp
        } else {
            let qp = net.idle_qp();
            idle.push(qp.clone());
            qp
        };
        handles.push(svc.add(soft_target(&net.a, &qp)).unwrap());
    }
    let per_thread: Vec<usize> = svc.thread_counters().iter().map(|c| c.targets).collect();
    assert_eq!(per_thread, vec![32, 32]);
    let threads: std::collections::BTreeSet<usize> =
        active_at.iter().map(|&i| handles[i].thread()).collect();
    assert_eq!(threads.len(), 2, "active QPs are served by both threads");

    let joins: Vec<_> = kernels
        .into_iter()
        .map(|mut k| {
            std::thread::spawn(move || {
                k.run(150, 3);
                k
            })
        })
        .collect();
    let kernels: Vec<Kernel> = joins.into_iter().map(|j| j.join().unwrap()).collect();
    for k in &kernels {
        k.verify();
        assert_eq!(dbrec_snd(&k.qp), k.pi as u32);
    }
    for qp in &idle {
        assert_eq!(dbrec_snd(qp), 0, "idle QP {:#x} was rung", qp.qpn());
        assert_eq!(register(qp).to_u64(), 0);
    }
    let c = svc.counters();
    assert_eq!(c.bad_producers, 0);
    assert!((4..=200).contains(&c.doorbells), "{c:?}");
    assert_eq!(c.targets, 64);
    assert!(svc.thread_counters().iter().all(|t| t.scans > 0));
    assert_eq!(net.a.counters().wqes_executed, 600);
    assert_eq!(net.a.counters().bad_doorbells, 0);
    for h in handles {
        svc.remove(h).unwrap();
    }
    assert_eq!(svc.counters().targets, 0);
}

/// Plain memory standing in for a QP's proxy word, doorbell record and register.
#[repr(C, align(64))]
#[derive(Default)]
struct FakeQp {
    producer: AtomicU64,
    dbrec: AtomicU64,
    doorbell: AtomicU64,
}

impl FakeQp {
    fn target(self: &Arc<Self>, qpn: u32, wake: Option<Wake>) -> ProxyTarget {
        let keep: Arc<dyn Any + Send + Sync> = self.clone();
        // SAFETY: the three words live in `self`, kept alive by `keep`; all are aligned
        // atomics and only the proxy writes the record and the register.
        unsafe {
            ProxyTarget::new(
                &self.producer,
                std::ptr::from_ref(&self.dbrec).cast::<u8>().cast_mut(),
                std::ptr::from_ref(&self.doorbell).cast::<u8>().cast_mut(),
                qpn,
                wake,
                keep,
            )
        }
        .unwrap()
    }
    fn snd(&self) -> u32 {
        let raw = self.dbrec.load(Ordering::Acquire).to_ne_bytes();
        u32::from_be_bytes(raw[4..8].try_into().unwrap())
    }
    fn reg(&self) -> DoorbellValue {
        DoorbellValue::from_u64(self.doorbell.load(Ordering::Acquire))
    }
}

fn counting_wake() -> (Wake, Arc<AtomicUsize>) {
    let n = Arc::new(AtomicUsize::new(0));
    let m = n.clone();
    (
        Arc::new(move || {
            m.fetch_add(1, Ordering::Relaxed);
        }),
        n,
    )
}

#[test]
fn add_and_remove_while_running_loses_no_doorbell() {
    let net = Net::new();
    let svc = ProxyService::start(cfg(2)).unwrap();
    let mut k = net.kernel(9, 500);
    let h = svc.add(soft_target(&net.a, &k.qp)).unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    let d = done.clone();
    let driver = std::thread::spawn(move || {
        for (i, batch) in [1usize, 2, 3, 4].iter().cycle().take(160).enumerate() {
            k.run(*batch, *batch);
            if i % 40 == 0 {
                std::thread::sleep(Duration::from_millis(1)); // let the threads park
            }
        }
        d.store(1, Ordering::Release);
        k
    });
    let pool: Vec<Arc<Qp>> = (0..8).map(|_| net.idle_qp()).collect();
    let mut pool_handles: Vec<_> = pool
        .iter()
        .map(|q| Some(svc.add(soft_target(&net.a, q)).unwrap()))
        .collect();
    let mut churn = 0u64;
    while done.load(Ordering::Acquire) == 0 || churn < 50 {
        // A fake QP that publishes before it is removed: the doorbell is not lost.
        let fake = Arc::new(FakeQp::default());
        let fh = svc.add(fake.target(0x42, None)).unwrap();
        let published = churn % 3;
        if published > 0 {
            fake.producer.store(published, Ordering::Release);
        }
        if churn % 2 == 0 {
            std::thread::yield_now();
        }
        assert_eq!(svc.remove(fh).unwrap(), published);
        assert_eq!(fake.snd(), published as u32);
        assert_eq!(
            Arc::strong_count(&fake),
            1,
            "the service still holds a removed target"
        );
        // Idle soft QPs come and go.
        let slot = (churn as usize) % pool.len();
        match pool_handles[slot].take() {
            Some(ph) => assert_eq!(svc.remove(ph).unwrap(), 0),
            None => pool_handles[slot] = Some(svc.add(soft_target(&net.a, &pool[slot])).unwrap()),
        }
        churn += 1;
    }
    let k = driver.join().unwrap();
    k.verify();
    assert_eq!(k.next, 400);
    assert_eq!(svc.counters().bad_producers, 0);
    assert_eq!(net.a.counters().wqes_executed, 400);
    assert_eq!(svc.remove(h).unwrap(), k.pi);
    for qp in &pool {
        assert_eq!(dbrec_snd(qp), 0);
    }
    drop(pool_handles);
}

#[test]
fn a_removed_qp_is_not_forwarded() {
    let net = Net::new();
    let svc = ProxyService::start(cfg(1)).unwrap();
    let mut k = net.kernel(5, 16);
    let h = svc.add(soft_target(&net.a, &k.qp)).unwrap();
    k.run(4, 4);
    let last = svc.remove(h).unwrap();
    assert_eq!(last, k.pi);
    let (snd, reg, rung) = (dbrec_snd(&k.qp), register(&k.qp), svc.counters().doorbells);
    let executed = net.a.counters().wqes_executed;

    k.post();
    k.publish();
    std::thread::sleep(Duration::from_millis(30));
    assert!(k.cq.poll().is_none(), "a removed QP was rung");
    assert_eq!((dbrec_snd(&k.qp), register(&k.qp)), (snd, reg));
    assert_eq!(svc.counters().doorbells, rung);
    assert_eq!(net.a.counters().wqes_executed, executed);

    // Added again from where it was left, the pending WQE goes out.
    let h = svc
        .add(soft_target(&net.a, &k.qp).with_start(last))
        .unwrap();
    k.drain_to(0);
    k.verify();
    assert_eq!(svc.counters().doorbells, rung + 1);
    assert_eq!(svc.remove(h).unwrap(), k.pi);
}

#[test]
fn sanity_rule_on_plain_memory() {
    let svc = ProxyService::start(cfg(1)).unwrap();
    let fake = Arc::new(FakeQp::default());
    let (wake, woken) = counting_wake();
    let h = svc.add(fake.target(0xabcdef, Some(wake))).unwrap();
    let s = &svc;
    // The proxy counts a doorbell before it rings it: wait for the count and for the ring
    // (the register holding the new index) too.
    let forwarded = |n: u64, q: &Arc<FakeQp>, pi: u32| {
        let q = q.clone();
        move || s.counters().doorbells == n && q.reg().index() == pi as u16
    };

    fake.producer.store(10, Ordering::Release);
    wait_until("first doorbell", forwarded(1, &fake, 10));
    assert_eq!(fake.snd(), 10);
    assert_eq!(fake.reg(), DoorbellValue::from_pi(10, 0xabcdef));
    wait_until("woken 1", || woken.load(Ordering::Relaxed) == 1);

    fake.producer.store(5, Ordering::Release);
    wait_until("backwards counted", || svc.counters().bad_producers == 1);
    fake.producer.store(10 + MAX_JUMP + 1, Ordering::Release);
    wait_until("jump counted", || svc.counters().bad_producers == 2);
    assert_eq!((fake.snd(), fake.reg().index()), (10, 10));
    assert_eq!(svc.counters().doorbells, 1);

    // Exactly MAX_JUMP ahead of the last forwarded value is sane.
    fake.producer.store(10 + MAX_JUMP, Ordering::Release);
    let pi = 10 + MAX_JUMP;
    wait_until("max jump forwarded", forwarded(2, &fake, pi as u32));
    assert_eq!(fake.snd(), pi as u16 as u32);
    assert_eq!(fake.reg(), DoorbellValue::from_pi(pi as u16, 0xabcdef));
    wait_until("woken 2", || woken.load(Ordering::Relaxed) == 2);
    assert_eq!(svc.remove(h).unwrap(), pi);

    // Across the 16-bit wrap, from a start the doorbell already covered.
    let wrap = Arc::new(FakeQp::default());
    let h = svc
        .add(wrap.target(7, None).with_start(65530).with_max_jump(64))
        .unwrap();
    wrap.producer.store(65530 + 65, Ordering::Release);
    wait_until("over max_jump counted", || {
        svc.counters().bad_producers == 3
    });
    wrap.producer.store(65540, Ordering::Release);
    wait_until("wrapped doorbell", forwarded(3, &wrap, 4));
    assert_eq!(wrap.snd(), 4);
    assert_eq!(wrap.reg(), DoorbellValue::from_pi(4, 7));
    assert_eq!(svc.remove(h).unwrap(), 65540);

    // A panicking wake is contained: counted, the doorbell written, the thread alive.
    let p = Arc::new(FakeQp::default());
    let h = svc
        .add(p.target(
            8,
            Some(Arc::new(|| panic!("wake failed (expected by the test)"))),
        ))
        .unwrap();
    p.producer.store(1, Ordering::Release);
    wait_until("panicking wake counted", || svc.counters().wake_panics == 1);
    assert_eq!(p.snd(), 1);
    p.producer.store(2, Ordering::Release);
    wait_until("thread still alive", || svc.counters().wake_panics == 2);
    assert_eq!(p.snd(), 2);
    assert_eq!(svc.remove(h).unwrap(), 2);
    svc.shutdown().unwrap();
}

#[test]
fn idle_threads_park_and_shutdown_joins_them() {
    let t0 = Instant::now();
    let svc = ProxyService::start(ProxyConfig {
        threads: 2,
        spin: Duration::from_micros(20),
        min_park: Duration::from_micros(10),
        max_park: Duration::from_millis(1),
    })
    .unwrap();
    let fakes: Vec<Arc<FakeQp>> = (0..4).map(|_| Arc::new(FakeQp::default())).collect();
    let handles: Vec<_> = fakes
        .iter()
        .enumerate()
        .map(|(i, f)| svc.add(f.target(i as u32 + 1, None)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let c = svc.counters();
    // Two threads idle for 50 ms: mostly parked (not spinning), with bounded timeouts.
    assert!(c.parks >= 10, "{c:?}");
    assert!(c.idle >= Duration::from_millis(40), "{c:?}");
    assert!(
        c.idle <= 2 * t0.elapsed() + Duration::from_millis(5),
        "{c:?}"
    );
    assert!(c.scans >= c.parks);
    assert_eq!((c.doorbells, c.targets), (0, 4));

    // A write after a long idle period is still noticed (within max_park).
    fakes[0].producer.store(3, Ordering::Release);
    wait_until("doorbell after idling", || svc.counters().doorbells == 1);

    svc.shutdown().unwrap();
    svc.shutdown().unwrap(); // idempotent
    assert!(!svc.is_running());
    let scans = svc.counters().scans;
    fakes[1].producer.store(1, Ordering::Release);
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(svc.counters().scans, scans, "a thread still scans");
    assert_eq!(svc.counters().doorbells, 1);
    assert_eq!(fakes[1].snd(), 0);
    assert!(matches!(
        svc.add(fakes[0].target(9, None)),
        Err(ProxyError::ShutDown)
    ));
    // Removal still works; it forwards what was published before it.
    let mut hs = handles.into_iter();
    assert_eq!(svc.remove(hs.next().unwrap()).unwrap(), 3);
    assert_eq!(svc.remove(hs.next().unwrap()).unwrap(), 1);
    assert_eq!(fakes[1].snd(), 1);
    drop(svc);
    for f in &fakes {
        assert_eq!(Arc::strong_count(f), 1, "a target outlived the service");
    }
}

#[test]
fn bad_configs_and_targets_are_refused() {
    let bad = |c: ProxyConfig| matches!(ProxyService::start(c), Err(ProxyError::InvalidConfig(_)));
    assert!(bad(ProxyConfig {
        threads: 0,
        ..Default::default()
    }));
    assert!(bad(ProxyConfig {
        min_park: Duration::from_millis(2),
        max_park: Duration::from_millis(1),
        ..Default::default()
    }));
    let f = Arc::new(FakeQp::default());
    let keep: Arc<dyn Any + Send + Sync> = f.clone();
    let reg = std::ptr::from_ref(&f.doorbell).cast::<u8>().cast_mut();
    // SAFETY: refused before any access (misaligned register; QPN over 24 bits).
    let misaligned =
        unsafe { ProxyTarget::new(&f.producer, reg, reg.wrapping_add(4), 1, None, keep.clone()) };
    assert!(matches!(misaligned, Err(ProxyError::InvalidTarget(_))));
    // SAFETY: as above.
    let big_qpn = unsafe { ProxyTarget::new(&f.producer, reg, reg, 1 << 24, None, keep) };
    assert!(matches!(big_qpn, Err(ProxyError::InvalidTarget(_))));

    // A handle of one service is refused by another.
    let s1 = ProxyService::start(ProxyConfig::default()).unwrap();
    let s2 = ProxyService::start(ProxyConfig::default()).unwrap();
    let h = s1.add(f.target(1, None)).unwrap();
    assert!(matches!(s2.remove(h), Err(ProxyError::UnknownHandle)));
}
