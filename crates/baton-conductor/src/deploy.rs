//! Multi-process deployments: `baton worker` and `baton conductor`.
//!
//! A worker process runs one engine ([`WorkerHandle`]), its KV server, its control API
//! ([`baton_protocol::control`]) and — for a colocated worker — the OpenAI API directly (a conductor over
//! just this worker, handy for measuring what routing adds). It registers with the cluster's
//! registry under a lease and deregisters on shutdown; if it dies, the lease lapses within its
//! TTL and the conductor forgets it. If it lives but its lease lapsed (it was frozen or cut off
//! past the TTL), it joins again.
//!
//! A conductor process serves the OpenAI API and follows membership: each worker that joins
//! becomes a [`RemoteWorker`], each that leaves is dropped and its streaming requests are lost
//! (retried when nothing was streamed yet). With the embedded registry the conductor also
//! serves the registry's `/cluster/*` routes that workers register through.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_cluster::{
    ClusterError, ClusterSecret, EmbeddedRegistry, KvSummary, LeftReason, MembershipEvent, MembershipWatch, Registry,
    RegistryConfig, WorkerId, WorkerInfo,
};
use baton_engine::EngineConfig;

use crate::conductor::Conductor;
use crate::remote::RemoteWorker;
use crate::{ServeError, compat, load, routing};
use baton_protocol::{KvTransfer, Role, Worker};
use baton_worker::{TransportChoice, WorkerHandle, WorkerOptions};

/// Loads the model on a blocking thread, so the runtime keeps serving meanwhile.
async fn load_off_runtime(
    path: &std::path::Path,
    model_id: Option<&str>,
    device: baton_model::DeviceOptions,
) -> Result<crate::Loaded, ServeError> {
    let (path, model_id) = (path.to_owned(), model_id.map(str::to_owned));
    tokio::task::spawn_blocking(move || load(&path, model_id.as_deref(), device))
        .await
        .map_err(|e| ServeError::Config(format!("loading the model: {e}")))?
}

/// A worker process.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Hugging Face checkpoint directory or GGUF file.
    pub model: PathBuf,
    /// Where the model computes (`--device`, `--dtype`).
    pub device: baton_model::DeviceOptions,
    /// The id clients name (must match the conductor's).
    pub model_id: Option<String>,
    /// Prefill, decode or colocated.
    pub role: Role,
    /// Cluster id (default: `<role>-<host>-<port>`).
    pub name: Option<String>,
    /// Where the control API (and, for colocated workers, the OpenAI API) listens.
    pub listen: SocketAddr,
    /// Where the KV server listens (every role: hand-offs, and its cache to peers that fetch).
    pub kv_listen: SocketAddr,
    /// The host others use to reach this worker (default: the listen address, or loopback
    /// when that is unspecified).
    pub advertise: Option<IpAddr>,
    /// The cluster's registry.
    pub registry: RegistryConfig,
    /// The shared secret.
    pub secret: ClusterSecret,
    /// The engine.
    pub engine: EngineConfig,
    /// How long handed-off KV is held.
    pub lease: Duration,
    /// How pulls travel.
    pub transport: TransportChoice,
    /// Membership lease: a dead worker is forgotten this long after its last heartbeat.
    pub ttl: Duration,
    /// Emulate the model with this cost profile (see [`crate::ServeConfig::emulate`]).
    pub emulate: Option<baton_sched::CostProfile>,
    /// The emulated link (see [`crate::ServeConfig::emulate_link`]).
    pub emulate_link: Option<baton_sched::Link>,
    /// On shutdown, how long to wait for the requests held to finish (and their KV to be
    /// taken) before exiting anyway.
    pub drain_timeout: Duration,
    /// A colocated worker serves the OpenAI API on its control port behind this key (none: it
    /// does not serve it).
    pub api_key: Option<String>,
    /// Certificates (PEM) to trust for an `https://` registry (a conductor serving TLS).
    pub tls_ca: Option<PathBuf>,
    /// Serve the control API (and a colocated worker's OpenAI API) over TLS with this
    /// certificate chain and private key (PEM files); it registers an `https://` URL. The KV
    /// plane speaks TLS too, with the same certificate, and checks its peers' against
    /// `tls_ca` (then required): every worker of such a cluster has a certificate.
    pub tls: Option<(PathBuf, PathBuf)>,
}

/// The TLS of a worker's KV plane, from its `--tls-cert/--tls-key` and `--tls-ca`.
fn kv_tls(config: &WorkerConfig) -> Result<Option<baton_transfer::KvTls>, ServeError> {
    match (&config.tls, &config.tls_ca) {
        (None, _) => Ok(None),
        (Some((cert, key)), Some(ca)) => {
            baton_transfer::KvTls::from_pem_files(cert, key, ca).map(Some).map_err(ServeError::Config)
        }
        (Some(_), None) => Err(ServeError::Config(
            "a worker with --tls-cert speaks TLS on its KV plane too and checks its peers' certificates against \
             --tls-ca: give --tls-ca (the cluster's CA, or the certificate its workers share)"
                .into(),
        )),
    }
}

/// How long a worker being shut down waits for what it holds (Kubernetes' default grace period).
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// A running worker process's addresses, for whoever started it (tests, benchmarks).
#[derive(Debug, Clone)]
pub struct WorkerReady {
    /// Cluster id.
    pub name: String,
    /// Control API (and OpenAI API for colocated workers).
    pub url: String,
    /// KV server, if any.
    pub kv_addr: Option<SocketAddr>,
}

/// Runs a worker until `shutdown` resolves, then drains it: it stops taking work, leaves
/// membership (so the conductor routes elsewhere at once), finishes what it holds within
/// [`WorkerConfig::drain_timeout`] and returns `Ok`. Returns an error, having left membership,
/// when its engine thread dies, or when the registry refuses it on joining again after its lease
/// was lost (a lost lease is otherwise joined again). `on_ready` is called once it is registered
/// and serving.
pub async fn run_worker(
    config: WorkerConfig,
    listener: tokio::net::TcpListener,
    on_ready: impl FnOnce(WorkerReady),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    // Checked before the model loads, so a bad certificate fails at once.
    let kv_tls = kv_tls(&config)?;
    let loaded = load_off_runtime(&config.model, config.model_id.as_deref(), config.device).await?;
    let local = listener.local_addr()?;
    let host = config.advertise.unwrap_or(if local.ip().is_unspecified() {
        std::net::Ipv4Addr::LOCALHOST.into()
    } else {
        local.ip()
    });
    let name = config.name.clone().unwrap_or_else(|| format!("{}-{}-{}", config.role.as_str(), host, local.port()));
    let id = WorkerId::new(name.replace(['[', ']'], ""))?;
    // Instance ids are unique in a cluster: KV addresses, KV events and transfer peers carry
    // them. Derived from the cluster id (unique already), stable across restarts.
    let engine_config = baton_engine::EngineConfig { instance: instance_of(id.as_str()), ..config.engine.clone() };
    let engine = crate::engine(&loaded, engine_config, config.emulate.as_ref())?;
    let geometry = engine.kv_geometry();
    let options = WorkerOptions {
        lease: config.lease,
        secret: config.secret.clone(),
        kv_bind: config.kv_listen,
        kv_advertise: Some(config.advertise.unwrap_or(if config.kv_listen.ip().is_unspecified() {
            host
        } else {
            config.kv_listen.ip()
        })),
        transport: config.transport,
        compat: compat(&loaded, &engine),
        io_timeout: Duration::from_secs(10),
        push_delay: push_delay_from_env(),
        fetch_delay: fault_ms_from_env(FETCH_DELAY_ENV, "every pull of a fetched prefix pauses"),
        panic_at_step: panic_at_step_from_env(),
        drop_event_seq: drop_event_seq_from_env(),
        kv_tls,
        link: crate::emulated_link(config.emulate.as_ref(), config.emulate_link),
        refuse_role_switches: fault_count_from_env(REFUSE_ROLE_SWITCHES_ENV, "role switches are refused"),
    };
    let handle = WorkerHandle::spawn(id.to_string(), config.role, engine, options)?;
    let mut app = baton_worker::control::router(handle.clone(), config.secret.clone());
    match &config.api_key {
        // A colocated worker serves the OpenAI API itself only behind a key: its control port
        // would otherwise answer anyone with neither a key nor the cluster's signature.
        Some(key) if config.role == Role::Colocated => {
            let direct = Conductor::new(
                loaded.validator.clone(),
                vec![Arc::new(handle.clone())],
                Box::new(routing::LeastLoad::default()),
                Some(key.clone()),
                None,
            )
            .with_protect_metrics(true);
            app = app.merge(Arc::new(direct).router());
        }
        _ => {
            app = app.fallback(|| async {
                baton_protocol::error::ApiError::NotFound(
                    "not a route of a worker's control API: clients talk to the conductor (a colocated worker \
                     serves the OpenAI API itself when started with --api-key)"
                        .into(),
                )
            });
        }
    }
    let tls = match &config.tls {
        Some((cert, key)) => Some(baton_protocol::http::tls_acceptor(cert, key).map_err(ServeError::Config)?),
        None => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{}", SocketAddr::new(host, local.port()));
    let info = WorkerInfo {
        id: id.clone(),
        role: config.role,
        control_url: url.clone(),
        kv_addr: handle.kv_addr().map(|a| a.to_string()).unwrap_or_default(),
        model: loaded.validator.model_id.clone(),
        kv: KvSummary {
            num_layers: geometry.layers as u32,
            num_kv_heads: geometry.kv_heads as u32,
            head_dim: geometry.head_dim as u32,
            block_tokens: geometry.block_size as u32,
            dtype: format!("{:?}", geometry.dtype).to_lowercase(),
        },
        capacity_blocks: config.engine.num_blocks as u64,
        started_at_ms: baton_cluster::unix_millis(),
    };
    let limits = baton_protocol::http::HttpLimits::control();
    let mut server =
        tokio::spawn(crate::serve_draining(listener, app, limits, tls, std::future::pending(), Duration::ZERO));
    let ca = match &config.tls_ca {
        Some(path) => Some(
            std::fs::read(path).map_err(|e| ServeError::Config(format!("reading --tls-ca {}: {e}", path.display())))?,
        ),
        None => None,
    };
    let registry = baton_cluster::connect_with_ca(&config.registry, config.secret.clone(), ca.as_deref()).await?;
    let mut shutdown = std::pin::pin!(shutdown);
    // A worker started beside its conductor (a compose file, a pod, a script) may come up
    // first: it waits for the registry, saying so, rather than exiting.
    let mut lease = match join(registry.as_ref(), &info, config.ttl, &mut shutdown).await {
        Some(joined) => joined?,
        None => {
            server.abort();
            return Ok(());
        }
    };
    on_ready(WorkerReady { name: id.to_string(), url, kv_addr: handle.kv_addr() });
    let outcome = loop {
        tokio::select! {
            () = &mut shutdown => break Ok(()),
            why = handle.stopped() => break Err(format!("the worker stopped: {why}")),
            reason = lease.lost() => {
                // The registry dropped this worker (it was frozen or cut off past its TTL); the
                // conductor has already run its requests elsewhere and forgotten its blocks.
                // Join again as soon as the registry answers: the conductor takes a rejoining
                // worker clean and reads its cache from a fresh snapshot of its state stream.
                tracing::warn!(worker = %id, "lost cluster membership ({reason}); joining again");
                match join(registry.as_ref(), &info, config.ttl, &mut shutdown).await {
                    Some(Ok(l)) => {
                        tracing::info!(worker = %id, "joined the cluster again");
                        lease = l;
                    }
                    Some(Err(e)) => break Err(format!("joining the cluster again: {e}")),
                    None => {
                        server.abort();
                        return Ok(());
                    }
                }
            }
            r = &mut server => break Err(format!("the control API stopped: {r:?}")),
        }
    };
    // Stop taking work before leaving, so a request routed meanwhile is answered `Lost` (and
    // run elsewhere) rather than started here.
    handle.drain();
    if let Err(e) = registry.deregister(lease).await {
        tracing::error!(error = %e, "deregistering failed; the membership lease will lapse instead");
    }
    if let Err(why) = outcome {
        server.abort();
        tracing::error!(worker = %id, "{why}; left the cluster");
        return Err(ServeError::Config(why));
    }
    tracing::info!(worker = %id, "left the cluster; draining");
    let left = tokio::time::timeout(config.drain_timeout, handle.idle()).await;
    match left {
        Ok(()) => tracing::info!(worker = %id, "drained"),
        Err(_) => {
            let stats = handle.stats().await.unwrap_or_default();
            tracing::warn!(worker = %id, ?stats, "the drain deadline passed; stopping with work in flight");
        }
    }
    server.abort();
    Ok(())
}

/// Registers `info` (at start, or again after its lease was lost), retrying with back-off
/// (250 ms doubling to 5 s, jittered) while the registry cannot be reached; `None` when
/// `shutdown` came first. An error the registry gives (a refused proof, a conflicting member)
/// ends the retries.
async fn join(
    registry: &dyn baton_cluster::Registry,
    info: &WorkerInfo,
    ttl: Duration,
    shutdown: &mut (impl Future<Output = ()> + Unpin),
) -> Option<Result<baton_cluster::Lease, ClusterError>> {
    let mut waits = baton_protocol::retry::backoff(Duration::from_millis(250), Duration::from_secs(5));
    loop {
        tokio::select! {
            () = &mut *shutdown => return None,
            r = registry.register(info.clone(), ttl) => match r {
                Ok(lease) => return Some(Ok(lease)),
                Err(e) if e.is_transient() => tracing::warn!(error = %e, "the registry is unreachable; retrying"),
                Err(e) => return Some(Err(e)),
            },
        }
        tokio::select! {
            () = &mut *shutdown => return None,
            () = tokio::time::sleep(waits.next().unwrap_or(Duration::from_secs(5))) => {}
        }
    }
}

/// A conductor process.
#[derive(Debug, Clone)]
pub struct ConductorConfig {
    /// The model (its tokenizer, chat template and limits validate requests).
    pub model: PathBuf,
    /// The id clients name.
    pub model_id: Option<String>,
    /// The cluster's registry: `embedded` serves it from this process.
    pub registry: RegistryConfig,
    /// The shared secret.
    pub secret: ClusterSecret,
    /// Require `Authorization: Bearer <key>` from clients.
    pub api_key: Option<String>,
    /// Require the key on `/metrics` and `/health` too.
    pub protect_metrics: bool,
    /// How requests are routed and admitted.
    pub policy: crate::sched::PolicyChoice,
    /// Tokens per KV block of the workers (prompt hashing for prefix-aware policies).
    pub block_tokens: usize,
    /// How KV moves from prefill to decode workers (every worker supports both modes).
    pub kv_transfer: KvTransfer,
    /// Where past requests' KV is kept (`--pd-caching`).
    pub pd_caching: baton_protocol::wire::PdCaching,
    /// What feeds the conductor's KV index.
    pub kv_index: crate::view::KvIndexMode,
    /// Elastic prefill/decode (`--elastic`): switch workers' roles under imbalance.
    pub elastic: Option<crate::elastic::ElasticConfig>,
    /// On shutdown, how long the requests in flight may take to finish.
    pub drain_timeout: Duration,
    /// Serve the API over TLS with this certificate chain and private key (PEM files).
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Certificates (PEM) to trust for workers whose control API is `https://`, and for an
    /// `https://` etcd-less registry.
    pub tls_ca: Option<PathBuf>,
    /// How long a worker's generate stream may stay silent (workers send a keep-alive every
    /// [`baton_protocol::control::KEEPALIVE`]) before the request is taken from it.
    pub worker_timeout: Duration,
    /// How long a request may wait for decode room before it starts (`None`: no limit;
    /// [`Conductor::with_max_queue_wait`]).
    pub max_queue_wait: Option<Duration>,
}

/// The environment variable that delays a worker process's pushes (fault injection for
/// tests, see [`WorkerOptions::push_delay`]).
pub const PUSH_DELAY_ENV: &str = "BATON_FAULT_PUSH_DELAY_MS";

/// The environment variable that pauses a worker process's pulls of fetched prefixes midway
/// (fault injection for tests, see [`WorkerOptions::fetch_delay`]).
pub const FETCH_DELAY_ENV: &str = "BATON_FAULT_FETCH_DELAY_MS";

/// A worker's instance id from its cluster id: FNV-1a, so the same name gets the same id on
/// every start and different names differ (a collision needs ~65k workers to be likely).
pub fn instance_of(name: &str) -> baton_kv::InstanceId {
    baton_kv::InstanceId(baton_kv::fnv1a_32(name.as_bytes()))
}

/// The environment variable that makes a worker process refuse its first N role switches with
/// a 503 (fault injection for tests: a conductor whose switch fails).
pub const REFUSE_ROLE_SWITCHES_ENV: &str = "BATON_FAULT_REFUSE_ROLE_SWITCHES";

/// A fault injection variable's value: read only in builds with the `fault-injection` feature
/// (the tests'); elsewhere a variable that is set is ignored, with a warning.
fn fault_env(var: &str) -> Option<String> {
    let value = std::env::var(var).ok()?;
    if cfg!(feature = "fault-injection") {
        Some(value)
    } else {
        tracing::warn!("{var} is set but ignored: this build has no fault injection (cargo feature `fault-injection`)");
        None
    }
}

fn fault_count_from_env(var: &str, what: &str) -> u32 {
    let n = fault_env(var).and_then(|v| v.parse::<u32>().ok()).unwrap_or(0);
    if n > 0 {
        tracing::warn!("{var} is set: the first {n} {what} (fault injection)");
    }
    n
}

/// The environment variable that makes a worker process's engine thread panic at a given step
/// (fault injection for tests, see [`WorkerOptions::panic_at_step`]).
pub const PANIC_AT_STEP_ENV: &str = "BATON_FAULT_PANIC_AT_STEP";

fn panic_at_step_from_env() -> Option<u64> {
    let n = fault_env(PANIC_AT_STEP_ENV)?.parse::<u64>().ok()?;
    tracing::warn!("{PANIC_AT_STEP_ENV} is set: the engine thread panics at step {n} (fault injection)");
    Some(n)
}

/// The environment variable that makes a worker process leave one KV event out of its state
/// stream (fault injection for tests, see [`WorkerOptions::drop_event_seq`]).
pub const DROP_EVENT_ENV: &str = "BATON_FAULT_DROP_EVENT_SEQ";

fn drop_event_seq_from_env() -> Option<u64> {
    let seq = fault_env(DROP_EVENT_ENV)?.parse::<u64>().ok()?;
    tracing::warn!("{DROP_EVENT_ENV} is set: KV event {seq} is left out of the state stream (fault injection)");
    Some(seq)
}

fn push_delay_from_env() -> Duration {
    fault_ms_from_env(PUSH_DELAY_ENV, "every push of this worker waits")
}

/// A fault injection delay from the environment variable `var` (milliseconds), announced.
fn fault_ms_from_env(var: &str, what: &str) -> Duration {
    let ms = fault_env(var).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    if ms > 0 {
        tracing::warn!("{var} is set: {what} {ms} ms (fault injection)");
    }
    Duration::from_millis(ms)
}

/// Runs a conductor on `listener` until `shutdown` resolves.
pub async fn run_conductor(
    config: ConductorConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    // The tokenizer, chat template and config only: a conductor never runs the model.
    let (path, model_id) = (config.model.clone(), config.model_id.clone());
    let validator = tokio::task::spawn_blocking(move || crate::load_frontend(&path, model_id.as_deref()))
        .await
        .map_err(|e| ServeError::Config(format!("loading the model's tokenizer: {e}")))??;
    let elastic = config.elastic.clone().map(crate::elastic::Elastic::new);
    let conductor = Arc::new(
        Conductor::new(validator, Vec::new(), config.policy.build(config.block_tokens), config.api_key.clone(), None)
            .with_kv_transfer(config.kv_transfer)
            .with_pd_caching(config.pd_caching)
            .with_kv_index(config.kv_index)
            .with_protect_metrics(config.protect_metrics)
            .with_max_queue_wait(config.max_queue_wait)
            .with_elastic(elastic),
    );
    let mut app = conductor.clone().router();
    let registry: Arc<dyn Registry> = match &config.registry {
        RegistryConfig::Embedded => {
            let embedded = EmbeddedRegistry::start(config.secret.clone());
            app = baton_cluster::router(embedded.clone()).merge(app);
            Arc::new(embedded)
        }
        other => baton_cluster::connect(other, config.secret.clone()).await?,
    };
    let watch = registry.watch().await?;
    let ca = match &config.tls_ca {
        Some(path) => Some(
            std::fs::read(path).map_err(|e| ServeError::Config(format!("reading --tls-ca {}: {e}", path.display())))?,
        ),
        None => None,
    };
    let follower = tokio::spawn(follow(conductor, watch, config.secret.clone(), ca, config.worker_timeout));
    let tls = match &config.tls {
        Some((cert, key)) => Some(baton_protocol::http::tls_acceptor(cert, key).map_err(ServeError::Config)?),
        None => None,
    };
    let limits = baton_protocol::http::HttpLimits::default();
    let result = crate::serve_draining(listener, app, limits, tls, shutdown, config.drain_timeout).await;
    follower.abort();
    Ok(result?)
}

/// Keeps the conductor's workers in step with membership.
/// Workers whose control API is `https://` are trusted by the certificates of `ca_pem`; a
/// worker's generate stream silent for `worker_timeout` is given up on.
pub async fn follow(
    conductor: Arc<Conductor>,
    mut watch: MembershipWatch,
    secret: ClusterSecret,
    ca_pem: Option<Vec<u8>>,
    worker_timeout: Duration,
) {
    let mut remotes: HashMap<WorkerId, Arc<RemoteWorker>> = HashMap::new();
    while let Some(event) = watch.recv().await {
        match event {
            MembershipEvent::Joined(info) => {
                if info.model != conductor.model_id() {
                    tracing::warn!(
                        worker = %info.id,
                        model = info.model,
                        "a worker serving another model joined; ignoring it (start it with the same --model-id)"
                    );
                    continue;
                }
                // Said once, here; routing then pairs workers only of one KV kind.
                let kind = info.kv.to_string();
                if let Some(other) =
                    remotes.iter().find_map(|(id, w)| (*id != info.id && w.kv_kind() != Some(&kind)).then_some(w))
                {
                    tracing::warn!(
                        worker = %info.id,
                        kv = %info.kv,
                        other = other.name(),
                        other_kv = other.kv_kind().unwrap_or_default(),
                        "a worker joined whose KV cache differs from another's: no KV moves between them, so \
                         requests pair prefill and decode workers of one KV kind only, and run whole on a decode \
                         worker where no prefill worker shares its kind (start every worker with the same \
                         --kv-dtype and --block-size)"
                    );
                }
                match RemoteWorker::with_ca(info.clone(), secret.clone(), ca_pem.as_deref()) {
                    Ok(w) => {
                        let w = Arc::new(w.with_idle_timeout(worker_timeout));
                        if let Some(old) = remotes.insert(info.id.clone(), w.clone()) {
                            old.mark_gone();
                        }
                        conductor.add_worker(w);
                    }
                    Err(e) => tracing::error!(worker = %info.id, error = %e, "cannot reach the worker that joined"),
                }
            }
            MembershipEvent::Left(id, reason) => {
                tracing::warn!(worker = %id, ?reason, "worker left the cluster");
                conductor.remove_worker(id.as_str());
                // A worker that said goodbye is draining: its requests in flight finish over
                // their own streams. One presumed dead loses them now (they run elsewhere).
                if let Some(w) = remotes.remove(&id)
                    && reason != LeftReason::Deregistered
                {
                    w.mark_gone();
                }
            }
        }
    }
    tracing::error!("the membership watch ended; the worker set is frozen");
}

/// Whether every worker reports no request in flight and every block allocatable.
pub async fn all_quiet(workers: &[Arc<dyn Worker>]) -> bool {
    for w in workers {
        match w.stats().await {
            Some(s) if s.is_quiet() => {}
            _ => return false,
        }
    }
    true
}
