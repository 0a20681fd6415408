//! FNV-1a 64: a tiny, stable hash of bytes, the same on every VM, worker and build (tenant
//! buckets, digests). Not for hash tables fed by clients (it is not keyed) nor where quality
//! matters (prefix blocks use xxHash).

/// FNV-1a 64's offset basis: the hash of no bytes.
const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV's 64-bit prime.
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a::new();
    h.write(bytes);
    h.finish()
}

/// FNV-1a 64 over several pieces: the same as [`fnv1a64`] of their concatenation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fnv1a(u64);

impl Fnv1a {
    pub const fn new() -> Self {
        Self(OFFSET_BASIS)
    }

    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(PRIME);
        }
    }

    pub const fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv1a {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_test_vectors() {
        // From the FNV reference test suite (Landon Curt Noll, test_fnv.c, FNV-1a 64).
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"b"), 0xaf63_df4c_8601_f1a5);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn streaming_equals_one_shot() {
        let mut h = Fnv1a::new();
        for piece in [&b"foo"[..], b"", b"bar"] {
            h.write(piece);
        }
        assert_eq!(h.finish(), fnv1a64(b"foobar"));
        assert_eq!(Fnv1a::default().finish(), fnv1a64(b""));
    }
}
