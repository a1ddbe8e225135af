//! The mlx5 formats crate keeps its folders in layers: the top-level modules (a file or a folder under
//! `src/` each) never use each other in a circle, as `rs_cycles.py` reads them. A lower layer
//! never names a higher one (`DESIGN.md`, "Layers"); the test reads the sources and fails on
//! any circle, printing it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

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
