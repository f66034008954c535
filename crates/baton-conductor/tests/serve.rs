//! The conductor and its workers on a real socket: disaggregated output (KV pulled or pushed)
//! equals colocated output equals the engine alone; streaming, concurrency and cancellation, in
//! the middle of a push too; bad input answered with OpenAI-style errors; and after every
//! scenario, no KV block held anywhere.

use std::sync::Arc;
use std::time::Duration;

use baton_conductor::ServeConfig;
use baton_engine::{Engine, EngineConfig, GenerationRequest, RequestId, StopParams};
use baton_model::{Checkpoint, LogitAdjust, SamplingParams};
use baton_protocol::KvTransfer;
use serde_json::{Value, json};

mod common;
use common::{Server, SseReader, fixture, start_with};

fn engine_config() -> EngineConfig {
    // Small blocks so every prompt spans several; a small arena so leaks would show.
    EngineConfig { block_size: 4, num_blocks: 256, max_batch_tokens: 64, prefill_chunk: 32, ..EngineConfig::default() }
}

async fn start(model: &str, prefill: usize, decode: usize, colocated: usize, api_key: Option<&str>) -> Server {
    let config = ServeConfig {
        prefill,
        decode,
        colocated,
        engine: engine_config(),
        api_key: api_key.map(str::to_owned),
        ..ServeConfig::new(fixture(model))
    };
    start_with(&config).await
}

/// One prefill and one decode worker handing KV over in `mode`; each push waits `push_delay`.
async fn start_handoff(model: &str, mode: KvTransfer, push_delay: Duration) -> Server {
    let config =
        ServeConfig { engine: engine_config(), kv_transfer: mode, push_delay, ..ServeConfig::new(fixture(model)) };
    start_with(&config).await
}

impl Server {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = reqwest::Client::new().post(format!("{}{path}", self.url)).json(&body).send().await.expect("sends");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let r = reqwest::Client::new()
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("sends");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    async fn stream(&self, path: &str, body: Value, stop_after: Option<usize>) -> (String, Option<String>, usize) {
        stream(&self.url, path, body, stop_after).await
    }
}

/// Streams a request and returns the concatenated text, the finish reason and the chunk count;
/// `stop_after` drops the connection after that many chunks.
async fn stream(url: &str, path: &str, body: Value, stop_after: Option<usize>) -> (String, Option<String>, usize) {
    let r = reqwest::Client::new().post(format!("{url}{path}")).json(&body).send().await.expect("sends");
    let mut reader = SseReader::new(r);
    let (mut text, mut finish, mut chunks) = (String::new(), None, 0);
    while let Some(v) = reader.next().await {
        let choice = &v["choices"][0];
        text.push_str(choice["text"].as_str().or(choice["delta"]["content"].as_str()).unwrap_or(""));
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
        chunks += 1;
        if stop_after == Some(chunks) {
            break;
        }
    }
    (text, finish, chunks)
}

/// The engine alone, greedy, for the reference output.
fn engine_alone(model: &str, prompt: &str, max_tokens: usize) -> (Vec<u32>, String) {
    common::engine_alone(model, engine_config(), prompt, max_tokens)
}

const PROMPTS: [&str; 3] = [
    "Disaggregated inference separates prefill and decode.",
    "The KV cache is transferred from the prefill worker to the decode worker",
    "A",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_equals_colocated_equals_the_engine() {
    for model in ["tiny-llama", "tiny-qwen2"] {
        let disagg = start(model, 1, 1, 0, None).await;
        let coloc = start(model, 0, 0, 1, None).await;
        for prompt in PROMPTS {
            let (ids, want) = engine_alone(model, prompt, 20);
            let body = json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": true});
            for server in [&disagg, &coloc] {
                let (status, v) = server.post("/v1/completions", body.clone()).await;
                assert_eq!(status, 200, "{v}");
                assert_eq!(v["choices"][0]["text"], want, "{model} {prompt:?}");
                assert_eq!(v["choices"][0]["finish_reason"], "length");
                assert_eq!(v["usage"]["prompt_tokens"], ids.len());
                assert_eq!(v["usage"]["completion_tokens"], 20);
                let mut streamed = body.clone();
                streamed["stream"] = json!(true);
                let (text, finish, _) = server.stream("/v1/completions", streamed, None).await;
                assert_eq!(text, want, "{model} {prompt:?} streamed");
                assert_eq!(finish.as_deref(), Some("length"));
            }
        }
        disagg.assert_no_kv_held().await;
        coloc.assert_no_kv_held().await;
    }
}

/// The engine alone, greedy with `adjust`: token ids and text.
fn engine_alone_adjusted(model: &str, prompt: &str, max_tokens: usize, adjust: LogitAdjust) -> (Vec<u32>, String) {
    let ckpt = Checkpoint::open(&fixture(model)).expect("loads");
    let ids = ckpt.tokenizer.encode(prompt, true).expect("encodes");
    let mut e = Engine::new(Arc::new(ckpt.model), Some(Arc::new(ckpt.tokenizer)), engine_config()).expect("engine");
    e.add_request(GenerationRequest {
        sampling: SamplingParams { adjust, ..SamplingParams::greedy() },
        stop: StopParams { max_tokens, ignore_eos: true, stop_strings: vec![] },
        ..GenerationRequest::new(RequestId(0), ids)
    })
    .expect("valid");
    let done = e.run_to_completion().expect("runs").remove(0);
    (done.token_ids, done.text)
}

/// Penalties and biases reach the sampler on both sides of a hand-off: the decode worker
/// continues with the prefill worker's counts, so disaggregated equals colocated equals the
/// engine alone — and differs from the same request without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_and_logit_bias_survive_the_hand_off() {
    let model = "tiny-llama";
    let prompt = PROMPTS[0];
    let (plain, _) = engine_alone_adjusted(model, prompt, 16, LogitAdjust::default());
    // Penalties on everything repeated and a bias against the plain run's first token; then
    // negative penalties, which favour the first token again only where the decode worker
    // counts the token the prefill worker generated.
    let penalised = LogitAdjust {
        presence_penalty: 1.0,
        frequency_penalty: 1.5,
        repetition_penalty: 1.3,
        logit_bias: vec![(plain[0], -100.0)],
        min_p: 0.0,
        constraint: None,
    };
    let favoured = LogitAdjust { presence_penalty: -2.0, frequency_penalty: -2.0, ..LogitAdjust::default() };
    let (want_penalised, _) = engine_alone_adjusted(model, prompt, 16, penalised.clone());
    assert_ne!(want_penalised[0], plain[0], "the bias removes the first token");
    let (want_favoured, _) = engine_alone_adjusted(model, prompt, 16, favoured.clone());
    assert!(want_favoured.iter().all(|&t| t == plain[0]), "the first token repeats: {want_favoured:?}");
    assert_ne!(plain.iter().filter(|&&t| t == plain[0]).count(), 16, "unlike the plain run");
    let body = |a: &LogitAdjust| {
        let bias: serde_json::Map<String, Value> =
            a.logit_bias.iter().map(|(t, b)| (t.to_string(), json!(b))).collect();
        json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
            "presence_penalty": a.presence_penalty, "frequency_penalty": a.frequency_penalty,
            "repetition_penalty": a.repetition_penalty, "logit_bias": bias})
    };
    for server in [start(model, 1, 1, 0, None).await, start(model, 0, 0, 1, None).await] {
        for (adjust, want) in [(&penalised, &want_penalised), (&favoured, &want_favoured)] {
            let (_, want_text) = engine_alone_adjusted(model, prompt, 16, adjust.clone());
            let (status, v) = server.post("/v1/completions", body(adjust)).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["choices"][0]["text"], want_text.as_str(), "{adjust:?} -> {want:?}");
        }
        server.assert_no_kv_held().await;
    }
}

/// `stop_token_ids`: generation ends at the first listed token (counted, its text left out),
/// whether the prefill worker generates it (the first token) or the decode worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_token_ids_end_generation_without_their_text() {
    let model = "tiny-llama";
    let prompt = PROMPTS[0];
    let (plain, _) = engine_alone_adjusted(model, prompt, 16, LogitAdjust::default());
    let ckpt = Checkpoint::open(&fixture(model)).expect("loads");
    for server in [start(model, 1, 1, 0, None).await, start(model, 0, 0, 1, None).await] {
        for at in [0, 3] {
            // The first occurrence of the token ends it.
            let first = plain.iter().position(|&t| t == plain[at]).expect("present");
            let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                "stop_token_ids": [plain[at]]});
            let (status, v) = server.post("/v1/completions", body).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
            assert_eq!(v["usage"]["completion_tokens"], first + 1, "{v}");
            let want = ckpt.tokenizer.decode(&plain[..first], true).expect("decodes");
            assert_eq!(v["choices"][0]["text"], want.as_str(), "{v}");
        }
        server.assert_no_kv_held().await;
    }
}

/// Completions' `echo`: the prompt (as sent, or decoded from token ids) before the generated
/// text, in full and streamed responses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_puts_the_prompt_before_the_completion() {
    let server = start("tiny-llama", 1, 1, 0, None).await;
    let prompt = PROMPTS[1];
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (_, plain) = server.post("/v1/completions", body.clone()).await;
    let generated = plain["choices"][0]["text"].as_str().expect("text").to_owned();
    let mut echoed = body.clone();
    echoed["echo"] = json!(true);
    let (status, v) = server.post("/v1/completions", echoed.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], format!("{prompt}{generated}"));
    assert_eq!(v["usage"]["completion_tokens"], 6);
    echoed["stream"] = json!(true);
    let (text, finish, _) = server.stream("/v1/completions", echoed, None).await;
    assert_eq!(text, format!("{prompt}{generated}"), "streamed");
    assert_eq!(finish.as_deref(), Some("length"));
    server.assert_no_kv_held().await;
}

/// Streamed chunks' `logprobs` objects, in order.
async fn streamed_logprobs(url: &str, path: &str, mut body: Value) -> Vec<Value> {
    body["stream"] = json!(true);
    let r = reqwest::Client::new().post(format!("{url}{path}")).json(&body).send().await.expect("sends");
    let text = r.text().await.expect("body");
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["logprobs"].as_object().map(|o| Value::Object(o.clone())))
        .collect()
}

/// `logprobs`: one entry per generated token, the greedy token the most likely of its
/// alternatives, the same disaggregated (first token from the prefill worker) as colocated,
/// streamed as whole; chat's shape with `top_logprobs` alternatives and bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_report_every_token_alike_disaggregated_colocated_and_streamed() {
    let mut per_server = Vec::new();
    for server in [start("tiny-llama", 1, 1, 0, None).await, start("tiny-llama", 0, 0, 1, None).await] {
        let body = json!({"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": 2});
        let (status, v) = server.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let logprobs: Vec<f64> = lp["token_logprobs"]
            .as_array()
            .expect("token_logprobs")
            .iter()
            .map(|x| x.as_f64().expect("a number"))
            .collect();
        assert_eq!(logprobs.len(), 6, "{lp}");
        assert_eq!(lp["tokens"].as_array().expect("tokens").len(), 6);
        assert_eq!(lp["text_offset"].as_array().expect("offsets").len(), 6);
        for (i, top) in lp["top_logprobs"].as_array().expect("top_logprobs").iter().enumerate() {
            let top = top.as_object().expect("an object");
            assert!(!top.is_empty() && top.len() <= 2, "{top:?}");
            let best = top.values().map(|x| x.as_f64().expect("a number")).fold(f64::NEG_INFINITY, f64::max);
            assert!(logprobs[i] <= 0.0 && (logprobs[i] - best).abs() < 1e-5, "greedy picks the most likely: {lp}");
        }
        let streamed = streamed_logprobs(&server.url, "/v1/completions", body).await;
        let streamed: Vec<f64> = streamed
            .iter()
            .flat_map(|o| o["token_logprobs"].as_array().expect("token_logprobs").clone())
            .map(|x| x.as_f64().expect("a number"))
            .collect();
        assert_eq!(streamed, logprobs, "streamed");

        let chat = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
        let (status, v) = server.post("/v1/chat/completions", chat).await;
        assert_eq!(status, 200, "{v}");
        let content = v["choices"][0]["logprobs"]["content"].as_array().expect("content").clone();
        assert_eq!(content.len(), 5, "{v}");
        for c in &content {
            assert_eq!(c["top_logprobs"].as_array().expect("alternatives").len(), 3, "{c}");
            assert_eq!(c["bytes"].as_array().expect("bytes").len(), c["token"].as_str().expect("token").len(), "{c}");
        }
        let (_, plain) = server.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})).await;
        assert!(plain["choices"][0]["logprobs"].is_null(), "{plain}");
        server.assert_no_kv_held().await;
        per_server.push(logprobs);
    }
    for (a, b) in per_server[0].iter().zip(&per_server[1]) {
        assert!((a - b).abs() < 1e-4, "disaggregated {:?} vs colocated {:?}", per_server[0], per_server[1]);
    }
}

/// `usage.prompt_tokens_details.cached_tokens`: none the first time, the prefix cache's whole
/// blocks the second (on the prefill worker when disaggregated: the decode worker's received KV
/// does not count), in full and streamed responses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reports_the_prompt_tokens_served_from_the_prefix_cache() {
    let prompt = PROMPTS[1];
    for server in [start("tiny-llama", 1, 1, 0, None).await, start("tiny-llama", 0, 0, 1, None).await] {
        let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
        let (status, first) = server.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{first}");
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{first}");
        let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
        let (_, second) = server.post("/v1/completions", body.clone()).await;
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached tokens");
        // Whole blocks of 4, short of the last prompt token (its logits are needed).
        assert!(cached > 0 && cached < prompt_tokens && cached % 4 == 0, "{cached} of {prompt_tokens}: {second}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let r = reqwest::Client::new().post(format!("{}/v1/completions", server.url)).json(&streamed).send().await;
        let text = r.expect("sends").text().await.expect("body");
        let usage: Value = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find(|v| v["usage"].is_object())
            .expect("a usage chunk")["usage"]
            .clone();
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], cached, "{usage}");
        server.assert_no_kv_held().await;
    }
}

/// `baton_prefill_tokens_total` on the server's `/metrics`.
async fn prefill_tokens(server: &Server) -> u64 {
    let text = reqwest::get(format!("{}/metrics", server.url)).await.expect("sends").text().await.expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix("baton_prefill_tokens_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no baton_prefill_tokens_total in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_one_prefill_and_differ_by_seed() {
    let prompt = PROMPTS[1];
    for server in [start("tiny-llama", 1, 1, 0, None).await, start("tiny-llama", 0, 0, 1, None).await] {
        let body =
            json!({"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3, "ignore_eos": true});
        let (status, v) = server.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{v}");
        let choices = v["choices"].as_array().expect("choices");
        let indices: Vec<u64> = choices.iter().map(|c| c["index"].as_u64().expect("index")).collect();
        assert_eq!(indices, [0, 1, 2], "{v}");
        let texts: Vec<&str> = choices.iter().map(|c| c["text"].as_str().expect("text")).collect();
        assert!(texts[0] != texts[1] && texts[1] != texts[2] && texts[0] != texts[2], "{texts:?}");
        let p = v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
        assert_eq!(v["usage"]["completion_tokens"], 18, "{v}");
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{v}");
        // The prompt was computed once: the later choices found its whole blocks (of 4) cached
        // and computed only the rest, the last token at least.
        let tail = p - (p - 1) / 4 * 4;
        assert!(tail < p);
        assert_eq!(prefill_tokens(&server).await, p + 2 * tail, "prompt of {p} tokens");
        // Choice i is choice 0 of a request seeded seed + i.
        for (i, text) in texts.iter().enumerate() {
            let one =
                json!({"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11 + i, "ignore_eos": true});
            let (_, v1) = server.post("/v1/completions", one).await;
            assert_eq!(v1["choices"][0]["text"].as_str(), Some(*text), "choice {i}");
        }
        // Streamed: every chunk names its choice, and each choice's text is the same.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let r = reqwest::Client::new().post(format!("{}/v1/completions", server.url)).json(&streamed).send().await;
        let sse = r.expect("sends").text().await.expect("body");
        let mut parts = vec![String::new(); 3];
        let mut finished = 0;
        let mut usage = Value::Null;
        for d in
            sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter_map(|d| serde_json::from_str::<Value>(d).ok())
        {
            for c in d["choices"].as_array().expect("choices") {
                let i = c["index"].as_u64().expect("index") as usize;
                parts[i].push_str(c["text"].as_str().unwrap_or_default());
                finished += usize::from(!c["finish_reason"].is_null());
            }
            if d["usage"].is_object() {
                usage = d["usage"].clone();
            }
        }
        assert_eq!(parts, texts, "{sse}");
        assert_eq!((finished, &usage["completion_tokens"]), (3, &json!(18)), "{sse}");
        server.assert_no_kv_held().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streams_and_concurrent_requests_are_each_correct() {
    let server = start("tiny-llama", 1, 1, 0, None).await;
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is prefill?"}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (status, full) = server.post("/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(full["choices"][0]["message"]["role"], "assistant");
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let (text, finish, _) = server.stream("/v1/chat/completions", streamed, None).await;
    assert_eq!(text, full["choices"][0]["message"]["content"].as_str().expect("content"));
    assert_eq!(finish.as_deref(), Some("length"));

    let mut tasks = Vec::new();
    for i in 0..8 {
        let prompt = PROMPTS[i % PROMPTS.len()];
        let (_, want) = engine_alone("tiny-llama", prompt, 16);
        let url = server.url.clone();
        let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true, "stream": true});
        tasks.push(tokio::spawn(async move {
            let (text, finish, _) = stream(&url, "/v1/completions", body, None).await;
            assert_eq!(text, want, "concurrent stream {i}");
            assert_eq!(finish.as_deref(), Some("length"));
        }));
    }
    for t in tasks {
        t.await.expect("stream task");
    }
    server.assert_no_kv_held().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_kv() {
    for mode in [KvTransfer::Pull, KvTransfer::Push, KvTransfer::Layerwise] {
        let server = start_handoff("tiny-llama", mode, Duration::ZERO).await;
        let body = json!({"prompt": PROMPTS[1], "max_tokens": 900, "ignore_eos": true, "stream": true});
        let (_, finish, chunks) = server.stream("/v1/completions", body, Some(3)).await;
        assert_eq!((finish, chunks), (None, 3), "dropped mid-stream");
        server.assert_no_kv_held().await;
    }
}

/// Whole push, layer-wise push and pull hand over the same KV: the same output as the engine
/// alone, for prompts of one block, several blocks and several prefill chunks (chunks of 32
/// tokens: each layer of each chunk goes out as it is computed, boundary blocks with the chunk
/// that fills them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_kv_gives_the_output_of_pulled_kv_and_of_the_engine() {
    let long = PROMPTS.join(" ").repeat(3);
    let prompts: Vec<&str> = PROMPTS.iter().copied().chain([long.as_str()]).collect();
    for model in ["tiny-llama", "tiny-qwen2"] {
        for mode in [KvTransfer::Push, KvTransfer::Layerwise] {
            // Fresh servers both: the usage counts what each prefix cache held.
            let pull = start_handoff(model, KvTransfer::Pull, Duration::ZERO).await;
            let push = start_handoff(model, mode, Duration::ZERO).await;
            assert_eq!(push.conductor.kv_transfer(), mode);
            for prompt in &prompts {
                let (ids, want) = engine_alone(model, prompt, 20);
                let body = json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": true});
                let (status, pulled) = pull.post("/v1/completions", body.clone()).await;
                assert_eq!(status, 200, "{pulled}");
                let (status, pushed) = push.post("/v1/completions", body.clone()).await;
                assert_eq!(status, 200, "{pushed}");
                assert_eq!(pushed["choices"][0]["text"], want, "{model} {mode:?} {prompt:?}: vs the engine");
                assert_eq!(pushed["choices"][0]["text"], pulled["choices"][0]["text"], "{model} {prompt:?}");
                assert_eq!(pushed["usage"], pulled["usage"]);
                assert_eq!(pushed["usage"]["prompt_tokens"], ids.len());
                let mut streamed = body.clone();
                streamed["stream"] = json!(true);
                let (text, finish, _) = push.stream("/v1/completions", streamed, None).await;
                assert_eq!(text, want, "{model} {mode:?} {prompt:?} streamed");
                assert_eq!(finish.as_deref(), Some("length"));
            }
            assert!(engine_alone(model, &long, 1).0.len() > 64, "the long prompt spans several chunks");
            // Requests that end at the prefill worker hand nothing over, in push modes too.
            for max_tokens in [1, 2] {
                let body =
                    json!({"prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
                let (status, v) = push.post("/v1/completions", body).await;
                assert_eq!((status, v["usage"]["completion_tokens"].as_u64()), (200, Some(max_tokens)), "{v}");
            }
            let metrics =
                reqwest::get(format!("{}/metrics", push.url)).await.expect("metrics").text().await.expect("text");
            let moved = metrics.lines().find(|l| l.starts_with("baton_kv_transfer_bytes_total")).expect("counter");
            assert!(!moved.ends_with(" 0"), "{mode:?}: no KV was pushed: {moved}");
            // No hand-off fell back to pulling or recomputing; in layer-wise mode every one (a
            // post and a stream per prompt, and the request of 2 tokens) was streamed.
            let retries = metrics.lines().find(|l| l.starts_with("baton_retries_total")).expect("counter");
            assert!(retries.ends_with(" 0"), "{mode:?}: {retries}");
            let layerwise =
                metrics.lines().find(|l| l.starts_with("baton_kv_layerwise_handoffs_total")).expect("counter");
            let want = if mode == KvTransfer::Layerwise { 2 * prompts.len() + 1 } else { 0 };
            assert_eq!(layerwise, format!("baton_kv_layerwise_handoffs_total {want}"), "{mode:?}");
            push.assert_no_kv_held().await;
            pull.assert_no_kv_held().await;
        }
    }
}

/// The stand-in device (`--device stand-in`, issue #58) in every hand-off mode: the engine's
/// output on the CPU, nothing held after, and the workers' copy meters
/// (`baton_kv_copy_bytes_total`) count the hand-offs' copies. (Between processes they go device
/// to device: `crates/baton/tests/cluster.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stand_in_device_hands_kv_over_in_every_mode_with_the_cpus_output() {
    let long = PROMPTS.join(" ").repeat(3);
    for mode in [KvTransfer::Pull, KvTransfer::Push, KvTransfer::Layerwise] {
        let config = ServeConfig {
            engine: engine_config(),
            kv_transfer: mode,
            device: baton_model::DeviceOptions {
                device: baton_model::ComputeDevice::StandIn,
                ..baton_model::DeviceOptions::default()
            },
            ..ServeConfig::new(fixture("tiny-llama"))
        };
        let server = start_with(&config).await;
        for prompt in [PROMPTS[0], long.as_str()] {
            let want = engine_alone("tiny-llama", prompt, 12).1;
            let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
            let (status, v) = server.post("/v1/completions", body).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["choices"][0]["text"], want, "{mode:?} {prompt:?}: the stand-in vs the CPU engine");
        }
        // One process: the workers hand KV over through shared memory, as `baton serve` does on
        // a GPU too. The side that copies counts it: a pull lands host bytes in the decode
        // worker's arena, a push reads the prefill worker's arena out to the host's mapping.
        let (h2d, d2h) = (
            common::copy_bytes(&server.url, "host_to_device").await,
            common::copy_bytes(&server.url, "device_to_host").await,
        );
        let counted = if mode == KvTransfer::Pull { h2d } else { d2h };
        assert!(counted > 0.0, "{mode:?}: the hand-offs' copies went uncounted ({h2d} h2d, {d2h} d2h)");
        server.assert_no_kv_held().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pushes_are_each_correct_and_a_client_gone_mid_push_frees_everything() {
    for mode in [KvTransfer::Push, KvTransfer::Layerwise] {
        concurrent_pushes(mode).await;
    }
}

async fn concurrent_pushes(mode: KvTransfer) {
    // Every push waits a little (a layer-wise one between its writes), so pushes overlap and a
    // client can leave in the middle of one.
    let server = start_handoff("tiny-llama", mode, Duration::from_millis(300)).await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let prompt = PROMPTS[i % PROMPTS.len()];
        let (_, want) = engine_alone("tiny-llama", prompt, 16);
        let url = server.url.clone();
        let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true, "stream": true});
        tasks.push(tokio::spawn(async move {
            let (text, finish, _) = stream(&url, "/v1/completions", body, None).await;
            assert_eq!(text, want, "concurrent pushed stream {i}, {mode:?}");
            assert_eq!(finish.as_deref(), Some("length"));
        }));
    }
    for t in tasks {
        t.await.expect("stream task");
    }
    server.assert_no_kv_held().await;

    // The first chunk is the prefill worker's token; the push is then waiting its 300 ms.
    for _ in 0..3 {
        let body = json!({"prompt": PROMPTS[1], "max_tokens": 50, "ignore_eos": true, "stream": true});
        let (_, finish, chunks) = server.stream("/v1/completions", body, Some(1)).await;
        assert_eq!((finish, chunks), (None, 1), "dropped mid-push");
    }
    server.assert_no_kv_held().await;
    // And the workers still serve.
    let (_, want) = engine_alone("tiny-llama", PROMPTS[0], 8);
    let body = json!({"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (status, v) = server.post("/v1/completions", body).await;
    assert_eq!((status, v["choices"][0]["text"].as_str()), (200, Some(want.as_str())), "{v}");
    server.assert_no_kv_held().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_style_errors() {
    let server = start("tiny-llama", 1, 1, 0, None).await;
    let long = "word ".repeat(2000);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/completions", "{not json".into(), 400, "not valid JSON"),
        ("/v1/completions", "[1, 2]".into(), 400, "JSON object"),
        ("/v1/completions", r#"{"prompt": "hi", "temprature": 0.5}"#.into(), 400, "temprature"),
        ("/v1/completions", r#"{"max_tokens": 5}"#.into(), 400, "prompt"),
        ("/v1/completions", json!({"prompt": long}).to_string(), 400, "context"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": -3}"#.into(), 400, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 100000000000}"#.into(), 400, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "hi", "temperature": 5}"#.into(), 400, "temperature"),
        ("/v1/completions", r#"{"prompt": "hi", "top_p": 0}"#.into(), 400, "top_p"),
        ("/v1/completions", r#"{"prompt": "hi", "n": 17}"#.into(), 400, "n"),
        ("/v1/completions", r#"{"prompt": "hi", "seed": -1}"#.into(), 400, "seed"),
        ("/v1/completions", r#"{"prompt": "hi", "presence_penalty": 2.5}"#.into(), 400, "presence_penalty"),
        ("/v1/completions", r#"{"prompt": "hi", "frequency_penalty": -3}"#.into(), 400, "frequency_penalty"),
        ("/v1/completions", r#"{"prompt": "hi", "repetition_penalty": 0}"#.into(), 400, "repetition_penalty"),
        ("/v1/completions", r#"{"prompt": "hi", "min_p": 1.5}"#.into(), 400, "min_p"),
        ("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"99999": 1}}"#.into(), 400, "logit_bias"),
        ("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"1": 200}}"#.into(), 400, "logit_bias"),
        ("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"x": 1}}"#.into(), 400, "logit_bias"),
        ("/v1/completions", r#"{"prompt": "hi", "logprobs": 6}"#.into(), 400, "logprobs"),
        ("/v1/completions", r#"{"prompt": "hi", "stop_token_ids": [99999]}"#.into(), 400, "stop_token_ids"),
        ("/v1/completions", r#"{"prompt": "hi", "echo": true, "logprobs": 1}"#.into(), 400, "echo"),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "echo": true}"#.into(),
            400,
            "echo",
        ),
        ("/v1/completions", r#"{"prompt": "hi", "top_logprobs": 2}"#.into(), 400, "top_logprobs"),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}"#.into(),
            400,
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}"#.into(),
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}"#.into(),
            400,
            "top_logprobs",
        ),
        ("/v1/completions", r#"{"prompt": [1, 2, 99999]}"#.into(), 400, "vocabulary"),
        ("/v1/completions", r#"{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}"#.into(), 400, "stop"),
        ("/v1/completions", r#"{"prompt": "hi", "model": "gpt-9"}"#.into(), 404, "gpt-9"),
        ("/v1/chat/completions", r#"{"messages": []}"#.into(), 400, "messages"),
        ("/v1/chat/completions", r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#.into(), 400, "role"),
        ("/v1/chat/completions", r#"{"messages": "hello"}"#.into(), 400, "invalid"),
        ("/v1/nothing", "{}".into(), 404, "no such endpoint"),
        ("/v1/completions", r#"{"prompt": "hi", "modalities": ["text", "audio"]}"#.into(), 400, "modalities"),
        ("/v1/completions", r#"{"prompt": "hi", "store": "yes"}"#.into(), 400, "store"),
    ];
    for (path, body, status, needle) in cases {
        let (got, v) = server.post_raw(path, &body).await;
        assert_eq!(got, status, "{body} -> {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{body}: `{message}` should mention `{needle}`");
        assert!(v["error"]["type"].is_string(), "{v}");
    }
    server.assert_no_kv_held().await;
}

/// The fields OpenAI's clients send that change nothing here are accepted (as vLLM accepts
/// them) and the answer is the one without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_fields_that_change_nothing_are_accepted() {
    let server = start("tiny-llama", 0, 0, 1, None).await;
    let plain = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0});
    let (status, want) = server.post("/v1/chat/completions", plain.clone()).await;
    assert_eq!(status, 200, "{want}");
    let mut extra = plain;
    for (k, v) in [
        ("store", json!(false)),
        ("metadata", json!({"team": "baton"})),
        ("service_tier", json!("auto")),
        ("safety_identifier", json!("user-1")),
        ("prompt_cache_key", json!("session-1")),
        ("reasoning_effort", json!("low")),
        ("modalities", json!(["text"])),
    ] {
        extra[k] = v;
    }
    let (status, got) = server.post("/v1/chat/completions", extra).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"]);
    let (status, got) =
        server.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2, "store": true, "metadata": {}})).await;
    assert_eq!(status, 200, "{got}");
    server.assert_no_kv_held().await;
}

/// A client may name the model by its id or by the path it was served from; answers carry the
/// id, and another name is still a 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_answers_to_its_path_too() {
    let server = start("tiny-llama", 0, 0, 1, None).await;
    let path = fixture("tiny-llama").display().to_string();
    for name in ["tiny-llama", path.as_str()] {
        let (status, v) = server.post("/v1/completions", json!({"model": name, "prompt": "hi", "max_tokens": 2})).await;
        assert_eq!(status, 200, "{name}: {v}");
        assert_eq!(v["model"], "tiny-llama", "{v}");
    }
    let (status, v) = server.post("/v1/completions", json!({"model": "tiny", "prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(status, 404, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_on_a_model_without_a_template_is_a_400_that_names_the_options() {
    // tiny-llama without its chat_template.jinja (its tokenizer_config.json has none).
    let dir = std::env::temp_dir().join(format!("baton-no-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for entry in std::fs::read_dir(fixture("tiny-llama")).expect("fixture") {
        let path = entry.expect("entry").path();
        if path.file_name().is_some_and(|n| n != "chat_template.jinja") {
            std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
        }
    }
    let server = start_with(&ServeConfig { engine: engine_config(), ..ServeConfig::new(dir.clone()) }).await;
    let (status, v) =
        server.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    for needle in ["no chat template", "/v1/completions", "--model smollm2-135m-instruct", "scripts/fetch-model.sh"] {
        assert!(message.contains(needle), "`{message}` should mention `{needle}`");
    }
    let (status, v) = server.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(status, 200, "{v}");
    server.assert_no_kv_held().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_is_required_when_set() {
    let server = start("tiny-llama", 0, 0, 1, Some("sesame")).await;
    let (status, v) = server.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(status, 401, "{v}");
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.url))
        .bearer_auth("sesame")
        .json(&json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("sends");
    assert_eq!(r.status().as_u16(), 200);
    let r = reqwest::Client::new()
        .get(format!("{}/v1/models", server.url))
        .bearer_auth("nope")
        .send()
        .await
        .expect("sends");
    assert_eq!(r.status().as_u16(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics_answer() {
    let server = start("tiny-llama", 1, 1, 0, None).await;
    let (status, _) =
        server.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 3, "ignore_eos": true})).await;
    assert_eq!(status, 200);
    let get = |p: &str| reqwest::Client::new().get(format!("{}{p}", server.url)).send();
    let models: Value = get("/v1/models").await.expect("sends").json().await.expect("json");
    assert_eq!(models["data"][0]["id"], "tiny-llama");
    assert_eq!(get("/health").await.expect("sends").status().as_u16(), 200);
    let text = get("/metrics").await.expect("sends").text().await.expect("text");
    for needle in [
        "baton_time_to_first_token_seconds_count 1",
        "baton_requests_total{outcome=\"ok\"} 1",
        "baton_routing_decisions_total{route=\"disaggregated\"} 1",
        "baton_kv_blocks{state=\"total\",tier=\"device\",worker=\"prefill-0\"} 256",
    ] {
        assert!(text.contains(needle), "metrics lack `{needle}`:\n{text}");
    }
    // The request's stay on its decode worker was measured (predictive admission's `t_d`).
    let residency: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("baton_decode_residency_seconds "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no baton_decode_residency_seconds:\n{text}"));
    assert!(residency > 0.0, "{residency}");

    // With no worker left, a request fails once and is counted once (#37: it was counted twice).
    for w in server.conductor.workers() {
        assert!(server.conductor.remove_worker(w.name()).is_some());
    }
    let (status, v) = server.post("/v1/completions", json!({"prompt": "hi", "max_tokens": 3})).await;
    assert_eq!(status, 503, "{v}");
    let text = get("/metrics").await.expect("sends").text().await.expect("text");
    assert!(text.contains("baton_requests_total{outcome=\"failed\"} 1\n"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_cluster_answers_429_with_retry_after() {
    let config = ServeConfig {
        prefill: 0,
        decode: 0,
        colocated: 1,
        engine: engine_config(),
        policy: baton_conductor::sched::PolicyChoice::Simple { max_in_flight: Some(1) },
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let conductor = baton_conductor::build(&config).expect("builds");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(baton_conductor::serve(listener, conductor.clone(), std::future::pending()));
    let body = json!({"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true});
    let send = |body: Value| {
        let url = url.clone();
        async move { reqwest::Client::new().post(format!("{url}/v1/completions")).json(&body).send().await.expect("sends") }
    };
    let responses = futures_join(vec![send(body.clone()), send(body.clone()), send(body.clone()), send(body)]).await;
    let mut ok = 0;
    let mut rejected = 0;
    for r in responses {
        match r.status().as_u16() {
            200 => ok += 1,
            429 => {
                rejected += 1;
                assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
                let v: Value = r.json().await.expect("json");
                assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert!(ok >= 1 && rejected >= 1, "{ok} served, {rejected} rejected");
    let server = Server { url, conductor, _shutdown: tokio::sync::oneshot::channel().0 };
    server.assert_no_kv_held().await;
}

/// Runs futures concurrently and returns their outputs in order.
async fn futures_join<F: std::future::Future + Send + 'static>(futures: Vec<F>) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("joins"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduling_crates_policies_route_live_requests() {
    use baton_sched::{AdmissionConfig, CostProfile, PolicyConfig, PolicyKind};
    for policy in [PolicyKind::KvCentric, PolicyKind::PromptTree, PolicyKind::LoadAware] {
        let config = ServeConfig {
            prefill: 1,
            decode: 1,
            colocated: 0,
            engine: engine_config(),
            policy: baton_conductor::sched::PolicyChoice::Sched {
                policy,
                config: PolicyConfig::default(),
                admission: AdmissionConfig::default(),
                cost: Box::new(CostProfile::llama2_70b_8xa800()),
                seed: 1,
                kv_fetch: true,
                decode_affinity: true,
                conditional_tokens: None,
            },
            ..ServeConfig::new(fixture("tiny-llama"))
        };
        let conductor = baton_conductor::build(&config).expect("builds");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(baton_conductor::serve(listener, conductor.clone(), std::future::pending()));
        let server = Server { url, conductor, _shutdown: tokio::sync::oneshot::channel().0 };
        let body =
            json!({"model": "tiny-llama", "prompt": "Once upon a time there was", "max_tokens": 8, "temperature": 0});
        let (s1, a) = server.post("/v1/completions", body.clone()).await;
        let (s2, b) = server.post("/v1/completions", body).await;
        assert_eq!((s1, s2), (200, 200), "{}: {a} {b}", policy.name());
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "{}", policy.name());
        assert_eq!(a["usage"]["completion_tokens"], 8);
        server.assert_no_kv_held().await;
    }
}

/// The 70B-on-8×H100 profile (its KV bytes a token) with step times shrunk so a test runs in
/// milliseconds; the shape stays.
fn fast_70b_profile() -> baton_sched::CostProfile {
    let mut profile = baton_sched::CostProfile::llama2_70b_8xh100();
    profile.prefill.fixed_us = 200.0;
    profile.prefill.per_token_us = 1.0;
    profile.prefill.attention_us = 0.0;
    profile.decode.fixed_us = 300.0;
    profile
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_workers_hand_kv_over_and_run_to_exact_lengths() {
    let profile = fast_70b_profile();
    for kv_transfer in [KvTransfer::Pull, KvTransfer::Push, KvTransfer::Layerwise] {
        let config = ServeConfig {
            engine: engine_config(),
            emulate: Some(profile.clone()),
            kv_transfer,
            ..ServeConfig::new(fixture("tiny-llama"))
        };
        let server = start_with(&config).await;
        for max_tokens in [1, 2, 17] {
            let body = json!({"model": "tiny-llama", "prompt": "An emulated prompt of a few blocks of tokens", "max_tokens": max_tokens});
            let (status, v) = server.post("/v1/completions", body).await;
            assert_eq!(status, 200, "{kv_transfer:?}: {v}");
            assert_eq!(v["usage"]["completion_tokens"], max_tokens, "{kv_transfer:?}: {v}");
            assert_eq!(v["choices"][0]["finish_reason"], "length");
        }
        server.assert_no_kv_held().await;
    }
}

/// Layer-wise reservations wait for an idle prefill worker: of two requests that overlap on
/// one prefill worker (its emulated prefill takes a second), the one that finds the other
/// prefilling there is handed over by pull after its prefill, so its decode blocks are not
/// held while it queues; the other streams layer by layer. Both give the full answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layerwise_reservation_waits_for_an_idle_prefill_worker() {
    let mut profile = fast_70b_profile();
    profile.prefill.per_token_us = 100_000.0;
    let config = ServeConfig {
        engine: engine_config(),
        emulate: Some(profile),
        kv_transfer: KvTransfer::Layerwise,
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let server = start_with(&config).await;
    let body = json!({"model": "tiny-llama", "prompt": "An emulated prompt of a few blocks", "max_tokens": 4});
    let first = {
        let (url, body) = (server.url.clone(), body.clone());
        tokio::spawn(async move {
            let r = reqwest::Client::new().post(format!("{url}/v1/completions")).json(&body).send().await;
            r.expect("sends").json::<Value>().await.expect("JSON")
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, second) = server.post("/v1/completions", body).await;
    let first = first.await.expect("first request");
    assert_eq!(status, 200, "{second}");
    for v in [&first, &second] {
        assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    }
    let text = reqwest::get(format!("{}/metrics", server.url)).await.expect("sends").text().await.expect("text");
    assert!(text.contains("baton_kv_layerwise_handoffs_total 1\n"), "one of the two:\n{text}");
    assert!(text.contains("baton_retries_total 0\n"), "{text}");
    server.assert_no_kv_held().await;
}

/// An emulated link (`--emulate-link-gbps`) makes a hand-off take the emulated model's KV bytes
/// over its bandwidth, pulled or pushed: each hand-off, from the end of the prefill to the
/// decode worker's first token (`baton_kv_transfer_seconds`), lasts at least the prompt's KV
/// (the 70B profile's 327,680 bytes a token) over 0.1 Gb/s, less the prefill's time for a
/// layer-wise push (which crosses the prefill worker's link while the prefill computes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emulated_link_makes_hand_offs_take_the_real_bytes_over_its_bandwidth() {
    let profile = fast_70b_profile();
    let link = baton_sched::Link { bytes_per_s: 12_500_000, latency_us: 0 };
    for kv_transfer in [KvTransfer::Pull, KvTransfer::Push, KvTransfer::Layerwise] {
        let config = ServeConfig {
            engine: engine_config(),
            emulate: Some(profile.clone()),
            emulate_link: Some(link),
            kv_transfer,
            ..ServeConfig::new(fixture("tiny-llama"))
        };
        let server = start_with(&config).await;
        let body = json!({"model": "tiny-llama", "prompt": "A prompt whose KV crosses a slow link", "max_tokens": 2});
        let (status, v) = server.post("/v1/completions", body).await;
        assert_eq!(status, 200, "{kv_transfer:?}: {v}");
        let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
        let least = (prompt_tokens * profile.kv_bytes_per_token) as f64 / link.bytes_per_s as f64;
        let text = reqwest::get(format!("{}/metrics", server.url)).await.expect("sends").text().await.expect("text");
        let figure = |name: &str| -> f64 {
            text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
        };
        assert_eq!(figure("baton_kv_transfer_seconds_count "), 1.0, "{kv_transfer:?}");
        let took = figure("baton_kv_transfer_seconds_sum ");
        // A layer-wise push begins crossing as the prefill computes: only that much is hidden.
        let hidden = match kv_transfer {
            KvTransfer::Layerwise => profile.prefill_time(prompt_tokens, 0.0) as f64 / 1e6,
            _ => 0.0,
        };
        assert!(took >= least - hidden, "{kv_transfer:?}: the hand-off took {took} s, the link needs {least} s");
        server.assert_no_kv_held().await;
    }
}

/// A client that leaves while its KV crawls over an emulated link (1 kB/s: the prompt's 70B KV
/// would take hours) frees the decode worker's reserved blocks at once: the wait for the link
/// ends with the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_a_slow_emulated_transfer_frees_its_kv() {
    for kv_transfer in [KvTransfer::Pull, KvTransfer::Push, KvTransfer::Layerwise] {
        let config = ServeConfig {
            engine: engine_config(),
            emulate: Some(fast_70b_profile()),
            emulate_link: Some(baton_sched::Link { bytes_per_s: 1_000, latency_us: 0 }),
            kv_transfer,
            ..ServeConfig::new(fixture("tiny-llama"))
        };
        let server = start_with(&config).await;
        let body = json!({"prompt": PROMPTS[1], "max_tokens": 50, "ignore_eos": true, "stream": true});
        // The second token waits for the link: the client gives up on it after a second (the
        // hand-off has long begun by then) and its connection closes.
        let waited =
            tokio::time::timeout(Duration::from_secs(1), server.stream("/v1/completions", body, Some(2))).await;
        assert!(waited.is_err(), "{kv_transfer:?}: a second token came before the link could carry the KV");
        server.assert_no_kv_held().await;
    }
}

/// The load reports carry decode-only step figures (what admission scales its predicted steps
/// by): the decode worker, which ran decode steps, reports their mean time, batch and context;
/// the prefill worker, which ran none, reports none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_carry_decode_only_step_figures() {
    let server = start("tiny-llama", 1, 1, 0, None).await;
    let body = json!({"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": true});
    let (status, v) = server.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{v}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let url = format!("{}/debug/kv-index", server.url);
        let index: Value = reqwest::get(url).await.expect("the index").json().await.expect("JSON");
        let reports: Vec<(String, Value)> = index["workers"]
            .as_object()
            .expect("workers")
            .iter()
            .map(|(name, w)| (name.clone(), w["report"].clone()))
            .collect();
        let decode = reports.iter().find(|(n, _)| n.starts_with("decode")).map(|(_, r)| r.clone());
        let prefill = reports.iter().find(|(n, _)| n.starts_with("prefill")).map(|(_, r)| r.clone());
        if let (Some(d), Some(p)) = (decode, prefill)
            && d["decode_step_us"].as_u64().is_some_and(|us| us > 0)
        {
            let batch = d["decode_step_batch"].as_f64().expect("a batch");
            assert!((1.0..=1.0001).contains(&batch), "one sequence decoded: {d}");
            // The prompt and the tokens so far: more than the prompt's few tokens.
            assert!(d["decode_step_context"].as_f64().expect("a context") > 4.0, "{d}");
            assert_eq!(p["decode_step_us"].as_u64(), Some(0), "the prefill worker ran no decode step: {p}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no decode step figures: {reports:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.assert_no_kv_held().await;
}
