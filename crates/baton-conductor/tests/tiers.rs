//! KV tiers below the device arena, through `baton serve`'s builder: a prompt's prefix evicted
//! from a worker's device arena to host memory, or on to disk, is found there by the next
//! request with the same prefix, copied back and reused, with the same output as computing it;
//! a full disk tier evicts, and every request still completes.

#![allow(clippy::unwrap_used)]

mod common;

use baton_conductor::ServeConfig;
use baton_engine::EngineConfig;
use common::{Server, fixture, start_with};
use serde_json::{Value, json};

/// One colocated worker whose device arena (24 blocks of 4 tokens) holds three prompts.
async fn start(host_blocks: usize, disk: Option<(&std::path::Path, usize)>) -> Server {
    let engine = EngineConfig {
        block_size: 4,
        num_blocks: 24,
        max_batch_tokens: 64,
        prefill_chunk: 32,
        host_blocks,
        disk_blocks: disk.map_or(0, |d| d.1),
        disk_dir: disk.map(|d| d.0.to_owned()),
        ..EngineConfig::default()
    };
    start_with(&ServeConfig { prefill: 0, decode: 0, colocated: 1, engine, ..ServeConfig::new(fixture("tiny-llama")) })
        .await
}

async fn complete(server: &Server, prompt: &str) -> (String, u64) {
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
    let r = reqwest::Client::new().post(format!("{}/v1/completions", server.url)).json(&body).send().await.unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    (text, v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap())
}

/// Distinct prompts of about 30 tokens: with their answers, a third of the device arena each.
/// They differ from their first word on, so no block is shared.
fn prompt(i: usize) -> String {
    const WORDS: [&str; 10] = ["Red", "Blue", "Green", "Yellow", "Purple", "Orange", "Black", "White", "Grey", "Pink"];
    format!("{} story: the quick brown fox jumps over the lazy dog and runs away.", WORDS[i])
}

/// Runs prompt 0, then `pushes` other prompts (each evicting the one before it from the device
/// arena), then prompt 0 again; returns the first and last answers and the last's cached tokens.
async fn evict_and_return(server: &Server, pushes: usize) -> (String, String, u64) {
    let (first, cached) = complete(server, &prompt(0)).await;
    assert_eq!(cached, 0);
    for i in 1..=pushes {
        complete(server, &prompt(i)).await;
    }
    let (again, cached) = complete(server, &prompt(0)).await;
    (first, again, cached)
}

#[tokio::test]
async fn a_prefix_evicted_to_host_is_reused_with_the_same_output() {
    // Without a host tier the evicted prefix is gone: the baseline that makes this test bite.
    let bare = start(0, None).await;
    let (first, again, cached) = evict_and_return(&bare, 4).await;
    assert_eq!(first, again);
    assert_eq!(cached, 0, "the device arena alone cannot have kept prompt 0");

    let tiered = start(64, None).await;
    let (first, again, cached) = evict_and_return(&tiered, 4).await;
    assert_eq!(first, again, "output from the host tier's KV differs");
    assert!(cached >= 24, "prompt 0's prefix should come back from host memory, got {cached} tokens");
    tiered.assert_no_kv_held().await;
}

#[tokio::test]
async fn a_prefix_evicted_to_disk_is_reused_and_no_block_file_is_left_behind() {
    let dir = std::env::temp_dir().join(format!("baton-tiers-{}", std::process::id()));
    let server = start(16, Some((&dir, 64))).await;
    // Eight other prompts push prompt 0 past the device arena and the 16 host blocks, to disk.
    let (first, again, cached) = evict_and_return(&server, 8).await;
    assert_eq!(first, again, "output from the disk tier's KV differs");
    assert!(cached >= 24, "prompt 0's prefix should come back from disk, got {cached} tokens");
    // The block file lost its name when it was made (its space goes with the worker, however
    // the worker ends): the directory never shows it.
    assert!(dir.is_dir(), "the disk tier's directory is made");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no block file by name");
    server.assert_no_kv_held().await;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The conductor's index of `worker`'s blocks in `tier` (from its KV events).
async fn indexed(server: &Server, worker: &str, tier: &str) -> u64 {
    let text = reqwest::get(format!("{}/metrics", server.url)).await.unwrap().text().await.unwrap();
    let series = format!("baton_kv_index_blocks{{tier=\"{tier}\",worker=\"{worker}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&series)).map_or(0, |v| v.trim().parse().unwrap())
}

/// A full disk tier evicts: ten prompts of about ten blocks each go through a worker whose
/// tiers hold 24 + 8 + 8 blocks. Every answer equals the tierless worker's, the disk tier fills
/// (the conductor's index shows it full) and never holds more than its blocks, the first prompt
/// has left every tier by the end (its prefix is computed again), and no KV is held after.
#[tokio::test]
async fn a_full_disk_tier_evicts_and_every_request_still_completes() {
    let bare = start(0, None).await;
    let mut want = Vec::new();
    for i in 0..10 {
        want.push(complete(&bare, &prompt(i)).await.0);
    }
    let dir = std::env::temp_dir().join(format!("baton-full-disk-{}", std::process::id()));
    let server = start(8, Some((&dir, 8))).await;
    let mut most_on_disk = 0;
    for (i, want) in want.iter().enumerate() {
        assert_eq!(&complete(&server, &prompt(i)).await.0, want, "prompt {i}");
        // The index follows the worker's events; give them a moment.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let on_disk = indexed(&server, "colocated-0", "disk").await;
        assert!(on_disk <= 8, "{on_disk} blocks indexed on a disk tier of 8");
        most_on_disk = most_on_disk.max(on_disk);
    }
    assert_eq!(most_on_disk, 8, "the disk tier never filled");
    let (again, cached) = complete(&server, &prompt(0)).await;
    assert_eq!(again, want[0]);
    assert_eq!(cached, 0, "prompt 0 should have been evicted from every tier");
    server.assert_no_kv_held().await;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
