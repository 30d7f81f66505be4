//! Issue 41 through containerd's CRI, as kubelet asks: a container with
//! no securityContext (containerd's default capabilities, CAP_SYS_CHROOT
//! among them) stays in its root, the same pod under crust and under runc.
//!
//! Each pod has two containers: `sibling` (uid 1000) keeps a file named by
//! a random needle in its rootfs and on a host directory bound into it;
//! `attacker` (root, defaults) runs `crust-escape` from the test image
//! (scripts/test-images/escape.c): the chroot + `..` break-out, every
//! visible `/proc/<pid>/root` and `/cwd`, every inherited directory
//! descriptor. After each attempt its `/` must still be its own root, the
//! needle out of reach, the guest's `kernel.core_pattern` not writable, and
//! its capabilities and seccomp mode unchanged. `unshare -U` works in both
//! containers (RuntimeDefault still refusing it is pod_confinement's).
//! The runc pod's report is the reference: crust's must be the same lines.
//! Where runc does not run under the CRI plugin (some machines), the runc
//! half is skipped and says so; crust's absolute checks still run.
//! Budget: one TCG guest, ~40 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::BTreeSet;

use common::{Env, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;

/// A pod's sandbox and its two containers.
struct Pod {
    sandbox: String,
    attacker: String,
    sibling: String,
}

fn container(
    name: &str,
    command: &str,
    run_as_user: Option<i64>,
    mounts: Vec<cri::Mount>,
) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: crust_testkit::BUSYBOX_IMAGE.into(),
            ..Default::default()
        }),
        command: vec!["sh".into(), "-c".into(), command.into()],
        mounts,
        linux: Some(cri::LinuxContainerConfig {
            // What kubelet sends for a container without securityContext
            // in a hostNetwork pod.
            security_context: Some(cri::LinuxContainerSecurityContext {
                run_as_user: run_as_user.map(|value| cri::Int64Value { value }),
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Node as i32,
                    pid: cri::NamespaceMode::Container as i32,
                    ipc: cri::NamespaceMode::Pod as i32,
                    ..Default::default()
                }),
                masked_paths: common::strings(common::KUBELET_MASKED_PATHS),
                readonly_paths: common::strings(common::KUBELET_READONLY_PATHS),
                ..Default::default()
            }),
            ..Default::default()
        }),
        log_path: format!("{name}.log"),
        ..Default::default()
    }
}

/// RunPodSandbox with `handler` ("" is runc), then both containers.
async fn try_pod(
    cri: &mut Cri,
    env: &Env,
    handler: &str,
    needle: &str,
    shared: &std::path::Path,
) -> Result<Pod, String> {
    let name = format!(
        "escape-{}",
        if handler.is_empty() { "runc" } else { handler }
    );
    let log_dir = env.dir.path().join(&name);
    std::fs::create_dir_all(&log_dir).unwrap();
    let mut config = common::host_network_sandbox(
        &name,
        &format!("9f8a1c2e-0000-4000-8000-00000e5c{:04x}", handler.len()),
        0,
    );
    config.log_directory = log_dir.display().to_string();
    let sandbox = cri
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.into(),
        })
        .await
        .map_err(|e| format!("RunPodSandbox {name}: {e}"))?
        .into_inner()
        .pod_sandbox_id;
    let mut ids = Vec::new();
    for c in [
        container(
            "sibling",
            &format!("touch /tmp/{needle} && exec sleep 100000"),
            Some(1000),
            vec![cri::Mount {
                container_path: "/data".into(),
                host_path: shared.display().to_string(),
                ..Default::default()
            }],
        ),
        container("attacker", "exec sleep 100000", None, Vec::new()),
    ] {
        let id = cri
            .runtime
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: sandbox.clone(),
                config: Some(c),
                sandbox_config: Some(config.clone()),
            })
            .await
            .map_err(|e| format!("CreateContainer {name}: {e}"))?
            .into_inner()
            .container_id;
        cri.runtime
            .start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            })
            .await
            .map_err(|e| format!("StartContainer {name}: {e}"))?;
        ids.push(id);
    }
    Ok(Pod {
        sandbox,
        sibling: ids.remove(0),
        attacker: ids.remove(0),
    })
}

/// What a pod shows: the escape report's distinct lines and `unshare -U`
/// in each container.
async fn observe(cri: &mut Cri, pod: &Pod, needle: &str) -> BTreeSet<String> {
    // The sibling's file is there before the attempt (no false "out of
    // reach" from a sibling that never wrote it).
    let (code, out) = exec(cri, &pod.sibling, &format!("ls /tmp/{needle}")).await;
    assert_eq!(code, 0, "the sibling's needle: {out}");
    let (code, out) = exec(cri, &pod.attacker, &format!("crust-escape {needle}")).await;
    assert_eq!(code, 0, "crust-escape: {out}");
    let mut seen: BTreeSet<String> = out.lines().map(str::to_string).collect();
    for (who, cid) in [("attacker", &pod.attacker), ("sibling", &pod.sibling)] {
        let (code, out) = exec(cri, cid, "id -u; unshare -U id -u").await;
        seen.insert(format!("{who}: id, unshare -U id: {code} {out:?}"));
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_with_default_capabilities_stays_in_its_root() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let needle = format!(
        "needle-{:016x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    );
    // A host directory bound into the sibling (over virtio-fs in crust's
    // guest): the needle there must be out of reach too.
    let shared = env.dir.path().join("sibling-data");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::write(shared.join(&needle), "the sibling's data").unwrap();
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();

    let pod = try_pod(
        &mut cri,
        &env,
        crust_testkit::CRUST_HANDLER,
        &needle,
        &shared,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.logs()));
    let crust = observe(&mut cri, &pod, &needle).await;
    let report = crust.iter().cloned().collect::<Vec<_>>().join("\n");
    eprintln!("crust's report:\n{report}");
    // Absolute: every attempt ran and reached nothing.
    for must in [
        "chroot: own root",
        "chroot: needle not found",
        "proc-root: own root",
        "proc-cwd: own root",
        "Seccomp:\t0",
    ] {
        assert!(crust.contains(must), "{must:?} missing:\n{report}");
    }
    for never in [
        "ESCAPED",
        "FOUND",
        "core_pattern writable",
        ": fork",
        "mkdtemp",
    ] {
        assert!(!report.contains(never), "{never:?}:\n{report}");
    }
    // Default capabilities, no CAP_SYS_ADMIN (bit 21) gained.
    let cap_eff = crust
        .iter()
        .find_map(|l| l.strip_prefix("CapEff:\t"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or_else(|| panic!("no CapEff:\n{report}"));
    assert!(
        cap_eff & (1 << 18) != 0 && cap_eff & (1 << 21) == 0,
        "CapEff {cap_eff:x}"
    );
    // Nested user namespaces, as root and as uid 1000.
    for (who, uid) in [("attacker", 0), ("sibling", 1000)] {
        let line = format!("{who}: id, unshare -U id: 0 \"{uid}\\n65534\\n\"");
        assert!(crust.contains(&line), "{line}:\n{report}");
    }
    // The pod runs on: the sibling still has its file, its data untouched.
    let (code, out) = exec(&mut cri, &pod.sibling, &format!("cat /data/{needle}")).await;
    assert_eq!((code, out.as_str()), (0, "the sibling's data"));
    common::stop_and_remove_sandbox(&mut cri, &pod.sandbox).await;

    // The same pod under runc: the reference.
    match try_pod(&mut cri, &env, "", &needle, &shared).await {
        Ok(pod) => {
            let runc = observe(&mut cri, &pod, &needle).await;
            common::stop_and_remove_sandbox(&mut cri, &pod.sandbox).await;
            assert_eq!(
                crust,
                runc,
                "crust's report differs from runc's:\n--- crust\n{report}\n--- runc\n{}",
                runc.iter().cloned().collect::<Vec<_>>().join("\n")
            );
        }
        Err(e) => {
            eprintln!("SKIPPED the runc pod: runc does not run under the CRI plugin here: {e}")
        }
    }
}
