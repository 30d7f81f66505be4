//! deploy/kubernetes validated offline by scripts/validate-manifests.py:
//! every file and the rendered base, example overlay and uninstall against
//! the Kubernetes schemas that `kubernetes-validate` ships (strict), the
//! built-in renderer checked against `kubectl kustomize` when kubectl is
//! installed, and the deployment's own facts (pinned sidecars, node
//! deployment flags, mounts, probe wiring, RBAC within what each sidecar's
//! repository ships), and that the examples ask only for what base
//! installs (RuntimeClass, StorageClass; no hostNetwork). A broken copy
//! must fail, so the check can fail.

use std::path::Path;
use std::process::Command;

fn validate(dir: &Path) -> (bool, String) {
    let root = crust_testkit::workspace_root();
    let out = Command::new(crust_testkit::venv_python_with("kubernetes_validate"))
        .arg(root.join("scripts/validate-manifests.py"))
        .env("CRUST_MANIFESTS_DIR", dir)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn manifests_validate_against_current_kubernetes_and_the_deployment_facts() {
    let dir = crust_testkit::workspace_root().join("deploy/kubernetes");
    let (ok, text) = validate(&dir);
    assert!(ok, "{text}");
    assert!(text.contains("against Kubernetes 1.35.0, 1.37.0"), "{text}");
}

#[test]
fn a_broken_copy_fails_validation() {
    let src = crust_testkit::workspace_root().join("deploy/kubernetes");
    let tmp = tempfile::tempdir().unwrap();
    let st = Command::new("cp")
        .arg("-r")
        .arg(&src)
        .arg(tmp.path().join("k"))
        .status()
        .unwrap();
    assert!(st.success());
    let k = tmp.path().join("k");
    let edit = |rel: &str, from: &str, to: &str| {
        let p = k.join(rel);
        let s = std::fs::read_to_string(&p).unwrap();
        assert!(s.contains(from), "{rel} lacks {from}");
        std::fs::write(&p, s.replacen(from, to, 1)).unwrap();
    };
    // A field Kubernetes does not know, a sidecar off its pinned release,
    // a verb beyond the upstream rules, and the lost Bidirectional mount.
    edit(
        "base/csidriver.yaml",
        "requiresRepublish: false",
        "requiresRepublish: false\n  attachable: true",
    );
    edit(
        "base/csi-node.yaml",
        "csi-provisioner:v6.3.0",
        "csi-provisioner:v5.0.0",
    );
    edit(
        "base/rbac-csi-node.yaml",
        "verbs: [\"get\", \"list\", \"watch\", \"create\", \"update\", \"patch\", \"delete\"]",
        "verbs: [\"*\"]",
    );
    edit(
        "base/csi-node.yaml",
        "mountPropagation: Bidirectional",
        "mountPropagation: None",
    );
    // The peers' Service losing its not-ready pods, and the key Secret
    // made mandatory (a node would not start before it exists).
    edit(
        "base/csi-peers.yaml",
        "publishNotReadyAddresses: true",
        "publishNotReadyAddresses: false",
    );
    edit("base/csi-node.yaml", "optional: true", "optional: false");
    // An example pod back on hostNetwork, and its claim on a class base
    // does not install.
    edit(
        "examples/pvc-pod.yaml",
        "  runtimeClassName: crust\n",
        "  runtimeClassName: crust\n  hostNetwork: true\n",
    );
    edit(
        "examples/pvc-pod.yaml",
        "storageClassName: crust-ext4-deferred",
        "storageClassName: crust-ext5",
    );
    let (ok, text) = validate(&k);
    assert!(!ok, "{text}");
    for want in [
        "'attachable' was unexpected",
        "sidecar csi-provisioner",
        "verbs ['*'] beyond",
        "Bidirectional",
        "crust-csi-peers must be headless",
        "optional Secret crust-csi-peer-key",
        "pod crust-demo uses hostNetwork",
        "StorageClass crust-ext5, which base lacks",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}
