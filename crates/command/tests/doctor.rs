//! `gpuverbs doctor --json` on this machine (CI: no GPU, no RDMA device) and under
//! `gpuverbs emu` (the emulated mlx5 devices through the real rdma-core): the JSON parses,
//! every check has a known status and a reason, and the exit status is the worst check's
//! (0 ok / not applicable, 1 warn, 3 fail). Without a GPU nothing fails (the soft NIC and
//! the CPU initiator run here) unless `--gpu` asks for one.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

const GPUVERBS: &str = env!("CARGO_BIN_EXE_gpuverbs");
/// Set in the environment of the test binary re-run under `gpuverbs emu`.
const CHILD: &str = "GPUVERBS_DOCTOR_TEST_CHILD";

/// Builds the preload library next to the gpuverbs binary, once (as tests/emu.rs does).
fn preload() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = Path::new(GPUVERBS).parent().unwrap().to_path_buf();
        let mut c = Command::new(option_env!("CARGO").unwrap_or("cargo"));
        c.args(["build", "-q", "-p", "gpuverbs-uverbs-preload"]);
        if dir.file_name().is_some_and(|n| n == "release") {
            c.arg("--release");
        }
        if let Some(target) = dir.parent() {
            c.env("CARGO_TARGET_DIR", target);
        }
        assert!(
            c.status().unwrap().success(),
            "building the preload library failed"
        );
        let p = dir.join("libgpuverbs_uverbs_preload.so");
        assert!(p.is_file(), "{} missing", p.display());
        p
    })
    .clone()
}

/// A command with no device override inherited from the caller's environment.
fn clean(c: &mut Command) -> &mut Command {
    c.env_remove("GPUVERBS_DEVICE")
        .env_remove("GPUVERBS_SOFTNIC_ADDR")
        .env_remove("SYSFS_PATH")
}

#[derive(Debug)]
struct Checks {
    list: Vec<(String, String, String)>,
    code: i32,
    text: String,
    runs_here: String,
}

impl Checks {
    fn get(&self, name: &str) -> (&str, &str) {
        let c = self
            .list
            .iter()
            .find(|c| c.0 == name)
            .unwrap_or_else(|| panic!("no check {name}:\n{}", self.text));
        (c.1.as_str(), c.2.as_str())
    }
}

/// Parses `--json` output and checks its shape and the exit status mapping.
fn parse(out: &Output) -> Checks {
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr);
    let v: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}\nstderr:\n{err}"));
    let runs_here = v["runs_here"].as_str().expect("runs_here").to_string();
    let arr = v["checks"].as_array().expect("a checks array");
    assert!(!arr.is_empty());
    let mut list = Vec::new();
    let mut worst = 0;
    for c in arr {
        let obj = c.as_object().unwrap();
        assert_eq!(obj.len(), 3, "{c}");
        let name = c["name"].as_str().unwrap().to_string();
        let status = c["status"].as_str().unwrap().to_string();
        let detail = c["detail"].as_str().unwrap().to_string();
        assert!(!detail.is_empty(), "{name} has no detail");
        worst = worst.max(match status.as_str() {
            "not_applicable" | "ok" => 0,
            "warn" => 1,
            "fail" => 3,
            s => panic!("{name}: unknown status {s}"),
        });
        list.push((name, status, detail));
    }
    let code = out.status.code().expect("an exit status");
    assert_eq!(
        code, worst,
        "exit status vs worst check:\n{text}\nstderr:\n{err}"
    );
    Checks {
        list,
        code,
        text,
        runs_here,
    }
}

fn cuda_present() -> bool {
    gpuverbs::cuda::driver_available()
}

#[test]
fn doctor_json_without_gpu_or_nic() {
    let out = clean(Command::new(GPUVERBS).args(["doctor", "--json"]))
        .output()
        .unwrap();
    let c = parse(&out);
    for name in [
        "cuda.driver",
        "nvidia.kernel_module",
        "nvidia.peermem",
        "rdma_core",
        "iommu",
        "memlock",
        "trial.doorbell_iomemory",
        "choice.device",
        "choice.doorbell",
        "choice.rings",
        "choice.gpu_memory",
    ] {
        c.get(name);
    }
    if !cuda_present() {
        // No GPU is no failure: the soft NIC and the CPU initiator run here.
        let (st, d) = c.get("cuda.driver");
        assert!(st == "not_applicable" || st == "warn", "{st}: {d}");
        assert!(d.contains("no CUDA driver"), "{d}");
        assert!(d.contains("CPU initiator") && d.contains("--gpu"), "{d}");
        for n in ["trial.doorbell_iomemory", "trial.dma_buf"] {
            let (st, d) = c.get(n);
            assert_eq!(st, "not_applicable", "{n}");
            assert!(d.contains("no CUDA driver"), "{n}: {d}");
        }
        assert_eq!(c.get("choice.gpu_memory").0, "not_applicable");
        assert!(
            !c.list.iter().any(|(_, st, _)| st == "fail"),
            "no check fails without a GPU:\n{}",
            c.text
        );
        assert!(c.code == 0 || c.code == 1, "exit status {}", c.code);
        assert!(c.runs_here.contains("CPU initiator"), "{}", c.runs_here);
        assert!(c.runs_here.contains("no GPU"), "{}", c.runs_here);
    }
    let (st, d) = c.get("rdma.devices");
    if !Path::new("/sys/class/infiniband").exists() {
        // CI: the kernel has no RDMA; the soft NIC is what gpuverbs uses
        assert_eq!(st, "warn", "{d}");
        assert!(d.contains("soft NIC"), "{d}");
        let (st, d) = c.get("choice.device");
        assert_eq!(st, "warn");
        assert!(d.starts_with("backend soft NIC"), "{d}");
        assert_eq!(c.get("topology").0, "not_applicable");
        assert!(
            c.runs_here.starts_with("the soft NIC softnic"),
            "{}",
            c.runs_here
        );
    }
}

#[test]
fn doctor_gpu_fails_without_a_gpu() {
    let out = clean(Command::new(GPUVERBS).args(["doctor", "--json", "--gpu"]))
        .output()
        .unwrap();
    let c = parse(&out);
    if cuda_present() {
        return;
    }
    let (st, d) = c.get("cuda.driver");
    assert_eq!(st, "fail", "{d}");
    assert!(d.contains("--gpu: a GPU was asked for"), "{d}");
    assert_eq!(c.code, 3, "a failed check gives 3");
}

#[test]
fn doctor_text_says_the_exit_status() {
    let out = clean(Command::new(GPUVERBS).arg("doctor"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let code = out.status.code().unwrap();
    assert!(text.contains(&format!("exit status {code}\n")), "{text}");
    assert!(text.contains("] cuda.driver"), "{text}");
    assert!(text.contains("\nWhat runs here: the "), "{text}");
}

#[test]
fn doctor_under_emu_lists_the_emulated_devices() {
    let out = clean(&mut Command::new(GPUVERBS))
        .env("GPUVERBS_PRELOAD", preload())
        .args(["emu", "--devices", "2", "--ip", "127.0.96.1", "--"])
        .args([GPUVERBS, "doctor", "--json"])
        .output()
        .unwrap();
    let c = parse(&out);
    let (st, d) = c.get("rdma.mlx5_0");
    assert_eq!(st, "ok", "{d}");
    assert!(d.contains("[0] ::ffff:127.0.96.1 RoCE v2"), "{d}");
    assert!(d.contains("ACTIVE, Ethernet, MTU 4096"), "{d}");
    assert!(d.contains("emulated"), "{d}");
    let (st, d) = c.get("rdma.mlx5_1");
    assert_eq!(st, "ok");
    assert!(d.contains("::ffff:127.0.96.2 RoCE v2"), "{d}");
    let (st, d) = c.get("choice.device");
    assert_eq!(st, "ok");
    assert!(
        d.starts_with("backend mlx5 mlx5_0 (auto: rdma-core lists mlx5_0, mlx5_1"),
        "{d}"
    );
    let (_, d) = c.get("choice.doorbell");
    assert!(d.starts_with("GpuDoorbell"), "{d}");
    assert!(c.get("choice.gpu_memory").1.contains("mlx5 backend"));
    assert!(
        c.runs_here.starts_with("the mlx5 backend on mlx5_0"),
        "{}",
        c.runs_here
    );
    if !cuda_present() {
        assert_eq!(c.get("trial.doorbell_iomemory").0, "not_applicable");
        // both devices ok and no GPU: nothing fails (memlock or the like may warn)
        assert!(c.code == 0 || c.code == 1, "{}", c.text);
    }
}

/// Run under `gpuverbs emu` by the test below: the doorbell page the trial registration uses.
#[test]
fn doorbell_page_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let page = gpuverbs_command::doctor::rdma::with_doorbell_page(None, |p| {
        // SAFETY: the page is the UAR mapping of the open context, alive during the call.
        let first = unsafe { std::ptr::read_volatile(p.ptr().cast::<u32>()) };
        (p.device.clone(), p.addr, first)
    })
    .unwrap()
    .expect("an mlx5 device");
    println!("PAGE {} {:#x} {}", page.0, page.1, page.1 % 4096);
}

#[test]
fn the_doorbell_page_is_a_cq_uar_of_an_open_context() {
    let exe = std::env::current_exe().unwrap();
    let out = clean(&mut Command::new(GPUVERBS))
        .env("GPUVERBS_PRELOAD", preload())
        .env(CHILD, "1")
        .args(["emu", "--ip", "127.0.97.1", "--"])
        .arg(&exe)
        .args([
            "--exact",
            "doorbell_page_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let line = text
        .lines()
        .find_map(|l| l.find("PAGE ").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("{text}"));
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f[1], "mlx5_0", "{line}");
    assert_ne!(f[2], "0x0", "{line}");
    assert_eq!(f[3], "0", "page aligned: {line}");
}
