//! A checkpoint: config, weights, tokenizer and chat template together, from a Hugging Face
//! directory or from one GGUF file.

use std::path::{Path, PathBuf};

use baton_text::{ChatTemplate, Tokenizer};

use crate::config::{ModelConfig, read_json};
use crate::device::DeviceOptions;
use crate::error::{ModelError, Result};
use crate::gguf::{GgufFile, GgufHyperparams, GgufWeights, chat_template_from_gguf, tokenizer_from_gguf};
use crate::model::Model;
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

/// What a router needs of a checkpoint, without its weights: the config, the tokenizer and the
/// chat template (a conductor validates and routes requests; it never runs the model).
pub struct Frontend {
    /// The model's configuration (context length, vocabulary, KV geometry).
    pub config: ModelConfig,
    /// The tokenizer, with BOS/EOS texts.
    pub tokenizer: Tokenizer,
    /// The chat template, when the checkpoint has one.
    pub chat_template: Option<ChatTemplate>,
}

impl Frontend {
    /// Opens a checkpoint's config, tokenizer and chat template, leaving the weights unread.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_file() {
            let file = GgufFile::open(path)?;
            let hp = GgufHyperparams::from_gguf(&file)?;
            let config = ModelConfig::from_gguf(&hp, path)?;
            let tokenizer = tokenizer_from_gguf(file.metadata())?;
            let chat_template = chat_template_from_gguf(file.metadata(), &tokenizer)?;
            Ok(Self { config, tokenizer, chat_template })
        } else {
            let config = ModelConfig::from_dir(path)?;
            let (tokenizer, chat_template) = Checkpoint::dir_tokenizer(path, &config)?;
            Ok(Self { config, tokenizer, chat_template })
        }
    }

    /// The KV geometry of the model with blocks of `block_size` tokens.
    pub fn kv_geometry(&self, block_size: usize) -> baton_kv::KvGeometry {
        baton_kv::KvGeometry::new(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, block_size)
    }
}

impl Checkpoint {
    /// Opens a Hugging Face directory ([`Checkpoint::open_dir`]) or a GGUF file
    /// ([`Checkpoint::open_gguf`]).
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_on(path, DeviceOptions::default())
    }

    /// [`Checkpoint::open`], with the model's weights on `device` (`--device`, `--dtype`).
    pub fn open_on(path: &Path, device: DeviceOptions) -> Result<Self> {
        if path.is_file() { Self::open_gguf_on(path, device) } else { Self::open_dir_on(path, device) }
    }

    /// Loads a GGUF file: hyperparameters, weights (quantized matrices stay quantized), the
    /// tokenizer and the chat template stored in it.
    pub fn open_gguf(path: &Path) -> Result<Self> {
        Self::open_gguf_on(path, DeviceOptions::default())
    }

    fn open_gguf_on(path: &Path, device: DeviceOptions) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let hp = GgufHyperparams::from_gguf(&file)?;
        let config = ModelConfig::from_gguf(&hp, path)?;
        let model = Model::load_on(&config, &GgufWeights::new(&file, &hp), device)?;
        let tokenizer = tokenizer_from_gguf(file.metadata())?;
        let chat_template = chat_template_from_gguf(file.metadata(), &tokenizer)?;
        Ok(Self { dir: path.to_owned(), model, tokenizer, chat_template })
    }

    /// Loads `config.json`, `generation_config.json`, the safetensors weights, `tokenizer.json`,
    /// `tokenizer_config.json` and the chat template (`chat_template.jinja`, else the
    /// `chat_template` field of `tokenizer_config.json`) from a directory.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        Self::open_dir_on(dir, DeviceOptions::default())
    }

    fn open_dir_on(dir: &Path, device: DeviceOptions) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::Io {
                path: dir.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a checkpoint directory"),
            });
        }
        let config = ModelConfig::from_dir(dir)?;
        let weights = SafetensorsWeights::from_dir(dir)?;
        let model = Model::load_on(&config, &weights, device)?;
        let (tokenizer, chat_template) = Self::dir_tokenizer(dir, &config)?;
        Ok(Self { dir: dir.to_owned(), model, tokenizer, chat_template })
    }

    /// A directory's tokenizer (BOS/EOS texts from `tokenizer_config.json` or the config's ids)
    /// and chat template (`chat_template.jinja`, else `tokenizer_config.json`'s field).
    fn dir_tokenizer(dir: &Path, config: &ModelConfig) -> Result<(Tokenizer, Option<ChatTemplate>)> {
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
        Ok((tokenizer, chat_template))
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

#[cfg(test)]
mod frontend_tests {
    use super::*;

    /// A router's view of a checkpoint needs no weights: a directory with the config, tokenizer
    /// and template but no `model.safetensors` opens as a [`Frontend`] (and not as a
    /// [`Checkpoint`]), with the same tokenizer, template and KV geometry as the whole checkpoint.
    #[test]
    fn a_frontend_opens_without_the_weights() {
        let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/models/tiny-llama"));
        let dir = std::env::temp_dir().join(format!("baton-frontend-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        for f in
            ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
        {
            std::fs::copy(src.join(f), dir.join(f)).expect("copy fixture file");
        }
        assert!(Checkpoint::open(&dir).is_err(), "a checkpoint without weights must not load");
        let front = Frontend::open(&dir).expect("frontend without weights");
        let whole = Checkpoint::open(src).expect("the fixture");
        assert_eq!(front.config.num_layers, whole.model.config().num_layers);
        assert_eq!(front.kv_geometry(16), whole.model.kv_geometry(16));
        let text = "The capital of France is";
        assert_eq!(front.tokenizer.encode(text, true).ok(), whole.tokenizer.encode(text, true).ok());
        assert_eq!(front.chat_template.is_some(), whole.chat_template.is_some());
        std::fs::remove_dir_all(&dir).ok();
    }
}
