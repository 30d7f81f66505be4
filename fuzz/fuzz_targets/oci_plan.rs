//! Long form only (the `shim` feature): a container's OCI spec, as
//! containerd writes config.json into the bundle, read by the crust shim
//! and turned into what the guest runs (crust-sandbox's `spec::load` +
//! `spec::plan`), and the LinuxResources of a task Update
//! (`spec::update_limits`).
//! Invariants: no panic; malformed input is an error, never a plan; a plan
//! runs something, shares only absolute host paths without `..`, mounts
//! each destination once, names a valid namespace set and passes the
//! guest's own checks of what it carries (sysctls, user namespace), so
//! nothing the shim accepts is refused by the agent later; a plan does
//! not depend on anything but its input.
#![no_main]

use std::path::{Component, Path};

use crust_sandbox::spec::{self, Planned};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the reader: the rest is a config.json or an
    // Update's LinuxResources JSON.
    let Some((&head, body)) = data.split_first() else {
        return;
    };
    if head & 1 == 1 {
        if let Ok(l) = spec::update_limits(spec::LINUX_RESOURCES_URL, body) {
            assert!(l.memory.is_none_or(|m| m > 0), "{l:?}");
        }
        return;
    }
    let dir = Path::new(&std::env::var("CRUST_FUZZ_SCRATCH").unwrap_or_else(|_| "/tmp".into()))
        .join(format!("oci-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), body).unwrap();
    let Ok(oci) = spec::load(&dir) else {
        return;
    };
    let Ok(plan) = spec::plan(&oci, Path::new("/run/bundle")) else {
        return;
    };
    assert!(!plan.process.args.is_empty());
    assert_eq!(
        spec::plan(&oci, Path::new("/run/bundle")).as_ref(),
        Ok(&plan)
    );
    let mut destinations = std::collections::HashSet::new();
    for m in &plan.mounts {
        let d = match m {
            Planned::Guest(g) => g.destination.clone(),
            Planned::HostBind {
                destination,
                source,
                ..
            } => {
                assert!(source.is_absolute(), "{source:?}");
                assert!(
                    !source.components().any(|c| c == Component::ParentDir),
                    "{source:?}"
                );
                destination.clone()
            }
        };
        assert!(destinations.insert(d.clone()), "{d} mounted twice");
    }
    crust_agent_proto::check_sysctls(&plan.sysctl, &plan.ipc, &plan.uts)
        .expect("the agent refuses the shim's sysctls");
    crust_agent_proto::check_user_namespace(&plan.user, plan.process.user.as_ref(), &[])
        .expect("the agent refuses the shim's user namespace");
});
