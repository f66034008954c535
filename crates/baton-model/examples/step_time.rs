//! Times a 512-token prefill and decode steps of a GGUF model, with and without the output
//! head: `step_time [MODEL.gguf] [all|prefill|decode] [STEPS]`. Run under `perf stat` or
//! `perf record` with `prefill` or `decode` to see one phase alone (the other runs only as
//! far as it must: decode needs the prompt's KV, so it prefills in 64-token chunks' time).

use std::time::Instant;

use baton_kv::{BlockAllocator, KvArena, KvLayout};
use baton_model::{Checkpoint, LogitsWanted, SeqStep};

/// CPU time of the whole process so far (all threads), from `/proc/self/stat`; on a loaded
/// machine it moves far less than wall time does. Zero where that file is not readable.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest.split_whitespace().skip(11).take(2).filter_map(|v| v.parse().ok()).collect();
    f.iter().sum::<f64>() / 100.0
}

fn main() -> Result<(), baton_model::ModelError> {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| ".models/gemma-3-270m-q4_k_m.gguf".into());
    let mode = args.next().unwrap_or_else(|| "all".into());
    let steps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(10);
    let ckpt = Checkpoint::open(std::path::Path::new(&path))?;
    let model = &ckpt.model;
    let mut kv = KvArena::new(model.kv_geometry(16), KvLayout::BlockMajor, 64 + steps.div_ceil(16) * 4);
    let blocks =
        BlockAllocator::new(64 + steps.div_ceil(16) * 4).allocate(64 + steps.div_ceil(16) * 4).expect("blocks");
    let prompt: Vec<u32> = (0..512u32).map(|t| (t * 31 + 1000) % 262_144).collect();
    let prompt_len = if mode == "decode" { 16 } else { 512 };
    let (t, cpu) = (Instant::now(), cpu_seconds());
    let step = SeqStep { start_pos: 0, tokens: &prompt[..prompt_len], blocks: &blocks, logits: LogitsWanted::Last };
    model.forward(&[step], &mut kv)?;
    println!(
        "prefill {prompt_len}: {:.1} ms (cpu {:.0} ms)",
        t.elapsed().as_secs_f64() * 1e3,
        (cpu_seconds() - cpu) * 1e3
    );
    if mode == "prefill" {
        return Ok(());
    }
    let mut pos = prompt_len;
    for logits in [LogitsWanted::None, LogitsWanted::Last, LogitsWanted::None, LogitsWanted::Last] {
        let (t, cpu) = (Instant::now(), cpu_seconds());
        for _ in 0..steps {
            let step = SeqStep { start_pos: pos, tokens: &[1000], blocks: &blocks, logits };
            model.forward(&[step], &mut kv)?;
            pos += 1;
        }
        println!(
            "decode step ({logits:?}): {:.2} ms (cpu {:.2} ms)",
            t.elapsed().as_secs_f64() * 1e3 / steps as f64,
            (cpu_seconds() - cpu) * 1e3 / steps as f64
        );
    }
    Ok(())
}
