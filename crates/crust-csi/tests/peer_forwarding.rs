//! ControllerModifyVolume of a volume another node owns (README "Live
//! QoS", `crust_csi::peer`): two `crust-csi` processes play two nodes, each
//! serving the peer service on loopback and naming both as `--peers` (as a
//! headless Service names every node, itself included). The external
//! resizer's plugin is node A; the volume is node B's.
//!
//! What is shown: the owner applies it and the answer is the owner's
//! (OK, or its INVALID_ARGUMENT naming the key, with B's record unchanged);
//! a volume on no node is NOT_FOUND; the owner down is UNAVAILABLE (the
//! resizer retries), then OK once it is back; a missing or different key
//! is FAILED_PRECONDITION or UNAVAILABLE, and the fixed key is used
//! without a restart. And the attacker on the pod network: a forged seal,
//! another key, a stale request, an oversized one and a replayed one (also
//! replayed to the owner's next process after a restart) are refused, and
//! B's record stays byte for byte; a request held back and let go after
//! a newer change is answered "superseded" and changes nothing; a server
//! that takes B's address and answers "OK" without the key is not
//! believed. Under a second.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use crust_peer_seal::{ModifyVolumeBody, PeerKey};
use crust_proto::peer::v1alpha1 as wire;
use tonic::Code;
use wire::peer_client::PeerClient;

fn write_key(path: &Path, fill: char) {
    std::fs::write(path, format!("{}\n", fill.to_string().repeat(44))).unwrap();
}

/// A node serving peers on `own`, asking `all`, with the key at `key`.
fn peer_node(id: &str, own: u16, all: &[u16], key: &Path) -> TestNode {
    common::peer_node(id, own, all, key, &["--peer-timeout".into(), "10s".into()])
}

async fn peer_client(port: u16) -> PeerClient<tonic::transport::Channel> {
    PeerClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap()
}

fn sealed(key: &Path, body: &ModifyVolumeBody) -> wire::SealedRequest {
    let s = crust_peer_seal::seal(&PeerKey::read(key).unwrap(), body);
    wire::SealedRequest {
        body: s.body,
        mac: s.mac,
    }
}

fn body(id: &str, iops: &str) -> ModifyVolumeBody {
    ModifyVolumeBody::new(
        id,
        BTreeMap::from([("iops".to_string(), iops.to_string())]),
        "attacker",
    )
    .unwrap()
}

/// A server on a peer's address that answers every request "OK" in a
/// reply it cannot seal.
struct Impostor {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

struct Yes;

#[tonic::async_trait]
impl wire::peer_server::Peer for Yes {
    async fn modify_volume(
        &self,
        _: tonic::Request<wire::SealedRequest>,
    ) -> Result<tonic::Response<wire::ModifyVolumeReply>, tonic::Status> {
        Ok(tonic::Response::new(wire::ModifyVolumeReply {
            body: br#"{"nonce":"","node":"node-b","owner":true,"code":0,"message":""}"#.to_vec(),
            mac: vec![0; 32],
        }))
    }
}

impl Impostor {
    async fn serve(port: u16) -> Impostor {
        let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(wire::peer_server::PeerServer::new(Yes))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(l),
                    async {
                        let _ = rx.await;
                    },
                )
                .await;
        });
        Impostor {
            stop: Some(tx),
            task: Some(task),
        }
    }
}

impl Drop for Impostor {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_modify_reaches_the_volumes_node_and_nothing_else_gets_in() {
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("key");
    write_key(&key, 'k');
    let (pa, pb) = (free_port(), free_port());
    let a = peer_node("node-a", pa, &[pa, pb], &key);
    let mut b = peer_node("node-b", pb, &[pa, pb], &key);
    let mut ca = a.clients().await;
    let mut cb = b.clients().await;

    let id = cb
        .create(create_req("peer-vol", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    assert!(
        !a.state.join(format!("volumes/{id}.json")).exists(),
        "the volume is B's only"
    );

    // Through A (the resizer's plugin): applied on B.
    modify_limits(&mut ca, &id, &[("iops", "200")])
        .await
        .unwrap();
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 200}));

    // The owner's refusal is the answer, and changes nothing.
    let before = record_bytes(&b, &id);
    let s = assert_code(
        modify_limits(&mut ca, &id, &[("iops", "fast")]).await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("iops"), "{}", s.message());
    assert_eq!(record_bytes(&b, &id), before);
    // Missing fields are still refused first, by A itself.
    assert_code(
        modify_limits(&mut ca, &id, &[]).await,
        Code::InvalidArgument,
    );
    // On no node at all.
    let s = assert_code(
        modify_limits(
            &mut ca,
            "vol-0000000000000000000000000000dead",
            &[("iops", "1")],
        )
        .await,
        Code::NotFound,
    );
    assert!(s.message().contains("none of the 2"), "{}", s.message());

    // The attacker on the pod network, straight at B's peer port.
    let mut raw = peer_client(pb).await;
    let mut forged = sealed(&key, &body(&id, "1"));
    forged.mac[0] ^= 1;
    let s = raw.modify_volume(forged).await.unwrap_err();
    assert_eq!(s.code(), Code::Unauthenticated, "{s:?}");
    let other = keys.path().join("other");
    write_key(&other, 'x');
    let s = raw
        .modify_volume(sealed(&other, &body(&id, "1")))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unauthenticated, "{s:?}");
    let mut stale = body(&id, "1");
    stale.issued_unix_ms -= 120_000;
    let s = raw.modify_volume(sealed(&key, &stale)).await.unwrap_err();
    assert!(
        s.code() == Code::Unauthenticated && s.message().contains("clock"),
        "{s:?}"
    );
    let mut huge = sealed(&key, &body(&id, "1"));
    huge.body = vec![b' '; 2 << 20];
    let s = raw.modify_volume(huge).await.unwrap_err();
    assert_ne!(s.code(), Code::Ok);
    assert_eq!(record_bytes(&b, &id), before, "a refused request changed B");
    // A request captured on the wire works once, never twice.
    let captured = sealed(&key, &body(&id, "300"));
    raw.modify_volume(captured.clone()).await.unwrap();
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 300}));
    modify_limits(&mut ca, &id, &[("iops", "200")])
        .await
        .unwrap();
    let s = raw.modify_volume(captured).await.unwrap_err();
    assert!(
        s.code() == Code::Unauthenticated && s.message().contains("replayed"),
        "{s:?}"
    );
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 200}));

    // A request held back by someone on the path and let go after a newer
    // change: B answers (sealed, to whoever sent it) that it is superseded,
    // and keeps the newer limits.
    let held = body(&id, "5");
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    modify_limits(&mut ca, &id, &[("iops", "200")])
        .await
        .unwrap();
    let reply = raw
        .modify_volume(sealed(&key, &held))
        .await
        .unwrap()
        .into_inner();
    let answer = crust_peer_seal::open_answer(
        &PeerKey::read(&key).unwrap(),
        &reply.body,
        &reply.mac,
        &held.nonce,
    )
    .unwrap();
    assert!(
        answer.owner && answer.node == "node-b" && answer.code == Code::Aborted as i32,
        "{answer:?}"
    );
    assert!(answer.message.contains("latest change"), "{answer:?}");
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 200}));

    // B down: UNAVAILABLE (retried), never NOT_FOUND; B back: applied.
    // A request B took before it went down cannot be replayed to the new
    // process, which has not seen its nonce.
    let taken = sealed(&key, &body(&id, "400"));
    raw.modify_volume(taken.clone()).await.unwrap();
    modify_limits(&mut ca, &id, &[("iops", "200")])
        .await
        .unwrap();
    drop(raw);
    drop(cb);
    b.crash();
    let s = assert_code(
        modify_limits(&mut ca, &id, &[("iops", "250")]).await,
        Code::Unavailable,
    );
    assert!(s.message().contains("did not answer"), "{}", s.message());
    // Whoever takes B's address meanwhile and answers "OK" without the
    // key is not believed.
    let impostor = Impostor::serve(pb).await;
    let s = assert_code(
        modify_limits(&mut ca, &id, &[("iops", "250")]).await,
        Code::Unavailable,
    );
    assert!(
        s.message().contains("not this node's to trust"),
        "{}",
        s.message()
    );
    drop(impostor);
    b.start();
    let s = peer_client(pb)
        .await
        .modify_volume(taken)
        .await
        .unwrap_err();
    assert!(
        s.code() == Code::Unauthenticated
            && s.message().contains("before this node's plugin started"),
        "{s:?}"
    );
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 200}));
    modify_limits(&mut ca, &id, &[("iops", "250")])
        .await
        .unwrap();
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 250}));

    // The key file absent (its Secret not created yet): FAILED_PRECONDITION
    // naming it; put in place: used at the next request, no restart.
    let moved = keys.path().join("moved");
    std::fs::rename(&key, &moved).unwrap();
    let s = assert_code(
        modify_limits(&mut ca, &id, &[("iops", "10")]).await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message().contains("crust-csi-peer-key"),
        "{}",
        s.message()
    );
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 250}));
    std::fs::rename(&moved, &key).unwrap();
    modify_limits(&mut ca, &id, &[("iops", "10")])
        .await
        .unwrap();
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 10}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_different_keys_answer_unavailable_not_not_found() {
    let keys = tempfile::tempdir().unwrap();
    let (ka, kb) = (keys.path().join("a"), keys.path().join("b"));
    write_key(&ka, 'a');
    write_key(&kb, 'b');
    let (pa, pb) = (free_port(), free_port());
    let a = peer_node("node-a", pa, &[pa, pb], &ka);
    let b = peer_node("node-b", pb, &[pa, pb], &kb);
    let mut ca = a.clients().await;
    let id = b
        .clients()
        .await
        .create(create_req("peer-keys", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let before = record_bytes(&b, &id);
    let s = assert_code(
        modify_limits(&mut ca, &id, &[("iops", "200")]).await,
        Code::Unavailable,
    );
    assert!(s.message().contains("seal"), "{}", s.message());
    assert_eq!(record_bytes(&b, &id), before);
    assert!(
        b.plugin
            .as_ref()
            .unwrap()
            .stderr()
            .contains("peer ModifyVolume refused"),
        "B logs the refusal"
    );
    // The operator fixes A's key (the Secret updated): no restart needed.
    std::fs::copy(&kb, &ka).unwrap();
    modify_limits(&mut ca, &id, &[("iops", "200")])
        .await
        .unwrap();
    assert_eq!(limits_of(&b, &id), serde_json::json!({"iops": 200}));
}
