//! containerd configuration for the `crust` runtime handler: the drop-in
//! file in both config formats, and the one edit of the root config that
//! makes containerd read it.
//!
//! Facts this follows (containerd's own loader, `LoadConfigWithPlugins`):
//! * the root config (`/etc/containerd/config.toml`) lists drop-ins in a
//!   top-level `imports` array (absolute paths or globs; relative ones are
//!   relative to the root config's directory);
//! * a drop-in may not have a higher `version` than the root config
//!   (containerd 2.x refuses to start), and a lower one is migrated on
//!   load: so the drop-in takes the root config's version;
//! * version 2 (containerd 1.x, also read by 2.x) names the CRI runtimes
//!   `plugins."io.containerd.grpc.v1.cri".containerd.runtimes.<handler>`,
//!   version 3 (containerd 2.x) `plugins."io.containerd.cri.v1.runtime"
//!   .containerd.runtimes.<handler>`; both take `runtime_type`,
//!   `runtime_path` (1.6 and later) and `privileged_without_host_devices`;
//! * containerd 1.x replaces a whole plugin section with an imported
//!   file's (2.x merges them): a version-2 root config that has its own
//!   CRI section (nearly every Kubernetes node's) gets the runtime table
//!   inline instead of through a drop-in, which would erase the node's
//!   CRI settings; `config dump` of Debian's containerd 1.6 in the tests
//!   shows both outcomes;
//! * without a root config containerd runs on defaults; a root config
//!   created here keeps 2.2's default `imports` of
//!   `/etc/containerd/conf.d/*.toml`, so other drop-ins still load.

use std::path::{Path, PathBuf};

use toml_edit::{Array, DocumentMut, Item, Table, value};

/// containerd's runtime type of the crust shim (`containerd-shim-crust-v2`).
pub const RUNTIME_TYPE: &str = "io.containerd.crust.v2";
/// Where containerd 2.2 looks for drop-ins by default.
pub const DEFAULT_IMPORTS: &str = "/etc/containerd/conf.d/*.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Where, never what: the parser's own message quotes the offending
    /// line, which in a mistaken or hostile config may be a secret.
    #[error("{path}: not valid TOML at line {line}, column {column} (content not shown)")]
    Parse {
        path: PathBuf,
        line: usize,
        column: usize,
    },
    #[error(
        "{path}: containerd config version {version} is not supported (2 for containerd 1.x, \
         3 for 2.x); migrate it with `containerd config migrate`"
    )]
    Version { path: PathBuf, version: i64 },
    #[error("{path}: `imports` must be an array of strings")]
    Imports { path: PathBuf },
    #[error("{path}: `{key}` must be a table to hold the crust runtime (content not shown)")]
    NotATable { path: PathBuf, key: String },
}

/// The config format of a containerd root config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Version {
    /// `version = 2`: containerd 1.x (2.x migrates it on load).
    V2,
    /// `version = 3`: containerd 2.x.
    V3,
}

impl Version {
    pub fn number(self) -> i64 {
        match self {
            Version::V2 => 2,
            Version::V3 => 3,
        }
    }

    /// The CRI plugin's table holding `containerd.runtimes`.
    pub fn cri_plugin(self) -> &'static str {
        match self {
            Version::V2 => "io.containerd.grpc.v1.cri",
            Version::V3 => "io.containerd.cri.v1.runtime",
        }
    }
}

/// What the drop-in declares.
#[derive(Debug, Clone)]
pub struct Handler {
    /// RuntimeClass handler name (`crust`).
    pub name: String,
    /// Absolute host path of `containerd-shim-crust-v2`.
    pub shim: PathBuf,
}

/// The handler's runtime table (the same in both versions).
fn runtime_table(handler: &Handler) -> Table {
    let mut rt = Table::new();
    rt["runtime_type"] = value(RUNTIME_TYPE);
    rt["runtime_path"] = value(handler.shim.to_string_lossy().as_ref());
    // A privileged pod's host devices must not be passed into its VM.
    rt["privileged_without_host_devices"] = value(true);
    // The pod's own settings for crust (memory-bytes, anti-spoofing):
    // containerd hands a runtime only the pod annotations listed here.
    let mut annotations = Array::new();
    annotations.push("io.crust.*");
    rt["pod_annotations"] = value(annotations);
    rt
}

/// The drop-in for `handler`, in the format of `version`.
pub fn render_dropin(handler: &Handler, version: Version) -> String {
    let mut doc = DocumentMut::new();
    doc["version"] = value(version.number());
    let rt = runtime_table(handler);
    let mut runtimes = Table::new();
    runtimes.set_implicit(true);
    runtimes.insert(&handler.name, Item::Table(rt));
    let mut containerd = Table::new();
    containerd.set_implicit(true);
    containerd.insert("runtimes", Item::Table(runtimes));
    let mut cri = Table::new();
    cri.set_implicit(true);
    cri.insert("containerd", Item::Table(containerd));
    let mut plugins = Table::new();
    plugins.set_implicit(true);
    plugins.insert(version.cri_plugin(), Item::Table(cri));
    doc.insert("plugins", Item::Table(plugins));
    format!("# Written by crust-node-install; removed by `crust-node-install uninstall`.\n{doc}")
}

/// A parsed root config.
pub struct RootConfig {
    path: PathBuf,
    doc: DocumentMut,
}

impl RootConfig {
    /// Parses `text` read from `path` (host path, for messages and for
    /// resolving relative imports).
    pub fn parse(path: &Path, text: &str) -> Result<RootConfig, ConfigError> {
        let doc = text.parse::<DocumentMut>().map_err(|e| {
            let (line, column) = line_column(text, e.span().map_or(0, |s| s.start));
            ConfigError::Parse {
                path: path.to_path_buf(),
                line,
                column,
            }
        })?;
        Ok(RootConfig {
            path: path.to_path_buf(),
            doc,
        })
    }

    /// The config's format; a config without `version` is version 1.
    pub fn version(&self) -> Result<Version, ConfigError> {
        let v = self
            .doc
            .get("version")
            .and_then(Item::as_integer)
            .unwrap_or(1);
        match v {
            2 => Ok(Version::V2),
            3 => Ok(Version::V3),
            other => Err(ConfigError::Version {
                path: self.path.clone(),
                version: other,
            }),
        }
    }

    fn imports(&self) -> Result<Vec<String>, ConfigError> {
        let bad = || ConfigError::Imports {
            path: self.path.clone(),
        };
        match self.doc.get("imports") {
            None => Ok(Vec::new()),
            Some(item) => item
                .as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|v| v.as_str().map(str::to_string).ok_or_else(bad))
                .collect(),
        }
    }

    /// Whether containerd reads `dropin` through this config's `imports`.
    pub fn imports_file(&self, dropin: &Path) -> Result<bool, ConfigError> {
        let dir = self.path.parent().unwrap_or(Path::new("/"));
        Ok(self.imports()?.iter().any(|i| {
            let p = if Path::new(i).is_absolute() {
                PathBuf::from(i)
            } else {
                dir.join(i)
            };
            glob_match(&p.to_string_lossy(), &dropin.to_string_lossy())
        }))
    }

    /// Appends `dropin` to `imports` (created when missing).
    pub fn add_import(&mut self, dropin: &Path) -> Result<(), ConfigError> {
        self.imports()?;
        let entry = dropin.to_string_lossy().into_owned();
        match self.doc.get_mut("imports").and_then(Item::as_array_mut) {
            Some(a) => a.push(entry),
            None => {
                let mut a = Array::new();
                a.push(entry);
                self.doc["imports"] = value(a);
            }
        }
        Ok(())
    }

    /// Removes `dropin` from `imports` (the entry [`RootConfig::add_import`]
    /// added); drops an `imports` left empty.
    pub fn remove_import(&mut self, dropin: &Path) -> Result<bool, ConfigError> {
        self.imports()?;
        let entry = dropin.to_string_lossy();
        let Some(a) = self.doc.get_mut("imports").and_then(Item::as_array_mut) else {
            return Ok(false);
        };
        let before = a.len();
        a.retain(|v| v.as_str() != Some(entry.as_ref()));
        let removed = a.len() != before;
        if a.is_empty() {
            self.doc.remove("imports");
        }
        Ok(removed)
    }

    /// Whether the config has its own table for the CRI plugin of
    /// `version`. containerd 1.x replaces a whole plugin section with an
    /// imported file's (`mergeConfig`: "Replace entire sections instead of
    /// merging map's values"; 2.0 merges them), so a version-2 config with
    /// such a table must get the runtime inline: a drop-in would erase the
    /// node's CRI settings (sandbox image, runc, registries...).
    pub fn has_cri_section(&self, version: Version) -> bool {
        self.doc
            .get("plugins")
            .and_then(|p| p.get(version.cri_plugin()))
            .is_some()
    }

    /// Adds the handler's runtime table to this config's CRI section. A
    /// key on the way that holds something other than a table is refused
    /// (and nothing changes): the config is the node's, not ours to fix.
    pub fn add_runtime(&mut self, handler: &Handler, version: Version) -> Result<(), ConfigError> {
        let mut at: Option<&Item> = Some(self.doc.as_item());
        let mut key = String::new();
        for k in ["plugins", version.cri_plugin(), "containerd", "runtimes"] {
            key = if key.is_empty() {
                k.to_string()
            } else {
                format!("{key}.{k}")
            };
            at = at.and_then(|i| i.get(k));
            if let Some(i) = at
                && i.as_table_like().is_none()
            {
                return Err(ConfigError::NotATable {
                    path: self.path.clone(),
                    key,
                });
            }
        }
        let rt = &mut self.doc["plugins"][version.cri_plugin()]["containerd"]["runtimes"];
        if let Some(t) = rt.as_table_mut() {
            t.set_implicit(true);
        }
        rt[handler.name.as_str()] = Item::Table(runtime_table(handler));
        Ok(())
    }

    /// Removes the handler's runtime table added by [`RootConfig::add_runtime`].
    pub fn remove_runtime(&mut self, name: &str, version: Version) -> bool {
        self.doc
            .get_mut("plugins")
            .and_then(|p| p.get_mut(version.cri_plugin()))
            .and_then(|c| c.get_mut("containerd"))
            .and_then(|c| c.get_mut("runtimes"))
            .and_then(Item::as_table_like_mut)
            .is_some_and(|t| t.remove(name).is_some())
    }

    pub fn render(&self) -> String {
        self.doc.to_string()
    }
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (
        before.matches('\n').count() + 1,
        before[line_start..].chars().count() + 1,
    )
}

/// The root config written where none exists: version 2 (read by
/// containerd 1.x and 2.x alike) importing the default drop-in directory.
pub fn new_root_config(imports: &[&Path]) -> String {
    let mut doc = DocumentMut::new();
    doc["version"] = value(2);
    let mut a = Array::new();
    for i in imports {
        a.push(i.to_string_lossy().as_ref());
    }
    doc["imports"] = value(a);
    format!("# Written by crust-node-install (no containerd config existed).\n{doc}")
}

/// Go `filepath.Match` semantics for the patterns containerd globs:
/// `*` matches any run of non-`/` characters, `?` one of them.
pub fn glob_match(pattern: &str, path: &str) -> bool {
    fn seg(p: &[u8], s: &[u8]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(b'*'), _) => seg(&p[1..], s) || (!s.is_empty() && seg(p, &s[1..])),
            (Some(b'?'), Some(_)) => seg(&p[1..], &s[1..]),
            (Some(a), Some(b)) if a == b => seg(&p[1..], &s[1..]),
            _ => false,
        }
    }
    let (ps, ss): (Vec<&str>, Vec<&str>) =
        (pattern.split('/').collect(), path.split('/').collect());
    ps.len() == ss.len()
        && ps
            .iter()
            .zip(&ss)
            .all(|(p, s)| seg(p.as_bytes(), s.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handler() -> Handler {
        Handler {
            name: "crust".into(),
            shim: "/opt/crust/bin/containerd-shim-crust-v2".into(),
        }
    }

    #[test]
    fn dropins_name_the_cri_plugin_of_each_version() {
        for (v, plugin) in [
            (Version::V2, "io.containerd.grpc.v1.cri"),
            (Version::V3, "io.containerd.cri.v1.runtime"),
        ] {
            let text = render_dropin(&handler(), v);
            let doc: DocumentMut = text.parse().unwrap();
            assert_eq!(doc["version"].as_integer(), Some(v.number()));
            let rt = &doc["plugins"][plugin]["containerd"]["runtimes"]["crust"];
            assert_eq!(rt["runtime_type"].as_str(), Some(RUNTIME_TYPE));
            assert_eq!(
                rt["runtime_path"].as_str(),
                Some("/opt/crust/bin/containerd-shim-crust-v2")
            );
            assert_eq!(rt["privileged_without_host_devices"].as_bool(), Some(true));
            // The pod's io.crust.* annotations reach crust.
            let listed: Vec<&str> = rt["pod_annotations"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|v| v.as_str())
                .collect();
            assert_eq!(listed, ["io.crust.*"], "{text}");
            assert_eq!(doc["plugins"].as_table().unwrap().len(), 1, "{text}");
        }
    }

    #[test]
    fn versions_and_imports() {
        let p = Path::new("/etc/containerd/config.toml");
        let d = Path::new("/etc/containerd/conf.d/crust.toml");
        let c = RootConfig::parse(p, "version = 3\nimports = [\"conf.d/*.toml\"]\n").unwrap();
        assert_eq!(c.version().unwrap(), Version::V3);
        assert!(c.imports_file(d).unwrap(), "relative glob");
        let c = RootConfig::parse(p, "root = \"/x\"\n").unwrap();
        assert!(matches!(
            c.version(),
            Err(ConfigError::Version { version: 1, .. })
        ));
        let text =
            "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"p\"\n";
        let mut c = RootConfig::parse(p, text).unwrap();
        assert!(!c.imports_file(d).unwrap());
        c.add_import(d).unwrap();
        let edited = c.render();
        let mut back = RootConfig::parse(p, &edited).unwrap();
        assert!(back.imports_file(d).unwrap());
        assert_eq!(
            back.doc["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"].as_str(),
            Some("p")
        );
        assert!(back.remove_import(d).unwrap());
        assert_eq!(back.render(), text, "the edit is undone byte for byte");
        assert!(
            RootConfig::parse(p, "imports = 3\nversion = 2")
                .unwrap()
                .imports_file(d)
                .is_err()
        );
        assert!(RootConfig::parse(p, "version = [").is_err());
        let secret = "version = 2\nroot:$6$s3cr3tHash:19000:0:99999:7:::\n";
        let e = RootConfig::parse(p, secret).err().unwrap();
        assert!(matches!(e, ConfigError::Parse { line: 2, .. }), "{e:?}");
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
    }

    #[test]
    fn inline_runtime_round_trip() {
        let p = Path::new("/etc/containerd/config.toml");
        let text =
            "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"p\"\n";
        let mut c = RootConfig::parse(p, text).unwrap();
        assert!(c.has_cri_section(Version::V2) && !c.has_cri_section(Version::V3));
        c.add_runtime(&handler(), Version::V2).unwrap();
        let doc: DocumentMut = c.render().parse().unwrap();
        let cri = &doc["plugins"]["io.containerd.grpc.v1.cri"];
        assert_eq!(cri["sandbox_image"].as_str(), Some("p"));
        assert_eq!(
            cri["containerd"]["runtimes"]["crust"]["runtime_type"].as_str(),
            Some(RUNTIME_TYPE)
        );
        assert!(c.remove_runtime("crust", Version::V2));
        assert!(!c.remove_runtime("crust", Version::V2));
    }

    /// A key on the way that is not a table (toml_edit's indexing panicked
    /// on it; found while writing the containerd_config fuzz target) is
    /// refused, naming it, and the config is unchanged.
    #[test]
    fn a_non_table_on_the_way_is_refused_not_a_panic() {
        let p = Path::new("/etc/containerd/config.toml");
        for (text, key) in [
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\ncontainerd = 1\n",
                "containerd",
            ),
            (
                "version = 2\nplugins = { \"io.containerd.grpc.v1.cri\" = \"x\" }\n",
                "grpc.v1.cri",
            ),
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\nruntimes = [1]\n",
                "runtimes",
            ),
        ] {
            let mut c = RootConfig::parse(p, text).unwrap();
            let e = c
                .add_runtime(&handler(), Version::V2)
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains("must be a table"), "{e}");
            assert_eq!(c.render(), text);
        }
    }

    #[test]
    fn globs_follow_go_filepath_match() {
        assert!(glob_match(
            "/etc/containerd/conf.d/*.toml",
            "/etc/containerd/conf.d/crust.toml"
        ));
        assert!(glob_match("/a/?.toml", "/a/b.toml"));
        assert!(!glob_match("/etc/*.toml", "/etc/containerd/crust.toml"));
        assert!(!glob_match(
            "/etc/containerd/conf.d/*.toml",
            "/etc/containerd/conf.d/crust.conf"
        ));
        assert!(glob_match("/x/crust.toml", "/x/crust.toml"));
    }
}
