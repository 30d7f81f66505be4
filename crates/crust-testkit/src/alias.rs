//! Devices a host tool creates behind crust's back that expose a volume's
//! data a second time (issue 24): the backing file attached again and
//! mounted, a hard link of it attached, a loop stacked on the volume's
//! device. Made with `losetup` as any host tool would, and released on
//! drop (the mount first, then the loop, then the link).

use std::path::{Path, PathBuf};
use std::process::Command;

use crust_blockdev::{FsType, LoopGuard, MountGuard};
use tempfile::TempDir;

/// The ways of reaching a volume's data through another device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AliasCase {
    /// `losetup -f <backing file>`, then that device mounted (rw).
    SecondAttachMounted,
    /// `losetup -f <hard link of the backing file>` (another path, same inode).
    HardLink,
    /// `losetup -f /dev/loopN`: a loop on the volume's own device.
    Stacked,
}

impl AliasCase {
    pub const ALL: [AliasCase; 3] = [
        AliasCase::SecondAttachMounted,
        AliasCase::HardLink,
        AliasCase::Stacked,
    ];

    /// Creates the alias of the volume `backing` attached at `dev`
    /// (holding ext4 when the case mounts).
    pub fn make(self, backing: &Path, dev: &Path) -> Alias {
        let scratch = tempfile::tempdir().expect("alias scratch dir");
        let (source, link) = match self {
            AliasCase::SecondAttachMounted => (backing.to_path_buf(), None),
            AliasCase::HardLink => {
                let link = backing.with_extension("link");
                std::fs::hard_link(backing, &link).expect("hard link");
                (link.clone(), Some(link))
            }
            AliasCase::Stacked => (dev.to_path_buf(), None),
        };
        let link = LinkGuard(link);
        let device = losetup(&source, false);
        let mount = (self == AliasCase::SecondAttachMounted).then(|| {
            let m = MountGuard::mount_fs(device.path(), scratch.path(), FsType::Ext4, &[], false)
                .expect("mount the alias");
            std::fs::write(scratch.path().join("from-the-alias"), b"second kernel")
                .expect("write through the alias");
            m
        });
        Alias {
            mount,
            device,
            _link: link,
            _scratch: scratch,
        }
    }
}

/// An alias device; fields drop in order: unmount, detach, unlink.
#[derive(Debug)]
pub struct Alias {
    mount: Option<MountGuard>,
    device: LoopGuard,
    _link: LinkGuard,
    _scratch: TempDir,
}

impl Alias {
    /// The alias device node, `/dev/loopM`.
    pub fn dev(&self) -> &Path {
        self.device.path()
    }

    pub fn dev_str(&self) -> &str {
        self.dev().to_str().expect("loop path is UTF-8")
    }

    /// Where it is mounted, if the case mounts it.
    pub fn mount_point(&self) -> Option<&Path> {
        self.mount.as_ref().map(MountGuard::target)
    }
}

#[derive(Debug)]
struct LinkGuard(Option<PathBuf>);

impl Drop for LinkGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// `losetup -f --show [-P] source` (the way a host tool attaches), guarded.
pub fn losetup(source: &Path, partscan: bool) -> LoopGuard {
    let mut cmd = Command::new("losetup");
    cmd.args(["-f", "--show"]);
    if partscan {
        cmd.arg("-P");
    }
    let out = cmd.arg(source).output().expect("run losetup");
    assert!(
        out.status.success(),
        "losetup {}: {}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let dev = String::from_utf8(out.stdout).expect("losetup output");
    LoopGuard::adopt_path(Path::new(dev.trim())).expect("adopt the loop device")
}

/// sha256 of a file's (or device's) bytes, by `sha256sum`.
pub fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("run sha256sum");
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("a digest")
        .to_string()
}

/// Panics unless `e2fsck -fn` finds the ext4 in `image` clean.
pub fn assert_fsck_clean(image: &Path) {
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(image)
        .output()
        .expect("run e2fsck");
    assert!(
        out.status.success(),
        "e2fsck -fn {}: {}{}",
        image.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
