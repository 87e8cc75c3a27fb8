//! Kubernetes service discovery: the backends are the Ready pods matching a label selector.
//!
//! A `kube-runtime` watcher lists and then watches the pods (resuming, and re-listing when
//! the watch is dropped or expires). A pod becomes a backend when it is Ready and has an IP;
//! it joins the routing candidates once its `/v1/models` answers (the health checks), and
//! leaves — index entries dropped — when it is deleted, stops being Ready, or fails its checks.
//! A changed pod IP is a new backend URL: the old one leaves, the new one joins.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;

use super::monitor::{Monitor, WeakMonitor};
use crate::core::backend::BackendSpec;
use crate::core::disagg::Role;

/// What `--discovery k8s` needs.
#[derive(Clone, Debug)]
pub struct K8sSettings {
    pub namespace: Option<String>,
    pub label_selector: Option<String>,
    /// Port of the pods' OpenAI server when a pod declares no container port named `http`.
    pub port: u16,
    /// The ports every selected pod serves on (an InferencePool's `targetPorts`): one backend
    /// per pod and port, whatever the pod declares.
    pub target_ports: Option<Vec<u16>>,
    /// A pod label whose value, when present, is the model the pod serves (instead of asking
    /// its `/v1/models`).
    pub model_label: String,
    /// A pod label whose value is the pod's role in a disaggregated fleet (`prefill`,
    /// `decode`, `both`; llm-d's `llm-d.ai/role`); without it, or with another value, both.
    pub role_label: String,
    /// The InferencePool whose selector and ports replace `label_selector` and `port`.
    pub inference_pool: Option<String>,
}

/// The backends a pod stands for now: one, on its `http` port (else the default), or one per
/// target port; none unless it is Ready, has an IP and is not being deleted.
pub fn pod_backends(pod: &Pod, settings: &K8sSettings) -> Vec<BackendSpec> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    if pod.metadata.deletion_timestamp.is_some() {
        return Vec::new();
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let Some(ip) = status.pod_ip.as_deref().filter(|ip| !ip.is_empty()) else {
        return Vec::new();
    };
    if !ready {
        return Vec::new();
    }
    let ports = match &settings.target_ports {
        Some(ports) => ports.clone(),
        None => vec![pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some("http"))
            .and_then(|p| u16::try_from(p.container_port).ok())
            .unwrap_or(settings.port)],
    };
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_owned()
    };
    let labels = pod.metadata.labels.as_ref();
    let models = labels
        .and_then(|l| l.get(&settings.model_label))
        .map(|m| vec![m.clone()]);
    let role = labels
        .and_then(|l| l.get(&settings.role_label))
        .and_then(|r| Role::parse(r))
        .unwrap_or_default();
    ports
        .into_iter()
        .map(|port| {
            let mut spec = BackendSpec::new(&format!("http://{host}:{port}"));
            spec.models = models.clone();
            spec.role = role;
            spec
        })
        .collect()
}

impl PodWatch {
    /// Watches the pods `settings` select and keeps the fleet equal to the static backends plus
    /// the Ready pods, until the monitor goes; `synced` turns true once the first full list is
    /// applied.
    pub async fn watch(self, settings: K8sSettings) {
        let PodWatch {
            monitor,
            client,
            static_specs,
            api_key,
            synced,
        } = self;
        let api: Api<Pod> = match &settings.namespace {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::default_namespaced(client),
        };
        let mut config = watcher::Config::default();
        if let Some(selector) = &settings.label_selector {
            config = config.labels(selector);
        }
        let mut events = watcher::watcher(api, config).default_backoff().boxed();
        // Pods by name; `listing` collects a re-list until it is complete.
        let mut pods: BTreeMap<String, Vec<BackendSpec>> = BTreeMap::new();
        let mut listing: Option<BTreeMap<String, Vec<BackendSpec>>> = None;
        while let Some(event) = events.next().await {
            let changed = match event {
                Ok(Event::Init) => {
                    listing = Some(BTreeMap::new());
                    false
                }
                Ok(Event::InitApply(pod)) => {
                    if let (Some(list), Some(name)) = (listing.as_mut(), pod.metadata.name.clone())
                    {
                        let specs = pod_backends(&pod, &settings);
                        if !specs.is_empty() {
                            list.insert(name, specs);
                        }
                    }
                    false
                }
                Ok(Event::InitDone) => {
                    pods = listing.take().unwrap_or_default();
                    true
                }
                Ok(Event::Apply(pod)) => {
                    let Some(name) = pod.metadata.name.clone() else {
                        continue;
                    };
                    let specs = pod_backends(&pod, &settings);
                    if specs.is_empty() {
                        pods.remove(&name).is_some()
                    } else {
                        pods.insert(name, specs.clone()) != Some(specs)
                    }
                }
                Ok(Event::Delete(pod)) => pod
                    .metadata
                    .name
                    .as_ref()
                    .is_some_and(|name| pods.remove(name).is_some()),
                Err(e) => {
                    tracing::warn!(error = %e, "pod watch failed; retrying");
                    false
                }
            };
            if !changed {
                continue;
            }
            let Some(monitor) = monitor.upgrade() else {
                return;
            };
            let mut specs = static_specs.clone();
            for spec in pods.values().flatten() {
                let mut spec = spec.clone();
                spec.api_key = api_key.clone();
                if !specs.iter().any(|s| s.url == spec.url) {
                    specs.push(spec);
                }
            }
            tracing::info!(pods = pods.len(), backends = specs.len(), "pods changed");
            if let Err(e) = monitor.apply(&specs).await {
                tracing::warn!(error = %e, "could not apply the discovered pods");
            }
            synced.store(true, Ordering::Release);
        }
    }
}

/// Starts discovery in the background: in-cluster configuration or KUBECONFIG, unless a
/// client is given (tests point one at a fake API server). The flag it returns turns true once
/// the pods (of the InferencePool, when one is named) have been listed and applied.
pub async fn spawn(
    monitor: &Monitor,
    settings: K8sSettings,
    static_specs: Vec<BackendSpec>,
    api_key: Option<String>,
    client: Option<kube::Client>,
) -> anyhow::Result<Arc<AtomicBool>> {
    let client = match client {
        Some(c) => c,
        None => kube::Client::try_default().await.map_err(|e| {
            anyhow::anyhow!("Kubernetes discovery: no in-cluster configuration or KUBECONFIG: {e}")
        })?,
    };
    let synced = Arc::new(AtomicBool::new(false));
    let pods = PodWatch {
        monitor: monitor.downgrade(),
        client,
        static_specs,
        api_key,
        synced: synced.clone(),
    };
    match settings.inference_pool.clone() {
        Some(pool) => {
            tokio::spawn(super::inference_pool::run(pods, settings, pool));
        }
        None => {
            tokio::spawn(pods.watch(settings));
        }
    }
    Ok(synced)
}

/// What a pod watch needs besides its settings (the InferencePool watcher restarts it with new
/// settings when the pool changes).
#[derive(Clone)]
pub struct PodWatch {
    pub monitor: WeakMonitor,
    pub client: kube::Client,
    pub static_specs: Vec<BackendSpec>,
    pub api_key: Option<String>,
    pub synced: Arc<AtomicBool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> K8sSettings {
        K8sSettings {
            namespace: None,
            label_selector: None,
            port: 8000,
            target_ports: None,
            model_label: "model".into(),
            role_label: "llm-d.ai/role".into(),
            inference_pool: None,
        }
    }

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn ready_pods_with_an_ip_are_backends() {
        let ready = pod(serde_json::json!({
            "metadata": {"name": "a", "labels": {"model": "m1"}},
            "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": 9000}]}]},
            "status": {"podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}
        }));
        let spec = pod_backends(&ready, &settings()).remove(0);
        assert_eq!(spec.url, "http://10.0.0.5:9000");
        assert_eq!(spec.models, Some(vec!["m1".to_owned()]));
        // A pool's target ports: one backend per port, the pod's own ports ignored.
        let pool = K8sSettings {
            target_ports: Some(vec![8001, 8002]),
            ..settings()
        };
        let urls: Vec<String> = pod_backends(&ready, &pool)
            .into_iter()
            .map(|s| s.url)
            .collect();
        assert_eq!(urls, ["http://10.0.0.5:8001", "http://10.0.0.5:8002"]);
        let default_port = pod(serde_json::json!({
            "metadata": {"name": "b"},
            "spec": {"containers": [{"name": "vllm"}]},
            "status": {"podIP": "10.0.0.6", "conditions": [{"type": "Ready", "status": "True"}]}
        }));
        let spec = pod_backends(&default_port, &settings()).remove(0);
        assert_eq!(
            (spec.url.as_str(), spec.models),
            ("http://10.0.0.6:8000", None)
        );
        let not_ready = pod(serde_json::json!({
            "metadata": {"name": "c"},
            "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "False"}]}
        }));
        assert!(pod_backends(&not_ready, &settings()).is_empty());
        let no_ip = pod(serde_json::json!({
            "metadata": {"name": "d"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }));
        assert!(pod_backends(&no_ip, &settings()).is_empty());
    }

    #[test]
    fn the_role_label_names_a_pods_role() {
        let with_role = |role: &str| {
            pod(serde_json::json!({
                "metadata": {"name": "a", "labels": {"llm-d.ai/role": role}},
                "status": {"podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}
            }))
        };
        let role = |p: &Pod| pod_backends(p, &settings()).remove(0).role;
        assert_eq!(role(&with_role("prefill")), Role::Prefill);
        assert_eq!(role(&with_role("decode")), Role::Decode);
        assert_eq!(role(&with_role("prefill-decode")), Role::Both);
        assert_eq!(role(&with_role("something-else")), Role::Both);
    }
}
