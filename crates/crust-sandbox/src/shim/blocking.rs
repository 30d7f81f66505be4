//! The shim API's blocking GET, for the verbs crust_ops runs on every
//! kubelet poll (`crust stats`): one request on its own connection
//! (`connection: close`), without a tokio runtime or hyper's handshake,
//! which cost more than the answer in a CLI that lives for one call.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use super::{ApiError, Code, MAX_BODY, ShimClient, ShimError};

/// Largest answer read (as the async client's limit).
const MAX_ANSWER: usize = 16 * MAX_BODY;

impl ShimClient {
    /// `GET path_and_query`, bounded by the client's timeout as a whole.
    pub fn get_blocking<T: DeserializeOwned>(&self, path_and_query: &str) -> Result<T, ShimError> {
        let deadline = Instant::now() + self.timeout;
        let timed_out = || ShimError::Timeout {
            what: format!("GET {path_and_query}"),
            after: self.timeout,
        };
        let mut s = UnixStream::connect(&self.socket).map_err(|source| ShimError::Unreachable {
            socket: self.socket.display().to_string(),
            source,
        })?;
        let io = |e: std::io::Error| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => timed_out(),
            _ => ShimError::Protocol(format!("GET {path_and_query}: {e}")),
        };
        let request = format!(
            "GET {path_and_query} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        );
        s.set_write_timeout(Some(left(deadline).ok_or_else(timed_out)?))
            .map_err(io)?;
        s.write_all(request.as_bytes()).map_err(io)?;
        // The shim closes the connection after its answer.
        let mut answer = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            s.set_read_timeout(Some(left(deadline).ok_or_else(timed_out)?))
                .map_err(io)?;
            match s.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) if answer.len() + n > MAX_ANSWER => {
                    return Err(ShimError::Protocol(format!(
                        "the answer to GET {path_and_query} exceeds {MAX_ANSWER} bytes"
                    )));
                }
                Ok(n) => answer.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        let (status, body) = split_answer(&answer)?;
        if !(200..300).contains(&status) {
            let err = ApiError::from_body(body).unwrap_or_else(|| {
                ApiError::new(
                    Code::Internal,
                    format!("HTTP {status}: {}", String::from_utf8_lossy(body)),
                )
            });
            return Err(ShimError::Api(err));
        }
        serde_json::from_slice(body)
            .map_err(|e| ShimError::Protocol(format!("malformed answer: {e}")))
    }
}

/// Time left before `deadline`; None once it passed (a zero timeout
/// would mean "none" to the socket).
fn left(deadline: Instant) -> Option<Duration> {
    Some(deadline.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero())
}

/// The status and body of a whole HTTP/1.1 answer read to its end.
fn split_answer(answer: &[u8]) -> Result<(u16, &[u8]), ShimError> {
    let bad = |why: String| ShimError::Protocol(format!("malformed HTTP answer: {why}"));
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let head = match resp.parse(answer) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Err(bad("it ends inside its head".into())),
        Err(e) => return Err(bad(e.to_string())),
    };
    let status = resp.code.ok_or_else(|| bad("no status".into()))?;
    let header = |name: &str| {
        resp.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).trim().to_string())
    };
    if header("transfer-encoding").is_some() {
        return Err(bad("a transfer-encoding the shim never sends".into()));
    }
    let rest = &answer[head..];
    let body = match header("content-length") {
        Some(v) => {
            let len: usize = v
                .parse()
                .map_err(|_| bad(format!("content-length {v:?}")))?;
            rest.get(..len)
                .ok_or_else(|| bad(format!("the body has {} of its {len} bytes", rest.len())))?
        }
        None => rest,
    };
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_split_by_their_length() {
        let a = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nContent-Length: 2\r\n\r\n{}";
        assert_eq!(split_answer(a).unwrap(), (200, &b"{}"[..]));
        let a = b"HTTP/1.1 404 Not Found\r\n\r\n{\"code\":\"NOT_FOUND\"}";
        assert_eq!(
            split_answer(a).unwrap(),
            (404, &b"{\"code\":\"NOT_FOUND\"}"[..])
        );
        for bad in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n{}"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-le",
            b"garbage",
        ] {
            assert!(
                matches!(split_answer(bad), Err(ShimError::Protocol(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
