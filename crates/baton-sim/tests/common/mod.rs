//! Helpers shared by the integration tests.

use std::path::PathBuf;

/// The published Mooncake trace in the shared fixtures: `$BATON_SHARED/fixtures/traces/` when
/// that variable is set (a git worktree away from the main checkout), else `../shared/` beside
/// the repository root. Panics when it is missing: CI always has the shared fixtures.
pub(crate) fn published_trace() -> PathBuf {
    let shared = std::env::var_os("BATON_SHARED")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"), PathBuf::from);
    let path = shared.join("fixtures/traces/synthetic_trace.jsonl");
    assert!(
        path.exists(),
        "the Mooncake trace is missing at {} (it lives in the shared fixtures, ../shared/fixtures/traces/ from the repo \
         root; set BATON_SHARED to the shared directory when the checkout is elsewhere)",
        path.display()
    );
    path
}
