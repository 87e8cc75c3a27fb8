//! `serve`'s settings: flags, `PREFIX_ROUTER_*` variables and the TOML config file, plus the
//! production-stack router's flags where they map.
//!
//! Precedence: command line, then environment, then config file, then defaults. The config file
//! takes the same keys as the long flags (`policy = "prefix_load"`, `cache-threshold = 0.6`) and
//! `[[backends]]` tables with `url`, `models`, `capacity`, `weight` and `api-key`.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{CommandFactory, FromArgMatches};
use serde::Deserialize;

use super::backend::BackendSpec;
use super::policy::PolicyKind;
use crate::core::disagg::Role;
use crate::store_args::StoreArgs;

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "PREFIX_ROUTER_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// A backend's base URL (repeatable, or comma-separated).
    #[arg(
        long = "backend",
        env = "PREFIX_ROUTER_BACKENDS",
        value_delimiter = ','
    )]
    pub backends: Vec<String>,
    /// A prefill server of a disaggregated fleet (repeatable, or comma-separated): it computes
    /// prompts whose KV blocks a decode server then pulls (vLLM's NixlConnector).
    #[arg(long = "prefill", env = "PREFIX_ROUTER_PREFILL", value_delimiter = ',')]
    pub prefill_backends: Vec<String>,
    /// A decode server of a disaggregated fleet (repeatable, or comma-separated): it answers
    /// requests, pulling their prompts from a prefill server unless it holds most of them.
    #[arg(long = "decode", env = "PREFIX_ROUTER_DECODE", value_delimiter = ',')]
    pub decode_backends: Vec<String>,
    /// Disaggregated fleets: a decode server computes a request's prompt itself when it lacks
    /// at most this many of its tokens (no prefill server, no transfer).
    #[arg(long, env = "PREFIX_ROUTER_PD_THRESHOLD", default_value_t = 512)]
    pub pd_threshold: u64,
    /// Disaggregated fleets: the longest a prefill server may take to answer; after it (or
    /// its failure) the decode server computes the prompt itself.
    #[arg(long, env = "PREFIX_ROUTER_PD_PREFILL_TIMEOUT", default_value = "30s", value_parser = crate::duration::parse)]
    pub pd_prefill_timeout: Duration,
    /// TOML config file (re-read when it changes: backends join and leave).
    #[arg(long, env = "PREFIX_ROUTER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Routing policy.
    #[arg(long, env = "PREFIX_ROUTER_POLICY", value_enum, default_value = "cost")]
    pub policy: PolicyKind,
    /// prefix_load: below this matched fraction, route by load instead.
    #[arg(long, env = "PREFIX_ROUTER_CACHE_THRESHOLD", default_value_t = 0.5)]
    pub cache_threshold: f64,
    /// prefix_load and cost: the load guard trips when the matched backend has more requests in flight
    /// above the least loaded one than 1.5 times the fleet's mean load per backend (at least 6,
    /// at most this many)...
    #[arg(long, env = "PREFIX_ROUTER_BALANCE_ABS", default_value_t = 16)]
    pub balance_abs: u64,
    /// ... and more than this times its in-flight count.
    #[arg(long, env = "PREFIX_ROUTER_BALANCE_REL", default_value_t = 1.5)]
    pub balance_rel: f64,
    /// session policy: the header naming the session.
    #[arg(
        long,
        env = "PREFIX_ROUTER_SESSION_HEADER",
        default_value = "x-session-id"
    )]
    pub session_header: String,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Precise mode: follow every backend's KV-cache events (vLLM's ZMQ publisher) and match
    /// requests by their token blocks where a backend's events are live; the string index
    /// answers for the others. Needs a tokenizer per model (`--tokenizer`).
    #[arg(long, env = "PREFIX_ROUTER_KV_EVENTS")]
    pub kv_events: bool,
    /// The publishers' port on the backends' hosts (vLLM's default), unless a backend's
    /// config names its own (`kv-events = "tcp://host:port"`).
    #[arg(long, env = "PREFIX_ROUTER_KV_EVENTS_PORT", default_value_t = 5557)]
    pub kv_events_port: u16,
    /// The publishers' replay sockets on the backends' hosts (vLLM opens one when its
    /// `--kv-events-config` has a `replay_endpoint`), unless a backend's config names its own
    /// (`kv-replay = "tcp://host:port"`). With it, batches missed in a sequence gap or before
    /// joining are asked for again instead of re-learning the backend.
    #[arg(long, env = "PREFIX_ROUTER_KV_REPLAY_PORT")]
    pub kv_replay_port: Option<u16>,
    /// A backend whose publisher was joined while running (at start, after a reconnection or
    /// a sequence gap) is trusted after this long; the string index answers for it meanwhile
    /// (a fresh publisher, or an emptied cache, is trusted at once).
    #[arg(long, env = "PREFIX_ROUTER_KV_WARMUP", default_value = "30s", value_parser = crate::duration::parse)]
    pub kv_warmup: Duration,
    /// The largest message (one batch of events, or of a replay) accepted from a publisher, in
    /// bytes: a larger one is refused before it is read, and the publisher disconnected.
    #[arg(long, env = "PREFIX_ROUTER_KV_EVENTS_MAX_MESSAGE", default_value_t = 16 << 20, value_parser = message_size)]
    pub kv_events_max_message: usize,
    /// How long a routed request's blocks count as held before the backend reports them.
    #[arg(long, env = "PREFIX_ROUTER_KV_CREDIT", default_value = "2s", value_parser = crate::duration::parse)]
    pub kv_credit: Duration,
    /// `MODEL=DIR`: the model's tokenizer and chat template (`tokenizer.json`,
    /// `tokenizer_config.json`, `chat_template.jinja`), to compute token ids as vLLM does
    /// (repeatable; `[tokenizers]` in the config file).
    #[arg(
        long = "tokenizer",
        env = "PREFIX_ROUTER_TOKENIZERS",
        value_delimiter = ','
    )]
    pub tokenizers: Vec<String>,
    /// Precise mode: request bodies larger than this (bytes) are not tokenized; the string
    /// index matches them (tokenizing megabytes costs the router seconds of CPU).
    #[arg(long, env = "PREFIX_ROUTER_TOKENIZE_MAX_BYTES", default_value_t = 2 << 20)]
    pub tokenize_max_bytes: usize,
    /// A shared remote `prefix-router index` to use as the store instead of `--store`.
    #[arg(long, env = "PREFIX_ROUTER_INDEX_URL")]
    pub index_url: Option<String>,
    /// Export a trace span per request to this OpenTelemetry collector over OTLP/HTTP (JSON),
    /// e.g. `http://otel-collector:4318` (off by default).
    #[arg(long, env = "PREFIX_ROUTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// How often finished spans are sent to the collector.
    #[arg(long, env = "PREFIX_ROUTER_OTLP_INTERVAL", default_value = "5s", value_parser = crate::duration::parse)]
    pub otlp_interval: Duration,
    #[command(flatten)]
    pub bus: crate::replica_bus::ReplicaBusArgs,
    /// Longest wait for the prefix store on a request before routing by load.
    #[arg(long, env = "PREFIX_ROUTER_STORE_TIMEOUT", default_value = "50ms", value_parser = crate::duration::parse)]
    pub store_timeout: Duration,
    /// Interval of the health checks (`GET /health`).
    #[arg(long, env = "PREFIX_ROUTER_HEALTH_INTERVAL", default_value = "5s", value_parser = crate::duration::parse)]
    pub health_interval: Duration,
    /// Failed checks (or connection failures) before a backend leaves the candidates.
    #[arg(long, env = "PREFIX_ROUTER_UNHEALTHY_AFTER", default_value_t = 2)]
    pub unhealthy_after: u32,
    /// Interval of the load scrapes (`GET /metrics`).
    #[arg(long, env = "PREFIX_ROUTER_METRICS_INTERVAL", default_value = "1s", value_parser = crate::duration::parse)]
    pub metrics_interval: Duration,
    /// Retries on the next candidate after a connection error or a 5xx before any byte went
    /// to the client.
    #[arg(long, env = "PREFIX_ROUTER_MAX_RETRIES", default_value_t = 2)]
    pub max_retries: usize,
    /// Longest a request may take end to end (504 before the answer began).
    #[arg(long, env = "PREFIX_ROUTER_REQUEST_TIMEOUT", default_value = "600s", value_parser = crate::duration::parse)]
    pub request_timeout: Duration,
    /// Longest wait for a TCP connection to a backend.
    #[arg(long, env = "PREFIX_ROUTER_CONNECT_TIMEOUT", default_value = "2s", value_parser = crate::duration::parse)]
    pub connect_timeout: Duration,
    /// Bearer token sent to every backend (a backend's own `api-key` in the config wins).
    #[arg(long, env = "PREFIX_ROUTER_BACKEND_API_KEY", hide_env_values = true)]
    pub backend_api_key: Option<String>,
    /// Largest accepted request body, in bytes.
    #[arg(long, env = "PREFIX_ROUTER_MAX_BODY", default_value_t = 32 << 20)]
    pub max_body: usize,
    /// Streamed requests: longest wait for a backend's answer to begin (its status line)
    /// before the next candidate is tried, so a hung backend costs this much, not the whole
    /// request timeout. (A non-streamed answer begins only when generation ends: it is bounded
    /// by --request-timeout alone.)
    #[arg(long, env = "PREFIX_ROUTER_UPSTREAM_TIMEOUT", default_value = "120s", value_parser = crate::duration::parse)]
    pub upstream_timeout: Duration,
    /// Bearer token for the remote index (`--index-url`): its admin key when it has one.
    #[arg(long, env = "PREFIX_ROUTER_INDEX_KEY", hide_env_values = true)]
    pub index_key: Option<String>,
    #[command(flatten)]
    pub access: crate::access::AccessArgs,
    #[command(flatten)]
    pub tenants: crate::tenants::TenantsArgs,
    #[command(flatten)]
    pub limits: crate::server::ServerLimits,
    #[command(flatten)]
    pub queue: QueueArgs,

    /// Where backends come from: `static` (flags and config file) or `k8s` (pods, plus any
    /// static ones).
    #[arg(long, env = "PREFIX_ROUTER_DISCOVERY", default_value = "static", value_parser = ["static", "k8s"])]
    pub discovery: String,
    /// k8s: the namespace to watch (default: the pod's own, or KUBECONFIG's).
    #[arg(long, alias = "k8s-namespace", env = "PREFIX_ROUTER_NAMESPACE")]
    pub namespace: Option<String>,
    /// k8s: label selector of the vLLM pods, e.g. `app=vllm`.
    #[arg(
        long,
        alias = "k8s-label-selector",
        env = "PREFIX_ROUTER_LABEL_SELECTOR"
    )]
    pub label_selector: Option<String>,
    /// k8s: the pods' port, unless a pod declares a container port named `http`.
    #[arg(long, env = "PREFIX_ROUTER_K8S_PORT", default_value_t = 8000)]
    pub k8s_port: u16,
    /// k8s: a pod label naming the model the pod serves (else its /v1/models is asked).
    #[arg(long, env = "PREFIX_ROUTER_K8S_MODEL_LABEL", default_value = "model")]
    pub k8s_model_label: String,
    /// k8s: a pod label naming the pod's role in a disaggregated fleet (`prefill`, `decode`,
    /// `both`), as llm-d labels its pods.
    #[arg(
        long,
        env = "PREFIX_ROUTER_K8S_ROLE_LABEL",
        default_value = "llm-d.ai/role"
    )]
    pub k8s_role_label: String,
    /// k8s: take the pods' selector and ports from this InferencePool
    /// (`inference.networking.k8s.io/v1`, in `--namespace`), following its changes, instead of
    /// `--label-selector` and `--k8s-port`. Implies `--discovery k8s`.
    #[arg(long, env = "PREFIX_ROUTER_INFERENCE_POOL")]
    pub inference_pool: Option<String>,

    // The production-stack router's flags, mapped onto ours.
    /// (production-stack) Comma-separated backend URLs.
    #[arg(long, hide = true)]
    pub static_backends: Option<String>,
    /// (production-stack) Comma-separated models, one per static backend (or one for all).
    #[arg(long, hide = true)]
    pub static_models: Option<String>,
    /// (production-stack) roundrobin | session | prefixaware | kvaware.
    #[arg(long, hide = true)]
    pub routing_logic: Option<String>,
    /// (production-stack) The session header.
    #[arg(long, hide = true)]
    pub session_key: Option<String>,
    /// (production-stack) Port to listen on.
    #[arg(long, hide = true)]
    pub port: Option<u16>,
    /// (production-stack) Host to listen on.
    #[arg(long, hide = true)]
    pub host: Option<IpAddr>,
    /// (production-stack) `static` or `k8s`.
    #[arg(long, hide = true)]
    pub service_discovery: Option<String>,
}

/// `[[backends]]` of the config file.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileBackend {
    url: String,
    models: Option<Vec<String>>,
    capacity: Option<u64>,
    weight: Option<u32>,
    #[serde(alias = "api_key")]
    api_key: Option<String>,
    #[serde(alias = "kv_events")]
    kv_events: Option<String>,
    #[serde(alias = "kv_replay")]
    kv_replay: Option<String>,
    /// `prefill`, `decode` or `both`.
    role: Option<String>,
}

#[derive(clap::Parser)]
struct Wrapper {
    #[command(flatten)]
    args: ServeArgs,
}

/// The gateway queue (flow control): off unless a saturation bound is set.
#[derive(clap::Args, Debug, Clone)]
pub struct QueueArgs {
    /// Hold requests at the router while every backend for their model would make them wait
    /// longer than this before their prefill starts (predicted from the prefill queued there
    /// and the backend's learned prefill speed). Turns the queue on.
    #[arg(long, env = "PREFIX_ROUTER_MAX_QUEUE_WAIT", value_parser = crate::duration::parse)]
    pub max_queue_wait: Option<Duration>,
    /// Also hold them while every backend has at least this many requests waiting for their
    /// first byte (this router's, counted live, plus those of others that
    /// `vllm:num_requests_waiting` reported beyond ours at the last scrape). Turns the queue on.
    #[arg(long, env = "PREFIX_ROUTER_QUEUE_WHEN_WAITING")]
    pub queue_when_waiting: Option<u64>,
    /// Also hold them while every backend's KV cache is at least this full (a share, 0 to 1):
    /// vLLM makes a request wait for blocks when its cache is full, in arrival order. The use
    /// is the backend's `vllm:kv_cache_usage_perc` at the last scrape, less this router's
    /// requests then, plus this router's requests in flight now (their uncached prompt
    /// tokens), of its `num_gpu_blocks × block_size`. Turns the queue on.
    #[arg(long, env = "PREFIX_ROUTER_QUEUE_WHEN_KV_USAGE", value_parser = share)]
    pub queue_when_kv_usage: Option<f64>,
    /// Requests held at once; one more gets 429 with `Retry-After`.
    #[arg(long, env = "PREFIX_ROUTER_MAX_QUEUED", default_value_t = 1000)]
    pub max_queued: usize,
    /// Longest stay in the queue; then 503 with `Retry-After`.
    #[arg(long, env = "PREFIX_ROUTER_QUEUE_TIMEOUT", default_value = "60s", value_parser = crate::duration::parse)]
    pub queue_timeout: Duration,
    /// Header naming a request's tenant (tenants of one priority take turns in the queue),
    /// read only with `--trust-client-headers`; otherwise a request's tenant is its keys-file
    /// tenant, else its bearer token.
    #[arg(long, env = "PREFIX_ROUTER_TENANT_HEADER", default_value = "x-tenant")]
    pub tenant_header: String,
    /// Take `x-priority` and the tenant header from clients that are no keys-file tenant
    /// (behind a gateway that sets or strips them). Without it they are ignored: any client
    /// could otherwise jump the queue or take a new turn per request. A keys-file tenant may
    /// always lower its priority with `x-priority`.
    #[arg(long, env = "PREFIX_ROUTER_TRUST_CLIENT_HEADERS")]
    pub trust_client_headers: bool,
    /// Also tell the backends each request's priority: written into the body as vLLM's
    /// `priority` (negated: vLLM serves lower values first), so that backends started with
    /// `--scheduling-policy priority` order their own waiting requests by it too. Only for
    /// such backends (vLLM refuses a non-zero priority otherwise); a body that sets
    /// `priority` itself is left as it is. Not in endpoint-picker mode, where Envoy sends the
    /// body.
    #[arg(long, env = "PREFIX_ROUTER_FORWARD_PRIORITY")]
    pub forward_priority: bool,
    /// The share (0 to 1) of the queue's bounds kept for requests above the default
    /// priority: requests of priority 0 or below are held once every backend reaches
    /// `1 - share` of `--queue-when-waiting` (at least one waiting), of `--queue-when-kv-usage`
    /// or of `--max-queue-wait`,
    /// so a high-priority request finds room, and few waiting ahead of it, when it comes.
    #[arg(long, env = "PREFIX_ROUTER_QUEUE_PRIORITY_RESERVE", default_value_t = 0.0, value_parser = share)]
    pub queue_priority_reserve: f64,
}

/// A message size in bytes, 4 KiB to 1 GiB.
fn message_size(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (4096..=1 << 30).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a size in bytes from 4096 to 1073741824"
        )),
    }
}

/// A share between 0 and 1.
fn share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err(format!("`{s}` is not a share between 0 and 1")),
    }
}

impl QueueArgs {
    pub fn settings(&self) -> crate::core::admission::AdmissionSettings {
        crate::core::admission::AdmissionSettings {
            max_wait: self.max_queue_wait,
            max_waiting: self.queue_when_waiting,
            max_kv_usage: self.queue_when_kv_usage,
            max_queued: self.max_queued,
            timeout: self.queue_timeout,
            priority_reserve: self.queue_priority_reserve,
        }
    }
}

impl ServeArgs {
    /// The defaults, with the given backends.
    pub fn with_backends(listen: SocketAddr, backends: &[String]) -> Self {
        let mut args = <Wrapper as clap::Parser>::parse_from(["serve"]).args;
        args.listen = listen;
        args.backends = backends.to_vec();
        args
    }

    /// Parses `serve`'s words (as on the command line, without `serve`) and resolves them.
    pub fn from_words(words: &[String]) -> anyhow::Result<Self> {
        let mut argv = vec!["serve".to_owned()];
        argv.extend(words.iter().cloned());
        // Later words override earlier ones, as in the config-file merge.
        let matches = Wrapper::command()
            .args_override_self(true)
            .try_get_matches_from(argv)?;
        let args = Wrapper::from_arg_matches(&matches)?.args;
        args.resolve(words)
    }

    /// Applies the config file (for keys neither on the command line nor in the environment)
    /// and the production-stack flags. `cli` is the `serve` part of the command line.
    pub fn resolve(self, cli: &[String]) -> anyhow::Result<Self> {
        let mut args = match &self.config {
            None => self,
            Some(path) => {
                let file_args = file_flags(path)?;
                let mut argv = vec!["serve".to_owned()];
                argv.extend(file_args);
                argv.extend(cli.iter().cloned());
                let cmd = Wrapper::command().args_override_self(true);
                let matches = cmd
                    .try_get_matches_from(argv)
                    .with_context(|| format!("in config file {}", path.display()))?;
                let mut args = Wrapper::from_arg_matches(&matches)?.args;
                args.config = Some(path.clone());
                args
            }
        };
        args.apply_production_stack_flags()?;
        Ok(args)
    }

    fn apply_production_stack_flags(&mut self) -> anyhow::Result<()> {
        if let Some(list) = &self.static_backends {
            self.backends.extend(
                list.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned),
            );
        }
        if let Some(logic) = &self.routing_logic {
            self.policy = match logic.as_str() {
                "roundrobin" | "round_robin" => PolicyKind::RoundRobin,
                "session" => PolicyKind::Session,
                "prefixaware" | "kvaware" | "cache_aware" => PolicyKind::Cost,
                "least_loaded" | "leastloaded" => PolicyKind::LeastLoaded,
                other => bail!("--routing-logic {other:?} is not supported (roundrobin, session, prefixaware, kvaware)"),
            };
        }
        if let Some(key) = &self.session_key {
            self.session_header = key.clone();
        }
        if self.port.is_some() || self.host.is_some() {
            self.listen = SocketAddr::new(
                self.host.unwrap_or(self.listen.ip()),
                self.port.unwrap_or(self.listen.port()),
            );
        }
        match self.service_discovery.as_deref() {
            None => {}
            Some(d @ ("static" | "k8s")) => self.discovery = d.to_owned(),
            Some(other) => bail!("--service-discovery {other:?} is not supported (static, k8s)"),
        }
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.cache_threshold),
            "--cache-threshold must be within 0..1"
        );
        anyhow::ensure!(self.balance_rel >= 1.0, "--balance-rel must be at least 1");
        Ok(())
    }

    /// `--tokenizer MODEL=DIR` pairs.
    pub fn tokenizer_dirs(&self) -> anyhow::Result<Vec<(String, PathBuf)>> {
        self.tokenizers
            .iter()
            .map(|pair| {
                let (model, dir) = pair
                    .split_once('=')
                    .with_context(|| format!("--tokenizer {pair:?}: expected MODEL=DIR"))?;
                Ok((model.to_owned(), PathBuf::from(dir)))
            })
            .collect()
    }

    /// The Kubernetes discovery settings, when `--discovery k8s`.
    pub fn k8s(&self) -> Option<super::discovery::K8sSettings> {
        (self.discovery == "k8s" || self.inference_pool.is_some()).then(|| {
            super::discovery::K8sSettings {
                namespace: self.namespace.clone(),
                label_selector: self.label_selector.clone(),
                port: self.k8s_port,
                target_ports: None,
                model_label: self.k8s_model_label.clone(),
                role_label: self.k8s_role_label.clone(),
                inference_pool: self.inference_pool.clone(),
            }
        })
    }

    /// Every backend: the flags', then the config file's (which may add models and keys).
    pub fn backend_specs(&self) -> anyhow::Result<Vec<BackendSpec>> {
        let static_models: Vec<String> = self
            .static_models
            .iter()
            .flat_map(|m| m.split(','))
            .map(|m| m.trim().to_owned())
            .filter(|m| !m.is_empty())
            .collect();
        let mut specs: Vec<BackendSpec> = Vec::new();
        // The file's `backend = [...]` is read here, not merged into the flags at start, so
        // that a reload sees its edits (the environment ranks above the file, as for every key).
        let mut urls = self.backends.clone();
        if let Some(path) = &self.config {
            if std::env::var_os("PREFIX_ROUTER_BACKENDS").is_none() {
                urls.extend(file_backend_urls(path)?);
            }
        }
        for (i, url) in urls.iter().enumerate() {
            let mut spec = BackendSpec::new(url);
            spec.api_key = self.backend_api_key.clone();
            spec.capacity = None;
            if static_models.len() == 1 {
                spec.models = Some(static_models.clone());
            } else if let Some(m) = static_models.get(i) {
                spec.models = Some(vec![m.clone()]);
            }
            specs.push(spec);
        }
        let roled = self
            .prefill_backends
            .iter()
            .map(|url| (url, Role::Prefill))
            .chain(self.decode_backends.iter().map(|url| (url, Role::Decode)));
        for (url, role) in roled {
            let mut spec = BackendSpec::new(url);
            spec.role = role;
            spec.api_key = self.backend_api_key.clone();
            specs.retain(|s| s.url != spec.url);
            specs.push(spec);
        }
        if let Some(path) = &self.config {
            for b in file_backends(path)? {
                let mut spec = BackendSpec::new(&b.url);
                spec.models = b.models;
                spec.capacity = b.capacity;
                spec.weight = b.weight.unwrap_or(1);
                spec.api_key = b.api_key.or_else(|| self.backend_api_key.clone());
                spec.kv_events = b.kv_events;
                spec.kv_replay = b.kv_replay;
                if let Some(role) = &b.role {
                    spec.role = Role::parse(role).ok_or_else(|| {
                        anyhow::anyhow!(
                            "backend {}: role {role:?} is not prefill, decode or both",
                            b.url
                        )
                    })?;
                }
                specs.retain(|s| s.url != spec.url);
                specs.push(spec);
            }
        }
        Ok(specs)
    }
}

fn read_table(path: &Path) -> anyhow::Result<toml::Table> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    text.parse::<toml::Table>()
        .with_context(|| format!("config file {} is not valid TOML", path.display()))
}

/// The top-level `backend = "URL"` or `backend = ["URL", ...]` of the config file.
fn file_backend_urls(path: &Path) -> anyhow::Result<Vec<String>> {
    let table = read_table(path)?;
    let invalid = || {
        anyhow::anyhow!(
            "`backend` in {} must be a URL or a list of URLs",
            path.display()
        )
    };
    match table.get("backend") {
        None => Ok(Vec::new()),
        Some(toml::Value::String(url)) => Ok(vec![url.clone()]),
        Some(toml::Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(invalid))
            .collect(),
        Some(_) => Err(invalid()),
    }
}

fn file_backends(path: &Path) -> anyhow::Result<Vec<FileBackend>> {
    let table = read_table(path)?;
    match table.get("backends") {
        None => Ok(Vec::new()),
        Some(v) => v
            .clone()
            .try_into()
            .with_context(|| format!("`backends` in {}", path.display())),
    }
}

/// The config file's settings as command-line flags, skipping keys whose environment variable
/// is set (the environment ranks above the file).
fn file_flags(path: &Path) -> anyhow::Result<Vec<String>> {
    let table = read_table(path)?;
    let known: Vec<String> = Wrapper::command()
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_owned))
        .collect();
    let mut argv = Vec::new();
    for (key, value) in table {
        // Backends are read by `backend_specs` (at start and at every reload).
        if key == "backends" || key == "backend" {
            continue;
        }
        // `[tokenizers]`: model = "dir", as `--tokenizer model=dir`.
        if key == "tokenizers" {
            let toml::Value::Table(models) = &value else {
                bail!(
                    "`tokenizers` in {} must be a table of model = \"dir\"",
                    path.display()
                );
            };
            if std::env::var_os("PREFIX_ROUTER_TOKENIZERS").is_some() {
                continue;
            }
            for (model, dir) in models {
                let dir = dir.as_str().with_context(|| {
                    format!(
                        "tokenizers.{model} in {} must be a directory",
                        path.display()
                    )
                })?;
                argv.push("--tokenizer".to_owned());
                argv.push(format!("{model}={dir}"));
            }
            continue;
        }
        let flag = key.replace('_', "-");
        if !known.contains(&flag) || flag == "config" {
            bail!("unknown setting {key:?} in config file {}", path.display());
        }
        let env = format!("PREFIX_ROUTER_{}", flag.replace('-', "_").to_uppercase());
        if std::env::var_os(&env).is_some() {
            continue;
        }
        let values: Vec<&toml::Value> = match &value {
            toml::Value::Array(items) => items.iter().collect(),
            other => vec![other],
        };
        for v in values {
            // A switch is given by its name alone (true) or left out (false).
            if let toml::Value::Boolean(on) = v {
                if *on {
                    argv.push(format!("--{flag}"));
                }
                continue;
            }
            argv.push(format!("--{flag}"));
            argv.push(match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => bail!(
                    "setting {key:?} in {}: unsupported value {other}",
                    path.display()
                ),
            });
        }
    }
    Ok(argv)
}

/// Modification time of the config file, to notice changes.
pub fn modified(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(cli: &[&str]) -> anyhow::Result<ServeArgs> {
        let words: Vec<String> = cli.iter().map(|s| s.to_string()).collect();
        ServeArgs::from_words(&words)
    }

    #[test]
    fn config_file_fills_what_the_command_line_leaves() {
        let dir = std::env::temp_dir().join(format!("prefix-router-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("router.toml");
        std::fs::write(
            &path,
            r#"
policy = "round_robin"
cache-threshold = 0.7
max_retries = 4
backend = ["http://a:1"]

[[backends]]
url = "http://b:2/"
models = ["m"]
capacity = 99
api-key = "k"
"#,
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let args = parse(&["--config", p, "--cache-threshold", "0.3"]).unwrap();
        assert_eq!(args.policy, PolicyKind::RoundRobin);
        assert_eq!(args.cache_threshold, 0.3, "the command line wins");
        assert_eq!(args.max_retries, 4);
        let specs = args.backend_specs().unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[1].url, "http://b:2");
        assert_eq!(specs[1].models, Some(vec!["m".to_owned()]));
        assert_eq!(specs[1].capacity, Some(99));
        assert_eq!(specs[1].api_key.as_deref(), Some("k"));

        // An edit of the top-level `backend` list is seen by the next read (a reload).
        std::fs::write(
            &path,
            "policy = \"round_robin\"\nbackend = [\"http://a:1\", \"http://c:3\"]\n",
        )
        .unwrap();
        let urls: Vec<String> = args
            .backend_specs()
            .unwrap()
            .into_iter()
            .map(|s| s.url)
            .collect();
        assert_eq!(urls, ["http://a:1", "http://c:3"]);

        // Switches are true or false.
        std::fs::write(
            &path,
            "kv-events = true\nforward-priority = false\ntrust_client_headers = true\n",
        )
        .unwrap();
        let args = parse(&["--config", p]).unwrap();
        assert!(args.kv_events && args.queue.trust_client_headers);
        assert!(!args.queue.forward_priority);

        std::fs::write(&path, "polcy = \"x\"\n").unwrap();
        let err = parse(&["--config", p]).unwrap_err();
        assert!(format!("{err:#}").contains("unknown setting"), "{err:#}");
    }

    #[test]
    fn production_stack_flags_map() {
        let args = parse(&[
            "--static-backends",
            "http://a:1,http://b:2",
            "--static-models",
            "m1,m2",
            "--routing-logic",
            "session",
            "--session-key",
            "x-user",
            "--port",
            "9999",
            "--service-discovery",
            "static",
        ])
        .unwrap();
        assert_eq!(args.policy, PolicyKind::Session);
        assert_eq!(args.session_header, "x-user");
        assert_eq!(args.listen.port(), 9999);
        let specs = args.backend_specs().unwrap();
        assert_eq!(specs[0].models, Some(vec!["m1".to_owned()]));
        assert_eq!(specs[1].models, Some(vec!["m2".to_owned()]));
        assert!(parse(&["--routing-logic", "disaggregated_prefill"]).is_err());
        // Production-stack's cache-aware logics map to the default, our cache-aware best.
        for logic in ["prefixaware", "kvaware"] {
            let args = parse(&["--backend", "http://a:1", "--routing-logic", logic]).unwrap();
            assert_eq!(args.policy, PolicyKind::Cost, "{logic}");
        }
        let args = parse(&["--backend", "http://a:1"]).unwrap();
        assert_eq!(args.policy, PolicyKind::Cost, "the default policy");
    }
}
