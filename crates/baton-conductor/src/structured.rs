//! Structured output and tool calling on the OpenAI API: `response_format`, `tools` and
//! `tool_choice` validated into a grammar [`Constraint`] and a prompt; tool calls parsed back
//! out of the generated text, whole or as it streams.
//!
//! Tool calls are written Hermes-style, `<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
//! what most open models with tool support emit and what vLLM and llama.cpp ask of models
//! whose chat template has no tools. When the template renders `tools` (found by probing it,
//! [`ChatTemplate::supports_tools`]) the tools and the history's calls go to the template;
//! otherwise [`Tools::system_prompt`] describes them in the system message, and past calls and
//! results are written into the messages as text. `tool_choice: "required"` or a named
//! function constrains the output with a grammar — the tags around a JSON object whose `name`
//! is one of the allowed functions and whose `arguments` follow that function's `parameters`
//! schema — so the call always parses; `"auto"` lets the model choose, and the text is parsed
//! for calls after generation. One call per turn is generated under a grammar
//! (`parallel_tool_calls` is accepted; `"auto"` returns every call the model wrote).
//!
//! [`ChatTemplate::supports_tools`]: baton_model::ChatTemplate::supports_tools

use baton_model::Constraint;
use serde_json::{Value, json};

use baton_protocol::error::ApiError;

/// Opening tag of a tool call in the generated text.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closing tag of a tool call.
pub const CALL_CLOSE: &str = "</tool_call>";

/// `response_format`: `None` for text (the default), else the constraint on the output.
pub fn response_format(value: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let bad = |m: &str| Err(ApiError::param("response_format", m));
    let Some(value) = value.filter(|v| !v.is_null()) else { return Ok(None) };
    let Some(obj) = value.as_object() else { return bad("must be an object with a `type`") };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonSchema(json!({"type": "object"})))),
        Some("json_schema") => {
            let Some(spec) = obj.get("json_schema").and_then(Value::as_object) else {
                return bad("`json_schema` needs a `json_schema` object with a `schema`");
            };
            if spec.get("name").is_some_and(|n| !n.is_string()) {
                return bad("`json_schema.name` must be a string");
            }
            if spec.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                return bad("`json_schema.strict` must be a boolean");
            }
            match spec.get("schema") {
                Some(schema @ Value::Object(_)) => {
                    let mut schema = schema.clone();
                    close_objects(&mut schema);
                    Ok(Some(Constraint::JsonSchema(schema)))
                }
                Some(_) => bad("`json_schema.schema` must be a JSON schema object"),
                None => bad("`json_schema` needs a `schema`"),
            }
        }
        Some(other) => bad(&format!("unknown type `{other}`: use `text`, `json_object` or `json_schema`")),
        None => bad("must have a `type`: `text`, `json_object` or `json_schema`"),
    }
}

/// Closes every object of a schema that lists `properties` and says nothing of others
/// (`additionalProperties: false`), at any depth: what OpenAI's strict mode asks of a schema and
/// what xgrammar (vLLM's default) assumes. Left open, a small model pads the object with keys
/// copied from the schema until `max_tokens` (the README's example ran for the whole context).
/// A schema that allows other keys says so (`additionalProperties: true` or a schema).
fn close_objects(schema: &mut Value) {
    match schema {
        Value::Object(o) => {
            if o.contains_key("properties") && !o.contains_key("additionalProperties") {
                o.insert("additionalProperties".to_owned(), Value::Bool(false));
            }
            for (k, v) in o.iter_mut() {
                match k.as_str() {
                    // Maps of names to schemas.
                    "properties" | "$defs" | "definitions" | "patternProperties" => {
                        if let Value::Object(m) = v {
                            m.values_mut().for_each(close_objects);
                        }
                    }
                    // A schema, or a list of them.
                    "items"
                    | "additionalItems"
                    | "prefixItems"
                    | "anyOf"
                    | "oneOf"
                    | "allOf"
                    | "not"
                    | "if"
                    | "then"
                    | "else"
                    | "additionalProperties"
                    | "contains" => close_objects(v),
                    _ => {}
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// JSON schema of its arguments.
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call a tool (the tools are not shown to the model).
    None,
    /// The model decides.
    Auto,
    /// The model must call one of the tools.
    Required,
    /// The model must call this function.
    Function(String),
}

/// A request's tools and how they may be used.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The functions.
    pub tools: Vec<Tool>,
    /// How they may be used.
    pub choice: ToolChoice,
    /// `tools` as sent, for chat templates that render them.
    pub raw: Value,
}

/// A tool call parsed from generated text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// `call_...`.
    pub id: String,
    /// The function.
    pub name: String,
    /// Its arguments, as a JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// The call in a message's `tool_calls`.
    pub fn json(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Tools {
    /// Validates `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no tools are
    /// given (an empty list is none).
    pub fn parse(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<&Value>,
    ) -> Result<Option<Tools>, ApiError> {
        if parallel.is_some_and(|p| !p.is_boolean() && !p.is_null()) {
            return Err(ApiError::param("parallel_tool_calls", "must be a boolean"));
        }
        let list = match tools {
            None | Some(Value::Null) => &[][..],
            Some(Value::Array(list)) => list.as_slice(),
            Some(_) => return Err(ApiError::param("tools", "must be a list of tools")),
        };
        let choice = choice.filter(|c| !c.is_null());
        if list.is_empty() {
            return match choice {
                None => Ok(None),
                Some(_) => Err(ApiError::param("tool_choice", "`tool_choice` is only allowed when `tools` are given")),
            };
        }
        let mut parsed = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let bad = |m: &str| ApiError::param(&format!("tools[{i}]"), m);
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad("only tools of `type: \"function\"` are supported"));
            }
            let f = t.get("function").and_then(Value::as_object).ok_or_else(|| bad("needs a `function` object"))?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            if !valid_name(name) {
                return Err(bad("`function.name` must be 1 to 64 letters, digits, `_` or `-`"));
            }
            if parsed.iter().any(|p: &Tool| p.name == name) {
                return Err(bad(&format!("the function name `{name}` is used twice")));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => return Err(bad("`function.parameters` must be a JSON schema object")),
            };
            let description = match f.get("description") {
                None | Some(Value::Null) => None,
                Some(Value::String(d)) => Some(d.clone()),
                Some(_) => return Err(bad("`function.description` must be a string")),
            };
            parsed.push(Tool { name: name.to_owned(), description, parameters });
        }
        let choice = match choice {
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(ApiError::param(
                        "tool_choice",
                        format!("unknown choice `{other}`: use `none`, `auto`, `required` or a function"),
                    ));
                }
            },
            Some(obj @ Value::Object(_)) => {
                let name = (obj.get("type").and_then(Value::as_str) == Some("function"))
                    .then(|| obj.pointer("/function/name").and_then(Value::as_str))
                    .flatten()
                    .ok_or_else(|| {
                        ApiError::param(
                            "tool_choice",
                            "must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        )
                    })?;
                if !parsed.iter().any(|t| t.name == name) {
                    return Err(ApiError::param("tool_choice", format!("names `{name}`, which is not among `tools`")));
                }
                ToolChoice::Function(name.to_owned())
            }
            Some(_) => return Err(ApiError::param("tool_choice", "must be a string or a function object")),
        };
        Ok(Some(Tools { tools: parsed, choice, raw: Value::Array(list.to_vec()) }))
    }

    /// Whether the model is shown the tools and its output is parsed for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The functions the model may call now.
    fn callable(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter().filter(|t| match &self.choice {
            ToolChoice::None => false,
            ToolChoice::Auto | ToolChoice::Required => true,
            ToolChoice::Function(name) => &t.name == name,
        })
    }

    /// The grammar of one call when the choice forces one (`required` or a named function):
    /// the tags around `{"name": .., "arguments": ..}`, the arguments under the function's
    /// `parameters` schema, its objects closed (`close_objects`): a small model otherwise pads
    /// the arguments with keys copied from the schema, which no function takes.
    pub fn constraint(&self) -> Option<Constraint> {
        if !matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_)) {
            return None;
        }
        let calls: Vec<Value> = self
            .callable()
            .map(|t| {
                let mut arguments = t.parameters.clone();
                close_objects(&mut arguments);
                json!({"type": "object", "properties": {"name": {"const": t.name}, "arguments": arguments},
                    "required": ["name", "arguments"], "additionalProperties": false})
            })
            .collect();
        let schema = match <[Value; 1]>::try_from(calls) {
            Ok([one]) => one,
            Err(many) => json!({"anyOf": many}),
        };
        let schema = baton_model::grammar::with_json_style(&schema);
        Some(Constraint::Lark(format!("start: \"{CALL_OPEN}\\n\" call \"\\n{CALL_CLOSE}\"\ncall: %json {schema}\n")))
    }

    /// The system prompt's description of the tools, for a chat template that does not render
    /// them: the functions as JSON, and how to call one.
    pub fn system_prompt(&self) -> String {
        let mut text = String::from(
            "# Tools\n\nYou can call functions to help answer the user. Their signatures are listed as JSON \
             inside <tools></tools> tags:\n<tools>\n",
        );
        for t in self.callable() {
            let mut f = json!({"name": t.name, "parameters": t.parameters});
            if let Some(d) = &t.description {
                f["description"] = json!(d);
            }
            text.push_str(&json!({"type": "function", "function": f}).to_string());
            text.push('\n');
        }
        text.push_str(&format!(
            "</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments inside \
             {CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n{{\"name\": <function name>, \"arguments\": <arguments as a \
             JSON object>}}\n{CALL_CLOSE}"
        ));
        if matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_)) {
            text.push_str("\nAnswer with a function call.");
        }
        text
    }

    /// The tool calls in generated text, and the text before the first of them (`None` when
    /// empty); `None` when the text holds no call to a known function (it is then plain
    /// content). A call whose closing tag is missing (the text ended) counts if its JSON is
    /// whole.
    pub fn parse_calls(&self, text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
        if !self.active() {
            return None;
        }
        let start = text.find(CALL_OPEN)?;
        let mut calls = Vec::new();
        let mut rest = &text[start..];
        while let Some(open) = rest.find(CALL_OPEN) {
            let body = &rest[open + CALL_OPEN.len()..];
            let (json_text, next) = match body.find(CALL_CLOSE) {
                Some(end) => (&body[..end], &body[end + CALL_CLOSE.len()..]),
                None => (body, ""),
            };
            calls.push(self.call(json_text.trim())?);
            rest = next;
        }
        let content = text[..start].trim();
        Some(((!content.is_empty()).then(|| content.to_owned()), calls))
    }

    fn call(&self, json_text: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(json_text).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.tools.iter().any(|t| t.name == name) {
            return None;
        }
        let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or_else(|| json!({}));
        let arguments = match args {
            // Some models write the arguments as a JSON string already.
            Value::String(s) => s,
            other => other.to_string(),
        };
        Some(ToolCall { id: new_call_id(), name: name.to_owned(), arguments })
    }
}

/// A new `call_` id: 24 random hex digits.
fn new_call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

/// Holds back streamed text that may be a tool call: text goes out as it comes until
/// [`CALL_OPEN`] may be starting; from the tag on, everything waits for the end, when the
/// whole text is parsed ([`Tools::parse_calls`]).
#[derive(Debug, Default)]
pub struct CallStream {
    held: String,
    in_call: bool,
}

impl CallStream {
    /// Takes a delta; returns the text that can go out now.
    pub fn push(&mut self, delta: &str) -> String {
        self.held.push_str(delta);
        if self.in_call {
            return String::new();
        }
        if let Some(at) = self.held.find(CALL_OPEN) {
            self.in_call = true;
            let out = self.held[..at].to_owned();
            self.held.drain(..at);
            return out;
        }
        // Keep the longest tail that could still grow into the tag.
        let keep = (1..CALL_OPEN.len().min(self.held.len() + 1))
            .rev()
            .find(|&k| self.held.is_char_boundary(self.held.len() - k) && self.held.ends_with(&CALL_OPEN[..k]))
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        out
    }

    /// The text held back, at the end (when it turned out not to be a call).
    pub fn take_held(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The `message` of a chat choice and its finish reason: tool calls when the request's tools
/// are active and the text holds some (`content` is then the text before them, or null), the
/// text otherwise.
pub fn chat_message(text: String, tools: Option<&Tools>, finish_reason: &'static str) -> (Value, &'static str) {
    match tools.and_then(|t| t.parse_calls(&text)) {
        Some((content, calls)) => (
            json!({"role": "assistant", "content": content,
                "tool_calls": calls.iter().map(ToolCall::json).collect::<Vec<_>>()}),
            "tool_calls",
        ),
        None => (json!({"role": "assistant", "content": text}), finish_reason),
    }
}

/// The `delta.tool_calls` of a streamed chunk carrying whole calls.
pub fn tool_call_deltas(calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"index": i, "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}})
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_schema_has_its_objects_closed_unless_it_opens_them() {
        let format = json!({"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object",
            "properties": {"city": {"type": "string"},
                "mayor": {"type": "object", "properties": {"name": {"type": "string"}}},
                "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
                "extra": {"type": "object", "properties": {}, "additionalProperties": true}},
        }}});
        let Some(Constraint::JsonSchema(s)) = response_format(Some(&format)).expect("valid") else {
            panic!("a JSON schema constraint")
        };
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["mayor"]["additionalProperties"], false);
        assert_eq!(s["properties"]["tags"]["items"]["additionalProperties"], false);
        assert_eq!(s["properties"]["extra"]["additionalProperties"], true, "an open object stays open");
        assert_eq!(
            s["properties"]["city"],
            json!({"type": "string"}),
            "no keyword added where there are no properties"
        );
    }

    fn tools(choice: Value) -> Result<Option<Tools>, ApiError> {
        let list = json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "add"}},
        ]);
        Tools::parse(Some(&list), Some(&choice), None)
    }

    fn param_of(e: ApiError) -> String {
        e.body()["error"]["param"].as_str().unwrap_or_default().to_owned()
    }

    #[test]
    fn response_formats_validate_into_constraints() {
        assert_eq!(response_format(None).ok(), Some(None));
        assert_eq!(response_format(Some(&json!({"type": "text"}))).ok(), Some(None));
        assert_eq!(
            response_format(Some(&json!({"type": "json_object"}))).ok(),
            Some(Some(Constraint::JsonSchema(json!({"type": "object"}))))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
        let closed = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": false});
        assert_eq!(response_format(Some(&rf)).ok(), Some(Some(Constraint::JsonSchema(closed))));
        for bad in [
            json!("json"),
            json!({"type": "xml"}),
            json!({}),
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            json!({"type": "json_schema", "json_schema": {"schema": 3}}),
        ] {
            let e = response_format(Some(&bad)).expect_err("refused");
            assert_eq!(param_of(e), "response_format", "{bad}");
        }
    }

    #[test]
    fn tool_choices_validate_and_name_the_parameter() {
        assert_eq!(tools(json!("auto")).expect("valid").expect("some").choice, ToolChoice::Auto);
        assert_eq!(tools(json!("required")).expect("valid").expect("some").choice, ToolChoice::Required);
        let named = json!({"type": "function", "function": {"name": "add"}});
        assert_eq!(tools(named).expect("valid").expect("some").choice, ToolChoice::Function("add".into()));
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(param_of(tools(unknown).expect_err("unknown function")), "tool_choice");
        assert_eq!(param_of(tools(json!("sometimes")).expect_err("unknown choice")), "tool_choice");
        let alone = Tools::parse(None, Some(&json!("required")), None).expect_err("no tools");
        assert_eq!(param_of(alone), "tool_choice");
        let bad = Tools::parse(Some(&json!([{"type": "retrieval"}])), None, None).expect_err("not a function");
        assert_eq!(param_of(bad), "tools[0]");
        let parallel = Tools::parse(None, None, Some(&json!("yes"))).expect_err("not a boolean");
        assert_eq!(param_of(parallel), "parallel_tool_calls");
        assert_eq!(Tools::parse(Some(&json!([])), None, None).expect("valid"), None);
    }

    #[test]
    fn calls_parse_out_of_text_and_unknown_functions_stay_text() {
        let t = tools(json!("auto")).expect("valid").expect("some");
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (content, calls) = t.parse_calls(text).expect("a call");
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(serde_json::from_str::<Value>(&calls[0].arguments).ok(), Some(json!({"city": "Paris"})));
        assert!(calls[0].id.starts_with("call_"));
        assert_eq!(t.parse_calls("<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>"), None);
        assert_eq!(t.parse_calls("just text"), None);
        let (message, finish) = chat_message(text.to_owned(), Some(&t), "stop");
        assert_eq!(finish, "tool_calls");
        assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
    }

    #[test]
    fn the_stream_holds_back_only_what_may_be_a_call() {
        let mut s = CallStream::default();
        assert_eq!(s.push("Hello <to"), "Hello ");
        assert_eq!(s.push("y>"), "<toy>");
        assert_eq!(s.push(" and <tool_"), " and ");
        assert_eq!(s.push("call>{\"name\""), "");
        assert_eq!(s.push("...}</tool_call>"), "");
        assert_eq!(s.take_held(), "<tool_call>{\"name\"...}</tool_call>");
    }

    #[test]
    fn a_forced_choice_has_a_grammar_and_auto_has_none() {
        assert_eq!(tools(json!("auto")).expect("valid").expect("some").constraint(), None);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let Some(Constraint::Lark(lark)) = tools(named).expect("valid").expect("some").constraint() else {
            panic!("a Lark grammar")
        };
        assert!(lark.starts_with("start: \"<tool_call>\\n\" call"), "{lark}");
        assert!(lark.contains("\"const\":\"get_weather\"") && !lark.contains("\"add\""), "{lark}");
        assert!(lark.contains("\"required\":[\"city\"],\"additionalProperties\":false"), "closed: {lark}");
    }
}
