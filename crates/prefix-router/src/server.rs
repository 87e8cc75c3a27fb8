//! Running an axum app on a socket: the accept loop with the limits an open port needs (slow
//! clients cannot pin connections, heads are bounded, requests in flight are capped), until a
//! signal or a shutdown request.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use crate::api_error::ApiError;
use crate::json_body::BodyTimedOut;

/// Limits of the HTTP server, the same for every subcommand that listens.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerLimits {
    /// Longest wait for a request's headers, also between keep-alive requests: a client that
    /// sends nothing (or too slowly) loses the connection.
    #[arg(long, env = "PREFIX_ROUTER_HEADER_TIMEOUT", default_value = "10s", value_parser = crate::duration::parse)]
    pub header_timeout: Duration,
    /// Largest request head (request line and headers), in bytes; larger gets 431.
    #[arg(long, env = "PREFIX_ROUTER_MAX_HEADER_BYTES", default_value_t = 64 * 1024)]
    pub max_header_bytes: usize,
    /// Requests handled at once (health and metrics excepted); more get 429 with Retry-After.
    #[arg(long, env = "PREFIX_ROUTER_MAX_CONCURRENT", default_value_t = 4096)]
    pub max_concurrent: usize,
    /// Longest time to receive a request's body once its headers are in; a slower client gets
    /// 408 (a client that sends headers and then stalls holds nothing for long).
    #[arg(long, env = "PREFIX_ROUTER_BODY_TIMEOUT", default_value = "30s", value_parser = crate::duration::parse)]
    pub body_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            max_concurrent: 4096,
            body_timeout: Duration::from_secs(30),
        }
    }
}

/// Binds `addr` with a clear error when it is taken.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed at the call, not at the first
/// poll: a signal that arrives once the server is up (even before its accept loop first waits)
/// stops it cleanly instead of killing it. Call it inside the runtime.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        // A handler that could not be installed never fires.
        let arrived = |installed: std::io::Result<tokio::signal::unix::Signal>| async move {
            match installed {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        async move {
            tokio::select! {
                _ = arrived(interrupt) => {},
                _ = arrived(terminate) => {},
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// A response body that keeps a concurrency permit until it is done or dropped.
struct PermitBody {
    inner: Body,
    _permit: OwnedSemaphorePermit,
}

impl HttpBody for PermitBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<bytes::Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Caps the requests in flight (streams count until their last byte): beyond the cap, 429.
///
/// Applied by each app to the routes that do work (`route_layer`), not to its health and
/// metrics: a liveness probe must answer on a busy server, or the kubelet restarts it.
#[derive(Clone)]
pub struct ConcurrencyLimit {
    permits: Arc<Semaphore>,
}

impl ConcurrencyLimit {
    pub fn new(max: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(max.max(1))),
        }
    }

    /// The middleware: `router.route_layer(axum::middleware::from_fn(move |req, next|
    /// limit.clone().admit(req, next)))`.
    pub async fn admit(
        self,
        req: Request,
        next: axum::middleware::Next,
    ) -> axum::response::Response {
        let Ok(permit) = self.permits.try_acquire_owned() else {
            let mut resp = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too many requests in flight; retry shortly",
            )
            .into_response();
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return resp;
        };
        let resp = next.run(req).await;
        resp.map(|inner| {
            Body::new(PermitBody {
                inner,
                _permit: permit,
            })
        })
    }
}

/// A request body that fails with [`BodyTimedOut`] when it has not all arrived in time.
struct DeadlineBody {
    inner: Body,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl HttpBody for DeadlineBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<bytes::Bytes>, Self::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Pending => match self.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(axum::Error::new(BodyTimedOut)))),
                Poll::Pending => Poll::Pending,
            },
            ready => ready,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Gives every request body a deadline of `timeout` from now (its head has just arrived).
fn limit_body_time(app: Router, timeout: Duration) -> Router {
    app.layer(axum::middleware::from_fn(
        move |req: Request, next: axum::middleware::Next| {
            let req = if http_body::Body::is_end_stream(req.body()) {
                req
            } else {
                req.map(|inner| {
                    Body::new(DeadlineBody {
                        inner,
                        deadline: Box::pin(tokio::time::sleep(timeout)),
                    })
                })
            };
            next.run(req)
        },
    ))
}

/// Serves `app` until `stop` resolves, then lets open connections finish (up to 30 s).
async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    stop: impl std::future::Future<Output = ()>,
) {
    let app = limit_body_time(app, limits.body_timeout);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(limits.max_header_bytes as u32);
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        // Small writes (an SSE event, a response head) go out at once: without TCP_NODELAY,
        // Nagle's algorithm holds them until the peer's delayed ACK, up to 40 ms.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(Duration::from_secs(30), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after 30 s; closing them");
    }
}

/// Serves `app` on `listener` until a signal arrives.
pub async fn serve_until_signal(
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
) -> anyhow::Result<()> {
    serve(listener, app, limits, shutdown_signal()).await;
    Ok(())
}

/// A server running in the background of this process (tests, `demo`, `bench`).
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Running {
    /// Serves `app` on `listener` in a background task.
    pub fn spawn(listener: TcpListener, app: Router, limits: ServerLimits) -> anyhow::Result<Self> {
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, app, limits, async {
            let _ = stopped.await;
        }));
        Ok(Self {
            addr,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// `http://addr`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, lets requests in flight finish, and waits.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
