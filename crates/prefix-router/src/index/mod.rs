//! `prefix-router index`: the string server over HTTP.

mod api;
mod metrics;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prefix_index::{PrefixStore, Tick};
use tokio::net::TcpListener;

pub use api::{app, IndexState};

use crate::server::{self, Running};
use crate::store_args::StoreArgs;

#[derive(clap::Args, Debug, Clone)]
pub struct IndexArgs {
    /// Address to listen on.
    #[arg(long, env = "PREFIX_ROUTER_LISTEN", default_value = "127.0.0.1:9000")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub store: StoreArgs,
    /// How often expired entries (see `--ttl`) are purged; 0s never (they stay invisible).
    #[arg(long, env = "PREFIX_ROUTER_PURGE_INTERVAL", default_value = "10s", value_parser = crate::duration::parse)]
    pub purge_interval: Duration,
    #[command(flatten)]
    pub access: crate::access::AccessArgs,
    #[command(flatten)]
    pub limits: crate::server::ServerLimits,
    /// Largest accepted request body, in bytes.
    #[arg(long, env = "PREFIX_ROUTER_MAX_BODY", default_value_t = 16 << 20)]
    pub max_body: usize,
}

impl IndexArgs {
    /// The defaults, listening on `listen`.
    pub fn with_listen(listen: SocketAddr) -> Self {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: IndexArgs,
        }
        let mut args = Wrapper::parse_from(["index"]).args;
        args.listen = listen;
        args
    }
}

async fn state(args: &IndexArgs) -> anyhow::Result<IndexState> {
    let store = args.store.open().await?;
    let state = IndexState::new(store.clone(), args.store.hasher()?, args.max_body)
        .with_keys(args.access.keys()?)
        .with_max_concurrent(args.limits.max_concurrent);
    if args.store.config()?.ttl_ms.is_some() && !args.purge_interval.is_zero() {
        spawn_purger(store, args.purge_interval, state.clock());
    }
    Ok(state)
}

/// Frees expired entries in the background; a TTL already hides them from queries.
///
/// "Now" is the latest `t` a notify brought, not the wall clock: clients may give times on
/// their own scale, and entries must not vanish because of a clock they never used.
fn spawn_purger(store: Arc<dyn PrefixStore>, period: Duration, clock: Arc<AtomicU64>) {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(period);
        loop {
            ticker.tick().await;
            let now = Tick::from_millis(clock.load(Ordering::Relaxed));
            if let Err(e) = store.purge_expired(now).await {
                tracing::warn!(error = %e, "purging expired entries failed");
            }
        }
    });
}

/// Runs the string server until SIGINT or SIGTERM.
pub async fn run(args: IndexArgs) -> anyhow::Result<()> {
    let app = app(state(&args).await?);
    let listener = server::bind(args.listen).await?;
    tracing::info!(
        listen = %listener.local_addr()?,
        store = %args.store.store,
        chunk_size = args.store.chunk_size,
        capacity = args.store.capacity,
        "string server ready"
    );
    server::serve_until_signal(listener, app, args.limits.clone()).await
}

/// Starts the string server in the background on an already bound listener.
pub async fn spawn(args: IndexArgs, listener: TcpListener) -> anyhow::Result<Running> {
    Running::spawn(listener, app(state(&args).await?), args.limits.clone())
}
