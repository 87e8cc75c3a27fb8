//! Results: one object per system (`results.json`), a markdown table and an SVG chart.

use std::fmt::Write;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use crate::driver::Sample;
use crate::fleet::Counters;
use crate::stats::{mean, percentile};

/// One system's figures (schema in the README). Times are real milliseconds.
#[derive(Clone, Debug, Serialize, Default)]
pub struct SystemResult {
    pub name: String,
    pub workload: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub figures: Option<Figures>,
}

#[derive(Clone, Debug, Serialize, Default)]
pub struct Figures {
    pub requests: usize,
    /// Σ prefix-cache hits ÷ Σ queries (tokens) from the sims' `/metrics`.
    pub hit_rate: f64,
    /// The same from the answers' `usage.prompt_tokens_details.cached_tokens` (cross-check).
    pub hit_rate_usage: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    pub e2e_p50_ms: f64,
    /// Streams: gaps between successive chunks of an answer (inter-token latency), over every
    /// gap of every request; and the mean time per output token after the first.
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    pub tpot_mean_ms: f64,
    pub throughput_rps: f64,
    pub output_tps: f64,
    /// Max ÷ mean requests per backend.
    pub imbalance: f64,
    pub errors: usize,
    /// Latency through the system minus straight to a sim (sims not waiting), at the same
    /// percentile.
    pub router_overhead_p50_ms: Option<f64>,
    pub router_overhead_p99_ms: Option<f64>,
    /// Our routers only: their own histogram of the time from receiving a request to sending
    /// it upstream, during the overhead phase (bucket upper bounds).
    pub router_added_p50_ms: Option<f64>,
    pub router_added_p99_ms: Option<f64>,
    /// Our routers only: the median of |observed − predicted| ÷ observed TTFT of the run's
    /// streamed requests, from the routers' `prefix_router_ttft_prediction_error` (bucket upper
    /// bound, so within 0.05 above the true median).
    pub ttft_prediction_error_p50: Option<f64>,
    /// Closed-loop requests/s through the system against sims that do not wait.
    pub max_rps: Option<f64>,
    /// CPU time of the router process(es) per request over the whole run.
    pub cpu_ms_per_request: Option<f64>,
    /// Replicas on a bus: bytes published on the bus per routing decision (decisions, load
    /// tables and heartbeats, compressed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bus_bytes_per_decision: Option<f64>,
    /// Disaggregated fleets (`--pd-prefill`): what the prefill and decode pools did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdFigures>,
    /// By priority and by tenant, where requests carried them (the overload workload).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<ClassFigures>,
}

/// A disaggregated fleet's pools over a run, from the servers' own counters.
#[derive(Clone, Debug, Serialize, Default)]
pub struct PdFigures {
    /// Requests the prefill servers answered (prefill calls) ÷ requests answered: transfers
    /// per request.
    pub prefills_per_request: f64,
    /// Prompt tokens the decode servers pulled from the prefill servers ÷ the tokens they were
    /// asked.
    pub pulled_share: f64,
    /// Prefix-cache hit rates (tokens) of each pool.
    pub prefill_hit_rate: f64,
    pub decode_hit_rate: f64,
    /// Our routers: requests whose decode server lacked at most `--pd-threshold` tokens, and
    /// so were not disaggregated, ÷ requests routed (from their decisions counter).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_cached_share: Option<f64>,
}

impl PdFigures {
    /// From the counters of a fleet whose first `prefill_servers` servers prefill.
    pub fn from_counters(counters: &Counters, prefill_servers: usize, answered: usize) -> Self {
        let split = |v: &[f64]| -> (f64, f64) {
            let p = prefill_servers.min(v.len());
            (v[..p].iter().sum(), v[p..].iter().sum())
        };
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let (prefill_calls, _) = split(&counters.finished);
        let (prefill_hits, decode_hits) = split(&counters.server_hits);
        let (prefill_queries, decode_queries) = split(&counters.server_queries);
        let (_, pulled) = split(&counters.pulled);
        PdFigures {
            prefills_per_request: ratio(prefill_calls, answered as f64),
            pulled_share: ratio(pulled, decode_queries),
            prefill_hit_rate: ratio(prefill_hits, prefill_queries),
            decode_hit_rate: ratio(decode_hits, decode_queries),
            skipped_cached_share: None,
        }
    }
}

/// The figures of one class of requests: one priority, or one tenant within a priority.
#[derive(Clone, Debug, Serialize, Default)]
pub struct ClassFigures {
    /// `priority=1`, or `priority=0 tenant=tenant-3`.
    pub class: String,
    pub requests: usize,
    pub errors: usize,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Requests that ended while requests were still being sent, per second of that time:
    /// the class's share of the fleet while everyone competed for it.
    pub contended_rps: f64,
    /// The same over the second half of that time only: a queue that builds under overload
    /// shares the fleet by its rules once it is full, while in the first seconds requests
    /// pass in proportion to what each sends.
    pub steady_rps: f64,
}

/// The classes a sample belongs to: its priority, and its tenant within that priority.
fn class_names(s: &Sample) -> impl Iterator<Item = String> {
    let priority = s.priority.as_deref().unwrap_or("0");
    let p = s.priority.as_ref().map(|p| format!("priority={p}"));
    let t = s
        .tenant
        .as_ref()
        .map(|t| format!("priority={priority} tenant={t}"));
    p.into_iter().chain(t)
}

/// Figures by priority, and by tenant within each priority (fair sharing is within one).
fn classes(samples: &[Sample]) -> Vec<ClassFigures> {
    let window = samples.iter().map(|s| s.sent_at).fold(0.0, f64::max);
    let mut keys: Vec<String> = samples.iter().flat_map(class_names).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .map(|class| {
            let of: Vec<&Sample> = samples
                .iter()
                .filter(|s| class_names(s).any(|c| c == class))
                .collect();
            let ttft: Vec<f64> = of.iter().filter(|s| s.ok).map(|s| s.ttft * 1e3).collect();
            let ended_within = |from: f64| {
                of.iter()
                    .filter(|s| s.ok && (from..=window).contains(&(s.sent_at + s.e2e)))
                    .count()
            };
            let contended = ended_within(0.0);
            let steady = ended_within(window / 2.0);
            ClassFigures {
                requests: of.len(),
                errors: of.iter().filter(|s| !s.ok).count(),
                ttft_mean_ms: mean(&ttft),
                ttft_p50_ms: percentile(&ttft, 50.0),
                ttft_p99_ms: percentile(&ttft, 99.0),
                contended_rps: contended as f64 / window.max(1e-9),
                steady_rps: steady as f64 / (window / 2.0).max(1e-9),
                class,
            }
        })
        .collect()
}

/// The per-class table of a comparison (empty when no request had a class).
pub fn classes_markdown(results: &[SystemResult]) -> String {
    let mut out = String::new();
    for r in results {
        let Some(f) = r.figures.as_ref().filter(|f| !f.classes.is_empty()) else {
            continue;
        };
        if out.is_empty() {
            out.push_str("\n| system | class | requests | errors | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | contended req/s | 2nd half req/s |\n|---|---|---|---|---|---|---|---|---|\n");
        }
        for c in &f.classes {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
                r.name,
                c.class,
                c.requests,
                c.errors,
                c.ttft_mean_ms,
                c.ttft_p50_ms,
                c.ttft_p99_ms,
                c.contended_rps,
                c.steady_rps
            );
        }
    }
    out
}

/// Summarises a run's samples and the sims' counters over it.
pub fn figures(samples: &[Sample], counters: &Counters, wall_secs: f64) -> Figures {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let ttft: Vec<f64> = ok.iter().map(|s| s.ttft * 1e3).collect();
    let e2e: Vec<f64> = ok.iter().map(|s| s.e2e * 1e3).collect();
    let itl: Vec<f64> = ok
        .iter()
        .flat_map(|s| s.itl.iter().map(|g| g * 1e3))
        .collect();
    let tpot: Vec<f64> = ok
        .iter()
        .filter(|s| s.completion_tokens > 1 && !s.itl.is_empty())
        .map(|s| (s.e2e - s.ttft) * 1e3 / (s.completion_tokens - 1) as f64)
        .collect();
    let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|s| s.cached_tokens).sum();
    let output: u64 = ok.iter().map(|s| s.completion_tokens).sum();
    let per_backend = &counters.finished;
    let mean_load = mean(per_backend);
    let max_load = per_backend.iter().cloned().fold(0.0, f64::max);
    Figures {
        requests: samples.len(),
        hit_rate: if counters.queries > 0.0 {
            counters.hits / counters.queries
        } else {
            0.0
        },
        hit_rate_usage: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        ttft_mean_ms: mean(&ttft),
        e2e_p50_ms: percentile(&e2e, 50.0),
        itl_p50_ms: percentile(&itl, 50.0),
        itl_p99_ms: percentile(&itl, 99.0),
        tpot_mean_ms: mean(&tpot),
        throughput_rps: ok.len() as f64 / wall_secs.max(1e-9),
        output_tps: output as f64 / wall_secs.max(1e-9),
        imbalance: if mean_load > 0.0 {
            max_load / mean_load
        } else {
            0.0
        },
        errors: samples.len() - ok.len(),
        classes: classes(samples),
        ..Figures::default()
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.3}"))
}

/// The markdown table of a comparison.
pub fn markdown(results: &[SystemResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| system | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TTFT mean ms | e2e p50 ms | ITL p50/p99 ms | req/s | out tok/s | imbalance | errors | overhead p50 ms | overhead p99 ms | added p50/p99 ms | max req/s | CPU ms/req | TTFT prediction error p50 |"
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in results {
        match &r.figures {
            None => {
                let _ = writeln!(
                    out,
                    "| {} | skipped: {} ||||||||||||||||",
                    r.name,
                    r.reason.as_deref().unwrap_or("")
                );
            }
            Some(f) => {
                let _ = writeln!(
                    out,
                    "| {} | {:.3} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1}/{:.1} | {:.1} | {:.0} | {:.2} | {} | {} | {} | {} | {} | {} | {} |",
                    r.name,
                    f.hit_rate,
                    f.ttft_p50_ms,
                    f.ttft_p90_ms,
                    f.ttft_p99_ms,
                    f.ttft_mean_ms,
                    f.e2e_p50_ms,
                    f.itl_p50_ms,
                    f.itl_p99_ms,
                    f.throughput_rps,
                    f.output_tps,
                    f.imbalance,
                    f.errors,
                    ms(f.router_overhead_p50_ms),
                    ms(f.router_overhead_p99_ms),
                    match (f.router_added_p50_ms, f.router_added_p99_ms) {
                        (Some(a), Some(b)) => format!("{a:.3}/{b:.3}"),
                        _ => "–".into(),
                    },
                    f.max_rps.map_or("–".into(), |v| format!("{v:.0}")),
                    f.cpu_ms_per_request.map_or("–".into(), |v| format!("{v:.3}")),
                    f.ttft_prediction_error_p50
                        .map_or("–".into(), |v| format!("≤ {:.0} %", v * 100.0)),
                );
            }
        }
    }
    for r in results {
        if let Some(pd) = r.figures.as_ref().and_then(|f| f.pd.as_ref()) {
            let _ = writeln!(
                out,
                "\n{}: {:.2} prefill calls per request, {:.0} % of the decode servers' prompt tokens pulled, hit rate {:.3} on the prefill servers and {:.3} on the decode servers{}.",
                r.name,
                pd.prefills_per_request,
                pd.pulled_share * 100.0,
                pd.prefill_hit_rate,
                pd.decode_hit_rate,
                pd.skipped_cached_share.map_or(String::new(), |s| format!(
                    "; {:.0} % of requests decoded where their prompt was held (no prefill call)",
                    s * 100.0
                )),
            );
        }
    }
    for r in results {
        if let Some(bytes) = r.figures.as_ref().and_then(|f| f.bus_bytes_per_decision) {
            let _ = writeln!(
                out,
                "\n{}: {bytes:.0} bytes on the replica bus per routing decision.",
                r.name
            );
        }
    }
    out
}

/// A two-panel SVG bar chart: mean TTFT and hit rate per system.
pub fn svg_chart(results: &[SystemResult], title: &str) -> String {
    let ran: Vec<(&str, &Figures)> = results
        .iter()
        .filter_map(|r| r.figures.as_ref().map(|f| (r.name.as_str(), f)))
        .collect();
    let (w, bar_h, gap, left, panel_w) = (900.0, 22.0, 8.0, 190.0, 300.0);
    let h = 70.0 + ran.len() as f64 * (bar_h + gap) + 40.0;
    let max_ttft = ran.iter().map(|(_, f)| f.ttft_mean_ms).fold(1e-9, f64::max);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" font-size="16" font-weight="bold">{}</text>"#,
        20,
        escape(title)
    );
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="52">mean TTFT (ms, lower is better)</text>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="52">prefix-cache hit rate (higher is better)</text>"#,
        left + panel_w + 80.0
    );
    for (i, (name, f)) in ran.iter().enumerate() {
        let y = 66.0 + i as f64 * (bar_h + gap);
        let ours = !matches!(*name, "sglang-router" | "smg" | "vllm-router" | "oracle");
        let color = if ours {
            "#2f6fba"
        } else if *name == "oracle" {
            "#888888"
        } else {
            "#d9822b"
        };
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            left - 8.0,
            y + 16.0,
            escape(name)
        );
        let tw = panel_w * f.ttft_mean_ms / max_ttft;
        let _ = writeln!(
            s,
            r#"<rect x="{left}" y="{y}" width="{tw:.1}" height="{bar_h}" fill="{color}"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}">{:.0}</text>"#,
            left + tw + 4.0,
            y + 16.0,
            f.ttft_mean_ms
        );
        let hx = left + panel_w + 80.0;
        let hw = panel_w * f.hit_rate.clamp(0.0, 1.0);
        let _ = writeln!(
            s,
            r#"<rect x="{hx}" y="{y}" width="{hw:.1}" height="{bar_h}" fill="{color}"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}">{:.3}</text>"#,
            hx + hw + 4.0,
            y + 16.0,
            f.hit_rate
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="20" y="{}" fill="#555">blue: prefix-router; orange: peer routers; grey: oracle (upper bound)</text>"##,
        h - 14.0
    );
    s.push_str("</svg>\n");
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Writes `results.json`, `results.md` and `chart.svg` into `dir`.
/// Every request of one system's run, one JSON line each in send order
/// (`requests/SYSTEM.jsonl`, `SYSTEM.2.jsonl` for its second run in the same comparison): to
/// find what the slowest requests were.
pub fn write_requests(dir: &Path, system: &str, samples: &[Sample]) -> anyhow::Result<()> {
    let dir = dir.join("requests");
    std::fs::create_dir_all(&dir)?;
    let name = system.replace(['/', ' '], "_");
    let path = (1..)
        .map(|n| match n {
            1 => dir.join(format!("{name}.jsonl")),
            n => dir.join(format!("{name}.{n}.jsonl")),
        })
        .find(|p| !p.exists())
        .expect("a free name");
    let mut sorted: Vec<&Sample> = samples.iter().collect();
    sorted.sort_by(|a, b| a.sent_at.total_cmp(&b.sent_at));
    let mut text = String::new();
    for sample in sorted {
        text.push_str(&serde_json::to_string(sample)?);
        text.push('\n');
    }
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_from_samples() {
        let samples: Vec<Sample> = (1..=10)
            .map(|i| Sample {
                ok: i != 10,
                ttft: i as f64 / 1000.0,
                e2e: 2.0 * i as f64 / 1000.0,
                prompt_tokens: 100,
                cached_tokens: 50,
                completion_tokens: 10,
                ..Sample::default()
            })
            .collect();
        let counters = Counters {
            hits: 30.0,
            queries: 40.0,
            finished: vec![6.0, 3.0],
            ..Counters::default()
        };
        let f = figures(&samples, &counters, 2.0);
        assert_eq!(f.errors, 1);
        assert_eq!(f.hit_rate, 0.75);
        assert_eq!(f.hit_rate_usage, 0.5);
        assert_eq!(f.ttft_p50_ms, 5.0);
        assert_eq!(f.imbalance, 6.0 / 4.5);
        assert_eq!(f.throughput_rps, 4.5);
        assert_eq!(f.output_tps, 45.0);
    }

    #[test]
    fn inter_token_latency_is_every_gap_of_every_stream() {
        let sample = |itl: Vec<f64>| Sample {
            ok: true,
            ttft: 0.01,
            e2e: 0.01 + itl.iter().sum::<f64>(),
            completion_tokens: itl.len() as u64 + 1,
            itl,
            ..Sample::default()
        };
        // 98 gaps of 1 ms and two of 101 ms.
        let mut gaps = vec![0.001; 48];
        gaps.extend([0.101, 0.101]);
        let samples = vec![sample(gaps), sample(vec![0.001; 50])];
        let f = figures(&samples, &Counters::default(), 1.0);
        assert!((f.itl_p50_ms - 1.0).abs() < 1e-9);
        assert!(
            f.itl_p99_ms > 50.0 && f.itl_p99_ms <= 101.0,
            "{}",
            f.itl_p99_ms
        );
        // Per request: (48 + 202) / 50 = 5 ms and 1 ms.
        assert!((f.tpot_mean_ms - 3.0).abs() < 1e-9, "{}", f.tpot_mean_ms);
    }

    #[test]
    fn pools_of_a_disaggregated_fleet_are_read_apart() {
        // Servers 0 and 1 prefill, 2 and 3 decode.
        let counters = Counters {
            finished: vec![3.0, 2.0, 4.0, 6.0],
            server_hits: vec![10.0, 10.0, 30.0, 0.0],
            server_queries: vec![100.0, 100.0, 100.0, 100.0],
            pulled: vec![0.0, 0.0, 50.0, 50.0],
            ..Counters::default()
        };
        let pd = PdFigures::from_counters(&counters, 2, 10);
        assert_eq!(pd.prefills_per_request, 0.5);
        assert_eq!(pd.pulled_share, 0.5);
        assert_eq!(pd.prefill_hit_rate, 0.1);
        assert_eq!(pd.decode_hit_rate, 0.15);
    }

    #[test]
    fn classes_split_by_priority_and_tenant() {
        let sample = |priority: &str, tenant: &str, sent_at: f64, ttft: f64| Sample {
            ok: true,
            sent_at,
            ttft,
            e2e: ttft,
            priority: Some(priority.into()),
            tenant: Some(tenant.into()),
            ..Sample::default()
        };
        let samples = [
            sample("1", "a", 0.0, 0.1),
            sample("0", "a", 1.0, 0.5),
            sample("0", "b", 2.0, 0.3),
            // Ends after the last send: not counted as contended throughput.
            sample("0", "b", 4.0, 9.0),
        ];
        let c = classes(&samples);
        let names: Vec<&str> = c.iter().map(|c| c.class.as_str()).collect();
        assert_eq!(
            names,
            [
                "priority=0",
                "priority=0 tenant=a",
                "priority=0 tenant=b",
                "priority=1",
                "priority=1 tenant=a"
            ]
        );
        assert_eq!(c[0].requests, 3);
        assert_eq!(c[3].ttft_mean_ms, 100.0);
        assert_eq!(c[2].contended_rps, 1.0 / 4.0);
        // Of b's, the one that ended at 2.3 s is in the second half of the 4 s.
        assert_eq!(c[2].steady_rps, 1.0 / 2.0);
        assert_eq!(c[1].steady_rps, 0.0, "a's ended at 1.5 s");
        assert!(classes_markdown(&[SystemResult {
            name: "x".into(),
            figures: Some(Figures {
                classes: c,
                ..Figures::default()
            }),
            ..SystemResult::default()
        }])
        .contains("| x | priority=0 tenant=b | 2 |"));
    }

    #[test]
    fn skipped_systems_say_why() {
        let r = SystemResult {
            name: "smg".into(),
            workload: "random".into(),
            skipped: true,
            reason: Some("not installed".into()),
            figures: None,
        };
        let v = serde_json::to_value([&r]).unwrap();
        assert_eq!(v[0]["skipped"], true);
        assert_eq!(v[0]["reason"], "not installed");
        assert!(markdown(std::slice::from_ref(&r)).contains("skipped: not installed"));
        assert!(svg_chart(&[r], "t").starts_with("<svg"));
    }
}
