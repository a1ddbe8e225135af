//! The server/client roles of `echo` and `kv_transfer` as two processes: what runs without a
//! GPU. Their kernels' sides (echo's server, both of kv_transfer's) must refuse at once on a
//! machine without one (before they listen or connect), and echo's CPU client's own parts
//! (rendezvous, the soft NIC's wire port, the endpoint exchange) are checked against another
//! sample's server. The GPU paths run on a GPU machine (the commands are in the binaries' doc
//! comments).

use std::process::Output;
use std::time::Duration;

mod common;
use common::{command, free_port, text, wait};

const ECHO: &str = env!("CARGO_BIN_EXE_echo");
const PUT_BW: &str = env!("CARGO_BIN_EXE_put_bw");
const KV: &str = env!("CARGO_BIN_EXE_kv_transfer");

fn run(bin: &str, args: &[&str]) -> (Output, Duration) {
    wait(
        command(bin, args).spawn().expect("start"),
        Duration::from_secs(60),
    )
}

#[test]
fn server_without_a_gpu_refuses_before_it_listens() {
    let port = free_port();
    let (out, took) = run(ECHO, &["-p", &port, "--timeout", "3", "-n", "10"]);
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    if stderr.contains("echo needs") {
        // No GPU (CI), or no kernels: one line, at once, without waiting for a client.
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.starts_with("echo: error: echo needs "), "{stderr}");
        assert!(stderr.contains("the server is a kernel"), "{stderr}");
        assert!(!stderr.contains("waiting for a client"), "{stderr}");
        assert!(took < Duration::from_secs(3), "took {took:?}: {stderr}");
    } else {
        // A GPU: the server listens, and gives up after --timeout without a client.
        assert!(
            stderr.contains("echo: server: waiting for a client on port"),
            "{stderr}"
        );
        assert!(stderr.contains("rendezvous (server)"), "{stderr}");
    }
}

#[test]
fn cpu_client_without_a_server_gives_up_after_its_timeout() {
    let port = free_port();
    let (out, took) = run(ECHO, &["127.0.0.1", "-p", &port, "--timeout", "1"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("echo: client: connecting to 127.0.0.1:{port}")),
        "{stderr}"
    );
    assert!(stderr.contains("rendezvous (client)"), "{stderr}");
    assert!(took < Duration::from_secs(20), "took {took:?}: {stderr}");
}

#[test]
fn cpu_client_meets_a_server_and_both_see_the_test_differs() {
    // The CPU client needs no GPU: it meets put_bw's server, opens its soft NIC with a wire
    // port, sets up its QP and buffers, and the endpoint exchange ends both with the reason.
    let port = free_port();
    let server = command(
        PUT_BW,
        &["-p", &port, "--timeout", "30", "--initiator", "cpu"],
    )
    .spawn()
    .expect("start put_bw's server");
    let client = command(ECHO, &["127.0.0.1", "-p", &port, "--timeout", "30"])
        .spawn()
        .expect("start echo's client");
    let (client, _) = wait(client, Duration::from_secs(120));
    let (server, _) = wait(server, Duration::from_secs(120));
    let (cerr, serr) = (text(&client.stderr), text(&server.stderr));
    assert_eq!(client.status.code(), Some(1), "{cerr}");
    assert_eq!(server.status.code(), Some(1), "{serr}");
    assert!(cerr.contains("the peer runs put_bw, not echo"), "{cerr}");
    assert!(serr.contains("the peer runs echo, not put_bw"), "{serr}");
    assert!(!cerr.contains("panicked") && !serr.contains("panicked"));
}

#[test]
fn role_arguments_are_checked() {
    // A server host and --loopback contradict each other (clap: exit 2).
    let (out, _) = run(ECHO, &["127.0.0.1", "--loopback"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let (out, _) = run(ECHO, &["-p", "1", "--loopback"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    // The client needs the server's real port.
    let (out, _) = run(ECHO, &["127.0.0.1", "-p", "0"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("-p 0: the client needs the server's port"),
        "{stderr}"
    );
    // The GPU client sends SENDs only.
    let (out, _) = run(
        ECHO,
        &[
            "127.0.0.1",
            "-p",
            "1",
            "--initiator",
            "gpu",
            "--op",
            "write-imm",
        ],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--initiator gpu sends SENDs (--op send)"),
        "{stderr}"
    );
}

#[test]
fn kv_transfer_sides_without_a_gpu_refuse_before_the_rendezvous() {
    let port = free_port();
    for (args, who) in [
        (vec!["-p", &port, "--timeout", "3"], "the receiver (server)"),
        (
            vec!["127.0.0.1", "-p", &port, "--timeout", "3"],
            "the sender (client)",
        ),
    ] {
        let (out, took) = run(KV, &args);
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        if stderr.contains("kv_transfer needs") {
            // No GPU (CI): one line, at once, neither listening nor connecting.
            assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
            assert!(
                stderr.starts_with(&format!(
                    "kv_transfer: error: kv_transfer needs a GPU: {who}"
                )),
                "{stderr}"
            );
            assert!(!stderr.contains("waiting for a client"), "{stderr}");
            assert!(!stderr.contains("connecting to"), "{stderr}");
            assert!(took < Duration::from_secs(3), "took {took:?}: {stderr}");
        } else {
            // A GPU: the side meets no peer and gives up after --timeout.
            assert!(stderr.contains("rendezvous ("), "{stderr}");
        }
    }
}

#[test]
fn kv_transfer_role_arguments_are_checked() {
    let (out, _) = run(KV, &["127.0.0.1", "--loopback"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let (out, _) = run(KV, &["127.0.0.1", "-p", "0"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("-p 0: the client needs the server's port"),
        "{stderr}"
    );
    let (out, _) = run(KV, &["-p", "0", "--block-size", "12"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--block-size must be a multiple of 8"),
        "{stderr}"
    );
}
