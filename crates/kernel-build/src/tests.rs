//! Unit tests: nvcc discovery order (fake nvcc scripts in temp dirs), the unity file, and a
//! whole build through a fake nvcc.

use super::*;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A temporary directory, removed on drop. Tests holding one run one at a time: a script being
/// written while another test forks nvcc could be inherited open for writing, and exec'ing it
/// would then fail with ETXTBSY.
struct TempDir(PathBuf, #[allow(dead_code)] MutexGuard<'static, ()>);

impl TempDir {
    fn new(tag: &str) -> Self {
        static LOCK: Mutex<()> = Mutex::new(());
        let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        static N: AtomicU32 = AtomicU32::new(0);
        let p = env::temp_dir().join(format!(
            "gpuverbs-kernel-build-test-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        Self(p, guard)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Writes an executable script at `path` (creating parents).
fn script(path: &Path, body: &str) -> PathBuf {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
    }
    path.to_path_buf()
}

fn fake_nvcc(path: &Path) -> PathBuf {
    script(path, "exit 0")
}

fn venv_nvcc(venv: &Path, python: &str) -> PathBuf {
    venv.join("lib")
        .join(python)
        .join("site-packages/nvidia/cu13/bin/nvcc")
}

/// Every rule has an nvcc; the fixture removes them one by one.
struct Fixture {
    _dir: TempDir,
    nvcc_env: PathBuf,
    home: PathBuf,
    cuda_path: PathBuf,
    path_dir: PathBuf,
    venv_a: PathBuf,
    venv_b: PathBuf,
    prefix: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let dir = TempDir::new("order");
        let d = dir.path().to_path_buf();
        let f = Self {
            nvcc_env: fake_nvcc(&d.join("explicit/my-nvcc")),
            home: d.join("home"),
            cuda_path: d.join("cudapath"),
            path_dir: d.join("pathdir"),
            venv_a: d.join("a/.cuda"),
            venv_b: d.join("b/.cuda"),
            prefix: d.join("usr-local-cuda"),
            _dir: dir,
        };
        fake_nvcc(&f.home.join("bin/nvcc"));
        fake_nvcc(&f.cuda_path.join("bin/nvcc"));
        fake_nvcc(&f.path_dir.join("nvcc"));
        fake_nvcc(&venv_nvcc(&f.venv_a, "python3.11"));
        fake_nvcc(&venv_nvcc(&f.venv_b, "python3.11"));
        fake_nvcc(&f.prefix.join("bin/nvcc"));
        f
    }

    fn search(&self) -> NvccSearch {
        let empty = self._dir.path().join("empty");
        fs::create_dir_all(&empty).unwrap();
        NvccSearch {
            nvcc: Some(self.nvcc_env.clone().into()),
            cuda_home: Some(self.home.clone().into()),
            cuda_path: Some(self.cuda_path.clone().into()),
            path: Some(env::join_paths([empty, self.path_dir.clone()]).unwrap()),
            venvs: vec![self.venv_a.clone(), self.venv_b.clone()],
            prefixes: vec![self.prefix.clone()],
        }
    }
}

fn found(s: &NvccSearch) -> Nvcc {
    s.find().expect("no error").expect("found")
}

#[test]
fn discovery_order() {
    let f = Fixture::new();
    let mut s = f.search();

    assert_eq!(
        found(&s),
        Nvcc {
            path: f.nvcc_env.clone(),
            origin: NvccOrigin::NvccEnv
        }
    );

    // An empty NVCC counts as unset.
    s.nvcc = Some(OsString::new());
    assert_eq!(found(&s).origin, NvccOrigin::CudaHome);
    assert_eq!(found(&s).path, f.home.join("bin/nvcc"));

    // CUDA_HOME set but without nvcc: skipped.
    s.cuda_home = Some(f._dir.path().join("nowhere").into());
    assert_eq!(found(&s).origin, NvccOrigin::CudaPath);
    assert_eq!(found(&s).path, f.cuda_path.join("bin/nvcc"));

    s.cuda_path = None;
    assert_eq!(found(&s).origin, NvccOrigin::Path);
    assert_eq!(found(&s).path, f.path_dir.join("nvcc"));

    s.path = None;
    assert_eq!(found(&s).origin, NvccOrigin::Venv(f.venv_a.clone()));
    assert_eq!(found(&s).path, venv_nvcc(&f.venv_a, "python3.11"));

    fs::remove_file(venv_nvcc(&f.venv_a, "python3.11")).unwrap();
    assert_eq!(found(&s).origin, NvccOrigin::Venv(f.venv_b.clone()));

    s.venvs.clear();
    assert_eq!(found(&s).origin, NvccOrigin::System(f.prefix.clone()));
    assert_eq!(found(&s).path, f.prefix.join("bin/nvcc"));

    s.prefixes.clear();
    let searched = s.find().unwrap().unwrap_err();
    assert_eq!(
        searched,
        format!(
            "$NVCC (unset), $CUDA_HOME/bin/nvcc = {}/nowhere/bin/nvcc (missing), $CUDA_PATH \
             (unset), PATH",
            f._dir.path().display()
        )
    );
}

#[test]
fn not_found_lists_everything_searched() {
    let dir = TempDir::new("none");
    let venv = dir.path().join(".cuda");
    let prefix = dir.path().join("cuda");
    let s = NvccSearch {
        nvcc: None,
        cuda_home: None,
        cuda_path: None,
        path: Some(dir.path().as_os_str().to_owned()),
        venvs: vec![venv.clone()],
        prefixes: vec![prefix.clone()],
    };
    assert_eq!(
        s.find().unwrap().unwrap_err(),
        format!(
            "$NVCC (unset), $CUDA_HOME (unset), $CUDA_PATH (unset), PATH, \
             {}/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc, {}/bin/nvcc",
            venv.display(),
            prefix.display()
        )
    );
}

#[test]
fn nvcc_env_must_be_executable() {
    let f = Fixture::new();
    let mut s = f.search();
    let missing = f._dir.path().join("missing/nvcc");
    s.nvcc = Some(missing.clone().into());
    match s.find() {
        Err(BuildError::NvccInvalid { value }) => assert_eq!(value, missing),
        other => panic!("expected NvccInvalid, got {other:?}"),
    }
    // A bare name is looked up on PATH.
    s.nvcc = Some("nvcc".into());
    assert_eq!(
        found(&s),
        Nvcc {
            path: f.path_dir.join("nvcc"),
            origin: NvccOrigin::NvccEnv
        }
    );
    s.path = None;
    assert!(matches!(s.find(), Err(BuildError::NvccInvalid { .. })));
}

#[cfg(unix)]
#[test]
fn non_executable_files_are_skipped() {
    let f = Fixture::new();
    let mut s = f.search();
    s.nvcc = None;
    s.cuda_home = None;
    s.cuda_path = None;
    fs::write(f.path_dir.join("nvcc"), "not executable").unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(f.path_dir.join("nvcc"), fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(found(&s).origin, NvccOrigin::Venv(f.venv_a.clone()));
}

#[test]
fn venv_prefers_the_newest_python() {
    let dir = TempDir::new("venv");
    let venv = dir.path().join(".cuda");
    for py in ["python3.9", "python3.12", "python3.10"] {
        fake_nvcc(&venv_nvcc(&venv, py));
    }
    // Not a Python directory: ignored.
    fake_nvcc(&venv_nvcc(&venv, "perl5"));
    assert_eq!(find_venv_nvcc(&venv), Some(venv_nvcc(&venv, "python3.12")));
    fs::remove_file(venv_nvcc(&venv, "python3.12")).unwrap();
    assert_eq!(find_venv_nvcc(&venv), Some(venv_nvcc(&venv, "python3.10")));
    assert_eq!(find_venv_nvcc(&dir.path().join("absent")), None);
}

#[test]
fn default_venvs_nearest_first_then_the_gpuverbs_tree() {
    let dir = TempDir::new("venvs");
    let root = dir.path();
    let krate = root.join("ws/samples/user");
    fs::create_dir_all(&krate).unwrap();
    fs::create_dir_all(root.join("ws/.cuda")).unwrap();
    fs::create_dir_all(root.join("ws/samples/user/.cuda")).unwrap();
    let tree = root.join("gpuverbs");
    assert_eq!(
        default_venvs(&krate, &tree),
        vec![
            root.join("ws/samples/user/.cuda"),
            root.join("ws/.cuda"),
            tree.join(".cuda")
        ]
    );
    // The tree's venv is not listed twice.
    assert_eq!(
        default_venvs(&krate, &root.join("ws")),
        vec![root.join("ws/samples/user/.cuda"), root.join("ws/.cuda")]
    );
}

#[test]
fn unity_file_includes_every_source_in_order() {
    let sources = [
        PathBuf::from("/src/a.cu"),
        PathBuf::from("/src/dir with \"quotes\"/b.cu"),
        PathBuf::from(r"C:\k\c.cu"),
    ];
    let u = unity_source("mykernels", &sources);
    assert_eq!(
        u,
        "// Generated by gpuverbs-kernel-build for `mykernels`: every kernel source, one \
         translation unit.\n\
         #include \"/src/a.cu\"\n\
         #include \"/src/dir with \\\"quotes\\\"/b.cu\"\n\
         #include \"C:\\\\k\\\\c.cu\"\n"
    );
    assert_eq!(
        unity_source("x\ny", &[]),
        "// Generated by gpuverbs-kernel-build for `x y`: every kernel source, one translation \
         unit.\n"
    );
}

#[test]
fn gpuverbs_headers_are_in_the_tree() {
    let inc = gpuverbs_include_dir();
    for h in ["gpuverbs.cuh", "qp.cuh", "desc.h"] {
        assert!(inc.join("gpuverbs").join(h).is_file(), "{h} in {inc:?}");
    }
    assert!(gpuverbs_root().join("Cargo.toml").is_file());
    assert!(!gpuverbs_root().to_string_lossy().contains(".."));
}

/// A fake nvcc that records its arguments and the unity file, and writes a fatbin header.
#[cfg(unix)]
fn fatbin_nvcc(dir: &Path) -> PathBuf {
    script(
        &dir.join("bin/nvcc"),
        &format!(
            r#"echo "$@" > "{log}/args"
out=""
prev=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  prev="$a"
  last="$a"
done
cp "$last" "{log}/unity.cu"
echo "warning: fake nvcc" >&2
printf '\120\355\125\272\0\0\0\0\0\0\0\0\0\0\0\0' > "$out""#,
            log = dir.display()
        ),
    )
}

#[cfg(unix)]
#[test]
fn builds_through_nvcc() {
    let dir = TempDir::new("build");
    let d = dir.path();
    let nvcc = fatbin_nvcc(d);
    let krate = d.join("crate");
    script(&krate.join("kernels/b.cu"), "");
    script(&krate.join("kernels/a.cu"), "");
    script(&krate.join("kernels/sub/not_a_source.cu"), "");
    script(&krate.join("kernels/helper.cuh"), "");
    script(&krate.join("extra.cu"), "");
    let out = d.join("out");
    fs::create_dir_all(&out).unwrap();

    let k = Kernels::new()
        .manifest_dir(&krate)
        .out_dir(&out)
        .cargo_directives(false)
        .nvcc(&nvcc)
        .source("extra.cu")
        .sources_from_dir("kernels")
        .include("kernels")
        .include_gpuverbs()
        .nvcc_arg("-DUSER=1")
        .out_name("mine");
    assert_eq!(k.fatbin_path().unwrap(), out.join("mine.fatbin"));
    match k.compile().unwrap() {
        Outcome::Built {
            fatbin,
            command,
            nvcc: found,
        } => {
            assert_eq!(fatbin, out.join("mine.fatbin"));
            assert_eq!(found.origin, NvccOrigin::Explicit);
            assert!(command.contains("-DUSER=1"), "{command}");
        }
        other => panic!("{other:?}"),
    }
    let fatbin = fs::read(out.join("mine.fatbin")).unwrap();
    assert_eq!(&fatbin[..4], &FATBIN_MAGIC.to_le_bytes());
    assert!(!out.join("mine.fatbin.tmp").exists());

    let unity = fs::read_to_string(d.join("unity.cu")).unwrap();
    assert_eq!(
        unity,
        unity_source(
            "mine",
            &[
                krate.join("extra.cu"),
                krate.join("kernels/a.cu"),
                krate.join("kernels/b.cu")
            ]
        )
    );
    assert_eq!(
        fs::read_to_string(out.join("mine-unity.cu")).unwrap(),
        unity
    );
    let args = fs::read_to_string(d.join("args")).unwrap();
    let expected = format!(
        "{} -DUSER=1 -I {} -I {} -o {} {}\n",
        NVCC_FLAGS.join(" "),
        krate.join("kernels").display(),
        gpuverbs_include_dir().display(),
        out.join("mine.fatbin.tmp").display(),
        out.join("mine-unity.cu").display()
    );
    assert_eq!(args, expected);
    assert_eq!(k.build().unwrap(), Some(out.join("mine.fatbin")));
}

#[cfg(unix)]
#[test]
fn nvcc_failures_are_errors_with_output() {
    let dir = TempDir::new("fail");
    let d = dir.path();
    script(&d.join("k/a.cu"), "");
    let k = Kernels::new()
        .manifest_dir(d)
        .out_dir(d)
        .cargo_directives(false)
        .sources_from_dir("k");

    let failing = script(
        &d.join("bin/failing"),
        "echo 'a.cu(3): error: oops' >&2; exit 2",
    );
    match k.clone().nvcc(&failing).build() {
        Err(e @ BuildError::NvccFailed { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("a.cu(3): error: oops"), "{msg}");
            assert!(msg.contains("exit status: 2"), "{msg}");
        }
        other => panic!("{other:?}"),
    }

    let garbage = script(
        &d.join("bin/garbage"),
        r#"for a in "$@"; do if [ "$p" = "-o" ]; then echo hello > "$a"; fi; p="$a"; done"#,
    );
    assert!(matches!(
        k.clone().nvcc(&garbage).build(),
        Err(BuildError::NotAFatbin { len: 6, .. })
    ));

    assert!(matches!(
        k.clone().nvcc(d.join("bin/absent")).build(),
        Err(BuildError::NvccInvalid { .. })
    ));
}

#[cfg(unix)]
#[test]
fn missing_inputs_are_reported() {
    let dir = TempDir::new("inputs");
    let d = dir.path();
    let nvcc = fatbin_nvcc(d);
    let base = Kernels::new()
        .manifest_dir(d)
        .out_dir(d)
        .cargo_directives(false)
        .nvcc(&nvcc);

    // No sources: an empty fatbin, NoSources from compile, an error from build.
    fs::write(d.join("x.fatbin"), b"stale").unwrap();
    let k = base.clone().sources_from_dir("nothing-here").out_name("x");
    assert_eq!(
        k.compile().unwrap(),
        Outcome::NoSources {
            dirs: vec![d.join("nothing-here")]
        }
    );
    assert_eq!(fs::read(d.join("x.fatbin")).unwrap(), b"");
    assert!(matches!(k.build(), Err(BuildError::NoSources { .. })));

    assert!(matches!(
        base.clone().source("absent.cu").build(),
        Err(BuildError::SourceMissing { .. })
    ));
    for bad in ["", "a/b", ".."] {
        assert!(matches!(
            base.clone().out_name(bad).build(),
            Err(BuildError::InvalidOutName { .. })
        ));
    }
}

#[test]
fn no_nvcc_is_a_warning_unless_required() {
    let dir = TempDir::new("nonvcc");
    let d = dir.path();
    script(&d.join("k/a.cu"), "");
    fs::write(d.join("x.fatbin"), b"stale").unwrap();
    let nowhere = NvccSearch {
        venvs: vec![d.join(".cuda")],
        ..NvccSearch::default()
    };
    let k = Kernels::new()
        .manifest_dir(d)
        .out_dir(d)
        .cargo_directives(false)
        .sources_from_dir("k")
        .out_name("x")
        .nvcc_search(nowhere);
    assert_eq!(
        k.compile().unwrap(),
        Outcome::NvccNotFound {
            searched: format!(
                "$NVCC (unset), $CUDA_HOME (unset), $CUDA_PATH (unset), PATH, \
                 {}/.cuda/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc",
                d.display()
            )
        }
    );
    assert_eq!(k.clone().require_nvcc(false).build().unwrap(), None);
    // The fatbin exists (for include_bytes!) and is empty.
    assert_eq!(fs::read(d.join("x.fatbin")).unwrap(), b"");
    match k.require_nvcc(true).build() {
        Err(e @ BuildError::NvccRequired { .. }) => {
            assert!(e.to_string().contains(REQUIRE_NVCC_ENV), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn env_is_needed_without_overrides() {
    // Unit tests do not run under a build script: OUT_DIR is unset.
    if env::var_os("OUT_DIR").is_none() {
        assert!(matches!(
            Kernels::new().fatbin_path(),
            Err(BuildError::Env { var: "OUT_DIR" })
        ));
    }
}
