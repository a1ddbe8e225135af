//! The soft NIC's modules form layers: each module uses only modules of lower layers (or of
//! its own layer that come before it in the list below), never one above it. The test reads
//! the sources and fails on any reference that goes up, so a call back into the engine from
//! the wire (the cycle this layout removed) cannot come back unnoticed. A second test looks
//! at folders: the top-level modules (a file or a folder under `src/` each) never use each
//! other in a circle, as `rs_cycles.py` reads them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Bottom first. A module may use any module listed before it. (`buffer` and `devmem` are the
/// `verbs` crate's, re-exported; the crate sits below all of these.)
const LAYERS: &[&str] = &[
    // formats and plain resources
    "clock",
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
    // objects and the tables that hold them
    "qp",
    "shared",
    "gather",
    // behaviour, lowest first
    "completion",
    "responder",
    "wire",
    "wire::requester",
    "wire::responder",
    "ud",
    "wire::transport",
    "engine",
    "device",
    // clients of the device
    "initiator",
    "bench",
];

/// The modules a source file names through `crate::` or `super::` paths (comments and the
/// test module left out).
fn uses(module: &str, src: &str) -> Vec<String> {
    let code = code(src);
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

/// Every file under `dir`, at any depth.
fn walk(dir: &Path) -> Vec<PathBuf> {
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

// ---------------------------------------------------------------------------- folder level

/// Top-level modules, and the top-level modules each one uses.
type Graph = BTreeMap<String, BTreeSet<String>>;

#[test]
fn no_folders_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let shown: Vec<String> = circles(&folder_graph(&src))
        .iter()
        .map(|c| c.join(" -> "))
        .collect();
    assert!(
        shown.is_empty(),
        "top-level modules in a circle:\n{}",
        shown.join("\n")
    );
}

#[test]
fn the_folder_checker_sees_circles() {
    let src = "use crate::qp::Qp;\nuse crate::{wire::X, Gid}; // crate::engine\n\
               #[cfg(test)]\nmod tests {\n use crate::device; }";
    assert_eq!(crate_names(&code(src)), ["qp", "wire", "X", "Gid"]);
    let mut graph = Graph::new();
    for (m, used) in [("a", "b"), ("b", "c"), ("b", "d"), ("c", "a")] {
        graph.entry(m.into()).or_default().insert(used.into());
        graph.entry(used.into()).or_default();
    }
    assert_eq!(circles(&graph), [["a", "b", "c", "a"]]);
}

/// The graph of `src/`'s top-level modules (a file or a folder each; `lib.rs` is none), read
/// as `rs_cycles.py` reads it: a module uses another when its code names it in a `crate::`
/// path (`crate::m::..`, `crate::{m, ..}`) or names something `lib.rs` re-exports from it.
fn folder_graph(src: &Path) -> Graph {
    let read = |f: &Path| code(&std::fs::read_to_string(f).unwrap());
    let files: Vec<PathBuf> = walk(src)
        .into_iter()
        .filter(|f| f.extension().is_some_and(|x| x == "rs"))
        .collect();
    let mut graph: Graph = files
        .iter()
        .map(|f| (top_module(src, f), BTreeSet::new()))
        .collect();
    graph.remove("lib");
    let reexported = reexports(&read(&src.join("lib.rs")), &graph);
    for f in files.iter().filter(|f| !f.ends_with("lib.rs")) {
        let me = top_module(src, f);
        let text = read(f);
        let used: BTreeSet<String> = crate_names(&text)
            .into_iter()
            .filter_map(|n| {
                if graph.contains_key(n) {
                    Some(n.to_string())
                } else {
                    reexported.get(n).cloned()
                }
            })
            .filter(|m| *m != me)
            .collect();
        graph.get_mut(&me).unwrap().extend(used);
    }
    graph
}

/// The top-level module a source file belongs to: `a` for `src/a.rs` and for `src/a/..`.
fn top_module(src: &Path, file: &Path) -> String {
    let first = file
        .strip_prefix(src)
        .unwrap()
        .iter()
        .next()
        .unwrap()
        .to_str()
        .unwrap();
    first.strip_suffix(".rs").unwrap_or(first).to_string()
}

/// The names `lib.rs` re-exports from the crate's own modules (`pub use m::{A, B}`), each
/// with its module.
fn reexports(lib: &str, graph: &Graph) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for (i, _) in lib.match_indices("pub use ") {
        let rest = &lib[i + "pub use ".len()..];
        let m = ident(rest);
        if let (true, Some(names)) = (graph.contains_key(m), rest[m.len()..].strip_prefix("::")) {
            out.extend(
                head_names(names)
                    .into_iter()
                    .map(|n| (n.to_string(), m.to_string())),
            );
        }
    }
    out
}

/// The circles a depth-first walk of `graph` closes, each from its first module back to it.
fn circles(graph: &Graph) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        if !done.contains(m) {
            visit(graph, m, &mut Vec::new(), &mut done, &mut out);
        }
    }
    out
}

/// One step of [`circles`]' walk: `m`, then what it uses that the walk has not finished.
fn visit<'g>(
    graph: &'g Graph,
    m: &'g String,
    path: &mut Vec<&'g String>,
    done: &mut BTreeSet<&'g String>,
    out: &mut Vec<Vec<String>>,
) {
    path.push(m);
    for next in &graph[m] {
        if let Some(i) = path.iter().position(|p| *p == next) {
            out.push(path[i..].iter().copied().chain([next]).cloned().collect());
        } else if !done.contains(next) {
            visit(graph, next, path, done, out);
        }
    }
    path.pop();
    done.insert(m);
}

/// A source without comments and without its inline test module (`#[cfg(test)] mod m {`).
fn code(src: &str) -> String {
    let lines: Vec<&str> = src
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect();
    let text = lines.join("\n");
    let mut from = 0;
    while let Some(i) = text[from..].find("#[cfg(test)]") {
        let at = from + i;
        let rest = text[at + "#[cfg(test)]".len()..].trim_start();
        if let Some(m) = rest.strip_prefix("mod ").map(str::trim_start) {
            if m[ident(m).len()..].trim_start().starts_with('{') {
                return text[..at].to_string();
            }
        }
        from = at + 1;
    }
    text
}

/// The names the `crate::` paths of `code` start with: `m` of `crate::m::..`, and every name
/// of a `crate::{..}` group.
fn crate_names(code: &str) -> Vec<&str> {
    code.match_indices("crate::")
        .flat_map(|(i, _)| head_names(&code[i + "crate::".len()..]))
        .collect()
}

/// The names at the start of a path's rest `s`: every name of a `{..}` group, or the one name.
fn head_names(s: &str) -> Vec<&str> {
    match s.strip_prefix('{') {
        Some(group) => group[..group.find('}').unwrap_or(group.len())]
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect(),
        None => vec![ident(s)],
    }
}

/// The identifier `s` starts with (empty if none).
fn ident(s: &str) -> &str {
    &s[..s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len())]
}
