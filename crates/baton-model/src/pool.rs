//! A model step on rayon's pool, with the pool's other threads kept awake until it ends.
//!
//! A batch-1 decode step of a small model is a hundred-odd parallel products of tens of
//! microseconds each, with a few microseconds of serial work between them (norms, rotary
//! embeddings, one row's attention). Rayon puts a thread that finds no work for a few
//! microseconds to sleep, and waking it again (a futex, an inter-processor interrupt on a VM)
//! takes about as long as the gap: until it is up, the stepping thread does the product's other
//! half itself. Keeping them awake (two threads, `baton bench engine --batches 1,1,1,1`, eight
//! runs each way alternating with `BATON_CPU_POLL=0`): SmolLM2 135M Q4_1 decodes at a median of
//! 202 tokens/s, was 192; Gemma 3 270M Q4_K_M at 89, was 80. `perf` put a seventh of SmolLM2-135M's decode step, two threads, in sleeping
//! and waking (issue #38). llama.cpp avoids it the same way: its threads spin between the
//! operations of a graph.
//!
//! [`step_in_pool`] runs the step on a pool thread (the caller blocks once, for the whole step)
//! and gives every other thread of the pool a job that keeps it awake: it runs whatever work
//! the pool has ([`rayon::yield_now`]) and spins between, until the step ends. Work too small
//! to hand to sleeping threads (one decode row's attention over a short context) asks
//! [`threads_awake`] whether they are up, and shares itself when they are.
//!
//! **One step at a time.** A keep-awake job never holds a thread its own step needs: it runs
//! the step's work itself, and every other thread takes it (from rayon's per-thread broadcast
//! queue) before it could steal any of the step's work. Two steps at once on one pool are
//! another matter — `baton serve`'s prefill and decode workers share the process's pool: a
//! thread that picks up step A's keep-awake job while it waits, inside step B's work, for part
//! of it holds step B until step A ends (a decode step stalled behind a whole prefill step), and
//! if step A waited on step B the same way neither would end. So threads are kept awake only
//! while one step runs in the process: a step that starts beside another keeps no one awake,
//! and every keep-awake job gives its thread back as soon as a second step starts, once its
//! step is over, or after [`IDLE_LIMIT`] without work.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a keep-awake job spins with nothing to do before it gives its thread back: far
/// longer than the serial gaps of a step, short enough that a thread it holds past need (a
/// caller of the pool other than a step) waits little.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_millis(1);

/// Steps running in this process now (every pool).
static STEPS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Set on the thread running a step that keeps the pool's other threads awake, for the
    /// whole of that step ([`threads_awake`]).
    static STEPPING_AWAKE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread runs a step that keeps the pool's other threads awake, and no other
/// step runs beside it (the keep-awake jobs have then left). Work too small to wake a sleeping
/// thread for (a few microseconds: one decode row's attention at a short context) is worth
/// sharing then.
pub(crate) fn threads_awake() -> bool {
    STEPPING_AWAKE.get() && STEPS.load(Ordering::Acquire) == 1
}

/// [`STEPPING_AWAKE`] set while it lives.
struct SteppingAwake;

impl SteppingAwake {
    fn new() -> Self {
        STEPPING_AWAKE.set(true);
        Self
    }
}

impl Drop for SteppingAwake {
    fn drop(&mut self) {
        STEPPING_AWAKE.set(false);
    }
}

/// A step counted in [`STEPS`] while it lives.
struct Counted;

impl Counted {
    /// Counts a step; also says whether it is the only one.
    fn new() -> (Self, bool) {
        (Self, STEPS.fetch_add(1, Ordering::AcqRel) == 0)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        STEPS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs `step` on a thread of the current rayon pool (right here when this is one), with the
/// pool's other threads kept awake until it returns when no other step runs in the process.
pub(crate) fn step_in_pool<T: Send>(step: impl FnOnce() -> T + Send) -> T {
    let (_counted, alone) = Counted::new();
    // A one-thread pool has no one to keep awake.
    if !alone || !keep_awake() || rayon::current_num_threads() < 2 {
        return rayon::scope(|_| step());
    }
    let done = AtomicBool::new(false);
    // A scope's body runs on a pool thread, the caller waiting once for the whole of it; the
    // scope also waits for the keep-awake jobs, which end once `done` is set.
    rayon::scope(|s| {
        let stepping = rayon::current_thread_index();
        let done = &done;
        s.spawn_broadcast(move |_, ctx| {
            // The stepping thread's own copy returns at once: it may come to it while it waits,
            // inside the step, for work another thread took.
            if Some(ctx.index()) != stepping {
                stay_awake(done);
            }
        });
        let out = {
            let _awake = SteppingAwake::new();
            step()
        };
        done.store(true, Ordering::Release);
        out
    })
}

/// Whether steps keep the pool's threads awake: yes, unless `BATON_CPU_POLL=0` (read once per
/// process; llama.cpp's `--poll 0`): for a CPU shared with other busy processes, where a
/// spinning thread takes time they need, and to measure what spinning gains.
fn keep_awake() -> bool {
    static KEEP_AWAKE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *KEEP_AWAKE.get_or_init(|| std::env::var("BATON_CPU_POLL").map_or(true, |v| v.trim() != "0"))
}

/// Runs the pool's pending work, spinning when there is none, until `done` is set, another
/// step starts, or nothing has come for [`IDLE_LIMIT`].
fn stay_awake(done: &AtomicBool) {
    let mut idle_since = Instant::now();
    while !done.load(Ordering::Acquire) && STEPS.load(Ordering::Acquire) == 1 {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = Instant::now();
        } else if idle_since.elapsed() > IDLE_LIMIT {
            return;
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use rayon::prelude::*;

    use super::*;

    /// A step shaped like a decode step: many small parallel products with serial work between.
    fn fake_step(seed: u64) -> u64 {
        let mut acc = seed;
        for layer in 0..50u64 {
            let v = (0..4096usize)
                .into_par_iter()
                .with_min_len(256)
                .map(|i| (i as u64 ^ layer).wrapping_mul(acc | 1))
                .reduce(|| 0, u64::wrapping_add);
            acc = acc.wrapping_add(v).rotate_left(7);
        }
        acc
    }

    #[test]
    fn a_step_returns_what_it_computes_from_inside_and_outside_the_pool() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool");
        let expected = fake_step(7);
        // From outside the pool: the step runs on one of its threads.
        assert_eq!(pool.install(|| step_in_pool(|| fake_step(7))), expected);
        // From a pool thread, and nested in another step.
        let nested = pool.install(|| step_in_pool(|| step_in_pool(|| fake_step(7))));
        assert_eq!(nested, expected);
        // A one-thread pool has no one to keep awake.
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
        assert_eq!(one.install(|| step_in_pool(|| fake_step(7))), expected);
    }

    #[test]
    fn the_other_threads_run_the_steps_work() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        let seen = AtomicUsize::new(0);
        let stepping = pool.install(|| {
            step_in_pool(|| {
                let me = rayon::current_thread_index();
                (0..64).into_par_iter().for_each(|_| {
                    std::thread::sleep(Duration::from_millis(1));
                    if rayon::current_thread_index() != me {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                });
                me
            })
        });
        assert!(stepping.is_some());
        assert!(seen.load(Ordering::Relaxed) > 0, "the second thread took none of the step's work");
    }

    #[test]
    fn only_a_keep_awake_step_counts_its_threads_awake() {
        // Outside any step, on this thread: never (whatever other tests run beside).
        assert!(!threads_awake());
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        // A step runs alone unless another test steps at that moment: one of a few tries is.
        let awake = (0..20).any(|_| pool.install(|| step_in_pool(threads_awake)));
        assert_eq!(awake, keep_awake());
        // A one-thread pool keeps no one awake.
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
        assert!(!one.install(|| step_in_pool(threads_awake)));
        assert!(!threads_awake());
    }

    /// Two steps at once on one pool, each waiting on its own parallel work, from several
    /// callers: the case where a keep-awake job can land above another step's wait. Every step
    /// must finish (a deadlock here hangs the test) with its own answer.
    #[test]
    fn concurrent_steps_on_one_pool_all_finish() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().expect("a pool");
        let expected: Vec<u64> = (0..4).map(fake_step).collect();
        std::thread::scope(|s| {
            let callers: Vec<_> = (0..4u64)
                .map(|seed| {
                    let pool = &pool;
                    s.spawn(move || {
                        (0..20).map(|_| pool.install(|| step_in_pool(|| fake_step(seed)))).collect::<Vec<_>>()
                    })
                })
                .collect();
            for (seed, caller) in callers.into_iter().enumerate() {
                let answers = caller.join().expect("a caller");
                assert!(answers.iter().all(|&a| a == expected[seed]), "step {seed} answered wrongly");
            }
        });
    }
}
