//! The fleet under test — simulated vLLM servers or real ones, started here or already
//! running — and its counters.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use vllm_sim::{Fleet, SimConfig};

/// The sims' totals at one moment.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub hits: f64,
    pub queries: f64,
    /// Finished requests, per server.
    pub finished: Vec<f64>,
    /// Prefix-cache hits and queries (tokens), per server.
    pub server_hits: Vec<f64>,
    pub server_queries: Vec<f64>,
    /// Prompt tokens pulled from other servers (vLLM's KV connector), per server.
    pub pulled: Vec<f64>,
}

impl Counters {
    /// What happened between `before` and `self`.
    pub fn since(&self, before: &Counters) -> Counters {
        let minus = |after: &[f64], before: &[f64]| -> Vec<f64> {
            after
                .iter()
                .zip(before.iter().chain(std::iter::repeat(&0.0)))
                .map(|(a, b)| a - b)
                .collect()
        };
        Counters {
            hits: self.hits - before.hits,
            queries: self.queries - before.queries,
            finished: minus(&self.finished, &before.finished),
            server_hits: minus(&self.server_hits, &before.server_hits),
            server_queries: minus(&self.server_queries, &before.server_queries),
            pulled: minus(&self.pulled, &before.pulled),
        }
    }
}

/// The servers a comparison routes to.
pub struct BenchFleet {
    pub urls: Vec<String>,
    /// The servers' KV-event publishers, in `urls` order (empty when they publish none).
    pub kv_events: Vec<String>,
    /// Their replay sockets, in `urls` order (empty when they have none).
    pub kv_replay: Vec<String>,
    /// Tokens per KV block of the servers.
    pub block_size: usize,
    /// Each server's KV cache in tokens (0: unknown).
    pub cache_tokens: u64,
    /// The tokenizer directory of the servers' model, when they tokenize for real.
    pub tokenizer: Option<std::path::PathBuf>,
    owned: Owned,
}

enum Owned {
    Sims(Fleet),
    Vllm(crate::vllm_fleet::VllmFleet),
    AttachedVllm,
    Nothing,
}

#[derive(Parser)]
struct SimWords {
    #[command(flatten)]
    config: SimConfig,
}

/// Parses `--sim-args` (the `sim` subcommand's flags, space-separated).
pub fn sim_config(words: &str) -> anyhow::Result<SimConfig> {
    let argv = std::iter::once("sim").chain(words.split_whitespace());
    Ok(SimWords::try_parse_from(argv)
        .context("in --sim-args")?
        .config)
}

impl BenchFleet {
    /// Starts `n` sims in this process on free ports.
    pub async fn start(n: usize, config: SimConfig) -> anyhow::Result<Self> {
        let block_size = config.block_size;
        let cache_tokens = (config.kv_blocks * config.block_size) as u64;
        let tokenizer = config.tokenizer.clone();
        let fleet = Fleet::start(config, n, SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        Ok(Self {
            urls: fleet.urls(),
            kv_events: fleet.kv_events(),
            kv_replay: fleet
                .servers
                .iter()
                .filter_map(|s| s.kv_replay.clone())
                .collect(),
            block_size,
            cache_tokens,
            tokenizer,
            owned: Owned::Sims(fleet),
        })
    }

    /// Starts real vLLM servers.
    pub async fn start_vllm(config: crate::vllm_fleet::VllmFleetConfig) -> anyhow::Result<Self> {
        let block_size = config.block_size;
        let cache_tokens = (config.num_blocks * config.block_size) as u64;
        let fleet = crate::vllm_fleet::VllmFleet::start(config).await?;
        Ok(Self {
            urls: fleet.urls(),
            kv_events: fleet.servers.iter().map(|s| s.kv_events.clone()).collect(),
            kv_replay: fleet.servers.iter().map(|s| s.kv_replay.clone()).collect(),
            block_size,
            cache_tokens,
            tokenizer: Some(fleet.model_dir.clone()),
            owned: Owned::Vllm(fleet),
        })
    }

    /// Uses real vLLM servers that are already running (described by `bench vllm-fleet`).
    pub fn attach_vllm(file: &crate::vllm_fleet::FleetFile) -> Self {
        Self {
            urls: file.urls.clone(),
            kv_events: file.kv_events.clone(),
            kv_replay: file.kv_replay.clone(),
            block_size: file.block_size,
            cache_tokens: (file.num_blocks * file.block_size) as u64,
            tokenizer: Some(file.model_dir.clone()),
            owned: Owned::AttachedVllm,
        }
    }

    /// Uses sims that are already running.
    pub fn attach(urls: Vec<String>) -> Self {
        Self {
            urls: urls
                .into_iter()
                .map(|u| u.trim_end_matches('/').to_owned())
                .collect(),
            kv_events: Vec::new(),
            kv_replay: Vec::new(),
            block_size: SimConfig::default().block_size,
            cache_tokens: 0,
            tokenizer: None,
            owned: Owned::Nothing,
        }
    }

    /// True for real vLLM servers (no `/sim/*` controls: no time scale, no probes).
    pub fn is_vllm(&self) -> bool {
        matches!(self.owned, Owned::Vllm(_) | Owned::AttachedVllm)
    }

    pub async fn counters(&self, client: &reqwest::Client) -> anyhow::Result<Counters> {
        let mut c = Counters::default();
        for url in &self.urls {
            let text = client
                .get(format!("{url}/metrics"))
                .send()
                .await
                .with_context(|| format!("cannot read {url}/metrics"))?
                .text()
                .await?;
            let sum = |name: &str| -> f64 {
                text.lines()
                    .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum()
            };
            let (hits, queries) = (
                sum("vllm:prefix_cache_hits_total"),
                sum("vllm:prefix_cache_queries_total"),
            );
            c.hits += hits;
            c.queries += queries;
            c.server_hits.push(hits);
            c.server_queries.push(queries);
            c.finished.push(sum("vllm:request_success_total"));
            c.pulled.push(sum("vllm:external_prefix_cache_hits_total"));
        }
        Ok(c)
    }

    async fn post_all(
        &self,
        client: &reqwest::Client,
        path: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<()> {
        for url in &self.urls {
            let status = client
                .post(format!("{url}{path}"))
                .json(&body)
                .send()
                .await?
                .status();
            anyhow::ensure!(status.is_success(), "{url}{path} answered {status}");
        }
        Ok(())
    }

    /// Empties every prefix cache (and, on sims, the counters; vLLM's counters only grow,
    /// which [`Counters::since`] allows for).
    pub async fn reset(&self, client: &reqwest::Client) -> anyhow::Result<()> {
        if self.is_vllm() {
            // vLLM answers only when started with VLLM_SERVER_DEV_MODE=1 (the fleet is).
            self.post_all(client, "/reset_prefix_cache", json!({}))
                .await
        } else {
            self.post_all(client, "/sim/reset", json!({})).await
        }
    }

    /// Waits (at most `limit`) until no server has a request running or waiting: what the last
    /// system left behind is done before the next one is measured.
    pub async fn wait_idle(&self, client: &reqwest::Client, limit: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let mut busy = 0.0;
            for url in &self.urls {
                let Ok(resp) = client.get(format!("{url}/metrics")).send().await else {
                    continue;
                };
                let Ok(text) = resp.text().await else {
                    continue;
                };
                busy += text
                    .lines()
                    .filter(|l| {
                        l.starts_with("vllm:num_requests_running")
                            || l.starts_with("vllm:num_requests_waiting")
                    })
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>();
            }
            if busy == 0.0 || tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Whether the servers are this process's own simulators (they can be started afresh).
    pub fn is_own_sims(&self) -> bool {
        matches!(self.owned, Owned::Sims(_))
    }

    pub async fn set_time_scale(&self, client: &reqwest::Client, scale: f64) -> anyhow::Result<()> {
        self.post_all(client, "/sim/config", json!({ "time_scale": scale }))
            .await
    }

    pub async fn shutdown(self) {
        match self.owned {
            Owned::Sims(fleet) => fleet.shutdown().await,
            Owned::Vllm(fleet) => fleet.stop().await,
            Owned::AttachedVllm | Owned::Nothing => {}
        }
    }
}
