//! The CLI door takes a bundle's network namespace as the containerd door
//! takes a pod's (crust-sandbox's `net`): a namespace made by CNI's own
//! bridge and host-local plugins (from /usr/lib/cni) is mirrored into the
//! guest, whose `eth0` gets CNI's address and reaches CNI's gateway; the
//! state file records what was attached; after delete the namespace is as
//! CNI left it. A bundle naming a namespace that does not exist is refused
//! before anything boots. Budget: one TCG guest, ~10 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::PathBuf;

use common::*;
use crust_testkit::{CniNamespace, VmSlot};
use serde_json::{Value, json};

/// `env.bundle` with `linux.namespaces` naming `netns`.
fn bundle_in(env: &Env, name: &str, args: &[&str], netns: &str) -> PathBuf {
    let dir = env.bundle(name, args, vec![]);
    let path = dir.join("config.json");
    let mut spec: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    spec["linux"] = json!({"namespaces": [{"type": "network", "path": netns}]});
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    dir
}

#[test]
fn a_bundles_cni_namespace_goes_into_the_guest() {
    let env = Env::new();
    let cni = CniNamespace::new(env.dir.path(), "net");
    let before = cni.links();
    let _slot = VmSlot::acquire();

    // A namespace that is not there: refused naming it, nothing left.
    let gone = bundle_in(
        &env,
        "gone",
        &["sleep", "600"],
        "/run/netns/crust-no-such-ns",
    );
    let err = env.fails(&["create", "--bundle", gone.to_str().unwrap(), "gone"]);
    assert!(err.contains("crust-no-such-ns"), "{err}");
    assert!(!env.root.join("gone").exists(), "sandbox gone left state");

    let b = bundle_in(&env, "net", &["sleep", "600"], &cni.path());
    env.ok(&["create", "--bundle", b.to_str().unwrap(), "net"]);
    let sb = env.sandbox("net");
    let st = env.state_file("net");
    assert_eq!(
        st["networkNamespace"].as_str(),
        Some(cni.path().as_str()),
        "{st}"
    );
    assert_eq!(st["networkLinks"], json!(["eth0"]), "{st}");
    assert!(
        cni.links().len() > before.len(),
        "no tap in the namespace: {:?}",
        cni.links()
    );

    // The guest's eth0 has CNI's address and reaches CNI's gateway.
    let addrs = sb.sh("ip -o -4 addr show dev eth0");
    assert!(
        addrs.contains(&cni.address),
        "{addrs} lacks {}",
        cni.address
    );
    let routes = sb.sh("ip -4 route");
    assert!(
        routes.contains(&format!("default via {}", cni.gateway)),
        "{routes}"
    );
    sb.sh(&format!("ping -c 2 -W 5 {}", cni.gateway));

    env.ok(&["start", "net"]);
    env.ok(&["delete", "--force", "net"]);
    drop(sb);
    assert_eq!(cni.links(), before, "the namespace is not as CNI left it");
    assert_clean(&env);
}
