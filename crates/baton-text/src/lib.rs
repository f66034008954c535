//! Text in and out of a model, for Baton: the [`Tokenizer`] (Hugging Face `tokenizer.json`, or
//! rebuilt from a GGUF file's vocabulary by [`tokenizer_from_gguf`]), the [`ChatTemplate`]
//! (minijinja, rendering as transformers renders), structured output's [`Grammar`]
//! (llguidance), and the [`Sampler`] that picks each next token from the logits, under the
//! request's grammar when it has one.
//!
//! ```no_run
//! use baton_text::{ChatMessage, ChatTemplate, Sampler, SamplingParams, Tokenizer};
//!
//! let dir = std::path::Path::new("fixtures/models/tiny-llama");
//! let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
//! let source = std::fs::read_to_string(dir.join("chat_template.jinja")).expect("a template");
//! let template = ChatTemplate::new(&source, Some("<s>"), Some("</s>"))?;
//! let prompt = template.render(&[ChatMessage::new("user", "Hello")], true)?;
//! let ids = tokenizer.encode(&prompt, !template.starts_with_bos(&prompt))?;
//! let mut sampler = Sampler::new(SamplingParams::greedy(), 0);
//! sampler.observe_prompt(&ids);
//! let logits = vec![0.0; tokenizer.vocab_size()]; // a forward pass's, in Baton
//! let next = sampler.sample(&logits);
//! println!("{}", tokenizer.decode(&[next], true)?);
//! # Ok::<(), baton_model_types::ModelError>(())
//! ```
//!
//! Layout: `tokenizer.rs` (encode, decode, incremental decoding, each token's bytes),
//! `gguf.rs` (the tokenizer and chat template a GGUF file's metadata describes), `chat.rs`,
//! [`grammar`] and [`sampling`]. Errors are `baton-model-types`' `ModelError` (its `Tokenizer`,
//! `Template` and `Grammar` kinds), as the model crate returns them.
//!
//! Invariants: a grammar's state depends only on the tokens committed to it (a state rebuilt
//! from the first k tokens allows what the step-by-step state allowed: `grammar.rs` tests); a
//! token sampled under a grammar is one the grammar allows.

mod chat;
mod gguf;
pub mod grammar;
pub mod sampling;
mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use gguf::{chat_template_from_gguf, tokenizer_from_gguf};
pub use grammar::{Constraint, Grammar, GrammarCompiler};
pub use sampling::{LogitAdjust, Sampler, SamplingParams, TokenLogprobs, argmax, token_logprobs};
pub use tokenizer::{IncrementalDecoder, Tokenizer};
