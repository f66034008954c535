//! Chat templates, rendered with minijinja the way transformers renders them with jinja2.

use minijinja::{Environment, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with a role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. transformers renders with `trim_blocks` and `lstrip_blocks`, Python
    /// string methods, `raise_exception` and `strftime_now`; so does this.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> String {
            // Templates use it for "today's date" lines; a fixed, valid date keeps rendering pure.
            "01 Jan 2026".to_owned()
        });
        env.add_template_owned("chat", source.to_owned()).map_err(|e| ModelError::Template(e.to_string()))?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_owned(),
            eos_token: eos_token.unwrap_or_default().to_owned(),
        })
    }

    /// Renders a conversation; `add_generation_prompt` appends the assistant's turn header.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| ModelError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| ModelError::Template(e.to_string()))
    }

    /// Whether rendered text already starts with BOS, so encoding must not add another.
    pub fn starts_with_bos(&self, rendered: &str) -> bool {
        !self.bos_token.is_empty() && rendered.starts_with(&self.bos_token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_with_python_methods_and_trimmed_blocks() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}\n  {{ m.role | upper }}:{{ m['content'].strip() }}\n{% endfor %}",
            Some("<s>"),
            None,
        )
        .expect("compiles");
        let out = t.render(&[ChatMessage::new("user", "  hi  ")], false).expect("renders");
        assert_eq!(out, "<s>  USER:hi\n");
        assert!(t.starts_with_bos(&out));
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).expect("compiles");
        let e = t.render(&[], false).expect_err("raises").to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
