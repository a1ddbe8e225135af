//! Completion queues, RC queue pairs and DC initiators and targets: sizes, ring placement,
//! doorbell mode, state transitions, endpoints and connection.

mod cq;
mod dc;
mod poster;
mod qp;
mod recover;
mod ring;
mod state;

pub use crate::backend::ConnectOptions;
pub use cq::{Cq, CqOptions};
pub use dc::{DcTarget, Dct, DctOptions};
pub use poster::Poster;
pub(crate) use poster::PosterClaim;
pub use qp::{Qp, QpOptions};
pub use recover::Drained;
pub use ring::RingPlacement;
pub(crate) use state::QueueState;
pub use verbs::{CqInit, CqMode, QpState};
pub use verbs::{DoorbellMode, Modify};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::seam::GpuRings;
    use crate::{Context, DeviceRequest, Error};
    use std::sync::Arc;
    use verbs::initiator::RingMode;
    use verbs::{DmaBuf, SimDeviceMemory};

    /// Set in the child processes of the test below.
    const PSN_CHILD: &str = "GPUVERBS_TEST_PSN_CHILD";

    #[test]
    fn initial_psns_are_random_not_a_function_of_the_qpn() {
        if std::env::var_os(PSN_CHILD).is_some() {
            // The first QP of a fresh process: the same QPN in every run.
            let ctx = Context::open(DeviceRequest::Soft).unwrap();
            let pd = ctx.alloc_pd();
            let cq = ctx.create_cq(CqOptions::default()).unwrap();
            let qp = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
            let ep = qp.endpoint();
            println!("\nPSN-CHILD {} {}", qp.qpn(), ep.psn());
            return;
        }
        let name = "queue::tests::initial_psns_are_random_not_a_function_of_the_qpn";
        let mut seen = Vec::new();
        for _ in 0..4 {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", name, "--nocapture", "--test-threads=1"])
                .env(PSN_CHILD, "1")
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text
                .lines()
                .find_map(|l| l.split_once("PSN-CHILD ").map(|(_, v)| v.trim()))
                .unwrap_or_else(|| panic!("no PSN line in {text}"));
            let v: Vec<u32> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            assert!(v[1] <= 0xff_ffff);
            seen.push((v[0], v[1]));
        }
        assert!(seen.iter().all(|&(q, _)| q == seen[0].0), "{seen:x?}");
        let mut psns: Vec<u32> = seen.iter().map(|&(_, p)| p).collect();
        psns.sort_unstable();
        psns.dedup();
        // the same QPN every time; four equal 24-bit draws would be a 2^-72 chance
        assert!(psns.len() > 1, "{seen:x?}");
    }

    /// A GPU of simulated device memory that hands out rings one after the other.
    struct SimGpu {
        mem: Arc<SimDeviceMemory>,
        next: std::sync::atomic::AtomicU64,
    }

    impl Default for SimGpu {
        fn default() -> Self {
            Self {
                mem: SimDeviceMemory::new(1 << 20),
                next: Default::default(),
            }
        }
    }

    impl GpuRings for SimGpu {
        fn ring_buffer(&self, len: usize) -> Result<DmaBuf, Error> {
            use std::sync::atomic::Ordering::Relaxed;
            let off = self
                .next
                .fetch_add((len as u64).next_multiple_of(4096), Relaxed);
            assert!(off + len as u64 <= 1 << 20, "the simulated GPU is full");
            let mem: Arc<dyn verbs::DeviceMemory> = self.mem.clone();
            Ok(DmaBuf::from_device(
                self.mem.base() + off,
                len,
                mem,
                Box::new(()),
            ))
        }
        fn dmabuf(&self, _: u64, _: u64) -> Result<(std::os::fd::OwnedFd, u64), String> {
            Err("simulated GPU memory has no dma-buf".into())
        }
        fn memory(&self) -> Arc<dyn verbs::DeviceMemory> {
            self.mem.clone()
        }
    }

    #[test]
    fn automatic_placement_is_host_memory_on_the_soft_nic_and_without_a_gpu() {
        let ctx = Context::open(DeviceRequest::Soft).unwrap();
        let pd = ctx.alloc_pd();
        let gpu = SimGpu::default();
        // the default, with a GPU to place rings for: the soft NIC wants host rings
        let cq = ctx
            .create_cq_with(CqOptions::default(), Some(&gpu))
            .unwrap();
        assert_eq!(cq.placement(), RingPlacement::HostMapped);
        assert!(
            cq.placement_reason().contains("soft NIC's engine"),
            "{}",
            cq.placement_reason()
        );
        let qp = pd
            .create_qp_with(QpOptions::new(&cq, &cq), Some(&gpu))
            .unwrap();
        assert_eq!(qp.placement(), RingPlacement::HostMapped);
        assert!(
            qp.placement_reason().contains("soft NIC's engine"),
            "{}",
            qp.placement_reason()
        );
        // host rings: a plain GPU doorbell
        assert_eq!(qp.doorbell().0, DoorbellMode::GpuDoorbell);
        assert!(qp.doorbell().1.starts_with("auto: "), "{}", qp.doorbell().1);
        assert!(qp.try_cpu_initiator(RingMode::Doca).is_ok());
        // without a GPU: host memory, whatever the device
        let host = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
        assert_eq!(host.placement(), RingPlacement::HostMapped);
        assert!(host
            .placement_reason()
            .starts_with("auto: host memory, no GPU given"));
        // asked for: as asked, and said so
        let mut o = QpOptions::new(&cq, &cq);
        o.placement = RingPlacement::Gpu;
        let on_gpu = pd.create_qp_with(o, Some(&gpu)).unwrap();
        assert_eq!(
            (on_gpu.placement(), on_gpu.placement_reason()),
            (RingPlacement::Gpu, "requested")
        );
        // a send ring in GPU memory: the soft NIC's automatic doorbell is BlueFlame (its engine
        // would copy each WQE out of GPU memory; the register carries a single one to it)
        let (mode, why) = on_gpu.doorbell();
        assert_eq!(mode, DoorbellMode::BlueFlame);
        assert!(
            why.starts_with("auto: BlueFlame") && why.contains("GPU memory"),
            "{why}"
        );
        // a mode asked for is kept, GPU rings or not
        let mut o = QpOptions::new(&cq, &cq);
        o.placement = RingPlacement::Gpu;
        o.doorbell = DoorbellMode::GpuDoorbell;
        let asked = pd.create_qp_with(o, Some(&gpu)).unwrap();
        assert_eq!(asked.doorbell(), (DoorbellMode::GpuDoorbell, "requested"));
    }

    #[test]
    fn rings_in_device_memory_reach_the_device_and_refuse_the_cpu() {
        let ctx = Context::open(DeviceRequest::Soft).unwrap();
        let pd = ctx.alloc_pd();
        let gpu_o = CqOptions {
            depth: 64,
            placement: RingPlacement::Gpu,
            ..Default::default()
        };
        // without the GPU: an error that names the call to use
        match ctx.create_cq(gpu_o) {
            Err(Error::Unsupported(m)) => assert!(m.contains("create_cq_on"), "{m}"),
            r => panic!("{r:?}"),
        }
        let gpu = SimGpu::default();
        let cq = ctx.create_cq_with(gpu_o, Some(&gpu)).unwrap();
        assert_eq!(cq.placement(), RingPlacement::Gpu);
        let host_cq = ctx.create_cq(CqOptions::default()).unwrap();
        assert_eq!(host_cq.placement(), RingPlacement::HostMapped);
        let mut o = QpOptions::new(&host_cq, &host_cq);
        o.placement = RingPlacement::Gpu;
        match pd.create_qp(o.clone()) {
            Err(Error::Unsupported(m)) => assert!(m.contains("create_qp_on"), "{m}"),
            r => panic!("{r:?}"),
        }
        let qp = pd.create_qp_with(o, Some(&gpu)).unwrap();
        assert_eq!(qp.placement(), RingPlacement::Gpu);
        assert!(matches!(
            qp.try_cpu_initiator(RingMode::Doca),
            Err(Error::InvalidArgument(_))
        ));
        // a host QP on a device-memory CQ is refused too
        let q2 = pd.create_qp(QpOptions::new(&cq, &host_cq)).unwrap();
        assert_eq!(q2.placement(), RingPlacement::HostMapped);
        assert!(q2.try_cpu_initiator(RingMode::Doca).is_err());
        let q3 = pd.create_qp(QpOptions::new(&host_cq, &host_cq)).unwrap();
        assert!(q3.try_cpu_initiator(RingMode::Doca).is_ok());
    }

    #[test]
    fn a_gpu_export_claim_excludes_the_cpu_and_pairs_with_the_proxy() {
        let ctx = Context::open(DeviceRequest::Soft).unwrap();
        let cq = ctx.create_cq(CqOptions::default()).unwrap();
        let qp = ctx.alloc_pd().create_qp(QpOptions::new(&cq, &cq)).unwrap();
        let ini = qp.cpu_initiator(RingMode::Doca);
        assert!(matches!(
            qp.posters.claim(Poster::GpuExport),
            Err(Error::PosterBusy {
                held: Poster::CpuInitiator,
                wanted: Poster::GpuExport
            })
        ));
        drop(ini);
        let gpu = qp.posters.claim(Poster::GpuExport).unwrap();
        let proxy = qp.posters.claim(Poster::Proxy).unwrap();
        assert!(matches!(
            qp.posters.claim(Poster::GpuExport),
            Err(Error::PosterBusy {
                held: Poster::GpuExport,
                wanted: Poster::GpuExport
            })
        ));
        assert!(matches!(
            qp.try_cpu_initiator(RingMode::Doca),
            Err(Error::PosterBusy {
                wanted: Poster::CpuInitiator,
                ..
            })
        ));
        drop((gpu, proxy));
        assert!(qp.try_cpu_initiator(RingMode::Doca).is_ok());
    }

    #[test]
    fn a_gpu_descriptor_continues_from_the_queue() {
        use crate::export::resume_desc;
        use crate::{Access, ConnectOptions, HostBuffer};
        use prm::wqe::{CtrlFlags, Local, Op};
        let (a, b) = (
            Context::open(DeviceRequest::Soft).unwrap(),
            Context::open(DeviceRequest::Soft).unwrap(),
        );
        let (sa, ra, cb) = (
            a.create_cq(CqOptions::default()).unwrap(),
            a.create_cq(CqOptions::default()).unwrap(),
            b.create_cq(CqOptions::default()).unwrap(),
        );
        let pa = a.alloc_pd();
        let qa = pa.create_qp(QpOptions::new(&sa, &ra)).unwrap();
        let shared = pa.create_qp(QpOptions::new(&sa, &sa)).unwrap();
        let pb = b.alloc_pd();
        let qb = pb.create_qp(QpOptions::new(&cb, &cb)).unwrap();
        let o = ConnectOptions {
            access: Access::REMOTE_WRITE,
            ..Default::default()
        };
        qa.connect(&qb.endpoint(), o).unwrap();
        qb.connect(&qa.endpoint(), o).unwrap();
        let (src, dst) = (HostBuffer::new(64), HostBuffer::new(64));
        let smr = pa.register(&src).unwrap();
        let dmr = pb
            .register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let mut ini = qa.cpu_initiator(RingMode::RdmaCore);
        ini.post_recv(&[smr.sge(0, 8)]).unwrap();
        for i in 0..3 {
            let op = Op::Write {
                remote: dmr.remote(i * 8),
                local: Local::Sges(&[smr.sge(0, 8)]),
                imm: None,
            };
            ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
            ini.wait_send(std::time::Duration::from_secs(5)).unwrap();
        }
        drop(ini);
        let st = qa.queue_state();
        let mut d = crate::export::QpDesc {
            rq_wqes: 256,
            ..Default::default()
        };
        resume_desc(&mut d, &st).unwrap();
        assert_eq!(
            (
                d.sq_reserved,
                d.sq_ready,
                d.sq_rung,
                d.sq_retired,
                d.sq_signaled_end
            ),
            (3, 3, 3, 3, 3)
        );
        assert_eq!((d.scq_ci, d.rcq_ci, d.rq_posted), (3, 0, 1));
        // A receive CQ that also takes send completions (here qa's): an RQ never posted to
        // starts fresh, one posted to is not in step with it.
        let mut e = crate::export::QpDesc {
            rq_wqes: 256,
            ..Default::default()
        };
        resume_desc(&mut e, &shared.queue_state()).unwrap();
        assert_eq!((e.scq_ci, e.rcq_ci, e.rq_posted), (3, 3, 3));
        let mut ini = shared.cpu_initiator(RingMode::RdmaCore);
        ini.post_recv(&[smr.sge(0, 8)]).unwrap();
        drop(ini);
        assert!(matches!(
            resume_desc(&mut e, &shared.queue_state()),
            Err(Error::InvalidArgument(_))
        ));
    }
}
