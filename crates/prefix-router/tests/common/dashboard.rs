//! The Grafana dashboard (deploy/grafana/prefix-router.json) and the metrics its panels query.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

pub fn dashboard() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/grafana/prefix-router.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The metric names in a PromQL expression (ours and vLLM's).
pub fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
        let word_len = rest[i..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len() - i);
        let word = &rest[i..i + word_len];
        if word.starts_with("prefix_router_") || word.starts_with("vllm:") {
            out.push(word.to_owned());
        }
        rest = &rest[i + word_len..];
    }
    out
}

/// Every metric the dashboard's panels query.
pub fn queried_metrics() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for panel in dashboard()["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            names.extend(metric_names(target["expr"].as_str().unwrap()));
        }
    }
    names
}

/// The sample names in `/metrics` texts.
pub fn exposed(texts: &[String]) -> BTreeSet<String> {
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}
