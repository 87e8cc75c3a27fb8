//! Kubernetes discovery against a fake API server (list + watch of pods, ADDED / MODIFIED /
//! DELETED events, and a watch that drops and must be resumed), driving a router in front of
//! simulated vLLM servers.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use parking_lot::Mutex;
use prefix_router::serve::{self, ServeArgs};
use serde_json::{json, Value};
use tokio::sync::broadcast;

#[derive(Default)]
struct Cluster {
    rv: u64,
    /// Objects by (resource, name).
    objects: BTreeMap<(String, String), Value>,
    /// (resourceVersion, type, object) of every change, for watches resuming from a version.
    log: Vec<(u64, String, Value)>,
    /// Bumped to cut every open watch.
    cut: u64,
}

#[derive(Clone)]
struct Fake {
    cluster: Arc<Mutex<Cluster>>,
    events: broadcast::Sender<(u64, String, Value)>,
}

/// The API resource an object belongs to.
fn resource(object: &Value) -> String {
    match object["kind"].as_str().unwrap() {
        "Pod" => "pods".into(),
        "InferencePool" => "inferencepools".into(),
        other => panic!("the fake API has no {other}"),
    }
}

impl Fake {
    fn new() -> Self {
        Self {
            cluster: Arc::default(),
            events: broadcast::channel(1024).0,
        }
    }

    fn change(&self, kind: &str, mut object: Value) {
        let mut c = self.cluster.lock();
        c.rv += 1;
        let rv = c.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        let key = (resource(&object), name);
        if kind == "DELETED" {
            c.objects.remove(&key);
        } else {
            c.objects.insert(key, object.clone());
        }
        c.log.push((rv, kind.to_owned(), object.clone()));
        let _ = self.events.send((rv, kind.to_owned(), object));
    }

    fn cut_watches(&self) {
        self.cluster.lock().cut += 1;
    }
}

/// Whether an object of `wanted` matches the query's label and field selectors.
fn selected(object: &Value, wanted: &str, q: &HashMap<String, String>) -> bool {
    let labels = q.get("labelSelector").is_none_or(|sel| {
        sel.split(',').all(|term| {
            let (k, v) = term.split_once('=').unwrap_or((term, ""));
            object["metadata"]["labels"][k].as_str() == Some(v)
        })
    });
    let fields = q.get("fieldSelector").is_none_or(|sel| {
        sel.split(',').all(|term| match term.split_once('=') {
            Some(("metadata.name", name)) => object["metadata"]["name"].as_str() == Some(name),
            _ => panic!("the fake API does not know the field selector {term}"),
        })
    });
    resource(object) == wanted && labels && fields
}

async fn pods(
    State(fake): State<Fake>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(fake, "pods", "PodList", ns, q)
}

async fn pools(
    State(fake): State<Fake>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(fake, "inferencepools", "InferencePoolList", ns, q)
}

fn list_or_watch(
    fake: Fake,
    wanted: &'static str,
    list_kind: &str,
    ns: String,
    q: HashMap<String, String>,
) -> Response {
    assert_eq!(ns, "llm", "the router watches the namespace it was given");
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (backlog, my_cut) = {
            let c = fake.cluster.lock();
            let backlog: Vec<_> = c
                .log
                .iter()
                .filter(|(rv, _, _)| *rv > from)
                .cloned()
                .collect();
            (backlog, c.cut)
        };
        let mut live = fake.events.subscribe();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(64);
        let cluster = fake.cluster.clone();
        tokio::spawn(async move {
            let line = |kind: &str, object: &Value| {
                bytes::Bytes::from(format!("{}\n", json!({"type": kind, "object": object})))
            };
            for (_, kind, object) in backlog {
                if selected(&object, wanted, &q) && tx.send(Ok(line(&kind, &object))).await.is_err()
                {
                    return;
                }
            }
            loop {
                tokio::select! {
                    event = live.recv() => match event {
                        Ok((rv, kind, object)) if rv > from && selected(&object, wanted, &q) => {
                            if tx.send(Ok(line(&kind, &object))).await.is_err() {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(_) => return,
                    },
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {
                        if cluster.lock().cut != my_cut {
                            return; // the watch drops
                        }
                    }
                }
            }
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ))
            .unwrap();
    }
    let c = fake.cluster.lock();
    let items: Vec<&Value> = c
        .objects
        .values()
        .filter(|o| selected(o, wanted, &q))
        .collect();
    Json(json!({
        "apiVersion": "v1", "kind": list_kind,
        "metadata": {"resourceVersion": c.rv.to_string()},
        "items": items,
    }))
    .into_response()
}

/// The fake API server on a free loopback port, and a client for it.
async fn serve_fake(fake: &Fake) -> kube::Client {
    let api = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let api_url = format!("http://{}", api.local_addr().unwrap());
    let app = Router::new()
        .route("/api/v1/namespaces/{ns}/pods", get(pods))
        .route(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
            get(pools),
        )
        .with_state(fake.clone());
    tokio::spawn(async move { axum::serve(api, app).await.unwrap() });
    kube::Client::try_from(kube::Config::new(api_url.parse().unwrap())).unwrap()
}

fn pod(name: &str, port: u16, ready: bool, extra_labels: Value) -> Value {
    let mut labels = json!({"app": "vllm"});
    for (k, v) in extra_labels.as_object().unwrap() {
        labels[k] = v.clone();
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "uid": format!("uid-{name}"), "labels": labels},
        "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "phase": "Running",
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    })
}

async fn health(router: &str) -> (u64, u64) {
    let v: Value = reqwest::get(format!("{router}/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    (
        v["backends"].as_u64().unwrap(),
        v["healthy_backends"].as_u64().unwrap(),
    )
}

async fn until(router: &str, backends: u64) {
    for _ in 0..100 {
        if health(router).await == (backends, backends) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "expected {backends} healthy backends, have {:?}",
        health(router).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_join_and_leave_through_list_and_watch() {
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let sims = vllm_sim::Fleet::start(
        vllm_sim::SimConfig {
            time_scale: 0.0,
            ..vllm_sim::SimConfig::default()
        },
        4,
        loopback,
    )
    .await
    .unwrap();
    let ports: Vec<u16> = sims.servers.iter().map(|s| s.addr.port()).collect();
    let fake = Fake::new();
    // One matching pod before the router starts, and one of another app that must be ignored.
    fake.change("ADDED", pod("vllm-0", ports[0], true, json!({})));
    let mut other = pod("db-0", ports[3], true, json!({}));
    other["metadata"]["labels"] = json!({"app": "postgres"});
    fake.change("ADDED", other);

    let client = serve_fake(&fake).await;

    let listener = tokio::net::TcpListener::bind(loopback).await.unwrap();
    let words: Vec<String> = [
        "--listen",
        &listener.local_addr().unwrap().to_string(),
        "--service-discovery",
        "k8s",
        "--k8s-namespace",
        "llm",
        "--k8s-label-selector",
        "app=vllm",
        "--health-interval",
        "100ms",
        "--metrics-interval",
        "100ms",
        "--unhealthy-after",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args = ServeArgs::from_words(&words).unwrap();
    let (running, _gw) = serve::spawn_with(args, listener, Some(client))
        .await
        .unwrap();
    let router = running.url();

    until(&router, 1).await;
    let ask = || async {
        reqwest::Client::new()
            .post(format!("{router}/v1/completions"))
            .json(&json!({"model": "sim-model", "prompt": "hello", "max_tokens": 1}))
            .send()
            .await
            .unwrap()
            .status()
    };
    assert!(ask().await.is_success());

    fake.change("ADDED", pod("vllm-1", ports[1], true, json!({})));
    until(&router, 2).await;
    // Not Ready: it leaves; Ready again: it returns.
    fake.change("MODIFIED", pod("vllm-1", ports[1], false, json!({})));
    until(&router, 1).await;
    fake.change("MODIFIED", pod("vllm-1", ports[1], true, json!({})));
    until(&router, 2).await;

    // The watch drops; a pod arrives meanwhile; the resumed watch brings it.
    fake.cut_watches();
    fake.change(
        "ADDED",
        pod("vllm-2", ports[2], true, json!({"model": "sim-model"})),
    );
    until(&router, 3).await;

    // Deleted: it leaves, and requests go to the others.
    fake.change("DELETED", pod("vllm-0", ports[0], true, json!({})));
    until(&router, 2).await;
    let before = metric_sum(&sims.urls()[0]).await;
    for _ in 0..6 {
        assert!(ask().await.is_success());
    }
    assert_eq!(
        metric_sum(&sims.urls()[0]).await,
        before,
        "no request for the deleted pod"
    );

    // Its address changes (here the port): the old backend leaves, the new one joins.
    fake.change(
        "MODIFIED",
        pod("vllm-2", ports[3], true, json!({"model": "sim-model"})),
    );
    for _ in 0..100 {
        let text = reqwest::get(format!("{router}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let healthy: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("prefix_router_backend_healthy{"))
            .collect();
        let has = |port: u16| {
            healthy.iter().any(|l| {
                l.contains(&format!("backend=\"http://127.0.0.1:{port}\"")) && l.ends_with(" 1")
            })
        };
        if has(ports[3])
            && !healthy
                .iter()
                .any(|l| l.contains(&format!(":{}\"", ports[2])))
        {
            running.shutdown().await;
            sims.shutdown().await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the moved pod did not move");
}

async fn metric_sum(sim: &str) -> f64 {
    let text = reqwest::get(format!("{sim}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with("vllm:request_success_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn pool(selector: Value, ports: &[u16]) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": "llm", "uid": "uid-pool"},
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
            "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}},
        },
    })
}

/// The healthy backends' URLs, from `/metrics`.
async fn healthy_backends(url: &str) -> Vec<String> {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut urls: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("prefix_router_backend_healthy{") && l.ends_with(" 1"))
        .filter_map(|l| Some(l.split("backend=\"").nth(1)?.split('"').next()?.to_owned()))
        .collect();
    urls.sort();
    urls
}

async fn until_backends(url: &str, want: &[u16]) {
    let mut want: Vec<String> = want
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    want.sort();
    for _ in 0..100 {
        if healthy_backends(url).await == want && health(url).await.0 == want.len() as u64 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "expected backends {want:?}, have {:?}",
        healthy_backends(url).await
    );
}

async fn readiness(grpc: &str) -> i32 {
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        tonic::transport::Channel::from_shared(grpc.to_owned())
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "readiness".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_picker_follows_its_inference_pool() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let sims = vllm_sim::Fleet::start(
        vllm_sim::SimConfig {
            time_scale: 0.0,
            ..vllm_sim::SimConfig::default()
        },
        3,
        loopback,
    )
    .await
    .unwrap();
    let ports: Vec<u16> = sims.servers.iter().map(|s| s.addr.port()).collect();
    let fake = Fake::new();
    // One pod; the pool's target ports make it several endpoints (as for data-parallel ranks).
    fake.change("ADDED", pod("vllm-0", 1, true, json!({})));
    let client = serve_fake(&fake).await;
    let picker = common::envoy::picker_with(
        &[],
        &["--inference-pool", "llama", "--namespace", "llm"],
        Some(client),
    )
    .await;
    let router = picker.http.url();
    let grpc = picker.grpc_url();

    // No pool yet: alive, not ready, no backends.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(readiness(&grpc).await, ServingStatus::NotServing as i32);
    assert_eq!(health(&router).await, (0, 0));

    fake.change("ADDED", pool(json!({"app": "vllm"}), &ports[..2]));
    until_backends(&router, &ports[..2]).await;
    let mut ready = false;
    for _ in 0..100 {
        ready = readiness(&grpc).await == ServingStatus::Serving as i32;
        if ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "ready once the pool's pods are listed");

    // A port added to the pool: one more endpoint.
    fake.change("MODIFIED", pool(json!({"app": "vllm"}), &ports));
    until_backends(&router, &ports).await;
    // The pod stops being Ready, then is again.
    fake.change("MODIFIED", pod("vllm-0", 1, false, json!({})));
    until_backends(&router, &[]).await;
    fake.change("MODIFIED", pod("vllm-0", 1, true, json!({})));
    until_backends(&router, &ports).await;
    // A selector the pod does not match: no endpoints.
    fake.change(
        "MODIFIED",
        pool(json!({"app": "vllm", "tier": "gold"}), &ports),
    );
    until_backends(&router, &[]).await;
    fake.change("MODIFIED", pod("vllm-0", 1, true, json!({"tier": "gold"})));
    until_backends(&router, &ports).await;
    // The pool deleted: nothing; created again, on one port: its endpoint.
    fake.change("DELETED", pool(json!({"app": "vllm"}), &ports));
    until_backends(&router, &[]).await;
    fake.change("ADDED", pool(json!({"app": "vllm"}), &ports[2..]));
    until_backends(&router, &ports[2..]).await;
    drop(picker);
    sims.shutdown().await;
}

/// A picker with static backends whose InferencePool does not exist (yet) is ready to pick
/// among the static ones: readiness does not wait for a pool that may never come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_pool_leaves_a_picker_with_static_backends_ready() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let sims = vllm_sim::Fleet::start(
        vllm_sim::SimConfig {
            time_scale: 0.0,
            ..vllm_sim::SimConfig::default()
        },
        1,
        loopback,
    )
    .await
    .unwrap();
    let fake = Fake::new();
    let client = serve_fake(&fake).await;
    let picker = common::envoy::picker_with(
        &sims.urls(),
        &["--inference-pool", "llama", "--namespace", "llm"],
        Some(client),
    )
    .await;
    let grpc = picker.grpc_url();
    let mut ready = false;
    for _ in 0..100 {
        ready = readiness(&grpc).await == ServingStatus::Serving as i32;
        if ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        ready,
        "ready with its static backend while the pool is missing"
    );
    drop(picker);
    sims.shutdown().await;
}
