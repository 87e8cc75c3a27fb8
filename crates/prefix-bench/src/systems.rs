//! The routing systems a comparison runs: our router with each policy and store (started as
//! processes of this binary), the oracle, and the peer routers from PyPI.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::process::{Child, Command};

use crate::oracle::Oracle;

/// A system's name in `--systems` and in the results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum System {
    RoundRobin,
    LeastLoaded,
    Prefix,
    PrefixLoad,
    PrefixLoadSqlite,
    PrefixLoadPostgres,
    PrefixLoadIndex,
    PrefixLoadReplicas,
    PrefixLoadEvents,
    PrefixLoadEventsReplicas,
    Cost,
    CostAggregated,
    CostEvents,
    CostQueue,
    CostReplicas,
    Oracle,
    SglangRouter,
    Smg,
    VllmRouter,
}

pub const ALL: [System; 19] = [
    System::RoundRobin,
    System::LeastLoaded,
    System::Prefix,
    System::PrefixLoad,
    System::PrefixLoadSqlite,
    System::PrefixLoadPostgres,
    System::PrefixLoadIndex,
    System::PrefixLoadReplicas,
    System::PrefixLoadEvents,
    System::PrefixLoadEventsReplicas,
    System::Cost,
    System::CostAggregated,
    System::CostEvents,
    System::CostQueue,
    System::CostReplicas,
    System::Oracle,
    System::SglangRouter,
    System::Smg,
    System::VllmRouter,
];

impl System {
    pub fn name(self) -> &'static str {
        match self {
            System::RoundRobin => "round_robin",
            System::LeastLoaded => "least_loaded",
            System::Prefix => "prefix",
            System::PrefixLoad => "prefix_load",
            System::PrefixLoadSqlite => "prefix_load+sqlite",
            System::PrefixLoadPostgres => "prefix_load+postgres",
            System::PrefixLoadIndex => "prefix_load+index",
            System::PrefixLoadReplicas => "prefix_load+replicas",
            System::PrefixLoadEvents => "prefix_load+events",
            System::PrefixLoadEventsReplicas => "prefix_load+events+replicas",
            System::Cost => "cost",
            System::CostAggregated => "cost+aggregated",
            System::CostEvents => "cost+events",
            System::CostQueue => "cost+queue",
            System::CostReplicas => "cost+replicas",
            System::Oracle => "oracle",
            System::SglangRouter => "sglang-router",
            System::Smg => "smg",
            System::VllmRouter => "vllm-router",
        }
    }

    pub fn parse(name: &str) -> anyhow::Result<Self> {
        ALL.iter()
            .copied()
            .find(|s| s.name() == name.trim())
            .ok_or_else(|| {
                let names: Vec<_> = ALL.iter().map(|s| s.name()).collect();
                anyhow::anyhow!("unknown system {name:?}; systems are {}", names.join(", "))
            })
    }

    /// True for the PyPI routers.
    pub fn is_peer(self) -> bool {
        matches!(
            self,
            System::SglangRouter | System::Smg | System::VllmRouter
        )
    }
}

/// What launching needs.
pub struct LaunchContext {
    /// The `prefix-router` binary.
    pub router_exe: PathBuf,
    pub sims: Vec<String>,
    /// The servers' KV-event publishers (precise systems; the oracle on real vLLM), else empty.
    pub kv_events: Vec<String>,
    /// Their replay sockets (given to precise systems where known), else empty.
    pub kv_replay: Vec<String>,
    /// Whether the oracle learns the servers' contents from their events (real vLLM) rather
    /// than by asking them (sims).
    pub oracle_from_events: bool,
    /// Tokens per KV block of the servers.
    pub block_size: usize,
    /// Each server's KV cache in tokens (0: unknown).
    pub cache_tokens: u64,
    /// The servers' tokenizer directory (precise systems tokenize requests with it).
    pub tokenizer: Option<PathBuf>,
    /// Tell our routers each server's cache is this many times its real size (a wrong
    /// capacity estimate, as in a cache-pressure experiment); None: they learn it.
    pub assumed_cache_factor: Option<f64>,
    /// The model the workload asks for.
    pub model: String,
    pub postgres_url: Option<String>,
    pub replicas: usize,
    /// The +replicas systems share state over this NATS server instead of a store.
    pub replica_bus: Option<String>,
    pub peers_venv: PathBuf,
    /// Logs of the started processes go here.
    pub work_dir: PathBuf,
    /// Load-guard settings shared by prefix_load and the oracle.
    pub cache_threshold: f64,
    pub balance_abs: u64,
    pub balance_rel: f64,
    /// The gateway-queue flags of the `+queue` systems.
    pub queue_args: Vec<String>,
    /// Our routers' `--log` filter.
    pub router_log: String,
    /// A disaggregated fleet: the first this many servers prefill, the rest decode (0: none).
    pub pd_prefill: usize,
    /// More flags for every one of our routers (`--router-args`).
    pub router_args: Vec<String>,
}

impl LaunchContext {
    /// The servers to launch systems against, from `fleet` (a fleet started afresh has new
    /// addresses).
    pub fn use_fleet(&mut self, fleet: &crate::fleet::BenchFleet) {
        self.sims = fleet.urls.clone();
        self.kv_events = fleet.kv_events.clone();
        self.kv_replay = fleet.kv_replay.clone();
        self.block_size = fleet.block_size;
        self.cache_tokens = fleet.cache_tokens;
        self.tokenizer = fleet.tokenizer.clone();
    }
}

/// A running system.
pub struct Launched {
    /// Where its clients send requests (several for router replicas).
    pub urls: Vec<String>,
    pub oracle: Option<Arc<Oracle>>,
    /// Processes whose CPU time counts as the router's.
    pub router_pids: Vec<u32>,
    children: Vec<Child>,
}

impl Launched {
    pub async fn stop(mut self) {
        for child in &mut self.children {
            let _ = child.start_kill();
        }
        for child in &mut self.children {
            let _ = child.wait().await;
        }
    }
}

/// Why a system did not run.
pub struct Skipped(pub String);

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn spawn(exe: &Path, args: &[String], log: &Path) -> Result<Child, Skipped> {
    let log_file = std::fs::File::create(log)
        .map_err(|e| Skipped(format!("cannot write {}: {e}", log.display())))?;
    let err_file = log_file.try_clone().map_err(|e| Skipped(e.to_string()))?;
    Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log_file)
        .stderr(err_file)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Skipped(format!("cannot start {}: {e}", exe.display())))
}

async fn wait_until(deadline: Duration, mut ready: impl AsyncFnMut() -> bool) -> bool {
    let until = Instant::now() + deadline;
    while Instant::now() < until {
        if ready().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

impl LaunchContext {
    /// The flags putting a replica on the bus, on a subject of this launch's own (a fresh
    /// fleet: no snapshot of an earlier system's replicas).
    fn bus_args(&self, bus: &str) -> Vec<String> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        // The replicas authenticate their frames as in production (the cost is measured too).
        let key = self.work_dir.join(format!("bus-key-{nanos}"));
        let _ = std::fs::write(&key, format!("prefix-router bench key {nanos}\n"));
        vec![
            "--replica-bus".into(),
            bus.into(),
            "--replica-bus-subject".into(),
            format!("prefix-router-bench-{nanos}"),
            "--replica-bus-key-file".into(),
            key.display().to_string(),
        ]
    }

    /// Server `i`'s role in a disaggregated fleet (`prefill` or `decode`), None in an
    /// aggregated one.
    fn role_of(&self, i: usize) -> Option<&'static str> {
        match self.pd_prefill {
            0 => None,
            n if i < n => Some("prefill"),
            _ => Some("decode"),
        }
    }

    /// The flags of one of our routers; its backends go in a config file (with their KV-event
    /// publishers when `events`, and a capacity when it is to be wrong).
    fn router_args(
        &self,
        port: u16,
        policy: &str,
        extra: &[String],
        events: bool,
        roles: bool,
    ) -> Result<Vec<String>, Skipped> {
        let mut args = vec![
            "serve".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--policy".into(),
            policy.into(),
            "--log".into(),
            self.router_log.clone(),
            "--cache-threshold".into(),
            self.cache_threshold.to_string(),
            "--balance-abs".into(),
            self.balance_abs.to_string(),
            "--balance-rel".into(),
            self.balance_rel.to_string(),
        ];
        let mut config = String::new();
        for (i, url) in self.sims.iter().enumerate() {
            config.push_str(&format!("[[backends]]\nurl = {url:?}\n"));
            if let Some(role) = self.role_of(i).filter(|_| roles) {
                config.push_str(&format!("role = {role:?}\n"));
            }
            if events {
                let endpoint = self.kv_events.get(i).ok_or_else(|| {
                    Skipped("the servers publish no KV events (sims: --sim-args '--kv-events --tokenizer DIR')".into())
                })?;
                config.push_str(&format!("kv-events = {endpoint:?}\n"));
                if let Some(replay) = self.kv_replay.get(i) {
                    config.push_str(&format!("kv-replay = {replay:?}\n"));
                }
            }
            if let Some(factor) = self.assumed_cache_factor {
                // The router's own estimate: the cache's tokens × 4 bytes ÷ the chunk size.
                let entries = self.cache_tokens as f64 * 4.0
                    / prefix_index::DEFAULT_CHUNK_SIZE as f64
                    * factor;
                config.push_str(&format!("capacity = {}\n", entries.round().max(1.0)));
            }
        }
        let path = self.work_dir.join(format!("backends-{port}.toml"));
        std::fs::write(&path, config)
            .map_err(|e| Skipped(format!("cannot write {}: {e}", path.display())))?;
        args.extend(["--config".into(), path.display().to_string()]);
        if events {
            let dir = self.tokenizer.as_ref().ok_or_else(|| {
                Skipped(
                    "no tokenizer for the servers' model (sims: --sim-args '--tokenizer DIR')"
                        .into(),
                )
            })?;
            args.extend([
                "--kv-events".into(),
                "--tokenizer".into(),
                format!("{}={}", self.model, dir.display()),
                // Each run starts from emptied caches, and an emptied cache is known exactly.
                "--kv-warmup".into(),
                "0s".into(),
            ]);
        }
        args.extend(extra.iter().cloned());
        args.extend(self.router_args.iter().cloned());
        Ok(args)
    }

    /// Starts one of our routers and waits until it sees every sim; in a disaggregated fleet
    /// it knows the servers' roles.
    async fn router(
        &self,
        client: &reqwest::Client,
        name: &str,
        policy: &str,
        extra: &[String],
        events: bool,
    ) -> Result<(String, Child), Skipped> {
        self.router_with_roles(client, name, policy, extra, events, true)
            .await
    }

    async fn router_with_roles(
        &self,
        client: &reqwest::Client,
        name: &str,
        policy: &str,
        extra: &[String],
        events: bool,
        roles: bool,
    ) -> Result<(String, Child), Skipped> {
        let port = free_port().map_err(|e| Skipped(e.to_string()))?;
        let log = self
            .work_dir
            .join(format!("{}-{port}.log", name.replace('+', "_")));
        let child = spawn(
            &self.router_exe,
            &self.router_args(port, policy, extra, events, roles)?,
            &log,
        )?;
        let url = format!("http://127.0.0.1:{port}");
        let n = self.sims.len() as u64;
        let ready = wait_until(Duration::from_secs(30), async || {
            let Ok(resp) = client.get(format!("{url}/health")).send().await else {
                return false;
            };
            let Ok(v) = resp.json::<serde_json::Value>().await else {
                return false;
            };
            v["healthy_backends"].as_u64() == Some(n)
        })
        .await;
        if !ready {
            return Err(Skipped(format!(
                "the router did not become ready (see {})",
                log.display()
            )));
        }
        Ok((url, child))
    }

    /// Starts a `prefix-router index` and returns its URL.
    async fn index(&self, client: &reqwest::Client) -> Result<(String, Child), Skipped> {
        let port = free_port().map_err(|e| Skipped(e.to_string()))?;
        let log = self.work_dir.join(format!("index-{port}.log"));
        let args: Vec<String> = [
            "index",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--log",
            "warn",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let child = spawn(&self.router_exe, &args, &log)?;
        let url = format!("http://127.0.0.1:{port}");
        let ready = wait_until(Duration::from_secs(30), async || {
            client
                .get(format!("{url}/health"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
        if !ready {
            return Err(Skipped(format!(
                "the index did not start (see {})",
                log.display()
            )));
        }
        Ok((url, child))
    }

    /// The peer's executable, installing the peers first if needed.
    async fn peer_bin(&self, name: &str) -> Result<PathBuf, Skipped> {
        let bin = self.peers_venv.join("bin").join(name);
        if bin.exists() {
            return Ok(bin);
        }
        let script = Path::new("scripts/peers-venv.sh");
        if script.exists() {
            let out = Command::new("bash")
                .arg(script)
                .arg(&self.peers_venv)
                .output()
                .await
                .map_err(|e| Skipped(format!("cannot run {}: {e}", script.display())))?;
            if !out.status.success() {
                return Err(Skipped(format!(
                    "installing the peers from PyPI failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                        .lines()
                        .last()
                        .unwrap_or("")
                )));
            }
        }
        if bin.exists() {
            Ok(bin)
        } else {
            Err(Skipped(format!(
                "{name} is not installed in {} (run scripts/peers-venv.sh)",
                self.peers_venv.display()
            )))
        }
    }

    async fn peer(
        &self,
        client: &reqwest::Client,
        system: System,
    ) -> Result<(String, Child), Skipped> {
        let name = system.name();
        if self.pd_prefill > 0 && system != System::VllmRouter {
            return Err(Skipped(
                "its P/D mode speaks SGLang's bootstrap protocol, not vLLM's NixlConnector".into(),
            ));
        }
        let bin = self.peer_bin(name).await?;
        let port = free_port().map_err(|e| Skipped(e.to_string()))?;
        let metrics_port = free_port().map_err(|e| Skipped(e.to_string()))?;
        let mut args: Vec<String> = Vec::new();
        if system != System::VllmRouter {
            args.push("launch".into());
        }
        args.extend([
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
        ]);
        if self.pd_prefill > 0 {
            // vllm-router's P/D mode: a prefill call, then the decode call with the transfer
            // parameters, as ours.
            args.extend([
                "--vllm-pd-disaggregation".into(),
                "--kv-connector".into(),
                "nixl".into(),
            ]);
            for (i, url) in self.sims.iter().enumerate() {
                let role = self.role_of(i).unwrap_or("decode");
                args.extend([format!("--{role}"), url.clone()]);
            }
        } else {
            args.push("--worker-urls".into());
            args.extend(self.sims.iter().cloned());
        }
        args.extend([
            "--policy".into(),
            "cache_aware".into(),
            "--prometheus-port".into(),
            metrics_port.to_string(),
        ]);
        let log = self.work_dir.join(format!("{name}.log"));
        let child = spawn(&bin, &args, &log)?;
        let url = format!("http://127.0.0.1:{port}");
        let probe = json!({"model": self.model, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1});
        let ready = wait_until(Duration::from_secs(90), async || {
            client
                .post(format!("{url}/v1/chat/completions"))
                .json(&probe)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
        if !ready {
            return Err(Skipped(format!(
                "{name} did not route to the servers (see {})",
                log.display()
            )));
        }
        Ok((url, child))
    }

    /// Starts `system`.
    pub async fn launch(
        &self,
        client: &reqwest::Client,
        system: System,
    ) -> Result<Launched, Skipped> {
        let mut children = Vec::new();
        let mut urls = Vec::new();
        let mut router_pids = Vec::new();
        let mut oracle = None;
        match system {
            System::RoundRobin
            | System::LeastLoaded
            | System::Prefix
            | System::PrefixLoad
            | System::Cost => {
                let policy = system.name();
                let (url, child) = self.router(client, policy, policy, &[], false).await?;
                router_pids.extend(child.id());
                urls.push(url);
                children.push(child);
            }
            System::CostAggregated => {
                // The control of a disaggregated fleet: every server prefills and decodes.
                let (url, child) = self
                    .router_with_roles(client, system.name(), "cost", &[], false, false)
                    .await?;
                router_pids.extend(child.id());
                urls.push(url);
                children.push(child);
            }
            System::PrefixLoadSqlite => {
                let port_hint = free_port().map_err(|e| Skipped(e.to_string()))?;
                let db = self.work_dir.join(format!("sqlite-{port_hint}.db"));
                let extra = ["--store".to_owned(), format!("sqlite:{}", db.display())];
                let (url, child) = self
                    .router(client, system.name(), "prefix_load", &extra, false)
                    .await?;
                router_pids.extend(child.id());
                urls.push(url);
                children.push(child);
            }
            System::PrefixLoadPostgres => {
                let Some(pg) = &self.postgres_url else {
                    return Err(Skipped("no --postgres-url given".into()));
                };
                empty_postgres(pg).await?;
                let extra = ["--store".to_owned(), pg.clone()];
                let (url, child) = self
                    .router(client, system.name(), "prefix_load", &extra, false)
                    .await?;
                router_pids.extend(child.id());
                urls.push(url);
                children.push(child);
            }
            System::PrefixLoadIndex => {
                let (index_url, index) = self.index(client).await?;
                router_pids.extend(index.id());
                children.push(index);
                let extra = ["--index-url".to_owned(), index_url];
                let (url, child) = self
                    .router(client, system.name(), "prefix_load", &extra, false)
                    .await?;
                router_pids.extend(child.id());
                urls.push(url);
                children.push(child);
            }
            System::PrefixLoadReplicas | System::CostReplicas => {
                let policy = if system == System::CostReplicas {
                    "cost"
                } else {
                    "prefix_load"
                };
                // Shared state: the replica bus when given, else PostgreSQL when given, else a
                // remote index.
                let extra = match (&self.replica_bus, &self.postgres_url) {
                    (Some(bus), _) => self.bus_args(bus),
                    (None, Some(pg)) => {
                        empty_postgres(pg).await?;
                        vec!["--store".to_owned(), pg.clone()]
                    }
                    (None, None) => {
                        let (index_url, index) = self.index(client).await?;
                        router_pids.extend(index.id());
                        children.push(index);
                        vec!["--index-url".to_owned(), index_url]
                    }
                };
                for _ in 0..self.replicas.max(1) {
                    let (url, child) = self
                        .router(client, system.name(), policy, &extra, false)
                        .await?;
                    router_pids.extend(child.id());
                    urls.push(url);
                    children.push(child);
                }
            }
            System::CostEvents | System::CostQueue => {
                let (extra, events) = match system {
                    System::CostQueue => (self.queue_args.as_slice(), false),
                    _ => (&[][..], true),
                };
                let (url, child) = self
                    .router(client, system.name(), "cost", extra, events)
                    .await?;
                router_pids.extend(child.id());
                urls.push(url);
                children.push(child);
            }
            System::PrefixLoadEvents | System::PrefixLoadEventsReplicas => {
                // No shared store: every replica follows every server's events.
                let replicas = if system == System::PrefixLoadEvents {
                    1
                } else {
                    self.replicas.max(1)
                };
                // With a bus, the replicas share their decisions (block credits) and load.
                let extra = match (&self.replica_bus, system) {
                    (Some(bus), System::PrefixLoadEventsReplicas) => self.bus_args(bus),
                    _ => Vec::new(),
                };
                for _ in 0..replicas {
                    let (url, child) = self
                        .router(client, system.name(), "prefix_load", &extra, true)
                        .await?;
                    router_pids.extend(child.id());
                    urls.push(url);
                    children.push(child);
                }
            }
            System::Oracle => {
                let events = if !self.oracle_from_events || self.kv_events.is_empty() {
                    None
                } else {
                    Some(
                        crate::oracle::EventView::start(&self.kv_events, self.block_size)
                            .await
                            .map_err(|e| Skipped(format!("cannot follow the KV events: {e:#}")))?,
                    )
                };
                oracle = Some(Oracle::new(
                    self.sims.clone(),
                    events,
                    self.cache_threshold,
                    self.balance_abs,
                    self.balance_rel,
                ));
            }
            System::SglangRouter | System::Smg | System::VllmRouter => {
                let (url, child) = self.peer(client, system).await?;
                router_pids.extend(child.id());
                urls.push(url);
                children.push(child);
            }
        }
        Ok(Launched {
            urls,
            oracle,
            router_pids,
            children,
        })
    }
}

/// Empties the prefix tables of a PostgreSQL database, so a run starts from the same empty
/// state as the sims it talks about.
async fn empty_postgres(url: &str) -> Result<(), Skipped> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| Skipped(format!("cannot reach PostgreSQL at {url}: {e}")))?;
    tokio::spawn(connection);
    client
        .batch_execute(
            "DO $$ BEGIN
               IF to_regclass('prefix_router_entries') IS NOT NULL THEN
                 TRUNCATE prefix_router_entries, prefix_router_servers;
               END IF;
             END $$;",
        )
        .await
        .map_err(|e| Skipped(format!("cannot empty the prefix tables: {e}")))
}

/// CPU seconds used so far by `pids` and all their descendants (Linux `/proc`).
pub fn cpu_seconds(pids: &[u32]) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let ticks_per_sec = 100.0; // USER_HZ on Linux
    let mut procs: Vec<(u32, u32, f64)> = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command (which may contain spaces) start after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let (Some(ppid), Some(utime), Some(stime)) =
            (fields.get(1), fields.get(11), fields.get(12))
        else {
            continue;
        };
        let cpu = (utime.parse::<f64>().unwrap_or(0.0) + stime.parse::<f64>().unwrap_or(0.0))
            / ticks_per_sec;
        procs.push((pid, ppid.parse().unwrap_or(0), cpu));
    }
    let mut tree: Vec<u32> = pids.to_vec();
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        for &(pid, ppid, _) in &procs {
            if ppid == parent && !tree.contains(&pid) {
                tree.push(pid);
            }
        }
        i += 1;
    }
    procs
        .iter()
        .filter(|(pid, _, _)| tree.contains(pid))
        .map(|(_, _, cpu)| cpu)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in ALL {
            assert_eq!(System::parse(s.name()).unwrap(), s);
        }
        assert!(System::parse("nope").is_err());
    }

    #[test]
    fn cpu_time_of_this_process_is_counted() {
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(300) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(cpu_seconds(&[std::process::id()]) > 0.1);
    }
}
