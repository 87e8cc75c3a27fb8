//! deploy/: the plain manifests and the Helm chart render to valid YAML with the fields a
//! deployment needs, and the router config they carry is one `serve` accepts.
//!
//! No `helm` binary here: the chart's templates are rendered by a small renderer of the subset
//! of Go templates they use (values, release name, `quote`, `toYaml | nindent`, `if`/`else`/`end`), and
//! the test fails if a template uses anything else.

use std::path::{Path, PathBuf};

use serde_norway::Value;

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn docs(text: &str) -> Vec<Value> {
    text.split("\n---")
        .map(|d| {
            serde_norway::from_str::<Value>(d).unwrap_or_else(|e| panic!("invalid YAML: {e}\n{d}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn get<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.')
        .fold(v, |v, key| match key.parse::<usize>() {
            Ok(i) => &v[i],
            Err(_) => &v[key],
        })
}

fn kind<'a>(all: &'a [Value], kind: &str) -> &'a Value {
    all.iter()
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// The checks every rendering must pass.
fn check(all: &[Value], expect_scrape: bool) {
    let args = check_common(all, expect_scrape);
    let container = get(kind(all, "Deployment"), "spec.template.spec.containers.0");
    assert_eq!(
        get(container, "readinessProbe.httpGet.path").as_str(),
        Some("/health")
    );
    assert_eq!(get(container, "args.0").as_str(), Some("serve"));
    assert_eq!(args.discovery, "k8s");
    assert_eq!(args.label_selector.as_deref(), Some("app=vllm"));
    assert!(args.k8s().is_some());
}

/// The checks of a rendering that deploys the endpoint picker with its pool.
fn check_epp(all: &[Value]) {
    let args = check_common(all, true);
    let container = get(kind(all, "Deployment"), "spec.template.spec.containers.0");
    assert_eq!(get(container, "args.0").as_str(), Some("epp"));
    assert_eq!(
        get(container, "readinessProbe.grpc.service").as_str(),
        Some("readiness"),
        "ready once the pool's pods are listed"
    );
    let env = container["env"].as_sequence().unwrap();
    let grpc_listen = env
        .iter()
        .find(|e| e["name"].as_str() == Some("PREFIX_ROUTER_GRPC_LISTEN"))
        .expect("the gRPC address");
    let grpc_port: u64 = grpc_listen["value"]
        .as_str()
        .unwrap()
        .strip_prefix("0.0.0.0:")
        .unwrap()
        .parse()
        .unwrap();
    let role = kind(all, "Role");
    assert_eq!(
        get(role, "rules.1.resources.0").as_str(),
        Some("inferencepools")
    );
    let pool = kind(all, "InferencePool");
    assert_eq!(
        pool["apiVersion"].as_str(),
        Some("inference.networking.k8s.io/v1")
    );
    assert_eq!(
        args.inference_pool.as_deref(),
        pool["metadata"]["name"].as_str(),
        "the picker follows the pool the manifests create"
    );
    assert_eq!(args.k8s().unwrap().inference_pool, args.inference_pool);
    assert_eq!(
        get(pool, "spec.selector.matchLabels.app").as_str(),
        Some("vllm")
    );
    assert_eq!(get(pool, "spec.targetPorts.0.number").as_u64(), Some(8000));
    // The pool names the picker's Service and its gRPC port.
    let service = kind(all, "Service");
    assert_eq!(
        get(pool, "spec.endpointPickerRef.name"),
        &service["metadata"]["name"]
    );
    let grpc = service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["name"].as_str() == Some("grpc"))
        .expect("a gRPC Service port");
    assert_eq!(grpc["port"].as_u64(), Some(grpc_port));
    assert_eq!(
        get(pool, "spec.endpointPickerRef.port.number").as_u64(),
        Some(grpc_port)
    );
    let route = kind(all, "HTTPRoute");
    assert_eq!(
        get(route, "spec.rules.0.backendRefs.0.kind").as_str(),
        Some("InferencePool")
    );
    assert_eq!(
        get(route, "spec.rules.0.backendRefs.0.name"),
        &pool["metadata"]["name"]
    );
}

/// What the gateway and the picker deployments share; returns the config the ConfigMap
/// carries, as `serve` reads it.
fn check_common(all: &[Value], expect_scrape: bool) -> prefix_router::serve::ServeArgs {
    let role = kind(all, "Role");
    assert_eq!(get(role, "rules.0.resources.0").as_str(), Some("pods"));
    let verbs: Vec<&str> = get(role, "rules.0.verbs")
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(verbs, ["get", "list", "watch"]);
    let binding = kind(all, "RoleBinding");
    let account = kind(all, "ServiceAccount")["metadata"]["name"]
        .as_str()
        .unwrap();
    assert_eq!(get(binding, "subjects.0.name").as_str(), Some(account));
    assert_eq!(get(binding, "roleRef.name"), &role["metadata"]["name"]);

    let deployment = kind(all, "Deployment");
    let pod = get(deployment, "spec.template");
    assert_eq!(get(pod, "spec.serviceAccountName").as_str(), Some(account));
    let container = get(pod, "spec.containers.0");
    assert_eq!(
        get(container, "livenessProbe.httpGet.path").as_str(),
        Some("/health")
    );
    let env = container["env"].as_sequence().unwrap();
    let listen = env
        .iter()
        .find(|e| e["name"].as_str() == Some("PREFIX_ROUTER_LISTEN"))
        .unwrap();
    assert!(
        listen["value"].as_str().unwrap().starts_with("0.0.0.0:"),
        "listens on every interface"
    );
    assert!(container["resources"]["requests"]["cpu"].is_string());
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(
        annotations["prometheus.io/scrape"].as_str() == Some("true"),
        expect_scrape,
        "{annotations:?}"
    );
    assert!(kind(all, "Service")["spec"]["ports"][0]["port"].is_number());

    // The router config in the ConfigMap is accepted by `serve` (written out, then parsed).
    let toml = kind(all, "ConfigMap")["data"]["router.toml"]
        .as_str()
        .unwrap();
    static WRITTEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let file = std::env::temp_dir().join(format!(
        "deploy-router-{}-{}.toml",
        std::process::id(),
        WRITTEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::write(&file, toml).unwrap();
    let args = prefix_router::serve::ServeArgs::from_words(&[
        "--config".into(),
        file.display().to_string(),
    ])
    .unwrap();
    std::fs::remove_file(&file).unwrap();
    args
}

#[test]
fn plain_manifests_are_complete() {
    let text = std::fs::read_to_string(deploy().join("manifests/prefix-router.yaml")).unwrap();
    check(&docs(&text), true);
    let text = std::fs::read_to_string(deploy().join("manifests/epp.yaml")).unwrap();
    check_epp(&docs(&text));
}

#[test]
fn the_helm_chart_mounts_the_tenants_keys_file_from_a_secret() {
    let dir = deploy().join("helm/prefix-router");
    let mut values: Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("values.yaml")).unwrap()).unwrap();
    let all = render_chart(&dir, values.clone());
    let toml = kind(&all, "ConfigMap")["data"]["router.toml"]
        .as_str()
        .unwrap();
    assert!(!toml.contains("api-keys-file"), "{toml}");
    values["tenants"]["secretName"] = Value::from("router-keys");
    let all = render_chart(&dir, values);
    let args = check_common(&all, true);
    let path = args
        .tenants
        .api_keys_file
        .expect("the keys file is configured");
    let pod = get(kind(&all, "Deployment"), "spec.template.spec");
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["secret"]["secretName"].as_str() == Some("router-keys"))
        .expect("the Secret is a volume");
    let mount = get(pod, "containers.0.volumeMounts")
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("and it is mounted");
    assert_eq!(
        path,
        std::path::Path::new(mount["mountPath"].as_str().unwrap()).join("keys.toml")
    );
}

#[test]
fn the_helm_chart_deploys_the_endpoint_picker_with_its_pool() {
    let dir = deploy().join("helm/prefix-router");
    let mut values: Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("values.yaml")).unwrap()).unwrap();
    // Off by default: no pool, no route.
    let all = render_chart(&dir, values.clone());
    assert!(!all
        .iter()
        .any(|d| matches!(d["kind"].as_str(), Some("InferencePool" | "HTTPRoute"))));
    values["epp"]["enabled"] = Value::from(true);
    // No Gateway named: the pool, no route.
    let all = render_chart(&dir, values.clone());
    assert!(all
        .iter()
        .any(|d| d["kind"].as_str() == Some("InferencePool")));
    assert!(!all.iter().any(|d| d["kind"].as_str() == Some("HTTPRoute")));
    values["epp"]["gateway"] = Value::from("inference-gateway");
    let all = render_chart(&dir, values);
    check_epp(&all);
    assert_eq!(
        get(kind(&all, "HTTPRoute"), "spec.parentRefs.0.name").as_str(),
        Some("inference-gateway")
    );
}

// ---- a renderer for the chart's template subset ----------------------------------------------

fn lookup<'a>(ctx: &'a Value, path: &str) -> &'a Value {
    let path = path.trim().trim_start_matches('.');
    path.split('.').fold(ctx, |v, key| &v[key])
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

fn eval(expr: &str, ctx: &Value) -> String {
    let mut stages = expr.split('|').map(str::trim);
    let head = stages.next().unwrap();
    let mut out = if let Some(path) = head.strip_prefix("toYaml ") {
        serde_norway::to_string(lookup(ctx, path))
            .unwrap()
            .trim_end()
            .to_owned()
    } else if let Some(file) = head.strip_prefix(".Files.Get ") {
        let dir = PathBuf::from(ctx["ChartDir"].as_str().unwrap());
        std::fs::read_to_string(dir.join(file.trim().trim_matches('"')))
            .unwrap_or_else(|e| panic!("{file}: {e}"))
            .trim_end()
            .to_owned()
    } else {
        scalar(lookup(ctx, head))
    };
    for stage in stages {
        out = match stage.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["quote"] => format!("{out:?}"),
            ["nindent", n] => {
                let pad = " ".repeat(n.parse().unwrap());
                out.lines().map(|l| format!("\n{pad}{l}")).collect()
            }
            other => panic!("template function {other:?} is not supported by the test renderer"),
        };
    }
    out
}

fn truthy(v: &Value) -> bool {
    !matches!(v, Value::Null | Value::Bool(false)) && v.as_str() != Some("")
}

fn render(template: &str, ctx: &Value) -> String {
    let mut out = String::new();
    let mut rest = template;
    // A stack of "is this branch shown" for if/end.
    let mut shown = vec![true];
    while let Some(start) = rest.find("{{") {
        let mut before = &rest[..start];
        let end = rest[start..].find("}}").expect("closed action") + start;
        let mut action = &rest[start + 2..end];
        let mut after = &rest[end + 2..];
        if let Some(a) = action.strip_prefix('-') {
            before = before.trim_end();
            action = a;
        }
        if let Some(a) = action.strip_suffix('-') {
            after = after.trim_start();
            action = a;
        }
        if shown.iter().all(|s| *s) {
            out.push_str(before);
        }
        let action = action.trim();
        if let Some(cond) = action.strip_prefix("if ") {
            shown.push(truthy(lookup(ctx, cond)));
        } else if action == "else" {
            let branch = shown.pop().expect("else inside an if");
            shown.push(!branch);
        } else if action == "end" {
            shown.pop().expect("balanced if/end");
        } else if shown.iter().all(|s| *s) {
            out.push_str(&eval(action, ctx));
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

fn render_chart(dir: &Path, values: Value) -> Vec<Value> {
    let chart: Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("Chart.yaml")).unwrap()).unwrap();
    let ctx = serde_norway::to_value(serde_json::json!({
        "Release": {"Name": "r1", "Namespace": "llm"},
    }))
    .unwrap();
    let mut ctx = ctx;
    ctx["Values"] = values;
    ctx["ChartDir"] = Value::from(dir.display().to_string());
    ctx["Chart"] = serde_norway::to_value(serde_json::json!({"Name": chart["name"].as_str(), "AppVersion": chart["appVersion"].as_str()})).unwrap();
    let mut all = Vec::new();
    let mut templates: Vec<_> = std::fs::read_dir(dir.join("templates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    templates.sort();
    for t in templates {
        all.extend(docs(&render(&std::fs::read_to_string(&t).unwrap(), &ctx)));
    }
    all
}

#[test]
fn the_helm_chart_renders_with_its_values() {
    let dir = deploy().join("helm/prefix-router");
    let values: Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("values.yaml")).unwrap()).unwrap();
    let all = render_chart(&dir, values.clone());
    check(&all, true);
    assert_eq!(
        get(kind(&all, "Deployment"), "spec.replicas").as_u64(),
        Some(1)
    );

    // Several replicas sharing PostgreSQL, no scrape annotations.
    let mut shared = values;
    shared["replicaCount"] = Value::from(3);
    shared["router"]["store"] = Value::from("postgres://router@postgres/router");
    shared["metrics"]["scrape"] = Value::from(false);
    let all = render_chart(&dir, shared);
    check(&all, false);
    assert_eq!(
        get(kind(&all, "Deployment"), "spec.replicas").as_u64(),
        Some(3)
    );
    let toml = kind(&all, "ConfigMap")["data"]["router.toml"]
        .as_str()
        .unwrap();
    assert!(
        toml.contains("store = \"postgres://router@postgres/router\""),
        "{toml}"
    );
    assert!(!toml.contains("replica-bus ="), "{toml}");

    // Several replicas on a replica bus deployed with the release: the config names its
    // Service, and serve accepts the config.
    let mut bus =
        serde_norway::from_str::<Value>(&std::fs::read_to_string(dir.join("values.yaml")).unwrap())
            .unwrap();
    bus["replicaCount"] = Value::from(3);
    bus["replicaBus"]["deploy"] = Value::from(true);
    let all = render_chart(&dir, bus);
    check(&all, true);
    let nats = all
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("Service")
                && d["metadata"]["name"].as_str() == Some("r1-nats")
        })
        .expect("a NATS Service");
    assert_eq!(get(nats, "spec.ports.0.port").as_u64(), Some(4222));
    let toml = kind(&all, "ConfigMap")["data"]["router.toml"]
        .as_str()
        .unwrap();
    assert!(
        toml.contains("replica-bus = \"nats://r1-nats:4222\""),
        "{toml}"
    );
    let file = std::env::temp_dir().join(format!("router-bus-{}.toml", std::process::id()));
    std::fs::write(&file, toml).unwrap();
    let args = prefix_router::serve::ServeArgs::from_words(&[
        "--config".into(),
        file.display().to_string(),
    ])
    .unwrap();
    std::fs::remove_file(&file).unwrap();
    assert_eq!(args.bus.replica_bus.as_deref(), Some("nats://r1-nats:4222"));
    assert_eq!(args.bus.replica_bus_subject, "prefix-router");

    // The dashboard for Grafana's sidecar: the same JSON as deploy/grafana, labelled.
    let mut graf =
        serde_norway::from_str::<Value>(&std::fs::read_to_string(dir.join("values.yaml")).unwrap())
            .unwrap();
    assert!(!render_chart(&dir, graf.clone())
        .iter()
        .any(|d| d["metadata"]["name"].as_str() == Some("r1-prefix-router-dashboard")));
    graf["grafana"]["dashboard"] = Value::from(true);
    let all = render_chart(&dir, graf);
    let cm = all
        .iter()
        .find(|d| d["metadata"]["name"].as_str() == Some("r1-prefix-router-dashboard"))
        .expect("the dashboard ConfigMap");
    assert_eq!(
        get(cm, "metadata.labels.grafana_dashboard").as_str(),
        Some("1")
    );
    let shipped: serde_json::Value =
        serde_json::from_str(cm["data"]["prefix-router.json"].as_str().unwrap()).unwrap();
    let source: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(deploy().join("grafana/prefix-router.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(shipped, source);
}
