//! The checks: facts in, [`Check`]s out. The deciding functions are pure (they take what the
//! probes found), so the tests (`tests.rs`) cover the cases this machine cannot show.

use crate::doctor::cuda::{self, CudaProbeError, DriverInfo, GpuInfo};
use crate::doctor::sysfs::{self, Bdf, Limit, PeerMapping, PeerMem, Sys};
use crate::doctor::{nvml, rdma, Check, Options, Report, Status};
use gpuverbs::device::BackendKind;
use gpuverbs::{Access, Context, CqOptions, DeviceRequest, QpOptions, Selection};

mod pcie;

use pcie::topology;
pub use pcie::{acs_check, iommu_check, path_status};

const NA: Status = Status::NotApplicable;

/// A GPU as the checks see it: from the driver when there is one, else from sysfs.
#[derive(Clone, Debug)]
struct GpuRef {
    /// `gpu0`, ... (CUDA ordinal), or `pci:0000:65:00.0` without a driver.
    label: String,
    bdf: Option<Bdf>,
}

/// Runs every check against the machine `sys` describes; `opts.gpu`: a GPU is wanted.
pub fn run(sys: &Sys, opts: Options) -> Report {
    let mut r = Report::default();
    let pci_gpus = sysfs::nvidia_gpus(sys);
    let module = sysfs::nvidia_module(sys);
    let peer = sysfs::peermem(sys);
    let pmo = sysfs::peer_mapping_override(sys);
    let driver = cuda::probe();

    r.checks.push(cuda_driver(&driver, &pci_gpus, opts.gpu));
    r.checks.push(kernel_module(
        module.as_ref(),
        !pci_gpus.is_empty(),
        opts.gpu,
    ));

    let mut gpus: Vec<GpuRef> = Vec::new();
    let mut infos: Vec<GpuInfo> = Vec::new();
    if let Ok(d) = &driver {
        for (i, g) in d.gpus.iter().enumerate() {
            match g {
                Ok(g) => {
                    let numa = g
                        .bdf
                        .and_then(|b| sysfs::pci_device(sys, b))
                        .and_then(|p| p.numa_node);
                    r.checks.extend(gpu_checks(g, numa));
                    gpus.push(GpuRef {
                        label: format!("gpu{i}"),
                        bdf: g.bdf,
                    });
                    infos.push(g.clone());
                }
                Err(e) => r.checks.push(Check::new(
                    format!("gpu{i}"),
                    Status::Fail,
                    format!("the driver lists it, but querying it failed: {e}"),
                )),
            }
        }
    } else {
        gpus.extend(pci_gpus.iter().map(|p| GpuRef {
            label: format!("pci:{}", p.bdf),
            bdf: Some(p.bdf),
        }));
    }
    let dma_buf_any = infos.iter().any(|g| g.dma_buf == Ok(1));
    r.checks
        .push(peermem_check(&peer, !gpus.is_empty(), dma_buf_any));

    // rdma-core
    let libs = rdma::libraries();
    let devices = match &libs {
        Ok(_) => Some(rdma::devices()),
        Err(_) => None,
    };
    r.checks.push(rdma_core(&libs));
    let mut nics: Vec<(String, Option<sysfs::PciDevice>)> = Vec::new();
    match &devices {
        None => r.checks.push(Check::new(
            "rdma.devices",
            NA,
            "rdma-core is not loaded, so no device can be listed",
        )),
        Some(Err(e)) if !matches!(e, rdma::RdmaProbeError::Verbs { errno, .. } if *errno == libc::ENOSYS) => {
            r.checks
                .push(Check::new("rdma.devices", Status::Fail, e.to_string()))
        }
        Some(list) => {
            let list = list.as_ref().map(Vec::as_slice).unwrap_or_default();
            if list.is_empty() {
                r.checks.push(no_rdma_devices(
                    sys,
                    devices.as_ref().is_some_and(|d| d.is_err()),
                ));
            }
            for d in list {
                let emulated = sysfs::rdma_attr(sys, &d.name, "board_id")
                    .is_some_and(|b| b == "GPUVERBS_SOFTNIC");
                r.checks.push(rdma_device(d, emulated));
                nics.push((d.name.clone(), sysfs::rdma_pci_device(sys, &d.name)));
            }
        }
    }

    // topology, ACS, IOMMU
    let mut bdfs: Vec<Bdf> = gpus.iter().filter_map(|g| g.bdf).collect();
    bdfs.extend(nics.iter().filter_map(|(_, p)| p.as_ref().map(|p| p.bdf)));
    r.checks.extend(topology(sys, &gpus, &nics));
    r.checks.push(iommu_check(&sysfs::iommu(sys, &bdfs)));

    // BAR1
    r.checks.extend(bar1_checks(sys, &gpus, driver.is_ok()));

    // memlock
    r.checks.push(memlock_check(sysfs::memlock(sys)));

    // trials
    let first_gpu = infos.first().map(|g| g.ordinal);
    r.checks
        .push(doorbell_trial(first_gpu, &driver, devices.as_ref(), &pmo));
    match &driver {
        Ok(_) if infos.is_empty() => r.checks.push(Check::new("trial.dma_buf", NA, "no GPU")),
        Ok(_) => {
            for g in &infos {
                r.checks
                    .push(dma_buf_trial(g, cuda::trial_dmabuf(g.ordinal)));
            }
        }
        Err(e) => r
            .checks
            .push(Check::new("trial.dma_buf", NA, e.to_string())),
    }

    // what gpuverbs chooses
    let (checks, selection) = choice(first_gpu, dma_buf_any, &peer);
    r.checks.extend(checks);
    r.runs_here = runs_here(selection.as_ref(), first_gpu);
    r
}

/// The report's closing sentence: the device gpuverbs opens here and who posts on it.
pub fn runs_here(sel: Option<&Selection>, gpu: Option<usize>) -> String {
    let Some(sel) = sel else {
        return String::new();
    };
    let dev = match sel.kind {
        BackendKind::Soft => format!("the soft NIC {} (in this process)", sel.name),
        BackendKind::Mlx5 => format!("the mlx5 backend on {}", sel.name),
    };
    match gpu {
        Some(g) => format!(
            "{dev}, driven by CUDA kernels on gpu{g} (GPU-initiated) or by the CPU initiator"
        ),
        None => format!(
            "{dev}, driven by the CPU initiator (host threads post and poll: Qp::cpu_initiator, \
             the samples' --initiator cpu); no GPU, so no kernel posts"
        ),
    }
}

/// rdma-core lists nothing (or says ENOSYS: no kernel RDMA support).
fn no_rdma_devices(sys: &Sys, enosys: bool) -> Check {
    let mlx = sysfs::mellanox_nics(sys);
    let what = if enosys {
        "ibv_get_device_list: ENOSYS, the kernel has no RDMA support (no class/infiniband_verbs)"
    } else {
        "rdma-core lists no RDMA device"
    };
    let detail = if mlx.is_empty() {
        format!("{what}; no Mellanox network function on the PCI bus either: gpuverbs uses the in-process soft NIC")
    } else {
        format!(
            "{what}, but the PCI bus has Mellanox network functions {} (is mlx5_ib loaded?): \
             gpuverbs uses the in-process soft NIC",
            mlx.iter()
                .map(|d| d.bdf.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    Check::new("rdma.devices", Status::Warn, detail)
}

fn attr_text(a: &Result<i32, CudaProbeError>) -> String {
    match a {
        Ok(v) => v.to_string(),
        Err(e) => format!("unreadable ({e})"),
    }
}

/// The CUDA driver and its devices. Without a GPU anywhere (none on the PCI bus, and no driver or
/// one that finds no device) it is not applicable; a GPU or driver that is there but unusable is
/// a warning; with `want_gpu` (`doctor --gpu`) either is a failure.
pub fn cuda_driver(
    d: &Result<DriverInfo, CudaProbeError>,
    pci: &[sysfs::PciDevice],
    want_gpu: bool,
) -> Check {
    let pci_text = if pci.is_empty() {
        "no NVIDIA GPU on the PCI bus".to_string()
    } else {
        format!(
            "NVIDIA GPUs on the PCI bus: {}",
            pci.iter()
                .map(|p| format!("{} ({:04x}:{:04x})", p.bdf, p.vendor, p.device))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let without = if want_gpu {
        "--gpu: a GPU was asked for, and GPU-initiated networking needs one"
    } else {
        "what runs here without a GPU: the soft NIC (or an rdma-core device) with the CPU \
         initiator; kernels need a GPU (`doctor --gpu` makes this a failure)"
    };
    let missing = |absent_everywhere: bool| match (want_gpu, absent_everywhere) {
        (true, _) => Status::Fail,
        (false, true) => NA,
        (false, false) => Status::Warn,
    };
    match d {
        Ok(d) if !d.gpus.is_empty() => Check::new(
            "cuda.driver",
            Status::Ok,
            format!(
                "CUDA driver {} (cuDriverGetVersion {}), {} device(s); {pci_text}",
                d.version_text(),
                d.version,
                d.gpus.len()
            ),
        ),
        Ok(d) => Check::new(
            "cuda.driver",
            missing(pci.is_empty()),
            format!(
                "CUDA driver {} (cuDriverGetVersion {}) lists no device (CUDA_VISIBLE_DEVICES?); \
                 {pci_text}; {without}",
                d.version_text(),
                d.version
            ),
        ),
        Err(e) => Check::new(
            "cuda.driver",
            missing(
                pci.is_empty()
                    && (matches!(e, CudaProbeError::NoDriver)
                        || e.code() == Some(cuda::ERR_NO_DEVICE)),
            ),
            format!("{e}; {pci_text}; {without}"),
        ),
    }
}

fn kernel_module(m: Option<&sysfs::NvidiaModule>, gpu_on_bus: bool, want_gpu: bool) -> Check {
    match m {
        Some(m) => Check::new(
            "nvidia.kernel_module",
            Status::Ok,
            format!(
                "{} kernel module {} (/proc/driver/nvidia/version: {})",
                if m.open { "open" } else { "proprietary" },
                m.version.as_deref().unwrap_or("(version not found)"),
                m.line
            ),
        ),
        None if gpu_on_bus => Check::new(
            "nvidia.kernel_module",
            if want_gpu { Status::Fail } else { Status::Warn },
            "/proc/driver/nvidia/version is absent although an NVIDIA GPU is on the PCI bus: the \
             nvidia kernel module is not loaded (or this container cannot see /proc/driver/nvidia)",
        ),
        None => Check::new(
            "nvidia.kernel_module",
            NA,
            "/proc/driver/nvidia/version is absent: no NVIDIA kernel module loaded",
        ),
    }
}

/// The per-GPU checks: identity, dma-buf, GPUDirect RDMA write ordering.
fn gpu_checks(g: &GpuInfo, numa: Option<u32>) -> Vec<Check> {
    let n = format!("gpu{}", g.ordinal);
    let mut v = vec![Check::new(
        n.clone(),
        Status::Ok,
        format!(
            "{} (sm_{}{}), {} GiB, PCI {} ({}), NUMA node {}",
            g.name,
            g.cc.0,
            g.cc.1,
            g.memory >> 30,
            g.bdf
                .map_or_else(|| "unparsed".to_string(), |b| b.to_string()),
            g.bus_id,
            numa.map_or_else(|| "unknown".into(), |n| n.to_string())
        ),
    )];
    let gdr = format!("GPU_DIRECT_RDMA_SUPPORTED {}", attr_text(&g.gdr));
    v.push(match &g.dma_buf {
        Ok(1) => Check::new(
            format!("{n}.dma_buf"),
            Status::Ok,
            format!("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED 1: GPU memory can be exported as dma-buf (ibv_reg_dmabuf_mr); {gdr}"),
        ),
        Ok(v) => Check::new(
            format!("{n}.dma_buf"),
            Status::Warn,
            format!("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED {v}: no dma-buf export (needs the open kernel module, or a kernel with dma-buf support); GPU-memory registration then needs nvidia-peermem; {gdr}"),
        ),
        Err(e) => Check::new(format!("{n}.dma_buf"), Status::Warn, format!("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED unreadable: {e}; {gdr}")),
    });
    v.push(writes_ordering(&n, &g.writes_ordering, &g.flush_options));
    v
}

/// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: 200 (all devices) and 100 (owner) are
/// what a kernel polling NIC-written data relies on; 0 means NIC writes may be seen out of order
/// by kernels without a `cuFlushGPUDirectRDMAWrites`.
fn writes_ordering(
    n: &str,
    o: &Result<i32, CudaProbeError>,
    flush: &Result<i32, CudaProbeError>,
) -> Check {
    let name = format!("{n}.gdr_writes_ordering");
    let flush = format!("FLUSH_WRITES_OPTIONS {}", attr_text(flush));
    match o {
        Ok(200) => Check::new(name, Status::Ok, format!("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING 200 (ALL_DEVICES): NIC writes into GPU memory are seen in order by every device; {flush}")),
        Ok(100) => Check::new(name, Status::Ok, format!("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING 100 (OWNER): NIC writes are seen in order by kernels on this GPU (not by peers); {flush}")),
        Ok(v) => Check::new(name, Status::Warn, format!("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING {v} (NONE): a kernel may see a NIC's signal before the data it announces; such data needs cuFlushGPUDirectRDMAWrites; {flush}")),
        Err(e) => Check::new(name, Status::Warn, format!("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING unreadable: {e}")),
    }
}

/// nvidia-peermem: needed for GPU-memory registration where dma-buf is not available.
fn peermem_check(p: &PeerMem, gpus: bool, dma_buf: bool) -> Check {
    let mut evidence = match &p.nvidia_peermem {
        Some(v) => format!("/sys/module/nvidia_peermem present (version {v})"),
        None => "/sys/module/nvidia_peermem absent".to_string(),
    };
    if p.memory_peers.is_empty() {
        evidence.push_str("; no /sys/kernel/mm/memory_peers/*/version");
    } else {
        for (n, v) in &p.memory_peers {
            evidence.push_str(&format!("; memory_peers/{n} version {v}"));
        }
    }
    let (status, what) = match (p.loaded(), gpus, dma_buf) {
        (true, _, _) => (
            Status::Ok,
            "peer-memory client loaded: ibv_reg_mr on GPU addresses works",
        ),
        (false, false, _) => (NA, "no GPU"),
        (false, true, true) => (
            Status::Ok,
            "not loaded, not needed: the GPU exports dma-buf (ibv_reg_dmabuf_mr)",
        ),
        (false, true, false) => (
            Status::Fail,
            "not loaded and no dma-buf: a NIC cannot register GPU memory (modprobe nvidia-peermem)",
        ),
    };
    Check::new("nvidia.peermem", status, format!("{what}; {evidence}"))
}

fn rdma_core(l: &Result<rdma::Libraries, rdma::RdmaProbeError>) -> Check {
    match l {
        Ok(l) => {
            let rel = l.release.as_deref().map_or_else(
                || "release unknown".to_string(),
                |r| format!("rdma-core {r}"),
            );
            let file = l.verbs_file.as_deref().unwrap_or(rdma_core_sys::LIBIBVERBS);
            match &l.mlx5 {
                Ok(m) => Check::new("rdma_core", Status::Ok, format!("{rel}: {file}, {m}")),
                Err(e) => Check::new(
                    "rdma_core",
                    Status::Warn,
                    format!("{rel}: {file}; the mlx5 provider did not load ({e}): the ConnectX backend cannot be used"),
                ),
            }
        }
        Err(e) => Check::new(
            "rdma_core",
            Status::Warn,
            format!("{e}: only the in-process soft NIC is available"),
        ),
    }
}

/// One RDMA device: ok when it is an mlx5 device with an ACTIVE Ethernet port that has a RoCE
/// v2 GID (what gpuverbs' backend needs); warn otherwise, saying which part is missing.
fn rdma_device(d: &rdma::Device, emulated: bool) -> Check {
    let name = format!("rdma.{}", d.name);
    let ports = match &d.ports {
        Ok(p) => p,
        Err(e) => return Check::new(name, Status::Fail, e.to_string()),
    };
    let mut text = format!(
        "{}{}{}",
        if d.mlx5 { "mlx5" } else { "not mlx5" },
        if emulated {
            " (emulated: gpuverbs emu)"
        } else {
            ""
        },
        if d.fw_ver.is_empty() {
            String::new()
        } else {
            format!(", fw {}", d.fw_ver)
        }
    );
    for p in ports {
        let gids: Vec<String> = p
            .gids
            .iter()
            .map(|g| format!("[{}] {} {}", g.index, g.gid, g.kind))
            .collect();
        text.push_str(&format!(
            "; port {}: {}, {}, MTU {}, GIDs {}",
            p.num,
            p.state,
            p.link_layer,
            p.mtu,
            if gids.is_empty() {
                "none".to_string()
            } else {
                gids.join(", ")
            }
        ));
    }
    let usable = ports
        .first()
        .is_some_and(|p| p.active && p.link_layer == "Ethernet" && p.has_roce_v2());
    let status = if d.mlx5 && usable {
        Status::Ok
    } else {
        text.push_str(if !d.mlx5 {
            ": gpuverbs' backend drives mlx5 devices only"
        } else {
            ": gpuverbs needs port 1 ACTIVE, Ethernet, with a RoCE v2 GID"
        });
        Status::Warn
    };
    Check::new(name, status, text)
}

fn bar1_checks(sys: &Sys, gpus: &[GpuRef], driver: bool) -> Vec<Check> {
    if gpus.is_empty() {
        return vec![Check::new("bar1", NA, "no GPU")];
    }
    let ids: Vec<String> = gpus
        .iter()
        .map(|g| g.bdf.map(|b| b.to_string()).unwrap_or_default())
        .collect();
    let nv = if driver {
        nvml::bar1(&ids)
    } else {
        Err(nvml::NvmlError::NotLoaded("no CUDA driver".into()))
    };
    gpus.iter()
        .enumerate()
        .map(|(i, g)| {
            let name = format!("{}.bar1", g.label);
            let sysfs_size = g.bdf.and_then(|b| sysfs::bar_size(sys, b, 1)).map_or_else(
                || "sysfs BAR1 size unknown".to_string(),
                |s| format!("sysfs BAR1 {}", Limit::Bytes(s)),
            );
            match &nv {
                Err(e) => Check::new(name, NA, format!("NVML not available: {e}; {sysfs_size}")),
                Ok(v) => match &v[i] {
                    Err(e) => Check::new(name, Status::Warn, format!("{e}; {sysfs_size}")),
                    Ok(b) => bar1_status(&name, b, &sysfs_size),
                },
            }
        })
        .collect()
}

/// BAR1 from NVML: below 1 GiB total, or under 10% free, is a warning (registrations of GPU
/// memory map through it).
pub fn bar1_status(name: &str, b: &nvml::Bar1, extra: &str) -> Check {
    let text = format!(
        "NVML BAR1 total {}, used {}, free {}; {extra}",
        Limit::Bytes(b.total),
        Limit::Bytes(b.used),
        Limit::Bytes(b.free)
    );
    if b.total < 1 << 30 {
        Check::new(
            name,
            Status::Warn,
            format!("{text}: a small BAR1 limits how much GPU memory a NIC can reach at once"),
        )
    } else if b.free < b.total / 10 {
        Check::new(name, Status::Warn, format!("{text}: BAR1 is nearly full"))
    } else {
        Check::new(name, Status::Ok, text)
    }
}

/// The locked-memory limit: unlimited is ok, anything else a warning with the value
/// (registrations and pinned rings beyond it fail with ENOMEM).
pub fn memlock_check(l: Option<(Limit, Limit)>) -> Check {
    match l {
        None => Check::new("memlock", Status::Warn, "/proc/self/limits has no Max locked memory line"),
        Some((Limit::Unlimited, h)) => Check::new("memlock", Status::Ok, format!("soft unlimited, hard {h}")),
        Some((s, h)) => Check::new(
            "memlock",
            Status::Warn,
            format!("soft {s}, hard {h} (/proc/self/limits): memory registrations and pinned rings beyond it fail with ENOMEM; raise it (ulimit -l unlimited, or LimitMEMLOCK= / --ulimit memlock=-1 in containers)"),
        ),
    }
}

/// The PeerMappingOverride hint for a failed I/O-memory registration.
pub fn peer_mapping_hint(p: &PeerMapping) -> String {
    match p {
        PeerMapping::Unknown => "(the NVIDIA driver's parameters are unreadable, so PeerMappingOverride is unknown)".into(),
        PeerMapping::NotSet => "RegistryDwords in /proc/driver/nvidia/params does not set PeerMappingOverride: on many x86 hosts the driver maps a third-party PCIe BAR only with NVreg_RegistryDwords=\"PeerMappingOverride=1;\" (modprobe option of the nvidia module)".into(),
        PeerMapping::Set(v) => format!("PeerMappingOverride={v} is set in the driver's RegistryDwords, so the refusal has another cause (IOMMU, ACS, an unprivileged process: CUDA_ERROR_NOT_PERMITTED)"),
    }
}

/// Interprets a doorbell-page registration trial.
pub fn doorbell_outcome(dev: &str, t: &cuda::HostRegisterTrial, p: &PeerMapping) -> Check {
    let name = "trial.doorbell_iomemory";
    match (&t.iomemory, &t.plain) {
        (Ok(a), _) => Check::new(
            name,
            Status::Ok,
            format!("cuMemHostRegister(IOMEMORY) of {dev}'s UAR page worked (GPU address {a:#x}): kernels can ring the doorbell themselves"),
        ),
        (Err(e), Some(Ok(_))) => Check::new(
            name,
            Status::Warn,
            format!("{e}; as plain memory it worked (what gpuverbs' export falls back to; on a real UAR, which is MMIO, only IOMEMORY is right). {}", peer_mapping_hint(p)),
        ),
        (Err(e), plain) => Check::new(
            name,
            Status::Fail,
            format!(
                "{e}{}: kernels cannot ring {dev}'s doorbell (the CPU proxy would be needed). {}",
                match plain {
                    Some(Err(e2)) => format!("; as plain memory: {e2}"),
                    _ => String::new(),
                },
                peer_mapping_hint(p)
            ),
        ),
    }
}

fn doorbell_trial(
    gpu: Option<usize>,
    driver: &Result<DriverInfo, CudaProbeError>,
    devices: Option<&Result<Vec<rdma::Device>, rdma::RdmaProbeError>>,
    p: &PeerMapping,
) -> Check {
    let name = "trial.doorbell_iomemory";
    let has_mlx5 = matches!(devices, Some(Ok(l)) if l.iter().any(|d| d.mlx5));
    let soft = "the soft NIC's doorbell page is host memory, registered without IOMEMORY";
    match (driver, gpu, has_mlx5) {
        (Err(e), _, _) => return Check::new(name, NA, format!("{e}")),
        (Ok(_), None, _) => return Check::new(name, NA, "no GPU"),
        (_, _, false) => {
            return Check::new(
                name,
                NA,
                format!("no mlx5 device whose UAR could be mapped ({soft})"),
            )
        }
        _ => {}
    }
    let ordinal = gpu.unwrap_or(0);
    let r = rdma::with_doorbell_page(None, |page| {
        // SAFETY: `page` is a UAR page the open context mapped; the context and its CQ stay
        // alive for the whole call (`with_doorbell_page` destroys them afterwards).
        let t = unsafe { cuda::trial_host_register(ordinal, page.ptr(), 4096) };
        (page.device.clone(), t)
    });
    match r {
        Ok(Some((dev, Ok(t)))) => doorbell_outcome(&dev, &t, p),
        Ok(Some((dev, Err(e)))) => Check::new(name, Status::Fail, format!("{dev}: {e}")),
        Ok(None) => Check::new(name, NA, "no mlx5 device could be opened"),
        Err(e) => Check::new(
            name,
            Status::Fail,
            format!("cannot get a doorbell page: {e}"),
        ),
    }
}

/// Interprets a dma-buf export trial.
pub fn dma_buf_trial(g: &GpuInfo, r: Result<cuda::DmaBufTrial, CudaProbeError>) -> Check {
    let name = format!("trial.dma_buf.gpu{}", g.ordinal);
    match r {
        Ok(t) => Check::new(
            name,
            Status::Ok,
            format!("cuMemGetHandleForAddressRange(DMA_BUF_FD) of {} MiB of device memory gave a dma-buf fd ({})", t.len >> 20, t.fd_target),
        ),
        Err(e) => {
            let status = if g.dma_buf == Ok(1) { Status::Fail } else { Status::Warn };
            Check::new(
                name,
                status,
                format!(
                    "{e}{}",
                    if g.dma_buf == Ok(1) {
                        " although the device reports DMA_BUF_SUPPORTED"
                    } else {
                        " (the device does not report DMA_BUF_SUPPORTED)"
                    }
                ),
            )
        }
    }
}

/// What gpuverbs itself picks: the host API's `Context::open(Auto)` and a QP's automatic
/// doorbell mode, ring placement, and the GPU-memory registration path; and the selection.
fn choice(gpu: Option<usize>, dma_buf: bool, peer: &PeerMem) -> (Vec<Check>, Option<Selection>) {
    let ctx = match Context::open(DeviceRequest::Auto) {
        Ok(c) => c,
        Err(e) => {
            return (
                vec![Check::new(
                    "choice.device",
                    Status::Fail,
                    format!("Context::open(DeviceRequest::Auto) failed: {e}"),
                )],
                None,
            )
        }
    };
    let sel = ctx.selection().clone();
    let mut v = vec![Check::new(
        "choice.device",
        match sel.kind {
            BackendKind::Mlx5 => Status::Ok,
            BackendKind::Soft => Status::Warn,
        },
        format!(
            "backend {sel}{}",
            match sel.kind {
                BackendKind::Soft =>
                    ": a software mlx5 device in this process (no RDMA hardware is used)",
                BackendKind::Mlx5 => "",
            }
        ),
    )];
    let qp = ctx.try_alloc_pd().and_then(|pd| {
        let cq = ctx.create_cq(CqOptions::default())?;
        let qp = pd.create_qp(QpOptions::new(&cq, &cq))?;
        Ok((pd, qp))
    });
    let (pd, qp) = match qp {
        Ok(x) => x,
        Err(e) => {
            v.push(Check::new(
                "choice.doorbell",
                Status::Fail,
                format!("creating a PD, CQ and QP failed: {e}"),
            ));
            return (v, Some(sel));
        }
    };
    let (mode, reason) = qp.doorbell();
    let gpu_handle = gpu.map(cuda::host_api_gpu);
    let export = match &gpu_handle {
        Some(Ok(g)) => match g.export_qp(&qp) {
            Ok(_) => (Status::Ok, "; export_qp into gpu0 worked".to_string()),
            Err(e) => (Status::Fail, format!("; export_qp into gpu0 failed: {e}")),
        },
        Some(Err(e)) => (
            Status::Warn,
            format!("; gpu0 could not be opened through the host API: {e}"),
        ),
        None => (Status::NotApplicable, "; not tried: no GPU".to_string()),
    };
    v.push(Check::new(
        "choice.doorbell",
        export.0.max(Status::Ok),
        format!("{mode:?}: {reason}{}", export.1),
    ));
    let kind = sel.kind;
    v.push(Check::new(
        "choice.rings",
        Status::Ok,
        format!(
            "RingPlacement::Auto by default: {:?} here ({}); for a GPU's kernels \
             (Context::create_cq_on, Pd::create_qp_on) {}",
            qp.placement(),
            qp.placement_reason(),
            match kind {
                BackendKind::Soft => "host memory (the soft NIC's engine runs on the CPU; RingPlacement::Gpu on request)",
                BackendKind::Mlx5 => "GPU memory, DEVX umems (docs/mlx5-backend.md; RingPlacement::HostMapped on request)",
            }
        ),
    ));
    let path = match kind {
        BackendKind::Soft => "the soft NIC reaches GPU memory through CUDA copies (Pd::register_device_mem); neither dma-buf nor nvidia-peermem is needed".to_string(),
        BackendKind::Mlx5 => format!(
            "GPU-memory regions on the mlx5 backend: ibv_reg_dmabuf_mr with a dma-buf of the GPU pages, else ibv_reg_mr on the GPU address (nvidia-peermem); the platform offers {}",
            match (dma_buf, peer.loaded()) {
                (true, true) => "dma-buf and nvidia-peermem",
                (true, false) => "dma-buf",
                (false, true) => "nvidia-peermem",
                (false, false) => "neither dma-buf nor nvidia-peermem",
            }
        ),
    };
    let (st, tried) = match &gpu_handle {
        Some(Ok(g)) => match g.alloc(1 << 16) {
            Ok(mem) => match pd.register_device_mem(&mem, Access::LOCAL_WRITE) {
                Ok(mr) => (
                    Status::Ok,
                    format!(
                        "; Pd::register_device_mem of 64 KiB on gpu0 worked (lkey {:#x}{})",
                        mr.lkey().0,
                        match mr.gpu_path() {
                            Some(p) => format!(", through {p:?}"),
                            None => String::new(),
                        }
                    ),
                ),
                Err(e) => (
                    Status::Fail,
                    format!("; Pd::register_device_mem on gpu0: {e}"),
                ),
            },
            Err(e) => (
                Status::Fail,
                format!("; allocating 64 KiB on gpu0 failed: {e}"),
            ),
        },
        Some(Err(e)) => (Status::Warn, format!("; not tried: {e}")),
        None => (NA, "; not tried: no GPU".to_string()),
    };
    v.push(Check::new(
        "choice.gpu_memory",
        st,
        format!("{path}{tried}"),
    ));
    (v, Some(sel))
}

#[cfg(test)]
mod tests;
