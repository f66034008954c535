//! The JSON report (configuration, per-request records, summary per run) and the text tables
//! printed from it, pure.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::arrival::Arrival;
use crate::metrics::{RequestRecord, Stats, Summary};
use crate::{BenchConfig, BenchError};

/// Everything a benchmark measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// `baton-bench`.
    pub tool: String,
    /// The crate's version.
    pub version: String,
    /// The model the requests named.
    pub model: String,
    /// The configuration (without the API key).
    pub config: BenchConfig,
    /// Requests the workload had (before the duration bound).
    pub workload_requests: usize,
    /// One run per arrival process (several for a sweep).
    pub runs: Vec<RunReport>,
}

/// One run: one arrival process over the whole workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// A short name (`rate 2/s`, `concurrency 4`).
    pub label: String,
    /// The arrival process.
    pub arrival: Arrival,
    /// The figures.
    pub summary: Summary,
    /// Every request, by id.
    pub records: Vec<RequestRecord>,
}

impl Report {
    /// Reads a report written by [`Report::write`].
    pub fn read(path: &Path) -> Result<Report, BenchError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| BenchError::Io { path: path.to_path_buf(), source })?;
        serde_json::from_str(&text).map_err(|e| BenchError::Parse {
            what: format!("report {}", path.display()),
            line: e.line(),
            message: e.to_string(),
        })
    }

    /// Writes the report as pretty JSON.
    pub fn write(&self, path: &Path) -> Result<(), BenchError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| BenchError::Config(e.to_string()))?;
        std::fs::write(path, text).map_err(|source| BenchError::Io { path: path.to_path_buf(), source })
    }
}

/// Which way a metric is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    /// Smaller is better (latencies).
    Lower,
    /// Larger is better (throughput, attainment).
    Higher,
    /// Neither (counts, duration).
    Neither,
}

/// One row of a table: a name, a value and which way is better.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The metric.
    pub name: String,
    /// Its value.
    pub value: f64,
    /// Which way is better.
    pub better: Better,
}

fn stats_rows(rows: &mut Vec<Row>, name: &str, s: &Stats) {
    for (q, v) in [("mean", s.mean), ("p50", s.p50), ("p90", s.p90), ("p99", s.p99)] {
        rows.push(Row { name: format!("{name} {q} (ms)"), value: v, better: Better::Lower });
    }
}

/// The rows of a summary, in display order.
pub fn rows(s: &Summary) -> Vec<Row> {
    let row = |name: &str, value: f64, better| Row { name: name.into(), value, better };
    let mut r = vec![
        row("requests sent", s.sent as f64, Better::Neither),
        row("requests completed", s.completed as f64, Better::Higher),
        row("requests failed", (s.sent - s.completed) as f64, Better::Lower),
    ];
    for (kind, n) in s.outcomes.iter().filter(|(k, _)| k.as_str() != "ok") {
        r.push(row(&format!("  {kind}"), *n as f64, Better::Lower));
    }
    r.extend([
        row("duration (s)", s.duration_s, Better::Neither),
        row("input tokens", s.input_tokens as f64, Better::Neither),
        row("output tokens", s.output_tokens as f64, Better::Neither),
        row("request throughput (req/s)", s.request_throughput, Better::Higher),
        row("output throughput (tok/s)", s.output_throughput, Better::Higher),
        row("total token throughput (tok/s)", s.total_token_throughput, Better::Higher),
        row("max in flight", s.max_in_flight as f64, Better::Neither),
    ]);
    stats_rows(&mut r, "TTFT", &s.ttft_ms);
    stats_rows(&mut r, "TPOT", &s.tpot_ms);
    stats_rows(&mut r, "ITL", &s.itl_ms);
    stats_rows(&mut r, "JCT", &s.jct_ms);
    if let Some(slo) = &s.slo {
        let limit = |x: Option<f64>| x.map_or_else(|| "-".to_owned(), |v| format!("{v}"));
        let name = format!("SLO attainment (%) [TTFT {} ms, TBT {} ms]", limit(slo.slo.ttft_ms), limit(slo.slo.tbt_ms));
        r.push(row(&name, slo.attainment * 100.0, Better::Higher));
        r.push(row("goodput (req/s)", slo.goodput_req_s, Better::Higher));
    }
    r
}

fn fmt_value(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e12 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A table of every run of a report: metrics as rows, runs as columns.
pub fn summary_table(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "baton bench serve: {} ({}), {} requests per run",
        report.config.url, report.model, report.workload_requests
    );
    let columns: Vec<(String, Vec<Row>)> = report.runs.iter().map(|r| (r.label.clone(), rows(&r.summary))).collect();
    write_table(&mut out, &columns);
    out
}

fn write_table(out: &mut String, columns: &[(String, Vec<Row>)]) {
    // Rows are matched by name: runs with different outcome kinds have different rows.
    let mut names: Vec<String> = Vec::new();
    for (_, rows) in columns {
        for r in rows {
            if !names.contains(&r.name) {
                names.push(r.name.clone());
            }
        }
    }
    let width = names.iter().map(|n| n.chars().count()).max().unwrap_or(0).max(6);
    let col = columns.iter().map(|(h, _)| h.chars().count()).max().unwrap_or(0).max(10);
    let _ = write!(out, "{:width$}", "");
    for (h, _) in columns {
        let _ = write!(out, "  {h:>col$}");
    }
    out.push('\n');
    for name in &names {
        let _ = write!(out, "{name:width$}");
        for (_, rows) in columns {
            let v = rows.iter().find(|r| &r.name == name).map_or_else(|| "-".to_owned(), |r| fmt_value(r.value));
            let _ = write!(out, "  {v:>col$}");
        }
        out.push('\n');
    }
}

/// One figure of a rate sweep compared across reports (the headline comparison's four): its
/// name, unit, which way is better, and how to read it from a run's summary (`None` where the
/// run has no such figure, e.g. goodput without SLOs).
#[derive(Clone, Copy)]
pub struct SweepFigure {
    /// Name, e.g. `TTFT p90`.
    pub name: &'static str,
    /// Unit, e.g. `ms`.
    pub unit: &'static str,
    /// Which way is better.
    pub better: Better,
    /// The value of a run.
    pub pick: fn(&Summary) -> Option<f64>,
}

/// P90 per-request TTFT, TBT (a request's mean gap between tokens, TPOT) and JCT, and goodput:
/// the figures of KVDirect's Figure 13 plus Mooncake's goodput.
pub const SWEEP_FIGURES: [SweepFigure; 4] = [
    SweepFigure { name: "TTFT p90", unit: "ms", better: Better::Lower, pick: |s| Some(s.ttft_ms.p90) },
    SweepFigure {
        name: "TBT p90 (per-request TPOT)",
        unit: "ms",
        better: Better::Lower,
        pick: |s| Some(s.tpot_ms.p90),
    },
    SweepFigure { name: "JCT p90", unit: "ms", better: Better::Lower, pick: |s| Some(s.jct_ms.p90) },
    SweepFigure { name: "goodput", unit: "req/s", better: Better::Higher, pick: |s| s.slo.map(|x| x.goodput_req_s) },
];

/// The runs of a report at Poisson rates, sorted by rate.
pub fn sweep_runs(report: &Report) -> Vec<(f64, &Summary)> {
    let mut v: Vec<(f64, &Summary)> = report
        .runs
        .iter()
        .filter_map(|r| match r.arrival {
            Arrival::Poisson { rate } => Some((rate, &r.summary)),
            _ => None,
        })
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// Rate sweeps of several reports (e.g. colocated and disaggregated serving) side by side: for
/// each of [`SWEEP_FIGURES`], one line per rate with every report's value and the best one's
/// name where it beats every other by more than 5%. Rates are matched by value; a report without
/// a rate shows `-`.
pub fn sweep_table(reports: &[(&str, &Report)]) -> String {
    let mut out = String::new();
    let runs: Vec<Vec<(f64, &Summary)>> = reports.iter().map(|(_, r)| sweep_runs(r)).collect();
    let mut rates: Vec<f64> = runs.iter().flatten().map(|p| p.0).collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    let col = reports.iter().map(|(n, _)| n.chars().count()).max().unwrap_or(0).max(10);
    for fig in SWEEP_FIGURES {
        let _ = writeln!(out, "{} ({})", fig.name, fig.unit);
        let _ = write!(out, "  {:>12}", "rate (req/s)");
        for (name, _) in reports {
            let _ = write!(out, "  {name:>col$}");
        }
        let _ = writeln!(out, "  best");
        for &rate in &rates {
            let values: Vec<Option<f64>> =
                runs.iter().map(|r| r.iter().find(|p| p.0 == rate).and_then(|p| (fig.pick)(p.1))).collect();
            let _ = write!(out, "  {:>12}", fmt_value(rate));
            for v in &values {
                let _ = write!(out, "  {:>col$}", v.map_or_else(|| "-".to_owned(), fmt_value));
            }
            let best = clear_winner(&values, fig.better).map_or("", |i| reports[i].0);
            let _ = writeln!(out, "  {best}");
        }
        out.push('\n');
    }
    out.push_str("(best: the report that beats every other by more than 5%)\n");
    out
}

/// The index of the value that is better than every other by more than 5%, if any.
fn clear_winner(values: &[Option<f64>], better: Better) -> Option<usize> {
    let known: Vec<(usize, f64)> = values.iter().enumerate().filter_map(|(i, v)| v.map(|v| (i, v))).collect();
    if known.len() < 2 {
        return None;
    }
    let beats = |x: f64, y: f64| match better {
        Better::Lower => x < y * 0.95,
        Better::Higher => x > y * 1.05,
        Better::Neither => false,
    };
    known.iter().find(|&&(i, x)| known.iter().all(|&(j, y)| i == j || beats(x, y))).map(|p| p.0)
}

/// A side-by-side table of two reports, run by run (matched in order): A, B, and B/A with a
/// mark on the better side.
pub fn compare_table(a: &Report, b: &Report, name_a: &str, name_b: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "A: {name_a} ({}, {})", a.config.url, a.model);
    let _ = writeln!(out, "B: {name_b} ({}, {})", b.config.url, b.model);
    if a.runs.len() != b.runs.len() {
        let _ = writeln!(out, "note: A has {} runs, B has {}; comparing the first {}", a.runs.len(), b.runs.len(), {
            a.runs.len().min(b.runs.len())
        });
    }
    for (ra, rb) in a.runs.iter().zip(&b.runs) {
        let _ = writeln!(out, "\n{} | {}", ra.label, rb.label);
        let rows_a = rows(&ra.summary);
        let rows_b = rows(&rb.summary);
        let width = rows_a.iter().chain(&rows_b).map(|r| r.name.chars().count()).max().unwrap_or(0);
        let _ = writeln!(out, "{:width$}  {:>12}  {:>12}  {:>8}", "", "A", "B", "B/A");
        let mut names: Vec<&Row> = rows_a.iter().collect();
        for r in &rows_b {
            if !rows_a.iter().any(|x| x.name == r.name) {
                names.push(r);
            }
        }
        for r in names {
            let va = rows_a.iter().find(|x| x.name == r.name).map(|x| x.value);
            let vb = rows_b.iter().find(|x| x.name == r.name).map(|x| x.value);
            let show = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), fmt_value);
            let (ratio, mark) = match (va, vb) {
                (Some(x), Some(y)) if x != 0.0 => {
                    let ratio = y / x;
                    let mark = match r.better {
                        Better::Lower if ratio < 0.95 => " B",
                        Better::Lower if ratio > 1.05 => " A",
                        Better::Higher if ratio > 1.05 => " B",
                        Better::Higher if ratio < 0.95 => " A",
                        _ => "",
                    };
                    (format!("{ratio:.2}"), mark)
                }
                _ => ("-".to_owned(), ""),
            };
            let _ = writeln!(out, "{:width$}  {:>12}  {:>12}  {:>8}{mark}", r.name, show(va), show(vb), ratio);
        }
    }
    out.push_str("\n(A or B after a ratio marks the better side when they differ by more than 5%)\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Slo, SloSummary, summarize};

    /// A report with one Poisson run per (rate, TTFT p90, TPOT p90, JCT p90, goodput).
    fn sweep(points: &[(f64, f64, f64, f64, Option<f64>)]) -> Report {
        let runs = points
            .iter()
            .map(|&(rate, ttft, tbt, jct, goodput)| {
                let mut summary = summarize(&[], &Slo::default(), 0);
                summary.ttft_ms.p90 = ttft;
                summary.tpot_ms.p90 = tbt;
                summary.jct_ms.p90 = jct;
                summary.slo =
                    goodput.map(|g| SloSummary { slo: Slo::default(), met: 0, attainment: 0.0, goodput_req_s: g });
                RunReport {
                    label: format!("rate {rate}/s"),
                    arrival: Arrival::Poisson { rate },
                    summary,
                    records: Vec::new(),
                }
            })
            .collect();
        Report {
            tool: "baton-bench".into(),
            version: "0".into(),
            model: "m".into(),
            config: BenchConfig::new("http://127.0.0.1:1"),
            workload_requests: 0,
            runs,
        }
    }

    #[test]
    fn sweep_table_matches_rates_and_names_clear_winners() {
        let colocated = sweep(&[(2.0, 100.0, 20.0, 900.0, Some(1.9)), (4.0, 300.0, 40.0, 2000.0, Some(2.5))]);
        // Rates out of order and one extra: matched by value, missing ones shown as "-".
        let disagg = sweep(&[
            (8.0, 900.0, 12.0, 3000.0, Some(3.0)),
            (4.0, 310.0, 12.0, 1000.0, Some(3.8)),
            (2.0, 150.0, 12.5, 880.0, Some(1.9)),
        ]);
        let table = sweep_table(&[("colocated", &colocated), ("disagg", &disagg)]);
        let line = |fig: &str, rate: &str| -> Vec<String> {
            let block = table.split("\n\n").find(|b| b.starts_with(fig)).unwrap_or_else(|| panic!("{fig} in\n{table}"));
            let row = block.lines().find(|l| l.split_whitespace().next() == Some(rate)).expect("rate row");
            row.split_whitespace().map(str::to_owned).collect()
        };
        assert_eq!(line("TTFT p90", "2"), ["2", "100", "150", "colocated"]);
        assert_eq!(line("TTFT p90", "4"), ["4", "300", "310"], "within 5%: no winner");
        assert_eq!(line("TTFT p90", "8"), ["8", "-", "900"], "one value: no winner");
        assert_eq!(line("TBT p90", "4"), ["4", "40", "12", "disagg"]);
        assert_eq!(line("JCT p90", "2"), ["2", "900", "880"]);
        assert_eq!(line("goodput", "4"), ["4", "2.50", "3.80", "disagg"], "higher is better");
        let rates: Vec<_> = table.lines().skip(2).take(3).map(|l| l.split_whitespace().next().unwrap_or("")).collect();
        assert_eq!(rates, ["2", "4", "8"], "sorted by rate");
    }

    #[test]
    fn a_missing_figure_names_no_winner() {
        assert_eq!(clear_winner(&[None, Some(1.0)], Better::Lower), None);
        assert_eq!(clear_winner(&[Some(1.0), Some(2.0), Some(1.02)], Better::Lower), None);
        assert_eq!(clear_winner(&[Some(3.0), Some(2.0), Some(1.0)], Better::Higher), Some(0));
        assert_eq!(clear_winner(&[Some(1.0), Some(2.0)], Better::Neither), None);
    }
}
