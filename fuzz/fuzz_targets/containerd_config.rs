//! The node installer's edit of the host's containerd config
//! (crust-node-install `containerd::RootConfig`), as `plan_root` does it.
//! The file is the node's, written by whoever: invariants are no panic;
//! an edit keeps valid TOML that parses back; adding the runtime or the
//! import twice equals once (idempotent); every top-level key of the
//! original survives; removing what was added finds it.
#![no_main]

use std::path::{Path, PathBuf};

use crust_node_install::Version;
use crust_node_install::containerd::{Handler, RootConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("/etc/containerd/config.toml");
    let Ok(cfg) = RootConfig::parse(path, text) else {
        return;
    };
    let Ok(version) = cfg.version() else { return };
    let keys = |c: &RootConfig| -> Vec<String> {
        let t: toml_edit::DocumentMut = c.render().parse().expect("rendered TOML parses");
        t.as_table().iter().map(|(k, _)| k.to_string()).collect()
    };
    let before = keys(&cfg);
    let handler = Handler {
        name: "crust".into(),
        shim: PathBuf::from("/opt/crust/bin/containerd-shim-crust-v2"),
    };
    let dropin = Path::new("/etc/containerd/conf.d/crust.toml");
    if version == Version::V2 && cfg.has_cri_section(version) {
        let mut once = RootConfig::parse(path, text).unwrap();
        if once.add_runtime(&handler, version).is_err() {
            return;
        }
        let rendered = once.render();
        let mut twice = RootConfig::parse(path, &rendered).expect("the edit parses back");
        twice.add_runtime(&handler, version).expect("a second add works");
        assert_eq!(twice.render(), rendered, "adding twice equals once");
        for k in &before {
            assert!(keys(&once).contains(k), "key {k} lost");
        }
        assert!(once.remove_runtime("crust", version), "the added runtime is found");
    } else {
        let mut once = RootConfig::parse(path, text).unwrap();
        let Ok(already) = once.imports_file(dropin) else {
            return;
        };
        if already {
            return;
        }
        if once.add_import(dropin).is_err() {
            return;
        }
        let rendered = once.render();
        let again = RootConfig::parse(path, &rendered).expect("the edit parses back");
        assert!(again.imports_file(dropin).unwrap(), "the import is there");
        for k in &before {
            assert!(keys(&again).contains(k), "key {k} lost");
        }
        let mut back = again;
        assert!(back.remove_import(dropin).unwrap(), "the added import is found");
    }
});
