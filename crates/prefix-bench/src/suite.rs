//! `bench suite`: every workload of the suite compared over rounds, and one regret table — per
//! workload, the default policy against the best of our policies and the best peer.
//!
//! A policy can look best on the one workload it was tuned on; the suite asks whether the
//! default ever gives away what another of our policies (or a peer) would have won.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Parser;
use serde::Serialize;

use crate::rounds::{self, Interval, SystemSummary};
use crate::{compare, CompareArgs};

/// The policy every deployment gets unless it asks for another.
pub const DEFAULT_POLICY: &str = "cost";

/// The systems the suite compares unless told: our plain policies (`round_robin` aside, which
/// `least_loaded` beats everywhere) and the peers.
pub const SUITE_SYSTEMS: &str =
    "cost,prefix,prefix_load,least_loaded,vllm-router,sglang-router,smg";

/// The workloads of the suite and the `bench compare` flags each one runs with. Every one is
/// the generator's defaults but for the load level (the agent workload at low load, and eight
/// times as fast with five times the sessions, where balancing starts to pay) and the Mooncake
/// trace's scale (its 512-token blocks as 64 tokens, ten times faster, the
/// first 1,000 requests: the trace's sharing and arrival pattern at 8 sims' size).
pub const WORKLOADS: &[(&str, &[&str])] = &[
    ("agent", &["--workload", "agent"]),
    (
        "agent-high",
        &["--workload", "agent", "--speedup", "8", "--sessions", "160"],
    ),
    ("rag", &["--workload", "rag"]),
    ("multi-turn", &["--workload", "multi-turn"]),
    ("shared-prefix", &["--workload", "shared-prefix"]),
    ("bursty", &["--workload", "bursty"]),
    ("prefix-repetition", &["--workload", "prefix-repetition"]),
    ("random", &["--workload", "random"]),
    (
        "mooncake",
        &[
            "--workload",
            "mooncake",
            "--mooncake-block-tokens",
            "64",
            "--speedup",
            "10",
            "--requests",
            "1000",
        ],
    ),
];

#[derive(clap::Args, Debug)]
pub struct SuiteArgs {
    /// Workloads to run (default: all): agent, agent-high, rag, multi-turn, shared-prefix,
    /// bursty, prefix-repetition, random, mooncake.
    #[arg(long, value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// Rounds of every comparison (`bench compare --rounds`).
    #[arg(long, default_value_t = 3)]
    pub rounds: u64,
    /// Comma-separated systems.
    #[arg(long, default_value = SUITE_SYSTEMS)]
    pub systems: String,
    /// A Mooncake trace (the `conversation_trace.jsonl` of Mooncake's FAST'25 release); without
    /// it the mooncake workload is skipped.
    #[arg(long)]
    pub mooncake_trace: Option<PathBuf>,
    /// Each workload's comparison goes to DIR/WORKLOAD, the regret table to DIR/suite.md and
    /// DIR/suite.json.
    #[arg(long, default_value = "bench-results/suite")]
    pub out: PathBuf,
    /// More `bench compare` flags for every workload, after `--` (they override the suite's),
    /// e.g. `-- --sim-args "--kv-blocks 2000"`.
    #[arg(last = true, allow_hyphen_values = true)]
    pub compare_args: Vec<String>,
}

/// `bench compare`'s flags, later ones overriding earlier.
#[derive(Parser)]
#[command(args_override_self = true)]
struct CompareLine {
    #[command(flatten)]
    compare: CompareArgs,
}

/// One workload's row of the regret table.
#[derive(Clone, Debug, Serialize)]
pub struct Regret {
    pub workload: String,
    /// Why it did not run, if it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    /// The default policy's mean TTFT, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_ttft_mean_ms: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best_ours: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best_ours_ttft_mean_ms: Option<Interval>,
    /// The default's mean and p99 TTFT over the best of ours', round by round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_best_ours_mean: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_best_ours_p99: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best_peer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best_peer_ttft_mean_ms: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_best_peer_mean: Option<Interval>,
}

/// The regret row of one workload's summaries.
pub fn regret(workload: &str, summaries: &[SystemSummary]) -> Regret {
    let find = |name: &str| summaries.iter().find(|s| s.name == name && !s.skipped);
    let mut row = Regret {
        workload: workload.to_owned(),
        skipped: None,
        default_ttft_mean_ms: None,
        best_ours: None,
        best_ours_ttft_mean_ms: None,
        vs_best_ours_mean: None,
        vs_best_ours_p99: None,
        best_peer: None,
        best_peer_ttft_mean_ms: None,
        vs_best_peer_mean: None,
    };
    let Some(default) = find(DEFAULT_POLICY) else {
        row.skipped = Some(format!("{DEFAULT_POLICY} did not run"));
        return row;
    };
    row.default_ttft_mean_ms = default.ttft_mean_ms_interval;
    if let Some(r) = &default.vs_best_ours {
        row.best_ours_ttft_mean_ms = find(&r.against).and_then(|s| s.ttft_mean_ms_interval);
        row.best_ours = Some(r.against.clone());
        row.vs_best_ours_mean = Some(r.ttft_mean);
        row.vs_best_ours_p99 = Some(r.ttft_p99);
    }
    if let Some(r) = &default.vs_best_peer {
        row.best_peer_ttft_mean_ms = find(&r.against).and_then(|s| s.ttft_mean_ms_interval);
        row.best_peer = Some(r.against.clone());
        row.vs_best_peer_mean = Some(r.ttft_mean);
    }
    row
}

fn ms(i: &Option<Interval>) -> String {
    i.map_or("–".into(), |i| format!("{:.1}", i.median))
}

fn ratio(i: &Option<Interval>) -> String {
    i.as_ref().map_or("–".into(), rounds::Ratio::describe)
}

/// The regret table in markdown.
pub fn markdown(rows: &[Regret], rounds: u64) -> String {
    let mut out = format!(
        "Mean TTFT in ms, medians over {rounds} round(s); ratios of `{DEFAULT_POLICY}` to the \
         others round by round, with 95 % intervals.\n\n\
         | workload | `{DEFAULT_POLICY}` | best of ours | ÷ best of ours (mean) | ÷ best of ours (p99) | best peer | ÷ best peer (mean) |\n\
         |---|---|---|---|---|---|---|\n"
    );
    for r in rows {
        if let Some(why) = &r.skipped {
            let _ = writeln!(out, "| {} | skipped: {why} | | | | | |", r.workload);
            continue;
        }
        let named = |name: &Option<String>, i: &Option<Interval>| {
            name.as_ref()
                .map_or("–".into(), |n| format!("{n} {}", ms(i)))
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.workload,
            ms(&r.default_ttft_mean_ms),
            named(&r.best_ours, &r.best_ours_ttft_mean_ms),
            ratio(&r.vs_best_ours_mean),
            ratio(&r.vs_best_ours_p99),
            named(&r.best_peer, &r.best_peer_ttft_mean_ms),
            ratio(&r.vs_best_peer_mean),
        );
    }
    out
}

/// The `bench compare` flags of one workload of the suite.
fn compare_line(args: &SuiteArgs, name: &str, flags: &[&str]) -> Vec<String> {
    let mut line: Vec<String> = vec!["compare".into()];
    line.extend(flags.iter().map(|s| s.to_string()));
    if name == "mooncake" {
        if let Some(trace) = &args.mooncake_trace {
            line.extend(["--trace".into(), trace.display().to_string()]);
        }
    }
    line.extend([
        "--rounds".into(),
        args.rounds.to_string(),
        "--systems".into(),
        args.systems.clone(),
        "--out".into(),
        args.out.join(name).display().to_string(),
        // The suite compares routing: the overhead and maximum-throughput phases are the
        // same on every workload.
        "--overhead-requests".into(),
        "0".into(),
        "--throughput-secs".into(),
        "0".into(),
    ]);
    line.extend(args.compare_args.iter().cloned());
    line
}

/// `prefix-router bench suite`.
pub async fn suite(args: SuiteArgs, router_exe: PathBuf) -> anyhow::Result<Vec<Regret>> {
    let names: Vec<&str> = WORKLOADS.iter().map(|(n, _)| *n).collect();
    for w in &args.workloads {
        anyhow::ensure!(
            names.contains(&w.as_str()),
            "unknown workload {w:?}; the suite's are {}",
            names.join(", ")
        );
    }
    std::fs::create_dir_all(&args.out)?;
    let mut rows = Vec::new();
    for (name, flags) in WORKLOADS {
        if !args.workloads.is_empty() && !args.workloads.iter().any(|w| w == name) {
            continue;
        }
        eprintln!("== {name}");
        if *name == "mooncake" && args.mooncake_trace.is_none() {
            rows.push(Regret {
                skipped: Some("no --mooncake-trace".into()),
                ..regret(name, &[])
            });
            continue;
        }
        let line = compare_line(&args, name, flags);
        let compare_args = CompareLine::try_parse_from(&line)
            .map_err(|e| anyhow::anyhow!("{name}: {e}"))?
            .compare;
        let row = match compare(compare_args, router_exe.clone()).await {
            Ok(c) => regret(name, &c.summaries),
            Err(e) => Regret {
                skipped: Some(format!("the comparison failed: {e:#}")),
                ..regret(name, &[])
            },
        };
        rows.push(row);
        let md = markdown(&rows, args.rounds);
        std::fs::write(args.out.join("suite.md"), &md)?;
        std::fs::write(
            args.out.join("suite.json"),
            serde_json::to_string_pretty(&rows)? + "\n",
        )?;
    }
    println!("{}", markdown(&rows, args.rounds));
    println!("results in {}", args.out.display());
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Figures;

    fn summary(name: &str, rounds_ms: &[(f64, f64)]) -> Vec<crate::report::SystemResult> {
        rounds_ms
            .iter()
            .map(|&(mean, p99)| crate::report::SystemResult {
                name: name.into(),
                workload: "w".into(),
                figures: Some(Figures {
                    ttft_mean_ms: mean,
                    ttft_p99_ms: p99,
                    ..Figures::default()
                }),
                ..Default::default()
            })
            .collect()
    }

    /// Rounds of several systems: system i's round r is `results[i][r]`.
    fn rounds_of(
        results: Vec<Vec<crate::report::SystemResult>>,
    ) -> Vec<Vec<crate::report::SystemResult>> {
        let n = results[0].len();
        (0..n)
            .map(|r| results.iter().map(|s| s[r].clone()).collect())
            .collect()
    }

    #[test]
    fn regret_compares_the_default_with_the_best_of_ours_and_of_the_peers() {
        let rounds = rounds_of(vec![
            summary("cost", &[(44.0, 100.0), (46.0, 110.0), (45.0, 105.0)]),
            summary("prefix", &[(40.0, 120.0), (41.0, 118.0), (42.0, 119.0)]),
            summary(
                "round_robin",
                &[(90.0, 300.0), (95.0, 310.0), (92.0, 305.0)],
            ),
            summary("smg", &[(50.0, 200.0), (52.0, 190.0), (51.0, 195.0)]),
            summary(
                "vllm-router",
                &[(60.0, 200.0), (62.0, 190.0), (61.0, 195.0)],
            ),
        ]);
        let r = regret("agent", &rounds::summarize(&rounds));
        assert_eq!(r.best_ours.as_deref(), Some("prefix"));
        assert_eq!(r.best_peer.as_deref(), Some("smg"));
        let mean = r.vs_best_ours_mean.unwrap();
        // 44/40, 46/41, 45/42: all above 1.
        assert!(mean.low > 1.05 && mean.high < 1.13, "{mean:?}");
        assert!(r.vs_best_ours_p99.unwrap().high < 1.0);
        assert!(r.vs_best_peer_mean.unwrap().median < 0.9);
        let md = markdown(&[r], 3);
        assert!(md.contains("| agent | 45.0 | prefix 41.0 |"), "{md}");
    }

    #[test]
    fn a_default_that_is_the_best_has_no_regret() {
        let rounds = rounds_of(vec![
            summary("cost", &[(30.0, 100.0), (31.0, 100.0)]),
            summary("prefix", &[(40.0, 100.0), (41.0, 100.0)]),
        ]);
        let r = regret("rag", &rounds::summarize(&rounds));
        assert_eq!(r.best_ours.as_deref(), Some("cost"));
        assert_eq!(r.vs_best_ours_mean.unwrap().median, 1.0);
        assert!(r.best_peer.is_none());
    }

    #[test]
    fn every_workload_parses_as_a_comparison() {
        let args = SuiteArgs::try_parse_from_test(&[
            "--",
            "--sim-args",
            "--kv-blocks 2000",
            "--rounds",
            "2",
        ]);
        for (name, flags) in WORKLOADS {
            let line = compare_line(&args, name, flags);
            let c = CompareLine::try_parse_from(&line).unwrap().compare;
            // The flags after `--` override the suite's.
            assert_eq!(c.rounds, 2, "{name}");
            assert_eq!(c.sim_args, "--kv-blocks 2000");
            assert_eq!(c.out, args.out.join(name));
        }
    }

    impl SuiteArgs {
        fn try_parse_from_test(argv: &[&str]) -> SuiteArgs {
            #[derive(Parser)]
            struct S {
                #[command(flatten)]
                s: SuiteArgs,
            }
            let mut full = vec!["suite"];
            full.extend_from_slice(argv);
            S::try_parse_from(full).unwrap().s
        }
    }
}
