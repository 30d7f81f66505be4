//! containerd's `shim delete` after a shim was killed: the dead shim's
//! socket goes even when the bundle's `address` file is already gone (the
//! node soak found one left in containerd's socket dir after a shim was
//! SIGKILLed just before RemovePodSandbox). No VM; well under a second.

use std::os::unix::net::UnixListener;
use std::process::Command;

#[test]
fn delete_removes_a_dead_shims_socket_without_the_address_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bundle = d.join("bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    for r in ["runtime", "crust", "kata"] {
        std::fs::create_dir_all(d.join(r)).unwrap();
    }
    let grpc = d.join("containerd.sock").display().to_string();
    let address = containerd_shim::socket_address(&grpc, "k8s.io", "pod-x");
    let path = address.trim_start_matches("unix://").to_string();
    // A socket file nobody listens on any more: what a SIGKILL leaves.
    std::fs::create_dir_all(std::path::Path::new(&path).parent().unwrap()).unwrap();
    drop(UnixListener::bind(&path).unwrap());
    assert!(std::path::Path::new(&path).exists());
    let _cleanup = SocketFile(path.clone());

    let out = Command::new(crust_testkit::workspace_bin("containerd-shim-crust-v2"))
        .env("CRUST_RUNTIME_ROOT", d.join("runtime"))
        .env("CRUST_RUNTIME_CRUST_ROOT", d.join("crust"))
        .env("CRUST_RUNTIME_KATA_ROOT", d.join("kata"))
        .args(["-namespace", "k8s.io", "-address", &grpc, "-id", "pod-x"])
        .args(["-bundle", bundle.to_str().unwrap(), "delete"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !std::path::Path::new(&path).exists(),
        "the dead shim's socket {path} is left behind"
    );
}

/// Removes the socket file if the test failed before `delete` did.
struct SocketFile(String);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
