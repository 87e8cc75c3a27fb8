//! `prefix-router epp`: an endpoint picker for the Gateway API Inference Extension.
//!
//! A conformant gateway (Envoy, Istio, agentgateway, NGINX Gateway Fabric) asks the picker
//! where each inference request goes over Envoy's external-processing gRPC service
//! (`envoy.service.ext_proc.v3.ExternalProcessor`), as the extension's endpoint-picker protocol
//! defines it: the picker reads the whole request, answers with the chosen endpoint and its
//! fallbacks (`x-gateway-destination-endpoint`, header and `envoy.lb` metadata), and watches
//! the response pass. The decision is `serve`'s: the same core, policies, stores, KV events,
//! tenants and gateway queue; only the transport differs. The gateway proxies the bytes.
//!
//! Beside the gRPC service: gRPC health (`liveness`, `readiness` and the ext_proc service's
//! name) on the same port, and `/metrics` and `/health` over HTTP on `--listen`.
//!
//! The gRPC port is bounded like the HTTP one: at most `--max-concurrent` streams at once (one
//! more is refused with RESOURCE_EXHAUSTED), a stream silent for longer than the request
//! timeout is closed, and TLS (mutual, with a client CA) is available.

mod envoy;
mod exchange;
mod metrics;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic_health::ServingStatus;

use crate::serve::{Gateway, ServeArgs};
use crate::server::{self, Running};
pub use envoy::{DESTINATION, LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE};
use exchange::Exchange;
use metrics::EppMetrics;

/// The ext_proc service's name, as gateways ask its health.
pub const SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

#[derive(clap::Args, Debug, Clone)]
pub struct EppArgs {
    /// Address of the gRPC service: ext_proc and gRPC health (`--listen` serves `/metrics`
    /// and `/health` over HTTP).
    #[arg(
        long,
        env = "PREFIX_ROUTER_GRPC_LISTEN",
        default_value = "127.0.0.1:9002"
    )]
    pub grpc_listen: SocketAddr,
    /// Serve gRPC over TLS with this certificate chain (PEM), with `--grpc-tls-key`.
    #[arg(long, env = "PREFIX_ROUTER_GRPC_TLS_CERT")]
    pub grpc_tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of `--grpc-tls-cert`.
    #[arg(long, env = "PREFIX_ROUTER_GRPC_TLS_KEY")]
    pub grpc_tls_key: Option<std::path::PathBuf>,
    /// Require gateways to present a client certificate signed by this CA (PEM): mutual TLS.
    #[arg(long, env = "PREFIX_ROUTER_GRPC_TLS_CLIENT_CA")]
    pub grpc_tls_client_ca: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

impl EppArgs {
    /// The flags that are the picker's own, not `serve`'s (left out of the config-file merge).
    pub const OWN_FLAGS: &'static [&'static str] = &[
        "--grpc-listen",
        "--grpc-tls-cert",
        "--grpc-tls-key",
        "--grpc-tls-client-ca",
    ];

    /// The gRPC server's TLS settings, if TLS is asked for.
    fn tls(&self) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
        use anyhow::Context;
        let read = |flag: &str, path: &std::path::Path| {
            std::fs::read(path).with_context(|| format!("{flag}: cannot read {}", path.display()))
        };
        let (cert, key) = match (&self.grpc_tls_cert, &self.grpc_tls_key) {
            (None, None) => {
                anyhow::ensure!(
                    self.grpc_tls_client_ca.is_none(),
                    "--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key"
                );
                return Ok(None);
            }
            (Some(cert), Some(key)) => (cert, key),
            _ => anyhow::bail!("--grpc-tls-cert and --grpc-tls-key go together"),
        };
        let identity = tonic::transport::Identity::from_pem(
            read("--grpc-tls-cert", cert)?,
            read("--grpc-tls-key", key)?,
        );
        let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.grpc_tls_client_ca {
            tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(read(
                "--grpc-tls-client-ca",
                ca,
            )?));
        }
        Ok(Some(tls))
    }
}

/// What every stream shares.
pub(crate) struct Picker {
    gw: Arc<Gateway>,
    metrics: EppMetrics,
    /// Streams open at once, at most `--max-concurrent`.
    streams: Arc<tokio::sync::Semaphore>,
    /// A stream whose gateway sends nothing for this long is closed.
    idle: Duration,
}

/// The ext_proc service: one task per stream.
#[derive(Clone)]
struct ExtProc(Arc<Picker>);

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream =
        tokio_stream::wrappers::ReceiverStream<Result<ProcessingResponse, tonic::Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let Ok(slot) = self.0.streams.clone().try_acquire_owned() else {
            self.0.metrics.refused("too_many_streams");
            return Err(tonic::Status::resource_exhausted(
                "the endpoint picker has as many streams open as --max-concurrent allows",
            ));
        };
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let picker = self.0.clone();
        let idle = picker.idle;
        tokio::spawn(async move {
            let _slot = slot;
            let mut exchange = Exchange::new(picker);
            loop {
                let message = tokio::select! {
                    m = tokio::time::timeout(idle, inbound.message()) => m,
                    _ = tx.closed() => break,
                };
                let message = match message {
                    Ok(Ok(Some(m))) => m,
                    Ok(Ok(None)) => break,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "ext_proc stream ended");
                        break;
                    }
                    Err(_) => {
                        tracing::debug!(?idle, "ext_proc stream idle for too long: closed");
                        break;
                    }
                };
                // A gateway that gives up while the request waits (in the queue, say) takes
                // its place with it.
                let answers = tokio::select! {
                    a = exchange.on_message(message) => a,
                    _ = tx.closed() => break,
                };
                match answers {
                    Ok(answers) => {
                        for answer in answers {
                            if tx.send(Ok(answer)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(status) => {
                        tracing::warn!(error = %status.message(), "ext_proc stream refused");
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                }
            }
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

/// A picker running in the background (tests, bench): its gRPC and HTTP addresses.
pub struct RunningPicker {
    pub grpc: SocketAddr,
    pub http: Running,
    pub gateway: Arc<Gateway>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl RunningPicker {
    /// `http://grpc-addr`, for a gRPC client.
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc)
    }
}

impl Drop for RunningPicker {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Builds the picker and serves it on the given listeners until `stop` resolves.
async fn start(
    args: EppArgs,
    grpc: TcpListener,
    k8s_client: Option<kube::Client>,
) -> anyhow::Result<(Arc<Picker>, impl std::future::Future<Output = ()>)> {
    let tls = args.tls()?;
    let (gw, metrics) = crate::serve::gateway_with(&args.serve, EppMetrics::register).await?;
    let synced = crate::serve::start_background(&gw, &args.serve, k8s_client).await?;
    let max_streams = args.serve.limits.max_concurrent.max(1);
    let picker = Arc::new(Picker {
        gw: gw.clone(),
        metrics,
        streams: Arc::new(tokio::sync::Semaphore::new(max_streams)),
        // The longest a gateway may legitimately say nothing: while a whole answer is
        // generated (up to the request timeout).
        idle: args.serve.request_timeout + Duration::from_secs(30),
    });
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    // Ready once the backends are known (the pool's pods listed).
    for name in ["", "readiness", SERVICE] {
        health
            .set_service_status(name, ServingStatus::NotServing)
            .await;
    }
    tokio::spawn(async move {
        while !synced.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for name in ["", "readiness", SERVICE] {
            health
                .set_service_status(name, ServingStatus::Serving)
                .await;
        }
    });
    let service = ExternalProcessorServer::new(ExtProc(picker.clone()))
        .max_decoding_message_size(args.serve.max_body + (1 << 20));
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .tcp_keepalive(Some(Duration::from_secs(60)))
        .max_concurrent_streams(Some(u32::try_from(max_streams).unwrap_or(u32::MAX)));
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    let router = builder.add_service(health_service).add_service(service);
    // Every answer is a small message the gateway waits for: Nagle would hold it back.
    let incoming = tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true));
    let serve = async move {
        if let Err(e) = router
            .serve_with_incoming_shutdown(incoming, std::future::pending())
            .await
        {
            tracing::error!(error = %e, "the gRPC server stopped");
        }
    };
    Ok((picker, serve))
}

/// The picker's HTTP side: metrics and health.
fn ops_app(gw: Arc<Gateway>) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(crate::serve::metrics_text))
        .route("/health", get(crate::serve::health))
        .with_state(gw)
}

/// Runs the picker until SIGINT or SIGTERM.
pub async fn run(args: EppArgs) -> anyhow::Result<()> {
    let grpc = server::bind(args.grpc_listen).await?;
    let http = server::bind(args.serve.listen).await?;
    let grpc_addr = grpc.local_addr()?;
    let (picker, serve_grpc) = start(args.clone(), grpc, None).await?;
    tracing::info!(
        grpc = %grpc_addr,
        http = %http.local_addr()?,
        policy = picker.gw.core.policy_name(),
        store = picker.gw.core.store().kind(),
        discovery = args.serve.discovery.as_str(),
        pool = args.serve.inference_pool.as_deref().unwrap_or("-"),
        "endpoint picker ready"
    );
    let grpc_task = tokio::spawn(serve_grpc);
    server::serve_until_signal(http, ops_app(picker.gw.clone()), args.serve.limits.clone()).await?;
    grpc_task.abort();
    Ok(())
}

/// Starts a picker in the background on bound listeners (tests give a fake Kubernetes API).
pub async fn spawn(
    args: EppArgs,
    grpc: TcpListener,
    http: TcpListener,
    k8s_client: Option<kube::Client>,
) -> anyhow::Result<RunningPicker> {
    let grpc_addr = grpc.local_addr()?;
    let (picker, serve_grpc) = start(args.clone(), grpc, k8s_client).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        tokio::select! {
            _ = serve_grpc => {}
            _ = stopped => {}
        }
    });
    Ok(RunningPicker {
        grpc: grpc_addr,
        http: Running::spawn(http, ops_app(picker.gw.clone()), args.serve.limits.clone())?,
        gateway: picker.gw.clone(),
        stop: Some(stop),
    })
}
