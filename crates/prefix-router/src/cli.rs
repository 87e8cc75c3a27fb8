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

/// The command-line reference (`docs/reference/cli.md`): every subcommand's flags with their
/// environment variables, defaults and help, as `--help` knows them. A test keeps the page in
/// step with this.
pub fn reference_markdown() -> String {
    use clap::CommandFactory;
    let mut root = Cli::command();
    root.build();
    let mut out = String::from(
        "# Command-line reference\n\n\
         Generated from the binary's own definitions: `cargo test -p prefix-router --test docs` \
         fails when this page and `--help` differ, and `UPDATE_DOCS=1` with the same command \
         rewrites it.\n\n\
         Every flag can also be set by its environment variable and, for `serve` and `epp`, by \
         the `--config` file under the flag's long name (`policy = \"cost\"`); precedence: \
         command line, environment, config file, default. Durations take units (`500ms`, \
         `2s`, `1m`) or a number of seconds.\n\n",
    );
    out.push_str("## `prefix-router`\n\n");
    push_about(&mut out, &root);
    push_flags(&mut out, &root, true);
    for sub in root.get_subcommands() {
        push_command(&mut out, sub, "prefix-router");
    }
    out
}

fn push_command(out: &mut String, cmd: &clap::Command, parent: &str) {
    if cmd.get_name() == "help" {
        return;
    }
    let path = format!("{parent} {}", cmd.get_name());
    out.push_str(&format!("## `{path}`\n\n"));
    push_about(out, cmd);
    push_flags(out, cmd, false);
    for sub in cmd.get_subcommands() {
        push_command(out, sub, &path);
    }
}

fn push_about(out: &mut String, cmd: &clap::Command) {
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        let about = one_line(&about.to_string());
        out.push_str(&about);
        if !about.ends_with(['.', ')']) {
            out.push('.');
        }
        out.push_str("\n\n");
    }
}

/// A table of the command's flags (its own; the global ones only at the root).
fn push_flags(out: &mut String, cmd: &clap::Command, root: bool) {
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && (root || !a.is_global_set()))
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if args.is_empty() {
        return;
    }
    out.push_str("| flag | environment | default | meaning |\n|---|---|---|---|\n");
    for a in args {
        let name = match (a.get_long(), a.get_short()) {
            (Some(l), _) => format!("`--{l}`"),
            (None, Some(s)) => format!("`-{s}`"),
            (None, None) => format!("`<{}>`", a.get_id()),
        };
        let env = a
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let default = a
            .get_default_values()
            .iter()
            .map(|v| format!("`{}`", v.to_string_lossy()))
            .collect::<Vec<_>>()
            .join(", ");
        let mut help = a
            .get_long_help()
            .or(a.get_help())
            .map(|h| one_line(&h.to_string()))
            .unwrap_or_default();
        let values: Vec<String> = a
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        if !help.is_empty() && !help.ends_with(['.', ')', '?', '!']) {
            help.push('.');
        }
        if !values.is_empty() && a.get_action().takes_values() {
            help.push_str(&format!(" One of: {}.", values.join(", ")));
        }
        out.push_str(&format!(
            "| {name} | {env} | {default} | {} |\n",
            help.replace('|', "\\|")
        ));
    }
    out.push('\n');
}

/// Help text on one line (a table cell).
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
