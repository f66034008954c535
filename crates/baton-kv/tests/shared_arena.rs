//! Another process maps the arena read-only through its handle and sees the bytes written here.
//!
//! The test binary re-runs itself as the child (`child_reads_arena` with an environment
//! variable naming the handle); without that variable the child test does nothing.

use baton_kv::{BlockId, KvArena, KvGeometry, KvLayout, KvPart, MappedArena};

const ENV: &str = "BATON_KV_ARENA_CHILD";

fn value(i: usize) -> f32 {
    (i % 1000) as f32 * 0.5
}

#[test]
fn another_process_maps_the_arena_read_only() {
    let g = KvGeometry::new(2, 2, 8, 4);
    let mut arena = KvArena::new_shared(g, KvLayout::BlockMajor, 16).expect("memfd arena");
    for (i, x) in arena.as_mut_slice().iter_mut().enumerate() {
        *x = value(i);
    }
    let handle = arena.handle().expect("shared arena has a handle");
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args(["--exact", "child_reads_arena", "--nocapture", "--test-threads=1"])
        .env(ENV, format!("{} {}", handle.path().display(), handle.len))
        .output()
        .expect("spawn child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("1 passed"), "child test did not run: {stdout}");
    assert!(stdout.contains("child verified"), "child did not check the bytes: {stdout}");
    // The parent's view is untouched and still writable.
    arena.token_mut(0, KvPart::Key, BlockId(3), 0).fill(-1.0);
    assert_eq!(arena.block(0, KvPart::Key, BlockId(3))[0], -1.0);
}

#[test]
fn child_reads_arena() {
    let Ok(spec) = std::env::var(ENV) else { return };
    let (path, len) = spec.split_once(' ').expect("path and length");
    let len: usize = len.parse().expect("length");
    let mapped = MappedArena::open_path(std::path::Path::new(path), len).expect("map the parent's arena");
    let data = mapped.as_slice();
    assert_eq!(data.len() * 4, len);
    for (i, &x) in data.iter().enumerate() {
        assert_eq!(x, value(i), "element {i}");
    }
    println!("child verified {} elements in pid {}", data.len(), std::process::id());
}
