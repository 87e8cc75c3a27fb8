//! The flags that choose and shape a prefix store, shared by `index` and `serve`.

use std::sync::Arc;

use anyhow::{bail, Context};
use prefix_index::{MemoryStore, PrefixHasher, PrefixStore, StoreConfig, DEFAULT_CHUNK_SIZE};

#[derive(clap::Args, Debug, Clone)]
pub struct StoreArgs {
    /// Where the index lives: `memory` (the only store so far; `sqlite:PATH` and
    /// `postgres://...` come with the SQL stores).
    #[arg(long, env = "PREFIX_ROUTER_STORE", default_value = "memory")]
    pub store: String,
    /// Bytes per chunk of the request string.
    #[arg(long, env = "PREFIX_ROUTER_CHUNK_SIZE", default_value_t = DEFAULT_CHUNK_SIZE)]
    pub chunk_size: usize,
    /// Entries (chunks) each server may hold before the least recently used are evicted.
    #[arg(long, env = "PREFIX_ROUTER_CAPACITY", default_value_t = prefix_index::DEFAULT_CAPACITY)]
    pub capacity: u64,
    /// Seconds after its last use that an entry stops matching (off by default).
    #[arg(long, env = "PREFIX_ROUTER_TTL")]
    pub ttl: Option<f64>,
    /// Seed of the chunk hash. Keep it secret on a public endpoint, so that clients cannot
    /// craft colliding prefixes to steer traffic.
    #[arg(
        long,
        env = "PREFIX_ROUTER_HASH_SEED",
        default_value_t = 0,
        hide_env_values = true
    )]
    pub hash_seed: u64,
}

impl StoreArgs {
    pub fn hasher(&self) -> anyhow::Result<PrefixHasher> {
        Ok(PrefixHasher::new(self.chunk_size, self.hash_seed)?)
    }

    pub fn config(&self) -> anyhow::Result<StoreConfig> {
        let ttl_ms = match self.ttl {
            None => None,
            Some(secs) if secs.is_finite() && secs > 0.0 => Some((secs * 1000.0).round() as u64),
            Some(secs) => bail!("--ttl must be a positive number of seconds, got {secs}"),
        };
        let config = StoreConfig {
            default_capacity: self.capacity,
            ttl_ms,
        };
        config.validate()?;
        Ok(config)
    }

    /// Opens the store named by `--store`.
    pub fn open(&self) -> anyhow::Result<Arc<dyn PrefixStore>> {
        let config = self.config()?;
        match self.store.as_str() {
            "memory" => Ok(Arc::new(
                MemoryStore::new(config).context("opening the memory store")?,
            )),
            other => bail!("unsupported --store {other:?}: this build supports `memory`"),
        }
    }
}
