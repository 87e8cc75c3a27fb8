//! The string server over HTTP, started in-process on a free loopback port.

use prefix_router::index::{self, IndexArgs};
use prefix_router::server::Running;
use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};

async fn start(configure: impl FnOnce(&mut IndexArgs)) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut args = IndexArgs::with_listen(listener.local_addr().unwrap());
    args.store.chunk_size = 4;
    configure(&mut args);
    index::spawn(args, listener).await.unwrap()
}

async fn call(
    server: &Running,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut req = Client::new().request(method, format!("{}{path}", server.url()));
    if let Some(body) = body {
        req = req.json(&body);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn raw(
    server: &Running,
    method: Method,
    path: &str,
    body: &'static [u8],
) -> (StatusCode, Value) {
    let resp = Client::new()
        .request(method, format!("{}{path}", server.url()))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test]
async fn notify_query_servers_capacity_delete() {
    let server = start(|_| {}).await;
    let (s, v) = call(
        &server,
        Method::POST,
        "/v1/notify",
        Some(json!({"request": "aaaabbbbccccdd", "server_id": 7, "t": 100.0})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v, json!({"chunks": 4, "inserted": 4, "evicted": 0}));
    call(
        &server,
        Method::POST,
        "/v1/notify",
        Some(json!({"request": "aaaabbbb", "server_id": 3})),
    )
    .await;

    let (s, v) = call(
        &server,
        Method::POST,
        "/v1/query",
        Some(json!({"request": "aaaabbbbccccXX", "server_ids": [3, 7, 11], "t": 101.0})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({
            "server_id": 7, "matched_chunks": 3, "total_chunks": 4,
            "matches": [
                {"server_id": 3, "matched_chunks": 2},
                {"server_id": 7, "matched_chunks": 3},
                {"server_id": 11, "matched_chunks": 0}
            ]
        })
    );

    let (_, v) = call(&server, Method::GET, "/v1/servers", None).await;
    assert_eq!(
        v,
        json!({"servers": [
            {"server_id": 3, "chunks": 2, "capacity": 16384},
            {"server_id": 7, "chunks": 4, "capacity": 16384}
        ]})
    );

    let (s, v) = call(
        &server,
        Method::PUT,
        "/v1/servers/7",
        Some(json!({"capacity": 1})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["evicted"], 3);
    let (s, v) = call(&server, Method::DELETE, "/v1/servers/3", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["removed"], 2);
    let (_, v) = call(&server, Method::GET, "/v1/servers", None).await;
    assert_eq!(
        v,
        json!({"servers": [{"server_id": 7, "chunks": 1, "capacity": 1}]})
    );

    let (s, v) = call(&server, Method::GET, "/health", None).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"status": "ok"})));

    let resp = Client::new()
        .get(format!("{}/metrics", server.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let text = resp.text().await.unwrap();
    for needle in [
        "prefix_index_http_requests_total{endpoint=\"POST /v1/notify\",status=\"200\"} 2",
        "prefix_index_http_request_duration_seconds_bucket{",
        "prefix_index_entries{server_id=\"7\"} 1",
        "prefix_index_capacity{server_id=\"7\"} 1",
        "prefix_index_evicted_entries_total{server_id=\"7\"} 3",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    server.shutdown().await;
}

/// Every malformed input gets a 4xx in OpenAI's error shape and leaves the index unchanged.
#[tokio::test]
async fn bad_input_is_refused_and_changes_nothing() {
    let server = start(|args| args.max_body = 1024).await;
    call(
        &server,
        Method::POST,
        "/v1/notify",
        Some(json!({"request": "aaaabbbb", "server_id": 1, "t": 5.0})),
    )
    .await;
    let snapshot = call(&server, Method::GET, "/v1/servers", None).await;

    let cases: Vec<(Method, &str, &'static [u8], StatusCode)> = vec![
        (
            Method::POST,
            "/v1/notify",
            b"not json",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\", \"server_id\": 1",
            StatusCode::BAD_REQUEST,
        ),
        (Method::POST, "/v1/notify", b"", StatusCode::BAD_REQUEST),
        (Method::POST, "/v1/notify", b"[]", StatusCode::BAD_REQUEST),
        (
            Method::POST,
            "/v1/notify",
            b"{\"server_id\": 1}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\"}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": 5, \"server_id\": 1}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\", \"server_id\": \"1\"}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\", \"server_id\": -1}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\", \"server_id\": 1.5}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\", \"server_id\": 18446744073709551616}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\", \"server_id\": 1, \"t\": -3}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\", \"server_id\": 1, \"t\": \"now\"}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"aaaa\", \"server_id\": 1, \"extra\": true}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/notify",
            b"{\"request\": \"\xff\xfe\", \"server_id\": 1}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/query",
            b"{\"request\": \"aaaa\", \"server_ids\": []}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/query",
            b"{\"request\": \"aaaa\", \"server_ids\": [1, -2]}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/query",
            b"{\"request\": \"aaaa\", \"server_ids\": 1}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/v1/query",
            b"{\"request\": \"aaaa\"}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::PUT,
            "/v1/servers/abc",
            b"{\"capacity\": 3}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::PUT,
            "/v1/servers/-1",
            b"{\"capacity\": 3}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::PUT,
            "/v1/servers/1",
            b"{\"capacity\": -3}",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::PUT,
            "/v1/servers/1",
            b"{\"capacity\": 99999999999}",
            StatusCode::BAD_REQUEST,
        ),
        (Method::PUT, "/v1/servers/1", b"{}", StatusCode::BAD_REQUEST),
        (
            Method::DELETE,
            "/v1/servers/99999999999999999999",
            b"",
            StatusCode::BAD_REQUEST,
        ),
        (Method::GET, "/v1/nowhere", b"", StatusCode::NOT_FOUND),
        (
            Method::GET,
            "/v1/notify",
            b"",
            StatusCode::METHOD_NOT_ALLOWED,
        ),
        (
            Method::PATCH,
            "/v1/servers/1",
            b"{\"capacity\": 3}",
            StatusCode::METHOD_NOT_ALLOWED,
        ),
    ];
    for (method, path, body, expected) in cases {
        let (status, v) = raw(&server, method.clone(), path, body).await;
        let shown = String::from_utf8_lossy(body);
        assert_eq!(status, expected, "{method} {path} {shown}: {v}");
        assert_eq!(
            v["error"]["code"],
            expected.as_u16(),
            "{method} {path} {shown}: {v}"
        );
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        assert!(v["error"]["type"].is_string(), "{v}");
    }

    // Over the body limit: 413, also in the JSON shape.
    let big = json!({"request": "x".repeat(4096), "server_id": 1});
    let (status, v) = call(&server, Method::POST, "/v1/notify", Some(big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(v["error"]["code"], 413);

    assert_eq!(
        call(&server, Method::GET, "/v1/servers", None).await,
        snapshot
    );
    let (_, v) = call(
        &server,
        Method::POST,
        "/v1/query",
        Some(json!({"request": "aaaabbbb", "server_ids": [1], "t": 6.0})),
    )
    .await;
    assert_eq!(v["matched_chunks"], 2);
    server.shutdown().await;
}

#[tokio::test]
async fn ttl_from_the_command_line_hides_old_entries() {
    let server = start(|args| args.store.ttl = Some(10.0)).await;
    call(
        &server,
        Method::POST,
        "/v1/notify",
        Some(json!({"request": "aaaabbbb", "server_id": 1, "t": 100.0})),
    )
    .await;
    let q = |t: f64| json!({"request": "aaaabbbb", "server_ids": [1], "t": t});
    assert_eq!(
        call(&server, Method::POST, "/v1/query", Some(q(109.0)))
            .await
            .1["matched_chunks"],
        2
    );
    assert_eq!(
        call(&server, Method::POST, "/v1/query", Some(q(111.0)))
            .await
            .1["matched_chunks"],
        0
    );
    server.shutdown().await;
}

/// The real binary: starts on a free port, answers, and exits cleanly on SIGTERM.
#[tokio::test]
async fn binary_serves_and_stops_on_sigterm() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_prefix-router"))
        .args(["index", "--listen", "127.0.0.1:0", "--chunk-size", "4"])
        .env("PREFIX_ROUTER_LOG_JSON", "false")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("the server logs its address");
            if let Some(rest) = line.split("listen=").nth(1) {
                break rest.split_whitespace().next().unwrap().to_owned();
            }
        }
    })
    .await
    .expect("the server logs its address within 30 s");
    let resp = Client::new()
        .post(format!("http://{addr}/v1/notify"))
        .json(&json!({"request": "aaaabbbb", "server_id": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let pid = child.id().unwrap() as i32;
    // SAFETY: sending a signal to our own child.
    unsafe { libc_kill(pid, 15) };
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}
