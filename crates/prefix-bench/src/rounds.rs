//! Repeated rounds: every system runs N times (the order rotated each round), and each figure
//! is reported as the median over the rounds with a 95 % interval (a bootstrap of the median),
//! and each system's ratio to the best peer, the oracle and the best of our own systems as the
//! median of the per-round ratios (paired: both ran in the same round), with its interval. A
//! ratio whose interval spans 1.0 is no difference.

use std::fmt::Write;

use serde::Serialize;

use crate::report::{Figures, SystemResult};
use crate::workload::splitmix;

/// A median over rounds and its 95 % interval.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Interval {
    pub median: f64,
    pub low: f64,
    pub high: f64,
}

impl Interval {
    /// Whether the interval spans `x`.
    pub fn spans(&self, x: f64) -> bool {
        self.low <= x && x <= self.high
    }
}

fn median_of(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Resamples of the bootstrap.
const RESAMPLES: usize = 4000;

/// The median of `values` and a 95 % percentile-bootstrap interval of it (deterministic: the
/// resampling is seeded by the values). One value: an interval of zero width.
pub fn interval(values: &[f64]) -> Option<Interval> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let median = median_of(&v);
    if v.len() == 1 {
        return Some(Interval {
            median,
            low: median,
            high: median,
        });
    }
    let mut state = v.iter().fold(0x5EED, |s, x| splitmix(s ^ x.to_bits()));
    let mut medians = Vec::with_capacity(RESAMPLES);
    let mut sample = vec![0.0; v.len()];
    for _ in 0..RESAMPLES {
        for slot in sample.iter_mut() {
            state = splitmix(state);
            *slot = v[(state % v.len() as u64) as usize];
        }
        sample.sort_by(f64::total_cmp);
        medians.push(median_of(&sample));
    }
    medians.sort_by(f64::total_cmp);
    let at = |q: f64| medians[((RESAMPLES - 1) as f64 * q).round() as usize];
    Some(Interval {
        median,
        low: at(0.025),
        high: at(0.975),
    })
}

/// A system's ratio to another one, round by round.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    /// The system compared with.
    pub against: String,
    /// Mean TTFT ÷ the other's mean TTFT.
    pub ttft_mean: Interval,
    /// p99 TTFT ÷ the other's p99 TTFT.
    pub ttft_p99: Interval,
}

impl Ratio {
    /// `0.72× (0.68–0.76)`, or `no difference (0.95–1.04)`.
    pub fn describe(i: &Interval) -> String {
        if i.spans(1.0) && i.low < i.high {
            format!("no difference ({:.2}–{:.2})", i.low, i.high)
        } else if i.low < i.high {
            format!("{:.2}× ({:.2}–{:.2})", i.median, i.low, i.high)
        } else {
            format!("{:.2}×", i.median)
        }
    }
}

/// One system over every round.
#[derive(Clone, Debug, Serialize)]
pub struct SystemSummary {
    pub name: String,
    pub workload: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The figures of its median round (by mean TTFT).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub figures: Option<Figures>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_mean_ms_interval: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_p99_ms_interval: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itl_p99_ms_interval: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hit_rate_interval: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throughput_rps_interval: Option<Interval>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_best_peer: Option<Ratio>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_oracle: Option<Ratio>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_best_ours: Option<Ratio>,
    /// Every round's figures, in round order.
    pub rounds: Vec<Option<Figures>>,
}

/// Whether a system is a peer router (not ours, not the oracle).
pub fn is_peer(name: &str) -> bool {
    matches!(name, "sglang-router" | "smg" | "vllm-router")
}

/// Whether a system is one of ours (a policy of this router, in any set-up).
pub fn is_ours(name: &str) -> bool {
    !is_peer(name) && name != "oracle"
}

/// Summarizes `rounds` (each round's results, in any system order).
pub fn summarize(rounds: &[Vec<SystemResult>]) -> Vec<SystemSummary> {
    let mut names: Vec<String> = Vec::new();
    for r in rounds.iter().flatten() {
        if !names.contains(&r.name) {
            names.push(r.name.clone());
        }
    }
    let figures_of = |name: &str| -> Vec<Option<Figures>> {
        rounds
            .iter()
            .map(|round| {
                round
                    .iter()
                    .find(|r| r.name == name)
                    .and_then(|r| r.figures.clone())
            })
            .collect()
    };
    let metric = |figs: &[Option<Figures>], f: fn(&Figures) -> f64| -> Vec<f64> {
        figs.iter().flatten().map(f).collect()
    };
    let median_ttft =
        |name: &str| interval(&metric(&figures_of(name), |f| f.ttft_mean_ms)).map(|i| i.median);
    let best = |pick: fn(&str) -> bool| -> Option<String> {
        names
            .iter()
            .filter(|n| pick(n))
            .filter_map(|n| Some((n.clone(), median_ttft(n)?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(n, _)| n)
    };
    let best_peer = best(is_peer);
    let best_ours = best(is_ours);
    let oracle = names
        .iter()
        .find(|n| *n == "oracle" && median_ttft(n).is_some())
        .cloned();
    let ratio = |name: &str, against: &Option<String>| -> Option<Ratio> {
        let against = against.as_ref()?;
        let (a, b) = (figures_of(name), figures_of(against));
        let paired = |f: fn(&Figures) -> f64| -> Vec<f64> {
            a.iter()
                .zip(&b)
                .filter_map(|(x, y)| Some(f(x.as_ref()?) / f(y.as_ref()?)))
                .filter(|r| r.is_finite())
                .collect()
        };
        Some(Ratio {
            against: against.clone(),
            ttft_mean: interval(&paired(|f| f.ttft_mean_ms))?,
            ttft_p99: interval(&paired(|f| f.ttft_p99_ms))?,
        })
    };
    names
        .iter()
        .map(|name| {
            let figs = figures_of(name);
            let first = rounds.iter().flatten().find(|r| &r.name == name);
            let ttft = metric(&figs, |f| f.ttft_mean_ms);
            let mean_interval = interval(&ttft);
            // The round whose mean TTFT is nearest the median stands for the system.
            let median_round = mean_interval.and_then(|i| {
                figs.iter()
                    .flatten()
                    .min_by(|a, b| {
                        (a.ttft_mean_ms - i.median)
                            .abs()
                            .total_cmp(&(b.ttft_mean_ms - i.median).abs())
                    })
                    .cloned()
            });
            SystemSummary {
                name: name.clone(),
                workload: first.map(|r| r.workload.clone()).unwrap_or_default(),
                skipped: median_round.is_none(),
                reason: if median_round.is_none() {
                    rounds
                        .iter()
                        .flatten()
                        .find(|r| &r.name == name && r.reason.is_some())
                        .and_then(|r| r.reason.clone())
                } else {
                    None
                },
                figures: median_round,
                ttft_mean_ms_interval: mean_interval,
                ttft_p99_ms_interval: interval(&metric(&figs, |f| f.ttft_p99_ms)),
                itl_p99_ms_interval: interval(&metric(&figs, |f| f.itl_p99_ms)),
                hit_rate_interval: interval(&metric(&figs, |f| f.hit_rate)),
                throughput_rps_interval: interval(&metric(&figs, |f| f.throughput_rps)),
                vs_best_peer: ratio(name, &best_peer),
                vs_oracle: ratio(name, &oracle),
                vs_best_ours: ratio(name, &best_ours),
                rounds: figs,
            }
        })
        .collect()
}

fn cell(i: &Option<Interval>, digits: usize) -> String {
    match i {
        None => "–".into(),
        Some(i) if i.low < i.high => format!(
            "{:.d$} ({:.d$}–{:.d$})",
            i.median,
            i.low,
            i.high,
            d = digits
        ),
        Some(i) => format!("{:.d$}", i.median, d = digits),
    }
}

fn ratio_cell(r: &Option<Ratio>) -> String {
    r.as_ref().map_or("–".into(), |r| {
        format!("{}: {}", r.against, Ratio::describe(&r.ttft_mean))
    })
}

/// The summary table: medians and intervals over rounds, and the ratios of mean TTFT.
pub fn markdown(summaries: &[SystemSummary], rounds: usize) -> String {
    let mut out = format!(
        "Medians over {rounds} round(s), 95 % intervals in parentheses; ratios of mean TTFT, round by round.\n\n\
         | system | mean TTFT ms | p99 TTFT ms | p99 ITL ms | hit rate | req/s | ÷ best peer | ÷ oracle | ÷ best of ours |\n\
         |---|---|---|---|---|---|---|---|---|\n"
    );
    for s in summaries {
        if s.skipped {
            let _ = writeln!(
                out,
                "| {} | skipped: {} | | | | | | | |",
                s.name,
                s.reason.as_deref().unwrap_or("")
            );
            continue;
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.name,
            cell(&s.ttft_mean_ms_interval, 1),
            cell(&s.ttft_p99_ms_interval, 1),
            cell(&s.itl_p99_ms_interval, 1),
            cell(&s.hit_rate_interval, 3),
            cell(&s.throughput_rps_interval, 1),
            ratio_cell(&s.vs_best_peer),
            ratio_cell(&s.vs_oracle),
            ratio_cell(&s.vs_best_ours),
        );
    }
    out
}

/// The systems of one round, rotated: round `r` starts `r` places further, so every system
/// runs early and late equally often.
pub fn rotated<T: Clone>(systems: &[T], round: usize) -> Vec<T> {
    let mut order = systems.to_vec();
    if !order.is_empty() {
        let k = round % order.len();
        order.rotate_left(k);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(name: &str, ttft: f64, p99: f64) -> SystemResult {
        SystemResult {
            name: name.into(),
            workload: "w".into(),
            figures: Some(Figures {
                ttft_mean_ms: ttft,
                ttft_p99_ms: p99,
                hit_rate: 0.5,
                ..Figures::default()
            }),
            ..SystemResult::default()
        }
    }

    #[test]
    fn an_interval_holds_its_median_and_widens_with_spread() {
        let tight = interval(&[10.0, 10.1, 9.9, 10.0, 10.05]).unwrap();
        let wide = interval(&[5.0, 15.0, 9.0, 12.0, 7.0]).unwrap();
        assert_eq!(tight.median, 10.0);
        assert!(tight.low <= 10.0 && 10.0 <= tight.high);
        assert!(wide.high - wide.low > tight.high - tight.low);
        assert_eq!(
            interval(&[3.0]).unwrap(),
            Interval {
                median: 3.0,
                low: 3.0,
                high: 3.0
            }
        );
        assert_eq!(interval(&[]), None);
        // Deterministic.
        assert_eq!(interval(&[5.0, 15.0, 9.0]), interval(&[5.0, 15.0, 9.0]));
    }

    #[test]
    fn ratios_are_paired_by_round_and_a_span_over_one_is_no_difference() {
        // The same fleet drifts between rounds; cost is 0.8 of smg within every round.
        let rounds: Vec<Vec<SystemResult>> = [1.0, 1.3, 0.9, 1.2, 1.1]
            .iter()
            .map(|drift| {
                vec![
                    result("cost", 40.0 * drift, 100.0 * drift),
                    result("prefix", 41.0 * drift, 99.0 * drift),
                    result("smg", 50.0 * drift, 120.0 * drift),
                    result("oracle", 40.0 * drift, 100.0 * drift),
                ]
            })
            .collect();
        let s = summarize(&rounds);
        let cost = s.iter().find(|s| s.name == "cost").unwrap();
        let peer = cost.vs_best_peer.as_ref().unwrap();
        assert_eq!(peer.against, "smg");
        assert!((peer.ttft_mean.median - 0.8).abs() < 1e-9);
        assert!(peer.ttft_mean.high < 1.0, "paired: the drift cancels");
        assert_eq!(cost.vs_best_ours.as_ref().unwrap().against, "cost");
        let prefix = s.iter().find(|s| s.name == "prefix").unwrap();
        let vs = prefix.vs_best_ours.as_ref().unwrap();
        assert!((vs.ttft_mean.median - 41.0 / 40.0).abs() < 1e-9);
        assert!(Ratio::describe(&Interval {
            median: 1.01,
            low: 0.95,
            high: 1.05
        })
        .starts_with("no difference"));
        assert_eq!(rotated(&[1, 2, 3], 1), vec![2, 3, 1]);
        assert_eq!(rotated(&[1, 2, 3], 3), vec![1, 2, 3]);
    }
}
