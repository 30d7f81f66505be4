//! The shim API's routes: a request's method, path, query and body read
//! into the [`Call`] they name, and back.
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | GET (or POST) | `/direct-volume/stats?path=<escaped>` (or GET `/direct-volume/stats/<escaped>`) | | `VolumeStats` in Kata's spelling (units 1/2, zero fields left out) |
//! | POST | `/direct-volume/resize` | [`ResizeRequest`] | [`crate::ResizeResponse`] |
//! | POST | `/volume/freeze` | [`FreezeRequest`] | `{}` |
//! | POST | `/volume/thaw` | [`ThawRequest`] | [`crate::ThawResponse`] |
//! | POST | `/volume/throttle` | [`ThrottleRequest`] | `{}` |
//! | GET  | `/state` | | `SandboxState` |
//! | POST | `/start` | | `SandboxState` |
//! | POST | `/kill` | [`crate::KillRequest`] | `{}` |
//! | POST | `/shutdown` | | `{}` (the shim exits afterwards) |
//! | POST | `/volumes` | [`crate::AddVolumeRequest`] | `Volume` |
//! | POST | `/exec` | [`ExecRequest`] | [`crate::ExecResponse`] |
//! | GET  | `/logs` | | [`crate::LogsResponse`] |
//! | GET  | `/metrics` | | Prometheus text 0.0.4, what kata-monitor scrapes |
//!
//! Errors are `{"code": "NOT_FOUND", "message": "..."}` with a matching
//! HTTP status, except on Kata's endpoints ([`kata_endpoint`]): there they
//! are plain text, `NOT_FOUND: ...` ([`ApiError::to_text`]), as Kata's shim
//! answers in text. Kata's CLI prints whatever body `stats` gets with exit
//! status 0, and a Go consumer decoding a JSON error object into Kata's
//! stats type gets zero usage and no condition ("no data, no problem");
//! text fails to decode as stats in every JSON reader.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{
    AddVolumeRequest, ApiError, ApiResult, Code, ExecRequest, FreezeRequest, KillRequest,
    ResizeRequest, ThawRequest, ThrottleRequest, percent_decode, percent_encode,
};

const STATS: &str = "/direct-volume/stats";
const KATA_PREFIX: &str = "/direct-volume/";

/// One call of the shim API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// A volume's stats; the path is a volume path, its host device or
    /// its guest path.
    Stats(String),
    Resize(ResizeRequest),
    /// Checked against the freeze time limit at the door.
    Freeze(FreezeRequest),
    Thaw(ThawRequest),
    Throttle(ThrottleRequest),
    State,
    Start,
    Kill(i32),
    Shutdown,
    AddVolume(String),
    Exec(ExecRequest),
    Logs,
    Metrics,
}

/// A request as a client sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wire {
    pub method: &'static str,
    pub path_and_query: String,
    /// JSON, when the call has a body.
    pub body: Option<Vec<u8>>,
}

/// Whether errors on `path` are answered in Kata's text form.
pub fn kata_endpoint(path: &str) -> bool {
    path.starts_with(KATA_PREFIX)
}

impl Call {
    /// Reads a request. `query` is what follows `?` (none: no `?`); `body`
    /// is read only by calls that take one.
    pub fn parse(method: &str, path: &str, query: Option<&str>, body: &[u8]) -> ApiResult<Call> {
        let post = method == "POST";
        let get = method == "GET";
        let call = match path {
            STATS if get || post => {
                let p = query.and_then(|q| query_param(q, "path")).ok_or_else(|| {
                    ApiError::new(Code::InvalidArgument, "missing query parameter path")
                })?;
                Call::Stats(percent_decode(p)?)
            }
            // Seed 000's curl example puts the escaped path in the URL path.
            p if get && p.starts_with(STATS) && p[STATS.len()..].starts_with('/') => {
                Call::Stats(percent_decode(&p[STATS.len() + 1..])?)
            }
            "/direct-volume/resize" if post => Call::Resize(json(body)?),
            "/volume/freeze" if post => Call::Freeze(checked_freeze(json(body)?)?),
            "/volume/thaw" if post => Call::Thaw(json(body)?),
            "/volume/throttle" if post => Call::Throttle(json(body)?),
            "/state" if get => Call::State,
            "/start" if post => Call::Start,
            "/kill" if post => Call::Kill(json::<KillRequest>(body)?.signal),
            "/shutdown" if post => Call::Shutdown,
            "/volumes" if post => Call::AddVolume(json::<AddVolumeRequest>(body)?.volume_path),
            "/exec" if post => Call::Exec(json(body)?),
            "/logs" if get => Call::Logs,
            "/metrics" if get => Call::Metrics,
            _ => {
                return Err(ApiError::new(
                    Code::NotFound,
                    format!("no endpoint {method} {path}"),
                ));
            }
        };
        Ok(call)
    }

    /// The request a client sends for this call.
    pub fn wire(&self) -> Wire {
        let (method, path, body) = match self {
            Call::Stats(p) => ("GET", format!("{STATS}?path={}", percent_encode(p)), None),
            Call::Resize(r) => ("POST", "/direct-volume/resize".into(), Some(to_json(r))),
            Call::Freeze(r) => ("POST", "/volume/freeze".into(), Some(to_json(r))),
            Call::Thaw(r) => ("POST", "/volume/thaw".into(), Some(to_json(r))),
            Call::Throttle(r) => ("POST", "/volume/throttle".into(), Some(to_json(r))),
            Call::State => ("GET", "/state".into(), None),
            Call::Start => ("POST", "/start".into(), None),
            Call::Kill(signal) => (
                "POST",
                "/kill".into(),
                Some(to_json(&KillRequest { signal: *signal })),
            ),
            Call::Shutdown => ("POST", "/shutdown".into(), None),
            Call::AddVolume(p) => (
                "POST",
                "/volumes".into(),
                Some(to_json(&AddVolumeRequest {
                    volume_path: p.clone(),
                })),
            ),
            Call::Exec(x) => ("POST", "/exec".into(), Some(to_json(x))),
            Call::Logs => ("GET", "/logs".into(), None),
            Call::Metrics => ("GET", "/metrics".into(), None),
        };
        Wire {
            method,
            path_and_query: path,
            body,
        }
    }
}

fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("serializable")
}

fn json<T: DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            Code::InvalidArgument,
            format!("malformed request body: {e}"),
        )
    })
}

/// The freeze time limit is checked at the door, for every handler: a
/// guest's writers block while it lasts.
fn checked_freeze(r: FreezeRequest) -> ApiResult<FreezeRequest> {
    crust_agent_proto::freeze_limit(r.max_frozen_ms)
        .map_err(|e| ApiError::new(Code::InvalidArgument, e.to_string()))?;
    Ok(r)
}

fn query_param<'q>(query: &'q str, key: &str) -> Option<&'q str> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then_some(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_read_and_written_alike() {
        let calls = [
            Call::Stats("/var/lib/kubelet/pods/p/volumes/v x/mount".into()),
            Call::Resize(ResizeRequest {
                volume_path: "/v".into(),
                size: 1 << 30,
                max_bytes: Some(2 << 30),
            }),
            Call::Freeze(FreezeRequest {
                volume_path: "/v".into(),
                max_frozen_ms: 1000,
            }),
            Call::Thaw(ThawRequest {
                volume_path: "/v".into(),
            }),
            Call::Throttle(ThrottleRequest {
                volume_path: "/v".into(),
                limits: "iops=200".into(),
            }),
            Call::State,
            Call::Start,
            Call::Kill(9),
            Call::Shutdown,
            Call::AddVolume("/v".into()),
            Call::Exec(ExecRequest {
                args: vec!["df".into()],
                env: vec![],
                timeout_ms: Some(5),
            }),
            Call::Logs,
            Call::Metrics,
        ];
        for c in calls {
            let w = c.wire();
            let (path, query) = match w.path_and_query.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (w.path_and_query.as_str(), None),
            };
            let body = w.body.unwrap_or_default();
            assert_eq!(Call::parse(w.method, path, query, &body), Ok(c));
        }
    }

    #[test]
    fn kata_spellings_and_refusals() {
        let stats = |m, p, q| Call::parse(m, p, q, b"");
        assert_eq!(
            stats("POST", STATS, Some("x=1&path=%2Fa%20b")),
            Ok(Call::Stats("/a b".into()))
        );
        assert_eq!(
            stats("GET", "/direct-volume/stats/%2Fa", None),
            Ok(Call::Stats("/a".into()))
        );
        let code = |r: ApiResult<Call>| r.unwrap_err().code;
        assert_eq!(code(stats("GET", STATS, None)), Code::InvalidArgument);
        assert_eq!(
            code(stats("GET", STATS, Some("path=%zz"))),
            Code::InvalidArgument
        );
        assert_eq!(
            code(stats("GET", "/direct-volume/statsx", None)),
            Code::NotFound
        );
        assert_eq!(code(stats("DELETE", "/state", None)), Code::NotFound);
        assert_eq!(
            code(Call::parse("POST", "/kill", None, b"{\"signal\":\"x\"}")),
            Code::InvalidArgument
        );
        let over = format!("{{\"volumePath\":\"/v\",\"maxFrozenMs\":{}}}", u64::MAX);
        assert_eq!(
            code(Call::parse("POST", "/volume/freeze", None, over.as_bytes())),
            Code::InvalidArgument
        );
        assert!(kata_endpoint("/direct-volume/nope") && !kata_endpoint("/state"));
    }
}
