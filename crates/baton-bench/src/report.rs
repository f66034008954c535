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
