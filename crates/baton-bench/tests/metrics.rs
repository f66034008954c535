//! The metric math on hand-made timelines: percentiles, TTFT / TPOT / ITL / JCT, throughput,
//! SLO attainment and goodput, outcomes by kind, the in-flight timeline.

use baton_bench::metrics::{Outcome, RequestRecord, Slo, Stats, TbtStat, in_flight, summarize};
use baton_measure::percentile;

/// A completed request: sent at `start` ms, first token after `ttft` ms, then tokens `gaps` ms
/// apart (one chunk per token).
fn done(id: usize, start_ms: u64, ttft_ms: u64, gaps_ms: &[u64]) -> RequestRecord {
    let jct = ttft_ms + gaps_ms.iter().sum::<u64>();
    RequestRecord {
        id,
        chain: id,
        turn: 0,
        scheduled_us: start_ms * 1000,
        start_us: start_ms * 1000,
        ttft_us: Some(ttft_ms * 1000),
        itl_us: gaps_ms.iter().map(|g| g * 1000).collect(),
        jct_us: jct * 1000,
        input_tokens: 100,
        input_from_usage: true,
        cached_tokens: None,
        output_tokens: gaps_ms.len() as u64 + 1,
        chunks: gaps_ms.len() as u64 + 1,
        max_tokens: gaps_ms.len() as u64 + 1,
        outcome: Outcome::Ok,
        error: None,
    }
}

fn failed(id: usize, start_ms: u64, jct_ms: u64, outcome: Outcome) -> RequestRecord {
    RequestRecord {
        ttft_us: None,
        itl_us: vec![],
        jct_us: jct_ms * 1000,
        output_tokens: 0,
        chunks: 0,
        outcome,
        error: Some("x".into()),
        ..done(id, start_ms, 0, &[])
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// The live side (`Stats`, in ms) and the simulated side (`baton_sim::Percentiles`, whole µs)
/// give the same p50 / p90 / p99 for the same samples: the one definition of
/// `baton_measure::percentile`, the simulator's rounded to its clock's microsecond. The samples
/// are ones where nearest rank, rounded and floored ranks all give other figures.
#[test]
fn bench_and_sim_report_the_same_percentiles() {
    let samples_us: Vec<u64> =
        vec![1_000, 1_250, 1_900, 2_000, 2_500, 3_100, 4_000, 5_200, 7_700, 12_300, 20_000, 31_000, 40_001];
    for n in [1, 2, 3, 4, 7, 10, 13] {
        let us = &samples_us[..n];
        let live = Stats::of(&us.iter().map(|&t| t as f64 / 1e3).collect::<Vec<_>>());
        let sim = baton_sim::Percentiles::of(us.iter().rev().copied().collect());
        for (q, l, s) in [(50, live.p50, sim.p50), (90, live.p90, sim.p90), (99, live.p99, sim.p99)] {
            assert!((l * 1e3 - s as f64).abs() <= 0.5 + 1e-6, "{n} samples, p{q}: live {l} ms, sim {s} µs");
        }
        assert_eq!((live.count, live.max * 1e3), (sim.count, sim.max as f64));
    }
    // p90 of the first ten: h = 0.9 · 9 = 8.1, 7,700 + 0.1 · (12,300 − 7,700) = 8,160 µs (what
    // `np.percentile` says); nearest rank, the floored and the rounded rank all say 7,700.
    let ten = &samples_us[..10];
    assert!(close(percentile(ten, 90.0), 8_160.0));
    assert!(close(Stats::of(&ten.iter().map(|&t| t as f64 / 1e3).collect::<Vec<_>>()).p90, 8.16));
    assert_eq!(baton_sim::Percentiles::of(ten.to_vec()).p90, 8_160);
}

#[test]
fn a_hand_made_timeline() {
    // Three requests over one second:
    //   r0: sent 0, TTFT 100, gaps 10 10 10        -> JCT 130, 4 tokens, TPOT 10
    //   r1: sent 200, TTFT 300, gaps 50 50         -> JCT 400, 3 tokens, TPOT 50
    //   r2: sent 500, rejected with 429 after 5 ms
    //   r3: sent 600, TTFT 50, gaps 20 20 20 20 20 -> ends at 750, 6 tokens, TPOT 20
    // First send 0, last end 750 (r1 ends at 600 too): duration 0.75 s.
    let records = vec![
        done(0, 0, 100, &[10, 10, 10]),
        done(1, 200, 300, &[50, 50]),
        failed(2, 500, 5, Outcome::Rejected),
        done(3, 600, 50, &[20, 20, 20, 20, 20]),
    ];
    let s = summarize(&records, &Slo::default(), 0);
    assert_eq!((s.sent, s.completed), (4, 3));
    assert_eq!(s.outcomes.get("ok"), Some(&3));
    assert_eq!(s.outcomes.get("rejected_429"), Some(&1));
    assert!(close(s.duration_s, 0.75));
    assert_eq!(s.output_tokens, 4 + 3 + 6);
    assert_eq!(s.input_tokens, 300);
    assert!(close(s.output_throughput, 13.0 / 0.75));
    assert!(close(s.request_throughput, 3.0 / 0.75));
    assert!(close(s.total_token_throughput, 313.0 / 0.75));
    // TTFT over completed requests: 50, 100, 300.
    assert!(close(s.ttft_ms.mean, 150.0) && close(s.ttft_ms.p50, 100.0));
    assert!(close(s.ttft_ms.p90, 260.0), "{}", s.ttft_ms.p90);
    // TPOT per request: 10, 50, 20.
    assert!(close(s.tpot_ms.mean, 80.0 / 3.0) && close(s.tpot_ms.p50, 20.0));
    // ITL pooled: 10 x3, 50 x2, 20 x5 -> 10 gaps, mean (30 + 100 + 100) / 10.
    assert_eq!(s.itl_ms.count, 10);
    assert!(close(s.itl_ms.mean, 23.0) && close(s.itl_ms.p50, 20.0) && close(s.itl_ms.max, 50.0));
    // JCT: 130, 400, 150.
    assert!(close(s.jct_ms.p50, 150.0) && close(s.jct_ms.max, 400.0));
    assert!(s.slo.is_none());
    // TTFT never exceeds JCT, per request.
    for r in records.iter().filter(|r| r.ok()) {
        assert!(r.ttft_us.expect("ttft") <= r.jct_us);
    }
}

#[test]
fn slo_attainment_and_goodput_count_only_requests_meeting_both() {
    let records = vec![
        done(0, 0, 100, &[10, 10, 10]),          // meets both
        done(1, 200, 300, &[50, 50]),            // misses TTFT and TBT
        failed(2, 500, 5, Outcome::Rejected),    // rejected: counts for nothing
        done(3, 600, 50, &[20, 20, 20, 20, 20]), // TPOT 20: meets both at TBT 25
        failed(4, 700, 50, Outcome::Timeout),    // ends at 750 too
    ];
    let slo = Slo { ttft_ms: Some(200.0), tbt_ms: Some(25.0), tbt_stat: TbtStat::Mean };
    let s = summarize(&records, &slo, 0);
    let x = s.slo.expect("slo summary");
    assert_eq!(x.met, 2);
    assert!(close(x.attainment, 2.0 / 5.0));
    assert!(close(x.goodput_req_s, 2.0 / 0.75));
    assert_eq!(s.outcomes.get("timeout"), Some(&1));

    // The TTFT target alone: r1 (300 ms) misses.
    let only_ttft = Slo { ttft_ms: Some(200.0), ..Slo::default() };
    assert_eq!(summarize(&records, &only_ttft, 0).slo.expect("slo").met, 2);
    // TBT by the longest gap: a request with one slow gap misses although its mean is fine.
    let spiky = vec![done(0, 0, 10, &[5, 5, 5, 5, 80])];
    let mean = Slo { tbt_ms: Some(30.0), ..Slo::default() };
    let max = Slo { tbt_ms: Some(30.0), tbt_stat: TbtStat::Max, ..Slo::default() };
    assert_eq!(summarize(&spiky, &mean, 0).slo.expect("slo").met, 1);
    assert_eq!(summarize(&spiky, &max, 0).slo.expect("slo").met, 0);
    // A floor on the duration (the run's wall time) lowers the rates.
    let s = summarize(&records, &slo, 2_000_000);
    assert!(close(s.slo.expect("slo").goodput_req_s, 1.0));
}

#[test]
fn in_flight_timeline_counts_overlaps() {
    // r0 [0, 130), r1 [200, 600), r3 [600, 750): r1's end and r3's start coincide.
    let records = vec![done(0, 0, 100, &[10, 10, 10]), done(1, 200, 300, &[50, 50]), done(3, 600, 50, &[100])];
    let t = in_flight(&records);
    assert_eq!(t, vec![(0, 1), (130_000, 0), (200_000, 1), (600_000, 1), (750_000, 0)]);
    let s = summarize(&records, &Slo::default(), 0);
    assert_eq!(s.max_in_flight, 1);
    let overlapping = vec![done(0, 0, 100, &[]), done(1, 10, 100, &[]), done(2, 20, 10, &[])];
    assert_eq!(summarize(&overlapping, &Slo::default(), 0).max_in_flight, 3);
}

#[test]
fn outcome_kinds() {
    assert_eq!(Outcome::Http { status: 503 }.kind(), "http_503");
    assert_eq!(Outcome::Rejected.kind(), "rejected_429");
    let json = serde_json::to_string(&Outcome::Http { status: 500 }).expect("serializes");
    assert_eq!(serde_json::from_str::<Outcome>(&json).expect("parses"), Outcome::Http { status: 500 });
}
