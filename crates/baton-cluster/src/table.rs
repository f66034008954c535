//! The embedded registry's pure core: a membership table that applies commands and expires
//! leases at a time the caller passes in. No I/O, no clock, no tasks, so every rule is tested
//! without sleeping.
//!
//! A member's lease expires when `now >= last heartbeat + ttl`; [`MembershipTable::next_deadline`]
//! tells the owning task when to call [`MembershipTable::expire`] next.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::types::{ClusterError, LeftReason, MembershipEvent, WorkerId, WorkerInfo};

/// Shortest lease TTL the registry accepts.
pub const MIN_TTL: Duration = Duration::from_millis(100);
/// Longest lease TTL the registry accepts.
pub const MAX_TTL: Duration = Duration::from_secs(3600);
/// How many recent departures the table remembers (remote watchers read their reasons).
pub const DEPARTED_LOG: usize = 256;

/// A registration's lease: proof, with the worker id, that a heartbeat or deregistration comes
/// from the holder of the registration and not from an older incarnation of the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub u64);

/// Something a worker asks of the registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Join with `info`, kept alive by heartbeats at least every `ttl`.
    Register {
        /// Who is joining.
        info: WorkerInfo,
        /// Lease length.
        ttl: Duration,
        /// The lease id the caller chose for this registration (unique).
        lease: LeaseId,
    },
    /// Renew a lease.
    Heartbeat {
        /// The member.
        worker: WorkerId,
        /// Its lease.
        lease: LeaseId,
    },
    /// Leave on purpose.
    Deregister {
        /// The member.
        worker: WorkerId,
        /// Its lease.
        lease: LeaseId,
    },
}

#[derive(Clone, Debug)]
struct Member {
    info: WorkerInfo,
    lease: LeaseId,
    ttl: Duration,
    deadline: Duration,
}

/// Live members and their leases. Time is a `Duration` since an epoch the owner picks.
#[derive(Debug, Default)]
pub struct MembershipTable {
    members: BTreeMap<WorkerId, Member>,
    leases: HashMap<LeaseId, WorkerId>,
    departed: VecDeque<(WorkerId, LeftReason)>,
}

impl MembershipTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies `command` at time `now`; returns the membership events it caused (in order).
    ///
    /// Registering an id that is already a live member is refused (`DuplicateWorker`): a
    /// restarted worker waits for its old lease to expire or deregisters it first. A heartbeat
    /// or deregistration whose lease does not match the member's is `UnknownLease`.
    pub fn apply(&mut self, command: Command, now: Duration) -> Result<Vec<MembershipEvent>, ClusterError> {
        match command {
            Command::Register { info, ttl, lease } => {
                if !(MIN_TTL..=MAX_TTL).contains(&ttl) {
                    return Err(ClusterError::InvalidTtl(format!("{ttl:?} is outside {MIN_TTL:?}..={MAX_TTL:?}")));
                }
                if self.members.contains_key(&info.id) {
                    return Err(ClusterError::DuplicateWorker(info.id));
                }
                if self.leases.contains_key(&lease) {
                    return Err(ClusterError::Protocol(format!("lease id {} is already in use", lease.0)));
                }
                self.leases.insert(lease, info.id.clone());
                let member = Member { info: info.clone(), lease, ttl, deadline: now + ttl };
                self.members.insert(info.id.clone(), member);
                Ok(vec![MembershipEvent::Joined(info)])
            }
            Command::Heartbeat { worker, lease } => {
                let member = self.member_with_lease(&worker, lease)?;
                member.deadline = member.deadline.max(now + member.ttl);
                Ok(Vec::new())
            }
            Command::Deregister { worker, lease } => {
                self.member_with_lease(&worker, lease)?;
                Ok(vec![self.remove(&worker, LeftReason::Deregistered)])
            }
        }
    }

    /// Removes every member whose lease ran out by `now`; returns their `Left(LeaseExpired)`
    /// events, earliest deadline first.
    pub fn expire(&mut self, now: Duration) -> Vec<MembershipEvent> {
        let mut expired: Vec<(Duration, WorkerId)> =
            self.members.values().filter(|m| m.deadline <= now).map(|m| (m.deadline, m.info.id.clone())).collect();
        expired.sort();
        expired.into_iter().map(|(_, id)| self.remove(&id, LeftReason::LeaseExpired)).collect()
    }

    /// The earliest lease deadline, when there is a member.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.members.values().map(|m| m.deadline).min()
    }

    /// Live members, ordered by id.
    pub fn members(&self) -> Vec<WorkerInfo> {
        self.members.values().map(|m| m.info.clone()).collect()
    }

    /// The most recent departures (at most [`DEPARTED_LOG`]), oldest first.
    pub fn departed(&self) -> Vec<(WorkerId, LeftReason)> {
        self.departed.iter().cloned().collect()
    }

    /// One `Joined` per live member: what a new watcher receives first.
    pub fn snapshot_events(&self) -> Vec<MembershipEvent> {
        self.members.values().map(|m| MembershipEvent::Joined(m.info.clone())).collect()
    }

    fn member_with_lease(&mut self, worker: &WorkerId, lease: LeaseId) -> Result<&mut Member, ClusterError> {
        match self.members.get_mut(worker) {
            Some(member) if member.lease == lease => Ok(member),
            _ => Err(ClusterError::UnknownLease(worker.clone())),
        }
    }

    fn remove(&mut self, worker: &WorkerId, reason: LeftReason) -> MembershipEvent {
        if let Some(member) = self.members.remove(worker) {
            self.leases.remove(&member.lease);
        }
        if self.departed.len() == DEPARTED_LOG {
            self.departed.pop_front();
        }
        self.departed.push_back((worker.clone(), reason));
        MembershipEvent::Left(worker.clone(), reason)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::types::{KvSummary, Role};

    pub(crate) fn info(id: &str, role: Role) -> WorkerInfo {
        WorkerInfo {
            id: WorkerId::new(id).expect("valid id"),
            role,
            control_url: format!("http://127.0.0.1:9000/{id}"),
            kv_addr: "127.0.0.1:9100".into(),
            model: "tiny".into(),
            kv: KvSummary { num_layers: 2, num_kv_heads: 2, head_dim: 8, block_tokens: 16, dtype: "f32".into() },
            capacity_blocks: 64,
            started_at_ms: 1,
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn register(t: &mut MembershipTable, id: &str, lease: u64, ttl: u64, now: u64) -> Vec<MembershipEvent> {
        t.apply(Command::Register { info: info(id, Role::Prefill), ttl: secs(ttl), lease: LeaseId(lease) }, secs(now))
            .expect("register")
    }

    fn wid(id: &str) -> WorkerId {
        WorkerId::new(id).expect("valid id")
    }

    #[test]
    fn join_heartbeat_expire_and_deregister() {
        let mut t = MembershipTable::new();
        assert_eq!(register(&mut t, "p0", 1, 2, 0), vec![MembershipEvent::Joined(info("p0", Role::Prefill))]);
        register(&mut t, "p1", 2, 2, 0);
        assert_eq!(t.next_deadline(), Some(secs(2)));

        // p0 heartbeats at 1.5 s; at 2 s only p1 has run out.
        t.apply(Command::Heartbeat { worker: wid("p0"), lease: LeaseId(1) }, Duration::from_millis(1500))
            .expect("heartbeat");
        assert!(t.expire(Duration::from_millis(1999)).is_empty());
        assert_eq!(t.expire(secs(2)), vec![MembershipEvent::Left(wid("p1"), LeftReason::LeaseExpired)]);
        assert_eq!(t.next_deadline(), Some(Duration::from_millis(3500)));

        // A heartbeat for the expired lease is refused; the worker must register again.
        assert!(matches!(
            t.apply(Command::Heartbeat { worker: wid("p1"), lease: LeaseId(2) }, secs(2)),
            Err(ClusterError::UnknownLease(_))
        ));
        assert_eq!(
            t.apply(Command::Deregister { worker: wid("p0"), lease: LeaseId(1) }, secs(3)).expect("deregister"),
            vec![MembershipEvent::Left(wid("p0"), LeftReason::Deregistered)]
        );
        assert!(t.members().is_empty());
        assert_eq!(t.next_deadline(), None);
        assert_eq!(t.departed(), vec![(wid("p1"), LeftReason::LeaseExpired), (wid("p0"), LeftReason::Deregistered)]);
    }

    #[test]
    fn duplicates_stale_leases_and_bad_ttls_are_refused() {
        let mut t = MembershipTable::new();
        register(&mut t, "d0", 7, 5, 0);
        let dup =
            t.apply(Command::Register { info: info("d0", Role::Decode), ttl: secs(5), lease: LeaseId(8) }, secs(1));
        assert!(matches!(dup, Err(ClusterError::DuplicateWorker(_))));
        let wrong_lease = t.apply(Command::Deregister { worker: wid("d0"), lease: LeaseId(8) }, secs(1));
        assert!(matches!(wrong_lease, Err(ClusterError::UnknownLease(_))));
        for ttl in [Duration::ZERO, Duration::from_millis(99), MAX_TTL + Duration::from_millis(1)] {
            let r = t.apply(Command::Register { info: info("x", Role::Decode), ttl, lease: LeaseId(9) }, secs(1));
            assert!(matches!(r, Err(ClusterError::InvalidTtl(_))), "{ttl:?}");
        }
        // After expiry the id is free again, under a new lease.
        assert_eq!(t.expire(secs(5)).len(), 1);
        register(&mut t, "d0", 10, 5, 5);
        assert_eq!(t.snapshot_events().len(), 1);
    }

    #[test]
    fn expiry_order_follows_deadlines() {
        let mut t = MembershipTable::new();
        register(&mut t, "b", 1, 3, 0);
        register(&mut t, "a", 2, 2, 0);
        register(&mut t, "c", 3, 1, 0);
        let left: Vec<_> = t
            .expire(secs(10))
            .into_iter()
            .map(|e| match e {
                MembershipEvent::Left(id, LeftReason::LeaseExpired) => id.to_string(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(left, ["c", "a", "b"]);
    }
}
