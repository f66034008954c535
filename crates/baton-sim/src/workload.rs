//! Workloads: Mooncake-format traces, ShareGPT-style files and synthetic generators.
//!
//! Every workload becomes a list of [`SimRequest`]s sorted by arrival: lengths and the block
//! hashes of the prompt (equal hashes at the same position mean an equal prefix). Parsing is
//! separate from reading files, so tests can feed strings.

use std::path::Path;

use baton_kv::BlockHash;
pub use baton_measure::trace::MOONCAKE_BLOCK_TOKENS;
use baton_measure::{Poisson, trace};
use baton_sched::{Micros, SessionId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::SimError;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRequest {
    /// Arrival, virtual microseconds from the start.
    pub arrival_us: Micros,
    /// Prompt length.
    pub input_tokens: u64,
    /// Tokens to generate (end-of-sequence ignored).
    pub output_tokens: u64,
    /// Hashes of the prompt's blocks (the last may be partial).
    pub hashes: Vec<BlockHash>,
    /// Session, if the workload has them.
    pub session: Option<SessionId>,
}

/// Parses a Mooncake-format trace ([`baton_measure::trace::parse_mooncake`]: one JSON object a
/// line, `timestamp` in ms, `input_length`, `output_length`, `hash_ids`), dividing arrival
/// times by `time_scale` (2.0 replays twice as fast).
pub fn parse_mooncake(text: &str, time_scale: f64) -> Result<Vec<SimRequest>, SimError> {
    if !(time_scale.is_finite() && time_scale > 0.0) {
        return Err(SimError::Config(format!("time scale must be positive, got {time_scale}")));
    }
    let mut out: Vec<SimRequest> = trace::parse_mooncake(text)?
        .into_iter()
        .map(|(_, t)| SimRequest {
            arrival_us: (t.timestamp * 1000.0 / time_scale).round() as Micros,
            input_tokens: t.input_tokens(),
            output_tokens: t.output_tokens(),
            hashes: t.hash_ids.into_iter().map(BlockHash).collect(),
            session: None,
        })
        .collect();
    out.sort_by_key(|r| r.arrival_us);
    Ok(out)
}

/// Reads a Mooncake-format trace file.
pub fn read_mooncake(path: &Path, time_scale: f64) -> Result<Vec<SimRequest>, SimError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
    parse_mooncake(&text, time_scale)
}

/// Parses a ShareGPT-style JSON file ([`baton_measure::trace::parse_sharegpt`]:
/// `[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}, ...]`).
/// Every human turn is a request whose prompt is the whole conversation so far (so later turns
/// share the earlier turns' blocks) and whose output is the next reply. Tokens are estimated as
/// characters / 4 ([`baton_measure::trace::estimate_tokens`]); arrivals are Poisson at `rate`
/// per second.
pub fn parse_sharegpt(text: &str, rate: f64, block_tokens: u64, seed: u64) -> Result<Vec<SimRequest>, SimError> {
    let convs = trace::parse_sharegpt(text)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut arrivals = poisson(rate);
    for (c, conv) in convs.iter().enumerate() {
        let mut context = 0u64;
        let turns = &conv.conversations;
        for (i, turn) in turns.iter().enumerate() {
            let tokens = turn.tokens();
            if turn.is_human() {
                let input = context + tokens;
                let output = turns.get(i + 1).map_or(64, trace::Message::tokens);
                let t = arrivals.advance(uniform(&mut rng));
                out.push(SimRequest {
                    arrival_us: (t * 1e6) as Micros,
                    input_tokens: input,
                    output_tokens: output,
                    hashes: session_hashes(c as u64, input, block_tokens),
                    session: Some(SessionId(c as u64)),
                });
            }
            context += tokens;
        }
    }
    out.sort_by_key(|r| r.arrival_us);
    Ok(out)
}

/// The Poisson arrivals of `rate` per second (a rate of 0 or less: one in 30 years).
fn poisson(rate: f64) -> Poisson {
    Poisson::new(rate.max(1e-9))
}

/// A uniform in (0, 1) from the run's RNG, for [`Poisson::advance`].
fn uniform(rng: &mut StdRng) -> f64 {
    rng.random_range(f64::EPSILON..1.0)
}

/// Block hashes of a prompt of `tokens` tokens that is a prefix of session `session`'s
/// conversation: block `i` of the session is the same block in every turn.
fn session_hashes(session: u64, tokens: u64, block_tokens: u64) -> Vec<BlockHash> {
    let blocks = tokens.div_ceil(block_tokens);
    // Full blocks are shared across turns; a partial last block is unique to this request.
    (0..blocks)
        .map(|b| {
            let full = (b + 1) * block_tokens <= tokens;
            let tag = if full { 0 } else { tokens };
            BlockHash(splitmix(session.wrapping_mul(0x9E37_79B9) ^ (b << 32) ^ tag.wrapping_mul(0x85EB_CA6B)))
        })
        .collect()
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A synthetic workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Synthetic {
    /// Independent requests, Poisson arrivals, uniform lengths in the given ranges.
    Poisson {
        /// Requests.
        requests: usize,
        /// Requests per second.
        rate: f64,
        /// Prompt length range (inclusive).
        input: (u64, u64),
        /// Output length range (inclusive).
        output: (u64, u64),
    },
    /// Sessions sharing a system prompt, each a chain of turns that extends its own history
    /// (the multi-turn pattern that prefix caching and session affinity exploit).
    SharedPrefix {
        /// Sessions.
        sessions: usize,
        /// Turns per session.
        turns: usize,
        /// Requests per second (all sessions together).
        rate: f64,
        /// Tokens of the system prompt shared by every session.
        system_tokens: u64,
        /// Tokens each turn adds (user message plus the previous reply).
        turn_tokens: u64,
        /// Output length.
        output: u64,
    },
    /// Sessions that each have a long context of their own (a document, a code base, a long
    /// history) and come back to it turn after turn: session starts are Poisson at `rate`, each
    /// turn extends the previous one's prompt by `turn_tokens` and arrives `think_s` seconds
    /// after it (an open loop: a turn does not wait for the previous answer). No block is
    /// shared between sessions, so only an instance that holds a session's history can reuse it.
    OwnContext {
        /// Sessions.
        sessions: usize,
        /// Turns per session.
        turns: usize,
        /// Session starts per second.
        rate: f64,
        /// Tokens of a session's first prompt.
        context_tokens: u64,
        /// Tokens each later turn adds (the previous answer and the new question).
        turn_tokens: u64,
        /// Output length.
        output: u64,
        /// Seconds from one turn of a session to its next.
        think_s: f64,
    },
    /// Multi-turn conversations that open with one of a few hot shared prefixes (system prompts,
    /// few-shot preambles): session starts are Poisson at `rate`, each session picks prefix `k`
    /// (0-based) with Zipf probability ∝ `1 / (k + 1)^zipf`, and each turn extends the session's
    /// own history by `turn_tokens`, `think_s` seconds after the previous turn (open loop).
    ///
    /// Many concurrent requests then share the hottest prefix: a policy that sends every request
    /// to the instance holding the longest prefix piles them all onto one instance (issue #18).
    HotPrefixes {
        /// Sessions.
        sessions: usize,
        /// Turns per session.
        turns: usize,
        /// Session starts per second.
        rate: f64,
        /// Distinct shared prefixes.
        prefixes: usize,
        /// Zipf exponent of the prefixes' popularity (0: uniform).
        zipf: f64,
        /// Tokens of each shared prefix.
        prefix_tokens: u64,
        /// Tokens each turn adds after the prefix (the question, later the previous answer too).
        turn_tokens: u64,
        /// Output length.
        output: u64,
        /// Seconds from one turn of a session to its next.
        think_s: f64,
    },
}

/// Generates a synthetic workload, deterministic for `seed`.
pub fn synthesize(spec: &Synthetic, block_tokens: u64, seed: u64) -> Vec<SimRequest> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    match *spec {
        Synthetic::Poisson { requests, rate, input, output } => {
            let mut arrivals = poisson(rate);
            for i in 0..requests {
                let t = arrivals.advance(uniform(&mut rng));
                let inp = rng.random_range(input.0.max(1)..=input.1.max(input.0.max(1)));
                let outp = rng.random_range(output.0.max(1)..=output.1.max(output.0.max(1)));
                out.push(SimRequest {
                    arrival_us: (t * 1e6) as Micros,
                    input_tokens: inp,
                    output_tokens: outp,
                    hashes: session_hashes(1 << 40 | i as u64, inp, block_tokens),
                    session: None,
                });
            }
        }
        Synthetic::SharedPrefix { sessions, turns, rate, system_tokens, turn_tokens, output } => {
            // Interleave sessions: each arrival picks a random session that still has turns.
            let mut next_turn = vec![0usize; sessions];
            let mut live: Vec<usize> = (0..sessions).collect();
            let mut arrivals = poisson(rate);
            let sys_blocks = system_tokens / block_tokens.max(1);
            while !live.is_empty() {
                let k = rng.random_range(0..live.len());
                let s = live[k];
                let turn = next_turn[s];
                next_turn[s] += 1;
                if next_turn[s] == turns {
                    live.swap_remove(k);
                }
                let t = arrivals.advance(uniform(&mut rng));
                let input = system_tokens + (turn as u64 + 1) * turn_tokens;
                let mut hashes = session_hashes(s as u64, input, block_tokens);
                // The system prompt's full blocks are the same in every session.
                for (b, h) in hashes.iter_mut().enumerate().take(sys_blocks as usize) {
                    *h = BlockHash(splitmix(0xC0FFEE ^ b as u64));
                }
                out.push(SimRequest {
                    arrival_us: (t * 1e6) as Micros,
                    input_tokens: input,
                    output_tokens: output,
                    hashes,
                    session: Some(SessionId(s as u64)),
                });
            }
        }
        Synthetic::OwnContext { sessions, turns, rate, context_tokens, turn_tokens, output, think_s } => {
            let mut starts = poisson(rate);
            for s in 0..sessions {
                let start = starts.advance(uniform(&mut rng));
                for turn in 0..turns {
                    // Whole milliseconds, so the workload survives a trace file unchanged.
                    let at_ms = ((start + turn as f64 * think_s) * 1e3).round() as Micros;
                    let input = context_tokens + turn as u64 * turn_tokens;
                    out.push(SimRequest {
                        arrival_us: at_ms * 1000,
                        input_tokens: input.max(1),
                        output_tokens: output.max(1),
                        hashes: session_hashes(1 << 48 | s as u64, input.max(1), block_tokens),
                        session: Some(SessionId(s as u64)),
                    });
                }
            }
            out.sort_by_key(|r| r.arrival_us);
        }
        Synthetic::HotPrefixes {
            sessions,
            turns,
            rate,
            prefixes,
            zipf,
            prefix_tokens,
            turn_tokens,
            output,
            think_s,
        } => {
            let weights: Vec<f64> = (0..prefixes.max(1)).map(|k| (k as f64 + 1.0).powf(-zipf)).collect();
            let total: f64 = weights.iter().sum();
            let shared_blocks = (prefix_tokens / block_tokens.max(1)) as usize;
            let mut starts = poisson(rate);
            for s in 0..sessions {
                let start = starts.advance(uniform(&mut rng));
                let mut u = rng.random_range(0.0..total);
                let prefix = weights.iter().position(|&w| {
                    u -= w;
                    u < 0.0
                });
                let prefix = prefix.unwrap_or(weights.len() - 1) as u64;
                for turn in 0..turns {
                    let at_ms = ((start + turn as f64 * think_s) * 1e3).round() as Micros;
                    let input = (prefix_tokens + (turn as u64 + 1) * turn_tokens).max(1);
                    let mut hashes = session_hashes(1 << 52 | s as u64, input, block_tokens);
                    // The prefix's full blocks are the same in every session that opens with it.
                    for (b, h) in hashes.iter_mut().enumerate().take(shared_blocks) {
                        *h = BlockHash(splitmix(0xC0FFEE ^ ((prefix + 1) << 40) ^ b as u64));
                    }
                    out.push(SimRequest {
                        arrival_us: at_ms * 1000,
                        input_tokens: input,
                        output_tokens: output.max(1),
                        hashes,
                        session: Some(SessionId(s as u64)),
                    });
                }
            }
            out.sort_by_key(|r| r.arrival_us);
        }
    }
    out
}

/// Writes requests as a Mooncake-format trace (one JSON line each: `timestamp` in whole
/// milliseconds, `input_length`, `output_length`, `hash_ids`), so the very workload `baton sim`
/// runs can be replayed against a live server (`baton bench serve --workload mooncake`).
/// Sessions are not part of the format; arrivals are truncated to the millisecond.
pub fn to_mooncake(requests: &[SimRequest]) -> String {
    let mut out = String::new();
    for r in requests {
        let hash_ids: Vec<u64> = r.hashes.iter().map(|h| h.0).collect();
        out.push_str(&trace::mooncake_line(r.arrival_us / 1000, r.input_tokens, r.output_tokens, &hash_ids));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_context_sessions_extend_their_own_history_and_survive_a_trace_file() {
        let spec = Synthetic::OwnContext {
            sessions: 5,
            turns: 3,
            rate: 2.0,
            context_tokens: 2048,
            turn_tokens: 512,
            output: 16,
            think_s: 4.0,
        };
        let reqs = synthesize(&spec, 512, 7);
        assert_eq!(reqs.len(), 15);
        assert!(reqs.windows(2).all(|w| w[0].arrival_us <= w[1].arrival_us));
        let mut by_session: std::collections::BTreeMap<_, Vec<&SimRequest>> = Default::default();
        for r in &reqs {
            by_session.entry(r.session).or_default().push(r);
        }
        assert_eq!(by_session.len(), 5);
        for turns in by_session.values() {
            for (k, w) in turns.windows(2).enumerate() {
                // Each turn extends the last: its whole prompt blocks are the previous prompt's.
                assert_eq!(w[1].input_tokens, 2048 + (k as u64 + 1) * 512);
                assert_eq!(&w[1].hashes[..w[0].hashes.len()], &w[0].hashes[..]);
                assert_eq!(w[1].arrival_us - w[0].arrival_us, 4_000_000);
            }
        }
        // No block is shared between sessions.
        let firsts: std::collections::BTreeSet<_> = by_session.values().map(|t| t[0].hashes[0]).collect();
        assert_eq!(firsts.len(), 5);
        // Written as a trace and read back, the workload is the same (sessions aside).
        let back = parse_mooncake(&to_mooncake(&reqs), 1.0).expect("parse");
        let strip = |r: &SimRequest| SimRequest { session: None, ..r.clone() };
        assert_eq!(back, reqs.iter().map(strip).collect::<Vec<_>>());
    }

    #[test]
    fn hot_prefix_sessions_share_a_zipf_popular_prefix_and_extend_their_own_history() {
        let spec = Synthetic::HotPrefixes {
            sessions: 400,
            turns: 3,
            rate: 20.0,
            prefixes: 3,
            zipf: 1.5,
            prefix_tokens: 1024 + 100,
            turn_tokens: 512,
            output: 8,
            think_s: 2.0,
        };
        let reqs = synthesize(&spec, 512, 5);
        assert_eq!(reqs, synthesize(&spec, 512, 5), "deterministic for a seed");
        assert_eq!(reqs.len(), 1200);
        assert!(reqs.windows(2).all(|w| w[0].arrival_us <= w[1].arrival_us));
        let mut by_session: std::collections::BTreeMap<_, Vec<&SimRequest>> = Default::default();
        for r in &reqs {
            by_session.entry(r.session).or_default().push(r);
        }
        // Sessions per prefix (named by its first block), most popular first: 1 : 2^-1.5 : 3^-1.5.
        let mut popularity: std::collections::BTreeMap<BlockHash, usize> = Default::default();
        for turns in by_session.values() {
            *popularity.entry(turns[0].hashes[0]).or_default() += 1;
            for (k, w) in turns.windows(2).enumerate() {
                assert_eq!(w[1].input_tokens, 1124 + (k as u64 + 2) * 512);
                // Whole blocks of the previous turn reappear; the partial one does not.
                let whole = (w[0].input_tokens / 512) as usize;
                assert_eq!(w[1].hashes[..whole], w[0].hashes[..whole]);
                assert_ne!(w[1].hashes[whole], w[0].hashes[whole]);
                assert_eq!(w[1].arrival_us - w[0].arrival_us, 2_000_000);
            }
        }
        let mut counts: Vec<usize> = popularity.into_values().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(counts.len(), 3);
        assert!(counts[0] > 220 && counts[1] > 60 && counts[2] > 25, "{counts:?}");
        // Only the prefix's two whole blocks are shared between sessions of a prefix; its partial
        // third block is each session's own.
        let hot = by_session.values().filter(|t| t[0].hashes[0] == reqs[0].hashes[0]).collect::<Vec<_>>();
        assert!(hot.iter().all(|t| t[0].hashes[..2] == hot[0][0].hashes[..2]));
        assert_ne!(hot[0][0].hashes[2], hot[1][0].hashes[2]);
    }

    /// A seed's arrivals are the ones it gave before they came from `baton_measure::Poisson`,
    /// for every generator and ShareGPT files.
    #[test]
    fn a_seed_gives_the_arrivals_it_gave() {
        let arrivals = |spec: Synthetic| synthesize(&spec, 512, 9).iter().map(|r| r.arrival_us).collect::<Vec<_>>();
        let (rate, think_s) = (3.0, 1.0);
        assert_eq!(
            arrivals(Synthetic::Poisson { requests: 6, rate, input: (10, 20), output: (1, 2) }),
            [145_295, 298_609, 301_049, 733_142, 735_104, 816_837]
        );
        let shared =
            Synthetic::SharedPrefix { sessions: 3, turns: 2, rate, system_tokens: 10, turn_tokens: 5, output: 2 };
        assert_eq!(arrivals(shared), [71_251, 166_487, 792_338, 952_535, 1_612_304, 1_646_920]);
        let own = Synthetic::OwnContext {
            sessions: 6,
            turns: 1,
            rate,
            context_tokens: 10,
            turn_tokens: 5,
            output: 2,
            think_s,
        };
        assert_eq!(arrivals(own), [145_000, 1_250_000, 1_345_000, 1_498_000, 1_645_000, 1_805_000]);
        let hot = Synthetic::HotPrefixes {
            sessions: 6,
            turns: 1,
            rate,
            prefixes: 2,
            zipf: 1.0,
            prefix_tokens: 10,
            turn_tokens: 5,
            output: 2,
            think_s,
        };
        assert_eq!(arrivals(hot), [145_000, 241_000, 387_000, 390_000, 424_000, 546_000]);
        let text = r#"[{"conversations": [{"from": "human", "value": "aaaa"}, {"from": "gpt", "value": "b"},
            {"from": "human", "value": "c"}]}, {"conversations": [{"from": "human", "value": "d"}]}]"#;
        let sharegpt = parse_sharegpt(text, rate, 4, 9).expect("parse");
        assert_eq!(sharegpt.iter().map(|r| r.arrival_us).collect::<Vec<_>>(), [145_295, 1_249_747, 1_344_984]);
    }

    #[test]
    fn mooncake_lines_parse_and_scale() {
        let text = "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\
                    {\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [2]}\n";
        let r = parse_mooncake(text, 2.0).expect("parse");
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].arrival_us, 0);
        assert_eq!(r[1].arrival_us, 500_000);
        assert_eq!(r[1].hashes, vec![BlockHash(0), BlockHash(1)]);
        assert!(matches!(parse_mooncake("{nope", 1.0), Err(SimError::Parse { line: 1, .. })));
        assert!(parse_mooncake(text, 0.0).is_err());
    }

    #[test]
    fn sharegpt_turns_share_their_history() {
        let text = r#"[{"conversations": [
            {"from": "human", "value": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"},
            {"from": "gpt", "value": "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"},
            {"from": "human", "value": "cccccccc"}]}]"#;
        let r = parse_sharegpt(text, 1.0, 4, 0).expect("parse");
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].input_tokens, r[0].output_tokens), (10, 12));
        assert_eq!(r[1].input_tokens, 24);
        assert_eq!(r[1].hashes[..2], r[0].hashes[..2], "full blocks of turn 1 reappear in turn 2");
    }

    #[test]
    fn synthetic_workloads_are_deterministic_and_share_prefixes() {
        let spec = Synthetic::SharedPrefix {
            sessions: 4,
            turns: 3,
            rate: 2.0,
            system_tokens: 1024,
            turn_tokens: 512,
            output: 16,
        };
        let a = synthesize(&spec, 512, 1);
        assert_eq!(a, synthesize(&spec, 512, 1));
        assert_eq!(a.len(), 12);
        assert!(a.windows(2).all(|w| w[0].arrival_us <= w[1].arrival_us));
        assert!(a.iter().all(|r| r.hashes[..2] == a[0].hashes[..2]), "system prompt shared");
        let p = synthesize(&Synthetic::Poisson { requests: 50, rate: 10.0, input: (100, 200), output: (1, 8) }, 512, 3);
        assert_eq!(p.len(), 50);
        assert!(p.iter().all(|r| (100..=200).contains(&r.input_tokens)));
    }
}
