//! Text and JSON rendering of CSI responses.
//!
//! JSON uses the proto field names (snake_case, like the rest of crust's
//! JSON, e.g. the runtime CLI's stats), int64 as JSON numbers, enums as their
//! proto names (`"BYTES"`, `"SINGLE_NODE_WRITER"`; an unknown value as its
//! number), unset messages as `null`, timestamps as RFC 3339 strings.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use crust_proto::csi::v1 as csi;
use serde_json::{Map, Value, json};

use crate::units::human_size;
use crate::{Render, table};

macro_rules! enum_name {
    ($fn:ident, $ty:ty) => {
        /// The proto name of the enum value, or its number when unknown.
        pub fn $fn(v: i32) -> Value {
            match <$ty>::try_from(v) {
                Ok(e) => Value::String(e.as_str_name().to_string()),
                Err(_) => Value::from(v),
            }
        }
    };
}

enum_name!(plugin_service_name, csi::plugin_capability::service::Type);
enum_name!(
    plugin_expansion_name,
    csi::plugin_capability::volume_expansion::Type
);
enum_name!(access_mode_name, csi::volume_capability::access_mode::Mode);
enum_name!(
    controller_rpc_name,
    csi::controller_service_capability::rpc::Type
);
enum_name!(node_rpc_name, csi::node_service_capability::rpc::Type);
enum_name!(
    group_rpc_name,
    csi::group_controller_service_capability::rpc::Type
);
enum_name!(usage_unit_name, csi::volume_usage::Unit);
enum_name!(volume_health_status_name, csi::VolumeHealthErrorType);
enum_name!(storage_health_status_name, csi::StorageHealthErrorType);

fn name_text(v: Value) -> String {
    match v {
        Value::String(s) => s,
        other => format!("UNKNOWN({other})"),
    }
}

/// JSON of a Controller/Node capability list: `{"capabilities":[{"rpc":{"type":…}}]}`.
fn rpc_caps_json(names: &[Option<Value>]) -> Value {
    json!({ "capabilities": names.iter().map(|n| match n {
        Some(name) => json!({ "rpc": { "type": name } }),
        None => json!({}),
    }).collect::<Vec<_>>() })
}

/// Text of a Controller/Node capability list, one `rpc NAME` line each.
fn rpc_caps_text(names: &[Option<Value>]) -> String {
    let mut out = String::new();
    for n in names {
        match n {
            Some(name) => {
                let _ = writeln!(out, "rpc {}", name_text(name.clone()));
            }
            None => out.push_str("(empty capability)\n"),
        }
    }
    if out.is_empty() {
        out.push_str("(no capabilities)\n");
    }
    out
}

/// A string map with sorted keys (HashMap order is random).
fn map_json(m: &HashMap<String, String>) -> Value {
    let sorted: BTreeMap<_, _> = m.iter().collect();
    json!(sorted)
}

fn map_text(m: &HashMap<String, String>) -> String {
    if m.is_empty() {
        return "-".to_string();
    }
    let sorted: BTreeMap<_, _> = m.iter().collect();
    sorted
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn opt<T>(o: &Option<T>, f: impl Fn(&T) -> Value) -> Value {
    o.as_ref().map(f).unwrap_or(Value::Null)
}

pub fn topology_json(t: &csi::Topology) -> Value {
    json!({ "segments": map_json(&t.segments) })
}

fn topologies_text(ts: &[csi::Topology]) -> String {
    if ts.is_empty() {
        return "-".to_string();
    }
    ts.iter()
        .map(|t| format!("{{{}}}", map_text(&t.segments)))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn content_source_json(s: &csi::VolumeContentSource) -> Value {
    use csi::volume_content_source::Type;
    match &s.r#type {
        Some(Type::Snapshot(x)) => json!({ "snapshot": { "snapshot_id": x.snapshot_id } }),
        Some(Type::Volume(x)) => json!({ "volume": { "volume_id": x.volume_id } }),
        None => json!({}),
    }
}

fn content_source_text(s: &Option<csi::VolumeContentSource>) -> Option<String> {
    use csi::volume_content_source::Type;
    match s.as_ref()?.r#type.as_ref()? {
        Type::Snapshot(x) => Some(format!("snapshot {}", x.snapshot_id)),
        Type::Volume(x) => Some(format!("volume {}", x.volume_id)),
    }
}

pub fn volume_json(v: &csi::Volume) -> Value {
    json!({
        "capacity_bytes": v.capacity_bytes,
        "volume_id": v.volume_id,
        "volume_context": map_json(&v.volume_context),
        "content_source": opt(&v.content_source, content_source_json),
        "accessible_topology": v.accessible_topology.iter().map(topology_json).collect::<Vec<_>>(),
    })
}

fn volume_text(out: &mut String, v: &csi::Volume) {
    let _ = writeln!(out, "volume_id:           {}", v.volume_id);
    let _ = writeln!(
        out,
        "capacity:            {} ({} bytes)",
        human_size(v.capacity_bytes),
        v.capacity_bytes
    );
    let _ = writeln!(out, "volume_context:      {}", map_text(&v.volume_context));
    if let Some(src) = content_source_text(&v.content_source) {
        let _ = writeln!(out, "content_source:      {src}");
    }
    let _ = writeln!(
        out,
        "accessible_topology: {}",
        topologies_text(&v.accessible_topology)
    );
}

pub fn volume_capability_json(c: &csi::VolumeCapability) -> Value {
    use csi::volume_capability::AccessType;
    let mut m = Map::new();
    match &c.access_type {
        Some(AccessType::Block(_)) => {
            m.insert("block".into(), json!({}));
        }
        Some(AccessType::Mount(mv)) => {
            m.insert(
                "mount".into(),
                json!({
                    "fs_type": mv.fs_type,
                    "mount_flags": mv.mount_flags,
                    "volume_mount_group": mv.volume_mount_group,
                    "volume_supplemental_group": mv.volume_supplemental_group,
                    "volume_supplemental_group_change_policy": mv.volume_supplemental_group_change_policy,
                }),
            );
        }
        None => {}
    }
    m.insert(
        "access_mode".into(),
        opt(
            &c.access_mode,
            |a| json!({ "mode": access_mode_name(a.mode) }),
        ),
    );
    Value::Object(m)
}

fn volume_capability_text(c: &csi::VolumeCapability) -> String {
    use csi::volume_capability::AccessType;
    let access = match &c.access_type {
        Some(AccessType::Block(_)) => "block".to_string(),
        Some(AccessType::Mount(mv)) => {
            let mut s = format!(
                "mount fs_type={}",
                if mv.fs_type.is_empty() {
                    "(default)"
                } else {
                    &mv.fs_type
                }
            );
            if !mv.mount_flags.is_empty() {
                let _ = write!(s, " flags={}", mv.mount_flags.join(","));
            }
            if !mv.volume_mount_group.is_empty() {
                let _ = write!(s, " mount_group={}", mv.volume_mount_group);
            }
            if !mv.volume_supplemental_group.is_empty() {
                let _ = write!(s, " supplemental_group={}", mv.volume_supplemental_group);
            }
            if !mv.volume_supplemental_group_change_policy.is_empty() {
                let _ = write!(
                    s,
                    " supplemental_group_change_policy={}",
                    mv.volume_supplemental_group_change_policy
                );
            }
            s
        }
        None => "(no access type)".to_string(),
    };
    let mode = c
        .access_mode
        .as_ref()
        .map(|a| name_text(access_mode_name(a.mode)))
        .unwrap_or_else(|| "(no access mode)".into());
    format!("{access} {mode}")
}

pub fn volume_condition_json(c: &csi::VolumeCondition) -> Value {
    json!({ "abnormal": c.abnormal, "message": c.message })
}

fn condition_text(c: &Option<csi::VolumeCondition>) -> String {
    match c {
        None => "-".into(),
        Some(c) if c.abnormal => format!("ABNORMAL: {}", c.message),
        Some(c) if c.message.is_empty() => "normal".into(),
        Some(c) => format!("normal: {}", c.message),
    }
}

fn snapshot_json(s: &csi::Snapshot) -> Value {
    json!({
        "size_bytes": s.size_bytes,
        "snapshot_id": s.snapshot_id,
        "source_volume_id": s.source_volume_id,
        "creation_time": opt(&s.creation_time, |t| Value::String(t.to_string())),
        "ready_to_use": s.ready_to_use,
        "group_snapshot_id": s.group_snapshot_id,
    })
}

fn snapshot_text(out: &mut String, s: &csi::Snapshot) {
    let _ = writeln!(out, "snapshot_id:       {}", s.snapshot_id);
    let _ = writeln!(out, "source_volume_id:  {}", s.source_volume_id);
    let _ = writeln!(
        out,
        "size:              {} ({} bytes)",
        human_size(s.size_bytes),
        s.size_bytes
    );
    let _ = writeln!(
        out,
        "creation_time:     {}",
        s.creation_time
            .as_ref()
            .map(|t| t.to_string())
            .unwrap_or_else(|| "-".into())
    );
    let _ = writeln!(out, "ready_to_use:      {}", s.ready_to_use);
    if !s.group_snapshot_id.is_empty() {
        let _ = writeln!(out, "group_snapshot_id: {}", s.group_snapshot_id);
    }
}

fn empty_json() -> Value {
    json!({})
}

macro_rules! empty_render {
    ($($ty:ident),*) => {
        $(impl Render for csi::$ty {
            fn to_json(&self) -> Value { empty_json() }
            fn to_text(&self) -> String { String::new() }
        })*
    };
}

empty_render!(
    DeleteVolumeResponse,
    ControllerUnpublishVolumeResponse,
    DeleteSnapshotResponse,
    ControllerModifyVolumeResponse,
    NodeStageVolumeResponse,
    NodeUnstageVolumeResponse,
    NodePublishVolumeResponse,
    NodeUnpublishVolumeResponse
);

impl Render for csi::GetPluginInfoResponse {
    fn to_json(&self) -> Value {
        json!({
            "name": self.name,
            "vendor_version": self.vendor_version,
            "manifest": map_json(&self.manifest),
        })
    }
    fn to_text(&self) -> String {
        let mut out = format!(
            "name:           {}\nvendor_version: {}\n",
            self.name, self.vendor_version
        );
        let sorted: BTreeMap<_, _> = self.manifest.iter().collect();
        for (k, v) in sorted {
            let _ = writeln!(out, "manifest:       {k}={v}");
        }
        out
    }
}

fn plugin_capability_json(c: &csi::PluginCapability) -> Value {
    use csi::plugin_capability::Type;
    match &c.r#type {
        Some(Type::Service(s)) => json!({ "service": { "type": plugin_service_name(s.r#type) } }),
        Some(Type::VolumeExpansion(e)) => {
            json!({ "volume_expansion": { "type": plugin_expansion_name(e.r#type) } })
        }
        None => json!({}),
    }
}

impl Render for csi::GetPluginCapabilitiesResponse {
    fn to_json(&self) -> Value {
        json!({ "capabilities": self.capabilities.iter().map(plugin_capability_json).collect::<Vec<_>>() })
    }
    fn to_text(&self) -> String {
        use csi::plugin_capability::Type;
        let mut out = String::new();
        for c in &self.capabilities {
            let line = match &c.r#type {
                Some(Type::Service(s)) => {
                    format!("service {}", name_text(plugin_service_name(s.r#type)))
                }
                Some(Type::VolumeExpansion(e)) => format!(
                    "volume_expansion {}",
                    name_text(plugin_expansion_name(e.r#type))
                ),
                None => "(empty capability)".into(),
            };
            out.push_str(&line);
            out.push('\n');
        }
        if out.is_empty() {
            out.push_str("(no capabilities)\n");
        }
        out
    }
}

impl Render for csi::ProbeResponse {
    fn to_json(&self) -> Value {
        json!({ "ready": self.ready })
    }
    fn to_text(&self) -> String {
        match self.ready {
            Some(r) => format!("ready: {r}\n"),
            None => "ready: (not reported, treat as ready)\n".into(),
        }
    }
}

/// `Render` of a response that carries one optional message: its JSON
/// under the field's name, its text, or a line saying it is missing.
macro_rules! render_one {
    ($ty:ident, $field:ident, $json:path, $text:path) => {
        impl Render for csi::$ty {
            fn to_json(&self) -> Value {
                json!({ stringify!($field): opt(&self.$field, $json) })
            }
            fn to_text(&self) -> String {
                let mut out = String::new();
                match &self.$field {
                    Some(v) => $text(&mut out, v),
                    None => out.push_str(concat!("(no ", stringify!($field), " in the answer)\n")),
                }
                out
            }
        }
    };
}

render_one!(CreateVolumeResponse, volume, volume_json, volume_text);

impl Render for csi::ControllerPublishVolumeResponse {
    fn to_json(&self) -> Value {
        json!({ "publish_context": map_json(&self.publish_context) })
    }
    fn to_text(&self) -> String {
        format!("publish_context: {}\n", map_text(&self.publish_context))
    }
}

impl Render for csi::ValidateVolumeCapabilitiesResponse {
    fn to_json(&self) -> Value {
        json!({
            "confirmed": opt(&self.confirmed, |c| json!({
                "volume_context": map_json(&c.volume_context),
                "volume_capabilities": c.volume_capabilities.iter().map(volume_capability_json).collect::<Vec<_>>(),
                "parameters": map_json(&c.parameters),
                "mutable_parameters": map_json(&c.mutable_parameters),
            })),
            "message": self.message,
        })
    }
    fn to_text(&self) -> String {
        let mut out = String::new();
        match &self.confirmed {
            Some(c) => {
                out.push_str("confirmed: yes\n");
                for cap in &c.volume_capabilities {
                    let _ = writeln!(out, "capability: {}", volume_capability_text(cap));
                }
                let _ = writeln!(out, "volume_context: {}", map_text(&c.volume_context));
                let _ = writeln!(out, "parameters: {}", map_text(&c.parameters));
                if !c.mutable_parameters.is_empty() {
                    let _ = writeln!(
                        out,
                        "mutable_parameters: {}",
                        map_text(&c.mutable_parameters)
                    );
                }
            }
            None => out.push_str("confirmed: no\n"),
        }
        if !self.message.is_empty() {
            let _ = writeln!(out, "message: {}", self.message);
        }
        out
    }
}

fn volume_status_json(published: &[String], cond: &Option<csi::VolumeCondition>) -> Value {
    json!({
        "published_node_ids": published,
        "volume_condition": opt(cond, volume_condition_json),
    })
}

impl Render for csi::ListVolumesResponse {
    fn to_json(&self) -> Value {
        json!({
            "entries": self.entries.iter().map(|e| json!({
                "volume": opt(&e.volume, volume_json),
                "status": opt(&e.status, |s| volume_status_json(&s.published_node_ids, &s.volume_condition)),
            })).collect::<Vec<_>>(),
            "next_token": self.next_token,
        })
    }
    fn to_text(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .entries
            .iter()
            .map(|e| {
                let (id, cap) = e
                    .volume
                    .as_ref()
                    .map(|v| (v.volume_id.clone(), human_size(v.capacity_bytes)))
                    .unwrap_or_else(|| ("-".into(), "-".into()));
                let (nodes, cond) = e
                    .status
                    .as_ref()
                    .map(|s| {
                        let n = if s.published_node_ids.is_empty() {
                            "-".to_string()
                        } else {
                            s.published_node_ids.join(",")
                        };
                        (n, condition_text(&s.volume_condition))
                    })
                    .unwrap_or_else(|| ("-".into(), "-".into()));
                vec![id, cap, nodes, cond]
            })
            .collect();
        let mut out = table(
            &["VOLUME_ID", "CAPACITY", "PUBLISHED_NODES", "CONDITION"],
            &rows,
        );
        if !self.next_token.is_empty() {
            let _ = writeln!(out, "next_token: {}", self.next_token);
        }
        out
    }
}

impl Render for csi::GetCapacityResponse {
    fn to_json(&self) -> Value {
        json!({
            "available_capacity": self.available_capacity,
            "maximum_volume_size": self.maximum_volume_size,
            "minimum_volume_size": self.minimum_volume_size,
        })
    }
    fn to_text(&self) -> String {
        let sz = |o: Option<i64>| {
            o.map(|b| format!("{} ({b} bytes)", human_size(b)))
                .unwrap_or_else(|| "-".into())
        };
        format!(
            "available_capacity:  {}\nmaximum_volume_size: {}\nminimum_volume_size: {}\n",
            sz(Some(self.available_capacity)),
            sz(self.maximum_volume_size),
            sz(self.minimum_volume_size)
        )
    }
}

impl Render for csi::ControllerGetCapabilitiesResponse {
    fn to_json(&self) -> Value {
        rpc_caps_json(&controller_rpc_names(self))
    }
    fn to_text(&self) -> String {
        rpc_caps_text(&controller_rpc_names(self))
    }
}

/// The advertised RPC types by proto name (`None` for an empty entry).
fn controller_rpc_names(resp: &csi::ControllerGetCapabilitiesResponse) -> Vec<Option<Value>> {
    use csi::controller_service_capability::Type;
    resp.capabilities
        .iter()
        .map(|c| {
            c.r#type
                .as_ref()
                .map(|Type::Rpc(r)| controller_rpc_name(r.r#type))
        })
        .collect()
}

render_one!(
    CreateSnapshotResponse,
    snapshot,
    snapshot_json,
    snapshot_text
);

render_one!(GetSnapshotResponse, snapshot, snapshot_json, snapshot_text);

fn group_snapshot_json(g: &csi::VolumeGroupSnapshot) -> Value {
    json!({
        "group_snapshot_id": g.group_snapshot_id,
        "snapshots": g.snapshots.iter().map(snapshot_json).collect::<Vec<_>>(),
        "creation_time": opt(&g.creation_time, |t| Value::String(t.to_string())),
        "ready_to_use": g.ready_to_use,
    })
}

fn group_snapshot_text(g: &Option<csi::VolumeGroupSnapshot>) -> String {
    let Some(g) = g else {
        return "(no group snapshot in the answer)\n".into();
    };
    let mut out = format!(
        "group_snapshot_id: {}\nready_to_use:      {}\nmembers:           {}\n",
        g.group_snapshot_id,
        g.ready_to_use,
        g.snapshots.len()
    );
    for s in &g.snapshots {
        out.push('\n');
        snapshot_text(&mut out, s);
    }
    out
}

impl Render for csi::CreateVolumeGroupSnapshotResponse {
    fn to_json(&self) -> Value {
        json!({ "group_snapshot": opt(&self.group_snapshot, group_snapshot_json) })
    }
    fn to_text(&self) -> String {
        group_snapshot_text(&self.group_snapshot)
    }
}

impl Render for csi::GetVolumeGroupSnapshotResponse {
    fn to_json(&self) -> Value {
        json!({ "group_snapshot": opt(&self.group_snapshot, group_snapshot_json) })
    }
    fn to_text(&self) -> String {
        group_snapshot_text(&self.group_snapshot)
    }
}

impl Render for csi::DeleteVolumeGroupSnapshotResponse {
    fn to_json(&self) -> Value {
        empty_json()
    }
    fn to_text(&self) -> String {
        String::new()
    }
}

impl Render for csi::GroupControllerGetCapabilitiesResponse {
    fn to_json(&self) -> Value {
        use csi::group_controller_service_capability::Type;
        rpc_caps_json(
            &self
                .capabilities
                .iter()
                .map(|c| {
                    c.r#type
                        .as_ref()
                        .map(|Type::Rpc(r)| group_rpc_name(r.r#type))
                })
                .collect::<Vec<_>>(),
        )
    }
    fn to_text(&self) -> String {
        use csi::group_controller_service_capability::Type;
        rpc_caps_text(
            &self
                .capabilities
                .iter()
                .map(|c| {
                    c.r#type
                        .as_ref()
                        .map(|Type::Rpc(r)| group_rpc_name(r.r#type))
                })
                .collect::<Vec<_>>(),
        )
    }
}

impl Render for csi::ListSnapshotsResponse {
    fn to_json(&self) -> Value {
        json!({
            "entries": self.entries.iter().map(|e| json!({
                "snapshot": opt(&e.snapshot, snapshot_json),
            })).collect::<Vec<_>>(),
            "next_token": self.next_token,
        })
    }
    fn to_text(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .entries
            .iter()
            .filter_map(|e| e.snapshot.as_ref())
            .map(|s| {
                vec![
                    s.snapshot_id.clone(),
                    s.source_volume_id.clone(),
                    human_size(s.size_bytes),
                    s.ready_to_use.to_string(),
                    s.creation_time
                        .as_ref()
                        .map(|t| t.to_string())
                        .unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        let mut out = table(
            &["SNAPSHOT_ID", "SOURCE_VOLUME", "SIZE", "READY", "CREATED"],
            &rows,
        );
        if !self.next_token.is_empty() {
            let _ = writeln!(out, "next_token: {}", self.next_token);
        }
        out
    }
}

impl Render for csi::ControllerExpandVolumeResponse {
    fn to_json(&self) -> Value {
        json!({
            "capacity_bytes": self.capacity_bytes,
            "node_expansion_required": self.node_expansion_required,
        })
    }
    fn to_text(&self) -> String {
        format!(
            "capacity:                {} ({} bytes)\nnode_expansion_required: {}\n",
            human_size(self.capacity_bytes),
            self.capacity_bytes,
            self.node_expansion_required
        )
    }
}

impl Render for csi::ControllerGetVolumeResponse {
    fn to_json(&self) -> Value {
        json!({
            "volume": opt(&self.volume, volume_json),
            "status": opt(&self.status, |s| volume_status_json(&s.published_node_ids, &s.volume_condition)),
        })
    }
    fn to_text(&self) -> String {
        let mut out = String::new();
        match &self.volume {
            Some(v) => volume_text(&mut out, v),
            None => out.push_str("(no volume in the answer)\n"),
        }
        if let Some(s) = &self.status {
            let nodes = if s.published_node_ids.is_empty() {
                "-".to_string()
            } else {
                s.published_node_ids.join(",")
            };
            let _ = writeln!(out, "published_node_ids:  {nodes}");
            let _ = writeln!(
                out,
                "volume_condition:    {}",
                condition_text(&s.volume_condition)
            );
        }
        out
    }
}

impl Render for csi::NodeGetVolumeStatsResponse {
    fn to_json(&self) -> Value {
        json!({
            "usage": self.usage.iter().map(|u| json!({
                "available": u.available,
                "total": u.total,
                "used": u.used,
                "unit": usage_unit_name(u.unit),
            })).collect::<Vec<_>>(),
            "volume_condition": opt(&self.volume_condition, volume_condition_json),
        })
    }
    fn to_text(&self) -> String {
        let bytes_unit = csi::volume_usage::Unit::Bytes as i32;
        let rows: Vec<Vec<String>> = self
            .usage
            .iter()
            .map(|u| {
                let f = |v: i64| {
                    if u.unit == bytes_unit {
                        format!("{} ({v})", human_size(v))
                    } else {
                        v.to_string()
                    }
                };
                vec![
                    name_text(usage_unit_name(u.unit)),
                    f(u.total),
                    f(u.used),
                    f(u.available),
                ]
            })
            .collect();
        let mut out = table(&["UNIT", "TOTAL", "USED", "AVAILABLE"], &rows);
        let _ = writeln!(
            out,
            "volume_condition: {}",
            condition_text(&self.volume_condition)
        );
        out
    }
}

impl Render for csi::NodeExpandVolumeResponse {
    fn to_json(&self) -> Value {
        json!({ "capacity_bytes": self.capacity_bytes })
    }
    fn to_text(&self) -> String {
        format!(
            "capacity: {} ({} bytes)\n",
            human_size(self.capacity_bytes),
            self.capacity_bytes
        )
    }
}

impl Render for csi::NodeGetCapabilitiesResponse {
    fn to_json(&self) -> Value {
        rpc_caps_json(&node_rpc_names(self))
    }
    fn to_text(&self) -> String {
        rpc_caps_text(&node_rpc_names(self))
    }
}

/// The advertised RPC types by proto name (`None` for an empty entry).
fn node_rpc_names(resp: &csi::NodeGetCapabilitiesResponse) -> Vec<Option<Value>> {
    use csi::node_service_capability::Type;
    resp.capabilities
        .iter()
        .map(|c| {
            c.r#type
                .as_ref()
                .map(|Type::Rpc(r)| node_rpc_name(r.r#type))
        })
        .collect()
}

impl Render for csi::NodeGetInfoResponse {
    fn to_json(&self) -> Value {
        json!({
            "node_id": self.node_id,
            "max_volumes_per_node": self.max_volumes_per_node,
            "accessible_topology": opt(&self.accessible_topology, topology_json),
            "supported_file_systems": self.supported_file_systems,
        })
    }
    fn to_text(&self) -> String {
        let fs = if self.supported_file_systems.is_empty() {
            String::new()
        } else {
            format!(
                "supported_file_systems: {}\n",
                self.supported_file_systems.join(",")
            )
        };
        fs + &format!(
            "node_id:              {}\nmax_volumes_per_node: {}\naccessible_topology:  {}\n",
            self.node_id,
            if self.max_volumes_per_node == 0 {
                "unlimited".to_string()
            } else {
                self.max_volumes_per_node.to_string()
            },
            self.accessible_topology
                .as_ref()
                .map(|t| topologies_text(std::slice::from_ref(t)))
                .unwrap_or_else(|| "-".into())
        )
    }
}

/// JSON of a v1.13 `VolumeHealth`.
pub fn volume_health_json(h: &csi::VolumeHealth) -> Value {
    json!({
        "volume_id": h.volume_id,
        "health_statuses": h.health_statuses.iter().map(|e| json!({
            "status": volume_health_status_name(e.status),
            "reason": e.reason,
            "message": e.message,
        })).collect::<Vec<_>>(),
    })
}

/// One line per health entry, or `healthy`.
fn volume_health_text(out: &mut String, h: &csi::VolumeHealth) {
    if h.health_statuses.is_empty() {
        let _ = writeln!(out, "{}: healthy", h.volume_id);
    }
    for e in &h.health_statuses {
        let _ = writeln!(
            out,
            "{}: {} {}: {}",
            h.volume_id,
            name_text(volume_health_status_name(e.status)),
            e.reason,
            e.message
        );
    }
}

render_one!(
    NodeGetVolumeHealthResponse,
    volume_health,
    volume_health_json,
    volume_health_text
);

render_one!(
    ControllerGetVolumeHealthResponse,
    volume_health,
    volume_health_json,
    volume_health_text
);

impl Render for csi::ControllerListVolumeHealthResponse {
    fn to_json(&self) -> Value {
        json!({
            "entries": self.entries.iter().map(volume_health_json).collect::<Vec<_>>(),
            "next_token": self.next_token,
        })
    }
    fn to_text(&self) -> String {
        let mut out = String::new();
        for h in &self.entries {
            volume_health_text(&mut out, h);
        }
        if self.entries.is_empty() {
            out.push_str("(no volume with an adverse condition)\n");
        }
        if !self.next_token.is_empty() {
            let _ = writeln!(out, "next_token: {}", self.next_token);
        }
        out
    }
}

impl Render for csi::NodeGetStorageHealthResponse {
    fn to_json(&self) -> Value {
        json!({
            "backend_health": self.backend_health.iter().map(|b| json!({
                "status": storage_health_status_name(b.status),
                "reason": b.reason,
                "message": b.message,
                "volume_capability": opt(&b.volume_capability, volume_capability_json),
            })).collect::<Vec<_>>(),
        })
    }
    fn to_text(&self) -> String {
        let mut out = String::new();
        for b in &self.backend_health {
            let _ = writeln!(
                out,
                "{} {}: {}",
                name_text(storage_health_status_name(b.status)),
                b.reason,
                b.message
            );
        }
        if out.is_empty() {
            out.push_str("storage healthy (no adverse condition)\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{OutputFormat, render};
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};

    fn hm(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn topo(k: &str, v: &str) -> csi::Topology {
        csi::Topology {
            segments: hm(&[(k, v)]),
        }
    }

    fn volume() -> csi::Volume {
        csi::Volume {
            capacity_bytes: 1 << 30,
            volume_id: "vol-1".into(),
            volume_context: hm(&[("b", "2"), ("a", "1")]),
            content_source: Some(csi::VolumeContentSource {
                r#type: Some(csi::volume_content_source::Type::Snapshot(
                    csi::volume_content_source::SnapshotSource {
                        snapshot_id: "snap-1".into(),
                    },
                )),
            }),
            accessible_topology: vec![topo("topology.crust.io/node", "n1")],
        }
    }

    fn mount_cap() -> csi::VolumeCapability {
        csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: "ext4".into(),
                mount_flags: vec!["noatime".into()],
                volume_mount_group: String::new(),
                volume_supplemental_group: "100".into(),
                volume_supplemental_group_change_policy: "OnRootMismatch".into(),
            })),
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
        }
    }

    #[test]
    fn identity_json() {
        let info = csi::GetPluginInfoResponse {
            name: "crust.csi.io".into(),
            vendor_version: "0.1.0".into(),
            manifest: hm(&[("k", "v")]),
        };
        assert_eq!(
            info.to_json(),
            json!({"name": "crust.csi.io", "vendor_version": "0.1.0", "manifest": {"k": "v"}})
        );
        assert!(info.to_text().contains("crust.csi.io"));

        use csi::plugin_capability::{Service, Type, VolumeExpansion, service, volume_expansion};
        let caps = csi::GetPluginCapabilitiesResponse {
            capabilities: vec![
                csi::PluginCapability {
                    r#type: Some(Type::Service(Service {
                        r#type: service::Type::ControllerService as i32,
                    })),
                },
                csi::PluginCapability {
                    r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                        r#type: volume_expansion::Type::Online as i32,
                    })),
                },
                csi::PluginCapability {
                    r#type: Some(Type::Service(Service { r#type: 42 })),
                },
            ],
        };
        assert_eq!(
            caps.to_json(),
            json!({"capabilities": [
                {"service": {"type": "CONTROLLER_SERVICE"}},
                {"volume_expansion": {"type": "ONLINE"}},
                {"service": {"type": 42}},
            ]})
        );
        assert!(caps.to_text().contains("UNKNOWN(42)"));

        assert_eq!(
            csi::ProbeResponse { ready: Some(true) }.to_json(),
            json!({"ready": true})
        );
        assert_eq!(
            csi::ProbeResponse { ready: None }.to_json(),
            json!({"ready": null})
        );
    }

    #[test]
    fn volume_json_shape() {
        let r = csi::CreateVolumeResponse {
            volume: Some(volume()),
        };
        assert_eq!(
            r.to_json(),
            json!({"volume": {
                "capacity_bytes": 1073741824i64,
                "volume_id": "vol-1",
                "volume_context": {"a": "1", "b": "2"},
                "content_source": {"snapshot": {"snapshot_id": "snap-1"}},
                "accessible_topology": [{"segments": {"topology.crust.io/node": "n1"}}],
            }})
        );
        // keys sorted in the pretty output, too
        let s = render(&r, OutputFormat::Json);
        assert!(s.find("\"a\"").unwrap() < s.find("\"b\"").unwrap());
        let t = r.to_text();
        assert!(t.contains("vol-1") && t.contains("1.0Gi") && t.contains("a=1,b=2"));

        let g = csi::ControllerGetVolumeResponse {
            volume: Some(volume()),
            status: Some(csi::controller_get_volume_response::VolumeStatus {
                published_node_ids: vec!["n1".into()],
                volume_condition: Some(csi::VolumeCondition {
                    abnormal: true,
                    message: "device gone".into(),
                }),
            }),
        };
        let j = g.to_json();
        assert_eq!(j["status"]["published_node_ids"], json!(["n1"]));
        assert_eq!(
            j["status"]["volume_condition"],
            json!({"abnormal": true, "message": "device gone"})
        );
        assert!(g.to_text().contains("ABNORMAL: device gone"));
    }

    #[test]
    fn list_volumes_json() {
        let r = csi::ListVolumesResponse {
            entries: vec![csi::list_volumes_response::Entry {
                volume: Some(csi::Volume {
                    volume_id: "v".into(),
                    capacity_bytes: 5,
                    ..Default::default()
                }),
                status: None,
            }],
            next_token: "2".into(),
        };
        assert_eq!(
            r.to_json(),
            json!({"entries": [{"volume": {
                "capacity_bytes": 5, "volume_id": "v", "volume_context": {},
                "content_source": null, "accessible_topology": []}, "status": null}],
                "next_token": "2"})
        );
        let t = r.to_text();
        assert!(t.starts_with("VOLUME_ID"), "{t}");
        assert!(t.contains("next_token: 2"));
    }

    #[test]
    fn controller_misc_json() {
        assert_eq!(
            csi::GetCapacityResponse {
                available_capacity: 10,
                maximum_volume_size: Some(8),
                minimum_volume_size: None
            }
            .to_json(),
            json!({"available_capacity": 10, "maximum_volume_size": 8, "minimum_volume_size": null})
        );
        use csi::controller_service_capability::{Rpc, Type, rpc};
        let caps = csi::ControllerGetCapabilitiesResponse {
            capabilities: vec![csi::ControllerServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: rpc::Type::CreateDeleteVolume as i32,
                })),
            }],
        };
        assert_eq!(
            caps.to_json(),
            json!({"capabilities": [{"rpc": {"type": "CREATE_DELETE_VOLUME"}}]})
        );
        assert_eq!(caps.to_text(), "rpc CREATE_DELETE_VOLUME\n");
        assert_eq!(
            csi::ControllerExpandVolumeResponse {
                capacity_bytes: 2 << 30,
                node_expansion_required: true
            }
            .to_json(),
            json!({"capacity_bytes": 2147483648i64, "node_expansion_required": true})
        );
        assert_eq!(
            csi::ControllerPublishVolumeResponse {
                publish_context: hm(&[("dev", "/dev/x")])
            }
            .to_json(),
            json!({"publish_context": {"dev": "/dev/x"}})
        );
        let v = csi::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                volume_context: HashMap::new(),
                volume_capabilities: vec![
                    mount_cap(),
                    csi::VolumeCapability {
                        access_type: Some(AccessType::Block(Default::default())),
                        access_mode: Some(AccessMode {
                            mode: Mode::MultiNodeReaderOnly as i32,
                        }),
                    },
                ],
                parameters: hm(&[("p", "1")]),
                mutable_parameters: HashMap::new(),
            }),
            message: String::new(),
        };
        assert_eq!(
            v.to_json(),
            json!({"confirmed": {
                "volume_context": {},
                "volume_capabilities": [
                    {"mount": {"fs_type": "ext4", "mount_flags": ["noatime"], "volume_mount_group": "",
                               "volume_supplemental_group": "100",
                               "volume_supplemental_group_change_policy": "OnRootMismatch"},
                     "access_mode": {"mode": "SINGLE_NODE_WRITER"}},
                    {"block": {}, "access_mode": {"mode": "MULTI_NODE_READER_ONLY"}},
                ],
                "parameters": {"p": "1"},
                "mutable_parameters": {},
            }, "message": ""})
        );
        assert!(v.to_text().contains("block MULTI_NODE_READER_ONLY"));
        let no = csi::ValidateVolumeCapabilitiesResponse {
            confirmed: None,
            message: "xfs unsupported".into(),
        };
        assert_eq!(
            no.to_json(),
            json!({"confirmed": null, "message": "xfs unsupported"})
        );
    }

    #[test]
    fn snapshots_json() {
        let s = csi::Snapshot {
            size_bytes: 1024,
            snapshot_id: "s1".into(),
            source_volume_id: "v1".into(),
            creation_time: Some(prost_types::Timestamp {
                seconds: 0,
                nanos: 0,
            }),
            ready_to_use: true,
            group_snapshot_id: String::new(),
            accessible_topology: vec![],
        };
        let j = csi::CreateSnapshotResponse {
            snapshot: Some(s.clone()),
        }
        .to_json();
        assert_eq!(
            j,
            json!({"snapshot": {"size_bytes": 1024, "snapshot_id": "s1", "source_volume_id": "v1",
            "creation_time": "1970-01-01T00:00:00Z", "ready_to_use": true, "group_snapshot_id": ""}})
        );
        assert_eq!(
            csi::GetSnapshotResponse {
                snapshot: Some(s.clone())
            }
            .to_json(),
            j
        );
        let l = csi::ListSnapshotsResponse {
            entries: vec![csi::list_snapshots_response::Entry { snapshot: Some(s) }],
            next_token: String::new(),
        };
        assert_eq!(l.to_json()["entries"][0], j);
        assert!(l.to_text().contains("s1"));
    }

    #[test]
    fn node_json() {
        use csi::volume_usage::Unit;
        let st = csi::NodeGetVolumeStatsResponse {
            usage: vec![
                csi::VolumeUsage {
                    available: 3,
                    total: 10,
                    used: 7,
                    unit: Unit::Bytes as i32,
                },
                csi::VolumeUsage {
                    available: 1,
                    total: 2,
                    used: 1,
                    unit: Unit::Inodes as i32,
                },
            ],
            volume_condition: Some(csi::VolumeCondition {
                abnormal: false,
                message: "ok".into(),
            }),
        };
        assert_eq!(
            st.to_json(),
            json!({"usage": [
                {"available": 3, "total": 10, "used": 7, "unit": "BYTES"},
                {"available": 1, "total": 2, "used": 1, "unit": "INODES"},
            ], "volume_condition": {"abnormal": false, "message": "ok"}})
        );
        let t = st.to_text();
        assert!(t.contains("BYTES") && t.contains("INODES") && t.contains("normal: ok"));

        use csi::node_service_capability::{Rpc, Type, rpc};
        let caps = csi::NodeGetCapabilitiesResponse {
            capabilities: [
                rpc::Type::StageUnstageVolume,
                rpc::Type::DeferFsOps,
                rpc::Type::DeferFsOpsWithSupplementalGroupChangePolicy,
            ]
            .into_iter()
            .map(|t| csi::NodeServiceCapability {
                r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })),
            })
            .collect(),
        };
        assert_eq!(
            caps.to_json(),
            json!({"capabilities": [
                {"rpc": {"type": "STAGE_UNSTAGE_VOLUME"}},
                {"rpc": {"type": "DEFER_FS_OPS"}},
                {"rpc": {"type": "DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY"}},
            ]})
        );
        let info = csi::NodeGetInfoResponse {
            node_id: "n1".into(),
            max_volumes_per_node: 0,
            accessible_topology: Some(topo("zone", "a")),
            supported_file_systems: vec!["ext4".into(), "xfs".into()],
        };
        assert_eq!(
            info.to_json(),
            json!({"node_id": "n1", "max_volumes_per_node": 0,
                   "accessible_topology": {"segments": {"zone": "a"}},
                   "supported_file_systems": ["ext4", "xfs"]})
        );
        assert!(info.to_text().contains("supported_file_systems: ext4,xfs"));
        assert!(info.to_text().contains("unlimited"));
        assert_eq!(
            csi::NodeExpandVolumeResponse { capacity_bytes: 9 }.to_json(),
            json!({"capacity_bytes": 9})
        );
        assert_eq!(csi::NodePublishVolumeResponse {}.to_json(), json!({}));
        assert_eq!(csi::DeleteVolumeResponse {}.to_text(), "");
    }
}
