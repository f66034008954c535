//! The OpenAI request parser: any body a client can post to `/v1/completions` and
//! `/v1/chat/completions`, validated against the tiny Llama fixture's tokenizer and chat
//! template. Every input is a `ValidRequest` or a 400, never a panic.
#![no_main]

use std::sync::LazyLock;

use baton_conductor::openai::Validator;
use libfuzzer_sys::fuzz_target;

/// Built as the conductor builds its own (`load_frontend`), so a field added to the validator
/// cannot leave this target behind.
static VALIDATOR: LazyLock<Validator> = LazyLock::new(|| {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/tiny-llama");
    baton_conductor::load_frontend(&dir, Some("tiny")).expect("the tiny-llama fixture loads")
});

fuzz_target!(|data: &[u8]| {
    let _ = VALIDATOR.completion(data);
    let _ = VALIDATOR.chat(data);
});
