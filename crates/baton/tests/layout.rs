//! The workspace's layout stays as ARCHITECTURE.md draws it: no module of any crate imports
//! another that imports it back (`scripts/import-cycles.py`, which lists each cycle it finds),
//! and no source file grows past 850 lines of non-test code (`scripts/code-lines.py`: blank
//! lines, comments and `#[cfg(test)]` modules left out), where a file stops being about one
//! thing.

use std::path::Path;
use std::process::Command;

/// Runs a script of `scripts/` with `python3` from the workspace root: its exit status and output.
fn script(name: &str) -> (bool, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("python3")
        .arg(root.join("scripts").join(name))
        .current_dir(&root)
        .output()
        .unwrap_or_else(|e| panic!("python3 runs scripts/{name}: {e}"));
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), report)
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let (ok, report) = script("import-cycles.py");
    assert!(ok, "import cycles:\n{report}");
    assert!(report.contains("0 import cycle(s)"), "{report}");
}

#[test]
fn no_source_file_has_more_than_850_lines_of_code() {
    let (ok, report) = script("code-lines.py");
    assert!(ok, "files too long:\n{report}");
    assert!(report.contains("0 file(s) over 850 code lines"), "{report}");
}

/// The GPU enters through one interface (issue #58): the `cuda` feature is named only where
/// the CUDA backend lives (`baton-model/src/cuda/`) and where a build picks it or its stub
/// (`baton-model/src/lib.rs`); every other file talks to the backend interface.
#[test]
fn the_cuda_feature_is_named_only_where_the_backend_is_chosen() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../crates");
    let mut files = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a readable directory").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let allowed = |rel: &str| {
        rel.starts_with("baton-model/src/cuda/")
            || rel == "baton-model/src/lib.rs"
            // The CUDA kernels' own test (compiled with NVRTC where the feature is on).
            || rel == "baton-model/tests/cuda_kernels.rs"
    };
    let offenders: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let rel = f.strip_prefix(&root).ok()?.to_string_lossy().into_owned();
            let text = std::fs::read_to_string(f).ok()?;
            (text.contains("feature = \"cuda\"") && !allowed(&rel)).then_some(rel)
        })
        .collect();
    assert!(files.len() > 100, "found the sources ({} files)", files.len());
    assert!(offenders.is_empty(), "the `cuda` feature named outside the backend's choice: {offenders:?}");
}
