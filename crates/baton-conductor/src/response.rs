//! The API's responses: what runs send ([`Piece`]s, tagged with their choice's index), shaped
//! into one JSON body or a stream of server-sent events, for the `n` choices of a request.
//! A chat request with tools has its text parsed for tool calls ([`crate::structured`]): an
//! answer that holds some has `tool_calls` (streamed as one `delta.tool_calls` chunk once the
//! choice ends; text that may start a call is held back until then) and finish reason
//! `tool_calls`.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use baton_engine::RequestId;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::openai::{Endpoint, LogprobEntry, ValidRequest, logprobs_json};
use crate::structured::{CallStream, chat_message, tool_call_deltas};
use baton_protocol::Finish;
use baton_protocol::error::ApiError;

/// What a run sends the response: text as it comes, then the end.
pub(crate) enum Piece {
    Text(String),
    /// The log-probabilities of the token whose text comes next (when the request asked).
    Logprobs(LogprobEntry),
    Done {
        reason: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Failed(ApiError),
}

fn created() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn response_id(valid: &ValidRequest, id: RequestId) -> String {
    match valid.endpoint {
        Endpoint::Completions => format!("cmpl-{}", id.0),
        Endpoint::Chat => format!("chatcmpl-{}", id.0),
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens}})
}

/// A request's usage over its choices: the prompt (and its cached tokens) counted once, as the
/// first choice saw it, the completions summed (as OpenAI).
#[derive(Default)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
}

impl Usage {
    fn add(&mut self, index: usize, prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) {
        if index == 0 {
            self.prompt_tokens = prompt_tokens;
            self.cached_tokens = cached_tokens;
        }
        self.completion_tokens += completion_tokens;
    }

    fn json(&self) -> Value {
        usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
    }
}

/// The whole response once every choice is done (the first failure answers instead).
pub(crate) async fn full_response(
    valid: ValidRequest,
    id: RequestId,
    mut rx: mpsc::UnboundedReceiver<(usize, Piece)>,
) -> Response {
    let n = valid.n;
    let mut texts = vec![valid.echo.clone().unwrap_or_default(); n];
    let mut entries: Vec<Vec<LogprobEntry>> = vec![Vec::new(); n];
    let mut choices: Vec<Option<Value>> = vec![None; n];
    let mut total = Usage::default();
    let mut done = 0;
    while let Some((i, piece)) = rx.recv().await {
        match piece {
            Piece::Text(t) => texts[i].push_str(&t),
            Piece::Logprobs(e) => entries[i].push(e),
            Piece::Failed(e) => return e.into_response(),
            Piece::Done { reason, prompt_tokens, completion_tokens, cached_tokens } => {
                total.add(i, prompt_tokens, completion_tokens, cached_tokens);
                let logprobs = valid.logprobs.map_or(Value::Null, |_| logprobs_json(valid.endpoint, &entries[i], 0));
                let text = std::mem::take(&mut texts[i]);
                choices[i] = Some(match valid.endpoint {
                    Endpoint::Completions => {
                        json!({"index": i, "text": text, "finish_reason": reason.as_openai(), "logprobs": logprobs})
                    }
                    Endpoint::Chat => {
                        let (message, finish) = chat_message(text, valid.tools.as_deref(), reason.as_openai());
                        json!({"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs})
                    }
                });
                done += 1;
                if done < n {
                    continue;
                }
                let object = if valid.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
                return Json(json!({
                    "id": response_id(&valid, id), "object": object, "created": created(), "model": valid.model,
                    "choices": choices, "usage": total.json(),
                }))
                .into_response();
            }
        }
    }
    ApiError::Internal("the request ended without a result".into()).into_response()
}

/// Server-sent events: every choice's deltas as they come, each chunk naming its choice's
/// `index`; usage (when asked) and `[DONE]` after the last choice ends.
pub(crate) fn sse_response(
    valid: ValidRequest,
    id: RequestId,
    mut rx: mpsc::UnboundedReceiver<(usize, Piece)>,
) -> Response {
    let (tx, out) = mpsc::unbounded_channel::<Result<Event, Infallible>>();
    tokio::spawn(async move {
        let n = valid.n;
        let rid = response_id(&valid, id);
        let created = created();
        let chat = valid.endpoint == Endpoint::Chat;
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk = |choice: Value, usage: Value| {
            let data = json!({"id": rid, "object": object, "created": created, "model": valid.model,
                "choices": choice, "usage": usage});
            Ok(Event::default().data(data.to_string()))
        };
        for i in 0..n {
            if chat {
                let role = json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null}]);
                if tx.send(chunk(role, Value::Null)).is_err() {
                    return;
                }
            }
            if let Some(echo) = valid.echo.as_ref().filter(|e| !e.is_empty()) {
                let choice = json!([{"index": i, "text": echo, "finish_reason": null, "logprobs": null}]);
                if tx.send(chunk(choice, Value::Null)).is_err() {
                    return;
                }
            }
        }
        // Per choice: log-probabilities of tokens whose text has not been sent yet, and the
        // text sent so far (completions' `text_offset` counts from it).
        let mut pending: Vec<Vec<LogprobEntry>> = vec![Vec::new(); n];
        let mut sent_text = vec![0; n];
        // With tools: each choice's whole text (parsed for calls at its end), and what may be a
        // call held back from the stream.
        let tools = valid.tools.clone();
        let mut texts = vec![String::new(); n];
        let mut calls: Vec<CallStream> = (0..n).map(|_| CallStream::default()).collect();
        let mut total = Usage::default();
        let mut done = 0;
        let take_logprobs = |pending: &mut Vec<LogprobEntry>, sent_text: usize| {
            valid.logprobs.map_or(Value::Null, |_| logprobs_json(valid.endpoint, &std::mem::take(pending), sent_text))
        };
        loop {
            // A client that went away is noticed at once: dropping `rx` cancels the runs.
            let piece = tokio::select! {
                p = rx.recv() => p,
                () = tx.closed() => return,
            };
            let Some((i, piece)) = piece else { break };
            let sent = match piece {
                Piece::Logprobs(e) => {
                    pending[i].push(e);
                    Ok(())
                }
                Piece::Text(t) if t.is_empty() => Ok(()),
                Piece::Text(t) if tools.is_some() => {
                    texts[i].push_str(&t);
                    let out = calls[i].push(&t);
                    if out.is_empty() {
                        Ok(())
                    } else {
                        let logprobs = take_logprobs(&mut pending[i], sent_text[i]);
                        sent_text[i] += out.len();
                        tx.send(chunk(
                            json!([{"index": i, "delta": {"content": out}, "finish_reason": null, "logprobs": logprobs}]),
                            Value::Null,
                        ))
                    }
                }
                Piece::Text(t) => {
                    let logprobs = take_logprobs(&mut pending[i], sent_text[i]);
                    let choice = if chat {
                        json!([{"index": i, "delta": {"content": t}, "finish_reason": null, "logprobs": logprobs}])
                    } else {
                        json!([{"index": i, "text": t, "finish_reason": null, "logprobs": logprobs}])
                    };
                    sent_text[i] += t.len();
                    tx.send(chunk(choice, Value::Null))
                }
                Piece::Done { reason, prompt_tokens, completion_tokens, cached_tokens } => {
                    // With tools: the calls the text holds, or the text held back after all.
                    let mut delta = json!({});
                    let mut finish = reason.as_openai();
                    if let Some(t) = &tools {
                        match t.parse_calls(&std::mem::take(&mut texts[i])) {
                            Some((_, found)) => {
                                delta = json!({"tool_calls": tool_call_deltas(&found)});
                                finish = "tool_calls";
                            }
                            None => {
                                let held = calls[i].take_held();
                                if !held.is_empty() {
                                    sent_text[i] += held.len();
                                    delta = json!({"content": held});
                                }
                            }
                        }
                    }
                    // Tokens whose text was held back (an end-of-sequence, a stop string) last.
                    let logprobs =
                        if pending[i].is_empty() { Value::Null } else { take_logprobs(&mut pending[i], sent_text[i]) };
                    let choice = if chat {
                        json!([{"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}])
                    } else {
                        json!([{"index": i, "text": "", "finish_reason": reason.as_openai(), "logprobs": logprobs}])
                    };
                    total.add(i, prompt_tokens, completion_tokens, cached_tokens);
                    done += 1;
                    let sent = tx.send(chunk(choice, Value::Null));
                    if done == n {
                        if valid.include_usage {
                            let _ = tx.send(chunk(json!([]), total.json()));
                        }
                        let _ = tx.send(Ok(Event::default().data("[DONE]")));
                        return;
                    }
                    sent
                }
                Piece::Failed(e) => {
                    // Headers are gone: the error travels as an event, then the stream ends.
                    let _ = tx.send(Ok(Event::default().data(e.body().to_string())));
                    return;
                }
            };
            if sent.is_err() {
                // The client went away: dropping `rx` cancels the runs.
                return;
            }
        }
    });
    Sse::new(UnboundedReceiverStream::new(out)).keep_alive(KeepAlive::default()).into_response()
}
