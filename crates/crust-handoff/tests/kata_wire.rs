//! Kata-layout records against Kata's own readers and writers (facts from
//! kata-containers: `src/runtime/pkg/direct-volume/utils.go` (Go runtime
//! and CLI), `src/libs/kata-types/src/mount.rs` plus runtime-rs'
//! `rawblock_volume.rs` (Rust runtime), and `src/tools/csi-kata-directvolume`
//! (Kata's CSI driver)). Issue 25, items 3, 4 and 8 (store side).

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;

use crust_handoff::{Layout, MountInfo, Policy, Store, kata_key};

const TARGET: &str = "/var/lib/kubelet/pods/9f3c/volumes/kubernetes.io~csi/pvc-1/mount";

fn block_dev() -> String {
    let mut devs: Vec<PathBuf> = fs::read_dir("/dev")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().map(|t| t.is_block_device()).unwrap_or(false))
        .map(|e| e.path())
        .collect();
    devs.sort();
    devs[0].to_str().unwrap().to_string()
}

fn kata_store() -> (tempfile::TempDir, Store) {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::new(Layout::Kata, tmp.path().join("dv"), Policy::default()).unwrap();
    (tmp, store)
}

fn on_disk(store: &Store) -> String {
    fs::read_to_string(store.root().join(kata_key(TARGET)).join("mountInfo.json")).unwrap()
}

/// runtime-rs' `DirectVolumeMountInfo` (kata-types): serde with exact
/// field names, `metadata`/`options` defaulted.
#[derive(Debug, serde::Deserialize)]
#[allow(dead_code)]
struct RuntimeRsMountInfo {
    #[serde(rename = "volume-type")]
    volume_type: String,
    device: String,
    #[serde(rename = "fstype")]
    fs_type: String,
    #[serde(default)]
    metadata: HashMap<String, String>,
    #[serde(default)]
    options: Vec<String>,
}

/// What runtime-rs does with a record before it touches the device:
/// decode, then `RawblockVolume::new`'s check (`volume type {:?} is invalid`
/// unless `directvol`).
fn runtime_rs_accepts(json: &str) -> Result<RuntimeRsMountInfo, String> {
    let mi: RuntimeRsMountInfo = serde_json::from_str(json).map_err(|e| e.to_string())?;
    if mi.volume_type != "directvol" {
        return Err(format!("volume type {:?} is invalid", mi.volume_type));
    }
    Ok(mi)
}

/// Item 3: whatever crust writes in the Kata layout (its own writers and
/// `direct-volume add` with Kata's design-doc spelling) passes runtime-rs'
/// rule; Kata's Go runtime never reads the field, and crust still reads
/// `block` and no volume type at all.
#[test]
fn records_written_in_the_kata_layout_pass_runtime_rs() {
    let dev = block_dev();
    let (_t, store) = kata_store();
    store
        .stage(TARGET, &MountInfo::block(&dev, "ext4"))
        .unwrap();
    let mi = runtime_rs_accepts(&on_disk(&store)).unwrap();
    assert_eq!(
        (mi.device.as_str(), mi.fs_type.as_str()),
        (dev.as_str(), "ext4")
    );
    store.remove(TARGET).unwrap();
    store
        .stage_claimed(TARGET, &MountInfo::block(&dev, "xfs"), "sb1", None)
        .unwrap();
    runtime_rs_accepts(&on_disk(&store)).unwrap();
    store.remove(TARGET).unwrap();
    // Kata's design doc: `"volume-type": "block"`, a `Device` key.
    for given in [
        format!(r#"{{"volume-type":"block","Device":"{dev}","fstype":"ext4"}}"#),
        format!(r#"{{"device":"{dev}","fstype":"ext4"}}"#),
        format!(r#"{{"volume-type":"block","device":"{dev}","fstype":"ext4","options":null}}"#),
    ] {
        store.stage_bytes(TARGET, given.as_bytes()).unwrap();
        let written = on_disk(&store);
        assert_eq!(
            written,
            format!(r#"{{"volume-type":"directvol","device":"{dev}","fstype":"ext4"}}"#),
            "{given}"
        );
        runtime_rs_accepts(&written).unwrap();
        store.remove(TARGET).unwrap();
    }
    // Reading stays lenient: block, none, directvol.
    for vt in [
        r#""volume-type":"block","#,
        "",
        r#""volume-type":"directvol","#,
    ] {
        let dir = store.root().join(kata_key(TARGET));
        store
            .stage(TARGET, &MountInfo::block(&dev, "ext4"))
            .unwrap();
        fs::write(
            dir.join("mountInfo.json"),
            format!(r#"{{{vt}"device":"{dev}","fstype":"ext4"}}"#),
        )
        .unwrap();
        assert_eq!(store.read(TARGET).unwrap().device, dev, "{vt}");
        store.remove(TARGET).unwrap();
    }
}

/// Item 4 (store side): the bytes Kata's CSI driver hands `direct-volume
/// add` (Go's json.Marshal of its MountInfo: the whole volume context as
/// metadata, `["bind","rw"]`) are stored as given, like Kata's `Add`;
/// bytes some reader would take differently are stored canonically.
#[test]
fn add_stores_the_callers_bytes_when_every_reader_reads_them_alike() {
    let dev = block_dev();
    let (_t, store) = kata_store();
    let driver = format!(
        r#"{{"volume-type":"directvol","device":"{dev}","fstype":"ext4","metadata":{{"capacity_in_bytes":"268435456","createFilesystem":"true","direct_volume_name":"pvc-1","is_directvolume":"True","katacontainers.direct.volume/fstype":"ext4","katacontainers.direct.volume/volumetype":"directvol","storage.kubernetes.io/csiProvisionerIdentity":"1700000000000-8081-directvolume.csi.katacontainers.io"}},"options":["bind","rw"]}}"#
    );
    let mi = store.stage_bytes(TARGET, driver.as_bytes()).unwrap();
    assert_eq!(on_disk(&store), driver, "stored byte for byte");
    assert_eq!(mi.options, ["bind", "rw"]);
    assert_eq!(mi.create_filesystem(), Ok(Some(true)));
    runtime_rs_accepts(&on_disk(&store)).unwrap();
    assert_eq!(store.read(TARGET).unwrap(), mi);
    // The same record again, spelled differently: nothing rewritten.
    let spaced = driver.replace(",", " , ");
    store.stage_bytes(TARGET, spaced.as_bytes()).unwrap();
    assert_eq!(on_disk(&store), driver);
    store.remove(TARGET).unwrap();

    // Go folds U+017F onto `s`: "f\u017ftype" IS the fstype for Kata, so
    // crust reads it so too (and a second fstype is a duplicate).
    let folded = format!(r#"{{"volume-type":"directvol","device":"{dev}","f\u017ftype":"xfs"}}"#);
    let mi = store.stage_bytes(TARGET, folded.as_bytes()).unwrap();
    assert_eq!(mi.fstype, "xfs");
    // runtime-rs would not see that key: canonical bytes are stored.
    assert_eq!(
        on_disk(&store),
        format!(r#"{{"volume-type":"directvol","device":"{dev}","fstype":"xfs"}}"#)
    );
    store.remove(TARGET).unwrap();
    for dup in [
        format!(r#"{{"device":"{dev}","Device":"/dev/null","fstype":"ext4"}}"#),
        format!(r#"{{"device":"{dev}","fstype":"ext4","f\u017fTYPE":"xfs"}}"#),
        format!(r#"{{"device":"{dev}","fstype":"ext4","metadata":{{"a":"1","a":"2"}}}}"#),
    ] {
        let e = store.stage_bytes(TARGET, dup.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("duplicate"), "{dup}: {e}");
        assert!(!store.root().join(kata_key(TARGET)).exists(), "{dup}");
    }
}

/// Item 8 (store side): an unusable fsGroup, fsGroupChangePolicy or
/// createFilesystem is not a broken record (Kata's Go runtime logs and
/// skips each); an encryption key still is.
#[test]
fn unusable_non_essential_metadata_is_read_and_ignored() {
    let dev = block_dev();
    let (_t, store) = kata_store();
    let rec = format!(
        r#"{{"volume-type":"directvol","device":"{dev}","fstype":"ext4","metadata":{{"fsGroup":"abc","fsGroupChangePolicy":"Sometimes","createFilesystem":"maybe"}},"options":["bind","rw"]}}"#
    );
    let mi = store.stage_bytes(TARGET, rec.as_bytes()).unwrap();
    let read = store.read(TARGET).unwrap();
    assert_eq!(read, mi);
    assert_eq!(read.fs_group(), None);
    assert_eq!(read.fs_group_change_policy(), None);
    let warnings = crust_handoff::validate::metadata_warnings(&read);
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(
        warnings.iter().all(|w| w.contains("ignored")),
        "{warnings:?}"
    );
    let key = format!(
        r#"{{"device":"{dev}","fstype":"ext4","metadata":{{"fsGroup":"abc","encryptionKey":"k"}}}}"#
    );
    let e = store.stage_bytes(TARGET, key.as_bytes()).unwrap_err();
    assert!(e.to_string().contains("must never"), "{e}");
}

/// Item 1, the rule: a regular file is a volume's disk only beneath a
/// configured root, reached without a symlink, through directories that
/// only root can change (a root-owned sticky directory such as /tmp
/// included), and itself not writable by others. Kata's driver layout
/// `<storage>/<volume id>/directvol-rawdisk.<size>` (dirs 0750, file 0644)
/// passes; each way to swap the file is refused, naming the setting.
#[test]
fn file_devices_follow_one_rule() {
    use crust_handoff::validate::open_file_device;
    use std::os::unix::fs::{PermissionsExt, symlink};
    const SETTING: &str = "--file-device-roots (TEST_VAR)";
    let tmp = tempfile::tempdir().unwrap(); // under /tmp: root-owned, sticky
    let storage = tmp.path().join("kata-directvol-storages");
    let vol = storage.join("62a268d9-893a-11ee-97cb-d89d6725e7b0");
    fs::create_dir_all(&vol).unwrap();
    for d in [&storage, &vol] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o750)).unwrap();
    }
    let disk = vol.join("directvol-rawdisk.64M");
    fs::File::create(&disk).unwrap().set_len(64 << 20).unwrap();
    fs::set_permissions(&disk, fs::Permissions::from_mode(0o644)).unwrap();
    let roots = vec![storage.clone()];
    let d = disk.to_str().unwrap();
    let fd = open_file_device(d, &roots, SETTING, true).unwrap();
    assert_eq!(
        rustix::fs::fstat(&fd).unwrap().st_ino,
        std::os::unix::fs::MetadataExt::ino(&fs::metadata(&disk).unwrap())
    );
    assert!(
        rustix::fs::fcntl_getfl(&fd)
            .unwrap()
            .contains(rustix::fs::OFlags::RDWR)
    );

    // Outside every root, or no roots at all: the refusal names the setting.
    for roots in [vec![], vec![tmp.path().join("elsewhere")]] {
        let e = open_file_device(d, &roots, SETTING, false).unwrap_err();
        assert!(e.contains(SETTING) && e.contains("outside"), "{e}");
    }
    // A symlink anywhere on the path.
    let link_dir = storage.join("linked");
    symlink(&vol, &link_dir).unwrap();
    let via = link_dir.join("directvol-rawdisk.64M");
    let e = open_file_device(via.to_str().unwrap(), &roots, SETTING, false).unwrap_err();
    assert!(e.contains("symlink"), "{e}");
    let link_file = vol.join("disk-link");
    symlink(&disk, &link_file).unwrap();
    let e = open_file_device(link_file.to_str().unwrap(), &roots, SETTING, false).unwrap_err();
    assert!(e.contains("symlink"), "{e}");
    // A directory others may write to (not sticky), then one not root's.
    fs::set_permissions(&vol, fs::Permissions::from_mode(0o777)).unwrap();
    let e = open_file_device(d, &roots, SETTING, false).unwrap_err();
    assert!(e.contains("writable by group or others"), "{e}");
    fs::set_permissions(&vol, fs::Permissions::from_mode(0o1777)).unwrap();
    rustix::fs::chown(&vol, Some(rustix::fs::Uid::from_raw(65534)), None).unwrap();
    let e = open_file_device(d, &roots, SETTING, false).unwrap_err();
    assert!(e.contains("owned by uid 65534"), "{e}");
    rustix::fs::chown(&vol, Some(rustix::fs::Uid::ROOT), None).unwrap();
    fs::set_permissions(&vol, fs::Permissions::from_mode(0o750)).unwrap();
    // The file itself writable by others.
    fs::set_permissions(&disk, fs::Permissions::from_mode(0o666)).unwrap();
    let e = open_file_device(d, &roots, SETTING, false).unwrap_err();
    assert!(e.contains("file") && e.contains("writable"), "{e}");
    fs::set_permissions(&disk, fs::Permissions::from_mode(0o644)).unwrap();
    // A record naming it goes through the same rule when read.
    let (_t, store) = kata_store();
    let store = Store::new(
        Layout::Kata,
        store.root(),
        Policy {
            file_device_roots: roots.clone(),
            file_device_setting: SETTING.into(),
            ..Policy::default()
        },
    )
    .unwrap();
    store
        .stage_bytes(TARGET, kata_driver_bytes(d).as_bytes())
        .unwrap();
    assert_eq!(store.read(TARGET).unwrap().device, d);
    fs::set_permissions(&vol, fs::Permissions::from_mode(0o770)).unwrap();
    let e = store.read(TARGET).unwrap_err().to_string();
    assert!(e.contains("writable by group or others"), "{e}");
}

fn kata_driver_bytes(dev: &str) -> String {
    format!(
        r#"{{"volume-type":"directvol","device":"{dev}","fstype":"ext4","metadata":{{"is_directvolume":"True"}},"options":["bind","rw"]}}"#
    )
}
