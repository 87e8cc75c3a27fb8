//! Real vLLM servers on this machine: vLLM's CPU build serving a tiny Llama with random
//! weights and a real tokenizer, so that routing claims are checked against the engine our
//! users run (its real prefix cache, metrics and KV-cache events).
//!
//! `scripts/vllm-venv.sh` installs vLLM once into a virtual environment outside the clone;
//! `scripts/vllm-model.py` writes the model directory; `scripts/vllm-server.py` runs each server
//! so that everything it starts goes when this process lets go of it (or dies).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::process::{Child, ChildStdin, Command};

/// The model name the fleet serves.
pub const MODEL: &str = "tiny-llama";

/// How the servers are started.
#[derive(Clone, Debug)]
pub struct VllmFleetConfig {
    pub servers: usize,
    /// Tokens per KV block (the CPU backend needs a multiple of 32).
    pub block_size: usize,
    /// KV blocks per server (`--num-gpu-blocks-override`): the prefix cache's size.
    pub num_blocks: usize,
    /// Longest request (prompt + output) in tokens; the cache must hold one.
    pub max_model_len: usize,
    /// More flags for every server.
    pub extra_args: Vec<String>,
    /// Where logs go (and the model directory unless `model_dir` is set).
    pub work_dir: PathBuf,
    /// The model directory (written when missing).
    pub model_dir: Option<PathBuf>,
    /// Longest wait for all servers to answer `/health`.
    pub startup_timeout: Duration,
}

impl Default for VllmFleetConfig {
    fn default() -> Self {
        Self {
            servers: 2,
            block_size: 32,
            num_blocks: 512,
            max_model_len: 8192,
            extra_args: Vec::new(),
            work_dir: std::env::temp_dir().join("prefix-router-vllm"),
            model_dir: None,
            startup_timeout: Duration::from_secs(900),
        }
    }
}

/// The real fleet's flags (`bench vllm-fleet`, `bench compare --fleet vllm`).
#[derive(clap::Args, Debug, Clone)]
pub struct VllmFleetArgs {
    /// vLLM servers to start (each takes about 3 GB and a minute or two to start here).
    #[arg(long, default_value_t = 2)]
    pub vllm_servers: usize,
    /// KV blocks per server (`--num-gpu-blocks-override`).
    #[arg(long, default_value_t = 512)]
    pub vllm_blocks: usize,
    /// Tokens per KV block (a multiple of 32 on CPU).
    #[arg(long, default_value_t = 32)]
    pub vllm_block_size: usize,
    /// `--max-model-len` of the servers.
    #[arg(long, default_value_t = 8192)]
    pub vllm_max_model_len: usize,
    /// More vLLM flags for every server, space-separated.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub vllm_args: String,
    /// Use the running fleet described in this file (by `bench vllm-fleet`) instead of
    /// starting one.
    #[arg(long)]
    pub vllm_fleet_file: Option<PathBuf>,
}

impl VllmFleetArgs {
    /// The fleet these flags describe, logging into `work_dir`.
    pub fn config(&self, work_dir: &Path) -> VllmFleetConfig {
        VllmFleetConfig {
            servers: self.vllm_servers,
            block_size: self.vllm_block_size,
            num_blocks: self.vllm_blocks,
            max_model_len: self.vllm_max_model_len,
            extra_args: self
                .vllm_args
                .split_whitespace()
                .map(str::to_owned)
                .collect(),
            work_dir: work_dir.to_owned(),
            ..VllmFleetConfig::default()
        }
    }
}

/// `prefix-router bench vllm-fleet`: starts a real fleet, prints where it is, and stops it on
/// Ctrl-C (or SIGTERM).
pub async fn serve_fleet(args: VllmFleetArgs, work_dir: PathBuf) -> anyhow::Result<()> {
    eprintln!(
        "starting {} vLLM server(s) (the first start installs vLLM: several minutes)",
        args.vllm_servers
    );
    let fleet = VllmFleet::start(args.config(&work_dir)).await?;
    let description = work_dir.join("fleet.json");
    std::fs::write(
        &description,
        serde_json::to_string_pretty(&FleetFile {
            urls: fleet.urls(),
            kv_events: fleet.servers.iter().map(|s| s.kv_events.clone()).collect(),
            kv_replay: fleet.servers.iter().map(|s| s.kv_replay.clone()).collect(),
            model_dir: fleet.model_dir.clone(),
            block_size: fleet.config.block_size,
            num_blocks: fleet.config.num_blocks,
        })?,
    )?;
    println!("model: {MODEL} ({})", fleet.model_dir.display());
    println!(
        "fleet description (for bench compare --vllm-fleet-file): {}",
        description.display()
    );
    for (i, server) in fleet.servers.iter().enumerate() {
        println!(
            "vllm server {i}: {}   kv events: {}   replay: {}   log: {}",
            server.url,
            server.kv_events,
            server.kv_replay,
            server.log.display()
        );
    }
    println!("Ctrl-C stops the fleet.");
    wait_for_signal().await;
    fleet.stop().await;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// A running fleet as `bench vllm-fleet` describes it in `fleet.json`, so that benchmarks can
/// use it without starting their own.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone)]
pub struct FleetFile {
    pub urls: Vec<String>,
    pub kv_events: Vec<String>,
    /// The publishers' replay sockets (older files lack them).
    #[serde(default)]
    pub kv_replay: Vec<String>,
    pub model_dir: PathBuf,
    pub block_size: usize,
    /// KV-cache blocks of each server (older files lack it: 0, unknown).
    #[serde(default)]
    pub num_blocks: usize,
}

impl FleetFile {
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read {} (written by bench vllm-fleet)",
                path.display()
            )
        })?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a fleet description", path.display()))
    }
}

/// One running vLLM server.
pub struct VllmServer {
    pub url: String,
    /// Its KV-event publisher (ZMQ PUB, bound on all interfaces by vLLM; reach it on loopback).
    pub kv_events: String,
    /// Its publisher's replay socket (ZMQ ROUTER, vLLM's `replay_endpoint`).
    pub kv_replay: String,
    pub log: PathBuf,
    child: Child,
    /// Closing it makes `vllm-server.py` take the server and its helpers down.
    stdin: Option<ChildStdin>,
}

/// A running fleet of vLLM servers; stopped by [`VllmFleet::stop`], or when dropped (the
/// closed pipes tell each `vllm-server.py` to stop its server).
pub struct VllmFleet {
    pub servers: Vec<VllmServer>,
    pub model_dir: PathBuf,
    pub config: VllmFleetConfig,
}

/// The repository's root (the scripts live there).
pub fn repo_root() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if built.join("scripts/vllm-venv.sh").exists() {
        return built;
    }
    PathBuf::from(".")
}

/// The python of the vLLM environment, installing it when needed (`scripts/vllm-venv.sh`).
pub async fn python() -> anyhow::Result<PathBuf> {
    let script = repo_root().join("scripts/vllm-venv.sh");
    anyhow::ensure!(
        script.exists(),
        "{} is missing: run from the repository",
        script.display()
    );
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .await
        .context("running scripts/vllm-venv.sh")?;
    if !out.status.success() {
        bail!(
            "scripts/vllm-venv.sh failed ({}): installing vLLM's CPU build did not work (its message is above)",
            out.status
        );
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// The model directory: the tiny Llama with its tokenizer, written once by
/// `scripts/vllm-model.py`.
pub async fn model_dir(python: &Path, dir: &Path) -> anyhow::Result<PathBuf> {
    // Written again when the script changes (its hash is kept beside the files).
    let script = repo_root().join("scripts/vllm-model.py");
    let version = format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(&std::fs::read(&script).unwrap_or_default())
    );
    let stamp = dir.join("written-by");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(version.as_str()) {
        let out = Command::new(python)
            .arg(&script)
            .arg(dir)
            .envs(offline_env())
            .output()
            .await
            .context("running scripts/vllm-model.py")?;
        if !out.status.success() {
            bail!(
                "writing the model directory {} failed: {}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
        }
        std::fs::write(&stamp, version)?;
    }
    Ok(dir.to_owned())
}

fn offline_env() -> [(&'static str, &'static str); 5] {
    [
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        // POST /reset_prefix_cache, to start every benchmark system on empty caches.
        ("VLLM_SERVER_DEV_MODE", "1"),
    ]
}

/// A free port for a server that binds it later, chosen below Linux's ephemeral range
/// (32768 and up): a port from that range can be handed by the kernel to another socket in the
/// minute a vLLM server takes to bind it (vLLM opens many), and the server then fails with
/// "address already in use" (seen in CI). Below it, only explicit binds compete.
fn free_port() -> anyhow::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(7919);
    for _ in 0..SPAN {
        let port = (FIRST + start.wrapping_add(NEXT.fetch_add(1, Relaxed)) % SPAN) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no free port from {FIRST} to {}", FIRST + SPAN)
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl VllmFleet {
    /// Installs vLLM if needed, writes the model, starts the servers on free loopback ports
    /// and waits until every one answers `/health`.
    pub async fn start(config: VllmFleetConfig) -> anyhow::Result<Self> {
        anyhow::ensure!(config.servers > 0, "a fleet needs at least one server");
        anyhow::ensure!(
            config.block_size.is_multiple_of(32),
            "vLLM's CPU backend needs a block size that is a multiple of 32"
        );
        anyhow::ensure!(
            config.num_blocks * config.block_size >= config.max_model_len,
            "the KV cache ({} blocks of {}) must hold one request of --max-model-len {}",
            config.num_blocks,
            config.block_size,
            config.max_model_len
        );
        let mut config = config;
        std::fs::create_dir_all(&config.work_dir)
            .with_context(|| format!("cannot create {}", config.work_dir.display()))?;
        config.work_dir = std::path::absolute(&config.work_dir)?;
        let python = python().await?;
        let model_dir = model_dir(
            &python,
            &config
                .model_dir
                .clone()
                .unwrap_or_else(|| config.work_dir.join("model")),
        )
        .await?;
        let mut servers = Vec::new();
        for i in 0..config.servers {
            servers.push(spawn_server(&python, &model_dir, &config, i)?);
        }
        let mut fleet = Self {
            servers,
            model_dir,
            config,
        };
        let started = tokio::time::Instant::now();
        let client = reqwest::Client::new();
        for i in 0..fleet.servers.len() {
            loop {
                let server = &mut fleet.servers[i];
                if let Some(status) = server.child.try_wait()? {
                    bail!(
                        "vLLM server {i} exited while starting ({status}); the end of {}:\n{}",
                        server.log.display(),
                        tail(&server.log, 30)
                    );
                }
                let healthy = client
                    .get(format!("{}/health", server.url))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if healthy {
                    break;
                }
                if started.elapsed() > fleet.config.startup_timeout {
                    bail!(
                        "vLLM server {i} did not answer /health within {:?}; the end of {}:\n{}",
                        fleet.config.startup_timeout,
                        server.log.display(),
                        tail(&server.log, 30)
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Ok(fleet)
    }

    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.url.clone()).collect()
    }

    /// Kills server `i` and everything it started with SIGKILL, as a crash would; waits until
    /// it is gone.
    pub async fn crash(&mut self, i: usize) -> anyhow::Result<()> {
        use tokio::io::AsyncWriteExt;
        let server = &mut self.servers[i];
        let stdin = server
            .stdin
            .as_mut()
            .context("the server was stopped already")?;
        stdin.write_all(b"kill\n").await?;
        stdin.flush().await?;
        tokio::time::timeout(Duration::from_secs(30), server.child.wait())
            .await
            .context("the killed server's wrapper did not exit")??;
        server.stdin.take();
        Ok(())
    }

    /// Stops every server and waits for them to go.
    pub async fn stop(mut self) {
        for server in &mut self.servers {
            server.stdin.take();
        }
        for server in &mut self.servers {
            // vllm-server.py gives the server 15 s, then kills it.
            if tokio::time::timeout(Duration::from_secs(30), server.child.wait())
                .await
                .is_err()
            {
                tracing::warn!(url = server.url, "a vLLM server did not stop within 30 s");
            }
        }
    }
}

/// The CPU server `index` computes on: the machine's CPUs in turn.
fn cpu_for(index: usize) -> String {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (index % cpus).to_string()
}

fn spawn_server(
    python: &Path,
    model_dir: &Path,
    config: &VllmFleetConfig,
    index: usize,
) -> anyhow::Result<VllmServer> {
    let port = free_port()?;
    let events_port = free_port()?;
    let replay_port = free_port()?;
    let log = config.work_dir.join(format!("vllm-{index}.log"));
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let kv_events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        // A wildcard address makes vLLM bind (a host address would make it connect).
        "endpoint": format!("tcp://*:{events_port}"),
        "replay_endpoint": format!("tcp://*:{replay_port}"),
    });
    let mut command = Command::new(python);
    command
        .arg(repo_root().join("scripts/vllm-server.py"))
        .arg("--model")
        .arg(model_dir)
        .args(["--served-model-name", MODEL, "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .args(["--load-format", "dummy"])
        .args(["--block-size", &config.block_size.to_string()])
        .args(["--num-gpu-blocks-override", &config.num_blocks.to_string()])
        .args(["--max-model-len", &config.max_model_len.to_string()])
        .args(["--enable-prefix-caching", "--enable-prompt-tokens-details"])
        // The render endpoints, which vllm-router's cache_aware policy calls before every
        // chat request (403 without this flag on vLLM 0.32); nothing else changes.
        .arg("--enable-scale-out")
        .args(["--kv-events-config", &kv_events.to_string()])
        .args(&config.extra_args)
        .envs(offline_env())
        // vLLM binds its worker's threads to CPU 0 unless told otherwise: every server on this
        // machine would then compute on the same core. One core each, in turn.
        .env("VLLM_CPU_OMP_THREADS_BIND", cpu_for(index))
        .stdin(Stdio::piped())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    let mut child = command
        .spawn()
        .with_context(|| format!("starting vLLM server {index} ({})", python.display()))?;
    let stdin = child.stdin.take();
    Ok(VllmServer {
        url: format!("http://127.0.0.1:{port}"),
        kv_events: format!("tcp://127.0.0.1:{events_port}"),
        kv_replay: format!("tcp://127.0.0.1:{replay_port}"),
        log,
        child,
        stdin,
    })
}
