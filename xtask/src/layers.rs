//! `cargo xtask layers`: module circles in every crate of the workspace, at two levels: the
//! folder level (each top-level file or folder under a crate's source root is one node) and
//! the file level (each source file is one node). A lower layer never names a higher one, so
//! there must be none; the test below fails CI on any (the per-crate `layering` tests order
//! the modules of the host API and the soft NIC further).
//!
//! A module names another through `crate::` and `super::` paths (test modules and comments
//! left out); `crate::Name` where the crate root re-exports `Name` names the module it comes
//! from. A crate-wide error module may name any module's types (it is vocabulary, not a layer).

use anyhow::{bail, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every crate root's source folder (a binary with modules of its own is a root too).
pub const ROOTS: &[&str] = &[
    "src",
    "crates/prm/src",
    "crates/verbs/src",
    "crates/softnic/src",
    "crates/uverbs/src",
    "crates/uverbs/preload/src",
    "crates/rdma-core-sys/src",
    "crates/softnic-cuda/src",
    "crates/kernel-build/src",
    "crates/command/src",
    "crates/gpu-tests/src",
    "samples/src",
    "samples/src/bin/softnic_bench",
    "samples/user-kernel/src",
    "python/src",
    "xtask/src",
];

/// Modules that may name any other (crate-wide error vocabulary).
const SINKS: &[&str] = &["error", "errors"];

/// The module graph of one source folder: module path (`a::b`) → modules it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// A source file's module path under `root` (`None` for a crate root, or a separate binary).
fn module_of(root: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(root).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    match last.as_str() {
        "mod.rs" => {}
        "lib.rs" | "main.rs" if parts.is_empty() => return None,
        f => parts.push(f.strip_suffix(".rs")?.to_string()),
    }
    (!parts.is_empty()).then(|| parts.join("::"))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// A file's code without comments and without its test module (from `#[cfg(test)]` on).
fn code(src: &str) -> String {
    let text: String = src
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    match text.find("#[cfg(test)]") {
        Some(i) if text[i..].contains("mod ") => text[..i].to_string(),
        _ => text,
    }
}

/// The `::`-separated identifiers that follow `prefix` at each place it occurs, with a `{..}`
/// group expanded one level: `crate::a::{b, c::D}` → `[a, b]`, `[a, c, D]`.
fn paths_after(text: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let ident = |s: &str| {
        s.find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len())
    };
    for (i, _) in text.match_indices(prefix) {
        if text[..i]
            .chars()
            .last()
            .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
        {
            continue; // inside a longer path (`a::super::`, `super::super::`)
        }
        let mut s = &text[i + prefix.len()..];
        let mut head = Vec::new();
        loop {
            let n = ident(s);
            if n == 0 {
                break;
            }
            head.push(s[..n].to_string());
            s = &s[n..];
            if !s.starts_with("::") {
                break;
            }
            s = &s[2..];
        }
        if let Some(group) = s.strip_prefix('{').and_then(|g| g.split('}').next()) {
            for item in group.split(',') {
                let mut p = head.clone();
                p.extend(
                    item.split("::")
                        .map(|x| x.split_whitespace().next().unwrap_or("").to_string())
                        .filter(|x| !x.is_empty() && x != "self"),
                );
                if !p.is_empty() {
                    out.push(p);
                }
            }
        } else if !head.is_empty() {
            out.push(head);
        }
    }
    out
}

/// The longest prefix of `path` that is a module, if any.
fn resolve(path: &[String], mods: &BTreeSet<String>) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| mods.contains(m))
}

/// The file-level module graph of a source folder.
pub fn graph(root: &Path) -> Graph {
    let mut files = Vec::new();
    sources(root, &mut files);
    let mods: BTreeSet<String> = files.iter().filter_map(|f| module_of(root, f)).collect();
    // names the crate root re-exports: `pub use a::b::{C, D}` makes `crate::C` name `a::b`
    let mut reexports = BTreeMap::new();
    for top in ["lib.rs", "main.rs"] {
        let Ok(src) = std::fs::read_to_string(root.join(top)) else {
            continue;
        };
        for p in paths_after(&code(&src), "pub use ") {
            if let (Some(m), Some(name)) = (resolve(&p, &mods), p.last()) {
                reexports.insert(name.clone(), m);
            }
        }
    }
    let mut g = Graph::new();
    for f in &files {
        let Some(me) = module_of(root, f) else {
            continue;
        };
        let text = code(&std::fs::read_to_string(f).unwrap_or_default());
        let parent: Vec<String> = me.split("::").map(str::to_string).collect();
        let mut named = BTreeSet::new();
        for p in paths_after(&text, "crate::") {
            let m = resolve(&p, &mods).or_else(|| reexports.get(&p[0]).cloned());
            // (`p` is never empty: `paths_after` drops empty paths)
            named.extend(m);
        }
        for p in paths_after(&text, "super::") {
            // `super::super::x`: one level up for each `super`
            let ups = 1 + p.iter().take_while(|s| *s == "super").count();
            let mut full = parent[..parent.len().saturating_sub(ups)].to_vec();
            full.extend(p.into_iter().skip(ups - 1));
            named.extend(resolve(&full, &mods));
        }
        named.remove(&me);
        g.entry(me).or_default().extend(named);
    }
    g
}

/// The graph with each module folded into its top-level module.
pub fn folders(g: &Graph) -> Graph {
    let top = |m: &str| m.split("::").next().unwrap_or(m).to_string();
    let mut out = Graph::new();
    for (m, uses) in g {
        let e = out.entry(top(m)).or_default();
        e.extend(uses.iter().map(|u| top(u)).filter(|u| *u != top(m)));
    }
    out
}

/// Every circle found by a depth-first walk (each as `a -> b -> a`), sinks left out.
pub fn circles(g: &Graph) -> Vec<String> {
    fn walk(
        u: &str,
        g: &Graph,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
        out: &mut Vec<String>,
    ) {
        state.insert(u.to_string(), 1);
        stack.push(u.to_string());
        for v in g.get(u).into_iter().flatten() {
            if SINKS.contains(&v.as_str()) {
                continue;
            }
            match state.get(v) {
                Some(1) => {
                    let at = stack.iter().position(|s| s == v).unwrap_or(0);
                    let mut c = stack[at..].to_vec();
                    c.push(v.clone());
                    out.push(c.join(" -> "));
                }
                None => walk(v, g, state, stack, out),
                _ => {}
            }
        }
        stack.pop();
        state.insert(u.to_string(), 2);
    }
    let (mut state, mut out) = (BTreeMap::new(), Vec::new());
    for u in g.keys() {
        if !state.contains_key(u) && !SINKS.contains(&u.as_str()) {
            walk(u, g, &mut state, &mut Vec::new(), &mut out);
        }
    }
    out
}

/// The circles of every root, each line naming its root and level.
pub fn report(workspace: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for r in ROOTS {
        let g = graph(&workspace.join(r));
        for c in circles(&folders(&g)) {
            out.push(format!("{r} (folders): {c}"));
        }
        for c in circles(&g) {
            out.push(format!("{r} (files): {c}"));
        }
    }
    out
}

pub fn run() -> Result<()> {
    let found = report(&crate::workspace_root());
    for l in &found {
        println!("{l}");
    }
    if !found.is_empty() {
        bail!("{} module circle(s)", found.len());
    }
    println!("layers: no module circle in {} source roots", ROOTS.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_root_exists() {
        let ws = crate::workspace_root();
        for r in ROOTS {
            assert!(ws.join(r).is_dir(), "{r}");
        }
    }

    #[test]
    fn no_crate_has_a_module_circle_at_folder_or_file_level() {
        let found = report(&crate::workspace_root());
        assert!(found.is_empty(), "module circles:\n{}", found.join("\n"));
    }

    #[test]
    fn a_circle_is_found_through_paths_groups_super_and_reexports() {
        let dir = std::env::temp_dir().join(format!("xtask-layers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a")).unwrap();
        let w = |p: &str, s: &str| std::fs::write(dir.join(p), s).unwrap();
        w("lib.rs", "mod a; mod b; mod c; pub use c::Thing;\n");
        w(
            "a/mod.rs",
            "mod x;\nuse crate::{b::B, Thing}; // crate::c in a comment\n",
        );
        w("a/x.rs", "use super::super::b;\n");
        w("b.rs", "pub struct B; fn f() { crate::a::x::g() }\n");
        w(
            "c.rs",
            "pub struct Thing;\n#[cfg(test)]\nmod tests { use crate::a; }\n",
        );
        let g = graph(&dir);
        assert_eq!(g["a"], ["b", "c"].map(String::from).into());
        assert_eq!(g["a::x"], ["b"].map(String::from).into());
        assert_eq!(g["c"], BTreeSet::new());
        assert_eq!(circles(&folders(&g)), ["a -> b -> a"]);
        assert_eq!(circles(&g), ["b -> a::x -> b"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
