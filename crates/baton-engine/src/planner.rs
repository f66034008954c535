//! The step planner: a pure function from the engine's state to the next step.
//!
//! Every sequence is a list of tokens (prompt, then generated) of which the first `computed`
//! have their KV in the cache. A step computes the next run of each scheduled sequence: the rest
//! of its prompt (in chunks of at most `prefill_chunk` tokens) or, once the prompt is done, the
//! one token it sampled last. Prefill and decode share one token budget per step, so decode
//! never stalls behind a long prompt (continuous batching with chunked prefill).
//!
//! Memory discipline (what makes a step never fail for want of blocks, and the engine never
//! wedge): `free_blocks` counts every block an allocation can get (free, or cached and held by
//! no one); a sequence gives back only what it holds alone ([`SeqView::freeable`]), and a
//! waiting sequence's cache hit costs only the cached blocks no one holds yet
//! ([`SeqView::to_pin`]): waiting sequences take their cached prefix when admitted, not while
//! they wait.
//!
//! Order of decisions:
//! 1. Running sequences, oldest first, each take what they need from the token budget and the
//!    free blocks. When blocks run out, the newest running sequence is preempted (its blocks
//!    freed, to be recomputed later) until the older one fits; when no newer one is left,
//!    waiting sequences that hold blocks (KV received from a peer, not yet admitted) give
//!    them up, newest first; then the sequence itself waits.
//! 2. Waiting sequences, first come first served, are admitted only while the free blocks cover
//!    their *whole* remaining prompt (admission by free blocks: an admitted prompt will not be
//!    preempted for lack of room by another admission), the token budget lasts and fewer than
//!    `max_num_seqs` run. When nothing runs and the first waiting sequence does not fit, the
//!    waiting sequences behind it give up the blocks they hold. No admission happens in a step
//!    that preempted.

use baton_kv::KvGeometry;

use crate::RequestId;

/// Limits that shape each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens computed in one step, over all sequences.
    pub max_batch_tokens: usize,
    /// Most prompt tokens of one sequence computed in one step.
    pub prefill_chunk: usize,
}

/// What the planner needs to know of a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqView {
    /// The sequence.
    pub id: RequestId,
    /// Tokens whose KV is in the cache.
    pub computed: usize,
    /// Tokens known (prompt and generated); `total - computed` are left to compute.
    pub total: usize,
    /// Blocks the sequence holds (a waiting sequence: or will hold once it takes its cache
    /// hit, which `computed` then counts too).
    pub blocks: usize,
    /// Of `blocks`, those it holds alone: what preempting it makes allocatable.
    pub freeable: usize,
    /// Of `blocks`, cached blocks a waiting sequence has yet to take that no one holds:
    /// admitting it takes them out of the free blocks.
    pub to_pin: usize,
}

/// The engine's state as the planner sees it.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    /// Limits.
    pub config: PlannerConfig,
    /// Blocks on the free list.
    pub free_blocks: usize,
    /// Running sequences, oldest first.
    pub running: &'a [SeqView],
    /// Waiting sequences, first come first served.
    pub waiting: &'a [SeqView],
}

/// One sequence's work in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    /// The sequence.
    pub id: RequestId,
    /// Tokens to compute, from its `computed` position on.
    pub num_tokens: usize,
    /// Blocks to allocate for it before the step.
    pub new_blocks: usize,
}

/// The planner's decision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Running sequences to preempt first (free their blocks, back to the front of the queue).
    pub preempted: Vec<RequestId>,
    /// Waiting sequences that start running in this step (each is also in `batch`).
    pub admitted: Vec<RequestId>,
    /// The work of the step, running sequences first.
    pub batch: Vec<Scheduled>,
}

impl Plan {
    /// Tokens the step computes.
    pub fn num_tokens(&self) -> usize {
        self.batch.iter().map(|s| s.num_tokens).sum()
    }
}

/// Plans the next step. Pure: the same input gives the same plan.
pub fn plan(input: &PlanInput<'_>) -> Plan {
    let c = input.config;
    let geometry = KvGeometry::new(1, 1, 1, c.block_size);
    let mut budget = c.max_batch_tokens;
    let mut free = input.free_blocks;
    let mut out = Plan::default();
    // Waiting sequences that hold blocks and may give them up, newest last.
    let mut holders: Vec<SeqView> = input.waiting.iter().filter(|w| w.freeable > 0).copied().collect();
    // Running sequences that may still be preempted, newest last.
    let mut alive: Vec<SeqView> = input.running.to_vec();
    let mut i = 0;
    while i < alive.len() {
        if budget == 0 {
            break;
        }
        let s = alive[i];
        let num = (s.total - s.computed).min(c.prefill_chunk).min(budget);
        let need = geometry.blocks_for(s.computed + num).saturating_sub(s.blocks);
        while need > free && alive.len() > i + 1 {
            let victim = alive.pop().expect("more than i + 1 alive");
            free += victim.freeable;
            out.preempted.push(victim.id);
        }
        while need > free
            && let Some(victim) = holders.pop()
        {
            free += victim.freeable;
            out.preempted.push(victim.id);
        }
        if need > free {
            // Nothing newer is left to evict: this sequence waits for blocks itself.
            alive.remove(i);
            free += s.freeable;
            out.preempted.push(s.id);
            continue;
        }
        if num > 0 {
            budget -= num;
            free -= need;
            out.batch.push(Scheduled { id: s.id, num_tokens: num, new_blocks: need });
        }
        i += 1;
    }
    if !out.preempted.is_empty() {
        return out;
    }
    for (running, w) in (alive.len()..).zip(input.waiting) {
        if running >= c.max_num_seqs || budget == 0 {
            break;
        }
        let whole_prompt = geometry.blocks_for(w.total).saturating_sub(w.blocks) + w.to_pin;
        let mut dropped = false;
        if whole_prompt > free && running == 0 {
            // Nothing runs, so nothing will free blocks: those waiting behind give theirs up.
            while whole_prompt > free
                && let Some(victim) = holders.pop()
                && victim.id != w.id
            {
                free += victim.freeable;
                out.preempted.push(victim.id);
                dropped = true;
            }
        }
        if whole_prompt > free {
            break;
        }
        let num = (w.total - w.computed).min(c.prefill_chunk).min(budget);
        let need = geometry.blocks_for(w.computed + num).saturating_sub(w.blocks);
        // Reserve the whole prompt's blocks in this plan, allocate only the chunk's.
        free -= whole_prompt;
        budget -= num;
        out.admitted.push(w.id);
        out.batch.push(Scheduled { id: w.id, num_tokens: num, new_blocks: need });
        if dropped {
            // The views of the sequences that gave up their blocks are stale now.
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CONFIG: PlannerConfig =
        PlannerConfig { block_size: 4, max_num_seqs: 8, max_batch_tokens: 16, prefill_chunk: 8 };

    fn seq(id: u64, computed: usize, total: usize, blocks: usize) -> SeqView {
        SeqView { id: RequestId(id), computed, total, blocks, freeable: blocks, to_pin: 0 }
    }

    #[test]
    fn decode_and_chunked_prefill_share_the_budget() {
        let running = [seq(1, 10, 11, 3), seq(2, 0, 30, 0)];
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 100, running: &running, waiting: &[] });
        assert_eq!(p.batch[0], Scheduled { id: RequestId(1), num_tokens: 1, new_blocks: 0 });
        assert_eq!(p.batch[1], Scheduled { id: RequestId(2), num_tokens: 8, new_blocks: 2 });
    }

    #[test]
    fn admission_needs_blocks_for_the_whole_prompt() {
        let waiting = [seq(1, 0, 20, 0), seq(2, 0, 4, 0)];
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 4, running: &[], waiting: &waiting });
        assert!(p.admitted.is_empty(), "20 tokens need 5 blocks; FCFS does not skip ahead");
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 5, running: &[], waiting: &waiting });
        assert_eq!(p.admitted, vec![RequestId(1)]);
        assert_eq!(p.batch[0].new_blocks, 2, "only the first chunk's blocks are allocated");
    }

    #[test]
    fn newest_running_sequence_is_preempted_when_blocks_run_out() {
        let running = [seq(1, 8, 9, 2), seq(2, 4, 5, 1)];
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 0, running: &running, waiting: &[seq(3, 0, 1, 0)] });
        assert_eq!(p.preempted, vec![RequestId(2)]);
        assert_eq!(p.batch, vec![Scheduled { id: RequestId(1), num_tokens: 1, new_blocks: 1 }]);
        assert!(p.admitted.is_empty());
    }

    #[test]
    fn a_victim_frees_only_the_blocks_it_holds_alone() {
        // Request 2's blocks are shared with the prefix cache's other users: preempting it frees
        // nothing, so request 1 cannot fit after all and waits itself.
        let shared = SeqView { freeable: 0, ..seq(2, 4, 5, 1) };
        let running = [seq(1, 8, 9, 2), shared];
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 0, running: &running, waiting: &[] });
        assert_eq!(p.preempted, vec![RequestId(2), RequestId(1)]);
        assert!(p.batch.is_empty());
    }

    #[test]
    fn a_cache_hit_costs_only_the_blocks_no_one_holds() {
        // 20 tokens = 5 blocks; 3 are cached, 1 of them held by no one: admission takes 2 new
        // blocks and pins 1, so 3 free blocks suffice and 2 do not.
        let hit = SeqView { to_pin: 1, freeable: 0, ..seq(1, 12, 20, 3) };
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 2, running: &[], waiting: &[hit] });
        assert!(p.admitted.is_empty());
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 3, running: &[], waiting: &[hit] });
        assert_eq!(p.admitted, vec![RequestId(1)]);
        assert_eq!(p.batch[0], Scheduled { id: RequestId(1), num_tokens: 8, new_blocks: 2 });
    }

    #[test]
    fn waiting_holders_give_up_their_blocks_rather_than_wedge() {
        // Nothing runs; the first waiting prompt needs 3 blocks; the two behind it hold 2 each
        // (KV received from a peer) and the pool has 1 free: the newest holder gives its blocks up.
        let waiting = [seq(1, 0, 12, 0), seq(2, 5, 6, 2), seq(3, 5, 6, 2)];
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 1, running: &[], waiting: &waiting });
        assert_eq!(p.preempted, vec![RequestId(3)]);
        assert_eq!(p.admitted, vec![RequestId(1)]);
        // A running sequence that needs a block takes it from a waiting holder before waiting.
        let running = [seq(4, 8, 9, 2)];
        let p = plan(&PlanInput { config: CONFIG, free_blocks: 0, running: &running, waiting: &waiting[1..] });
        assert_eq!(p.preempted, vec![RequestId(3)]);
        assert_eq!(p.batch, vec![Scheduled { id: RequestId(4), num_tokens: 1, new_blocks: 1 }]);
    }

    fn waiting_view(i: usize, total: usize, kind: u8, k: usize, pin: usize) -> SeqView {
        let id = 100 + i as u64;
        match kind {
            // KV received from a peer, held while waiting.
            1 => {
                let computed = k.min(total - 1);
                seq(id, computed, total, computed.div_ceil(4))
            }
            // A cache hit in whole blocks, taken at admission.
            2 => {
                let blocks = (k / 4).min((total - 1) / 4);
                SeqView { freeable: 0, to_pin: pin.min(blocks), ..seq(id, blocks * 4, total, blocks) }
            }
            _ => seq(id, 0, total, 0),
        }
    }

    proptest! {
        /// Whatever the state, a plan never takes more blocks than the free ones and those its
        /// victims hold alone, and never exceeds the budget, the sequence limit or a sequence's
        /// remaining tokens; it schedules each sequence at most once and never one it preempts.
        #[test]
        fn plans_respect_every_limit(
            free in 0usize..40,
            running in proptest::collection::vec((0usize..40, 1usize..10, 0usize..4), 0..6),
            waiting in proptest::collection::vec((1usize..40, 0u8..3, 0usize..40, 0usize..4), 0..6),
        ) {
            let running: Vec<SeqView> = running.iter().enumerate().map(|(i, &(computed, extra, shared))| {
                let total = computed + extra;
                let blocks = computed.div_ceil(4);
                SeqView { freeable: blocks - shared.min(blocks), ..seq(i as u64, computed, total, blocks) }
            }).collect();
            let waiting: Vec<SeqView> = waiting.iter().enumerate()
                .map(|(i, &(t, kind, k, pin))| waiting_view(i, t, kind, k, pin)).collect();
            let input = PlanInput { config: CONFIG, free_blocks: free, running: &running, waiting: &waiting };
            let p = plan(&input);
            prop_assert!(p.num_tokens() <= CONFIG.max_batch_tokens);
            let all = || running.iter().chain(&waiting);
            let freed: usize = all().filter(|s| p.preempted.contains(&s.id)).map(|s| s.freeable).sum();
            let pinned: usize = waiting.iter().filter(|s| p.admitted.contains(&s.id)).map(|s| s.to_pin).sum();
            let used: usize = p.batch.iter().map(|s| s.new_blocks).sum();
            prop_assert!(used + pinned <= free + freed);
            let mut ids: Vec<_> = p.batch.iter().map(|s| s.id).collect();
            ids.sort();
            ids.dedup();
            prop_assert_eq!(ids.len(), p.batch.len());
            let mut gone = p.preempted.clone();
            gone.sort();
            gone.dedup();
            prop_assert_eq!(gone.len(), p.preempted.len());
            for s in &p.batch {
                prop_assert!(!p.preempted.contains(&s.id));
                let v = all().find(|v| v.id == s.id).expect("known");
                prop_assert!(s.num_tokens >= 1 && v.computed + s.num_tokens <= v.total);
                prop_assert!(s.num_tokens <= CONFIG.prefill_chunk);
            }
            let still = running.iter().filter(|s| !p.preempted.contains(&s.id)).count();
            prop_assert!(still + p.admitted.len() <= CONFIG.max_num_seqs.max(running.len()));
        }
    }
}
