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
