//! `baton bench serve` and `baton bench compare`: the load generator against any
//! OpenAI-compatible server, a thin shell over `baton-bench` (arguments in, report, table and
//! plots out).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use baton_bench::arrival::Arrival;
use baton_bench::client::Endpoint;
use baton_bench::metrics::{Slo, TbtStat};
use baton_bench::report::{Report, compare_table, summary_table, sweep_runs, sweep_table};
use baton_bench::runner::{Observer, Quiet};
use baton_bench::workload::{LengthDist, WorkloadSpec};
use baton_bench::{BenchConfig, progress::ProgressBars};

/// The kinds of workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum WorkloadKind {
    /// Independent requests with --input-len / --output-len tokens.
    Synthetic,
    /// --sessions sessions of --turns causal turns sharing a --system-len system prompt.
    Sessions,
    /// A ShareGPT-format JSON file (--dataset).
    Sharegpt,
    /// A Mooncake-format trace (--dataset); replayed at its timestamps unless a rate or a
    /// concurrency is given.
    Mooncake,
}

/// Arguments of `baton bench serve`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  baton bench serve --num-requests 64 --input-len 256 --output-len 64 --ignore-eos --rate 2
  baton bench serve --rates 1,2,4,8 --slo-ttft-ms 500 --slo-tbt-ms 50 --ignore-eos
  baton bench serve --workload sessions --sessions 8 --turns 4 --concurrency 4 --endpoint chat
  baton bench serve --workload mooncake --dataset fixtures/traces/synthetic_trace.jsonl \\
      --time-scale 2 --max-input-len 4096 --num-requests 200
  baton bench compare .bench/a/report.json .bench/b/report.json")]
pub(crate) struct ServeBenchArgs {
    /// The server's root URL (a trailing /v1 is accepted).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Another replica of the server (a second conductor routing to the same workers); repeat
    /// for more. Requests go to --url and each replica in turn, as a round-robin load balancer
    /// in front of them would send them.
    #[arg(long = "replica", value_name = "URL")]
    replicas: Vec<String>,
    /// API: completions (/v1/completions) or chat (/v1/chat/completions).
    #[arg(long, default_value = "completions")]
    endpoint: Endpoint,
    /// Model id to send (default: the first model the server lists).
    #[arg(long)]
    model: Option<String>,
    /// Bearer token for the server.
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    api_key: Option<String>,

    /// What to send.
    #[arg(long, value_enum, default_value = "synthetic", help_heading = "Workload")]
    workload: WorkloadKind,
    /// The ShareGPT or Mooncake file.
    #[arg(long, help_heading = "Workload")]
    dataset: Option<PathBuf>,
    /// Most requests per run (the synthetic workload has exactly this many).
    #[arg(long, default_value_t = 100, help_heading = "Workload")]
    num_requests: usize,
    /// Prompt tokens of synthetic requests: N, uniform:MIN:MAX or normal:MEAN:STD. Prompts are
    /// common English words, about one token each.
    #[arg(long, default_value = "128", help_heading = "Workload")]
    input_len: LengthDist,
    /// Output tokens (max_tokens) of synthetic requests and session turns: N, uniform:MIN:MAX or
    /// normal:MEAN:STD. Add --ignore-eos for exact lengths.
    #[arg(long, default_value = "128", help_heading = "Workload")]
    output_len: LengthDist,
    /// Sessions of the sessions workload.
    #[arg(long, default_value_t = 8, help_heading = "Workload")]
    sessions: usize,
    /// Turns per session; turn k+1 is sent after turn k's answer, with the whole conversation.
    #[arg(long, default_value_t = 4, help_heading = "Workload")]
    turns: usize,
    /// Tokens of the system prompt every session shares.
    #[arg(long, default_value_t = 512, help_heading = "Workload")]
    system_len: u64,
    /// Tokens of user text each turn adds: N, uniform:MIN:MAX or normal:MEAN:STD.
    #[arg(long, default_value = "64", help_heading = "Workload")]
    turn_len: LengthDist,
    /// ShareGPT: send every turn of a conversation as a causal session (default: first turns).
    #[arg(long, help_heading = "Workload")]
    multi_turn: bool,
    /// Mooncake: leave out requests with longer prompts.
    #[arg(long, help_heading = "Workload")]
    max_input_len: Option<u64>,
    /// Pause between an answer and the session's next turn, ms.
    #[arg(long, default_value_t = 0.0, help_heading = "Workload")]
    think_time_ms: f64,

    /// Poisson arrivals at this many requests (sessions) per second; "inf" sends all at once.
    #[arg(long, conflicts_with_all = ["rates", "concurrency"], help_heading = "Arrivals")]
    rate: Option<String>,
    /// A sweep: one run per rate, comma-separated (e.g. 1,2,4,inf).
    #[arg(long, value_delimiter = ',', conflicts_with = "concurrency", help_heading = "Arrivals")]
    rates: Vec<String>,
    /// Closed loop: keep this many requests in flight; comma-separated for a sweep.
    #[arg(long, value_delimiter = ',', help_heading = "Arrivals")]
    concurrency: Vec<usize>,
    /// Mooncake trace replay speed-up (2 replays twice as fast).
    #[arg(long, default_value_t = 1.0, help_heading = "Arrivals")]
    time_scale: f64,
    /// Most requests in flight in open-loop runs (rates, trace).
    #[arg(long, help_heading = "Arrivals")]
    max_concurrency: Option<usize>,

    /// Send nothing new after this many seconds of a run (in-flight requests finish).
    #[arg(long, help_heading = "Bounds")]
    duration_s: Option<f64>,
    /// Limit of one request, from sending to its last chunk, seconds.
    #[arg(long, default_value_t = 300.0, help_heading = "Bounds")]
    request_timeout_s: f64,
    /// Limit of making a connection, seconds.
    #[arg(long, default_value_t = 10.0, help_heading = "Bounds")]
    connect_timeout_s: f64,
    /// Benchmark a server that is not on this machine.
    #[arg(long, help_heading = "Bounds")]
    allow_remote: bool,

    /// Send ignore_eos: true so every answer is exactly max_tokens long (Baton, vLLM).
    #[arg(long, help_heading = "Requests")]
    ignore_eos: bool,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0, help_heading = "Requests")]
    temperature: f64,
    /// Seed of lengths, texts, arrivals and sampling.
    #[arg(long, default_value_t = 0, help_heading = "Requests")]
    seed: u64,

    /// TTFT target, ms: SLO attainment and goodput count requests that completed within it.
    #[arg(long, help_heading = "SLOs")]
    slo_ttft_ms: Option<f64>,
    /// Time-between-tokens target, ms.
    #[arg(long, help_heading = "SLOs")]
    slo_tbt_ms: Option<f64>,
    /// What --slo-tbt-ms bounds per request: mean (TPOT), p90 or max of its gaps.
    #[arg(long, default_value = "mean", help_heading = "SLOs")]
    slo_tbt_stat: TbtStat,

    /// Directory for report.json and the plots.
    #[arg(long, default_value = ".bench/serve", help_heading = "Output")]
    out_dir: PathBuf,
    /// Skip the plots.
    #[arg(long, help_heading = "Output")]
    no_plots: bool,
    /// No progress bar.
    #[arg(long, help_heading = "Output")]
    no_progress: bool,
    /// Print the summaries as JSON instead of a table.
    #[arg(long, help_heading = "Output")]
    json: bool,
}

/// Arguments of `baton bench compare`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  baton bench compare .bench/a/report.json .bench/b/report.json
  baton bench compare colocated/report.json disaggregated/report.json elastic/report.json \\
      --names colocated,disaggregated,elastic --plot .bench/versus")]
pub(crate) struct CompareArgs {
    /// The reports, two or more. With two, run by run side by side (A, B and B/A); with rate
    /// sweeps, every report by rate.
    #[arg(required = true, num_args = 2.., value_name = "REPORT")]
    reports: Vec<PathBuf>,
    /// Names of the reports in the tables and plots, comma-separated, one per report (default:
    /// the file paths).
    #[arg(long, value_delimiter = ',')]
    names: Vec<String>,
    /// When the reports are rate sweeps: also draw TTFT, TBT and JCT p90 and goodput against
    /// the rate, one line per report, as versus.png and versus.svg in this directory.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
}

fn parse_rate(s: &str) -> anyhow::Result<Arrival> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("inf") {
        return Ok(Arrival::Burst);
    }
    let rate: f64 = s.parse().with_context(|| format!("bad rate {s:?}: expected a number or inf"))?;
    Ok(Arrival::Poisson { rate })
}

impl ServeBenchArgs {
    fn config(&self) -> anyhow::Result<BenchConfig> {
        let dataset =
            || self.dataset.clone().with_context(|| format!("--workload {:?} needs --dataset FILE", self.workload));
        let workload = match self.workload {
            WorkloadKind::Synthetic => {
                WorkloadSpec::Synthetic { requests: self.num_requests, input: self.input_len, output: self.output_len }
            }
            WorkloadKind::Sessions => WorkloadSpec::Sessions {
                sessions: self.sessions,
                turns: self.turns,
                system_tokens: self.system_len,
                turn_tokens: self.turn_len,
                output: self.output_len,
            },
            WorkloadKind::Sharegpt => {
                WorkloadSpec::ShareGpt { path: dataset()?, requests: None, multi_turn: self.multi_turn }
            }
            WorkloadKind::Mooncake => {
                WorkloadSpec::Mooncake { path: dataset()?, requests: None, max_input_tokens: self.max_input_len }
            }
        };
        let mut arrivals: Vec<Arrival> = Vec::new();
        for r in self.rate.iter().chain(&self.rates) {
            arrivals.push(parse_rate(r)?);
        }
        arrivals.extend(self.concurrency.iter().map(|&c| Arrival::Closed { concurrency: c }));
        if arrivals.is_empty() {
            arrivals.push(if self.workload == WorkloadKind::Mooncake {
                Arrival::Trace { time_scale: self.time_scale }
            } else {
                Arrival::Burst
            });
        }
        Ok(BenchConfig {
            url: self.url.clone(),
            replicas: self.replicas.clone(),
            endpoint: self.endpoint,
            model: self.model.clone(),
            api_key: self.api_key.clone(),
            workload,
            max_requests: Some(self.num_requests),
            arrivals,
            max_concurrency: self.max_concurrency,
            duration_s: self.duration_s,
            request_timeout_s: self.request_timeout_s,
            connect_timeout_s: self.connect_timeout_s,
            think_time_ms: self.think_time_ms,
            ignore_eos: self.ignore_eos,
            temperature: self.temperature,
            seed: self.seed,
            slo: Slo { ttft_ms: self.slo_ttft_ms, tbt_ms: self.slo_tbt_ms, tbt_stat: self.slo_tbt_stat },
            allow_remote: self.allow_remote,
        })
    }
}

pub(crate) fn serve(a: ServeBenchArgs) -> anyhow::Result<()> {
    let config = a.config()?;
    config.validate()?;
    let observer: Arc<dyn Observer> = if a.no_progress { Arc::new(Quiet) } else { Arc::new(ProgressBars::new()) };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = runtime.block_on(baton_bench::run(&config, observer))?;
    std::fs::create_dir_all(&a.out_dir).with_context(|| format!("creating {}", a.out_dir.display()))?;
    let path = a.out_dir.join("report.json");
    report.write(&path)?;
    if a.json {
        let summaries: Vec<_> = report.runs.iter().map(|r| (&r.label, &r.summary)).collect();
        println!("{}", serde_json::to_string_pretty(&summaries)?);
    } else {
        print!("{}", summary_table(&report));
    }
    eprintln!("report: {}", path.display());
    if !a.no_plots {
        let files = baton_bench::plot::write_plots(&report, &a.out_dir)?;
        eprintln!("plots: {}", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "));
    }
    Ok(())
}

pub(crate) fn compare(a: CompareArgs) -> anyhow::Result<()> {
    let reports = a.reports.iter().map(|p| Report::read(p)).collect::<Result<Vec<_>, _>>()?;
    let names = if a.names.is_empty() {
        a.reports.iter().map(|p| p.display().to_string()).collect()
    } else {
        anyhow::ensure!(
            a.names.len() == reports.len(),
            "--names takes one name per report, comma-separated ({} reports, {} names)",
            reports.len(),
            a.names.len()
        );
        a.names.clone()
    };
    if let ([ra, rb], [name_a, name_b]) = (reports.as_slice(), names.as_slice()) {
        print!("{}", compare_table(ra, rb, name_a, name_b));
    }
    let all: Vec<(&str, &Report)> = names.iter().map(String::as_str).zip(&reports).collect();
    let sweeps = reports.iter().all(|r| sweep_runs(r).len() >= 2);
    if sweeps {
        print!("\nBy rate\n{}", sweep_table(&all));
    }
    if let Some(dir) = &a.plot {
        anyhow::ensure!(sweeps, "--plot needs rate sweeps (baton bench serve --rates R1,R2,...)");
        let files = baton_bench::plot::write_versus(&all, dir)?;
        eprintln!("plots: {}", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "));
    }
    Ok(())
}
