//! A checkpoint: config, weights, tokenizer and chat template together, from a Hugging Face
//! directory or from one GGUF file.

use std::path::{Path, PathBuf};

use crate::chat::ChatTemplate;
use crate::config::{ModelConfig, read_json};
use crate::error::{ModelError, Result};
use crate::gguf::{GgufFile, GgufHyperparams, GgufWeights, chat_template_from_gguf, tokenizer_from_gguf};
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::weights::SafetensorsWeights;

/// Everything loaded from a checkpoint directory.
pub struct Checkpoint {
    /// Where it was loaded from: the directory, or the `.gguf` file.
    pub dir: PathBuf,
    /// The model, weights in memory.
    pub model: Model,
    /// The tokenizer, with BOS/EOS texts.
    pub tokenizer: Tokenizer,
    /// The chat template, when the checkpoint has one.
    pub chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("dir", &self.dir).field("model", &self.model).finish_non_exhaustive()
    }
}

impl Checkpoint {
    /// Opens a Hugging Face directory ([`Checkpoint::open_dir`]) or a GGUF file
    /// ([`Checkpoint::open_gguf`]).
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_file() { Self::open_gguf(path) } else { Self::open_dir(path) }
    }

    /// Loads a GGUF file: hyperparameters, weights (quantized matrices stay quantized), the
    /// tokenizer and the chat template stored in it.
    pub fn open_gguf(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let hp = GgufHyperparams::from_gguf(&file)?;
        let config = ModelConfig::from_gguf(&hp, path)?;
        let model = Model::load(&config, &GgufWeights::new(&file, &hp))?;
        let tokenizer = tokenizer_from_gguf(file.metadata())?;
        let chat_template = chat_template_from_gguf(file.metadata(), &tokenizer)?;
        Ok(Self { dir: path.to_owned(), model, tokenizer, chat_template })
    }

    /// Loads `config.json`, `generation_config.json`, the safetensors weights, `tokenizer.json`,
    /// `tokenizer_config.json` and the chat template (`chat_template.jinja`, else the
    /// `chat_template` field of `tokenizer_config.json`) from a directory.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::Io {
                path: dir.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a checkpoint directory"),
            });
        }
        let config = ModelConfig::from_dir(dir)?;
        let weights = SafetensorsWeights::from_dir(dir)?;
        let model = Model::load(&config, &weights)?;
        let mut tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;

        let tc_path = dir.join("tokenizer_config.json");
        let tc = if tc_path.exists() { Some(read_json(&tc_path)?) } else { None };
        let special = |key: &str| -> Option<String> {
            let v = tc.as_ref()?.get(key)?;
            // Either a plain string or an AddedToken object with `content`.
            v.as_str().or_else(|| v.get("content").and_then(|c| c.as_str())).map(str::to_owned)
        };
        let id_text = |id: Option<u32>| id.and_then(|i| tokenizer.decode(&[i], false).ok());
        let bos_token = special("bos_token").or_else(|| id_text(config.bos_token_id));
        let eos_token = special("eos_token").or_else(|| id_text(config.eos_token_ids.first().copied()));
        tokenizer.bos_token = bos_token;
        tokenizer.eos_token = eos_token;

        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            Some(std::fs::read_to_string(&jinja).map_err(|source| ModelError::Io { path: jinja.clone(), source })?)
        } else {
            match tc.as_ref().and_then(|t| t.get("chat_template")) {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_owned),
                Some(_) => {
                    return Err(ModelError::InvalidField {
                        path: tc_path,
                        field: "chat_template".into(),
                        reason: "must be a string or a list of named templates".into(),
                    });
                }
            }
        };
        let chat_template = source
            .map(|s| ChatTemplate::new(&s, tokenizer.bos_token.as_deref(), tokenizer.eos_token.as_deref()))
            .transpose()?;
        Ok(Self { dir: dir.to_owned(), model, tokenizer, chat_template })
    }

    /// Renders a chat with the template and encodes it, adding BOS only when the rendered text
    /// does not already start with it.
    pub fn encode_chat(&self, messages: &[crate::ChatMessage]) -> Result<(String, Vec<u32>)> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| ModelError::Template(format!("{} has no chat template", self.dir.display())))?;
        let text = template.render(messages, true)?;
        let ids = self.tokenizer.encode(&text, !template.starts_with_bos(&text))?;
        Ok((text, ids))
    }
}

/// File name of Baton's default model (Gemma 3 270M, Q4_K_M), as `scripts/fetch-model.sh`
/// stores it.
pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// Where Baton's default model is: in `$BATON_MODELS_DIR` when that is set, else in
/// `<repo_root>/.models`. The file may be missing; `scripts/fetch-model.sh` fetches it.
pub fn default_model_path(repo_root: &Path) -> PathBuf {
    let dir = std::env::var_os("BATON_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root.join(".models"));
    dir.join(DEFAULT_MODEL_FILE)
}
