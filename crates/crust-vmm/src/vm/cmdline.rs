//! QEMU's command line for a [`VmConfig`].

use serde_json::json;

use super::rundir::{RunPaths, esc};
use crate::config::{VmConfig, boot_port_id, hotplug_port_id};
use crate::{AGENT_PORT_NAME, FORWARD_PORT_NAME, STDIO_PORT_NAME};
use crust_sandbox_records::ResolvedAccel;

const BASE_CMDLINE: &[&str] = &[
    "console=ttyS0",
    "panic=-1",
    "quiet",
    "loglevel=4",
    "rdinit=/init",
    // Nothing is behind the legacy keyboard controller; probing it costs
    // boot time under TCG.
    "i8042.noaux",
    "i8042.nomux",
    "i8042.nopnp",
    "i8042.dumbkbd",
    // A VM's TSC needs no watchdog or re-calibration; skip crypto
    // self-tests and audit: all boot time under TCG.
    "tsc=reliable",
    "no_timer_check",
    "cryptomgr.notests",
    "audit=0",
    // No bounce buffers: virtio devices address guest memory directly.
    // With hot-pluggable memory above 4 GiB the kernel would otherwise set
    // aside (and zero, so the host backs it) a 64 MiB SWIOTLB pool.
    "swiotlb=noforce",
];

pub(crate) fn qemu_args(cfg: &VmConfig, accel: ResolvedAccel, paths: &RunPaths) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    // Threads named by role (`CPU 0/TCG`, `worker`...): their CPU time can
    // be told apart in /proc (top -H, the pod network benchmark).
    push(&["-name", &format!("crust-{},debug-threads=on", cfg.name)]);
    push(&["-machine", "q35"]);
    match accel {
        ResolvedAccel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
        ResolvedAccel::Tcg if cfg.tcg_tb_mib > 0 => {
            push(&["-accel", &format!("tcg,tb-size={}", cfg.tcg_tb_mib)]);
        }
        ResolvedAccel::Tcg => push(&["-accel", "tcg"]),
    }
    let mem = if cfg.memory_hotplug() {
        format!(
            "{}M,slots={},maxmem={}M",
            cfg.memory_mib,
            crate::config::MEMORY_SLOTS,
            cfg.max_memory_mib
        )
    } else {
        cfg.memory_mib.to_string()
    };
    let smp = if cfg.cpu_hotplug() {
        format!("{},maxcpus={}", cfg.cpus, cfg.max_cpus)
    } else {
        cfg.cpus.to_string()
    };
    push(&["-m", &mem, "-smp", &smp]);
    if !cfg.shares.is_empty() {
        // vhost-user devices map guest RAM: it must be shareable memory.
        push(&[
            "-object",
            &format!(
                "memory-backend-memfd,id=crust-mem,size={}M,share=on",
                cfg.memory_mib
            ),
            "-numa",
            "node,memdev=crust-mem",
        ]);
    }
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    push(&["-msg", "timestamp=on"]);
    if let Some(fw) = cfg.firmware_path() {
        push(&["-bios", &fw.to_string_lossy()]);
    }
    let mut cmdline: Vec<String> = BASE_CMDLINE.iter().map(|s| s.to_string()).collect();
    if cfg.memory_hotplug() {
        // Hot-added DIMMs come online by themselves.
        cmdline.push("memhp_default_state=online".into());
    }
    cmdline.extend(cfg.kernel_cmdline_extra.iter().cloned());
    push(&["-kernel", &cfg.kernel.to_string_lossy()]);
    push(&["-initrd", &cfg.initrd.to_string_lossy()]);
    push(&["-append", &cmdline.join(" ")]);
    push(&[
        "-chardev",
        &format!("file,id=crust-console,path={}", esc(&paths.console_log)),
        "-serial",
        "chardev:crust-console",
    ]);
    push(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", esc(&paths.qmp_socket)),
    ]);
    push(&[
        "-device",
        "virtio-serial-pci,id=crust-vser",
        "-chardev",
        &format!(
            "socket,id=crust-agent,path={},server=on,wait=off",
            esc(&paths.agent_socket)
        ),
        "-device",
        &format!("virtserialport,bus=crust-vser.0,chardev=crust-agent,name={AGENT_PORT_NAME}"),
        "-chardev",
        &format!(
            "socket,id=crust-stdio,path={},server=on,wait=off",
            esc(&paths.stdio_socket)
        ),
        "-device",
        &format!("virtserialport,bus=crust-vser.0,chardev=crust-stdio,name={STDIO_PORT_NAME}"),
        "-chardev",
        &format!(
            "socket,id=crust-forward,path={},server=on,wait=off",
            esc(&paths.forward_socket)
        ),
        "-device",
        &format!("virtserialport,bus=crust-vser.0,chardev=crust-forward,name={FORWARD_PORT_NAME}"),
    ]);
    for (i, sh) in cfg.shares.iter().enumerate() {
        push(&[
            "-chardev",
            &format!("socket,id=crust-fs{i},path={}", esc(&paths.fs_socket(i))),
            "-device",
            &format!("vhost-user-fs-pci,chardev=crust-fs{i},tag={}", sh.tag),
        ]);
    }
    // Free page reporting: pages the guest frees go back to the host
    // (QEMU discards them), so a pod's host memory falls again after its
    // guest's page cache or heap shrinks. Never inflated.
    push(&[
        "-device",
        "virtio-balloon-pci,id=crust-balloon,free-page-reporting=on",
    ]);
    a.extend(device_args(cfg));
    a
}

/// NICs, boot disks (each on its own root port, with an iothread) and
/// the empty root ports left for hot-plug.
fn device_args(cfg: &VmConfig) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    let vhost = std::path::Path::new(crate::config::VHOST_NET).exists();
    for (i, nic) in cfg.nics.iter().enumerate() {
        let (netdev, device) = nic.qemu_args(i, vhost);
        push(&["-netdev", &netdev, "-device", &device]);
    }
    let mut chassis = 1;
    for (i, d) in cfg.disks.iter().enumerate() {
        let port = boot_port_id(i);
        push(&[
            "-device",
            &format!("pcie-root-port,id={port},chassis={chassis}"),
        ]);
        chassis += 1;
        // JSON syntax: no escaping of paths needed.
        push(&["-blockdev", &d.blockdev_add_args().to_string()]);
        // A queue per vCPU and an iothread per disk, as hot-plugs get
        // (crust-qmp's device_add_virtio_blk); the host's sector size.
        let iothread = d.iothread_id();
        push(&["-object", &format!("iothread,id={iothread}")]);
        let mut dev = d.device_add_args(&port);
        dev["num-queues"] = json!(cfg.cpus);
        dev["iothread"] = json!(iothread);
        if let Ok(bs) = crust_blockdev::logical_block_size(&d.path) {
            dev["logical_block_size"] = json!(bs);
            dev["physical_block_size"] = json!(bs);
        }
        push(&["-device", &dev.to_string()]);
    }
    for i in 0..cfg.hotplug_ports {
        push(&[
            "-device",
            &format!("pcie-root-port,id={},chassis={chassis}", hotplug_port_id(i)),
        ]);
        chassis += 1;
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DiskSpec, ShareSpec};

    #[test]
    fn command_line_shape() {
        let k = tempfile::NamedTempFile::new().unwrap();
        let mut cfg = VmConfig::new("t1", k.path(), k.path(), "/run/x,y");
        cfg.disks.push(DiskSpec {
            id: "data".into(),
            path: k.path().into(),
            serial: "crust-data".into(),
            readonly: true,
        });
        cfg.hotplug_ports = 2;
        cfg.max_memory_mib = 2048;
        cfg.max_cpus = 4;
        cfg.kernel_cmdline_extra = vec!["foo=bar".into()];
        cfg.shares.push(ShareSpec {
            tag: "pod".into(),
            dir: "/srv".into(),
        });
        let paths = RunPaths::new(&cfg.run_dir);
        let a = qemu_args(&cfg, ResolvedAccel::Tcg, &paths);
        let joined = a.join(" ");
        for want in [
            "-machine q35",
            "-accel tcg,tb-size=32",
            "-nodefaults -no-user-config -nographic -no-reboot",
            "unix:/run/x,,y/qmp.sock,server=on,wait=off",
            "socket,id=crust-agent,path=/run/x,,y/agent.sock,server=on,wait=off",
            "name=org.crust.agent",
            "pcie-root-port,id=crust-boot0,chassis=1",
            "pcie-root-port,id=crust-hp0,chassis=2",
            "pcie-root-port,id=crust-hp1,chassis=3",
            "foo=bar",
            "memory-backend-memfd,id=crust-mem,size=256M,share=on",
            "-numa node,memdev=crust-mem",
            "-m 256M,slots=8,maxmem=2048M",
            "-smp 1,maxcpus=4",
            "memhp_default_state=online",
            "socket,id=crust-fs0,path=/run/x,,y/fs0.sock",
            "vhost-user-fs-pci,chardev=crust-fs0,tag=pod",
        ] {
            assert!(joined.contains(want), "missing {want:?} in {joined}");
        }
        let bd = a.iter().position(|x| x == "-blockdev").unwrap();
        let v: serde_json::Value = serde_json::from_str(&a[bd + 1]).unwrap();
        assert_eq!(v["read-only"], true);
        assert_eq!(v["file"]["cache"]["direct"], true);
        assert_eq!(
            a[bd + 2..bd + 4],
            ["-object", "iothread,id=iothread-crust-disk-data"]
        );
        let dev: serde_json::Value = serde_json::from_str(&a[bd + 5]).unwrap();
        assert_eq!(dev["bus"], "crust-boot0");
        assert_eq!(dev["serial"], "crust-data");
        assert_eq!(dev["iothread"], "iothread-crust-disk-data");
        assert_eq!(dev["num-queues"], cfg.cpus);
    }
}
