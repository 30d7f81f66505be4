//! Prometheus metrics of the plugin, served as OpenMetrics text at
//! `http://<--metrics-address>/metrics` by a small hyper server.
//!
//! * `volumes_published_with_deferred_ops_total` (counter): successful
//!   NodePublishVolume calls with deferred filesystem operations, repeats
//!   included (the KEP's definition: each call that returns success).
//! * `volume_stats_health_status_abnormal` (gauge): how many volumes the
//!   last NodeGetVolumeStats reported abnormal. Each volume counts once
//!   while its latest stats say abnormal; a normal answer or its deletion
//!   takes it out again. A gauge (not a counter of abnormal answers) so
//!   an alert can fire on "> 0" and clear by itself.
//! * `csi_rpc_requests_total{method, code}` (counter) and
//!   `csi_rpc_duration_seconds{method}` (histogram) for every CSI RPC,
//!   measured by a tower layer around the gRPC server ([`RpcMetricsLayer`]).
//! * `listener_refused_connections_total{listener, reason}` (counter),
//!   `listener_idle_closed_connections_total{listener}` (counter) and
//!   `listener_open_connections{listener}` (gauge) for the TCP listeners
//!   the pod network reaches (`peer`, `metrics`; [`crust_tcp_guard`]).

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use http_body_util::Full;
use hyper::body::Bytes;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tonic::Code;
use tonic::codegen::http;

/// OpenMetrics text format (what Prometheus negotiates first).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    listener: String,
    reason: String,
}

type HistogramFamily = Family<MethodLabels, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 0.25 ms .. ~8 s: bind mounts take well under a millisecond, a
    // first stage with mkfs or a runtime CLI call can take seconds.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

/// The plugin's metric registry.
pub struct Metrics {
    registry: Registry,
    deferred_publishes: Counter,
    abnormal: Gauge,
    abnormal_volumes: Mutex<HashSet<String>>,
    rpc_requests: Family<RpcLabels, Counter>,
    rpc_duration: HistogramFamily,
    /// The guarded listeners' own counters, copied in at each scrape.
    listeners: Mutex<Vec<(&'static str, Arc<crust_tcp_guard::Counters>)>>,
    refused: Family<RefusalLabels, Counter>,
    idle_closed: Family<ListenerLabels, Counter>,
    open: Family<ListenerLabels, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let deferred_publishes = Counter::default();
        // The `_total` suffix is added by the encoder.
        registry.register(
            "volumes_published_with_deferred_ops",
            "NodePublishVolume calls with deferred filesystem operations that returned success",
            deferred_publishes.clone(),
        );
        let abnormal = Gauge::default();
        registry.register(
            "volume_stats_health_status_abnormal",
            "Volumes whose latest NodeGetVolumeStats reported an abnormal volume condition",
            abnormal.clone(),
        );
        let rpc_requests = Family::<RpcLabels, Counter>::default();
        registry.register(
            "csi_rpc_requests",
            "CSI RPCs served, by method and gRPC status code",
            rpc_requests.clone(),
        );
        let rpc_duration: HistogramFamily =
            Family::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "csi_rpc_duration_seconds",
            "Time to answer a CSI RPC, by method",
            rpc_duration.clone(),
        );
        let refused = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "listener_refused_connections",
            "TCP connections closed at accept, by listener and bound (full, per_peer)",
            refused.clone(),
        );
        let idle_closed = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "listener_idle_closed_connections",
            "TCP connections closed for holding no request, by listener",
            idle_closed.clone(),
        );
        let open = Family::<ListenerLabels, Gauge>::default();
        registry.register(
            "listener_open_connections",
            "TCP connections open now, by listener",
            open.clone(),
        );
        Metrics {
            registry,
            deferred_publishes,
            abnormal,
            abnormal_volumes: Mutex::default(),
            rpc_requests,
            rpc_duration,
            listeners: Mutex::default(),
            refused,
            idle_closed,
            open,
        }
    }

    /// Reports the guarded listener `name`'s counters from now on.
    pub fn watch_listener(&self, name: &'static str, counters: Arc<crust_tcp_guard::Counters>) {
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((name, counters));
    }

    /// Copies the listeners' counters into the registry's.
    fn sync_listeners(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let catch_up = |c: &Counter, now: u64| {
            let seen = c.get();
            if now > seen {
                c.inc_by(now - seen);
            }
        };
        for (name, c) in self
            .listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let listener = name.to_string();
            for (reason, n) in [
                ("full", c.refused_full.load(Relaxed)),
                ("per_peer", c.refused_per_peer.load(Relaxed)),
            ] {
                let labels = RefusalLabels {
                    listener: listener.clone(),
                    reason: reason.into(),
                };
                catch_up(&self.refused.get_or_create(&labels), n);
            }
            let labels = ListenerLabels { listener };
            catch_up(
                &self.idle_closed.get_or_create(&labels),
                c.closed_idle.load(Relaxed),
            );
            self.open
                .get_or_create(&labels)
                .set(c.open.load(Relaxed) as i64);
        }
    }

    pub fn deferred_publish_succeeded(&self) {
        self.deferred_publishes.inc();
    }

    /// Records the condition NodeGetVolumeStats just reported for `volume`.
    pub fn observe_condition(&self, volume: &str, abnormal: bool) {
        let mut set = self
            .abnormal_volumes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if abnormal {
            set.insert(volume.to_string());
        } else {
            set.remove(volume);
        }
        self.abnormal.set(set.len() as i64);
    }

    /// The volume is gone: it no longer counts as abnormal.
    pub fn forget_volume(&self, volume: &str) {
        self.observe_condition(volume, false);
    }

    pub fn observe_rpc(&self, method: &str, code: Code, seconds: f64) {
        self.rpc_requests
            .get_or_create(&RpcLabels {
                method: method.to_string(),
                code: code_name(code).to_string(),
            })
            .inc();
        self.rpc_duration
            .get_or_create(&MethodLabels {
                method: method.to_string(),
            })
            .observe(seconds);
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        self.sync_listeners();
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The canonical gRPC name of a status code.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The RPC name of a gRPC path (`/csi.v1.Node/NodePublishVolume` ->
/// `NodePublishVolume`); anything that is not a CSI method is `unknown`
/// so a client cannot grow the label set without bound.
fn method_of(path: &str) -> String {
    let known_service = ["/csi.v1.Identity/", "/csi.v1.Controller/", "/csi.v1.Node/"]
        .iter()
        .find(|p| path.starts_with(*p));
    match known_service {
        Some(prefix) => {
            let name = &path[prefix.len()..];
            if !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphabetic())
            {
                name.to_string()
            } else {
                "unknown".to_string()
            }
        }
        None => "unknown".to_string(),
    }
}

/// Tower layer counting and timing every RPC. CSI RPCs are unary: tonic
/// has run the handler when the response head exists, and an error is a
/// trailers-only response whose head carries `grpc-status`; no
/// `grpc-status` in the head means the call succeeded.
#[derive(Clone)]
pub struct RpcMetricsLayer {
    metrics: Arc<Metrics>,
}

impl RpcMetricsLayer {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        RpcMetricsLayer { metrics }
    }
}

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;
    fn layer(&self, inner: S) -> RpcMetrics<S> {
        RpcMetrics {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RpcMetrics<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S, B, RB> tower::Service<http::Request<B>> for RpcMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = method_of(req.uri().path());
        let metrics = self.metrics.clone();
        let started = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            let code = match &r {
                Ok(resp) => resp
                    .headers()
                    .get("grpc-status")
                    .map(|v| Code::from_bytes(v.as_bytes()))
                    .unwrap_or(Code::Ok),
                Err(_) => Code::Internal,
            };
            metrics.observe_rpc(&method, code, started.elapsed().as_secs_f64());
            r
        })
    }
}

/// Binds the metrics endpoint (before the CSI socket, so a bad address
/// stops the plugin at start).
pub async fn bind(address: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address).await
}

/// The metrics listener's bounds: Prometheus scrapes with one connection
/// per target, so a few (the idle time is `--listener-idle-timeout`'s).
pub const METRICS_LIMITS: crust_tcp_guard::Limits = crust_tcp_guard::Limits {
    connections: 64,
    per_peer: 8,
    idle: std::time::Duration::from_secs(10),
};

/// Serves `GET /metrics` until `shutdown` fires, under `limits`
/// ([`crust_tcp_guard`]: anyone on the pod network reaches this port).
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    limits: crust_tcp_guard::Limits,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    let counters = Arc::new(crust_tcp_guard::Counters::default());
    metrics.watch_listener("metrics", counters.clone());
    let mut incoming = crust_tcp_guard::incoming(listener, limits, counters, "metrics endpoint");
    loop {
        let conn = tokio::select! {
            c = incoming.accept() => c,
            _ = shutdown.changed() => return,
        };
        let metrics = metrics.clone();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            let activity = conn.activity().clone();
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let metrics = metrics.clone();
                let _busy = activity.begin();
                async move { Ok::<_, Infallible>(respond(&metrics, &req)) }
            });
            let conn = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.idle)
                .serve_connection(hyper_util::rt::TokioIo::new(conn), svc);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "metrics connection ended with an error");
                    }
                }
                _ = stop.changed() => conn.as_mut().graceful_shutdown(),
            }
        });
    }
}

fn respond<B>(metrics: &Metrics, req: &hyper::Request<B>) -> hyper::Response<Full<Bytes>> {
    let reply = |status: u16, ctype: &str, body: String| {
        hyper::Response::builder()
            .status(status)
            .header("content-type", ctype)
            .body(Full::new(Bytes::from(body)))
            .expect("static response parts are valid")
    };
    if req.uri().path() != "/metrics" {
        return reply(
            404,
            "text/plain",
            "not found; metrics are at /metrics\n".into(),
        );
    }
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return reply(405, "text/plain", "only GET is allowed\n".into());
    }
    reply(200, CONTENT_TYPE, metrics.encode())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_the_documented_names() {
        let m = Metrics::new();
        m.deferred_publish_succeeded();
        m.deferred_publish_succeeded();
        m.observe_condition("vol-a", true);
        m.observe_condition("vol-b", true);
        m.observe_condition("vol-a", true);
        m.observe_condition("vol-b", false);
        m.observe_rpc("NodePublishVolume", Code::Ok, 0.001);
        m.observe_rpc("NodePublishVolume", Code::FailedPrecondition, 0.002);
        let text = m.encode();
        assert!(
            text.contains("\nvolumes_published_with_deferred_ops_total 2\n"),
            "{text}"
        );
        assert!(
            text.contains("\nvolume_stats_health_status_abnormal 1\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "csi_rpc_requests_total{method=\"NodePublishVolume\",code=\"FAILED_PRECONDITION\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("csi_rpc_duration_seconds_count{method=\"NodePublishVolume\"} 2"),
            "{text}"
        );
        m.forget_volume("vol-a");
        assert!(
            m.encode()
                .contains("\nvolume_stats_health_status_abnormal 0\n")
        );
    }

    #[test]
    fn method_labels_are_bounded() {
        assert_eq!(
            method_of("/csi.v1.Node/NodePublishVolume"),
            "NodePublishVolume"
        );
        assert_eq!(method_of("/csi.v1.Identity/Probe"), "Probe");
        assert_eq!(method_of("/evil/Anything"), "unknown");
        assert_eq!(method_of("/csi.v1.Node/a{b}"), "unknown");
    }
}
