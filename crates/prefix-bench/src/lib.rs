//! prefix-bench: the same workload against every routing system, on the same simulated fleet,
//! in one run. It talks HTTP like a user; our router runs as its own process, like the peers.
#![forbid(unsafe_code)]

pub mod driver;
pub mod fleet;
pub mod meta;
pub mod oracle;
pub mod report;
pub mod rounds;
pub mod stats;
pub mod suite;
pub mod systems;
pub mod vllm_fleet;
pub mod workload;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use driver::{Arrivals, Driven, Target};
use fleet::BenchFleet;
use report::{Figures, SystemResult};
pub use rounds::SystemSummary;
use systems::{LaunchContext, System};
use workload::{Job, WorkloadArgs, WorkloadKind};

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// One workload against one OpenAI-compatible URL.
    Run(Box<RunArgs>),
    /// The same workload against every system, on one fleet.
    Compare(Box<CompareArgs>),
    /// Every workload of the suite compared over rounds, and the regret table: per workload,
    /// the default policy against the best of our policies and the best peer.
    Suite(Box<suite::SuiteArgs>),
    /// Starts real vLLM servers (CPU build, tiny model, real tokenizer) and waits for Ctrl-C.
    VllmFleet {
        #[command(flatten)]
        fleet: vllm_fleet::VllmFleetArgs,
        /// Where the logs and the model directory go.
        #[arg(long, default_value = "target/vllm-fleet")]
        work_dir: PathBuf,
    },
}

#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// Poisson arrivals at this rate (requests/s; for multi-turn, new conversations/s).
    /// Default: 60 shared-prefix, 4 multi-turn, 20 prefix-repetition, 40 random, 20 rag; the
    /// agent workload keeps its own times (`--session-rate`, `--speedup`).
    #[arg(long)]
    pub qps: Option<f64>,
    /// Closed loop with this many clients instead of Poisson arrivals.
    #[arg(long, conflicts_with = "qps")]
    pub concurrency: Option<usize>,
    /// Send at most this many requests.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Start no request after this many seconds.
    #[arg(long)]
    pub duration: Option<f64>,
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The OpenAI-compatible base URL (without /v1).
    #[arg(long)]
    pub url: String,
    /// Sim servers behind it, to report hit rate and imbalance (repeatable).
    #[arg(long)]
    pub sim_url: Vec<String>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    /// Write results.json, results.md and chart.svg here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    /// The servers: `sim` (simulated, in this process) or `vllm` (real vLLM servers started
    /// here: see `--vllm-servers`; the overhead and throughput phases need sims and are
    /// skipped).
    #[arg(long, default_value = "sim", value_parser = ["sim", "vllm"])]
    pub fleet: String,
    #[command(flatten)]
    pub vllm: vllm_fleet::VllmFleetArgs,
    /// Start this many sim servers in this process (afresh for every system: nothing one
    /// system leaves in a server meets the next).
    #[arg(long, default_value_t = 8)]
    pub sim_servers: usize,
    /// Run every system this many times, the order rotated each round; figures are reported as
    /// medians over the rounds with 95 % intervals, and ratios between systems round by round.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub rounds: u64,
    /// Use sim servers already running instead (repeatable).
    #[arg(long)]
    pub sim_url: Vec<String>,
    /// Flags for the started sims, as for `prefix-router sim`. The default makes one server's
    /// cache too small for all shared-prefix prefixes while the fleet's holds them.
    #[arg(long, default_value = "--kv-blocks 3000", allow_hyphen_values = true)]
    pub sim_args: String,
    /// Comma-separated systems (default: all).
    #[arg(long, value_delimiter = ',')]
    pub systems: Vec<String>,
    /// Where results.json, results.md and chart.svg go.
    #[arg(long, default_value = "bench-results")]
    pub out: PathBuf,
    /// PostgreSQL for the prefix_load+postgres system.
    #[arg(long)]
    pub postgres_url: Option<String>,
    /// Router processes of the +replicas systems (clients spread over them).
    #[arg(long, default_value_t = 4)]
    pub router_replicas: usize,
    /// The +replicas systems share what they learn over this NATS server (`--replica-bus`
    /// of `serve`) instead of through a shared store (`--postgres-url` or a remote index).
    #[arg(long)]
    pub replica_bus: Option<String>,
    /// Cache pressure: tell our routers each server's KV cache is this many times its real
    /// size (their string index then assumes prefixes long evicted are still there), as in
    /// llm-d's experiment with a wrong capacity. Default: the routers learn the real size.
    #[arg(long)]
    pub assumed_cache_factor: Option<f64>,
    /// Router overhead: Poisson rate of the overhead phase (requests/s)...
    #[arg(long, default_value_t = 1000.0)]
    pub overhead_qps: f64,
    /// ... and its requests (0 skips the phase).
    #[arg(long, default_value_t = 1000)]
    pub overhead_requests: usize,
    /// Seconds of the closed-loop maximum-throughput phase (0 skips it).
    #[arg(long, default_value_t = 3.0)]
    pub throughput_secs: f64,
    /// Virtualenv holding the peer routers (made by scripts/peers-venv.sh).
    #[arg(long, default_value = "target/peers-venv")]
    pub peers_venv: PathBuf,
    /// Load-guard settings of prefix_load and the oracle.
    #[arg(long, default_value_t = 0.5)]
    pub cache_threshold: f64,
    #[arg(long, default_value_t = 16)]
    pub balance_abs: u64,
    #[arg(long, default_value_t = 1.5)]
    pub balance_rel: f64,
    /// The gateway-queue flags of the `+queue` systems (the benchmark's client sets
    /// `x-priority` and `x-tenant`, so the router trusts them).
    #[arg(
        long,
        default_value = "--max-queue-wait 500ms --max-queued 100000 --trust-client-headers",
        allow_hyphen_values = true
    )]
    pub queue_args: String,
    /// A disaggregated fleet: the first N servers prefill, the rest decode (our routers get
    /// their roles, vllm-router runs its P/D mode, `cost+aggregated` ignores the roles as the
    /// control; the sims speak vLLM's NixlConnector protocol). 0: an aggregated fleet.
    #[arg(long, default_value_t = 0)]
    pub pd_prefill: usize,
    /// More flags for every one of our routers (e.g. `--pd-threshold 128`).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub router_args: String,
    /// Our routers' log filter (`--log` of `serve`; each router logs to its own file in
    /// `--out`), e.g. `warn,prefix_router::decision=debug` to keep every routing decision.
    #[arg(long, default_value = "warn")]
    pub router_log: String,
}

fn default_qps(kind: WorkloadKind) -> f64 {
    match kind {
        WorkloadKind::SharedPrefix => 60.0,
        WorkloadKind::MultiTurn => 4.0,
        WorkloadKind::PrefixRepetition => 20.0,
        WorkloadKind::Random | WorkloadKind::Trace | WorkloadKind::Mooncake => 40.0,
        WorkloadKind::Bursty => 4.0,
        WorkloadKind::Overload => 20.0,
        // Sets its own times (--session-rate).
        WorkloadKind::Agent => 0.0,
        WorkloadKind::Rag => 20.0,
    }
}

fn arrivals(w: &WorkloadArgs, load: &LoadArgs) -> Arrivals {
    match (load.concurrency, w.workload) {
        (Some(c), _) => Arrivals::Closed(c),
        (None, WorkloadKind::Trace | WorkloadKind::Mooncake) if load.qps.is_none() => {
            Arrivals::Trace
        }
        (None, WorkloadKind::Agent) => Arrivals::Trace,
        (None, kind) => Arrivals::Poisson(load.qps.unwrap_or_else(|| default_qps(kind))),
    }
}

/// The workload's jobs, cut to `--requests`.
fn limited_jobs(w: &WorkloadArgs, load: &LoadArgs) -> anyhow::Result<Vec<Job>> {
    anyhow::ensure!(
        !(w.workload == WorkloadKind::Agent && load.qps.is_some()),
        "the agent workload keeps its own times: set its load with --session-rate or --speedup, not --qps"
    );
    let mut jobs = workload::jobs(w)?;
    if let Some(limit) = load.requests {
        let mut total = 0;
        jobs.retain(|j| {
            total += j.requests();
            total <= limit
        });
    }
    Ok(jobs)
}

fn progress(total: usize, label: &str) -> ProgressBar {
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>22} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(label.to_owned());
    bar
}

fn workload_name(w: &WorkloadArgs) -> String {
    serde_json::to_value(w.workload)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// A small request for the overhead and throughput phases.
fn probe_body(i: u64) -> serde_json::Value {
    json!({"model": "sim-model", "max_tokens": 1, "messages": [
        {"role": "user", "content": workload::text(0xFEED ^ i, 64)}]})
}

/// Latencies (ms) of `n` small requests at `qps` in one Poisson stream, alternating between
/// `direct` and `routed` so that both see the same background load.
async fn paired_latencies(
    direct: Target,
    routed: Target,
    n: usize,
    qps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let client = driver::client();
    let targets = std::sync::Arc::new([direct, routed]);
    let started = tokio::time::Instant::now();
    // Each side at `qps`.
    let tasks: Vec<_> = driver::poisson_times(2 * n, 2.0 * qps, 0xC0FFEE)
        .into_iter()
        .enumerate()
        .map(|(i, at)| {
            let (client, targets) = (client.clone(), targets.clone());
            tokio::spawn(async move {
                tokio::time::sleep_until(started + Duration::from_secs_f64(at)).await;
                let body = probe_body(i as u64);
                let (base, lease) = targets[i % 2].pick(&client, &body).await;
                let start = std::time::Instant::now();
                let result = driver::exchange(
                    &client,
                    &format!("{base}/v1/chat/completions"),
                    &body,
                    start,
                )
                .await;
                drop(lease);
                (
                    i % 2,
                    result.ok().filter(|(s, _)| s.ok).map(|(s, _)| s.e2e * 1e3),
                )
            })
        })
        .collect();
    let mut out = (Vec::new(), Vec::new());
    for task in tasks {
        if let Ok((side, Some(ms))) = task.await {
            if side == 0 {
                out.0.push(ms)
            } else {
                out.1.push(ms)
            }
        }
    }
    out
}

/// A counter's increase between the `before` and `after` scrapes, summed over its series whose
/// labels contain `filter` and over several routers.
fn counter_delta(before: &[String], after: &[String], name: &str, filter: &str) -> f64 {
    let sum = |texts: &[String]| -> f64 {
        texts
            .iter()
            .flat_map(|t| t.lines())
            .filter(|l| {
                l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(filter)
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    sum(after) - sum(before)
}

/// The buckets (upper bound, count) of the histogram `name`, summed over its series and over
/// the scrapes of several routers (replicas), counted between the `before` and `after` scrapes.
fn histogram_delta(before: &[String], after: &[String], name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut sums: Vec<(f64, f64)> = Vec::new();
    let mut add = |text: &str, sign: f64| {
        for line in text.lines().filter(|l| l.starts_with(&prefix)) {
            let parsed = (|| {
                let le = line.split("le=\"").nth(1)?.split('"').next()?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse::<f64>().ok()?
                };
                Some((le, line.rsplit(' ').next()?.parse::<f64>().ok()?))
            })();
            let Some((le, count)) = parsed else { continue };
            match sums.iter_mut().find(|(l, _)| *l == le) {
                Some((_, c)) => *c += sign * count,
                None => sums.push((le, sign * count)),
            }
        }
    };
    after.iter().for_each(|t| add(t, 1.0));
    before.iter().for_each(|t| add(t, -1.0));
    sums.sort_by(|a, b| a.0.total_cmp(&b.0));
    sums
}

/// The `q` quantile of cumulative buckets, as the upper bound of the bucket that holds it.
fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map(|(le, _)| *le)
}

/// Percentiles (p50, p99, in ms) of `prefix_router_added_latency_seconds` between two scrapes
/// of routers' `/metrics`, at the resolution of its buckets (upper bounds).
fn added_latency(before: &[String], after: &[String]) -> Option<(f64, f64)> {
    let buckets = histogram_delta(before, after, "prefix_router_added_latency_seconds");
    let q = |p| bucket_quantile(&buckets, p).map(|s| s * 1e3);
    Some((q(0.5)?, q(0.99)?))
}

/// The `/metrics` text of each of `urls` (a router that does not answer is left out).
async fn scrape_all(client: &reqwest::Client, urls: &[String]) -> Vec<String> {
    let mut texts = Vec::new();
    for url in urls {
        let text = async {
            client
                .get(format!("{url}/metrics"))
                .send()
                .await?
                .text()
                .await
        };
        if let Ok(text) = text.await {
            texts.push(text);
        }
    }
    texts
}

fn quiet_workload() -> WorkloadArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct W {
        #[command(flatten)]
        w: WorkloadArgs,
    }
    W::parse_from(["w", "--no-stream"]).w
}

/// Runs the workload against one system and measures it.
async fn measure(
    args: &CompareArgs,
    fleet: &BenchFleet,
    client: &reqwest::Client,
    system: System,
    launched: &systems::Launched,
    out: &Path,
) -> anyhow::Result<Figures> {
    let target = || match &launched.oracle {
        Some(o) => Target::Oracle(o.clone()),
        None => Target::urls(launched.urls.clone()),
    };
    let cpu_before = systems::cpu_seconds(&launched.router_pids);
    let sims = !fleet.is_vllm();
    fleet.reset(client).await?;
    let before = fleet.counters(client).await?;
    let ours = !system.is_peer() && system != System::Oracle;
    let routers_before = if ours {
        scrape_all(client, &launched.urls).await
    } else {
        Vec::new()
    };
    let jobs = limited_jobs(&args.workload, &args.load)?;
    let total: usize = jobs.iter().map(Job::requests).sum();
    let driven: Driven = driver::drive(
        target(),
        jobs,
        &args.workload,
        arrivals(&args.workload, &args.load),
        args.load.duration.map(Duration::from_secs_f64),
        progress(total, system.name()),
    )
    .await;
    let counters = fleet.counters(client).await?.since(&before);
    report::write_requests(out, system.name(), &driven.samples)?;
    let mut figures = report::figures(&driven.samples, &counters, driven.wall.as_secs_f64());
    // The pools' figures of the systems that disaggregate (the others answer on every server).
    if args.pd_prefill > 0 && !matches!(system, System::CostAggregated | System::Oracle) {
        let answered = driven.samples.iter().filter(|s| s.ok).count();
        figures.pd = Some(report::PdFigures::from_counters(
            &counters,
            args.pd_prefill,
            answered,
        ));
    }
    if ours {
        let routers_after = scrape_all(client, &launched.urls).await;
        let errors = histogram_delta(
            &routers_before,
            &routers_after,
            "prefix_router_ttft_prediction_error",
        );
        figures.ttft_prediction_error_p50 = bucket_quantile(&errors, 0.5);
        if let Some(pd) = &mut figures.pd {
            let decisions = |filter| {
                counter_delta(
                    &routers_before,
                    &routers_after,
                    "prefix_router_routing_decisions_total",
                    filter,
                )
            };
            let all = decisions("");
            if all > 0.0 {
                pd.skipped_cached_share = Some(decisions("reason=\"pd_skip_cached\"") / all);
            }
        }
        let sent =
            |name| counter_delta(&routers_before, &routers_after, name, "direction=\"sent\"");
        let decisions = sent("prefix_router_replica_bus_decisions_total");
        if decisions > 0.0 {
            figures.bus_bytes_per_decision =
                Some(sent("prefix_router_replica_bus_bytes_total") / decisions);
        }
    }
    if let Some(path) = &args.workload.write_trace {
        workload::write_trace(path, &driven.sent)?;
    }
    let mut requests = driven.samples.len();
    // Router overhead and maximum throughput, against sims that do not wait.
    if sims {
        fleet.set_time_scale(client, 0.0).await?;
    }
    if sims && args.overhead_requests > 0 {
        let routers = if ours { &launched.urls[..] } else { &[] };
        let before = scrape_all(client, routers).await;
        let (direct, routed) = paired_latencies(
            Target::urls(fleet.urls.clone()),
            target(),
            args.overhead_requests,
            args.overhead_qps,
        )
        .await;
        requests += routed.len();
        let p = |v: &[f64], q| stats::percentile(v, q);
        figures.router_overhead_p50_ms = Some(p(&routed, 50.0) - p(&direct, 50.0));
        figures.router_overhead_p99_ms = Some(p(&routed, 99.0) - p(&direct, 99.0));
        let after = scrape_all(client, routers).await;
        if let Some((p50, p99)) = added_latency(&before, &after) {
            figures.router_added_p50_ms = Some(p50);
            figures.router_added_p99_ms = Some(p99);
        }
    }
    if sims && args.throughput_secs > 0.0 {
        // More than 64 clients can send in the time (about 20,000 requests/s at most here).
        let jobs: Vec<Job> = (0..(args.throughput_secs * 20_000.0) as u64)
            .map(|i| {
                Job::Single(workload::TraceItem {
                    t: None,
                    endpoint: workload::Api::Chat,
                    body: probe_body(i % 4096),
                    headers: Default::default(),
                })
            })
            .collect();
        let w = quiet_workload();
        let secs = args.throughput_secs;
        let driven = driver::drive(
            target(),
            jobs,
            &w,
            Arrivals::Closed(64),
            Some(Duration::from_secs_f64(secs)),
            ProgressBar::hidden(),
        )
        .await;
        let ok = driven.samples.iter().filter(|s| s.ok).count();
        requests += driven.samples.len();
        figures.max_rps = Some(ok as f64 / driven.wall.as_secs_f64());
    }
    if sims {
        fleet
            .set_time_scale(client, fleet_time_scale(args)?)
            .await?;
    }
    if !launched.router_pids.is_empty() {
        let cpu = systems::cpu_seconds(&launched.router_pids) - cpu_before;
        figures.cpu_ms_per_request = Some(cpu * 1e3 / requests.max(1) as f64);
    }
    Ok(figures)
}

fn fleet_time_scale(args: &CompareArgs) -> anyhow::Result<f64> {
    Ok(fleet::sim_config(&args.sim_args)?.time_scale)
}

/// What a comparison found: where it ran, each round's results, and the summary over rounds.
pub struct Comparison {
    pub meta: meta::RunMeta,
    pub rounds: Vec<Vec<SystemResult>>,
    pub summaries: Vec<rounds::SystemSummary>,
}

/// The servers a comparison runs on, as its arguments ask.
async fn start_fleet(args: &mut CompareArgs) -> anyhow::Result<BenchFleet> {
    Ok(if args.fleet == "vllm" {
        if args.workload.model == workload::DEFAULT_MODEL {
            args.workload.model = vllm_fleet::MODEL.to_owned();
        }
        match &args.vllm.vllm_fleet_file {
            Some(file) => BenchFleet::attach_vllm(&vllm_fleet::FleetFile::read(file)?),
            None => {
                eprintln!(
                    "starting {} vLLM server(s) (logs in {})",
                    args.vllm.vllm_servers,
                    args.out.join("vllm").display()
                );
                BenchFleet::start_vllm(args.vllm.config(&args.out.join("vllm"))).await?
            }
        }
    } else if args.sim_url.is_empty() {
        BenchFleet::start(args.sim_servers, fleet::sim_config(&args.sim_args)?).await?
    } else {
        BenchFleet::attach(args.sim_url.clone())
    })
}

/// Writes the comparison so far: `results.json` (where it ran, and per system the median
/// round's figures, the intervals, the ratios and every round), `results.md`, `chart.svg`.
fn write_comparison(out: &Path, c: &Comparison, title: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&json!({"meta": c.meta, "systems": c.summaries}))? + "\n",
    )?;
    let medians: Vec<SystemResult> = c
        .summaries
        .iter()
        .map(|s| SystemResult {
            name: s.name.clone(),
            workload: s.workload.clone(),
            skipped: s.skipped,
            reason: s.reason.clone(),
            figures: s.figures.clone(),
        })
        .collect();
    let mut md = rounds::markdown(&c.summaries, c.rounds.len());
    md.push_str("\nThe median round of each system:\n\n");
    md.push_str(&report::markdown(&medians));
    md.push_str(&report::classes_markdown(&medians));
    std::fs::write(out.join("results.md"), md)?;
    std::fs::write(out.join("chart.svg"), report::svg_chart(&medians, title))?;
    Ok(())
}

/// `prefix-router bench compare`.
pub async fn compare(mut args: CompareArgs, router_exe: PathBuf) -> anyhow::Result<Comparison> {
    let client = driver::client();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    // This comparison's per-request records replace the last one's.
    let _ = std::fs::remove_dir_all(args.out.join("requests"));
    let mut fleet = start_fleet(&mut args).await?;
    let systems: Vec<System> = if args.systems.is_empty() {
        // The aggregated control is `cost` itself unless the fleet is disaggregated.
        systems::ALL
            .into_iter()
            .filter(|&s| s != System::CostAggregated || args.pd_prefill > 0)
            .collect()
    } else {
        args.systems
            .iter()
            .map(|s| System::parse(s))
            .collect::<anyhow::Result<_>>()?
    };
    let rounds = args.rounds as usize;
    let fleet_name = format!(
        "{} {} servers",
        fleet.urls.len(),
        if fleet.is_vllm() { "vLLM" } else { "sim" }
    );
    let meta = meta::RunMeta::collect(
        &client,
        fleet_name.clone(),
        &fleet.urls,
        fleet.is_vllm(),
        &args.peers_venv,
        rounds,
    )
    .await;

    let mut ctx = LaunchContext {
        router_exe,
        sims: fleet.urls.clone(),
        kv_events: fleet.kv_events.clone(),
        kv_replay: fleet.kv_replay.clone(),
        oracle_from_events: fleet.is_vllm(),
        block_size: fleet.block_size,
        cache_tokens: fleet.cache_tokens,
        tokenizer: fleet.tokenizer.clone(),
        assumed_cache_factor: args.assumed_cache_factor,
        model: args.workload.model.clone(),
        postgres_url: args.postgres_url.clone(),
        replicas: args.router_replicas,
        replica_bus: args.replica_bus.clone(),
        peers_venv: args.peers_venv.clone(),
        work_dir: args.out.clone(),
        cache_threshold: args.cache_threshold,
        balance_abs: args.balance_abs,
        balance_rel: args.balance_rel,
        queue_args: args
            .queue_args
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        router_log: args.router_log.clone(),
        pd_prefill: args.pd_prefill,
        router_args: args
            .router_args
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
    };
    let workload = workload_name(&args.workload);
    let title = format!("{workload}: {fleet_name}");
    let mut comparison = Comparison {
        meta,
        rounds: Vec::new(),
        summaries: Vec::new(),
    };
    let mut fresh = true;
    for round in 0..rounds {
        let out = if rounds > 1 {
            args.out.join(format!("round-{}", round + 1))
        } else {
            args.out.clone()
        };
        comparison.rounds.push(Vec::new());
        for system in rounds::rotated(&systems, round) {
            // Every system meets servers as the first one did: our own sims started afresh
            // (nothing left in a cache, a queue or a connection pool), other servers emptied
            // and idle.
            if !fresh {
                if fleet.is_own_sims() {
                    fleet.shutdown().await;
                    fleet = start_fleet(&mut args).await?;
                    ctx.use_fleet(&fleet);
                } else {
                    fleet.wait_idle(&client, Duration::from_secs(60)).await;
                }
            }
            fresh = false;
            let mut result = SystemResult {
                name: system.name().into(),
                workload: workload.clone(),
                ..SystemResult::default()
            };
            match ctx.launch(&client, system).await {
                Err(systems::Skipped(reason)) => {
                    eprintln!("{:>22}: skipped ({reason})", system.name());
                    result.skipped = true;
                    result.reason = Some(reason);
                }
                Ok(launched) => {
                    let measured = measure(&args, &fleet, &client, system, &launched, &out).await;
                    launched.stop().await;
                    match measured {
                        Ok(f) => {
                            eprintln!(
                                "{:>22}: hit rate {:.3}, TTFT mean {:.1} ms, p99 {:.1} ms, errors {}{}",
                                system.name(),
                                f.hit_rate,
                                f.ttft_mean_ms,
                                f.ttft_p99_ms,
                                f.errors,
                                if rounds > 1 {
                                    format!(" (round {})", round + 1)
                                } else {
                                    String::new()
                                }
                            );
                            result.figures = Some(f);
                        }
                        Err(e) => {
                            result.skipped = true;
                            result.reason = Some(format!("the run failed: {e:#}"));
                        }
                    }
                }
            }
            comparison.rounds.last_mut().expect("a round").push(result);
            comparison.summaries = rounds::summarize(&comparison.rounds);
            write_comparison(&args.out, &comparison, &title)?;
        }
    }
    fleet.shutdown().await;
    println!(
        "{}",
        std::fs::read_to_string(args.out.join("results.md")).unwrap_or_default()
    );
    println!("results in {}", args.out.display());
    Ok(comparison)
}

/// `prefix-router bench run`.
pub async fn run_one(args: RunArgs) -> anyhow::Result<Figures> {
    let client = driver::client();
    let fleet = BenchFleet::attach(args.sim_url.clone());
    let before = fleet.counters(&client).await?;
    let jobs = limited_jobs(&args.workload, &args.load)?;
    let total = jobs.iter().map(Job::requests).sum();
    let driven = driver::drive(
        Target::urls(vec![args.url.trim_end_matches('/').to_owned()]),
        jobs,
        &args.workload,
        arrivals(&args.workload, &args.load),
        args.load.duration.map(Duration::from_secs_f64),
        progress(total, "run"),
    )
    .await;
    let counters = fleet.counters(&client).await?.since(&before);
    let figures = report::figures(&driven.samples, &counters, driven.wall.as_secs_f64());
    if let Some(path) = &args.workload.write_trace {
        workload::write_trace(path, &driven.sent)?;
    }
    let result = SystemResult {
        name: args.url.clone(),
        workload: workload_name(&args.workload),
        figures: Some(figures.clone()),
        ..SystemResult::default()
    };
    if let Some(out) = &args.out {
        let meta = meta::RunMeta::collect(
            &client,
            format!("{} behind {}", args.sim_url.len(), args.url),
            &args.sim_url,
            false,
            Path::new(""),
            1,
        )
        .await;
        let rounds = vec![vec![result.clone()]];
        let comparison = Comparison {
            meta,
            summaries: rounds::summarize(&rounds),
            rounds,
        };
        write_comparison(out, &comparison, &args.url)?;
    }
    println!("{}", report::markdown(&[result]));
    if let Some(e) = driven.samples.iter().find_map(|s| s.error.as_ref()) {
        eprintln!("first error: {e}");
    }
    Ok(figures)
}

/// Dispatches `prefix-router bench ...`.
pub async fn run(args: BenchArgs, router_exe: PathBuf) -> anyhow::Result<()> {
    match args.command {
        BenchCommand::Run(a) => run_one(*a).await.map(|_| ()),
        BenchCommand::Compare(a) => compare(*a, router_exe).await.map(|_| ()),
        BenchCommand::Suite(a) => suite::suite(*a, router_exe).await.map(|_| ()),
        BenchCommand::VllmFleet { fleet, work_dir } => {
            vllm_fleet::serve_fleet(fleet, work_dir).await
        }
    }
}

/// `prefix-router demo`: a small fleet, a short shared-prefix workload under round robin and
/// the default policy (cost), and the table.
pub async fn demo(router_exe: &Path, out: PathBuf) -> anyhow::Result<Comparison> {
    use clap::Parser;
    #[derive(Parser)]
    struct C {
        #[command(flatten)]
        c: CompareArgs,
    }
    let out = out.to_string_lossy().into_owned();
    let args = C::parse_from([
        "demo",
        "--sim-servers",
        "4",
        "--sim-args=--kv-blocks 1400",
        "--groups",
        "16",
        "--prompts-per-group",
        "10",
        "--system-len",
        "1024",
        "--question-len",
        "64",
        "--output-len",
        "32",
        "--qps",
        "40",
        "--systems",
        "round_robin,cost",
        "--overhead-requests",
        "300",
        "--throughput-secs",
        "0",
        "--out",
        &out,
    ])
    .c;
    println!(
        "prefix-router demo: 4 simulated vLLM servers (each caches ~1/3 of the 16 shared 1,024-token prompts), \
         160 chat requests at 40/s, first round robin, then cost (the default policy).\n"
    );
    compare(args, router_exe.to_path_buf()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Words {
        #[command(flatten)]
        compare: CompareArgs,
    }

    #[test]
    fn sim_args_take_flags_as_a_separate_word() {
        for argv in [
            ["bench", "--sim-args", "--kv-blocks 2000"],
            ["bench", "--sim-args=--kv-blocks 2000", "--seed=1"],
        ] {
            let args = Words::try_parse_from(argv).unwrap().compare;
            assert_eq!(fleet::sim_config(&args.sim_args).unwrap().kv_blocks, 2000);
        }
    }

    #[test]
    fn histogram_quantiles_count_the_run_over_every_replica() {
        let scrape = |a: u32, b: u32, inf: u32| {
            format!(
                "# TYPE h histogram\nh_sum 1\nh_count {inf}\n\
                 h_bucket{{backend=\"x\",le=\"0.1\"}} {a}\n\
                 h_bucket{{backend=\"x\",le=\"0.2\"}} {b}\n\
                 h_bucket{{backend=\"x\",le=\"+Inf\"}} {inf}\n"
            )
        };
        // Replica 1 had 5 requests before the run; during it each replica saw 4 under 0.1,
        // and replica 2 two more under 0.2 and two above.
        let before = [scrape(5, 5, 5), scrape(0, 0, 0)];
        let after = [scrape(9, 9, 9), scrape(4, 6, 8)];
        let buckets = histogram_delta(&before, &after, "h");
        assert_eq!(
            buckets,
            vec![(0.1, 8.0), (0.2, 10.0), (f64::INFINITY, 12.0)]
        );
        assert_eq!(bucket_quantile(&buckets, 0.5), Some(0.1));
        assert_eq!(bucket_quantile(&buckets, 0.8), Some(0.2));
        assert_eq!(bucket_quantile(&buckets, 0.99), Some(f64::INFINITY));
        assert_eq!(
            bucket_quantile(&histogram_delta(&after, &after, "h"), 0.5),
            None
        );
    }
}
