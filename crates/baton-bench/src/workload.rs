//! Workloads, pure: what to send, built deterministically from a seed (and a file's text).
//!
//! A workload is a list of [`Chain`]s. A chain is one independent request, or a session whose
//! turns are causal: turn k+1 is sent only after turn k's answer has arrived, and its prompt is
//! the whole conversation so far (previous prompts, the answers as the server gave them, the new
//! user text), so consecutive turns share a growing prefix. The runner assembles those prompts;
//! here a turn holds only its new text.
//!
//! - [`synthetic`]: independent requests with fixed or distributed lengths ([`LengthDist`]).
//! - [`sessions`]: sessions sharing one system prompt, each a chain of turns.
//! - [`parse_sharegpt`]: ShareGPT-format conversations (first turn, or every turn as a session).
//! - [`parse_mooncake`]: Mooncake-format traces; the text of each 512-token block is generated
//!   from its hash id, so equal ids give equal text and equal token prefixes.

use std::path::{Path, PathBuf};

use baton_measure::trace::{self, ParseError};
pub use baton_measure::trace::{MOONCAKE_BLOCK_TOKENS, estimate_tokens};
use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::text::{mix, splitmix, words};

/// One request of a chain: the text it adds to the conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Turn {
    /// New user text (about one token a word).
    pub text: String,
    /// Prompt tokens the workload aims at (the whole conversation so far, estimated).
    pub input_tokens: u64,
    /// Output tokens to ask for (`max_tokens`).
    pub max_tokens: u64,
}

/// An independent request (one turn) or a session (turns sent one after another).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chain {
    /// Arrival from the trace, µs from the trace's start (trace workloads only).
    pub arrival_us: Option<u64>,
    /// The turns, in order.
    pub turns: Vec<Turn>,
}

/// What a run sends.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// Chains, in order of arrival.
    pub chains: Vec<Chain>,
    /// Entries of the source left out (too long, no usable turn).
    pub skipped: usize,
}

impl Workload {
    /// Requests in all chains.
    pub fn requests(&self) -> usize {
        self.chains.iter().map(|c| c.turns.len()).sum()
    }

    /// Keeps the first `n` requests (whole chains in order, the last one possibly cut short).
    pub fn truncate(&mut self, n: usize) {
        let mut left = n;
        self.chains.retain_mut(|c| {
            if left == 0 {
                return false;
            }
            c.turns.truncate(left);
            left -= c.turns.len();
            true
        });
    }
}

/// A length: fixed, or drawn per request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthDist {
    /// Always this many tokens.
    Fixed(u64),
    /// Uniform over `min..=max`.
    Uniform {
        /// Smallest.
        min: u64,
        /// Largest.
        max: u64,
    },
    /// Normal, rounded and clamped to at least 1.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
}

impl LengthDist {
    /// Draws a length (at least 1) from the stream `state`.
    pub fn sample(&self, state: &mut u64) -> u64 {
        match *self {
            LengthDist::Fixed(n) => n.max(1),
            LengthDist::Uniform { min, max } => {
                let (lo, hi) = (min.max(1), max.max(min.max(1)));
                lo + splitmix(state) % (hi - lo + 1)
            }
            LengthDist::Normal { mean, std } => {
                // Box–Muller on two uniforms in (0, 1].
                let u1 = ((splitmix(state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (splitmix(state) >> 11) as f64 / (1u64 << 53) as f64;
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (mean + std * z).round().max(1.0) as u64
            }
        }
    }
}

impl std::str::FromStr for LengthDist {
    type Err = String;

    /// `N`, `uniform:MIN:MAX` or `normal:MEAN:STD`.
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |x: &str| x.trim().parse::<f64>().map_err(|_| format!("not a number: {x:?} in {s:?}"));
        let int = |x: &str| x.trim().parse::<u64>().map_err(|_| format!("not a whole number: {x:?} in {s:?}"));
        let d = match parts.as_slice() {
            [n] => LengthDist::Fixed(int(n)?),
            ["fixed", n] => LengthDist::Fixed(int(n)?),
            ["uniform", a, b] => LengthDist::Uniform { min: int(a)?, max: int(b)? },
            ["normal", m, sd] => LengthDist::Normal { mean: num(m)?, std: num(sd)? },
            _ => return Err(format!("expected N, uniform:MIN:MAX or normal:MEAN:STD, got {s:?}")),
        };
        match d {
            LengthDist::Fixed(0) => Err("a length must be at least 1".into()),
            LengthDist::Uniform { min, max } if min == 0 || max < min => {
                Err(format!("uniform needs 1 <= MIN <= MAX, got {s:?}"))
            }
            LengthDist::Normal { mean, std } if !(mean >= 1.0 && std >= 0.0 && mean.is_finite() && std.is_finite()) => {
                Err(format!("normal needs MEAN >= 1 and STD >= 0, got {s:?}"))
            }
            d => Ok(d),
        }
    }
}

impl std::fmt::Display for LengthDist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LengthDist::Fixed(n) => write!(f, "{n}"),
            LengthDist::Uniform { min, max } => write!(f, "uniform:{min}:{max}"),
            LengthDist::Normal { mean, std } => write!(f, "normal:{mean}:{std}"),
        }
    }
}

/// A workload to build.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum WorkloadSpec {
    /// Independent requests.
    Synthetic {
        /// Requests.
        requests: usize,
        /// Prompt length.
        input: LengthDist,
        /// Output length.
        output: LengthDist,
    },
    /// Sessions with a shared system prompt and causal turns.
    Sessions {
        /// Sessions.
        sessions: usize,
        /// Turns per session.
        turns: usize,
        /// Tokens of the system prompt every session starts with.
        system_tokens: u64,
        /// Tokens of the user text each turn adds.
        turn_tokens: LengthDist,
        /// Output length of each turn.
        output: LengthDist,
    },
    /// A ShareGPT-format JSON file.
    ShareGpt {
        /// The file.
        path: PathBuf,
        /// Most requests (all usable ones when absent).
        requests: Option<usize>,
        /// Every human turn of a conversation as a causal session (default: the first turn only).
        multi_turn: bool,
    },
    /// A Mooncake-format trace (JSON lines).
    Mooncake {
        /// The file.
        path: PathBuf,
        /// Most requests (all when absent).
        requests: Option<usize>,
        /// Leave out requests with longer prompts.
        max_input_tokens: Option<u64>,
    },
}

/// The seeds a workload is built from: one for lengths (and orders), one for generated texts.
/// A plain `u64` seeds both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seeds {
    /// Lengths, ShareGPT's shuffle.
    pub lengths: u64,
    /// Generated prompt texts (synthetic, sessions, Mooncake blocks).
    pub text: u64,
}

impl From<u64> for Seeds {
    fn from(seed: u64) -> Self {
        Seeds { lengths: seed, text: seed }
    }
}

impl Seeds {
    /// The seeds of run `run` of a sweep: the same lengths in every run, but fresh texts after
    /// the first, so that no run finds the previous runs' prompts in the server's prefix cache
    /// (within a run, shared prefixes stay shared). Run 0 is `seed` itself. A ShareGPT file's
    /// texts are the file's, the same in every run.
    pub fn for_run(seed: u64, run: usize) -> Self {
        let text = if run == 0 { seed } else { mix(&[seed, TAG_RUN, run as u64]) };
        Seeds { lengths: seed, text }
    }
}

/// Builds a workload, reading its file if it has one.
pub fn build(spec: &WorkloadSpec, seed: impl Into<Seeds>) -> Result<Workload, BenchError> {
    let seed = seed.into();
    match spec {
        WorkloadSpec::Synthetic { requests, input, output } => Ok(synthetic(*requests, input, output, seed)),
        WorkloadSpec::Sessions { sessions: n, turns, system_tokens, turn_tokens, output } => {
            Ok(sessions(*n, *turns, *system_tokens, turn_tokens, output, seed))
        }
        WorkloadSpec::ShareGpt { path, requests, multi_turn } => {
            parse_sharegpt(&read(path)?, *requests, *multi_turn, seed.lengths)
        }
        WorkloadSpec::Mooncake { path, requests, max_input_tokens } => {
            parse_mooncake(&read(path)?, *requests, *max_input_tokens, seed)
        }
    }
}

fn read(path: &Path) -> Result<String, BenchError> {
    std::fs::read_to_string(path).map_err(|source| BenchError::Io { path: path.to_path_buf(), source })
}

// Tags that keep the seed streams of different purposes apart.
const TAG_LENGTHS: u64 = 1;
const TAG_PROMPT: u64 = 2;
const TAG_SYSTEM: u64 = 3;
const TAG_BLOCK: u64 = 4;
const TAG_SHUFFLE: u64 = 5;
const TAG_RUN: u64 = 6;

/// `requests` independent requests with lengths drawn from `input` and `output`; each prompt has
/// its own text, so no two share a prefix.
pub fn synthetic(requests: usize, input: &LengthDist, output: &LengthDist, seed: impl Into<Seeds>) -> Workload {
    let Seeds { lengths: seed, text: text_seed } = seed.into();
    let mut lengths = mix(&[seed, TAG_LENGTHS]);
    let chains = (0..requests)
        .map(|i| {
            let inp = input.sample(&mut lengths);
            let out = output.sample(&mut lengths);
            let text = words(mix(&[text_seed, TAG_PROMPT, i as u64]), inp);
            Chain { arrival_us: None, turns: vec![Turn { text, input_tokens: inp, max_tokens: out }] }
        })
        .collect();
    Workload { chains, skipped: 0 }
}

/// `n` sessions of `turns` turns each. Every session's first turn starts with the same system
/// prompt of `system_tokens` tokens; each turn adds user text of `turn_tokens`.
pub fn sessions(
    n: usize,
    turns: usize,
    system_tokens: u64,
    turn_tokens: &LengthDist,
    output: &LengthDist,
    seed: impl Into<Seeds>,
) -> Workload {
    let Seeds { lengths: seed, text: text_seed } = seed.into();
    let system = words(mix(&[text_seed, TAG_SYSTEM]), system_tokens);
    let mut lengths = mix(&[seed, TAG_LENGTHS]);
    let chains = (0..n)
        .map(|s| {
            let mut context = system_tokens;
            let turns = (0..turns)
                .map(|t| {
                    let user = turn_tokens.sample(&mut lengths);
                    let out = output.sample(&mut lengths);
                    let mut text = if t == 0 { system.clone() } else { String::new() };
                    text.push_str(&words(mix(&[text_seed, TAG_PROMPT, s as u64, t as u64]), user));
                    context += user;
                    let turn = Turn { text, input_tokens: context, max_tokens: out };
                    context += out;
                    turn
                })
                .collect();
            Chain { arrival_us: None, turns }
        })
        .collect();
    Workload { chains, skipped: 0 }
}

/// A file's parse error, named.
fn parse_error(what: &str) -> impl Fn(ParseError) -> BenchError + '_ {
    move |e| BenchError::Parse { what: what.into(), line: e.line, message: e.message }
}

/// Parses a ShareGPT-format file: `[{"conversations": [{"from": "human", "value": ...},
/// {"from": "gpt", "value": ...}, ...]}, ...]` (`messages` with `role`/`content` also
/// accepted). Conversations are taken in an order shuffled by `seed`. A request is a human turn
/// that has a reply; it asks for as many tokens as the reply has (estimated). With
/// `multi_turn`, all such turns of a conversation form one causal session; otherwise only the
/// first turn is sent. Conversations without such a turn are skipped.
pub fn parse_sharegpt(
    text: &str,
    requests: Option<usize>,
    multi_turn: bool,
    seed: u64,
) -> Result<Workload, BenchError> {
    let convs = trace::parse_sharegpt(text).map_err(parse_error("ShareGPT file"))?;
    let mut order: Vec<usize> = (0..convs.len()).collect();
    let mut state = mix(&[seed, TAG_SHUFFLE]);
    for i in (1..order.len()).rev() {
        let j = (splitmix(&mut state) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut workload = Workload::default();
    for &c in &order {
        let msgs = &convs[c].conversations;
        let mut turns = Vec::new();
        let mut context = 0;
        for (i, m) in msgs.iter().enumerate() {
            if !m.is_human() {
                context += m.tokens();
                continue;
            }
            let Some(reply) = msgs.get(i + 1).filter(|r| !r.is_human()) else {
                break;
            };
            if m.value.trim().is_empty() {
                break;
            }
            context += m.tokens();
            turns.push(Turn { text: m.value.clone(), input_tokens: context, max_tokens: reply.tokens() });
            if !multi_turn {
                break;
            }
        }
        if turns.is_empty() {
            workload.skipped += 1;
        } else {
            workload.chains.push(Chain { arrival_us: None, turns });
        }
    }
    if let Some(n) = requests {
        workload.truncate(n);
    }
    Ok(workload)
}

/// Parses a Mooncake-format trace: one JSON object a line with `timestamp` (ms from the start),
/// `input_length`, `output_length` and `hash_ids` (one id per 512-token block of the prompt).
/// Block `i`'s text is 512 words generated from `hash_ids[i]` (and `seed`), so equal ids give
/// equal text; a last, partial block comes from the request's own seed. Requests with prompts
/// longer than `max_input_tokens` are skipped; at most `requests` are kept, in arrival order.
pub fn parse_mooncake(
    text: &str,
    requests: Option<usize>,
    max_input_tokens: Option<u64>,
    seed: impl Into<Seeds>,
) -> Result<Workload, BenchError> {
    let seed = seed.into().text;
    let mut lines = trace::parse_mooncake(text).map_err(parse_error("Mooncake trace"))?;
    lines.sort_by(|a, b| a.1.timestamp.total_cmp(&b.1.timestamp));
    let mut workload = Workload::default();
    for (n, t) in lines {
        if requests.is_some_and(|r| workload.chains.len() >= r) {
            break;
        }
        let input = t.input_tokens();
        if max_input_tokens.is_some_and(|m| input > m) {
            workload.skipped += 1;
            continue;
        }
        workload.chains.push(Chain {
            arrival_us: Some((t.timestamp * 1000.0).round() as u64),
            turns: vec![Turn {
                text: mooncake_prompt(input, &t.hash_ids, seed, n as u64),
                input_tokens: input,
                max_tokens: t.output_tokens(),
            }],
        });
    }
    Ok(workload)
}

/// The prompt of a trace request: block by block, whole blocks from their hash ids, a partial
/// last block (or a block without an id) from the request's own seed.
pub fn mooncake_prompt(input_tokens: u64, hash_ids: &[u64], seed: u64, request: u64) -> String {
    let blocks = input_tokens.div_ceil(MOONCAKE_BLOCK_TOKENS);
    let mut text = String::new();
    for b in 0..blocks {
        let tokens = (input_tokens - b * MOONCAKE_BLOCK_TOKENS).min(MOONCAKE_BLOCK_TOKENS);
        let block_seed = match hash_ids.get(b as usize) {
            Some(&id) if tokens == MOONCAKE_BLOCK_TOKENS => mix(&[seed, TAG_BLOCK, id]),
            _ => mix(&[seed, TAG_PROMPT, request, b]),
        };
        text.push_str(&words(block_seed, tokens));
    }
    text
}
