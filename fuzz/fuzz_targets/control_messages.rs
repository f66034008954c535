//! What travels on the control plane: a worker's work requests and event lines, its state
//! stream, the cluster proof header and `--registry` values. Parsing must never panic.
#![no_main]

use baton_cluster::{ClusterSecret, RegistryConfig};
use baton_protocol::wire::{RequestEvent, StateUpdate, WorkRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<WorkRequest>(data);
    let _ = serde_json::from_slice::<RequestEvent>(data);
    let _ = serde_json::from_slice::<StateUpdate>(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let secret = ClusterSecret::new("fuzz").expect("a non-empty secret");
        let _ = secret.verify_request(Some(text), "POST", "/worker/v1/generate", 1_000_000, data);
        let _ = text.parse::<RegistryConfig>();
    }
});
