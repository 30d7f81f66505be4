//! OCI bundle parsing: the parts of `config.json` a VM runtime without a
//! shared root filesystem can honour (process args/env/cwd/user, mounts).
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
}

impl Bundle {
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
        Ok(Bundle {
            dir: dir.to_path_buf(),
            args,
            env,
            cwd,
            uid: user.uid(),
            gid: user.gid(),
            additional_gids: user.additional_gids().clone().unwrap_or_default(),
            mounts,
        })
    }
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
