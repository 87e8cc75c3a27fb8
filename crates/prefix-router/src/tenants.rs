//! Tenants: who a client is (its API key), what priority its requests get in the gateway
//! queue, and how much it may ask (a token-bucket rate and a cap on requests in flight).
//!
//! The keys file (`--api-keys-file`, TOML, or JSON when its name ends in `.json`):
//!
//! ```toml
//! [tenants.team-a]
//! keys = ["sk-team-a-1", "sha256:9f86d08…"]   # plain, or the hex SHA-256 of the key
//! priority = 5          # the queue's priority (default 0); x-priority may lower it, not raise it
//! rate = 20.0           # requests per second, refilling a bucket of `burst` (default: none)
//! burst = 40            # default: max(1, rate)
//! max-concurrent = 8    # requests in flight at once (default: none)
//! ```
//!
//! Keys are kept only as SHA-256 digests (and never logged); the file is re-read when it
//! changes, keeping each tenant's bucket and in-flight count across reloads. A tenant removed
//! from the file loses its metric series; one removed and added back while its requests still
//! run is the same tenant again (its bucket and in-flight count hold). A refused request gets
//! 429 with `Retry-After`, and changes nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use anyhow::Context;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::metric_label::Label;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct TenantsArgs {
    /// Tenants and their API keys, priorities and limits (TOML, or JSON by extension);
    /// re-read when it changes. Clients must then send one of its keys (or `--api-key`).
    #[arg(long, env = "PREFIX_ROUTER_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
}

/// One tenant as the file declares it.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct TenantSpec {
    keys: Vec<String>,
    #[serde(default)]
    priority: i32,
    rate: Option<f64>,
    burst: Option<f64>,
    max_concurrent: Option<u64>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    tenants: HashMap<String, TenantSpec>,
}

/// What a tenant may do; `None`: unlimited.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    pub rate: Option<f64>,
    pub burst: f64,
    pub max_concurrent: Option<u64>,
}

type Digest32 = [u8; 32];

fn digest(key: &[u8]) -> Digest32 {
    Sha256::digest(key).into()
}

fn parse_key(key: &str) -> anyhow::Result<Digest32> {
    match key.strip_prefix("sha256:") {
        Some(hex) => {
            anyhow::ensure!(
                hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
                "a sha256: key needs 64 hex digits"
            );
            let mut out = [0u8; 32];
            for (i, byte) in out.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)?;
            }
            Ok(out)
        }
        None => {
            anyhow::ensure!(key.len() >= 8, "keys must have at least 8 characters");
            Ok(digest(key.as_bytes()))
        }
    }
}

/// The parsed file: key digest → tenant name, and each tenant's priority and limits.
struct Parsed {
    keys: HashMap<Digest32, String>,
    tenants: HashMap<String, (i32, Limits)>,
}

fn parse(path: &Path, text: &str) -> anyhow::Result<Parsed> {
    let file: KeysFile = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(text)?
    } else {
        toml::from_str(text)?
    };
    let mut keys = HashMap::new();
    let mut tenants = HashMap::new();
    for (name, spec) in file.tenants {
        anyhow::ensure!(
            !name.is_empty() && name.len() <= 64,
            "tenant names are 1 to 64 characters"
        );
        anyhow::ensure!(
            crate::core::admission::PRIORITIES.contains(&spec.priority),
            "tenant {name}: priority must be from {} to {}",
            crate::core::admission::PRIORITIES.start(),
            crate::core::admission::PRIORITIES.end()
        );
        if let Some(rate) = spec.rate {
            anyhow::ensure!(
                rate.is_finite() && rate > 0.0,
                "tenant {name}: rate must be above 0"
            );
        }
        let burst = spec.burst.unwrap_or(spec.rate.unwrap_or(1.0).max(1.0));
        anyhow::ensure!(
            burst.is_finite() && burst >= 1.0,
            "tenant {name}: burst must be at least 1"
        );
        anyhow::ensure!(
            spec.max_concurrent != Some(0),
            "tenant {name}: max-concurrent must be at least 1"
        );
        anyhow::ensure!(!spec.keys.is_empty(), "tenant {name} has no keys");
        for key in &spec.keys {
            let d = parse_key(key).with_context(|| format!("tenant {name}"))?;
            if let Some(other) = keys.insert(d, name.clone()) {
                anyhow::bail!("a key of tenant {name} is also a key of tenant {other}");
            }
        }
        let limits = Limits {
            rate: spec.rate,
            burst,
            max_concurrent: spec.max_concurrent,
        };
        tenants.insert(name, (spec.priority, limits));
    }
    Ok(Parsed { keys, tenants })
}

/// A tenant's live state: its settings (replaced on reload) and what it holds now.
pub struct Tenant {
    pub name: Arc<str>,
    /// The gateway queue's fairness key of its requests (its keys share turns).
    pub fairness_key: u64,
    priority: AtomicI32,
    limits: ArcSwap<Limits>,
    /// Tokens left and when they were counted.
    bucket: Mutex<(f64, Instant)>,
    inflight: AtomicU64,
    /// No longer in the keys file (its requests still running count here, not in metrics).
    retired: AtomicBool,
    metrics: Arc<TenantMetrics>,
}

/// Why a tenant's request is refused, and when to retry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limited {
    Rate { retry_after: Duration },
    Concurrency,
}

/// Counts a request against its tenant's cap until dropped.
pub struct TenantGuard(Arc<Tenant>);

impl Drop for TenantGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Relaxed);
        self.0.show_inflight();
    }
}

impl Tenant {
    fn new(
        name: &str,
        priority: i32,
        limits: Limits,
        metrics: Arc<TenantMetrics>,
        now: Instant,
    ) -> Self {
        Self {
            name: name.into(),
            fairness_key: xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), 3),
            priority: AtomicI32::new(priority),
            limits: ArcSwap::from_pointee(limits),
            bucket: Mutex::new((limits.burst, now)),
            inflight: AtomicU64::new(0),
            retired: AtomicBool::new(false),
            metrics,
        }
    }

    /// Sets its in-flight gauge to its count (a retired tenant has no series).
    fn show_inflight(&self) {
        if !self.retired.load(Relaxed) {
            self.metrics
                .inflight(&self.name)
                .set(self.inflight.load(Relaxed) as i64);
        }
    }

    /// Gone from the keys file: its series go (its running requests still end here).
    fn retire(&self) {
        self.retired.store(true, Relaxed);
        for outcome in OUTCOMES {
            self.metrics.requests.remove(&TenantLabels {
                tenant: Label(self.name.clone()),
                outcome,
            });
        }
        self.metrics.inflight.remove(&TenantOnly {
            tenant: Label(self.name.clone()),
        });
    }

    /// Back in the keys file.
    fn reinstate(&self) {
        self.retired.store(false, Relaxed);
        self.show_inflight();
    }

    /// The queue priority of its requests.
    pub fn priority(&self) -> i32 {
        self.priority.load(Relaxed)
    }

    /// Takes a place for one request at `now`, or says why not (nothing is taken then).
    pub fn admit(self: &Arc<Self>, now: Instant) -> Result<TenantGuard, Limited> {
        let limits = **self.limits.load();
        let outcome = self.try_admit(&limits, now);
        let label = match &outcome {
            Ok(_) => OUTCOMES[0],
            Err(Limited::Rate { .. }) => OUTCOMES[1],
            Err(Limited::Concurrency) => OUTCOMES[2],
        };
        if !self.retired.load(Relaxed) {
            self.metrics.requests(&self.name, label).inc();
        }
        outcome
    }

    fn try_admit(self: &Arc<Self>, limits: &Limits, now: Instant) -> Result<TenantGuard, Limited> {
        let held = self.inflight.fetch_add(1, Relaxed) + 1;
        let guard = TenantGuard(self.clone());
        self.show_inflight();
        if limits.max_concurrent.is_some_and(|max| held > max) {
            return Err(Limited::Concurrency);
        }
        if let Some(rate) = limits.rate {
            let mut bucket = self.bucket.lock();
            let (tokens, at) = *bucket;
            let refilled =
                (tokens + now.saturating_duration_since(at).as_secs_f64() * rate).min(limits.burst);
            if refilled < 1.0 {
                *bucket = (refilled, now.max(at));
                return Err(Limited::Rate {
                    retry_after: Duration::from_secs_f64((1.0 - refilled) / rate),
                });
            }
            *bucket = (refilled - 1.0, now.max(at));
        }
        Ok(guard)
    }

    fn update(&self, priority: i32, limits: Limits) {
        self.priority.store(priority, Relaxed);
        let before = **self.limits.load();
        if before != limits {
            self.limits.store(Arc::new(limits));
            // A smaller burst takes effect at once.
            let mut bucket = self.bucket.lock();
            bucket.0 = bucket.0.min(limits.burst);
        }
    }
}

/// The outcomes of a tenant's requests, as labelled.
const OUTCOMES: [&str; 3] = ["admitted", "rate_limited", "concurrency_limited"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: Label,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantOnly {
    tenant: Label,
}

struct TenantMetrics {
    requests: Family<TenantLabels, Counter>,
    inflight: Family<TenantOnly, Gauge>,
    reloads: Family<ReloadLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    outcome: &'static str,
}

impl TenantMetrics {
    fn requests(&self, tenant: &Arc<str>, outcome: &'static str) -> Counter {
        self.requests
            .get_or_create(&TenantLabels {
                tenant: Label(tenant.clone()),
                outcome,
            })
            .clone()
    }

    fn inflight(&self, tenant: &Arc<str>) -> Gauge {
        self.inflight
            .get_or_create(&TenantOnly {
                tenant: Label(tenant.clone()),
            })
            .clone()
    }
}

/// The tenants of the keys file.
pub struct Tenants {
    path: PathBuf,
    by_key: ArcSwap<HashMap<Digest32, Arc<Tenant>>>,
    /// Every tenant of the file, by name: reloads keep their state.
    known: Mutex<HashMap<String, Arc<Tenant>>>,
    /// Tenants removed from the file, while requests of theirs still run: added back, they
    /// are the same tenant.
    retired: Mutex<HashMap<String, Weak<Tenant>>>,
    metrics: Arc<TenantMetrics>,
}

impl Tenants {
    /// Reads the keys file (an error if it is missing or invalid).
    pub fn load(path: &Path, registry: &mut Registry) -> anyhow::Result<Arc<Self>> {
        let metrics = Arc::new(TenantMetrics {
            requests: Family::default(),
            inflight: Family::default(),
            reloads: Family::default(),
        });
        registry.register(
            "prefix_router_tenant_requests",
            "Requests by tenant (keys file) and outcome: admitted, rate_limited, concurrency_limited",
            metrics.requests.clone(),
        );
        registry.register(
            "prefix_router_tenant_inflight",
            "Requests in flight by tenant",
            metrics.inflight.clone(),
        );
        registry.register(
            "prefix_router_tenant_reloads",
            "Re-reads of the keys file after it changed, by outcome (applied, invalid)",
            metrics.reloads.clone(),
        );
        let tenants = Arc::new(Self {
            path: path.to_owned(),
            by_key: ArcSwap::from_pointee(HashMap::new()),
            known: Mutex::new(HashMap::new()),
            retired: Mutex::new(HashMap::new()),
            metrics,
        });
        tenants
            .reload()
            .with_context(|| format!("--api-keys-file {}", path.display()))?;
        Ok(tenants)
    }

    fn reload(&self) -> anyhow::Result<usize> {
        let text = std::fs::read_to_string(&self.path)?;
        let parsed = parse(&self.path, &text)?;
        let now = Instant::now();
        let mut known = self.known.lock();
        let mut retired = self.retired.lock();
        retired.retain(|_, t| t.strong_count() > 0);
        for (name, &(priority, limits)) in &parsed.tenants {
            match known.get(name) {
                Some(t) => t.update(priority, limits),
                None => {
                    let t = match retired.remove(name).and_then(|t| t.upgrade()) {
                        Some(back) => {
                            back.update(priority, limits);
                            back.reinstate();
                            back
                        }
                        None => Arc::new(Tenant::new(
                            name,
                            priority,
                            limits,
                            self.metrics.clone(),
                            now,
                        )),
                    };
                    known.insert(name.clone(), t);
                }
            }
        }
        known.retain(|name, t| {
            let keep = parsed.tenants.contains_key(name);
            if !keep {
                t.retire();
                retired.insert(name.clone(), Arc::downgrade(t));
            }
            keep
        });
        let by_key = parsed
            .keys
            .into_iter()
            .map(|(d, name)| (d, known[&name].clone()))
            .collect();
        self.by_key.store(Arc::new(by_key));
        Ok(parsed.tenants.len())
    }

    /// The tenant of a bearer token, if it is one of the file's keys.
    pub fn identify(&self, token: &[u8]) -> Option<Arc<Tenant>> {
        self.by_key.load().get(&digest(token)).cloned()
    }

    /// Re-reads the file every second while it changes; an invalid file keeps the tenants as
    /// they were (logged and counted).
    pub fn watch(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let mut seen = modified(&self.path);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let Some(tenants) = weak.upgrade() else {
                    return;
                };
                let now = modified(&tenants.path);
                if now == seen {
                    continue;
                }
                seen = now;
                let outcome = match tenants.reload() {
                    Ok(n) => {
                        tracing::info!(tenants = n, "keys file changed: tenants reloaded");
                        "applied"
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the changed keys file is invalid; keeping the tenants");
                        "invalid"
                    }
                };
                tenants
                    .metrics
                    .reloads
                    .get_or_create(&ReloadLabels { outcome })
                    .inc();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(text: &str, ext: &str) -> anyhow::Result<Arc<Tenants>> {
        let path = std::env::temp_dir().join(format!(
            "keys-{}-{}.{ext}",
            std::process::id(),
            xxhash_rust::xxh3::xxh3_64(text.as_bytes())
        ));
        std::fs::write(&path, text).unwrap();
        let out = Tenants::load(&path, &mut Registry::default());
        std::fs::remove_file(&path).unwrap();
        out
    }

    #[test]
    fn keys_plain_and_hashed_name_their_tenant() {
        let hex: String = Sha256::digest(b"secret-key-b")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let hashed = format!("sha256:{hex}");
        let t = tenants(
            &format!(
                "[tenants.a]\nkeys = [\"secret-key-a\"]\npriority = 3\n[tenants.b]\nkeys = [\"{hashed}\"]\n"
            ),
            "toml",
        )
        .unwrap();
        let a = t.identify(b"secret-key-a").unwrap();
        assert_eq!((&*a.name, a.priority()), ("a", 3));
        assert_eq!(&*t.identify(b"secret-key-b").unwrap().name, "b");
        assert!(t.identify(b"secret-key-c").is_none());
        let json = tenants(
            r#"{"tenants": {"j": {"keys": ["json-key-1"], "rate": 2}}}"#,
            "json",
        )
        .unwrap();
        assert_eq!(&*json.identify(b"json-key-1").unwrap().name, "j");
    }

    #[test]
    fn invalid_files_are_refused_with_the_reason() {
        for (text, why) in [
            ("[tenants.a]\nkeys = [\"short\"]\n", "8 characters"),
            ("[tenants.a]\nkeys = []\n", "no keys"),
            ("[tenants.a]\nkeys = [\"key-one-1\"]\nrate = 0\n", "rate"),
            (
                "[tenants.a]\nkeys = [\"key-one-1\"]\npriority = 1000\n",
                "priority",
            ),
            (
                "[tenants.a]\nkeys = [\"key-one-1\"]\nmax-concurrent = 0\n",
                "max-concurrent",
            ),
            (
                "[tenants.a]\nkeys = [\"key-one-1\"]\n[tenants.b]\nkeys = [\"key-one-1\"]\n",
                "also a key",
            ),
            (
                "[tenants.a]\nkeys = [\"key-one-1\"]\nbogus = 1\n",
                "unknown field",
            ),
            ("[tenants.a]\nkeys = [\"sha256:12\"]\n", "64 hex"),
        ] {
            let e = format!("{:#}", tenants(text, "toml").err().expect(text));
            assert!(e.contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn the_bucket_refills_at_the_rate_and_refusals_take_nothing() {
        let t = tenants(
            "[tenants.a]\nkeys = [\"key-one-1\"]\nrate = 10\nburst = 2\n",
            "toml",
        )
        .unwrap();
        let a = t.identify(b"key-one-1").unwrap();
        let t0 = Instant::now();
        let held = [a.admit(t0).unwrap(), a.admit(t0).unwrap()];
        let Err(Limited::Rate { retry_after }) = a.admit(t0) else {
            panic!("the burst is spent")
        };
        assert!((retry_after.as_secs_f64() - 0.1).abs() < 1e-9);
        assert_eq!(a.inflight.load(Relaxed), 2, "a refusal holds nothing");
        assert!(a.admit(t0 + Duration::from_millis(100)).is_ok());
        assert!(a.admit(t0 + Duration::from_millis(100)).is_err());
        drop(held);
        // Idle for long: the bucket holds its burst, not more.
        let later = t0 + Duration::from_secs(60);
        assert!(a.admit(later).is_ok() && a.admit(later).is_ok());
        assert!(a.admit(later).is_err());
    }

    #[test]
    fn the_concurrency_cap_counts_requests_until_they_end() {
        let t = tenants(
            "[tenants.a]\nkeys = [\"key-one-1\"]\nmax-concurrent = 2\n",
            "toml",
        )
        .unwrap();
        let a = t.identify(b"key-one-1").unwrap();
        let now = Instant::now();
        let first = a.admit(now).unwrap();
        let _second = a.admit(now).unwrap();
        assert_eq!(a.admit(now).err(), Some(Limited::Concurrency));
        drop(first);
        assert!(a.admit(now).is_ok());
    }

    /// A tenant removed from the file loses its series; added back while a request of its
    /// still runs, it is the same tenant (its cap counts that request).
    #[test]
    fn a_removed_tenant_leaves_the_metrics_and_comes_back_with_its_state() {
        let path = std::env::temp_dir().join(format!("keys-reload-{}.toml", std::process::id()));
        let with_a = "[tenants.a]\nkeys = [\"secret-key-a\"]\nmax-concurrent = 1\n[tenants.b]\nkeys = [\"secret-key-b\"]\n";
        std::fs::write(&path, with_a).unwrap();
        let mut registry = Registry::default();
        let t = Tenants::load(&path, &mut registry).unwrap();
        let text = |registry: &Registry| {
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
            out
        };
        let a = t.identify(b"secret-key-a").unwrap();
        let running = a.admit(Instant::now()).unwrap();
        assert!(text(&registry).contains("tenant=\"a\""));
        std::fs::write(&path, "[tenants.b]\nkeys = [\"secret-key-b\"]\n").unwrap();
        t.reload().unwrap();
        assert!(t.identify(b"secret-key-a").is_none());
        assert!(
            !text(&registry).contains("tenant=\"a\""),
            "{}",
            text(&registry)
        );
        std::fs::write(&path, with_a).unwrap();
        t.reload().unwrap();
        let back = t.identify(b"secret-key-a").unwrap();
        assert!(Arc::ptr_eq(&a, &back), "the same tenant");
        assert_eq!(
            back.admit(Instant::now()).err(),
            Some(Limited::Concurrency),
            "its running request still counts"
        );
        drop(running);
        let _again = back.admit(Instant::now()).unwrap();
        assert!(text(&registry).contains("prefix_router_tenant_inflight{tenant=\"a\"} 1"));
        std::fs::remove_file(&path).unwrap();
    }
}
