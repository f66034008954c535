//! What a caller hands the engine and what it gets back.

use baton_kv::BlockId;
use baton_model::{SamplingParams, TokenLogprobs};

use crate::RequestId;

/// When generation ends. Serialisable, so a request crosses processes whole (fields left out
/// take their defaults).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StopParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Stop when the text contains any of these; the text ends before the match.
    pub stop_strings: Vec<String>,
}

impl Default for StopParams {
    fn default() -> Self {
        Self { max_tokens: 16, ignore_eos: false, stop_strings: Vec::new() }
    }
}

/// KV blocks holding the first `tokens` tokens of some sequence, with one reference held on
/// each block for whoever holds this value. Give it back with
/// [`crate::Engine::release_kv`] or pass it as a later request's [`GenerationRequest::prefix`].
///
/// Usually a whole number of blocks; the last block is partial only for KV retained with
/// [`KvRetention::All`] (a prefill handing a request over), and such a block must be held by
/// nobody else when it is passed on, since the next tokens are written into it.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "retained KV blocks stay allocated until released"]
pub struct KvPrefix {
    /// The blocks, in token order.
    pub blocks: Vec<BlockId>,
    /// Tokens they hold.
    pub tokens: usize,
}

/// Which KV a finished request keeps (in [`Finished::kv`]) instead of freeing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvRetention {
    /// None: everything is freed (or cached by the prefix index).
    #[default]
    None,
    /// The prompt's whole blocks, to reuse as another request's prefix.
    PromptBlocks,
    /// Every computed token's KV, partial last block included: what a prefill worker holds
    /// for the decode worker to pull.
    All,
}

/// A request to generate.
#[derive(Debug)]
pub struct GenerationRequest {
    /// Caller-chosen id, unique among the engine's live requests.
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens already generated for this request elsewhere (a decode worker continuing after
    /// a prefill worker's first token). They count toward `max_tokens`; their text is not
    /// produced again.
    pub generated: Vec<u32>,
    /// How to sample.
    pub sampling: SamplingParams,
    /// When to stop.
    pub stop: StopParams,
    /// KV of the prompt's first tokens, already computed (a reused prefix): prefill starts
    /// after it. The engine takes over the references it holds.
    pub prefix: Option<KvPrefix>,
    /// Return the logits of every prompt position in [`Finished::prompt_logits`].
    pub return_prompt_logits: bool,
    /// KV to keep when finished, handed back in [`Finished::kv`].
    pub retain_kv: KvRetention,
    /// Whether the request takes its prompt's cached prefix and leaves its KV in the prefix
    /// cache when it ends (with the engine's `prefix_caching` on). `false` runs it as though
    /// nothing were cached (MemServe's PD-Basic, for comparisons).
    pub prefix_cache: bool,
    /// Report each generated token's log-probability and those of the `n` most likely tokens
    /// (`Some(n)`), or nothing (`None`).
    pub logprobs: Option<usize>,
    /// Generating one of these ends the request (`FinishReason::Stop`); the token counts, its
    /// text is left out (as vLLM's `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// Hand the prompt's KV to the engine's [`KvStream`] layer by layer as the forward pass
    /// writes it (a prefill worker's layer-wise push; see [`Engine::set_kv_stream`](crate::Engine::set_kv_stream)).
    pub stream_kv: bool,
}

/// Blocks of a request whose KV a step completes: the unit of layer-wise streaming. Each block
/// is whole (or the prompt's last) and stays as it is while the request holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPiece {
    /// The request.
    pub id: RequestId,
    /// Position of `blocks[0]` among the request's blocks.
    pub first: usize,
    /// The blocks.
    pub blocks: Vec<BlockId>,
    /// Tokens of KV in them.
    pub tokens: usize,
}

/// Where an engine streams the KV of requests with [`GenerationRequest::stream_kv`].
///
/// For each step, the prompt blocks the step completes (and, on a request's first step, those
/// it took from the prefix cache) make one [`KvPiece`], reported once a layer is written:
/// `layer_written(l, layers, piece)` for `l` in `0..layers`, in order, where `layers` is the
/// model's layer count. The engine's arena may have fewer layers than that (an emulated
/// backend's arena has one): layer `l` of `layers` completes the arena's layers
/// `l·A/layers..(l+1)·A/layers` of `A`. A preempted request streams its blocks again when it
/// runs again (the last write of a block wins).
pub trait KvStream: Send {
    /// Layer `layer` of `layers` of `piece`'s blocks is written and will not change while the
    /// request holds them.
    fn layer_written(&mut self, layer: usize, layers: usize, piece: &KvPiece);
}

impl GenerationRequest {
    /// A greedy request with default stop parameters.
    pub fn new(id: RequestId, prompt: Vec<u32>) -> Self {
        Self {
            id,
            prompt,
            generated: Vec::new(),
            sampling: SamplingParams::greedy(),
            stop: StopParams::default(),
            prefix: None,
            return_prompt_logits: false,
            retain_kv: KvRetention::None,
            prefix_cache: true,
            logprobs: None,
            stop_token_ids: Vec::new(),
            stream_kv: false,
        }
    }
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token.
    Eos,
    /// `max_tokens` or the model's context length.
    Length,
    /// A stop string.
    Stop,
    /// The caller aborted it.
    Aborted,
    /// The output's grammar failed (llguidance could not compute a mask, or refused a token):
    /// the text is not a sentence of the grammar, and the request ends with an error.
    GrammarFailed,
}

impl FinishReason {
    /// The OpenAI API's name for it.
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Eos | FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Aborted => "abort",
            FinishReason::GrammarFailed => "error",
        }
    }
}

/// A token a request produced in a step, with the text it adds.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The request.
    pub id: RequestId,
    /// The token.
    pub token: u32,
    /// Text this token makes visible (may be empty while a character or a possible stop string
    /// is incomplete).
    pub text_delta: String,
    /// The token's log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// A request that ended.
#[derive(Debug)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Why.
    pub reason: FinishReason,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens that came from a reused prefix instead of being computed.
    pub cached_tokens: usize,
    /// Generated token ids (an end-of-sequence token that stopped generation included), the
    /// request's [`GenerationRequest::generated`] first.
    pub token_ids: Vec<u32>,
    /// Generated text (stop string and end-of-sequence excluded; the text of tokens generated
    /// upstream included, though never streamed again); empty without a tokenizer.
    pub text: String,
    /// Logits of the prompt positions the engine computed, `[rows][vocab]` flattened, when asked
    /// for: positions `prompt_tokens - rows .. prompt_tokens` (from `cached_tokens` on, since a
    /// reused prefix is not computed).
    pub prompt_logits: Option<Vec<f32>>,
    /// The retained KV when asked for.
    pub kv: Option<KvPrefix>,
}

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOutput {
    /// Tokens produced, one per sequence that sampled.
    pub tokens: Vec<TokenEvent>,
    /// Requests that ended.
    pub finished: Vec<Finished>,
    /// Tokens computed in the step (prefill and decode).
    pub computed_tokens: usize,
    /// Of the step's sequences, those that decoded (one token after some KV)...
    pub decode_batch: usize,
    /// ...and their context, tokens in all. A step with `computed_tokens == decode_batch` ran
    /// no prefill chunk.
    pub decode_context: usize,
    /// Sequences preempted by this step.
    pub preempted: usize,
}
