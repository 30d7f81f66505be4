//! Building the images the way CI does, for the image tests.

use std::path::Path;
use std::process::Command;

/// The cargo profile these tests were built with (`debug` images carry a
/// `-dev` tag).
pub fn profile() -> String {
    // target/<profile>/deps/<test>-xxxx
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

/// The image tag for this workspace version and profile.
pub fn tag() -> String {
    let version = env!("CARGO_PKG_VERSION");
    if profile() == "debug" {
        format!("{version}-dev")
    } else {
        version.to_string()
    }
}

/// Runs `scripts/build-images.sh` from the already built binaries into
/// `out`; returns its `images.txt` (references and digests).
pub fn build_images(out: &Path, source_date_epoch: Option<&str>) -> String {
    for bin in [
        "crust-csi",
        "crustctl",
        "crust-runtime",
        "crust-node-install",
    ] {
        crust_testkit::workspace_bin(bin);
    }
    crust_testkit::ensure_guest_image();
    let root = crust_testkit::workspace_root();
    // The payload's static per-poll CLI (cargo keeps it when up to date).
    let poll = Command::new("bash")
        .arg(root.join("scripts/build-poll-cli.sh"))
        .current_dir(&root)
        .stdin(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(poll.success(), "scripts/build-poll-cli.sh failed");
    let mut cmd = Command::new("bash");
    cmd.arg(root.join("scripts/build-images.sh"))
        .args(["--profile", &profile(), "--no-build"])
        .current_dir(&root)
        .env("CRUST_IMAGES_OUT", out)
        .env("CRUST_GUEST_DIR", crust_testkit::guest_image_dir())
        .stdin(std::process::Stdio::null());
    if let Some(t) = source_date_epoch {
        cmd.env("SOURCE_DATE_EPOCH", t);
    }
    assert!(cmd.status().unwrap().success(), "build-images.sh failed");
    std::fs::read_to_string(out.join("images.txt")).unwrap()
}
