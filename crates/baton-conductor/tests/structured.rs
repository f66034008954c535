//! Structured output and tool calling through `baton serve`, on the real default model
//! (SmolLM2 135M Instruct): `response_format` answers that parse and validate against their
//! schema, colocated and handed from prefill to decode (KV pulled and pushed), streamed and not;
//! forced tool calls parsed into `tool_calls` whose arguments follow the function's
//! parameters; a history with a tool result; and invalid combinations answered with a 400
//! naming the parameter.
//!
//! Needs the model: run `scripts/fetch-model.sh` (the tests fail, not skip, without it).

use std::path::PathBuf;

use baton_conductor::ServeConfig;
use baton_engine::EngineConfig;
use baton_protocol::KvTransfer;
use serde_json::{Value, json};

mod common;
use common::{Server, fixture, sse_chunks, start_with};

fn smollm2() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = baton_model::known_model_path(&root, "smollm2-135m-instruct").expect("a known model");
    assert!(path.is_file(), "{} is missing: run `scripts/fetch-model.sh` first", path.display());
    path
}

fn engine_config() -> EngineConfig {
    EngineConfig {
        block_size: 16,
        num_blocks: 256,
        max_batch_tokens: 256,
        prefill_chunk: 256,
        ..EngineConfig::default()
    }
}

/// `baton serve` on SmolLM2: one prefill and one decode worker handing KV over in `mode`, or
/// (`None`) one colocated worker.
async fn start(mode: Option<KvTransfer>) -> Server {
    let base = ServeConfig { engine: engine_config(), ..ServeConfig::new(smollm2()) };
    let config = match mode {
        Some(kv_transfer) => ServeConfig { kv_transfer, ..base },
        None => ServeConfig { prefill: 0, decode: 0, colocated: 1, ..base },
    };
    start_with(&config).await
}

async fn post(server: &Server, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.url))
        .json(body)
        .send()
        .await
        .expect("sends");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A streamed chat: the content, the tool-call deltas and the finish reason.
async fn stream(server: &Server, body: &Value) -> (String, Vec<Value>, Option<String>) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.url))
        .json(&body)
        .send()
        .await
        .expect("sends");
    let (mut text, mut calls, mut finish) = (String::new(), Vec::new(), None);
    for v in sse_chunks(r).await {
        let choice = &v["choices"][0];
        text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if let Some(c) = choice["delta"]["tool_calls"].as_array() {
            calls.extend(c.iter().cloned());
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
    }
    (text, calls, finish)
}

fn city_schema() -> Value {
    json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "is_capital": {"type": "boolean"},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["city", "country", "is_capital", "population_millions"], "additionalProperties": false})
}

/// Checks an answer against [`city_schema`]: every field there, of its type, nothing else.
fn assert_city(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.len(), 4, "{text}");
    assert!(o["city"].as_str().is_some_and(|s| s.chars().count() <= 40), "{text}");
    assert!(o["country"].as_str().is_some_and(|s| s.chars().count() <= 40), "{text}");
    assert!(o["is_capital"].is_boolean(), "{text}");
    assert!(o["population_millions"].as_u64().is_some_and(|p| p <= 1000), "{text}");
}

fn city_request() -> Value {
    json!({
        "messages": [{"role": "user", "content": "Describe Paris as JSON with its city, country, whether it is a capital and its population in millions."}],
        "max_tokens": 96, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": city_schema(), "strict": true}},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_answers_validate_colocated_and_handed_off_streamed_or_not() {
    let mut answers = Vec::new();
    for mode in [Some(KvTransfer::Pull), Some(KvTransfer::Push), Some(KvTransfer::Layerwise), None] {
        let server = start(mode).await;
        let (status, v) = post(&server, &city_request()).await;
        assert_eq!(status, 200, "{mode:?}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{mode:?}: {v}");
        let text = v["choices"][0]["message"]["content"].as_str().expect("content").to_owned();
        assert_city(&text);
        let (streamed, calls, finish) = stream(&server, &city_request()).await;
        assert_eq!((streamed.as_str(), finish.as_deref()), (text.as_str(), Some("stop")), "{mode:?}");
        assert!(calls.is_empty());

        // json_object: any object; too few tokens: the answer is cut, as vLLM's.
        let mut object = city_request();
        object["response_format"] = json!({"type": "json_object"});
        let (status, v) = post(&server, &object).await;
        assert_eq!(status, 200, "{v}");
        let content = v["choices"][0]["message"]["content"].as_str().expect("content");
        if v["choices"][0]["finish_reason"] == "stop" {
            assert!(serde_json::from_str::<Value>(content).expect("JSON").is_object(), "{content}");
        } else {
            assert!(content.starts_with('{'), "{content}");
        }
        let mut short = city_request();
        short["max_tokens"] = json!(3);
        let (status, v) = post(&server, &short).await;
        assert_eq!((status, v["choices"][0]["finish_reason"].as_str()), (200, Some("length")), "{v}");
        server.assert_no_kv_held().await;
        answers.push(text);
    }
    // Greedy: the grammar state a decode worker rebuilds from the prefill's token is the one
    // a colocated worker reaches, so every deployment answers alike.
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"]}}},
    ])
}

/// Checks a call's arguments against its function's parameters.
fn assert_arguments(name: &str, arguments: &str) {
    let v: Value = serde_json::from_str(arguments).unwrap_or_else(|e| panic!("not JSON ({e}): {arguments}"));
    assert!(v["city"].as_str().is_some_and(|c| c.chars().count() <= 40), "{arguments}");
    // The parameters' own keys only (a forced call closes an open parameters schema).
    match name {
        "get_weather" => {
            assert!(["celsius", "fahrenheit"].contains(&v["unit"].as_str().unwrap_or("")), "{arguments}");
            assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{arguments}");
        }
        "get_time" => assert_eq!(v.as_object().map(|o| o.len()), Some(1), "{arguments}"),
        other => panic!("unknown function {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tool_calls_come_back_as_tool_calls_and_a_tool_result_is_taken() {
    let server = start(Some(KvTransfer::Pull)).await;
    let ask = json!([{"role": "user", "content": "What is the weather like in Paris today?"}]);
    for (choice, expect) in
        [(json!("required"), None), (json!({"type": "function", "function": {"name": "get_time"}}), Some("get_time"))]
    {
        let body = json!({"messages": ask, "tools": weather_tools(), "tool_choice": choice, "max_tokens": 80,
            "temperature": 0, "parallel_tool_calls": false});
        let (status, v) = post(&server, &body).await;
        assert_eq!(status, 200, "{v}");
        let choice0 = &v["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{v}");
        assert_eq!(choice0["message"]["content"], Value::Null, "{v}");
        let call = &choice0["message"]["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
        let name = call["function"]["name"].as_str().expect("name");
        if let Some(expect) = expect {
            assert_eq!(name, expect);
        }
        let arguments = call["function"]["arguments"].as_str().expect("arguments are a JSON text");
        assert_arguments(name, arguments);

        let (text, calls, finish) = stream(&server, &body).await;
        assert_eq!((text.as_str(), finish.as_deref()), ("", Some("tool_calls")));
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(calls[0]["function"]["name"], name);
        assert_eq!(calls[0]["function"]["arguments"], arguments, "streamed as answered");
    }

    // The call and its result in the history: the model answers in text.
    let history = json!([
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21, \"sky\": \"sunny\"}"},
    ]);
    let body = json!({"messages": history, "tools": weather_tools(), "max_tokens": 24, "temperature": 0});
    let (status, v) = post(&server, &body).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
    server.assert_no_kv_held().await;
}

/// A chat body asking for JSON under `schema`.
fn schema_format(schema: Value) -> Value {
    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
}

/// An object that must hold two more of itself: no finite JSON matches it.
fn endless_node() -> Value {
    json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/node"}, "b": {"$ref": "#/$defs/node"}},
        "required": ["a", "b"]})
}

/// A grammar that fails mid-generation, past the tokens the validator walks, ends the request
/// with an error the client sees — a 400 naming the parameter, or an error event after the
/// streamed text — never as a complete output with `finish_reason: "stop"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_failing_mid_generation_ends_with_an_error_not_a_stop() {
    let server = start_with(&ServeConfig { engine: engine_config(), ..ServeConfig::new(fixture("tiny-llama")) }).await;
    // A nine-digit number first (the validator's walk passes), then the endless object.
    let body = schema_format(json!({"type": "array", "prefixItems": [{"type": "integer", "minimum": 100_000_000,
        "maximum": 100_000_001}, {"$ref": "#/$defs/node"}], "items": false, "minItems": 2,
        "$defs": {"node": endless_node()}}));
    let (status, v) = post(&server, &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "response_format", "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("failed after")), "{v}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.url))
        .json(&streamed)
        .send()
        .await
        .expect("sends");
    assert_eq!(r.status().as_u16(), 200);
    let raw = r.text().await.expect("the stream ends");
    assert!(!raw.contains("[DONE]"), "a failed stream ended as a complete one: {raw}");
    let chunks: Vec<Value> = raw
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).expect("JSON events"))
        .collect();
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert!(text.starts_with("[10000000"), "{text:?}");
    assert!(chunks.iter().all(|c| c["choices"][0]["finish_reason"].is_null()), "a finish reason came: {chunks:?}");
    let last = chunks.last().expect("events");
    assert_eq!(last["error"]["param"], "response_format", "the stream did not end with the error: {last}");
    server.assert_no_kv_held().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_structured_requests_are_400s_naming_the_parameter() {
    let server = start_with(&ServeConfig { engine: engine_config(), ..ServeConfig::new(fixture("tiny-llama")) }).await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let named = |name: &str| json!({"type": "function", "function": {"name": name}});
    let cases = [
        (json!({"messages": user, "tools": weather_tools(), "tool_choice": named("nope")}), "tool_choice"),
        (json!({"messages": user, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": user, "tools": weather_tools(), "tool_choice": "always"}), "tool_choice"),
        (json!({"messages": user, "tools": [{"type": "code_interpreter"}]}), "tools[0]"),
        (json!({"messages": user, "tools": weather_tools(), "parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (
            json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format",
        ),
        (json!({"messages": user, "response_format": {"type": "yaml"}}), "response_format"),
        (
            json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
            "schema": {"type": "object", "properties": 5}}}}),
            "response_format",
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_object"}, "tools": weather_tools(),
            "tool_choice": "required"}),
            "response_format",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": 5}}}],
            "tool_choice": "required"}),
            "tools",
        ),
        // Schemas the grammar engine compiles but cannot serve (#37: each answered 200 with
        // output that does not parse and `finish_reason: "stop"`).
        (schema_format(json!({"$ref": "#"})), "response_format"),
        (schema_format(json!({"$defs": {"node": endless_node()}, "$ref": "#/$defs/node"})), "response_format"),
        (schema_format(json!({"type": "string", "pattern": "^(a{1000}){1000}$"})), "response_format"),
        (json!({"messages": [{"role": "tool", "content": "42"}]}), "messages[0].tool_call_id"),
        (
            json!({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls",
        ),
    ];
    for (body, param) in cases {
        let (status, v) = post(&server, &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    // response_format on completions too.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.url))
        .json(&json!({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {}}}))
        .send()
        .await
        .expect("sends");
    assert_eq!(r.status().as_u16(), 400);
    server.assert_no_kv_held().await;
}
