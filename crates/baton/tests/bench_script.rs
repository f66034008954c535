//! `scripts/bench-vs-llamacpp.sh` when llama.cpp crashes (#61): on a VM that advertises AMX,
//! llama.cpp's native build dies with a general-protection fault on its first prefill, and the
//! script used to exit printing nothing. Here a stand-in llama.cpp dies of SIGSEGV in a copy of
//! the script's tree; the script must say so, say why it may have, and offer a build without AMX.

#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]
use std::path::Path;
use std::process::Command;

fn run_with_crashing_llama_cpp(cpu_flags: &str) -> (i32, String) {
    let root = std::env::temp_dir().join(format!("baton-bench-script-{}-{}", std::process::id(), cpu_flags.len()));
    let bin = root.join(".bench/venv/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(root.join("scripts")).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench-vs-llamacpp.sh");
    std::fs::copy(script, root.join("scripts/bench-vs-llamacpp.sh")).unwrap();
    // `import llama_cpp` succeeds (no build is attempted); the benchmark itself dies as llama.cpp did.
    std::fs::write(bin.join("python"), "#!/bin/sh\n[ \"$1\" = \"-c\" ] && exit 0\nkill -SEGV $$\n").unwrap();
    let python = bin.join("python");
    let mut perms = std::fs::metadata(&python).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&python, perms).unwrap();
    std::fs::write(root.join("model.gguf"), b"").unwrap();
    std::fs::write(root.join("cpuinfo"), format!("flags\t\t: fpu sse2 avx2 {cpu_flags}\n")).unwrap();
    let out = Command::new("bash")
        .arg(root.join("scripts/bench-vs-llamacpp.sh"))
        .arg(root.join("model.gguf"))
        .env("CPUINFO", root.join("cpuinfo"))
        .env("BATON_BIN", "/nonexistent/baton") // never reached: no build either
        .env_remove("LLAMA_CPP_CPU")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&root);
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_llama_cpp_crash_is_reported_with_its_likely_cause_and_a_build_without_amx() {
    let (status, stderr) = run_with_crashing_llama_cpp("avx512f amx_bf16 amx_tile amx_int8");
    assert_eq!(status, 1, "{stderr}");
    assert!(stderr.contains("llama.cpp was killed by SIGSEGV"), "says that llama.cpp crashed:\n{stderr}");
    assert!(stderr.contains("advertises AMX"), "names the likely cause on an AMX machine:\n{stderr}");
    assert!(stderr.contains("LLAMA_CPP_CPU=noamx"), "offers a build without AMX:\n{stderr}");

    let (status, stderr) = run_with_crashing_llama_cpp("avx512f");
    assert_eq!(status, 1, "{stderr}");
    assert!(stderr.contains("llama.cpp was killed by SIGSEGV"), "{stderr}");
    assert!(!stderr.contains("advertises AMX"), "no AMX blamed where the CPU has none:\n{stderr}");
    assert!(stderr.contains("LLAMA_CPP_CPU=avx2"), "offers the portable build:\n{stderr}");
}
