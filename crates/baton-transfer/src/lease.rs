//! Leases on the blocks a prefill side holds for transfers, pure: time comes in as an argument
//! (milliseconds on any monotonic clock) and releases come out as values for the shell to hand
//! to the blocks' owner.
//!
//! A lease is created when the prefill side offers a request's blocks (pull) or starts writing
//! them (push), renewed when a decode side opens the transfer, and ends exactly once: on
//! COMPLETE ([`ReleaseReason::Completed`]), when its deadline passes
//! ([`ReleaseReason::Expired`]), or when the owner cancels it. A read or COMPLETE after the end
//! is an error, so data read from released blocks is never accepted.

use std::collections::{HashMap, HashSet, VecDeque};

use baton_kv::BlockId;

use crate::TransferId;

/// Why a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// The decode side sent COMPLETE: it has the data.
    Completed,
    /// No COMPLETE before the deadline.
    Expired,
    /// The owner withdrew the offer.
    Cancelled,
}

/// Blocks handed back to their owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// The transfer.
    pub id: TransferId,
    /// The blocks the lease held, as offered.
    pub blocks: Vec<BlockId>,
    /// Why.
    pub reason: ReleaseReason,
}

/// Lease operations that are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// No such lease and none recently ended.
    #[error("no lease for transfer {0}")]
    Unknown(TransferId),
    /// The lease ran out and its blocks were released.
    #[error("the lease of transfer {0} expired; its blocks were released")]
    Expired(TransferId),
    /// An id offered twice.
    #[error("transfer {0} is already leased")]
    Duplicate(TransferId),
    /// A transfer names blocks the lease does not hold.
    #[error("transfer {id} names {block}, which its lease does not hold")]
    NotLeased {
        /// The transfer.
        id: TransferId,
        /// The block.
        block: BlockId,
    },
}

#[derive(Debug, Clone)]
struct Lease {
    blocks: Vec<BlockId>,
    deadline: u64,
    ttl: u64,
}

/// How many ended ids are remembered, to tell "expired" from "never existed".
const REMEMBERED: usize = 4096;

/// The live leases of one prefill side.
#[derive(Debug, Default)]
pub struct LeaseTable {
    live: HashMap<TransferId, Lease>,
    expired: HashSet<TransferId>,
    expired_order: VecDeque<TransferId>,
}

impl LeaseTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Holds `blocks` for transfer `id` until `now + ttl` (renewed by [`open`](Self::open)).
    pub fn offer(&mut self, id: TransferId, blocks: Vec<BlockId>, now: u64, ttl: u64) -> Result<(), LeaseError> {
        if self.live.contains_key(&id) {
            return Err(LeaseError::Duplicate(id));
        }
        self.forget(id);
        self.live.insert(id, Lease { blocks, deadline: now.saturating_add(ttl), ttl });
        Ok(())
    }

    /// A decode side opens the transfer reading `blocks` (all held by the lease); renews it.
    pub fn open(&mut self, id: TransferId, blocks: &[BlockId], now: u64) -> Result<(), LeaseError> {
        let lease = self.live_lease(id, now)?;
        if let Some(&block) = blocks.iter().find(|b| !lease.blocks.contains(b)) {
            return Err(LeaseError::NotLeased { id, block });
        }
        if let Some(l) = self.live.get_mut(&id) {
            l.deadline = now.saturating_add(l.ttl);
        }
        Ok(())
    }

    /// The blocks of a live lease (reads check this before serving bytes).
    pub fn blocks(&self, id: TransferId, now: u64) -> Result<&[BlockId], LeaseError> {
        Ok(&self.live_lease(id, now)?.blocks)
    }

    fn live_lease(&self, id: TransferId, now: u64) -> Result<&Lease, LeaseError> {
        match self.live.get(&id) {
            Some(l) if l.deadline > now => Ok(l),
            Some(_) => Err(LeaseError::Expired(id)),
            None if self.expired.contains(&id) => Err(LeaseError::Expired(id)),
            None => Err(LeaseError::Unknown(id)),
        }
    }

    /// COMPLETE: ends a live lease. Refused (and the blocks are left to [`expire`](Self::expire))
    /// when the deadline has passed, so a successful COMPLETE proves the blocks were held for the
    /// whole transfer.
    pub fn complete(&mut self, id: TransferId, now: u64) -> Result<Release, LeaseError> {
        self.live_lease(id, now)?;
        let lease = self.live.remove(&id).ok_or(LeaseError::Unknown(id))?;
        Ok(Release { id, blocks: lease.blocks, reason: ReleaseReason::Completed })
    }

    /// The owner withdraws an offer.
    pub fn cancel(&mut self, id: TransferId) -> Option<Release> {
        let lease = self.live.remove(&id)?;
        Some(Release { id, blocks: lease.blocks, reason: ReleaseReason::Cancelled })
    }

    /// Ends every lease whose deadline is at or before `now`.
    pub fn expire(&mut self, now: u64) -> Vec<Release> {
        let due: Vec<TransferId> = self.live.iter().filter(|(_, l)| l.deadline <= now).map(|(&id, _)| id).collect();
        let mut out = Vec::with_capacity(due.len());
        for id in due {
            if let Some(lease) = self.live.remove(&id) {
                self.remember(id);
                out.push(Release { id, blocks: lease.blocks, reason: ReleaseReason::Expired });
            }
        }
        out.sort_by_key(|r| r.id);
        out
    }

    /// The earliest deadline, if any lease is live.
    pub fn next_deadline(&self) -> Option<u64> {
        self.live.values().map(|l| l.deadline).min()
    }

    /// Live leases.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no lease is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    fn remember(&mut self, id: TransferId) {
        if self.expired.insert(id) {
            self.expired_order.push_back(id);
            if self.expired_order.len() > REMEMBERED
                && let Some(old) = self.expired_order.pop_front()
            {
                self.expired.remove(&old);
            }
        }
    }

    fn forget(&mut self, id: TransferId) {
        if self.expired.remove(&id) {
            self.expired_order.retain(|&x| x != id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn b(v: &[u32]) -> Vec<BlockId> {
        v.iter().copied().map(BlockId).collect()
    }

    #[test]
    fn complete_within_lease_releases_once() {
        let mut t = LeaseTable::new();
        t.offer(TransferId(1), b(&[1, 2]), 0, 100).expect("offer");
        t.open(TransferId(1), &b(&[2]), 50).expect("open renews to 150");
        let r = t.complete(TransferId(1), 120).expect("still live");
        assert_eq!((r.blocks, r.reason), (b(&[1, 2]), ReleaseReason::Completed));
        assert_eq!(t.complete(TransferId(1), 121), Err(LeaseError::Unknown(TransferId(1))));
        assert!(t.expire(1000).is_empty());
    }

    #[test]
    fn after_expiry_reads_and_complete_are_errors() {
        let mut t = LeaseTable::new();
        t.offer(TransferId(1), b(&[1]), 0, 100).expect("offer");
        assert_eq!(t.blocks(TransferId(1), 100), Err(LeaseError::Expired(TransferId(1))));
        assert_eq!(t.complete(TransferId(1), 100), Err(LeaseError::Expired(TransferId(1))));
        let released = t.expire(100);
        assert_eq!(released.len(), 1);
        assert_eq!(released[0].reason, ReleaseReason::Expired);
        assert_eq!(t.open(TransferId(1), &[], 101), Err(LeaseError::Expired(TransferId(1))));
    }

    #[test]
    fn open_checks_blocks() {
        let mut t = LeaseTable::new();
        t.offer(TransferId(3), b(&[1]), 0, 10).expect("offer");
        assert!(matches!(t.open(TransferId(3), &b(&[2]), 1), Err(LeaseError::NotLeased { .. })));
        assert_eq!(t.offer(TransferId(3), b(&[4]), 1, 10), Err(LeaseError::Duplicate(TransferId(3))));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Offer(u8, u8),
        Open(u8),
        Complete(u8),
        Cancel(u8),
        Tick(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..8, 1u8..4).prop_map(|(i, n)| Op::Offer(i, n)),
            (0u8..8).prop_map(Op::Open),
            (0u8..8).prop_map(Op::Complete),
            (0u8..8).prop_map(Op::Cancel),
            (0u8..30).prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Under random operations every offered block is released exactly once (or is still
        /// leased), and a COMPLETE succeeds only before the lease's deadline.
        #[test]
        fn every_lease_ends_exactly_once(ops in proptest::collection::vec(op(), 1..200)) {
            let mut t = LeaseTable::new();
            let mut now = 0u64;
            let mut next_block = 0u32;
            let mut held: HashMap<TransferId, (Vec<BlockId>, u64)> = HashMap::new();
            let mut released: Vec<BlockId> = Vec::new();
            let mut offered: Vec<BlockId> = Vec::new();
            for op in ops {
                match op {
                    Op::Offer(i, n) => {
                        let blocks: Vec<BlockId> = (0..n as u32).map(|k| BlockId(next_block + k)).collect();
                        let ok = t.offer(TransferId(i as u64), blocks.clone(), now, 20).is_ok();
                        prop_assert_eq!(ok, !held.contains_key(&TransferId(i as u64)));
                        if ok {
                            next_block += n as u32;
                            offered.extend(&blocks);
                            held.insert(TransferId(i as u64), (blocks, now + 20));
                        }
                    }
                    Op::Open(i) => {
                        if t.open(TransferId(i as u64), &[], now).is_ok() {
                            let h = held.get_mut(&TransferId(i as u64));
                            prop_assert!(h.as_ref().is_some_and(|h| h.1 > now));
                            if let Some(h) = h { h.1 = now + 20; }
                        }
                    }
                    Op::Complete(i) => {
                        if let Ok(r) = t.complete(TransferId(i as u64), now) {
                            let h = held.remove(&r.id);
                            prop_assert!(h.as_ref().is_some_and(|h| h.1 > now), "complete after deadline");
                            released.extend(r.blocks);
                        }
                    }
                    Op::Cancel(i) => {
                        if let Some(r) = t.cancel(TransferId(i as u64)) {
                            held.remove(&r.id);
                            released.extend(r.blocks);
                        }
                    }
                    Op::Tick(dt) => {
                        now += dt as u64;
                        for r in t.expire(now) {
                            let h = held.remove(&r.id);
                            prop_assert!(h.is_some_and(|h| h.1 <= now));
                            released.extend(r.blocks);
                        }
                    }
                }
                prop_assert_eq!(t.len(), held.len());
            }
            let mut all: Vec<BlockId> = released;
            all.extend(held.values().flat_map(|h| h.0.iter().copied()));
            all.sort();
            offered.sort();
            prop_assert_eq!(all, offered);
        }
    }
}
