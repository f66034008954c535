//! A request checked before it is queued: its ids, tokens, limits and stop strings against the
//! model and the arena, a prefix it brings (blocks held, sized for its tokens), and its grammar
//! compiled (an invalid one refused like any invalid request).

use super::*;

impl Engine {
    /// The request's grammar, compiled from its constraint (the vocabulary's compiler is built
    /// on the first request that has one).
    pub(super) fn grammar(&self, req: &GenerationRequest) -> Result<Option<baton_model::Grammar>, EngineError> {
        let Some(constraint) = &req.sampling.adjust.constraint else { return Ok(None) };
        let invalid = |m: String| EngineError::InvalidRequest(m);
        if matches!(self.backend, Backend::Emulated(_)) {
            return Err(invalid("an emulated engine samples no logits, so it cannot follow a grammar".into()));
        }
        let tokenizer = self.tokenizer.as_ref().ok_or_else(|| invalid("a grammar needs a tokenizer".into()))?;
        let compiler = tokenizer.grammar_compiler().map_err(|e| invalid(e.to_string()))?;
        let grammar = compiler.compile(constraint).map_err(|e| invalid(e.to_string()))?;
        Ok(Some(grammar))
    }

    pub(super) fn validate(&self, req: &GenerationRequest) -> Result<(), EngineError> {
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        let cfg = self.backend.config();
        let bs = self.config.block_size;
        if self.seqs.contains_key(&req.id) {
            return invalid(format!("request id {} is already in use", req.id.0));
        }
        if req.prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return invalid(format!("token id {t} is outside the vocabulary ({} tokens)", cfg.vocab_size));
        }
        if req.return_prompt_logits && matches!(self.backend, Backend::Emulated(_)) {
            return invalid("an emulated engine computes no logits".into());
        }
        if req.stop.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        if let Err(m) = req.sampling.validate() {
            return invalid(m);
        }
        if !req.stop.stop_strings.is_empty() && self.tokenizer.is_none() {
            return invalid("stop strings need a tokenizer".into());
        }
        if req.stop.stop_strings.iter().any(String::is_empty) {
            return invalid("stop strings must not be empty".into());
        }
        let longest = req.prompt.len() + req.stop.max_tokens;
        if req.prompt.len() >= cfg.max_position_embeddings {
            return invalid(format!(
                "the prompt has {} tokens; the model's context is {}",
                req.prompt.len(),
                cfg.max_position_embeddings
            ));
        }
        let longest = longest.min(cfg.max_position_embeddings);
        if longest.div_ceil(bs) > self.config.num_blocks {
            return invalid(format!(
                "prompt plus max_tokens ({longest} tokens) needs more KV blocks than the engine has ({} of {bs} tokens)",
                self.config.num_blocks
            ));
        }
        if req.generated.len() >= req.stop.max_tokens {
            return invalid(format!(
                "{} tokens were generated already; max_tokens is {}",
                req.generated.len(),
                req.stop.max_tokens
            ));
        }
        if let Some(&t) = req.generated.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return invalid(format!("generated token id {t} is outside the vocabulary ({} tokens)", cfg.vocab_size));
        }
        let known = req.prompt.len() + req.generated.len();
        if let Some(prefix) = &req.prefix {
            let partial = prefix.tokens % bs != 0;
            if prefix.blocks.len() != prefix.tokens.div_ceil(bs) {
                return invalid(format!(
                    "a prefix of {} tokens needs {} blocks of {bs}, not {}",
                    prefix.tokens,
                    prefix.tokens.div_ceil(bs),
                    prefix.blocks.len()
                ));
            }
            if prefix.tokens >= known {
                return invalid(format!(
                    "the prefix covers {} tokens; at most {} may be cached",
                    prefix.tokens,
                    known - 1
                ));
            }
            let held = |b: &baton_kv::BlockId| self.pool.ref_count(Loc { tier: Tier::Device, block: *b });
            if let Some(b) = prefix.blocks.iter().find(|b| held(b) == 0) {
                return invalid(format!("reused prefix {b} is not allocated"));
            }
            if partial && prefix.blocks.last().is_some_and(|b| held(b) != 1) {
                return invalid("a prefix ending in a partial block must hold that block alone".into());
            }
        }
        Ok(())
    }
}
