//! Helpers shared by the integration tests.

use std::path::PathBuf;

/// The published Mooncake trace, shipped in the repository (`fixtures/traces/`, Apache-2.0).
pub(crate) fn published_trace() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/traces/synthetic_trace.jsonl");
    assert!(path.exists(), "the Mooncake trace is missing at {}: it is part of the repository", path.display());
    path
}
