//! What the endpoint picker costs a request: one whole ext_proc exchange over loopback gRPC, as
//! a gateway plays it (one stream per request on a shared HTTP/2 connection: request headers,
//! the body, the pick and the body handed back, the response headers and body handed back),
//! against a unary gRPC call on the same connection (the floor: a gRPC round trip here).
//!
//! `cargo bench -p prefix-router --bench epp`

use std::net::SocketAddr;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use prefix_router::epp::{self, EppArgs};
use tonic::transport::Channel;

#[derive(clap::Parser)]
struct Words {
    #[command(flatten)]
    args: EppArgs,
}

fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    })
}

fn message(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

/// One request's whole exchange; returns the number of answers (5).
async fn exchange(
    client: &mut ExternalProcessorClient<Channel>,
    body: &[u8],
    answer: &[u8],
) -> usize {
    let mut first = message(processing_request::Request::RequestHeaders(HttpHeaders {
        headers: headers(&[(":method", "POST"), (":path", "/v1/chat/completions")]),
        ..Default::default()
    }));
    first.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        response_body_mode: BodySendMode::FullDuplexStreamed as i32,
        send_body_without_waiting_for_header_response: true,
    });
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(first).await.unwrap();
    tx.send(message(processing_request::Request::RequestBody(
        HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..Default::default()
        },
    )))
    .await
    .unwrap();
    let mut answers = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // The pick and the body handed back.
    for _ in 0..2 {
        answers.message().await.unwrap().unwrap();
    }
    tx.send(message(processing_request::Request::ResponseHeaders(
        HttpHeaders {
            headers: headers(&[(":status", "200"), ("content-type", "application/json")]),
            ..Default::default()
        },
    )))
    .await
    .unwrap();
    tx.send(message(processing_request::Request::ResponseBody(
        HttpBody {
            body: answer.to_vec(),
            end_of_stream: true,
            ..Default::default()
        },
    )))
    .await
    .unwrap();
    for _ in 0..2 {
        answers.message().await.unwrap().unwrap();
    }
    drop(tx);
    let mut n = 4;
    while let Ok(Some(_)) = answers.message().await {
        n += 1;
    }
    n + 1
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let (sims, picker) = rt.block_on(async {
        let sims = vllm_sim::Fleet::start(
            vllm_sim::SimConfig {
                time_scale: 0.0,
                ..vllm_sim::SimConfig::default()
            },
            8,
            loopback,
        )
        .await
        .unwrap();
        let grpc = tokio::net::TcpListener::bind(loopback).await.unwrap();
        let http = tokio::net::TcpListener::bind(loopback).await.unwrap();
        let mut words = vec![
            "epp".to_owned(),
            "--grpc-listen".into(),
            grpc.local_addr().unwrap().to_string(),
            "--listen".into(),
            http.local_addr().unwrap().to_string(),
        ];
        for u in sims.urls() {
            words.push("--backend".into());
            words.push(u);
        }
        let args = <Words as clap::Parser>::parse_from(words).args;
        let picker = epp::spawn(args, grpc, http, None).await.unwrap();
        // Until every backend answered its health check.
        for _ in 0..100 {
            let h: serde_json::Value = reqwest_health(&picker.http.url()).await;
            if h["healthy_backends"] == 8 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        (sims, picker)
    });
    let channel = rt.block_on(async {
        Channel::from_shared(picker.grpc_url())
            .unwrap()
            .connect()
            .await
            .unwrap()
    });
    let prefix = "You are a helpful assistant. ".repeat(140);
    let answer = br#"{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1000,"completion_tokens":1,"total_tokens":1001}}"#;
    let mut group = c.benchmark_group("epp");
    let mut n = 0u64;
    group.bench_function("exchange_4k_chat", |b| {
        let mut client = ExternalProcessorClient::new(channel.clone());
        b.iter(|| {
            n += 1;
            let body = serde_json::to_vec(&serde_json::json!({
                "model": "sim-model",
                "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": format!("question {}", n % 64)}],
            }))
            .unwrap();
            rt.block_on(exchange(&mut client, &body, answer))
        })
    });
    group.bench_function("grpc_health_round_trip", |b| {
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        b.iter(|| {
            rt.block_on(health.check(tonic_health::pb::HealthCheckRequest {
                service: "readiness".into(),
            }))
            .unwrap()
        })
    });
    group.finish();
    drop(picker);
    rt.block_on(sims.shutdown());
}

async fn reqwest_health(url: &str) -> serde_json::Value {
    reqwest::get(format!("{url}/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(8));
    targets = bench
}
criterion_main!(benches);
