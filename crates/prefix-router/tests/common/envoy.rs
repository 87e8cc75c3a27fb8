//! The gateway's side of the endpoint-picker protocol (Envoy's ext_proc, FULL_DUPLEX_STREAMED),
//! for the tests: one stream message by message, and a minimal gateway that proxies HTTP
//! requests where the picker says, as a conformant gateway does.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use prefix_router::epp;
use tokio::sync::mpsc;

/// The gateway's side of one ext_proc stream.
pub struct Gateway {
    pub tx: mpsc::Sender<ProcessingRequest>,
    pub rx: tonic::Streaming<ProcessingResponse>,
}

impl Gateway {
    pub async fn open(url: &str) -> Self {
        Self::try_open(url).await.unwrap()
    }

    /// Opens a stream, or the status the picker refused it with.
    pub async fn try_open(url: &str) -> Result<Self, tonic::Status> {
        let mut client = ExternalProcessorClient::connect(url.to_owned())
            .await
            .unwrap();
        let (tx, outbound) = mpsc::channel(16);
        let rx = client
            .process(tokio_stream::wrappers::ReceiverStream::new(outbound))
            .await?
            .into_inner();
        Ok(Self { tx, rx })
    }

    pub async fn send(&self, message: ProcessingRequest) {
        self.tx.send(message).await.unwrap();
    }

    /// The picker's next answer (within 10 s).
    pub async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("the picker answered within 10 s")
            .expect("the stream is fine")
            .expect("the stream is open")
    }

    /// Whether an answer comes within `ms` (the picker must stay silent at some points).
    pub async fn silent_for(&mut self, ms: u64) -> bool {
        tokio::time::timeout(Duration::from_millis(ms), self.rx.message())
            .await
            .is_err()
    }
}

pub fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

pub fn full_duplex() -> Option<ProtocolConfiguration> {
    Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        response_body_mode: BodySendMode::FullDuplexStreamed as i32,
        send_body_without_waiting_for_header_response: true,
    })
}

pub fn metadata(namespace: &str, key: &str, kind: Kind) -> Option<Metadata> {
    Some(Metadata {
        filter_metadata: HashMap::from([(
            namespace.to_owned(),
            Struct {
                fields: [(key.to_owned(), Value { kind: Some(kind) })].into(),
            },
        )]),
        ..Default::default()
    })
}

/// The picked endpoints, from the headers' answer; checks the header and the metadata agree.
pub fn picked(answer: &ProcessingResponse) -> Vec<String> {
    let Some(processing_response::Response::RequestHeaders(h)) = &answer.response else {
        panic!("expected the request headers' answer, got {answer:?}");
    };
    let common = h.response.as_ref().unwrap();
    assert!(common.clear_route_cache, "the route is chosen again");
    let set = &common.header_mutation.as_ref().unwrap().set_headers;
    let header = set
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == epp::DESTINATION)
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
        .expect("the destination header is set");
    let meta = answer.dynamic_metadata.as_ref().unwrap().fields[epp::LB_NAMESPACE].clone();
    let Some(Kind::StructValue(lb)) = meta.kind else {
        panic!("envoy.lb is a struct");
    };
    let Some(Kind::StringValue(value)) = &lb.fields[epp::DESTINATION].kind else {
        panic!("the metadata endpoint is a string");
    };
    assert_eq!(&header, value, "header and metadata carry the same value");
    header.split(',').map(str::to_owned).collect()
}

/// The bytes of a streamed body answer, and whether it ends the stream.
pub fn streamed(answer: &ProcessingResponse, request: bool) -> (Vec<u8>, bool) {
    let b = match (&answer.response, request) {
        (Some(processing_response::Response::RequestBody(b)), true) => b,
        (Some(processing_response::Response::ResponseBody(b)), false) => b,
        _ => panic!("expected a body answer, got {answer:?}"),
    };
    let Some(body_mutation::Mutation::StreamedResponse(s)) = b
        .response
        .as_ref()
        .and_then(|c| c.body_mutation.as_ref())
        .and_then(|m| m.mutation.as_ref())
    else {
        panic!("expected a streamed body, got {answer:?}");
    };
    (s.body.clone(), s.end_of_stream)
}

pub fn request_headers(path: &str, meta: Option<Metadata>) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: full_duplex(),
        metadata_context: meta,
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(headers(&[
                (":method", "POST"),
                (":path", path),
                (":authority", "gateway"),
                ("content-type", "application/json"),
                ("x-request-id", "req-1"),
            ])),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub fn body_message(request: bool, bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    let body = HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(if request {
            processing_request::Request::RequestBody(body)
        } else {
            processing_request::Request::ResponseBody(body)
        }),
        ..Default::default()
    }
}

/// A minimal gateway in front of the picker, as Envoy with the ext_proc filter plays it: each
/// HTTP request is asked of the picker on its own stream, sent to the first endpoint offered,
/// and its answer passed back through the picker to the client. Returns its base URL.
pub async fn proxy(picker_grpc: String) -> String {
    use axum::body::Bytes;
    use axum::extract::{Request, State};
    use axum::response::{IntoResponse, Response};
    async fn handle(State(grpc): State<String>, req: Request) -> Response {
        let path = req.uri().path().to_owned();
        let body: Bytes = axum::body::to_bytes(req.into_body(), 64 << 20)
            .await
            .unwrap();
        let mut gw = Gateway::open(&grpc).await;
        gw.send(request_headers(&path, None)).await;
        gw.send(body_message(true, &body, true)).await;
        let first = gw.next().await;
        if let Some(processing_response::Response::ImmediateResponse(r)) = &first.response {
            let status = r.status.as_ref().unwrap().code as u16;
            return (
                axum::http::StatusCode::from_u16(status).unwrap(),
                r.body.clone(),
            )
                .into_response();
        }
        let endpoint = picked(&first).remove(0);
        let mut forwarded = Vec::new();
        loop {
            let (piece, end) = streamed(&gw.next().await, true);
            forwarded.extend(piece);
            if end {
                break;
            }
        }
        let answer = reqwest::Client::new()
            .post(format!("http://{endpoint}{path}"))
            .header("content-type", "application/json")
            .body(forwarded)
            .send()
            .await
            .unwrap();
        let status = answer.status();
        let content_type = answer.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_owned();
        let bytes = answer.bytes().await.unwrap();
        gw.send(ProcessingRequest {
            metadata_context: metadata(epp::LB_NAMESPACE, epp::SERVED, Kind::StringValue(endpoint)),
            request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: Some(headers(&[
                    (":status", status.as_str()),
                    ("content-type", &content_type),
                ])),
                ..Default::default()
            })),
            ..Default::default()
        })
        .await;
        gw.next().await;
        gw.send(body_message(false, &bytes, true)).await;
        let (back, _) = streamed(&gw.next().await, false);
        (status, [("content-type", content_type)], back).into_response()
    }
    let listener = tokio::net::TcpListener::bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .fallback(axum::routing::post(handle))
        .with_state(picker_grpc);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// A picker in front of `urls` (fast health checks), with `extra` words.
pub async fn picker(urls: &[String], extra: &[&str]) -> prefix_router::epp::RunningPicker {
    picker_with(urls, extra, None).await
}

/// [`picker`], with the Kubernetes client its discovery uses (a fake API server).
pub async fn picker_with(
    urls: &[String],
    extra: &[&str],
    k8s: Option<kube::Client>,
) -> prefix_router::epp::RunningPicker {
    let grpc = tokio::net::TcpListener::bind(std::net::SocketAddr::from(super::LOOPBACK))
        .await
        .unwrap();
    let http = tokio::net::TcpListener::bind(std::net::SocketAddr::from(super::LOOPBACK))
        .await
        .unwrap();
    let mut words = vec![
        "epp".to_owned(),
        "--grpc-listen".into(),
        grpc.local_addr().unwrap().to_string(),
        "--listen".into(),
        http.local_addr().unwrap().to_string(),
    ];
    words.extend(super::fast_checks(urls, extra));
    // Later words override earlier ones (a test's own --health-interval, say).
    let matches = <Wrapper as clap::CommandFactory>::command()
        .args_override_self(true)
        .try_get_matches_from(words)
        .unwrap();
    let args = <Wrapper as clap::FromArgMatches>::from_arg_matches(&matches)
        .unwrap()
        .args;
    epp::spawn(args, grpc, http, k8s).await.unwrap()
}

#[derive(clap::Parser)]
pub struct Wrapper {
    #[command(flatten)]
    pub args: prefix_router::epp::EppArgs,
}

/// The request headers' answer's header mutation: (set, removed).
pub fn mutation(answer: &ProcessingResponse) -> (HashMap<String, String>, Vec<String>) {
    let Some(processing_response::Response::RequestHeaders(h)) = &answer.response else {
        panic!("expected the request headers' answer, got {answer:?}");
    };
    let m = h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap();
    let set = m
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .map(|h| {
            (
                h.key.clone(),
                String::from_utf8(h.raw_value.clone()).unwrap(),
            )
        })
        .collect();
    (set, m.remove_headers.clone())
}
