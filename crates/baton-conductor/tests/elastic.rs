//! Elastic prefill/decode (issue #18), live: the conductor switches a worker's role when the
//! prefill pool is overloaded while the decode pool idles (FlowKV §3.3), mid-traffic. Every
//! request keeps the greedy text of the engine alone, the switched worker takes the new kind of
//! work, no worker holds KV afterwards, and within the hysteresis nothing switches.

use std::time::Duration;

use baton_conductor::ServeConfig;
use baton_conductor::elastic::ElasticConfig;
use baton_engine::EngineConfig;
use baton_protocol::Role;
use baton_sched::CostProfile;
use serde_json::{Value, json};

mod common;
use common::{Server, engine_alone, fixture, start_with};

fn engine_config() -> EngineConfig {
    EngineConfig { block_size: 4, num_blocks: 256, max_batch_tokens: 64, prefill_chunk: 32, ..EngineConfig::default() }
}

/// A prefill load the 70B cost profile predicts far over a 1 ms TTFT target, and a decode load
/// far under a 60 s TBT target: the prefill pool is overloaded whenever a prompt waits.
fn elastic(hold: Duration) -> ElasticConfig {
    let mut config = ElasticConfig::new(CostProfile::llama2_70b_8xa800(), 1_000, 60_000_000, hold);
    config.max_per_minute = 1;
    config
}

const PROMPTS: [&str; 4] = [
    "The quick brown fox jumps over the lazy dog while the cat watches.",
    "Once upon a time, in a land far away, there lived a careful engineer.",
    "Disaggregated serving splits prefill and decode onto separate workers.",
    "A cache that spans the cluster keeps every prefix it has computed.",
];

async fn complete(url: &str, prompt: &str) -> String {
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let r = reqwest::Client::new().post(format!("{url}/v1/completions")).json(&body).send().await.expect("sends");
    let status = r.status().as_u16();
    let v: Value = r.json().await.expect("JSON");
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().expect("text").to_owned()
}

async fn metric(server: &Server, series: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", server.url)).await.expect("scrapes").text().await.expect("text");
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.trim().parse().ok())).unwrap_or(0.0)
}

/// Twelve requests, four at a time, each checked against the engine alone.
async fn traffic(server: &Server, want: &[String]) {
    for wave in 0..3 {
        let calls: Vec<_> = (0..PROMPTS.len())
            .map(|i| {
                let url = server.url.clone();
                tokio::spawn(async move { complete(&url, PROMPTS[i]).await })
            })
            .collect();
        for (i, call) in calls.into_iter().enumerate() {
            assert_eq!(call.await.expect("request task"), want[i], "wave {wave}, prompt {i}");
        }
    }
}

fn roles(server: &Server) -> Vec<(String, Role)> {
    let mut roles: Vec<_> = server.conductor.workers().iter().map(|w| (w.name().to_owned(), w.role())).collect();
    roles.sort_by(|a, b| a.0.cmp(&b.0));
    roles
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_becomes_a_prefill_worker_under_prefill_load() {
    for model in ["tiny-llama", "tiny-qwen2"] {
        let want: Vec<String> = PROMPTS.iter().map(|p| engine_alone(model, engine_config(), p, 8).1).collect();
        let config = ServeConfig {
            prefill: 1,
            decode: 2,
            engine: engine_config(),
            elastic: Some(elastic(Duration::ZERO)),
            ..ServeConfig::new(fixture(model))
        };
        let server = start_with(&config).await;
        traffic(&server, &want).await;
        assert_eq!(metric(&server, "baton_role_switches_total{from=\"decode\",to=\"prefill\"}").await, 1.0, "{model}");
        let now = roles(&server);
        let switched: Vec<&str> = now
            .iter()
            .filter(|(n, r)| n.starts_with("decode") && *r == Role::Prefill)
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(switched.len(), 1, "{model}: {now:?}");
        // The cap (one a minute) and the least per role (one decode worker) hold the rest.
        assert_eq!(now.iter().filter(|(_, r)| *r == Role::Decode).count(), 1, "{model}: {now:?}");
        // The switched worker took prefills: its prefix cache was looked up for prompts.
        let series = format!("baton_prefix_cache_queries_tokens_total{{worker=\"{}\"}}", switched[0]);
        assert!(metric(&server, &series).await > 0.0, "{model}: {} computed no prompt", switched[0]);
        server.assert_no_kv_held().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imbalance_shorter_than_the_hold_switches_nothing() {
    let model = "tiny-llama";
    let want: Vec<String> = PROMPTS.iter().map(|p| engine_alone(model, engine_config(), p, 8).1).collect();
    let config = ServeConfig {
        prefill: 1,
        decode: 2,
        engine: engine_config(),
        elastic: Some(elastic(Duration::from_secs(3600))),
        ..ServeConfig::new(fixture(model))
    };
    let server = start_with(&config).await;
    traffic(&server, &want).await;
    assert_eq!(metric(&server, "baton_role_switches_total{").await, 0.0);
    let now = roles(&server);
    assert_eq!(now.iter().filter(|(_, r)| *r == Role::Decode).count(), 2, "{now:?}");
    server.assert_no_kv_held().await;
}
