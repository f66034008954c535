//! Engine options shared by `baton serve` and `baton worker`.

use baton_engine::EngineConfig;
use baton_kv::KvLayout;

/// How each worker's engine is sized.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct EngineFlags {
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 2048)]
    num_blocks: usize,
    /// Most sequences a worker runs at once.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Most tokens a worker computes per step.
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Most prompt tokens of one sequence per step (chunked prefill).
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// KV layout: block-major or layer-major.
    #[arg(long, default_value = "block-major")]
    layout: KvLayout,
}

impl EngineFlags {
    /// The engine configuration these flags describe.
    pub(crate) fn config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            layout: self.layout,
            max_num_seqs: self.max_num_seqs,
            max_batch_tokens: self.max_batch_tokens,
            prefill_chunk: self.prefill_chunk,
            ..EngineConfig::default()
        }
    }
}
