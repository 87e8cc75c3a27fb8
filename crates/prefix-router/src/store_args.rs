//! The flags that choose and shape a prefix store, shared by `index` and `serve`.

use std::sync::Arc;

use anyhow::{bail, Context};
use prefix_index::{
    MemoryStore, PostgresStore, PrefixHasher, PrefixStore, SqliteStore, StoreConfig,
    DEFAULT_CHUNK_SIZE,
};

#[derive(clap::Args, Debug, Clone)]
pub struct StoreArgs {
    /// Where the index lives: `memory`, `sqlite:PATH` (embedded, durable) or
    /// `postgres://user@host/db` (shared by several processes).
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
    /// Connections to PostgreSQL (per process).
    #[arg(long, env = "PREFIX_ROUTER_STORE_POOL", default_value_t = 16)]
    pub pool_size: usize,
    /// Seed of the chunk hash (default 0; with a replica bus key, one derived from the key).
    /// Keep it secret on a public endpoint, so that clients cannot craft colliding prefixes
    /// to steer traffic.
    #[arg(long, env = "PREFIX_ROUTER_HASH_SEED", hide_env_values = true)]
    pub hash_seed: Option<u64>,
}

impl StoreArgs {
    /// The hasher of `--chunk-size` and `--hash-seed` (0 when not given).
    pub fn hasher(&self) -> anyhow::Result<PrefixHasher> {
        self.hasher_seeded(self.hash_seed.unwrap_or(0))
    }

    /// The hasher of `--chunk-size` and `seed`.
    pub fn hasher_seeded(&self, seed: u64) -> anyhow::Result<PrefixHasher> {
        Ok(PrefixHasher::new(self.chunk_size, seed)?)
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

    /// Opens the store named by `--store` (a database that cannot be reached is an error).
    pub async fn open(&self) -> anyhow::Result<Arc<dyn PrefixStore>> {
        let config = self.config()?;
        let url = self.store.as_str();
        if url == "memory" {
            return Ok(Arc::new(
                MemoryStore::new(config).context("opening the memory store")?,
            ));
        }
        if let Some(path) = url.strip_prefix("sqlite:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            anyhow::ensure!(!path.is_empty(), "--store sqlite:PATH needs a path");
            return Ok(Arc::new(
                SqliteStore::open(std::path::Path::new(path), config)
                    .with_context(|| format!("opening the SQLite store {path}"))?,
            ));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(Arc::new(
                PostgresStore::open(url, config, self.pool_size)
                    .await
                    .context("opening the PostgreSQL store")?,
            ));
        }
        bail!("unsupported --store {url:?}: use memory, sqlite:PATH or postgres://user@host/db")
    }
}
