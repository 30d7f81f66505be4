//! OCI bundle parsing: the parts of `config.json` a VM runtime without a
//! shared root filesystem can honour (process args/env/cwd/user, mounts,
//! the network namespace).
//! The guest brings its own root filesystem, so `root.path` is not used.

use std::path::{Path, PathBuf};

use crust_handoff::validate::check_abs_path;
use oci_spec::runtime::Spec;
use serde::{Deserialize, Serialize};

/// Largest `config.json` read (a real one is a few KiB).
const MAX_CONFIG_SIZE: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("bundle {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("bundle {path}: config.json is not a valid OCI runtime spec: {reason}")]
    Parse { path: String, reason: String },
    #[error("bundle {path}: {reason}")]
    Invalid { path: String, reason: String },
}

/// One OCI mount, reduced to what the runtime looks at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleMount {
    pub destination: String,
    pub source: Option<String>,
    #[serde(rename = "type")]
    pub typ: Option<String>,
    pub options: Vec<String>,
}

impl BundleMount {
    /// A mount whose source names a host path (a bind mount, or anything
    /// whose source contains a slash); `proc`, `tmpfs`, ... are not.
    pub fn source_is_path(&self) -> bool {
        let bind_type = matches!(self.typ.as_deref(), None | Some("bind") | Some("none"));
        let bind_opt = self.options.iter().any(|o| o == "bind" || o == "rbind");
        let slashy = self.source.as_deref().is_some_and(|s| s.contains('/'));
        (bind_type || bind_opt || slashy) && self.source.is_some()
    }

    pub fn readonly(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }
}

/// Annotations carrying the uid of the pod a container belongs to:
/// containerd's CRI plugin sets the first; kubelet's pod-uid label, which
/// CRI-O (inside [`CRIO_LABELS_ANNOTATION`]) and crustctl pass, is the second.
pub const POD_UID_ANNOTATIONS: [&str; 2] =
    ["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"];
/// CRI-O's JSON map of the container's labels (holds `io.kubernetes.pod.uid`).
pub const CRIO_LABELS_ANNOTATION: &str = "io.kubernetes.cri-o.Labels";
/// Longest pod uid accepted (kubelet's are 36-character UUIDs).
const MAX_POD_UID: usize = 128;

/// The process and mounts of an OCI bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bundle {
    /// Absolute bundle directory.
    pub dir: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
    pub mounts: Vec<BundleMount>,
    /// The pod's uid from the annotations (see [`POD_UID_ANNOTATIONS`]),
    /// when the bundle names one: its deferred volumes must then lie in
    /// that pod's kubelet volumes directory.
    #[serde(default)]
    pub pod_uid: Option<String>,
    /// The OCI annotation `io.crust.defer-fs-ops: required`: a volume
    /// crust-csi published on the host must be handed over; a decline
    /// fails the container instead of falling back to the host mount.
    #[serde(default)]
    pub defer_required: bool,
    /// The process as the guest runs it (capabilities, rlimits,
    /// noNewPrivileges, ...), read as the containerd door reads a
    /// container's ([`crate::spec::process_spec`]).
    pub process: crust_agent_proto::ProcessSpec,
    /// `linux.seccomp`, enforced by the agent as for the containerd door's
    /// containers.
    #[serde(default)]
    pub seccomp: Option<crust_agent_proto::Seccomp>,
    /// The spec asks for a user namespace: likewise only the shim's
    /// containers have one.
    #[serde(default)]
    pub user_namespace: bool,
    /// The host block devices of `linux.devices`: only the shim's
    /// containers get them (through the raw-device plug routine).
    #[serde(default)]
    pub devices: Vec<String>,
    /// The network namespace `linux.namespaces` names (CNI's): its
    /// interfaces go into the guest ([`crate::net`]). None: the guest has
    /// `lo` only.
    #[serde(default)]
    pub network_namespace: Option<String>,
    /// The bundle's `io.crust.network.anti-spoofing` is `off`.
    #[serde(default)]
    pub anti_spoofing_off: bool,
}

impl Bundle {
    /// What the CLI's workload cannot have yet (a user namespace, host
    /// devices): refused, since a mapping or device ignored would read as
    /// honoured.
    pub fn refuse_unsupported(&self) -> Result<(), BundleError> {
        if self.user_namespace {
            return Err(BundleError::Invalid {
                path: self.dir.display().to_string(),
                reason: "linux.namespaces: the crust-runtime CLI's workload has no user namespace; run it through containerd-shim-crust-v2".into(),
            });
        }
        if !self.devices.is_empty() {
            return Err(BundleError::Invalid {
                path: self.dir.display().to_string(),
                reason: format!(
                    "linux.devices ({}): the crust-runtime CLI's workload gets no host device; run it through containerd-shim-crust-v2, which plugs them held exclusively",
                    self.devices.join(", ")
                ),
            });
        }
        Ok(())
    }

    /// Reads and validates `<dir>/config.json`. `dir` must be absolute.
    pub fn load(dir: &Path) -> Result<Bundle, BundleError> {
        let shown = dir.display().to_string();
        let invalid = |reason: String| BundleError::Invalid {
            path: shown.clone(),
            reason,
        };
        if !dir.is_absolute() {
            return Err(invalid(
                "the bundle directory must be an absolute path".into(),
            ));
        }
        let config = dir.join("config.json");
        let meta = std::fs::metadata(&config).map_err(|source| BundleError::Io {
            path: config.display().to_string(),
            source,
        })?;
        if !meta.is_file() {
            return Err(invalid("config.json is not a regular file".into()));
        }
        if meta.len() > MAX_CONFIG_SIZE {
            return Err(invalid(format!(
                "config.json is larger than {MAX_CONFIG_SIZE} bytes"
            )));
        }
        let bytes = std::fs::read(&config).map_err(|source| BundleError::Io {
            path: config.display().to_string(),
            source,
        })?;
        Bundle::parse(dir, &bytes)
    }

    /// Parses a `config.json` body for the bundle at `dir`.
    pub fn parse(dir: &Path, bytes: &[u8]) -> Result<Bundle, BundleError> {
        let shown = dir.display().to_string();
        let invalid = |reason: String| BundleError::Invalid {
            path: shown.clone(),
            reason,
        };
        let spec: Spec = serde_json::from_slice(bytes).map_err(|e| BundleError::Parse {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        let process = spec
            .process()
            .as_ref()
            .ok_or_else(|| invalid("config.json has no process".into()))?;
        let args = process.args().clone().unwrap_or_default();
        if args.is_empty() || args[0].is_empty() {
            return Err(invalid("process.args is empty".into()));
        }
        let env = process.env().clone().unwrap_or_default();
        if let Some(bad) = env.iter().find(|e| !e.contains('=') || e.starts_with('=')) {
            return Err(invalid(format!(
                "process.env entry {bad:?} is not NAME=VALUE"
            )));
        }
        let cwd = process.cwd().to_str().unwrap_or("").to_string();
        if cwd != "/" {
            check_abs_path("process.cwd", &cwd).map_err(invalid)?;
        }
        let user = process.user();
        let mut mounts = Vec::new();
        for m in spec.mounts().as_deref().unwrap_or_default() {
            let destination = m
                .destination()
                .to_str()
                .ok_or_else(|| invalid("a mount destination is not UTF-8".into()))?
                .to_string();
            check_abs_path("mount destination", &destination).map_err(invalid)?;
            let source = match m.source() {
                Some(s) => Some(
                    s.to_str()
                        .ok_or_else(|| {
                            invalid(format!("the source of mount {destination} is not UTF-8"))
                        })?
                        .to_string(),
                ),
                None => None,
            };
            let mount = BundleMount {
                destination,
                source,
                typ: m.typ().clone(),
                options: m.options().clone().unwrap_or_default(),
            };
            // A relative or traversing host path could be steered by
            // whoever controls the working directory or a symlink: refuse.
            if mount.source_is_path() {
                let src = mount.source.as_deref().unwrap_or_default();
                check_abs_path("mount source", src)
                    .map_err(|r| invalid(format!("mount {}: {r}", mount.destination)))?;
            }
            mounts.push(mount);
        }
        let pod_uid = pod_uid(spec.annotations().as_ref()).map_err(invalid)?;
        let defer_required = spec.annotations().as_ref().is_some_and(|a| {
            a.get(crate::records::DEFER_ANNOTATION).map(String::as_str) == Some("required")
        });
        let network_namespace = match crate::net::PodNetworkSpec::of(&spec).map_err(invalid)? {
            crate::net::PodNetworkSpec::Namespace(p) => Some(p),
            crate::net::PodNetworkSpec::Host | crate::net::PodNetworkSpec::Empty => None,
        };
        let anti_spoofing =
            crate::net::anti_spoofing(&spec.annotations().clone().unwrap_or_default())
                .map_err(invalid)?;
        let linux = spec.linux().as_ref();
        Ok(Bundle {
            dir: dir.to_path_buf(),
            args,
            env,
            cwd,
            uid: user.uid(),
            gid: user.gid(),
            additional_gids: user.additional_gids().clone().unwrap_or_default(),
            mounts,
            pod_uid,
            defer_required,
            process: crate::spec::process_spec(process),
            seccomp: linux
                .and_then(|l| l.seccomp().as_ref())
                .map(crate::spec::seccomp)
                .transpose()
                .map_err(invalid)?,
            user_namespace: linux.is_some_and(|l| {
                l.namespaces()
                    .iter()
                    .flatten()
                    .any(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::User)
            }),
            devices: linux.map(host_devices).unwrap_or_default(),
            network_namespace,
            anti_spoofing_off: anti_spoofing == crust_podnet::AntiSpoof::Off,
        })
    }
}

/// The host devices of `linux.devices`, as errors name them.
fn host_devices(linux: &oci_spec::runtime::Linux) -> Vec<String> {
    linux
        .devices()
        .iter()
        .flatten()
        .map(|d| format!("{} ({}:{})", d.path().display(), d.major(), d.minor()))
        .collect()
}

/// A bundle of `/bin/true` with `mounts` and nothing else, for unit tests.
#[cfg(test)]
pub(crate) fn for_tests(mounts: Vec<BundleMount>) -> Bundle {
    Bundle {
        dir: "/b".into(),
        args: vec!["/bin/true".into()],
        env: vec![],
        cwd: "/".into(),
        uid: 0,
        gid: 0,
        additional_gids: vec![],
        process: crust_agent_proto::ProcessSpec {
            args: vec!["/bin/true".into()],
            cwd: Some("/".into()),
            ..Default::default()
        },
        mounts,
        pod_uid: None,
        defer_required: false,
        seccomp: None,
        user_namespace: false,
        devices: Vec::new(),
        network_namespace: None,
        anti_spoofing_off: false,
    }
}

/// The pod uid every annotation naming one agrees on. Two that disagree
/// are refused: one of them was not set by the container manager.
fn pod_uid(
    annotations: Option<&std::collections::HashMap<String, String>>,
) -> Result<Option<String>, String> {
    let Some(a) = annotations else {
        return Ok(None);
    };
    let mut found: Vec<(String, String)> = POD_UID_ANNOTATIONS
        .iter()
        .filter_map(|k| a.get(*k).map(|v| (k.to_string(), v.clone())))
        .collect();
    if let Some(labels) = a.get(CRIO_LABELS_ANNOTATION) {
        let labels: std::collections::HashMap<String, serde_json::Value> =
            serde_json::from_str(labels).map_err(|e| {
                format!("annotation {CRIO_LABELS_ANNOTATION} is not a JSON object: {e}")
            })?;
        if let Some(v) = labels.get(POD_UID_ANNOTATIONS[1]) {
            let v = v.as_str().ok_or_else(|| {
                format!(
                    "annotation {CRIO_LABELS_ANNOTATION}: {} is not a string",
                    POD_UID_ANNOTATIONS[1]
                )
            })?;
            found.push((
                format!("{CRIO_LABELS_ANNOTATION}[{}]", POD_UID_ANNOTATIONS[1]),
                v.to_string(),
            ));
        }
    }
    let Some((key, uid)) = found.first().cloned() else {
        return Ok(None);
    };
    let valid = !uid.is_empty()
        && uid.len() <= MAX_POD_UID
        && uid != "."
        && uid != ".."
        && uid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid {
        return Err(format!("annotation {key}: {uid:?} is not a pod uid"));
    }
    if let Some((other_key, other)) = found.iter().find(|(_, v)| *v != uid) {
        return Err(format!(
            "annotations disagree on the pod uid: {key} says {uid:?}, {other_key} says {other:?}"
        ));
    }
    Ok(Some(uid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<Bundle, BundleError> {
        Bundle::parse(Path::new("/b"), v.to_string().as_bytes())
    }

    fn spec(mounts: serde_json::Value) -> serde_json::Value {
        json!({
            "ociVersion": "1.0.2",
            "process": {"user": {"uid": 1000, "gid": 100, "additionalGids": [5]},
                        "args": ["/bin/sh", "-c", "true"], "env": ["A=1"], "cwd": "/data"},
            "root": {"path": "rootfs"},
            "mounts": mounts,
        })
    }

    #[test]
    fn parses_process_and_mounts() {
        let b = parse(spec(json!([
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/data", "type": "bind", "source": "/var/lib/kubelet/pods/u/volumes/x/pv/mount", "options": ["rbind", "ro"]},
        ])))
        .unwrap();
        assert_eq!(b.args, ["/bin/sh", "-c", "true"]);
        assert_eq!(b.env, ["A=1"]);
        assert_eq!(b.cwd, "/data");
        assert_eq!(
            (b.uid, b.gid, b.additional_gids.as_slice()),
            (1000, 100, &[5][..])
        );
        assert_eq!(b.mounts.len(), 2);
        assert!(!b.mounts[0].source_is_path());
        assert!(b.mounts[1].source_is_path());
        assert!(b.mounts[1].readonly());
    }

    #[test]
    fn pod_uid_from_annotations() {
        let with = |a: serde_json::Value| {
            let mut s = spec(json!([]));
            s["annotations"] = a;
            parse(s)
        };
        assert_eq!(parse(spec(json!([]))).unwrap().pod_uid, None);
        assert_eq!(with(json!({"other": "x"})).unwrap().pod_uid, None);
        let uid = "0b5d2c3e-1f4a-4b6c-9d7e-8f9a0b1c2d3e";
        for a in [
            json!({"io.kubernetes.cri.sandbox-uid": uid}),
            json!({"io.kubernetes.pod.uid": uid}),
            json!({"io.kubernetes.cri.sandbox-uid": uid, "io.kubernetes.pod.uid": uid}),
            json!({"io.kubernetes.cri-o.Labels":
                format!(r#"{{"io.kubernetes.pod.uid":"{uid}","app":"x"}}"#)}),
        ] {
            assert_eq!(
                with(a.clone()).unwrap().pod_uid.as_deref(),
                Some(uid),
                "{a}"
            );
        }
        for (a, why) in [
            (
                json!({"io.kubernetes.cri.sandbox-uid": uid, "io.kubernetes.pod.uid": "victim"}),
                "disagree",
            ),
            (
                json!({"io.kubernetes.pod.uid": uid,
                       "io.kubernetes.cri-o.Labels": r#"{"io.kubernetes.pod.uid":"victim"}"#}),
                "disagree",
            ),
            (
                json!({"io.kubernetes.pod.uid": "../victim"}),
                "not a pod uid",
            ),
            (json!({"io.kubernetes.pod.uid": ".."}), "not a pod uid"),
            (
                json!({"io.kubernetes.cri.sandbox-uid": ""}),
                "not a pod uid",
            ),
            (
                json!({"io.kubernetes.cri-o.Labels": "{"}),
                "not a JSON object",
            ),
        ] {
            let e = with(a.clone()).unwrap_err().to_string();
            assert!(e.contains(why), "{a}: {e}");
        }
    }

    #[test]
    fn refuses_relative_or_traversing_sources() {
        for src in ["data/x", "/a/../b", "/a/./b", "/a//b", "/a/b/", "../x"] {
            let e = parse(spec(
                json!([{"destination": "/d", "type": "bind", "source": src}]),
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains("mount source"), "{src}: {e}");
        }
        // Bind option on an untyped mount also marks the source a path.
        let e = parse(spec(
            json!([{"destination": "/d", "source": "rel", "options": ["bind"]}]),
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("not absolute"), "{e}");
    }

    #[test]
    fn refuses_bad_process() {
        let mut s = spec(json!([]));
        s["process"]["args"] = json!([]);
        assert!(parse(s).unwrap_err().to_string().contains("process.args"));
        let mut s = spec(json!([]));
        s["process"]["cwd"] = json!("rel");
        assert!(parse(s).unwrap_err().to_string().contains("process.cwd"));
        let mut s = spec(json!([]));
        s["process"]["env"] = json!(["NOEQUALS"]);
        assert!(parse(s).unwrap_err().to_string().contains("NAME=VALUE"));
        let mut s = spec(json!([]));
        // Enforced by both doors: read as the guest takes it.
        s["linux"] = json!({"seccomp": {"defaultAction": "SCMP_ACT_ERRNO"}});
        let b = parse(s).unwrap();
        assert!(b.seccomp.is_some());
        b.refuse_unsupported().unwrap();
        let mut s = spec(json!([]));
        s["linux"] = json!({"namespaces": [{"type": "user"}],
            "uidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}]});
        let e = parse(s)
            .unwrap()
            .refuse_unsupported()
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no user namespace"), "{e}");
        // A raw device the CLI cannot hold is refused, not ignored.
        let mut s = spec(json!([]));
        s["linux"] =
            json!({"devices": [{"path": "/dev/xvda", "type": "b", "major": 7, "minor": 3}]});
        let e = parse(s)
            .unwrap()
            .refuse_unsupported()
            .unwrap_err()
            .to_string();
        assert!(e.contains("linux.devices (/dev/xvda (7:3))"), "{e}");
        let mut s = spec(json!([]));
        s.as_object_mut().unwrap().remove("process");
        assert!(parse(s).unwrap_err().to_string().contains("no process"));
        assert!(matches!(
            Bundle::parse(Path::new("/b"), b"{not json"),
            Err(BundleError::Parse { .. })
        ));
        let e = parse(spec(
            json!([{"destination": "rel", "type": "tmpfs", "source": "tmpfs"}]),
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("mount destination"), "{e}");
    }

    #[test]
    fn load_needs_absolute_dir_and_config() {
        assert!(
            Bundle::load(Path::new("rel"))
                .unwrap_err()
                .to_string()
                .contains("absolute")
        );
        let d = tempfile::tempdir().unwrap();
        assert!(matches!(
            Bundle::load(d.path()),
            Err(BundleError::Io { .. })
        ));
        std::fs::write(d.path().join("config.json"), spec(json!([])).to_string()).unwrap();
        assert_eq!(Bundle::load(d.path()).unwrap().dir, d.path());
    }
}
