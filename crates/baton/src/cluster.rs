//! `baton worker` and `baton conductor`: one process per role, for multi-process and multi-host
//! deployments. Workers find the conductor through a registry: the conductor's embedded one
//! (`--registry http://CONDUCTOR:PORT`) or etcd (`--registry etcd://HOST:PORT`).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use baton_cluster::{ClusterSecret, RegistryConfig};
use baton_conductor::deploy::{ConductorConfig, WorkerConfig, run_conductor, run_worker};
use baton_protocol::Role;
use baton_worker::TransportChoice;

/// The cluster secret, shared by every member.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SecretFlag {
    /// Shared cluster secret: workers, the conductor and KV peers without it are refused.
    #[arg(long, env = "BATON_CLUSTER_SECRET", hide_env_values = true)]
    cluster_secret: String,
}

impl SecretFlag {
    fn secret(&self) -> anyhow::Result<ClusterSecret> {
        ClusterSecret::new(self.cluster_secret.as_bytes().to_vec()).context("--cluster-secret")
    }
}

/// A worker's role on the command line.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum RoleArg {
    /// Computes prompts and hands their KV over.
    Prefill,
    /// Receives KV (pulled or pushed) and generates.
    Decode,
    /// Both, in one engine.
    Colocated,
}

/// How KV reaches a decode worker.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum TransportArg {
    /// The fastest path both workers have: shared memory for a peer on this host (the same
    /// kernel and PID namespace, as each says at CONNECT), TCP for others.
    Auto,
    /// Shared memory only (same host).
    Shm,
    /// TCP only.
    Tcp,
}

/// Arguments of `baton worker`.
#[derive(Debug, clap::Args)]
pub(crate) struct WorkerArgs {
    /// What this worker does.
    #[arg(long, value_enum)]
    role: RoleArg,
    /// The cluster's registry: `http://CONDUCTOR:PORT` (the conductor's embedded registry) or
    /// `etcd://HOST:PORT[,HOST:PORT...]`.
    #[arg(long)]
    registry: RegistryConfig,
    #[command(flatten)]
    secret: SecretFlag,
    /// Model: a Hugging Face checkpoint directory, a GGUF file or a short name of
    /// `scripts/fetch-model.sh` (default: `smollm2-135m-instruct` from `./.models`). Must be the
    /// conductor's.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model id (default: the file or directory name); must match the conductor's.
    #[arg(long, visible_alias = "served-model-name")]
    model_id: Option<String>,
    /// Cluster id (default: `<role>-<host>-<port>`).
    #[arg(long)]
    name: Option<String>,
    /// Address of the control API (and of the OpenAI API, for a colocated worker).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port of the control API (0 picks one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Port of the KV server (0 picks one); it listens on --host.
    #[arg(long, default_value_t = 0)]
    kv_port: u16,
    /// Address other hosts use to reach this worker, if not --host.
    #[arg(long)]
    advertise: Option<IpAddr>,
    /// How KV travels to this worker from prefill workers, pulled or pushed (the conductor's
    /// --kv-transfer picks which).
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportArg,
    /// Seconds handed-off KV is held when no decode worker pulls it.
    #[arg(long, default_value_t = 30)]
    lease_s: u64,
    /// Seconds after its last heartbeat a silent worker is dropped from the cluster.
    #[arg(long, default_value_t = 3.0)]
    ttl_s: f64,
    /// On SIGTERM or Ctrl-C: seconds to finish the requests in flight (and let their KV be
    /// taken) after leaving the cluster, before exiting anyway.
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    drain_timeout_s: f64,
    /// A colocated worker serves the OpenAI API on its control port, for clients that skip the
    /// conductor, only with this key (`Authorization: Bearer <KEY>`, also on its `/metrics` and
    /// `/health`); without it that port answers only the conductor's signed calls.
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Certificates (PEM) to trust: an `https://` --registry (a conductor started with
    /// --tls-cert, e.g. its own self-signed certificate), and, with --tls-cert, the KV peers'
    /// certificates (required then).
    #[arg(long, value_name = "PEM")]
    tls_ca: Option<PathBuf>,
    /// --tls-cert/--tls-key: serve the control API over HTTPS (the conductor then needs
    /// --tls-ca to trust it) and the KV plane over TLS (every worker of the cluster then has a
    /// certificate naming its advertised address, and trusts its peers' with --tls-ca).
    #[command(flatten)]
    tls: TlsFlags,
    #[command(flatten)]
    engine: crate::engine_flags::EngineFlags,
}

/// TLS on the OpenAI API (`baton serve`, `baton conductor`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "TLS")]
pub(crate) struct TlsFlags {
    /// Serve the API over HTTPS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1); needs --tls-cert.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl TlsFlags {
    /// The two files, when TLS is on.
    pub(crate) fn files(&self) -> Option<(PathBuf, PathBuf)> {
        self.tls_cert.clone().zip(self.tls_key.clone())
    }

    /// The TLS acceptor these flags describe (checked now, so a bad file fails at start).
    pub(crate) fn acceptor(&self) -> anyhow::Result<Option<baton_protocol::http::TlsAcceptor>> {
        self.files()
            .map(|(cert, key)| baton_protocol::http::tls_acceptor(&cert, &key).map_err(anyhow::Error::msg))
            .transpose()
    }
}

/// Arguments of `baton conductor`.
#[derive(Debug, clap::Args)]
pub(crate) struct ConductorArgs {
    /// The cluster's registry: `embedded` (served by this process at /cluster/*; workers use
    /// `--registry http://THIS_HOST:PORT`) or `etcd://HOST:PORT[,HOST:PORT...]`.
    #[arg(long, default_value = "embedded")]
    registry: RegistryConfig,
    #[command(flatten)]
    secret: SecretFlag,
    /// Model (its tokenizer and chat template validate requests); the workers' model. A path or
    /// a short name, as for `baton worker`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model id clients send and answers carry (default: the file or directory name; the
    /// path and a known short name are accepted too). `--served-model-name` as in vLLM.
    #[arg(long, visible_alias = "served-model-name")]
    model_id: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require clients to send `Authorization: Bearer <KEY>`.
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Require the API key on `/metrics` and `/health` too (scrapers and probes must then send
    /// it); without this flag they answer anyone.
    #[arg(long)]
    protect_metrics: bool,
    /// Tokens per KV block of the workers (prefix-aware policies hash prompts in blocks).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// On SIGTERM or Ctrl-C: seconds the requests in flight may take to finish.
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    drain_timeout_s: f64,
    /// Seconds a worker's stream may stay silent before its request is taken from it (and run
    /// elsewhere when nothing was streamed yet). Workers send a keep-alive every 2 s, so only a
    /// frozen worker or a half-open connection stays silent this long.
    #[arg(long, default_value_t = 10.0, value_parser = seconds)]
    worker_timeout_s: f64,
    /// Certificates (PEM) to trust for workers that serve their control API over HTTPS.
    #[arg(long, value_name = "PEM")]
    tls_ca: Option<PathBuf>,
    #[command(flatten)]
    routing: crate::engine_flags::RoutingFlags,
    #[command(flatten)]
    tls: TlsFlags,
}

/// A number of seconds, 0 or more.
pub(crate) fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("`{s}` is not a number of seconds (0 or more)")),
    }
}

/// Resolves on SIGTERM (what Kubernetes and systemd send) or Ctrl-C (SIGINT).
pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => eprintln!("SIGTERM: shutting down"),
                    _ = tokio::signal::ctrl_c() => eprintln!("Ctrl-C: shutting down"),
                }
                return;
            }
            Err(e) => eprintln!("cannot watch SIGTERM ({e}); only Ctrl-C shuts down cleanly"),
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

pub(crate) fn worker(a: WorkerArgs) -> anyhow::Result<()> {
    let model = crate::generate::model_path(a.model.as_deref())?;
    if !(a.ttl_s > 0.0 && a.ttl_s.is_finite()) {
        anyhow::bail!("--ttl-s must be a positive number of seconds");
    }
    let config = WorkerConfig {
        model: model.clone(),
        device: a.engine.device(),
        model_id: a.model_id,
        role: match a.role {
            RoleArg::Prefill => Role::Prefill,
            RoleArg::Decode => Role::Decode,
            RoleArg::Colocated => Role::Colocated,
        },
        name: a.name,
        listen: SocketAddr::new(a.host, a.port),
        kv_listen: SocketAddr::new(a.host, a.kv_port),
        advertise: a.advertise,
        registry: a.registry,
        secret: a.secret.secret()?,
        engine: a.engine.config(),
        lease: Duration::from_secs(a.lease_s),
        transport: match a.transport {
            TransportArg::Auto => TransportChoice::Auto,
            TransportArg::Shm => TransportChoice::Shm,
            TransportArg::Tcp => TransportChoice::Tcp,
        },
        ttl: Duration::from_secs_f64(a.ttl_s),
        emulate: a.engine.emulate()?,
        emulate_link: a.engine.emulate_link(),
        drain_timeout: Duration::from_secs_f64(a.drain_timeout_s),
        api_key: a.api_key,
        tls_ca: a.tls_ca,
        tls: a.tls.files(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
        eprintln!("loading {} ...", model.display());
        let role = config.role.as_str();
        run_worker(
            config,
            listener,
            |ready| {
                // One line a supervisor (or a test) can wait for.
                println!(
                    "baton worker {} ({role}) ready: control {} kv {}",
                    ready.name,
                    ready.url,
                    ready.kv_addr.map_or_else(|| "-".to_owned(), |a| a.to_string())
                );
            },
            shutdown_signal(),
        )
        .await
        .context("worker")
    })
}

pub(crate) fn conductor(a: ConductorArgs) -> anyhow::Result<()> {
    let model = crate::generate::model_path(a.model.as_deref())?;
    // Checked now, so a bad certificate or key fails before anything starts.
    let tls_on = a.tls.acceptor()?.is_some();
    let config = ConductorConfig {
        model: model.clone(),
        model_id: a.model_id,
        registry: a.registry,
        secret: a.secret.secret()?,
        api_key: a.api_key,
        protect_metrics: a.protect_metrics,
        policy: a.routing.choice()?,
        kv_transfer: a.routing.kv_transfer(),
        pd_caching: a.routing.pd_caching(),
        kv_index: a.routing.kv_index(),
        elastic: a.routing.elastic()?,
        block_tokens: a.block_size,
        drain_timeout: Duration::from_secs_f64(a.drain_timeout_s),
        tls: a.tls.files(),
        tls_ca: a.tls_ca,
        worker_timeout: Duration::from_secs_f64(a.worker_timeout_s),
        max_queue_wait: a.routing.max_queue_wait(),
    };
    let addr = SocketAddr::new(a.host, a.port);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let scheme = if tls_on { "https" } else { "http" };
        println!("baton conductor listening on {scheme}://{}", listener.local_addr()?);
        run_conductor(config, listener, shutdown_signal()).await.context("conductor")
    })
}
