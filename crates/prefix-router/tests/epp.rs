//! `prefix-router epp` against simulated vLLM servers, with this test playing the gateway's
//! side of the endpoint-picker protocol message by message (Envoy's ext_proc in
//! FULL_DUPLEX_STREAMED mode): request headers, body pieces and end of stream; then, having
//! sent the request to the picked endpoint itself, the response headers (with the served
//! endpoint in `envoy.lb` metadata), body pieces and trailers.

mod common;

use common::envoy::*;

use std::collections::HashMap;
use std::time::Duration;

use common::{eventually, fleet, instant, metric, text};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HttpHeaders, HttpTrailers, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Value};
use prefix_router::epp;
use serde_json::json;

fn subset(endpoints: &[&str]) -> Option<Metadata> {
    metadata(
        epp::SUBSET_NAMESPACE,
        epp::SUBSET,
        Kind::ListValue(ListValue {
            values: endpoints
                .iter()
                .map(|e| Value {
                    kind: Some(Kind::StringValue((*e).to_owned())),
                })
                .collect(),
        }),
    )
}

/// An immediate answer's status and JSON body.
fn immediate(answer: &ProcessingResponse) -> (i32, serde_json::Value) {
    let Some(processing_response::Response::ImmediateResponse(r)) = &answer.response else {
        panic!("expected an immediate response, got {answer:?}");
    };
    (
        r.status.as_ref().unwrap().code,
        serde_json::from_slice(&r.body).unwrap(),
    )
}

/// Sends a request's headers and body (in `pieces`) and returns the picked endpoints, having
/// checked the body comes back whole.
async fn ask(
    gateway: &mut Gateway,
    path: &str,
    meta: Option<Metadata>,
    body_bytes: &[u8],
    pieces: usize,
) -> Vec<String> {
    gateway.send(request_headers(path, meta)).await;
    let size = body_bytes.len().div_ceil(pieces);
    let chunks: Vec<&[u8]> = body_bytes.chunks(size).collect();
    for (i, c) in chunks.iter().enumerate() {
        gateway
            .send(body_message(true, c, i + 1 == chunks.len()))
            .await;
    }
    let endpoints = picked(&gateway.next().await);
    let mut back = Vec::new();
    loop {
        let (bytes, end) = streamed(&gateway.next().await, true);
        back.extend(bytes);
        if end {
            break;
        }
    }
    assert_eq!(back, body_bytes, "the request body comes back unchanged");
    endpoints
}

/// Plays the gateway's response side: sends the request to `endpoint` over HTTP, then passes
/// the answer through the picker piece by piece; returns the answer as the client gets it.
async fn pass_answer(
    gateway: &mut Gateway,
    endpoint: &str,
    path: &str,
    body_bytes: &[u8],
) -> Vec<u8> {
    let answer = reqwest::Client::new()
        .post(format!("http://{endpoint}{path}"))
        .header("content-type", "application/json")
        .body(body_bytes.to_vec())
        .send()
        .await
        .unwrap();
    let status = answer.status().as_u16().to_string();
    let content_type = answer.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    let bytes = answer.bytes().await.unwrap();
    gateway
        .send(ProcessingRequest {
            metadata_context: metadata(
                epp::LB_NAMESPACE,
                epp::SERVED,
                Kind::StringValue(endpoint.to_owned()),
            ),
            request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: Some(headers(&[
                    (":status", &status),
                    ("content-type", &content_type),
                ])),
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await;
    let answer = gateway.next().await;
    assert!(
        matches!(
            answer.response,
            Some(processing_response::Response::ResponseHeaders(_))
        ),
        "response headers answered: {answer:?}"
    );
    let mut client_sees = Vec::new();
    let half = bytes.len() / 2;
    for (piece, end) in [(&bytes[..half], false), (&bytes[half..], true)] {
        gateway.send(body_message(false, piece, end)).await;
        let (back, ended) = streamed(&gateway.next().await, false);
        assert_eq!(back, piece, "each response piece is handed back unchanged");
        assert_eq!(ended, end);
        client_sees.extend(back);
    }
    gateway
        .send(ProcessingRequest {
            request: Some(processing_request::Request::ResponseTrailers(
                HttpTrailers::default(),
            )),
            ..Default::default()
        })
        .await;
    let answer = gateway.next().await;
    assert!(matches!(
        answer.response,
        Some(processing_response::Response::ResponseTrailers(_))
    ));
    client_sees
}

fn chat(prompt: &str, stream: bool) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "stream": stream,
    }))
    .unwrap()
}

fn endpoint(url: &str) -> String {
    url.trim_start_matches("http://").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_picked_by_prefix_echoed_and_their_answers_passed_through() {
    let sims = fleet(instant(), 3).await;
    let urls = sims.urls();
    let p = picker(&urls, &[]).await;
    let all: Vec<String> = urls.iter().map(|u| endpoint(u)).collect();

    // A long prompt in three pieces: nothing is answered before the last piece.
    let shared = text(1, 8_000);
    let first = chat(&format!("{shared} question one"), true);
    let mut gw = Gateway::open(&p.grpc_url()).await;
    gw.send(request_headers("/v1/chat/completions", None)).await;
    gw.send(body_message(true, &first[..1000], false)).await;
    assert!(
        gw.silent_for(200).await,
        "the picker waits for the whole body"
    );
    gw.send(body_message(true, &first[1000..], true)).await;
    let endpoints = picked(&gw.next().await);
    let mut sorted = endpoints.clone();
    sorted.sort();
    let mut expected = all.clone();
    expected.sort();
    assert_eq!(
        sorted, expected,
        "the chosen endpoint, then every other as a fallback"
    );
    let mut back = Vec::new();
    loop {
        let (bytes, end) = streamed(&gw.next().await, true);
        back.extend(bytes);
        if end {
            break;
        }
    }
    assert_eq!(back, first);
    let answer = pass_answer(&mut gw, &endpoints[0], "/v1/chat/completions", &first).await;
    assert!(String::from_utf8_lossy(&answer).contains("data: [DONE]"));
    drop(gw);

    // The same prefix again, on new streams: the same endpoint first, every time.
    for i in 0..4 {
        let mut gw = Gateway::open(&p.grpc_url()).await;
        let again = chat(&format!("{shared} another question {i}"), true);
        let e = ask(&mut gw, "/v1/chat/completions", None, &again, 2).await;
        assert_eq!(
            e[0], endpoints[0],
            "a shared prefix goes where it was sent before"
        );
        pass_answer(&mut gw, &e[0], "/v1/chat/completions", &again).await;
    }
    // Other prompts spread over the fleet (round robin among equals, by load).
    let mut firsts = std::collections::HashSet::new();
    for i in 0..6 {
        let mut gw = Gateway::open(&p.grpc_url()).await;
        let other = chat(&text(100 + i, 2_000), false);
        let e = ask(&mut gw, "/v1/chat/completions", None, &other, 1).await;
        let answer = pass_answer(&mut gw, &e[0], "/v1/chat/completions", &other).await;
        let v: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(v["object"], "chat.completion");
        firsts.insert(e[0].clone());
    }
    assert!(firsts.len() >= 2, "unrelated prompts spread: {firsts:?}");

    // Every request counted, on the backend that served it, and nothing left in flight.
    let http = p.http.url();
    assert_eq!(
        metric(&http, "prefix_router_requests_total", "status=\"200\"").await,
        11.0
    );
    let served_first = urls.iter().find(|u| endpoint(u) == endpoints[0]).unwrap();
    assert!(
        metric(
            &http,
            "prefix_router_requests_total",
            &format!("backend=\"{served_first}\"")
        )
        .await
            >= 5.0
    );
    assert!(
        eventually(5, || async {
            metric(&http, "prefix_router_inflight", "").await == 0.0
        })
        .await
    );
    assert!(
        metric(&http, "prefix_router_ttft_seconds_count", "").await >= 5.0,
        "streamed answers' first bytes teach the TTFT"
    );
    sims.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_limits_the_pick_and_an_empty_or_foreign_one_is_503() {
    let sims = fleet(instant(), 3).await;
    let urls = sims.urls();
    let p = picker(&urls, &[]).await;
    let all: Vec<String> = urls.iter().map(|u| endpoint(u)).collect();
    let shared = text(7, 6_000);
    // Taught: this prefix lives on the first pick.
    let mut gw = Gateway::open(&p.grpc_url()).await;
    let home = ask(&mut gw, "/v1/completions", None, &completion(&shared), 1).await[0].clone();
    pass_answer(&mut gw, &home, "/v1/completions", &completion(&shared)).await;
    // The gateway allows two others only: the pick keeps to them, the cached one excluded.
    let others: Vec<&str> = all
        .iter()
        .filter(|e| **e != home)
        .map(String::as_str)
        .collect();
    let mut gw = Gateway::open(&p.grpc_url()).await;
    let e = ask(
        &mut gw,
        "/v1/completions",
        subset(&others),
        &completion(&shared),
        1,
    )
    .await;
    let mut got = e.clone();
    got.sort();
    let mut want: Vec<String> = others.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(got, want, "only the subset's endpoints are offered");
    drop(gw);
    // Nothing eligible: 503, in OpenAI's error shape.
    for hint in [subset(&[]), subset(&["10.9.9.9:8000"])] {
        let mut gw = Gateway::open(&p.grpc_url()).await;
        gw.send(request_headers("/v1/completions", hint)).await;
        gw.send(body_message(true, &completion("hello"), true))
            .await;
        let (status, error) = immediate(&gw.next().await);
        assert_eq!(status, 503);
        assert_eq!(error["error"]["code"], 503);
        assert!(error["error"]["message"].is_string());
    }
    assert_eq!(
        metric(
            &p.http.url(),
            "prefix_router_epp_refused_total",
            "reason=\"no_endpoint\""
        )
        .await,
        2.0
    );
    sims.shutdown().await;
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2})).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_answered_by_the_picker_in_openais_shape_and_take_nothing() {
    let sims = fleet(instant(), 2).await;
    let p = picker(&sims.urls(), &["--max-body", "10000"]).await;
    let cases: [(&[u8], i32, &str); 4] = [
        (b"{\"model\": \"sim-model\", \"prompt\": ", 400, "invalid"),
        (b"[1, 2]", 400, "invalid"),
        (
            br#"{"model": "no-such-model", "prompt": "hi"}"#,
            404,
            "unknown_model",
        ),
        (&[b'x'; 20_000], 413, "too_large"),
    ];
    let mut counted: HashMap<&str, f64> = HashMap::new();
    for (bytes, want, reason) in cases {
        let mut gw = Gateway::open(&p.grpc_url()).await;
        gw.send(request_headers("/v1/completions", None)).await;
        for (i, c) in bytes.chunks(6_000).enumerate() {
            gw.send(body_message(true, c, (i + 1) * 6_000 >= bytes.len()))
                .await;
        }
        let (status, error) = immediate(&gw.next().await);
        assert_eq!(status, want, "{reason}");
        assert!(error["error"]["message"].as_str().unwrap().len() > 5);
        *counted.entry(reason).or_default() += 1.0;
        assert_eq!(
            metric(
                &p.http.url(),
                "prefix_router_epp_refused_total",
                &format!("reason=\"{reason}\"")
            )
            .await,
            counted[reason],
        );
    }
    let http = p.http.url();
    assert_eq!(metric(&http, "prefix_router_inflight", "").await, 0.0);
    assert_eq!(
        metric(&http, "prefix_router_requests_total", "").await,
        0.0,
        "nothing reached a backend"
    );
    sims.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_served_by_a_fallback_moves_the_load_and_a_closed_stream_releases_it() {
    let sims = fleet(instant(), 2).await;
    let urls = sims.urls();
    let p = picker(&urls, &[]).await;
    let http = p.http.url();
    let request = completion(&text(3, 3_000));
    let mut gw = Gateway::open(&p.grpc_url()).await;
    let e = ask(&mut gw, "/v1/completions", None, &request, 1).await;
    assert_eq!(e.len(), 2);
    // Picked and not yet answered: one request in flight, on the first.
    let inflight_on = |i: usize| {
        let http = http.clone();
        let url = urls.iter().find(|u| endpoint(u) == e[i]).unwrap().clone();
        async move {
            metric(
                &http,
                "prefix_router_inflight",
                &format!("backend=\"{url}\""),
            )
            .await
        }
    };
    assert_eq!(inflight_on(0).await, 1.0);
    let first = urls.iter().find(|u| endpoint(u) == e[0]).unwrap();
    let second = urls.iter().find(|u| endpoint(u) == e[1]).unwrap();
    let entries_on = |url: &str| {
        let (http, url) = (http.clone(), url.to_string());
        async move {
            metric(
                &http,
                "prefix_router_index_entries",
                &format!("backend=\"{url}\""),
            )
            .await
        }
    };
    assert_eq!(entries_on(second).await, 0.0, "not sent there yet");
    // The gateway says the fallback served it (the first failed): the load moves there.
    pass_answer(&mut gw, &e[1], "/v1/completions", &request).await;
    assert_eq!(
        metric(
            &http,
            "prefix_router_epp_served_elsewhere_total",
            "reason=\"fallback\""
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &http,
            "prefix_router_retries_total",
            &format!("backend=\"{first}\"")
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &http,
            "prefix_router_requests_total",
            &format!("backend=\"{second}\",model=\"sim-model\",status=\"200\"")
        )
        .await,
        1.0
    );
    assert_eq!(inflight_on(0).await + inflight_on(1).await, 0.0);
    // The index learned where the request really went. (The first is credited too, from when the
    // request was sent there, so the two hold it alike and a next pick between them is a
    // near-tie: which of them it takes says nothing about the index.)
    let (held_first, held_second) = (entries_on(first).await, entries_on(second).await);
    assert!(held_first > 0.0, "{held_first}");
    assert_eq!(
        held_second, held_first,
        "the index learned where the request really went"
    );
    let mut gw = Gateway::open(&p.grpc_url()).await;
    ask(&mut gw, "/v1/completions", None, &request, 1).await;
    // The gateway closes the stream before any answer: the load is released, counted 499.
    drop(gw);
    assert!(
        eventually(5, || async {
            metric(&http, "prefix_router_inflight", "").await == 0.0
        })
        .await
    );
    assert!(
        eventually(5, || async {
            metric(&http, "prefix_router_requests_total", "status=\"499\"").await == 1.0
        })
        .await
    );
    sims.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_bodies_are_left_unchanged_and_grpc_health_answers() {
    let sims = fleet(instant(), 2).await;
    let p = picker(&sims.urls(), &[]).await;
    let mut gw = Gateway::open(&p.grpc_url()).await;
    let mut headers_message = request_headers("/v1/completions", None);
    headers_message.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Buffered as i32,
        response_body_mode: BodySendMode::Buffered as i32,
        send_body_without_waiting_for_header_response: false,
    });
    gw.send(headers_message).await;
    gw.send(body_message(true, &completion("buffered"), true))
        .await;
    assert_eq!(picked(&gw.next().await).len(), 2);
    let answer = gw.next().await;
    let Some(processing_response::Response::RequestBody(b)) = &answer.response else {
        panic!("expected the body's answer, got {answer:?}");
    };
    assert!(
        b.response.as_ref().unwrap().body_mutation.is_none(),
        "a buffered body is left as the gateway holds it"
    );
    // A request without a body (a GET) is picked at its headers, by load.
    let mut gw = Gateway::open(&p.grpc_url()).await;
    let mut get = request_headers("/v1/models", None);
    if let Some(processing_request::Request::RequestHeaders(h)) = &mut get.request {
        h.end_of_stream = true;
    }
    gw.send(get).await;
    assert_eq!(picked(&gw.next().await).len(), 2);
    // Plain streamed mode cannot be served (the headers would need an answer before the
    // body): the stream is refused with a clear status.
    let mut gw = Gateway::open(&p.grpc_url()).await;
    let mut headers_message = request_headers("/v1/completions", None);
    headers_message.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Streamed as i32,
        ..Default::default()
    });
    gw.send(headers_message).await;
    let refused = tokio::time::timeout(Duration::from_secs(10), gw.rx.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("FULL_DUPLEX_STREAMED"));

    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let mut health = HealthClient::new(
        tonic::transport::Channel::from_shared(p.grpc_url())
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    for service in ["liveness", "readiness", epp::SERVICE] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service}");
    }
    sims.shutdown().await;
}

/// Request headers with a bearer token.
fn keyed_headers(path: &str, key: &str) -> ProcessingRequest {
    let mut message = request_headers(path, None);
    if let Some(processing_request::Request::RequestHeaders(h)) = &mut message.request {
        h.headers.as_mut().unwrap().headers.push(
            envoy_types::pb::envoy::config::core::v3::HeaderValue {
                key: "authorization".into(),
                raw_value: format!("Bearer {key}").into_bytes(),
                ..Default::default()
            },
        );
    }
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_keys_and_limits_hold_behind_the_gateway_too() {
    let sims = fleet(instant(), 2).await;
    let file = std::env::temp_dir().join(format!("epp-keys-{}.toml", std::process::id()));
    std::fs::write(
        &file,
        "[tenants.alpha]\nkeys = [\"alpha-key-1\"]\nrate = 0.1\nburst = 1\n",
    )
    .unwrap();
    let p = picker(&sims.urls(), &["--api-keys-file", file.to_str().unwrap()]).await;
    // Its burst of one is picked; the next is shed with 429 and the time to wait.
    let mut gw = Gateway::open(&p.grpc_url()).await;
    gw.send(keyed_headers("/v1/completions", "alpha-key-1"))
        .await;
    gw.send(body_message(true, &completion("one"), true)).await;
    assert_eq!(picked(&gw.next().await).len(), 2);
    drop(gw);
    let mut gw = Gateway::open(&p.grpc_url()).await;
    gw.send(keyed_headers("/v1/completions", "alpha-key-1"))
        .await;
    gw.send(body_message(true, &completion("two"), true)).await;
    let answer = gw.next().await;
    let (status, error) = immediate(&answer);
    assert_eq!(status, 429);
    assert_eq!(error["error"]["type"], "rate_limit_error");
    let Some(processing_response::Response::ImmediateResponse(r)) = &answer.response else {
        unreachable!()
    };
    let retry_after = r
        .headers
        .as_ref()
        .unwrap()
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == "retry-after")
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap());
    assert_eq!(retry_after.as_deref(), Some("10"), "0.1 requests/s: 10 s");
    // An unknown key is refused with 401.
    let mut gw = Gateway::open(&p.grpc_url()).await;
    gw.send(keyed_headers("/v1/completions", "nobody")).await;
    gw.send(body_message(true, &completion("three"), true))
        .await;
    assert_eq!(immediate(&gw.next().await).0, 401);
    let http = p.http.url();
    assert_eq!(
        metric(&http, "prefix_router_epp_refused_total", "reason=\"shed\"").await,
        1.0
    );
    assert_eq!(
        metric(
            &http,
            "prefix_router_epp_refused_total",
            "reason=\"unauthorized\""
        )
        .await,
        1.0
    );
    std::fs::remove_file(&file).unwrap();
    sims.shutdown().await;
}

/// A client's key is checked at its headers (a stranger's body is never buffered); the
/// client's `Authorization` (this router's key) does not reach the backend, which gets its
/// own key when one is configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_checked_at_the_headers_and_backends_get_their_own() {
    let sims = fleet(instant(), 1).await;
    let p = picker(&sims.urls(), &["--api-key", "client-key-123"]).await;
    let mut gw = Gateway::open(&p.grpc_url()).await;
    gw.send(keyed_headers("/v1/completions", "wrong-key")).await;
    assert_eq!(immediate(&gw.next().await).0, 401, "at the headers");
    let mut gw = Gateway::open(&p.grpc_url()).await;
    gw.send(keyed_headers("/v1/completions", "client-key-123"))
        .await;
    gw.send(body_message(true, &completion("hello"), true))
        .await;
    let (set, removed) = mutation(&gw.next().await);
    assert_eq!(removed, ["authorization"], "the client's key stays here");
    assert!(!set.contains_key("authorization"));
    drop(gw);
    drop(p);

    let p = picker(&sims.urls(), &["--backend-api-key", "backend-key-456"]).await;
    let mut gw = Gateway::open(&p.grpc_url()).await;
    gw.send(keyed_headers("/v1/completions", "anything")).await;
    gw.send(body_message(true, &completion("hello"), true))
        .await;
    let (set, removed) = mutation(&gw.next().await);
    assert_eq!(set["authorization"], "Bearer backend-key-456");
    assert!(removed.is_empty());
    sims.shutdown().await;
}

/// Streams beyond `--max-concurrent` are refused with RESOURCE_EXHAUSTED, not buffered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_beyond_the_bound_are_refused() {
    let sims = fleet(instant(), 1).await;
    let p = picker(&sims.urls(), &["--max-concurrent", "1"]).await;
    let first = Gateway::open(&p.grpc_url()).await;
    first.send(request_headers("/v1/completions", None)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    match Gateway::try_open(&p.grpc_url()).await {
        Err(status) => assert_eq!(status.code(), tonic::Code::ResourceExhausted),
        Ok(_) => panic!("a second stream was served"),
    }
    // The first one's place frees when it closes.
    drop(first);
    assert!(
        eventually(5, || async {
            Gateway::try_open(&p.grpc_url()).await.is_ok()
        })
        .await,
        "a stream is served again"
    );
    sims.shutdown().await;
}

/// With `response_body_mode: NONE` the answer is counted by its headers' status when the
/// stream closes (it was counted 499, every time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_without_a_body_are_counted_by_their_status() {
    let sims = fleet(instant(), 1).await;
    let p = picker(&sims.urls(), &[]).await;
    let mut gw = Gateway::open(&p.grpc_url()).await;
    let mut headers = request_headers("/v1/completions", None);
    headers.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        response_body_mode: BodySendMode::None as i32,
        send_body_without_waiting_for_header_response: true,
    });
    gw.send(headers).await;
    gw.send(body_message(true, &completion("hello"), true))
        .await;
    let endpoints = picked(&gw.next().await);
    assert_eq!(endpoints.len(), 1);
    let (_, end) = streamed(&gw.next().await, true);
    assert!(end);
    gw.send(ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(headers_of(&[(":status", "200")])),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await;
    gw.next().await;
    drop(gw);
    let http = p.http.url();
    assert!(
        eventually(5, || async {
            metric(&http, "prefix_router_requests_total", "status=\"200\"").await == 1.0
        })
        .await
    );
    assert_eq!(
        metric(&http, "prefix_router_requests_total", "status=\"499\"").await,
        0.0
    );
    assert_eq!(metric(&http, "prefix_router_inflight", "").await, 0.0);
    sims.shutdown().await;
}

fn headers_of(pairs: &[(&str, &str)]) -> envoy_types::pb::envoy::config::core::v3::HeaderMap {
    common::envoy::headers(pairs)
}
