//! One request's state inside the engine.

use baton_kv::BlockTable;
use baton_model::{Grammar, IncrementalDecoder, Sampler, Tokenizer};

use crate::request::{FinishReason, GenerationRequest, KvRetention, StopParams};
use crate::{EngineError, RequestId};

/// A request in flight: its tokens, its blocks, and the text produced so far.
#[derive(Debug)]
pub(crate) struct Sequence {
    pub(crate) id: RequestId,
    /// Prompt, then generated tokens.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Tokens whose KV is in `table`'s blocks.
    pub(crate) computed: usize,
    pub(crate) table: BlockTable,
    /// Prompt tokens whose KV was reused (cached or received), fixed when first admitted
    /// (`None` until then; a preemption does not change it).
    pub(crate) cached_tokens: Option<usize>,
    pub(crate) sampler: Sampler,
    pub(crate) stop: StopParams,
    pub(crate) retain_kv: KvRetention,
    /// Whether it uses the prefix cache ([`GenerationRequest::prefix_cache`]).
    pub(crate) prefix_cache: bool,
    /// `Some` while prompt logits are wanted and being collected.
    pub(crate) prompt_logits: Option<Vec<f32>>,
    pub(crate) decoder: IncrementalDecoder,
    /// Generated text so far, stop strings excluded.
    pub(crate) text: String,
    /// Bytes of `text` already handed out as deltas.
    pub(crate) emitted: usize,
    /// Alternatives per token whose log-probabilities are reported (`None`: none reported).
    pub(crate) logprobs: Option<usize>,
    pub(crate) stop_token_ids: Vec<u32>,
    /// Stream the prompt's KV layer by layer ([`GenerationRequest::stream_kv`]).
    pub(crate) stream_kv: bool,
    /// Leading blocks of `table` streamed already (back to 0 when preempted).
    pub(crate) streamed_blocks: usize,
}

impl Sequence {
    /// A sequence for a validated request, sampling under `grammar` (compiled from its
    /// constraint) if it has one; with a tokenizer, the text of tokens generated upstream is
    /// taken as already handed out. Those tokens advance the sampler's penalties and grammar as
    /// if they had been sampled here.
    pub(crate) fn new(
        req: GenerationRequest,
        fallback_seed: u64,
        tokenizer: Option<&Tokenizer>,
        grammar: Option<Grammar>,
    ) -> Result<Self, EngineError> {
        let prompt_len = req.prompt.len();
        let (table, computed) = match req.prefix {
            Some(p) => (BlockTable::new(p.blocks), p.tokens),
            None => (BlockTable::default(), 0),
        };
        let mut sampler = Sampler::new(req.sampling, fallback_seed);
        if let Some(g) = grammar {
            sampler = sampler.with_grammar(g);
        }
        sampler.observe_prompt(&req.prompt);
        req.generated.iter().for_each(|&t| sampler.observe(t));
        let mut tokens = req.prompt;
        tokens.extend_from_slice(&req.generated);
        let mut seq = Self {
            id: req.id,
            tokens,
            prompt_len,
            computed,
            table,
            cached_tokens: None,
            sampler,
            stop: req.stop,
            retain_kv: req.retain_kv,
            prefix_cache: req.prefix_cache,
            prompt_logits: req.return_prompt_logits.then(Vec::new),
            decoder: IncrementalDecoder::default(),
            text: String::new(),
            emitted: 0,
            logprobs: req.logprobs,
            stop_token_ids: req.stop_token_ids,
            stream_kv: req.stream_kv,
            streamed_blocks: 0,
        };
        if let Some(tok) = tokenizer {
            // One token at a time, as the worker that streamed them did: decoded all at once,
            // tokens ending inside a multi-byte character would hold back the whole text, and
            // the next token would stream it all again.
            for n in 1..=seq.generated().len() {
                let delta = seq.decoder.step(tok, &seq.tokens[prompt_len..prompt_len + n])?;
                seq.text.push_str(&delta);
            }
            seq.emitted = seq.text.len();
        }
        Ok(seq)
    }

    /// Whether the next computed prompt positions' logits are to be kept.
    pub(crate) fn collecting_prompt_logits(&self, vocab: usize) -> bool {
        self.computed < self.prompt_len
            && self.prompt_logits.as_ref().is_some_and(|l| l.len() < self.prompt_len * vocab)
    }

    pub(crate) fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Appends a sampled token and decides whether the sequence is done.
    pub(crate) fn push_token(
        &mut self,
        token: u32,
        eos: &[u32],
        tokenizer: Option<&Tokenizer>,
        max_context: usize,
    ) -> Result<Option<FinishReason>, EngineError> {
        self.tokens.push(token);
        self.sampler.observe(token);
        let stop_token = self.stop_token_ids.contains(&token);
        let reason = if self.sampler.grammar_failure().is_some() {
            Some(FinishReason::GrammarFailed)
        } else if (!self.stop.ignore_eos && eos.contains(&token)) || self.sampler.grammar_finished() {
            // A complete grammar allows nothing but end-of-sequence: the output is done.
            Some(FinishReason::Eos)
        } else if stop_token {
            Some(FinishReason::Stop)
        } else if self.generated().len() >= self.stop.max_tokens || self.tokens.len() >= max_context {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(tok) = tokenizer {
            let delta = self.decoder.step(tok, &self.tokens[self.prompt_len..])?;
            if stop_token {
                // The stop token's own text is left out.
                return Ok(reason);
            }
            self.text.push_str(&delta);
            if let Some(cut) = self.find_stop(delta.len()) {
                self.text.truncate(cut);
                return Ok(Some(FinishReason::Stop));
            }
            // A request handing its KV over continues elsewhere: an incomplete character stays
            // held back, as the next worker's decoder will hold it.
            if reason.is_some() && self.retain_kv != KvRetention::All {
                let tail = self.decoder.flush(tok, &self.tokens[self.prompt_len..])?;
                self.text.push_str(&tail);
            }
        }
        Ok(reason)
    }

    /// Byte offset of the earliest stop string that ends in the text `new_bytes` just added.
    fn find_stop(&self, new_bytes: usize) -> Option<usize> {
        self.stop
            .stop_strings
            .iter()
            .filter_map(|s| {
                let from = self.text.len().saturating_sub(new_bytes + s.len());
                let from = (from..=self.text.len()).find(|&i| self.text.is_char_boundary(i)).unwrap_or(0);
                self.text[from..].find(s.as_str()).map(|i| from + i)
            })
            .min()
    }

    /// Text not yet handed out, holding back a tail that might still become a stop string
    /// unless `all` is set.
    pub(crate) fn take_delta(&mut self, all: bool) -> String {
        let hold =
            if all { 0 } else { self.stop.stop_strings.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0) };
        let mut end = self.text.len().saturating_sub(hold).max(self.emitted);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let delta = self.text[self.emitted..end].to_owned();
        self.emitted = end;
        delta
    }
}
