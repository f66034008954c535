//! The HTTP shell under hostile clients, on real sockets: slow or idle clients are cut off at
//! their deadline, oversized requests are refused, and every error a client can get is an
//! OpenAI-style JSON body; the conductor refuses an over-long prompt before tokenising it and,
//! when asked, keeps `/metrics` and `/health` behind the API key.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use axum::routing::post;
use baton_conductor::ServeConfig;
use baton_protocol::http::{HttpLimits, serve};
use common::{fixture, start_with};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Short deadlines, so that a test waits a fraction of a second for them.
fn limits() -> HttpLimits {
    HttpLimits {
        header_timeout: Duration::from_millis(300),
        body_timeout: Duration::from_millis(300),
        max_body_bytes: 1024,
        max_header_bytes: 2048,
        max_headers: 20,
        max_connections: 64,
        max_connections_per_peer: 64,
        first_byte_timeout: Duration::from_millis(300),
    }
}

/// An echo route behind [`serve`] with [`limits`]; returns its address.
async fn echo_server() -> std::net::SocketAddr {
    let app = axum::Router::new().route("/echo", post(|body: axum::body::Bytes| async move { body }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, app, limits(), None, std::future::pending(), Duration::ZERO));
    addr
}

/// Sends `raw` and reads until the server closes the connection (or 5 s pass, a failure).
async fn exchange(addr: std::net::SocketAddr, raw: &[u8]) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(raw).await.unwrap();
    read_to_close(&mut tcp).await
}

async fn read_to_close(tcp: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the server kept the connection open: {}", String::from_utf8_lossy(&out));
    String::from_utf8_lossy(&out).into_owned()
}

/// The status and JSON body of a raw HTTP/1.1 response; panics if the body is not an
/// OpenAI-style error.
fn error_of(response: &str) -> (u16, Value) {
    let status: u16 = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{response:?}"));
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{response:?}"));
    assert!(head.to_ascii_lowercase().contains("content-type: application/json"), "{response}");
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(v["error"]["code"], status, "{v}");
    (status, v)
}

#[tokio::test]
async fn slow_headers_and_idle_connections_are_cut_at_the_deadline() {
    let addr = echo_server().await;
    // Half a request line, then nothing: hyper closes it after the header deadline.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    read_to_close(&mut slow).await;
    // A connection that never sends a byte.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    read_to_close(&mut idle).await;
    // A kept-alive connection, idle after its first request.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi").await.unwrap();
    let answer = read_to_close(&mut kept).await;
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("hi"), "{answer}");
}

/// A connection from `ip` (a loopback address: Linux answers all of 127.0.0.0/8) to `addr`.
async fn connect_from(ip: &str, addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    socket.connect(addr).await.unwrap()
}

/// One client cannot lock the others out (#37, item 4: one client's 4,096 idle connections
/// made a `/health` probe wait 35.5 s). Eight connections in all, four per address: a client
/// opening twenty idle ones has all past its fourth closed at once, and another client is
/// answered at once, well inside the idle connections' deadlines. A connection that sends
/// nothing is closed after the first-byte deadline, not the (longer) header deadline.
#[tokio::test]
async fn one_clients_idle_connections_do_not_delay_another_client() {
    let app = axum::Router::new().route("/echo", post(|body: axum::body::Bytes| async move { body }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = HttpLimits {
        header_timeout: Duration::from_secs(30),
        first_byte_timeout: Duration::from_secs(20),
        max_connections: 8,
        max_connections_per_peer: 4,
        ..limits()
    };
    tokio::spawn(serve(listener, app, limits, None, std::future::pending(), Duration::ZERO));
    let mut hog = Vec::new();
    for _ in 0..20 {
        hog.push(connect_from("127.0.0.1", addr).await);
    }
    let started = std::time::Instant::now();
    let mut other = connect_from("127.0.0.2", addr).await;
    other
        .write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 2\r\n\r\nhi")
        .await
        .unwrap();
    let answer = read_to_close(&mut other).await;
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("hi"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(3), "waited {:?} behind another client", started.elapsed());
    // The hog's connections past its share were closed without a byte.
    let mut closed = 0;
    for tcp in &mut hog {
        let mut byte = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(200), tcp.read(&mut byte)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, 16, "all but four of the hog's connections are closed");

    // A silent connection is closed at the first-byte deadline (300 ms here), not the header one.
    let addr = echo_server().await;
    let started = std::time::Instant::now();
    let mut silent = TcpStream::connect(addr).await.unwrap();
    read_to_close(&mut silent).await;
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
}

/// The requests hyper refuses itself, before any handler runs, get the same JSON errors (#37:
/// an empty-body 400 or 414).
#[tokio::test]
async fn requests_hyper_cannot_parse_get_json_errors_too() {
    let addr = echo_server().await;
    let long_uri = format!("POST /{} HTTP/1.1\r\nhost: x\r\n\r\n", "a".repeat(70_000));
    let cases: [&[u8]; 5] = [
        b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\nhello",
        b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nhi!",
        b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1e3\r\n\r\n",
        b"GARBAGE\r\n\r\n",
        long_uri.as_bytes(),
    ];
    for raw in cases {
        let (status, v) = error_of(&exchange(addr, raw).await);
        assert!((400..500).contains(&status), "{status}: {v}");
    }
}

#[tokio::test]
async fn a_trickled_body_gets_a_408_and_an_oversized_one_a_413() {
    let addr = echo_server().await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 100\r\n\r\nonly ten..")
        .await
        .unwrap();
    let (status, v) = error_of(&read_to_close(&mut tcp).await);
    assert_eq!(status, 408, "{v}");

    // Declared too large: refused without reading it.
    let raw = b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 5000\r\n\r\n";
    let (status, v) = error_of(&exchange(addr, raw).await);
    assert_eq!(status, 413, "{v}");
    // Chunked, growing past the limit.
    let mut raw = b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..3 {
        raw.extend_from_slice(format!("{:x}\r\n{}\r\n", 600, "a".repeat(600)).as_bytes());
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let (status, v) = error_of(&exchange(addr, &raw).await);
    assert_eq!(status, 413, "{v}");
}

#[tokio::test]
async fn framework_errors_are_openai_json() {
    let addr = echo_server().await;
    // Wrong method (axum's 405).
    let (status, v) = error_of(&exchange(addr, b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await);
    assert_eq!(status, 405, "{v}");
    // No such route (axum's empty 404).
    let (status, _) = error_of(&exchange(addr, b"GET /nothing HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await);
    assert_eq!(status, 404);
    // A broken chunked body.
    let raw = b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n";
    let (status, v) = error_of(&exchange(addr, raw).await);
    assert_eq!(status, 400, "{v}");
    // Too many headers, or too many bytes of them (431).
    let mut raw = b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n".to_vec();
    for i in 0..30 {
        raw.extend_from_slice(format!("x-h{i}: v\r\n").as_bytes());
    }
    raw.extend_from_slice(b"\r\n");
    let (status, v) = error_of(&exchange(addr, &raw).await);
    assert_eq!(status, 431, "{v}");
    let raw = format!(
        "POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\nx-big: {}\r\n\r\n",
        "b".repeat(3000)
    );
    let (status, v) = error_of(&exchange(addr, raw.as_bytes()).await);
    assert_eq!(status, 431, "{v}");
}

#[tokio::test]
async fn the_conductor_refuses_an_over_long_prompt_by_its_length_and_405s_in_json() {
    let server = start_with(&ServeConfig::new(fixture("tiny-llama"))).await;
    let http = reqwest::Client::new();
    // The bound is the context times the longest token: a prompt one byte over it cannot fit.
    let ckpt = baton_model::Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let context = ckpt.model.config().max_position_embeddings;
    let bound = baton_conductor::openai::Validator::prompt_bytes_bound(&ckpt.tokenizer, context);
    assert!(bound >= context * 4, "{bound}");
    let r = http
        .post(format!("{}/v1/completions", server.url))
        .json(&json!({"prompt": "a".repeat(bound + 1), "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "prompt", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("bytes"), "{body}");
    let r = http.get(format!("{}/v1/completions", server.url)).send().await.unwrap();
    assert_eq!(r.status(), 405);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], 405, "{body}");
}

#[tokio::test]
async fn metrics_and_health_want_the_key_only_when_protected() {
    for protect in [false, true] {
        let config = ServeConfig {
            api_key: Some("sesame".into()),
            protect_metrics: protect,
            ..ServeConfig::new(fixture("tiny-llama"))
        };
        let server = start_with(&config).await;
        let http = reqwest::Client::new();
        for path in ["/metrics", "/health"] {
            let open = http.get(format!("{}{path}", server.url)).send().await.unwrap();
            let keyed = http.get(format!("{}{path}", server.url)).bearer_auth("sesame").send().await.unwrap();
            assert_eq!(keyed.status(), 200, "{path}");
            if protect {
                assert_eq!(open.status(), 401, "{path} answered without the key");
            } else {
                assert_eq!(open.status(), 200, "{path}");
            }
        }
    }
}
