//! The shim API's wire types: what travels over the sandbox's unix socket
//! between `crust-runtime`'s shim server and its clients (the CLI,
//! crust_ops, Kata's `kata-runtime direct-volume`), and [`call`], which
//! turns a request's method, path, query and body into the call it names.
//! No I/O and no service: the server, the clients and the fuzz target all
//! read requests through the same code.

use http::StatusCode;
use serde::{Deserialize, Deserializer, Serialize};

pub mod call;

pub use call::Call;

/// Largest request body accepted.
pub const MAX_BODY: usize = 1 << 20;

/// Error classes, named like gRPC codes so the CLI and crust_ops can map
/// them onward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Code {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    OutOfRange,
    Unavailable,
    DeadlineExceeded,
    Internal,
}

impl Code {
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::OutOfRange => StatusCode::RANGE_NOT_SATISFIABLE,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// An error answered by the shim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{message}")]
pub struct ApiError {
    pub code: Code,
    pub message: String,
}

impl ApiError {
    pub fn new(code: Code, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
        }
    }

    /// `CODE: message` and a newline: what `/direct-volume/*` answers. Never
    /// JSON (it starts with a letter that begins no JSON value but
    /// `true`/`false`/`null`, and the code names none of those).
    pub fn to_text(&self) -> String {
        let code = serde_json::to_value(self.code).expect("serializable");
        format!(
            "{}: {}\n",
            code.as_str().unwrap_or("INTERNAL"),
            self.message
        )
    }

    /// Reads an error answer: the JSON object, or [`ApiError::to_text`]'s
    /// text; None for anything else.
    pub fn from_body(body: &[u8]) -> Option<ApiError> {
        if let Ok(e) = serde_json::from_slice::<ApiError>(body) {
            return Some(e);
        }
        let text = std::str::from_utf8(body).ok()?;
        let (code, message) = text.split_once(": ")?;
        let code: Code = serde_json::from_value(serde_json::Value::String(code.into())).ok()?;
        Some(ApiError::new(code, message.trim_end_matches('\n')))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KillRequest {
    pub signal: i32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddVolumeRequest {
    #[serde(rename = "volumePath", alias = "VolumePath", alias = "volume_path")]
    pub volume_path: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResponse {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogsResponse {
    pub output: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// What every handler answers.
pub type ApiResult<T> = Result<T, ApiError>;

/// The shim's freeze request (`POST /volume/freeze`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FreezeRequest {
    pub volume_path: String,
    /// The guest thaws by itself after this long.
    pub max_frozen_ms: u64,
}

/// The shim's throttle request (`POST /volume/throttle`): the volume's
/// I/O limits in `crust_handoff::IoLimits`' wire form (empty: none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ThrottleRequest {
    pub volume_path: String,
    pub limits: String,
}

/// The shim's thaw request (`POST /volume/thaw`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ThawRequest {
    pub volume_path: String,
}

/// What `crust thaw` prints: whether the volume stayed frozen from the
/// freeze until this thaw (then a copy made meanwhile is consistent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThawResponse {
    pub was_frozen: bool,
    pub expired: bool,
}

/// `{"capacity_bytes": N}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResizeResponse {
    pub capacity_bytes: u64,
}

/// The shim's resize request. `volumePath` (the KEP/crust spelling and one
/// of Kata's), `VolumePath`, or `volume_guest_path` (Kata's agent proto);
/// `size` or `Size`, as a number or a decimal string (Kata's curl example
/// quotes it). `maxBytes` is a crust extension: refuse to grow beyond it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    #[serde(
        rename = "volumePath",
        alias = "VolumePath",
        alias = "volume_guest_path"
    )]
    pub volume_path: String,
    #[serde(alias = "Size", deserialize_with = "u64_or_string")]
    pub size: u64,
    #[serde(
        rename = "maxBytes",
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "opt_u64_or_string"
    )]
    pub max_bytes: Option<u64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Num(u64),
    Str(String),
}

impl NumOrStr {
    fn into_u64<E: serde::de::Error>(self) -> Result<u64, E> {
        match self {
            NumOrStr::Num(n) => Ok(n),
            NumOrStr::Str(s) => s
                .parse::<u64>()
                .map_err(|_| E::custom(format!("size {s:?} is not a non-negative integer"))),
        }
    }
}

fn u64_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    NumOrStr::deserialize(d)?.into_u64()
}

fn opt_u64_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<NumOrStr>::deserialize(d)?
        .map(NumOrStr::into_u64)
        .transpose()
}

/// Escapes everything but RFC 3986 unreserved characters and `/`.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes `%XX` escapes (a `+` stays a `+`: Kata escapes with Go's
/// `url.PathEscape`).
pub fn percent_decode(s: &str) -> ApiResult<String> {
    let bad = || ApiError::new(Code::InvalidArgument, format!("malformed escape in {s:?}"));
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).ok_or_else(bad)?;
            // Two hex digits exactly: from_str_radix alone takes "+1".
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return Err(bad());
            }
            let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| ApiError::new(Code::InvalidArgument, "path is not UTF-8"))
}
