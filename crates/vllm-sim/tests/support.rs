//! Helpers for tests that need Python (shared by path with other crates' tests).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// True when tests must not skip for a missing dependency (CI sets `PREFIX_ROUTER_CI`).
pub fn in_ci() -> bool {
    std::env::var_os("PREFIX_ROUTER_CI").is_some()
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The python of the test venv (`scripts/python-venv.sh`), or None (test skipped) when it
/// cannot be made outside CI.
pub fn python_with_openai() -> Option<PathBuf> {
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/python-venv.sh"))
        .output();
    match out {
        Ok(out) if out.status.success() => {
            Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
        }
        other => {
            assert!(
                !in_ci(),
                "the Python test venv is required in CI: {other:?}"
            );
            eprintln!("skipping: no Python venv with openai ({other:?})");
            None
        }
    }
}

/// Runs a Python test script with arguments; panics with its output on failure.
pub async fn run_python(python: &PathBuf, script: &str, args: &[&str]) -> String {
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Sims that answer at once (no simulated time).
pub fn instant() -> vllm_sim::SimConfig {
    vllm_sim::SimConfig {
        time_scale: 0.0,
        ..vllm_sim::SimConfig::default()
    }
}

/// `n` sims on free loopback ports.
pub async fn fleet(config: vllm_sim::SimConfig, n: usize) -> vllm_sim::Fleet {
    vllm_sim::Fleet::start(config, n, std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap()
}

/// A metric's value from a server's `/metrics`, summed over its label sets.
pub async fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
