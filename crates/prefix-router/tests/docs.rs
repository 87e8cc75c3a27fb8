//! The reference pages stay in step with the code: `docs/reference/cli.md` is what the binary's
//! flags say (regenerated with `UPDATE_DOCS=1`), and `docs/reference/metrics.md` lists every
//! metric family the code registers (read off the source, so families without a series yet
//! count too) and every family a running router, endpoint picker and index server expose, and
//! nothing else.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use common::{bus_key_file, fleet, metrics_text, router, text, Nats};
use serde_json::json;

fn docs() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs")
}

#[test]
fn the_cli_reference_is_the_binarys_help() {
    let path = docs().join("reference/cli.md");
    let generated = prefix_router::cli::reference_markdown();
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let written = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        written == generated,
        "docs/reference/cli.md differs from the flags the binary defines: regenerate it with \
         `UPDATE_DOCS=1 cargo test -p prefix-router --test docs`"
    );
}

/// The families an exposition declares (`# TYPE name kind`), by the names samples carry
/// (counters end in `_total`).
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| {
            let mut words = l.strip_prefix("# TYPE ")?.split_whitespace();
            let name = words.next()?;
            Some(match words.next()? {
                "counter" if !name.ends_with("_total") => format!("{name}_total"),
                _ => name.to_owned(),
            })
        })
        .collect()
}

/// The families the metrics page documents: the first code span of each table row.
fn documented() -> BTreeSet<String> {
    let page = std::fs::read_to_string(docs().join("reference/metrics.md")).unwrap();
    page.lines()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| {
            let name = l.strip_prefix("| `")?.split('`').next()?;
            Some(name.to_owned())
        })
        .collect()
}

/// A family's name without the `_total` its counter samples carry.
fn stem(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

/// The families registered in the router's and the index's source: the name given to every
/// `register(` call, under its sub-registry's prefix (the replica bus's) or its HTTP metrics'
/// prefix.
fn registered_in_source() -> BTreeSet<String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["prefix-router/src", "prefix-index/src"] {
        let mut stack = vec![root.join(dir)];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    files.push(path);
                }
            }
        }
    }
    let literal_after = |text: &str, at: usize| -> Option<String> {
        let rest = text[at..].trim_start();
        let rest = rest.strip_prefix('"')?;
        Some(rest[..rest.find('"')?].to_owned())
    };
    let mut names = BTreeSet::new();
    let mut http_prefixes = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let prefix = text
            .find("sub_registry_with_prefix(")
            .and_then(|at| literal_after(&text, at + "sub_registry_with_prefix(".len()));
        for call in [".register(", "register_with_unit("] {
            for (at, _) in text.match_indices(call) {
                let Some(name) = literal_after(&text, at + call.len()) else {
                    continue;
                };
                names.insert(match &prefix {
                    Some(p) if !name.starts_with("prefix_") && !name.starts_with("vllm:") => {
                        format!("{p}_{name}")
                    }
                    _ => name,
                });
            }
        }
        for (at, _) in text.match_indices("HttpMetrics::register(") {
            let args = &text[at..];
            if let Some(comma) = args.find(',') {
                if let Some(p) = literal_after(args, comma + 1) {
                    http_prefixes.push(p);
                }
            }
        }
        if path.ends_with("http_metrics.rs") {
            for (at, _) in text.match_indices("format!(\"{prefix}") {
                let rest = &text[at + "format!(\"{prefix}".len()..];
                if let Some(end) = rest.find('"') {
                    names.insert(format!("{{prefix}}{}", &rest[..end]));
                }
            }
        }
    }
    let templated: Vec<String> = names
        .iter()
        .filter(|n| n.starts_with("{prefix}"))
        .cloned()
        .collect();
    for t in templated {
        names.remove(&t);
        for p in &http_prefixes {
            names.insert(t.replace("{prefix}", p));
        }
    }
    names.into_iter().map(|n| stem(&n).to_owned()).collect()
}

#[test]
fn every_family_the_code_registers_is_documented_and_no_other() {
    let registered = registered_in_source();
    assert!(
        registered.contains("prefix_router_replica_bus_connected")
            && registered.contains("prefix_index_http_requests")
            && registered.contains("prefix_router_requests"),
        "the source scan finds the families: {registered:?}"
    );
    let documented: BTreeSet<String> = documented().iter().map(|n| stem(n).to_owned()).collect();
    let undocumented: Vec<&String> = registered.difference(&documented).collect();
    let stale: Vec<&String> = documented.difference(&registered).collect();
    assert!(
        undocumented.is_empty(),
        "families registered but not in docs/reference/metrics.md: {undocumented:?}"
    );
    assert!(
        stale.is_empty(),
        "families in docs/reference/metrics.md that the code does not register: {stale:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_reference_lists_every_family() {
    let Some(nats) = Nats::start().await else {
        return;
    };
    let sims = fleet(common::instant(), 2).await;
    let urls = sims.urls();
    let keys = std::env::temp_dir().join(format!("docs-keys-{}.toml", std::process::id()));
    std::fs::write(&keys, "[tenants.team]\nkeys = [\"team-key-123\"]\n").unwrap();
    let key = bus_key_file();
    let events_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    // Every feature that registers metrics: precise mode, the queue, tenants, the bus.
    let words = [
        "--kv-events",
        "--kv-events-port",
        events_port.as_str(),
        "--max-queue-wait",
        "10s",
        "--api-keys-file",
        keys.to_str().unwrap(),
        "--replica-bus",
        &nats.url(),
        "--replica-bus-key-file",
        &key,
    ];
    let (r, _) = router(&urls, &words).await;
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{}/v1/completions", r.url()))
        .bearer_auth("team-key-123")
        .json(
            &json!({"model": "sim-model", "prompt": text(1, 500), "max_tokens": 2, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    let picker = common::envoy::picker(&urls, &[]).await;
    let index = common::index_server().await;
    let mut exposed = families(&metrics_text(&r.url()).await);
    exposed.extend(families(&metrics_text(&picker.http.url()).await));
    exposed.extend(families(&metrics_text(&index.url()).await));
    std::fs::remove_file(&keys).unwrap();
    let documented = documented();
    let undocumented: Vec<&String> = exposed.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "families exposed but not in docs/reference/metrics.md (as exposed, counters with \
         `_total`): {undocumented:?}"
    );
}

/// Every relative link of the documentation leads to a file that exists.
#[test]
fn the_documentations_links_lead_somewhere() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut pages = vec![
        repo.join("README.md"),
        repo.join("CONTRIBUTING.md"),
        repo.join("CHANGELOG.md"),
        repo.join("deploy/helm/prefix-router/README.md"),
    ];
    let mut dirs = vec![repo.join("docs")];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for (at, _) in text.match_indices("](") {
            let rest = &text[at + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if target.starts_with("http")
                || target.starts_with('#')
                || target.starts_with("mailto:")
            {
                continue;
            }
            let file = target.split('#').next().unwrap();
            if !page.parent().unwrap().join(file).exists() {
                broken.push(format!("{}: {target}", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "links to nothing: {broken:#?}");
}
