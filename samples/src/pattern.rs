//! The payload pattern: 8 bytes at a time from a mix of (seed, slot, word index), so every
//! slot of every run has its own bytes, and a byte at the wrong place, from the wrong slot or
//! from an earlier run shows.

/// splitmix64's finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of a run (a size of a test).
pub fn seed(test: u64, size: u64) -> u64 {
    mix(test.wrapping_mul(0x100_0000_01b3) ^ size)
}

/// Writes the `len` pattern bytes of `slot` into `out` (cleared first).
pub fn fill(out: &mut Vec<u8>, seed: u64, slot: u64, len: usize) {
    out.clear();
    out.reserve(len);
    let base = mix(seed ^ slot.wrapping_mul(0xd6e8_feb8_6659_fd93));
    let mut k = 0u64;
    while out.len() < len {
        let w = mix(base ^ k).to_le_bytes();
        let n = (len - out.len()).min(8);
        out.extend_from_slice(&w[..n]);
        k += 1;
    }
}

/// The first offset where `got` differs from `want`.
pub fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    if got == want {
        return None;
    }
    got.iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .or(Some(got.len().min(want.len())))
}

#[cfg(test)]
mod tests {
    use crate::pattern;

    #[test]
    fn pattern_differs_by_seed_slot_and_offset() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        pattern::fill(&mut a, 1, 0, 4099);
        assert_eq!(a.len(), 4099);
        pattern::fill(&mut b, 1, 1, 4099);
        assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 64);
        pattern::fill(&mut b, 2, 0, 4099);
        assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 64);
        pattern::fill(&mut b, 1, 0, 4099);
        assert_eq!(a, b);
        assert_eq!(pattern::first_difference(&a, &b), None);
        b[17] ^= 1;
        assert_eq!(pattern::first_difference(&a, &b), Some(17));
    }
}
