//! ControllerModifyVolume across nodes. A crust volume lives on one node
//! and each node's plugin knows only its own volumes, while Kubernetes
//! runs the external-resizer (which sends ControllerModifyVolume) once for
//! the cluster, beside one node's plugin. That plugin, finding no such
//! volume of its own, passes the request to the other nodes' plugins
//! (`--peers`, every address of a headless Service) and answers with the
//! owner's answer:
//!
//! - an owner that applied it: OK;
//! - an owner that refused or failed: the owner's code and message;
//! - every node asked answered "not mine": NOT_FOUND;
//! - some did not answer (down, unreachable, another key): UNAVAILABLE,
//!   which the resizer retries, so a volume whose node is briefly away is
//!   modified when it is back, never left at NOT_FOUND;
//! - the shared key missing: FAILED_PRECONDITION.
//!
//! The receiving side ([`PeerService`], `--peer-address`) opens the sealed
//! body (`crust_peer_seal`: key, clock, nonce) and runs the same
//! `controller_modify_volume` as the CSI door, for its own volumes only: a
//! passed request is never passed on again.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crust_peer_seal::{ModifyVolumeBody, PeerKey, ReplayCache, Sealed};
use crust_proto::csi::v1 as csi;
use crust_proto::peer::v1alpha1 as wire;
use tonic::{Code, Request, Response, Status};
use wire::peer_client::PeerClient;

use crate::config::PeerConfig;
use crate::driver::{Driver, blocking};
use crate::error::{PeerError, ServeError};

/// How long connecting to one peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest gRPC message the peer service decodes.
pub const MESSAGE_MAX_BYTES: usize = crust_peer_seal::BODY_MAX_BYTES + 1024;

fn key_file(cfg: &PeerConfig) -> Result<&PathBuf, PeerError> {
    cfg.key_file.as_ref().ok_or_else(|| {
        PeerError::Key(crust_peer_seal::KeyError::Read {
            path: PathBuf::new(),
            source: std::io::Error::other("no --peer-key-file"),
        })
    })
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
        let key = PeerKey::read(key_file(&self.cfg)?)?;
        let addresses = self.resolve(&req.volume_id).await?;
        let body = ModifyVolumeBody::new(
            &req.volume_id,
            req.mutable_parameters.into_iter().collect(),
            &self.node_id,
        )
        .map_err(|e| PeerError::Nonce(e.to_string()))?;
        let sealed = crust_peer_seal::seal(&key, &body);
        let answers = ask_all(&addresses, &sealed, self.cfg.timeout).await;
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

/// Sends `sealed` to every address at once; each answer with its address.
async fn ask_all(
    addresses: &[SocketAddr],
    sealed: &Sealed,
    timeout: Duration,
) -> Vec<(SocketAddr, Result<(), Status>)> {
    let mut set = tokio::task::JoinSet::new();
    for &a in addresses {
        let sealed = sealed.clone();
        set.spawn(async move {
            let answer = tokio::time::timeout(timeout, ask(a, sealed, timeout))
                .await
                .unwrap_or_else(|_| {
                    Err(Status::deadline_exceeded(format!(
                        "no answer within {timeout:?}"
                    )))
                });
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

async fn ask(address: SocketAddr, sealed: Sealed, timeout: Duration) -> Result<(), Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| Status::invalid_argument(e.to_string()))?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(timeout)
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("connect: {e}")))?;
    PeerClient::new(channel)
        .modify_volume(wire::SealedRequest {
            body: sealed.body,
            mac: sealed.mac,
        })
        .await
        .map(drop)
}

/// Codes that do not come from the volume's owner: "not mine", or no
/// usable answer at all (transport, timeout, another key, an older plugin
/// without the service).
fn not_from_owner(code: Code) -> bool {
    matches!(
        code,
        Code::NotFound
            | Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Unauthenticated
            | Code::ResourceExhausted
            | Code::Unimplemented
    )
}

/// The one answer for the caller out of the peers' answers (the module
/// doc gives the rules).
fn verdict(
    volume: &str,
    node: &str,
    answers: &[(SocketAddr, Result<(), Status>)],
) -> Result<(), PeerError> {
    if answers.iter().any(|(_, r)| r.is_ok()) {
        return Ok(());
    }
    let failed = || {
        answers
            .iter()
            .filter_map(|(a, r)| r.as_ref().err().map(|s| (a, s)))
    };
    if let Some((a, s)) = failed().find(|(_, s)| !not_from_owner(s.code())) {
        return Err(PeerError::Owner {
            address: a.to_string(),
            code: s.code(),
            message: s.message().to_string(),
        });
    }
    let unanswered: Vec<String> = failed()
        .filter(|(_, s)| s.code() != Code::NotFound)
        .map(|(a, s)| format!("{a}: {:?}: {}", s.code(), s.message()))
        .collect();
    if unanswered.is_empty() {
        return Err(PeerError::Nowhere {
            volume: volume.to_string(),
            node: node.to_string(),
            asked: answers.len(),
        });
    }
    Err(PeerError::Unanswered {
        volume: volume.to_string(),
        node: node.to_string(),
        asked: answers.len(),
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

    /// The sealed body, if this node's key opens it and it is fresh.
    fn open(&self, sealed: &wire::SealedRequest) -> Result<ModifyVolumeBody, PeerError> {
        let key = PeerKey::read(key_file(&self.driver.config().peer)?)?;
        Ok(crust_peer_seal::open(
            &key,
            &sealed.body,
            &sealed.mac,
            crust_peer_seal::now_unix_ms(),
            &self.seen,
        )?)
    }
}

#[tonic::async_trait]
impl wire::peer_server::Peer for PeerService {
    async fn modify_volume(
        &self,
        request: Request<wire::SealedRequest>,
    ) -> Result<Response<wire::ModifyVolumeReply>, Status> {
        let from = request.remote_addr();
        let body = self.open(request.get_ref()).inspect_err(|e| {
            tracing::warn!(from = ?from, "peer ModifyVolume refused: {e}");
        })?;
        tracing::info!(volume = %body.volume_id, from_node = %body.from_node, from = ?from, "ModifyVolume from a peer");
        let req = csi::ControllerModifyVolumeRequest {
            volume_id: body.volume_id,
            mutable_parameters: body.mutable_parameters.into_iter().collect(),
            ..Default::default()
        };
        blocking(&self.driver, move |d| {
            d.controller().controller_modify_volume(&req)
        })
        .await?;
        Ok(Response::new(wire::ModifyVolumeReply {}))
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
    let l = tokio::net::TcpListener::bind(address)
        .await
        .map_err(peer_err)?;
    let bound = l.local_addr().map_err(peer_err)?;
    tracing::info!("serving other nodes' plugins on {bound}");
    Ok(Some(l))
}

/// The peer service on its TCP listener until `stop` turns true.
pub async fn serve(
    listener: tokio::net::TcpListener,
    driver: Arc<Driver>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let svc = wire::peer_server::PeerServer::new(PeerService::new(driver))
        .max_decoding_message_size(MESSAGE_MAX_BYTES);
    let r = tonic::transport::Server::builder()
        .timeout(Duration::from_secs(120))
        .add_service(svc)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
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

    fn code_of(r: Result<(), PeerError>) -> Code {
        Status::from(r.unwrap_err()).code()
    }

    #[test]
    fn the_owners_answer_wins_and_silence_is_never_not_found() {
        let nf = || Err(Status::not_found("no"));
        // One OK among "not mine": OK.
        assert!(verdict("v", "n", &[(at(1), nf()), (at(2), Ok(()))]).is_ok());
        // The owner refused: its code, even beside a node that is down.
        let r = verdict(
            "v",
            "n",
            &[
                (at(1), Err(Status::unavailable("down"))),
                (at(2), Err(Status::invalid_argument("iops: not digits"))),
                (at(3), nf()),
            ],
        );
        let s = Status::from(r.unwrap_err());
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().contains("iops: not digits") && s.message().contains("10.0.0.1:2"));
        // Everyone says "not mine": NOT_FOUND.
        assert_eq!(
            code_of(verdict("v", "n", &[(at(1), nf()), (at(2), nf())])),
            Code::NotFound
        );
        // Someone did not answer (down, timed out, another key): retry.
        for silent in [
            Status::unavailable("connect"),
            Status::deadline_exceeded("slow"),
            Status::unauthenticated("seal"),
            Status::unimplemented("old plugin"),
        ] {
            let r = verdict("v", "n", &[(at(1), nf()), (at(2), Err(silent))]);
            assert_eq!(code_of(r), Code::Unavailable);
        }
        // Nobody to ask.
        assert_eq!(code_of(verdict("v", "n", &[])), Code::NotFound);
    }
}
