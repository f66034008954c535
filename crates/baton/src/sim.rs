//! `baton sim`: a whole cluster on virtual time, with the same scheduling policies the
//! conductor uses (baton-sched), on a trace or a synthetic workload.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use baton_engine::profile::load_profile;
use baton_sched::{AdmissionKind, PolicyKind};
use baton_sim::workload::Synthetic;
use baton_sim::{Report, SimConfig, WorkloadSpec};

/// Arguments of `baton sim`.
#[derive(Debug, clap::Args)]
pub(crate) struct SimArgs {
    /// Mooncake-format trace (JSON lines: timestamp, input_length, output_length, hash_ids).
    #[arg(long, group = "workload")]
    trace: Option<PathBuf>,
    /// ShareGPT-format JSON file, replayed as Poisson arrivals at --rate.
    #[arg(long, group = "workload")]
    sharegpt: Option<PathBuf>,
    /// Synthetic: this many Poisson requests at --rate, lengths from --input and --output.
    #[arg(long, group = "workload")]
    poisson: Option<usize>,
    /// Synthetic: this many shared-prefix sessions of --turns turns at --rate.
    #[arg(long, group = "workload")]
    sessions: Option<usize>,
    /// Synthetic: this many sessions, each with a context of its own of --input A tokens that
    /// every turn extends by B tokens; starts at --rate per second, turns --think-s apart.
    #[arg(long, group = "workload")]
    context_sessions: Option<usize>,
    /// Turns per session.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Seconds between a session's turns (--context-sessions).
    #[arg(long, default_value_t = 10.0)]
    think_s: f64,
    /// Write the workload as a Mooncake-format trace to this file (timestamps in ms) and exit,
    /// so `baton bench serve --workload mooncake --dataset FILE` replays it against a server.
    #[arg(long, value_name = "FILE")]
    write_trace: Option<PathBuf>,
    /// Arrival rate (requests or sessions per second).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Prompt length range A:B (for sessions: system prompt A, turn B tokens).
    #[arg(long, default_value = "1000:8000", value_parser = range)]
    input: (u64, u64),
    /// Output length range A:B.
    #[arg(long, default_value = "16:256", value_parser = range)]
    output: (u64, u64),
    /// Replay the trace this many times faster.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Prefill instances.
    #[arg(long)]
    prefill: Option<usize>,
    /// Decode instances.
    #[arg(long)]
    decode: Option<usize>,
    /// Colocated instances.
    #[arg(long)]
    colocated: Option<usize>,
    /// Policy: round-robin, random, least-load, session-affinity, prompt-tree, kv-centric,
    /// load-aware; several, comma-separated, run one after the other on the same workload.
    #[arg(long, value_delimiter = ',', default_value = "kv-centric")]
    policy: Vec<PolicyKind>,
    /// Admission: none, baseline, early, predictive; several, comma-separated, are run each.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    admission: Vec<AdmissionKind>,
    /// TTFT SLO in milliseconds.
    #[arg(long)]
    ttft_slo_ms: Option<u64>,
    /// TBT SLO in milliseconds.
    #[arg(long)]
    tbt_slo_ms: Option<u64>,
    /// Uniform decode time t_d of predictive rejection, in milliseconds.
    #[arg(long)]
    decode_time_ms: Option<u64>,
    /// Predictive admission assumes every running request decodes for --decode-time-ms
    /// (Mooncake's system-level prediction, as the live conductor does with the time it
    /// measures), instead of counting each one gone after its remaining output.
    #[arg(long)]
    uniform_decode_time: bool,
    /// Fraction of the TBT SLO that early and predictive admission keep free (the live
    /// conductor's --admission-tbt-headroom).
    #[arg(long, default_value_t = baton_sched::DEFAULT_TBT_HEADROOM, value_parser = crate::engine_flags::tbt_headroom)]
    admission_tbt_headroom: f64,
    /// Mooncake's kvcache_balancing_threshold.
    #[arg(long)]
    threshold: Option<f64>,
    /// KV blocks per instance on the device tier.
    #[arg(long)]
    device_blocks: Option<u64>,
    /// Of those, blocks the prefix cache may keep.
    #[arg(long)]
    cache_blocks: Option<u64>,
    /// Host DRAM blocks per instance.
    #[arg(long)]
    host_blocks: Option<u64>,
    /// Largest decode batch.
    #[arg(long)]
    max_batch: Option<usize>,
    /// Whether an instance may fetch a prefix cached on another (the live conductor's
    /// `--kv-fetch`).
    #[arg(long, value_enum, default_value = "on")]
    kv_fetch: crate::engine_flags::OnOff,
    /// Conditional disaggregation, as the live conductor's flag: a request with at most N
    /// prompt tokens not cached on the decode instance the policy chose runs whole there
    /// when the cost model predicts that is no slower. 0 (the default) never.
    #[arg(long, default_value_t = 0)]
    conditional_disagg_tokens: u64,
    /// How the hand-off's KV moves, as the live conductor's flag: `pull` and `push` cross the
    /// link after the prefill; `layerwise` crosses it layer by layer during the prefill (the
    /// profile's layer count; a fitted profile, without one, models no overlap).
    #[arg(long, value_enum, default_value = "pull")]
    kv_transfer: crate::engine_flags::KvTransferArg,
    /// Prompt tokens a prefill step computes at most, as the engine's flag (it sets what a
    /// layer-wise push leaves after the prefill: the last chunk's last layer).
    #[arg(long, default_value_t = 512)]
    prefill_chunk: u64,
    /// The instance-to-instance link in Gb/s, instead of the profile's (as `baton serve
    /// --emulate-link-gbps` sets an emulated worker's).
    #[arg(long)]
    network_gbps: Option<f64>,
    /// Load-aware: how long an imbalance with its busy pool at its SLO must last before a role
    /// changes, in milliseconds (default 2,000, as `--elastic-hold-s` live; deeper imbalances
    /// act sooner, shallower ones later).
    #[arg(long)]
    persist_ms: Option<u64>,
    /// Elastic roles whatever --policy routes, as `baton serve --elastic` / `baton conductor
    /// --elastic`: roles change by load-aware's rule (--persist-ms, --elastic-watermarks), which
    /// weighs the pools against --ttft-slo-ms and --tbt-slo-ms, looking every 250 ms.
    #[arg(long)]
    elastic: bool,
    /// Load-aware and --elastic: the low and high watermarks, LOW,HIGH (FlowKV's 0.3,0.7).
    #[arg(long, value_delimiter = ',')]
    elastic_watermarks: Option<Vec<f64>>,
    /// Cost profile: a800, h100 (LLaMA-2-70B on 8 GPUs) or a profile file (`baton profile`).
    #[arg(long, default_value = "a800")]
    profile: String,
    /// Write the reports (`NAME.json`) and plots (`NAME_ttft_cdf`, `NAME_jct_cdf`,
    /// `NAME_summary`, PNG and SVG) into this directory.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// File name stem of --plot's files.
    #[arg(long, default_value = "sim")]
    name: String,
    /// Title of the plots (default: the workload and the cluster).
    #[arg(long)]
    title: Option<String>,
    /// Seed of the scheduler and the generators.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the whole report as JSON.
    #[arg(long)]
    json: bool,
    /// With --json or --plot: add a record per request (instances chosen, prompt tokens found
    /// cached and fetched, when its prefill began, TTFT, JCT), to set beside a live run's.
    #[arg(long)]
    records: bool,
    /// Print one markdown table row (with SIM_ROW_HEADER set, the header first).
    #[arg(long)]
    row: bool,
    /// Write the load over time into this directory: per run `NAME-POLICY-ADMISSION.load.csv`
    /// (every instance's prefill queue, decode batch, waiting and incoming requests and decode
    /// step every --load-trace-ms of virtual time) and `.admissions.csv` (every decode check of
    /// early or predictive admission: the load it predicted, for when, and its verdict), and the
    /// pools' load over time as `NAME_load.png` and `.svg`.
    #[arg(long, value_name = "DIR")]
    load_trace: Option<PathBuf>,
    /// Interval of --load-trace's samples, in milliseconds of virtual time.
    #[arg(long, default_value_t = 100)]
    load_trace_ms: u64,
}

fn range(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s.split_once(':').ok_or("expected A:B")?;
    Ok((a.parse().map_err(|e| format!("{e}"))?, b.parse().map_err(|e| format!("{e}"))?))
}

pub(crate) fn run(a: SimArgs) -> anyhow::Result<()> {
    let mut cfg = SimConfig { seed: a.seed, records: a.records, ..SimConfig::default() };
    if a.load_trace.is_some() {
        cfg.load_trace_us = a.load_trace_ms.max(1) * 1000;
    }
    let set = |target: &mut usize, v: Option<usize>| {
        if let Some(v) = v {
            *target = v;
        }
    };
    set(&mut cfg.cluster.prefill, a.prefill);
    set(&mut cfg.cluster.decode, a.decode);
    set(&mut cfg.cluster.colocated, a.colocated);
    for (target, v) in [
        (&mut cfg.cluster.device_blocks, a.device_blocks),
        (&mut cfg.cluster.device_cache_blocks, a.cache_blocks),
        (&mut cfg.cluster.host_blocks, a.host_blocks),
    ] {
        if let Some(v) = v {
            *target = v;
        }
    }
    set(&mut cfg.cluster.max_batch, a.max_batch);
    if let Some(ms) = a.ttft_slo_ms {
        cfg.admission.slo.ttft_us = ms * 1000;
    }
    if let Some(ms) = a.tbt_slo_ms {
        cfg.admission.slo.tbt_us = ms * 1000;
    }
    if let Some(ms) = a.decode_time_ms {
        cfg.admission.decode_time_us = ms * 1000;
    }
    cfg.admission.tbt_headroom = a.admission_tbt_headroom;
    cfg.uniform_decode_time = a.uniform_decode_time;
    cfg.cluster.kv_fetch = matches!(a.kv_fetch, crate::engine_flags::OnOff::On);
    cfg.conditional_tokens = (a.conditional_disagg_tokens > 0).then_some(a.conditional_disagg_tokens);
    cfg.layerwise_push = matches!(a.kv_transfer, crate::engine_flags::KvTransferArg::Layerwise);
    cfg.cluster.prefill_chunk = a.prefill_chunk;
    if let Some(t) = a.threshold {
        cfg.policy_config.kvcache_balancing_threshold = t;
    }
    if let Some(ms) = a.persist_ms {
        cfg.policy_config.load_aware.persist_us = ms * 1000;
    }
    if let Some(w) = &a.elastic_watermarks {
        (cfg.policy_config.load_aware.low, cfg.policy_config.load_aware.high) = crate::engine_flags::watermarks(w)?;
    }
    if a.elastic {
        // The live conductor's controller looks every 250 ms (`ElasticConfig::interval`).
        cfg.elastic = true;
        cfg.rebalance_interval_us = 250_000;
    }
    cfg.cost = load_profile(&a.profile)?;
    if let Some(gbps) = a.network_gbps {
        if !(gbps.is_finite() && gbps > 0.0) {
            anyhow::bail!("--network-gbps must be a positive number, not {gbps}");
        }
        cfg.cost.network.bytes_per_s = (gbps * 1e9 / 8.0) as u64;
    }
    let workload_name = if let Some(p) = &a.trace {
        format!("{} at {}x", p.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned()), a.time_scale)
    } else if let Some(n) = a.poisson {
        format!("{n} Poisson requests at {}/s", a.rate)
    } else {
        "workload".to_owned()
    };
    cfg.workload = if let Some(path) = a.trace {
        WorkloadSpec::MooncakeTrace { path, time_scale: a.time_scale }
    } else if let Some(path) = a.sharegpt {
        WorkloadSpec::ShareGpt { path, rate: a.rate }
    } else if let Some(requests) = a.poisson {
        WorkloadSpec::Synthetic(Synthetic::Poisson { requests, rate: a.rate, input: a.input, output: a.output })
    } else if let Some(sessions) = a.sessions {
        WorkloadSpec::Synthetic(Synthetic::SharedPrefix {
            sessions,
            turns: a.turns,
            rate: a.rate,
            system_tokens: a.input.0,
            turn_tokens: a.input.1,
            output: a.output.1,
        })
    } else if let Some(sessions) = a.context_sessions {
        WorkloadSpec::Synthetic(Synthetic::OwnContext {
            sessions,
            turns: a.turns,
            rate: a.rate,
            context_tokens: a.input.0,
            turn_tokens: a.input.1,
            output: a.output.1,
            think_s: a.think_s,
        })
    } else {
        bail!("give a workload: --trace PATH, --sharegpt PATH, --poisson N, --sessions N or --context-sessions N");
    };
    if let Some(path) = &a.write_trace {
        let requests = baton_sim::load_workload(&cfg)?;
        std::fs::write(path, baton_sim::workload::to_mooncake(&requests))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {} requests to {}", requests.len(), path.display());
        return Ok(());
    }
    // The load-aware policy watches the same SLOs admission uses.
    cfg.policy_config.load_aware.ttft_slo_us = cfg.admission.slo.ttft_us;
    cfg.policy_config.load_aware.tbt_slo_us = cfg.admission.slo.tbt_us;
    let mut reports = Vec::new();
    for &policy in &a.policy {
        for &admission in &a.admission {
            let mut cfg = cfg.clone();
            cfg.policy = policy;
            cfg.admission.kind = admission;
            let t0 = Instant::now();
            let report = baton_sim::run(&cfg)?;
            let wall = t0.elapsed();
            if a.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else if a.row {
                print_row(&report, reports.is_empty());
            } else {
                print_summary(&report);
            }
            eprintln!(
                "simulated {} requests ({} events) in {:.2} s wall",
                report.requests,
                report.events,
                wall.as_secs_f64()
            );
            if let Some(dir) = &a.load_trace {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
                let stem = format!("{}-{}-{}", a.name, report.policy, report.admission);
                for (ext, text) in [
                    ("load.csv", report.load_trace.samples_csv()),
                    ("admissions.csv", report.load_trace.admissions_csv()),
                ] {
                    let path = dir.join(format!("{stem}.{ext}"));
                    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
                }
            }
            reports.push(report);
        }
    }
    let title = {
        let c = &cfg.cluster;
        a.title.clone().unwrap_or_else(|| {
            format!("{workload_name}, {}P+{}D+{}C, {}", c.prefill, c.decode, c.colocated, cfg.cost.name)
        })
    };
    if let Some(dir) = &a.load_trace {
        let files = baton_sim::plot::write_load_plot(dir, &a.name, &title, &reports)?;
        eprintln!("wrote the load traces and {} plots into {}", files.len(), dir.display());
    }
    if let Some(dir) = &a.plot {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let json = dir.join(format!("{}.json", a.name));
        std::fs::write(&json, serde_json::to_string_pretty(&reports)?)
            .with_context(|| format!("writing {}", json.display()))?;
        let files = baton_sim::plot::write_plots(dir, &a.name, &title, &reports)?;
        eprintln!("wrote {} and {} plots into {}", json.display(), files.len(), dir.display());
    }
    Ok(())
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn print_summary(r: &Report) {
    println!(
        "policy={} admission={} instances(P,D,C)={:?} requests={} completed={} rejected_early={} rejected_after_prefill={}",
        r.policy, r.admission, r.instances, r.requests, r.completed, r.rejected_early, r.rejected_after_prefill
    );
    println!(
        "TTFT ms: mean {:.0} p50 {:.0} p90 {:.0} p99 {:.0} | TBT ms: mean {:.1} p90 {:.1} | JCT ms: mean {:.0} p90 {:.0}",
        ms(r.ttft.mean),
        ms(r.ttft.p50),
        ms(r.ttft.p90),
        ms(r.ttft.p99),
        ms(r.tbt.mean),
        ms(r.tbt.p90),
        ms(r.jct.mean),
        ms(r.jct.p90)
    );
    println!(
        "SLO: ttft attainment {:.3}, both {:.3} ({} within SLO), goodput {:.2} req/s | wasted prefill {:.1} s ({} tokens) | cache hit {:.3}, transfers {} | run on decode {} | role changes {}",
        r.ttft_slo_attainment,
        r.slo_attainment,
        r.completed_within_slo,
        r.goodput_rps,
        r.wasted_prefill_us as f64 / 1e6,
        r.wasted_prefill_tokens,
        r.cache_hit_ratio,
        r.cache_transfers,
        r.run_on_decode,
        r.role_changes.len()
    );
}

/// Columns of `--row`.
const ROW_HEADER: &str = "| policy | admission | completed | rejected early | rejected after prefill | TTFT mean s | TTFT p90 s | TTFT SLO att. | within both SLOs | wasted prefill s | JCT mean s | goodput req/s | role changes |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|";

fn print_row(r: &Report, first: bool) {
    if first && std::env::var_os("SIM_ROW_HEADER").is_some() {
        println!("{ROW_HEADER}");
    }
    println!(
        "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.3} | {} | {:.1} | {:.2} | {:.2} | {} |",
        r.policy,
        r.admission,
        r.completed,
        r.rejected_early,
        r.rejected_after_prefill,
        r.ttft.mean as f64 / 1e6,
        r.ttft.p90 as f64 / 1e6,
        r.ttft_slo_attainment,
        r.completed_within_slo,
        r.wasted_prefill_us as f64 / 1e6,
        r.jct.mean as f64 / 1e6,
        r.goodput_rps,
        r.role_changes.len()
    );
}
