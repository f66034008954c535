//! The workspace's layout stays as ARCHITECTURE.md draws it: no module of any crate imports
//! another that imports it back (`scripts/import-cycles.py`, which lists each cycle it finds).

use std::path::Path;
use std::process::Command;

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("python3")
        .arg(root.join("scripts/import-cycles.py"))
        .current_dir(&root)
        .output()
        .expect("python3 runs scripts/import-cycles.py");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "import cycles:\n{report}{}", String::from_utf8_lossy(&out.stderr));
    assert!(report.contains("0 import cycle(s)"), "{report}");
}
