//! Issue 43, must-show 3 and mount propagation, through CRI as kubelet
//! asks. A read-only host path volume is read-only as runc makes it: the
//! volume itself, not a tmpfs mounted inside it on the host (CRI's
//! recursive read-only is what makes that read-only too). HostToContainer
//! propagation carries a host mount made after the container started;
//! Bidirectional, which needs the guest's mounts to reach the host, is
//! refused with an error naming the mount. Budget: one TCG guest, ~12 s.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Env, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;
use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};

/// A host directory bound on itself as a shared mount (containerd checks
/// that a propagated path is on one), unmounted with all below on drop.
struct HostTree(tempfile::TempDir);

impl HostTree {
    fn new() -> HostTree {
        let t = tempfile::tempdir().unwrap();
        rustix::mount::mount_bind(t.path(), t.path()).unwrap();
        rustix::mount::mount_change(t.path(), MountPropagationFlags::SHARED).unwrap();
        HostTree(t)
    }

    fn dir(&self, rel: &str) -> PathBuf {
        let p = self.0.path().join(rel);
        std::fs::create_dir_all(&p).unwrap();
        p
    }
}

impl Drop for HostTree {
    fn drop(&mut self) {
        crust_testkit::unmount_below(self.0.path());
        let _ = rustix::mount::unmount(self.0.path(), UnmountFlags::DETACH);
    }
}

fn tmpfs(at: &Path) {
    rustix::mount::mount("tmpfs", at, "tmpfs", MountFlags::empty(), None).unwrap();
}

/// CreateContainer (containerd only records it) then StartContainer of a
/// container binding `host` with Bidirectional propagation: the error.
async fn start_bidirectional(
    cri: &mut Cri,
    sb: &str,
    sandbox: &cri::PodSandboxConfig,
    host: &Path,
) -> tonic::Status {
    let mount = cri::Mount {
        container_path: "/both".into(),
        host_path: host.display().to_string(),
        propagation: cri::MountPropagation::PropagationBidirectional as i32,
        ..Default::default()
    };
    let config = common::busybox_container("both-ways", &["sleep", "600"], vec![mount], None);
    let both = common::create_container(cri, sb, sandbox, config)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}"));
    cri.runtime
        .start_container(cri::StartContainerRequest { container_id: both })
        .await
        .expect_err("Bidirectional propagation must be refused")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_volume_leaves_mounts_inside_it_writable_and_host_mounts_propagate() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let host = HostTree::new();
    let vol = host.dir("vol");
    std::fs::write(vol.join("top"), b"host").unwrap();
    let inner = host.dir("vol/tmpfs");
    tmpfs(&inner);
    let watch = host.dir("watch");
    let quiet = host.dir("quiet");
    let mount =
        |path: &str, host: &Path, readonly: bool, propagation: cri::MountPropagation| cri::Mount {
            container_path: path.into(),
            host_path: host.display().to_string(),
            readonly,
            propagation: propagation as i32,
            ..Default::default()
        };
    let sandbox = common::host_network_sandbox("mounts", "43d00000-0000-4000-8000-000000000001", 0);
    let (sb, app) = env
        .start_busybox_pod(
            &mut cri,
            &sandbox,
            &["sleep", "600"],
            vec![
                mount(
                    "/mnt",
                    &vol,
                    true,
                    cri::MountPropagation::PropagationPrivate,
                ),
                mount(
                    "/watch",
                    &watch,
                    false,
                    cri::MountPropagation::PropagationHostToContainer,
                ),
                mount(
                    "/quiet",
                    &quiet,
                    false,
                    cri::MountPropagation::PropagationPrivate,
                ),
            ],
        )
        .await;

    // The volume is read-only; the tmpfs inside it is not.
    let (rc, out) = exec(&mut cri, &app, "touch /mnt/new").await;
    assert_ne!(rc, 0, "the read-only volume took a write: {out}");
    assert!(out.contains("Read-only"), "{out}");
    let (rc, out) = exec(
        &mut cri,
        &app,
        "echo guest > /mnt/tmpfs/file && cat /mnt/top",
    )
    .await;
    assert_eq!(rc, 0, "the tmpfs inside the volume: {out}\n{}", env.logs());
    assert_eq!(out.trim(), "host");
    assert_eq!(std::fs::read(inner.join("file")).unwrap(), b"guest\n");
    assert!(!vol.join("new").exists());

    // Mounted on the host after the container started.
    for d in [&watch, &quiet] {
        let later = d.join("later");
        std::fs::create_dir(&later).unwrap();
        tmpfs(&later);
        std::fs::write(later.join("marker"), b"later").unwrap();
    }
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let (rc, out) = exec(&mut cri, &app, "cat /watch/later/marker").await;
        if rc == 0 {
            assert_eq!(out, "later");
            break;
        }
        assert!(
            Instant::now() < until,
            "HostToContainer: the host's later mount never showed: {out}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (rc, out) = exec(&mut cri, &app, "cat /quiet/later/marker").await;
    assert_ne!(rc, 0, "no propagation asked, yet the mount showed: {out}");

    // Bidirectional cannot be carried: refused at start (containerd's
    // CreateContainer only records the container), naming the mount.
    let e = start_bidirectional(&mut cri, &sb, &sandbox, &watch).await;
    assert!(
        e.message().contains("mount /both") && e.message().contains("Bidirectional"),
        "{e}"
    );
    common::stop_and_remove_sandbox(&mut cri, &sb).await;
}
