//! The simulator under overload: arrivals faster than the cluster serves them, so the prefill
//! queues (and the requests each decode instance has coming) grow for as long as arrivals last.
//!
//! Its snapshot is built from totals the instances keep, not from every queued request; these
//! tests hold that to be exactly the conductor's snapshot of the same figures, and hold the
//! simulator's work per event flat as the queues grow. The work is measured as bytes allocated
//! (this file's test binary counts them, per thread): a snapshot, index or decision that copied
//! the queues would allocate in proportion to them.
//! No test here reads a clock.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use baton_sched::{AdmissionKind, ClusterSnapshot, PolicyKind, Scheduler};
use baton_sim::workload::{SimRequest, Synthetic};
use baton_sim::{ClusterConfig, SimConfig, Simulator, WorkloadSpec};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// Counts the bytes every allocation (and every growth by reallocation) asks for, per thread
/// (the tests run side by side).
struct Counting;

thread_local! {
    static ALLOCATED: Cell<u64> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    // A thread being torn down has nothing left to count.
    let _ = ALLOCATED.try_with(|a| a.set(a.get() + bytes as u64));
}

fn allocated() -> u64 {
    ALLOCATED.with(Cell::get)
}

// A counting allocator is the one way to see, without a clock, that no code path (the
// simulator's, or a policy's in baton-sched) copies the queues per event.
#[allow(unsafe_code)]
// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size.saturating_sub(layout.size()));
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The workload (#35: 1,024–4,096 prompt tokens, 128–512 out) on 8P+8D, whose prefill
/// pool serves about 26 requests a second: `rate` 100 is four times that.
fn overloaded(requests: usize, admission: AdmissionKind) -> (SimConfig, Vec<SimRequest>) {
    let w = Synthetic::Poisson { requests, rate: 100.0, input: (1024, 4096), output: (128, 512) };
    let mut cfg = SimConfig {
        cluster: ClusterConfig { prefill: 8, decode: 8, ..ClusterConfig::default() },
        policy: PolicyKind::KvCentric,
        workload: WorkloadSpec::Synthetic(w),
        seed: 3,
        ..SimConfig::default()
    };
    cfg.admission.kind = admission;
    let reqs = baton_sim::load_workload(&cfg).expect("synthetic workload");
    (cfg, reqs)
}

/// Bytes allocated per event over a whole overloaded run of `requests`.
fn bytes_per_event(requests: usize) -> f64 {
    let (cfg, reqs) = overloaded(requests, AdmissionKind::None);
    let mut sim = Simulator::new(cfg, reqs);
    let before = allocated();
    sim.run_until(u64::MAX);
    let bytes = allocated() - before;
    let report = sim.finish();
    assert_eq!(report.completed, requests, "no admission control: every request completes");
    bytes as f64 / report.events as f64
}

/// Four times the requests at four times the cluster's capacity: the queues the last arrivals
/// find are about four times longer, and a simulator that copied them per arrival (as it did
/// before issue #35: a `PendingPrefill` per queued request, an `IncomingSeq` per request coming
/// to each decode instance) allocated about four times as much per event. Now the same.
#[test]
fn work_per_event_does_not_grow_with_the_queues() {
    let small = bytes_per_event(1_000);
    let large = bytes_per_event(4_000);
    assert!(large < small * 1.5, "{large:.0} bytes per event at 4,000 requests against {small:.0} at 1,000");
}

/// At points of an overloaded run, with each admission control, the simulator's snapshot (from
/// its running totals) is the one the conductor builds from the same per-worker figures
/// (`ClusterSnapshot::from_workers` over `Simulator::worker_loads`, every queued request
/// listed), and the two decide alike.
#[test]
fn the_snapshot_from_totals_is_the_conductors_under_overload() {
    for admission in [AdmissionKind::None, AdmissionKind::EarlyRejection, AdmissionKind::Predictive] {
        let (cfg, reqs) = overloaded(600, admission);
        let mut sim = Simulator::new(cfg.clone(), reqs.clone());
        let mut longest = 0;
        for k in 1..=12 {
            let at = reqs[reqs.len() * k / 13].arrival_us;
            sim.run_until(at);
            let next = reqs.iter().position(|r| r.arrival_us > at).expect("a later request");
            let loads = sim.worker_loads();
            let simulator = sim.snapshot();
            let conductor = ClusterSnapshot::from_workers(sim.now(), &loads, simulator.trees, &cfg.cost)
                .with_kv_fetch(cfg.cluster.kv_fetch);
            assert_eq!(conductor.instances, simulator.instances, "{admission:?} at {at} µs");
            longest = longest.max(loads.iter().map(|w| w.prefills.len()).max().unwrap_or(0));
            let req = sim.request_view(next);
            let decide = |snap: &ClusterSnapshot<'_>| {
                Scheduler::new(cfg.policy.build(&cfg.policy_config), cfg.admission).decide(
                    snap,
                    &req,
                    &mut StdRng::seed_from_u64(k as u64),
                )
            };
            assert_eq!(decide(&conductor), decide(&simulator), "{admission:?} at {at} µs");
        }
        if admission == AdmissionKind::None {
            assert!(longest > 20, "the queues grew ({longest} at most)");
        }
    }
}
