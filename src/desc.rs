//! The layout of the descriptor of a QP that kernels drive, and its C twin.
//!
//! [`QpDesc`] is defined once, by the `descriptor!` macro below, which produces both the Rust
//! `#[repr(C)]` struct and the C declaration in `kernels/include/gpuverbs/desc.h` (through
//! [`c_header`]; a test fails when the committed header differs, and
//! `GPUVERBS_WRITE_HEADER=1 cargo test -p gpuverbs desc` rewrites it). The C side also
//! static-asserts every offset, so nvcc checks the same layout.
//!
//! The descriptor has one owner: it lives in GPU memory and its mutable counters (reserved,
//! ready, rung, retired, consumer indexes) are changed only by the device API.

use bytemuck::{Pod, Zeroable};

macro_rules! descriptor {
    (
        $(#[doc = $doc:literal])*
        struct $name:ident as $cname:literal {
            $( $(#[doc = $fdoc:literal])* $field:ident : $ty:ident, )*
        }
    ) => {
        $(#[doc = $doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
        pub struct $name {
            $( $(#[doc = $fdoc])* pub $field: $ty, )*
        }

        impl $name {
            /// The C type name.
            pub const C_NAME: &'static str = $cname;
            /// (field, C type, offset, doc) of every field, in order.
            pub const FIELDS: &'static [(&'static str, &'static str, usize, &'static str)] = &[
                $( (stringify!($field), c_type(stringify!($ty)), core::mem::offset_of!($name, $field),
                    concat!($($fdoc),*)), )*
            ];
        }
    };
}

const fn c_type(rust: &str) -> &'static str {
    match rust.as_bytes() {
        b"u64" => "uint64_t",
        b"u32" => "uint32_t",
        _ => panic!("descriptor fields are u32 or u64"),
    }
}

descriptor! {
    /// Everything a kernel needs to drive one RC QP and its CQs. Addresses are GPU-visible.
    struct QpDesc as "gpuverbs_qp" {
        /// The layout's version (`GPUVERBS_DESC_VERSION`), written by the host at export.
        version: u32,
        /// `sizeof(gpuverbs_qp)`, written by the host at export.
        size: u32,
        /// SQ ring (64-byte blocks).
        sq_ring: u64,
        /// RQ ring.
        rq_ring: u64,
        /// 8-byte doorbell record (word 0 receive, word 1 send; big-endian).
        dbrec: u64,
        /// Doorbell / BlueFlame register (two 256-byte halves); 0 in CPU-proxy mode.
        db_reg: u64,
        /// CPU-proxy producer word (u64, blocks, monotonic); 0 unless CPU-proxy mode.
        proxy_word: u64,
        /// Send CQ ring (64-byte CQEs).
        scq_ring: u64,
        /// Send CQ doorbell record (word 0: consumer index, big-endian).
        scq_dbrec: u64,
        /// Receive CQ ring.
        rcq_ring: u64,
        /// Receive CQ doorbell record.
        rcq_dbrec: u64,
        /// 8 registered bytes where atomics whose old value nobody wants land.
        scratch: u64,
        /// SQ size in blocks (power of two).
        sq_blocks: u32,
        /// RQ size in WQEs.
        rq_wqes: u32,
        /// Bytes per receive WQE.
        rq_stride: u32,
        /// QP number.
        qpn: u32,
        /// Send CQ entries.
        scq_ncqe: u32,
        /// Receive CQ entries.
        rcq_ncqe: u32,
        /// Doorbell mode: 0 GPU doorbell, 1 BlueFlame, 2 CPU proxy, 3 no DBR (DBR-less register), 4 no DBR emulated (register + proxy word; a host thread keeps the record).
        db_mode: u32,
        /// Where rings and doorbells live: 0 host memory (system-scope ordering), 1 GPU memory.
        ring_loc: u32,
        /// Largest inline payload.
        max_inline: u32,
        /// lkey of `scratch`.
        scratch_lkey: u32,
        /// Send CQ is collapsed (every CQE in slot 0).
        scq_collapsed: u32,
        /// Receive CQ is collapsed.
        rcq_collapsed: u32,
        /// Device API state: blocks reserved so far.
        sq_reserved: u64,
        /// Device API state: blocks published in order (written and visible).
        sq_ready: u64,
        /// Device API state: producer index last told to the device; `u64::MAX` while a
        /// thread rings a shared QP (it is the doorbell's lock too).
        sq_rung: u64,
        /// Device API state: blocks completed (retired through CQEs).
        sq_retired: u64,
        /// Device API state: end of the last signaled WQE published.
        sq_signaled_end: u64,
        /// Device API state: first block of the last WQE published.
        sq_last_start: u64,
        /// Device API state: send CQ consumer index.
        scq_ci: u64,
        /// Device API state: receive CQ consumer index.
        rcq_ci: u64,
        /// Device API state: receive WQEs posted.
        rq_posted: u64,
        /// Device API state: index of the first error CQE seen on the send CQ, plus 1 (0 none).
        sq_error: u64,
        /// Device API state: the error CQE's syndrome << 24 | vendor << 16 | wqe_counter, and
        /// in bits 63..32 the failed WQE's first block (on the 64-bit SQ counter) >> 16.
        sq_error_info: u64,
        /// Device API state: next BlueFlame half.
        bf_half: u32,
        /// Device API state: send CQ lock.
        scq_lock: u32,
        /// Device API state: 1 while one thread holds the QP's state in registers (`checkout`).
        checked_out: u32,
        /// Device API state: receive-posting lock.
        rq_lock: u32,
        /// Device API state: receive CQ lock.
        rcq_lock: u32,
        /// Device API state: 1 once a shared-mode publish gave up waiting for an earlier
        /// reservation (its thread never published): the send queue has a hole, and every
        /// later send-side call returns BROKEN. Reset the QP, connect it and export it again.
        sq_broken: u32,
        /// The completion-counter table: `sq_blocks` entries of 16 bytes in GPU memory, one
        /// per SQ block ({the counted WQE's first block + 1, the counter's address}), written
        /// by the counted calls and read by the send-CQ poll path.
        sq_counters: u64,
        /// Device API state: the CQEs the send CQ will have written (counted from its creation,
        /// modulo 2^24 as the CQ counts) once every published WQE has completed: what a
        /// companion QP's WAIT names to wait for a WQE (`put_counter` and its kin). Set at
        /// export to the send CQ's consumer index; every publish adds its signaled WQEs.
        sq_cqes: u64,
        /// The send CQ's number (what a companion's WAIT names).
        scq_cqn: u32,
        /// The receive CQ's number.
        rcq_cqn: u32,
    }
}

/// Bumped by hand when a field keeps its place but changes its meaning; any change of the
/// layout changes [`DESC_VERSION`] by itself.
const DESC_REVISION: u32 = 3;

/// The descriptor's version: a hash (FNV-1a) of [`DESC_REVISION`] and every field's name, C
/// type and offset, so headers and a library of different layouts never agree on it. The
/// header carries it as `GPUVERBS_DESC_VERSION`; [`crate::gpu::Gpu::export_qp_for`] refuses a
/// kernel's headers of another version, and every descriptor carries it in
/// [`QpDesc::version`].
pub const DESC_VERSION: u32 = {
    const fn mix(mut h: u32, bytes: &[u8]) -> u32 {
        let mut i = 0;
        while i < bytes.len() {
            h ^= bytes[i] as u32;
            h = h.wrapping_mul(0x0100_0193);
            i += 1;
        }
        h
    }
    let mut h = mix(0x811c_9dc5, &DESC_REVISION.to_le_bytes());
    let mut i = 0;
    while i < QpDesc::FIELDS.len() {
        let (name, ty, off, _) = QpDesc::FIELDS[i];
        h = mix(h, name.as_bytes());
        h = mix(h, ty.as_bytes());
        h = mix(h, &(off as u32).to_le_bytes());
        i += 1;
    }
    h
};

impl QpDesc {
    /// A descriptor with its version and size set and everything else zero.
    pub fn new() -> Self {
        Self {
            version: DESC_VERSION,
            size: core::mem::size_of::<Self>() as u32,
            ..Self::default()
        }
    }
}

/// Doorbell-mode codes in [`QpDesc::db_mode`] ([`verbs::DoorbellMode::code`]).
pub mod db_mode {
    use verbs::DoorbellMode;
    /// DBREC + 8-byte doorbell store.
    pub const GPU_DOORBELL: u32 = DoorbellMode::GpuDoorbell.code();
    /// DBREC + whole WQE into the BlueFlame register.
    pub const BLUEFLAME: u32 = DoorbellMode::BlueFlame.code();
    /// Producer word for a host proxy thread.
    pub const CPU_PROXY: u32 = DoorbellMode::CpuProxy.code();
    /// No send doorbell record: an 8-byte doorbell carrying the producer index at the
    /// DBR-less register (UAR + `prm::doorbell::DBR_LESS_OFFSET`).
    pub const NO_DBR: u32 = DoorbellMode::NoDbr.code();
    /// No doorbell record from the kernel, emulated (GPUNetIO's `NO_DBR_SW_EMULATED`): an
    /// 8-byte doorbell at the ordinary register and the producer index in the CPU-proxy word;
    /// a host proxy thread writes the record and rings again.
    pub const NO_DBR_EMULATED: u32 = DoorbellMode::NoDbrEmulated.code();
}

/// The committed C header's path, relative to the workspace root.
pub const HEADER_PATH: &str = "kernels/include/gpuverbs/desc.h";

/// The C declaration of [`QpDesc`], with offset checks.
pub fn c_header() -> String {
    let mut s = String::new();
    s.push_str("/* Generated from src/desc.rs by gpuverbs (the single source of the layout).\n");
    s.push_str(
        " * Do not edit: GPUVERBS_WRITE_HEADER=1 cargo test -p gpuverbs desc rewrites it. */\n",
    );
    s.push_str("#pragma once\n#include <stdint.h>\n#include <stddef.h>\n\n");
    s.push_str("#ifdef __cplusplus\n#define GPUVERBS_STATIC_ASSERT static_assert\n#else\n#define GPUVERBS_STATIC_ASSERT _Static_assert\n#endif\n\n");
    s.push_str(&format!("typedef struct {} {{\n", QpDesc::C_NAME));
    for (name, ty, _, doc) in QpDesc::FIELDS {
        s.push_str(&format!("    {ty} {name}; /* {} */\n", doc.trim()));
    }
    s.push_str(&format!("}} {};\n\n", QpDesc::C_NAME));
    s.push_str(&format!(
        "GPUVERBS_STATIC_ASSERT(sizeof({}) == {}, \"gpuverbs_qp size\");\n",
        QpDesc::C_NAME,
        core::mem::size_of::<QpDesc>()
    ));
    for (name, _, off, _) in QpDesc::FIELDS {
        s.push_str(&format!(
            "GPUVERBS_STATIC_ASSERT(offsetof({}, {name}) == {off}, \"{name}\");\n",
            QpDesc::C_NAME
        ));
    }
    s.push_str(&format!(
        "\n/* The layout's version; a descriptor carries it in `version`. */\n#define GPUVERBS_DESC_VERSION {DESC_VERSION:#010x}u\n"
    ));
    for (n, v) in [
        ("GPU_DOORBELL", db_mode::GPU_DOORBELL),
        ("BLUEFLAME", db_mode::BLUEFLAME),
        ("CPU_PROXY", db_mode::CPU_PROXY),
        ("NO_DBR", db_mode::NO_DBR),
        ("NO_DBR_EMULATED", db_mode::NO_DBR_EMULATED),
    ] {
        s.push_str(&format!("#define GPUVERBS_DB_{n} {v}u\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_header_matches_the_rust_layout() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(HEADER_PATH);
        let want = c_header();
        if std::env::var_os("GPUVERBS_WRITE_HEADER").is_some() {
            std::fs::write(&path, &want).unwrap();
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{HEADER_PATH} is stale: run GPUVERBS_WRITE_HEADER=1 cargo test -p gpuverbs desc"
        );
    }

    #[test]
    fn the_version_follows_the_layout() {
        assert_eq!(QpDesc::FIELDS[0].0, "version");
        assert_eq!(QpDesc::FIELDS[1].0, "size");
        // a pinned value: a change of any field's name, type or offset (or of the revision)
        // must change it, so this fails until it is updated on purpose
        assert_eq!(
            DESC_VERSION, PINNED,
            "the descriptor changed: update PINNED to {DESC_VERSION:#010x}"
        );
    }

    // revision 3: db_mode 4, no DBR emulated (revision 2: db_mode 3, no DBR)
    const PINNED: u32 = 0x4b30_a12d;

    #[test]
    fn fields_are_naturally_aligned_and_in_order() {
        let mut end = 0;
        for (name, ty, off, _) in QpDesc::FIELDS {
            let size = if *ty == "uint64_t" { 8 } else { 4 };
            assert_eq!(off % size, 0, "{name} misaligned");
            assert_eq!(*off, end, "{name} leaves a hole");
            end = off + size;
        }
        assert_eq!(end, core::mem::size_of::<QpDesc>());
    }
}
