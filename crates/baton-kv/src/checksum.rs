//! Checksums of KV blocks that leave memory and come back (issue #63, item 3; STYLE.md 29).
//!
//! A block moved to the host or disk tier gets a CRC-32C of its bytes, taken in the block's
//! canonical `[L][2][T][H][D]` order ([`TensorDescriptor::byte_ranges`] of the block alone, the
//! same in every layout), so the sum taken from a layer-major device arena equals the one taken
//! from the block-major host arena or the disk file. The pool keeps one sum per host and disk
//! slot and checks it when the block is read back; a block that fails is dropped from the
//! index (with whatever is cached below it), counted and recomputed — never served.
//!
//! CRC-32C rather than a cryptographic hash: what this guards against is a failing disk, a
//! stray writer or a bit flip, not an adversary (who could write the sum too), and the
//! `crc32c` crate runs on the CPU's CRC instructions (SSE4.2, ARMv8), many GB/s a core.
//!
//! [`TensorDescriptor::byte_ranges`]: crate::TensorDescriptor::byte_ranges

use crate::{BlockId, ByteRange, KvArena};

/// CRC-32C of `ranges` of `bytes`, concatenated in order.
pub fn checksum_ranges(bytes: &[u8], ranges: &[ByteRange]) -> u32 {
    ranges.iter().fold(0, |sum, r| crc32c::crc32c_append(sum, &bytes[r.offset..r.end()]))
}

/// CRC-32C of one block of `arena`, in the block's canonical byte order.
pub fn block_checksum(arena: &KvArena, block: BlockId) -> u32 {
    checksum_ranges(arena.as_bytes(), &arena.descriptor().byte_ranges(&[block]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvGeometry, KvLayout, KvPart};

    #[test]
    fn a_block_has_the_same_sum_in_every_layout() {
        let g = KvGeometry::new(3, 2, 4, 4);
        let mut a = KvArena::new(g, KvLayout::LayerMajor, 4);
        for layer in 0..3 {
            for slot in 0..4 {
                let v: Vec<f32> = (0..8).map(|i| (layer * 100 + slot * 10 + i) as f32).collect();
                a.write_token(layer, KvPart::Key, BlockId(2), slot, &v);
                a.write_token(layer, KvPart::Value, BlockId(2), slot, &v);
            }
        }
        let mut b = KvArena::new(g, KvLayout::BlockMajor, 4);
        b.copy_blocks_from(&a, &[BlockId(2)], &[BlockId(0)]);
        assert_eq!(block_checksum(&a, BlockId(2)), block_checksum(&b, BlockId(0)));
        assert_ne!(block_checksum(&a, BlockId(2)), block_checksum(&a, BlockId(1)), "zeros sum otherwise");
    }

    #[test]
    fn crc32c_known_vector() {
        // RFC 3720, B.4: 32 bytes of zeros.
        assert_eq!(checksum_ranges(&[0u8; 32], &[ByteRange { offset: 0, len: 32 }]), 0x8a91_36aa);
    }
}
