//! Moving cached blocks between tiers: swap-out (the coldest device blocks down to the next
//! slower tier) and swap-in (held blocks back onto the device), each in two halves so that the
//! copies can run between them, on another thread for a swap-in ([`SwapCopier`]). A half
//! reserves its destination slots (owned by the swap until it ends); the other copies, moves
//! the index and gives back what it did not use.

use super::*;

/// A swap that has reserved its destination slots but not yet copied (see
/// [`MemPool::begin_swap_out`]). Must be given back to [`MemPool::finish_swap`].
#[derive(Debug)]
#[must_use = "a swap job holds slots until it is finished"]
pub struct SwapJob {
    moves: Vec<SwapMove>,
}

impl SwapJob {
    /// Blocks the job moves.
    pub fn len(&self) -> usize {
        self.moves.len()
    }

    /// Whether the job moves nothing.
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty()
    }
}

/// A swap-in that has reserved its device slots but not yet copied (see
/// [`MemPool::begin_swap_in`]): the copies are the caller's (a copier thread's, through a
/// [`SwapCopier`]), then the job goes back to [`MemPool::finish_swap_in`], or to
/// [`MemPool::abort_swap_in`].
#[derive(Debug)]
#[must_use = "a swap-in holds device slots and references until it is finished or aborted"]
pub struct SwapIn {
    addrs: Vec<KvAddr>,
    /// Per address, the device slot it is copied to (`None`: on the device already).
    dst: Vec<Option<BlockId>>,
}

impl SwapIn {
    /// The copies to make, slower tier slot → device block, before the job is finished.
    pub fn copies(&self) -> Vec<(Loc, BlockId)> {
        self.addrs.iter().zip(&self.dst).filter_map(|(a, d)| d.map(|d| (a.loc, d))).collect()
    }

    /// Blocks the job brings onto the device (the copies).
    pub fn lower(&self) -> usize {
        self.dst.iter().flatten().count()
    }
}

/// Copies blocks from the host and disk tiers onto reserved device slots from another thread:
/// its own mappings of the device and host arenas and its own descriptor of the disk file
/// ([`MemPool::swap_copier`]). It writes only the device slots a [`SwapIn`] reserved and reads
/// only slots the job holds references on, so the engine's thread may go on using every other
/// block meanwhile.
#[derive(Debug)]
pub struct SwapCopier {
    device: KvArena,
    host: Option<KvArena>,
    disk: Option<DiskStore>,
    checker: super::check::Checker,
}

impl SwapCopier {
    /// Copies slot `from` (host or disk) onto device block `to`, checking the block against
    /// its slot's checksum: `Corrupt` when it fails (counted, and dropped from the index when
    /// the swap-in is given back to [`MemPool::abort_swap_in`]).
    pub fn copy(&mut self, from: Loc, to: BlockId) -> Result<(), PoolError> {
        match (from.tier, &self.host, &self.disk) {
            (Tier::Host, Some(host), _) => self.device.copy_blocks_from(host, &[from.block], &[to]),
            (Tier::Disk, _, Some(disk)) => {
                let ranges = self.device.descriptor().byte_ranges(&[to]);
                disk.read_block(from.block, self.device.as_bytes_mut(), &ranges)?;
            }
            _ => return Err(PoolError::Config(format!("no {} tier to copy from", from.tier))),
        }
        let to = Loc { tier: Tier::Device, block: to };
        self.checker.after_copy(from, to, super::check::Copied::Into(&self.device), true)
    }
}

#[derive(Debug, Clone, Copy)]
struct SwapMove {
    node: NodeId,
    generation: u32,
    from: Loc,
    to: Loc,
}

impl MemPool {
    /// MemServe `swap_out`: moves up to `n` of the coldest evictable device blocks to the next
    /// slower tier, with real copies. Returns the blocks moved.
    ///
    /// A chain of cached blocks leaves the device deepest block first (a block never sits
    /// below a slower one), so this runs swap rounds until `n` moved or nothing can.
    pub fn swap_out(&mut self, n: usize, now: u64) -> Result<usize, PoolError> {
        let mut moved = 0;
        while moved < n {
            let job = self.begin_swap_out(n - moved, now)?;
            if job.is_empty() {
                break;
            }
            let round = self.finish_swap(job)?;
            if round == 0 {
                break;
            }
            moved += round;
        }
        Ok(moved)
    }

    /// First half of [`swap_out`](Self::swap_out): picks up to `n` victims, marks them moving
    /// and reserves their destination slots, which the job owns until
    /// [`finish_swap`](Self::finish_swap). Meanwhile the blocks stay readable and matchable;
    /// one that gets referenced, gains a device child or is deleted in between is not moved.
    pub fn begin_swap_out(&mut self, n: usize, now: u64) -> Result<SwapJob, PoolError> {
        self.tick(now);
        let mut moves = Vec::new();
        let Some(lower) = self.next_lower(Tier::Device) else { return Ok(SwapJob { moves }) };
        for _ in 0..n {
            let Some(v) = self.tiers[0].policy.victim() else { break };
            // Pin the victim first: making room below must not pick it.
            self.set_in_flight(v, true);
            self.refresh(v);
            if self.make_room(lower, 1).is_err() {
                self.set_in_flight(v, false);
                self.refresh(v);
                break;
            }
            let to = self.tiers[lower.index()].alloc.allocate(1).expect("room was made")[0];
            self.tiers[lower.index()].owner[to.index()] = SWAP_OWNER;
            let node = &self.index.nodes[v.index()];
            moves.push(SwapMove {
                node: v,
                generation: node.generation,
                from: node.loc,
                to: Loc { tier: lower, block: to },
            });
        }
        Ok(SwapJob { moves })
    }

    /// Second half of a swap: copies each block that may still move and points the index at
    /// its new slot; releases the rest. Returns the blocks moved.
    pub fn finish_swap(&mut self, job: SwapJob) -> Result<usize, PoolError> {
        let mut moved = 0;
        let mut first_err = None;
        for m in job.moves {
            let t = &mut self.tiers[m.to.tier.index()];
            t.owner[m.to.block.index()] = NO_OWNER;
            let live = self.index.is_live(m.node, m.generation) && self.index.nodes[m.node.index()].loc == m.from;
            if live {
                self.set_in_flight(m.node, false);
                if self.eligible(m.node) && first_err.is_none() {
                    match self.copy(m.from, m.to) {
                        Ok(()) => {
                            self.retarget(m.node, m.to);
                            moved += 1;
                            continue;
                        }
                        Err(e) => first_err = Some(e),
                    }
                }
                self.refresh(m.node);
            }
            self.tiers[m.to.tier.index()].alloc.free(&[m.to.block])?;
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    /// MemServe `swap_in`: brings the given held blocks onto the device tier with real copies
    /// and returns their device ids in order; the caller's reference moves with each block.
    /// A cached block only the caller holds moves in the index too; one that others hold is
    /// copied to a private device block. Device addresses pass through unchanged.
    ///
    /// A block that fails its checksum is dropped from the index (with what is cached below
    /// it) and the call fails with `Corrupt`, the caller's references dropped.
    pub fn swap_in(&mut self, addrs: &[KvAddr]) -> Result<Vec<BlockId>, PoolError> {
        let job = self.begin_swap_in(addrs)?;
        for (from, to) in job.copies() {
            if let Err(e) = self.copy(from, Self::dev(to)) {
                let corrupt = matches!(e, PoolError::Corrupt(_)).then(|| self.node_at(from)).flatten();
                self.abort_swap_in(job)?;
                if let Some(node) = corrupt {
                    self.drop_corrupt(node);
                }
                return Err(e);
            }
        }
        self.finish_swap_in(job)
    }

    /// First half of [`swap_in`](Self::swap_in): checks that the caller holds `addrs` and
    /// reserves a device slot for each one on a slower tier (making room as eviction does);
    /// the job owns those slots, and the caller's references keep the sources where they are,
    /// until [`finish_swap_in`](Self::finish_swap_in) (after the job's copies) or
    /// [`abort_swap_in`](Self::abort_swap_in).
    pub fn begin_swap_in(&mut self, addrs: &[KvAddr]) -> Result<SwapIn, PoolError> {
        for a in addrs {
            self.own(*a)?;
            if self.ref_count(a.loc) == 0 {
                return Err(PoolError::NotHeld(*a));
            }
        }
        let lower = addrs.iter().filter(|a| a.loc.tier != Tier::Device).count();
        self.make_room(Tier::Device, lower)?;
        let mut dst = Vec::with_capacity(addrs.len());
        for a in addrs {
            if a.loc.tier == Tier::Device {
                dst.push(None);
                continue;
            }
            let d = self.tiers[0].alloc.allocate(1).expect("room was made")[0];
            self.tiers[0].owner[d.index()] = SWAP_OWNER;
            dst.push(Some(d));
        }
        Ok(SwapIn { addrs: addrs.to_vec(), dst })
    }

    /// Second half of a swap-in whose copies are made: returns the device blocks in order, the
    /// caller's reference on each. A cached block only the caller holds moves in the index to
    /// its device copy; one that others hold (or that left the index meanwhile) keeps its slot,
    /// and the caller holds a private device copy.
    pub fn finish_swap_in(&mut self, job: SwapIn) -> Result<Vec<BlockId>, PoolError> {
        let mut out = Vec::with_capacity(job.addrs.len());
        for (a, d) in job.addrs.iter().zip(job.dst) {
            let Some(d) = d else {
                out.push(a.loc.block);
                continue;
            };
            self.tiers[0].owner[d.index()] = NO_OWNER;
            let owner = self.owner(a.loc);
            let movable = owner < SWAP_OWNER && {
                let node = &self.index.nodes[owner as usize];
                !node.in_flight
                    && self.ref_count(a.loc) == 1
                    && (node.parent == NO_OWNER || self.index.nodes[node.parent as usize].loc.tier == Tier::Device)
            };
            if movable {
                self.retarget(NodeId(owner), Self::dev(d));
            } else {
                self.tiers[0].refs[d.index()] = 1;
                self.drop_ref(a.loc)?;
            }
            out.push(d);
        }
        Ok(out)
    }

    /// Gives up a swap-in: its device slots go back to the free list and the caller's
    /// references on its blocks are dropped. Blocks the copier found corrupt leave the index,
    /// with everything cached below them.
    pub fn abort_swap_in(&mut self, job: SwapIn) -> Result<(), PoolError> {
        let locs: Vec<Loc> = job.addrs.iter().map(|a| a.loc).collect();
        let corrupt = self.reported_corrupt(&locs);
        for d in job.dst.iter().flatten() {
            self.tiers[0].owner[d.index()] = NO_OWNER;
            self.tiers[0].alloc.free(&[*d])?;
        }
        self.free_mem(&job.addrs)?;
        for node in corrupt {
            self.drop_corrupt(node);
        }
        Ok(())
    }

    /// A copier for swap-ins on another thread (see [`SwapCopier`]); fails when an arena is in
    /// private memory.
    pub fn swap_copier(&self) -> Result<SwapCopier, PoolError> {
        let view = |store: &Store| -> Result<Option<KvArena>, PoolError> {
            match store {
                Store::Arena(a) => Ok(Some(a.shared_view()?)),
                _ => Ok(None),
            }
        };
        let device = view(&self.tiers[0].store)?.ok_or_else(|| PoolError::Config("no device arena".into()))?;
        let host = view(&self.tiers[1].store)?;
        let disk = match &self.tiers[2].store {
            Store::Disk(d) => Some(d.try_clone()?),
            _ => None,
        };
        Ok(SwapCopier { device, host, disk, checker: self.checker.clone() })
    }
}
