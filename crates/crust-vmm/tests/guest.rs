//! Real QEMU guests running the real agent on real loop devices.
//!
//! Needs root and the guest image: run `guest/build-image.sh` first (CI
//! does). Each test boots one guest and holds a `VmSlot` throughout.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::time::Duration;

use common::*;
use crust_agent_proto::stdio::{Output, StdioMux};
use crust_agent_proto::{
    ContainerMount, ContainerPids, CreateContainer, ErrorCode, Exec, FsGroupPolicy, FsType,
    MountSource, MountVolume, ProcessRef, ProcessSpec, RemoveContainer, Rootfs, SignalProcess,
    StartContainer, StdioSpec, WaitProcess, WorkloadUser, frame,
};
use crust_testkit::LoopDisk;
use crust_vmm::{DiskSpec, Vm, VmConfig, VmError};
use serde_json::json;
use tokio::io::AsyncWriteExt;

fn mount_req(volume: &str, serial: &str, fstype: FsType) -> MountVolume {
    MountVolume {
        volume: volume.into(),
        serial: serial.into(),
        fstype,
        options: vec![],
        readonly: false,
        fs_group: None,
        fs_group_policy: None,
    }
}

/// A container on the guest's own root, as the runtime CLI runs its
/// workload.
fn guest_rooted(
    id: &str,
    args: &[&str],
    mounts: Vec<ContainerMount>,
    user: Option<WorkloadUser>,
) -> CreateContainer {
    let process = ProcessSpec {
        args: args.iter().map(|a| a.to_string()).collect(),
        env: vec!["PATH=/usr/bin:/bin".into()],
        user,
        ..Default::default()
    };
    CreateContainer {
        mounts,
        ..CreateContainer::new(id, Rootfs::Guest, process)
    }
}

fn vol(volume: &str, subpath: Option<&str>, destination: &str, readonly: bool) -> ContainerMount {
    ContainerMount {
        destination: destination.into(),
        source: MountSource::Volume {
            volume: volume.into(),
            subpath: subpath.map(String::from),
        },
        readonly,
        options: vec![],
        submounts: vec![],
    }
}

fn chmod(p: &std::path::Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn chown(p: &std::path::Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).unwrap();
}

/// Mount options, fsGroup (both policies), stats vs df, online growth,
/// subPath (created, escape refused), nested destinations (a planted
/// symlink refused, a real directory bound), read-only binds, a non-root workload
/// writing through fsGroup, health signals, concurrency, Shutdown, and the
/// written data on the device afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_fsgroup_subpath_workload_and_shutdown() {
    crust_testkit::require_root();
    let work = tempfile::tempdir().unwrap();
    let ext = LoopDisk::new(work.path().join("ext.img"), 256 * MIB);
    let xfs = LoopDisk::new(work.path().join("xfs.img"), 512 * MIB);
    mkfs_tool_defaults(&ext, &xfs);
    {
        let m = ext.mount_temp(&[], false);
        let r = m.path();
        chmod(r, 0o755);
        std::fs::create_dir_all(r.join("fsg/dir")).unwrap();
        chmod(&r.join("fsg/dir"), 0o700);
        std::fs::write(r.join("fsg/dir/file"), b"data").unwrap();
        chmod(&r.join("fsg/dir/file"), 0o600);
        std::fs::write(r.join("fsg/exec"), b"#!/bin/sh\n").unwrap();
        chmod(&r.join("fsg/exec"), 0o744);
        symlink("/tmp/marker", r.join("fsg/outlink")).unwrap();
        symlink("/", r.join("escape")).unwrap();
        symlink("../../..", r.join("escape2")).unwrap();
        // Left by an "earlier pod": bound at /data, these would redirect a
        // nested destination onto guest system paths.
        std::fs::create_dir(r.join("trap")).unwrap();
        symlink("/usr/sbin", r.join("trap/logs")).unwrap();
        symlink("/run/crust", r.join("trap/state")).unwrap();
    }
    {
        let m = xfs.mount_temp(&[], false);
        let r = m.path();
        chown(r, 0, 3000);
        chmod(r, 0o2770);
        std::fs::write(r.join("keep"), b"k").unwrap();
        chown(&r.join("keep"), 0, 0);
        chmod(&r.join("keep"), 0o600);
    }

    let g = Guest::boot(
        "vols",
        vec![
            disk("ext", ext.dev(), "crust-ext"),
            disk("xfs", xfs.dev(), "crust-xfs"),
        ],
    )
    .await;
    let a = &g.agent;
    let ping = a.ping().await.unwrap();
    assert_eq!(ping.protocol, crust_agent_proto::PROTOCOL_VERSION);
    g.sh("echo secret > /tmp/marker && chmod 600 /tmp/marker")
        .await;

    // --- bad input changes nothing -------------------------------------------
    let mut bad = mount_req("ext", "crust-ext", FsType::Ext4);
    // One allow-list for host and guest (crust-fs): a comma splits options
    // as mount(8) does, and `errors=panic` is refused everywhere.
    bad.options = vec!["noatime".into(), "nodev,errors=panic".into()];
    assert_eq!(
        code_of(a.mount_volume(bad).await),
        ErrorCode::InvalidArgument
    );
    let mut bad = mount_req("ext", "crust-ext", FsType::Xfs);
    bad.options = vec!["data=ordered".into()];
    assert_eq!(
        code_of(a.mount_volume(bad).await),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code_of(
            a.mount_volume(mount_req("../x", "crust-ext", FsType::Ext4))
                .await
        ),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code_of(
            a.call_with_timeout(
                mount_req("nope", "crust-nope", FsType::Ext4),
                Duration::from_secs(3)
            )
            .await
        ),
        ErrorCode::NotFound
    );
    assert_eq!(
        code_of(
            a.mount_volume(mount_req("x", "crust-xfs", FsType::Ext4))
                .await
        ),
        ErrorCode::FailedPrecondition,
        "an xfs disk mounted as ext4"
    );
    assert_eq!(g.sh("ls /run/crust/volumes").await.trim(), "");
    assert!(
        !g.sh("cat /proc/mounts")
            .await
            .contains("/run/crust/volumes")
    );

    // --- ext4 with options and fsGroup Always --------------------------------
    let mut req = mount_req("ext", "crust-ext", FsType::Ext4);
    req.options = ["noatime", "nodiratime", "data=ordered", "errors=remount-ro"]
        .map(String::from)
        .to_vec();
    req.fs_group = Some(2000);
    req.fs_group_policy = Some(FsGroupPolicy::Always);
    let mounted = a.mount_volume(req.clone()).await.unwrap();
    assert_eq!(mounted.mount_path, "/run/crust/volumes/ext");
    assert!(mounted.fs_group_applied);
    let line = g
        .mount_line("/run/crust/volumes/ext")
        .await
        .expect("ext mounted");
    assert!(
        line.starts_with(&format!("{} /run/crust/volumes/ext ext4 ", mounted.device)),
        "{line}"
    );
    for opt in ["rw", "noatime", "nodiratime", "errors=remount-ro"] {
        assert!(
            line.split([' ', ',']).any(|o| o == opt),
            "{opt} missing: {line}"
        );
    }
    let v = "/run/crust/volumes/ext";
    let st = g
        .sh(&format!(
            "cd {v} && stat -c '%n %a %g' . fsg fsg/dir fsg/dir/file fsg/exec fsg/outlink /tmp/marker"
        ))
        .await;
    let st: Vec<&str> = st.lines().collect();
    assert_eq!(
        st,
        vec![
            ". 2775 2000",
            "fsg 2775 2000",
            "fsg/dir 2770 2000",
            "fsg/dir/file 660 2000",
            "fsg/exec 774 2000",
            "fsg/outlink 777 2000",
            "/tmp/marker 600 0",
        ]
    );
    // Idempotent; a different disk for the same volume is refused.
    assert!(a.mount_volume(req.clone()).await.is_ok());
    assert_eq!(
        code_of(
            a.mount_volume(mount_req("ext", "crust-xfs", FsType::Xfs))
                .await
        ),
        ErrorCode::AlreadyExists
    );
    assert_eq!(
        code_of(
            a.mount_volume(mount_req("ext2", "crust-ext", FsType::Ext4))
                .await
        ),
        ErrorCode::AlreadyExists,
        "one disk, one mount"
    );

    // --- xfs with fsGroup OnRootMismatch ----------------------------------------
    let mut xreq = mount_req("xfsv", "crust-xfs", FsType::Xfs);
    xreq.fs_group = Some(3000);
    xreq.fs_group_policy = Some(FsGroupPolicy::OnRootMismatch);
    let xm = a.mount_volume(xreq.clone()).await.unwrap();
    assert!(!xm.fs_group_applied, "root already matched");
    let x = "/run/crust/volumes/xfsv";
    assert_eq!(
        g.sh(&format!("stat -c '%a %g' {x}/keep")).await.trim(),
        "600 0"
    );
    a.unmount_volume("xfsv").await.unwrap();
    a.unmount_volume("xfsv").await.unwrap(); // idempotent
    assert!(g.mount_line(x).await.is_none());
    xreq.fs_group = Some(3001);
    assert!(a.mount_volume(xreq).await.unwrap().fs_group_applied);
    assert_eq!(
        g.sh(&format!("stat -c '%a %g' {x} {x}/keep")).await,
        "2770 3001\n660 3001\n"
    );

    // --- stats equal df in the guest ------------------------------------------
    for (vol, path) in [("ext", v), ("xfsv", x)] {
        let s = a.stat_volume(vol).await.unwrap();
        let (t, u, av) = guest_df(&g, "-P -B1", path).await;
        assert_eq!(
            (s.bytes.total, s.bytes.used, s.bytes.available),
            (t, u, av),
            "{vol} bytes"
        );
        let (t, u, av) = guest_df(&g, "-i", path).await;
        assert_eq!(
            (s.inodes.total, s.inodes.used, s.inodes.available),
            (t, u, av),
            "{vol} inodes"
        );
        assert!(!s.condition.abnormal, "{}", s.condition.message);
    }
    assert_eq!(code_of(a.stat_volume("nope").await), ErrorCode::NotFound);
    // Unmounted behind the agent's back: stats check the remembered mount
    // (its id and device, one statx) and do not answer from the record.
    g.sh(&format!("umount {x}")).await;
    assert_eq!(code_of(a.stat_volume("xfsv").await), ErrorCode::NotFound);
    // The same disk mounted there again from outside (its mount id may be
    // the old one reused): the same volume, so its stats are right.
    g.sh(&format!("mount -t xfs {} {x}", xm.device)).await;
    let (t, _, _) = guest_df(&g, "-P -B1", x).await;
    assert_eq!(a.stat_volume("xfsv").await.unwrap().bytes.total, t);
    // Unmounted again after the fast path was used: NotFound again.
    g.sh(&format!("umount {x}")).await;
    assert_eq!(code_of(a.stat_volume("xfsv").await), ErrorCode::NotFound);
    let mut xreq = mount_req("xfsv", "crust-xfs", FsType::Xfs);
    xreq.fs_group = Some(3001);
    xreq.fs_group_policy = Some(FsGroupPolicy::OnRootMismatch);
    assert!(!a.mount_volume(xreq).await.unwrap().fs_group_applied);
    let (t, _, _) = guest_df(&g, "-P -B1", x).await;
    assert_eq!(a.stat_volume("xfsv").await.unwrap().bytes.total, t);

    // --- online growth ------------------------------------------------------
    let before = a.stat_volume("ext").await.unwrap().bytes.total;
    ext.grow(384 * MIB);
    let mut qmp = Qmp::connect(g.vm.qmp_socket()).await;
    qmp.execute(
        "block_resize",
        json!({"node-name": "crust-node-ext", "size": 384 * MIB}),
    )
    .await
    .unwrap();
    let grown = a.grow_volume("ext", Some(384 * MIB)).await.unwrap();
    assert_eq!(grown.device_bytes, 384 * MIB);
    assert!(
        grown.fs_total_bytes > before + 100 * MIB,
        "{grown:?} vs {before}"
    );
    assert_eq!(guest_df(&g, "-P -B1", v).await.0, grown.fs_total_bytes);

    // --- subPath escape refused, nothing mounted -----------------------------------
    // (the runtime CLI's workload: a container on the guest's own root)
    for sp in ["escape/etc", "escape2", "../x", "/etc"] {
        let r = a
            .call(guest_rooted(
                "esc",
                &["true"],
                vec![vol("ext", Some(sp), "/data", false)],
                None,
            ))
            .await;
        assert_eq!(code_of(r), ErrorCode::InvalidArgument, "subPath {sp}");
    }
    assert!(g.mount_line("/data").await.is_none());
    assert_eq!(
        code_of(a.call(ContainerPids { id: "esc".into() }).await),
        ErrorCode::NotFound,
        "nothing left of a refused container"
    );

    // --- a nested destination through a symlink in a volume: nothing mounted ------
    // On the guest's own root no destination follows a symlink: the
    // container shares the guest's filesystem, where a symlink the volume
    // planted would have the agent make directories in the guest's tools.
    let mounts_before = g.sh("cat /proc/mounts").await;
    let sbin_before = g.sh("ls -la /usr/sbin /run/crust/volumes").await;
    assert!(sbin_before.contains(" e2fsck\n"), "{sbin_before}");
    for nested in ["/data/logs", "/data/logs/bin", "/data/state/volumes/ext"] {
        let r = a
            .call(guest_rooted(
                "nested",
                &["true"],
                vec![
                    vol("ext", Some("trap"), "/data", false),
                    vol("xfsv", None, nested, false),
                ],
                None,
            ))
            .await;
        match r {
            Err(crust_agent_proto::ClientError::Agent(e)) => {
                assert_eq!(e.code, ErrorCode::InvalidArgument, "{nested}: {e:?}");
                assert!(e.message.contains("symlink"), "{nested}: {}", e.message);
            }
            other => panic!("{nested}: expected InvalidArgument, got {other:?}"),
        }
        assert_eq!(g.sh("cat /proc/mounts").await, mounts_before, "{nested}");
    }
    assert_eq!(
        g.sh("ls -la /usr/sbin /run/crust/volumes").await,
        sbin_before
    );
    assert_eq!(
        g.sh("cd /run/crust/volumes/ext/trap && readlink logs && readlink state")
            .await,
        "/usr/sbin\n/run/crust\n"
    );

    // --- the workload: non-root, writes via fsGroup, read-only xfs ----------------
    let mux = StdioMux::new(g.vm.stdio_socket());
    let mut out = mux.register(1);
    let mut spec = guest_rooted(
        "w",
        &[
            "sh",
            "-c",
            "echo hello-from-guest > /data/out.txt && sync; \
             if touch /xfs/nope 2>/dev/null; then echo xfs-writable; else echo xfs-readonly; fi; \
             id -u; echo started; exec sleep 600",
        ],
        vec![
            vol("ext", Some("app/data"), "/data", false),
            vol("xfsv", None, "/xfs", true),
            // Nested in /data through real directories: made and bound.
            vol("xfsv", None, "/data/nested/xfs", true),
        ],
        Some(WorkloadUser {
            uid: 1000,
            gid: 1000,
            supplemental_gids: vec![2000, 3001],
        }),
    );
    spec.process.env = vec!["HOME=/".into(), "PATH=/usr/bin:/bin".into()];
    spec.process.cwd = Some("/data".into());
    spec.process.stdio = StdioSpec {
        stream: 1,
        stdin: false,
        stdout: true,
        stderr: true,
    };
    let started = a.call(spec.clone()).await.unwrap();
    a.call(StartContainer { id: "w".into() }).await.unwrap();
    let mut log = String::new();
    while !log.contains("started") {
        match tokio::time::timeout(Duration::from_secs(20), out.recv()).await {
            Ok(Some(Output::Stdout(d) | Output::Stderr(d))) => {
                log.push_str(&String::from_utf8_lossy(&d));
            }
            Ok(Some(_)) => {}
            other => panic!("no output from the workload ({other:?}): {log:?}"),
        }
    }
    assert_eq!(log, "xfs-readonly\n1000\nstarted\n");
    let in_w = |script: &str| {
        let req = Exec {
            args: vec!["sh".into(), "-c".into(), script.into()],
            env: vec![],
            timeout_ms: 20_000,
            container: Some("w".into()),
        };
        a.call_with_timeout(req, Duration::from_secs(30))
    };
    let its_mounts = g.sh(&format!("cat /proc/{}/mounts", started.pid)).await;
    let line = |dest: &str| {
        its_mounts
            .lines()
            .find(|l| l.split(' ').nth(1) == Some(dest))
            .unwrap_or_else(|| panic!("{dest} not bound: {its_mounts}"))
            .to_string()
    };
    assert!(line("/xfs").contains(" xfs ro,"), "{}", line("/xfs"));
    assert!(line("/data/nested/xfs").contains(" xfs ro,"));
    assert!(
        g.mount_line("/xfs").await.is_none(),
        "the binds are the workload's, not the guest's"
    );
    assert_eq!(
        in_w("stat -c '%F' /run/crust/volumes/ext/app/data/nested/xfs && ls /data/nested/xfs")
            .await
            .unwrap()
            .stdout,
        "directory\nkeep\n"
    );
    assert_eq!(
        in_w("stat -c '%u %g %a' /data/out.txt /run/crust/volumes/ext/app/data")
            .await
            .unwrap()
            .stdout,
        "1000 2000 644\n0 2000 2775\n"
    );
    assert_eq!(
        code_of(a.unmount_volume("ext").await),
        ErrorCode::FailedPrecondition,
        "in use by the workload"
    );
    assert_eq!(
        code_of(a.call(spec).await),
        ErrorCode::AlreadyExists,
        "one container per id"
    );

    // A slow Exec does not hold up a Ping.
    let slow = {
        let a = a.clone();
        tokio::spawn(async move { a.exec(&["sleep", "4"], Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.ping().await.unwrap();
    assert!(!slow.is_finished(), "ping should not wait for the exec");
    assert_eq!(slow.await.unwrap().unwrap().exit_code, 0);
    assert_eq!(
        code_of(a.exec(&["sleep", "30"], Duration::from_millis(500)).await),
        ErrorCode::DeadlineExceeded
    );

    let init = ProcessRef {
        container: "w".into(),
        exec_id: None,
    };
    a.call(SignalProcess {
        process: init.clone(),
        signal: 15,
        all: true,
    })
    .await
    .unwrap();
    let stopped = a
        .call(WaitProcess {
            process: init,
            timeout_ms: 10_000,
        })
        .await
        .unwrap()
        .exited
        .expect("exited on TERM");
    assert_eq!(
        (stopped.pid, stopped.exit_code, stopped.signal),
        (started.pid, 143, Some(15))
    );
    // Its namespace is held until it is removed: its view stays readable.
    assert_eq!(
        in_w("cat /data/out.txt").await.unwrap().stdout,
        "hello-from-guest\n"
    );
    a.call(RemoveContainer { id: "w".into() }).await.unwrap();
    assert_eq!(
        code_of(in_w("true").await),
        ErrorCode::NotFound,
        "gone with the container"
    );

    // --- health ------------------------------------------------------------------
    let dev = mounted.device.trim_start_matches("/dev/");
    g.sh(&format!("echo 1 > /sys/fs/ext4/{dev}/trigger_fs_error"))
        .await;
    let s = a.stat_volume("ext").await.unwrap();
    assert!(s.condition.abnormal);
    let msg = &s.condition.message;
    assert!(
        msg.contains("has recorded") && msg.contains("e2fsck"),
        "{msg}"
    );
    g.sh(&format!("mount -o remount,ro {x}")).await;
    let s = a.stat_volume("xfsv").await.unwrap();
    assert!(
        s.condition.abnormal && s.condition.message.contains("read-only"),
        "{s:?}"
    );

    // --- Shutdown ends QEMU; the data is on the device ------------------------------
    a.shutdown().await.unwrap();
    let mut vm = g.vm;
    let exit = vm
        .wait_exit(Duration::from_secs(60))
        .await
        .expect("QEMU exits");
    assert!(exit.success(), "{exit:?}");
    let m = ext.mount_temp(&["noload"], true);
    let out = m.path().join("app/data/out.txt");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "hello-from-guest\n");
    let md = std::fs::metadata(&out).unwrap();
    assert_eq!((md.uid(), md.gid()), (1000, 2000));
    drop(m);
}

/// Hot-plug on the documented root ports, unplug while mounted (health),
/// xfs growth, protocol robustness (garbage, oversize, reconnect), attach
/// from the run dir.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hotplug_health_and_channel_robustness() {
    crust_testkit::require_root();
    let work = tempfile::tempdir().unwrap();
    let ext = LoopDisk::new(work.path().join("hp-ext.img"), 128 * MIB);
    let xfs = LoopDisk::new(work.path().join("hp-xfs.img"), 400 * MIB);
    mkfs_tool_defaults(&ext, &xfs);

    let g = Guest::boot("hotplug", vec![]).await;
    let a = &g.agent;
    let ports = g.vm.hotplug_ports().to_vec();
    assert_eq!(ports, vec!["crust-hp0", "crust-hp1"]);

    // Another process's view: attach by run dir; dropping it leaves QEMU up.
    let attached = Vm::attach(&g.vm.paths().run_dir).unwrap();
    assert_eq!(attached.pid(), g.vm.pid());
    drop(attached);
    let second = VmConfig::new(
        "again",
        crust_testkit::guest_image().0,
        crust_testkit::guest_image().1,
        g.vm.paths().run_dir.clone(),
    );
    assert!(matches!(
        Vm::launch(second).await,
        Err(VmError::AlreadyRunning { .. })
    ));

    let mut qmp = Qmp::connect(g.vm.qmp_socket()).await;
    let d_ext = disk("hpext", ext.dev(), "crust-hp-ext");
    let d_xfs = disk("hpxfs", xfs.dev(), "crust-hp-xfs");
    for (d, port) in [(&d_ext, &ports[0]), (&d_xfs, &ports[1])] {
        qmp.execute("blockdev-add", d.blockdev_add_args())
            .await
            .unwrap();
        qmp.execute("device_add", d.device_add_args(port))
            .await
            .unwrap();
    }
    a.mount_volume(mount_req("e", "crust-hp-ext", FsType::Ext4))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "mounting the hot-plugged ext4: {e}\n{}",
                g.vm.failure_context()
            )
        });
    a.mount_volume(mount_req("x", "crust-hp-xfs", FsType::Xfs))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "mounting the hot-plugged xfs: {e}\n{}",
                g.vm.failure_context()
            )
        });
    g.sh("echo hot > /run/crust/volumes/e/f && sync").await;

    // xfs online growth.
    let before = a.stat_volume("x").await.unwrap().bytes.total;
    xfs.grow(600 * MIB);
    qmp.execute(
        "block_resize",
        json!({"node-name": d_xfs.node_name(), "size": 600 * MIB}),
    )
    .await
    .unwrap();
    let grown = a.grow_volume("x", Some(600 * MIB)).await.unwrap();
    assert_eq!(grown.device_bytes, 600 * MIB);
    assert!(
        grown.fs_total_bytes > before + 150 * MIB,
        "{grown:?} vs {before}"
    );
    assert_eq!(
        guest_df(&g, "-P -B1", "/run/crust/volumes/x").await.0,
        grown.fs_total_bytes
    );

    // Clean unplug of xfs: unmount, device_del, blockdev-del.
    a.unmount_volume("x").await.unwrap();
    qmp.execute("device_del", json!({"id": d_xfs.device_id()}))
        .await
        .unwrap();
    qmp.wait_event("DEVICE_DELETED", &d_xfs.device_id()).await;
    qmp.execute("blockdev-del", json!({"node-name": d_xfs.node_name()}))
        .await
        .unwrap();
    assert_eq!(
        code_of(
            a.call_with_timeout(
                mount_req("x", "crust-hp-xfs", FsType::Xfs),
                Duration::from_secs(2)
            )
            .await
        ),
        ErrorCode::NotFound
    );

    // A read-only disk on the freed port: only a read-only mount works.
    let d_ro = DiskSpec {
        readonly: true,
        ..disk("hpro", xfs.dev(), "crust-hp-ro")
    };
    qmp.execute("blockdev-add", d_ro.blockdev_add_args())
        .await
        .unwrap();
    qmp.execute("device_add", d_ro.device_add_args(&ports[1]))
        .await
        .unwrap();
    assert_eq!(
        code_of(
            a.mount_volume(mount_req("ro", "crust-hp-ro", FsType::Xfs))
                .await
        ),
        ErrorCode::FailedPrecondition
    );
    let mut ro = mount_req("ro", "crust-hp-ro", FsType::Xfs);
    ro.readonly = true;
    ro.fs_group = Some(1234);
    assert!(!a.mount_volume(ro.clone()).await.unwrap().fs_group_applied);
    let line = g.mount_line("/run/crust/volumes/ro").await.unwrap();
    assert!(line.contains(" xfs ro,"), "{line}");
    ro.readonly = false;
    assert_eq!(code_of(a.mount_volume(ro).await), ErrorCode::AlreadyExists);
    a.unmount_volume("ro").await.unwrap();

    // The ext4 disk vanishes while mounted: reported, and unmount still works.
    assert!(!a.stat_volume("e").await.unwrap().condition.abnormal);
    qmp.execute("device_del", json!({"id": d_ext.device_id()}))
        .await
        .unwrap();
    qmp.wait_event("DEVICE_DELETED", &d_ext.device_id()).await;
    let s = a.stat_volume("e").await.unwrap();
    assert!(s.condition.abnormal);
    assert!(
        s.condition.message.contains("no longer attached"),
        "{}",
        s.condition.message
    );
    // A disk plugged meanwhile cannot take the vanished one's name while
    // the mount holds it (so the sysfs node that stats compare before
    // reading a serial is never another device's), and changes nothing.
    let d_new = DiskSpec {
        readonly: true,
        ..disk("hpnew", xfs.dev(), "crust-hp-new")
    };
    qmp.execute("blockdev-add", d_new.blockdev_add_args())
        .await
        .unwrap();
    qmp.execute("device_add", d_new.device_add_args(&ports[0]))
        .await
        .unwrap();
    let new_name = wait_for_guest_disk(&g, "crust-hp-new").await;
    assert!(
        !s.condition.message.contains(&format!("/dev/{new_name})")),
        "{new_name}: {}",
        s.condition.message
    );
    let s = a.stat_volume("e").await.unwrap();
    assert!(
        s.condition.abnormal && s.condition.message.contains("no longer attached"),
        "{}",
        s.condition.message
    );
    a.unmount_volume("e").await.unwrap();
    assert!(g.mount_line("/run/crust/volumes/e").await.is_none());

    // --- the channel: garbage and oversize frames, host reconnects --------------
    a.disconnect();
    let mut raw = tokio::net::UnixStream::connect(g.vm.agent_socket())
        .await
        .unwrap();
    let garbage = b"{this is not json";
    raw.write_all(&(garbage.len() as u32).to_be_bytes())
        .await
        .unwrap();
    raw.write_all(garbage).await.unwrap();
    let body = frame::read_frame_async(&mut raw).await.unwrap().unwrap();
    let resp: crust_agent_proto::Response = frame::decode(&body).unwrap();
    assert_eq!(resp.id, 0);
    match resp.outcome {
        crust_agent_proto::Outcome::Error(e) => assert_eq!(e.code, ErrorCode::InvalidArgument),
        o => panic!("{o:?}"),
    }
    let unknown = json!({"id": 77, "deadline_ms": 5000, "op": "teleport", "args": {}});
    raw.write_all(&frame::encode(&unknown).unwrap())
        .await
        .unwrap();
    let resp: crust_agent_proto::Response =
        frame::decode(&frame::read_frame_async(&mut raw).await.unwrap().unwrap()).unwrap();
    assert_eq!(resp.id, 77);
    assert!(
        matches!(resp.outcome, crust_agent_proto::Outcome::Error(ref e) if e.code == ErrorCode::Unimplemented)
    );
    // Announce 2 MiB, send a little, hang up mid-frame.
    raw.write_all(&(2u32 << 20).to_be_bytes()).await.unwrap();
    raw.write_all(&[b'x'; 1000]).await.unwrap();
    let resp: crust_agent_proto::Response =
        frame::decode(&frame::read_frame_async(&mut raw).await.unwrap().unwrap()).unwrap();
    assert!(
        matches!(resp.outcome, crust_agent_proto::Outcome::Error(ref e) if e.message.contains("exceeds"))
    );
    drop(raw);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A fresh connection is served from a clean state.
    let p = a.wait_ready(Duration::from_secs(30)).await.unwrap();
    assert!(p.uptime_ms > 0);
    // Orphans end up with the shell /init (PID 1), which reaps them.
    assert_eq!(g.sh("cat /proc/1/comm").await.trim(), "init");
    g.sh("for i in 1 2 3; do (sleep 0.1 &) ; done; sleep 0.3")
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ps = g.sh("ps -o pid,ppid,stat,comm").await;
    assert!(
        !ps.lines().skip(1).any(|l| l
            .split_whitespace()
            .nth(2)
            .is_some_and(|s| s.starts_with('Z'))),
        "zombies left:\n{ps}"
    );

    // Shutdown from a host that hangs up at once still powers off.
    a.disconnect();
    let mut raw = tokio::net::UnixStream::connect(g.vm.agent_socket())
        .await
        .unwrap();
    let req = json!({"id": 5, "deadline_ms": 30000, "op": "shutdown", "args": {}});
    raw.write_all(&frame::encode(&req).unwrap()).await.unwrap();
    drop(raw);
    let mut vm = g.vm;
    assert!(
        vm.wait_exit(Duration::from_secs(60))
            .await
            .expect("exit")
            .success()
    );
    assert!(!vm.qmp_socket().exists(), "sockets cleaned up");
}

/// A QEMU that cannot start reports why, and leaves no process behind.
#[tokio::test]
async fn early_exit_reports_qemu_log() {
    let _slot = crust_testkit::VmSlot::acquire();
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("not-a-kernel");
    std::fs::write(&junk, b"garbage").unwrap();
    let mut cfg = VmConfig::new("bad", &junk, &junk, dir.path().join("run"));
    cfg.accel = crust_vmm::Accel::Tcg;
    cfg.disks.push(DiskSpec {
        id: "d".into(),
        path: junk.clone(),
        serial: "crust-d".into(),
        readonly: true,
    });
    match Vm::launch(cfg).await {
        Err(VmError::EarlyExit { log_tail, .. }) => {
            assert!(log_tail.contains("kernel"), "{log_tail}")
        }
        Err(e) => panic!("expected EarlyExit, got {e}"),
        Ok(vm) => panic!(
            "QEMU with a garbage kernel came up: {}",
            vm.failure_context()
        ),
    }
    assert!(!dir.path().join("run/qmp.sock").exists());
    let bad = VmConfig::new("bad name", &junk, &junk, dir.path().join("run2"));
    assert!(matches!(
        Vm::launch(bad).await,
        Err(VmError::InvalidConfig(_))
    ));
    assert!(
        !dir.path().join("run2").exists(),
        "invalid config changes nothing"
    );
}

/// The kernel name of the guest disk with `serial`, once it shows up.
async fn wait_for_guest_disk(g: &Guest, serial: &str) -> String {
    for _ in 0..100 {
        let out = g
            .sh(&format!(
                "for d in /sys/block/*; do [ \"$(cat $d/serial 2>/dev/null)\" = {serial} ] && basename $d; done; true"
            ))
            .await;
        if let Some(n) = out.split_whitespace().next() {
            return n.to_string();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no guest disk with serial {serial}");
}
