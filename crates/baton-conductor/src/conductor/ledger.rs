//! The conductor's ledger of what runs where: each worker's requests in prefill and in decode
//! (kept by [`Tracked`] guards), the decode room bound to admitted requests ([`Binding`]), and the
//! measured time a request stays on its decode worker.

use super::*;

/// The conductor's ledger of its workers: a stable instance id per name, and the requests in
/// prefill and in decode on each, kept by [`Tracked`] guards.
#[derive(Debug, Default)]
pub(super) struct Loads {
    ids: HashMap<String, u32>,
    next_id: u32,
    /// Worker → request → (sent, µs; prompt tokens it computes, not cached there).
    pub(super) prefill: HashMap<String, HashMap<u64, (u64, usize)>>,
    /// Worker → request → (decode start, µs; context tokens).
    pub(super) decode: HashMap<String, HashMap<u64, (u64, usize)>>,
    /// Request → (its decode worker, when it was bound, µs): admitted to a decode worker but not
    /// yet decoding there (in prefill, or handing over), kept by a [`Binding`].
    bound: HashMap<u64, (String, u64)>,
    /// Worker → request → KV tokens, for the requests in `bound`: counted against the worker's
    /// room, so a burst cannot be admitted all at once against the same free blocks, and as
    /// sequences coming to it, so a burst does not pile onto one decode worker before its load
    /// reports show them. Kept per worker: a snapshot reads it per worker on every routing
    /// decision (no walk over every request in flight).
    bound_on: HashMap<String, HashMap<u64, usize>>,
    /// Request → when it was bound, µs, for requests that were bound and now decode: the start
    /// of their hold on decode room.
    held_since: HashMap<u64, u64>,
    /// How long requests stay on their decode worker (predictive admission's `t_d`).
    pub(super) decode_time: MovingMean,
    /// How long a request holds decode room, from its admission (binding) to the end of its
    /// decode: what the admission queue predicts waits with.
    pub(super) hold_time: MovingMean,
}

impl Loads {
    /// The KV tokens of each request admitted to decode worker `name` and not decoding yet.
    pub(super) fn bound_to(&self, name: &str) -> Vec<usize> {
        self.bound_on.get(name).map(|b| b.values().copied().collect()).unwrap_or_default()
    }

    /// Their sum: the KV tokens claimed on decode worker `name` by requests not decoding yet.
    pub(super) fn bound_tokens(&self, name: &str) -> usize {
        self.bound_on.get(name).map_or(0, |b| b.values().sum())
    }

    /// Binds `tokens` of request `id` to decode worker `worker` at `now` (µs).
    pub(super) fn bind(&mut self, id: u64, worker: &str, tokens: usize, now: u64) {
        self.unbind(id);
        self.bound_on.entry(worker.to_owned()).or_default().insert(id, tokens);
        self.bound.insert(id, (worker.to_owned(), now));
    }

    /// Ends request `id`'s binding, if it has one; when it was bound.
    pub(super) fn unbind(&mut self, id: u64) -> Option<u64> {
        let (worker, since) = self.bound.remove(&id)?;
        if let Some(on) = self.bound_on.get_mut(&worker) {
            on.remove(&id);
            if on.is_empty() {
                self.bound_on.remove(&worker);
            }
        }
        Some(since)
    }

    /// Decode worker `name`'s pool as the admission queue predicts with: its capacity and
    /// what holds room there, each with its predicted end (its start plus the measured hold;
    /// `hold` 0 while unmeasured).
    pub(super) fn decode_pool(&self, name: &str, capacity: usize, hold: u64) -> super::queue::DecodePool {
        let mut held: Vec<(u64, usize)> = Vec::new();
        if let Some(decoding) = self.decode.get(name) {
            held.extend(
                decoding
                    .iter()
                    .map(|(id, &(began, tokens))| (self.held_since.get(id).copied().unwrap_or(began) + hold, tokens)),
            );
        }
        if let Some(bound) = self.bound_on.get(name) {
            held.extend(
                bound.iter().map(|(id, &tokens)| (self.bound.get(id).map_or(0, |&(_, since)| since) + hold, tokens)),
            );
        }
        super::queue::DecodePool { capacity, held }
    }
}

/// A moving mean of durations, µs: the plain mean of the first 16, then an exponential one
/// (weight 1/16 for each new one). Plain at first, so that the first few durations weigh alike
/// (an exponential mean started at the first would keep 64% of it after eight).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct MovingMean {
    mean: Option<f64>,
    samples: u32,
}

impl MovingMean {
    /// Takes a duration in; the mean now.
    pub(super) fn observe(&mut self, us: u64) -> u64 {
        let us = us as f64;
        self.samples = self.samples.saturating_add(1);
        let weight = 1.0 / f64::from(self.samples.min(16));
        let mean = self.mean.map_or(us, |m| m + (us - m) * weight);
        self.mean = Some(mean);
        mean as u64
    }

    pub(super) fn get(self) -> Option<u64> {
        self.mean.map(|m| m as u64)
    }

    /// The mean once at least `n` durations went into it.
    pub(super) fn get_after(self, n: u32) -> Option<u64> {
        self.get().filter(|_| self.samples >= n)
    }
}

impl Loads {
    pub(super) fn id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.ids.insert(name.to_owned(), id);
        id
    }
}

/// A request's entry in the ledger while it prefills or decodes on a worker; removed on drop.
pub(crate) struct Tracked {
    conductor: Arc<Conductor>,
    worker: String,
    id: u64,
    decode: bool,
}

/// A request's claim on room in its decode worker's KV pool from admission until its decode
/// starts there (which takes the claim over) or the request ends; dropping it gives the room
/// back.
pub(crate) struct Binding {
    conductor: Arc<Conductor>,
    id: u64,
}

impl Drop for Binding {
    fn drop(&mut self) {
        let freed = self.conductor.loads().unbind(self.id).is_some();
        if freed {
            self.conductor.queue.wake();
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut loads = self.conductor.loads();
        if self.decode {
            let began = loads.decode.get_mut(&self.worker).and_then(|r| r.remove(&self.id));
            let held_since = loads.held_since.remove(&self.id);
            if let Some((began, _)) = began {
                let now = self.conductor.now_us();
                let mean = loads.decode_time.observe(now.saturating_sub(began));
                if let Some(since) = held_since {
                    loads.hold_time.observe(now.saturating_sub(since));
                }
                drop(loads);
                self.conductor.policy.decode_time(mean);
                // Decode room was freed: the head of the admission queue may start.
                self.conductor.queue.wake();
            }
        } else {
            loads.prefill.get_mut(&self.worker).map(|r| r.remove(&self.id));
        }
    }
}

impl Conductor {
    pub(super) fn loads(&self) -> std::sync::MutexGuard<'_, Loads> {
        self.loads.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records that request `id` prefills `prompt` on `worker` until the guard drops. The ledger
    /// counts the tokens the worker will compute: the prompt less the prefix its KV events say
    /// its cache holds (none with `--kv-index predicted`, which applies no events), as the
    /// simulator's queues do. The prompt is hashed here a second time (the policy hashed it in
    /// blocks of its own size); next to tokenising it, that is small.
    pub(super) fn track_prefill(
        self: &Arc<Self>,
        worker: &dyn Worker,
        id: RequestId,
        prompt: &[u32],
        fetched: usize,
    ) -> Tracked {
        let instance = InstanceId(self.loads().id(worker.name()));
        let block_tokens = worker.block_tokens().max(1);
        let hashes = baton_kv::prefix_hashes(prompt, block_tokens);
        let cached = self
            .view
            .trees()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .confirmed_prefix_len(instance, &hashes)
            * block_tokens;
        self.track(worker, id, false, prompt.len().saturating_sub(cached.max(fetched)))
    }

    /// Records that request `id` prefills (`decode: false`, `tokens` to compute) or decodes
    /// (`tokens` = context) on `worker` until the guard drops.
    pub(super) fn track(self: &Arc<Self>, worker: &dyn Worker, id: RequestId, decode: bool, tokens: usize) -> Tracked {
        let now = self.now_us();
        let mut loads = self.loads();
        let name = worker.name().to_owned();
        if decode {
            // Decoding, the request's context counts here: its admission claim is over, and its
            // hold on decode room goes on from when it was bound.
            if let Some(since) = loads.unbind(id.0) {
                loads.held_since.insert(id.0, since);
            }
            loads.decode.entry(name.clone()).or_default().insert(id.0, (now, tokens));
        } else {
            loads.prefill.entry(name.clone()).or_default().insert(id.0, (now, tokens));
        }
        Tracked { conductor: Arc::clone(self), worker: name, id: id.0, decode }
    }

    /// Claims room for `tokens` of KV on decode worker `decode` for request `id`, or finds none
    /// when what decodes there and what is already bound to it leave no room (the request
    /// waits in the admission queue). Checked and claimed under one lock: concurrent admissions
    /// see each other's claims, so a burst starts only as far as the decode pool can hold it
    /// (the policy's check saw a snapshot).
    pub(super) fn bind(self: &Arc<Self>, decode: &dyn Worker, id: RequestId, tokens: usize) -> Result<Binding, NoRoom> {
        let capacity = decode.capacity_blocks() * decode.block_tokens();
        let mut loads = self.loads();
        let decoding: usize = loads.decode.get(decode.name()).map_or(0, |r| r.values().map(|&(_, t)| t).sum());
        if !crate::routing::room_for(capacity, decoding + loads.bound_tokens(decode.name()), tokens) {
            return Err(NoRoom);
        }
        let now = self.now_us();
        loads.bind(id.0, decode.name(), tokens, now);
        Ok(Binding { conductor: Arc::clone(self), id: id.0 })
    }
}

#[cfg(test)]
mod tests {
    use super::MovingMean;

    #[test]
    fn the_first_durations_weigh_alike_then_the_mean_moves() {
        let mut m = MovingMean::default();
        assert_eq!((m.get(), m.get_after(1)), (None, None));
        assert_eq!(m.observe(100), 100);
        assert_eq!(m.observe(300), 200, "two durations, each half");
        assert_eq!(m.observe(500), 300);
        assert_eq!((m.get_after(3), m.get_after(4)), (Some(300), None));
        for _ in 0..13 {
            m.observe(300);
        }
        // Sixteen in: from here each new one weighs 1/16.
        assert_eq!(m.observe(1900), 400);
    }
}
