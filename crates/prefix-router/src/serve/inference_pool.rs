//! Backends from an InferencePool (`inference.networking.k8s.io/v1`, the Gateway API
//! Inference Extension): the pool names the pods (`spec.selector.matchLabels`) and the ports
//! they serve on (`spec.targetPorts`). The pool is watched; when its selector or ports change,
//! the pod watch of [`super::discovery`] restarts with the new ones, and when the pool goes,
//! only the static backends remain.

use std::collections::BTreeMap;

use futures_util::StreamExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use serde::Deserialize;

use super::discovery::{K8sSettings, PodWatch};

/// The pool's API group, version and kind.
pub const GROUP: &str = "inference.networking.k8s.io";
pub const VERSION: &str = "v1";
pub const KIND: &str = "InferencePool";

/// What the router reads of a pool's spec.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    pub selector: Selector,
    #[serde(default)]
    pub target_ports: Vec<Port>,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Selector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Port {
    pub number: u16,
}

impl PoolSpec {
    /// The pool's spec from its object, or why it cannot be used.
    pub fn of(object: &DynamicObject) -> Result<Self, String> {
        let spec = object.data.get("spec").ok_or("the pool has no spec")?;
        let spec: PoolSpec =
            serde_json::from_value(spec.clone()).map_err(|e| format!("invalid spec: {e}"))?;
        if spec.selector.match_labels.is_empty() {
            return Err("spec.selector.matchLabels is empty".into());
        }
        if spec.target_ports.is_empty() || spec.target_ports.iter().any(|p| p.number == 0) {
            return Err("spec.targetPorts needs at least one port number".into());
        }
        Ok(spec)
    }

    /// The pod discovery settings this pool stands for.
    pub fn pod_settings(&self, base: &K8sSettings) -> K8sSettings {
        let selector = self
            .selector
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        K8sSettings {
            label_selector: Some(selector),
            target_ports: Some(self.target_ports.iter().map(|p| p.number).collect()),
            ..base.clone()
        }
    }
}

/// Watches the pool `name` and keeps a pod watch running for its current spec.
pub async fn run(pods: PodWatch, settings: K8sSettings, name: String) {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, VERSION, KIND),
        "inferencepools",
    );
    let api: Api<DynamicObject> = match &settings.namespace {
        Some(ns) => Api::namespaced_with(pods.client.clone(), ns, &resource),
        None => Api::default_namespaced_with(pods.client.clone(), &resource),
    };
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher::watcher(api, config).default_backoff().boxed();
    let mut current: Option<(PoolSpec, tokio::task::AbortHandle)> = None;
    // Whether the last full list held the pool.
    let mut listed = false;
    while let Some(event) = events.next().await {
        let seen = match event {
            Ok(Event::Init) => {
                listed = false;
                continue;
            }
            Ok(Event::InitApply(pool)) => {
                listed = true;
                Some(pool)
            }
            Ok(Event::InitDone) if listed => continue,
            Ok(Event::InitDone) | Ok(Event::Delete(_)) => None,
            Ok(Event::Apply(pool)) => Some(pool),
            Err(e) => {
                tracing::warn!(error = %e, pool = %name, "InferencePool watch failed; retrying");
                continue;
            }
        };
        let spec = match seen.as_ref().map(PoolSpec::of) {
            Some(Ok(spec)) => Some(spec),
            Some(Err(why)) => {
                tracing::warn!(pool = %name, %why, "the InferencePool cannot be used; keeping its last pods");
                continue;
            }
            None => None,
        };
        if current.as_ref().map(|(s, _)| s) == spec.as_ref() && spec.is_some() {
            continue;
        }
        if let Some((_, task)) = current.take() {
            task.abort();
        }
        match spec {
            Some(spec) => {
                tracing::info!(pool = %name, selector = ?spec.selector.match_labels, ports = ?spec.target_ports, "InferencePool: watching its pods");
                let task = tokio::spawn(pods.clone().watch(spec.pod_settings(&settings)));
                current = Some((spec, task.abort_handle()));
            }
            None => {
                tracing::warn!(pool = %name, "the InferencePool does not exist: no pods");
                if let Some(monitor) = pods.monitor.upgrade() {
                    if let Err(e) = monitor.apply(&pods.static_specs).await {
                        tracing::warn!(error = %e, "could not apply the static backends");
                    }
                }
                // The fleet is known: the static backends alone, ready to pick among them if
                // there are any.
                if !pods.static_specs.is_empty() {
                    pods.synced
                        .store(true, std::sync::atomic::Ordering::Release);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(spec: serde_json::Value) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p"}, "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn a_pools_selector_and_ports_become_pod_settings() {
        let spec = PoolSpec::of(&pool(serde_json::json!({
            "selector": {"matchLabels": {"app": "vllm", "model": "llama"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        })))
        .unwrap();
        let base = K8sSettings {
            namespace: Some("llm".into()),
            label_selector: None,
            port: 1,
            target_ports: None,
            model_label: "model".into(),
            role_label: "llm-d.ai/role".into(),
            inference_pool: Some("p".into()),
        };
        let pods = spec.pod_settings(&base);
        assert_eq!(pods.label_selector.as_deref(), Some("app=vllm,model=llama"));
        assert_eq!(pods.target_ports, Some(vec![8000, 8001]));
        assert_eq!(pods.namespace.as_deref(), Some("llm"));
    }

    #[test]
    fn an_unusable_pool_is_refused_with_the_reason() {
        let no_labels =
            pool(serde_json::json!({"selector": {}, "targetPorts": [{"number": 8000}]}));
        assert!(PoolSpec::of(&no_labels)
            .unwrap_err()
            .contains("matchLabels"));
        let no_ports = pool(serde_json::json!({"selector": {"matchLabels": {"a": "b"}}}));
        assert!(PoolSpec::of(&no_ports).unwrap_err().contains("targetPorts"));
        let wrong = pool(
            serde_json::json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]}),
        );
        assert!(PoolSpec::of(&wrong).unwrap_err().contains("invalid spec"));
    }
}
