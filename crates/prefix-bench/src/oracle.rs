//! The oracle: routes by what every server really holds under the same load guard as
//! `prefix_load`. Its hit rate is the upper bound a router can reach.
//!
//! On simulated servers it asks each one (`/sim/probe`). On real vLLM servers it follows their
//! KV-cache events into a token-block index and matches each request's tokens (from vLLM's own
//! `/tokenize`) against it, as vLLM's scheduler will: leading full blocks, at most all but the
//! last prompt token.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use prefix_index::{BlockHasher, BlockIndex};
use serde_json::{json, Value};
use vllm_protocol::{KvEvent, Received, Subscriber};

/// How the oracle learns what a server holds.
enum View {
    /// `/sim/probe` on every sim.
    Sims,
    /// The servers' KV-cache events.
    Events(Arc<EventView>),
}

/// The real servers' caches, as their KV-cache events tell them.
pub struct EventView {
    index: BlockIndex,
    tasks: Vec<tokio::task::AbortHandle>,
    /// Batches applied, events skipped (unreadable or not applicable), per the whole fleet.
    pub applied: AtomicU64,
    pub skipped: AtomicU64,
}

impl Drop for EventView {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl EventView {
    /// Subscribes to every server's publisher (`kv_events[i]` is server `i`'s).
    pub async fn start(kv_events: &[String], block_size: usize) -> anyhow::Result<Arc<Self>> {
        let mut subscribers = Vec::new();
        for endpoint in kv_events {
            subscribers.push(
                Subscriber::connect(endpoint, Default::default(), Duration::from_secs(10)).await?,
            );
        }
        let view = Arc::new_cyclic(|weak: &std::sync::Weak<EventView>| {
            let tasks = subscribers
                .into_iter()
                .enumerate()
                .map(|(server, mut sub)| {
                    let weak = weak.clone();
                    tokio::spawn(async move {
                        loop {
                            let received = sub.next().await;
                            let Some(view) = weak.upgrade() else { return };
                            match received {
                                Received::Message(Ok(m)) => view.apply(server as u64, &m.batch),
                                Received::Message(Err(_)) => {
                                    view.skipped.fetch_add(1, Relaxed);
                                }
                                // The benchmark's servers stay up for the run.
                                Received::Refused(_)
                                | Received::Disconnected
                                | Received::Reconnected => {}
                            }
                        }
                    })
                    .abort_handle()
                })
                .collect();
            EventView {
                index: BlockIndex::new(BlockHasher::new(block_size, 0), 1 << 24),
                tasks,
                applied: AtomicU64::new(0),
                skipped: AtomicU64::new(0),
            }
        });
        Ok(view)
    }

    fn apply(&self, server: u64, batch: &vllm_protocol::EventBatch) {
        self.applied.fetch_add(1, Relaxed);
        self.skipped.fetch_add(batch.skipped.len() as u64, Relaxed);
        for event in &batch.events {
            match event {
                KvEvent::Stored(s) if s.is_matchable() => {
                    let hashes: Vec<u64> = vllm_protocol::events::raw_hashes(&s.block_hashes);
                    let stored = self.index.stored(
                        server,
                        s.parent.map(|p| p.0),
                        &hashes,
                        &s.token_ids,
                        s.block_size as usize,
                    );
                    if stored.is_err() {
                        self.skipped.fetch_add(1, Relaxed);
                    }
                }
                KvEvent::Stored(_) => {
                    self.skipped.fetch_add(1, Relaxed);
                }
                KvEvent::Removed(r) => {
                    let hashes: Vec<u64> = vllm_protocol::events::raw_hashes(&r.block_hashes);
                    self.index.removed(server, &hashes);
                }
                KvEvent::AllCleared => {
                    self.index.clear(server);
                }
            }
        }
    }

    /// Prompt tokens each server would find cached for `tokens`, as vLLM computes it.
    pub fn cached(&self, tokens: &[u32], servers: usize) -> Vec<u64> {
        let hasher = self.index.hasher();
        let names = hasher.hash(tokens);
        let ids: Vec<u64> = (0..servers as u64).collect();
        let block = hasher.block_size() as u64;
        // vLLM recomputes at least the last prompt token.
        let usable = (tokens.len() as u64).saturating_sub(1) / block;
        self.index
            .matches(&names, &ids)
            .into_iter()
            .map(|m| m.min(usable) * block)
            .collect()
    }
}

/// The token ids vLLM gives a request body (its `/tokenize`, chat-templated for chat).
pub async fn tokenize(client: &reqwest::Client, server: &str, body: &Value) -> Option<Vec<u32>> {
    let request = if body.get("messages").is_some() {
        let mut r = json!({"model": body["model"], "messages": body["messages"], "add_generation_prompt": true});
        if let Some(tools) = body.get("tools") {
            r["tools"] = tools.clone();
        }
        r
    } else {
        json!({"model": body["model"], "prompt": body["prompt"]})
    };
    let answer: Value = client
        .post(format!("{server}/tokenize"))
        .json(&request)
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    answer["tokens"]
        .as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

pub struct Oracle {
    view: View,
    sims: Vec<String>,
    inflight: Vec<AtomicU64>,
    /// Of those, the ones without a first byte yet.
    waiting_first_byte: Vec<AtomicU64>,
    turn: AtomicU64,
    pub cache_threshold: f64,
    pub balance_abs: u64,
    pub balance_rel: f64,
}

/// Counts a request in flight at one sim until dropped, and waiting for its first byte until
/// [`Lease::first_byte`].
pub struct Lease {
    oracle: Arc<Oracle>,
    index: usize,
    waiting_first_byte: bool,
}

impl Lease {
    /// The answer's first byte came.
    pub fn first_byte(&mut self) {
        if std::mem::take(&mut self.waiting_first_byte) {
            self.oracle.waiting_first_byte[self.index].fetch_sub(1, Relaxed);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.first_byte();
        self.oracle.inflight[self.index].fetch_sub(1, Relaxed);
    }
}

impl Oracle {
    /// An oracle over `sims` (probed), or over real servers whose events `events` follows.
    pub fn new(
        sims: Vec<String>,
        events: Option<Arc<EventView>>,
        cache_threshold: f64,
        balance_abs: u64,
        balance_rel: f64,
    ) -> Arc<Self> {
        Arc::new(Self {
            view: events.map_or(View::Sims, View::Events),
            inflight: sims.iter().map(|_| AtomicU64::new(0)).collect(),
            waiting_first_byte: sims.iter().map(|_| AtomicU64::new(0)).collect(),
            sims,
            turn: AtomicU64::new(0),
            cache_threshold,
            balance_abs,
            balance_rel,
        })
    }

    /// Chooses a sim for `body`; the lease counts it in flight there.
    pub async fn pick(self: &Arc<Self>, client: &reqwest::Client, body: &Value) -> (String, Lease) {
        let probes: Vec<Option<(u64, u64)>> = match &self.view {
            View::Sims => {
                let probes = self.sims.iter().map(|sim| async move {
                    let resp = client
                        .post(format!("{sim}/sim/probe"))
                        .json(body)
                        .send()
                        .await
                        .ok()?;
                    let v: Value = resp.json().await.ok()?;
                    Some((v["cached_tokens"].as_u64()?, v["prompt_tokens"].as_u64()?))
                });
                futures_util::future::join_all(probes).await
            }
            View::Events(view) => match tokenize(client, &self.sims[0], body).await {
                Some(tokens) => view
                    .cached(&tokens, self.sims.len())
                    .into_iter()
                    .map(|c| Some((c, tokens.len() as u64)))
                    .collect(),
                None => vec![None; self.sims.len()],
            },
        };
        let n = self.sims.len();
        let turn = self.turn.fetch_add(1, Relaxed) as usize;
        // Candidates by load, ties taking turns.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (self.inflight[i].load(Relaxed), (i + n - turn % n) % n));
        let cached = |i: usize| probes[i].map_or(0, |(c, _)| c);
        let least = order[0];
        let best = order
            .iter()
            .copied()
            .max_by_key(|&i| (cached(i), std::cmp::Reverse(self.inflight[i].load(Relaxed))))
            .unwrap_or(least);
        let prompt = probes[best].map_or(1, |(_, p)| p.max(1));
        let ratio = cached(best) as f64 / prompt as f64;
        let (chosen_load, least_load) = (
            self.inflight[best].load(Relaxed),
            self.inflight[least].load(Relaxed),
        );
        // The router's guard (prefix_load's `guard_margin` and `still_to_prefill`): the
        // margin is 1.5 times the fleet's mean load, at least 1 and at most balance_abs, and
        // never below the best server's requests still waiting for a first byte (at most
        // balance_abs).
        let mean = self
            .inflight
            .iter()
            .map(|l| l.load(Relaxed) as f64)
            .sum::<f64>()
            / n.max(1) as f64;
        let cap = (self.balance_abs as f64).max(1.0);
        let still_to_prefill = (self.waiting_first_byte[best].load(Relaxed) as f64).min(cap);
        let margin = (1.5 * mean).clamp(1.0, cap).max(still_to_prefill);
        let overloaded = chosen_load as f64 > least_load as f64 + margin
            && chosen_load as f64 > least_load as f64 * self.balance_rel;
        let index = if cached(best) == 0 || ratio < self.cache_threshold || overloaded {
            least
        } else {
            best
        };
        self.inflight[index].fetch_add(1, Relaxed);
        self.waiting_first_byte[index].fetch_add(1, Relaxed);
        (
            self.sims[index].clone(),
            Lease {
                oracle: self.clone(),
                index,
                waiting_first_byte: true,
            },
        )
    }
}
