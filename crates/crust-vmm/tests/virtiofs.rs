//! virtio-fs shares: a host directory served by the VM's own virtiofsd is
//! read and written from the guest, a bind mount made below the (shared)
//! share after boot shows up in the guest, and a virtiofsd killed with -9
//! takes the VM down (reported as such) instead of leaving it hanging.
//! Budget: one TCG guest, ~20 s.

use std::time::Duration;

use crust_agent_proto::AgentClient;
use crust_vmm::{Accel, ShareSpec, Vm, VmConfig};
use rustix::mount::{MountPropagationFlags, UnmountFlags};

/// Unmounts the share's bind mounts (deepest first) on drop.
struct Mounts(std::path::PathBuf);

impl Drop for Mounts {
    fn drop(&mut self) {
        crust_testkit::unmount_below(&self.0);
        let _ = rustix::mount::unmount(&self.0, UnmountFlags::DETACH);
    }
}

async fn sh(agent: &AgentClient, script: &str) -> (i32, String) {
    let r = agent
        .exec(&["sh", "-c", script], Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("exec {script:?}: {e}"));
    (r.exit_code, format!("{}{}", r.stdout, r.stderr))
}

#[tokio::test]
async fn share_read_write_submount_and_daemon_death() {
    crust_testkit::require_root();
    crust_testkit::ensure_guest_image();
    let _slot = crust_testkit::VmSlot::acquire();
    let (kernel, initrd) = crust_testkit::guest_image();
    let dir = tempfile::Builder::new()
        .prefix("crust-vfs-")
        .tempdir()
        .unwrap();
    let share = dir.path().join("share");
    std::fs::create_dir(&share).unwrap();
    std::fs::write(share.join("hello.txt"), b"from the host\n").unwrap();
    // A shared mount point: binds made below it later propagate into
    // virtiofsd's private mount namespace.
    rustix::mount::mount_bind(&share, &share).unwrap();
    let _mounts = Mounts(share.clone());
    rustix::mount::mount_change(&share, MountPropagationFlags::SHARED).unwrap();

    let mut cfg = VmConfig::new("vfs", kernel, initrd, dir.path().join("run"));
    cfg.accel = Accel::Tcg;
    cfg.die_with_parent = true;
    cfg.hotplug_ports = 0;
    cfg.shares = vec![ShareSpec {
        tag: "crust-test".into(),
        dir: share.clone(),
    }];
    let mut vm = Vm::launch(cfg).await.expect("launch");
    let fsd = vm.virtiofsd_pids();
    assert_eq!(fsd.len(), 1);
    let agent = AgentClient::new(vm.agent_socket());
    if let Err(e) = agent.wait_ready(Duration::from_secs(120)).await {
        panic!("agent not ready: {e}\n{}", vm.failure_context());
    }

    let (code, out) = sh(
        &agent,
        "for m in $(cat /etc/modules.d/virtiofs); do insmod /lib/modules/$m.ko; done; \
         mkdir -p /mnt/s && mount -t virtiofs crust-test /mnt/s && cat /mnt/s/hello.txt \
         && echo written-in-guest > /mnt/s/from-guest",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out, "from the host\n");
    assert_eq!(
        std::fs::read_to_string(share.join("from-guest")).unwrap(),
        "written-in-guest\n"
    );

    // A bind mount made after boot (how a container's rootfs and volumes
    // arrive) is visible through the share.
    let extra = dir.path().join("extra");
    std::fs::create_dir(&extra).unwrap();
    std::fs::write(extra.join("late.txt"), b"late bind\n").unwrap();
    std::fs::create_dir(share.join("sub")).unwrap();
    rustix::mount::mount_bind(&extra, share.join("sub")).unwrap();
    let (code, out) = sh(&agent, "cat /mnt/s/sub/late.txt").await;
    assert_eq!((code, out.as_str()), (0, "late bind\n"));

    // kill -9 of the VM's virtiofsd: the VM is ended, and says why.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(fsd[0] as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let exit = vm
        .wait_exit(Duration::from_secs(20))
        .await
        .expect("the VM ends when its virtiofsd dies");
    assert!(exit.virtiofsd_died, "{exit:?}");
    assert!(!crust_testkit::pid_alive(vm.pid() as i32));
    assert!(!dir.path().join("run/fs0.sock").exists());
}
