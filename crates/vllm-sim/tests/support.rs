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
