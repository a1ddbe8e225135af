//! Embeds the CUDA device API's headers (`kernels/include/gpuverbs/`) in the extension, so
//! that `gpuverbs.include_dir()` can hand them to a kernel build wherever the package is
//! installed.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels/include/gpuverbs");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("kernels/include/gpuverbs")
        .map(|e| {
            e.expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".cuh") || n.ends_with(".h"))
        .collect();
    names.sort();
    let mut out =
        String::from("/// The device API's headers: (path under the include folder, text).\n");
    out.push_str("pub(crate) const HEADERS: &[(&str, &str)] = &[\n");
    for n in &names {
        let path = dir.join(n).canonicalize().expect("a header");
        println!("cargo:rerun-if-changed={}", path.display());
        writeln!(
            out,
            "    (\"gpuverbs/{n}\", include_str!({:?})),",
            path.display().to_string()
        )
        .expect("writing to a string");
    }
    out.push_str("];\n");
    let dest = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("headers.rs");
    std::fs::write(dest, out).expect("writing headers.rs");
}
