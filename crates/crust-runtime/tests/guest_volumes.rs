//! One real guest with three deferred volumes (ext4 and xfs, CRUST and
//! Kata layouts): mount options, fsGroup under both policies, subPath,
//! stats against the guest's own `df`, the shim API over its unix socket
//! (stats, resize in every body spelling), teardown, and the bytes the
//! workload wrote, read back from the devices on the host afterwards.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use common::*;
use crust_blockdev::FsType;
use crust_handoff::{FsGroupChangePolicy, Layout, MountInfo};
use serde_json::Value;

/// A plain HTTP/1.1 request over the shim's unix socket (independent of
/// the runtime's own client).
fn http(sock: &Path, method: &str, path: &str, body: &str) -> (u16, Value) {
    let (status, text) = http_text(sock, method, path, body);
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {status} {text}")),
    )
}

/// The status and raw body (a `/direct-volume/*` error is text, `CODE: …`).
fn http_text(sock: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status: u16 = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_string())
}

/// Escapes like Go's url.PathEscape would, plus `~` (to exercise decoding).
fn escape(p: &str) -> String {
    p.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._/".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn usage(stats: &Value, unit: &str) -> (u64, u64, u64) {
    let u = stats["usage"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["unit"] == unit)
        .unwrap_or_else(|| panic!("no {unit} usage in {stats}"));
    (
        u["total"].as_u64().unwrap(),
        u["used"].as_u64().unwrap(),
        u["available"].as_u64().unwrap(),
    )
}

fn mount_line<'a>(mounts: &'a str, mountpoint: &str) -> &'a str {
    mounts
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(mountpoint))
        .unwrap_or_else(|| panic!("{mountpoint} not mounted in the guest:\n{mounts}"))
}

#[test]
fn volumes_in_guest() {
    let env = Env::new();
    {
        // --- disks and records --------------------------------------------
        // a: ext4, CRUST layout, fsGroup 2000 Always, also used via subPath.
        let a = env.disk("a.img", 64 * MIB, FsType::Ext4);
        a.with_host_mount(false, |m| {
            std::fs::create_dir_all(m.join("sub/dir")).unwrap();
            std::fs::write(m.join("old.txt"), b"old").unwrap();
            std::fs::set_permissions(m.join("old.txt"), std::fs::Permissions::from_mode(0o644))
                .unwrap();
        });
        // b: xfs, Kata layout, fsGroup 3000 OnRootMismatch with a root that
        // already matches: the file inside must be left alone.
        let b = env.disk("b.img", 320 * MIB, FsType::Xfs);
        b.with_host_mount(false, |m| {
            std::fs::write(m.join("keep.txt"), b"keep").unwrap();
            std::fs::set_permissions(m.join("keep.txt"), std::fs::Permissions::from_mode(0o644))
                .unwrap();
            std::os::unix::fs::chown(m, Some(0), Some(3000)).unwrap();
            std::fs::set_permissions(m, std::fs::Permissions::from_mode(0o2770)).unwrap();
        });
        // c: ext4, CRUST layout, fsGroup 4000 OnRootMismatch, root mismatching.
        let c = env.disk("c.img", 32 * MIB, FsType::Ext4);
        c.with_host_mount(false, |m| {
            std::fs::write(m.join("f.txt"), b"f").unwrap();
            std::fs::set_permissions(m.join("f.txt"), std::fs::Permissions::from_mode(0o600))
                .unwrap();
        });

        // e: ext4, CRUST layout, read-only by its record (`ro` option).
        let e = env.disk("e.img", 32 * MIB, FsType::Ext4);
        // d: hot-plugged into the running sandbox later.
        let d = env.disk("d.img", 32 * MIB, FsType::Ext4);

        let ta = env.target("pod-1", "pv-a");
        let tb = env.target("pod-1", "pv-b");
        let tc = env.target("pod-1", "pv-c");
        let mut mia = MountInfo::block(a.dev_str(), "ext4");
        mia.options = vec!["noatime".into(), "nodev".into()];
        mia.set_fs_group(Some(2000));
        mia.set_fs_group_change_policy(Some(FsGroupChangePolicy::Always));
        env.stage(Layout::Crust, &ta, &mia);
        // The Kata record goes through the Kata-compatible CLI, spelled the
        // way seed 000 spells it (capitalised key, no volume-type).
        env.ok(&[
            "direct-volume",
            "add",
            "--volume-path",
            &tb,
            "--mount-info",
            &format!(
                r#"{{"Device": "{}", "fstype": "xfs", "metadata": {{"fsGroup": "3000", "fsGroupChangePolicy": "OnRootMismatch"}}, "options": ["nosuid"]}}"#,
                b.dev_str()
            ),
        ]);
        let kata_dir = env.kata.join(crust_handoff::kata_key(&tb));
        let mi_meta = std::fs::metadata(kata_dir.join("mountInfo.json")).unwrap();
        assert_eq!(mi_meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::metadata(&kata_dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let mut mic = MountInfo::block(c.dev_str(), "ext4");
        mic.set_fs_group(Some(4000));
        mic.set_fs_group_change_policy(Some(FsGroupChangePolicy::OnRootMismatch));
        env.stage(Layout::Crust, &tc, &mic);
        let te = env.target("pod-1", "pv-e");
        let mut mie = MountInfo::block(e.dev_str(), "ext4");
        mie.options = vec!["ro".into()];
        env.stage(Layout::Crust, &te, &mie);

        let script = "echo hello-a > /data-a/from-guest.txt && echo hello-sub > /data-sub/sub.txt \
                      && echo hello-b > /data-b/from-guest.txt && sync && echo written && exec sleep 600";
        let bundle = env.bundle(
            "b1",
            &["sh", "-c", script],
            vec![
                serde_json::json!({"destination": "/proc", "type": "proc", "source": "proc"}),
                bind("/data-a", &ta, false),
                bind("/data-sub", &format!("{ta}/sub/dir"), false),
                bind("/data-b", &tb, false),
                bind("/data-b-ro", &tb, true),
                bind("/data-c", &tc, false),
                bind("/data-e", &te, false),
                bind("/etc/hosts", "/etc/hosts", true),
            ],
        );

        // --- create -----------------------------------------------------------
        let _slot = VmSlot::acquire();
        let sb = env.sandbox("vols");
        let pid_file = env.dir.path().join("vols.pid");
        env.ok(&[
            "create",
            "--bundle",
            bundle.to_str().unwrap(),
            "--pid-file",
            pid_file.to_str().unwrap(),
            "vols",
        ]);
        let st = sb.state();
        assert_eq!(
            std::fs::read_to_string(&pid_file).unwrap(),
            st["pid"].to_string()
        );
        assert_eq!(st["status"], "created");
        assert_eq!(st["ociVersion"], "1.0.2");
        assert_eq!(st["bundle"], bundle.to_str().unwrap());
        assert!(pid_alive(st["pid"].as_i64().unwrap() as i32));
        let vols = st["volumes"].as_array().unwrap();
        assert_eq!(vols.len(), 4, "{st}");
        let vol = |t: &str| vols.iter().find(|v| v["target"] == t).unwrap().clone();
        let (va, vb, vc) = (vol(&ta), vol(&tb), vol(&tc));
        assert_eq!(
            (va["layout"].as_str(), vb["layout"].as_str()),
            (Some("crust"), Some("kata"))
        );
        // The poll CLI recorded for crust_ops (below) answers stats as the
        // runtime does.
        let poll = std::fs::canonicalize(env!("CARGO_BIN_EXE_crust-runtime-poll")).unwrap();
        let by_poll = env.run_from_env_with(&poll, &["crust", "stats", &ta]);
        assert!(by_poll.status.success(), "{by_poll:?}");
        let by_poll: serde_json::Value = serde_json::from_slice(&by_poll.stdout).unwrap();
        assert_eq!(
            by_poll["usage"],
            env.json(&["crust", "stats", &ta])["usage"]
        );
        assert_eq!(st["skippedMounts"], serde_json::json!(["/etc/hosts"]));
        let id_of = |v: &Value| v["id"].as_str().unwrap().to_string();
        let (ga, gb, gc) = (
            format!("/run/crust/volumes/{}", id_of(&va)),
            format!("/run/crust/volumes/{}", id_of(&vb)),
            format!("/run/crust/volumes/{}", id_of(&vc)),
        );

        // Hand-off bookkeeping: claimant and runtime-cli (CRUST), claimant (Kata).
        let crust = env.store(Layout::Crust);
        let rec = crust.inspect(&ta).unwrap();
        assert_eq!(rec.claimant.as_deref(), Some("vols"));
        // The small poll CLI installed next to the runtime (see poll_cli.rs).
        assert_eq!(rec.runtime_cli.as_deref(), poll.to_str());
        assert_eq!(
            env.store(Layout::Kata).claimant(&tb).unwrap().as_deref(),
            Some("vols")
        );

        // A second create with the same id is refused, the first untouched.
        let err = env.fails(&["create", "--bundle", bundle.to_str().unwrap(), "vols"]);
        assert!(err.contains("already exists"), "{err}");
        assert_eq!(sb.state()["status"], "created");

        // --- start and what the guest sees ------------------------------------
        env.ok(&["start", "vols"]);
        assert_eq!(sb.state()["status"], "running");
        let list = env.json(&["list"]);
        assert_eq!(list[0]["id"], "vols");
        assert_eq!(list[0]["status"], "running");
        wait_for("the workload's writes", Duration::from_secs(60), || {
            let logs = env.ok(&["logs", "vols"]);
            logs.contains("written").then_some(())
        });

        let mounts = sb.sh("cat /proc/mounts");
        let la = mount_line(&mounts, &ga);
        assert!(
            la.contains(" ext4 ") && la.contains("noatime") && la.contains("nodev"),
            "{la}"
        );
        let lb = mount_line(&mounts, &gb);
        assert!(
            lb.contains(" xfs ") && lb.contains("nosuid") && lb.contains("rw,"),
            "{lb}"
        );
        assert!(
            mount_line(&mounts, "/data-b-ro").contains(" ro,"),
            "{mounts}"
        );
        assert!(mount_line(&mounts, "/data-b").contains(" rw,"), "{mounts}");
        for d in ["/data-a", "/data-sub", "/data-c"] {
            mount_line(&mounts, d);
        }
        assert!(!mounts.contains("/etc/hosts"), "{mounts}");
        let (code, _, _) = sb.exec(&["sh", "-c", "echo x > /data-b-ro/nope"]);
        assert_ne!(code, 0, "a read-only mount accepted a write");
        // A record marked `ro`: the disk itself is read-only in the guest.
        assert_eq!(vol(&te)["readonly"], true);
        let ge = format!("/run/crust/volumes/{}", id_of(&vol(&te)));
        assert!(mount_line(&mounts, &ge).contains(" ro,"), "{mounts}");
        assert!(mount_line(&mounts, "/data-e").contains(" ro,"), "{mounts}");
        let ro = sb.sh(&format!(
            "cat /sys/block/$(awk '$2==\"{ge}\"{{print $1}}' /proc/mounts | cut -d/ -f3)/ro"
        ));
        assert_eq!(ro.trim(), "1");
        let (code, _, _) = sb.exec(&["sh", "-c", "echo x > /data-e/nope"]);
        assert_ne!(code, 0, "a read-only volume accepted a write");

        // fsGroup Always: root and pre-existing entries get the group.
        let owners = sb.sh(&format!(
            "stat -c '%g %a' {ga} {ga}/old.txt {ga}/sub/dir {ga}/from-guest.txt"
        ));
        assert_eq!(
            owners.lines().collect::<Vec<_>>(),
            ["2000 2775", "2000 664", "2000 2775", "2000 644"],
            "{owners}"
        );
        // OnRootMismatch with a matching root: the walk is skipped.
        let owners = sb.sh(&format!("stat -c '%u %g %a' {gb} {gb}/keep.txt"));
        assert_eq!(
            owners.lines().collect::<Vec<_>>(),
            ["0 3000 2770", "0 0 644"],
            "{owners}"
        );
        // OnRootMismatch with a mismatching root: applied.
        let owners = sb.sh(&format!("stat -c '%g %a' {gc} {gc}/f.txt"));
        assert_eq!(
            owners.lines().collect::<Vec<_>>(),
            ["4000 2775", "4000 660"],
            "{owners}"
        );

        // subPath: the workload's file landed in the volume's sub/dir.
        assert_eq!(sb.sh(&format!("cat {ga}/sub/dir/sub.txt")), "hello-sub\n");

        // --- stats: the runtime's figures are the guest's df figures ---------
        for (target, guest) in [(&ta, &ga), (&tb, &gb)] {
            let stats = env.json(&["crust", "stats", target]);
            assert_eq!(stats["volume_condition"]["abnormal"], false, "{stats}");
            let (df_total, df_used, df_avail) = parse_df(&sb.sh(&format!("df -P -B1 {guest}")));
            assert_eq!(
                usage(&stats, "BYTES"),
                (df_total, df_used, df_avail),
                "{stats}"
            );
            let (i_total, i_used, i_free) = parse_df_i(&sb.sh(&format!("df -P -i {guest}")));
            assert_eq!(
                usage(&stats, "INODES"),
                (i_total, i_used, i_free),
                "{stats}"
            );
            // The Kata-compatible entry point answers the same figures, in
            // Kata's shim spelling (units 1/2).
            let kata = env.json(&["direct-volume", "stats", "--volume-path", target]);
            assert_eq!(kata["usage"][0]["unit"], 1, "{kata}");
            assert_eq!(kata["usage"][1]["unit"], 2, "{kata}");
            assert_eq!(
                serde_json::from_value::<crust_sandbox::stats::VolumeStats>(kata).unwrap(),
                serde_json::from_value::<crust_sandbox::stats::VolumeStats>(stats.clone()).unwrap()
            );
        }

        // --- shim API over the unix socket --------------------------------------
        let sock = env.root.join("vols/shim.sock");
        assert_eq!(
            std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let cli_stats = env.json(&["crust", "stats", &ta]);
        let (code, by_target) = http(
            &sock,
            "GET",
            &format!("/direct-volume/stats?path={}", escape(&ta)),
            "",
        );
        // The shim answers in Kata's spelling (units as numbers), the
        // CLI in the KEP's: the same figures.
        let as_stats = |v: &Value| {
            serde_json::from_value::<crust_sandbox::stats::VolumeStats>(v.clone()).unwrap()
        };
        assert_eq!(code, 200);
        assert_eq!(by_target["usage"][0]["unit"], 1, "{by_target}");
        assert_eq!(as_stats(&by_target), as_stats(&cli_stats));
        // Kata's CLI sends the device path.
        let (code, by_device) = http(
            &sock,
            "GET",
            &format!("/direct-volume/stats?path={}", escape(a.dev_str())),
            "",
        );
        assert_eq!(code, 200);
        assert_eq!(as_stats(&by_device), as_stats(&cli_stats));
        let (code, err) = http_text(&sock, "GET", "/direct-volume/stats?path=%2Fno%2Fsuch", "");
        assert_eq!(code, 404, "{err}");
        assert!(err.starts_with("NOT_FOUND: "), "{err}");

        // Resize b (xfs) online three times, once per body spelling.
        let mut size = 320 * MIB;
        for spelling in [
            r#"{"volumePath": "PATH", "size": SIZE}"#,
            r#"{"VolumePath": "PATH", "Size": "SIZE"}"#,
            r#"{"volume_guest_path": "PATH", "size": SIZE}"#,
        ] {
            size += 32 * MIB;
            b.grow_file(size);
            let body = spelling
                .replace("PATH", &tb)
                .replace("SIZE", &size.to_string());
            let (code, resp) = http(&sock, "POST", "/direct-volume/resize", &body);
            assert_eq!(
                (code, resp["capacity_bytes"].as_u64()),
                (200, Some(size)),
                "{body}: {resp}"
            );
            let guest_dev = sb.sh(&format!(
                "blockdev --getsize64 $(awk '$2==\"{gb}\"{{print $1}}' /proc/mounts)"
            ));
            assert_eq!(guest_dev.trim().parse::<u64>().unwrap(), size);
        }
        let (df_total, _, _) = parse_df(&sb.sh(&format!("df -P -B1 {gb}")));
        assert!(df_total > 320 * MIB, "xfs did not grow: {df_total}");
        assert_eq!(
            usage(&env.json(&["crust", "stats", &tb]), "BYTES").0,
            df_total
        );
        // A size the device does not have is refused, nothing changes.
        let body = format!(r#"{{"volumePath": "{tb}", "size": {}}}"#, size + MIB);
        let (code, err) = http_text(&sock, "POST", "/direct-volume/resize", &body);
        assert_eq!(code, 416, "{err}");
        assert!(err.starts_with("OUT_OF_RANGE: "), "{err}");
        let (code, err) = http_text(&sock, "POST", "/direct-volume/resize", r#"{"size": 1}"#);
        assert_eq!(code, 400, "{err}");
        assert!(err.starts_with("INVALID_ARGUMENT: "), "{err}");

        // --- hot-plug a volume into the running sandbox ---------------------------
        let td = env.target("pod-1", "pv-d");
        env.stage(Layout::Crust, &td, &MountInfo::block(d.dev_str(), "ext4"));
        let vd = env.json(&["add-volume", "vols", "--volume-path", &td]);
        let gd = format!("/run/crust/volumes/{}", vd["id"].as_str().unwrap());
        assert!(mount_line(&sb.sh("cat /proc/mounts"), &gd).contains(" ext4 "));
        sb.sh(&format!("echo hot > {gd}/hot.txt && sync"));
        assert_eq!(
            env.json(&["add-volume", "vols", "--volume-path", &td]),
            vd,
            "idempotent"
        );
        assert_eq!(crust.claimant(&td).unwrap().as_deref(), Some("vols"));
        let (df_total, _, _) = parse_df(&sb.sh(&format!("df -P -B1 {gd}")));
        assert_eq!(
            usage(&env.json(&["crust", "stats", &td]), "BYTES").0,
            df_total
        );
        let err = env.fails(&[
            "add-volume",
            "vols",
            "--volume-path",
            &env.target("pod-1", "pv-none"),
        ]);
        assert!(err.contains("no hand-off record"), "{err}");

        // The Kata record cannot be removed while the sandbox uses it.
        let err = env.fails(&["direct-volume", "remove", "--volume-path", &tb]);
        assert!(err.contains("claimed by sandbox vols"), "{err}");

        // --- teardown ---------------------------------------------------------------
        let err = env.fails(&["delete", "vols"]);
        assert!(err.contains("running"), "{err}");
        let qemu = sb.qemu_pid();
        env.ok(&["kill", "vols", "TERM"]);
        let st = wait_for("the workload to stop", Duration::from_secs(60), || {
            let st = sb.state();
            (st["status"] == "stopped").then_some(st)
        });
        assert_eq!(st["exitStatus"], 143, "{st}");
        assert!(pid_alive(qemu), "the VM must stay up until delete");
        // The stopped workload's VM still holds the volumes.
        assert!(crust_sandbox::sandbox::SandboxStore::new(&env.root).holds_volumes("vols"));
        // So crust_ops (a NodeUnpublishVolume arriving before the sandbox is
        // deleted) keeps the record: the runtime says the sandbox runs.
        let e = env.unstage(&td).unwrap_err();
        assert!(matches!(e, crust_ops::OpsError::StillClaimed { .. }), "{e}");
        assert!(
            e.to_string().starts_with(&format!(
                "volume at {td} is still claimed by sandbox vols; stop the sandbox first"
            )),
            "{e}"
        );
        assert_eq!(crust.claimant(&td).unwrap().as_deref(), Some("vols"));
        assert!(crust.runtime_cli(&td).unwrap().is_some());
        env.ok(&["delete", "vols"]);
        assert!(!env.root.join("vols").exists());
        assert!(!pid_alive(qemu));
        let rec = crust.inspect(&ta).unwrap();
        assert_eq!(
            (rec.claimant, rec.runtime_cli),
            (None, None),
            "claim and runtime-cli released"
        );
        assert!(env.store(Layout::Kata).claimant(&tb).unwrap().is_none());
        assert!(
            crust.exists(&ta).unwrap(),
            "the record itself belongs to the CSI plugin and stays"
        );
        let err = env.fails(&["state", "vols"]);
        assert!(err.contains("does not exist"), "{err}");
        env.ok(&["delete", "--force", "vols"]);
        drop(sb);
        assert_eq!(
            crust.claimant(&td).unwrap(),
            None,
            "the hot-plugged volume was released too"
        );
        // The usual order (sandbox deleted, then NodeUnpublishVolume): the
        // record goes without a question to the runtime.
        env.unstage(&td).unwrap();
        assert!(!crust.exists(&td).unwrap());
        env.ok(&["direct-volume", "remove", "--volume-path", &tb]);
        assert!(!kata_dir.exists());
        env.ok(&["direct-volume", "remove", "--volume-path", &tb]);

        // --- run: create + start + wait + delete, exit status passed on ---------
        let check = "test \"$(cat /data/from-guest.txt)\" = hello-a && echo again > /data/run.txt && sync && exit 7";
        let rb = env.bundle("run", &["sh", "-c", check], vec![bind("/data", &ta, false)]);
        let runner = env.sandbox("runner");
        let out = env.run(&["run", "--bundle", rb.to_str().unwrap(), "runner"]);
        assert_eq!(out.status.code(), Some(7), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "7\n");
        assert!(!env.root.join("runner").exists());
        assert_eq!(crust.claimant(&ta).unwrap(), None);
        drop(runner);

        // --- the bytes are on the devices ---------------------------------------------
        a.with_host_mount(true, |m| {
            assert_eq!(
                std::fs::read_to_string(m.join("from-guest.txt")).unwrap(),
                "hello-a\n"
            );
            assert_eq!(
                std::fs::read_to_string(m.join("sub/dir/sub.txt")).unwrap(),
                "hello-sub\n"
            );
            assert_eq!(std::fs::metadata(m.join("old.txt")).unwrap().gid(), 2000);
            assert_eq!(
                std::fs::read_to_string(m.join("run.txt")).unwrap(),
                "again\n"
            );
        });
        d.with_host_mount(true, |m| {
            assert_eq!(std::fs::read_to_string(m.join("hot.txt")).unwrap(), "hot\n");
        });
        b.with_host_mount(true, |m| {
            assert_eq!(
                std::fs::read_to_string(m.join("from-guest.txt")).unwrap(),
                "hello-b\n"
            );
            let st = rustix::fs::statvfs(m).unwrap();
            assert!(st.f_blocks * st.f_frsize > 320 * MIB);
        });
    }
    assert_clean(&env);
}

use crust_testkit::VmSlot;
