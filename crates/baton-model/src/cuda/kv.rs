//! An engine's state on the device: its KV arena, stream, cuBLAS handle, workspace, staging
//! and captured decode steps.

use super::*;

/// A step's activations, sized for `rows` new tokens.
#[derive(Debug)]
pub(super) struct Workspace {
    pub(super) rows: usize,
    pub(super) x: DevBuf,
    pub(super) h: DevBuf,
    pub(super) qkv: DevBuf,
    pub(super) attn: DevBuf,
    pub(super) o: DevBuf,
    pub(super) gu: DevBuf,
    pub(super) act: DevBuf,
    pub(super) logits: DevBuf,
    pub(super) kv_stage: DevBuf,
    /// Each logits row's argmax.
    pub(super) argmax: DevBuf,
    /// Its first pass: `ARGMAX_PARTS` (value, index) pairs a row.
    pub(super) argmax_partial: DevBuf,
    /// Split-K attention's count of splits done per (row, KV head), zero between launches.
    pub(super) counters: DevBuf,
    /// Split-K partials of attention: [`PARTIAL_ROWS`] (row, split) pairs of every head.
    pub(super) partial: DevBuf,
}

/// A captured decode step. cudarc's graph is not `Send` (it holds raw driver handles); an
/// engine, and its [`CudaKv`] with it, moves to its own thread once.
pub(super) struct Graph(pub(super) cudarc::driver::CudaGraph);

// SAFETY: a graph's handles are the context's, valid on any thread that binds it (every use
// does); the graph is launched and destroyed only by its `CudaKv`'s owner, one thread at a time.
unsafe impl Send for Graph {}

/// One engine's KV arena on the device, with its stream, cuBLAS handle and workspace.
pub struct CudaKv {
    pub(super) k: Arc<Kernels>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: CudaBlas,
    /// Block-major `[blocks][layers][2][block_size][kv_heads · head_dim]`; shared with the
    /// transfer plane's handle on it ([`super::ipc::CudaArena`]), so the allocation lives as
    /// long as either holds it.
    pub(super) cache: Arc<DevBuf>,
    /// Blocks whose host copy is the newer one (written there by someone else than the forward
    /// pass): uploaded before a step reads them.
    pub(super) stale: Vec<bool>,
    /// Blocks whose device copy is the newer one (arrived device to device): downloaded by
    /// [`CudaKv::settle`]. Never set together with `stale`.
    pub(super) host_stale: Vec<bool>,
    pub(super) ws: Option<Workspace>,
    pub(super) words: Option<DevBuf>,
    pub(super) kv_kind: Kind,
    /// Captured decode steps by batch-size bucket ([`StepPack::decode_bucket`]); they hold the
    /// workspace's and `words`' addresses,
    /// so growing either drops them.
    pub(super) graphs: Vec<(usize, Graph)>,
    /// `--enforce-eager` turns graphs off (to measure what they save).
    pub(super) graphs_enabled: bool,
    /// The device arena's block past the pool's, which padded decode rows write to.
    pub(super) scratch_block: u32,
    /// The tiled prefill attention and the rows of its tiles (`TILE_Q` over the GQA group);
    /// `None` where no tiled kernel takes these types or `--prefill-attention rows` turns it off.
    pub(super) tiled: Option<(Tiled, usize)>,
    /// cuBLAS's workspace, set once, so a captured GEMM allocates nothing.
    pub(super) _blas_workspace: DevBuf,
    /// Pinned staging of the index upload, and of the logits and new KV coming down.
    pub(super) pinned_up: Option<Pinned>,
    pub(super) pinned_down: Option<Pinned>,
    /// `--device-timing`: where steps spend their time, printed on drop.
    pub(super) timing: Option<Timing>,
    /// `--device-profile`: where the GPU spends a step's time, printed on drop.
    pub(super) profile: Option<Profile>,
    /// The host arena, page-locked for the device (an engine's, block-major): blocks a step
    /// writes whole go down by DMA straight into it, with no staging and no host copy.
    pub(super) host_pinned: Option<HostPinned>,
    /// Where the copies between the device arena and the host's are counted (the engine's
    /// pool's meter).
    pub(super) meter: Arc<baton_kv::CopyMeter>,
}

impl Drop for CudaKv {
    fn drop(&mut self) {
        if let Some(t) = &self.timing {
            for (kind, t) in ["decode", "prefill/mixed"].iter().zip(&t.kinds) {
                if t.steps == 0 {
                    continue;
                }
                let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / t.steps as f64;
                eprintln!(
                    "baton cuda timing: {} {kind} steps, per step: prepare {:.3} ms, enqueue {:.3} ms, GPU and copies {:.3} ms, unpack {:.3} ms",
                    t.steps,
                    ms(t.prepare),
                    ms(t.enqueue),
                    ms(t.wait),
                    ms(t.unpack)
                );
            }
        }
        if let Some(p) = &self.profile {
            p.print();
        }
    }
}

impl std::fmt::Debug for CudaKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKv")
            .field("cache_bytes", &self.cache.bytes)
            .field("kv", &self.kv_kind)
            .finish_non_exhaustive()
    }
}

impl CudaKv {
    /// Starts a profiled step's events (a no-op unless profiling).
    pub(super) fn mark_start(&self) -> Result<()> {
        self.mark("start")
    }

    /// Records an event after the launch just enqueued, named for the profiler (a no-op unless
    /// profiling).
    pub(super) fn mark(&self, name: &'static str) -> Result<()> {
        let Some(p) = &self.profile else { return Ok(()) };
        let event = self.stream.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
        event.record(&self.stream).map_err(err)?;
        p.marks.lock().map_err(|_| err("profile lock poisoned"))?.push((name, event));
        Ok(())
    }

    /// Enqueues the copies of `blocks` (written whole by the step just enqueued) from the device
    /// arena into the page-locked host arena, one copy a run of consecutive block ids; the
    /// step's end synchronises. Both arenas are block-major with the same geometry, so a block
    /// is at the same offset in each.
    pub(super) fn copy_whole_blocks(&self, blocks: &[u32], arena: &mut KvArena) -> Result<()> {
        let block_bytes = arena.geometry().block_elems() * self.kv_kind.size();
        let bytes = arena.as_bytes_mut();
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                j += 1;
            }
            let (start, len) = (blocks[i] as usize * block_bytes, (j - i) * block_bytes);
            self.meter.add(baton_kv::CopyDirection::DeviceToHost, len as u64);
            // SAFETY: blocks of both arenas; the host bytes are not read (the blocks are not
            // yet published) or freed before the stream synchronises at the step's end.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut bytes[start..start + len],
                    self.cache.at(start),
                    self.stream.cu_stream(),
                )
            }
            .map_err(err)?;
            i = j;
        }
        Ok(())
    }

    /// Marks blocks whose host bytes someone else wrote: they are uploaded before a step reads
    /// them.
    pub(crate) fn invalidate(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            if let Some(s) = self.stale.get_mut(b.0 as usize) {
                *s = true;
                self.host_stale[b.0 as usize] = false;
            }
        }
    }

    /// Marks blocks that arrived device to device: the device copy is the newer one.
    pub(crate) fn arrived_on_device(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            if let Some(h) = self.host_stale.get_mut(b.0 as usize) {
                *h = true;
                self.stale[b.0 as usize] = false;
            }
        }
    }

    /// Makes both copies of `blocks` agree: downloads those the device has newer into the host
    /// arena, uploads those the host has newer. Returns the blocks copied.
    pub(crate) fn settle(&mut self, blocks: &[BlockId], arena: &mut KvArena) -> Result<usize> {
        let mut down: Vec<u32> = Vec::new();
        let mut copied = 0;
        for b in blocks {
            let i = b.0 as usize;
            if self.host_stale.get_mut(i).is_some_and(std::mem::take) {
                down.push(b.0);
            } else if self.stale.get_mut(i).is_some_and(std::mem::take) {
                self.upload_block(i, arena)?;
                copied += 1;
            }
        }
        if !down.is_empty() {
            // Only a block-major arena is offered device to device (`device_arena`), so only
            // its blocks arrive there: at the same offsets in both arenas.
            down.sort_unstable();
            self.copy_whole_blocks(&down, arena)?;
            copied += down.len();
        }
        if copied > 0 {
            self.stream.synchronize().map_err(err)?;
        }
        Ok(copied)
    }

    /// The device arena as the transfer plane opens it, when it is laid out as the host's (a
    /// block-major host arena from offset 0: a block at the same offset in both).
    pub(crate) fn device_arena(&self, arena: &KvArena) -> Option<Result<Arc<dyn baton_transfer::DeviceArena>>> {
        let desc = arena.descriptor();
        if desc.dims != KvLayout::BlockMajor.dims() || desc.base != 0 {
            return None;
        }
        Some(
            super::ipc::CudaArena::new(Arc::clone(&self.cache))
                .map(|a| Arc::new(a) as Arc<dyn baton_transfer::DeviceArena>),
        )
    }

    /// Enqueues the upload of block `i` from the host arena (the caller synchronises the
    /// stream before the host bytes may change).
    fn upload_block(&self, i: usize, arena: &KvArena) -> Result<()> {
        let g = *arena.geometry();
        let size = g.dtype.size();
        self.meter.add(baton_kv::CopyDirection::HostToDevice, (g.block_elems() * size) as u64);
        let desc = arena.descriptor();
        let bytes = arena.as_bytes();
        let slab = g.slab_elems() * size;
        if desc.dims == KvLayout::BlockMajor.dims() {
            // The host's block is contiguous and laid out as the device's: one copy.
            let (src, len) = (desc.offset(0, KvPart::Key, i, 0, 0) * size, g.block_elems() * size);
            // SAFETY: one block inside each arena.
            return unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    self.cache.at(i * len),
                    &bytes[src..src + len],
                    self.stream.cu_stream(),
                )
            }
            .map_err(err);
        }
        for l in 0..g.layers {
            for (pi, part) in [KvPart::Key, KvPart::Value].into_iter().enumerate() {
                let src = desc.offset(l, part, i, 0, 0) * size;
                let dst = self.cache.at(((i * g.layers + l) * 2 + pi) * slab);
                // SAFETY: both ranges are one slab inside their arenas.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(dst, &bytes[src..src + slab], self.stream.cu_stream())
                }
                .map_err(err)?;
            }
        }
        Ok(())
    }

    /// Device memory the arena and the workspace take.
    pub(crate) fn device_bytes(&self) -> (usize, usize) {
        let ws = self.ws.as_ref().map_or(0, |w| {
            [
                &w.x,
                &w.h,
                &w.qkv,
                &w.attn,
                &w.o,
                &w.gu,
                &w.act,
                &w.logits,
                &w.kv_stage,
                &w.partial,
                &w.argmax,
                &w.argmax_partial,
                &w.counters,
            ]
            .iter()
            .map(|b| b.bytes)
            .sum()
        });
        (self.cache.bytes, ws + self.words.as_ref().map_or(0, |w| w.bytes))
    }

    /// Uploads the stale blocks this step reads.
    pub(super) fn upload_stale(&mut self, pack: &StepPack, arena: &KvArena) -> Result<()> {
        let mut uploaded = false;
        for &b in &pack.tables {
            let i = b as usize;
            // (The scratch block, past the pool's, is never stale: nothing reads what it holds.)
            if !self.stale.get_mut(i).is_some_and(std::mem::take) {
                continue;
            }
            uploaded = true;
            self.upload_block(i, arena)?;
        }
        // The host bytes must stay put until the copies read them.
        if uploaded { self.stream.synchronize().map_err(err) } else { Ok(()) }
    }

    /// Grows the workspace to `rows` rows and the index buffer to `words` words.
    pub(super) fn reserve(
        &mut self,
        ctx: &Arc<CudaContext>,
        model: &CudaModel,
        rows: usize,
        words: usize,
    ) -> Result<()> {
        if self.words.as_ref().is_none_or(|w| w.bytes < words * 4) {
            self.graphs.clear();
            self.words = Some(DevBuf::new(ctx, words.next_power_of_two() * 4)?);
        }
        if self.ws.as_ref().is_some_and(|w| w.rows >= rows) {
            return Ok(());
        }
        self.graphs.clear();
        self.ws = None;
        let rows = rows.next_power_of_two().max(16);
        let c = &model.config;
        let a = model.act.size();
        let (q_w, kv_w) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let buf = |elems: usize, size: usize| DevBuf::new(ctx, rows * elems * size);
        self.ws = Some(Workspace {
            rows,
            x: buf(c.hidden_size, a)?,
            h: buf(c.hidden_size, a)?,
            qkv: buf(q_w + 2 * kv_w, a)?,
            attn: buf(q_w, a)?,
            o: buf(c.hidden_size, a)?,
            gu: buf(2 * c.intermediate_size, a)?,
            act: buf(c.intermediate_size, a)?,
            logits: buf(c.vocab_size, 4)?,
            kv_stage: buf(c.num_layers * 2 * kv_w, self.kv_kind.size())?,
            partial: DevBuf::new(ctx, PARTIAL_ROWS * c.num_heads * (c.head_dim + 2) * 4)?,
            argmax: buf(1, 4)?,
            argmax_partial: buf(ARGMAX_PARTS, 8)?,
            counters: {
                let b = DevBuf::new(ctx, PARTIAL_ROWS * c.num_kv_heads * 4)?;
                // SAFETY: `b` holds that many bytes; the memset is synchronous.
                unsafe { cudarc::driver::result::memset_d8_sync(b.ptr, 0, b.bytes) }.map_err(err)?;
                b
            },
        });
        Ok(())
    }
}

impl crate::backend::KvState for CudaKv {
    fn invalidate(&mut self, blocks: &[BlockId]) {
        CudaKv::invalidate(self, blocks);
    }

    fn arrived_on_device(&mut self, blocks: &[BlockId]) {
        CudaKv::arrived_on_device(self, blocks);
    }

    fn settle(&mut self, blocks: &[BlockId], arena: &mut KvArena) -> Result<usize> {
        CudaKv::settle(self, blocks, arena)
    }

    fn device_arena(&self, arena: &KvArena) -> Option<Result<Arc<dyn baton_transfer::DeviceArena>>> {
        CudaKv::device_arena(self, arena)
    }

    fn device_bytes(&self) -> (usize, usize) {
        CudaKv::device_bytes(self)
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
