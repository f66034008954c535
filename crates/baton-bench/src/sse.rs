//! Server-sent events, framing apart from transport: [`SseDecoder`] turns bytes as they arrive
//! into the events' `data` payloads, and [`parse_chunk`] reads one OpenAI streaming chunk
//! (completions or chat) into what the metrics need. No I/O here.

use serde_json::Value;

/// Splits a byte stream into SSE events and returns each event's data (the `data:` lines of
/// one event joined by newlines). Comments and other fields are ignored.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseDecoder {
    /// A decoder at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the data of every event they complete, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(pos) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let mut line = &self.buf[start..start + pos];
            start += pos + 1;
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            if line.is_empty() {
                if let Some(d) = self.data.take() {
                    out.push(d);
                }
                continue;
            }
            let line = String::from_utf8_lossy(line);
            if let Some(rest) = line.strip_prefix("data:") {
                let rest = rest.strip_prefix(' ').unwrap_or(rest);
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(rest);
                    }
                    None => self.data = Some(rest.to_owned()),
                }
            }
        }
        self.buf.drain(..start);
        out
    }

    /// Ends the stream: the data of an event left without its closing blank line, if any.
    pub fn finish(&mut self) -> Option<String> {
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            let mut tail = self.push(&rest);
            tail.extend(self.push(b"\n\n"));
            return tail.pop();
        }
        self.data.take()
    }
}

/// Token counts a server reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
    /// Prompt tokens served from a prefix cache (`usage.prompt_tokens_details.cached_tokens`, as
    /// vLLM, SGLang and Baton report it), when the server says.
    pub cached_tokens: Option<u64>,
}

/// What one event of an OpenAI stream says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chunk {
    /// Output text (completions' `text`, chat's `delta.content`), when non-empty.
    pub text: Option<String>,
    /// `usage`, when present.
    pub usage: Option<Usage>,
    /// A finish reason, when present.
    pub finish_reason: Option<String>,
    /// An error object's message, when the server sent one.
    pub error: Option<String>,
    /// The `[DONE]` sentinel.
    pub done: bool,
}

/// Reads one event's data. Unparseable data is an error.
pub fn parse_chunk(data: &str) -> Result<Chunk, String> {
    let data = data.trim();
    if data == "[DONE]" {
        return Ok(Chunk { done: true, ..Chunk::default() });
    }
    let v: Value = serde_json::from_str(data).map_err(|e| format!("bad stream chunk ({e}): {}", clip(data)))?;
    let mut chunk = Chunk::default();
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        let msg = err.get("message").and_then(Value::as_str).map_or_else(|| err.to_string(), str::to_owned);
        chunk.error = Some(msg);
        return Ok(chunk);
    }
    if let Some(choice) = v.get("choices").and_then(Value::as_array).and_then(|c| c.first()) {
        let text = choice
            .get("text")
            .and_then(Value::as_str)
            .or_else(|| choice.get("delta").and_then(|d| d.get("content")).and_then(Value::as_str));
        chunk.text = text.filter(|t| !t.is_empty()).map(str::to_owned);
        chunk.finish_reason = choice.get("finish_reason").and_then(Value::as_str).map(str::to_owned);
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        let n = |k: &str| u.get(k).and_then(Value::as_u64);
        if let (Some(p), Some(c)) = (n("prompt_tokens"), n("completion_tokens")) {
            let cached_tokens =
                u.get("prompt_tokens_details").and_then(|d| d.get("cached_tokens")).and_then(Value::as_u64);
            chunk.usage = Some(Usage { prompt_tokens: p, completion_tokens: c, cached_tokens });
        }
    }
    Ok(chunk)
}

/// A long text cut for an error message.
pub(crate) fn clip(s: &str) -> String {
    if s.chars().count() <= 200 { s.to_owned() } else { format!("{}…", s.chars().take(200).collect::<String>()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_pushes() {
        let mut d = SseDecoder::new();
        assert!(d.push(b"data: {\"a\"").is_empty());
        assert_eq!(d.push(b": 1}\n\ndata: [DONE]\r\n\r\n: comment\n\n"), vec!["{\"a\": 1}", "[DONE]"]);
        assert_eq!(d.push(b"event: x\ndata: one\ndata: two\n\n"), vec!["one\ntwo"]);
        assert!(d.push(b"data: tail").is_empty());
        assert_eq!(d.finish().as_deref(), Some("tail"));
    }

    #[test]
    fn chunks_of_both_endpoints() {
        let c =
            parse_chunk(r#"{"choices":[{"index":0,"text":" hi","finish_reason":null}],"usage":null}"#).expect("parses");
        assert_eq!(c.text.as_deref(), Some(" hi"));
        assert_eq!(c.usage, None);
        let c = parse_chunk(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#).expect("parses");
        assert_eq!(c.text, None, "an empty delta is not a token");
        let c = parse_chunk(r#"{"choices":[{"delta":{},"finish_reason":"length"}]}"#).expect("parses");
        assert_eq!(c.finish_reason.as_deref(), Some("length"));
        let c = parse_chunk(r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#).expect("parses");
        assert_eq!(c.usage, Some(Usage { prompt_tokens: 5, completion_tokens: 7, cached_tokens: None }));
        let c = parse_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":3}}}"#,
        )
        .expect("parses");
        assert_eq!(c.usage, Some(Usage { prompt_tokens: 5, completion_tokens: 7, cached_tokens: Some(3) }));
        let c = parse_chunk(r#"{"error":{"message":"boom","type":"server_error"}}"#).expect("parses");
        assert_eq!(c.error.as_deref(), Some("boom"));
        assert!(parse_chunk("[DONE]").expect("parses").done);
        assert!(parse_chunk("{not json").is_err());
    }
}
