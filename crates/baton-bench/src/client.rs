//! The HTTP shell: one streaming request to an OpenAI-compatible server, timed. Every wait
//! (connect, headers, each chunk) is bounded by the request's deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::BenchError;
use crate::metrics::Outcome;
use crate::sse::{SseDecoder, Usage, clip, parse_chunk};

/// Which API to call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `/v1/completions` with a `prompt`.
    #[default]
    Completions,
    /// `/v1/chat/completions` with `messages`.
    Chat,
}

impl Endpoint {
    /// The path under the server's root.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "completions" | "completion" => Ok(Endpoint::Completions),
            "chat" | "chat-completions" => Ok(Endpoint::Chat),
            _ => Err(format!("expected completions or chat, got {s:?}")),
        }
    }
}

/// Who wrote a message of a conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The client.
    User,
    /// The server.
    Assistant,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// Its text.
    pub content: String,
}

/// What every request of a run carries besides its conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOptions {
    /// The API.
    pub endpoint: Endpoint,
    /// Model id.
    pub model: String,
    /// Send `ignore_eos: true`, so the output is exactly `max_tokens` long on servers that
    /// support it (Baton, vLLM).
    pub ignore_eos: bool,
    /// Sampling temperature (0: greedy).
    pub temperature: f64,
}

/// The JSON body of one streaming request. For completions, the conversation becomes one prompt
/// (each later user message after a newline), so a turn's prompt extends the previous turn's.
pub fn request_body(opts: &RequestOptions, conversation: &[Message], max_tokens: u64, seed: u64) -> Value {
    let mut body = json!({
        "model": opts.model,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": opts.temperature,
    });
    match opts.endpoint {
        Endpoint::Completions => {
            let mut prompt = String::new();
            for (i, m) in conversation.iter().enumerate() {
                if i > 0 && m.role == Role::User {
                    prompt.push('\n');
                }
                prompt.push_str(&m.content);
            }
            body["prompt"] = json!(prompt);
        }
        Endpoint::Chat => {
            let messages: Vec<Value> = conversation
                .iter()
                .map(|m| {
                    let role = if m.role == Role::User { "user" } else { "assistant" };
                    json!({"role": role, "content": m.content})
                })
                .collect();
            body["messages"] = json!(messages);
        }
    }
    if opts.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    if opts.temperature > 0.0 {
        body["seed"] = json!(seed & 0x7FFF_FFFF_FFFF_FFFF);
    }
    body
}

/// The client side of one request, timed from just before sending.
#[derive(Debug, Clone, PartialEq)]
pub struct Exchange {
    /// Time to the first chunk with text.
    pub ttft_us: Option<u64>,
    /// Gaps between consecutive chunks with text.
    pub itl_us: Vec<u64>,
    /// Sending to the end of the stream or the failure.
    pub jct_us: u64,
    /// The output text.
    pub text: String,
    /// Chunks with text.
    pub chunks: u64,
    /// The server's token counts, if it sent them.
    pub usage: Option<Usage>,
    /// How it ended.
    pub outcome: Outcome,
    /// Why it failed.
    pub error: Option<String>,
    /// Whether the server accepted it (HTTP 200: the stream began). A failure after that,
    /// with or without a token, is one the client could not have been told of in time.
    pub accepted: bool,
}

/// An HTTP client for one server, or for replicas of one server (conductors routing to the same
/// workers) that it sends requests to in turn, as a round-robin load balancer in front of them
/// would.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// The replicas' roots; never empty.
    bases: Arc<[String]>,
    /// Which replica the next request goes to (modulo `bases.len()`).
    next: Arc<AtomicUsize>,
    api_key: Option<String>,
}

impl Client {
    /// A client for the server at `url` (its root, with or without a trailing `/v1`).
    pub fn new(url: &str, api_key: Option<String>, connect_timeout: Duration) -> Result<Client, BenchError> {
        let http = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| BenchError::Http(format!("cannot build an HTTP client: {e}")))?;
        let base = url.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base).to_owned();
        Ok(Client { http, bases: Arc::from([base]), next: Arc::new(AtomicUsize::new(0)), api_key })
    }

    /// The same client sending its requests in turn to `url` and each of `replicas` (roots, with
    /// or without a trailing `/v1`).
    pub fn with_replicas(mut self, replicas: &[String]) -> Client {
        let mut bases = self.bases.to_vec();
        for url in replicas {
            let base = url.trim_end_matches('/');
            bases.push(base.strip_suffix("/v1").unwrap_or(base).to_owned());
        }
        self.bases = bases.into();
        self
    }

    /// The replica the next request goes to.
    fn base(&self) -> &str {
        &self.bases[self.next.fetch_add(1, Ordering::Relaxed) % self.bases.len()]
    }

    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let b = self.http.post(format!("{}{path}", self.base()));
        match &self.api_key {
            Some(k) => b.bearer_auth(k),
            None => b,
        }
    }

    /// The first model the server lists at `/v1/models`.
    pub async fn first_model(&self, timeout: Duration) -> Result<String, BenchError> {
        let url = format!("{}/v1/models", self.bases[0]);
        let mut req = self.http.get(&url).timeout(timeout);
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.map_err(|e| BenchError::Http(format!("GET {url}: {e}")))?;
        let status = resp.status();
        let v: Value = resp.json().await.map_err(|e| BenchError::Http(format!("GET {url}: {e}")))?;
        if !status.is_success() {
            return Err(BenchError::Http(format!("GET {url}: HTTP {status}: {}", clip(&v.to_string()))));
        }
        v["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| BenchError::Http(format!("GET {url}: no model listed; pass --model")))
    }

    /// Sends one streaming request and times it; never fails, a failure is an outcome.
    pub async fn stream(&self, endpoint: Endpoint, body: &Value, timeout: Duration) -> Exchange {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut ex = Exchange {
            ttft_us: None,
            itl_us: Vec::new(),
            jct_us: 0,
            text: String::new(),
            chunks: 0,
            usage: None,
            outcome: Outcome::Ok,
            error: None,
            accepted: false,
        };
        let result = self.stream_into(endpoint, body, start, deadline, &mut ex).await;
        ex.jct_us = micros(start.elapsed());
        if let Err((outcome, error)) = result {
            ex.outcome = outcome;
            ex.error = Some(error);
        }
        ex
    }

    async fn stream_into(
        &self,
        endpoint: Endpoint,
        body: &Value,
        start: Instant,
        deadline: Instant,
        ex: &mut Exchange,
    ) -> Result<(), (Outcome, String)> {
        let timed_out = || (Outcome::Timeout, "request timed out".to_owned());
        let send = self.post(endpoint.path()).json(body).send();
        let mut resp = match tokio::time::timeout_at(deadline, send).await {
            Err(_) => return Err(timed_out()),
            Ok(Err(e)) => return Err(classify(&e)),
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        if !status.is_success() {
            let text = tokio::time::timeout_at(deadline, resp.text()).await.ok().and_then(Result::ok);
            let outcome =
                if status.as_u16() == 429 { Outcome::Rejected } else { Outcome::Http { status: status.as_u16() } };
            return Err((outcome, format!("HTTP {status}: {}", clip(text.as_deref().unwrap_or("")))));
        }
        ex.accepted = true;
        let mut decoder = SseDecoder::new();
        let mut last: Option<Instant> = None;
        let mut finished = false;
        loop {
            let bytes = match tokio::time::timeout_at(deadline, resp.chunk()).await {
                Err(_) => return Err(timed_out()),
                Ok(Err(e)) => return Err(classify(&e)),
                Ok(Ok(b)) => b,
            };
            let now = Instant::now();
            let events = match &bytes {
                Some(b) => decoder.push(b),
                None => decoder.finish().into_iter().collect(),
            };
            for data in events {
                let chunk = parse_chunk(&data).map_err(|e| (Outcome::Stream, e))?;
                if let Some(msg) = chunk.error {
                    return Err((Outcome::ServerError, msg));
                }
                if chunk.done {
                    return Ok(());
                }
                if let Some(t) = chunk.text {
                    match last {
                        None => ex.ttft_us = Some(micros(now - start)),
                        Some(prev) => ex.itl_us.push(micros(now - prev)),
                    }
                    last = Some(now);
                    ex.chunks += 1;
                    ex.text.push_str(&t);
                }
                if chunk.usage.is_some() {
                    ex.usage = chunk.usage;
                }
                finished |= chunk.finish_reason.is_some();
            }
            if bytes.is_none() {
                // A stream without `[DONE]` still counts if it gave a finish reason.
                return if finished { Ok(()) } else { Err((Outcome::Stream, "the stream ended early".into())) };
            }
        }
    }
}

fn classify(e: &reqwest::Error) -> (Outcome, String) {
    let outcome = if e.is_timeout() {
        Outcome::Timeout
    } else if e.is_connect() {
        Outcome::Connect
    } else {
        Outcome::Stream
    };
    (outcome, e.to_string())
}

pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
