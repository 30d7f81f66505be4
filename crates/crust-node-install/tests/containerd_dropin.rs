//! deploy/systemd/containerd.service.d/crust.conf, the example systemd
//! drop-in that puts the shim's settings into containerd's environment,
//! checked against the code: every variable it sets is one the shim,
//! crust-runtime or crust-csi reads (a string literal in their sources; a
//! misspelt name would be ignored silently), none is a test-only one, and
//! the values crust-csi must share (hand-off root, Handover socket) equal
//! what the DaemonSet passes crust-csi or crust-csi's default. A broken
//! copy must fail, so the check can fail. No I/O beyond reading the tree
//! (< 1 s).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const DROPIN: &str = "deploy/systemd/containerd.service.d/crust.conf";

/// Crates whose binaries run with containerd's environment, or share it.
const READERS: [&str; 6] = [
    "crust-sandbox",
    "crust-runtime",
    "crust-shim",
    "crust-vmm",
    "crust-handoff",
    "crust-csi",
];

fn root() -> PathBuf {
    crust_testkit::workspace_root()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every `"CRUST_…"` string literal in the readers' sources.
fn names_read() -> BTreeSet<String> {
    let mut files = Vec::new();
    for c in READERS {
        rust_files(&root().join("crates").join(c).join("src"), &mut files);
    }
    let mut names = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for piece in text.split('"').skip(1).step_by(2) {
            if piece.starts_with("CRUST_")
                && piece
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            {
                names.insert(piece.to_string());
            }
        }
    }
    names
}

/// `Environment=NAME=VALUE` lines (optionally quoted) of a unit file.
fn environment(unit: &str) -> Vec<(String, String)> {
    unit.lines()
        .filter_map(|l| l.trim().strip_prefix("Environment="))
        .map(|kv| {
            let kv = kv.trim_matches('"');
            let (k, v) = kv.split_once('=').expect("NAME=VALUE");
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// The value of `--flag=` among the DaemonSet's crust-csi arguments.
fn daemonset_flag(flag: &str) -> Option<String> {
    let ds = std::fs::read_to_string(root().join("deploy/kubernetes/base/csi-node.yaml")).unwrap();
    let prefix = format!("- --{flag}=");
    ds.lines()
        .find_map(|l| l.trim().strip_prefix(&prefix).map(str::to_string))
}

/// A `pub const NAME: &str = "…";` in a source file.
fn const_value(file: &str, name: &str) -> String {
    let text = std::fs::read_to_string(root().join(file)).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains(&format!("const {name}: &str")))
        .unwrap_or_else(|| panic!("{name} not in {file}"));
    line.split('"').nth(1).unwrap().to_string()
}

/// What is wrong with a drop-in's text (empty: nothing).
fn problems(unit: &str, read: &BTreeSet<String>) -> Vec<String> {
    let mut bad = Vec::new();
    let env = environment(unit);
    if !unit.lines().any(|l| l.trim() == "[Service]") {
        bad.push("no [Service] section".to_string());
    }
    if env.is_empty() {
        bad.push("no Environment= line".to_string());
    }
    for (k, _) in &env {
        if !read.contains(k) {
            bad.push(format!("{k} is read by no binary"));
        }
        if k.contains("_TEST_") {
            bad.push(format!("{k} is a test-only variable"));
        }
    }
    let value = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let shared = [
        (
            "CRUST_RUNTIME_CRUST_ROOT",
            daemonset_flag("crust-root").unwrap_or_else(|| {
                const_value("crates/crust-handoff/src/store.rs", "DEFAULT_CRUST_ROOT")
            }),
        ),
        (
            "CRUST_RUNTIME_HANDOVER_ENDPOINT",
            daemonset_flag("handover-endpoint").unwrap_or_else(|| {
                const_value(
                    "crates/crust-csi/src/config.rs",
                    "DEFAULT_HANDOVER_ENDPOINT",
                )
            }),
        ),
    ];
    for (k, csi) in shared {
        match value(k) {
            Some(v) if v == csi => {}
            Some(v) => bad.push(format!("{k}={v} but crust-csi uses {csi}")),
            None => bad.push(format!("{k} is not set (crust-csi uses {csi})")),
        }
    }
    bad
}

#[test]
fn the_containerd_dropin_names_only_what_the_binaries_read() {
    let read = names_read();
    // The scan finds what it must (else it proves nothing).
    for k in [
        "CRUST_RUNTIME_ACCEL",
        "CRUST_SHIM_RUNTIME_CLI",
        "CRUST_CSI_CRUST_ROOT",
    ] {
        assert!(read.contains(k), "{k} not found in the sources: {read:?}");
    }
    // Both sides' Handover defaults agree.
    assert_eq!(
        const_value("crates/crust-sandbox/src/handover.rs", "DEFAULT_ENDPOINT"),
        const_value(
            "crates/crust-csi/src/config.rs",
            "DEFAULT_HANDOVER_ENDPOINT"
        )
    );
    let unit = std::fs::read_to_string(root().join(DROPIN)).unwrap();
    assert_eq!(problems(&unit, &read), Vec::<String>::new());
}

#[test]
fn a_broken_dropin_fails_the_check() {
    let read = names_read();
    let unit = std::fs::read_to_string(root().join(DROPIN)).unwrap();
    let misspelt = unit.replace("CRUST_RUNTIME_ACCEL=", "CRUST_RUNTIME_ACCELERATOR=");
    assert!(
        problems(&misspelt, &read)
            .iter()
            .any(|p| p.contains("CRUST_RUNTIME_ACCELERATOR is read by no binary")),
        "{:?}",
        problems(&misspelt, &read)
    );
    let elsewhere = unit.replace(
        "unix:///run/crust/handover.sock",
        "unix:///run/crust-csi/handover.sock",
    );
    assert!(
        problems(&elsewhere, &read)
            .iter()
            .any(|p| p.starts_with("CRUST_RUNTIME_HANDOVER_ENDPOINT=")),
        "{:?}",
        problems(&elsewhere, &read)
    );
    let test_only = format!("{unit}Environment=CRUST_RUNTIME_TEST_HANDOVER_CRASH=x\n");
    assert!(
        problems(&test_only, &read)
            .iter()
            .any(|p| p.contains("test-only")),
        "{:?}",
        problems(&test_only, &read)
    );
}
