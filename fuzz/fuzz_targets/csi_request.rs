//! CSI request validation through the plugin's real gRPC service
//! implementations (crust-csi's ControllerService and NodeService, the
//! code a CO's request reaches after tonic decodes it). Input: one byte
//! choosing the RPC, then the request's protobuf bytes.
//! The plugin runs on a state dir in the run's scratch directory with a
//! backend that holds nothing and refuses to create anything, and with
//! deferral off, so no input can allocate, attach, mount or write a
//! hand-off record: with no volume to find, every node RPC that names
//! one ends before touching a path (NOT_FOUND, or OK for
//! NodeUnpublishVolume's idempotency), and the state dir is checked to
//! stay empty after every input, so that stays true.
//! Invariants: no panic; never INTERNAL or UNKNOWN (a malformed request
//! is the caller's fault, and no host failure can happen here); nothing
//! is ever created (CreateVolume and CreateSnapshot never answer OK);
//! the state dir stays empty.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crust_backend::{
    Allocation, Backend, BackendError, BackingState, Capacity, Result as BackendResult,
    StorageProblem,
};
use crust_csi::controller::ControllerService;
use crust_csi::node::NodeService;
use crust_csi::{Config, Driver};
use crust_proto::csi::v1 as csi;
use csi::controller_server::Controller;
use csi::node_server::Node;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::{Code, Request, Status};

/// A backend with no volumes that refuses every allocation.
struct Refusing;

impl Backend for Refusing {
    fn kind(&self) -> &'static str {
        "refusing"
    }
    fn create(&self, _: &str, size: u64, _: u64) -> BackendResult<Allocation> {
        Err(BackendError::Exhausted {
            requested: size,
            available: 0,
        })
    }
    fn delete(&self, _: &str) -> BackendResult<()> {
        Ok(())
    }
    fn get(&self, _: &str) -> BackendResult<Option<Allocation>> {
        Ok(None)
    }
    fn list(&self) -> BackendResult<Vec<Allocation>> {
        Ok(vec![])
    }
    fn expand(&self, id: &str, _: u64) -> BackendResult<u64> {
        Err(BackendError::NotFound(id.into()))
    }
    fn attach(&self, id: &str) -> BackendResult<PathBuf> {
        Err(BackendError::NotFound(id.into()))
    }
    fn attached_device(&self, _: &str) -> BackendResult<Option<PathBuf>> {
        Ok(None)
    }
    fn detach(&self, _: &str) -> BackendResult<()> {
        Ok(())
    }
    fn capacity(&self) -> BackendResult<Capacity> {
        Ok(Capacity {
            available_bytes: 0,
            maximum_volume_size: 0,
            minimum_volume_size: 1 << 20,
        })
    }
    fn probe(&self) -> BackendResult<()> {
        Ok(())
    }
    fn backing_state(&self, id: &str) -> BackingState {
        BackingState::Missing(id.into())
    }
    fn storage_health(&self) -> Vec<StorageProblem> {
        vec![]
    }
}

struct Plugin {
    rt: tokio::runtime::Runtime,
    controller: ControllerService,
    node: NodeService,
    volumes: PathBuf,
}

fn plugin() -> &'static Plugin {
    static P: OnceLock<Plugin> = OnceLock::new();
    P.get_or_init(|| {
        // scripts/fuzz.sh gives each run a scratch directory and removes it.
        let scratch = std::env::var_os("CRUST_FUZZ_SCRATCH")
            .map_or(PathBuf::from("/dev/shm/crust-fuzz-csi"), PathBuf::from)
            .join(format!("csi-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).unwrap();
        let mut cfg = Config::pool(
            scratch.join("csi.sock"),
            scratch.join("state"),
            scratch.join("pool"),
            1 << 30,
        );
        cfg.node_id = "fuzz-node".into();
        cfg.deferral.enabled = false;
        cfg.deferral.ops.crust_root = scratch.join("crust");
        cfg.deferral.ops.kata_root = scratch.join("kata");
        cfg.deferral.ops.kata_shim_dirs = vec![];
        let driver = Driver::new(cfg, Arc::new(Refusing)).expect("driver");
        Plugin {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            controller: ControllerService::new(driver.clone()),
            node: NodeService::new(driver),
            volumes: scratch.join("state/volumes"),
        }
    })
}

/// The answer's status code; OK when the RPC succeeded.
fn code<T>(r: Result<tonic::Response<T>, Status>) -> Code {
    r.map_or_else(|s| s.code(), |_| Code::Ok)
}

fn req<M: Message + Default>(bytes: &[u8]) -> Option<Request<M>> {
    M::decode(bytes).ok().map(Request::new)
}

/// Calls the RPC `which` picks; None when the bytes are not its request
/// (tonic answers that itself, before any of crust's code).
async fn call(p: &Plugin, which: u8, b: &[u8]) -> Option<(&'static str, Code)> {
    let (c, n) = (&p.controller, &p.node);
    Some(match which % 20 {
        0 => ("CreateVolume", code(c.create_volume(req(b)?).await)),
        1 => ("DeleteVolume", code(c.delete_volume(req(b)?).await)),
        2 => (
            "ValidateVolumeCapabilities",
            code(c.validate_volume_capabilities(req(b)?).await),
        ),
        3 => ("ListVolumes", code(c.list_volumes(req(b)?).await)),
        4 => ("GetCapacity", code(c.get_capacity(req(b)?).await)),
        5 => (
            "ControllerExpandVolume",
            code(c.controller_expand_volume(req(b)?).await),
        ),
        6 => (
            "ControllerGetVolume",
            code(c.controller_get_volume(req(b)?).await),
        ),
        7 => ("CreateSnapshot", code(c.create_snapshot(req(b)?).await)),
        8 => ("DeleteSnapshot", code(c.delete_snapshot(req(b)?).await)),
        9 => ("ListSnapshots", code(c.list_snapshots(req(b)?).await)),
        10 => ("GetSnapshot", code(c.get_snapshot(req(b)?).await)),
        11 => (
            "ControllerGetVolumeHealth",
            code(c.controller_get_volume_health(req(b)?).await),
        ),
        12 => (
            "ControllerListVolumeHealth",
            code(c.controller_list_volume_health(req(b)?).await),
        ),
        13 => ("NodeStageVolume", code(n.node_stage_volume(req(b)?).await)),
        14 => (
            "NodePublishVolume",
            code(n.node_publish_volume(req(b)?).await),
        ),
        15 => (
            "NodeGetVolumeStats",
            code(n.node_get_volume_stats(req(b)?).await),
        ),
        16 => (
            "NodeExpandVolume",
            code(n.node_expand_volume(req(b)?).await),
        ),
        17 => (
            "NodeUnstageVolume",
            code(n.node_unstage_volume(req(b)?).await),
        ),
        18 => (
            "NodeUnpublishVolume",
            code(n.node_unpublish_volume(req(b)?).await),
        ),
        _ => (
            "NodeGetVolumeHealth",
            code(n.node_get_volume_health(req(b)?).await),
        ),
    })
}

fn is_empty_dir(p: &Path) -> bool {
    std::fs::read_dir(p).map_or(true, |mut d| d.next().is_none())
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    let p = plugin();
    let Some((rpc, code)) = p.rt.block_on(call(p, which, bytes)) else {
        return;
    };
    assert!(
        !matches!(code, Code::Internal | Code::Unknown),
        "{rpc} answered {code:?}"
    );
    if matches!(rpc, "CreateVolume" | "CreateSnapshot") {
        assert_ne!(code, Code::Ok, "{rpc} created something");
    }
    assert!(is_empty_dir(&p.volumes), "{rpc} left a volume record");
});
