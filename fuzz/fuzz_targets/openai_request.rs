//! The OpenAI request parser: any body a client can post to `/v1/completions` and
//! `/v1/chat/completions`, validated against the tiny Llama fixture's tokenizer and chat
//! template. Every input is a `ValidRequest` or a 400, never a panic.
#![no_main]

use std::sync::{Arc, LazyLock};

use baton_conductor::openai::Validator;
use libfuzzer_sys::fuzz_target;

static VALIDATOR: LazyLock<Validator> = LazyLock::new(|| {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/tiny-llama");
    let front = baton_model::Frontend::open(&dir).expect("the tiny-llama fixture loads");
    let max_context = front.config.max_position_embeddings;
    Validator {
        model_id: "tiny".into(),
        max_context,
        vocab_size: front.config.vocab_size,
        max_prompt_bytes: Validator::prompt_bytes_bound(&front.tokenizer, max_context),
        tokenizer: Arc::new(front.tokenizer),
        template: front.chat_template.map(Arc::new),
    }
});

fuzz_target!(|data: &[u8]| {
    let _ = VALIDATOR.completion(data);
    let _ = VALIDATOR.chat(data);
});
