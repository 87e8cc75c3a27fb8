//! Forwarding a request to a backend and its answer back, byte for byte.
//!
//! The body goes upstream unchanged; the answer streams back as it arrives (no buffering), and
//! carries the in-flight guard, so the counters drop exactly when the client has the last byte,
//! the backend fails, or the client goes away (which drops the upstream connection and so
//! cancels the request in vLLM).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::http::header::{self, HeaderName};
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body_util::Full;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use parking_lot::Mutex;
use tokio::task::AbortHandle;

use crate::core::backend::{Backend, InflightGuard};

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
    if let Some(auth) = backend.authorization() {
        out.insert(header::AUTHORIZATION, auth);
    }
    req
}

/// How an answer ended, for the caller's accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ended {
    /// The status to count: the backend's when the last frame passed, 502 when the backend
    /// broke the answer, 504 past the deadline, 499 when the client left first.
    pub status: u16,
    /// `usage.prompt_tokens` as the answer reported it (a whole JSON answer, or a stream's
    /// usage chunk), if it passed.
    pub prompt_tokens: Option<u64>,
}

/// Copies an upstream answer's head, wrapping its body so it carries `guard`; `on_end` learns
/// how the answer ended.
pub fn downstream_response(
    upstream: Response<Incoming>,
    guard: InflightGuard,
    on_end: impl FnOnce(Ended) + Send + 'static,
    deadline: Instant,
) -> Response<Body> {
    let (parts, body) = upstream.into_parts();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let status = parts.status.as_u16();
    let shared = Arc::new(Shared {
        live: Mutex::new(Some(Live {
            inner: body,
            guard,
            on_end: Box::new(on_end),
            prompt_tokens: None,
        })),
        waker: AtomicWaker::new(),
    });
    // The deadline holds whether or not the client reads: a client that stops reading is not
    // polling this body, so a timer of its own ends the upstream request and frees its slot.
    let timer = {
        let shared = Arc::downgrade(&shared);
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline.into()).await;
            if let Some(shared) = shared.upgrade() {
                shared.end(StatusCode::GATEWAY_TIMEOUT.as_u16());
                shared.waker.wake();
            }
        })
        .abort_handle()
    };
    let mut response = Response::new(Body::new(GuardedBody {
        shared,
        sse,
        status,
        timer,
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

/// What a response holds while it lasts: the upstream body and the in-flight count.
struct Live {
    inner: Incoming,
    guard: InflightGuard,
    on_end: Box<dyn FnOnce(Ended) + Send>,
    /// The answer's `usage.prompt_tokens`, once seen.
    prompt_tokens: Option<u64>,
}

impl Live {
    /// Looks for `"prompt_tokens":N` in a frame of the answer (vLLM writes usage once, in the
    /// JSON answer or the stream's usage chunk).
    fn look_for_usage(&mut self, frame: &[u8]) {
        if self.prompt_tokens.is_none() {
            self.prompt_tokens = prompt_tokens_in(frame);
        }
    }
}

/// The number after `"prompt_tokens":` in a piece of an answer, if there is one.
pub(crate) fn prompt_tokens_in(frame: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"prompt_tokens\":";
    let at = memchr::memmem::find(frame, KEY)?;
    frame[at + KEY.len()..]
        .iter()
        .skip_while(|b| **b == b' ')
        .take_while(|b| b.is_ascii_digit())
        .fold(None, |n: Option<u64>, b| {
            Some(
                n.unwrap_or(0)
                    .saturating_mul(10)
                    .saturating_add(u64::from(b - b'0')),
            )
        })
}

/// Whether an answer of `status` whose first frame is `first` tells its backend's prefill
/// speed: a success, and (a stream) not an error event (vLLM reports some failures, a prompt
/// too long for instance, as a 200 stream whose first event is an error).
pub(crate) fn learnable_answer(status: u16, sse: bool, first: &[u8]) -> bool {
    (200..300).contains(&status) && !(sse && is_error_event(first))
}

/// Whether the first event of a stream is an error: its first `data:` line is a JSON object
/// with an `error` member, or whose `object` is `"error"`.
fn is_error_event(frame: &[u8]) -> bool {
    let head = &frame[..frame.len().min(4096)];
    let Some(at) = memchr::memmem::find(head, b"data:") else {
        return false;
    };
    let line = &head[at + 5..];
    let line = &line[..memchr::memchr(b'\n', line).unwrap_or(line.len())];
    match serde_json::from_slice::<serde_json::Value>(line.trim_ascii()) {
        Ok(serde_json::Value::Object(o)) => {
            o.contains_key("error") || o.get("object").and_then(|v| v.as_str()) == Some("error")
        }
        // A cut JSON (a long event): only an error that says so at its start.
        _ => {
            let start = line.trim_ascii_start();
            start.starts_with(b"{\"error\"") || start.starts_with(b"{\"object\":\"error\"")
        }
    }
}

/// Shared between the body and its deadline timer; whichever ends the answer first takes
/// [`Live`], so it ends exactly once.
struct Shared {
    live: Mutex<Option<Live>>,
    waker: AtomicWaker,
}

impl Shared {
    /// Ends the answer with `status` if it is still live: drops the upstream body (which
    /// cancels the request in vLLM) and the in-flight count, and counts it.
    fn end(&self, status: u16) {
        let live = self.live.lock().take();
        if let Some(live) = live {
            drop(live.inner);
            drop(live.guard);
            (live.on_end)(Ended {
                status,
                prompt_tokens: live.prompt_tokens,
            });
        }
    }
}

/// The answer's body: passes frames through and ends the answer exactly once.
struct GuardedBody {
    shared: Arc<Shared>,
    sse: bool,
    status: u16,
    timer: AbortHandle,
    done: bool,
}

impl GuardedBody {
    fn finish(&mut self, status: u16) {
        self.done = true;
        self.timer.abort();
        self.shared.end(status);
    }

    /// A stream that breaks mid-way ends with an error event for SSE clients, so they do not
    /// wait for a `[DONE]` that will never come; other bodies end with an error (the client
    /// sees a truncated answer).
    fn broken(
        &mut self,
        status: u16,
        why: &str,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.finish(status);
        if self.sse {
            let event = serde_json::json!({"error": {
                "message": format!("the backend stream broke: {why}"),
                "type": "service_unavailable_error", "param": null, "code": status,
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
        this.shared.waker.register(cx.waker());
        let mut live = this.shared.live.lock();
        let Some(state) = live.as_mut() else {
            drop(live);
            return this.broken(
                StatusCode::GATEWAY_TIMEOUT.as_u16(),
                "the request timed out",
            );
        };
        let polled = Pin::new(&mut state.inner).poll_frame(cx);
        let at_end = match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                let data = frame.data_ref().map_or(&[][..], |d| &d[..]);
                state
                    .guard
                    .first_byte(learnable_answer(this.status, this.sse, data));
                state.look_for_usage(data);
                // hyper stops polling a body of known length once it has all of it, so the
                // last frame, not the end of the stream, is where a sized answer ends.
                state.inner.is_end_stream()
            }
            _ => false,
        };
        drop(live);
        match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if at_end {
                    let status = this.status;
                    this.finish(status);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.broken(StatusCode::BAD_GATEWAY.as_u16(), &e.to_string())
            }
            Poll::Ready(None) => {
                let status = this.status;
                this.finish(status);
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        match self.shared.live.lock().as_ref() {
            Some(live) => live.inner.size_hint(),
            None => SizeHint::with_exact(0),
        }
    }
}

impl Drop for GuardedBody {
    /// The client went away before the end: the guard and the upstream connection go now.
    fn drop(&mut self) {
        if !self.done {
            self.finish(499);
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

#[cfg(test)]
mod tests {
    #[test]
    fn errors_and_error_events_teach_no_prefill() {
        use super::learnable_answer;
        let chunk = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[]}\n\n";
        assert!(learnable_answer(200, true, chunk));
        assert!(
            learnable_answer(200, false, b"{\"error\": 1}"),
            "a whole answer"
        );
        assert!(!learnable_answer(400, true, chunk));
        assert!(!learnable_answer(503, false, b""));
        for error in [
            &b"data: {\"error\": {\"message\": \"too long\", \"code\": 400}}\n\n"[..],
            b"data: {\"object\": \"error\", \"message\": \"x\"}\n\n",
            b"data: {\"error\": {\"message\": \"cut",
        ] {
            assert!(
                !learnable_answer(200, true, error),
                "{}",
                String::from_utf8_lossy(error)
            );
        }
    }

    use super::prompt_tokens_in;

    #[test]
    fn usage_is_read_from_answers_and_usage_chunks() {
        assert_eq!(
            prompt_tokens_in(br#"{"usage":{"prompt_tokens":1234,"total_tokens":1240}}"#),
            Some(1234)
        );
        assert_eq!(
            prompt_tokens_in(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\": 7}}\n\n"),
            Some(7)
        );
        assert_eq!(prompt_tokens_in(br#"{"prompt_tokens":null}"#), None);
        assert_eq!(prompt_tokens_in(b"data: [DONE]"), None);
        assert_eq!(
            prompt_tokens_in(br#"{"prompt_tokens":99999999999999999999999}"#),
            Some(u64::MAX)
        );
    }
}
