//! The run loop (I/O): starts chains at their scheduled times, holds requests back at the
//! concurrency limit, sends each session's turns one after another, and records every request.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::client::{Client, Message, RequestOptions, Role, request_body};
use crate::metrics::RequestRecord;
use crate::text::mix;
use crate::workload::Workload;

/// Told about progress while a benchmark runs (a progress bar, a log).
pub trait Observer: Send + Sync {
    /// A run of `requests` requests starts.
    fn run_started(&self, _label: &str, _requests: usize) {}
    /// A request ended.
    fn request_done(&self, _record: &RequestRecord) {}
    /// The run ended.
    fn run_finished(&self) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct Quiet;

impl Observer for Quiet {}

/// How one run goes.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// Start offset of each chain, µs.
    pub starts: Vec<u64>,
    /// Most requests in flight at once.
    pub concurrency: Option<usize>,
    /// Send nothing new after this long.
    pub duration: Option<Duration>,
    /// Limit of one request, from sending to the end of its stream.
    pub request_timeout: Duration,
    /// Pause between an answer and the session's next turn.
    pub think_time: Duration,
    /// Seed of per-request sampling seeds.
    pub seed: u64,
}

/// Runs a workload and returns its records, ordered by id.
pub async fn run(
    client: Arc<Client>,
    opts: Arc<RequestOptions>,
    workload: &Workload,
    plan: &RunPlan,
    observer: Arc<dyn Observer>,
) -> Vec<RequestRecord> {
    let t0 = Instant::now();
    let deadline = plan.duration.map(|d| t0 + d);
    let permits = Arc::new(Semaphore::new(plan.concurrency.unwrap_or(Semaphore::MAX_PERMITS)));
    let mut tasks = tokio::task::JoinSet::new();
    let mut first_id = 0;
    for (c, chain) in workload.chains.iter().enumerate() {
        let start = t0 + Duration::from_micros(plan.starts.get(c).copied().unwrap_or(0));
        if deadline.is_some_and(|d| start >= d) {
            // Due after the run's duration: never sent (and not waited for).
            first_id += chain.turns.len();
            continue;
        }
        let ctx = ChainCtx {
            client: client.clone(),
            opts: opts.clone(),
            permits: permits.clone(),
            observer: observer.clone(),
            t0,
            start,
            deadline,
            request_timeout: plan.request_timeout,
            think_time: plan.think_time,
            seed: plan.seed,
            chain: c,
            first_id,
        };
        first_id += chain.turns.len();
        let turns = chain.turns.clone();
        tasks.spawn(ctx.run(turns));
    }
    let mut records = Vec::new();
    while let Some(done) = tasks.join_next().await {
        // A chain task only ends by returning; a panic would be a bug in this crate.
        if let Ok(mut r) = done {
            records.append(&mut r);
        }
    }
    records.sort_by_key(|r| r.id);
    records
}

struct ChainCtx {
    client: Arc<Client>,
    opts: Arc<RequestOptions>,
    permits: Arc<Semaphore>,
    observer: Arc<dyn Observer>,
    t0: Instant,
    start: Instant,
    deadline: Option<Instant>,
    request_timeout: Duration,
    think_time: Duration,
    seed: u64,
    chain: usize,
    first_id: usize,
}

impl ChainCtx {
    async fn run(self, turns: Vec<crate::workload::Turn>) -> Vec<RequestRecord> {
        tokio::time::sleep_until(self.start).await;
        let mut conversation: Vec<Message> = Vec::new();
        let mut records = Vec::new();
        for (k, turn) in turns.into_iter().enumerate() {
            if k > 0 && !self.think_time.is_zero() {
                tokio::time::sleep(self.think_time).await;
            }
            let scheduled = Instant::now();
            if self.deadline.is_some_and(|d| scheduled >= d) {
                break;
            }
            let Ok(_permit) = self.permits.acquire().await else { break };
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            conversation.push(Message { role: Role::User, content: turn.text });
            let id = self.first_id + k;
            let body = request_body(&self.opts, &conversation, turn.max_tokens, mix(&[self.seed, id as u64]));
            let sent = Instant::now();
            let ex = self.client.stream(self.opts.endpoint, &body, self.request_timeout).await;
            let ok = ex.outcome == crate::metrics::Outcome::Ok;
            let record = RequestRecord {
                id,
                chain: self.chain,
                turn: k,
                scheduled_us: crate::client::micros(scheduled - self.t0),
                start_us: crate::client::micros(sent - self.t0),
                ttft_us: ex.ttft_us,
                itl_us: ex.itl_us,
                jct_us: ex.jct_us,
                input_tokens: ex.usage.map_or(turn.input_tokens, |u| u.prompt_tokens),
                input_from_usage: ex.usage.is_some(),
                cached_tokens: ex.usage.and_then(|u| u.cached_tokens),
                output_tokens: ex.usage.map_or(ex.chunks, |u| u.completion_tokens),
                chunks: ex.chunks,
                max_tokens: turn.max_tokens,
                outcome: ex.outcome,
                error: ex.error,
            };
            self.observer.request_done(&record);
            records.push(record);
            if !ok {
                // Later turns need this answer.
                break;
            }
            conversation.push(Message { role: Role::Assistant, content: ex.text });
        }
        records
    }
}
