//! A real vLLM fleet shared by the tests of one test binary: started once (three servers take
//! about three minutes here), stopped when the process exits (the wrappers' pipes close).
//!
//! In CI (`PREFIX_ROUTER_CI`) the fleet must start; elsewhere the tests skip when no vLLM
//! environment has been installed (`scripts/vllm-venv.sh`).

use std::path::PathBuf;
use std::sync::{mpsc, OnceLock};

use prefix_bench::vllm_fleet::{VllmFleet, VllmFleetConfig};

#[allow(unused_imports)]
pub use prefix_bench::vllm_fleet::MODEL;

/// The shared fleet: its servers' URLs and KV-event endpoints.
pub struct SharedFleet {
    pub urls: Vec<String>,
    pub kv_events: Vec<String>,
    /// The publishers' replay sockets.
    pub kv_replay: Vec<String>,
    pub model_dir: PathBuf,
    /// Started by hand (`PREFIX_ROUTER_VLLM_URLS`): no crashes.
    pub external: bool,
    crash: mpsc::Sender<(usize, mpsc::Sender<anyhow::Result<()>>)>,
}

impl SharedFleet {
    /// Crashes server `i` (SIGKILL to it and its helpers).
    pub async fn crash(&self, i: usize) -> anyhow::Result<()> {
        let (done, result) = mpsc::channel();
        self.crash.send((i, done))?;
        tokio::task::spawn_blocking(move || result.recv()).await??
    }
}

/// Tests on the shared fleet take turns: vLLM's counters and caches are shared.
pub static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn installed() -> bool {
    let dir = std::env::var_os("PREFIX_ROUTER_VLLM_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/prefix-router/vllm-venv"))
        });
    dir.is_some_and(|d| d.join(".requirements").exists())
}

fn in_ci() -> bool {
    std::env::var_os("PREFIX_ROUTER_CI").is_some()
}

/// The fleet of `servers` vLLM servers, started on first use; None (skip) outside CI when vLLM
/// is not installed here.
pub async fn shared(servers: usize) -> Option<&'static SharedFleet> {
    static FLEET: OnceLock<Result<SharedFleet, String>> = OnceLock::new();
    if let Some(urls) = std::env::var_os("PREFIX_ROUTER_VLLM_URLS") {
        // A fleet started by hand (`prefix-router bench vllm-fleet --vllm-servers 3`), to
        // iterate without waiting for vLLM to start; crashes are not available on it. Its
        // model directory: PREFIX_ROUTER_VLLM_MODEL, else vllm-fleet's default.
        let fleet = FLEET.get_or_init(|| {
            let (crash, _) = mpsc::channel();
            Ok(SharedFleet {
                urls: urls
                    .to_string_lossy()
                    .split(',')
                    .map(str::to_owned)
                    .collect(),
                kv_events: Vec::new(),
                kv_replay: Vec::new(),
                model_dir: std::env::var_os("PREFIX_ROUTER_VLLM_MODEL").map_or_else(
                    || {
                        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                            .join("../../target/vllm-fleet/model")
                    },
                    PathBuf::from,
                ),
                external: true,
                crash,
            })
        });
        return fleet.as_ref().ok();
    }
    if !in_ci() && !installed() {
        eprintln!("skipping: no vLLM environment (scripts/vllm-venv.sh installs one)");
        return None;
    }
    let fleet = tokio::task::spawn_blocking(move || FLEET.get_or_init(|| start(servers)))
        .await
        .unwrap();
    match fleet {
        Ok(fleet) => Some(fleet),
        Err(e) => panic!("the real vLLM fleet did not start: {e}"),
    }
}

/// Starts the fleet on a thread of its own that keeps it (and its runtime) for the life of the
/// process and crashes servers on request.
fn start(servers: usize) -> Result<SharedFleet, String> {
    let (ready, started) = mpsc::channel();
    let (crash, crashes) = mpsc::channel::<(usize, mpsc::Sender<anyhow::Result<()>>)>();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let config = VllmFleetConfig {
            servers,
            work_dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vllm-fleet"),
            ..VllmFleetConfig::default()
        };
        let mut fleet = match runtime.block_on(VllmFleet::start(config)) {
            Ok(fleet) => fleet,
            Err(e) => {
                let _ = ready.send(Err(format!("{e:#}")));
                return;
            }
        };
        let _ = ready.send(Ok((
            fleet.urls(),
            fleet.servers.iter().map(|s| s.kv_events.clone()).collect(),
            fleet.servers.iter().map(|s| s.kv_replay.clone()).collect(),
            fleet.model_dir.clone(),
        )));
        for (i, done) in crashes {
            let _ = done.send(runtime.block_on(fleet.crash(i)));
        }
        // Never reached while a test can still ask; the process's exit stops the servers.
        std::mem::forget(fleet);
    });
    let (urls, kv_events, kv_replay, model_dir) = started.recv().map_err(|e| e.to_string())??;
    Ok(SharedFleet {
        urls,
        kv_events,
        kv_replay,
        model_dir,
        external: false,
        crash,
    })
}
