//! The node installer against a temporary host root: files placed with
//! their modes, the containerd drop-in in the root config's format (and
//! read back by Debian's containerd 1.6 itself), idempotent runs, upgrades
//! that drop stale files, and an uninstall that leaves the host tree
//! exactly as it was before the install.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt, symlink};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use crust_node_install::{InstallError, Options, RootAction, Step, Version, install, uninstall};
use sha2::{Digest, Sha256};
use toml_edit::DocumentMut;

/// Every entry under `root`: path -> (kind, mode, content digest).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, (char, u32, String)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            let mode = m.permissions().mode() & 0o7777;
            let t = m.file_type();
            if t.is_dir() {
                out.insert(rel, ('d', mode, String::new()));
                stack.push(p);
            } else if t.is_symlink() {
                let target = fs::read_link(&p).unwrap();
                out.insert(rel, ('l', 0, target.to_string_lossy().into_owned()));
            } else if !t.is_file() {
                out.insert(rel, ('s', mode, String::new()));
            } else {
                let d = Sha256::digest(fs::read(&p).unwrap());
                out.insert(rel, ('f', mode, format!("{d:x}")));
            }
        }
    }
    out
}

struct Host {
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        for d in ["root", "payload", "etc-before"] {
            fs::create_dir(dir.path().join(d)).unwrap();
        }
        Host { dir }
    }
    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }
    fn at(&self, host_path: &str) -> PathBuf {
        self.root().join(host_path.trim_start_matches('/'))
    }
    fn write(&self, host_path: &str, text: &str) {
        let p = self.at(host_path);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }
    /// A payload like the image's: binaries, libraries, data, its description.
    fn payload(&self, name: &str, version: &str, files: &[(&str, &str, u32)]) -> PathBuf {
        let pl = self.dir.path().join(name);
        for (rel, body, mode) in files {
            let p = pl.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, body).unwrap();
            fs::set_permissions(&p, fs::Permissions::from_mode(*mode)).unwrap();
        }
        let info = serde_json::json!({
            "version": version, "prefix": "/opt/crust", "components": ["crust-runtime"]
        });
        fs::create_dir_all(pl.join("share/crust")).unwrap();
        fs::write(pl.join("share/crust/payload.json"), info.to_string()).unwrap();
        pl
    }
    fn opts(&self, payload: &Path) -> Options {
        let mut o = Options::new(self.root(), payload);
        // A stand-in for `systemctl restart containerd`: counts calls.
        let marker = self.dir.path().join("reloads");
        o.reload = Some(vec![
            "sh".into(),
            "-c".into(),
            format!("echo reload >> {}", marker.display()),
        ]);
        o
    }
    fn reloads(&self) -> usize {
        fs::read_to_string(self.dir.path().join("reloads"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }
}

const V1: &[(&str, &str, u32)] = &[
    ("bin/crust-runtime", "runtime v1", 0o755),
    ("bin/qemu-system-x86_64", "qemu", 0o755),
    ("lib/ld-linux-x86-64.so.2", "loader", 0o755),
    ("lib/libold.so.1", "old lib", 0o755),
    ("guest-image/vmlinuz", "kernel", 0o644),
];
const V2: &[(&str, &str, u32)] = &[
    ("bin/crust-runtime", "runtime v2", 0o755),
    ("bin/qemu-system-x86_64", "qemu", 0o755),
    ("bin/containerd-shim-crust-v2", "shim", 0o755),
    ("lib/ld-linux-x86-64.so.2", "loader", 0o755),
    ("guest-image/vmlinuz", "kernel", 0o644),
];

fn dropin_doc(h: &Host) -> DocumentMut {
    fs::read_to_string(h.at("/etc/containerd/conf.d/crust.toml"))
        .unwrap()
        .parse()
        .unwrap()
}

/// Runs Debian's containerd on the installed configuration as it will see
/// it on the node: `config dump` in a private mount namespace where the
/// temporary host's /etc/containerd is at /etc/containerd.
fn containerd_dump(h: &Host) -> String {
    assert!(
        Path::new("/etc/containerd").is_dir(),
        "containerd is not installed (scripts/install-deps.sh)"
    );
    let script = format!(
        "mount --bind {} /etc/containerd && exec containerd --config /etc/containerd/config.toml config dump",
        h.at("/etc/containerd").display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "containerd rejected the config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn fresh_node_without_containerd_config_then_upgrade_then_uninstall() {
    crust_testkit::require_root();
    let h = Host::new();
    h.write("/etc/hostname", "node-1\n");
    fs::create_dir_all(h.at("/opt/other")).unwrap();
    let before = snapshot(&h.root());
    let p1 = h.payload("p1", "0.1.0", V1);

    let r = install(&h.opts(&p1)).unwrap();
    assert!(r.containerd_changed);
    assert_eq!(h.reloads(), 1);
    for (rel, body, mode) in V1 {
        let p = h.at("/opt/crust").join(rel);
        assert_eq!(fs::read_to_string(&p).unwrap(), *body, "{rel}");
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o7777,
            *mode
        );
    }
    // No root config existed: a version-2 one importing conf.d, read by
    // containerd 1.x and 2.x alike; the drop-in matches it.
    let root_cfg: DocumentMut = fs::read_to_string(h.at("/etc/containerd/config.toml"))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(root_cfg["version"].as_integer(), Some(2));
    let d = dropin_doc(&h);
    assert_eq!(d["version"].as_integer(), Some(2));
    let rt = &d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["crust"];
    assert_eq!(rt["runtime_type"].as_str(), Some("io.containerd.crust.v2"));
    let dump = containerd_dump(&h);
    assert!(
        dump.contains("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crust]")
            && dump.contains("runtime_type = \"io.containerd.crust.v2\"")
            && dump.contains("runtime_path = \"/opt/crust/bin/containerd-shim-crust-v2\""),
        "{dump}"
    );
    let m = crust_node_install::install::read_manifest(&h.opts(&p1))
        .unwrap()
        .unwrap();
    assert!(matches!(m.root, RootAction::Created { .. }));
    assert_eq!(m.config_version, Version::V2);

    // Idempotent: nothing written, containerd not reloaded.
    let installed = snapshot(&h.root());
    let r = install(&h.opts(&p1)).unwrap();
    assert!(r.written.is_empty() && r.removed.is_empty() && !r.containerd_changed);
    assert_eq!(h.reloads(), 1);
    assert_eq!(snapshot(&h.root()), installed);

    // Upgrade: changed files replaced, new ones added, stale ones removed;
    // containerd's configuration is the same, so no reload.
    let p2 = h.payload("p2", "0.2.0", V2);
    let r = install(&h.opts(&p2)).unwrap();
    assert!(!r.containerd_changed);
    assert_eq!(h.reloads(), 1);
    assert_eq!(r.removed, vec![PathBuf::from("/opt/crust/lib/libold.so.1")]);
    assert!(!h.at("/opt/crust/lib/libold.so.1").exists());
    assert_eq!(
        fs::read_to_string(h.at("/opt/crust/bin/crust-runtime")).unwrap(),
        "runtime v2"
    );
    assert!(h.at("/opt/crust/bin/containerd-shim-crust-v2").is_file());

    // Uninstall: the host tree is exactly what it was; again: no-op.
    let r = uninstall(&h.opts(&p2)).unwrap();
    assert!(r.containerd_changed);
    assert_eq!(h.reloads(), 2);
    assert_eq!(snapshot(&h.root()), before);
    let r = uninstall(&h.opts(&p2)).unwrap();
    assert!(r.removed.is_empty() && !r.containerd_changed);
    assert_eq!(h.reloads(), 2);
}

const HOST_V2: &str = r#"# the node's own containerd 1.7 configuration
version = 2
root = "/var/lib/containerd"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
"#;

/// containerd 1.x replaces a whole plugin section with an imported file's:
/// a drop-in would wipe this node's CRI settings, so the runtime goes
/// inline, and containerd itself shows both the node's settings and crust.
#[test]
fn existing_v2_config_with_a_cri_section_gets_the_runtime_inline_and_back() {
    crust_testkit::require_root();
    let h = Host::new();
    h.write("/etc/containerd/config.toml", HOST_V2);
    let before = snapshot(&h.root());
    let p = h.payload("p", "0.1.0", V1);
    install(&h.opts(&p)).unwrap();

    let edited = fs::read_to_string(h.at("/etc/containerd/config.toml")).unwrap();
    let doc: DocumentMut = edited.parse().unwrap();
    assert!(doc.get("imports").is_none(), "{edited}");
    assert!(!h.at("/etc/containerd/conf.d/crust.toml").exists());
    let dump = containerd_dump(&h);
    assert!(
        dump.contains("sandbox_image = \"registry.k8s.io/pause:3.10\""),
        "{dump}"
    );
    assert!(dump.contains("containerd.runtimes.runc]"), "{dump}");
    assert!(dump.contains("containerd.runtimes.crust]"), "{dump}");
    assert!(
        dump.contains("runtime_type = \"io.containerd.crust.v2\""),
        "{dump}"
    );
    let r = install(&h.opts(&p)).unwrap();
    assert!(!r.containerd_changed, "idempotent: {r:?}");

    uninstall(&h.opts(&p)).unwrap();
    assert_eq!(
        fs::read_to_string(h.at("/etc/containerd/config.toml")).unwrap(),
        HOST_V2
    );
    assert_eq!(snapshot(&h.root()), before);
}

#[test]
fn a_config_edited_after_install_keeps_the_edit_on_uninstall() {
    crust_testkit::require_root();
    let h = Host::new();
    h.write("/etc/containerd/config.toml", HOST_V2);
    let p = h.payload("p", "0.1.0", V1);
    install(&h.opts(&p)).unwrap();
    let cfg = h.at("/etc/containerd/config.toml");
    let edited = fs::read_to_string(&cfg).unwrap() + "\n[debug]\n  level = \"debug\"\n";
    fs::write(&cfg, &edited).unwrap();
    // A reinstall after the edit, then uninstall: our table goes, the
    // edit stays.
    install(&h.opts(&p)).unwrap();
    uninstall(&h.opts(&p)).unwrap();
    let text = fs::read_to_string(&cfg).unwrap();
    let after: DocumentMut = text.parse().unwrap();
    assert!(!text.contains("crust"), "{text}");
    assert_eq!(after["debug"]["level"].as_str(), Some("debug"));
    assert_eq!(
        after["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"].as_str(),
        Some("registry.k8s.io/pause:3.10")
    );
}

#[test]
fn an_import_added_to_an_edited_v3_config_is_the_only_thing_removed() {
    crust_testkit::require_root();
    let h = Host::new();
    let host_v3 =
        "version = 3\n\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n";
    h.write("/etc/containerd/config.toml", host_v3);
    let p = h.payload("p", "0.1.0", V1);
    install(&h.opts(&p)).unwrap();
    let cfg = h.at("/etc/containerd/config.toml");
    let doc: DocumentMut = fs::read_to_string(&cfg).unwrap().parse().unwrap();
    assert_eq!(
        doc["imports"]
            .as_array()
            .unwrap()
            .get(0)
            .and_then(|v| v.as_str()),
        Some("/etc/containerd/conf.d/crust.toml")
    );
    assert_eq!(dropin_doc(&h)["version"].as_integer(), Some(3));
    let edited = fs::read_to_string(&cfg).unwrap() + "\n[debug]\n  level = 'debug'\n";
    fs::write(&cfg, &edited).unwrap();
    install(&h.opts(&p)).unwrap();
    uninstall(&h.opts(&p)).unwrap();
    let text = fs::read_to_string(&cfg).unwrap();
    assert!(
        !text.contains("crust") && text.contains("level = 'debug'"),
        "{text}"
    );
    assert!(!h.at("/etc/containerd/conf.d/crust.toml").exists());
}

#[test]
fn v3_config_that_already_imports_conf_d_gets_a_v3_dropin_and_no_edit() {
    crust_testkit::require_root();
    let h = Host::new();
    let host_v3 = "version = 3\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n\n\
                   [plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n";
    h.write("/etc/containerd/config.toml", host_v3);
    h.write("/etc/containerd/conf.d/other.toml", "version = 3\n");
    let before = snapshot(&h.root());
    let p = h.payload("p", "0.1.0", V1);
    install(&h.opts(&p)).unwrap();
    assert_eq!(
        fs::read_to_string(h.at("/etc/containerd/config.toml")).unwrap(),
        host_v3,
        "already imported: untouched"
    );
    let d = dropin_doc(&h);
    assert_eq!(d["version"].as_integer(), Some(3));
    let rt = &d["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["crust"];
    assert_eq!(rt["runtime_type"].as_str(), Some("io.containerd.crust.v2"));
    assert_eq!(
        rt["runtime_path"].as_str(),
        Some("/opt/crust/bin/containerd-shim-crust-v2")
    );
    assert!(d["plugins"].get("io.containerd.grpc.v1.cri").is_none());
    uninstall(&h.opts(&p)).unwrap();
    assert_eq!(snapshot(&h.root()), before);
}

#[test]
fn bad_input_changes_nothing() {
    crust_testkit::require_root();
    // A version-1 containerd config: refused with the way out.
    let h = Host::new();
    h.write(
        "/etc/containerd/config.toml",
        "root = \"/var/lib/containerd\"\n",
    );
    let p = h.payload("p", "0.1.0", V1);
    let before = snapshot(&h.root());
    let e = install(&h.opts(&p)).unwrap_err().to_string();
    assert!(
        e.contains("version 1") && e.contains("containerd config migrate"),
        "{e}"
    );
    assert_eq!(snapshot(&h.root()), before);
    assert_eq!(h.reloads(), 0);

    // A payload built for another prefix: refused before anything is written.
    let h = Host::new();
    let p = h.payload("p", "0.1.0", V1);
    let before = snapshot(&h.root());
    let mut o = h.opts(&p);
    o.prefix = "/usr/local/crust".into();
    let e = install(&o).unwrap_err().to_string();
    assert!(e.contains("built for prefix /opt/crust"), "{e}");
    assert_eq!(snapshot(&h.root()), before);
}

/// What a mistaken or hostile host might have at a config path: a secret
/// to keep out of messages, links, FIFOs.
const SECRET: &str = "root:$6$s3cr3tHashThatMustNotLeak:19000:0:99999:7:::\n";

fn mkfifo(p: &Path) {
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    let st = Command::new("mkfifo").arg(p).status().unwrap();
    assert!(st.success());
}

#[test]
fn a_config_that_is_a_link_is_refused_by_name_and_nothing_is_read_or_changed() {
    crust_testkit::require_root();
    // A link to a secret, relative (inside the host) and absolute (whose
    // target, resolved in the installer's container, is not even the
    // host's file), and a distribution-style link into a read-only tree.
    let outside = tempfile::tempdir().unwrap();
    fs::write(outside.path().join("shadow"), SECRET).unwrap();
    let abs_secret = outside.path().join("shadow");
    for target in [
        PathBuf::from("../shadow"),
        abs_secret,
        PathBuf::from("/usr/share/containerd/config.toml"),
    ] {
        let h = Host::new();
        h.write("/etc/shadow", SECRET);
        h.write("/usr/share/containerd/config.toml", "version = 3\n");
        fs::create_dir_all(h.at("/etc/containerd")).unwrap();
        symlink(&target, h.at("/etc/containerd/config.toml")).unwrap();
        let p = h.payload("p", "0.1.0", V1);
        let before = snapshot(&h.root());
        let e = install(&h.opts(&p)).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, InstallError::Symlink { .. }), "{msg}");
        assert!(
            msg.contains("etc/containerd/config.toml")
                && msg.contains(&*target.to_string_lossy())
                && !msg.contains("s3cr3t"),
            "{msg}"
        );
        assert_eq!(
            snapshot(&h.root()),
            before,
            "the link and all else unchanged"
        );
        assert_eq!(h.reloads(), 0);
    }

    // A regular config that is not TOML: where, never what.
    let h = Host::new();
    h.write("/etc/containerd/config.toml", SECRET);
    let p = h.payload("p", "0.1.0", V1);
    let before = snapshot(&h.root());
    let msg = install(&h.opts(&p)).unwrap_err().to_string();
    assert!(msg.contains("line 1") && !msg.contains("s3cr3t"), "{msg}");
    assert_eq!(snapshot(&h.root()), before);
}

/// Runs `f` on a thread and fails (rather than hangs) if it takes over
/// 20 s (a blocked open never returns; a loaded CI machine is slow); `unblock` is opened for writing first, to release a reader
/// stuck on a FIFO.
fn without_blocking<T: Send + 'static>(
    unblock: &Path,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(f()).unwrap());
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(v) => v,
        Err(_) => {
            let _ = fs::OpenOptions::new()
                .write(true)
                .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
                .open(unblock);
            panic!("blocked on {}", unblock.display());
        }
    }
}

#[test]
fn a_fifo_for_a_config_is_refused_at_once() {
    crust_testkit::require_root();
    for fifo in [
        "/etc/containerd/config.toml",
        "/etc/containerd/conf.d/crust.toml",
    ] {
        let h = Host::new();
        if fifo.ends_with("crust.toml") {
            h.write(
                "/etc/containerd/config.toml",
                "version = 3\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n",
            );
        }
        mkfifo(&h.at(fifo));
        let p = h.payload("p", "0.1.0", V1);
        let before = snapshot(&h.root());
        let o = h.opts(&p);
        let e = without_blocking(&h.at(fifo), move || install(&o).map(drop));
        let msg = e.unwrap_err().to_string();
        assert!(msg.contains(fifo) && msg.contains("FIFO"), "{msg}");
        assert_eq!(snapshot(&h.root()), before, "{fifo}");
    }
}

#[test]
fn a_failure_mid_install_leaves_nothing_behind() {
    crust_testkit::require_root();
    let v3 = "version = 3\n";
    // conf.d a link: refused before anything is written.
    let h = Host::new();
    h.write("/etc/containerd/config.toml", v3);
    fs::create_dir_all(h.at("/etc/containerd.d-real")).unwrap();
    symlink("../containerd.d-real", h.at("/etc/containerd/conf.d")).unwrap();
    let p = h.payload("p", "0.1.0", V1);
    let before = snapshot(&h.root());
    let msg = install(&h.opts(&p)).unwrap_err().to_string();
    assert!(
        msg.contains("etc/containerd/conf.d") && msg.contains("../containerd.d-real"),
        "{msg}"
    );
    assert_eq!(snapshot(&h.root()), before);
    assert!(uninstall(&h.opts(&p)).unwrap().removed.is_empty());

    // A failure no check foresees (the drop-in's temporary name taken by
    // a directory), after the payload was written: rolled back.
    let h = Host::new();
    h.write("/etc/containerd/config.toml", v3);
    fs::create_dir_all(h.at("/etc/containerd/conf.d/.crust.toml.crust-tmp/x")).unwrap();
    let p = h.payload("p", "0.1.0", V1);
    let before = snapshot(&h.root());
    let e = install(&h.opts(&p)).unwrap_err();
    assert!(matches!(e, InstallError::RolledBack { .. }), "{e}");
    assert_eq!(snapshot(&h.root()), before);
    assert_eq!(h.reloads(), 0);
}

thread_local! {
    /// The step the fault hook stops at, and whether it crashes (panics).
    static FAULT: Cell<Option<(Step, bool)>> = const { Cell::new(None) };
}

fn fault(s: Step) -> bool {
    match FAULT.get() {
        Some((at, crash)) if at == s => {
            if crash {
                panic!("crash after {s:?}");
            }
            true
        }
        _ => false,
    }
}

/// After a failure at any step the install is rolled back; after a crash
/// there, uninstall removes all of it: for each way the root config is
/// handled, and for an upgrade.
#[test]
fn a_failure_or_crash_between_any_two_steps_is_undone() {
    crust_testkit::require_root();
    let steps = [
        Step::Recorded,
        Step::Payload,
        Step::Dropin,
        Step::RootConfig,
    ];
    for config in [None, Some("version = 3\n"), Some(HOST_V2)] {
        for at in steps {
            for crash in [false, true] {
                let h = Host::new();
                if let Some(c) = config {
                    h.write("/etc/containerd/config.toml", c);
                }
                let p = h.payload("p", "0.1.0", V1);
                let before = snapshot(&h.root());
                let mut o = h.opts(&p);
                o.fault = Some(fault);
                FAULT.set(Some((at, crash)));
                let r = catch_unwind(AssertUnwindSafe(|| install(&o)));
                FAULT.set(None);
                let case = format!("{config:?} {at:?} crash={crash}");
                match r {
                    Ok(Err(InstallError::RolledBack { .. })) => assert!(!crash, "{case}"),
                    Err(_) => {
                        assert!(crash, "{case}");
                        let m = crust_node_install::install::read_manifest(&o).unwrap();
                        assert!(m.is_some_and(|m| m.pending), "{case}: a pending record");
                        uninstall(&o).unwrap();
                    }
                    Ok(other) => panic!("{case}: {other:?}"),
                }
                assert_eq!(snapshot(&h.root()), before, "{case}");
            }
        }
    }

    // An upgrade stopped half way keeps a record of old and new: a rerun
    // completes it, uninstall removes both.
    let h = Host::new();
    h.write("/etc/containerd/config.toml", "version = 3\n");
    let before = snapshot(&h.root());
    install(&h.opts(&h.payload("p1", "0.1.0", V1))).unwrap();
    let p2 = h.payload("p2", "0.2.0", V2);
    let mut o = h.opts(&p2);
    o.fault = Some(fault);
    FAULT.set(Some((Step::Recorded, false)));
    let e = install(&o).unwrap_err();
    FAULT.set(None);
    assert!(matches!(e, InstallError::Incomplete { .. }), "{e}");
    assert!(
        h.at("/opt/crust/bin/crust-runtime").is_file(),
        "old runtime kept"
    );
    uninstall(&o).unwrap();
    assert_eq!(snapshot(&h.root()), before);
}
