//! A real tonic server on a unix socket, called with the exact HTTP/2
//! bytes grpc-core sends (its `:authority` is the %-encoded socket path):
//! served through `crust_proto::server::incoming` the call succeeds; the
//! same bytes against a plain tonic listener get the stream reset, which
//! is what Python, C++ and Java clients saw before the front existed.
//! (The Python `grpcio` test in crust-csi covers a real client.)

use std::path::Path;
use std::time::Duration;

use crust_proto::csi::v1 as csi;
use csi::identity_server::{Identity, IdentityServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tonic::{Request, Response, Status};

struct Id;

#[tonic::async_trait]
impl Identity for Id {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: "front.crust.dev".into(),
            vendor_version: "1".into(),
            manifest: Default::default(),
        }))
    }
    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
}

/// What came back for stream 1.
#[derive(Debug, Default)]
struct Answer {
    headers: Vec<(String, String)>,
    data: Vec<u8>,
    reset: Option<u32>,
}

fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([ty, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// One GetPluginInfo call as grpc-core writes it.
async fn call(sock: &Path, authority: &str) -> Answer {
    let mut s = UnixStream::connect(sock).await.unwrap();
    let mut enc = loona_hpack::Encoder::new();
    let headers: [(&[u8], &[u8]); 8] = [
        (b":path", b"/csi.v1.Identity/GetPluginInfo"),
        (b":authority", authority.as_bytes()),
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"grpc-timeout", b"5S"),
        (
            b"user-agent",
            b"grpc-python/1.85.1 grpc-c/58.0.0 (linux; chttp2)",
        ),
    ];
    let block = enc.encode(headers);
    let mut out = crust_proto::authority::PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    out.extend(frame(0x1, 0x4, 1, &block)); // HEADERS, END_HEADERS
    out.extend(frame(0x0, 0x1, 1, &[0, 0, 0, 0, 0])); // empty message, END_STREAM
    s.write_all(&out).await.unwrap();

    let mut dec = loona_hpack::Decoder::new();
    let mut ans = Answer::default();
    let mut buf = Vec::new();
    let read = async {
        loop {
            while buf.len() >= 9 {
                let len =
                    (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
                if buf.len() < 9 + len {
                    break;
                }
                let (ty, flags) = (buf[3], buf[4]);
                let stream = u32::from_be_bytes(buf[5..9].try_into().unwrap());
                let payload: Vec<u8> = buf[9..9 + len].to_vec();
                buf.drain(..9 + len);
                match (ty, stream) {
                    (0x4, 0) if flags & 1 == 0 => {
                        s.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap() // SETTINGS ACK
                    }
                    (0x1, 1) => {
                        for (n, v) in dec.decode(&payload).unwrap() {
                            ans.headers.push((
                                String::from_utf8(n).unwrap(),
                                String::from_utf8(v).unwrap(),
                            ));
                        }
                        if flags & 1 != 0 {
                            return;
                        }
                    }
                    (0x0, 1) => {
                        ans.data.extend(&payload);
                        if flags & 1 != 0 {
                            return;
                        }
                    }
                    (0x3, 1) => {
                        ans.reset = Some(u32::from_be_bytes(payload[..4].try_into().unwrap()));
                        return;
                    }
                    (0x7, _) => return, // GOAWAY
                    _ => {}
                }
            }
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await.unwrap();
            if n == 0 {
                return;
            }
            buf.extend(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the server answered");
    ans
}

fn header<'a>(a: &'a Answer, name: &str) -> Option<&'a str> {
    a.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

#[tokio::test]
async fn grpc_core_authority_is_served_through_the_front_and_reset_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let fronted = dir.path().join("front.sock");
    let plain = dir.path().join("plain.sock");
    let l1 = tokio::net::UnixListener::bind(&fronted).unwrap();
    let l2 = tokio::net::UnixListener::bind(&plain).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IdentityServer::new(Id))
            .serve_with_incoming(crust_proto::server::incoming(l1)),
    );
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IdentityServer::new(Id))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l2)),
    );
    // What grpc-core sends for `unix:<path>` and `unix://<path>`.
    let encoded: String = fronted
        .display()
        .to_string()
        .trim_start_matches('/')
        .replace('/', "%2F");
    for authority in [encoded.clone(), format!("%2F{encoded}"), "localhost".into()] {
        let a = call(&fronted, &authority).await;
        assert_eq!(a.reset, None, "{authority}: {a:?}");
        assert_eq!(header(&a, ":status"), Some("200"), "{a:?}");
        assert_eq!(header(&a, "grpc-status"), Some("0"), "{a:?}");
        let msg: csi::GetPluginInfoResponse = prost::Message::decode(&a.data[5..]).unwrap();
        assert_eq!(msg.name, "front.crust.dev");
    }
    // Without the front h2 resets the stream (PROTOCOL_ERROR = 1): the
    // failure Python clients reported as "Stream removed".
    let a = call(&plain, &encoded).await;
    assert_eq!(a.reset, Some(1), "{a:?}");
    // A valid authority works either way (grpc-go, tonic).
    let a = call(&plain, "localhost").await;
    assert_eq!(header(&a, "grpc-status"), Some("0"), "{a:?}");
}

/// tonic's own client (what crustctl and kubelet-like Go clients look
/// like to the server) keeps working through the front.
#[tokio::test]
async fn tonic_clients_keep_working() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IdentityServer::new(Id))
            .serve_with_incoming(crust_proto::server::incoming(l)),
    );
    let ep = crust_proto::endpoint::Endpoint::parse(&format!("unix://{}", sock.display())).unwrap();
    let mut c = csi::identity_client::IdentityClient::new(ep.connect().await.unwrap());
    for _ in 0..3 {
        let r = c
            .get_plugin_info(csi::GetPluginInfoRequest {})
            .await
            .unwrap();
        assert_eq!(r.get_ref().name, "front.crust.dev");
    }
    let e = c.probe(csi::ProbeRequest {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented);
}

/// What the front costs: unary calls through a fronted and a plain
/// server (same tonic client, valid authority), and the rewriter alone on
/// a grpc-core request stream. Prints figures, asserts nothing about speed.
///
/// `cargo test --release -p crust-proto --test authority_front -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn front_overhead() {
    use std::time::Instant;
    let dir = tempfile::tempdir().unwrap();
    let mut socks = Vec::new();
    for (name, fronted) in [("front", true), ("plain", false)] {
        let sock = dir.path().join(format!("{name}.sock"));
        let l = tokio::net::UnixListener::bind(&sock).unwrap();
        let server = tonic::transport::Server::builder().add_service(IdentityServer::new(Id));
        if fronted {
            tokio::spawn(server.serve_with_incoming(crust_proto::server::incoming(l)));
        } else {
            tokio::spawn(
                server.serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l)),
            );
        }
        socks.push((name, sock));
    }
    const N: usize = 5000;
    for round in 0..2 {
        for (name, sock) in &socks {
            let ep = crust_proto::endpoint::Endpoint::parse(&format!("unix://{}", sock.display()))
                .unwrap();
            let mut c = csi::identity_client::IdentityClient::new(ep.connect().await.unwrap());
            let mut lat = Vec::with_capacity(N);
            let t0 = Instant::now();
            for _ in 0..N {
                let t = Instant::now();
                c.get_plugin_info(csi::GetPluginInfoRequest {})
                    .await
                    .unwrap();
                lat.push(t.elapsed());
            }
            let total = t0.elapsed();
            lat.sort();
            if round == 1 {
                println!(
                    "{name}: {N} GetPluginInfo in {total:?}: mean {:?}, p50 {:?}, p99 {:?}",
                    total / N as u32,
                    lat[N / 2],
                    lat[N * 99 / 100]
                );
            }
        }
    }
    // The rewriter alone: one grpc-core request (HEADERS + DATA) repeated.
    let mut enc = loona_hpack::Encoder::new();
    let headers: [(&[u8], &[u8]); 7] = [
        (b":path", b"/csi.v1.Node/NodeGetVolumeStats"),
        (b":authority", b"var%2Flib%2Fkubelet%2Fplugins%2Fcsi.sock"),
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (
            b"user-agent",
            b"grpc-python/1.85.1 grpc-c/58.0.0 (linux; chttp2)",
        ),
    ];
    let mut input = crust_proto::authority::PREFACE.to_vec();
    let reqs = 100_000u32;
    for i in 0..reqs {
        let block = enc.encode(headers);
        input.extend(frame(0x1, 0x4, 2 * i + 1, &block));
        input.extend(frame(0x0, 0x1, 2 * i + 1, &[0u8; 100]));
    }
    let mut rw = crust_proto::authority::Rewriter::new();
    let t0 = Instant::now();
    for chunk in input.chunks(16 * 1024) {
        rw.feed(chunk).unwrap();
        let n = rw.output().len();
        rw.consume(n);
    }
    let took = t0.elapsed();
    assert_eq!(rw.rewritten(), u64::from(reqs));
    println!(
        "rewriter: {reqs} requests ({} bytes) in {took:?}: {:?} per request",
        input.len(),
        took / reqs
    );
}
