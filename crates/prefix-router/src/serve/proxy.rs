//! Forwarding a request to a backend and its answer back, byte for byte.
//!
//! The body goes upstream unchanged; the answer streams back as it arrives (no buffering), and
//! carries the in-flight guard, so the counters drop exactly when the client has the last byte,
//! the backend fails, or the client goes away (which drops the upstream connection and so
//! cancels the request in vLLM).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::header::{self, HeaderName};
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::backend::{Backend, InflightGuard};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The pooled HTTP/1.1 client for the backends and for a remote index.
pub fn client(connect_timeout: Duration) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_keepalive(Some(Duration::from_secs(30)));
    // Without a timer the pool never reaps idle connections: after a burst their descriptors and
    // buffers would stay until reused. vLLM (uvicorn) closes a connection idle for 5 s; reusing
    // one at that moment fails the request, so connections idle for 4 s are not reused.
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(4))
        .pool_max_idle_per_host(4096)
        .build(connector)
}

/// Headers that describe one hop, never forwarded.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

/// Builds the upstream request: same method, path, query and body; hop-by-hop headers dropped;
/// the backend's API key, when configured, replaces the client's Authorization.
pub fn upstream_request(
    backend: &Backend,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> Request<Full<Bytes>> {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let base = backend.url();
    let target = format!("{base}{path}");
    let mut req = Request::builder()
        .method(method.clone())
        .uri(target)
        .body(Full::new(body))
        .expect("a backend URL and a request path make a valid URI");
    let out = req.headers_mut();
    for (name, value) in headers {
        if !hop_by_hop(name) {
            out.append(name.clone(), value.clone());
        }
    }
    if let Some(auth) = &backend.authorization {
        out.insert(header::AUTHORIZATION, auth.clone());
    }
    req
}

/// Copies an upstream answer's head, wrapping its body so it carries `guard`.
pub fn downstream_response(
    upstream: Response<Incoming>,
    guard: InflightGuard,
    on_end: impl FnOnce(u16, Duration) + Send + 'static,
    deadline: Instant,
) -> Response<Body> {
    let (parts, body) = upstream.into_parts();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let status = parts.status.as_u16();
    let mut response = Response::new(Body::new(GuardedBody {
        inner: body,
        guard: Some(guard),
        sse,
        status,
        started: Instant::now(),
        on_end: Some(Box::new(on_end)),
        deadline: Box::pin(tokio::time::sleep_until(deadline.into())),
        done: false,
    }));
    *response.status_mut() = parts.status;
    let headers = response.headers_mut();
    for (name, value) in &parts.headers {
        if !hop_by_hop(name) || name == header::CONTENT_LENGTH {
            headers.append(name.clone(), value.clone());
        }
    }
    response
}

/// The answer's body: passes frames through and releases the in-flight guard at the end.
struct GuardedBody {
    inner: Incoming,
    guard: Option<InflightGuard>,
    sse: bool,
    status: u16,
    started: Instant,
    on_end: Option<Box<dyn FnOnce(u16, Duration) + Send>>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    done: bool,
}

impl GuardedBody {
    fn finish(&mut self) {
        self.done = true;
        self.guard.take();
        if let Some(on_end) = self.on_end.take() {
            on_end(self.status, self.started.elapsed());
        }
    }

    /// A stream that breaks mid-way ends with an error event for SSE clients, so they do not
    /// wait for a `[DONE]` that will never come; other bodies end with an error (the client
    /// sees a truncated answer).
    fn broken(&mut self, why: &str) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.status = StatusCode::BAD_GATEWAY.as_u16();
        self.finish();
        if self.sse {
            let event = serde_json::json!({"error": {
                "message": format!("the backend stream broke: {why}"),
                "type": "service_unavailable_error", "param": null, "code": 502,
            }});
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!(
                "data: {event}\n\n"
            ))))))
        } else {
            Poll::Ready(Some(Err(axum::Error::new(std::io::Error::other(
                why.to_owned(),
            )))))
        }
    }
}

impl HttpBody for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            return this.broken("the request timed out");
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(guard) = &mut this.guard {
                    guard.first_byte();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => this.broken(&e.to_string()),
            Poll::Ready(None) => {
                this.finish();
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for GuardedBody {
    /// The client went away before the end: the guard and the upstream connection go now.
    fn drop(&mut self) {
        if !self.done {
            self.status = 499;
            self.finish();
        }
    }
}

/// `x-request-id` of the request, or a new one.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    headers
        .get("x-request-id")
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .cloned()
        .unwrap_or_else(|| {
            let n: u128 =
                (u128::from(prefix_index::Tick::from_secs(prefix_index::now_secs()).millis())
                    << 64)
                    | u128::from(
                        xxhash_rust::xxh3::xxh3_64(&std::process::id().to_le_bytes())
                            ^ next_counter(),
                    );
            HeaderValue::from_str(&format!("{n:032x}")).expect("hex is a valid header")
        })
}

fn next_counter() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    COUNTER
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
