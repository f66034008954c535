//! A batch step's interface, whatever backend computes it: each sequence's part of the step
//! ([`SeqStep`]: new tokens after what the cache holds, the block table, the logits wanted) in,
//! [`StepLogits`] out. A prefill chunk, a decode token or a prompt that starts after a reused
//! prefix are the same thing here. Plain data, below the backends and the packing for a device.

use std::ops::Range;

use baton_kv::BlockId;

use crate::error::{ModelError, Result};

/// Which logits a sequence wants back from a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// The last new token's (to sample the next token).
    Last,
    /// Every new token's (to check a prompt's logits).
    All,
    /// Only which token the last new token's logits rank first ([`StepLogits::argmax`]): a
    /// greedy request that needs nothing else of them. A GPU then picks it on the device and
    /// copies one id back instead of a vocabulary of floats.
    Argmax,
}

/// One sequence's part of a batch step.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    /// Tokens of this sequence already in the KV cache; the new tokens take positions
    /// `start_pos..start_pos + tokens.len()`.
    pub start_pos: usize,
    /// The new tokens.
    pub tokens: &'a [u32],
    /// Block table covering at least `start_pos + tokens.len()` positions.
    pub blocks: &'a [BlockId],
    /// Logits to return.
    pub logits: LogitsWanted,
}

impl SeqStep<'_> {
    /// Refuses what no backend computes: a block table too short for the positions, a token
    /// outside the vocabulary.
    pub(crate) fn check(&self, block_size: usize, vocab: usize) -> Result<()> {
        let end = self.start_pos + self.tokens.len();
        if self.blocks.len() * block_size < end {
            return Err(ModelError::InvalidInput(format!(
                "block table of {} blocks cannot hold {end} positions",
                self.blocks.len()
            )));
        }
        if let Some(&bad) = self.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!("token id {bad} is outside the vocabulary of {vocab}")));
        }
        Ok(())
    }

    /// Which of the new tokens' logits are wanted (indices into `tokens`).
    pub(crate) fn logit_rows(&self) -> Range<usize> {
        match self.logits {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last | LogitsWanted::Argmax => self.tokens.len().saturating_sub(1)..self.tokens.len(),
            LogitsWanted::All => 0..self.tokens.len(),
        }
    }
}

/// Logits of a batch step: rows in batch order, and for each sequence the rows that are its.
#[derive(Debug, Clone)]
pub struct StepLogits {
    /// `[rows][vocab]`.
    pub data: Vec<f32>,
    /// Vocabulary size.
    pub vocab: usize,
    /// Row range of each sequence of the batch, in batch order (empty for a sequence that
    /// asked for [`LogitsWanted::Argmax`] when the backend picked on the device).
    pub rows: Vec<Range<usize>>,
    /// For each sequence that asked for [`LogitsWanted::Argmax`], the first token of largest
    /// logit (as [`crate::argmax`]); `None` for the others.
    pub argmax: Vec<Option<u32>>,
}

impl StepLogits {
    /// The logits rows of sequence `i` of the batch, `[rows][vocab]` flattened.
    pub fn of(&self, i: usize) -> &[f32] {
        let r = &self.rows[i];
        &self.data[r.start * self.vocab..r.end * self.vocab]
    }
}
