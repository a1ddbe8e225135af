//! The host API's modules form layers (docs/architecture.md, "The host API's layers"): each
//! module uses only modules listed before it below, never one after it, so a lower layer never
//! calls back up. The test reads the sources under `src/` and fails on any reference that goes
//! up (a `crate::`, `super::` or `self::` path, a path through a child module, or a name the
//! crate root re-exports), and on any source file that is not placed in a layer.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

/// Bottom first. A module may use any module listed before it.
const LAYERS: &[&str] = &[
    // crate-wide vocabulary and formats
    "error",
    "desc",
    // the CUDA driver, the embedded kernels
    "fatbin",
    "cuda",
    // the device backends: what they share, the queues' geometry and the seam each implements,
    // one room per device kind, the open device on top
    "backend",
    "backend::geometry",
    "backend::seam",
    "backend::mlx5::device",
    "backend::mlx5::devx",
    "backend::mlx5::objects",
    "backend::mlx5::dc",
    "backend::mlx5::ops",
    "backend::mlx5",
    "backend::soft::controls",
    "backend::soft::addr",
    "backend::soft::route",
    "backend::soft::ops",
    "backend::soft",
    "backend::context",
    "device",
    // a GPU context (mapping and device memory only), whose memory the backends place rings in
    "gpu",
    // PDs, buffers, regions; the registration cache on top of them
    "memory::buffer",
    "memory::inflight",
    "memory::region",
    "memory",
    "regcache::config",
    "regcache::source",
    "regcache",
    // what peers exchange, and how (a QP connects to an endpoint)
    "endpoint",
    "bootstrap::error",
    "bootstrap::link",
    "bootstrap::job",
    "bootstrap::exchange",
    "bootstrap::mpi",
    "bootstrap",
    // CQs, QPs, state transitions, posters
    "queue::ring",
    "queue::cq",
    "queue::poster",
    "queue::qp",
    "queue::dc",
    "queue::state",
    "queue::recover",
    "queue",
    // the descriptor a kernel drives (exporting a QP into a GPU), the CPU proxy
    "export",
    "proxy",
    // re-exports for users
    "post",
    // the unit tests' shared set-up (built for tests only): may use everything
    "testing",
];

/// Crate-wide vocabulary: may name any module's types (the error enum carries them).
const VOCABULARY: &[&str] = &["error"];

/// The source of a module, without comments and without its `#[cfg(test)] mod tests`.
fn code(src: &str) -> String {
    let mut text = src.to_string();
    if let Some(i) = find_tests(&text) {
        text.truncate(i);
    }
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Where the test module (`#[cfg(test)]` followed by `mod tests`) begins.
fn find_tests(text: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = text[from..].find("#[cfg(test)]") {
        let at = from + i;
        let rest = text[at + "#[cfg(test)]".len()..].trim_start();
        if rest.starts_with("mod tests") {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Reads an identifier at the start of `s`.
fn ident(s: &str) -> (&str, &str) {
    let n = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
    (&s[..n], &s[n..])
}

/// The paths a `use` tree or an expression path names, starting at `s` (just after the first
/// `::`): `a::b::C`, `a::{b::C, d}`, `a::*`, `a::B as C`; `(path, alias)` pairs.
fn tree(s: &str) -> Vec<(Vec<String>, Option<String>)> {
    fn skip_ws(s: &str, i: usize) -> usize {
        s.len() - s[i..].trim_start().len()
    }
    fn go(s: &str, prefix: &[String], out: &mut Vec<(Vec<String>, Option<String>)>) -> usize {
        let mut path = prefix.to_vec();
        let mut i = 0;
        loop {
            i = skip_ws(s, i);
            if s[i..].starts_with('{') {
                i += 1;
                loop {
                    i = skip_ws(s, i);
                    if s[i..].starts_with('}') {
                        return i + 1;
                    }
                    i += go(&s[i..], &path, out);
                    i = skip_ws(s, i);
                    if s[i..].starts_with(',') {
                        i += 1;
                    } else {
                        return i + usize::from(s[i..].starts_with('}'));
                    }
                }
            }
            if s[i..].starts_with('*') {
                out.push((path, None));
                return i + 1;
            }
            let (id, after) = ident(&s[i..]);
            if id.is_empty() {
                out.push((path, None));
                return i;
            }
            i += id.len();
            if id != "self" {
                path.push(id.to_string());
            }
            if after.starts_with("::") && !after[2..].starts_with('<') {
                i += 2;
                continue;
            }
            let j = skip_ws(s, i);
            let mut alias = None;
            if s[j..].starts_with("as ") {
                let k = skip_ws(s, j + 3);
                let (name, _) = ident(&s[k..]);
                alias = Some(name.to_string());
                i = k + name.len();
            }
            out.push((path, alias));
            return i;
        }
    }
    let mut out = Vec::new();
    go(s, &[], &mut out);
    out
}

/// Inline modules (`mod name { .. }`) of a source: (name, start, end).
fn inline_mods(code: &str) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = code[from..].find("mod ") {
        let at = from + i;
        from = at + 4;
        if at > 0 && code[..at].ends_with(|c: char| is_ident(c)) {
            continue;
        }
        let (name, rest) = ident(&code[at + 4..]);
        if name.is_empty() || !rest.trim_start().starts_with('{') {
            continue;
        }
        let open = code.len() - rest.trim_start().len();
        let mut depth = 0;
        let mut end = code.len();
        for (j, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((name.to_string(), open, end));
    }
    out
}

/// The modules of [`LAYERS`] that the source of `module` names (itself left out), or the
/// paths it names that no module of [`LAYERS`] holds (`Err`). `roots`: the names the crate
/// root re-exports, and the module each comes from.
fn uses(
    module: &str,
    src: &str,
    roots: &BTreeMap<String, String>,
) -> Result<Vec<String>, Vec<String>> {
    let code = code(src);
    let here: Vec<String> = module.split("::").map(String::from).collect();
    let children: HashSet<String> = code
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let m = match l.strip_prefix("pub") {
                Some(r) if r.starts_with('(') => r.split_once(") mod ")?.1,
                Some(r) => r.strip_prefix(" mod ")?,
                None => l.strip_prefix("mod ")?,
            };
            let (name, rest) = ident(m);
            (rest == ";").then(|| name.to_string())
        })
        .collect();
    let inline = inline_mods(&code);
    let mut out = Vec::new();
    let mut unknown = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let prev = code[..i].chars().next_back();
        if prev.is_some_and(|c| is_ident(c) || c == ':' || c == '$') {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        }
        let (word, after) = ident(rest);
        let start = if word.is_empty() || !after.starts_with("::") {
            None
        } else {
            // the module path of the code at `i`, inline modules included
            let mut scope = here.clone();
            scope.extend(
                inline
                    .iter()
                    .filter(|(_, s, e)| *s < i && i < *e)
                    .map(|(n, _, _)| n.clone()),
            );
            match word {
                "crate" => Some((Vec::new(), &after[2..])),
                "self" => Some((scope, &after[2..])),
                "super" => {
                    let mut base = scope;
                    let mut tail = &after[2..];
                    base.pop();
                    while let Some(t) = tail.strip_prefix("super::") {
                        base.pop();
                        tail = t;
                    }
                    Some((base, tail))
                }
                w if children.contains(w) => Some((here.clone(), rest)),
                _ => None,
            }
        };
        let Some((base, tail)) = start else {
            i += word
                .len()
                .max(rest.chars().next().map_or(1, char::len_utf8));
            continue;
        };
        for (path, _) in tree(tail) {
            let mut full = base.clone();
            full.extend(path);
            match resolve(&full, roots) {
                Some(m) if m != module => out.push(m),
                Some(_) => {}
                None => unknown.push(format!("{module}: {}", full.join("::"))),
            }
        }
        i += word.len();
    }
    if unknown.is_empty() {
        Ok(out)
    } else {
        Err(unknown)
    }
}

/// The module of [`LAYERS`] that holds the item at `path` (from the crate root).
fn resolve(path: &[String], roots: &BTreeMap<String, String>) -> Option<String> {
    for n in (1..=path.len()).rev() {
        let m = path[..n].join("::");
        if LAYERS.contains(&m.as_str()) {
            return Some(m);
        }
    }
    roots.get(path.first()?).cloned()
}

/// The names `lib.rs` re-exports (`pub use module::Name`), and the module each comes from.
fn root_names(lib: &str) -> BTreeMap<String, String> {
    let code = code(lib);
    let mut out = BTreeMap::new();
    for (at, _) in code.match_indices("pub use ") {
        for (path, alias) in tree(&code[at + "pub use ".len()..]) {
            let Some(name) = alias.or_else(|| path.last().cloned()) else {
                continue;
            };
            let holder = (1..path.len())
                .rev()
                .map(|n| path[..n].join("::"))
                .find(|p| LAYERS.contains(&p.as_str()));
            if let Some(m) = holder {
                out.insert(name, m);
            }
        }
    }
    out
}

/// `(module, the module above it that it names)` for every upward reference of `module`.
fn upward(module: &str, deps: &[String]) -> Vec<String> {
    if VOCABULARY.contains(&module) {
        return Vec::new();
    }
    let rank = |m: &str| {
        LAYERS
            .iter()
            .position(|l| *l == m)
            .expect("a layered module")
    };
    deps.iter()
        .filter(|d| rank(d) > rank(module))
        .map(|d| format!("{module} uses {d}"))
        .collect()
}

/// The module a source file under `src/` is (`a/b.rs`: `a::b`; `a/mod.rs`: `a`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

#[test]
fn no_module_uses_one_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let roots = root_names(&lib);
    let mut up = Vec::new();
    let mut unknown = Vec::new();
    let mut files = Vec::new();
    for file in walk(&src) {
        if file.extension().is_none_or(|x| x != "rs") || file == src.join("lib.rs") {
            continue;
        }
        let m = module_of(&src, &file);
        assert!(
            LAYERS.contains(&m.as_str()),
            "{} ({m}) is not placed in a layer",
            file.display()
        );
        files.push(m.clone());
        match uses(&m, &std::fs::read_to_string(&file).unwrap(), &roots) {
            Ok(deps) => up.extend(upward(&m, &deps)),
            Err(u) => unknown.extend(u),
        }
    }
    // every layer has a source file (the re-export modules may still be inline in lib.rs)
    for m in LAYERS {
        assert!(
            files.iter().any(|f| f == m) || lib.contains(&format!("mod {m} {{")),
            "module {m} has no source file"
        );
    }
    assert!(unknown.is_empty(), "paths no layer holds: {unknown:#?}");
    up.sort();
    up.dedup();
    assert!(up.is_empty(), "references that go up a layer: {up:#?}");
}

#[test]
fn the_checker_sees_upward_references() {
    let roots = root_names("pub use queue::{Cq, Qp as QueuePair};\npub use error::Error;");
    assert_eq!(roots["QueuePair"], "queue");
    let src = "use crate::queue::Qp;\n\
               use super::{buffer::HostBuffer, Pd};\n\
               use crate::{gpu::Gpu, Error};\n\
               fn f() { let _ = crate::QueuePair::new(); }\n\
               // crate::proxy in a comment\n\
               mod sealed { use super::super::inflight::Watch; }\n\
               #[cfg(test)]\n\
               mod tests { use crate::export::ExportedQp; }";
    let deps = uses("memory::region", src, &roots).unwrap();
    assert_eq!(
        deps,
        [
            "queue",
            "memory::buffer",
            "memory",
            "gpu",
            "error",
            "queue",
            "memory::inflight"
        ]
    );
    assert_eq!(
        upward("memory::region", &deps),
        [
            "memory::region uses queue",
            "memory::region uses memory",
            "memory::region uses queue"
        ]
    );
    // a parent naming its child module, and a path no module holds
    let deps = uses("memory", "mod region;\npub use region::Mr;", &roots).unwrap();
    assert_eq!(deps, ["memory::region"]);
    assert!(uses("gpu", "use crate::nowhere::X;", &roots).is_err());
}

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
