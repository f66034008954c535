//! KV that crosses the engine's edge: blocks reserved for KV a peer sends
//! ([`Engine::reserve_kv`], reusing what the cache holds already), KV imported into the prefix
//! cache or exported from it for a peer, references handed back; the device copy's marks for KV
//! that arrived device to device and its settling before a peer reads; and the KV events and
//! index snapshot a conductor follows the cache by.

use super::*;

impl Engine {
    /// Blocks this engine has marked stale on its model's device: those whose bytes arrived
    /// from elsewhere than its forward pass (reserved for a transfer, copied up from a slower
    /// tier). Counted on every backend.
    pub fn device_invalidated_blocks(&self) -> u64 {
        self.device_kv.invalidated_blocks()
    }

    /// Blocks this engine has marked as arrived on its model's device (KV a peer's GPU wrote
    /// device to device), and blocks it has settled (both copies made to agree before others
    /// read them: at a request's end, an import, an offer). Counted on every backend.
    pub fn device_kv_marks(&self) -> (u64, u64) {
        (self.device_kv.arrived_blocks(), self.device_kv.settled_blocks())
    }

    /// Tells the engine that KV for `blocks` (reserved with [`Self::reserve_kv`]) arrived in its
    /// device arena device to device, not in the host arena: the device copy is the newer one
    /// until the blocks are settled.
    pub fn kv_arrived_on_device(&mut self, blocks: &[BlockId]) {
        self.device_kv.arrived_on_device(blocks);
    }

    /// Makes the host and device copies of `blocks` agree before a peer reads them (blocks this
    /// engine offers on its KV server: the peer may read either copy).
    pub fn settle_kv(&mut self, blocks: &[BlockId]) -> Result<(), EngineError> {
        self.device_kv.settle(blocks, self.pool.arena_mut())?;
        Ok(())
    }

    /// This engine's device KV arena as the transfer plane opens it, for peers on this host to
    /// copy device to device (`None` on the CPU, or for a host arena the device's is not laid
    /// out as).
    pub fn device_arena(&self) -> Option<Result<std::sync::Arc<dyn baton_transfer::DeviceArena>, EngineError>> {
        self.device_kv.device_arena(self.pool.arena()).map(|r| r.map_err(EngineError::from))
    }

    /// KV events (blocks stored in / removed from the prefix index) since the last call, for a
    /// remote index to apply.
    pub fn drain_kv_events(&mut self) -> Vec<KvEvent> {
        self.pool.drain_events()
    }

    /// Everything the prefix index caches now, with the sequence number of the next KV event:
    /// a remote index that holds these entries and applies events from that number on stays
    /// equal to this engine's (a resynchronisation's starting point).
    pub fn kv_index_snapshot(&self) -> (u64, std::collections::BTreeMap<baton_kv::BlockHash, baton_kv::IndexEntry>) {
        (self.pool.next_event_seq(), self.pool.index_entries())
    }

    /// Allocates blocks for `tokens` tokens of KV that will arrive from elsewhere (a decode worker
    /// pulling a prefill worker's KV into them), for a later request's
    /// [`GenerationRequest::prefix`]. Fails when the pool cannot make room.
    pub fn reserve_kv(&mut self, tokens: usize) -> Result<KvPrefix, EngineError> {
        let blocks = self.pool.alloc_blocks(tokens.div_ceil(self.config.block_size))?;
        self.device_kv.invalidate(&blocks);
        Ok(KvPrefix { blocks, tokens })
    }

    /// [`Self::reserve_kv`] for KV that may be partly cached here already: `known` are the
    /// tokens the KV to receive holds (`tokens` of them). The longest cached prefix of `known` in
    /// whole blocks is taken from the prefix cache (one reference per block; never the last
    /// block, so something is always received), the rest allocated. Returns the blocks and how
    /// many leading ones came from the cache: those need not travel (MemServe's incremental
    /// hand-off: a decode worker holding a session's history receives only the new blocks).
    pub fn reserve_kv_reusing(&mut self, known: &[u32], tokens: usize) -> Result<(KvPrefix, usize), EngineError> {
        let bs = self.config.block_size;
        let n = tokens.div_ceil(bs);
        let mut blocks = Vec::new();
        if self.config.prefix_caching && n > 1 {
            let whole = ((n - 1) * bs).min(known.len()) / bs * bs;
            blocks =
                take_prefix(&mut self.pool, &mut self.swapped_in, &mut self.device_kv, self.clock, &known[..whole])?.0;
        }
        let cached = blocks.len();
        match self.pool.alloc_blocks(n - cached) {
            Ok(rest) => {
                self.device_kv.invalidate(&rest);
                blocks.extend(rest);
                Ok((KvPrefix { blocks, tokens }, cached))
            }
            Err(e) => {
                self.pool.free_blocks(&blocks)?;
                Err(e.into())
            }
        }
    }

    /// Puts KV received from a peer into the prefix cache without running anything (MemServe's
    /// `transfer_with_insert`): `kv` holds the KV of `tokens` (one reference per block, given
    /// up here); its whole blocks are cached under those tokens. Returns the blocks cached.
    pub fn import_kv(&mut self, tokens: &[u32], kv: KvPrefix) -> Result<usize, EngineError> {
        let cached = if self.config.prefix_caching {
            // The cache's blocks are read from the host (tiers, peers): bring it up to date.
            self.device_kv.settle(&kv.blocks, self.pool.arena_mut())?;
            let whole = kv.tokens.min(tokens.len());
            self.pool.insert(&tokens[..whole], &kv.blocks, self.clock)?
        } else {
            0
        };
        self.pool.free_blocks(&kv.blocks)?;
        Ok(cached)
    }

    /// Takes the longest cached prefix of `tokens` (whole blocks; blocks on a slower tier are
    /// brought onto the device first), one reference per block held by the caller, for a peer
    /// to read (a prefix fetched from this instance's cache). `None` when nothing is cached (or
    /// prefix caching is off); give the blocks back with [`Self::release_kv`].
    pub fn export_prefix(&mut self, tokens: &[u32]) -> Option<KvPrefix> {
        if !self.config.prefix_caching {
            return None;
        }
        match take_prefix(&mut self.pool, &mut self.swapped_in, &mut self.device_kv, self.clock, tokens) {
            Ok((blocks, tokens)) if !blocks.is_empty() => Some(KvPrefix { blocks, tokens }),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot export a cached prefix");
                None
            }
        }
    }

    /// The KV arena, for a transfer to write reserved blocks into.
    pub fn kv_mut(&mut self) -> &mut KvArena {
        self.pool.arena_mut()
    }

    /// Gives back the references a retained [`KvPrefix`] holds.
    pub fn release_kv(&mut self, prefix: KvPrefix) -> Result<(), EngineError> {
        self.pool.free_blocks(&prefix.blocks)?;
        Ok(())
    }
}
