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
//! **The step's team.** The awake threads also form a team for the step's products
//! ([`for_each_chunk`]): a product is published once, each thread works through its own
//! contiguous share of the pieces and then takes what is left of the others', and the
//! stepping thread waits for one completion count. A rayon product instead pushes jobs that
//! the other thread steals one at a time, each steal and each join a round trip between the
//! two cores' caches (60–340 ns on this VM, `baton bench engine`'s `hand-off ns`), a few per
//! product, ~150 products a SmolLM2 step. In-process A/B (a build whose batches alternated team
//! on and off, `baton bench engine --batches 1,1,1,1,1,1,1,1`, two threads, SmolLM2 135M Q4_1):
//! 250 against 241 tokens/s with the two vCPUs on one core complex, 236 against 232 on two.
//! `BATON_CPU_TEAM=0` turns the team off, for measuring it again.
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

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long a keep-awake job spins with nothing to do before it gives its thread back: far
/// longer than the serial gaps of a step, short enough that a thread it holds past need (a
/// caller of the pool other than a step) waits little.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_millis(1);

/// Steps running in this process now (every pool).
static STEPS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The team of the step this thread runs while it keeps the pool's other threads awake
    /// (null otherwise, and while this thread runs one of the team's jobs).
    static TEAM: std::cell::Cell<*const Team> = const { std::cell::Cell::new(std::ptr::null()) };
}

/// This thread's team, when it runs a step that keeps the pool's other threads awake, no other
/// step runs beside it, and at least one of those threads is still there.
fn awake_team() -> Option<&'static Team> {
    let team = TEAM.get();
    // SAFETY: `TEAM` is set only by `OnTeam`, which clears it before the team it points to is
    // dropped (both live in `step_in_pool`'s frame, the guard declared after the team).
    #[allow(unsafe_code)]
    let team = unsafe { team.as_ref() }?;
    (STEPS.load(Ordering::Acquire) == 1 && team.present.0.load(Ordering::Acquire) > 0).then_some(team)
}

/// Whether this thread runs a step that keeps the pool's other threads awake, and they are
/// still there for it (no other step runs beside it). Work too small to wake a sleeping
/// thread for (a few microseconds: one decode row's attention at a short context) is worth
/// sharing then.
pub fn threads_awake() -> bool {
    awake_team().is_some()
}

/// [`awake_team`], when it runs the step's products ([`use_team`]).
fn team() -> Option<&'static Team> {
    awake_team().filter(|_| use_team())
}

/// [`TEAM`] set while it lives.
struct OnTeam;

impl OnTeam {
    fn new(team: &Team) -> Self {
        TEAM.set(team);
        Self
    }
}

impl Drop for OnTeam {
    fn drop(&mut self) {
        TEAM.set(std::ptr::null());
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
pub fn step_in_pool<T: Send>(step: impl FnOnce() -> T + Send) -> T {
    let (_counted, alone) = Counted::new();
    // A one-thread pool has no one to keep awake.
    if !alone || !keep_awake() || rayon::current_num_threads() < 2 {
        return rayon::scope(|_| step());
    }
    let done = AtomicBool::new(false);
    // A scope's body runs on a pool thread, the caller waiting once for the whole of it; the
    // scope also waits for the keep-awake jobs, which end once `done` is set.
    let team = Team::new(rayon::current_num_threads());
    rayon::scope(|s| {
        let stepping = rayon::current_thread_index();
        let (done, team) = (&done, &team);
        s.spawn_broadcast(move |_, ctx| {
            // The stepping thread's own copy returns at once: it may come to it while it waits,
            // inside the step, for work another thread took.
            if Some(ctx.index()) != stepping {
                stay_awake(done, team, ctx.index());
            }
        });
        let out = {
            let _on_team = OnTeam::new(team);
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

/// Whether the threads kept awake also run the step's products as a team ([`for_each_chunk`]):
/// yes, unless `BATON_CPU_TEAM=0` (read once per process), which hands them to rayon as outside
/// a step — to measure what the team gains.
fn use_team() -> bool {
    static USE_TEAM: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USE_TEAM.get_or_init(|| std::env::var("BATON_CPU_TEAM").map_or(true, |v| v.trim() != "0"))
}

/// Runs the team's jobs and the pool's pending work, spinning when there is none, until `done`
/// is set, another step starts, or nothing has come for [`IDLE_LIMIT`].
fn stay_awake(done: &AtomicBool, team: &Team, member: usize) {
    team.present.0.fetch_add(1, Ordering::AcqRel);
    let mut seen = 0;
    let mut idle_since = Instant::now();
    while !done.load(Ordering::Acquire) && STEPS.load(Ordering::Acquire) == 1 {
        let generation = team.generation.0.load(Ordering::SeqCst);
        if generation != seen {
            seen = generation;
            team.work(generation, member);
            idle_since = Instant::now();
        } else if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = Instant::now();
        } else if idle_since.elapsed() > IDLE_LIMIT {
            break;
        } else {
            std::hint::spin_loop();
        }
    }
    team.present.0.fetch_sub(1, Ordering::AcqRel);
}

/// Runs `f(state, i, chunk)` for every `chunk`-long piece of `out` (the last may be shorter),
/// `i` counting from 0, in parallel; each thread taking part makes its own `state` with `init`
/// (once per call, and only if it runs a piece).
///
/// Inside a step that keeps the pool's threads awake (a decode step) the pieces go to the
/// step's team: each thread starts on its own contiguous share and takes what is left of the
/// others' when it is done, so a product costs one publication and one completion count
/// between the threads, not a rayon job per stolen half. Elsewhere they go to rayon.
pub fn for_each_chunk<T: Send, S>(
    out: &mut [T],
    chunk: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize, &mut [T]) + Sync + Send,
) {
    assert!(chunk > 0, "pieces of at least one element");
    let tasks = out.len().div_ceil(chunk);
    match team() {
        Some(_) if tasks <= 1 => {
            if !out.is_empty() {
                f(&mut init(), 0, out);
            }
        }
        Some(team) if tasks <= MAX_TASKS => {
            let len = out.len();
            let base = SendPtr(out.as_mut_ptr());
            let job = |first: usize, claim: &mut dyn FnMut() -> Option<usize>| {
                let mut state = init();
                let mut task = Some(first);
                while let Some(i) = task {
                    let start = i * chunk;
                    let n = chunk.min(len - start);
                    // SAFETY: every task index below `tasks` is claimed exactly once in a job
                    // (`Team::claim`), so the pieces handed out are disjoint, and `out` is
                    // borrowed mutably until `Team::run` has seen every task complete.
                    #[allow(unsafe_code)]
                    let piece = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), n) };
                    f(&mut state, i, piece);
                    task = claim();
                }
            };
            team.run(tasks, &job);
        }
        _ => out.par_chunks_mut(chunk).enumerate().for_each_init(init, |s, (i, piece)| f(s, i, piece)),
    }
}

/// A raw pointer to the pieces of a slice handed to the team's threads.
struct SendPtr<T>(*mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (through a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: the pointer is only turned into disjoint pieces of a slice of `Send` elements, each
// used by one thread (`for_each_chunk`).
#[allow(unsafe_code)]
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// Most pieces a team job takes (a task index fits in 16 bits of a share's state).
const MAX_TASKS: usize = u16::MAX as usize;

/// One cache line (two on parts that fetch lines in pairs) for each value the team's threads
/// write, so that one thread's writes do not take another's line from it.
#[repr(align(128))]
struct Padded<T>(T);

/// A job for the team: called with the first piece its thread claimed and a way to claim the
/// next.
type Job<'a> = dyn Fn(usize, &mut dyn FnMut() -> Option<usize>) + Sync + 'a;

/// The pool's threads working together on a step's parallel products, without rayon's queues.
///
/// The stepping thread publishes a job (its pieces split into one contiguous share per pool
/// thread, a new generation) and works on it too; the other threads, spinning in
/// [`stay_awake`], see the generation change and join. Each thread takes pieces from its own
/// share first, then from the others'; a share's state (generation, next piece, end) is one
/// word changed by compare-and-swap, so a piece is claimed once, and a claim from a stale
/// generation fails. A thread that has left the team (or never came) has its share taken by
/// the others; the job is over when the completed count reaches the pieces. The job and the
/// pieces live in the stepping thread's frame: it waits for that count before it returns, and
/// a thread touches the job only after a claim in its generation succeeded.
struct Team {
    /// The current job's generation; published last (the stepping thread alone writes it).
    generation: Padded<AtomicU64>,
    /// The current job: a pointer to a `&Job` in the stepping thread's frame.
    job: Padded<AtomicPtr<()>>,
    /// Each pool thread's share of the current job: generation (32 bits), next piece (16 bits),
    /// end (16 bits).
    shares: Box<[Padded<AtomicU64>]>,
    /// Pieces of the current job done (or given up after a panic).
    completed: Padded<AtomicUsize>,
    /// The pool's other threads taking part now.
    present: Padded<AtomicUsize>,
    /// The first panic of a piece on another thread, re-raised on the stepping thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Team {
    fn new(threads: usize) -> Self {
        Self {
            generation: Padded(AtomicU64::new(0)),
            job: Padded(AtomicPtr::new(std::ptr::null_mut())),
            shares: (0..threads).map(|_| Padded(AtomicU64::new(0))).collect(),
            completed: Padded(AtomicUsize::new(0)),
            present: Padded(AtomicUsize::new(0)),
            panic: Mutex::new(None),
        }
    }

    /// Runs `job` over `tasks` pieces with whichever of the team's threads are there; returns
    /// once every piece is done. On the stepping thread only.
    fn run(&self, tasks: usize, job: &Job<'_>) {
        let threads = self.shares.len();
        let generation = self.generation.0.load(Ordering::Relaxed) + 1;
        for (t, share) in self.shares.iter().enumerate() {
            share.0.store(pack(generation, t * tasks / threads, (t + 1) * tasks / threads), Ordering::SeqCst);
        }
        self.completed.0.store(0, Ordering::SeqCst);
        let job_ref: &Job<'_> = job;
        self.job.0.store((&raw const job_ref).cast_mut().cast(), Ordering::SeqCst);
        self.generation.0.store(generation, Ordering::SeqCst);
        // The pieces' work may itself ask for parallel work: not of this team while it runs.
        let team = TEAM.replace(std::ptr::null());
        let member = rayon::current_thread_index().unwrap_or(0) % threads;
        self.work(generation, member);
        TEAM.set(team);
        while self.completed.0.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        if let Some(panic) = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            resume_unwind(panic);
        }
    }

    /// Claims and runs pieces of the job of `generation` as thread `member` until none is left,
    /// then counts them completed.
    fn work(&self, generation: u64, member: usize) {
        let mut claimed = 0;
        let mut share = member;
        let mut claim = || {
            let next = self.claim(generation, &mut share);
            claimed += usize::from(next.is_some());
            next
        };
        if let Some(first) = claim() {
            // SAFETY: a claim in `generation` succeeded, so the stepping thread is inside
            // `run` for this generation and the `&Job` it published lives until every claimed
            // piece is counted completed.
            #[allow(unsafe_code)]
            let job: &Job<'_> = unsafe { *self.job.0.load(Ordering::SeqCst).cast::<&Job<'_>>() };
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| job(first, &mut claim))) {
                self.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(panic);
                // The rest is claimed and given up, so the job ends.
                while claim().is_some() {}
            }
        }
        if claimed > 0 {
            self.completed.0.fetch_add(claimed, Ordering::AcqRel);
        }
    }

    /// The next piece of the job of `generation`, from share `*share` onwards (moving on when
    /// one is used up), or `None` once every share is used up or the job is over.
    fn claim(&self, generation: u64, share: &mut usize) -> Option<usize> {
        let threads = self.shares.len();
        for _ in 0..threads {
            let state = &self.shares[*share].0;
            let mut now = state.load(Ordering::SeqCst);
            loop {
                let (g, next, end) = unpack(now);
                if g != generation & 0xffff_ffff {
                    return None;
                }
                if next >= end {
                    break;
                }
                match state.compare_exchange_weak(now, now + (1 << 16), Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(_) => return Some(next),
                    Err(seen) => now = seen,
                }
            }
            *share = (*share + 1) % threads;
        }
        None
    }
}

/// A share's state as one word: generation (low 32 bits of it), next piece, end.
fn pack(generation: u64, next: usize, end: usize) -> u64 {
    ((generation & 0xffff_ffff) << 32) | ((next as u64) << 16) | end as u64
}

/// [`pack`]'s parts.
fn unpack(state: u64) -> (u64, usize, usize) {
    (state >> 32, ((state >> 16) & 0xffff) as usize, (state & 0xffff) as usize)
}

/// For tests that need a step's team: this crate's, and those of the crates that step in the pool
/// (`baton-model`'s). The lock is per process, so it keeps apart the tests of one test binary.
#[doc(hidden)]
pub mod testing {
    use std::time::{Duration, Instant};

    use super::threads_awake;

    /// Held by the tests that wait inside a step for its team: two of them waiting at once
    /// would keep each other from ever stepping alone.
    pub static WAITING_FOR_TEAM: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Whether the step's other threads join its team within a while (they do unless another
    /// step runs in this process, as other tests' steps may).
    pub fn wait_for_team() -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(200) {
            if threads_awake() {
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use rayon::prelude::*;

    use super::testing::{WAITING_FOR_TEAM, wait_for_team};
    use super::*;

    /// A step shaped like a decode step: many small parallel products with serial work between,
    /// half of them through [`for_each_chunk`] (the team's jobs inside a step), half through
    /// rayon directly.
    fn fake_step(seed: u64) -> u64 {
        let mut acc = seed;
        for layer in 0..50u64 {
            let v = if layer % 2 == 0 {
                let mut out = vec![0u64; 4096];
                for_each_chunk(
                    &mut out,
                    256,
                    || (),
                    |_, task, piece| {
                        for (j, o) in piece.iter_mut().enumerate() {
                            *o = ((task * 256 + j) as u64 ^ layer).wrapping_mul(acc | 1);
                        }
                    },
                );
                out.into_iter().fold(0, u64::wrapping_add)
            } else {
                (0..4096usize)
                    .into_par_iter()
                    .with_min_len(256)
                    .map(|i| (i as u64 ^ layer).wrapping_mul(acc | 1))
                    .reduce(|| 0, u64::wrapping_add)
            };
            acc = acc.wrapping_add(v).rotate_left(7);
        }
        acc
    }

    /// Which thread ran each piece, and how often, for `pieces` pieces of `chunk` elements
    /// (the last one shorter).
    fn record_pieces(pieces: usize, chunk: usize) -> Vec<(usize, Option<usize>)> {
        let len = pieces * chunk - chunk / 2;
        let mut out = vec![(0usize, None); len];
        for_each_chunk(&mut out, chunk, rayon::current_thread_index, |me, task, piece| {
            assert_eq!(piece.len(), chunk.min(len - task * chunk), "piece {task}'s length");
            for slot in piece {
                *slot = (slot.0 + 1, *me);
            }
        });
        out
    }

    #[test]
    fn the_team_runs_every_piece_once_and_both_threads_take_part() {
        let _alone = WAITING_FOR_TEAM.lock().unwrap_or_else(|e| e.into_inner());
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        // A step runs alone unless another test steps at that moment: one of a few tries is.
        // Another test's step starting during a try also sends the other thread away (it may
        // have taken no piece by then), so a try counts once both threads took pieces.
        let mut teamed = false;
        let mut threads = std::collections::HashSet::new();
        for _ in 0..20 {
            threads.clear();
            pool.install(|| {
                step_in_pool(|| {
                    if !wait_for_team() || team().is_none() {
                        return;
                    }
                    teamed = true;
                    for round in 0..2000 {
                        let pieces = 1 + round % 40;
                        let out = record_pieces(pieces, 3 + round % 5);
                        assert!(out.iter().all(|&(runs, _)| runs == 1), "round {round}: a piece ran twice or never");
                        if team().is_some() {
                            threads.extend(out.iter().map(|&(_, t)| t));
                        }
                        if round % 50 == 49 {
                            // A serial gap between products, as in a step.
                            std::thread::sleep(Duration::from_micros(50));
                        }
                    }
                })
            });
            if threads.len() == 2 {
                break;
            }
        }
        assert_eq!(teamed, keep_awake() && use_team(), "no step formed a team");
        if teamed {
            assert_eq!(threads.len(), 2, "one thread ran every piece of the team's jobs: {threads:?}");
        }
        // Outside a step the same call goes to rayon, with the same result.
        assert!(pool.install(|| record_pieces(17, 4)).iter().all(|&(runs, _)| runs == 1));
    }

    #[test]
    fn a_team_whose_other_thread_left_still_finishes_every_product() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        pool.install(|| {
            step_in_pool(|| {
                assert!(record_pieces(64, 8).iter().all(|&(runs, _)| runs == 1));
                // Longer than the keep-awake threads wait without work: they give their thread
                // back, and the products after go to rayon (or to the team, if one came back).
                std::thread::sleep(IDLE_LIMIT * 5);
                for _ in 0..50 {
                    assert!(record_pieces(64, 8).iter().all(|&(runs, _)| runs == 1));
                }
            })
        });
    }

    #[test]
    fn a_panicking_piece_panics_the_caller_on_whichever_thread_it_ran() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        for bad in [0, 31, 63] {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| {
                    step_in_pool(|| {
                        // Many products, so the bad piece also lands on the other thread.
                        for _ in 0..200 {
                            let mut out = vec![0u8; 64];
                            for_each_chunk(&mut out, 1, || (), |_, task, _| assert_ne!(task, bad, "piece {bad}"));
                        }
                    })
                })
            }));
            assert!(caught.is_err(), "piece {bad} panicked and the caller did not");
        }
        // The pool is still usable.
        assert!(pool.install(|| step_in_pool(|| record_pieces(9, 2))).iter().all(|&(runs, _)| runs == 1));
    }

    #[test]
    fn a_share_packs_and_unpacks() {
        for (g, next, end) in [(1, 0, 0), (0xffff_ffff, 65_534, 65_535), (7, 3, 9)] {
            assert_eq!(unpack(pack(g, next, end)), (g, next, end));
        }
        // Generations wrap at 32 bits; a claim compares them wrapped.
        assert_eq!(unpack(pack(1 << 32 | 5, 1, 2)).0, 5);
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
        let _alone = WAITING_FOR_TEAM.lock().unwrap_or_else(|e| e.into_inner());
        // Outside any step, on this thread: never (whatever other tests run beside).
        assert!(!threads_awake());
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        // A step runs alone unless another test steps at that moment: one of a few tries is.
        let awake = (0..20).any(|_| pool.install(|| step_in_pool(wait_for_team)));
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
