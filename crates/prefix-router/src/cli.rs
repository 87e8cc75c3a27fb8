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
    /// The string server: the prefix index over HTTP (query/notify).
    Index(IndexArgs),
    /// A fleet of simulated vLLM servers (prefix cache, queueing, vLLM's API and metrics).
    Sim(vllm_sim::SimArgs),
    /// Benchmarks: one workload against one URL (`run`), or every system side by side
    /// (`compare`).
    Bench(Box<prefix_bench::BenchArgs>),
    /// A one-minute tour: simulated servers, round robin vs prefix_load on a shared-prefix
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

/// Parses a duration flag: a bare number is seconds (`1`, `0.5`), as in the production-stack
/// router's flags; otherwise humantime's units (`500ms`, `2s`, `1m 30s`).
pub fn duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<f64>() {
        return std::time::Duration::try_from_secs_f64(secs)
            .map_err(|_| format!("{text:?} is not a duration: seconds must be 0 or more"));
    }
    humantime::parse_duration(text).map_err(|e| {
        format!(
            "{text:?} is not a duration ({e}); use a number of seconds or units like 500ms, 2s, 1m"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::duration;
    use std::time::Duration;

    #[test]
    fn durations_take_bare_seconds_and_units() {
        assert_eq!(duration("1"), Ok(Duration::from_secs(1)));
        assert_eq!(duration("0.25"), Ok(Duration::from_millis(250)));
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("1m 30s"), Ok(Duration::from_secs(90)));
        assert!(duration("-1").is_err());
        assert!(duration("soon").unwrap_err().contains("number of seconds"));
    }
}
