//! A small reader for CUDA fatbin containers (what `nvcc -fatbin` writes and `cuModuleLoadData`
//! accepts), enough to list which code a fatbin carries: `(kind, sm_arch)` per entry.
//!
//! # Layout (little-endian)
//!
//! A fatbin is one or more containers back to back. Each container:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `0xBA55ED50` |
//! | 4 | 2 | version (1) |
//! | 6 | 2 | header size (16) |
//! | 8 | 8 | fat size: bytes of entries that follow the header |
//!
//! The container header (magic, version, header size, fat size, PTX = 1 / ELF = 2 kinds) is the one
//! NVIDIA's `fatbinary.h` declared in older toolkits. The entry header below is not publicly
//! documented; its layout is what nvcc 13.0 writes (checked byte by byte against `nvcc -fatbin`
//! output, see the tests) and matches the community descriptions of the format. Each entry:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 2 | kind: 1 = PTX, 2 = ELF (cubin), 8 = NVVM IR |
//! | 2 | 2 | entry version (0x0101) |
//! | 4 | 4 | entry header size: 64 plus variable data (object name, options), padded to 8 |
//! | 8 | 8 | payload size (padded to 8 bytes); the payload follows the entry header |
//! | 16 | 4 | compressed size (0 when the payload is stored uncompressed) |
//! | 20 | 4 | offset (in the entry header) of an options record `{u32 offset, u32 length}`, or 0 |
//! | 24 | 2 | code version minor (PTX ISA minor, or cubin ABI minor) |
//! | 26 | 2 | code version major |
//! | 28 | 4 | arch: sm number, e.g. 90 for `sm_90` (ELF) or `compute_90` (PTX) |
//! | 32 | 4 | object name offset (in the entry header), or 0 |
//! | 36 | 4 | object name length |
//! | 40 | 8 | flags: 0x1 64-bit, 0x10 Linux host, 0x2000 LZ4-compressed, 0x8000 zstd-compressed |
//! | 48 | 8 | (reserved) |
//! | 56 | 8 | uncompressed payload size (0 when not compressed) |
//!
//! The next entry starts at `entry + header size + payload size`; a container ends exactly after its
//! last entry (no terminator). nvcc 13.0 stores the source name (with `-lineinfo`) and the PTX JIT
//! options (e.g. ` --generate-line-info `) inside the variable part of the entry header.

use std::fmt;

/// Magic number of a fatbin container header.
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;
/// Size of the container header.
pub const CONTAINER_HEADER_SIZE: usize = 16;
/// Size of the fixed part of an entry header (an entry's header may be longer).
pub const ENTRY_HEADER_MIN_SIZE: usize = 64;

/// Entry flag: the code is for a 64-bit host.
pub const FLAG_64BIT: u64 = 0x1;
/// Entry flag: the host is Linux.
pub const FLAG_HOST_LINUX: u64 = 0x10;
/// Entry flag: the payload is LZ4-compressed (older toolkits).
pub const FLAG_COMPRESSED_LZ4: u64 = 0x2000;
/// Entry flag: the payload is zstd-compressed (CUDA 12.8+ / 13).
pub const FLAG_COMPRESSED_ZSTD: u64 = 0x8000;

/// What an entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntryKind {
    /// PTX text for a virtual architecture (`compute_NN`), JIT-compiled by the driver.
    Ptx,
    /// An ELF cubin: SASS for a real architecture (`sm_NN`).
    Elf,
    /// NVVM IR (LTO).
    NvvmIr,
    /// A kind this reader does not know.
    Other(u16),
}

impl EntryKind {
    /// Decodes the entry header's kind field.
    pub fn from_raw(raw: u16) -> Self {
        match raw {
            1 => EntryKind::Ptx,
            2 => EntryKind::Elf,
            8 => EntryKind::NvvmIr,
            other => EntryKind::Other(other),
        }
    }

    /// The entry header's kind field.
    pub fn raw(self) -> u16 {
        match self {
            EntryKind::Ptx => 1,
            EntryKind::Elf => 2,
            EntryKind::NvvmIr => 8,
            EntryKind::Other(raw) => raw,
        }
    }
}

/// An entry's target: its kind and architecture. Displays as `sm_90` (ELF), `compute_90` (PTX),
/// `nvvm_90`, or `kind0x10_90`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// What the entry holds.
    pub kind: EntryKind,
    /// The sm number (e.g. 90).
    pub sm_arch: u32,
}

impl Target {
    /// SASS for `sm_<arch>`.
    pub const fn elf(sm_arch: u32) -> Self {
        Target {
            kind: EntryKind::Elf,
            sm_arch,
        }
    }

    /// PTX for `compute_<arch>`.
    pub const fn ptx(sm_arch: u32) -> Self {
        Target {
            kind: EntryKind::Ptx,
            sm_arch,
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            EntryKind::Elf => write!(f, "sm_{}", self.sm_arch),
            EntryKind::Ptx => write!(f, "compute_{}", self.sm_arch),
            EntryKind::NvvmIr => write!(f, "nvvm_{}", self.sm_arch),
            EntryKind::Other(raw) => write!(f, "kind{raw:#x}_{}", self.sm_arch),
        }
    }
}

/// One entry of a fatbin container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry<'a> {
    /// What the entry holds.
    pub kind: EntryKind,
    /// The sm number: `sm_NN` for ELF, `compute_NN` for PTX.
    pub sm_arch: u32,
    /// Code version `(major, minor)`: the PTX ISA version for PTX (e.g. 9.0), the cubin ABI version
    /// for ELF.
    pub code_version: (u16, u16),
    /// Raw flags (see the `FLAG_*` constants).
    pub flags: u64,
    /// Offset of this entry's header from the start of the parsed buffer.
    pub offset: usize,
    /// Size of the entry header.
    pub header_size: u32,
    /// Compressed payload size, when the payload is compressed.
    pub compressed_size: Option<u32>,
    /// Uncompressed payload size as recorded (0 when the payload is stored uncompressed).
    pub uncompressed_size: u64,
    /// The whole entry header (`header_size` bytes, fixed part included).
    pub header: &'a [u8],
    /// The payload as stored (compressed or not), including its padding to 8 bytes.
    pub payload: &'a [u8],
}

impl<'a> Entry<'a> {
    /// The entry's `(kind, sm_arch)`.
    pub fn target(&self) -> Target {
        Target {
            kind: self.kind,
            sm_arch: self.sm_arch,
        }
    }

    /// Whether the payload is stored compressed (the driver decompresses it when loading).
    pub fn is_compressed(&self) -> bool {
        self.compressed_size.is_some()
            || self.flags & (FLAG_COMPRESSED_LZ4 | FLAG_COMPRESSED_ZSTD) != 0
    }

    /// The object (source) name recorded in the entry header, if any (nvcc records it with
    /// `-lineinfo` / `-G`). `None` when absent, out of bounds, or not UTF-8.
    pub fn object_name(&self) -> Option<&'a str> {
        let offset = le_u32(self.header, 32) as usize;
        let len = le_u32(self.header, 36) as usize;
        header_str(self.header, offset, len)
    }

    /// The JIT compile options recorded for a PTX entry (e.g. ` --generate-line-info `), if any.
    pub fn options(&self) -> Option<&'a str> {
        let record = le_u32(self.header, 20) as usize;
        if record == 0 {
            return None;
        }
        let pair = self.header.get(record..record.checked_add(8)?)?;
        header_str(
            self.header,
            le_u32(pair, 0) as usize,
            le_u32(pair, 4) as usize,
        )
    }
}

/// A string stored at `[offset, offset + len)` of an entry header; trailing NULs are dropped.
fn header_str(header: &[u8], offset: usize, len: usize) -> Option<&str> {
    if offset == 0 || len == 0 {
        return None;
    }
    let bytes = header.get(offset..offset.checked_add(len)?)?;
    let bytes = bytes.split(|&b| b == 0).next().unwrap_or(bytes);
    std::str::from_utf8(bytes).ok().filter(|s| !s.is_empty())
}

/// A parsed fatbin: the entries of all its containers, in file order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fatbin<'a> {
    /// Number of containers.
    pub containers: usize,
    /// All entries, in file order.
    pub entries: Vec<Entry<'a>>,
}

impl Fatbin<'_> {
    /// `(kind, sm_arch)` of every entry, in file order.
    pub fn targets(&self) -> Vec<Target> {
        self.entries.iter().map(Entry::target).collect()
    }

    /// Whether some entry has this target.
    pub fn contains(&self, target: Target) -> bool {
        self.entries.iter().any(|e| e.target() == target)
    }
}

/// Why a buffer is not a well-formed fatbin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FatbinError {
    /// The buffer is empty.
    #[error("fatbin is empty")]
    Empty,
    /// A header or payload runs past the end of the buffer (or of its container).
    #[error(
        "fatbin truncated: {what} at offset {offset} needs {needed} bytes, only {available} left"
    )]
    Truncated {
        /// Which structure.
        what: &'static str,
        /// Where it starts.
        offset: usize,
        /// Bytes it needs.
        needed: u64,
        /// Bytes available.
        available: usize,
    },
    /// A container does not start with [`FATBIN_MAGIC`].
    #[error("bad fatbin magic {found:#010x} at offset {offset} (expected {FATBIN_MAGIC:#010x})")]
    BadMagic {
        /// Where the container starts.
        offset: usize,
        /// What was there.
        found: u32,
    },
    /// A container header or entry header declares an impossible size.
    #[error("bad {what} header size {size} at offset {offset}")]
    BadHeaderSize {
        /// `container` or `entry`.
        what: &'static str,
        /// Where the header starts.
        offset: usize,
        /// The declared size.
        size: u64,
    },
}

/// Parses a fatbin (one or more containers back to back) and lists its entries.
///
/// The reader checks every size against the buffer (it never reads out of bounds or panics on
/// malformed input) but does not validate or decompress payloads.
pub fn parse(bytes: &[u8]) -> Result<Fatbin<'_>, FatbinError> {
    if bytes.is_empty() {
        return Err(FatbinError::Empty);
    }
    let mut entries = Vec::new();
    let mut containers = 0;
    let mut pos = 0;
    while pos < bytes.len() {
        pos = parse_container(bytes, pos, &mut entries)?;
        containers += 1;
    }
    Ok(Fatbin {
        containers,
        entries,
    })
}

/// Parses the container at `start`; returns where the next one starts.
fn parse_container<'a>(
    bytes: &'a [u8],
    start: usize,
    entries: &mut Vec<Entry<'a>>,
) -> Result<usize, FatbinError> {
    let header = slice(
        bytes,
        start,
        CONTAINER_HEADER_SIZE as u64,
        "container header",
    )?;
    let magic = le_u32(header, 0);
    if magic != FATBIN_MAGIC {
        return Err(FatbinError::BadMagic {
            offset: start,
            found: magic,
        });
    }
    let header_size = u64::from(le_u16(header, 6));
    let fat_size = le_u64(header, 8);
    if header_size < CONTAINER_HEADER_SIZE as u64 {
        return Err(FatbinError::BadHeaderSize {
            what: "container",
            offset: start,
            size: header_size,
        });
    }
    let body_len = header_size
        .checked_add(fat_size)
        .ok_or(FatbinError::BadHeaderSize {
            what: "container",
            offset: start,
            size: fat_size,
        })?;
    let container = slice(bytes, start, body_len, "container")?;
    // `container.len() == header_size + fat_size`, so both fit in usize.
    let end = container.len();
    let mut pos = header_size as usize;
    while pos < end {
        let fixed = slice(container, pos, ENTRY_HEADER_MIN_SIZE as u64, "entry header")
            .map_err(|e| rebase(e, start))?;
        let entry_header_size = le_u32(fixed, 4);
        if (entry_header_size as usize) < ENTRY_HEADER_MIN_SIZE {
            return Err(FatbinError::BadHeaderSize {
                what: "entry",
                offset: start + pos,
                size: entry_header_size.into(),
            });
        }
        let header = slice(container, pos, entry_header_size.into(), "entry header")
            .map_err(|e| rebase(e, start))?;
        let payload_offset = pos + entry_header_size as usize;
        let payload_size = le_u64(fixed, 8);
        let payload = slice(container, payload_offset, payload_size, "entry payload")
            .map_err(|e| rebase(e, start))?;
        let compressed_size = le_u32(fixed, 16);
        entries.push(Entry {
            kind: EntryKind::from_raw(le_u16(fixed, 0)),
            sm_arch: le_u32(fixed, 28),
            code_version: (le_u16(fixed, 26), le_u16(fixed, 24)),
            flags: le_u64(fixed, 40),
            offset: start + pos,
            header_size: entry_header_size,
            compressed_size: (compressed_size != 0).then_some(compressed_size),
            uncompressed_size: le_u64(fixed, 56),
            header,
            payload,
        });
        pos = payload_offset + payload.len();
    }
    Ok(start + end)
}

/// `bytes[offset..offset + len]`, or `Truncated`.
fn slice<'a>(
    bytes: &'a [u8],
    offset: usize,
    len: u64,
    what: &'static str,
) -> Result<&'a [u8], FatbinError> {
    let available = bytes.len().saturating_sub(offset);
    match usize::try_from(len) {
        Ok(n) if n <= available => Ok(&bytes[offset..offset + n]),
        _ => Err(FatbinError::Truncated {
            what,
            offset,
            needed: len,
            available,
        }),
    }
}

/// Makes an error's offset relative to the whole buffer instead of the container.
fn rebase(e: FatbinError, base: usize) -> FatbinError {
    match e {
        FatbinError::Truncated {
            what,
            offset,
            needed,
            available,
        } => FatbinError::Truncated {
            what,
            offset: offset + base,
            needed,
            available,
        },
        other => other,
    }
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds one entry: a 64-byte header (or `header_size` bytes) then the payload padded to 8.
    fn entry(
        kind: u16,
        arch: u32,
        header_size: u32,
        payload: &[u8],
        compressed: Option<(u32, u64)>,
    ) -> Vec<u8> {
        let padded = payload.len().div_ceil(8) * 8;
        let mut e = Vec::new();
        e.extend_from_slice(&kind.to_le_bytes());
        e.extend_from_slice(&0x0101u16.to_le_bytes());
        e.extend_from_slice(&header_size.to_le_bytes());
        e.extend_from_slice(&(padded as u64).to_le_bytes());
        e.extend_from_slice(&compressed.map_or(0, |c| c.0).to_le_bytes()); // 16: compressed size
        e.extend_from_slice(&0u32.to_le_bytes()); // 20
        e.extend_from_slice(&8u16.to_le_bytes()); // 24: minor
        e.extend_from_slice(&1u16.to_le_bytes()); // 26: major
        e.extend_from_slice(&arch.to_le_bytes()); // 28
        e.extend_from_slice(&0u32.to_le_bytes()); // 32: name offset
        e.extend_from_slice(&0u32.to_le_bytes()); // 36: name length
        let flags = FLAG_64BIT
            | FLAG_HOST_LINUX
            | if compressed.is_some() {
                FLAG_COMPRESSED_ZSTD
            } else {
                0
            };
        e.extend_from_slice(&flags.to_le_bytes()); // 40
        e.extend_from_slice(&0u64.to_le_bytes()); // 48
        e.extend_from_slice(&compressed.map_or(0, |c| c.1).to_le_bytes()); // 56: uncompressed size
        e.resize(header_size as usize, 0);
        e.extend_from_slice(payload);
        e.resize(header_size as usize + padded, 0);
        e
    }

    fn container(entries: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = entries.concat();
        let mut c = Vec::new();
        c.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        c.extend_from_slice(&1u16.to_le_bytes());
        c.extend_from_slice(&16u16.to_le_bytes());
        c.extend_from_slice(&(body.len() as u64).to_le_bytes());
        c.extend_from_slice(&body);
        c
    }

    fn sample() -> Vec<u8> {
        container(&[
            entry(2, 80, 64, b"\x7fELF-sm80-cubin", None),
            entry(2, 90, 64, b"\x7fELF-sm90", None),
            entry(1, 90, 80, b"zstd-ptx", Some((8, 923))),
        ])
    }

    #[test]
    fn parses_hand_made_container() {
        let bytes = sample();
        // Spot-check the hand-made layout itself.
        assert_eq!(&bytes[..4], &[0x50, 0xED, 0x55, 0xBA]);
        let fb = parse(&bytes).unwrap();
        assert_eq!(fb.containers, 1);
        assert_eq!(
            fb.targets(),
            vec![Target::elf(80), Target::elf(90), Target::ptx(90)]
        );
        assert!(fb.contains(Target::ptx(90)));
        assert!(!fb.contains(Target::ptx(80)));

        let e0 = &fb.entries[0];
        assert_eq!(e0.kind, EntryKind::Elf);
        assert_eq!(e0.offset, 16);
        assert_eq!(e0.header_size, 64);
        assert_eq!(e0.payload.len(), 16);
        assert!(e0.payload.starts_with(b"\x7fELF-sm80-cubin"));
        assert_eq!(e0.code_version, (1, 8));
        assert_eq!(e0.flags, 0x11);
        assert!(!e0.is_compressed());

        let e1 = &fb.entries[1];
        assert_eq!(e1.offset, 16 + 64 + 16);
        assert_eq!(e1.payload, b"\x7fELF-sm90\0\0\0\0\0\0\0");

        let e2 = &fb.entries[2];
        assert_eq!(e2.kind, EntryKind::Ptx);
        assert_eq!(e2.header_size, 80);
        assert_eq!(e2.payload, b"zstd-ptx");
        assert_eq!(e2.compressed_size, Some(8));
        assert_eq!(e2.uncompressed_size, 923);
        assert!(e2.is_compressed());
        assert_eq!(e2.offset + 80 + 8, bytes.len());
    }

    #[test]
    fn reads_object_name_and_options() {
        // The layout nvcc 13.0 writes for a PTX entry compiled with -lineinfo: object name at 64,
        // options record at 72 pointing to the options string at 80.
        let options = b" --generate-line-info ";
        let mut e = entry(1, 90, 104, b"ptx", None);
        e[20..24].copy_from_slice(&72u32.to_le_bytes());
        e[32..36].copy_from_slice(&64u32.to_le_bytes());
        e[36..40].copy_from_slice(&5u32.to_le_bytes());
        e[64..69].copy_from_slice(b"k.cu\0");
        e[72..76].copy_from_slice(&80u32.to_le_bytes());
        e[76..80].copy_from_slice(&(options.len() as u32).to_le_bytes());
        e[80..80 + options.len()].copy_from_slice(options);
        let bytes = container(&[e, entry(2, 80, 64, b"elf", None)]);
        let fb = parse(&bytes).unwrap();
        assert_eq!(fb.entries[0].header.len(), 104);
        assert_eq!(fb.entries[0].object_name(), Some("k.cu"));
        assert_eq!(fb.entries[0].options(), Some(" --generate-line-info "));
        assert_eq!(fb.entries[0].payload, b"ptx\0\0\0\0\0");
        assert_eq!(fb.entries[1].object_name(), None);
        assert_eq!(fb.entries[1].options(), None);

        // Out-of-bounds string references are ignored, not a panic.
        let mut e = entry(1, 90, 64, b"", None);
        e[20..24].copy_from_slice(&60u32.to_le_bytes());
        e[32..36].copy_from_slice(&60u32.to_le_bytes());
        e[36..40].copy_from_slice(&u32::MAX.to_le_bytes());
        let bytes = container(&[e]);
        let fb = parse(&bytes).unwrap();
        assert_eq!(fb.entries[0].object_name(), None);
        assert_eq!(fb.entries[0].options(), None);
    }

    #[test]
    fn parses_back_to_back_containers() {
        let mut bytes = container(&[entry(2, 80, 64, b"a", None)]);
        bytes.extend(container(&[entry(1, 90, 64, b"b", None)]));
        let fb = parse(&bytes).unwrap();
        assert_eq!(fb.containers, 2);
        assert_eq!(fb.targets(), vec![Target::elf(80), Target::ptx(90)]);
        assert_eq!(fb.entries[1].offset, 16 + 64 + 8 + 16);
    }

    #[test]
    fn empty_container_has_no_entries() {
        let bytes = container(&[]);
        let fb = parse(&bytes).unwrap();
        assert_eq!(fb.containers, 1);
        assert!(fb.entries.is_empty());
    }

    #[test]
    fn rejects_malformed_input() {
        assert_eq!(parse(&[]), Err(FatbinError::Empty));

        let mut bad_magic = sample();
        bad_magic[0] ^= 1;
        assert!(matches!(
            parse(&bad_magic),
            Err(FatbinError::BadMagic { offset: 0, .. })
        ));

        assert!(matches!(
            parse(&sample()[..10]),
            Err(FatbinError::Truncated {
                what: "container header",
                ..
            })
        ));

        // The container claims more bytes than the buffer holds.
        let bytes = sample();
        assert!(matches!(
            parse(&bytes[..bytes.len() - 8]),
            Err(FatbinError::Truncated {
                what: "container",
                ..
            })
        ));

        // An entry's payload runs past its container.
        let mut bytes = container(&[entry(2, 80, 64, b"12345678", None)]);
        bytes[16 + 8] = 16;
        assert!(matches!(
            parse(&bytes),
            Err(FatbinError::Truncated {
                what: "entry payload",
                offset: 80,
                needed: 16,
                available: 8
            })
        ));

        // An entry header smaller than the fixed part.
        let mut bytes = sample();
        bytes[16 + 4] = 32;
        assert!(matches!(
            parse(&bytes),
            Err(FatbinError::BadHeaderSize {
                what: "entry",
                offset: 16,
                size: 32
            })
        ));

        // Absurd sizes do not overflow or panic.
        let mut bytes = sample();
        bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse(&bytes).is_err());
        let mut bytes = sample();
        bytes[16 + 8..16 + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse(&bytes).is_err());

        // Trailing garbage after a good container.
        let mut bytes = sample();
        bytes.extend_from_slice(&[0; 4]);
        assert!(matches!(parse(&bytes), Err(FatbinError::Truncated { .. })));
    }

    #[test]
    fn target_display() {
        assert_eq!(Target::elf(80).to_string(), "sm_80");
        assert_eq!(Target::ptx(90).to_string(), "compute_90");
        assert_eq!(
            EntryKind::from_raw(EntryKind::Other(0x10).raw()),
            EntryKind::Other(0x10)
        );
    }
}
