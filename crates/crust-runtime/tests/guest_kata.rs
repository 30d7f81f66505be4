//! crust-runtime as a drop-in for Kata, replayed with the exact exchange
//! of Kata's own tools (facts taken from kata-containers: the Go CLI's
//! `kata-volume.go`, `pkg/direct-volume`, `shimclient`, the Go shim's
//! `shim_management.go`, runtime-rs' `shim_mgmt` handlers):
//!
//! * a record as Kata accepts it (keys in any case, unknown keys,
//!   `directvol`, `createFilesystem=true` on a blank device) is consumed;
//! * the sandbox id is the first entry of the record directory that is not
//!   `mountInfo.json`; the shim socket is `/run/vc/sbs/<id>/shim-monitor.sock`,
//!   else `/run/kata/<id>/shim-monitor.sock` (temp dirs here);
//! * `GET /direct-volume/stats?path=<url.PathEscape(device)>` with Go's
//!   client headers answers Kata's JSON (units 1/2, zero fields left out);
//!   runtime-rs' POST is served too;
//! * `POST /direct-volume/resize` with `{"VolumePath":…,"Size":…}` (Go)
//!   and `{"volume_guest_path":…,"size":…}` (runtime-rs) grow the volume;
//! * an error answer is text (`NOT_FOUND: ...`), which no JSON reader
//!   takes for stats (Kata's CLI prints it with exit status 0);
//! * the links are gone after teardown.
//!
//! Time budget: about 15 s (one TCG boot).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use crust_testkit::{LoopDisk, VmSlot};
use serde_json::Value;

/// Go's `url.PathEscape`: unreserved characters and `$&+:=@` stay, the
/// rest (including `/`) becomes `%XX` in upper-case hex.
fn go_path_escape(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~$&+:=@".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Kata's `GetSandboxIDForVolume`: the first directory entry that is not
/// `mountInfo.json` (Go's os.ReadDir sorts by name).
fn kata_sandbox_id(record_dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(record_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
        .into_iter()
        .find(|n| n != "mountInfo.json")
        .expect("a sandbox file")
}

/// Kata's `ClientSocketAddress`: the Go runtime's path, else the Rust one.
fn kata_socket(go_dir: &Path, rust_dir: &Path, id: &str) -> PathBuf {
    let go = go_dir.join(id).join("shim-monitor.sock");
    if std::fs::metadata(&go).is_ok() {
        return go;
    }
    let rust = rust_dir.join(id).join("shim-monitor.sock");
    std::fs::metadata(&rust).unwrap_or_else(|e| {
        panic!(
            "it fails to stat both {} and {}: {e}",
            go.display(),
            rust.display()
        )
    });
    rust
}

/// One request as Go's net/http client writes it for Kata's shimclient
/// (`http://shim<path>`, DisableKeepAlives); returns (status, body).
fn go_request(sock: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: shim\r\nUser-Agent: Go-http-client/1.1\r\n");
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Length: {}\r\nContent-Type: application/json\r\n",
            b.len()
        ));
    }
    req.push_str("Connection: close\r\nAccept-Encoding: gzip\r\n\r\n");
    req.push_str(body.unwrap_or(""));
    s.write_all(req.as_bytes()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_string())
}

fn plant_kata_record(kata_root: &Path, target: &str, json: &str) -> PathBuf {
    let dir = kata_root.join(crust_handoff::kata_key(target));
    std::fs::create_dir_all(&dir).unwrap();
    for d in [kata_root, dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let f = dir.join("mountInfo.json");
    std::fs::write(&f, json).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    dir
}

fn usage_of(stats: &Value, unit: u64) -> (u64, u64, u64) {
    let u = stats["usage"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["unit"] == unit)
        .unwrap_or_else(|| panic!("no unit {unit} in {stats}"));
    let n = |k: &str| u[k].as_u64().unwrap_or(0);
    (n("total"), n("used"), n("available"))
}

#[test]
fn kata_cli_and_shim_exchange_replayed() {
    let env = Env::new();
    let go_dir = env.dir.path().join("vc-sbs");
    let rust_dir = env.dir.path().join("kata-run");
    // A blank device: only createFilesystem may (and must) format it.
    let disk = LoopDisk::new(env.files.join("kata.img"), 256 * MIB);
    let dev = disk.dev_str().to_string();
    let target = env.target("pod-k", "pv-kata");
    // Kata-valid, crust-hostile until now: key case, directvol, unknown key.
    let record_dir = plant_kata_record(
        &env.kata,
        &target,
        &format!(
            r#"{{"volume-type":"directvol","Device":"{dev}","FsType":"ext4","metadata":{{"createFilesystem":"true","fsGroup":"2000"}},"nodeName":"node-1"}}"#
        ),
    );
    {
        let _slot = VmSlot::acquire();
        let b = env.bundle(
            "kata",
            &["sleep", "600"],
            vec![bind("/data", &target, false)],
        );
        env.ok(&["create", "--bundle", b.to_str().unwrap(), "kata1"]);
        let sb = env.sandbox("kata1");
        let st = sb.state();
        let vid = st["volumes"][0]["id"].as_str().unwrap().to_string();
        let gp = format!("/run/crust/volumes/{vid}");
        // createFilesystem formatted the blank device, fsGroup applied.
        let mounts = sb.sh("cat /proc/mounts");
        assert!(
            mounts.lines().any(|l| l.contains(&format!(" {gp} ext4 "))),
            "{mounts}"
        );
        assert_eq!(sb.sh(&format!("stat -c %g {gp}")).trim(), "2000");
        assert_eq!(
            crust_blockdev::probe_fs(Path::new(&dev)).unwrap(),
            crust_blockdev::Probe::Fs(crust_blockdev::FsType::Ext4)
        );
        sb.sh(&format!("echo from-kata > {gp}/f && sync"));

        // --- what `kata-runtime direct-volume stats --volume-path T` does ---
        let id = kata_sandbox_id(&record_dir);
        assert_eq!(id, "kata1");
        let sock = kata_socket(&go_dir, &rust_dir, &id);
        assert_eq!(sock, go_dir.join("kata1/shim-monitor.sock"));
        assert!(std::fs::metadata(&sock).unwrap().file_type().is_socket());
        assert!(
            std::fs::metadata(rust_dir.join("kata1/shim-monitor.sock"))
                .unwrap()
                .file_type()
                .is_socket()
        );
        let escaped = go_path_escape(&dev);
        assert!(escaped.starts_with("%2Fdev%2Floop"), "{escaped}");
        let (status, body) = go_request(
            &sock,
            "GET",
            &format!("/direct-volume/stats?path={escaped}"),
            None,
        );
        assert_eq!(status, 200, "{body}");
        let stats: Value = serde_json::from_str(&body).unwrap();
        // Kata's numeric units and Go's omitempty.
        assert!(
            !body.contains("BYTES") && !body.contains("\"abnormal\""),
            "{body}"
        );
        let (total, used, avail) = usage_of(&stats, 1);
        let (df_total, df_used, df_avail) = parse_df(&sb.sh(&format!("df -P -B1 {gp}")));
        assert_eq!(
            (total, used, avail),
            (df_total, df_used, df_avail),
            "{body}"
        );
        let (it, iu, ia) = usage_of(&stats, 2);
        assert_eq!((it, iu, ia), parse_df_i(&sb.sh(&format!("df -P -i {gp}"))));
        // crust_ops reads it as the runtime's stats.
        let parsed = crust_ops::parse::parse_stats(body.as_bytes()).unwrap();
        assert_eq!(parsed.usage.len(), 2);

        // runtime-rs routes stats as POST.
        let (status, post_body) = go_request(
            &sock,
            "POST",
            &format!("/direct-volume/stats?path={escaped}"),
            Some(""),
        );
        assert_eq!(status, 200, "{post_body}");

        // `crust-runtime direct-volume stats` prints that body, parsed by
        // clap (flags) or answered before clap (settings from the
        // environment, as crust_ops runs it: crust_runtime::poll) alike.
        let args = ["direct-volume", "stats", "--volume-path", target.as_str()];
        let by_flags = env.ok(&args);
        let out = env.run_from_env(&args);
        assert!(out.status.success(), "{out:?}");
        let by_env = String::from_utf8(out.stdout).unwrap();
        for printed in [&by_flags, &by_env] {
            let v: Value = serde_json::from_str(printed).unwrap();
            assert_eq!(v, stats, "{printed}");
        }
        let out = env.run_from_env(&["direct-volume", "stats", "--volume-path=/dev/nothing"]);
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("no hand-off record"),
            "{out:?}"
        );

        // --- `direct-volume resize --size N`: Go's ResizeRequest ---
        let mut size = 256 * MIB;
        for body in [
            r#"{"VolumePath":"DEV","Size":SIZE}"#,
            r#"{"volume_guest_path":"DEV","size":SIZE}"#,
        ] {
            size += 64 * MIB;
            disk.grow_file(size);
            let body = body.replace("DEV", &dev).replace("SIZE", &size.to_string());
            let (status, resp) = go_request(&sock, "POST", "/direct-volume/resize", Some(&body));
            assert_eq!(status, 200, "{body}: {resp}");
            let (t, _, _) = parse_df(&sb.sh(&format!("df -P -B1 {gp}")));
            assert!(t > df_total, "{body}: ext4 grew online ({df_total} -> {t})");
        }

        // --- an error answer: what Kata's CLI prints with exit status 0 ---
        let (status, err) = go_request(
            &sock,
            "GET",
            &format!(
                "/direct-volume/stats?path={}",
                go_path_escape("/dev/crust-none")
            ),
            None,
        );
        assert_eq!(status, 404, "{err}");
        // Text, as Kata's shim answers: no JSON reader takes it for stats.
        assert!(err.starts_with("NOT_FOUND: "), "{err}");
        assert!(serde_json::from_str::<Value>(&err).is_err(), "{err}");
        assert!(crust_ops::parse::parse_stats(err.as_bytes()).is_err());

        // --- Kata's lookup order: without the Go path, the Rust one ---
        std::fs::remove_file(go_dir.join("kata1/shim-monitor.sock")).unwrap();
        let sock = kata_socket(&go_dir, &rust_dir, &id);
        assert_eq!(sock, rust_dir.join("kata1/shim-monitor.sock"));
        let (status, _) = go_request(
            &sock,
            "GET",
            &format!("/direct-volume/stats?path={escaped}"),
            None,
        );
        assert_eq!(status, 200);

        env.ok(&["delete", "--force", "kata1"]);
        for d in [&go_dir, &rust_dir] {
            assert!(!d.join("kata1").exists(), "{} left", d.display());
        }
    }
    // The data survived; nothing was formatted twice.
    let m = disk.mount_temp(&[], true);
    assert_eq!(
        std::fs::read_to_string(m.path().join("f")).unwrap(),
        "from-kata\n"
    );
    drop(m);
    drop(disk);
    assert_clean(&env);
}

/// Without `createFilesystem` a blank device is never formatted: the
/// sandbox fails to mount it, saying so, and the device stays blank.
/// With `encryptionKey` the record is refused before anything starts.
#[test]
fn blank_without_create_filesystem_and_encryption_keys_are_refused() {
    let env = Env::new();
    let disk = LoopDisk::new(env.files.join("blank.img"), 64 * MIB);
    let dev = disk.dev_str().to_string();
    let t1 = env.target("pod-b", "pv-blank");
    plant_kata_record(
        &env.kata,
        &t1,
        &format!(
            r#"{{"device":"{dev}","fstype":"ext4","metadata":{{"createFilesystem":"false"}}}}"#
        ),
    );
    let t2 = env.target("pod-e", "pv-enc");
    plant_kata_record(
        &env.kata,
        &t2,
        &format!(
            r#"{{"device":"{dev}","fstype":"ext4","metadata":{{"encryptionKey":"ephemeral"}}}}"#
        ),
    );
    let b = env.bundle("enc", &["true"], vec![bind("/data", &t2, false)]);
    let err = env.fails(&["create", "--bundle", b.to_str().unwrap(), "enc"]);
    assert!(
        err.contains("encryptionKey") && err.contains("must never"),
        "{err}"
    );
    assert!(!env.root.join("enc").exists());
    {
        let _slot = VmSlot::acquire();
        let b = env.bundle("blank", &["true"], vec![bind("/data", &t1, false)]);
        let err = env.fails(&["create", "--bundle", b.to_str().unwrap(), "blank"]);
        eprintln!("blank device, createFilesystem=false: {err}");
        assert!(!env.root.join("blank").exists());
    }
    assert_eq!(
        crust_blockdev::probe_fs(Path::new(&dev)).unwrap(),
        crust_blockdev::Probe::Blank,
        "never formatted"
    );
    drop(disk);
    assert_clean(&env);
}

/// Issue 24: `createFilesystem=true` on a device whose data has no
/// signature (zero edges, data only at 32 MiB) is refused, not formatted:
/// the runtime has no records of the device, so only a full read could
/// prove it blank, and that read finds the data. The bytes stay.
#[test]
fn create_filesystem_never_formats_data_without_a_signature() {
    use std::os::unix::fs::FileExt;
    let env = Env::new();
    let disk = LoopDisk::new(env.files.join("middle.img"), 64 * MIB);
    let payload: Vec<u8> = (0..MIB).map(|i| (i * 29 + 5) as u8).collect();
    let dev_file = std::fs::OpenOptions::new()
        .write(true)
        .open(disk.dev())
        .unwrap();
    dev_file.write_all_at(&payload, 32 * MIB).unwrap();
    dev_file.sync_all().unwrap();
    drop(dev_file);
    let before = std::fs::read(disk.file()).unwrap();
    let dev = disk.dev_str().to_string();
    let t = env.target("pod-m", "pv-middle");
    plant_kata_record(
        &env.kata,
        &t,
        &format!(
            r#"{{"device":"{dev}","fstype":"ext4","metadata":{{"createFilesystem":"true"}}}}"#
        ),
    );
    {
        let _slot = VmSlot::acquire();
        let b = env.bundle("middle", &["true"], vec![bind("/data", &t, false)]);
        let err = env.fails(&["create", "--bundle", b.to_str().unwrap(), "middle"]);
        assert!(err.contains("holds data"), "{err}");
        assert!(!env.root.join("middle").exists());
    }
    assert!(
        std::fs::read(disk.file()).unwrap() == before,
        "the device's bytes are unchanged"
    );
    drop(disk);
    assert_clean(&env);
}

/// Issue 25 items 1, 2, 6, 8 in a guest: a volume exactly as Kata's CSI
/// driver (csi-kata-directvolume) makes it: a root-owned regular file
/// `<storage>/<volume id>/directvol-rawdisk.64M` (dirs 0750, file 0644,
/// formatted by the driver), its record as the driver marshals it
/// (`directvol`, the volume context as metadata, `["bind","rw"]`), plus an
/// unusable `fsGroup`. The sandbox mounts it; QEMU holds the file through
/// the descriptor crust opened (no path on its command line); Kata's stats
/// request is answered; `/metrics` answers kata-monitor's scrape; the
/// data is in the file afterwards.
#[test]
fn kata_csi_driver_file_volume_in_a_guest() {
    use std::os::unix::fs::MetadataExt;
    let env = Env::new();
    let storage = env.dir.path().join("kata-directvol-storages");
    let vol = storage.join("62a268d9-893a-11ee-97cb-d89d6725e7b0");
    std::fs::create_dir_all(&vol).unwrap();
    for d in [&storage, &vol] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o750)).unwrap();
    }
    let file = vol.join("directvol-rawdisk.64M");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mkfs = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&file)
        .status()
        .unwrap();
    assert!(mkfs.success());
    let dev = file.display().to_string();
    let target = env.target("pod-f", "pvc-file");
    let record = format!(
        r#"{{"volume-type":"directvol","device":"{dev}","fstype":"ext4","metadata":{{"capacity_in_bytes":"67108864","direct_volume_name":"pvc-file","fsGroup":"abc","is_directvolume":"True","katacontainers.direct.volume/fstype":"ext4","katacontainers.direct.volume/volumetype":"directvol","storage.kubernetes.io/csiProvisionerIdentity":"1700000000000-8081-directvolume.csi.katacontainers.io"}},"options":["bind","rw"]}}"#
    );
    let record_dir = plant_kata_record(&env.kata, &target, &record);
    {
        let _slot = VmSlot::acquire();
        let b = env.bundle("kf", &["sleep", "600"], vec![bind("/data", &target, false)]);
        // The roots as a deployment gives them (the shim inherits them).
        let out = env.run_with_vars(
            &[("CRUST_RUNTIME_FILE_DEVICE_ROOTS", &storage)],
            &["create", "--bundle", b.to_str().unwrap(), "kf"],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let sb = env.sandbox("kf");
        let vid = sb.state()["volumes"][0]["id"].as_str().unwrap().to_string();
        let gp = format!("/run/crust/volumes/{vid}");
        let mounts = sb.sh("cat /proc/mounts");
        assert!(
            mounts
                .lines()
                .any(|l| l.contains(&format!(" {gp} ext4 rw"))),
            "{mounts}"
        );
        // fsGroup "abc" ignored: no group change, the sandbox runs.
        assert_eq!(sb.sh(&format!("stat -c %g {gp}")).trim(), "0");
        sb.sh(&format!("echo from-kata-file > {gp}/f && sync"));

        // QEMU got the file as a descriptor, never its path.
        let qemu = sb.qemu_pid();
        let cmdline = std::fs::read(format!("/proc/{qemu}/cmdline")).unwrap();
        assert!(!String::from_utf8_lossy(&cmdline).contains("directvol-rawdisk"));
        let ino = std::fs::metadata(&file).unwrap().ino();
        let held = std::fs::read_dir(format!("/proc/{qemu}/fd"))
            .unwrap()
            .flatten()
            .any(|e| std::fs::metadata(e.path()).is_ok_and(|m| m.ino() == ino && m.is_file()));
        assert!(held, "QEMU holds the file");

        // Kata's `direct-volume stats`: the record's device is the file.
        let id = kata_sandbox_id(&record_dir);
        let sock = kata_socket(
            &env.dir.path().join("vc-sbs"),
            &env.dir.path().join("kata-run"),
            &id,
        );
        let (status, body) = go_request(
            &sock,
            "GET",
            &format!("/direct-volume/stats?path={}", go_path_escape(&dev)),
            None,
        );
        assert_eq!(status, 200, "{body}");
        let stats: Value = serde_json::from_str(&body).unwrap();
        let (total, used, _) = usage_of(&stats, 1);
        assert!(total > 50 * MIB && used > 0, "{body}");

        // Item 2 at the hot-plug door: an option the guest refuses stops
        // the plug before QEMU gets the device.
        let t2 = env.target("pod-f", "pvc-bad");
        plant_kata_record(
            &env.kata,
            &t2,
            &record.replace(r#"["bind","rw"]"#, r#"["bind","rw","errors=panic"]"#),
        );
        let err = env.fails(&["add-volume", "kf", "--volume-path", &t2]);
        assert!(err.contains("errors=panic"), "{err}");
        assert_eq!(sb.state()["volumes"].as_array().unwrap().len(), 1);

        // Item 6: what kata-monitor scrapes (shimclient.DoGet("/metrics")
        // on the same socket, then Prometheus text format 0.0.4).
        let (status, metrics) = go_request(&sock, "GET", "/metrics", None);
        assert_eq!(status, 200, "{metrics}");
        for line in [
            "crust_hypervisor_up 1".to_string(),
            "crust_guest_up 1".to_string(),
            "# TYPE crust_volume_stats_used_bytes gauge".to_string(),
            format!(
                "crust_volume_stats_capacity_bytes{{volume_path=\"{target}\",device=\"{dev}\"}} {total}"
            ),
            format!(
                "crust_volume_stats_health_status_abnormal{{volume_path=\"{target}\",device=\"{dev}\"}} 0"
            ),
        ] {
            assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
        }
        // kata-monitor adds these itself; a second one would break its encoder.
        assert!(!metrics.contains("sandbox_id="), "{metrics}");
        env.ok(&["delete", "--force", "kf"]);
    }
    let out = std::process::Command::new("debugfs")
        .args(["-R", "cat /f"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-kata-file\n");
    assert_clean(&env);
}
