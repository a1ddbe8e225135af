//! `docs/architecture.md` is the map of today's code: every path its tables name exists, and
//! every crate, and every top-level module of the crates it details (prm, verbs, softnic,
//! uverbs and the host API), is named in a table.

use std::collections::BTreeSet;
use std::path::Path;

/// The crates and top-level folders the map must name.
const FOLDERS: &[&str] = &[
    "src",
    "build.rs",
    "kernels/include/gpuverbs",
    "kernels/src",
    "samples",
    "samples/user-kernel",
    "python",
    "fuzz",
    "xtask",
    "docs",
    "crates/uverbs/preload",
];

/// The crates whose top-level modules the map must name, one per row.
const DETAILED: &[&str] = &[
    "crates/prm/src",
    "crates/verbs/src",
    "crates/softnic/src",
    "crates/uverbs/src",
    "src",
];

/// The first cell of every table row that is a code span: the paths the map names.
fn named(doc: &str) -> BTreeSet<String> {
    doc.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(|p| p.trim_end_matches('/').to_string())
        .collect()
}

#[test]
fn the_map_names_what_exists_and_all_of_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let names = named(&doc);
    assert!(names.len() > 40, "{names:?}");
    let missing: Vec<_> = names.iter().filter(|p| !root.join(p).exists()).collect();
    assert!(
        missing.is_empty(),
        "the map names paths that do not exist: {missing:?}"
    );
    let mut unnamed = Vec::new();
    for e in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
        let p = format!("crates/{}", e.file_name().to_string_lossy());
        if e.path().join("Cargo.toml").exists() && !names.contains(&p) {
            unnamed.push(p);
        }
    }
    unnamed.extend(
        FOLDERS
            .iter()
            .filter(|f| !names.contains(**f))
            .map(|f| f.to_string()),
    );
    for dir in DETAILED {
        for e in std::fs::read_dir(root.join(dir)).unwrap().flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            if matches!(file.as_str(), "lib.rs" | "main.rs") {
                continue;
            }
            let stem = file.trim_end_matches(".rs");
            // a module is a file, a folder, or both (`mem.rs` with `mem/`)
            let known = [format!("{dir}/{stem}.rs"), format!("{dir}/{stem}")]
                .iter()
                .any(|p| names.contains(p));
            if !known && (file.ends_with(".rs") || e.path().is_dir()) {
                unnamed.push(format!("{dir}/{file}"));
            }
        }
    }
    assert!(unnamed.is_empty(), "not on the map: {unnamed:?}");
}
