//! Serving simulated servers: the accept loop with a kill switch, and fleets of servers.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use anyhow::Context as _;
use axum::body::Body;
use axum::http::Request;
use axum::response::Response;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tower::Service;

use crate::api::{self, Server};
use crate::config::SimConfig;
use crate::engine::Engine;

/// Drops every request but `/sim/...` while the server is killed: the connection closes
/// without an answer, as when a vLLM process dies. An answer the server counted as a success
/// ([`api::Counted`]) goes out even if the kill came after it was made.
#[derive(Clone)]
struct KillSwitch {
    router: Router,
    engine: Arc<Engine>,
}

impl Service<Request<Incoming>> for KillSwitch {
    type Response = Response;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let control = req.uri().path().starts_with("/sim/");
        let engine = self.engine.clone();
        if !control && engine.is_killed() {
            return Box::pin(async { Err(std::io::Error::other("simulated server is killed")) });
        }
        let answer = self.router.call(req.map(Body::new));
        Box::pin(async move {
            let response: Result<Response, Infallible> = answer.await;
            let response = response.unwrap_or_else(|never| match never {});
            let counted = response.extensions().get::<api::Counted>().is_some();
            if !control && !counted && engine.is_killed() {
                return Err(std::io::Error::other("simulated server is killed"));
            }
            Ok(response)
        })
    }
}

/// One simulated vLLM server running in this process.
pub struct SimServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    /// Its KV-event publisher (`--kv-events`).
    pub kv_events: Option<String>,
    /// The publisher's replay socket (with `--kv-events`).
    pub kv_replay: Option<String>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl SimServer {
    /// Serves a new simulated server on `listener`.
    pub async fn spawn(listener: TcpListener, config: Arc<SimConfig>) -> anyhow::Result<Self> {
        let addr = listener.local_addr()?;
        let kv = config.kv_events;
        let block_size = config.block_size;
        let engine = Engine::start(config);
        let (kv_events, kv_replay) = if kv {
            let publisher = crate::events::start(block_size).await?;
            engine.publish_to(publisher.changes);
            (Some(publisher.endpoint), Some(publisher.replay))
        } else {
            (None, None)
        };
        let app = KillSwitch {
            router: api::router(Server::new(engine.clone(), addr)),
            engine: engine.clone(),
        };
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, app, stopped));
        Ok(Self {
            addr,
            engine,
            kv_events,
            kv_replay,
            stop,
            task,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, closes open connections and the engine.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        self.engine.shutdown();
        let _ = self.task.await;
    }
}

async fn accept_loop(listener: TcpListener, app: KillSwitch, mut stopped: watch::Receiver<bool>) {
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = stopped.changed() => return,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            let builder = auto::Builder::new(TokioExecutor::new());
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = connection => {}
                _ = stopped.changed() => {}
            }
        });
    }
}

/// N simulated servers in one process.
pub struct Fleet {
    pub servers: Vec<SimServer>,
}

impl Fleet {
    /// Starts `n` servers. With a port of 0 in `listen`, each takes a free port; otherwise
    /// they take consecutive ports from it.
    pub async fn start(config: SimConfig, n: usize, listen: SocketAddr) -> anyhow::Result<Self> {
        let config = Arc::new(config.load()?);
        let mut servers = Vec::with_capacity(n);
        for i in 0..n {
            let addr = if listen.port() == 0 {
                listen
            } else {
                let port = u16::try_from(usize::from(listen.port()) + i)
                    .context("not enough ports above --listen for --servers")?;
                SocketAddr::new(listen.ip(), port)
            };
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?;
            servers.push(SimServer::spawn(listener, config.clone()).await?);
        }
        Ok(Self { servers })
    }

    /// The servers' KV-event publishers (empty without `--kv-events`).
    pub fn kv_events(&self) -> Vec<String> {
        self.servers
            .iter()
            .filter_map(|s| s.kv_events.clone())
            .collect()
    }

    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(SimServer::url).collect()
    }

    pub async fn shutdown(self) {
        for server in self.servers {
            server.shutdown().await;
        }
    }
}
