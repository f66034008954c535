//! The OpenAI API's request bodies, and their validation into a typed [`ValidRequest`].
//!
//! Bodies are parsed by hand from bytes (not by an extractor) so that every malformed body,
//! unknown field or out-of-range parameter is a 400 with an OpenAI-style error naming the
//! parameter. Parameters OpenAI defines but Baton does not implement are accepted only at their
//! neutral value (e.g. `best_of: 1`), and refused otherwise, never silently
//! ignored. Penalties, `logit_bias` and `min_p` become the sampler's [`LogitAdjust`], and so
//! does the grammar of `response_format` or of a forced tool call ([`crate::structured`]): it is
//! compiled here once, so an invalid schema is a 400 naming the parameter.

use std::sync::Arc;

use baton_engine::StopParams;
use baton_model::{ChatMessage, ChatTemplate, Constraint, LogitAdjust, SamplingParams, TokenLogprobs, Tokenizer};
use serde::Deserialize;
use serde_json::Value;

use crate::structured::{self, CALL_CLOSE, CALL_OPEN, Tools};
use baton_protocol::error::ApiError;

/// Most stop strings per request (as OpenAI).
const MAX_STOP_STRINGS: usize = 4;
/// Most choices per request (`n`).
pub const MAX_N: usize = 16;
/// Completions' default `max_tokens` (as OpenAI).
const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// `prompt` of a completion: text, one text in a list, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// A list of texts (only one is supported: `n` prompts would be a batch API).
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<i64>),
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields both endpoints accept (unknown fields are refused before deserializing, because
/// serde's `deny_unknown_fields` does not work through `flatten`).
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "ignore_eos",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "stop_token_ids",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "best_of",
    "echo",
    "suffix",
    "response_format",
    "modalities",
];

/// Fields only chat accepts.
const CHAT_FIELDS: &[&str] = &["messages", "tools", "tool_choice", "parallel_tool_calls"];

/// Parameters common to both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// Model id.
    pub model: Option<String>,
    /// Tokens to generate.
    pub max_tokens: Option<i64>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature in [0, 2].
    pub temperature: Option<f64>,
    /// Nucleus sampling in (0, 1].
    pub top_p: Option<f64>,
    /// Top-k (an extension, as vLLM).
    pub top_k: Option<i64>,
    /// Choices per request, 1 to [`MAX_N`].
    pub n: Option<i64>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Seed of the sampler.
    pub seed: Option<i64>,
    /// Keep generating past end-of-sequence (an extension, as vLLM).
    pub ignore_eos: Option<bool>,
    /// End-user id: the session key routing keeps together (unless `x-session-id` names one).
    pub user: Option<String>,
    /// In [-2, 2]: subtracted once from the logit of each token generated so far.
    pub presence_penalty: Option<f64>,
    /// In [-2, 2]: subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: Option<f64>,
    /// Positive (an extension, as vLLM): prompt and generated tokens' logits divided by it
    /// (multiplied where negative).
    pub repetition_penalty: Option<f64>,
    /// In [0, 1] (an extension, as vLLM): drop tokens less likely than `min_p` times the best.
    pub min_p: Option<f64>,
    /// Token ids that end generation, their text left out (an extension, as vLLM).
    pub stop_token_ids: Option<Vec<i64>>,
    /// Token id (as a string) to a bias in [-100, 100] added to its logit.
    pub logit_bias: Option<Value>,
    /// Only absent, false or 0 is supported.
    pub logprobs: Option<Value>,
    /// Only absent or 0 is supported.
    pub top_logprobs: Option<i64>,
    /// Only absent or 1 is supported.
    pub best_of: Option<i64>,
    /// Only absent or false is supported.
    pub echo: Option<bool>,
    /// Only absent is supported.
    pub suffix: Option<String>,
    /// `{"type": "text" | "json_object" | "json_schema", ..}` (structured output).
    pub response_format: Option<Value>,
    /// Output types: only `["text"]` (or absent) is supported.
    pub modalities: Option<Vec<String>>,
}

/// A field accepted and ignored: its name, the test of its JSON type, and that type in words.
type IgnoredField = (&'static str, fn(&Value) -> bool, &'static str);

/// OpenAI's request fields that change nothing in the answer here, and the JSON type each must
/// have: storage, dashboard metadata, the processing tier, an end-user id for abuse detection,
/// a prompt-cache routing hint (Baton routes by the prompt itself), a reasoning model's effort
/// (these models do not reason). Accepted and ignored, as vLLM does; a wrong type is still a
/// 400 naming the field.
const IGNORED_FIELDS: &[IgnoredField] = &[
    ("store", Value::is_boolean, "a boolean"),
    ("metadata", Value::is_object, "an object"),
    ("service_tier", Value::is_string, "a string"),
    ("safety_identifier", Value::is_string, "a string"),
    ("prompt_cache_key", Value::is_string, "a string"),
    ("reasoning_effort", Value::is_string, "a string"),
];

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Everything else.
    #[serde(flatten)]
    pub common: Common,
}

/// Content of a chat message: text, or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Text.
    Text(String),
    /// Parts; only `{"type": "text", "text": ...}` is supported.
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Must be `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: Option<String>,
}

/// A chat message as sent.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessageIn {
    /// `system`, `user`, `assistant`, `developer`, `tool`.
    pub role: String,
    /// The content.
    pub content: Option<Content>,
    /// Participant name (passed to templates that render tools).
    pub name: Option<String>,
    /// An assistant's tool calls.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

/// A past tool call in an assistant message.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallIn {
    /// The call's id.
    pub id: Option<String>,
    /// Must be `function`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The function called.
    pub function: FunctionCallIn,
}

/// The function of a past tool call.
#[derive(Debug, Clone, Deserialize)]
pub struct FunctionCallIn {
    /// Its name.
    pub name: String,
    /// Its arguments, a JSON text.
    pub arguments: String,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// Functions the model may call.
    pub tools: Option<Value>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": ..}}`.
    pub tool_choice: Option<Value>,
    /// Accepted; a grammar-forced call is one call per turn.
    pub parallel_tool_calls: Option<Value>,
    /// Everything else.
    #[serde(flatten)]
    pub common: Common,
}

/// Which endpoint a request came through (shapes the response).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A request that passed validation: token ids and engine parameters.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Model id to echo back.
    pub model: String,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stopping.
    pub stop: StopParams,
    /// Stream server-sent events.
    pub stream: bool,
    /// Send usage in a last streamed chunk.
    pub include_usage: bool,
    /// Report each token's log-probability and the `n` most likely tokens' (`Some(n)`).
    pub logprobs: Option<usize>,
    /// Tokens that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Completions' `echo`: the prompt text, sent before the generated text.
    pub echo: Option<String>,
    /// Choices to generate (`n`): they share the prompt's KV, and choice `i` samples with
    /// `seed + i` when a seed is given (as vLLM).
    pub n: usize,
    /// The session the request belongs to (the `user` field, or the `x-session-id` header):
    /// session-affinity routing keeps a session's turns on one worker.
    pub session: Option<String>,
    /// The tools the model was shown, when its output is to be parsed for tool calls.
    pub tools: Option<Arc<Tools>>,
}

/// The 400 for `/v1/chat/completions` on a model without a chat template: what the client can
/// do instead, and what the operator can serve.
fn no_chat_template_message(model_id: &str) -> String {
    format!(
        "model `{model_id}` has no chat template, so it cannot answer /v1/chat/completions: send the text to \
         /v1/completions instead, or serve a chat model (`baton serve --model {}`, the default; `scripts/fetch-model.sh \
         {}` fetches it)",
        baton_model::DEFAULT_MODEL,
        baton_model::DEFAULT_MODEL
    )
}

/// What validation needs to know about the served model.
#[derive(Clone)]
pub struct Validator {
    /// The model id clients must name (or omit).
    pub model_id: String,
    /// Other names accepted for it (the path it was loaded from, a known short name).
    pub aliases: Vec<String>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template, if the model has one.
    pub template: Option<Arc<ChatTemplate>>,
    /// Context length in tokens.
    pub max_context: usize,
    /// Vocabulary size (token-id prompts are checked against it).
    pub vocab_size: usize,
    /// Longest prompt text, in bytes, that could fit the context
    /// ([`Validator::prompt_bytes_bound`]): a longer one is refused before it is tokenised.
    pub max_prompt_bytes: usize,
}

impl std::fmt::Debug for Validator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Validator").field("model_id", &self.model_id).field("max_context", &self.max_context).finish()
    }
}

/// Parses a JSON object body, refusing fields outside `COMMON_FIELDS` and `own` (whose first
/// is required).
fn parse<T: for<'de> Deserialize<'de>>(body: &[u8], own: &[&str]) -> Result<T, ApiError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
    let Some(obj) = value.as_object() else {
        return Err(ApiError::invalid("the body must be a JSON object"));
    };
    let ignored = |k: &str| IGNORED_FIELDS.iter().find(|f| f.0 == k);
    let own_field = |k: &str| own.contains(&k) || COMMON_FIELDS.contains(&k) || ignored(k).is_some();
    let own = own[0];
    if let Some(k) = obj.keys().find(|k| !own_field(k)) {
        return Err(ApiError::param(k, format!("Unrecognized request argument supplied: {k}")));
    }
    for (k, v) in obj {
        if let Some((_, has_type, what)) = ignored(k)
            && !v.is_null()
            && !has_type(v)
        {
            return Err(ApiError::param(k, format!("`{k}` must be {what}")));
        }
    }
    if !obj.contains_key(own) {
        return Err(ApiError::param(own, format!("`{own}` is required")));
    }
    serde_json::from_value(value).map_err(|e| ApiError::invalid(format!("invalid request: {e}")))
}

impl Validator {
    /// Validates a completion body.
    pub fn completion(&self, body: &[u8]) -> Result<ValidRequest, ApiError> {
        let req: CompletionRequest = parse(body, &["prompt"])?;
        // The prompt as the client sent it, for `echo`.
        let text = match &req.prompt {
            Prompt::Text(t) => Some(t.clone()),
            Prompt::Texts(ts) => ts.first().cloned(),
            Prompt::Tokens(_) => None,
        };
        let echo = req.common.echo == Some(true);
        let prompt_ids = match req.prompt {
            Prompt::Text(t) => self.encode(&t, true, "prompt")?,
            Prompt::Texts(ts) if ts.len() == 1 => self.encode(&ts[0], true, "prompt")?,
            Prompt::Texts(_) => return Err(ApiError::param("prompt", "exactly one prompt per request is supported")),
            Prompt::Tokens(ids) => ids
                .iter()
                .map(|&t| {
                    u32::try_from(t)
                        .ok()
                        .filter(|&t| (t as usize) < self.vocab_size)
                        .ok_or_else(|| ApiError::param("prompt", format!("token id {t} is outside the vocabulary")))
                })
                .collect::<Result<_, _>>()?,
        };
        let mut valid = self.finish(Endpoint::Completions, prompt_ids, req.common)?;
        if echo {
            valid.echo = Some(match text {
                Some(t) => t,
                None => self.tokenizer.decode(&valid.prompt_ids, true).map_err(|e| ApiError::invalid(e.to_string()))?,
            });
        }
        Ok(valid)
    }

    /// Validates a chat completion body: renders the conversation with the chat template.
    pub fn chat(&self, body: &[u8]) -> Result<ValidRequest, ApiError> {
        let req: ChatRequest = parse(body, CHAT_FIELDS)?;
        if req.messages.is_empty() {
            return Err(ApiError::param("messages", "at least one message is required"));
        }
        let template =
            self.template.as_ref().ok_or_else(|| ApiError::invalid(no_chat_template_message(&self.model_id)))?;
        let tools = Tools::parse(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls.as_ref())?
            .filter(Tools::active);
        // A template that renders tools gets them, and the history's calls, as data; for any
        // other the tools are described in the system message and past calls written as text.
        let native = template.supports_tools();
        let mut messages = Vec::with_capacity(req.messages.len() + 1);
        for (i, m) in req.messages.iter().enumerate() {
            messages.push(chat_message(i, m, native)?);
        }
        if let Some(t) = tools.as_ref().filter(|_| !native) {
            let prompt = t.system_prompt();
            match messages.first_mut() {
                Some(first) if first.role == "system" => first.content = format!("{}\n\n{prompt}", first.content),
                _ => messages.insert(0, ChatMessage::new("system", prompt)),
            }
        }
        let text = template.render_with_tools(&messages, tools.as_ref().filter(|_| native).map(|t| &t.raw), true)?;
        let ids = self.encode(&text, !template.starts_with_bos(&text), "messages")?;
        let mut valid = self.finish(Endpoint::Chat, ids, req.common)?;
        if let Some(call) = tools.as_ref().and_then(|t| t.constraint()) {
            if valid.sampling.adjust.constraint.is_some() {
                return Err(ApiError::param(
                    "response_format",
                    "`response_format` cannot be combined with a `tool_choice` that forces a call",
                ));
            }
            self.check_constraint(&call, "tools")?;
            valid.sampling.adjust.constraint = Some(call);
        }
        valid.tools = tools.map(Arc::new);
        Ok(valid)
    }

    /// Compiles a constraint as a worker will and walks its first tokens, so that an invalid
    /// one, or one the grammar engine cannot serve, is a 400 naming `param` before any token.
    fn check_constraint(&self, constraint: &Constraint, param: &str) -> Result<(), ApiError> {
        self.tokenizer
            .grammar_compiler()
            .and_then(|g| g.check(constraint))
            .map_err(|e| ApiError::param(param, e.to_string()))
    }

    /// The bound for [`Validator::max_prompt_bytes`]: `max_context` tokens of the longest token
    /// the vocabulary has. Tokenising costs time and memory in proportion to the text (a 1.9 MB
    /// prompt took 0.9 s and ~360 MB just to be refused), so a text no tokenisation can fit is
    /// refused by its length alone; below the bound the token count decides.
    pub fn prompt_bytes_bound(tokenizer: &Tokenizer, max_context: usize) -> usize {
        max_context.saturating_mul(tokenizer.longest_token_bytes())
    }

    fn encode(&self, text: &str, add_special: bool, param: &str) -> Result<Vec<u32>, ApiError> {
        if text.len() > self.max_prompt_bytes {
            return Err(ApiError::param(
                param,
                format!(
                    "the prompt is {} bytes, more than the {} bytes any prompt that fits the model's context of {} tokens can have",
                    text.len(),
                    self.max_prompt_bytes,
                    self.max_context
                ),
            ));
        }
        Ok(self.tokenizer.encode(text, add_special)?)
    }

    fn finish(&self, endpoint: Endpoint, prompt_ids: Vec<u32>, c: Common) -> Result<ValidRequest, ApiError> {
        let model = match c.model {
            Some(m) if m != self.model_id && !self.aliases.contains(&m) => return Err(ApiError::ModelNotFound(m)),
            _ => self.model_id.clone(),
        };
        if prompt_ids.is_empty() {
            return Err(ApiError::param("prompt", "the prompt is empty"));
        }
        if prompt_ids.len() >= self.max_context {
            return Err(ApiError::param(
                "prompt",
                format!(
                    "the prompt has {} tokens; this model's context is {} tokens",
                    prompt_ids.len(),
                    self.max_context
                ),
            ));
        }
        let room = self.max_context - prompt_ids.len();
        let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
            None if endpoint == Endpoint::Chat => room,
            None => DEFAULT_COMPLETION_TOKENS.min(room),
            Some(n) if n < 1 => return Err(ApiError::param("max_tokens", format!("must be at least 1, got {n}"))),
            Some(n) if n as u64 > room as u64 => {
                return Err(ApiError::param(
                    "max_tokens",
                    format!(
                        "{n} tokens do not fit: the prompt has {} tokens and the context is {}",
                        prompt_ids.len(),
                        self.max_context
                    ),
                ));
            }
            Some(n) => n as usize,
        };
        let temperature = c.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::param("temperature", format!("must be between 0 and 2, got {temperature}")));
        }
        let top_p = c.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::param("top_p", format!("must be in (0, 1], got {top_p}")));
        }
        let top_k = match c.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => return Err(ApiError::param("top_k", format!("must be positive (or -1 for all), got {k}"))),
        };
        let n = match c.n {
            None => 1,
            Some(n) if (1..=MAX_N as i64).contains(&n) => n as usize,
            Some(n) => return Err(ApiError::param("n", format!("must be from 1 to {MAX_N}, got {n}"))),
        };
        let seed = match c.seed {
            None => None,
            Some(s) => Some(u64::try_from(s).map_err(|_| ApiError::param("seed", "must be non-negative"))?),
        };
        let adjust = self.logit_adjust(&c)?;
        let logprobs = logprobs_param(endpoint, &c)?;
        let stop_token_ids =
            c.stop_token_ids
                .iter()
                .flatten()
                .map(|&t| {
                    u32::try_from(t).ok().filter(|&t| (t as usize) < self.vocab_size).ok_or_else(|| {
                        ApiError::param("stop_token_ids", format!("token id {t} is outside the vocabulary"))
                    })
                })
                .collect::<Result<Vec<u32>, _>>()?;
        let stop_strings = match c.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop_strings.len() > MAX_STOP_STRINGS {
            return Err(ApiError::param("stop", format!("at most {MAX_STOP_STRINGS} stop strings")));
        }
        if stop_strings.iter().any(String::is_empty) {
            return Err(ApiError::param("stop", "stop strings must not be empty"));
        }
        neutral("best_of", c.best_of.is_none_or(|v| v == 1))?;
        if c.echo == Some(true) {
            if endpoint == Endpoint::Chat {
                return Err(ApiError::param("echo", "`echo` is a /v1/completions parameter"));
            }
            if logprobs.is_some() {
                return Err(ApiError::param(
                    "echo",
                    "`echo` with `logprobs` (the prompt's log-probabilities) is not supported",
                ));
            }
        }
        neutral("suffix", c.suffix.is_none())?;
        if c.modalities.as_ref().is_some_and(|m| m.iter().any(|k| k != "text")) {
            return Err(ApiError::param(
                "modalities",
                "only text output is supported: `modalities` must be [\"text\"]",
            ));
        }
        let constraint = structured::response_format(c.response_format.as_ref())?;
        if let Some(constraint) = &constraint {
            self.check_constraint(constraint, "response_format")?;
        }
        let stream = c.stream.unwrap_or(false);
        Ok(ValidRequest {
            endpoint,
            model,
            prompt_ids,
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_k,
                top_p: top_p as f32,
                seed,
                adjust: LogitAdjust { constraint, ..adjust },
            },
            stop: StopParams { max_tokens, ignore_eos: c.ignore_eos.unwrap_or(false), stop_strings },
            stream,
            include_usage: stream && c.stream_options.is_some_and(|o| o.include_usage),
            logprobs,
            stop_token_ids,
            echo: None,
            n,
            session: c.user.clone().filter(|u| !u.is_empty()),
            tools: None,
        })
    }
}

impl Validator {
    /// Penalties, `logit_bias` and `min_p` (all absent: no adjustment).
    fn logit_adjust(&self, c: &Common) -> Result<LogitAdjust, ApiError> {
        let logit_bias = match &c.logit_bias {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Object(map)) => map
                .iter()
                .map(|(k, v)| {
                    let id = k
                        .parse::<u32>()
                        .map_err(|_| ApiError::param("logit_bias", format!("key {k:?} is not a token id")))?;
                    let bias = v.as_f64().ok_or_else(|| {
                        ApiError::param("logit_bias", format!("the bias of token {k} is not a number"))
                    })?;
                    Ok((id, bias as f32))
                })
                .collect::<Result<_, ApiError>>()?,
            Some(_) => return Err(ApiError::param("logit_bias", "must be an object of token id to bias")),
        };
        let adjust = LogitAdjust {
            presence_penalty: c.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: c.frequency_penalty.unwrap_or(0.0) as f32,
            repetition_penalty: c.repetition_penalty.unwrap_or(1.0) as f32,
            logit_bias,
            min_p: c.min_p.unwrap_or(0.0) as f32,
            constraint: None,
        };
        adjust.validate(self.vocab_size).map_err(|e| {
            let param = ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias"]
                .into_iter()
                .find(|p| e.starts_with(p))
                .unwrap_or("logit_bias");
            ApiError::param(param, e)
        })?;
        Ok(adjust)
    }
}

/// `logprobs` (and chat's `top_logprobs`): completions take `logprobs: N` (0 to 5
/// alternatives, as OpenAI's legacy API), chat `logprobs: true` with `top_logprobs: N` (0 to 20).
fn logprobs_param(endpoint: Endpoint, c: &Common) -> Result<Option<usize>, ApiError> {
    let off = |v: &Option<Value>| v.as_ref().is_none_or(|v| v.is_null() || v == &Value::Bool(false));
    match endpoint {
        Endpoint::Completions => {
            if c.top_logprobs.is_some_and(|n| n != 0) {
                return Err(ApiError::param("top_logprobs", "is chat's; completions take `logprobs: N`"));
            }
            if off(&c.logprobs) {
                return Ok(None);
            }
            match c.logprobs.as_ref().and_then(Value::as_i64) {
                Some(n @ 0..=5) => Ok(Some(n as usize)),
                _ => Err(ApiError::param("logprobs", "must be an integer from 0 to 5 (alternatives per token)")),
            }
        }
        Endpoint::Chat => {
            let on = match &c.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(_) => return Err(ApiError::param("logprobs", "must be true or false")),
            };
            let top = match c.top_logprobs {
                None => 0,
                Some(n @ 0..=20) => n as usize,
                Some(n) => return Err(ApiError::param("top_logprobs", format!("must be from 0 to 20, got {n}"))),
            };
            if !on && top > 0 {
                return Err(ApiError::param("top_logprobs", "needs `logprobs: true`"));
            }
            Ok(on.then_some(top))
        }
    }
}

/// One generated token's log-probabilities, the tokens as text.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobEntry {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens' texts and log-probabilities.
    pub top: Vec<(String, f32)>,
}

impl Validator {
    /// [`LogprobEntry`] of a generated token.
    pub fn logprob_entry(&self, token: u32, lp: &TokenLogprobs) -> LogprobEntry {
        let text = |t: u32| self.tokenizer.decode(&[t], false).unwrap_or_default();
        LogprobEntry {
            token: text(token),
            logprob: lp.logprob,
            top: lp.top.iter().map(|&(t, l)| (text(t), l)).collect(),
        }
    }
}

/// The `logprobs` object of a choice (or a streamed chunk) for `entries`: the legacy
/// completions shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`, offsets
/// counted from `text_offset`) or chat's `content` list.
pub fn logprobs_json(endpoint: Endpoint, entries: &[LogprobEntry], text_offset: usize) -> Value {
    match endpoint {
        Endpoint::Completions => {
            let mut offsets = Vec::with_capacity(entries.len());
            let mut at = text_offset;
            for e in entries {
                offsets.push(at);
                at += e.token.len();
            }
            let top: Vec<Value> = entries
                .iter()
                .map(|e| Value::Object(e.top.iter().map(|(t, l)| (t.clone(), serde_json::json!(l))).collect()))
                .collect();
            serde_json::json!({
                "tokens": entries.iter().map(|e| e.token.as_str()).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
                "top_logprobs": top,
                "text_offset": offsets,
            })
        }
        Endpoint::Chat => {
            let one = |t: &str, l: f32| serde_json::json!({"token": t, "logprob": l, "bytes": t.as_bytes()});
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut v = one(&e.token, e.logprob);
                    v["top_logprobs"] = e.top.iter().map(|(t, l)| one(t, *l)).collect();
                    v
                })
                .collect();
            serde_json::json!({ "content": content })
        }
    }
}

/// One message for the template: roles checked, content parts joined, tool calls and results
/// as data for a template that renders tools (`native`), else written into the text.
fn chat_message(i: usize, m: &ChatMessageIn, native: bool) -> Result<ChatMessage, ApiError> {
    if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
        return Err(ApiError::param(&format!("messages[{i}].role"), format!("unknown role `{}`", m.role)));
    }
    let mut content = match &m.content {
        None => String::new(),
        Some(Content::Text(t)) => t.clone(),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::param(
                            &format!("messages[{i}].content"),
                            "only text content parts are supported",
                        ));
                    }
                }
            }
            text
        }
    };
    if m.role == "tool" {
        let Some(id) = &m.tool_call_id else {
            return Err(ApiError::param(
                &format!("messages[{i}].tool_call_id"),
                "a `tool` message needs the id of the call it answers",
            ));
        };
        return Ok(if native {
            ChatMessage { tool_call_id: Some(id.clone()), name: m.name.clone(), ..ChatMessage::new("tool", content) }
        } else {
            ChatMessage::new("user", format!("<tool_response>\n{content}\n</tool_response>"))
        });
    }
    let role = if m.role == "developer" { "system" } else { m.role.as_str() };
    let calls = match &m.tool_calls {
        Some(calls) if !calls.is_empty() => calls,
        _ => return Ok(ChatMessage { name: m.name.clone().filter(|_| native), ..ChatMessage::new(role, content) }),
    };
    let param = format!("messages[{i}].tool_calls");
    if role != "assistant" {
        return Err(ApiError::param(&param, "only assistant messages have tool calls"));
    }
    let mut data = Vec::with_capacity(calls.len());
    for c in calls {
        if c.kind.as_deref().is_some_and(|k| k != "function") {
            return Err(ApiError::param(&param, "only calls of `type: \"function\"` are supported"));
        }
        // Templates index into the arguments, so they get an object where the text is one (as
        // vLLM passes them).
        let arguments = serde_json::from_str::<Value>(&c.function.arguments)
            .unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
        if !native {
            let call = serde_json::json!({"name": c.function.name, "arguments": arguments});
            if !content.is_empty() {
                content.push('\n');
            }
            content.push_str(&format!("{CALL_OPEN}\n{call}\n{CALL_CLOSE}"));
        }
        data.push(serde_json::json!({"id": c.id, "type": "function",
            "function": {"name": c.function.name, "arguments": arguments}}));
    }
    Ok(if native {
        ChatMessage { tool_calls: Some(Value::Array(data)), ..ChatMessage::new(role, content) }
    } else {
        ChatMessage::new(role, content)
    })
}

fn neutral(param: &str, ok: bool) -> Result<(), ApiError> {
    if ok {
        Ok(())
    } else {
        Err(ApiError::param(param, format!("`{param}` is not supported (only its default value)")))
    }
}
