//! The soft NIC's modules form layers: each module uses only modules of lower layers (or of
//! its own layer that come before it in the list below), never one above it. The test reads
//! the sources and fails on any reference that goes up, so a call back into the engine from
//! the wire (the cycle this layout removed) cannot come back unnoticed. Circles of folders and
//! files in every crate: `cargo xtask layers` (its test runs in `cargo test --workspace`).

use std::collections::HashMap;
use std::path::Path;

/// Bottom first. A module may use any module listed before it. (`buffer` and `devmem` are the
/// `verbs` crate's, re-exported; the crate sits below all of these.)
const LAYERS: &[&str] = &[
    // formats and plain resources
    "clock",
    "sched",
    "counters",
    "event",
    "mem",
    "mem::indirect",
    "cq",
    "srq",
    // datagrams: formats, captures, the port's settings, IPv4 identifications, the UDP port
    "net::packet",
    "net::pcap",
    "net",
    "net::ip_ids",
    "net::socket",
    // what a WQE's end looks like; the per-QP RC state a QP holds
    "outcome",
    "rc_state",
    // sources read ahead for the wire, kept per WQE (a QP holds them)
    "staged",
    // objects and the tables that hold them
    "qp",
    "shared",
    "gather",
    // the sources of the WQEs announced behind a wire WRITE or SEND, read with it
    "readahead",
    // behaviour, lowest first
    "completion",
    "responder",
    "wire",
    "wire::requester",
    "wire::responder",
    "wire::dct",
    "group",
    "ud",
    "gsi",
    "wire::transport",
    "dc",
    "engine",
    "device",
    // the multicast verbs: the device's, over `group` and `ud`
    "mcast",
    // clients of the device
    "initiator",
    "bench",
];

/// The modules a source file names through `crate::` or `super::` paths (comments and the
/// test module left out).
fn uses(module: &str, src: &str) -> Vec<String> {
    let code: String = src
        .split("#[cfg(test)]")
        .next()
        .unwrap_or("")
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let parent = module.rsplit_once("::").map(|(p, _)| p);
    let mut out = Vec::new();
    for (prefix, base) in [("crate::", None), ("super::", parent)] {
        let mut rest = code.as_str();
        while let Some(i) = rest.find(prefix) {
            rest = &rest[i + prefix.len()..];
            let path: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_' || *c == ':')
                .collect();
            let mut parts = path.split("::").filter(|p| !p.is_empty());
            let Some(first) = parts.next() else {
                // `super::{A, B}` names the parent module itself
                if let (Some(b), true) = (base, rest.starts_with('{')) {
                    if LAYERS.contains(&b) {
                        out.push(b.to_string());
                    }
                }
                continue;
            };
            let head = match base {
                Some(b) => format!("{b}::{first}"),
                None => first.to_string(),
            };
            let name = match parts.next() {
                Some(second) if LAYERS.contains(&format!("{head}::{second}").as_str()) => {
                    format!("{head}::{second}")
                }
                _ => head,
            };
            if LAYERS.contains(&name.as_str()) && name != module {
                out.push(name);
            }
        }
    }
    out
}

#[test]
fn no_module_uses_one_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let rank: HashMap<&str, usize> = LAYERS.iter().enumerate().map(|(i, m)| (*m, i)).collect();
    let mut seen = 0;
    let mut up = Vec::new();
    for m in LAYERS {
        let rel = m.replace("::", "/");
        let file = [src.join(format!("{rel}.rs")), src.join(&rel).join("mod.rs")]
            .into_iter()
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("module {m} has no source file"));
        let text = std::fs::read_to_string(&file).unwrap();
        seen += 1;
        for dep in uses(m, &text) {
            if rank[dep.as_str()] > rank[m] {
                up.push(format!("{m} uses {dep}"));
            }
        }
    }
    // every source file is placed in a layer
    let mut files = 0;
    for e in walk(&src) {
        // (a module's unit tests in a file of their own, `tests.rs`, belong to it)
        if e.extension().is_some_and(|x| x == "rs")
            && !e.ends_with("lib.rs")
            && !e.ends_with("tests.rs")
        {
            files += 1;
        }
    }
    assert_eq!(seen, files, "a source file is missing from LAYERS");
    assert!(up.is_empty(), "references that go up a layer: {up:#?}");
}

#[test]
fn the_checker_sees_upward_references() {
    let deps = uses(
        "wire::requester",
        "use crate::engine::Done;\nuse super::transport::run;\nuse super::{WireConfig};\n\
         // crate::device in a comment",
    );
    assert_eq!(deps, ["engine", "wire::transport", "wire"]);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
