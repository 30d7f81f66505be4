//! The guest's virtio-serial ports, found by the name the host gave them
//! (`virtserialport,name=...`). Both channels (requests in
//! [`crate::server`], container stdio in [`crate::container::stdio`]) look
//! their port up here.

use std::path::{Path, PathBuf};

/// Finds `/dev/vportNpM` for the port called `name`.
pub fn find_port(name: &str) -> Result<PathBuf, Vec<String>> {
    let mut seen = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/sys/class/virtio-ports") {
        for e in rd.flatten() {
            let n = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
            let n = n.trim();
            let dev = e.file_name().to_string_lossy().into_owned();
            if n == name {
                return Ok(Path::new("/dev").join(dev));
            }
            seen.push(format!("{dev}={n:?}"));
        }
    }
    Err(seen)
}
