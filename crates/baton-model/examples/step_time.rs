//! Times one decode step of a GGUF model, with and without the output head.

use std::time::Instant;

use baton_kv::{BlockAllocator, KvArena, KvLayout};
use baton_model::{Checkpoint, LogitsWanted, SeqStep};

fn main() -> Result<(), baton_model::ModelError> {
    let path = std::env::args().nth(1).unwrap_or_else(|| ".models/gemma-3-270m-q4_k_m.gguf".into());
    let ckpt = Checkpoint::open(std::path::Path::new(&path))?;
    let model = &ckpt.model;
    let mut kv = KvArena::new(model.kv_geometry(16), KvLayout::BlockMajor, 64);
    let blocks = BlockAllocator::new(64).allocate(64).expect("blocks");
    let prompt: Vec<u32> = (0..512u32).map(|t| (t * 31 + 1000) % 262_144).collect();
    let t = Instant::now();
    model
        .forward(&[SeqStep { start_pos: 0, tokens: &prompt, blocks: &blocks, logits: LogitsWanted::Last }], &mut kv)?;
    println!("prefill 512: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    for logits in [LogitsWanted::None, LogitsWanted::Last, LogitsWanted::None, LogitsWanted::Last] {
        let t = Instant::now();
        for i in 0..10 {
            let step = SeqStep { start_pos: 512 + i, tokens: &[1000], blocks: &blocks, logits };
            model.forward(&[step], &mut kv)?;
        }
        println!("decode step ({logits:?}): {:.2} ms", t.elapsed().as_secs_f64() * 1e2);
    }
    Ok(())
}
