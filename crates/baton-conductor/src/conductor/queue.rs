//! The admission queue: requests that would be disaggregated while no decode worker has room
//! for their KV wait here, first come first served, instead of being refused, as long as their
//! predicted wait is within their deadline (the TTFT SLO where one is set, else
//! `--max-queue-wait`).
//!
//! A request waits *before* it is sent anywhere: it holds no decode room and no prefill worker's
//! time while it queues, and its HTTP response has not started, so one whose deadline passes
//! gets its 429 (with `Retry-After`) before a byte of its stream. Only the request at the head of
//! the queue tries to start; when it starts it claims its decode room ([`super::Binding`]) and
//! goes on to its prefill, which guarantees it room when its KV is handed over (a request is
//! never failed after its 200 for want of room).
//!
//! The queue is its own state, behind one lock that nothing else takes while holding it
//! ([`AdmissionQueue`]): the conductor's ledger is read outside it. [`predict_starts`] is the pure
//! model that turns the ledger into each waiter's predicted wait.

use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Most requests that may wait in the queue at once. Each holds its validated request (a prompt
/// of at most the model's context), so the queue's memory is bounded by this times the largest
/// prompt; a request that finds it full is refused (429).
pub const MAX_QUEUED: usize = 4096;

/// How long a request may wait for decode room by default (`--max-queue-wait`): long enough to
/// ride out a burst that the running requests will make room for within seconds, short enough
/// that a chat user still reads the answer (the TTFT SLO admission uses by default, Mooncake's
/// 30 s for real workloads, is the same figure), and well inside the OpenAI client's 600 s
/// default timeout, so the client sees a 429 it can act on rather than a timeout of its own.
pub const DEFAULT_MAX_QUEUE_WAIT: Duration = Duration::from_secs(30);

/// How often the head of the queue looks again without being woken (a worker joining, a
/// breaker closing and a load report do not wake it; a request ending does).
const HEAD_POLL: Duration = Duration::from_millis(50);

/// The queue of requests waiting for decode room, in arrival order.
#[derive(Debug)]
pub(crate) struct AdmissionQueue {
    /// Guards only the queue's own entries; never held across an await or another lock.
    inner: Mutex<Inner>,
    /// Woken when decode room may have been freed or the head left.
    changed: Notify,
    /// The last replay of the whole queue ([`predict_starts`]), which every waiter reads its
    /// prediction from while it is fresh. Its own lock, never held with `inner`'s.
    replay: Mutex<Option<Replay>>,
}

/// One replay of the queue: when it was made, and each waiter's prediction by ticket id.
#[derive(Debug)]
struct Replay {
    at: Instant,
    /// Ticket ids in queue order (so increasing) and their predictions.
    ids: Vec<u64>,
    starts: Vec<Prediction>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Tickets and the KV tokens each needs, in arrival order.
    waiting: VecDeque<(u64, usize)>,
    next: u64,
}

/// A place in the [`AdmissionQueue`]; leaving it (dropping the ticket: started, refused, or the
/// client gone) removes it and wakes the rest.
#[derive(Debug)]
pub(crate) struct Ticket {
    queue: Arc<AdmissionQueue>,
    id: u64,
}

/// The queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

impl Default for AdmissionQueue {
    fn default() -> Self {
        Self { inner: Mutex::new(Inner::default()), changed: Notify::new(), replay: Mutex::new(None) }
    }
}

impl AdmissionQueue {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Joins the end of the queue with a request needing `tokens` of decode room.
    pub(crate) fn join(self: &Arc<Self>, tokens: usize) -> Result<Ticket, Full> {
        let mut inner = self.inner();
        if inner.waiting.len() >= MAX_QUEUED {
            return Err(Full);
        }
        let id = inner.next;
        inner.next += 1;
        inner.waiting.push_back((id, tokens));
        Ok(Ticket { queue: Arc::clone(self), id })
    }

    /// Requests waiting now.
    pub(crate) fn len(&self) -> usize {
        self.inner().waiting.len()
    }

    /// Whether nobody waits (an arrival may try to start at once).
    pub(crate) fn is_empty(&self) -> bool {
        self.inner().waiting.is_empty()
    }

    /// Every waiter's ticket id and decode room, in queue order.
    pub(crate) fn entries(&self) -> Vec<(u64, usize)> {
        self.inner().waiting.iter().copied().collect()
    }

    /// `ticket`'s prediction from a replay made less than `fresh` ago, if it was in it.
    pub(crate) fn replayed(&self, ticket: &Ticket, fresh: Duration) -> Option<Prediction> {
        let replay = self.replay.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let r = replay.as_ref().filter(|r| r.at.elapsed() < fresh)?;
        r.ids.binary_search(&ticket.id).ok().map(|i| r.starts[i])
    }

    /// Keeps a replay of the queue whose entries had these ids, for [`Self::replayed`].
    pub(crate) fn keep_replay(&self, ids: Vec<u64>, starts: Vec<Prediction>) {
        debug_assert_eq!(ids.len(), starts.len());
        let replay = Replay { at: Instant::now(), ids, starts };
        *self.replay.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(replay);
    }

    /// Wakes the queue: decode room may have been freed.
    pub(crate) fn wake(&self) {
        self.changed.notify_waiters();
    }

    /// Waits until the queue is woken, at most `max` (and at most [`HEAD_POLL`] for the head).
    pub(crate) async fn changed(&self, ticket: &Ticket, max: Duration) {
        let woken = self.changed.notified();
        let max = if ticket.is_head() { max.min(HEAD_POLL) } else { max };
        let _ = tokio::time::timeout(max, woken).await;
    }
}

impl Ticket {
    /// This ticket's id (ids grow in arrival order).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Whether this request is first in the queue (its turn to try to start).
    pub(crate) fn is_head(&self) -> bool {
        self.queue.inner().waiting.front().is_some_and(|(id, _)| *id == self.id)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut inner = self.queue.inner();
        if let Some(i) = inner.waiting.iter().position(|(id, _)| *id == self.id) {
            inner.waiting.remove(i);
        }
        drop(inner);
        self.queue.wake();
    }
}

/// A decode worker's KV pool as the prediction sees it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct DecodePool {
    /// Its KV capacity, tokens (0: unknown, always room).
    pub capacity: usize,
    /// What holds room there now, each as (when it is predicted to let go, µs on the
    /// conductor's clock; KV tokens): requests decoding there and requests admitted to it still
    /// in prefill or hand-off.
    pub held: Vec<(u64, usize)>,
}

/// What [`predict_starts`] foresees for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prediction {
    /// Its KV fits no decode worker, however empty: waiting cannot help.
    Never,
    /// It is predicted to start after this long, µs (0: now).
    After(u64),
    /// Nothing to predict with yet (no request has finished a decode here): it waits and its
    /// deadline decides.
    Unknown,
}

/// When each request of `queue` (the decode room each needs, in queue order) is predicted to
/// start, in one replay of the whole queue: each starts as soon as some pool has room for it
/// after those ahead of it started, and every request — running, admitted or started in the
/// replay — lets go of its room when its `hold` (µs: the measured time from admission to the end
/// of the decode) is over. A request whose predicted end has passed is taken to end now. One
/// replay serves every waiter (`O(n log n)` for the queue, where a replay per waiter was
/// `O(n²)`). Pure: the conductor's ledger and clock come in as arguments.
pub(crate) fn predict_starts(now: u64, pools: &[DecodePool], queue: &[usize], hold: Option<u64>) -> Vec<Prediction> {
    let fits = |p: &DecodePool, used: usize, n: usize| crate::routing::room_for(p.capacity, used, n);
    if pools.is_empty() {
        // No decode worker in routing now (its breaker tripped, or it left): one may come back.
        return vec![Prediction::Unknown; queue.len()];
    }
    let mut used: Vec<usize> = pools.iter().map(|p| p.held.iter().map(|&(_, n)| n).sum()).collect();
    // Releases as a min-heap of (time, pool, tokens).
    let mut releases: BinaryHeap<std::cmp::Reverse<(u64, usize, usize)>> = pools
        .iter()
        .enumerate()
        .flat_map(|(i, p)| p.held.iter().map(move |&(end, n)| std::cmp::Reverse((end.max(now), i, n))))
        .collect();
    let mut t = now;
    let mut starts = Vec::with_capacity(queue.len());
    for (k, &need) in queue.iter().enumerate() {
        if !pools.iter().any(|p| fits(p, 0, need)) {
            // It fits no pool, however empty: it will be refused, and takes no room.
            starts.push(Prediction::Never);
            continue;
        }
        let Some(hold) = hold else {
            // Without a measured hold only the first can be foreseen: it starts now if it fits.
            let now_fits = k == 0 && pools.iter().zip(&used).any(|(p, &u)| fits(p, u, need));
            starts.push(if now_fits { Prediction::After(0) } else { Prediction::Unknown });
            continue;
        };
        loop {
            // The first pool with room now takes it (the policies pick among those with room).
            if let Some(i) = (0..pools.len()).find(|&i| fits(&pools[i], used[i], need)) {
                used[i] += need;
                releases.push(std::cmp::Reverse((t + hold, i, need)));
                break;
            }
            match releases.pop() {
                Some(std::cmp::Reverse((end, i, n))) => {
                    t = t.max(end);
                    used[i] -= n;
                }
                // Nothing left to release and still no room (cannot happen for a request that
                // fits an empty pool): take it as starting now.
                None => break,
            }
        }
        starts.push(Prediction::After(t - now));
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// When a request needing `tokens` of decode room is predicted to start, behind the requests
    /// `ahead` of it (their room, in queue order): [`predict_starts`] of the queue with it at the
    /// end, its own entry.
    fn predict_wait(now: u64, pools: &[DecodePool], ahead: &[usize], tokens: usize, hold: Option<u64>) -> Prediction {
        let queue: Vec<usize> = ahead.iter().copied().chain(std::iter::once(tokens)).collect();
        predict_starts(now, pools, &queue, hold).pop().unwrap_or(Prediction::Unknown)
    }

    fn pool(capacity: usize, held: &[(u64, usize)]) -> DecodePool {
        DecodePool { capacity, held: held.to_vec() }
    }

    #[test]
    fn a_request_that_fits_now_with_nobody_ahead_starts_at_once() {
        let pools = [pool(100, &[(50, 40)])];
        assert_eq!(predict_wait(10, &pools, &[], 50, None), Prediction::After(0));
    }

    #[test]
    fn a_request_larger_than_every_pool_never_fits() {
        let pools = [pool(100, &[]), pool(64, &[])];
        assert_eq!(predict_wait(0, &pools, &[], 100, Some(1)), Prediction::Never);
        assert_eq!(predict_wait(0, &pools, &[], 99, Some(1)), Prediction::After(0));
    }

    #[test]
    fn without_a_measured_hold_or_a_decode_worker_a_wait_is_unknown() {
        let pools = [pool(100, &[(50, 90)])];
        assert_eq!(predict_wait(10, &pools, &[], 50, None), Prediction::Unknown);
        assert_eq!(predict_wait(10, &[], &[], 50, Some(1)), Prediction::Unknown);
    }

    #[test]
    fn a_request_waits_for_the_room_it_needs_to_be_let_go() {
        // 90 of 100 held: 40 ends at 30, 50 at 70. After the first release 50 are held: 45 more
        // fit, 50 more do not (room is strict), so a request of 50 waits for the second.
        let pools = [pool(100, &[(30, 40), (70, 50)])];
        assert_eq!(predict_wait(10, &pools, &[], 45, Some(1_000)), Prediction::After(20));
        assert_eq!(predict_wait(10, &pools, &[], 50, Some(1_000)), Prediction::After(60));
    }

    #[test]
    fn requests_ahead_start_first_and_let_go_after_their_hold() {
        // An empty pool of 100; each request needs 60, so only one fits at a time: the one
        // ahead starts now and ends at now + hold, then ours starts.
        let pools = [pool(100, &[])];
        assert_eq!(predict_wait(5, &pools, &[60], 60, Some(1_000)), Prediction::After(1_000));
        assert_eq!(predict_wait(5, &pools, &[60, 60], 60, Some(1_000)), Prediction::After(2_000));
    }

    #[test]
    fn an_overdue_request_is_taken_to_end_now_and_pools_are_used_by_whichever_has_room() {
        let pools = [pool(100, &[(1, 90)]), pool(100, &[(500, 90)])];
        assert_eq!(predict_wait(100, &pools, &[], 50, Some(1_000)), Prediction::After(0));
        // Two ahead of 50: the first takes the freed pool 0, the second waits for pool 1 (500).
        assert_eq!(predict_wait(100, &pools, &[50, 50], 40, Some(1_000)), Prediction::After(400));
    }

    #[test]
    fn one_replay_gives_each_waiter_what_a_replay_of_its_own_gives() {
        let pools = [pool(100, &[(500, 60), (900, 30)]), pool(80, &[(300, 70)])];
        let queue = [50, 90, 40, 200, 10, 75, 30];
        let starts = predict_starts(100, &pools, &queue, Some(1_000));
        for (k, &need) in queue.iter().enumerate() {
            // A waiter that fits no pool is skipped by those behind it, as it will be refused.
            let ahead: Vec<usize> = queue[..k].iter().copied().filter(|&n| n <= 100).collect();
            assert_eq!(starts[k], predict_wait(100, &pools, &ahead, need, Some(1_000)), "waiter {k}");
        }
        assert_eq!(starts[3], Prediction::Never, "200 tokens fit no pool");
        assert!(
            starts.windows(2).all(|w| match w {
                [Prediction::After(a), Prediction::After(b)] => a <= b,
                _ => true,
            }),
            "first come, first served: {starts:?}"
        );
        // Without a measured hold, only a first waiter with room can be foreseen.
        assert_eq!(predict_starts(0, &[pool(100, &[])], &[10, 10], None), [Prediction::After(0), Prediction::Unknown]);
    }

    #[tokio::test]
    async fn the_queue_is_first_come_first_served_and_a_ticket_leaves_when_dropped() {
        let q = Arc::new(AdmissionQueue::default());
        let a = q.join(10).expect("room");
        let b = q.join(20).expect("room");
        assert!(a.is_head() && !b.is_head());
        assert_eq!(q.entries(), [(a.id(), 10), (b.id(), 20)]);
        assert!(a.id() < b.id(), "ids grow in arrival order");
        assert_eq!(q.len(), 2);
        // A replay is read by the ticket it was made for, while it is fresh.
        q.keep_replay(vec![a.id(), b.id()], vec![Prediction::After(0), Prediction::After(7)]);
        assert_eq!(q.replayed(&b, Duration::from_secs(60)), Some(Prediction::After(7)));
        assert_eq!(q.replayed(&b, Duration::ZERO), None, "a stale replay is not read");
        drop(a);
        assert!(b.is_head());
        drop(b);
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn a_waiter_is_woken_when_the_head_leaves() {
        let q = Arc::new(AdmissionQueue::default());
        let a = q.join(10).expect("room");
        let b = q.join(20).expect("room");
        let started = std::time::Instant::now();
        let wait = {
            let q = Arc::clone(&q);
            tokio::spawn(async move {
                q.changed(&b, Duration::from_secs(10)).await;
                b.is_head()
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(a);
        assert!(wait.await.expect("joins"), "woken as the new head");
        assert!(started.elapsed() < Duration::from_secs(5), "woken, not timed out");
    }
}
