//! Issue 31, replayed through a real containerd and the shim, in one pod
//! (one TCG guest, ~15 s):
//! - Read-only stays read-only: a container with a read-only file bind and
//!   a read-only directory bind writes at the container path, after
//!   `mount -o remount,rw`, and through the pod's share under
//!   `/proc/1/root/run/crust/shares/`: every write fails, the host file and
//!   directory are unchanged.
//! - The share escape: root in a container of the pod (every capability)
//!   cannot create the next container's directory in the share (the
//!   guest's view of the share is read-only); and when such a directory is
//!   there anyway, with symlinks to a host file and a host directory where
//!   the next container's binds and rootfs go, that container's creation
//!   fails, the host file keeps its bytes and nothing is mounted outside
//!   the share. (Each path kind, planted one at a time, is covered against
//!   the descriptor code itself in crust-runtime's share.rs tests.)

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::Env;
use crust_testkit::BUSYBOX_IMAGE;

const RUNTIME: &str = "io.containerd.crust.v2";
/// The pod's share as the agent mounted it. The containers have PID
/// namespaces of their own, so the attacker, a compromised guest root,
/// is played by a command the agent runs in its own namespaces (the
/// pod's shim API `/exec`).
const GUEST_SHARE: &str = "/run/crust/shares/crust-pod";

/// Runs `script` as the guest's root, outside any container.
fn guest_exec(env: &Env, pod: &str, script: &str) -> String {
    let client = crust_sandbox::shim::ShimClient::new(
        env.runtime_root
            .join(pod)
            .join(crust_sandbox::sandbox::SHIM_SOCKET),
        std::time::Duration::from_secs(60),
    );
    let req = crust_sandbox::shim::ExecRequest {
        args: vec!["/bin/sh".into(), "-c".into(), script.into()],
        env: vec![],
        timeout_ms: Some(60_000),
    };
    let r = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(client.exec(&req))
        .unwrap_or_else(|e| panic!("guest exec: {e}"));
    format!("{}{}", r.stdout, r.stderr)
}

/// The host's mount points, but for those below `except` (this test's
/// runtime root) and those of other tests' dirs, which come and go while
/// tests run in parallel (their env and containerd dirs; `mine` are this
/// test's own and stay checked).
fn mount_points(except: &Path, mine: &[&Path]) -> BTreeSet<String> {
    let others = |p: &Path| {
        ["/tmp/cs-", "/tmp/ctrd-"]
            .iter()
            .any(|pre| p.to_string_lossy().starts_with(pre))
            && !mine.iter().any(|m| p.starts_with(m))
    };
    // containerd's own short-lived mounts (`mount.WithTempMount`, under
    // TMPDIR while a private containerd of any test unpacks or reads an
    // image): a full run saw one come and go across this check.
    let transient = |p: &Path| {
        p.to_string_lossy()
            .strip_prefix("/tmp/containerd-mount")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            // Named network namespaces (bind mounts of nsfs files) that
            // other tests' CNI pods make and drop: this test makes none, and
            // nothing in a share can name one (a CI run saw critest's).
            || p.parent() == Some(Path::new("/run/netns"))
            || p.parent() == Some(Path::new("/var/run/netns"))
    };
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_owned))
        .filter(|p| {
            let p = Path::new(p);
            !p.starts_with(except) && !others(p) && !transient(p)
        })
        .collect()
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The capabilities containerd's default spec leaves out (Linux 6.1 knows
/// 0..=40).
const BEYOND_CONTAINERD_DEFAULT: &[&str] = &[
    "CAP_DAC_READ_SEARCH",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_LEASE",
    "CAP_AUDIT_CONTROL",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

#[test]
fn guest_cannot_write_read_only_binds_nor_steer_the_host_through_the_share() {
    let env = Env::start("default");
    let ctrd = &env.ctrd;
    let d = env.dir.path();
    // What the pod may only read.
    let ro_file = d.join("ro-file");
    std::fs::write(&ro_file, b"read-only bytes\n").unwrap();
    let ro_dir = d.join("ro-dir");
    std::fs::create_dir(&ro_dir).unwrap();
    std::fs::write(ro_dir.join("keep"), b"kept\n").unwrap();
    // Host paths outside the share the attacker aims at.
    let host_file = d.join("host-file");
    std::fs::write(&host_file, b"precious host bytes\n").unwrap();
    let host_dir = d.join("host-dir");
    std::fs::create_dir(&host_dir).unwrap();

    let bind = |src: &Path, dst: &str| {
        format!("type=bind,src={},dst={dst},options=rbind:ro", src.display())
    };
    let (m_file, m_dir) = (bind(&ro_file, "/ro/file"), bind(&ro_dir, "/ro/dir"));
    // Every capability (the guest now applies the spec's sets), so the
    // test never depends on capabilities being dropped.
    let mut run = vec!["run", "-d", "--runtime", RUNTIME];
    for c in BEYOND_CONTAINERD_DEFAULT {
        run.extend(["--cap-add", c]);
    }
    run.extend([
        "--mount",
        &m_file,
        "--mount",
        &m_dir,
        BUSYBOX_IMAGE,
        "pod1",
        "sleep",
        "600",
    ]);
    ctrd.ctr_ok("default", &run);
    let exec = |id: &str, script: &str| {
        let o = ctrd.ctr_in(
            "default",
            &["task", "exec", "--exec-id", id, "pod1", "sh", "-c", script],
        );
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };

    // Must-show 3: every write path fails. WROTE marks a write that worked.
    let out = exec(
        "w1",
        r#"grep CapEff /proc/self/status
try() { if sh -c "$1" 2>/dev/null; then echo "WROTE: $1"; else echo "refused: $1"; fi; }
try 'echo x >> /ro/file'
try 'echo x > /ro/dir/new'
mount -o remount,rw /ro/file; mount -o remount,rw /ro/dir
try 'echo x >> /ro/file'
try 'echo x > /ro/dir/new'
"#,
    );
    let out = out
        + &guest_exec(
            &env,
            "pod1",
            &format!(
                r#"try() {{ if sh -c "$1" 2>/dev/null; then echo "WROTE: $1"; else echo "refused: $1"; fi; }}
S={GUEST_SHARE}/pod1
ls $S
for m in $S/m*; do
  if [ -d $m ]; then echo "FOUND dir $m"; try "echo x > $m/new"; try "mkdir $m/newdir";
  elif [ -f $m ]; then echo "FOUND file $m"; try "echo x >> $m"; try "echo x > $m"; fi
done
mount -o remount,rw {GUEST_SHARE}
for m in $S/m*; do
  if [ -d $m ]; then try "echo x > $m/new"; elif [ -f $m ]; then try "echo x >> $m"; fi
done
"#
            ),
        );
    assert!(
        out.contains("CapEff:\t000001ffffffffff") || out.contains("CapEff:\t000003ffffffffff"),
        "the guest root holds every capability: {out}"
    );
    assert!(
        out.contains("FOUND file ") && out.contains("FOUND dir "),
        "the binds were reached through the share: {out}\n{}",
        env.logs()
    );
    assert!(!out.contains("WROTE"), "{out}");
    // Each attempt ran and was refused (a script that failed early would
    // print neither).
    // 4 in the container; in the guest 2 per bind (a file, a dir), then
    // 1 each after the remount.
    assert_eq!(out.matches("refused: ").count(), 4 + 2 * 2 + 2, "{out}");
    assert_eq!(std::fs::read(&ro_file).unwrap(), b"read-only bytes\n");
    assert_eq!(listing(&ro_dir), vec!["keep"]);

    // Must-show 0, first layer: the guest cannot create the next
    // container's directory, nor anything else in the share's root.
    let share = env.runtime_root.join("pod1/share");
    let before_share = listing(&share);
    let out = guest_exec(
        &env,
        "pod1",
        &format!(
            r#"if mkdir {GUEST_SHARE}/victim 2>/dev/null; then echo PLANTED; fi
if ln -s {hf} {GUEST_SHARE}/pod1/m99 2>/dev/null; then echo PLANTED; fi
if ln -s {hd} {GUEST_SHARE}/victim-rootfs 2>/dev/null; then echo PLANTED; fi
echo done"#,
            hf = host_file.display(),
            hd = host_dir.display()
        ),
    );
    assert!(out.contains("done") && !out.contains("PLANTED"), "{out}");
    assert_eq!(listing(&share), before_share);

    // Second layer: as if the guest had got past the first, the victim's
    // directory is there with symlinks where its rootfs and binds go.
    let planted = share.join("victim");
    std::fs::create_dir(&planted).unwrap();
    std::os::unix::fs::symlink(&host_dir, planted.join("rootfs")).unwrap();
    for i in 0..32 {
        std::os::unix::fs::symlink(&host_file, planted.join(format!("m{i}"))).unwrap();
    }
    let mine = [env.dir.path(), env.ctrd.dir()];
    let mounts_before = mount_points(&env.runtime_root, &mine);
    let src = d.join("src-file");
    std::fs::write(&src, b"bind source\n").unwrap();
    let m_src = format!(
        "type=bind,src={},dst=/etc/extra,options=rbind",
        src.display()
    );
    let o = ctrd.ctr_in(
        "default",
        &[
            "run",
            "-d",
            "--runtime",
            RUNTIME,
            "--annotation",
            "io.kubernetes.cri.container-type=container",
            "--annotation",
            "io.kubernetes.cri.sandbox-id=pod1",
            "--mount",
            &m_src,
            BUSYBOX_IMAGE,
            "victim",
            "sleep",
            "600",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "the victim was created\n{}",
        env.logs()
    );
    assert!(
        err.contains("already exists in the share"),
        "the refusal says why: {err}\n{}",
        env.logs()
    );
    assert_eq!(std::fs::read(&host_file).unwrap(), b"precious host bytes\n");
    assert!(listing(&host_dir).is_empty());
    assert_eq!(
        mount_points(&env.runtime_root, &mine),
        mounts_before,
        "nothing was mounted outside the share"
    );
    let _ = ctrd.ctr_in("default", &["containers", "rm", "victim"]);

    // The pod goes on: the host side of its own binds is untouched.
    assert!(exec("w3", "cat /ro/file").contains("read-only bytes"));
    ctrd.ctr_ok("default", &["task", "kill", "-s", "SIGKILL", "pod1"]);
    for _ in 0..100 {
        if ctrd
            .ctr_ok("default", &["task", "ls"])
            .lines()
            .any(|l| l.starts_with("pod1") && l.contains("STOPPED"))
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let _ = ctrd.ctr_in("default", &["task", "delete", "pod1"]);
    let _ = ctrd.ctr_in("default", &["containers", "rm", "pod1"]);
    assert!(
        common::qemus_under(&env.runtime_root).is_empty(),
        "the pod's VM is gone"
    );
    assert_eq!(std::fs::read(&ro_file).unwrap(), b"read-only bytes\n");
    assert_eq!(listing(&ro_dir), vec!["keep"]);
}
