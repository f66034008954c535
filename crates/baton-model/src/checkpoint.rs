//! A Hugging Face checkpoint directory: config, weights, tokenizer and chat template together.

use std::path::{Path, PathBuf};

use crate::chat::ChatTemplate;
use crate::config::{ModelConfig, read_json};
use crate::error::{ModelError, Result};
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::weights::SafetensorsWeights;

/// Everything loaded from a checkpoint directory.
pub struct Checkpoint {
    /// Where it was loaded from.
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
    /// Loads `config.json`, `generation_config.json`, the safetensors weights, `tokenizer.json`,
    /// `tokenizer_config.json` and the chat template (`chat_template.jinja`, else the
    /// `chat_template` field of `tokenizer_config.json`).
    pub fn open(dir: &Path) -> Result<Self> {
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
