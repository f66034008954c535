//! The metadata table: ordered key/value pairs with typed getters whose errors name the key.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::GgufError;
use crate::value::{FromGgufValue, GgufValue};

/// A GGUF file's metadata, in file order.
#[derive(Debug, Clone, Default)]
pub struct GgufMetadata {
    path: PathBuf,
    entries: Vec<(String, GgufValue)>,
    index: HashMap<String, usize>,
}

impl GgufMetadata {
    /// An empty table; `path` is what errors name.
    pub fn new(path: &Path) -> Self {
        Self { path: path.to_owned(), entries: Vec::new(), index: HashMap::new() }
    }

    /// Adds or replaces a key (a later duplicate wins, as in llama.cpp's reader).
    pub fn insert(&mut self, key: String, value: GgufValue) {
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    /// The file the metadata came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The raw value of a key.
    pub fn value(&self, key: &str) -> Option<&GgufValue> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether the key is present.
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Keys and values in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A required key converted to `T`; errors name the file and the key.
    ///
    /// ```no_run
    /// # fn f(m: &baton_gguf::GgufMetadata) -> Result<(), baton_gguf::GgufError> {
    /// let layers: usize = m.get("gemma3.block_count")?;
    /// let tokens: &[String] = m.get("tokenizer.ggml.tokens")?;
    /// # Ok(()) }
    /// ```
    pub fn get<'a, T: FromGgufValue<'a>>(&'a self, key: &str) -> Result<T, GgufError> {
        self.get_opt(key)?.ok_or_else(|| GgufError::MissingKey { path: self.path.clone(), key: key.to_owned() })
    }

    /// An optional key converted to `T`: `Ok(None)` when absent, an error when present with
    /// another type.
    pub fn get_opt<'a, T: FromGgufValue<'a>>(&'a self, key: &str) -> Result<Option<T>, GgufError> {
        let Some(value) = self.value(key) else { return Ok(None) };
        T::from_value(value).map(Some).ok_or_else(|| GgufError::KeyType {
            path: self.path.clone(),
            key: key.to_owned(),
            expected: T::EXPECTED,
            actual: describe_with_value(value),
        })
    }

    /// An error about `key`'s value, for checks the caller makes after reading it.
    pub fn invalid(&self, key: &str, reason: impl Into<String>) -> GgufError {
        GgufError::InvalidValue { path: self.path.clone(), key: key.to_owned(), reason: reason.into() }
    }
}

fn describe_with_value(value: &GgufValue) -> String {
    match value {
        GgufValue::Array(_) => value.describe(),
        GgufValue::String(s) if s.len() > 40 => format!("a string ({} bytes)", s.len()),
        v => format!("{} {v:?}", v.value_type()),
    }
}
