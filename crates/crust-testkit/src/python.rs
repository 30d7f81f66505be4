//! Python's `grpcio` (grpc-core) as a gRPC client of crust's servers:
//! `scripts/install-deps.sh` installs it into a virtualenv, the calls are
//! made by `python/grpc_call.py` with the channel's default `:authority`.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Where `scripts/install-deps.sh` puts the virtualenv.
pub const DEFAULT_VENV: &str = "/opt/crust-test-venv";

/// `$CRUST_TEST_PYTHON`, else the virtualenv's python; panics with the
/// command to run when grpcio is not installed.
pub fn grpc_python() -> PathBuf {
    venv_python_with("grpc, grpc_tools")
}

/// The tests' python (see [`grpc_python`]) able to import `modules` (a
/// comma-separated `import` list); panics with the command to run if not.
pub fn venv_python_with(modules: &str) -> PathBuf {
    let py = std::env::var_os("CRUST_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_VENV).join("bin/python"));
    let ok = Command::new(&py)
        .args(["-c", &format!("import {modules}")])
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "{} cannot import {modules}: run scripts/install-deps.sh",
        py.display()
    );
    py
}

/// One call's outcome as the Python client saw it.
#[derive(Debug, Clone)]
pub struct PyAnswer {
    /// gRPC status code name (`OK`, `NOT_FOUND`, ...).
    pub code: String,
    pub details: String,
    /// The response in protobuf JSON (field names as in the .proto).
    pub response: serde_json::Value,
}

/// Makes `calls` (`(method, request JSON)`, e.g.
/// `("csi.v1.Identity/Probe", json!({}))`) on `target` (`unix:///path`)
/// with grpcio, in order, on one channel.
pub fn grpc_python_calls(target: &str, calls: &[(&str, serde_json::Value)]) -> Vec<PyAnswer> {
    let root = crate::workspace_root();
    let script = root.join("crates/crust-testkit/python/grpc_call.py");
    let protos = root.join("crates/crust-proto/proto");
    let input: Vec<serde_json::Value> = calls
        .iter()
        .map(|(m, r)| serde_json::json!({"method": m, "request": r}))
        .collect();
    let mut child = Command::new(grpc_python())
        .arg(&script)
        .arg(&protos)
        .arg(target)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(&input).unwrap().as_bytes())
        .unwrap();
    let out = child.wait_with_output().expect("python ran");
    assert!(
        out.status.success(),
        "grpc_call.py failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Vec<PyAnswer> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
            PyAnswer {
                code: v["code"].as_str().unwrap_or_default().to_string(),
                details: v["details"].as_str().unwrap_or_default().to_string(),
                response: v["response"].clone(),
            }
        })
        .collect();
    assert_eq!(answers.len(), calls.len(), "one answer per call");
    answers
}
