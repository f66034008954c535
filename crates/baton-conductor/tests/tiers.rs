//! KV tiers below the device arena, through `baton serve`'s builder: a prompt's prefix evicted
//! from a worker's device arena to host memory, or on to disk, is found there by the next
//! request with the same prefix, copied back and reused, with the same output as computing it;
//! a full disk tier evicts, and every request still completes.

#![allow(clippy::unwrap_used)]

mod common;

use baton_conductor::ServeConfig;
use baton_engine::EngineConfig;
use baton_model::{ComputeDevice, DeviceOptions};
use common::{Server, fixture, start_with};
use serde_json::{Value, json};

/// One colocated worker whose device arena (24 blocks of 4 tokens) holds three prompts.
async fn start(host_blocks: usize, disk: Option<(&std::path::Path, usize)>) -> Server {
    start_on(ComputeDevice::Cpu, host_blocks, disk).await
}

/// [`start`] on `device`.
async fn start_on(device: ComputeDevice, host_blocks: usize, disk: Option<(&std::path::Path, usize)>) -> Server {
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
    start_with(&ServeConfig {
        prefill: 0,
        decode: 0,
        colocated: 1,
        engine,
        device: DeviceOptions { device, ..DeviceOptions::default() },
        ..ServeConfig::new(fixture("tiny-llama"))
    })
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

/// Overwrites 64 bytes of every `block_bytes` slot of `file` (from byte 256 of each) with
/// 0x7F: floats of 3.4e38, what a failing disk or a stray writer might leave.
fn damage_every_block(file: &std::path::Path, block_bytes: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    let len = f.metadata().unwrap().len();
    for at in (0..len).step_by(block_bytes as usize) {
        f.write_all_at(&[0x7F; 64], at + 256).unwrap();
    }
}

/// The files this process holds open whose names contain `what`, one descriptor each (a
/// copier's duplicate descriptors name the same file), with their sizes.
fn open_files(what: &str) -> Vec<(std::path::PathBuf, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| std::fs::read_link(p).is_ok_and(|t| t.to_string_lossy().contains(what)))
        .filter_map(|p| std::fs::metadata(&p).ok().map(|m| (p, m)))
        .filter(|(_, m)| seen.insert((m.dev(), m.ino())))
        .map(|(p, m)| (p, m.len()))
        .collect()
}

/// KV that comes back from a slower tier is checked (#63, item 3: a disk tier damaged under a
/// worker made 8 of 10 prompts whose prefix came back from disk answer 200 with empty text).
/// Ten prompts go through a worker whose tiers hold 24 + 13 + 128 blocks, room for all of them,
/// so their prefixes end up on the host and disk tiers (the first comes back from disk, the
/// control); then every block slot of the host arena and of the disk tier's (unlinked) file is
/// damaged through `/proc/self/fd`, and the prompts run again: every answer equals the
/// tierless worker's, and the worker counts the damaged blocks it found
/// (`baton_kv_corrupt_blocks_total`). Without the checks the damaged KV is used.
#[tokio::test]
async fn kv_damaged_on_the_host_and_disk_tiers_is_recomputed_and_counted() {
    let bare = start(0, None).await;
    let mut want = Vec::new();
    for i in 0..10 {
        want.push(complete(&bare, &prompt(i)).await.0);
    }
    let dir = std::env::temp_dir().join(format!("baton-damaged-tiers-{}", std::process::id()));
    // 13 host blocks: an arena no other test here has the size of.
    let server = start(13, Some((&dir, 128))).await;
    for (i, want) in want.iter().enumerate() {
        assert_eq!(&complete(&server, &prompt(i)).await.0, want, "prompt {i}, undamaged");
    }
    let (again, cached) = complete(&server, &prompt(0)).await;
    assert_eq!((&again, cached >= 24), (&want[0], true), "prompt 0 should come back from disk ({cached} tokens)");
    let disk = open_files(&dir.to_string_lossy());
    assert_eq!(disk.len(), 1, "the disk tier's file: {disk:?}");
    let block_bytes = disk[0].1 / 128;
    let host: Vec<_> = open_files("baton-host-tier").into_iter().filter(|(_, len)| *len == 13 * block_bytes).collect();
    assert_eq!(host.len(), 1, "the host arena: {host:?}");
    damage_every_block(&disk[0].0, block_bytes);
    damage_every_block(&host[0].0, block_bytes);

    let mut reused = 0;
    for (i, want) in want.iter().enumerate().skip(1) {
        let (text, cached) = complete(&server, &prompt(i)).await;
        assert_eq!(&text, want, "prompt {i}, after the damage");
        reused += cached;
    }
    let text = reqwest::get(format!("{}/metrics", server.url)).await.unwrap().text().await.unwrap();
    let series = "baton_kv_corrupt_blocks_total{worker=\"colocated-0\"} ";
    let corrupt: u64 = text.lines().find_map(|l| l.strip_prefix(series)).map_or(0, |v| v.trim().parse().unwrap());
    println!("{corrupt} damaged blocks found and recomputed; {reused} prompt tokens still reused");
    assert!(corrupt >= 2, "the damaged blocks were not counted ({corrupt}):\n{text}");
    server.assert_no_kv_held().await;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The host and disk tiers below the stand-in device's arena (issue #58: host memory is a tier
/// of its own): a prefix evicted to host memory, and one evicted on to disk, comes back with the
/// CPU's output, and the worker's copy meter counts the blocks that left the device arena and
/// those that came back.
#[tokio::test]
async fn the_stand_in_devices_tiers_give_the_cpus_output_and_count_their_copies() {
    let dir = std::env::temp_dir().join(format!("baton-tiers-stand-in-{}", std::process::id()));
    for (host, disk) in [(64, None), (16, Some((dir.as_path(), 64)))] {
        let pushes = if disk.is_some() { 8 } else { 4 };
        let cpu = start_on(ComputeDevice::Cpu, host, disk).await;
        let want = evict_and_return(&cpu, pushes).await;
        drop(cpu);
        let server = start_on(ComputeDevice::StandIn, host, disk).await;
        let (first, again, cached) = evict_and_return(&server, pushes).await;
        assert_eq!((&first, &again), (&want.0, &want.1), "the stand-in's output vs the CPU's");
        assert!(cached >= 24, "prompt 0's prefix came back from a slower tier: {cached} tokens");
        assert!(
            common::copy_bytes(&server.url, "device_to_host").await > 0.0,
            "demotions left the device arena uncounted"
        );
        assert!(common::copy_bytes(&server.url, "host_to_device").await > 0.0, "the swap-in came back uncounted");
        server.assert_no_kv_held().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}
