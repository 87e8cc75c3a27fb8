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
//
// Values and variables (`.Values.x`, `$.Values.x`, `.`, `$k`, `$v.field`), string and number
// literals; `if`/`else`/`end`, `range $k, $v := X` and `range X`; the functions `quote`,
// `toYaml`, `toJson`, `nindent`, `indent`, `default`, `required`, `not`, `or` and `.Files.Get`.
// Anything else fails the test, so the chart stays within what is checked here.

#[derive(Debug)]
enum Node {
    Text(String),
    Expr(String),
    If(String, Vec<Node>, Vec<Node>),
    Range(Option<(String, String)>, String, Vec<Node>),
}

/// The template as text and actions, with `{{-` and `-}}` trimming applied.
fn tokens(template: &str) -> Vec<(bool, String)> {
    let mut out: Vec<(bool, String)> = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        let end = rest[start..].find("}}").expect("closed action") + start;
        let mut before = rest[..start].to_owned();
        let mut action = &rest[start + 2..end];
        let mut after = &rest[end + 2..];
        if let Some(a) = action.strip_prefix('-') {
            before = before.trim_end().to_owned();
            action = a;
        }
        if let Some(a) = action.strip_suffix('-') {
            after = after.trim_start();
            action = a;
        }
        out.push((false, before));
        out.push((true, action.trim().to_owned()));
        rest = after;
    }
    out.push((false, rest.to_owned()));
    out
}

/// Parses tokens into nodes up to an `end` or `else` (returned).
fn parse(
    tokens: &mut std::iter::Peekable<std::vec::IntoIter<(bool, String)>>,
) -> (Vec<Node>, Option<String>) {
    let mut nodes = Vec::new();
    while let Some((action, text)) = tokens.next() {
        if !action {
            nodes.push(Node::Text(text));
            continue;
        }
        if let Some(cond) = text.strip_prefix("if ") {
            let (then, stop) = parse(tokens);
            let otherwise = match stop.as_deref() {
                Some("else") => parse(tokens).0,
                Some("end") => Vec::new(),
                other => panic!("if without end: {other:?}"),
            };
            nodes.push(Node::If(cond.to_owned(), then, otherwise));
        } else if let Some(spec) = text.strip_prefix("range ") {
            let (vars, expr) = match spec.split_once(":=") {
                Some((vars, expr)) => {
                    let (k, v) = vars.split_once(',').expect("range $k, $v := X");
                    (
                        Some((k.trim().to_owned(), v.trim().to_owned())),
                        expr.trim().to_owned(),
                    )
                }
                None => (None, spec.trim().to_owned()),
            };
            let (body, stop) = parse(tokens);
            assert_eq!(stop.as_deref(), Some("end"), "range without end");
            nodes.push(Node::Range(vars, expr, body));
        } else if text == "end" || text == "else" {
            return (nodes, Some(text));
        } else if text.starts_with("/*") {
            // A comment.
        } else {
            nodes.push(Node::Expr(text));
        }
    }
    (nodes, None)
}

struct Scope<'a> {
    root: &'a Value,
    dot: Value,
    vars: Vec<(String, Value)>,
}

impl Scope<'_> {
    fn term(&self, term: &str) -> Value {
        let term = term.trim();
        if let Some(s) = term.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
            return Value::from(s.replace("\\\"", "\""));
        }
        if let Ok(n) = term.parse::<i64>() {
            return Value::from(n);
        }
        let (base, path) = if let Some(rest) = term.strip_prefix("$.") {
            (self.root.clone(), rest.to_owned())
        } else if let Some(rest) = term.strip_prefix('$') {
            let (name, path) = rest.split_once('.').unwrap_or((rest, ""));
            let value = self
                .vars
                .iter()
                .rev()
                .find(|(n, _)| n == &format!("${name}"))
                .unwrap_or_else(|| panic!("unknown variable ${name}"))
                .1
                .clone();
            (value, path.to_owned())
        } else if term == "." {
            return self.dot.clone();
        } else if ["Values", "Release", "Chart", "Files"]
            .iter()
            .any(|r| term.starts_with(&format!(".{r}")))
        {
            (self.root.clone(), term[1..].to_owned())
        } else if let Some(rest) = term.strip_prefix('.') {
            (self.dot.clone(), rest.to_owned())
        } else {
            panic!("template term {term:?} is not supported by the test renderer")
        };
        path.split('.')
            .filter(|k| !k.is_empty())
            .fold(base, |v, key| v[key].clone())
    }

    /// Evaluates a pipeline to a value.
    fn eval(&self, expr: &str) -> Value {
        let mut stages = split_pipes(expr).into_iter();
        let head = stages.next().unwrap();
        let mut value = self.call(&words(&head), None);
        for stage in stages {
            value = self.call(&words(&stage), Some(value));
        }
        value
    }

    /// A function call or a term; `piped` is the previous stage's value (the last argument).
    fn call(&self, words: &[String], piped: Option<Value>) -> Value {
        let mut args: Vec<Value> = Vec::new();
        let arg = |i: usize, args: &mut Vec<Value>| -> Value {
            args.get(i).cloned().unwrap_or(Value::Null)
        };
        let name = words[0].as_str();
        let rest: Vec<Value> = words[1..]
            .iter()
            .map(|w| {
                if w.starts_with('(') {
                    self.eval(w.trim_start_matches('(').trim_end_matches(')'))
                } else {
                    self.term(w)
                }
            })
            .collect();
        args.extend(rest);
        let was_piped = piped.is_some();
        args.extend(piped);
        let text = |v: &Value| -> String {
            match v {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                Value::Null => String::new(),
                other => panic!("not a scalar: {other:?}"),
            }
        };
        match name {
            "quote" => Value::from(format!("{:?}", text(&arg(0, &mut args)))),
            "toYaml" => Value::from(
                serde_norway::to_string(&arg(0, &mut args))
                    .unwrap()
                    .trim_end()
                    .to_owned(),
            ),
            "toJson" => Value::from(serde_json::to_string(&arg(0, &mut args)).unwrap()),
            "nindent" | "indent" => {
                let n: usize = text(&arg(0, &mut args)).parse().unwrap();
                let pad = " ".repeat(n);
                let body: String = text(&arg(1, &mut args))
                    .lines()
                    .map(|l| format!("\n{pad}{l}"))
                    .collect();
                Value::from(if name == "indent" {
                    body.trim_start_matches('\n').to_owned()
                } else {
                    body
                })
            }
            "default" => {
                let v = arg(1, &mut args);
                if truthy(&v) {
                    v
                } else {
                    arg(0, &mut args)
                }
            }
            "required" => {
                let v = arg(1, &mut args);
                assert!(truthy(&v), "required: {}", text(&arg(0, &mut args)));
                v
            }
            "not" => Value::from(!truthy(&arg(0, &mut args))),
            "or" => {
                let a = arg(0, &mut args);
                if truthy(&a) {
                    a
                } else {
                    arg(1, &mut args)
                }
            }
            ".Files.Get" => {
                let dir = PathBuf::from(self.root["ChartDir"].as_str().unwrap());
                let file = text(&arg(0, &mut args));
                Value::from(
                    std::fs::read_to_string(dir.join(&file))
                        .unwrap_or_else(|e| panic!("{file}: {e}"))
                        .trim_end()
                        .to_owned(),
                )
            }
            term if words.len() == 1 && !was_piped => self.term(term),
            other => panic!("template function {other:?} is not supported by the test renderer"),
        }
    }
}

/// Splits a pipeline at the `|` outside quotes and parentheses.
fn split_pipes(expr: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth, mut quoted) = (Vec::new(), String::new(), 0, false);
    for c in expr.chars() {
        match c {
            '"' => quoted = !quoted,
            '(' if !quoted => depth += 1,
            ')' if !quoted => depth -= 1,
            '|' if !quoted && depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out
}

/// The words of a call: terms, quoted strings and parenthesized pipelines.
fn words(stage: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth, mut quoted) = (Vec::new(), String::new(), 0, false);
    for c in stage.trim().chars() {
        match c {
            '"' => quoted = !quoted,
            '(' if !quoted => depth += 1,
            ')' if !quoted => depth -= 1,
            ' ' if !quoted && depth == 0 => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => false,
        Value::String(s) => !s.is_empty(),
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::Sequence(s) => !s.is_empty(),
        Value::Mapping(m) => !m.is_empty(),
        _ => true,
    }
}

fn emit(nodes: &[Node], scope: &mut Scope<'_>, out: &mut String) {
    for node in nodes {
        match node {
            Node::Text(t) => out.push_str(t),
            Node::Expr(e) => match scope.eval(e) {
                Value::String(s) => out.push_str(&s),
                Value::Number(n) => out.push_str(&n.to_string()),
                Value::Bool(b) => out.push_str(&b.to_string()),
                Value::Null => {}
                other => panic!("{e} is not a scalar: {other:?}"),
            },
            Node::If(cond, then, otherwise) => {
                let branch = if truthy(&scope.eval(cond)) {
                    then
                } else {
                    otherwise
                };
                emit(branch, scope, out);
            }
            Node::Range(vars, expr, body) => {
                let items: Vec<(Value, Value)> = match scope.eval(expr) {
                    Value::Sequence(items) => items
                        .into_iter()
                        .enumerate()
                        .map(|(i, v)| (Value::from(i as u64), v))
                        .collect(),
                    Value::Mapping(map) => {
                        let mut pairs: Vec<(Value, Value)> = map.into_iter().collect();
                        pairs.sort_by_key(|(k, _)| k.as_str().unwrap_or_default().to_owned());
                        pairs
                    }
                    Value::Null => Vec::new(),
                    other => panic!("range over {other:?}"),
                };
                for (k, v) in items {
                    let saved = std::mem::replace(&mut scope.dot, v.clone());
                    let depth = scope.vars.len();
                    if let Some((kn, vn)) = vars {
                        scope.vars.push((kn.clone(), k));
                        scope.vars.push((vn.clone(), v));
                    }
                    emit(body, scope, out);
                    scope.vars.truncate(depth);
                    scope.dot = saved;
                }
            }
        }
    }
}

fn render(template: &str, ctx: &Value) -> String {
    let mut tokens = tokens(template).into_iter().peekable();
    let (nodes, stop) = parse(&mut tokens);
    assert!(stop.is_none(), "unbalanced {stop:?}");
    let mut scope = Scope {
        root: ctx,
        dot: ctx.clone(),
        vars: Vec::new(),
    };
    let mut out = String::new();
    emit(&nodes, &mut scope, &mut out);
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
    bus["replicaBus"]["keySecret"] = Value::from("router-bus");
    bus["replicaBus"]["authSecret"] = Value::from("router-nats");
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

fn values(dir: &Path) -> Value {
    serde_norway::from_str(&std::fs::read_to_string(dir.join("values.yaml")).unwrap()).unwrap()
}

fn env_var<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_sequence()?
        .iter()
        .find(|e| e["name"].as_str() == Some(name))
}

fn mount_of<'a>(all: &'a [Value], volume: &str) -> Option<&'a str> {
    let container = get(kind(all, "Deployment"), "spec.template.spec.containers.0");
    container["volumeMounts"]
        .as_sequence()?
        .iter()
        .find(|m| m["name"].as_str() == Some(volume))?["mountPath"]
        .as_str()
}

/// Every feature can be turned on through the chart's values, and the config it renders is one
/// `serve` accepts with that feature on.
#[test]
fn the_helm_chart_reaches_every_feature() {
    let dir = deploy().join("helm/prefix-router");
    let mut v = values(&dir);
    v["precise"]["enabled"] = Value::from(true);
    v["precise"]["tokenizers"] =
        serde_norway::from_str("meta-llama/Llama-3.1-8B-Instruct: llama\n").unwrap();
    v["precise"]["tokenizersVolume"] =
        serde_norway::from_str("persistentVolumeClaim:\n  claimName: model-cache\n").unwrap();
    v["queue"]["maxQueueWait"] = Value::from("2s");
    v["queue"]["queueWhenWaiting"] = Value::from(8);
    v["queue"]["forwardPriority"] = Value::from(true);
    v["queue"]["trustClientHeaders"] = Value::from(true);
    v["auth"]["apiKeySecret"] = Value::from("router-api-key");
    v["auth"]["backendApiKeySecret"] = Value::from("vllm-api-key");
    v["auth"]["hashSeedSecret"] = Value::from("router-seed");
    v["tenants"]["secretName"] = Value::from("router-keys");
    v["otlp"]["endpoint"] = Value::from("http://otel:4318");
    v["replicaBus"]["url"] = Value::from("tls://nats.messaging:4222");
    v["replicaBus"]["keySecret"] = Value::from("router-bus");
    v["replicaBus"]["authSecret"] = Value::from("router-nats");
    v["router"]["config"] =
        serde_norway::from_str("max-retries: 4\nkv-credit: 3s\nkv-events-max-message: 8388608\n")
            .unwrap();
    v["router"]["extraConfig"] =
        Value::from("[[backends]]\nurl = \"http://10.0.0.9:8000\"\nmodels = [\"m\"]\n");
    v["extraArgs"] = serde_norway::from_str("[\"--log\", \"debug\"]").unwrap();
    v["extraEnv"] =
        serde_norway::from_str("- name: PREFIX_ROUTER_MAX_BODY\n  value: \"1048576\"\n").unwrap();
    v["extraVolumes"] = serde_norway::from_str("- name: scratch\n  emptyDir: {}\n").unwrap();
    v["extraVolumeMounts"] =
        serde_norway::from_str("- name: scratch\n  mountPath: /scratch\n").unwrap();
    let all = render_chart(&dir, v);
    let args = check_common(&all, true);
    assert!(args.kv_events);
    assert_eq!(args.kv_replay_port, Some(5558));
    let tokenizers = args.tokenizer_dirs().unwrap();
    assert_eq!(tokenizers[0].0, "meta-llama/Llama-3.1-8B-Instruct");
    let mount = mount_of(&all, "tokenizers").expect("the tokenizers are mounted");
    assert!(
        tokenizers[0].1.starts_with(mount),
        "{tokenizers:?} under {mount}"
    );
    assert_eq!(
        args.queue.max_queue_wait,
        Some(std::time::Duration::from_secs(2))
    );
    assert_eq!(args.queue.queue_when_waiting, Some(8));
    assert!(args.queue.forward_priority && args.queue.trust_client_headers);
    assert!(args.tenants.api_keys_file.is_some());
    let key_file = args
        .access
        .api_key_file
        .clone()
        .expect("the client key file");
    assert!(key_file.starts_with(mount_of(&all, "api-key").unwrap()));
    assert_eq!(args.otlp_endpoint.as_deref(), Some("http://otel:4318"));
    assert_eq!(args.max_retries, 4);
    assert_eq!(args.kv_credit, std::time::Duration::from_secs(3));
    assert_eq!(args.kv_events_max_message, 8 << 20);
    let toml: toml::Table = kind(&all, "ConfigMap")["data"]["router.toml"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        toml["backends"][0]["url"].as_str(),
        Some("http://10.0.0.9:8000"),
        "the extra config's table"
    );
    let bus_key = args.bus.replica_bus_key_file.clone().expect("the bus key");
    assert!(bus_key.starts_with(mount_of(&all, "bus-key").unwrap()));
    assert_eq!(
        args.bus.replica_bus.as_deref(),
        Some("tls://nats.messaging:4222")
    );
    let container = get(kind(&all, "Deployment"), "spec.template.spec.containers.0");
    for (var, secret) in [
        ("PREFIX_ROUTER_BACKEND_API_KEY", "vllm-api-key"),
        ("PREFIX_ROUTER_HASH_SEED", "router-seed"),
        ("PREFIX_ROUTER_REPLICA_BUS_USER", "router-nats"),
        ("PREFIX_ROUTER_REPLICA_BUS_PASSWORD", "router-nats"),
    ] {
        let e = env_var(container, var).unwrap_or_else(|| panic!("no {var}"));
        assert_eq!(get(e, "valueFrom.secretKeyRef.name").as_str(), Some(secret));
    }
    assert_eq!(
        env_var(container, "PREFIX_ROUTER_MAX_BODY").unwrap()["value"].as_str(),
        Some("1048576")
    );
    let argv: Vec<&str> = container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        argv,
        [
            "serve",
            "--config",
            "/etc/prefix-router/router.toml",
            "--log",
            "debug"
        ]
    );
    assert_eq!(mount_of(&all, "scratch"), Some("/scratch"));
    let pod = get(kind(&all, "Deployment"), "spec.template.spec");
    let volume = |name: &str| {
        pod["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no volume {name}"))
            .clone()
    };
    assert_eq!(
        get(&volume("tokenizers"), "persistentVolumeClaim.claimName").as_str(),
        Some("model-cache")
    );
    assert_eq!(
        get(&volume("bus-key"), "secret.secretName").as_str(),
        Some("router-bus")
    );
    assert!(volume("scratch")["emptyDir"].is_mapping());
}

/// A bus deployed with the release runs with a user and password and a NetworkPolicy that
/// admits the router pods only; without the secrets the chart refuses to render.
#[test]
fn the_helm_chart_deploys_nats_with_auth_and_a_network_policy() {
    let dir = deploy().join("helm/prefix-router");
    let mut v = values(&dir);
    v["replicaBus"]["deploy"] = Value::from(true);
    let missing = std::panic::catch_unwind(|| render_chart(&dir, v.clone()));
    assert!(
        missing.is_err(),
        "a bus without its key and credentials is refused"
    );
    v["replicaBus"]["keySecret"] = Value::from("router-bus");
    v["replicaBus"]["authSecret"] = Value::from("router-nats");
    let all = render_chart(&dir, v);
    let nats = all
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("Deployment")
                && d["metadata"]["name"].as_str() == Some("r1-nats")
        })
        .unwrap();
    let container = get(nats, "spec.template.spec.containers.0");
    let argv: Vec<&str> = container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(argv.windows(2).any(|w| w == ["--user", "$(NATS_USER)"]));
    assert!(argv.windows(2).any(|w| w == ["--pass", "$(NATS_PASSWORD)"]));
    assert_eq!(
        get(
            env_var(container, "NATS_PASSWORD").unwrap(),
            "valueFrom.secretKeyRef.name"
        )
        .as_str(),
        Some("router-nats")
    );
    let policy = kind(&all, "NetworkPolicy");
    assert_eq!(
        get(
            policy,
            "spec.podSelector.matchLabels.app.kubernetes.io/name"
        )
        .as_str(),
        None,
        "labels are read as one key"
    );
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"].as_str(),
        Some("nats")
    );
    assert_eq!(
        policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
            ["app.kubernetes.io/name"]
            .as_str(),
        Some("prefix-router")
    );
    let router = get(kind(&all, "Deployment"), "spec.template.spec.containers.0");
    assert!(env_var(router, "PREFIX_ROUTER_REPLICA_BUS_PASSWORD").is_some());
}

/// The picker serves TLS from a Secret when asked.
#[test]
fn the_helm_chart_gives_the_picker_tls() {
    let dir = deploy().join("helm/prefix-router");
    let mut v = values(&dir);
    v["epp"]["enabled"] = Value::from(true);
    v["epp"]["tlsSecret"] = Value::from("picker-tls");
    v["epp"]["clientCaKey"] = Value::from("ca.crt");
    let all = render_chart(&dir, v);
    let container = get(kind(&all, "Deployment"), "spec.template.spec.containers.0");
    let mount = mount_of(&all, "grpc-tls").unwrap();
    for var in [
        "PREFIX_ROUTER_GRPC_TLS_CERT",
        "PREFIX_ROUTER_GRPC_TLS_KEY",
        "PREFIX_ROUTER_GRPC_TLS_CLIENT_CA",
    ] {
        let path = env_var(container, var).unwrap()["value"].as_str().unwrap();
        assert!(path.starts_with(mount), "{var} = {path}");
    }
}

/// A whole router.toml of one's own replaces the generated one.
#[test]
fn the_helm_chart_takes_a_whole_config() {
    let dir = deploy().join("helm/prefix-router");
    let mut v = values(&dir);
    v["router"]["configOverride"] = Value::from(
        "policy = \"prefix_load\"\ndiscovery = \"k8s\"\nlabel-selector = \"app=vllm\"\n",
    );
    let all = render_chart(&dir, v);
    let args = check_common(&all, true);
    assert_eq!(
        args.policy,
        prefix_router::serve::policy::PolicyKind::PrefixLoad
    );
}
