//! Chat templates, rendered with minijinja the way transformers renders them with jinja2
//! (`tools` and messages' `tool_calls` included, for templates that render tools; `tojson`
//! writes JSON as Python's `json.dumps` does, keys in their order).

use baton_model_types::{ModelError, Result};
use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant's tool calls, in OpenAI's shape (`[{"id", "type": "function",
    /// "function": {"name", "arguments"}}]`), as templates that render tools read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The participant's (or, for a `tool` message, the function's) name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with a role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None, name: None }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Whether the template renders the `tools` it is given (found by rendering a probe).
    supports_tools: bool,
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
        env.add_filter("tojson", python_tojson);
        env.add_function("strftime_now", |_fmt: String| -> String {
            // Templates use it for "today's date" lines; a fixed, valid date keeps rendering pure.
            "01 Jan 2026".to_owned()
        });
        env.add_template_owned("chat", source.to_owned()).map_err(|e| ModelError::Template(e.to_string()))?;
        let mut template = Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_owned(),
            eos_token: eos_token.unwrap_or_default().to_owned(),
            supports_tools: false,
        };
        template.supports_tools = template.renders_tools();
        Ok(template)
    }

    /// Whether a conversation rendered with a tool mentions the tool's name (as llama.cpp
    /// probes a template's capabilities).
    fn renders_tools(&self) -> bool {
        const PROBE: &str = "baton_probe_tool_name";
        let tools = serde_json::json!([{"type": "function", "function": {"name": PROBE, "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}]);
        let messages = [ChatMessage::new("user", "hello")];
        self.render_with_tools(&messages, Some(&tools), true).is_ok_and(|text| text.contains(PROBE))
    }

    /// Whether the template renders `tools` (else a caller describes them in the prompt itself).
    pub fn supports_tools(&self) -> bool {
        self.supports_tools
    }

    /// Renders a conversation; `add_generation_prompt` appends the assistant's turn header.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders a conversation with the tools the assistant may call (OpenAI's `tools` list;
    /// `None` leaves `tools` undefined, as transformers does).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| ModelError::Template(e.to_string()))?;
        let base = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        };
        let ctx = match tools {
            Some(t) => context! { tools => Value::from_serialize(t), ..base },
            None => base,
        };
        tmpl.render(ctx).map_err(|e| ModelError::Template(e.to_string()))
    }

    /// Whether rendered text already starts with BOS, so encoding must not add another.
    pub fn starts_with_bos(&self, rendered: &str) -> bool {
        !self.bos_token.is_empty() && rendered.starts_with(&self.bos_token)
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// sort_keys=sort_keys)` — `", "` and `": "` between items, or one item a line under `indent`;
/// not HTML-escaped (minijinja's own `tojson` writes compact, escaped JSON). `ensure_ascii` and
/// `separators` are accepted and ignored.
fn python_tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = indent.filter(|i| !i.is_none()).map(usize::try_from).transpose()?;
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e))?;
    let mut out = String::new();
    write_python_json(&json, indent, sort_keys, 0, &mut out);
    Ok(out)
}

fn write_python_json(v: &serde_json::Value, indent: Option<usize>, sort_keys: bool, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let items: Vec<(Option<&String>, &J)> = match v {
        J::Array(a) if !a.is_empty() => a.iter().map(|x| (None, x)).collect(),
        J::Object(o) if !o.is_empty() => {
            let mut kv: Vec<_> = o.iter().map(|(k, x)| (Some(k), x)).collect();
            if sort_keys {
                kv.sort_by(|a, b| a.0.cmp(&b.0));
            }
            kv
        }
        scalar => {
            out.push_str(&scalar.to_string());
            return;
        }
    };
    let (open, close) = if v.is_array() { ('[', ']') } else { ('{', '}') };
    out.push(open);
    for (i, (key, x)) in items.into_iter().enumerate() {
        match indent {
            Some(n) => {
                out.push_str(if i == 0 { "\n" } else { ",\n" });
                out.push_str(&" ".repeat(n * (depth + 1)));
            }
            None if i > 0 => out.push_str(", "),
            None => {}
        }
        if let Some(k) = key {
            out.push_str(&serde_json::Value::String(k.clone()).to_string());
            out.push_str(": ");
        }
        write_python_json(x, indent, sort_keys, depth + 1, out);
    }
    if let Some(n) = indent {
        out.push('\n');
        out.push_str(&" ".repeat(n * depth));
    }
    out.push(close);
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
    fn a_template_that_renders_tools_is_told_from_one_that_does_not() {
        let plain = ChatTemplate::new("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", None, None)
            .expect("compiles");
        assert!(!plain.supports_tools());
        let with_tools = ChatTemplate::new(
            "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}\
             {% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}\
             {% for c in m.tool_calls %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}\
             {% endif %}\n{% endfor %}",
            None,
            None,
        )
        .expect("compiles");
        assert!(with_tools.supports_tools());
        let call = ChatMessage {
            tool_calls: Some(serde_json::json!([{"id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": {"x": 1}}}])),
            ..ChatMessage::new("assistant", "")
        };
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let out = with_tools.render_with_tools(&[call], Some(&tools), false).expect("renders");
        assert_eq!(out, "[f]assistant: <f {\"x\": 1}>");
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ messages[0].tool_calls | tojson }}|{{ messages[0].tool_calls[0] | tojson(indent=2) }}|\
             {{ messages[0].tool_calls[0] | tojson(sort_keys=true) }}|{{ [] | tojson }}",
            None,
            None,
        )
        .expect("compiles");
        let m = ChatMessage {
            tool_calls: Some(serde_json::json!([{"z": "<é>", "a": [1, 2.5, null, true], "m": {}}])),
            ..ChatMessage::new("assistant", "")
        };
        let out = t.render(&[m], false).expect("renders");
        assert_eq!(
            out,
            "[{\"z\": \"<é>\", \"a\": [1, 2.5, null, true], \"m\": {}}]|\
             {\n  \"z\": \"<é>\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"m\": {}\n}|\
             {\"a\": [1, 2.5, null, true], \"m\": {}, \"z\": \"<é>\"}|[]"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).expect("compiles");
        let e = t.render(&[], false).expect_err("raises").to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
