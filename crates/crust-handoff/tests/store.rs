//! The store against real directories (tempdir roots): on-disk format,
//! permissions, every refusal, claims and source lookup.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

use std::fs;
use std::os::unix::fs::{FileTypeExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use crust_handoff::{
    ErrorKind, FsGroupChangePolicy, HandoffError, Layout, MountInfo, Policy, Store, crust_key,
    kata_key,
};

const TARGET: &str = "/var/lib/kubelet/pods/9f3c/volumes/kubernetes.io~csi/pvc-1/mount";

/// Some block device node under /dev (the store only checks the type; the
/// node need not be attached).
fn block_dev() -> String {
    let mut devs: Vec<PathBuf> = fs::read_dir("/dev")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().map(|t| t.is_block_device()).unwrap_or(false))
        .map(|e| e.path())
        .collect();
    devs.sort();
    devs.first()
        .expect("a block device under /dev")
        .to_str()
        .unwrap()
        .to_string()
}

fn sample(dev: &str) -> MountInfo {
    let mut mi = MountInfo::block(dev, "ext4");
    mi.set_fs_group(Some(100));
    mi.set_fs_group_change_policy(Some(FsGroupChangePolicy::OnRootMismatch));
    mi.options = vec!["noatime".into()];
    mi
}

struct Fixture {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    store: Store,
}

fn fixture(layout: Layout, policy: Policy) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("records");
    let store = Store::new(layout, &root, policy).unwrap();
    Fixture {
        _tmp: tmp,
        root,
        store,
    }
}

fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn keys_are_hand_computed() {
    // printf '%s' PATH | sha256sum ; printf '%s' PATH | basenc --base64url
    assert_eq!(
        crust_key(TARGET),
        "3fc5bef5d7fbb743baf4c1fb2bc1677c0f5331d0a9b518ed9b1f96838ee00789"
    );
    assert_eq!(
        crust_key("/a"),
        "6a50dc8584134c7de537c0052ff6d236bf874355e050c90523e0c5ff2a543a28"
    );
    assert_eq!(
        kata_key(TARGET),
        "L3Zhci9saWIva3ViZWxldC9wb2RzLzlmM2Mvdm9sdW1lcy9rdWJlcm5ldGVzLmlvfmNzaS9wdmMtMS9tb3VudA=="
    );
    // The path of Kata's own how-to.
    assert_eq!(
        kata_key("/kubelet/kata-test-vol-001/volume001"),
        "L2t1YmVsZXQva2F0YS10ZXN0LXZvbC0wMDEvdm9sdW1lMDAx"
    );
    // URL-safe alphabet ('_' and '-', not '/' and '+') and '=' padding.
    assert_eq!(kata_key("/a?"), "L2E_");
    assert_eq!(kata_key("/a>>?"), "L2E-Pj8=");
}

#[test]
fn stage_writes_byte_exact_record_with_root_only_modes() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    f.store.stage(TARGET, &sample(&dev)).unwrap();
    let dir = f
        .root
        .join("3fc5bef5d7fbb743baf4c1fb2bc1677c0f5331d0a9b518ed9b1f96838ee00789");
    assert_eq!(f.store.record_dir(TARGET).unwrap(), dir);
    assert_eq!(
        fs::read_to_string(dir.join("mountInfo.json")).unwrap(),
        format!(
            r#"{{"volume-type":"block","device":"{dev}","fstype":"ext4","metadata":{{"fsGroup":"100","fsGroupChangePolicy":"OnRootMismatch"}},"options":["noatime"]}}"#
        )
    );
    assert_eq!(mode(&f.root), 0o700);
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("mountInfo.json")), 0o600);
    assert_eq!(names(&dir), ["mountInfo.json"], "no temp file left behind");
    assert_eq!(f.store.read(TARGET).unwrap(), sample(&dev));
}

#[test]
fn kata_layout_on_disk() {
    let dev = block_dev();
    let f = fixture(Layout::Kata, Policy::default());
    let mi = MountInfo::block(&dev, "xfs");
    f.store.stage(TARGET, &mi).unwrap();
    let dir = f.root.join(kata_key(TARGET));
    assert_eq!(
        fs::read_to_string(dir.join("mountInfo.json")).unwrap(),
        format!(r#"{{"volume-type":"directvol","device":"{dev}","fstype":"xfs"}}"#),
        "Kata's Rust runtime takes only directvol"
    );
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("mountInfo.json")), 0o600);
    f.store.claim(TARGET, "sandbox-1", |_| true).unwrap();
    assert_eq!(names(&dir), ["mountInfo.json", "sandbox-1"]);
    assert_eq!(fs::metadata(dir.join("sandbox-1")).unwrap().len(), 0);
    assert_eq!(mode(&dir.join("sandbox-1")), 0o600);
    // No runtime-cli in this format.
    assert_eq!(f.store.runtime_cli(TARGET).unwrap(), None);
    let e = f
        .store
        .set_runtime_cli(TARGET, "/usr/bin/kata-runtime")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    assert_eq!(names(&dir), ["mountInfo.json", "sandbox-1"]);
    // list() recovers the path from the name.
    let listed = f.store.list().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].target.as_deref(), Some(TARGET));
    let state = listed[0].state.as_ref().unwrap();
    assert_eq!(state.mount_info, f.store.normalized(&mi));
    assert_eq!(state.claimant.as_deref(), Some("sandbox-1"));
}

#[test]
fn reads_a_record_written_the_way_kata_writes_it() {
    // Kata stores whatever JSON its caller passed, 0600 in a 0700 dir.
    let dev = block_dev();
    let f = fixture(Layout::Kata, Policy::default());
    let dir = f
        .root
        .join(kata_key("/kubelet/kata-test-vol-001/volume001"));
    fs::create_dir_all(&dir).unwrap();
    fs::set_permissions(&f.root, fs::Permissions::from_mode(0o700)).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    let json = format!(
        "{{\n  \"device\": \"{dev}\",\n  \"volume-type\": \"block\",\n  \"fstype\": \"ext4\",\n  \"metadata\": {{\"fsGroup\": \"2000\"}}\n}}\n"
    );
    fs::write(dir.join("mountInfo.json"), json).unwrap();
    fs::set_permissions(
        dir.join("mountInfo.json"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    fs::write(dir.join("c9be9e0123"), "").unwrap();
    let mi = f
        .store
        .read("/kubelet/kata-test-vol-001/volume001")
        .unwrap();
    assert_eq!(mi.fs_group(), Some(2000));
    assert_eq!(mi.device, dev);
    assert_eq!(
        f.store
            .claimant("/kubelet/kata-test-vol-001/volume001")
            .unwrap()
            .as_deref(),
        Some("c9be9e0123")
    );
}

#[test]
fn stage_is_idempotent_and_overwrites_only_unclaimed() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    let dir = f.store.record_dir(TARGET).unwrap();
    f.store.stage(TARGET, &sample(&dev)).unwrap();
    let ino = fs::metadata(dir.join("mountInfo.json")).unwrap();
    f.store.stage(TARGET, &sample(&dev)).unwrap();
    let ino2 = fs::metadata(dir.join("mountInfo.json")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(ino.ino(), ino2.ino(), "same content: file untouched");

    // Different content, unclaimed: replaced, and a stale runtime-cli goes.
    f.store
        .set_runtime_cli(TARGET, "/usr/bin/crust-runtime")
        .unwrap();
    let mut other = sample(&dev);
    other.fstype = "xfs".into();
    f.store.stage(TARGET, &other).unwrap();
    assert_eq!(f.store.read(TARGET).unwrap(), other);
    assert_eq!(names(&dir), ["mountInfo.json"]);

    // Claimed: a different record is refused and nothing changes.
    f.store.claim(TARGET, "sb1", |_| true).unwrap();
    let before = fs::read(dir.join("mountInfo.json")).unwrap();
    let e = f.store.stage(TARGET, &sample(&dev)).unwrap_err();
    assert!(matches!(e, HandoffError::Conflict(_)), "{e}");
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    assert_eq!(fs::read(dir.join("mountInfo.json")).unwrap(), before);
    // ...but the same record again is fine while claimed.
    f.store.stage(TARGET, &other).unwrap();
}

#[test]
fn modes_are_root_only_even_over_existing_loose_dirs() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    f.store.stage(TARGET, &sample(&dev)).unwrap();
    let dir = f.store.record_dir(TARGET).unwrap();
    // A record dir left 0755 by someone: restaging makes it 0700 again.
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    let mut other = sample(&dev);
    other.options.clear();
    f.store.stage(TARGET, &other).unwrap();
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("mountInfo.json")), 0o600);
}

#[test]
fn bad_inputs_are_refused_and_write_nothing() {
    let dev = block_dev();
    let policy = Policy {
        allowed_target_prefixes: vec!["/var/lib/kubelet/pods/".into()],
        ..Policy::default()
    };
    let f = fixture(Layout::Crust, policy);
    let mut cases: Vec<(String, MountInfo, &str)> = Vec::new();
    let ok = sample(&dev);
    cases.push(("relative/path".into(), ok.clone(), "not absolute"));
    cases.push((format!("{TARGET}/"), ok.clone(), "not normalized"));
    cases.push((
        "/var/lib/kubelet/pods/x/../../../etc".into(),
        ok.clone(),
        "not normalized",
    ));
    cases.push((
        "/var/lib/kubelet/pods//x".into(),
        ok.clone(),
        "not normalized",
    ));
    cases.push((
        "/var/lib/kubelet/pods/x\0y".into(),
        ok.clone(),
        "control character",
    ));
    cases.push((
        format!("/var/lib/kubelet/pods/{}", "a".repeat(4096)),
        ok.clone(),
        "longer than",
    ));
    cases.push((
        "/etc/shadow".into(),
        ok.clone(),
        "outside the allowed prefixes",
    ));
    cases.push((
        "/var/lib/kubelet/pods".into(),
        ok.clone(),
        "outside the allowed prefixes",
    ));
    cases.push((
        "/var/lib/kubelet/podsx/y".into(),
        ok.clone(),
        "outside the allowed prefixes",
    ));
    let mut m = ok.clone();
    m.volume_type = "network".into();
    cases.push((TARGET.into(), m, "network"));
    let mut m = ok.clone();
    m.fstype = "btrfs".into();
    cases.push((TARGET.into(), m, "fstype"));
    let mut m = ok.clone();
    m.options = vec!["password=hunter2".into()];
    cases.push((TARGET.into(), m, "credential"));
    let mut m = ok.clone();
    m.options = vec!["username=admin".into()];
    cases.push((TARGET.into(), m, "credential"));
    let mut m = ok.clone();
    m.options = vec!["noatime,exec".into()];
    cases.push((TARGET.into(), m, "contains ','"));
    let mut m = ok.clone();
    m.metadata.insert("encryptionKey".into(), "abc".into());
    cases.push((TARGET.into(), m, "not allowed"));
    let mut m = ok.clone();
    m.metadata.insert("fsGroup".into(), "4294967296".into());
    cases.push((TARGET.into(), m, "32 bits"));
    let mut m = ok.clone();
    m.device = "/dev/does-not-exist-crust".into();
    cases.push((TARGET.into(), m, "No such file"));
    let mut m = ok.clone();
    m.device = "/dev/null".into();
    cases.push((TARGET.into(), m, "neither a block device"));
    let mut m = ok.clone();
    m.device = "dev/loop0".into();
    cases.push((TARGET.into(), m, "not absolute"));
    let mut m = ok.clone();
    m.device = "/etc/passwd".into();
    cases.push((TARGET.into(), m, "outside the configured file-device roots"));
    for (target, mi, why) in cases {
        let e = f.store.stage(&target, &mi).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{target}: {e}");
        assert!(e.to_string().contains(why), "{target}: {e} (wanted {why})");
        assert!(
            !e.to_string().contains("hunter2"),
            "a secret reached an error message"
        );
        assert!(!f.root.exists(), "nothing may be written for a bad request");
    }
    // Sandbox ids.
    f.store.stage(TARGET, &ok).unwrap();
    for id in [
        "",
        "../x",
        "a/b",
        ".x",
        "mountInfo.json",
        "runtime-cli",
        &"a".repeat(129),
    ] {
        let e = f.store.claim(TARGET, id, |_| true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{id:?}");
    }
    assert_eq!(
        names(&f.store.record_dir(TARGET).unwrap()),
        ["mountInfo.json"]
    );
    // A runtime-cli must be an absolute normalized path.
    for cli in ["kata-runtime", "/usr/bin/../bin/x", ""] {
        let e = f.store.set_runtime_cli(TARGET, cli).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{cli:?}");
    }
    assert_eq!(f.store.runtime_cli(TARGET).unwrap(), None);
}

#[test]
fn kata_layout_refuses_paths_whose_name_would_exceed_name_max() {
    let dev = block_dev();
    let f = fixture(Layout::Kata, Policy::default());
    let long = format!("/{}", "a".repeat(190)); // 191 bytes -> 256 chars of base64
    let e = f
        .store
        .stage(&long, &MountInfo::block(&dev, "ext4"))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(
        e.to_string().contains("too long for the Kata layout"),
        "{e}"
    );
    let fits = format!("/{}", "a".repeat(188)); // 189 bytes -> 252 chars
    f.store
        .stage(&fits, &MountInfo::block(&dev, "ext4"))
        .unwrap();
}

/// Writes a raw record file as an attacker (or a bug) might.
fn plant(f: &Fixture, target: &str, json: &[u8]) -> PathBuf {
    let dir = f.root.join(f.store.layout().key(target));
    fs::create_dir_all(&dir).unwrap();
    fs::set_permissions(&f.root, fs::Permissions::from_mode(0o700)).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(dir.join("mountInfo.json"), json).unwrap();
    fs::set_permissions(
        dir.join("mountInfo.json"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    dir
}

fn assert_bad(r: Result<MountInfo, HandoffError>, why: &str) {
    let e = r.unwrap_err();
    assert!(matches!(e, HandoffError::BadRecord { .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    assert!(e.to_string().contains(why), "{e} (wanted {why})");
}

#[test]
fn forged_and_broken_records_are_refused_on_read() {
    let dev = block_dev();
    let tmp_dev = tempfile::tempdir().unwrap();
    let img = tmp_dev.path().join("disk.img");
    fs::write(&img, vec![0u8; 4096]).unwrap();
    let img = img.to_str().unwrap().to_string();
    let f = fixture(Layout::Crust, Policy::default());
    let good = format!(r#"{{"volume-type":"block","device":"{dev}","fstype":"ext4"}}"#);

    plant(&f, TARGET, good.as_bytes());
    assert_eq!(
        f.store.read(TARGET).unwrap(),
        MountInfo::block(&dev, "ext4")
    );

    plant(&f, TARGET, &good.as_bytes()[..good.len() - 5]);
    assert_bad(f.store.read(TARGET), "malformed");
    plant(&f, TARGET, b"");
    assert_bad(f.store.read(TARGET), "malformed");
    plant(
        &f,
        TARGET,
        format!(
            r#"{{"volume-type":"block","device":"{dev}","fstype":"ext4","encryptionKey":"k"}}"#
        )
        .as_bytes(),
    );
    assert_bad(f.store.read(TARGET), "unknown field");
    plant(
        &f,
        TARGET,
        format!(
            r#"{{"volume-type":"block","device":"{dev}","fstype":"ext4","options":["password=x"]}}"#
        )
        .as_bytes(),
    );
    assert_bad(f.store.read(TARGET), "credential");
    plant(
        &f,
        TARGET,
        br#"{"volume-type":"block","device":"/dev/null","fstype":"ext4"}"#,
    );
    assert_bad(f.store.read(TARGET), "neither a block device");
    plant(
        &f,
        TARGET,
        format!(r#"{{"volume-type":"block","device":"{img}","fstype":"ext4"}}"#).as_bytes(),
    );
    assert_bad(
        f.store.read(TARGET),
        "outside the configured file-device roots",
    );
    plant(
        &f,
        TARGET,
        format!(r#"{{"volume-type":"network","device":"{dev}","fstype":"nfs"}}"#).as_bytes(),
    );
    assert_bad(f.store.read(TARGET), "network");

    // The same regular file is fine for a store whose policy allows its root.
    let allowed = Store::new(
        Layout::Crust,
        &f.root,
        Policy {
            file_device_roots: vec![tmp_dev.path().to_path_buf()],
            ..Policy::default()
        },
    )
    .unwrap();
    plant(
        &f,
        TARGET,
        format!(r#"{{"volume-type":"block","device":"{img}","fstype":"ext4"}}"#).as_bytes(),
    );
    assert_eq!(allowed.read(TARGET).unwrap().device, img);
    // ...but not through a symlink leading out of the root.
    let link = tmp_dev.path().join("link");
    symlink("/etc/passwd", &link).unwrap();
    plant(
        &f,
        TARGET,
        format!(
            r#"{{"volume-type":"block","device":"{}","fstype":"ext4"}}"#,
            link.display()
        )
        .as_bytes(),
    );
    let e = allowed.read(TARGET).unwrap_err();
    assert!(
        e.to_string().contains("never reached through symlinks"),
        "{e}"
    );
}

#[test]
fn oversized_record_is_refused_without_reading_it() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    let dir = plant(&f, TARGET, b"");
    // 10 MB: valid JSON start, then padding.
    let mut big =
        format!(r#"{{"volume-type":"block","device":"{dev}","fstype":"ext4","options":["#)
            .into_bytes();
    big.resize(10 * 1024 * 1024, b' ');
    fs::write(dir.join("mountInfo.json"), &big).unwrap();
    assert_bad(f.store.read(TARGET), "larger than 65536 bytes");
    // A FIFO in its place must not block the reader.
    fs::remove_file(dir.join("mountInfo.json")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        dir.join("mountInfo.json"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    assert_bad(f.store.read(TARGET), "not a regular file");
}

#[test]
fn symlinks_are_never_followed() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    let outside = tempfile::tempdir().unwrap();
    fs::set_permissions(outside.path(), fs::Permissions::from_mode(0o700)).unwrap();
    let good = format!(r#"{{"volume-type":"block","device":"{dev}","fstype":"ext4"}}"#);
    fs::write(outside.path().join("mountInfo.json"), &good).unwrap();
    fs::set_permissions(
        outside.path().join("mountInfo.json"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();

    // A symlink in place of the record dir.
    fs::create_dir_all(&f.root).unwrap();
    let link = f.root.join(crust_key(TARGET));
    symlink(outside.path(), &link).unwrap();
    assert_bad(
        f.store.read(TARGET),
        "symlink stands in place of the record directory",
    );
    let e = f
        .store
        .stage(TARGET, &MountInfo::block(&dev, "xfs"))
        .unwrap_err();
    assert!(e.to_string().contains("symlink"), "{e}");
    let e = f.store.remove(TARGET).unwrap_err();
    assert!(e.to_string().contains("symlink"), "{e}");
    let e = f.store.claim(TARGET, "sb", |_| true).unwrap_err();
    assert!(e.to_string().contains("symlink"), "{e}");
    assert!(
        fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(names(outside.path()), ["mountInfo.json"]);
    assert_eq!(
        fs::read_to_string(outside.path().join("mountInfo.json")).unwrap(),
        good
    );

    // A symlink in place of mountInfo.json inside a real record dir.
    fs::remove_file(&link).unwrap();
    fs::create_dir(&link).unwrap();
    fs::set_permissions(&link, fs::Permissions::from_mode(0o700)).unwrap();
    symlink(
        outside.path().join("mountInfo.json"),
        link.join("mountInfo.json"),
    )
    .unwrap();
    assert_bad(f.store.read(TARGET), "symlink");
    // ...and in place of a sandbox file: remove refuses, leaves everything.
    fs::remove_file(link.join("mountInfo.json")).unwrap();
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "xfs"))
        .unwrap();
    symlink("/etc/passwd", link.join("sb-evil")).unwrap();
    let e = f.store.remove(TARGET).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    assert_eq!(names(&link), ["mountInfo.json", "sb-evil"]);
    assert!(fs::metadata("/etc/passwd").is_ok());
}

#[test]
fn loose_permissions_on_a_record_are_refused() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    let dir = f.store.record_dir(TARGET).unwrap();
    fs::set_permissions(
        dir.join("mountInfo.json"),
        fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    assert_bad(f.store.read(TARGET), "lets others write");
    fs::set_permissions(
        dir.join("mountInfo.json"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    assert_bad(f.store.read(TARGET), "lets others write");
}

#[test]
fn remove_is_idempotent_and_refuses_unexpected_content() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    f.store.remove(TARGET).unwrap(); // nothing there, not even the root
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    f.store.claim(TARGET, "sb1", |_| true).unwrap();
    f.store
        .set_runtime_cli(TARGET, "/usr/bin/crust-runtime")
        .unwrap();
    let dir = f.store.record_dir(TARGET).unwrap();
    fs::create_dir(dir.join("junk")).unwrap();
    let e = f.store.remove(TARGET).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    assert!(e.to_string().contains("junk"), "{e}");
    assert_eq!(
        names(&dir),
        ["junk", "mountInfo.json", "runtime-cli", "sb1"]
    );
    fs::remove_dir(dir.join("junk")).unwrap();
    fs::write(dir.join("not valid!"), "").unwrap();
    assert!(f.store.remove(TARGET).is_err());
    assert_eq!(names(&dir).len(), 4);
    fs::remove_file(dir.join("not valid!")).unwrap();
    // sb1 still claims it: kept until the claim goes or is known stale.
    let e = f.store.remove(TARGET).unwrap_err();
    assert!(matches!(e, HandoffError::StillClaimed { .. }), "{e}");
    assert_eq!(names(&dir).len(), 3);
    f.store.remove_with(TARGET, |id| id != "sb1").unwrap();
    assert!(!dir.exists());
    assert!(f.root.exists(), "the root stays");
    f.store.remove(TARGET).unwrap();
    assert!(matches!(
        f.store.read(TARGET),
        Err(HandoffError::NotFound(_))
    ));
}

#[test]
fn claims_stale_claims_and_release() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    assert_eq!(
        f.store.claim(TARGET, "sb1", |_| true).unwrap_err().kind(),
        ErrorKind::NotFound,
        "no record, no claim"
    );
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    let dir = f.store.record_dir(TARGET).unwrap();
    assert_eq!(f.store.claimant(TARGET).unwrap(), None);
    f.store
        .claim(TARGET, "sb1", |_| panic!("no other claimant to ask about"))
        .unwrap();
    f.store.claim(TARGET, "sb1", |_| true).unwrap(); // idempotent
    assert_eq!(f.store.claimant(TARGET).unwrap().as_deref(), Some("sb1"));

    // A live other claimant wins.
    let e = f.store.claim(TARGET, "sb2", |id| id == "sb1").unwrap_err();
    match &e {
        HandoffError::Claimed { by, .. } => assert_eq!(by, "sb1"),
        other => panic!("{other}"),
    }
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    assert_eq!(names(&dir), ["mountInfo.json", "sb1"]);

    // A dead one is replaced.
    let asked = std::cell::RefCell::new(Vec::new());
    f.store
        .claim(TARGET, "sb2", |id| {
            asked.borrow_mut().push(id.to_string());
            false
        })
        .unwrap();
    assert_eq!(asked.into_inner(), ["sb1"]);
    assert_eq!(names(&dir), ["mountInfo.json", "sb2"]);
    assert_eq!(mode(&dir.join("sb2")), 0o600);

    // runtime-cli: exact bytes, no newline; read trims one written by hand.
    f.store
        .set_runtime_cli(TARGET, "/usr/bin/crust-runtime")
        .unwrap();
    assert_eq!(
        fs::read(dir.join("runtime-cli")).unwrap(),
        b"/usr/bin/crust-runtime"
    );
    assert_eq!(mode(&dir.join("runtime-cli")), 0o600);
    fs::write(dir.join("runtime-cli"), "/bin/kata-runtime\n").unwrap();
    assert_eq!(
        f.store.runtime_cli(TARGET).unwrap().as_deref(),
        Some("/bin/kata-runtime")
    );
    fs::write(dir.join("runtime-cli"), "bin/evil\n").unwrap();
    assert_eq!(
        f.store.runtime_cli(TARGET).unwrap_err().kind(),
        ErrorKind::FailedPrecondition
    );
    f.store
        .set_runtime_cli(TARGET, "/usr/bin/crust-runtime")
        .unwrap();

    let state = f.store.inspect(TARGET).unwrap();
    assert_eq!(state.claimant.as_deref(), Some("sb2"));
    assert_eq!(state.runtime_cli.as_deref(), Some("/usr/bin/crust-runtime"));

    // Releasing someone else's id changes nothing; releasing ours drops the
    // claim and the runtime-cli with it.
    f.store.release(TARGET, "sb1").unwrap();
    assert_eq!(names(&dir), ["mountInfo.json", "runtime-cli", "sb2"]);
    f.store.release(TARGET, "sb2").unwrap();
    f.store.release(TARGET, "sb2").unwrap();
    assert_eq!(names(&dir), ["mountInfo.json"]);
    assert_eq!(f.store.runtime_cli(TARGET).unwrap(), None);
    f.store.remove(TARGET).unwrap();
    f.store.release(TARGET, "sb2").unwrap(); // record gone: still Ok
}

#[test]
fn claimant_follows_kata_first_name_rule() {
    let dev = block_dev();
    let f = fixture(Layout::Kata, Policy::default());
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    let dir = f.store.record_dir(TARGET).unwrap();
    fs::write(dir.join("zzz"), "").unwrap();
    fs::write(dir.join("AAA"), "").unwrap();
    assert_eq!(f.store.claimant(TARGET).unwrap().as_deref(), Some("AAA"));
    // Claiming with both dead removes both stale claims.
    f.store.claim(TARGET, "new", |_| false).unwrap();
    assert_eq!(names(&dir), ["mountInfo.json", "new"]);
}

#[test]
fn list_ignores_foreign_names_and_reports_bad_records() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    f.store
        .stage("/p/a", &MountInfo::block(&dev, "ext4"))
        .unwrap();
    f.store
        .stage("/p/b", &MountInfo::block(&dev, "xfs"))
        .unwrap();
    // The crust root may share a directory with the ops socket.
    let _sock = std::os::unix::net::UnixListener::bind(f.root.join("ops.sock")).unwrap();
    fs::write(f.root.join("README"), "x").unwrap();
    plant(&f, "/p/c", b"{garbage");
    let listed = f.store.list().unwrap();
    assert_eq!(listed.len(), 3);
    let mut good: Vec<String> = listed
        .iter()
        .filter_map(|r| r.state.as_ref().ok().map(|s| s.mount_info.fstype.clone()))
        .collect();
    good.sort();
    assert_eq!(good, ["ext4", "xfs"]);
    let bad: Vec<_> = listed.iter().filter(|r| r.state.is_err()).collect();
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].key, crust_key("/p/c"));
    assert!(listed.iter().all(|r| r.target.is_none()));
}

#[test]
fn find_for_source_walks_up_to_the_stop_layer_only() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    let layer = "/var/lib/kubelet/pods/9f3c/volumes";
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();

    let m = f.store.find_for_source(TARGET, layer).unwrap().unwrap();
    assert_eq!(m.target, TARGET);
    assert_eq!(m.subpath, "");
    assert_eq!(m.mount_info.fstype, "ext4");

    let m = f
        .store
        .find_for_source(&format!("{TARGET}/data/logs"), layer)
        .unwrap()
        .unwrap();
    assert_eq!(m.target, TARGET);
    assert_eq!(m.subpath, "data/logs");

    // Not a path, or unrelated: nothing.
    assert_eq!(f.store.find_for_source("proc", layer).unwrap(), None);
    assert_eq!(f.store.find_for_source("/etc/hosts", layer).unwrap(), None);
    assert_eq!(
        f.store
            .find_for_source(
                "/var/lib/kubelet/pods/9f3c/volumes/kubernetes.io~csi/pvc-2/mount",
                layer
            )
            .unwrap(),
        None
    );
    let e = f
        .store
        .find_for_source(&format!("{TARGET}/../x"), layer)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);

    // A record above the stop layer is never reached.
    f.store
        .stage("/var/lib/kubelet/pods/9f3c", &MountInfo::block(&dev, "xfs"))
        .unwrap();
    f.store
        .stage("/var/lib/kubelet", &MountInfo::block(&dev, "xfs"))
        .unwrap();
    assert_eq!(
        f.store
            .find_for_source(
                "/var/lib/kubelet/pods/9f3c/volumes/kubernetes.io~csi/pvc-2/mount/sub",
                layer
            )
            .unwrap(),
        None
    );
    // The stop layer itself is the last place probed.
    f.store
        .stage(layer, &MountInfo::block(&dev, "xfs"))
        .unwrap();
    let m = f
        .store
        .find_for_source(
            "/var/lib/kubelet/pods/9f3c/volumes/kubernetes.io~csi/pvc-2/mount",
            layer,
        )
        .unwrap()
        .unwrap();
    assert_eq!(m.target, layer);
    assert_eq!(m.subpath, "kubernetes.io~csi/pvc-2/mount");

    // The nearest record wins, and a forged one is an error, not skipped.
    let m = f
        .store
        .find_for_source(&format!("{TARGET}/x"), layer)
        .unwrap()
        .unwrap();
    assert_eq!(m.target, TARGET);
    plant(
        &f,
        &format!("{TARGET}/x"),
        br#"{"volume-type":"block","device":"/dev/null","fstype":"ext4"}"#,
    );
    let e = f
        .store
        .find_for_source(&format!("{TARGET}/x/y"), layer)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
}

#[test]
fn find_for_source_skips_paths_outside_the_prefixes() {
    let dev = block_dev();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("r");
    let open = Store::new(Layout::Kata, &root, Policy::default()).unwrap();
    let strict = Store::new(
        Layout::Kata,
        &root,
        Policy {
            allowed_target_prefixes: vec!["/var/lib/kubelet/pods".into()],
            ..Policy::default()
        },
    )
    .unwrap();
    open.stage("/srv/vol", &MountInfo::block(&dev, "ext4"))
        .unwrap();
    assert!(
        open.find_for_source("/srv/vol/a", "/srv")
            .unwrap()
            .is_some()
    );
    assert_eq!(strict.find_for_source("/srv/vol/a", "/srv").unwrap(), None);
    assert_eq!(
        strict.read("/srv/vol").unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

#[test]
fn concurrent_claimers_exactly_one_wins() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    for round in 0..10 {
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|i| {
                    let store = f.store.clone();
                    s.spawn(move || store.claim(TARGET, &format!("r{round}-sb{i}"), |_| true))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let winners = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(winners, 1, "round {round}: {results:?}");
        assert!(
            results
                .iter()
                .filter_map(|r| r.as_ref().err())
                .all(|e| matches!(e, HandoffError::Claimed { .. }))
        );
        let holder = f.store.claimant(TARGET).unwrap().unwrap();
        f.store.release(TARGET, &holder).unwrap();
    }
}

#[test]
fn concurrent_stage_and_remove_leave_a_consistent_state() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    std::thread::scope(|s| {
        for i in 0..4 {
            let store = f.store.clone();
            let dev = dev.clone();
            s.spawn(move || {
                for _ in 0..50 {
                    if i % 2 == 0 {
                        store
                            .stage(TARGET, &MountInfo::block(&dev, "ext4"))
                            .unwrap();
                    } else {
                        store.remove(TARGET).unwrap();
                    }
                }
            });
        }
    });
    // Either a complete record or none; never a half-written one or a temp.
    let dir = f.store.record_dir(TARGET).unwrap();
    if dir.exists() {
        assert_eq!(names(&dir), ["mountInfo.json"]);
        assert_eq!(
            f.store.read(TARGET).unwrap(),
            MountInfo::block(&dev, "ext4")
        );
    }
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    assert_eq!(names(&dir), ["mountInfo.json"]);
}

#[test]
fn remove_refuses_a_live_claim_and_takes_a_stale_one_along() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    f.store.claim(TARGET, "sb1", |_| true).unwrap();
    f.store
        .set_runtime_cli(TARGET, "/usr/bin/crust-runtime")
        .unwrap();
    let dir = f.store.record_dir(TARGET).unwrap();
    let all = ["mountInfo.json", "runtime-cli", "sb1"];

    // A claim is a sandbox whose VM may have the device: refused, kept.
    let e = f.store.remove(TARGET).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    assert_eq!(
        e.to_string(),
        format!("volume at {TARGET} is still claimed by sandbox sb1; stop the sandbox first")
    );
    assert_eq!(names(&dir), all);
    // The caller says it still runs: the same.
    let asked = std::cell::RefCell::new(Vec::new());
    let e = f
        .store
        .remove_with(TARGET, |id| {
            asked.borrow_mut().push(id.to_string());
            true
        })
        .unwrap_err();
    assert!(
        matches!(&e, HandoffError::StillClaimed { by, .. } if by == "sb1"),
        "{e}"
    );
    assert_eq!(asked.into_inner(), ["sb1"]);
    assert_eq!(names(&dir), all);
    // A second claimant nobody vouched for keeps it too.
    fs::write(dir.join("sb2"), "").unwrap();
    fs::set_permissions(dir.join("sb2"), fs::Permissions::from_mode(0o600)).unwrap();
    let e = f.store.remove_with(TARGET, |id| id != "sb1").unwrap_err();
    assert!(
        matches!(&e, HandoffError::StillClaimed { by, .. } if by == "sb2"),
        "{e}"
    );
    assert_eq!(names(&dir), ["mountInfo.json", "runtime-cli", "sb1", "sb2"]);
    // Released by its sandbox: removable.
    f.store.release(TARGET, "sb2").unwrap();
    f.store.release(TARGET, "sb1").unwrap();
    f.store.remove(TARGET).unwrap();
    assert!(!dir.exists());

    // Stale (the caller established that the sandbox is dead): it goes.
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    f.store.claim(TARGET, "sb1", |_| true).unwrap();
    f.store.remove_with(TARGET, |_| false).unwrap();
    assert!(!dir.exists());
    f.store.remove_with(TARGET, |_| true).unwrap(); // nothing left: Ok
}

#[test]
fn kata_layout_removes_despite_a_sandbox_file() {
    // Kata keeps its <sandbox-id> file after the sandbox stops, so in that
    // layout a claim says nothing about liveness.
    let dev = block_dev();
    let f = fixture(Layout::Kata, Policy::default());
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    f.store.claim(TARGET, "c9be9e0c63af5a", |_| true).unwrap();
    let dir = f.store.record_dir(TARGET).unwrap();
    f.store
        .remove_with(TARGET, |_| panic!("not asked in the Kata layout"))
        .unwrap();
    assert!(!dir.exists());
}

#[test]
fn a_root_others_can_write_or_someone_else_owns_is_refused() {
    let dev = block_dev();
    let f = fixture(Layout::Crust, Policy::default());
    f.store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    let dir = f.store.record_dir(TARGET).unwrap();
    let before = fs::read(dir.join("mountInfo.json")).unwrap();
    let check = |why: &str| {
        let e = f.store.read(TARGET).unwrap_err();
        assert!(matches!(e, HandoffError::UnsafeRoot { .. }), "{e}");
        assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
        assert!(
            e.to_string().contains(why) && e.to_string().contains(f.root.to_str().unwrap()),
            "{e}"
        );
        for r in [
            f.store.stage(TARGET, &MountInfo::block(&dev, "xfs")),
            f.store.claim(TARGET, "sb", |_| true),
            f.store.remove(TARGET),
            f.store
                .find_for_source(TARGET, "/var/lib/kubelet/pods")
                .map(|_| ()),
            f.store.list().map(|_| ()),
        ] {
            assert!(matches!(r, Err(HandoffError::UnsafeRoot { .. })), "{r:?}");
        }
        assert_eq!(names(&dir), ["mountInfo.json"], "nothing changed");
        assert_eq!(fs::read(dir.join("mountInfo.json")).unwrap(), before);
    };
    for loose in [0o777, 0o1777, 0o720, 0o702] {
        fs::set_permissions(&f.root, fs::Permissions::from_mode(loose)).unwrap();
        check("lets group or others write");
        assert_eq!(mode(&f.root), loose, "refused, not silently fixed");
    }
    fs::set_permissions(&f.root, fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(f.store.read(TARGET).unwrap().fstype, "ext4", "0755 is fine");
    if rustix::process::geteuid().is_root() {
        std::os::unix::fs::chown(&f.root, Some(65534), None).unwrap();
        check("owned by uid 65534");
        std::os::unix::fs::chown(&f.root, Some(0), None).unwrap();
    }
    fs::set_permissions(&f.root, fs::Permissions::from_mode(0o700)).unwrap();
    f.store.remove(TARGET).unwrap();
}

/// Records Kata accepts are read as Kata reads them: keys in any case,
/// unknown keys ignored, no volume-type, `directvol`, `createFilesystem`;
/// an `encryptionKey` is refused, never acted on or passed along.
#[test]
fn kata_valid_records_are_read() {
    let dev = block_dev();
    let f = fixture(Layout::Kata, Policy::default());
    for (record, create_fs) in [
        (format!(r#"{{"Device":"{dev}","fstype":"ext4"}}"#), None),
        (
            format!(
                r#"{{"volume-type":"directvol","device":"{dev}","FsType":"ext4","metadata":{{"createFilesystem":"true","fsGroup":"5"}},"nodeName":"n"}}"#
            ),
            Some(true),
        ),
        (
            format!(
                r#"{{"volume-type":"block","device":"{dev}","fstype":"ext4","metadata":{{"createFilesystem":"false","driverHint":"x"}}}}"#
            ),
            Some(false),
        ),
    ] {
        plant(&f, TARGET, record.as_bytes());
        let mi = f
            .store
            .read(TARGET)
            .unwrap_or_else(|e| panic!("{record}: {e}"));
        assert_eq!(
            (mi.device.as_str(), mi.fstype.as_str()),
            (dev.as_str(), "ext4")
        );
        assert_eq!(mi.create_filesystem(), Ok(create_fs), "{record}");
    }
    for (record, why) in [
        (
            format!(
                r#"{{"device":"{dev}","fstype":"ext4","metadata":{{"encryptionKey":"ephemeral"}}}}"#
            ),
            "must never",
        ),
        (
            format!(r#"{{"volume-type":"blk","device":"{dev}","fstype":"ext4"}}"#),
            "unknown",
        ),
        (
            format!(r#"{{"device":"{dev}","Device":"/dev/null","fstype":"ext4"}}"#),
            "duplicate",
        ),
    ] {
        plant(&f, TARGET, record.as_bytes());
        assert_bad(f.store.read(TARGET), why);
    }
}

#[test]
fn stage_claimed_writes_the_claim_before_the_record() {
    let f = fixture(Layout::Crust, Policy::default());
    let dev = block_dev();
    let mi = sample(&dev);
    // A crash after the claim file, before mountInfo.json: invisible to
    // readers and claimers, completed by a retry.
    let dir = f.root.join(crust_key(TARGET));
    fs::create_dir_all(&dir).unwrap();
    for p in [&f.root, &dir] {
        fs::set_permissions(p, fs::Permissions::from_mode(0o700)).unwrap();
    }
    fs::write(dir.join("sb-old"), b"").unwrap();
    fs::set_permissions(dir.join("sb-old"), fs::Permissions::from_mode(0o600)).unwrap();
    assert!(matches!(
        f.store.read(TARGET),
        Err(HandoffError::NotFound(_))
    ));
    assert!(f.store.find_for_source(TARGET, TARGET).unwrap().is_none());
    assert!(matches!(
        f.store.claim(TARGET, "sb-x", |_| true),
        Err(HandoffError::NotFound(_))
    ));

    f.store
        .stage_claimed(TARGET, &mi, "sb-a", Some("/usr/bin/crust-runtime"))
        .unwrap();
    assert_eq!(names(&dir), ["mountInfo.json", "runtime-cli", "sb-a"]);
    let st = f.store.inspect(TARGET).unwrap();
    assert_eq!(st.mount_info, mi);
    assert_eq!(st.claimant.as_deref(), Some("sb-a"));
    assert_eq!(st.runtime_cli.as_deref(), Some("/usr/bin/crust-runtime"));
    for n in names(&dir) {
        assert_eq!(mode(&dir.join(n)), 0o600);
    }
    // Idempotent for the same sandbox; another sandbox is refused.
    f.store
        .stage_claimed(TARGET, &mi, "sb-a", Some("/usr/bin/crust-runtime"))
        .unwrap();
    let e = f
        .store
        .stage_claimed(TARGET, &mi, "sb-b", Some("/usr/bin/crust-runtime"))
        .unwrap_err();
    assert!(
        matches!(&e, HandoffError::Claimed { by, .. } if by == "sb-a"),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    // A complete record is never discarded as partial.
    assert!(!f.store.discard_partial(TARGET).unwrap());
    assert_eq!(f.store.claimant(TARGET).unwrap().as_deref(), Some("sb-a"));
    f.store.release(TARGET, "sb-a").unwrap();
    f.store.remove(TARGET).unwrap();

    // A partial directory is discarded whole.
    fs::create_dir_all(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(dir.join("sb-c"), b"").unwrap();
    fs::set_permissions(dir.join("sb-c"), fs::Permissions::from_mode(0o600)).unwrap();
    assert!(f.store.discard_partial(TARGET).unwrap());
    assert!(!dir.exists());
    assert!(
        f.store.discard_partial(TARGET).unwrap(),
        "nothing there: Ok"
    );
    // The Kata layout has no runtime-cli.
    let k = fixture(Layout::Kata, Policy::default());
    assert!(matches!(
        k.store.stage_claimed(TARGET, &mi, "sb-a", Some("/x")),
        Err(HandoffError::Unsupported(_))
    ));
}

/// Issue 42, item 2: a record another tool wrote (Kata's driver: no
/// device identity) gets the identity found at the first plug, in both
/// layouts, and keeps the rest of the record; an identity already there
/// is never replaced; no record is NOT_FOUND.
#[test]
fn the_first_plugs_identity_is_pinned_once() {
    for layout in [Layout::Kata, Layout::Crust] {
        let f = fixture(layout, Policy::default());
        let dev = block_dev();
        let missing = f
            .store
            .pin_device_identity(TARGET, "file:7:0:12:5")
            .unwrap_err();
        assert_eq!(missing.kind(), ErrorKind::NotFound, "{missing}");
        f.store.stage(TARGET, &sample(&dev)).unwrap();
        assert!(
            f.store
                .pin_device_identity(TARGET, "file:7:0:12:5")
                .unwrap()
        );
        let mi = f.store.read(TARGET).unwrap();
        assert_eq!(
            mi.metadata
                .get(crust_handoff::DEVICE_IDENTITY_KEY)
                .map(String::as_str),
            Some("file:7:0:12:5")
        );
        assert_eq!(
            (mi.device.as_str(), mi.fs_group()),
            (dev.as_str(), Some(100))
        );
        assert!(
            !f.store
                .pin_device_identity(TARGET, "file:7:0:99:5")
                .unwrap()
        );
        assert_eq!(
            f.store.read(TARGET).unwrap().metadata[crust_handoff::DEVICE_IDENTITY_KEY],
            "file:7:0:12:5",
            "never replaced"
        );
    }
}
