//! The segment allocator (FlowKV): free blocks kept as contiguous runs.
//!
//! Free space is a set of maximal runs `[start, start + len)`, indexed twice: by start (to merge a
//! freed run with its neighbours) and by length (to find the smallest run that fits). A request
//! is served from one run when any run is long enough (best fit), otherwise from the longest runs
//! first, so an allocation spans as few runs as possible. Every operation is `O(log r)` in the
//! number of free runs `r`, plus the length of the block list produced.
//!
//! [`SegmentAllocator::allocate_aligned`] serves FlowKV's segment alignment: given the block ids
//! of a peer's request, it hands out runs of the same lengths (the same ids where they are free),
//! so a transfer between the two is one copy per run rather than one per block.

use std::collections::{BTreeMap, BTreeSet};

use crate::{AllocatorError, BlockId};

/// A run of contiguous block ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Segment {
    /// First block of the run.
    pub start: BlockId,
    /// Blocks in the run.
    pub len: u32,
}

impl Segment {
    /// The block ids of the run, in order.
    pub fn blocks(self) -> impl Iterator<Item = BlockId> {
        (self.start.0..self.start.0 + self.len).map(BlockId)
    }

    /// One past the last block id.
    pub fn end(self) -> u32 {
        self.start.0 + self.len
    }
}

/// Splits a block list into its maximal runs of consecutive ids, in list order.
pub fn segments_of(blocks: &[BlockId]) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    for &b in blocks {
        match out.last_mut() {
            Some(s) if s.end() == b.0 => s.len += 1,
            _ => out.push(Segment { start: b, len: 1 }),
        }
    }
    out
}

/// Number of runs of consecutive ids in a block list: FlowKV's fragmentation measure (1 is
/// ideal; a transfer of the list needs that many copies in a block-major layout).
pub fn count_runs(blocks: &[BlockId]) -> usize {
    blocks.windows(2).filter(|w| w[1].0 != w[0].0.wrapping_add(1)).count() + usize::from(!blocks.is_empty())
}

/// Fragmentation counters of an allocator since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FragmentationStats {
    /// Successful allocations.
    pub allocations: u64,
    /// Runs handed out over all allocations.
    pub runs: u64,
    /// Blocks handed out over all allocations.
    pub blocks: u64,
}

impl FragmentationStats {
    /// Average runs per allocation (1.0 when every allocation was one contiguous run).
    pub fn runs_per_allocation(&self) -> f64 {
        if self.allocations == 0 { 0.0 } else { self.runs as f64 / self.allocations as f64 }
    }
}

/// Hands out block ids in contiguous runs. It knows which ids are free, not who holds the
/// others: reference counts live with the caller (see [`crate::MemPool`]).
#[derive(Debug, Clone)]
pub struct SegmentAllocator {
    num_blocks: u32,
    num_free: usize,
    /// Free runs: start → length. Runs never touch (they are merged when freed).
    by_start: BTreeMap<u32, u32>,
    /// Free runs: (length, start), for best fit.
    by_len: BTreeSet<(u32, u32)>,
    stats: FragmentationStats,
}

impl SegmentAllocator {
    /// An allocator over `num_blocks` free blocks (one run).
    pub fn new(num_blocks: usize) -> Self {
        let n = u32::try_from(num_blocks).expect("block ids are 32-bit");
        let mut a = Self {
            num_blocks: n,
            num_free: 0,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            stats: FragmentationStats::default(),
        };
        if n > 0 {
            a.insert_run(0, n);
        }
        a
    }

    /// Blocks managed.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks as usize
    }

    /// Blocks free.
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Maximal free runs (1 for an empty arena; more means free space is fragmented).
    pub fn num_free_runs(&self) -> usize {
        self.by_start.len()
    }

    /// Length of the longest free run.
    pub fn longest_free_run(&self) -> usize {
        self.by_len.last().map_or(0, |&(l, _)| l as usize)
    }

    /// Counters since creation.
    pub fn stats(&self) -> FragmentationStats {
        self.stats
    }

    /// The free runs, in id order.
    pub fn free_runs(&self) -> impl Iterator<Item = Segment> + '_ {
        self.by_start.iter().map(|(&s, &l)| Segment { start: BlockId(s), len: l })
    }

    /// Whether `block` is free.
    pub fn is_free(&self, block: BlockId) -> bool {
        self.by_start.range(..=block.0).next_back().is_some_and(|(&s, &l)| block.0 < s + l)
    }

    fn insert_run(&mut self, start: u32, len: u32) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.num_free += len as usize;
    }

    fn remove_run(&mut self, start: u32, len: u32) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.num_free -= len as usize;
    }

    /// Takes `len` blocks at the front of the free run starting at `start`.
    fn take_front(&mut self, start: u32, run_len: u32, len: u32) {
        self.remove_run(start, run_len);
        if run_len > len {
            self.insert_run(start + len, run_len - len);
        }
    }

    fn record(&mut self, runs: usize, blocks: usize) {
        self.stats.allocations += 1;
        self.stats.runs += runs as u64;
        self.stats.blocks += blocks as u64;
    }

    /// Takes `n` blocks, as few runs as it can, or `None` (taking nothing) when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        let mut out = Vec::with_capacity(n);
        self.allocate_into(n, &mut out).then_some(out)
    }

    /// Like [`allocate`](Self::allocate), appending the blocks to `out`; returns false (and
    /// appends nothing) when fewer than `n` are free.
    pub fn allocate_into(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        let mut segs = Vec::new();
        if !self.allocate_segments_into(n, &mut segs) {
            return false;
        }
        for s in segs {
            out.extend(s.blocks());
        }
        true
    }

    /// Takes `n` blocks as runs: one run when a free run is long enough, otherwise the longest
    /// runs first. `None` (taking nothing) when fewer than `n` are free.
    pub fn allocate_segments(&mut self, n: usize) -> Option<Vec<Segment>> {
        let mut out = Vec::new();
        self.allocate_segments_into(n, &mut out).then_some(out)
    }

    fn allocate_segments_into(&mut self, n: usize, out: &mut Vec<Segment>) -> bool {
        if n > self.num_free {
            return false;
        }
        if n == 0 {
            return true;
        }
        let want = n as u32;
        let before = out.len();
        if let Some(&(len, start)) = self.by_len.range((want, 0)..).next() {
            self.take_front(start, len, want);
            out.push(Segment { start: BlockId(start), len: want });
        } else {
            let mut left = want;
            while left > 0 {
                let &(len, start) = self.by_len.last().expect("num_free covers the request");
                let take = len.min(left);
                self.take_front(start, len, take);
                out.push(Segment { start: BlockId(start), len: take });
                left -= take;
            }
        }
        self.record(out.len() - before, n);
        true
    }

    /// Takes exactly the run `[start, start + len)` if every block of it is free.
    pub fn allocate_exact(&mut self, segment: Segment) -> bool {
        if segment.len == 0 {
            return true;
        }
        let Some((&s, &l)) = self.by_start.range(..=segment.start.0).next_back() else {
            return false;
        };
        if segment.end() > s + l {
            return false;
        }
        self.remove_run(s, l);
        if s < segment.start.0 {
            self.insert_run(s, segment.start.0 - s);
        }
        if segment.end() < s + l {
            self.insert_run(segment.end(), s + l - segment.end());
        }
        true
    }

    /// Takes as many blocks as `pattern` holds, shaped like it: for each run of consecutive ids
    /// in `pattern`, the same ids if they are free here, else one free run of that length (best
    /// fit), else whatever runs are left. `None` (taking nothing) when too few blocks are free.
    ///
    /// With source and destination runs aligned, a block-major transfer is one copy per run.
    pub fn allocate_aligned(&mut self, pattern: &[BlockId]) -> Option<Vec<BlockId>> {
        if pattern.len() > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(pattern.len());
        let mut runs = 0;
        let pattern_segments = segments_of(pattern);
        // Exact ids first, so runs taken for one pattern segment never steal another's ids.
        let mut exact = vec![false; pattern_segments.len()];
        for (i, s) in pattern_segments.iter().enumerate() {
            exact[i] = s.end() <= self.num_blocks && self.allocate_exact(*s);
        }
        for (i, s) in pattern_segments.iter().enumerate() {
            if exact[i] {
                out.extend(s.blocks());
                runs += 1;
                continue;
            }
            let mut segs = Vec::new();
            let ok = self.allocate_segments_into(s.len as usize, &mut segs);
            debug_assert!(ok, "num_free covers the pattern");
            self.stats.allocations -= 1;
            runs += segs.len();
            for seg in segs {
                out.extend(seg.blocks());
            }
        }
        self.stats.allocations += 1;
        self.stats.runs += runs as u64;
        self.stats.blocks += pattern.len() as u64;
        Some(out)
    }

    /// Returns blocks to the free list, merging runs. Fails, freeing nothing of the failing run,
    /// on an id outside the allocator or a block that is already free.
    pub fn free(&mut self, blocks: &[BlockId]) -> Result<(), AllocatorError> {
        let mut i = 0;
        while i < blocks.len() {
            let start = blocks[i].0;
            let mut len = 1;
            while i + (len as usize) < blocks.len() && blocks[i + len as usize].0 == start + len {
                len += 1;
            }
            self.free_segment(Segment { start: blocks[i], len })?;
            i += len as usize;
        }
        Ok(())
    }

    /// Returns one run to the free list, merging it with free neighbours.
    pub fn free_segment(&mut self, seg: Segment) -> Result<(), AllocatorError> {
        if seg.len == 0 {
            return Ok(());
        }
        if seg.end() > self.num_blocks || seg.end() < seg.start.0 {
            return Err(AllocatorError::OutOfRange(BlockId(seg.end().saturating_sub(1).max(seg.start.0))));
        }
        let (mut start, mut len) = (seg.start.0, seg.len);
        if let Some((&ps, &pl)) = self.by_start.range(..=start).next_back() {
            if ps + pl > start {
                return Err(AllocatorError::NotAllocated(BlockId(start)));
            }
            if ps + pl == start {
                self.remove_run(ps, pl);
                start = ps;
                len += pl;
            }
        }
        let end = start + len;
        if let Some((&ns, &nl)) = self.by_start.range(seg.start.0..).next() {
            if ns < seg.end() {
                // Restore the predecessor we may have merged before reporting.
                if start != seg.start.0 {
                    self.insert_run(start, seg.start.0 - start);
                }
                return Err(AllocatorError::NotAllocated(BlockId(ns)));
            }
            if ns == end {
                self.remove_run(ns, nl);
                len += nl;
            }
        }
        self.insert_run(start, len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().copied().map(BlockId).collect()
    }

    #[test]
    fn fresh_allocator_hands_out_one_run() {
        let mut a = SegmentAllocator::new(16);
        assert_eq!(a.allocate(4), Some(ids(&[0, 1, 2, 3])));
        assert_eq!(a.allocate(20), None);
        assert_eq!(a.num_free(), 12);
        assert_eq!(a.stats().runs_per_allocation(), 1.0);
    }

    #[test]
    fn best_fit_then_longest_runs() {
        let mut a = SegmentAllocator::new(16);
        let all = a.allocate(16).expect("16 free");
        // Free runs of 3 (0..3), 2 (5..7) and 5 (10..15).
        a.free(&all[0..3]).expect("held");
        a.free(&all[5..7]).expect("held");
        a.free(&all[10..15]).expect("held");
        assert_eq!(a.num_free_runs(), 3);
        assert_eq!(a.allocate(2), Some(ids(&[5, 6])), "best fit picks the run of exactly 2");
        assert_eq!(a.allocate(7), Some(ids(&[10, 11, 12, 13, 14, 0, 1])), "longest first");
        a.free(&ids(&[14, 13, 12])).expect("held");
        assert_eq!(
            a.free_runs().collect::<Vec<_>>(),
            vec![Segment { start: BlockId(2), len: 1 }, Segment { start: BlockId(12), len: 3 }]
        );
        assert_eq!(a.free(&ids(&[12])), Err(AllocatorError::NotAllocated(BlockId(12))));
        assert_eq!(a.free(&ids(&[16])), Err(AllocatorError::OutOfRange(BlockId(16))));
    }

    #[test]
    fn aligned_allocation_reuses_ids_or_run_lengths() {
        let mut a = SegmentAllocator::new(32);
        let got = a.allocate_aligned(&ids(&[4, 5, 6, 20, 21])).expect("free");
        assert_eq!(got, ids(&[4, 5, 6, 20, 21]));
        let got = a.allocate_aligned(&ids(&[4, 5, 6])).expect("free");
        assert_eq!(count_runs(&got), 1, "same run length elsewhere: {got:?}");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Aligned(Vec<u32>),
        Free(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..12).prop_map(Op::Alloc),
            proptest::collection::vec(0u32..40, 0..8).prop_map(Op::Aligned),
            (any::<usize>(), 1usize..6).prop_map(|(i, n)| Op::Free(i, n)),
        ]
    }

    proptest! {
        /// Every block is free xor held, runs are maximal and disjoint, counts add up, and a
        /// request is one run whenever a free run was long enough.
        #[test]
        fn free_xor_held_and_runs_maximal(ops in proptest::collection::vec(op(), 1..150)) {
            const N: usize = 40;
            let mut a = SegmentAllocator::new(N);
            let mut held: Vec<Vec<BlockId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let longest = a.longest_free_run();
                        let free = a.num_free();
                        match a.allocate(n) {
                            Some(bs) => {
                                prop_assert_eq!(bs.len(), n);
                                if n <= longest { prop_assert!(count_runs(&bs) <= 1); }
                                held.push(bs);
                            }
                            None => prop_assert!(n > free),
                        }
                    }
                    Op::Aligned(p) => {
                        let mut p: Vec<BlockId> = p.into_iter().map(BlockId).collect();
                        p.dedup();
                        if let Some(bs) = a.allocate_aligned(&p) {
                            prop_assert_eq!(bs.len(), p.len());
                            held.push(bs);
                        }
                    }
                    Op::Free(i, n) => {
                        if !held.is_empty() {
                            let k = i % held.len();
                            let take = n.min(held[k].len());
                            let part: Vec<BlockId> = held[k].drain(..take).collect();
                            a.free(&part).expect("held blocks free");
                            prop_assert!(a.free(&part).is_err() || part.is_empty(), "double free is caught");
                            if held[k].is_empty() { held.swap_remove(k); }
                        }
                    }
                }
                let mut owner = [0u8; N];
                for bs in &held { for b in bs { owner[b.index()] += 1; } }
                for (i, &o) in owner.iter().enumerate() {
                    prop_assert!(o <= 1, "block {} held twice", i);
                    prop_assert_eq!(o == 0, a.is_free(BlockId(i as u32)), "block {}", i);
                }
                let runs: Vec<Segment> = a.free_runs().collect();
                for w in runs.windows(2) { prop_assert!(w[0].end() < w[1].start.0, "runs merged and disjoint"); }
                prop_assert_eq!(runs.iter().map(|s| s.len as usize).sum::<usize>(), a.num_free());
                prop_assert_eq!(a.num_free() + held.iter().map(Vec::len).sum::<usize>(), N);
            }
        }
    }
}
