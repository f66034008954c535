//! `baton serve`: the all-in-one deployment — a conductor with its prefill and decode workers
//! in one process, serving the OpenAI-compatible API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use baton_conductor::ServeConfig;

/// Arguments of `baton serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Model: a Hugging Face checkpoint directory, a GGUF file, or a short name of
    /// `scripts/fetch-model.sh` (`smollm2-135m-instruct`, the default, or `gemma3-270m`) looked up
    /// in `$BATON_MODELS_DIR` or `./.models`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model id clients send and answers carry (default: the file or directory name; the
    /// path and a known short name are accepted too). `--served-model-name` as in vLLM.
    #[arg(long, visible_alias = "served-model-name")]
    model_id: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Prefill workers [default: 0, or 1 with --decode or --elastic]. `--prefill 1 --decode 1`
    /// disaggregates: a prefill worker computes each prompt and hands its KV to a decode worker.
    #[arg(long, help_heading = "Workers")]
    prefill: Option<usize>,
    /// Decode workers [default: 0, or 1 with --prefill or --elastic].
    #[arg(long, help_heading = "Workers")]
    decode: Option<usize>,
    /// Colocated workers (prefill and decode in one engine, as vLLM runs) [default: 1 when
    /// none of --prefill, --decode, --elastic is given, else 0]. The workers of one `baton
    /// serve` share its device (this machine's cores, or its GPU), so splitting prefill from
    /// decode there gains no compute (docs/benchmarks/serving.md measures both on 2 cores);
    /// disaggregation pays where each role has devices of its own (`baton conductor` and
    /// `baton worker` across GPUs or hosts).
    #[arg(long, help_heading = "Workers")]
    colocated: Option<usize>,
    /// Require clients to send `Authorization: Bearer <KEY>`.
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Require the API key on `/metrics` and `/health` too (scrapers and probes must then send
    /// it); without this flag they answer anyone.
    #[arg(long)]
    protect_metrics: bool,
    /// Seconds a prefill worker holds handed-off KV that no decode worker releases.
    #[arg(long, default_value_t = 30)]
    lease_s: u64,
    /// On SIGTERM or Ctrl-C: seconds the requests in flight may take to finish.
    #[arg(long, default_value_t = 30.0, value_parser = crate::cluster::seconds)]
    drain_timeout_s: f64,
    #[command(flatten)]
    engine: crate::engine_flags::EngineFlags,
    #[command(flatten)]
    routing: crate::engine_flags::RoutingFlags,
    #[command(flatten)]
    tls: crate::cluster::TlsFlags,
}

impl ServeArgs {
    /// Prefill, decode and colocated workers: one colocated worker by default; a prefill and a
    /// decode worker when either role is named (the other defaults to 1) or `--elastic` asks
    /// for roles that adapt (it starts from the pair), with colocated ones only if
    /// `--colocated` asks for them too.
    fn worker_counts(&self) -> (usize, usize, usize) {
        if self.prefill.is_none() && self.decode.is_none() && !self.routing.elastic_on() {
            return (0, 0, self.colocated.unwrap_or(1));
        }
        (self.prefill.unwrap_or(1), self.decode.unwrap_or(1), self.colocated.unwrap_or(0))
    }
}

pub(crate) fn run(a: ServeArgs) -> anyhow::Result<()> {
    let model = crate::generate::model_path(a.model.as_deref())?;
    let (prefill, decode, colocated) = a.worker_counts();
    let mut a = a;
    a.routing.predict_with(a.engine.emulate_name());
    let config = ServeConfig {
        model_id: a.model_id,
        prefill,
        decode,
        colocated,
        engine: a.engine.config(),
        device: a.engine.device(),
        api_key: a.api_key,
        protect_metrics: a.protect_metrics,
        lease: Duration::from_secs(a.lease_s),
        policy: a.routing.choice()?,
        kv_transfer: a.routing.kv_transfer(),
        pd_caching: a.routing.pd_caching(),
        kv_index: a.routing.kv_index(),
        elastic: a.routing.elastic()?,
        emulate: a.engine.emulate()?,
        emulate_link: a.engine.emulate_link(),
        max_queue_wait: a.routing.max_queue_wait(),
        ..ServeConfig::new(model.clone())
    };
    eprintln!("loading {} ...", model.display());
    let tls = a.tls.acceptor()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let conductor = baton_conductor::build(&config).with_context(|| format!("starting on {}", model.display()))?;
    let addr = SocketAddr::new(a.host, a.port);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        eprintln!(
            "baton serving {} on {scheme}://{} ({} prefill, {} decode, {} colocated workers); Ctrl-C or SIGTERM stops",
            model.display(),
            listener.local_addr()?,
            prefill,
            decode,
            config.colocated
        );
        let drain = Duration::from_secs_f64(a.drain_timeout_s);
        baton_conductor::serve_draining(
            listener,
            conductor.router(),
            baton_protocol::http::HttpLimits::default(),
            tls,
            crate::cluster::shutdown_signal(),
            drain,
        )
        .await?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: super::ServeArgs,
    }

    fn counts(args: &[&str]) -> (usize, usize, usize) {
        Cli::parse_from(std::iter::once("serve").chain(args.iter().copied())).serve.worker_counts()
    }

    #[test]
    fn worker_counts_follow_the_flags() {
        assert_eq!(counts(&[]), (0, 0, 1));
        assert_eq!(counts(&["--prefill", "1", "--decode", "1"]), (1, 1, 0));
        assert_eq!(counts(&["--decode", "2"]), (1, 2, 0));
        assert_eq!(counts(&["--prefill", "0", "--decode", "1"]), (0, 1, 0));
        assert_eq!(counts(&["--colocated", "2"]), (0, 0, 2));
        assert_eq!(counts(&["--elastic"]), (1, 1, 0), "elastic roles start from the pair");
        // An engine flag that starts like a worker flag changes nothing (it used to).
        assert_eq!(counts(&["--colocated", "2", "--prefill-chunk", "2048"]), (0, 0, 2));
        assert_eq!(counts(&["--colocated", "1", "--prefill", "2", "--decode", "1"]), (2, 1, 1));
        assert_eq!(counts(&["--prefill=3", "--decode=2"]), (3, 2, 0));
    }
}
