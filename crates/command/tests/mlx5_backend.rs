//! The ConnectX backend through the real libibverbs + libmlx5, on the emulated device: the same
//! traffic and error scenario runs on the in-process soft NIC and on `mlx5_0`/`mlx5_1` under
//! `gpuverbs emu`, and must give the same completions (statuses, byte counts, immediates, old
//! values of atomics) and the same bytes; likewise a DC scenario (a DC target on one device, a
//! DC initiator on the other: `mlx5dv_create_qp` DCI and DCT through the real libmlx5).

use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, DctOptions, DeviceRequest, HostBuffer, QpOptions,
};
use prm::wqe::{CtrlFlags, Local, Op};
use prm::Completion;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use verbs::initiator::{Initiator, RingMode};

const GPUVERBS: &str = env!("CARGO_BIN_EXE_gpuverbs");
const CHILD: &str = "GPUVERBS_MLX5_CHILD";
const T: Duration = Duration::from_secs(10);

fn preload() -> std::path::PathBuf {
    build(&["-p", "gpuverbs-uverbs-preload"]);
    Path::new(GPUVERBS)
        .parent()
        .unwrap()
        .join("libgpuverbs_uverbs_preload.so")
}

/// `cargo build` of more artifacts into the target folder of this test's binaries.
fn build(what: &[&str]) {
    let dir = Path::new(GPUVERBS).parent().unwrap().to_path_buf();
    let release = dir.file_name().is_some_and(|n| n == "release");
    let mut c = Command::new(option_env!("CARGO").unwrap_or("cargo"));
    c.args(["build", "-q"]).args(what);
    if release {
        c.arg("--release");
    }
    if let Some(target) = dir.parent() {
        c.env("CARGO_TARGET_DIR", target);
    }
    assert!(c.status().unwrap().success(), "cargo build {what:?} failed");
}

struct Side {
    _ctx: Context,
    qp: gpuverbs::Qp,
    /// The QP's poster (`None` between two).
    ini: Option<Initiator>,
    buf: HostBuffer,
    mr: gpuverbs::Mr,
}

impl Side {
    fn ini(&mut self) -> &mut Initiator {
        self.ini.as_mut().expect("a poster")
    }
}

/// Two connected QPs, one per context, each driven by a CPU initiator.
fn pair(a: &Context, b: &Context, o: ConnectOptions) -> (Side, Side) {
    let side = |ctx: &Context| {
        let pd = ctx.alloc_pd();
        let scq = ctx.create_cq(CqOptions::default()).unwrap();
        let rcq = ctx.create_cq(CqOptions::default()).unwrap();
        let qp = pd.create_qp(QpOptions::new(&scq, &rcq)).unwrap();
        let buf = HostBuffer::new(16384);
        let rights = Access::LOCAL_WRITE
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC;
        let mr = pd.register_with(&buf, rights).unwrap();
        (qp, buf, mr)
    };
    let (qa, ba, ma) = side(a);
    let (qb, bb, mb) = side(b);
    qa.connect(&qb.endpoint(), o).unwrap();
    qb.connect(&qa.endpoint(), o).unwrap();
    let ia = qa.cpu_initiator(RingMode::RdmaCore);
    let ib = qb.cpu_initiator(RingMode::RdmaCore);
    (
        Side {
            _ctx: a.clone(),
            qp: qa,
            ini: Some(ia),
            buf: ba,
            mr: ma,
        },
        Side {
            _ctx: b.clone(),
            qp: qb,
            ini: Some(ib),
            buf: bb,
            mr: mb,
        },
    )
}

fn outcome(c: &Completion) -> String {
    match c {
        Completion::Req {
            wqe_opcode,
            byte_cnt,
            ..
        } => format!("req op {wqe_opcode:#x} bytes {byte_cnt}"),
        Completion::Resp {
            kind,
            byte_cnt,
            imm,
            ..
        } => format!("resp {kind:?} bytes {byte_cnt} imm {imm:?}"),
        Completion::Error(e) => format!(
            "error {} syndrome {:#x} op {:#x}",
            if e.responder {
                "responder"
            } else {
                "requester"
            },
            e.syndrome,
            e.wqe_opcode
        ),
        Completion::Invalid(o) => format!("invalid {o:#x}"),
    }
}

fn send_wait(s: &mut Side, op: &Op<'_>) -> String {
    s.ini().post_and_ring(op, CtrlFlags::SIGNALED).unwrap();
    match s.ini().wait_send(T) {
        Ok(c) => outcome(&c),
        Err(e) => format!("wait: {e}"),
    }
}

/// Hands `x`'s QP from poster to poster: a new CPU initiator continues where the last one
/// stopped (after one that left unsignaled WRITEs behind its last completion, and after ones
/// that left nothing), its completions and bytes checked (the WRITEs land in `y`'s region at
/// 10000).
fn handover(x: &mut Side, y: &Side) -> Vec<String> {
    let mut out = Vec::new();
    for round in 0..3u8 {
        // a new poster: the old initiator goes first (one poster at a time)
        x.ini = None;
        x.ini = Some(
            x.qp.try_cpu_initiator(RingMode::RdmaCore)
                .unwrap_or_else(|e| panic!("{e}")),
        );
        let data = [round + 1; 64];
        x.buf.write(14000, &data);
        let src = [x.mr.sge(14000, 64)];
        let dst = |off: u64| y.mr.remote(10000 + off);
        let w = |off: u64| Op::Write {
            remote: dst(off),
            local: Local::Sges(&src),
            imm: None,
        };
        // two unsignaled WRITEs, then a signaled one: its completion retires all three
        let unsig = CtrlFlags {
            signaled: false,
            ..CtrlFlags::SIGNALED
        };
        x.ini().post(&w(0), unsig).unwrap();
        x.ini().post(&w(64), unsig).unwrap();
        out.push(format!("handover {round}: {}", send_wait(x, &w(128))));
        if round == 1 {
            // and two more unsignaled ones left behind for the next poster
            x.ini().post(&w(192), unsig).unwrap();
            x.ini().post_and_ring(&w(256), unsig).unwrap();
        }
        // (the unsignaled ones after the completion land a little later: wait, bounded)
        let n = if round == 1 { 5 } else { 3 };
        let t = std::time::Instant::now();
        let landed = || {
            let got = y.buf.to_vec();
            (0..n).all(|k| got[10000 + 64 * k..10064 + 64 * k] == data)
        };
        while !landed() && t.elapsed() < T {
            std::thread::sleep(Duration::from_millis(1));
        }
        out.push(format!("handover {round} bytes: {}", landed()));
    }
    out
}

/// The scenario: every line is one observable outcome.
fn scenario(a: &Context, b: &Context) -> Vec<String> {
    let mut out = Vec::new();
    let all = ConnectOptions {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        ..Default::default()
    };
    let (mut x, mut y) = pair(a, b, all);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    x.buf.write(0, &pattern);
    let w = Op::Write {
        remote: y.mr.remote(0),
        local: Local::Sges(&[x.mr.sge(0, 4096)]),
        imm: None,
    };
    out.push(format!("write: {}", send_wait(&mut x, &w)));
    out.push(format!(
        "write bytes equal: {}",
        y.buf.to_vec()[..4096] == pattern[..]
    ));
    let r = Op::Read {
        remote: y.mr.remote(0),
        local: &[x.mr.sge(8192, 4096)],
    };
    out.push(format!("read: {}", send_wait(&mut x, &r)));
    out.push(format!(
        "read bytes equal: {}",
        x.buf.to_vec()[8192..12288] == pattern[..]
    ));
    let sge = y.mr.sge(4096, 256);
    y.ini().post_recv(&[sge]).unwrap();
    x.buf.write(0, b"a send of some bytes");
    let s = Op::Send {
        local: Local::Sges(&[x.mr.sge(0, 20)]),
        imm: None,
    };
    out.push(format!("send: {}", send_wait(&mut x, &s)));
    out.push(format!(
        "send recv: {}",
        y.ini()
            .wait_recv(T)
            .map(|c| outcome(&c))
            .unwrap_or_else(|e| e.to_string())
    ));
    out.push(format!(
        "send bytes: {}",
        String::from_utf8_lossy(&y.buf.to_vec()[4096..4116])
    ));
    let sge = y.mr.sge(4096, 256);
    y.ini().post_recv(&[sge]).unwrap();
    let wi = Op::Write {
        remote: y.mr.remote(6000),
        local: Local::Sges(&[x.mr.sge(0, 16)]),
        imm: Some(0x1234),
    };
    out.push(format!("write_imm: {}", send_wait(&mut x, &wi)));
    out.push(format!(
        "write_imm recv: {}",
        y.ini()
            .wait_recv(T)
            .map(|c| outcome(&c))
            .unwrap_or_else(|e| e.to_string())
    ));
    out.extend(handover(&mut x, &y));
    y.buf.write(8192, &5u64.to_ne_bytes());
    let fa = Op::FetchAdd {
        remote: y.mr.remote(8192),
        add: 3,
        result: x.mr.sge(12288, 8),
    };
    out.push(format!("fetch_add: {}", send_wait(&mut x, &fa)));
    let old = u64::from_ne_bytes(x.buf.to_vec()[12288..12296].try_into().unwrap());
    let now = u64::from_ne_bytes(y.buf.to_vec()[8192..8200].try_into().unwrap());
    out.push(format!("fetch_add old {old} now {now}"));
    let cs = Op::CompareSwap {
        remote: y.mr.remote(8192),
        compare: 8,
        swap: 42,
        result: x.mr.sge(12288, 8),
    };
    out.push(format!("cmp_swap: {}", send_wait(&mut x, &cs)));
    let old = u64::from_ne_bytes(x.buf.to_vec()[12288..12296].try_into().unwrap());
    let now = u64::from_ne_bytes(y.buf.to_vec()[8192..8200].try_into().unwrap());
    out.push(format!("cmp_swap old {old} now {now}"));
    // bad rkey: REMOTE_ACCESS, then the QP is in error
    let mut bad = y.mr.remote(0);
    bad.rkey = prm::Rkey(bad.rkey.0 ^ 0x80);
    let w = Op::Write {
        remote: bad,
        local: Local::Sges(&[x.mr.sge(0, 64)]),
        imm: None,
    };
    out.push(format!("bad rkey: {}", send_wait(&mut x, &w)));
    out.push(format!("bad rkey state: {:?}", x.qp.state()));
    // bad lkey: LOCAL_PROT
    let (mut x, y) = pair(a, b, all);
    let mut sge = x.mr.sge(0, 64);
    sge.lkey = prm::Lkey(sge.lkey.0 ^ 0x80);
    let w = Op::Write {
        remote: y.mr.remote(0),
        local: Local::Sges(&[sge]),
        imm: None,
    };
    out.push(format!("bad lkey: {}", send_wait(&mut x, &w)));
    // a send longer than the receive buffer: REMOTE_INVAL_REQ and LOCAL_LENGTH
    let (mut x, mut y) = pair(a, b, all);
    let sge = y.mr.sge(0, 128);
    y.ini().post_recv(&[sge]).unwrap();
    let s = Op::Send {
        local: Local::Sges(&[x.mr.sge(0, 512)]),
        imm: None,
    };
    out.push(format!("too long: {}", send_wait(&mut x, &s)));
    out.push(format!(
        "too long recv: {}",
        y.ini()
            .wait_recv(T)
            .map(|c| outcome(&c))
            .unwrap_or_else(|e| e.to_string())
    ));
    // no receive posted, no RNR retries: RNR_RETRY_EXC
    let (mut x, _y) = pair(
        a,
        b,
        ConnectOptions {
            rnr_retry: 0,
            ..all
        },
    );
    let s = Op::Send {
        local: Local::Sges(&[x.mr.sge(0, 8)]),
        imm: None,
    };
    out.push(format!("rnr: {}", send_wait(&mut x, &s)));
    // the peer QP is gone: TRANSPORT_RETRY_EXC
    let (mut x, y) = pair(
        a,
        b,
        ConnectOptions {
            timeout: 8,
            retry_cnt: 1,
            ..all
        },
    );
    let target = y.mr.remote(0);
    drop(y);
    let w = Op::Write {
        remote: target,
        local: Local::Sges(&[x.mr.sge(0, 8)]),
        imm: None,
    };
    out.push(format!("peer gone: {}", send_wait(&mut x, &w)));
    out
}

/// Runs under `gpuverbs emu --devices 2` (started by the test below); does nothing otherwise.
#[test]
fn mlx5_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let a = Context::open(DeviceRequest::Named("mlx5_0".into())).unwrap();
    let b = Context::open(DeviceRequest::Named("mlx5_1".into())).unwrap();
    let auto = Context::open(DeviceRequest::Auto).unwrap();
    println!("SELECTION {}", auto.selection());
    println!("KIND {:?} {:?}", a.selection().kind, b.selection().kind);
    for line in scenario(&a, &b) {
        println!("RESULT {line}");
    }
}

/// A DC target on `b` (key 0xdc), a DC initiator on `a`: WRITE, READ back, fetch-add, then a
/// WQE with the wrong key on a second initiator (no answer: TRANSPORT_RETRY_EXC).
fn dc_scenario(a: &Context, b: &Context) -> Vec<String> {
    let rights =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let (pb, cb) = (b.alloc_pd(), b.create_cq(CqOptions::default()).unwrap());
    let dct = pb.create_dct(&cb, DctOptions::new(0xdc)).unwrap();
    let tb = HostBuffer::new(16384);
    let mrb = pb.register_with(&tb, rights).unwrap();
    let to = dct.target();
    let mut out = vec![format!("dct state {:?}", dct.state())];
    let pa = a.alloc_pd();
    let ba = HostBuffer::new(16384);
    let mra = pa.register_with(&ba, rights).unwrap();
    let dci = |retry_cnt| {
        let cq = a.create_cq(CqOptions::default()).unwrap();
        let c = ConnectOptions {
            timeout: 12,
            retry_cnt,
            ..Default::default()
        };
        let q = pa.create_dci(QpOptions::new(&cq, &cq), c).unwrap();
        q.reach(&to).unwrap();
        q
    };
    let q = dci(7);
    out.push(format!("dci state {:?}", q.state()));
    let mut ini = q.cpu_initiator(RingMode::RdmaCore);
    let go = |ini: &mut Initiator, op: &Op<'_>, t: &gpuverbs::DcTarget| {
        ini.post_with_av(op, CtrlFlags::SIGNALED, &t.address_vector())
            .unwrap();
        ini.ring();
        match ini.wait_send(T) {
            Ok(c) => outcome(&c),
            Err(e) => format!("wait: {e}"),
        }
    };
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    ba.write(0, &data);
    let write = Op::Write {
        remote: mrb.remote(0),
        local: Local::Sges(&[mra.sge(0, 4096)]),
        imm: None,
    };
    out.push(format!("dc write: {}", go(&mut ini, &write, &to)));
    out.push(format!(
        "dc write bytes: {}",
        tb.to_vec()[..4096] == data[..]
    ));
    let read = Op::Read {
        remote: mrb.remote(0),
        local: &[mra.sge(8192, 4096)],
    };
    out.push(format!("dc read: {}", go(&mut ini, &read, &to)));
    out.push(format!(
        "dc read bytes: {}",
        ba.to_vec()[8192..12288] == data[..]
    ));
    tb.write(12288, &9u64.to_ne_bytes());
    let fa = Op::FetchAdd {
        remote: mrb.remote(12288),
        add: 3,
        result: mra.sge(12288, 8),
    };
    out.push(format!("dc fetch_add: {}", go(&mut ini, &fa, &to)));
    let word = |b: &HostBuffer| u64::from_ne_bytes(b.to_vec()[12288..12296].try_into().unwrap());
    out.push(format!("dc fetch_add old {} now {}", word(&ba), word(&tb)));
    drop(ini);
    let bad = dci(0);
    let mut ini = bad.cpu_initiator(RingMode::RdmaCore);
    let wrong = gpuverbs::DcTarget { key: 0xdd, ..to };
    out.push(format!("dc wrong key: {}", go(&mut ini, &write, &wrong)));
    out
}

#[test]
fn dc_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let a = Context::open(DeviceRequest::Named("mlx5_0".into())).unwrap();
    let b = Context::open(DeviceRequest::Named("mlx5_1".into())).unwrap();
    // past the test harness's "test dc_child ... " on the same line
    println!();
    for line in dc_scenario(&a, &b) {
        println!("RESULT {line}");
    }
}

/// The DC scenario on the soft NIC and on the mlx5 backend (the provider's DCI and DCT through
/// the real libmlx5 under `gpuverbs emu`, and DEVX's): the same completions and bytes.
#[test]
fn the_mlx5_backend_runs_dc_as_the_soft_nic_does() {
    let a = Context::open(DeviceRequest::Soft).unwrap();
    let b = Context::open(DeviceRequest::Soft).unwrap();
    let soft = dc_scenario(&a, &b);
    let mlx5 = child_results("dc_child", 94, &[]);
    assert_eq!(
        mlx5, soft,
        "soft NIC (right) and mlx5 backend (left) differ"
    );
    // and with DEVX objects: a DCI made with CREATE_QP st DCI, a DCT with CREATE_DCT
    let devx = child_results("dc_child", 93, &[("GPUVERBS_MLX5_DEVX", "1")]);
    assert_eq!(
        devx, soft,
        "soft NIC (right) and the mlx5 backend's DEVX DC objects (left) differ"
    );
    for want in [
        "dct state Rtr",
        "dci state Rts",
        "dc write: req op 0x8 bytes 4096",
        "dc write bytes: true",
        "dc read bytes: true",
        "dc fetch_add old 9 now 12",
        "dc wrong key: error requester syndrome 0x15",
    ] {
        assert!(
            soft.iter().any(|l| l.starts_with(want)),
            "missing {want:?} in {soft:#?}"
        );
    }
}

/// The scenario's results in a child under `gpuverbs emu --devices 2`, with `env` set.
fn mlx5_scenario(net: u8, env: &[(&str, &str)]) -> Vec<String> {
    let text = child_output("mlx5_child", net, env);
    assert!(text.contains("KIND Mlx5 Mlx5"), "{text}");
    assert!(
        text.contains("SELECTION mlx5 mlx5_0 (auto: rdma-core lists mlx5_0, mlx5_1"),
        "{text}"
    );
    results(&text)
}

/// The `RESULT` lines of `child` under `gpuverbs emu --devices 2`.
fn child_results(child: &str, net: u8, env: &[(&str, &str)]) -> Vec<String> {
    results(&child_output(child, net, env))
}

fn results(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("RESULT ").map(str::to_string))
        .collect()
}

/// The output of test `child` of this binary run under `gpuverbs emu --devices 2` at
/// 127.0.`net`.1, with `env` set; it must succeed.
fn child_output(child: &str, net: u8, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(GPUVERBS)
        .env("GPUVERBS_PRELOAD", preload())
        .env(CHILD, "1")
        .envs(env.iter().copied())
        .args([
            "emu",
            "--devices",
            "2",
            "--ip",
            &format!("127.0.{net}.1"),
            "--",
        ])
        .arg(&exe)
        .args(["--exact", child, "--nocapture", "--test-threads=1"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{child} under gpuverbs emu ({env:?}) failed:\n{text}"
    );
    text
}

/// The scenario on the soft NIC, on the mlx5 backend's provider CQs and QPs, and on its DEVX
/// CQs and QPs (host-memory umems, `GPUVERBS_MLX5_DEVX=1`): the same completions.
#[test]
fn the_mlx5_backend_gives_the_soft_nics_completions() {
    let a = Context::open(DeviceRequest::Soft).unwrap();
    let b = Context::open(DeviceRequest::Soft).unwrap();
    let soft = scenario(&a, &b);
    let mlx5 = mlx5_scenario(95, &[]);
    assert_eq!(
        mlx5, soft,
        "soft NIC (right) and mlx5 backend (left) differ"
    );
    let devx = mlx5_scenario(98, &[("GPUVERBS_MLX5_DEVX", "1")]);
    assert_eq!(
        devx, soft,
        "soft NIC (right) and the mlx5 backend's DEVX objects (left) differ"
    );
    // and the scenario is what a ConnectX gives
    for want in [
        "write bytes equal: true",
        "read bytes equal: true",
        "send bytes: a send of some bytes",
        "fetch_add old 5 now 8",
        "cmp_swap old 8 now 42",
        "bad rkey: error requester syndrome 0x13",
        "bad lkey: error requester syndrome 0x4",
        "too long: error requester syndrome 0x12",
        "too long recv: error responder syndrome 0x1",
        "rnr: error requester syndrome 0x16",
        "handover 0: req op 0x8 bytes 64",
        "handover 2: req op 0x8 bytes 64",
        "handover 2 bytes: true",
        "peer gone: error requester syndrome 0x15",
    ] {
        assert!(
            soft.iter().any(|l| l.starts_with(want)),
            "missing {want:?} in {soft:#?}"
        );
    }
}

/// The samples run on the mlx5 backend under `gpuverbs emu` (loopback, CPU initiator), every
/// byte validated, and their JSON says which backend.
#[test]
fn put_bw_and_write_lat_run_on_the_mlx5_backend() {
    build(&[
        "-p",
        "gpuverbs-samples",
        "--bin",
        "put_bw",
        "--bin",
        "write_lat",
    ]);
    let dir = Path::new(GPUVERBS).parent().unwrap();
    for (bin, args) in [
        (
            "put_bw",
            &[
                "--loopback",
                "--initiator",
                "cpu",
                "-s",
                "4096",
                "-n",
                "50",
                "--json",
            ][..],
        ),
        (
            "write_lat",
            &[
                "--loopback",
                "--initiator",
                "cpu",
                "-s",
                "64",
                "-n",
                "50",
                "--json",
            ][..],
        ),
    ] {
        let out = Command::new(GPUVERBS)
            .env("GPUVERBS_PRELOAD", preload())
            .args(["emu", "--ip", "127.0.96.1", "--"])
            .arg(dir.join(bin))
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{bin} on mlx5_0 failed:\n{text}");
        let rec = text
            .lines()
            .find(|l| l.starts_with('{') && l.contains("\"bytes\""))
            .unwrap_or_else(|| panic!("{bin}: no JSON record:\n{text}"));
        assert!(rec.contains("\"backend\":\"mlx5\""), "{bin}: {rec}");
        assert!(rec.contains("\"device\":\"mlx5 mlx5_0"), "{bin}: {rec}");
    }
}

/// Runs under `gpuverbs emu` (started by the test below): `ibv_reg_dmabuf_mr` reaches the
/// emulation's one ioctl method through the real libibverbs + libmlx5 and is refused the way
/// mlx5_ib refuses what is not a dma-buf of device memory.
#[test]
fn dmabuf_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    use rdma_core_sys as sys;
    let v = sys::verbs().unwrap();
    let reg = v
        .ibv_reg_dmabuf_mr
        .expect("libibverbs has ibv_reg_dmabuf_mr");
    // SAFETY: the device list, context and PD are used while open and released at the end;
    // every pointer comes from libibverbs.
    unsafe {
        let mut n = 0;
        let list = (v.ibv_get_device_list)(&mut n);
        assert!(n >= 1, "no emulated device");
        let ctx = (v.ibv_open_device)(*list);
        assert!(!ctx.is_null());
        let pd = (v.ibv_alloc_pd)(ctx);
        assert!(!pd.is_null());
        let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        // a memfd is no dma-buf: EINVAL (not ENOTTY: the method is served)
        let fd = libc::memfd_create(c"not-a-dmabuf".as_ptr(), 0);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, 1 << 16), 0);
        let mr = reg(pd, 0, 4096, 0x10000, fd, 1);
        println!("DMABUF memfd {} {}", mr.is_null(), errno());
        // no fd at all: EBADF
        let mr = reg(pd, 0, 4096, 0x10000, 987_654, 1);
        println!("DMABUF nofd {} {}", mr.is_null(), errno());
        libc::close(fd);
        (v.ibv_dealloc_pd)(pd);
        (v.ibv_close_device)(ctx);
        (v.ibv_free_device_list)(list);
    }
}

#[test]
fn dmabuf_registration_reaches_the_emulated_kernel() {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(GPUVERBS)
        .env("GPUVERBS_PRELOAD", preload())
        .env(CHILD, "1")
        .args(["emu", "--ip", "127.0.97.1", "--"])
        .arg(&exe)
        .args(["--exact", "dmabuf_child", "--nocapture", "--test-threads=1"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("DMABUF memfd true {}", libc::EINVAL)),
        "{text}"
    );
    assert!(
        text.contains(&format!("DMABUF nofd true {}", libc::EBADF)),
        "{text}"
    );
}
