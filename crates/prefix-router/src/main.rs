#![forbid(unsafe_code)]
use clap::Parser;
use prefix_router::cli::{init_logging, Cli, Command};

/// jemalloc with a background thread that hands freed pages back to the system: after a burst of
/// thousands of connections the process returns to its idle size instead of keeping the peak
/// (glibc's malloc keeps it in per-thread arenas).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_json);
    if let Err(e) = tikv_jemalloc_ctl::background_thread::write(true) {
        tracing::warn!("jemalloc background purging is off ({e}); memory freed after a burst returns more slowly");
    }
    let result = match cli.command {
        Command::Serve(args) => match args.resolve(&serve_args("serve", &[])) {
            Ok(args) => prefix_router::serve::run(args).await,
            Err(e) => Err(e),
        },
        Command::Epp(mut args) => {
            let own = prefix_router::epp::EppArgs::OWN_FLAGS;
            match args.serve.resolve(&serve_args("epp", own)) {
                Ok(serve) => {
                    args.serve = serve;
                    prefix_router::epp::run(*args).await
                }
                Err(e) => Err(e),
            }
        }
        Command::Index(args) => prefix_router::index::run(args).await,
        Command::Bench(args) => match std::env::current_exe() {
            Ok(exe) => prefix_bench::run(*args, exe).await,
            Err(e) => Err(e.into()),
        },
        Command::Demo { out } => match std::env::current_exe() {
            Ok(exe) => prefix_bench::demo(&exe, out).await.map(|_| ()),
            Err(e) => Err(e.into()),
        },
        Command::Sim(args) => vllm_sim::run(args, prefix_router::server::shutdown_signal()).await,
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The command-line words after `command`, without the global logging flags and the
/// command's `own` flags (for the config file merge, which re-reads `serve`'s).
fn serve_args(command: &str, own: &[&str]) -> Vec<String> {
    let mut words = std::env::args().skip_while(|a| a != command).skip(1);
    let mut out = Vec::new();
    let takes_value = |w: &str| w == "--log" || own.contains(&w);
    let is_inline = |w: &str| {
        ["--log", "--log-json"]
            .iter()
            .chain(own)
            .any(|f| w.starts_with(&format!("{f}=")))
    };
    while let Some(w) = words.next() {
        match w.as_str() {
            w if takes_value(w) => {
                words.next();
            }
            "--log-json" => {}
            w if is_inline(w) => {}
            _ => out.push(w),
        }
    }
    out
}
