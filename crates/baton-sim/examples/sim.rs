//! Runs one simulation from the command line.
//!
//! ```text
//! cargo run --release -p baton-sim --example sim -- \
//!     --trace ../shared/fixtures/traces/synthetic_trace.jsonl --prefill 8 --decode 8 \
//!     --policy kv-centric --admission none --time-scale 1 --seed 0 [--json]
//! ```
//!
//! `--row` prints one markdown table row (see `ROW_HEADER`) instead of the summary.
//!
//! Other options: `--colocated N`, `--ttft-slo-ms MS`, `--tbt-slo-ms MS`, `--threshold F`
//! (Mooncake's kvcache_balancing_threshold), `--decode-time-ms MS` (t_d of predictive
//! rejection), `--profile a800|h100|PATH.json`, `--device-blocks N`, `--cache-blocks N`,
//! `--host-blocks N`, `--max-batch N`, `--persist-ms MS` (load-aware), `--sharegpt PATH --rate R`,
//! `--poisson N --rate R --input A:B --output A:B`, `--sessions N --turns T --rate R`.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use baton_sched::{AdmissionKind, CostProfile, PolicyKind};
use baton_sim::workload::Synthetic;
use baton_sim::{Report, SimConfig, WorkloadSpec};

fn range(s: &str) -> Result<(u64, u64)> {
    let (a, b) = s.split_once(':').context("expected A:B")?;
    Ok((a.parse()?, b.parse()?))
}

fn main() -> Result<()> {
    let mut cfg = SimConfig::default();
    let mut json = false;
    let mut row = false;
    let mut time_scale = 1.0;
    let mut trace = None;
    let mut sharegpt = None;
    let mut rate = 1.0;
    let mut poisson = None;
    let (mut input, mut output) = ((1000, 8000), (16, 256));
    let (mut sessions, mut turns) = (None, 4usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--trace" => trace = Some(val()?),
            "--sharegpt" => sharegpt = Some(val()?),
            "--poisson" => poisson = Some(val()?.parse::<usize>()?),
            "--sessions" => sessions = Some(val()?.parse::<usize>()?),
            "--turns" => turns = val()?.parse()?,
            "--rate" => rate = val()?.parse()?,
            "--input" => input = range(&val()?)?,
            "--output" => output = range(&val()?)?,
            "--prefill" => cfg.cluster.prefill = val()?.parse()?,
            "--decode" => cfg.cluster.decode = val()?.parse()?,
            "--colocated" => cfg.cluster.colocated = val()?.parse()?,
            "--policy" => cfg.policy = val()?.parse::<PolicyKind>()?,
            "--admission" => cfg.admission.kind = val()?.parse::<AdmissionKind>()?,
            "--time-scale" => time_scale = val()?.parse()?,
            "--seed" => cfg.seed = val()?.parse()?,
            "--ttft-slo-ms" => cfg.admission.slo.ttft_us = val()?.parse::<u64>()? * 1000,
            "--tbt-slo-ms" => cfg.admission.slo.tbt_us = val()?.parse::<u64>()? * 1000,
            "--decode-time-ms" => cfg.admission.decode_time_us = val()?.parse::<u64>()? * 1000,
            "--threshold" => cfg.policy_config.kvcache_balancing_threshold = val()?.parse()?,
            "--device-blocks" => cfg.cluster.device_blocks = val()?.parse()?,
            "--cache-blocks" => cfg.cluster.device_cache_blocks = val()?.parse()?,
            "--host-blocks" => cfg.cluster.host_blocks = val()?.parse()?,
            "--max-batch" => cfg.cluster.max_batch = val()?.parse()?,
            "--persist-ms" => cfg.policy_config.load_aware.persist_us = val()?.parse::<u64>()? * 1000,
            "--profile" => {
                cfg.cost = match val()?.as_str() {
                    "a800" => CostProfile::llama2_70b_8xa800(),
                    "h100" => CostProfile::llama2_70b_8xh100(),
                    path => CostProfile::from_json(&std::fs::read_to_string(path)?)?,
                }
            }
            "--json" => json = true,
            "--row" => row = true,
            "-h" | "--help" => {
                println!("see the doc comment of crates/baton-sim/examples/sim.rs");
                return Ok(());
            }
            other => bail!("unknown option {other}"),
        }
    }
    cfg.workload = if let Some(path) = trace {
        WorkloadSpec::MooncakeTrace { path: path.into(), time_scale }
    } else if let Some(path) = sharegpt {
        WorkloadSpec::ShareGpt { path: path.into(), rate }
    } else if let Some(requests) = poisson {
        WorkloadSpec::Synthetic(Synthetic::Poisson { requests, rate, input, output })
    } else if let Some(sessions) = sessions {
        WorkloadSpec::Synthetic(Synthetic::SharedPrefix {
            sessions,
            turns,
            rate,
            system_tokens: input.0,
            turn_tokens: input.1,
            output: output.1,
        })
    } else {
        bail!("give a workload: --trace PATH, --sharegpt PATH, --poisson N or --sessions N");
    };
    // The load-aware policy watches the same SLOs admission uses.
    cfg.policy_config.load_aware.ttft_slo_us = cfg.admission.slo.ttft_us;
    cfg.policy_config.load_aware.tbt_slo_us = cfg.admission.slo.tbt_us;
    let t0 = Instant::now();
    let report = baton_sim::run(&cfg)?;
    let wall = t0.elapsed();
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else if row {
        print_row(&report);
    } else {
        print_summary(&report);
    }
    eprintln!("simulated {} requests ({} events) in {:.2} s wall", report.requests, report.events, wall.as_secs_f64());
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
        "SLO: ttft attainment {:.3}, both {:.3} ({} within SLO), goodput {:.2} req/s | wasted prefill {:.1} s ({} tokens) | cache hit {:.3}, transfers {} | role changes {}",
        r.ttft_slo_attainment,
        r.slo_attainment,
        r.completed_within_slo,
        r.goodput_rps,
        r.wasted_prefill_us as f64 / 1e6,
        r.wasted_prefill_tokens,
        r.cache_hit_ratio,
        r.cache_transfers,
        r.role_changes.len()
    );
}

/// Columns of `--row`.
const ROW_HEADER: &str = "| policy | admission | completed | rejected early | rejected after prefill | TTFT mean s | TTFT p90 s | TTFT SLO att. | within both SLOs | wasted prefill s | JCT mean s | goodput req/s | role changes |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|";

fn print_row(r: &Report) {
    if std::env::var_os("SIM_ROW_HEADER").is_some() {
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
