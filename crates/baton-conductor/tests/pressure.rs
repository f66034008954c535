//! The server under load, as a hostile tester drives it through the OpenAI API (`baton serve`'s
//! own builder, a real socket): storms of concurrent streaming requests on a small KV arena never
//! hang, never fail after their first token (a refusal is a 429 with `Retry-After`, before it),
//! and give each request the greedy text it gets alone; after the storm nothing is held and the
//! next request is served.

use std::time::Duration;

use baton_conductor::ServeConfig;
use baton_engine::EngineConfig;

mod common;
use common::{Server, fixture, start_with};
use serde_json::{Value, json};

async fn start(config: &ServeConfig) -> Server {
    start_with(config).await
}

/// How one streamed request ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// `[DONE]` after this text.
    Done(String),
    /// Refused with 429 and a `Retry-After`, before any token.
    Refused,
    /// The request got no HTTP response (the connection failed).
    NoResponse,
}

/// Streams one request; panics on an error after the first token, a status other than 200 or
/// 429, a 429 without `Retry-After`, or a stream that ends without `[DONE]`. A stalled stream
/// fails the test through the client's timeout (a hang is a failure, not a wait).
async fn stream_once(client: &reqwest::Client, url: &str, path: &str, body: &Value) -> Outcome {
    let r = match client.post(format!("{url}{path}")).json(body).send().await {
        Ok(r) => r,
        // No answer at all (a connection lost in a burst of hundreds on two busy cores): the
        // client retries, as a client would; nothing was streamed, so nothing is duplicated.
        Err(e) => {
            eprintln!("no response ({e}); retrying");
            return Outcome::NoResponse;
        }
    };
    match r.status().as_u16() {
        200 => {}
        429 => {
            assert!(r.headers().get("retry-after").is_some(), "a 429 without Retry-After");
            return Outcome::Refused;
        }
        other => panic!("status {other}: {}", r.text().await.unwrap_or_default()),
    }
    Outcome::Done(read_stream(r).await.0)
}

/// Reads a 200's stream to its `[DONE]`: its text and how many chunks carried it. Panics on an
/// error event (a failure after the 200) or a stream that ends without `[DONE]`; a stalled
/// stream fails through the client's timeout.
async fn read_stream(mut r: reqwest::Response) -> (String, usize) {
    let (mut text, mut buf, mut chunks) = (String::new(), String::new(), 0);
    while let Some(bytes) = r.chunk().await.expect("the stream does not hang or break") {
        buf.push_str(std::str::from_utf8(&bytes).expect("utf-8"));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return (text, chunks);
            }
            let v: Value = serde_json::from_str(data).expect("chunk is JSON");
            assert!(v.get("error").is_none(), "an error after {chunks} streamed chunks: {v}");
            let choice = &v["choices"][0];
            text.push_str(choice["text"].as_str().or(choice["delta"]["content"].as_str()).unwrap_or(""));
            chunks += 1;
        }
    }
    panic!("the stream ended without [DONE] after {chunks} chunks");
}

/// Streams a request until it is served, honouring 429s (waiting `Retry-After`); returns the
/// text and how many times it was refused.
async fn until_served(client: reqwest::Client, url: String, path: &'static str, body: Value) -> (String, usize) {
    let (mut refused, mut lost) = (0, 0);
    loop {
        match stream_once(&client, &url, path, &body).await {
            Outcome::Done(text) => return (text, refused),
            Outcome::Refused => {
                refused += 1;
                assert!(refused < 200, "refused forever");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Outcome::NoResponse => {
                lost += 1;
                assert!(lost < 5, "no response five times");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

fn client() -> reqwest::Client {
    // A generous bound: a hang fails the test instead of blocking it.
    reqwest::Client::builder().timeout(Duration::from_secs(300)).build().expect("client")
}

/// The storm's requests: completions sharing a system prompt, unrelated completions and chats.
fn storm_bodies(max_tokens: usize) -> Vec<(&'static str, Value)> {
    let system = "You are a helpful assistant that answers questions about distributed inference. ";
    let mut bodies = Vec::new();
    for q in ["What is prefill?", "What is decode?", "Why move the KV cache?"] {
        bodies.push((
            "/v1/completions",
            json!({"prompt": format!("{system}{q}"), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": true, "stream": true}),
        ));
    }
    for p in ["Once upon a time", "The quick brown fox jumps over", "In a galaxy far away"] {
        bodies.push((
            "/v1/completions",
            json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true}),
        ));
    }
    for m in ["Hello there!", "Tell me a story about a relay race."] {
        bodies.push((
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": m}], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": true, "stream": true}),
        ));
    }
    bodies
}

/// Runs every body alone, one after another, for the reference texts.
async fn alone(server: &Server, bodies: &[(&'static str, Value)]) -> Vec<String> {
    let mut out = Vec::new();
    for (path, body) in bodies {
        out.push(until_served(client(), server.url.clone(), path, body.clone()).await.0);
    }
    out
}

/// `copies` of each body at once; every text must equal its reference.
async fn storm(server: &Server, bodies: &[(&'static str, Value)], reference: &[String], copies: usize) -> usize {
    let mut handles = Vec::new();
    for _ in 0..copies {
        for (i, (path, body)) in bodies.iter().enumerate() {
            let f = until_served(client(), server.url.clone(), path, body.clone());
            handles.push((i, tokio::spawn(f)));
        }
    }
    let mut refusals = 0;
    for (i, h) in handles {
        let (text, refused) = h.await.expect("joins");
        assert_eq!(text, reference[i], "request {i} under load differs from its run alone");
        refusals += refused;
    }
    refusals
}

/// Issue reproduction 1: 64 concurrent streams of 300 tokens on a 64-block arena, 1 prefill +
/// 1 decode. Before #37: most streams hung, some got a 429 after their first token, and the
/// server refused everything afterwards (the prefill engine wedged with its waiting requests
/// pinning cached prefixes). After #37: 12 served and 52 refused with 429 in 0.2 s (#63), the
/// burst admitted only as far as the decode pool held it *then*. Now the rest wait for decode
/// room in the conductor's queue, with the default limit: every stream is served on its first
/// try, none refused, each with its text alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_on_a_small_arena_is_served_whole_on_the_first_try() {
    let config = ServeConfig {
        engine: EngineConfig { num_blocks: 64, ..EngineConfig::default() },
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let server = start(&config).await;
    let bodies = storm_bodies(300);
    let reference = alone(&server, &bodies).await;
    server.assert_no_kv_held().await;
    let refusals = storm(&server, &bodies, &reference, 8).await;
    eprintln!("64 streams served; {refusals} refusals (429 before the first token) on the way");
    assert_eq!(refusals, 0, "a burst the running requests make room for within the limit waits; none is refused");
    server.assert_no_kv_held().await;
    // The server is not wedged: the next request is served, with the same text.
    let (text, refused) = until_served(client(), server.url.clone(), bodies[0].0, bodies[0].1.clone()).await;
    assert_eq!((text.as_str(), refused), (reference[0].as_str(), 0));
    server.assert_no_kv_held().await;
}

/// Issue reproduction 2: one colocated engine, 200 concurrent requests of one prompt whose
/// decode outgrows the arena. Before: a step failed with "out of device blocks" and every
/// request in flight got a 500. Now the engine preempts (and recomputes) instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocated_engine_preempts_instead_of_failing_its_batch() {
    let config = ServeConfig {
        prefill: 0,
        decode: 0,
        colocated: 1,
        engine: EngineConfig { num_blocks: 256, ..EngineConfig::default() },
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let server = start(&config).await;
    let prompt = "Relay runners pass the baton in a marked zone; ".repeat(8);
    let body = json!({"prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": true, "stream": true});
    let bodies = vec![("/v1/completions", body)];
    let reference = alone(&server, &bodies).await;
    let refusals = storm(&server, &bodies, &reference, 200).await;
    assert_eq!(refusals, 0, "a colocated engine queues; nothing refuses");
    server.assert_no_kv_held().await;
}

/// Issue reproduction 4: 200 concurrent requests on 1 prefill + 1 decode with no in-flight cap.
/// Before: 68 were refused with a 429 after their prefill (a streaming client saw a first token,
/// then an error). Now a request the decode side has no room for is refused before its prefill,
/// and one that is accepted completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_come_before_the_first_token_never_after() {
    let config = ServeConfig {
        engine: EngineConfig { num_blocks: 128, ..EngineConfig::default() },
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let server = start(&config).await;
    let bodies = storm_bodies(40);
    let reference = alone(&server, &bodies).await;
    let refusals = storm(&server, &bodies, &reference, 25).await;
    eprintln!("200 requests served; {refusals} refusals before the first token on the way");
    server.assert_no_kv_held().await;
}

/// A request that waits in the queue sends nothing, so no failed send tells the worker its
/// client left: before, it stayed queued (and pinned its cached prefix) until its turn came. Now
/// it leaves the queue at once. An emulated worker (20 ms per decode step) keeps the first
/// request running for seconds while the others wait behind it (one sequence at a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_whose_client_left_leaves_the_queue_at_once() {
    let mut profile = baton_sched::CostProfile::llama2_70b_8xh100();
    profile.decode.fixed_us = 20_000.0;
    let config = ServeConfig {
        prefill: 0,
        decode: 0,
        colocated: 1,
        engine: EngineConfig { max_num_seqs: 1, ..EngineConfig::default() },
        emulate: Some(profile),
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let server = start(&config).await;
    let worker = server.conductor.workers().remove(0);
    let body = |max_tokens: usize| json!({"prompt": "A prompt that waits its turn", "max_tokens": max_tokens, "ignore_eos": true, "stream": true});
    let open = |b: Value| {
        let url = server.url.clone();
        async move { client().post(format!("{url}/v1/completions")).json(&b).send().await.expect("sends") }
    };
    // The first runs for ~1000 × 20 ms; three more wait behind it.
    let running = open(body(1000)).await;
    assert_eq!(running.status().as_u16(), 200);
    let mut waiting = Vec::new();
    for _ in 0..3 {
        let r = open(body(10)).await;
        assert_eq!(r.status().as_u16(), 200);
        waiting.push(r);
    }
    let queued = |n: usize| {
        let worker = worker.clone();
        async move {
            for _ in 0..400 {
                let s = worker.stats().await.expect("stats");
                if s.waiting == n {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("the queue never held {n}: {:?}", worker.stats().await);
        }
    };
    queued(3).await;
    drop(waiting);
    let s = queued(0).await;
    assert_eq!(s.running, 1, "the queue emptied while the first request still ran: {s:?}");
    drop(running);
    server.assert_no_kv_held().await;
}

/// The refusal before the prefill is the conductor's, not one policy's: with the scheduling
/// crate's `kv-centric` policy on a 16-block decode worker, 40 concurrent requests each complete
/// with their solo text or are refused before their first token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_policy_refuses_before_the_first_token_never_after() {
    use baton_sched::{AdmissionConfig, CostProfile, PolicyConfig, PolicyKind};
    let config = ServeConfig {
        engine: EngineConfig { num_blocks: 16, ..EngineConfig::default() },
        policy: baton_conductor::sched::PolicyChoice::Sched {
            policy: PolicyKind::KvCentric,
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
    let server = start(&config).await;
    let bodies = storm_bodies(60);
    let reference = alone(&server, &bodies).await;
    let refusals = storm(&server, &bodies, &reference, 5).await;
    eprintln!("kv-centric: 40 requests served; {refusals} refusals before the first token on the way");
    server.assert_no_kv_held().await;
}

/// The storm over KV tiers: a 64-block device arena with 64 host and 64 disk blocks under each
/// worker, disaggregated with the default `--pd-caching 3` (answers returned into the prefill
/// worker's cache, hand-offs reusing what the decode worker caches). Evicted prefixes move down
/// the tiers and come back while hand-offs, returns and refusals go on; every text equals its
/// run alone, and afterwards no worker holds KV and each worker's block file is gone with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_over_kv_tiers_keeps_every_text_and_leaks_nothing() {
    let dir = std::env::temp_dir().join(format!("baton-storm-tiers-{}", std::process::id()));
    let config = ServeConfig {
        engine: EngineConfig {
            num_blocks: 64,
            host_blocks: 64,
            disk_blocks: 64,
            disk_dir: Some(dir.clone()),
            ..EngineConfig::default()
        },
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let server = start(&config).await;
    let bodies = storm_bodies(120);
    let reference = alone(&server, &bodies).await;
    let refusals = storm(&server, &bodies, &reference, 4).await;
    eprintln!("32 streams over KV tiers served; {refusals} refusals before the first token");
    server.assert_no_kv_held().await;
    // The storm pushed cached blocks below the device arena (the index follows the workers).
    let mut lower = 0;
    for _ in 0..200 {
        lower = ["prefill-0", "decode-1"]
            .iter()
            .filter_map(|w| server.conductor.view().blocks(w))
            .flatten()
            .filter(|(_, tier)| *tier != baton_kv::Tier::Device)
            .count();
        if lower > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    eprintln!("{lower} cached blocks below the device tier after the storm");
    assert!(lower > 0, "the storm used the host or disk tier");
    // Again, alone: what the tiers kept gives the same texts.
    assert_eq!(alone(&server, &bodies).await, reference);
    server.assert_no_kv_held().await;
    // Each worker's block file lost its name when it was made: whatever ends the workers,
    // nothing is left in the directory.
    assert_eq!(std::fs::read_dir(&dir).expect("the disk tier's directory").count(), 0, "no block file by name");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A busy worker is not a dead one (#37, item 2: requests queued on a healthy prefill worker
/// were failed after 120 s of silence, and the worker's breaker tripped). Emulated prefill of
/// 400 ms a step, one request at a time, and a 100 ms silence before the conductor probes: the
/// last of eight requests waits seconds without an event. Before, each such wait was "worker
/// lost"; now the probe finds the worker alive, every request completes, nothing is retried and
/// no breaker trips.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_busy_with_a_queue_is_not_taken_for_dead() {
    let mut profile = baton_sched::CostProfile::llama2_70b_8xh100();
    profile.prefill.fixed_us = 400_000.0;
    let config = ServeConfig {
        engine: EngineConfig { max_num_seqs: 1, ..EngineConfig::default() },
        emulate: Some(profile),
        worker_silence: Duration::from_millis(100),
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let server = start(&config).await;
    let body = json!({"prompt": "A prompt that waits its turn", "max_tokens": 4, "ignore_eos": true, "stream": true});
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let (client, url, body) = (client(), server.url.clone(), body.clone());
            tokio::spawn(async move { stream_once(&client, &url, "/v1/completions", &body).await })
        })
        .collect();
    for r in runs {
        assert!(matches!(r.await.expect("joins"), Outcome::Done(_)), "a queued request did not complete");
    }
    for w in server.conductor.workers() {
        assert!(!server.conductor.is_tripped(w.name()), "{} was taken for dead", w.name());
    }
    // (A run counts its outcome just after its client has the last event: wait for the eighth.)
    let mut metrics = String::new();
    for _ in 0..100 {
        let r = client().get(format!("{}/metrics", server.url)).send().await.expect("sends");
        metrics = r.text().await.expect("text");
        if metrics.contains("baton_requests_total{outcome=\"ok\"} 8") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(metrics.contains("baton_requests_total{outcome=\"ok\"} 8"), "{metrics}");
    assert!(metrics.contains("baton_retries_total 0"), "{metrics}");
    server.assert_no_kv_held().await;
}

/// A burst starts only as far as the decode pool holds it (#37, item 2: the whole burst was
/// admitted at once because only requests already decoding were counted), and the rest wait for
/// room (#63: they were refused). 64 blocks of 16 tokens, 300 concurrent streams of prompts from
/// ~30 to ~780 tokens on a slow emulated prefill, no limit on the wait (`--max-queue-wait 0`, as
/// vLLM queues): every one completes, none fails after its 200, and no breaker trips.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_waits_for_decode_room_and_is_served_whole() {
    let mut profile = baton_sched::CostProfile::llama2_70b_8xh100();
    profile.prefill.fixed_us = 50_000.0;
    let config = ServeConfig {
        engine: EngineConfig { num_blocks: 64, ..EngineConfig::default() },
        emulate: Some(profile),
        max_queue_wait: None,
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    let server = start(&config).await;
    let runs: Vec<_> = (0..300)
        .map(|i| {
            let prompt = "relay ".repeat(10 + (i * 37) % 250);
            let body = json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true, "stream": true});
            let (client, url) = (client(), server.url.clone());
            tokio::spawn(async move { stream_once(&client, &url, "/v1/completions", &body).await })
        })
        .collect();
    let (mut done, mut refused, mut lost) = (0, 0, 0);
    for r in runs {
        match r.await.expect("joins") {
            Outcome::Done(_) => done += 1,
            Outcome::Refused => refused += 1,
            Outcome::NoResponse => lost += 1,
        }
    }
    eprintln!("{done} completed, {refused} refused with 429 before their stream, {lost} without a response");
    assert_eq!((done, refused), (300 - lost, 0), "every request waits for room and is served");
    for w in server.conductor.workers() {
        assert!(!server.conductor.is_tripped(w.name()), "{} was taken for dead", w.name());
    }
    server.assert_no_kv_held().await;
}

/// Token ids of a prompt of exactly `n` tokens (the tiny model's vocabulary holds them).
fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + i % 200).collect()
}

/// A server whose decode worker holds one 70-token request at a time (8 blocks of 16 tokens)
/// and decodes at 100 ms a step, with `--max-queue-wait 1`.
async fn one_at_a_time() -> Server {
    let mut profile = baton_sched::CostProfile::llama2_70b_8xh100();
    profile.decode.fixed_us = 100_000.0;
    let config = ServeConfig {
        engine: EngineConfig { num_blocks: 8, ..EngineConfig::default() },
        emulate: Some(profile),
        max_queue_wait: Some(Duration::from_secs(1)),
        ..ServeConfig::new(fixture("tiny-llama"))
    };
    start(&config).await
}

/// Sends a streaming request of a 70-token prompt and 20 tokens out.
async fn send_70(server: &Server) -> reqwest::Response {
    let body = json!({"prompt": ids(70), "max_tokens": 20, "ignore_eos": true, "stream": true});
    client().post(format!("{}/v1/completions", server.url)).json(&body).send().await.expect("sends")
}

/// Reads a 200's stream to its end: its chunks ([`read_stream`]).
async fn finish(r: reqwest::Response) -> usize {
    assert_eq!(r.status().as_u16(), 200);
    read_stream(r).await.1
}

/// With `--max-queue-wait 1`, a request the conductor predicts would wait ~2 s for decode room
/// (the one ahead of it holds the room for 20 decode steps of 100 ms, and the first requests
/// measured how long a request holds it: a wait is predicted from four) is refused at once, its
/// `Retry-After` the predicted wait, before any stream; the request holding the room completes,
/// and the next after it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_predicted_to_wait_past_the_limit_is_refused_at_once() {
    let server = one_at_a_time().await;
    // Measures the hold: ~2 s from admission to the end of the decode, four times.
    for _ in 0..4 {
        finish(send_70(&server).await).await;
    }
    let holder = send_70(&server).await;
    assert_eq!(holder.status().as_u16(), 200);
    let asked = std::time::Instant::now();
    let refused = send_70(&server).await;
    let took = asked.elapsed();
    assert_eq!(refused.status().as_u16(), 429);
    let retry_after: u64 = refused
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After of whole seconds");
    assert!(took < Duration::from_millis(900), "refused at once ({took:?}), not at the limit");
    assert!(retry_after >= 2, "Retry-After {retry_after}: the predicted wait, over the limit");
    finish(holder).await;
    finish(send_70(&server).await).await;
    server.assert_no_kv_held().await;
}

/// Before the conductor has measured how long a request holds decode room, it cannot predict a
/// wait: the request waits in the queue, and when `--max-queue-wait 1` passes without room it
/// gets its 429 then, before its stream; the request holding the room completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_still_waiting_at_the_limit_is_refused_before_its_stream() {
    let server = one_at_a_time().await;
    let holder = send_70(&server).await;
    assert_eq!(holder.status().as_u16(), 200);
    let asked = std::time::Instant::now();
    let refused = send_70(&server).await;
    let took = asked.elapsed();
    assert_eq!(refused.status().as_u16(), 429, "no room within the limit");
    assert!(refused.headers().get("retry-after").is_some());
    assert!(took >= Duration::from_millis(950) && took < Duration::from_secs(5), "refused at the limit: {took:?}");
    let metrics =
        client().get(format!("{}/metrics", server.url)).send().await.expect("sends").text().await.expect("text");
    assert!(
        metrics.contains("baton_queue_length{role=\"conductor\",state=\"admission\",worker=\"conductor\"} 0"),
        "{metrics}"
    );
    finish(holder).await;
    server.assert_no_kv_held().await;
}

/// A request that waits for decode room is served when room comes within the limit: the one
/// holding it ends after ~0.6 s (6 decode steps), well inside `--max-queue-wait 1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_room_that_comes_within_the_limit() {
    let server = one_at_a_time().await;
    let body = json!({"prompt": ids(70), "max_tokens": 6, "ignore_eos": true, "stream": true});
    let holder = client().post(format!("{}/v1/completions", server.url)).json(&body).send().await.expect("sends");
    assert_eq!(holder.status().as_u16(), 200);
    let waiter = tokio::spawn({
        let url = server.url.clone();
        let body = body.clone();
        async move { client().post(format!("{url}/v1/completions")).json(&body).send().await.expect("sends") }
    });
    assert!(finish(holder).await > 0);
    assert!(finish(waiter.await.expect("joins")).await > 0, "the waiting request is served");
    server.assert_no_kv_held().await;
}

/// A prompt whose KV fits no decode worker, even empty, is refused at once, before its stream:
/// waiting cannot help it, and no worker could run it (a 400 naming `max_tokens`, as each
/// engine would answer it). 8 blocks of 16 tokens hold 128 tokens; the prompt has 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_fits_no_decode_worker_is_refused_at_once() {
    let server = one_at_a_time().await;
    let body = json!({"prompt": ids(200), "max_tokens": 1, "stream": true});
    let asked = std::time::Instant::now();
    let r = client().post(format!("{}/v1/completions", server.url)).json(&body).send().await.expect("sends");
    assert_eq!(r.status().as_u16(), 400);
    assert!(asked.elapsed() < Duration::from_millis(900), "refused at once, not at the limit");
    let error: Value = r.json().await.expect("an OpenAI-style error body");
    assert!(error["error"]["message"].as_str().is_some_and(|m| m.contains("needs more KV blocks")), "{error}");
    server.assert_no_kv_held().await;
}

/// A request whose prompt and answer together need more KV than a worker has is refused with a
/// 400 naming `max_tokens`, before its stream (#63: the decode worker refused it after the
/// prefill's first token had been streamed). 8 blocks of 16 tokens: 100 + 60 tokens do not fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_answer_cannot_fit_is_a_400_before_its_stream() {
    let server = one_at_a_time().await;
    let body = json!({"prompt": ids(100), "max_tokens": 60, "stream": true});
    let r = client().post(format!("{}/v1/completions", server.url)).json(&body).send().await.expect("sends");
    assert_eq!(r.status().as_u16(), 400);
    let error: Value = r.json().await.expect("an OpenAI-style error body");
    assert_eq!(error["error"]["param"], "max_tokens", "{error}");
    // The same prompt with an answer that fits is served.
    let body = json!({"prompt": ids(100), "max_tokens": 8, "ignore_eos": true, "stream": true});
    let r = client().post(format!("{}/v1/completions", server.url)).json(&body).send().await.expect("sends");
    assert!(finish(r).await > 0);
    server.assert_no_kv_held().await;
}
