//! Storms: many requests at once against a server, and how each ended from the client's side.
//!
//! A serving system under more load than it can hold must do one of two things with a request:
//! serve it, or refuse it before its stream starts (HTTP 429). Failing a request after its 200
//! (an error event in the stream, with or without tokens before it), or leaving it hanging, is
//! the bug a storm looks for. [`StormTally`] counts the four (plus failures before the stream,
//! e.g. a 503) and the tokens served; `baton bench storm`
//! is the thin shell that sends the requests, `scripts/bench-storm.sh` sweeps concurrency and KV
//! size.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::client::{Endpoint, Exchange};
use crate::metrics::Outcome;

/// How one request of a storm ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StormOutcome {
    /// Served to the end.
    Completed,
    /// Refused with 429 before its stream began: what an overloaded server should do.
    Refused,
    /// Failed before its stream began, otherwise than a 429 (a 5xx, a refused connection).
    FailedBefore,
    /// Failed after its 200 (an error event, a broken stream), tokens or not: the bug (target 0).
    FailedAfter,
    /// No answer within the client's timeout: the other bug (target 0).
    Hung,
}

/// Classifies an exchange.
pub fn classify(ex: &Exchange) -> StormOutcome {
    match ex.outcome {
        Outcome::Ok => StormOutcome::Completed,
        Outcome::Timeout => StormOutcome::Hung,
        _ if ex.accepted || ex.chunks > 0 => StormOutcome::FailedAfter,
        Outcome::Rejected => StormOutcome::Refused,
        _ => StormOutcome::FailedBefore,
    }
}

/// Counts of a storm's outcomes and the tokens served.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StormTally {
    /// Served to the end.
    pub completed: u64,
    /// Refused with 429 before the stream began.
    pub refused: u64,
    /// Failed before the stream began, not a 429.
    pub failed_before: u64,
    /// Failed after the server's 200 (target 0).
    pub failed_after: u64,
    /// Hung past the timeout (target 0).
    pub hung: u64,
    /// Text chunks (about one per token) of completed requests.
    pub tokens: u64,
    /// Completed requests whose first token came within the storm's deadline
    /// ([`StormTally::add_within`]).
    pub within_deadline: u64,
}

impl StormTally {
    /// Counts one exchange.
    pub fn add(&mut self, ex: &Exchange) {
        match classify(ex) {
            StormOutcome::Completed => {
                self.completed += 1;
                self.tokens += ex.chunks;
            }
            StormOutcome::Refused => self.refused += 1,
            StormOutcome::FailedBefore => self.failed_before += 1,
            StormOutcome::FailedAfter => self.failed_after += 1,
            StormOutcome::Hung => self.hung += 1,
        }
    }

    /// Counts one exchange, and whether it completed with its first token within `deadline`.
    pub fn add_within(&mut self, ex: &Exchange, deadline: std::time::Duration) {
        self.add(ex);
        let in_time = ex.ttft_us.is_some_and(|us| u128::from(us) <= deadline.as_micros());
        if classify(ex) == StormOutcome::Completed && in_time {
            self.within_deadline += 1;
        }
    }

    /// Requests counted.
    pub fn total(&self) -> u64 {
        self.completed + self.refused + self.failed_before + self.failed_after + self.hung
    }

    /// Whether nothing failed after its 200 and nothing hung.
    pub fn is_clean(&self) -> bool {
        self.failed_after == 0 && self.hung == 0
    }
}

/// The header of [`row`]'s table.
pub fn header() -> String {
    format!(
        "{:>10} {:>11} {:>9} {:>8} {:>13} {:>12} {:>6} {:>10} {:>10} {:>9} {:>10}",
        "kv_blocks",
        "concurrency",
        "completed",
        "refused",
        "failed_before",
        "failed_after",
        "hung",
        "ttft<=dl",
        "solo_equal",
        "wall_s",
        "tokens/s"
    )
}

/// One line of the table: a storm of `concurrency` requests on a server of `kv_blocks` blocks
/// (0: unknown) that took `wall_s` seconds; `solo` is how many completed texts equal the same
/// request's run alone, of how many were compared (`None`: not compared).
pub fn row(kv_blocks: usize, concurrency: usize, t: &StormTally, solo: Option<(u64, u64)>, wall_s: f64) -> String {
    let mut out = String::new();
    let rate = if wall_s > 0.0 { t.tokens as f64 / wall_s } else { 0.0 };
    let blocks = if kv_blocks == 0 { "-".to_owned() } else { kv_blocks.to_string() };
    let solo = solo.map_or_else(|| "-".to_owned(), |(equal, of)| format!("{equal}/{of}"));
    let _ = write!(
        out,
        "{blocks:>10} {concurrency:>11} {:>9} {:>8} {:>13} {:>12} {:>6} {:>10} {solo:>10} {wall_s:>9.1} {rate:>10.1}",
        t.completed, t.refused, t.failed_before, t.failed_after, t.hung, t.within_deadline
    );
    out
}

/// Which requests a storm sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StormMix {
    /// [`storm_request`]: short prompts, `max_tokens` each.
    #[default]
    Short,
    /// [`mixed_request`]: prompts of about 11 to 1,085 tokens and 8 to 128 tokens out (#63's
    /// overload point).
    Mixed,
}

/// The `i`-th request of a storm of `mix`.
pub fn request(mix: StormMix, i: usize, max_tokens: u64, model: &str) -> (Endpoint, Value) {
    match mix {
        StormMix::Short => storm_request(i, max_tokens, model),
        StormMix::Mixed => mixed_request(i, model),
    }
}

/// The storm's `i`-th request of mixed lengths: a prompt of about 11 to 1,085 tokens (a number
/// and one short word repeated) and 8 to 128 tokens out, spread over the range by `i`; every
/// third a chat.
pub fn mixed_request(i: usize, model: &str) -> (Endpoint, Value) {
    const WORDS: [&str; 5] = ["relay", "baton", "runner", "track", "lane"];
    let words = 10 + (i * 379) % 1075;
    let max_tokens = 8 + (i * 53) % 121;
    let (first, rest) = (WORDS[i % WORDS.len()], WORDS[(i + 1) % WORDS.len()]);
    let text = format!("{i}: {first}{}", format!(" {rest}").repeat(words));
    if i % 3 == 2 {
        (
            Endpoint::Chat,
            json!({"model": model, "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true}),
        )
    } else {
        (
            Endpoint::Completions,
            json!({"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": true, "stream": true}),
        )
    }
}

/// The storm's `i`-th request: completions that share a long system prompt, unrelated
/// completions and chats, in turn (what breaks a prefix cache that pins blocks, and what does
/// not share at all).
pub fn storm_request(i: usize, max_tokens: u64, model: &str) -> (Endpoint, Value) {
    const SYSTEM: &str = "You are a helpful assistant that answers questions about distributed \
        inference, key-value caches, and how prefill and decode share the work of serving. ";
    const TOPICS: [&str; 6] = ["prefill", "decode", "the KV cache", "batching", "routing", "preemption"];
    let topic = TOPICS[i % TOPICS.len()];
    match i % 3 {
        0 => (
            Endpoint::Completions,
            json!({"model": model, "prompt": format!("{SYSTEM}Question {i}: what is {topic}?"),
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true}),
        ),
        1 => (
            Endpoint::Completions,
            json!({"model": model, "prompt": format!("Story {i} begins with {topic} and a relay race"),
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true}),
        ),
        _ => (
            Endpoint::Chat,
            json!({"model": model, "messages": [{"role": "user", "content": format!("Tell me about {topic}, #{i}.")}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true}),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(outcome: Outcome, chunks: u64) -> Exchange {
        // A 200 came whenever the exchange got past its status: it completed or streamed.
        let accepted = outcome == Outcome::Ok || chunks > 0;
        Exchange {
            accepted,
            ttft_us: None,
            itl_us: Vec::new(),
            jct_us: 0,
            text: String::new(),
            chunks,
            usage: None,
            outcome,
            error: None,
        }
    }

    #[test]
    fn outcomes_are_told_apart_by_whether_the_stream_began() {
        assert_eq!(classify(&ex(Outcome::Ok, 5)), StormOutcome::Completed);
        assert_eq!(classify(&ex(Outcome::Rejected, 0)), StormOutcome::Refused);
        assert_eq!(classify(&ex(Outcome::Http { status: 503 }, 0)), StormOutcome::FailedBefore);
        assert_eq!(classify(&ex(Outcome::ServerError, 0)), StormOutcome::FailedBefore);
        assert_eq!(classify(&ex(Outcome::ServerError, 1)), StormOutcome::FailedAfter);
        assert_eq!(classify(&ex(Outcome::Stream, 3)), StormOutcome::FailedAfter);
        assert_eq!(classify(&ex(Outcome::Timeout, 0)), StormOutcome::Hung);
        assert_eq!(classify(&ex(Outcome::Timeout, 7)), StormOutcome::Hung);
        // A 200, then an error event before any token (#37: the late 503): a failure after.
        let late = Exchange { accepted: true, ..ex(Outcome::ServerError, 0) };
        assert_eq!(classify(&late), StormOutcome::FailedAfter);
        let mut t = StormTally::default();
        for e in [ex(Outcome::Ok, 5), ex(Outcome::Rejected, 0), ex(Outcome::ServerError, 1), ex(Outcome::Ok, 3)] {
            t.add(&e);
        }
        assert_eq!((t.completed, t.refused, t.failed_after, t.tokens, t.total()), (2, 1, 1, 8, 4));
        assert!(!t.is_clean());
        assert!(row(64, 16, &t, None, 2.0).contains("4.0"), "8 tokens in 2 s");
        assert!(row(64, 16, &t, Some((2, 2)), 2.0).contains("2/2"));
    }

    #[test]
    fn a_completion_within_the_deadline_is_counted_as_such() {
        let mut t = StormTally::default();
        let fast = Exchange { ttft_us: Some(900_000), ..ex(Outcome::Ok, 5) };
        let slow = Exchange { ttft_us: Some(1_100_000), ..ex(Outcome::Ok, 5) };
        let refused = ex(Outcome::Rejected, 0);
        for e in [&fast, &slow, &refused] {
            t.add_within(e, std::time::Duration::from_secs(1));
        }
        assert_eq!((t.completed, t.within_deadline, t.refused), (2, 1, 1));
    }

    #[test]
    fn the_mixed_storm_spans_its_lengths() {
        let lens: Vec<(usize, u64)> = (0..300)
            .map(|i| {
                let (_, b) = mixed_request(i, "m");
                let text = b["prompt"].as_str().or(b["messages"][0]["content"].as_str()).expect("text").to_owned();
                (text.split(' ').count(), b["max_tokens"].as_u64().expect("max_tokens"))
            })
            .collect();
        let (words, out): (Vec<usize>, Vec<u64>) = lens.into_iter().unzip();
        assert!(words.iter().min() < Some(&20) && words.iter().max() > Some(&1000), "{words:?}");
        assert!(out.iter().min() < Some(&16) && out.iter().max() > Some(&120), "{out:?}");
    }

    #[test]
    fn the_mix_has_shared_prefixes_unrelated_prompts_and_chats() {
        let (e0, b0) = storm_request(0, 8, "m");
        let (e3, b3) = storm_request(3, 8, "m");
        let (e2, _) = storm_request(2, 8, "m");
        assert_eq!((e0, e3, e2), (Endpoint::Completions, Endpoint::Completions, Endpoint::Chat));
        let (p0, p3) = (b0["prompt"].as_str().expect("a prompt"), b3["prompt"].as_str().expect("a prompt"));
        assert_eq!(p0[..100], p3[..100], "shared system prompt");
        assert_ne!(p0, p3);
    }
}
