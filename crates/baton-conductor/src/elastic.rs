//! Elastic prefill/decode (`--elastic`): the conductor switches workers' roles as FlowKV's
//! load-aware policy decides (§3.3), live.
//!
//! [`Elastic`] is the pure core: given the conductor's [`ClusterSnapshot`] (built from the
//! workers' load reports and the conductor's ledger, as the routing policies' is, with the
//! controller's own cost profile: [`Elastic::cost`]) it answers which worker
//! should switch to which role, if any. baton-sched's [`LoadAware::rebalance`] makes the call —
//! one pool over its high watermark while the other is under its low one, for the whole
//! hysteresis (`hold`), with a pause of `hold` after a switch and at least `min_per_role`
//! workers left in each role, a worker the idle role cannot spare becoming colocated (so one
//! prefill and one decode worker can be elastic too), and with none left to spare a worker of
//! the busy role becoming colocated as well — and [`Elastic`] adds a cap on switches per minute, so a
//! mis-tuned watermark can never make the cluster flap. The conductor's loop
//! ([`crate::Conductor::with_elastic`]) carries a decision out with [`crate::Worker::set_role`]:
//! the worker is routed as its new role from then on while what it holds runs to its end (its
//! engine prefills and decodes alike), so nothing is dropped and no KV is left behind.

use std::collections::VecDeque;
use std::time::Duration;

use baton_protocol::Role;
use baton_sched::{ClusterSnapshot, CostProfile, LoadAware, LoadAwareConfig, Micros, Policy};

/// Settings of elastic role switching.
#[derive(Debug, Clone)]
pub struct ElasticConfig {
    /// Watermarks, SLOs, hysteresis (`persist_us`) and the least workers per role.
    pub policy: LoadAwareConfig,
    /// At most this many switches in any minute.
    pub max_per_minute: usize,
    /// How often the conductor looks when no request arrives (it also looks after each one).
    pub interval: Duration,
    /// The cost model that turns queued work into time.
    pub cost: CostProfile,
}

impl ElasticConfig {
    /// Defaults with these SLOs and this hysteresis.
    pub fn new(cost: CostProfile, ttft_slo_us: Micros, tbt_slo_us: Micros, hold: Duration) -> Self {
        let policy = LoadAwareConfig {
            ttft_slo_us,
            tbt_slo_us,
            persist_us: hold.as_micros().try_into().unwrap_or(Micros::MAX),
            ..LoadAwareConfig::default()
        };
        Self { policy, max_per_minute: 2, interval: Duration::from_millis(250), cost }
    }
}

/// SLOs for a cluster whose operator named none, from the cost profile its workers run on: a
/// TBT target three times the decode step of one short request (the weights read once: 19.4 ms
/// for a 70B model on 8×H100), and a TTFT target of four 2,048-token prefills, at least a second.
/// Returns (TTFT, TBT) in microseconds.
pub fn default_slos(cost: &CostProfile) -> (Micros, Micros) {
    let ttft = (4 * cost.prefill_time(2048, 0.0)).max(1_000_000);
    let tbt = 3 * cost.decode_step(1, 0);
    (ttft, tbt.max(1))
}

/// A switch to carry out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Switch {
    /// The worker's position in the snapshot's instances.
    pub worker: usize,
    /// Its role now.
    pub from: Role,
    /// Its role to be.
    pub to: Role,
}

/// The decision side of elastic role switching (no I/O).
#[derive(Debug)]
pub struct Elastic {
    policy: LoadAware,
    config: ElasticConfig,
    /// When the switches of the last minute were made.
    recent: VecDeque<Micros>,
    /// The pools' mean loads at the last look (prefill, decode; 1.0 = at the SLO).
    loads: (f64, f64),
}

const MINUTE_US: Micros = 60_000_000;

impl Elastic {
    /// A controller with these settings.
    pub fn new(config: ElasticConfig) -> Self {
        Self { policy: LoadAware::new(config.policy), config, recent: VecDeque::new(), loads: (0.0, 0.0) }
    }

    /// The cost model that turns queued work into time: the snapshot [`decide`](Self::decide)
    /// reads is built with it.
    pub fn cost(&self) -> &CostProfile {
        &self.config.cost
    }

    /// How often to look.
    pub fn interval(&self) -> Duration {
        self.config.interval
    }

    /// The prefill and decode pools' mean loads at the last look, as the policy weighs them
    /// against its watermarks (queued prefill time over the TTFT target; decode step time over
    /// the TBT target, or KV memory in use if higher, plus waiting requests per running one).
    pub fn loads(&self) -> (f64, f64) {
        self.loads
    }

    /// Whether a worker should switch now, and which. Rebalancing reads no prompt tree.
    pub fn decide(&mut self, snapshot: &ClusterSnapshot<'_>) -> Option<Switch> {
        let now = snapshot.now;
        while self.recent.front().is_some_and(|&t| t + MINUTE_US <= now) {
            self.recent.pop_front();
        }
        self.loads = self.policy.pool_loads(snapshot);
        let change = self.policy.rebalance(snapshot)?;
        if self.recent.len() >= self.config.max_per_minute {
            return None;
        }
        let worker = snapshot.instances.iter().position(|i| i.id == change.instance)?;
        self.recent.push_back(now);
        Some(Switch { worker, from: snapshot.instances[worker].role, to: change.to })
    }

    /// The last switch [`decide`](Self::decide) asked for did not happen (the worker did not
    /// answer in time, or refused): it does not count toward the cap per minute.
    pub fn switch_failed(&mut self) {
        self.recent.pop_back();
    }
}

#[cfg(test)]
mod tests {
    use baton_sched::GlobalPromptTrees;

    use super::*;
    use crate::loads::WorkerFigures;

    fn view(index: usize, role: Role, prefilling: Vec<(u64, usize)>) -> WorkerFigures {
        WorkerFigures { prefilling, capacity_blocks: 1000, ..WorkerFigures::new(index as u32, role, 0) }
    }

    /// The conductor's ledger at some instant.
    struct Snapshot {
        workers: Vec<WorkerFigures>,
        now_us: u64,
    }

    impl Elastic {
        /// A look at the ledger, as the conductor takes it: the snapshot built with the
        /// controller's cost profile, over no prompt trees.
        fn look(&mut self, snapshot: &Snapshot) -> Option<Switch> {
            let loads: Vec<_> = snapshot.workers.iter().map(|w| w.clone().load(self.cost(), snapshot.now_us)).collect();
            let (trees, cost) = (GlobalPromptTrees::new(0), self.cost().clone());
            self.decide(&ClusterSnapshot::from_workers(snapshot.now_us, &loads, &trees, &cost).with_kv_fetch(false))
        }
    }

    /// One prefill worker with a long queue, two idle decode workers.
    fn prefill_hot(now_us: u64) -> Snapshot {
        let queue = (0..8).map(|i| (now_us, 4000 + i)).collect();
        Snapshot {
            workers: vec![view(0, Role::Prefill, queue), view(1, Role::Decode, vec![]), view(2, Role::Decode, vec![])],
            now_us,
        }
    }

    fn config(hold: Duration) -> ElasticConfig {
        ElasticConfig::new(CostProfile::llama2_70b_8xa800(), 1_000_000, 100_000, hold)
    }

    /// Without SLOs from the operator the controller weighs against ones the hardware can meet:
    /// for a 70B model on 8×H100, a TBT target of three 6.5 ms floors and a TTFT of a second.
    #[test]
    fn default_slos_come_from_the_cost_profile() {
        let (ttft, tbt) = default_slos(&CostProfile::llama2_70b_8xh100());
        eprintln!("h100: ttft {ttft} us, tbt {tbt} us");
        assert!((18_000..=21_000).contains(&tbt), "{tbt}");
        assert!((1_000_000..=2_000_000).contains(&ttft), "{ttft}");
        let (ttft, tbt) = default_slos(&CostProfile::llama2_70b_8xa800());
        eprintln!("a800: ttft {ttft} us, tbt {tbt} us");
    }

    #[test]
    fn an_imbalance_shorter_than_the_hold_switches_nothing() {
        let mut e = Elastic::new(config(Duration::from_secs(10)));
        assert_eq!(e.look(&prefill_hot(0)), None);
        // The hold, scaled by how far over its watermark the prefill pool is.
        let due = (10_000_000.0 / e.policy.pace(e.loads().0)) as u64;
        assert!(due < 10_000_000, "the queue is deep: sooner than the 10 s hold");
        let mut t = 0;
        while t + 100_000 < due {
            assert_eq!(e.look(&prefill_hot(t)), None, "at {t} us (due at {due})");
            t += 100_000;
        }
        // Once due, the idlest decode worker becomes a prefill worker.
        let s = e.look(&prefill_hot(due + 1)).expect("a switch");
        assert_eq!((s.worker, s.from, s.to), (1, Role::Decode, Role::Prefill));
    }

    #[test]
    fn no_more_switches_than_the_cap_in_a_minute() {
        let mut cfg = config(Duration::ZERO);
        cfg.max_per_minute = 1;
        cfg.policy.min_per_role = 0;
        let mut e = Elastic::new(cfg);
        assert!(e.look(&prefill_hot(1)).is_some());
        // The policy would switch again (no hold), but the cap holds it back for a minute.
        assert_eq!(e.look(&prefill_hot(2)), None);
        assert!(e.look(&prefill_hot(MINUTE_US + 2)).is_some());
    }

    #[test]
    fn a_switch_that_failed_does_not_count_toward_the_cap() {
        let mut cfg = config(Duration::ZERO);
        cfg.max_per_minute = 1;
        cfg.policy.min_per_role = 0;
        let mut e = Elastic::new(cfg);
        assert!(e.look(&prefill_hot(1)).is_some());
        e.switch_failed();
        // The worker did not switch: the next look may order it again within the minute.
        assert!(e.look(&prefill_hot(2)).is_some());
        assert_eq!(e.look(&prefill_hot(3)), None, "the one that succeeded spends the cap");
    }

    #[test]
    fn a_prefill_queue_the_worker_reports_counts_though_the_ledger_thinks_it_done() {
        // (The snapshot's queue is the longer of the ledger's and the report's: loads.rs.)
        let mut e = Elastic::new(config(Duration::ZERO));
        let mut snap = prefill_hot(100_000_000);
        // The ledger sent these long ago: by its estimates they are done.
        snap.workers[0].prefilling.iter_mut().for_each(|p| p.0 = 0);
        assert_eq!(e.look(&snap), None);
        assert_eq!(e.loads().0, 0.0);
        // The worker says 8 prompts of 4,000 tokens wait.
        snap.workers[0].report = Some(baton_protocol::wire::LoadReport {
            waiting: 8,
            queued_prefill_tokens: 32_000,
            ..baton_protocol::wire::LoadReport::default()
        });
        assert!(e.look(&snap).is_some(), "loads {:?}", e.loads());
    }

    #[test]
    fn a_balanced_cluster_keeps_its_roles() {
        let mut e = Elastic::new(config(Duration::ZERO));
        let idle = Snapshot {
            workers: vec![view(0, Role::Prefill, vec![]), view(1, Role::Decode, vec![]), view(2, Role::Decode, vec![])],
            now_us: 1,
        };
        assert_eq!(e.look(&idle), None);
    }
}
