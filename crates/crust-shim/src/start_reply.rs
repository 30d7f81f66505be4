//! What `start` prints, in the format of the containerd that called it.
//!
//! Facts from containerd's sources (the shim launch in `pkg/shim/util.go`
//! and `parseStartResponse` in `core/runtime/v2/shim.go`):
//!
//! | caller | how it shows | it parses | task API |
//! |---|---|---|---|
//! | 1.6 | no `MAX_SHIM_VERSION` in the environment | the plain address | v2 |
//! | 1.7 | `MAX_SHIM_VERSION=2`; Version service says 1.7 | plain, or JSON with `version` ≤ 2 | v2 |
//! | 2.0 – 2.2 | `MAX_SHIM_VERSION=2`; Version service says 2.x | JSON `{"version":3,"address":…,"protocol":"ttrpc"}` (plain still accepted as v2) | v3 (v2 for a plain address) |
//! | 2.3+ | stdin carries a protobuf `containerd.runtime.bootstrap.v1.BootstrapParams` (with `containerd_version`) | protobuf `BootstrapResult` first, then the legacy forms | v3 |
//!
//! containerd 1.7 and 2.0–2.2 start shims identically, so the shim asks
//! the caller: containerd's `containerd.services.version.v1.Version` on the
//! `-address` gRPC socket. If that fails the plain address is the safe
//! answer: every containerd accepts it (2.x then speaks task v2, which the
//! shim also serves).
//!
//! The BootstrapParams/Result messages below carry containerd's field
//! numbers (api/runtime/bootstrap/v1/bootstrap.proto).

use std::path::Path;
use std::time::Duration;

use containerd_shim::Flags;
use prost::Message;
use sha2::{Digest, Sha256};

/// Environment variable containerd ≥ 1.7 sets when starting a shim.
pub const MAX_SHIM_VERSION_ENV: &str = "MAX_SHIM_VERSION";

#[derive(Clone, PartialEq, Message)]
pub struct BootstrapParams {
    #[prost(string, tag = "1")]
    pub instance_id: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(int32, tag = "3")]
    pub log_level: i32,
    #[prost(string, tag = "4")]
    pub containerd_version: String,
    #[prost(string, tag = "5")]
    pub containerd_ttrpc_address: String,
    #[prost(string, tag = "6")]
    pub containerd_grpc_address: String,
    #[prost(string, tag = "7")]
    pub containerd_binary: String,
    #[prost(message, repeated, tag = "8")]
    pub extensions: Vec<Extension>,
    #[prost(string, optional, tag = "9")]
    pub socket_dir: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Extension {
    #[prost(message, optional, tag = "1")]
    pub value: Option<prost_types::Any>,
}

#[derive(Clone, PartialEq, Message)]
pub struct BootstrapResult {
    #[prost(int32, tag = "1")]
    pub version: i32,
    #[prost(string, tag = "2")]
    pub address: String,
    #[prost(string, tag = "3")]
    pub protocol: String,
    #[prost(int32, repeated, tag = "4")]
    pub capabilities: Vec<i32>,
    #[prost(map = "string, string", tag = "5")]
    pub metadata: std::collections::HashMap<String, String>,
}

#[derive(Clone, PartialEq, Message)]
struct VersionResponse {
    #[prost(string, tag = "1")]
    version: String,
    #[prost(string, tag = "2")]
    revision: String,
}

/// How to answer `start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// containerd 1.x: the address alone.
    Plain,
    /// containerd 2.0–2.2: JSON bootstrap params, task API v3.
    Json,
    /// containerd 2.3+: protobuf BootstrapResult.
    Protobuf { socket_dir: Option<String> },
}

impl Caller {
    pub fn socket_dir(&self) -> Option<&str> {
        match self {
            Caller::Protobuf { socket_dir } => socket_dir.as_deref().filter(|d| !d.is_empty()),
            _ => None,
        }
    }
}

/// The BootstrapParams on stdin, if that is what stdin holds. Older
/// containerds send nothing, or a protobuf `Any` of runtime options,
/// which has no field 4 and so no `containerd_version`.
pub fn bootstrap_params(stdin: &[u8], id: &str) -> Option<BootstrapParams> {
    let p = BootstrapParams::decode(stdin).ok()?;
    (!p.containerd_version.is_empty() && (p.instance_id.is_empty() || p.instance_id == id))
        .then_some(p)
}

/// Decides the reply format (see the module doc); asks containerd its
/// version only when the other signs leave 1.7 and 2.0–2.2 open.
pub fn detect(stdin: &[u8], flags: &Flags) -> Caller {
    let params = bootstrap_params(stdin, &flags.id);
    let max_version = std::env::var_os(MAX_SHIM_VERSION_ENV).is_some();
    decide(params, max_version, || containerd_version(&flags.address))
}

/// The decision of [`detect`], from what the shim saw.
pub fn decide(
    params: Option<BootstrapParams>,
    max_version_env: bool,
    version: impl FnOnce() -> Option<String>,
) -> Caller {
    if let Some(p) = params {
        return Caller::Protobuf {
            socket_dir: p.socket_dir,
        };
    }
    if !max_version_env {
        return Caller::Plain;
    }
    match version() {
        Some(v) if major(&v) >= Some(2) => Caller::Json,
        _ => Caller::Plain,
    }
}

/// Major version of `v1.7.2`, `2.1.0-rc.1`, ...
pub fn major(v: &str) -> Option<u32> {
    v.trim_start_matches('v').split('.').next()?.parse().ok()
}

/// Asks containerd's Version service on its gRPC socket (2 s at most).
pub fn containerd_version(grpc_address: &str) -> Option<String> {
    let path = grpc_address
        .strip_prefix("unix://")
        .unwrap_or(grpc_address)
        .to_string();
    if path.is_empty() {
        return None;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    rt.block_on(async move {
        tokio::time::timeout(Duration::from_secs(2), async move {
            let channel = crust_proto::endpoint::Endpoint::Unix(path.into())
                .connect()
                .await
                .ok()?;
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready().await.ok()?;
            let codec = tonic_prost::ProstCodec::<(), VersionResponse>::default();
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(
                "/containerd.services.version.v1.Version/Version",
            );
            let r = grpc
                .unary(tonic::Request::new(()), path, codec)
                .await
                .ok()?;
            Some(r.into_inner().version)
        })
        .await
        .ok()
        .flatten()
    })
}

/// The shim socket address under a socket dir containerd chose (2.3+),
/// hashed the way containerd hashes it.
pub fn address_in(dir: &str, grpc_address: &str, namespace: &str, id: &str) -> String {
    let path = Path::new(grpc_address).join(namespace).join(id);
    let d = Sha256::digest(path.to_string_lossy().as_bytes());
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    format!("unix://{}/{hex}", dir.trim_end_matches('/'))
}

/// The bytes `start` prints.
pub fn encode(caller: &Caller, address: &str) -> Vec<u8> {
    match caller {
        Caller::Plain => address.as_bytes().to_vec(),
        Caller::Json => serde_json::json!({
            "version": 3,
            "address": address,
            "protocol": "ttrpc",
        })
        .to_string()
        .into_bytes(),
        Caller::Protobuf { .. } => BootstrapResult {
            version: 3,
            address: address.to_string(),
            protocol: "ttrpc".into(),
            ..Default::default()
        }
        .encode_to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protobuf_params_are_told_from_runtime_options() {
        let p = BootstrapParams {
            instance_id: "c1".into(),
            namespace: "k8s.io".into(),
            containerd_version: "v2.3.0".into(),
            containerd_ttrpc_address: "/run/containerd/containerd.sock.ttrpc".into(),
            socket_dir: Some("/run/containerd/s2".into()),
            ..Default::default()
        };
        let got = bootstrap_params(&p.encode_to_vec(), "c1").unwrap();
        assert_eq!(got.socket_dir.as_deref(), Some("/run/containerd/s2"));
        // What 1.x/2.0-2.2 put on stdin: a protobuf Any of runtime options.
        let any = prost_types::Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: vec![0x10, 0x01],
        };
        assert!(bootstrap_params(&any.encode_to_vec(), "c1").is_none());
        assert!(bootstrap_params(b"", "c1").is_none());
        assert!(bootstrap_params(&p.encode_to_vec(), "other").is_none());
    }

    #[test]
    fn each_containerd_gets_its_format() {
        let p = BootstrapParams {
            instance_id: "c".into(),
            containerd_version: "v2.3.1".into(),
            ..Default::default()
        };
        let never = || -> Option<String> { panic!("no version query needed") };
        // 2.3+: the params on stdin decide, whatever else.
        assert!(matches!(
            decide(Some(p), true, never),
            Caller::Protobuf { .. }
        ));
        // 1.6: no MAX_SHIM_VERSION.
        assert_eq!(decide(None, false, never), Caller::Plain);
        // 1.7 and 2.0-2.2 look alike: the Version service tells.
        assert_eq!(decide(None, true, || Some("1.7.13".into())), Caller::Plain);
        assert_eq!(decide(None, true, || Some("v2.1.4".into())), Caller::Json);
        assert_eq!(
            decide(None, true, || Some("2.2.0-rc.1".into())),
            Caller::Json
        );
        // Unknown: the plain address, which every containerd accepts.
        assert_eq!(decide(None, true, || None), Caller::Plain);
    }

    #[test]
    fn replies_in_each_format() {
        let a = "unix:///run/containerd/s/abc";
        assert_eq!(encode(&Caller::Plain, a), a.as_bytes());
        let v: serde_json::Value = serde_json::from_slice(&encode(&Caller::Json, a)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"version": 3, "address": a, "protocol": "ttrpc"})
        );
        let r = BootstrapResult::decode(&encode(&Caller::Protobuf { socket_dir: None }, a)[..])
            .unwrap();
        assert_eq!(
            (r.version, r.address.as_str(), r.protocol.as_str()),
            (3, a, "ttrpc")
        );
        assert_eq!(major("v1.7.2"), Some(1));
        assert_eq!(major("2.1.0-rc.1"), Some(2));
        assert_eq!(major("garbage"), None);
    }

    #[test]
    fn socket_dir_address_hashes_like_containerd() {
        // Same hash input as containerd_shim::socket_address.
        let ours = address_in(
            "/run/containerd/s",
            "/run/containerd/containerd.sock",
            "k8s.io",
            "sb",
        );
        let theirs =
            containerd_shim::socket_address("/run/containerd/containerd.sock", "k8s.io", "sb");
        assert_eq!(ours, theirs);
        assert!(address_in("/x/", "/a", "n", "i").starts_with("unix:///x/"));
    }
}
