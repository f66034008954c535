//! End to end against a real `baton serve` (the conductor with a prefill and a decode worker,
//! in process, on 127.0.0.1:0) with the tiny Llama fixture: counts, exact output lengths with
//! `ignore_eos`, latency orderings, causal session turns, a rate sweep, errors by kind, the JSON
//! report and the plots.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_bench::arrival::Arrival;
use baton_bench::client::Endpoint;
use baton_bench::metrics::Slo;
use baton_bench::report::{Report, compare_table, summary_table};
use baton_bench::runner::Quiet;
use baton_bench::workload::{LengthDist, WorkloadSpec};
use baton_bench::{BenchConfig, BenchError};
use baton_conductor::ServeConfig;

struct Server {
    url: String,
    _shutdown: tokio::sync::oneshot::Sender<()>,
}

async fn start() -> Server {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
    let conductor = baton_conductor::build(&ServeConfig::new(model)).expect("builds");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(baton_conductor::serve(listener, conductor, async {
        let _ = rx.await;
    }));
    Server { url, _shutdown: tx }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synthetic_closed_loop_against_baton_serve() {
    let server = start().await;
    let config = BenchConfig {
        workload: WorkloadSpec::Synthetic {
            requests: 8,
            input: LengthDist::Uniform { min: 8, max: 24 },
            output: LengthDist::Fixed(6),
        },
        arrivals: vec![Arrival::Closed { concurrency: 2 }],
        ignore_eos: true,
        request_timeout_s: 60.0,
        slo: Slo { ttft_ms: Some(60_000.0), tbt_ms: Some(60_000.0), ..Slo::default() },
        ..BenchConfig::new(&server.url)
    };
    let report = baton_bench::run(&config, Arc::new(Quiet)).await.expect("runs");
    assert_eq!(report.model, "tiny-llama", "the model comes from /v1/models");
    assert_eq!(report.runs.len(), 1);
    let run = &report.runs[0];
    let s = &run.summary;
    assert_eq!((s.sent, s.completed), (8, 8), "{:?}", run.records.iter().map(|r| &r.error).collect::<Vec<_>>());
    assert_eq!(s.outcomes.get("ok"), Some(&8));
    assert_eq!(s.output_tokens, 8 * 6, "ignore_eos gives exact lengths");
    assert!(s.max_in_flight <= 2, "closed loop at concurrency 2, saw {}", s.max_in_flight);
    assert!(s.output_throughput > 0.0 && s.request_throughput > 0.0);
    assert_eq!(s.slo.expect("slo").met, 8);
    for r in &run.records {
        assert!(r.input_from_usage && r.input_tokens > 0);
        let cached = r.cached_tokens.expect("Baton reports its prefix cache hits");
        assert!(cached < r.input_tokens, "{cached} of {} prompt tokens cached", r.input_tokens);
        assert_eq!(r.output_tokens, 6);
        let ttft = r.ttft_us.expect("a first token");
        assert!(ttft <= r.jct_us, "TTFT {ttft} > JCT {}", r.jct_us);
        assert!(ttft + r.itl_us.iter().sum::<u64>() <= r.jct_us);
        assert_eq!(r.itl_us.len() as u64 + 1, r.chunks);
        assert!(r.chunks <= 6);
        assert!(r.scheduled_us <= r.start_us);
    }
    assert!(s.ttft_ms.p50 <= s.jct_ms.p50 && s.ttft_ms.p99 <= s.jct_ms.max);

    // The report survives a round trip and prints; the plots are written.
    let dir = scratch("synthetic");
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("report.json");
    report.write(&path).expect("writes");
    let back = Report::read(&path).expect("reads");
    // Floats may differ in the last digit through JSON; records and counts are exact.
    assert_eq!((&back.config, &back.runs[0].records), (&report.config, &run.records));
    assert_eq!(back.runs[0].summary.outcomes, s.outcomes);
    assert!(summary_table(&report).contains("TTFT p90 (ms)"));
    assert!(compare_table(&report, &back, "a", "b").contains("1.00"));
    let files = baton_bench::plot::write_plots(&report, &dir).expect("plots");
    for f in &files {
        assert!(std::fs::metadata(f).expect("written").len() > 1000, "{}", f.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_on_chat_are_causal_across_a_rate_sweep() {
    let server = start().await;
    let config = BenchConfig {
        endpoint: Endpoint::Chat,
        workload: WorkloadSpec::Sessions {
            sessions: 2,
            turns: 3,
            system_tokens: 16,
            turn_tokens: LengthDist::Fixed(4),
            output: LengthDist::Fixed(4),
        },
        arrivals: vec![Arrival::Poisson { rate: 20.0 }, Arrival::Poisson { rate: 40.0 }],
        ignore_eos: true,
        request_timeout_s: 60.0,
        ..BenchConfig::new(&server.url)
    };
    let report = baton_bench::run(&config, Arc::new(Quiet)).await.expect("runs");
    assert_eq!(report.runs.len(), 2);
    for run in &report.runs {
        assert_eq!(run.summary.completed, 6, "{}", run.label);
        for chain in 0..2 {
            let turns: Vec<_> = run.records.iter().filter(|r| r.chain == chain).collect();
            assert_eq!(turns.len(), 3);
            for pair in turns.windows(2) {
                assert!(pair[1].start_us >= pair[0].end_us(), "turn k+1 waits for turn k's answer");
                assert!(
                    pair[1].input_tokens > pair[0].input_tokens + pair[0].output_tokens,
                    "the next prompt holds the previous prompt and answer"
                );
            }
        }
    }
    let dir = scratch("sweep");
    let files = baton_bench::plot::write_plots(&report, &dir).expect("plots");
    assert!(files.iter().any(|f| f.ends_with("sweep.svg")));
    let versus = baton_bench::plot::write_versus(&[("a", &report), ("b", &report)], &dir).expect("versus plot");
    assert_eq!(versus.len(), 2);
    for f in &versus {
        assert!(std::fs::metadata(f).expect("written").len() > 1000, "{}", f.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_by_kind() {
    let server = start().await;
    // A model the server does not serve: every request is an HTTP error, none completes.
    let config = BenchConfig {
        model: Some("no-such-model".into()),
        workload: WorkloadSpec::Synthetic { requests: 3, input: LengthDist::Fixed(4), output: LengthDist::Fixed(2) },
        slo: Slo { ttft_ms: Some(1e6), ..Slo::default() },
        ..BenchConfig::new(&server.url)
    };
    let report = baton_bench::run(&config, Arc::new(Quiet)).await.expect("runs");
    let s = &report.runs[0].summary;
    assert_eq!((s.sent, s.completed), (3, 0));
    let (kind, n) = s.outcomes.iter().next().expect("one kind");
    assert!(kind.starts_with("http_4"), "{kind}");
    assert_eq!(*n, 3);
    assert_eq!(s.slo.expect("slo").attainment, 0.0);

    // Nothing listening: connection errors, quickly.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
        l.local_addr().expect("addr").port()
    };
    let config = BenchConfig {
        model: Some("m".into()),
        workload: WorkloadSpec::Synthetic { requests: 2, input: LengthDist::Fixed(4), output: LengthDist::Fixed(2) },
        connect_timeout_s: 2.0,
        ..BenchConfig::new(&format!("http://127.0.0.1:{port}"))
    };
    let report = baton_bench::run(&config, Arc::new(Quiet)).await.expect("runs");
    assert_eq!(report.runs[0].summary.outcomes.get("connect"), Some(&2));

    // Remote servers are refused unless allowed, before any request.
    let remote = BenchConfig::new("http://192.0.2.1:8000");
    assert!(matches!(baton_bench::run(&remote, Arc::new(Quiet)).await, Err(BenchError::Config(_))));
    assert!(BenchConfig { allow_remote: true, ..remote }.validate().is_ok());
    assert!(baton_bench::is_loopback_url("http://localhost:1/v1").expect("parses"));
    assert!(baton_bench::is_loopback_url("http://[::1]:8000").expect("parses"));
    assert!(!baton_bench::is_loopback_url("http://10.0.0.1:8000").expect("parses"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duration_bound_ends_the_run_without_waiting_out_the_schedule() {
    let server = start().await;
    // 200 requests at 2/s are scheduled over about 100 s; the run stops sending after 1 s and
    // must end when those few answers are in, not when the last scheduled arrival comes.
    let config = BenchConfig {
        workload: WorkloadSpec::Synthetic { requests: 200, input: LengthDist::Fixed(4), output: LengthDist::Fixed(2) },
        arrivals: vec![Arrival::Poisson { rate: 2.0 }],
        duration_s: Some(1.0),
        ignore_eos: true,
        request_timeout_s: 30.0,
        ..BenchConfig::new(&server.url)
    };
    let began = std::time::Instant::now();
    let report = baton_bench::run(&config, Arc::new(Quiet)).await.expect("runs");
    let took = began.elapsed();
    assert!(took < std::time::Duration::from_secs(40), "the run took {took:?}");
    let s = &report.runs[0].summary;
    assert!(s.sent < 20, "only arrivals within the first second are sent, got {}", s.sent);
    assert_eq!(s.completed, s.sent);
    assert!(report.runs[0].records.iter().all(|r| r.scheduled_us < 1_000_000));
}

/// Requests sent to `url` and its replicas alternate between them (round-robin), whatever the
/// arrival process: what a load balancer in front of two conductors does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_take_requests_in_turn() {
    let (a, b) = (start().await, start().await);
    let config = BenchConfig {
        replicas: vec![format!("{}/v1", b.url)],
        workload: WorkloadSpec::Synthetic { requests: 6, input: LengthDist::Fixed(8), output: LengthDist::Fixed(2) },
        arrivals: vec![Arrival::Closed { concurrency: 1 }],
        ignore_eos: true,
        request_timeout_s: 60.0,
        ..BenchConfig::new(&a.url)
    };
    let report = baton_bench::run(&config, Arc::new(Quiet)).await.expect("runs");
    assert_eq!(report.runs[0].summary.completed, 6);
    for server in [&a, &b] {
        let metrics =
            reqwest::get(format!("{}/metrics", server.url)).await.expect("metrics").text().await.expect("body");
        let answered = metrics
            .lines()
            .find_map(|l| l.strip_prefix("baton_time_to_first_token_seconds_count "))
            .unwrap_or_else(|| panic!("no TTFT count on {}", server.url));
        assert_eq!(answered, "3", "{} answered {answered} of the 6 requests", server.url);
    }
    let remote = BenchConfig { replicas: vec!["http://10.1.2.3:8000".into()], ..config };
    assert!(matches!(remote.validate(), Err(BenchError::Config(_))), "a remote replica needs --allow-remote");
}
