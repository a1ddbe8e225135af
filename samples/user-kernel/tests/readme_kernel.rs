//! README.md shows a CUDA kernel; `kernels/put_signal.cu` is that kernel, compiled by this
//! crate's build.rs (with nvcc, required in CI). The README's block must be the file, byte for
//! byte, so what a newcomer reads is what CI compiles.

use std::path::Path;

/// The line before the README's ```cuda block.
const MARKER: &str =
    "<!-- compiled in CI as samples/user-kernel/kernels/put_signal.cu: keep equal -->";

/// The body of the first fenced ```cuda block after `marker` in `md`.
fn block_after(md: &str, marker: &str) -> Option<String> {
    let rest = &md[md.find(marker)? + marker.len()..];
    let rest = &rest[rest.find("```cuda\n")? + "```cuda\n".len()..];
    let end = rest.find("\n```\n")?;
    Some(format!("{}\n", &rest[..end]))
}

#[test]
fn the_readme_kernel_is_the_compiled_file() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(dir.join("../../README.md")).unwrap();
    let file = std::fs::read_to_string(dir.join("kernels/put_signal.cu")).unwrap();
    let block = block_after(&readme, MARKER)
        .unwrap_or_else(|| panic!("README.md has no ```cuda block after {MARKER:?}"));
    assert!(
        block == file,
        "README.md's kernel differs from samples/user-kernel/kernels/put_signal.cu: copy the \
         file into the README (or the other way round)\n--- README\n{block}--- file\n{file}"
    );
}

#[test]
fn block_extraction() {
    let md = "x\n<!-- m -->\n```cuda\nint a;\n\nint b;\n```\nafter\n";
    assert_eq!(
        block_after(md, "<!-- m -->").as_deref(),
        Some("int a;\n\nint b;\n")
    );
    assert_eq!(block_after(md, "<!-- n -->"), None);
}
