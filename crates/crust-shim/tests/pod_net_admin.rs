//! Issue 43, must-show 7: a container with NET_ADMIN makes network
//! devices in the guest as it would on a host: the guest kernel asks for
//! the bridge, veth and dummy modules and the image's `/sbin/modprobe`
//! (the agent) loads them from the image's network payload on first use.
//! Budget: one TCG guest, ~10 s.

mod common;

use common::{Env, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_admin_makes_a_bridge_and_a_veth_pair_in_the_guest() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let sandbox =
        common::host_network_sandbox("netadmin", "43e00000-0000-4000-8000-000000000001", 0);
    let linux = cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            capabilities: Some(cri::Capability {
                add_capabilities: vec!["NET_ADMIN".into()],
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let (sb, app) = env
        .start_busybox_pod_with(&mut cri, &sandbox, &["sleep", "600"], vec![], Some(linux))
        .await;
    let (rc, before) = exec(&mut cri, &app, "cat /proc/modules").await;
    assert_eq!(rc, 0, "{before}");
    assert!(
        !before.lines().any(|l| l.starts_with("bridge ")),
        "bridge loaded before anyone asked: {before}"
    );
    let (rc, out) = exec(
        &mut cri,
        &app,
        "ip link add br0 type bridge && ip link add v0 type veth peer name v1 && \
         ip link set v0 master br0 && ip link add d0 type dummy && brctl addbr br1 && \
         ip link set br0 up && ip -o link show",
    )
    .await;
    assert_eq!(rc, 0, "{out}\n{}", env.logs());
    // busybox ip names the peer itself (veth0): no `peer name`.
    for dev in ["br0:", " v0@", "d0:", "br1:", "master br0"] {
        assert!(out.contains(dev), "{dev} not in: {out}");
    }
    let (_, after) = exec(&mut cri, &app, "cat /proc/modules").await;
    for m in ["bridge ", "veth ", "dummy "] {
        assert!(
            after.lines().any(|l| l.starts_with(m)),
            "{m}not loaded: {after}"
        );
    }
    common::stop_and_remove_sandbox(&mut cri, &sb).await;
}
