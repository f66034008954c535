//! Baton's conductor: an OpenAI-compatible HTTP API that routes each request to prefill and decode
//! workers and streams the answer, and the assembly of a deployment (`baton serve` runs the
//! conductor and its workers in one process).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use baton_conductor::{ServeConfig, build};
//!
//! let config = ServeConfig::new("fixtures/models/tiny-llama".into());
//! let conductor = build(&config)?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//! baton_conductor::serve(listener, conductor, std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! Modules: [`openai`] parses and validates request bodies; [`structured`] turns
//! `response_format` and `tools` into grammars and prompts and parses tool calls back out of
//! the generated text; [`conductor`] serves HTTP and drives each request choice's life (the
//! sans-I/O state machine in `life.rs`); [`view`] is the conductor's view of its workers (the
//! exact KV index fed by their state streams, and their load reports); [`remote`] is the
//! conductor's client of a worker's control API; [`deploy`] runs `baton worker` and `baton
//! conductor` processes; [`routing`] is the policy seam and [`sched`] its adapter to
//! `baton-sched`; [`elastic`] switches workers' roles; [`metrics`] renders Prometheus text and [`dashboard`] the live status page over it. What
//! conductor and workers share is `baton-protocol`; the workers themselves are `baton-worker`.

pub mod conductor;
pub mod dashboard;
pub mod deploy;
pub mod elastic;
mod life;
mod loads;
pub mod metrics;
pub mod openai;
pub mod remote;
mod response;
pub mod routing;
pub mod sched;
pub mod structured;
pub mod view;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_engine::{Engine, EngineConfig};
use baton_model::Checkpoint;

use baton_protocol::http;
use baton_protocol::wire::{self, KvTransfer, Role};
use baton_protocol::worker::Worker;
use baton_worker::handoff;
use baton_worker::worker::{self, TransportChoice, WorkerHandle, WorkerOptions};
pub use conductor::Conductor;

/// An all-in-one deployment: a conductor and its workers in one process.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Hugging Face checkpoint directory or GGUF file.
    pub model: PathBuf,
    /// Where the model computes (`--device`, `--dtype`); the workers share its weights.
    pub device: baton_model::DeviceOptions,
    /// The id clients name in `model` (default: the file or directory name).
    pub model_id: Option<String>,
    /// Prefill workers.
    pub prefill: usize,
    /// Decode workers.
    pub decode: usize,
    /// Colocated workers (prefill and decode in one engine).
    pub colocated: usize,
    /// Each worker's engine.
    pub engine: EngineConfig,
    /// Require `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Require the key on `/metrics` and `/health` too.
    pub protect_metrics: bool,
    /// How long a prefill worker holds handed-off KV that no one releases.
    pub lease: Duration,
    /// How the conductor routes (and admits) requests.
    pub policy: sched::PolicyChoice,
    /// How KV moves from prefill to decode workers.
    pub kv_transfer: KvTransfer,
    /// Where past requests' KV is kept (`--pd-caching`).
    pub pd_caching: wire::PdCaching,
    /// What feeds the conductor's KV index.
    pub kv_index: view::KvIndexMode,
    /// Elastic prefill/decode (`--elastic`): switch workers' roles under imbalance.
    pub elastic: Option<elastic::ElasticConfig>,
    /// Fault injection for tests (see [`WorkerOptions::push_delay`]).
    pub push_delay: Duration,
    /// Emulate the model with this cost profile instead of computing it (the engine loop, KV
    /// pool and transfers stay real; step times and tokens are emulated).
    pub emulate: Option<baton_sched::CostProfile>,
    /// With `emulate`: each worker receives KV over a link of this speed, carrying the emulated
    /// model's KV bytes (the profile's `kv_bytes_per_token`), so a hand-off takes as long as it
    /// would between GPU instances (`None`: as long as the emulated arena's copy).
    pub emulate_link: Option<baton_sched::Link>,
    /// How long a request's worker may send nothing before the conductor probes whether it is
    /// alive ([`Conductor::with_worker_silence`]).
    pub worker_silence: Duration,
    /// How long a request may wait for decode room before it starts (`--max-queue-wait`;
    /// `None`: no limit; [`Conductor::with_max_queue_wait`]).
    pub max_queue_wait: Option<Duration>,
}

impl ServeConfig {
    /// One prefill and one decode worker with default engines.
    pub fn new(model: PathBuf) -> Self {
        Self {
            model,
            device: baton_model::DeviceOptions::default(),
            model_id: None,
            prefill: 1,
            decode: 1,
            colocated: 0,
            engine: EngineConfig::default(),
            api_key: None,
            protect_metrics: false,
            lease: worker::DEFAULT_LEASE,
            policy: sched::PolicyChoice::default(),
            kv_transfer: KvTransfer::default(),
            pd_caching: wire::PdCaching::default(),
            kv_index: view::KvIndexMode::default(),
            elastic: None,
            push_delay: Duration::ZERO,
            emulate: None,
            emulate_link: None,
            worker_silence: conductor::WORKER_SILENCE,
            max_queue_wait: Some(conductor::DEFAULT_MAX_QUEUE_WAIT),
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The model failed to load.
    #[error(transparent)]
    Model(#[from] baton_model::ModelError),
    /// An engine could not be built.
    #[error(transparent)]
    Engine(#[from] baton_engine::EngineError),
    /// Threads or sockets.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The configuration makes no deployment.
    #[error("{0}")]
    Config(String),
    /// Cluster membership failed.
    #[error(transparent)]
    Cluster(#[from] baton_cluster::ClusterError),
}

/// A loaded model as the serving layer uses it: the validator (tokenizer, chat template,
/// limits) and the model itself.
pub(crate) struct Loaded {
    pub(crate) validator: openai::Validator,
    pub(crate) model: Arc<baton_model::Model>,
    pub(crate) tokenizer: Arc<baton_model::Tokenizer>,
}

pub(crate) fn load(
    path: &std::path::Path,
    model_id: Option<&str>,
    device: baton_model::DeviceOptions,
) -> Result<Loaded, ServeError> {
    let ckpt = Checkpoint::open_on(path, device)?;
    let model_id = model_id
        .map(str::to_owned)
        .unwrap_or_else(|| path.file_stem().map_or_else(|| "baton".to_owned(), |s| s.to_string_lossy().into_owned()));
    let tokenizer = Arc::new(ckpt.tokenizer);
    let model = Arc::new(ckpt.model);
    let max_context = model.config().max_position_embeddings;
    let validator = openai::Validator {
        aliases: model_aliases(path, &model_id),
        model_id,
        tokenizer: tokenizer.clone(),
        template: ckpt.chat_template.map(Arc::new),
        max_context,
        vocab_size: model.config().vocab_size,
        max_prompt_bytes: openai::Validator::prompt_bytes_bound(&tokenizer, max_context),
    };
    Ok(Loaded { validator, model, tokenizer })
}

/// Other names a client may give the served model: the path it was loaded from, and the short
/// name of a model `scripts/fetch-model.sh` knows (`smollm2-135m-instruct` for its GGUF file).
/// Answers name the model by its id.
fn model_aliases(path: &std::path::Path, model_id: &str) -> Vec<String> {
    let mut aliases = vec![path.display().to_string()];
    let file = path.file_name().and_then(|f| f.to_str());
    aliases.extend(baton_model::KNOWN_MODELS.iter().filter(|k| Some(k.file) == file).map(|k| k.name.to_owned()));
    aliases.retain(|a| a != model_id);
    aliases
}

/// What a conductor needs of a model, without its weights: the validator (tokenizer, chat
/// template, limits).
pub fn load_frontend(path: &std::path::Path, model_id: Option<&str>) -> Result<openai::Validator, ServeError> {
    let front = baton_model::Frontend::open(path)?;
    let model_id = model_id
        .map(str::to_owned)
        .unwrap_or_else(|| path.file_stem().map_or_else(|| "baton".to_owned(), |s| s.to_string_lossy().into_owned()));
    let max_context = front.config.max_position_embeddings;
    let validator = openai::Validator {
        aliases: model_aliases(path, &model_id),
        model_id,
        max_context,
        vocab_size: front.config.vocab_size,
        max_prompt_bytes: openai::Validator::prompt_bytes_bound(&front.tokenizer, max_context),
        tokenizer: Arc::new(front.tokenizer),
        template: front.chat_template.map(Arc::new),
    };
    Ok(validator)
}

/// The compatibility record KV peers compare: model id and the engine's KV geometry.
pub(crate) fn compat(loaded: &Loaded, engine: &Engine) -> baton_transfer::Compat {
    baton_transfer::Compat::new(loaded.validator.model_id.clone(), engine.kv_geometry())
}

/// The emulated link of a worker emulating `profile`, if one is asked for.
pub(crate) fn emulated_link(
    profile: Option<&baton_sched::CostProfile>,
    link: Option<baton_sched::Link>,
) -> Option<Arc<handoff::EmulatedLink>> {
    Some(Arc::new(handoff::EmulatedLink::new(link?, profile?.kv_bytes_per_token)))
}

/// An engine for the loaded model: computing it, or emulating it with a cost profile.
pub(crate) fn engine(
    loaded: &Loaded,
    config: EngineConfig,
    emulate: Option<&baton_sched::CostProfile>,
) -> Result<Engine, ServeError> {
    let tokenizer = Some(loaded.tokenizer.clone());
    Ok(match emulate {
        None => Engine::new(loaded.model.clone(), tokenizer, config)?,
        Some(profile) => Engine::emulated(
            baton_engine::EmulatedModel::new(loaded.model.config().clone(), profile.clone()),
            tokenizer,
            config,
        )?,
    })
}

/// Loads the model once and starts the workers (sharing its weights) and the conductor. KV
/// moves between the workers over the shared-memory transport, pulled or pushed as
/// `config.kv_transfer` says.
pub fn build(config: &ServeConfig) -> Result<Arc<Conductor>, ServeError> {
    if config.prefill + config.decode + config.colocated == 0 {
        return Err(ServeError::Config("at least one worker is needed".into()));
    }
    if (config.prefill == 0) != (config.decode == 0) {
        return Err(ServeError::Config("prefill and decode workers come together (or use colocated workers)".into()));
    }
    let loaded = load(&config.model, config.model_id.as_deref(), config.device)?;
    let secret = baton_cluster::ClusterSecret::random();
    let mut workers: Vec<Arc<dyn Worker>> = Vec::new();
    let roles = std::iter::repeat_n(Role::Prefill, config.prefill)
        .chain(std::iter::repeat_n(Role::Decode, config.decode))
        .chain(std::iter::repeat_n(Role::Colocated, config.colocated));
    for (i, role) in roles.enumerate() {
        let mut engine_config = config.engine.clone();
        engine_config.instance = baton_kv::InstanceId(i as u32);
        let engine = engine(&loaded, engine_config, config.emulate.as_ref())?;
        let options = WorkerOptions {
            lease: config.lease,
            secret: secret.clone(),
            kv_bind: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            kv_advertise: None,
            transport: TransportChoice::Shm,
            compat: compat(&loaded, &engine),
            io_timeout: Duration::from_secs(10),
            push_delay: config.push_delay,
            fetch_delay: Duration::ZERO,
            panic_at_step: None,
            drop_event_seq: None,
            kv_tls: None,
            link: emulated_link(config.emulate.as_ref(), config.emulate_link),
            refuse_role_switches: 0,
        };
        let name = format!("{}-{i}", role.as_str());
        workers.push(Arc::new(WorkerHandle::spawn(name, role, engine, options)?));
    }
    let bytes_per_token =
        config.emulate.as_ref().map(|profile| usize::try_from(profile.kv_bytes_per_token).unwrap_or(usize::MAX));
    let elastic = config.elastic.clone().map(elastic::Elastic::new);
    Ok(Arc::new(
        Conductor::new(
            loaded.validator,
            workers,
            config.policy.build(config.engine.block_size),
            config.api_key.clone(),
            bytes_per_token,
        )
        .with_kv_transfer(config.kv_transfer)
        .with_pd_caching(config.pd_caching)
        .with_kv_index(config.kv_index)
        .with_protect_metrics(config.protect_metrics)
        .with_worker_silence(config.worker_silence)
        .with_max_queue_wait(config.max_queue_wait)
        .with_elastic(elastic),
    ))
}

/// Serves the conductor's API on `listener` until `shutdown` resolves (then waits for the
/// requests in flight), within the default [`http::HttpLimits`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    conductor: Arc<Conductor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    http::serve(listener, conductor.router(), http::HttpLimits::default(), None, shutdown, Duration::MAX).await
}

/// Serves `app` within `limits` (over TLS with `tls`) until `shutdown` resolves; then stops
/// accepting connections and lets the requests in flight (streams included) finish, for at most
/// `drain`.
pub async fn serve_draining(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: http::HttpLimits,
    tls: Option<http::TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    drain: Duration,
) -> std::io::Result<()> {
    http::serve(listener, app, limits, tls, shutdown, drain).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_models_file_answers_to_its_short_name_and_path() {
        let file = baton_model::KNOWN_MODELS[0];
        let path = std::path::Path::new(".models").join(file.file);
        let aliases = model_aliases(&path, "SmolLM2");
        assert!(aliases.contains(&file.name.to_owned()), "{aliases:?}");
        assert!(aliases.contains(&path.display().to_string()), "{aliases:?}");
        assert!(model_aliases(std::path::Path::new("some/dir"), "dir").iter().all(|a| a == "some/dir"));
    }
}
