use clap::Parser;
use prefix_router::cli::{init_logging, Cli, Command};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_json);
    let result = match cli.command {
        Command::Index(args) => prefix_router::index::run(args).await,
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
