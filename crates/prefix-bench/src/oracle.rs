//! The oracle: routes with perfect knowledge of the simulated caches (`/sim/probe` on every
//! server) under the same load guard as `prefix_load`. Its hit rate is the upper bound a
//! router can reach.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use serde_json::Value;

pub struct Oracle {
    sims: Vec<String>,
    inflight: Vec<AtomicU64>,
    turn: AtomicU64,
    pub cache_threshold: f64,
    pub balance_abs: u64,
    pub balance_rel: f64,
}

/// Counts a request in flight at one sim until dropped.
pub struct Lease {
    oracle: Arc<Oracle>,
    index: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.oracle.inflight[self.index].fetch_sub(1, Relaxed);
    }
}

impl Oracle {
    pub fn new(
        sims: Vec<String>,
        cache_threshold: f64,
        balance_abs: u64,
        balance_rel: f64,
    ) -> Arc<Self> {
        Arc::new(Self {
            inflight: sims.iter().map(|_| AtomicU64::new(0)).collect(),
            sims,
            turn: AtomicU64::new(0),
            cache_threshold,
            balance_abs,
            balance_rel,
        })
    }

    /// Chooses a sim for `body`; the lease counts it in flight there.
    pub async fn pick(self: &Arc<Self>, client: &reqwest::Client, body: &Value) -> (String, Lease) {
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
        let probes: Vec<Option<(u64, u64)>> = futures_util::future::join_all(probes).await;
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
        let overloaded = chosen_load > least_load + self.balance_abs
            && chosen_load as f64 > least_load as f64 * self.balance_rel;
        let index = if cached(best) == 0 || ratio < self.cache_threshold || overloaded {
            least
        } else {
            best
        };
        self.inflight[index].fetch_add(1, Relaxed);
        (
            self.sims[index].clone(),
            Lease {
                oracle: self.clone(),
                index,
            },
        )
    }
}
