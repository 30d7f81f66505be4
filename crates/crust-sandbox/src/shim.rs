//! The shim API: HTTP/1.1 over the sandbox's unix socket
//! (`<root>/<id>/shim.sock`, 0600, also reachable where Kata's CLI looks:
//! `<kata shim dir>/<id>/shim-monitor.sock`, see [`crate::katashim`]).
//! Seed 000's `/direct-volume/stats` and `/direct-volume/resize`, plus the
//! lifecycle endpoints the CLI uses.
//!
//! The routes and wire types live in `crust-shim-api` ([`Call`] has the
//! table); this module serves them and is their client.

use std::convert::Infallible;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

mod blocking;
pub mod codes;

use crate::records::SandboxState;
use crate::records::Volume;
use crate::stats::{
    FreezeRequest, ResizeRequest, ResizeResponse, ThawRequest, ThawResponse, ThrottleRequest,
    VolumeStats,
};

pub use crust_shim_api::{
    AddVolumeRequest, ApiError, ApiResult, Code, Empty, ExecRequest, ExecResponse, KillRequest,
    LogsResponse, MAX_BODY, percent_decode, percent_encode,
};
use crust_shim_api::{Call, call::kata_endpoint};

pub use codes::{agent_code, handoff_code};

/// What the shim process implements behind the HTTP surface.
pub trait ShimHandler: Send + Sync + 'static {
    fn state(&self) -> impl Future<Output = ApiResult<SandboxState>> + Send;
    fn start(&self) -> impl Future<Output = ApiResult<SandboxState>> + Send;
    fn kill(&self, signal: i32) -> impl Future<Output = ApiResult<()>> + Send;
    /// Tears the sandbox down; the server stops accepting afterwards.
    fn shutdown(&self) -> impl Future<Output = ApiResult<()>> + Send;
    /// `path` is a volume path (target), its host device, or its guest path.
    fn stats(&self, path: String) -> impl Future<Output = ApiResult<VolumeStats>> + Send;
    fn resize(&self, req: ResizeRequest) -> impl Future<Output = ApiResult<ResizeResponse>> + Send;
    /// Freezes the volume's filesystem in the guest (thawed by the guest
    /// after `max_frozen_ms` at the latest).
    fn freeze(&self, req: FreezeRequest) -> impl Future<Output = ApiResult<()>> + Send;
    fn thaw(&self, req: ThawRequest) -> impl Future<Output = ApiResult<ThawResponse>> + Send;
    /// Sets the volume's I/O limits in the running guest.
    fn throttle(&self, req: ThrottleRequest) -> impl Future<Output = ApiResult<()>> + Send;
    fn add_volume(&self, volume_path: String) -> impl Future<Output = ApiResult<Volume>> + Send;
    fn exec(&self, req: ExecRequest) -> impl Future<Output = ApiResult<ExecResponse>> + Send;
    fn logs(&self) -> impl Future<Output = ApiResult<LogsResponse>> + Send;
    /// The sandbox's metrics in Prometheus text format 0.0.4.
    fn metrics(&self) -> impl Future<Output = ApiResult<String>> + Send;
}

/// Binds `path` (replacing a stale socket) with mode 0600.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Serves `handler` until `stop` turns true. A successful `/shutdown`
/// also flips `stop` (after its answer is written).
pub async fn serve<H: ShimHandler>(
    listener: UnixListener,
    handler: Arc<H>,
    stop: watch::Sender<bool>,
) {
    let mut stop_rx = stop.subscribe();
    let stop = Arc::new(stop);
    loop {
        tokio::select! {
            res = listener.accept() => {
                let Ok((stream, _)) = res else { continue };
                let handler = handler.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let handler = handler.clone();
                        let stop = stop.clone();
                        async move { Ok::<_, Infallible>(route(&*handler, &stop, req).await) }
                    });
                    if let Err(e) = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await
                    {
                        tracing::debug!("shim API connection: {e}");
                    }
                });
            }
            _ = stop_rx.wait_for(|s| *s) => break,
        }
    }
}

fn json_response<T: Serialize>(status: StatusCode, body: &T) -> Response<Full<Bytes>> {
    let bytes = serde_json::to_vec(body).expect("serializable");
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(bytes)))
        .expect("valid response")
}

fn reply<T: Serialize>(res: ApiResult<T>) -> Response<Full<Bytes>> {
    match res {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => json_response(e.code.http_status(), &e),
    }
}

/// An error on a Kata endpoint: text, never JSON (see the module doc).
fn text_error(e: &ApiError) -> Response<Full<Bytes>> {
    Response::builder()
        .status(e.code.http_status())
        .header("content-type", "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(e.to_text())))
        .expect("valid response")
}

/// Stats in Kata's shim spelling ([`VolumeStats::to_kata_json`]), so a
/// client built on Kata's types decodes them; errors in text.
fn reply_stats(res: ApiResult<VolumeStats>) -> Response<Full<Bytes>> {
    match res {
        Ok(s) => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(s.to_kata_json())))
            .expect("valid response"),
        Err(e) => text_error(&e),
    }
}

/// An answer on a Kata endpoint: JSON, errors in text.
fn reply_kata<T: Serialize>(res: ApiResult<T>) -> Response<Full<Bytes>> {
    match res {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => text_error(&e),
    }
}

async fn read_body(req: Request<Incoming>) -> ApiResult<Bytes> {
    Ok(Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            ApiError::new(
                Code::InvalidArgument,
                format!("reading the request body: {e}"),
            )
        })?
        .to_bytes())
}

/// Reads the call (crust-shim-api's routes), then runs it.
async fn route<H: ShimHandler>(
    h: &H,
    stop: &watch::Sender<bool>,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    tracing::debug!(%method, %path, "shim API request");
    let call = match read_body(req)
        .await
        .and_then(|body| Call::parse(method.as_str(), &path, query.as_deref(), &body))
    {
        Ok(c) => c,
        Err(e) if kata_endpoint(&path) => return text_error(&e),
        Err(e) => return reply::<Empty>(Err(e)),
    };
    dispatch(h, stop, call).await
}

async fn dispatch<H: ShimHandler>(
    h: &H,
    stop: &watch::Sender<bool>,
    call: Call,
) -> Response<Full<Bytes>> {
    match call {
        Call::Stats(p) => reply_stats(h.stats(p).await),
        Call::Resize(r) => reply_kata(h.resize(r).await),
        Call::Freeze(r) => reply(h.freeze(r).await.map(|()| Empty {})),
        Call::Thaw(r) => reply(h.thaw(r).await),
        Call::Throttle(r) => reply(h.throttle(r).await.map(|()| Empty {})),
        Call::State => reply(h.state().await),
        Call::Start => reply(h.start().await),
        Call::Kill(signal) => reply(h.kill(signal).await.map(|()| Empty {})),
        Call::Shutdown => {
            let res = h.shutdown().await;
            if res.is_ok() {
                // Let this answer go out before the listener closes.
                let stop = stop.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let _ = stop.send(true);
                });
            }
            reply(res.map(|()| Empty {}))
        }
        Call::AddVolume(p) => reply(h.add_volume(p).await),
        Call::Exec(x) => reply(h.exec(x).await),
        Call::Logs => reply(h.logs().await),
        Call::Metrics => match h.metrics().await {
            Ok(text) => Response::builder()
                .status(StatusCode::OK)
                .header("content-type", crate::metrics::CONTENT_TYPE)
                .body(Full::new(Bytes::from(text)))
                .expect("valid response"),
            // Text too: kata-monitor decodes any body as metrics.
            Err(e) => text_error(&e),
        },
    }
}

/// Failures of a call into a shim.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("cannot reach the shim at {socket}: {source}")]
    Unreachable {
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the shim did not answer {what} within {after:?}")]
    Timeout { what: String, after: Duration },
    #[error("{0}")]
    Api(#[from] ApiError),
    #[error("shim API protocol error: {0}")]
    Protocol(String),
}

fn stats_uri(path: &str) -> String {
    format!("/direct-volume/stats?path={}", percent_encode(path))
}

/// A client of one shim's API. Every call is bounded by a timeout.
#[derive(Debug, Clone)]
pub struct ShimClient {
    socket: PathBuf,
    timeout: Duration,
}

impl ShimClient {
    pub fn new(socket: impl Into<PathBuf>, timeout: Duration) -> ShimClient {
        ShimClient {
            socket: socket.into(),
            timeout,
        }
    }

    pub fn with_timeout(&self, timeout: Duration) -> ShimClient {
        ShimClient {
            socket: self.socket.clone(),
            timeout,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// One request/response; `body` is sent as JSON when given.
    pub async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ShimError> {
        let what = format!("{method} {path_and_query}");
        match tokio::time::timeout(self.timeout, self.call_inner(method, path_and_query, body))
            .await
        {
            Ok(r) => r,
            Err(_) => Err(ShimError::Timeout {
                what,
                after: self.timeout,
            }),
        }
    }

    async fn call_inner<T: DeserializeOwned>(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ShimError> {
        let stream =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| ShimError::Unreachable {
                    socket: self.socket.display().to_string(),
                    source,
                })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ShimError::Protocol(format!("handshake: {e}")))?;
        let conn = tokio::spawn(conn);
        let req = Request::builder()
            .method(method)
            .uri(path_and_query)
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ShimError::Protocol(format!("building the request: {e}")))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| ShimError::Protocol(format!("sending the request: {e}")))?;
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), 16 * MAX_BODY)
            .collect()
            .await
            .map_err(|e| ShimError::Protocol(format!("reading the answer: {e}")))?
            .to_bytes();
        conn.abort();
        if !status.is_success() {
            let err = ApiError::from_body(&bytes).unwrap_or_else(|| {
                ApiError::new(
                    Code::Internal,
                    format!("HTTP {status}: {}", String::from_utf8_lossy(&bytes)),
                )
            });
            return Err(ShimError::Api(err));
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| ShimError::Protocol(format!("malformed answer: {e}")))
    }

    pub async fn state(&self) -> Result<SandboxState, ShimError> {
        self.call(Method::GET, "/state", None).await
    }

    pub async fn start(&self) -> Result<SandboxState, ShimError> {
        self.call(Method::POST, "/start", None).await
    }

    pub async fn kill(&self, signal: i32) -> Result<(), ShimError> {
        let body = serde_json::to_vec(&KillRequest { signal }).expect("serializable");
        self.call::<Empty>(Method::POST, "/kill", Some(body))
            .await
            .map(drop)
    }

    pub async fn shutdown(&self) -> Result<(), ShimError> {
        self.call::<Empty>(Method::POST, "/shutdown", None)
            .await
            .map(drop)
    }

    pub async fn stats(&self, path: &str) -> Result<VolumeStats, ShimError> {
        self.call(Method::GET, &stats_uri(path), None).await
    }

    /// [`ShimClient::stats`] without an async runtime (see [`blocking`]).
    pub fn stats_blocking(&self, path: &str) -> Result<VolumeStats, ShimError> {
        self.get_blocking(&stats_uri(path))
    }

    pub async fn resize(&self, req: &ResizeRequest) -> Result<ResizeResponse, ShimError> {
        let body = serde_json::to_vec(req).expect("serializable");
        self.call(Method::POST, "/direct-volume/resize", Some(body))
            .await
    }

    pub async fn freeze(&self, req: &FreezeRequest) -> Result<(), ShimError> {
        let body = serde_json::to_vec(req).expect("serializable");
        self.call::<Empty>(Method::POST, "/volume/freeze", Some(body))
            .await
            .map(drop)
    }

    pub async fn thaw(&self, req: &ThawRequest) -> Result<ThawResponse, ShimError> {
        let body = serde_json::to_vec(req).expect("serializable");
        self.call(Method::POST, "/volume/thaw", Some(body)).await
    }

    pub async fn throttle(&self, req: &ThrottleRequest) -> Result<(), ShimError> {
        let body = serde_json::to_vec(req).expect("serializable");
        self.call::<Empty>(Method::POST, "/volume/throttle", Some(body))
            .await
            .map(drop)
    }

    pub async fn add_volume(&self, volume_path: &str) -> Result<Volume, ShimError> {
        let body = serde_json::to_vec(&AddVolumeRequest {
            volume_path: volume_path.into(),
        })
        .expect("serializable");
        self.call(Method::POST, "/volumes", Some(body)).await
    }

    pub async fn exec(&self, req: &ExecRequest) -> Result<ExecResponse, ShimError> {
        let body = serde_json::to_vec(req).expect("serializable");
        self.call(Method::POST, "/exec", Some(body)).await
    }

    pub async fn logs(&self) -> Result<LogsResponse, ShimError> {
        self.call(Method::GET, "/logs", None).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{FsFigures, VolumeStats};
    use serde::Deserialize;
    use std::sync::Mutex;

    /// A handler that records what it was asked (unit test of the HTTP layer only).
    #[derive(Default)]
    struct Fake {
        seen: Mutex<Vec<String>>,
    }

    impl ShimHandler for Fake {
        async fn state(&self) -> ApiResult<SandboxState> {
            Err(ApiError::new(Code::Unavailable, "no state in the fake"))
        }
        async fn start(&self) -> ApiResult<SandboxState> {
            Err(ApiError::new(Code::FailedPrecondition, "not created"))
        }
        async fn kill(&self, signal: i32) -> ApiResult<()> {
            self.seen.lock().unwrap().push(format!("kill {signal}"));
            Ok(())
        }
        async fn shutdown(&self) -> ApiResult<()> {
            self.seen.lock().unwrap().push("shutdown".into());
            Ok(())
        }
        async fn stats(&self, path: String) -> ApiResult<VolumeStats> {
            self.seen.lock().unwrap().push(format!("stats {path}"));
            if path == "/missing" {
                return Err(ApiError::new(Code::NotFound, "no such volume"));
            }
            let f = FsFigures {
                frsize: 1024,
                blocks: 10,
                bfree: 5,
                bavail: 4,
                files: 3,
                ffree: 1,
            };
            Ok(VolumeStats::from_figures(&f, path))
        }
        async fn resize(&self, req: ResizeRequest) -> ApiResult<ResizeResponse> {
            self.seen
                .lock()
                .unwrap()
                .push(format!("resize {} {}", req.volume_path, req.size));
            Ok(ResizeResponse {
                capacity_bytes: req.size,
            })
        }
        async fn freeze(&self, req: FreezeRequest) -> ApiResult<()> {
            self.seen
                .lock()
                .unwrap()
                .push(format!("freeze {} {}", req.volume_path, req.max_frozen_ms));
            Ok(())
        }
        async fn throttle(&self, req: ThrottleRequest) -> ApiResult<()> {
            self.seen
                .lock()
                .unwrap()
                .push(format!("throttle {} {}", req.volume_path, req.limits));
            Ok(())
        }
        async fn thaw(&self, req: ThawRequest) -> ApiResult<ThawResponse> {
            self.seen
                .lock()
                .unwrap()
                .push(format!("thaw {}", req.volume_path));
            Ok(ThawResponse {
                was_frozen: true,
                expired: false,
            })
        }
        async fn add_volume(&self, volume_path: String) -> ApiResult<Volume> {
            Err(ApiError::new(
                Code::NotFound,
                format!("no record for {volume_path}"),
            ))
        }
        async fn exec(&self, req: ExecRequest) -> ApiResult<ExecResponse> {
            Ok(ExecResponse {
                exit_code: 0,
                stdout: req.args.join(" "),
                stderr: String::new(),
            })
        }
        async fn logs(&self) -> ApiResult<LogsResponse> {
            Ok(LogsResponse {
                output: "hi".into(),
            })
        }
        async fn metrics(&self) -> ApiResult<String> {
            Ok("# TYPE crust_x gauge\ncrust_x 1\n".into())
        }
    }

    #[test]
    fn percent_roundtrip() {
        for s in [
            "/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/pv 1/mount",
            "/a?b&c=d%e",
            "/é",
        ] {
            assert_eq!(percent_decode(&percent_encode(s)).unwrap(), s);
        }
        assert_eq!(percent_decode("/a+b%2Fc").unwrap(), "/a+b/c");
        assert!(percent_decode("%4").is_err());
        assert!(percent_decode("%zz").is_err());
        assert!(percent_decode("%ff").is_err());
        // A sign is no hex digit (u8::from_str_radix alone accepted "+1").
        assert!(percent_decode("%+1").is_err());
    }

    #[tokio::test]
    #[allow(
        clippy::too_many_lines,
        reason = "one walk over the HTTP surface, request by request"
    )]
    async fn http_surface() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("shim.sock");
        let listener = bind(&sock).unwrap();
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let fake = Arc::new(Fake::default());
        let (stop, _) = watch::channel(false);
        let server = tokio::spawn(serve(listener, fake.clone(), stop));
        let c = ShimClient::new(&sock, Duration::from_secs(5));

        let path = "/k/pods/u/volumes/kubernetes.io~csi/pv a&b/mount";
        let s = c.stats(path).await.unwrap();
        assert_eq!(s.volume_condition.message, path);
        let s: VolumeStats = c
            .call(
                Method::GET,
                &format!("/direct-volume/stats/{}", percent_encode(path)),
                None,
            )
            .await
            .unwrap();
        assert_eq!(s.volume_condition.message, path);
        match c.stats("/missing").await {
            Err(ShimError::Api(e)) => assert_eq!(e.code, Code::NotFound),
            other => panic!("{other:?}"),
        }
        for body in [
            r#"{"volumePath":"/v","size":5}"#,
            r#"{"VolumePath":"/v","Size":5}"#,
            r#"{"volume_guest_path":"/v","size":5}"#,
        ] {
            let r: ResizeResponse = c
                .call(
                    Method::POST,
                    "/direct-volume/resize",
                    Some(body.as_bytes().to_vec()),
                )
                .await
                .unwrap();
            assert_eq!(r.capacity_bytes, 5);
        }
        match c
            .call::<ResizeResponse>(
                Method::POST,
                "/direct-volume/resize",
                Some(b"{\"size\":1}".to_vec()),
            )
            .await
        {
            Err(ShimError::Api(e)) => assert_eq!(e.code, Code::InvalidArgument),
            other => panic!("{other:?}"),
        }
        // The freeze limit: out of range never reaches the handler.
        for ms in [0, crust_agent_proto::MAX_FROZEN_MS + 1, u64::MAX] {
            let body = format!(r#"{{"volumePath":"/v","maxFrozenMs":{ms}}}"#);
            match c
                .call::<Empty>(Method::POST, "/volume/freeze", Some(body.into_bytes()))
                .await
            {
                Err(ShimError::Api(e)) => {
                    assert_eq!(e.code, Code::InvalidArgument, "{ms}: {e}");
                    assert!(e.message.contains("600000"), "{e}");
                }
                other => panic!("{ms}: {other:?}"),
            }
        }
        c.freeze(&FreezeRequest {
            volume_path: "/v".into(),
            max_frozen_ms: crust_agent_proto::MAX_FROZEN_MS,
        })
        .await
        .unwrap();
        c.throttle(&ThrottleRequest {
            volume_path: "/v".into(),
            limits: "iops=200".into(),
        })
        .await
        .unwrap();
        match c.call::<Empty>(Method::GET, "/nope", None).await {
            Err(ShimError::Api(e)) => assert_eq!(e.code, Code::NotFound),
            other => panic!("{other:?}"),
        }
        c.kill(15).await.unwrap();
        assert_eq!(
            c.exec(&ExecRequest {
                args: vec!["a".into(), "b".into()],
                env: vec![],
                timeout_ms: None
            })
            .await
            .unwrap()
            .stdout,
            "a b"
        );
        assert_eq!(c.logs().await.unwrap().output, "hi");
        c.shutdown().await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            fake.seen.lock().unwrap().as_slice(),
            [
                format!("stats {path}"),
                format!("stats {path}"),
                "stats /missing".to_string(),
                "resize /v 5".into(),
                "resize /v 5".into(),
                "resize /v 5".into(),
                "freeze /v 600000".into(),
                "throttle /v iops=200".into(),
                "kill 15".into(),
                "shutdown".into()
            ]
        );
        // Nobody listens any more.
        assert!(matches!(
            c.state().await,
            Err(ShimError::Unreachable { .. })
        ));
    }

    /// The blocking GET the per-poll verbs use reads what the real server
    /// answers, its error codes, a silent peer and a missing socket.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blocking_stats_against_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("shim.sock");
        let fake = Arc::new(Fake::default());
        let (stop, _) = watch::channel(false);
        let server = tokio::spawn(serve(bind(&sock).unwrap(), fake.clone(), stop));
        let c = ShimClient::new(&sock, Duration::from_secs(5));
        let path = "/k/pods/u/volumes/kubernetes.io~csi/pv a&b/mount";
        let (got, missing) = tokio::task::spawn_blocking({
            let c = c.clone();
            move || (c.stats_blocking(path), c.stats_blocking("/missing"))
        })
        .await
        .unwrap();
        assert_eq!(got.unwrap().volume_condition.message, path);
        match missing {
            Err(ShimError::Api(e)) => assert_eq!(e.code, Code::NotFound),
            other => panic!("{other:?}"),
        }
        c.shutdown().await.unwrap();
        server.await.unwrap();
        let gone = tokio::task::spawn_blocking(move || c.stats_blocking("/x"))
            .await
            .unwrap();
        assert!(
            matches!(gone, Err(ShimError::Unreachable { .. })),
            "{gone:?}"
        );

        let silent = dir.path().join("silent.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&silent).unwrap();
        let c = ShimClient::new(&silent, Duration::from_millis(300));
        let t = std::time::Instant::now();
        let r = tokio::task::spawn_blocking(move || c.stats_blocking("/x"))
            .await
            .unwrap();
        assert!(matches!(r, Err(ShimError::Timeout { .. })), "{r:?}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    /// Issue 25 item 5: what a Go consumer does with Kata's stats body
    /// (`json.Unmarshal` into the agent's `VolumeStatsResponse`: unknown
    /// keys ignored, missing ones zero). An error answer must fail that
    /// decode, on every `/direct-volume/*` path; crust's own client still
    /// gets the code.
    #[tokio::test]
    async fn kata_endpoints_answer_errors_no_stats_reader_takes_for_stats() {
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct GoVolumeStatsResponse {
            #[serde(default)]
            usage: Vec<serde_json::Value>,
            #[serde(default)]
            volume_condition: Option<serde_json::Value>,
        }
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("shim.sock");
        let (stop, _) = watch::channel(false);
        let server = tokio::spawn(serve(bind(&sock).unwrap(), Arc::new(Fake::default()), stop));
        let c = ShimClient::new(&sock, Duration::from_secs(5));
        let raw = |method: &'static str, uri: &'static str, body: &'static str| {
            let sock = sock.clone();
            tokio::task::spawn_blocking(move || {
                use std::io::{Read, Write};
                let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
                write!(
                    s,
                    "{method} {uri} HTTP/1.1\r\nHost: shim\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
                .unwrap();
                let mut out = String::new();
                s.read_to_string(&mut out).unwrap();
                out.split_once("\r\n\r\n").unwrap().1.to_string()
            })
        };
        for (method, uri, body) in [
            ("GET", "/direct-volume/stats?path=%2Fmissing", ""),
            ("GET", "/direct-volume/stats/%2Fmissing", ""),
            ("GET", "/direct-volume/stats", ""),
            ("GET", "/direct-volume/stats?path=%zz", ""),
            ("POST", "/direct-volume/resize", "{\"Size\":1}"),
            ("GET", "/direct-volume/nope", ""),
        ] {
            let answer = raw(method, uri, body).await.unwrap();
            assert!(
                serde_json::from_str::<GoVolumeStatsResponse>(&answer).is_err(),
                "{method} {uri}: {answer}"
            );
            assert!(ApiError::from_body(answer.as_bytes()).is_some(), "{answer}");
        }
        match c.stats("/missing").await {
            Err(ShimError::Api(e)) => {
                assert_eq!(
                    (e.code, e.message.as_str()),
                    (Code::NotFound, "no such volume")
                )
            }
            other => panic!("{other:?}"),
        }
        // Other endpoints keep their JSON errors.
        let answer = raw("POST", "/start", "").await.unwrap();
        assert_eq!(
            serde_json::from_str::<ApiError>(&answer).unwrap().code,
            Code::FailedPrecondition
        );
        c.shutdown().await.unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn client_times_out_on_a_silent_peer() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let _listener = UnixListener::bind(&sock).unwrap(); // accepts, never answers
        let c = ShimClient::new(&sock, Duration::from_millis(300));
        match c.stats("/x").await {
            Err(ShimError::Timeout { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
}
