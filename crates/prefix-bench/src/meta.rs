//! Where a result came from: the commit (and whether the tree had changes), the machine, the
//! versions of vLLM and of the peer routers, the command line. Recorded in `results.json`, so a
//! table can always say what produced it.

use std::path::Path;

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub struct RunMeta {
    /// `git rev-parse HEAD` of the working directory, if it is a checkout.
    pub commit: Option<String>,
    /// Whether the checkout had uncommitted changes.
    pub dirty: Option<bool>,
    pub cpu_model: Option<String>,
    pub cores: usize,
    /// The fleet's servers: `8 sim servers`, `2 vLLM servers`.
    pub fleet: String,
    /// vLLM's version, from the servers' `GET /version` (real vLLM only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vllm_version: Option<String>,
    /// The peer routers' versions, as installed in the peers' virtual environment.
    pub peers: std::collections::BTreeMap<String, String>,
    /// The command line that produced the result.
    pub command: String,
    /// When it started (Unix seconds).
    pub started_unix: u64,
    /// Rounds every system ran.
    pub rounds: usize,
}

fn git(args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map(|(_, m)| m.trim().to_owned())
}

/// The versions of the peers installed in `venv` (none when it is missing).
fn peer_versions(venv: &Path) -> std::collections::BTreeMap<String, String> {
    let python = venv.join("bin/python");
    let mut out = std::collections::BTreeMap::new();
    if !python.exists() {
        return out;
    }
    for package in ["sglang-router", "smg", "vllm-router"] {
        let version = std::process::Command::new(&python)
            .args([
                "-c",
                &format!("import importlib.metadata as m; print(m.version('{package}'))"),
            ])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
        if let Some(v) = version {
            out.insert(package.to_owned(), v);
        }
    }
    out
}

impl RunMeta {
    /// What can be read now about this run; the vLLM version is asked of `urls` when `vllm`.
    pub async fn collect(
        client: &reqwest::Client,
        fleet: String,
        urls: &[String],
        vllm: bool,
        peers_venv: &Path,
        rounds: usize,
    ) -> Self {
        let vllm_version = if vllm {
            let version = async {
                let url = urls.first()?;
                let v: serde_json::Value = client
                    .get(format!("{url}/version"))
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                v["version"].as_str().map(str::to_owned)
            };
            version.await
        } else {
            None
        };
        Self {
            commit: git(&["rev-parse", "HEAD"]),
            dirty: git(&["status", "--porcelain", "--untracked-files=no"]).map(|s| !s.is_empty()),
            cpu_model: cpu_model(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            fleet,
            vllm_version,
            peers: peer_versions(peers_venv),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            rounds,
        }
    }
}
