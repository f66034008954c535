//! The GGUF files Baton knows by a short name: what `scripts/fetch-model.sh NAME` fetches (pinned
//! and sha256-checked there) and `--model NAME` resolves, and the directory they are kept in.
//! Tests of every crate that need a real model find it here.

use std::path::{Path, PathBuf};

/// A model `scripts/fetch-model.sh NAME` fetches (pinned and sha256-checked there) into the
/// models directory, and `--model NAME` on the baton commands finds there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownModel {
    /// The short name (`scripts/fetch-model.sh NAME`, `--model NAME`).
    pub name: &'static str,
    /// The file name in the models directory.
    pub file: &'static str,
    /// One line for error messages and `--help`.
    pub about: &'static str,
}

/// The models the fetch script knows, the default first. Keep in step with
/// `scripts/fetch-model.sh`.
pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m-instruct",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        about: "SmolLM2 135M Instruct, GGUF Q4_1, with a chat template (the default)",
    },
    KnownModel {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        about: "Gemma 3 270M base, GGUF Q4_K_M, no chat template",
    },
];

/// Short name of Baton's default model (SmolLM2 135M Instruct, Q4_1).
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// File name of Baton's default model, as `scripts/fetch-model.sh` stores it.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The known model of this short name.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// The known models' names, comma-separated (for error messages).
pub fn known_model_names() -> String {
    KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

/// Where fetched models live: `$BATON_MODELS_DIR` when that is set, else `<repo_root>/.models`.
pub fn models_dir(repo_root: &Path) -> PathBuf {
    std::env::var_os("BATON_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root.join(".models"))
}

/// Where the known model `name` is (see [`models_dir`]); `None` for an unknown name. The file
/// may be missing; `scripts/fetch-model.sh NAME` fetches it.
pub fn known_model_path(repo_root: &Path, name: &str) -> Option<PathBuf> {
    known_model(name).map(|m| models_dir(repo_root).join(m.file))
}

/// Where Baton's default model is (see [`models_dir`]). The file may be missing;
/// `scripts/fetch-model.sh` fetches it.
pub fn default_model_path(repo_root: &Path) -> PathBuf {
    models_dir(repo_root).join(DEFAULT_MODEL_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_first_known_model_and_names_are_unique() {
        assert_eq!(KNOWN_MODELS[0].name, DEFAULT_MODEL);
        assert_eq!(KNOWN_MODELS[0].file, DEFAULT_MODEL_FILE);
        for (i, m) in KNOWN_MODELS.iter().enumerate() {
            assert!(KNOWN_MODELS[i + 1..].iter().all(|o| o.name != m.name && o.file != m.file), "{m:?}");
        }
        assert_eq!(known_model("gemma3-270m").map(|m| m.file), Some("gemma-3-270m-q4_k_m.gguf"));
        assert_eq!(known_model("gpt-9"), None);
    }

    #[test]
    fn the_fetch_script_knows_every_model_by_name_and_file() {
        let script = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/fetch-model.sh"))
            .expect("scripts/fetch-model.sh");
        for m in KNOWN_MODELS {
            assert!(script.contains(m.name) && script.contains(m.file), "fetch-model.sh lacks {m:?}");
        }
    }
}
