//! `baton serve`: the all-in-one deployment — a conductor with its prefill and decode workers
//! in one process, serving the OpenAI-compatible API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use baton_server::ServeConfig;

/// Arguments of `baton serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Model: a Hugging Face checkpoint directory or a GGUF file. Default: Gemma 3 270M from
    /// `$BATON_MODELS_DIR` or `./.models` (fetch it with `scripts/fetch-model.sh`).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model id clients send (default: the file or directory name).
    #[arg(long)]
    model_id: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Prefill workers.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Colocated workers instead (prefill and decode in one engine, as vLLM runs); with this
    /// flag and no explicit --prefill/--decode, no disaggregated workers are started.
    #[arg(long)]
    colocated: Option<usize>,
    /// Require clients to send `Authorization: Bearer <KEY>`.
    #[arg(long, env = "BATON_API_KEY")]
    api_key: Option<String>,
    #[command(flatten)]
    engine: crate::engine_flags::EngineFlags,
    #[command(flatten)]
    routing: crate::engine_flags::RoutingFlags,
    /// Seconds a prefill worker holds handed-off KV that no decode worker releases.
    #[arg(long, default_value_t = 30)]
    lease_s: u64,
}

pub(crate) fn run(a: ServeArgs) -> anyhow::Result<()> {
    let model = crate::generate::model_path(a.model.as_deref())?;
    let colocated_only =
        a.colocated.is_some() && !std::env::args().any(|x| x.starts_with("--prefill") || x.starts_with("--decode"));
    let (prefill, decode) = if colocated_only { (0, 0) } else { (a.prefill, a.decode) };
    let config = ServeConfig {
        model_id: a.model_id,
        prefill,
        decode,
        colocated: a.colocated.unwrap_or(0),
        engine: a.engine.config(),
        api_key: a.api_key,
        lease: Duration::from_secs(a.lease_s),
        policy: a.routing.choice()?,
        kv_transfer: a.routing.kv_transfer(),
        emulate: a.engine.emulate()?,
        ..ServeConfig::new(model.clone())
    };
    eprintln!("loading {} ...", model.display());
    let conductor = baton_server::build(&config).with_context(|| format!("starting on {}", model.display()))?;
    let addr = SocketAddr::new(a.host, a.port);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        eprintln!(
            "baton serving {} on http://{} ({} prefill, {} decode, {} colocated workers); Ctrl-C stops",
            model.display(),
            listener.local_addr()?,
            prefill,
            decode,
            config.colocated
        );
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        baton_server::serve(listener, conductor, shutdown).await?;
        Ok(())
    })
}
