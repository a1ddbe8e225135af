//! Unit tests of the deciding functions, on facts this machine cannot show.

use super::*;
use crate::doctor::sysfs::{Acs, IommuMode, PathType};

fn gpu(dma_buf: i32, ordering: i32) -> GpuInfo {
    GpuInfo {
        ordinal: 0,
        name: "NVIDIA H200".into(),
        bus_id: "00000000:65:00.0".into(),
        bdf: Bdf::parse("00000000:65:00.0"),
        cc: (9, 0),
        memory: 141 << 30,
        dma_buf: Ok(dma_buf),
        gdr: Ok(1),
        writes_ordering: Ok(ordering),
        flush_options: Ok(1),
        host_register: Ok(1),
    }
}

#[test]
fn gpu_attribute_checks() {
    let c = gpu_checks(&gpu(1, 200), Some(0));
    assert_eq!(c.len(), 3);
    assert_eq!(c[0].name, "gpu0");
    assert!(c[0].detail.contains("PCI 0000:65:00.0"), "{}", c[0].detail);
    assert!(c[0].detail.contains("NUMA node 0"));
    assert_eq!(
        (c[1].name.as_str(), c[1].status),
        ("gpu0.dma_buf", Status::Ok)
    );
    assert_eq!(c[2].status, Status::Ok);
    let c = gpu_checks(&gpu(0, 0), None);
    assert_eq!(c[1].status, Status::Warn);
    assert_eq!(c[2].status, Status::Warn);
    assert!(c[2].detail.contains("cuFlushGPUDirectRDMAWrites"));
    assert_eq!(gpu_checks(&gpu(1, 100), None)[2].status, Status::Ok);
}

#[test]
fn peermem_needed_only_without_dma_buf() {
    let none = PeerMem {
        nvidia_peermem: None,
        memory_peers: vec![],
    };
    let loaded = PeerMem {
        nvidia_peermem: Some("580.65.06".into()),
        memory_peers: vec![],
    };
    assert_eq!(
        peermem_check(&none, false, false).status,
        Status::NotApplicable
    );
    assert_eq!(peermem_check(&none, true, true).status, Status::Ok);
    assert_eq!(peermem_check(&none, true, false).status, Status::Fail);
    let c = peermem_check(&loaded, true, false);
    assert_eq!(c.status, Status::Ok);
    assert!(c.detail.contains("version 580.65.06"), "{}", c.detail);
}

#[test]
fn distance_acs_iommu_statuses() {
    assert_eq!(path_status(PathType::Pix), Status::Ok);
    assert_eq!(path_status(PathType::Pxb), Status::Ok);
    assert_eq!(path_status(PathType::Phb), Status::Warn);
    assert_eq!(path_status(PathType::Sys), Status::Warn);
    let b = Bdf::parse("0000:02:08.0").unwrap();
    let redirect =
        sysfs::AcsControl(sysfs::AcsControl::REQ_REDIRECT | sysfs::AcsControl::CMPLT_REDIRECT);
    let c = acs_check("pcie.acs", &[(b, Acs::Present(redirect))]);
    assert_eq!(c.status, Status::Warn);
    assert!(c.detail.contains("ReqRedir+CmpltRedir"), "{}", c.detail);
    assert_eq!(
        acs_check("a", &[(b, Acs::Present(sysfs::AcsControl(0)))]).status,
        Status::Ok
    );
    assert_eq!(acs_check("a", &[(b, Acs::Absent)]).status, Status::Ok);
    assert_eq!(acs_check("a", &[(b, Acs::Unreadable)]).status, Status::Warn);
    assert_eq!(acs_check("a", &[]).status, Status::Ok);
    let mut i = sysfs::Iommu {
        mode: IommuMode::Off,
        units: vec![],
        groups: 0,
        cmdline: vec![],
        domains: vec![],
    };
    assert_eq!(iommu_check(&i).status, Status::Ok);
    i.mode = IommuMode::Translated;
    i.domains = vec![(b, "DMA".into())];
    let c = iommu_check(&i);
    assert_eq!(c.status, Status::Warn);
    assert!(
        c.detail.contains("iommu=pt") && c.detail.contains("domain DMA"),
        "{}",
        c.detail
    );
    i.mode = IommuMode::Passthrough;
    assert_eq!(iommu_check(&i).status, Status::Ok);
}

#[test]
fn memlock_bar1_statuses() {
    assert_eq!(
        memlock_check(Some((Limit::Unlimited, Limit::Unlimited))).status,
        Status::Ok
    );
    let c = memlock_check(Some((Limit::Bytes(8 << 20), Limit::Bytes(8 << 20))));
    assert_eq!(c.status, Status::Warn);
    assert!(c.detail.contains("soft 8 MiB"), "{}", c.detail);
    assert_eq!(memlock_check(None).status, Status::Warn);
    let big = nvml::Bar1 {
        total: 128 << 30,
        used: 1 << 30,
        free: 127 << 30,
    };
    assert_eq!(bar1_status("b", &big, "").status, Status::Ok);
    let small = nvml::Bar1 {
        total: 256 << 20,
        used: 0,
        free: 256 << 20,
    };
    assert_eq!(bar1_status("b", &small, "").status, Status::Warn);
    let full = nvml::Bar1 {
        total: 16 << 30,
        used: 15 << 30,
        free: 1 << 30,
    };
    assert_eq!(bar1_status("b", &full, "").status, Status::Warn);
}

#[test]
fn doorbell_trial_explains_peer_mapping_override() {
    let refused = CudaProbeError::Call {
        op: "cuMemHostRegister(IOMEMORY)",
        code: cuda::ERR_NOT_SUPPORTED,
        name: "CUDA_ERROR_NOT_SUPPORTED".into(),
    };
    let t = cuda::HostRegisterTrial {
        iomemory: Err(refused.clone()),
        plain: Some(Err(refused.clone())),
    };
    let c = doorbell_outcome("mlx5_0", &t, &PeerMapping::NotSet);
    assert_eq!(c.status, Status::Fail);
    assert!(c.detail.contains("PeerMappingOverride=1"), "{}", c.detail);
    assert!(
        c.detail.contains("CUDA_ERROR_NOT_SUPPORTED (801)"),
        "{}",
        c.detail
    );
    let c = doorbell_outcome("mlx5_0", &t, &PeerMapping::Set(1));
    assert!(c.detail.contains("another cause"), "{}", c.detail);
    let t = cuda::HostRegisterTrial {
        iomemory: Err(refused),
        plain: Some(Ok(0x7f00_0000)),
    };
    assert_eq!(
        doorbell_outcome("mlx5_0", &t, &PeerMapping::NotSet).status,
        Status::Warn
    );
    let t = cuda::HostRegisterTrial {
        iomemory: Ok(0x7f00_0000),
        plain: None,
    };
    assert_eq!(
        doorbell_outcome("mlx5_0", &t, &PeerMapping::Unknown).status,
        Status::Ok
    );
}

#[test]
fn dma_buf_trial_statuses() {
    let ok = cuda::DmaBufTrial {
        len: 2 << 20,
        fd_target: "anon_inode:dmabuf".into(),
    };
    assert_eq!(dma_buf_trial(&gpu(1, 200), Ok(ok)).status, Status::Ok);
    let e = CudaProbeError::Call {
        op: "cuMemGetHandleForAddressRange(DMA_BUF_FD)",
        code: cuda::ERR_NOT_SUPPORTED,
        name: "CUDA_ERROR_NOT_SUPPORTED".into(),
    };
    assert_eq!(
        dma_buf_trial(&gpu(1, 200), Err(e.clone())).status,
        Status::Fail
    );
    assert_eq!(dma_buf_trial(&gpu(0, 200), Err(e)).status, Status::Warn);
}

#[test]
fn rdma_device_statuses() {
    let port = |active: bool, kind: &str| rdma::Port {
        num: 1,
        state: if active { "ACTIVE" } else { "DOWN" }.into(),
        active,
        link_layer: "Ethernet".into(),
        mtu: 4096,
        gids: vec![rdma::Gid {
            index: 0,
            gid: "::ffff:127.0.0.1".parse().unwrap(),
            kind: kind.into(),
        }],
    };
    let dev = |p: rdma::Port, mlx5: bool| rdma::Device {
        name: "mlx5_0".into(),
        mlx5,
        fw_ver: "0.1.0".into(),
        ports: Ok(vec![p]),
    };
    let c = rdma_device(&dev(port(true, "RoCE v2"), true), true);
    assert_eq!(c.status, Status::Ok);
    assert!(
        c.detail.contains("[0] ::ffff:127.0.0.1 RoCE v2"),
        "{}",
        c.detail
    );
    assert!(c.detail.contains("emulated"));
    assert_eq!(
        rdma_device(&dev(port(false, "RoCE v2"), true), false).status,
        Status::Warn
    );
    assert_eq!(
        rdma_device(&dev(port(true, "RoCE v1"), true), false).status,
        Status::Warn
    );
    assert_eq!(
        rdma_device(&dev(port(true, "RoCE v2"), false), false).status,
        Status::Warn
    );
}

#[test]
fn a_missing_gpu_fails_only_when_a_gpu_is_wanted() {
    let on_bus = [sysfs::PciDevice {
        bdf: Bdf::parse("0000:65:00.0").unwrap(),
        vendor: 0x10de,
        device: 0x2335,
        class: 0x030200,
        numa_node: None,
        path: None,
    }];
    let no_driver: Result<DriverInfo, CudaProbeError> = Err(CudaProbeError::NoDriver);
    let no_device_init: Result<DriverInfo, CudaProbeError> = Err(CudaProbeError::Call {
        op: "cuInit",
        code: 100,
        name: "CUDA_ERROR_NO_DEVICE".into(),
    });
    let init_error: Result<DriverInfo, CudaProbeError> = Err(CudaProbeError::Call {
        op: "cuInit",
        code: 999,
        name: "CUDA_ERROR_UNKNOWN".into(),
    });
    let no_device: Result<DriverInfo, CudaProbeError> = Ok(DriverInfo {
        version: 13000,
        gpus: vec![],
    });
    let one: Result<DriverInfo, CudaProbeError> = Ok(DriverInfo {
        version: 13000,
        gpus: vec![Ok(gpu(1, 200))],
    });
    // (driver, GPUs on the bus) -> (status without --gpu, with --gpu)
    let cases: [(&_, &[sysfs::PciDevice], Status, Status); 9] = [
        (&no_driver, &[], NA, Status::Fail),
        (&no_driver, &on_bus, Status::Warn, Status::Fail),
        (&no_device_init, &[], NA, Status::Fail),
        (&no_device_init, &on_bus, Status::Warn, Status::Fail),
        (&init_error, &[], Status::Warn, Status::Fail),
        (&no_device, &[], NA, Status::Fail),
        (&no_device, &on_bus, Status::Warn, Status::Fail),
        (&one, &on_bus, Status::Ok, Status::Ok),
        (&one, &[], Status::Ok, Status::Ok),
    ];
    for (i, (d, pci, plain, wanted)) in cases.into_iter().enumerate() {
        let c = cuda_driver(d, pci, false);
        assert_eq!(c.status, plain, "case {i}: {}", c.detail);
        if plain != Status::Ok {
            assert!(c.detail.contains("CPU initiator"), "case {i}: {}", c.detail);
            assert!(c.detail.contains("doctor --gpu"), "case {i}: {}", c.detail);
        }
        let c = cuda_driver(d, pci, true);
        assert_eq!(c.status, wanted, "case {i} with --gpu: {}", c.detail);
        if wanted == Status::Fail {
            assert!(
                c.detail.contains("--gpu: a GPU was asked for"),
                "{}",
                c.detail
            );
        }
    }
    // the kernel module: absent with a GPU on the bus
    assert_eq!(kernel_module(None, true, false).status, Status::Warn);
    assert_eq!(kernel_module(None, true, true).status, Status::Fail);
    assert_eq!(kernel_module(None, false, true).status, NA);
}

#[test]
fn what_runs_here() {
    let soft = Selection {
        kind: BackendKind::Soft,
        name: "softnic0".into(),
        reason: "x".into(),
    };
    let s = runs_here(Some(&soft), None);
    assert!(s.starts_with("the soft NIC softnic0"), "{s}");
    assert!(s.contains("CPU initiator") && s.contains("no GPU"), "{s}");
    let mlx5 = Selection {
        kind: BackendKind::Mlx5,
        name: "mlx5_0".into(),
        reason: "x".into(),
    };
    let s = runs_here(Some(&mlx5), Some(0));
    assert!(s.starts_with("the mlx5 backend on mlx5_0"), "{s}");
    assert!(s.contains("CUDA kernels on gpu0"), "{s}");
    assert_eq!(runs_here(None, None), "");
}
