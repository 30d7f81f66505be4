//! The node label, end to end over HTTP: the real `crust-node-install`
//! binary against a local peer standing in for the API server (plain HTTP
//! on loopback; in a cluster the same request goes over TLS with the
//! service account's CA). Install labels the node after installing;
//! uninstall removes the label first; a refused patch fails the command.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;

struct Request {
    line: String,
    headers: Vec<(String, String)>,
    body: serde_json::Value,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Serves `answers.len()` requests, one per connection, replying with the
/// given status codes; hands each request to the test.
fn api_server(answers: Vec<u16>) -> (String, mpsc::Receiver<Request>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for code in answers {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            let mut headers = Vec::new();
            loop {
                let mut h = String::new();
                r.read_line(&mut h).unwrap();
                let h = h.trim_end();
                if h.is_empty() {
                    break;
                }
                let (k, v) = h.split_once(':').unwrap();
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
            let len: usize = headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                .map(|(_, v)| v.parse().unwrap())
                .unwrap_or(0);
            let mut body = vec![0; len];
            r.read_exact(&mut body).unwrap();
            let reply = if code == 200 {
                "{}"
            } else {
                "{\"reason\":\"Forbidden\"}"
            };
            write!(
                &s,
                "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                reply.len()
            )
            .unwrap();
            tx.send(Request {
                line: line.trim_end().to_string(),
                headers,
                body: serde_json::from_slice(&body).unwrap(),
            })
            .unwrap();
        }
    });
    (url, rx)
}

fn payload(dir: &Path) {
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::create_dir_all(dir.join("share/crust")).unwrap();
    std::fs::write(dir.join("bin/crust-runtime"), "runtime").unwrap();
    std::fs::write(
        dir.join("share/crust/payload.json"),
        r#"{"version":"0.1.0","prefix":"/opt/crust","components":["crust-runtime"]}"#,
    )
    .unwrap();
}

fn run(dir: &Path, url: &str, verb: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_crust-node-install"))
        .arg("--host-root")
        .arg(dir.join("root"))
        .arg("--payload")
        .arg(dir.join("payload"))
        .args(["--node-name", "node-7", "--api-server", url])
        .arg("--api-token-file")
        .arg(dir.join("token"))
        .arg(verb)
        .output()
        .unwrap()
}

#[test]
fn install_labels_the_node_and_uninstall_unlabels_it_first() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("root")).unwrap();
    payload(&dir.path().join("payload"));
    std::fs::write(dir.path().join("token"), "secret-token\n").unwrap();
    let (url, rx) = api_server(vec![200, 200, 403]);

    let out = run(dir.path(), &url, "install");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = rx.recv().unwrap();
    assert_eq!(r.line, "PATCH /api/v1/nodes/node-7 HTTP/1.1");
    assert_eq!(r.header("authorization"), Some("Bearer secret-token"));
    assert_eq!(
        r.header("content-type"),
        Some("application/merge-patch+json")
    );
    assert_eq!(
        r.body,
        serde_json::json!({"metadata": {"labels": {"crust.dev/runtime": "installed"}}})
    );
    assert!(
        dir.path()
            .join("root/opt/crust/bin/crust-runtime")
            .is_file()
    );

    let out = run(dir.path(), &url, "uninstall");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = rx.recv().unwrap();
    assert_eq!(
        r.body,
        serde_json::json!({"metadata": {"labels": {"crust.dev/runtime": null}}})
    );
    assert!(!dir.path().join("root/opt/crust").exists());

    // A refused patch is a failure, never a silent success.
    let out = run(dir.path(), &url, "install");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("node-7") && err.contains("403"), "{err}");
}
