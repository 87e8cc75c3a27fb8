//! The command line: one binary, one subcommand per role.

use clap::{Parser, Subcommand};

use crate::index::IndexArgs;

#[derive(Parser, Debug)]
#[command(
    name = "prefix-router",
    version,
    about = "Prefix-cache-aware router for vLLM fleets"
)]
pub struct Cli {
    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or `prefix_router=debug`.
    #[arg(long, global = true, env = "PREFIX_ROUTER_LOG", default_value = "info")]
    pub log: String,
    /// Log as JSON lines instead of text.
    #[arg(long, global = true, env = "PREFIX_ROUTER_LOG_JSON")]
    pub log_json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// The router: an OpenAI-compatible, prefix-cache-aware gateway in front of vLLM servers.
    Serve(Box<crate::serve::ServeArgs>),
    /// An endpoint picker for the Gateway API Inference Extension: the router's decisions
    /// served to an Envoy-based gateway over ext_proc (gRPC).
    Epp(Box<crate::epp::EppArgs>),
    /// The string server: the prefix index over HTTP (query/notify).
    Index(IndexArgs),
    /// A fleet of simulated vLLM servers (prefix cache, queueing, vLLM's API and metrics).
    Sim(vllm_sim::SimArgs),
    /// Benchmarks: one workload against one URL (`run`), or every system side by side
    /// (`compare`).
    Bench(Box<prefix_bench::BenchArgs>),
    /// A one-minute tour: simulated servers, round robin vs the default policy (cost) on a shared-prefix
    /// workload, and the table.
    Demo {
        /// Where the results go.
        #[arg(long, default_value = "demo-results")]
        out: std::path::PathBuf,
    },
}

/// Sets up logging to stderr.
pub fn init_logging(filter: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
