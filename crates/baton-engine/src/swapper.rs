//! Swap-ins beside the step loop (issue #17). A request whose cached prefix lies partly on the
//! host or disk tier does not stall the step that admits it: the pool reserves device slots
//! and keeps references on the sources ([`MemPool::begin_acquire_prefix`]), a copier thread
//! copies the blocks through mappings of its own ([`baton_kv::SwapCopier`]), and the request
//! waits out of the planner's sight while the engine's other sequences keep stepping. When
//! the copy is done the engine finishes the swap-in ([`MemPool::finish_swap_in`]) and the
//! request waits like one holding received KV; an aborted request's swap-in is given back once
//! its copy ended (the copier may still be writing the slots until then).
//!
//! An emulated engine's copier waits as long as the cost profile's host and disk links would
//! take for the blocks, instead of charging that time to the step.
//!
//! [`MemPool::begin_acquire_prefix`]: baton_kv::MemPool::begin_acquire_prefix
//! [`MemPool::finish_swap_in`]: baton_kv::MemPool::finish_swap_in

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Duration;

use baton_kv::{BlockId, Loc, SwapCopier, SwapIn};

use crate::RequestId;

/// One swap-in for the copier: its copies, after `wait` (an emulated link's time).
struct Work {
    id: RequestId,
    copies: Vec<(Loc, BlockId)>,
    wait: Duration,
}

/// A swap-in the copier finished: its copies made, or why not.
struct Done {
    id: RequestId,
    result: Result<(), String>,
}

/// A swap-in under way.
struct Pending {
    job: SwapIn,
    /// Its request was aborted: the job is given back when the copy ends.
    aborted: bool,
}

/// A swap-in the copier is done with, to finish or give back.
pub(crate) struct Finished {
    pub(crate) id: RequestId,
    pub(crate) job: SwapIn,
    /// The copies were made and the request still wants them.
    pub(crate) usable: bool,
}

/// The engine's copier thread and the swap-ins it works on.
pub(crate) struct Swapper {
    work: Option<Sender<Work>>,
    done: Receiver<Done>,
    pending: HashMap<RequestId, Pending>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Swapper {
    /// Starts the copier thread with `copier`.
    pub(crate) fn spawn(mut copier: SwapCopier) -> std::io::Result<Self> {
        let (work_tx, work_rx) = std::sync::mpsc::channel::<Work>();
        let (done_tx, done) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("baton-kv-swap-in".into()).spawn(move || {
            for w in work_rx {
                if !w.wait.is_zero() {
                    std::thread::sleep(w.wait);
                }
                let result =
                    w.copies.iter().try_for_each(|&(from, to)| copier.copy(from, to)).map_err(|e| e.to_string());
                if done_tx.send(Done { id: w.id, result }).is_err() {
                    return;
                }
            }
        })?;
        Ok(Self { work: Some(work_tx), done, pending: HashMap::new(), thread: Some(thread) })
    }

    /// Hands request `id`'s swap-in to the copier. `false` when the copier is gone: the job
    /// comes back for the caller to give back.
    pub(crate) fn start(&mut self, id: RequestId, job: SwapIn, wait: Duration) -> Result<(), SwapIn> {
        let copies = job.copies();
        let sent = self.work.as_ref().is_some_and(|tx| tx.send(Work { id, copies, wait }).is_ok());
        if !sent {
            return Err(job);
        }
        self.pending.insert(id, Pending { job, aborted: false });
        Ok(())
    }

    /// Whether request `id` waits for its swap-in.
    pub(crate) fn is_swapping(&self, id: RequestId) -> bool {
        self.pending.get(&id).is_some_and(|p| !p.aborted)
    }

    /// Request `id` was aborted: its swap-in is given back when the copy ends.
    pub(crate) fn abort(&mut self, id: RequestId) {
        if let Some(p) = self.pending.get_mut(&id) {
            p.aborted = true;
        }
    }

    /// Swap-ins under way (aborted ones included: they hold slots until their copy ends).
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The swap-ins the copier is done with; waits up to `wait` for one when none is.
    pub(crate) fn finished(&mut self, wait: Duration) -> Vec<Finished> {
        let mut out = Vec::new();
        let mut next = if wait.is_zero() { self.done.try_recv().ok() } else { self.done.recv_timeout(wait).ok() };
        while let Some(d) = next {
            if let Some(p) = self.pending.remove(&d.id) {
                if let Err(e) = &d.result {
                    tracing::warn!(request = d.id.0, error = %e, "swapping a cached prefix in failed; computing it");
                }
                out.push(Finished { id: d.id, job: p.job, usable: d.result.is_ok() && !p.aborted });
            }
            next = self.done.try_recv().ok();
        }
        out
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        // The copier ends once its queue is empty; its mappings go with it.
        self.work.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Swapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Swapper").field("pending", &self.pending.len()).finish()
    }
}
