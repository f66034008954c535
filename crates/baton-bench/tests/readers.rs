//! The workload readers and generators on small fixtures (`tests/data/`): Mooncake traces,
//! ShareGPT files, synthetic lengths, sessions, arrival schedules.

use std::path::Path;

use baton_bench::arrival::{Arrival, schedule};
use baton_bench::workload::{
    self, LengthDist, MOONCAKE_BLOCK_TOKENS, Seeds, WorkloadSpec, parse_mooncake, parse_sharegpt, sessions, synthetic,
};

fn data(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name);
    std::fs::read_to_string(&path).expect("fixture exists")
}

fn word_count(s: &str) -> u64 {
    s.split_whitespace().count() as u64
}

#[test]
fn mooncake_trace_blocks_follow_hash_ids() {
    let w = parse_mooncake(&data("mooncake_small.jsonl"), None, None, 7).expect("parses");
    assert_eq!(w.chains.len(), 5);
    // Sorted by timestamp (ms -> µs).
    let arrivals: Vec<u64> = w.chains.iter().map(|c| c.arrival_us.expect("timestamp")).collect();
    assert_eq!(arrivals, vec![0, 125_000, 250_000, 1_000_000, 2_000_000]);
    let prompt = |i: usize| &w.chains[i].turns[0];
    // Lengths in words (about tokens) are the trace's input lengths; outputs are max_tokens.
    assert_eq!(word_count(&prompt(0).text), 1200);
    assert_eq!(prompt(0).max_tokens, 10);
    assert_eq!(prompt(1).max_tokens, 5);
    assert_eq!(word_count(&prompt(1).text), 600);
    // Requests 0 ([0,1,2]) and 2 ([0,1,3]) share the first two blocks exactly, then differ.
    let block = |s: &str, b: usize| -> String {
        s.split_whitespace()
            .skip(b * MOONCAKE_BLOCK_TOKENS as usize)
            .take(MOONCAKE_BLOCK_TOKENS as usize)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (a, c) = (&prompt(0).text, &prompt(2).text);
    let two_blocks = |s: &str| s.split_whitespace().take(1024).collect::<Vec<_>>().join(" ");
    assert_eq!(two_blocks(a), two_blocks(c));
    assert_ne!(block(a, 2), block(c, 2));
    // Request 3 is exactly blocks [0, 1] and a prefix of request 0 as text.
    assert!(a.starts_with(&prompt(3).text));
    assert_eq!(word_count(&prompt(3).text), 1024);
    // Request 1 ([0, 4], 600 tokens): block 0 shared, the partial block its own.
    assert_eq!(block(&prompt(1).text, 0), block(a, 0));
    // Same seed, same text; another seed, other text.
    let again = parse_mooncake(&data("mooncake_small.jsonl"), None, None, 7).expect("parses");
    assert_eq!(again, w);
    let other = parse_mooncake(&data("mooncake_small.jsonl"), None, None, 8).expect("parses");
    assert_ne!(other.chains[0].turns[0].text, w.chains[0].turns[0].text);
}

#[test]
fn mooncake_limits_and_errors() {
    let w = parse_mooncake(&data("mooncake_small.jsonl"), Some(2), None, 0).expect("parses");
    assert_eq!(w.requests(), 2);
    let w = parse_mooncake(&data("mooncake_small.jsonl"), None, Some(1100), 0).expect("parses");
    assert_eq!((w.requests(), w.skipped), (3, 2));
    let e = parse_mooncake("{\"timestamp\": 0}\n", None, None, 0).expect_err("missing fields");
    assert!(e.to_string().contains("line 1"), "{e}");
}

#[test]
fn mooncake_from_the_published_trace() {
    // The published trace, shipped in the repository.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/traces/synthetic_trace.jsonl");
    let text = std::fs::read_to_string(&path).expect("fixtures/traces/synthetic_trace.jsonl is in the repository");
    let w = parse_mooncake(&text, Some(50), None, 0).expect("parses");
    assert_eq!(w.requests(), 50);
    assert!(w.chains.windows(2).all(|p| p[0].arrival_us <= p[1].arrival_us));
}

#[test]
fn sharegpt_first_turns_and_sessions() {
    let text = data("sharegpt_small.json");
    let w = parse_sharegpt(&text, None, false, 3).expect("parses");
    // "c" has no answered turn.
    assert_eq!((w.chains.len(), w.skipped), (3, 1));
    assert!(w.chains.iter().all(|c| c.turns.len() == 1));
    let mut firsts: Vec<&str> = w.chains.iter().map(|c| c.turns[0].text.as_str()).collect();
    firsts.sort();
    assert_eq!(firsts, vec!["Count to three.", "Say hi.", "What is the capital of France?"]);
    let france = w.chains.iter().find(|c| c.turns[0].text.starts_with("What")).expect("conversation a");
    // Output length: the reply's characters / 4, rounded up.
    assert_eq!(
        france.turns[0].max_tokens,
        "The capital of France is Paris, a city on the Seine.".len().div_ceil(4) as u64
    );
    // Shuffled by seed, deterministically.
    assert_eq!(parse_sharegpt(&text, None, false, 3).expect("parses"), w);

    let m = parse_sharegpt(&text, None, true, 3).expect("parses");
    let france = m.chains.iter().find(|c| c.turns[0].text.starts_with("What")).expect("conversation a");
    assert_eq!(france.turns.len(), 2);
    assert_eq!(france.turns[1].text, "And of Italy?");
    assert_eq!(france.turns[1].max_tokens, 2);
    assert!(france.turns[1].input_tokens > france.turns[0].input_tokens);
    assert_eq!(m.requests(), 4);
    let capped = parse_sharegpt(&text, Some(2), true, 3).expect("parses");
    assert_eq!(capped.requests(), 2);
    assert!(parse_sharegpt("{", None, false, 0).is_err());
}

#[test]
fn synthetic_lengths_and_texts() {
    let w = synthetic(50, &LengthDist::Uniform { min: 10, max: 20 }, &LengthDist::Fixed(7), 1);
    assert_eq!(w.requests(), 50);
    for c in &w.chains {
        let t = &c.turns[0];
        assert!((10..=20).contains(&t.input_tokens));
        assert_eq!(word_count(&t.text), t.input_tokens);
        assert_eq!(t.max_tokens, 7);
    }
    assert_ne!(w.chains[0].turns[0].text, w.chains[1].turns[0].text);
    assert_eq!(w, synthetic(50, &LengthDist::Uniform { min: 10, max: 20 }, &LengthDist::Fixed(7), 1));
    let n = synthetic(2000, &LengthDist::Normal { mean: 100.0, std: 10.0 }, &LengthDist::Fixed(1), 2);
    let mean = n.chains.iter().map(|c| c.turns[0].input_tokens as f64).sum::<f64>() / 2000.0;
    assert!((mean - 100.0).abs() < 1.5, "mean {mean}");
    assert_eq!("uniform:4:8".parse::<LengthDist>(), Ok(LengthDist::Uniform { min: 4, max: 8 }));
    assert_eq!("normal:64:8".parse::<LengthDist>(), Ok(LengthDist::Normal { mean: 64.0, std: 8.0 }));
    assert_eq!("32".parse::<LengthDist>(), Ok(LengthDist::Fixed(32)));
    assert!("uniform:8:4".parse::<LengthDist>().is_err());
    assert!("0".parse::<LengthDist>().is_err());
}

#[test]
fn sessions_share_the_system_prompt() {
    let w = sessions(3, 4, 30, &LengthDist::Fixed(5), &LengthDist::Fixed(6), 9);
    assert_eq!(w.requests(), 12);
    let system: String = w.chains[0].turns[0].text.split_whitespace().take(30).collect::<Vec<_>>().join(" ");
    for c in &w.chains {
        assert!(c.turns[0].text.split_whitespace().take(30).collect::<Vec<_>>().join(" ") == system);
        assert_eq!(word_count(&c.turns[0].text), 35);
        assert_eq!(word_count(&c.turns[1].text), 5);
        // Targets: system + 5 per turn + 6 per earlier answer.
        assert_eq!(c.turns[2].input_tokens, 30 + 3 * 5 + 2 * 6);
    }
    let mut capped = w.clone();
    capped.truncate(6);
    assert_eq!((capped.chains.len(), capped.requests()), (2, 6));
    let built = workload::build(
        &WorkloadSpec::Sessions {
            sessions: 3,
            turns: 4,
            system_tokens: 30,
            turn_tokens: LengthDist::Fixed(5),
            output: LengthDist::Fixed(6),
        },
        9,
    )
    .expect("builds");
    assert_eq!(built, w);
}

#[test]
fn arrival_schedules() {
    let w = synthetic(2000, &LengthDist::Fixed(1), &LengthDist::Fixed(1), 0);
    let s = schedule(&Arrival::Poisson { rate: 10.0 }, &w, 5).expect("schedules");
    assert_eq!(s[0], 0);
    assert!(s.windows(2).all(|p| p[0] <= p[1]));
    // 1999 gaps of mean 100 ms.
    let mean_gap = s[1999] as f64 / 1999.0 / 1e3;
    assert!((mean_gap - 100.0).abs() < 8.0, "mean gap {mean_gap} ms");
    assert_eq!(s, schedule(&Arrival::Poisson { rate: 10.0 }, &w, 5).expect("schedules"));
    assert_ne!(s, schedule(&Arrival::Poisson { rate: 10.0 }, &w, 6).expect("schedules"));
    assert!(schedule(&Arrival::Closed { concurrency: 4 }, &w, 0).expect("schedules").iter().all(|&t| t == 0));
    assert!(schedule(&Arrival::Trace { time_scale: 1.0 }, &w, 0).is_err(), "no timestamps");
    assert!(schedule(&Arrival::Poisson { rate: 0.0 }, &w, 0).is_err());
    // A seed's arrivals are the ones it gave before they came from `baton_measure::Poisson`.
    let six = synthetic(6, &LengthDist::Fixed(8), &LengthDist::Fixed(4), 1);
    assert_eq!(
        schedule(&Arrival::Poisson { rate: 3.0 }, &six, 11).expect("schedules"),
        [0, 139_976, 997_199, 1_081_051, 1_818_935, 1_903_018]
    );

    let trace = parse_mooncake(&data("mooncake_small.jsonl"), None, None, 0).expect("parses");
    let t = schedule(&Arrival::Trace { time_scale: 2.0 }, &trace, 0).expect("schedules");
    assert_eq!(t, vec![0, 62_500, 125_000, 500_000, 1_000_000]);
}

#[test]
fn each_run_of_a_sweep_has_the_same_lengths_and_fresh_texts() {
    let spec = |n| WorkloadSpec::Synthetic {
        requests: n,
        input: LengthDist::Uniform { min: 10, max: 40 },
        output: LengthDist::Uniform { min: 1, max: 9 },
    };
    let first = workload::build(&spec(20), Seeds::for_run(5, 0)).expect("builds");
    assert_eq!(first, workload::build(&spec(20), 5).expect("builds"), "run 0 is the plain seed");
    let second = workload::build(&spec(20), Seeds::for_run(5, 1)).expect("builds");
    let third = workload::build(&spec(20), Seeds::for_run(5, 2)).expect("builds");
    for w in [&second, &third] {
        for (a, b) in first.chains.iter().zip(&w.chains) {
            let (ta, tb) = (&a.turns[0], &b.turns[0]);
            assert_eq!((ta.input_tokens, ta.max_tokens), (tb.input_tokens, tb.max_tokens), "same lengths");
            assert_eq!(word_count(&ta.text), word_count(&tb.text));
            let first_words = |t: &str| t.split_whitespace().take(4).collect::<Vec<_>>().join(" ");
            assert_ne!(first_words(&ta.text), first_words(&tb.text), "no prefix shared across runs");
        }
    }
    assert_ne!(second, third);

    // Sessions: within a run the system prompt is still shared; across runs it is not.
    let sessions_of = |run| {
        let spec = WorkloadSpec::Sessions {
            sessions: 2,
            turns: 2,
            system_tokens: 30,
            turn_tokens: LengthDist::Fixed(5),
            output: LengthDist::Fixed(6),
        };
        workload::build(&spec, Seeds::for_run(9, run)).expect("builds")
    };
    let system = |w: &workload::Workload, c: usize| -> String {
        w.chains[c].turns[0].text.split_whitespace().take(30).collect::<Vec<_>>().join(" ")
    };
    let (a, b) = (sessions_of(0), sessions_of(1));
    assert_eq!(system(&b, 0), system(&b, 1));
    assert_ne!(system(&a, 0), system(&b, 0));

    // Mooncake: equal hash ids still give equal blocks within a run, not across runs.
    let trace = data("mooncake_small.jsonl");
    let m0 = parse_mooncake(&trace, None, None, Seeds::for_run(7, 0)).expect("parses");
    let m1 = parse_mooncake(&trace, None, None, Seeds::for_run(7, 1)).expect("parses");
    assert_eq!(m0, parse_mooncake(&trace, None, None, 7).expect("parses"));
    assert_ne!(m0.chains[0].turns[0].text, m1.chains[0].turns[0].text);
}
