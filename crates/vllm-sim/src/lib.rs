//! vllm-sim: simulated vLLM servers for prefix-router's tests and benchmarks.
//!
//! Each server speaks vLLM's OpenAI-compatible HTTP API and models what matters to a router:
//! automatic prefix caching over a bounded KV cache ([`kv_cache`]), a FIFO prefill engine and
//! bounded decode seats ([`engine`]), vLLM's metrics, prefill/decode disaggregation as vLLM's
//! NixlConnector speaks it ([`disagg`]), and injectable faults. Nothing here
//! depends on the router: it stands in for vLLM.
#![forbid(unsafe_code)]

pub mod api;
pub mod config;
pub mod disagg;
pub mod engine;
pub mod events;
pub mod kv_cache;
pub mod metrics;
pub mod openai;
pub mod server;
pub mod text;
pub mod tokens;

use std::net::SocketAddr;

pub use config::SimConfig;
pub use server::{Fleet, SimServer};

/// `prefix-router sim`'s arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Number of servers, on consecutive ports from `--listen`.
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    /// Address of the first server.
    #[arg(long, default_value = "127.0.0.1:8100")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub config: SimConfig,
}

/// Runs a fleet until SIGINT or SIGTERM, printing one line per server.
pub async fn run(
    args: SimArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    anyhow::ensure!(args.servers > 0, "--servers must be at least 1");
    let fleet = Fleet::start(args.config, args.servers, args.listen).await?;
    for (i, server) in fleet.servers.iter().enumerate() {
        match (&server.kv_events, &server.kv_replay) {
            (Some(events), Some(replay)) => println!(
                "sim server {i}: {}   kv events: {events}   replay: {replay}",
                server.url()
            ),
            _ => println!("sim server {i}: {}", server.url()),
        }
    }
    shutdown.await;
    fleet.shutdown().await;
    Ok(())
}
