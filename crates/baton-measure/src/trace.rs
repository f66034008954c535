//! The workload files both sides read: Mooncake-format traces and ShareGPT-format
//! conversations. Parsing only: what a request becomes — prompt text for a live server
//! (`baton-bench`), block hashes for the simulator (`baton-sim`) — is each side's own.

use serde::Deserialize;

/// Tokens per block of a Mooncake trace's `hash_ids`.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// A workload file is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    /// 1-based line (0 when unknown).
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// One request of a Mooncake trace, as the line says.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceEntry {
    /// Arrival, milliseconds from the trace's start (finite and not negative; may have a
    /// fraction).
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Output tokens.
    pub output_length: u64,
    /// One id per 512-token block of the prompt: equal ids at the same position are an equal
    /// prefix. Absent: none (no block shared with another request).
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

impl TraceEntry {
    /// Prompt tokens, at least 1.
    pub fn input_tokens(&self) -> u64 {
        self.input_length.max(1)
    }

    /// Output tokens, at least 1.
    pub fn output_tokens(&self) -> u64 {
        self.output_length.max(1)
    }
}

/// Parses a Mooncake-format trace: one JSON object a line with `timestamp` (ms from the start),
/// `input_length`, `output_length` and `hash_ids`. Returns the entries in the file's order, each
/// with its 0-based line index; blank lines are skipped.
pub fn parse_mooncake(text: &str) -> Result<Vec<(usize, TraceEntry)>, ParseError> {
    let mut entries = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let e: TraceEntry =
            serde_json::from_str(line).map_err(|e| ParseError { line: n + 1, message: e.to_string() })?;
        if !(e.timestamp.is_finite() && e.timestamp >= 0.0) {
            return Err(ParseError { line: n + 1, message: format!("bad timestamp {}", e.timestamp) });
        }
        entries.push((n, e));
    }
    Ok(entries)
}

/// One line of a Mooncake-format trace (without its newline): the inverse of
/// [`parse_mooncake`] for whole-millisecond timestamps.
pub fn mooncake_line(timestamp_ms: u64, input_length: u64, output_length: u64, hash_ids: &[u64]) -> String {
    serde_json::json!({
        "timestamp": timestamp_ms,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    })
    .to_string()
}

/// One conversation of a ShareGPT-format file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Conversation {
    /// Its messages, in order (`messages` also accepted).
    #[serde(default, alias = "messages")]
    pub conversations: Vec<Message>,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Message {
    /// Who speaks: `human` or `user` for a request, anything else for a reply (`role` also
    /// accepted).
    #[serde(default, alias = "role")]
    pub from: String,
    /// The text (`content` also accepted).
    #[serde(default, alias = "content")]
    pub value: String,
}

impl Message {
    /// Whether the user speaks (`human` or `user`): a request, where anything else is a reply.
    pub fn is_human(&self) -> bool {
        matches!(self.from.as_str(), "human" | "user")
    }

    /// Its tokens, estimated ([`estimate_tokens`]).
    pub fn tokens(&self) -> u64 {
        estimate_tokens(&self.value)
    }
}

/// Parses a ShareGPT-format file: `[{"conversations": [{"from": "human", "value": ...},
/// {"from": "gpt", "value": ...}, ...]}, ...]` (`messages` with `role` / `content` also
/// accepted).
pub fn parse_sharegpt(text: &str) -> Result<Vec<Conversation>, ParseError> {
    serde_json::from_str(text).map_err(|e| ParseError { line: e.line(), message: e.to_string() })
}

/// Tokens of a text as estimated without a tokenizer: 4 characters a token, as is common, and
/// at least 1.
pub fn estimate_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_parse_in_file_order_and_write_back() {
        let text = "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 0, \"hash_ids\": [0, 1]}\n\
                    \n\
                    {\"timestamp\": 0.5, \"input_length\": 10, \"output_length\": 1}\n";
        let e = parse_mooncake(text).expect("parse");
        assert_eq!(e.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [0, 2], "blank lines skipped, order kept");
        assert_eq!((e[0].1.timestamp, e[0].1.hash_ids.as_slice(), e[0].1.output_tokens()), (1000.0, &[0, 1][..], 1));
        assert_eq!((e[1].1.timestamp, e[1].1.hash_ids.len()), (0.5, 0), "fractions and no hash ids accepted");
        let line = mooncake_line(1000, 600, 0, &[0, 1]);
        assert_eq!(parse_mooncake(&line).expect("parse")[0].1, e[0].1);
        assert_eq!(parse_mooncake("{nope").map_err(|e| e.line), Err(1));
        let bad = "{\"timestamp\": -1, \"input_length\": 1, \"output_length\": 1}\n";
        assert_eq!(parse_mooncake(&format!("\n{bad}")).map_err(|e| e.line), Err(2));
    }

    #[test]
    fn sharegpt_accepts_both_spellings() {
        let text = r#"[{"conversations": [{"from": "human", "value": "abcde"}, {"from": "gpt", "value": "x"}]},
                       {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}]"#;
        let c = parse_sharegpt(text).expect("parse");
        assert_eq!(c.len(), 2);
        assert!(c[0].conversations[0].is_human() && !c[0].conversations[1].is_human());
        assert!(c[1].conversations[0].is_human() && !c[1].conversations[1].is_human());
        assert_eq!(c[0].conversations[0].tokens(), 2, "5 characters: 2 tokens");
        assert_eq!(estimate_tokens(""), 1, "at least 1");
        assert!(parse_sharegpt("[{").is_err());
    }
}
