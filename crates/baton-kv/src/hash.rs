//! Chained block hashes (Mooncake's prefix-hash block keys).
//!
//! The key of a block is a hash of the previous block's key and this block's token ids, so a key
//! names a whole prefix, not just one block. Every process must compute the same key for the same
//! tokens, so the hash is defined here byte for byte and never uses `std`'s `DefaultHasher`
//! (whose output may change between processes and Rust releases).
//!
//! The input stream is the parent key as 8 little-endian bytes (zero for the first block)
//! followed by each token id as 4 little-endian bytes. It is consumed in 8-byte little-endian
//! words (two token ids per word, a lone last token zero-extended), each folded in with an
//! xxHash64-style round, then the token count is mixed in and the state is finalised with the
//! splitmix64 avalanche. The seed is fixed: [`HASH_SEED`].

/// FNV-1a (64-bit) of `bytes`: a small stable hash for names and keys that every process and
/// every release must hash alike (session keys, compatibility facts).
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// FNV-1a (32-bit) of `bytes`, as [`fnv1a_64`] where 32 bits are the id (instance ids).
pub fn fnv1a_32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5, |h, &b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// Seed of every block hash, the same in every process ("baton_kv" in ASCII).
pub const HASH_SEED: u64 = 0x6261_746f_6e5f_6b76;

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;

/// The chained hash of one block of tokens: identifies the block *and* everything before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[inline]
fn round(acc: u64, word: u64) -> u64 {
    (acc ^ word.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1).wrapping_add(P3)
}

#[inline]
fn avalanche(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The key of a block of `tokens` whose prefix has key `parent` (`None` for a prompt's first
/// block).
pub fn block_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = round(HASH_SEED, parent.map_or(0, |p| p.0));
    let mut pairs = tokens.chunks_exact(2);
    for pair in &mut pairs {
        h = round(h, u64::from(pair[0]) | (u64::from(pair[1]) << 32));
    }
    if let [last] = pairs.remainder() {
        h = round(h, u64::from(*last));
    }
    BlockHash(avalanche(h ^ (tokens.len() as u64).wrapping_mul(P3)))
}

/// Keys of every *full* block of `tokens`, `block_size` tokens each, in order. A partial last
/// block has no key: only whole blocks are cached.
pub fn prefix_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let h = block_hash(parent, block);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    /// The published FNV-1a test vectors: every process and release must hash names alike.
    #[test]
    fn fnv1a_matches_its_reference_vectors() {
        assert_eq!(super::fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(super::fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(super::fnv1a_32(b"a"), 0xe40c_292c);
        assert_eq!(super::fnv1a_32(b"foobar"), 0xbf9c_f968);
    }

    use super::*;

    #[test]
    fn hash_is_pinned_across_processes_and_releases() {
        // Golden values: a change here breaks every remote index and stored key.
        assert_eq!(block_hash(None, &[1, 2, 3, 4]), block_hash(None, &[1, 2, 3, 4]));
        let golden = block_hash(None, &[1, 2, 3, 4]).0;
        assert_eq!(golden, GOLDEN_1234, "block hash changed: {golden:#x}");
    }

    const GOLDEN_1234: u64 = 0x2374_c9b5_0485_2b0e;

    #[test]
    fn chain_depends_on_parent_and_order() {
        let a = block_hash(None, &[1, 2]);
        assert_ne!(a, block_hash(None, &[2, 1]));
        assert_ne!(block_hash(Some(a), &[3, 4]), block_hash(None, &[3, 4]));
        assert_ne!(block_hash(None, &[1]), block_hash(None, &[1, 0]));
        let hs = prefix_hashes(&[1, 2, 3, 4, 5], 2);
        assert_eq!(hs, vec![a, block_hash(Some(a), &[3, 4])]);
    }
}
