//! ControllerModifyVolume across nodes. A crust volume lives on one node
//! and each node's plugin knows only its own volumes, while Kubernetes
//! runs the external-resizer (which sends ControllerModifyVolume) once for
//! the cluster, beside one node's plugin. That plugin, finding no such
//! volume of its own, passes the request to the other nodes' plugins
//! (`--peers`, every address of a headless Service) and answers with the
//! owner's answer. Each node answers with a sealed [`Answer`] (whether it
//! has the volume, and its own outcome); an answer that does not open with
//! the key, for this very request, counts as no answer:
//!
//! - one owner: its outcome (OK, or its code and message);
//! - two owners: INTERNAL (a volume id on two nodes is a fault to fix);
//! - no owner, and every node answered "not mine": NOT_FOUND;
//! - no owner, and some did not answer (down, unreachable, another key):
//!   UNAVAILABLE, which the resizer retries, so a volume whose node is
//!   briefly away is modified when it is back;
//! - the shared key missing: FAILED_PRECONDITION.
//!
//! The receiving side ([`PeerService`], `--peer-address`) opens the sealed
//! body (`crust_peer_seal`: key, clock, nonce) and runs the same
//! `modify_volume` as the CSI door, for its own volumes only (a passed
//! request is never passed on again), refusing one issued no later than
//! the volume's latest change (a delayed or replayed request).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crust_peer_seal::{Answer, ModifyVolumeBody, PeerKey, ReplayCache, Sealed};
use crust_proto::csi::v1 as csi;
use crust_proto::peer::v1alpha1 as wire;
use tonic::{Code, Request, Response, Status};
use wire::peer_client::PeerClient;

use crate::config::PeerConfig;
use crate::driver::{Driver, blocking_typed};
use crate::error::{ControllerError, PeerError, ServeError};
use crate::qos::Issued;

/// How long connecting to one peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest gRPC message the peer service decodes.
pub const MESSAGE_MAX_BYTES: usize = crust_peer_seal::BODY_MAX_BYTES + 1024;

/// The shared key, read now (off the async threads) for both sides: a
/// Secret created or rotated after the start is used at once.
async fn read_key(cfg: &PeerConfig) -> Result<PeerKey, PeerError> {
    let path: PathBuf = cfg.key_file.clone().ok_or_else(|| {
        PeerError::Key(crust_peer_seal::KeyError::Read {
            path: PathBuf::new(),
            source: std::io::Error::other("no --peer-key-file"),
        })
    })?;
    tokio::task::spawn_blocking(move || PeerKey::read(&path))
        .await
        .map_err(|e| PeerError::Internal(format!("reading the peer key: {e}")))?
        .map_err(PeerError::Key)
}

/// The sending side: asks the other nodes' plugins.
pub struct Forwarder {
    cfg: PeerConfig,
    node_id: String,
}

impl Forwarder {
    /// The forwarder of `driver`'s configuration, if it names peers.
    pub fn of(driver: &Driver) -> Option<Arc<Forwarder>> {
        let cfg = &driver.config().peer;
        cfg.forwards().then(|| {
            Arc::new(Forwarder {
                cfg: cfg.clone(),
                node_id: driver.config().node_id.clone(),
            })
        })
    }

    /// Passes `req` (a volume this node does not have) to the peers.
    pub async fn modify_volume(
        &self,
        req: csi::ControllerModifyVolumeRequest,
    ) -> Result<(), PeerError> {
        let key = read_key(&self.cfg).await?;
        let addresses = self.resolve(&req.volume_id).await?;
        let body = ModifyVolumeBody::new(
            &req.volume_id,
            req.mutable_parameters.into_iter().collect(),
            &self.node_id,
        )
        .map_err(|e| PeerError::Internal(format!("drawing a nonce: {e}")))?;
        let sealed = crust_peer_seal::seal(&key, &body);
        let answers = ask_all(&addresses, &sealed, &key, &body.nonce, self.cfg.timeout).await;
        let verdict = verdict(&req.volume_id, &self.node_id, &answers);
        tracing::info!(
            volume = %req.volume_id,
            asked = answers.len(),
            ok = verdict.is_ok(),
            "ModifyVolume passed to the other nodes"
        );
        verdict
    }

    /// Every address of every `--peers` entry, resolved now (nodes come
    /// and go behind a headless Service).
    async fn resolve(&self, volume: &str) -> Result<Vec<SocketAddr>, PeerError> {
        let mut found = BTreeSet::new();
        let mut failures = Vec::new();
        for p in &self.cfg.peers {
            match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::lookup_host(p.as_str())).await {
                Ok(Ok(addrs)) => found.extend(addrs),
                Ok(Err(e)) => failures.push(format!("{p}: {e}")),
                Err(_) => failures.push(format!("{p}: name lookup timed out")),
            }
        }
        if found.is_empty() {
            return Err(PeerError::NoPeers {
                volume: volume.to_string(),
                node: self.node_id.clone(),
                reason: if failures.is_empty() {
                    "--peers resolved to no address".into()
                } else {
                    failures.join("; ")
                },
            });
        }
        Ok(found.into_iter().collect())
    }
}

/// What one address said: a sealed answer to this request, or why there
/// is none.
type Heard = (SocketAddr, Result<Answer, String>);

/// Sends `sealed` to every address at once; each answer with its address.
async fn ask_all(
    addresses: &[SocketAddr],
    sealed: &Sealed,
    key: &PeerKey,
    nonce: &str,
    timeout: Duration,
) -> Vec<Heard> {
    let mut set = tokio::task::JoinSet::new();
    for &a in addresses {
        let (sealed, key, nonce) = (sealed.clone(), key.clone(), nonce.to_string());
        set.spawn(async move {
            let answer = tokio::time::timeout(timeout, ask(a, sealed, &key, &nonce, timeout))
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")));
            (a, answer)
        });
    }
    let mut answers = Vec::with_capacity(addresses.len());
    while let Some(joined) = set.join_next().await {
        if let Ok(a) = joined {
            answers.push(a);
        }
    }
    answers.sort_by_key(|(a, _)| *a);
    answers
}

async fn ask(
    address: SocketAddr,
    sealed: Sealed,
    key: &PeerKey,
    nonce: &str,
    timeout: Duration,
) -> Result<Answer, String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(timeout)
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let reply = PeerClient::new(channel)
        .modify_volume(wire::SealedRequest {
            body: sealed.body,
            mac: sealed.mac,
        })
        .await
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    crust_peer_seal::open_answer(key, &reply.body, &reply.mac, nonce)
        .map_err(|e| format!("an answer that is not this node's to trust: {e}"))
}

/// The one answer for the caller out of the nodes' answers (the module
/// doc gives the rules).
fn verdict(volume: &str, node: &str, heard: &[Heard]) -> Result<(), PeerError> {
    let owners: Vec<(&SocketAddr, &Answer)> = heard
        .iter()
        .filter_map(|(a, r)| r.as_ref().ok().filter(|x| x.owner).map(|x| (a, x)))
        .collect();
    match owners.as_slice() {
        [] => {}
        [(_, a)] if a.code == 0 => return Ok(()),
        [(address, a)] => {
            return Err(PeerError::Owner {
                address: address.to_string(),
                node: a.node.clone(),
                code: Code::from(a.code),
                message: a.message.clone(),
            });
        }
        many => {
            return Err(PeerError::ManyOwners {
                volume: volume.to_string(),
                nodes: many
                    .iter()
                    .map(|(address, a)| {
                        format!("{} ({address}, code {:?})", a.node, Code::from(a.code))
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    let unanswered: Vec<String> = heard
        .iter()
        .filter_map(|(a, r)| r.as_ref().err().map(|e| format!("{a}: {e}")))
        .collect();
    if unanswered.is_empty() {
        return Err(PeerError::Nowhere {
            volume: volume.to_string(),
            node: node.to_string(),
            asked: heard.len(),
        });
    }
    Err(PeerError::Unanswered {
        volume: volume.to_string(),
        node: node.to_string(),
        asked: heard.len(),
        unanswered: unanswered.len(),
        detail: unanswered.join("; "),
    })
}

/// The receiving side: the `crust.peer.v1alpha1.Peer` service.
pub struct PeerService {
    driver: Arc<Driver>,
    seen: ReplayCache,
}

impl PeerService {
    pub fn new(driver: Arc<Driver>) -> PeerService {
        PeerService {
            driver,
            seen: ReplayCache::since(crust_peer_seal::now_unix_ms()),
        }
    }

    /// The key, and the sealed body if the key opens it and it is fresh.
    async fn open(
        &self,
        sealed: &wire::SealedRequest,
    ) -> Result<(PeerKey, ModifyVolumeBody), PeerError> {
        let key = read_key(&self.driver.config().peer).await?;
        let body = crust_peer_seal::open(
            &key,
            &sealed.body,
            &sealed.mac,
            crust_peer_seal::now_unix_ms(),
            &self.seen,
        )?;
        Ok((key, body))
    }

    /// This node's answer: whether it has the volume, and what its own
    /// ControllerModifyVolume said.
    fn answer(&self, nonce: String, outcome: Result<(), ControllerError>) -> Answer {
        let node = self.driver.config().node_id.clone();
        let (owner, code, message) = match outcome {
            Ok(()) => (true, Code::Ok, String::new()),
            Err(ControllerError::NotFound(_) | ControllerError::Missing(_)) => {
                (false, Code::NotFound, format!("not on node {node}"))
            }
            Err(e) => {
                let s = Status::from(e);
                (true, s.code(), s.message().to_string())
            }
        };
        Answer {
            nonce,
            node,
            owner,
            code: code as i32,
            message,
        }
    }
}

#[tonic::async_trait]
impl wire::peer_server::Peer for PeerService {
    async fn modify_volume(
        &self,
        request: Request<wire::SealedRequest>,
    ) -> Result<Response<wire::ModifyVolumeReply>, Status> {
        let from = request.remote_addr();
        let (key, body) = self.open(request.get_ref()).await.map_err(|e| {
            tracing::warn!(from = ?from, "peer ModifyVolume refused: {e}");
            e.for_the_sender()
        })?;
        tracing::info!(volume = %body.volume_id, from_node = %body.from_node, from = ?from, "ModifyVolume from a peer");
        let req = csi::ControllerModifyVolumeRequest {
            volume_id: body.volume_id,
            mutable_parameters: body.mutable_parameters.into_iter().collect(),
            ..Default::default()
        };
        let issued = Issued::Passed(body.issued_unix_ms);
        let outcome = blocking_typed(&self.driver, move |d| {
            d.controller().modify_volume(&req, issued)
        })
        .await?;
        let sealed = crust_peer_seal::seal_answer(&key, &self.answer(body.nonce, outcome));
        Ok(Response::new(wire::ModifyVolumeReply {
            body: sealed.body,
            mac: sealed.mac,
        }))
    }
}

/// Binds `--peer-address` (a bad one stops the plugin at start) and says
/// whether the key is readable yet.
pub async fn bind(cfg: &crate::Config) -> Result<Option<tokio::net::TcpListener>, ServeError> {
    if let Some(f) = &cfg.peer.key_file
        && let Err(e) = PeerKey::read(f)
    {
        // Not fatal: the Secret may be created after the plugin starts.
        tracing::warn!("requests between nodes fail until the key is readable: {e}");
    }
    let Some(address) = cfg.peer.listen else {
        return Ok(None);
    };
    let peer_err = |source| ServeError::Peer {
        address: address.to_string(),
        source,
    };
    let l = match tokio::net::TcpListener::bind(address).await {
        // `[::]` where the pod has no IPv6: the IPv4 wildcard instead.
        Err(e)
            if address.ip() == std::net::Ipv6Addr::UNSPECIFIED
                && matches!(
                    e.raw_os_error(),
                    Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
                ) =>
        {
            tracing::warn!("no IPv6 for {address} ({e}): serving peers on IPv4 only");
            tokio::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, address.port())).await
        }
        r => r,
    }
    .map_err(peer_err)?;
    let bound = l.local_addr().map_err(peer_err)?;
    tracing::info!("serving other nodes' plugins on {bound}");
    Ok(Some(l))
}

/// The peer listener's bounds: a node's plugins ask one request at a
/// time per volume, over one connection each (the idle time is
/// `--listener-idle-timeout`'s).
pub const PEER_LIMITS: crust_tcp_guard::Limits = crust_tcp_guard::Limits {
    connections: 256,
    per_peer: 16,
    idle: Duration::from_secs(30),
};

/// The peer service on its TCP listener until `stop` turns true, under
/// `limits` ([`crust_tcp_guard`]: anyone on the pod network reaches it).
pub async fn serve(
    listener: tokio::net::TcpListener,
    driver: Arc<Driver>,
    limits: crust_tcp_guard::Limits,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let counters = Arc::new(crust_tcp_guard::Counters::default());
    driver.metrics().watch_listener("peer", counters.clone());
    let svc = wire::peer_server::PeerServer::new(PeerService::new(driver))
        .max_decoding_message_size(MESSAGE_MAX_BYTES);
    // Few streams per connection; a request's own time is bounded here,
    // a connection's time without one by the guard.
    let r = tonic::transport::Server::builder()
        .timeout(Duration::from_secs(120))
        .concurrency_limit_per_connection(4)
        .max_concurrent_streams(Some(8))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .layer(crust_tcp_guard::TrackRequestsLayer)
        .add_service(svc)
        .serve_with_incoming_shutdown(
            crust_tcp_guard::incoming(listener, limits, counters, "peer service"),
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        )
        .await;
    if let Err(e) = r {
        tracing::error!("peer service: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    fn said(node: &str, owner: bool, code: Code, message: &str) -> Result<Answer, String> {
        Ok(Answer {
            nonce: "n".into(),
            node: node.into(),
            owner,
            code: code as i32,
            message: message.into(),
        })
    }

    fn code_of(r: Result<(), PeerError>) -> Code {
        Status::from(r.unwrap_err()).code()
    }

    #[test]
    fn only_the_owners_sealed_answer_counts() {
        let not_mine = |n: &str| said(n, false, Code::NotFound, "not on node");
        // The owner applied it.
        assert!(
            verdict(
                "v",
                "a",
                &[
                    (at(1), not_mine("a")),
                    (at(2), said("b", true, Code::Ok, ""))
                ]
            )
            .is_ok()
        );
        // The owner refused: its code, beside a node that is down and one
        // that does not have it.
        let r = verdict(
            "v",
            "a",
            &[
                (at(1), Err("connect: refused".into())),
                (
                    at(2),
                    said("b", true, Code::InvalidArgument, "iops: not digits"),
                ),
                (at(3), not_mine("c")),
            ],
        );
        let s = Status::from(r.unwrap_err());
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(
            s.message().contains("iops: not digits") && s.message().contains("node b"),
            "{}",
            s.message()
        );
        // An owner's failure is its code even when a transport would use
        // the same one.
        let r = verdict(
            "v",
            "a",
            &[(at(2), said("b", true, Code::Unavailable, "runtime gone"))],
        );
        assert_eq!(code_of(r), Code::Unavailable);
        // Everyone says "not mine": NOT_FOUND.
        assert_eq!(
            code_of(verdict(
                "v",
                "a",
                &[(at(1), not_mine("a")), (at(2), not_mine("b"))]
            )),
            Code::NotFound
        );
        // Someone gave no trusted answer (down, another key, an unsealed
        // "OK"): retry, never OK and never NOT_FOUND.
        let r = verdict(
            "v",
            "a",
            &[
                (at(1), not_mine("a")),
                (
                    at(2),
                    Err("an answer that is not this node's to trust".into()),
                ),
            ],
        );
        assert_eq!(code_of(r), Code::Unavailable);
        // Two owners: a fault, said as such.
        let r = verdict(
            "v",
            "a",
            &[
                (at(1), said("b", true, Code::Ok, "")),
                (at(2), said("c", true, Code::Ok, "")),
            ],
        );
        let s = Status::from(r.unwrap_err());
        assert_eq!(s.code(), Code::Internal);
        assert!(
            s.message().contains("b (") && s.message().contains("c ("),
            "{}",
            s.message()
        );
    }
}
