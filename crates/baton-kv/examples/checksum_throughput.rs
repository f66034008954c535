//! What checking a block costs (issue #63, item 3): CRC-32C of one KV block, as the pool takes
//! it when a block moves to the host or disk tier and again when it comes back, beside a
//! `memcpy` of the same block (the copy the check rides on). Blocks of Llama-3-8B's geometry
//! (32 layers, 8 KV heads of 128, 16 tokens, float16: 2 MiB, one range in a block-major
//! arena; 64 ranges of 32 KiB in a layer-major one) and of the test model (2 KiB). Prints
//! min and median GB/s over many single calls (the minimum time says most on a busy machine).
//!
//! Run: `cargo run --release -p baton-kv --example checksum_throughput [-- SAMPLES]`.

use std::hint::black_box;
use std::time::Instant;

use baton_kv::{BlockId, KvDtype, KvGeometry, KvLayout, block_checksum};

fn gbps(bytes: usize, mut ns: Vec<f64>) -> (f64, f64) {
    ns.sort_by(f64::total_cmp);
    (bytes as f64 / ns[0], bytes as f64 / ns[ns.len() / 2])
}

fn time(samples: usize, mut f: impl FnMut()) -> Vec<f64> {
    (0..samples)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as f64
        })
        .collect()
}

fn main() {
    let samples: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(200);
    let shapes = [
        ("llama-3-8b f16", KvGeometry { dtype: KvDtype::F16, ..KvGeometry::new(32, 8, 128, 16) }),
        ("tiny-llama f32", KvGeometry::new(2, 2, 16, 4)),
    ];
    for (name, g) in shapes {
        for layout in [KvLayout::BlockMajor, KvLayout::LayerMajor] {
            let mut arena = baton_kv::KvArena::new(g, layout, 4);
            for (i, b) in arena.as_bytes_mut().iter_mut().enumerate() {
                *b = (i * 31 + 7) as u8;
            }
            let bytes = g.block_elems() * g.dtype.size();
            let ranges = arena.descriptor().byte_ranges(&[BlockId(1)]).len();
            let crc = time(samples, || {
                black_box(block_checksum(black_box(&arena), BlockId(1)));
            });
            let mut dst = vec![0u8; bytes];
            let src = arena.as_bytes()[bytes..2 * bytes].to_vec();
            let copy = time(samples, || {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            });
            let ((crc_min, crc_med), (copy_min, copy_med)) = (gbps(bytes, crc), gbps(bytes, copy));
            println!(
                "{name:>15} {layout:?} block of {bytes} B in {ranges} ranges: crc32c {crc_min:.1} GB/s best, \
                 {crc_med:.1} median; memcpy {copy_min:.1} best, {copy_med:.1} median"
            );
        }
    }
    #[cfg(target_arch = "x86_64")]
    println!("SSE4.2 (the CRC-32C instruction): {}", std::is_x86_feature_detected!("sse4.2"));
}
