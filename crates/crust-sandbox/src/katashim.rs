//! Where Kata's own CLI finds a sandbox's shim. `kata-runtime direct-volume
//! stats|resize` reads the sandbox id from the Kata hand-off record, then
//! connects to `/run/vc/sbs/<id>/shim-monitor.sock` (Kata's Go runtime)
//! or, when that does not exist, `/run/kata/<id>/shim-monitor.sock`
//! (Kata's Rust runtime). For crust to be a drop-in, each sandbox's shim
//! socket is linked there for as long as the shim serves: created when the
//! shim starts serving, removed at teardown (and by `delete` after a
//! crash). The directories are configurable (`--kata-shim-dirs`) so tests
//! and side-by-side installs use their own.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::path::{Path, PathBuf};

/// The socket's name in each directory.
pub const SOCKET_NAME: &str = "shim-monitor.sock";
/// Kata's directories, in the order its Go CLI tries them.
pub const DEFAULT_DIRS: &str = "/run/vc/sbs,/run/kata";

/// `<dir>/<id>/shim-monitor.sock` for each of `dirs`.
pub fn paths(dirs: &[PathBuf], id: &str) -> Vec<PathBuf> {
    dirs.iter().map(|d| d.join(id).join(SOCKET_NAME)).collect()
}

/// Links `socket` (the shim's own) into every Kata directory. A link of a
/// dead earlier shim is replaced; a live socket of someone else (a real
/// Kata shim with this id) is refused. On failure nothing stays linked.
pub fn link(dirs: &[PathBuf], id: &str, socket: &Path) -> Result<(), String> {
    for (i, dir) in dirs.iter().enumerate() {
        if let Err(e) = link_one(dir, id, socket) {
            unlink(&dirs[..i], id, socket);
            return Err(e);
        }
    }
    Ok(())
}

fn link_one(dir: &Path, id: &str, socket: &Path) -> Result<(), String> {
    let sb = dir.join(id);
    let err = |what: &str, p: &Path, e: std::io::Error| format!("{what} {}: {e}", p.display());
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&sb)
        .map_err(|e| err("creating", &sb, e))?;
    let link = sb.join(SOCKET_NAME);
    match std::fs::symlink_metadata(&link) {
        Ok(m) => {
            let ours = std::fs::read_link(&link).is_ok_and(|t| t == socket);
            if ours {
                return Ok(());
            }
            let live = (m.file_type().is_socket() || m.file_type().is_symlink())
                && std::os::unix::net::UnixStream::connect(&link).is_ok();
            if live {
                return Err(format!(
                    "{} is served by another shim (a Kata sandbox with the same id?)",
                    link.display()
                ));
            }
            std::fs::remove_file(&link).map_err(|e| err("removing stale", &link, e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("checking", &link, e)),
    }
    std::os::unix::fs::symlink(socket, &link).map_err(|e| err("linking", &link, e))
}

/// Removes the links that point at `socket`, and the sandbox directories
/// once empty. Anything else is left alone.
pub fn unlink(dirs: &[PathBuf], id: &str, socket: &Path) {
    for link in paths(dirs, id) {
        if std::fs::read_link(&link).is_ok_and(|t| t == socket)
            && let Err(e) = std::fs::remove_file(&link)
        {
            tracing::warn!("removing {}: {e}", link.display());
        }
        if let Some(sb) = link.parent() {
            // Fails (and stays) when something else lives there.
            let _ = std::fs::remove_dir(sb);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_replace_stale_refuse_live_and_unlink_only_ours() {
        let d = tempfile::tempdir().unwrap();
        let dirs = vec![d.path().join("vc/sbs"), d.path().join("kata")];
        let sock = d.path().join("shim.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        link(&dirs, "sb1", &sock).unwrap();
        for p in paths(&dirs, "sb1") {
            assert_eq!(std::fs::read_link(&p).unwrap(), sock);
            std::os::unix::net::UnixStream::connect(&p).unwrap();
        }
        link(&dirs, "sb1", &sock).unwrap(); // idempotent
        // A stale link of an earlier shim is replaced.
        let stale = dirs[0].join("sb2").join(SOCKET_NAME);
        std::fs::create_dir_all(stale.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(d.path().join("gone.sock"), &stale).unwrap();
        link(&dirs, "sb2", &sock).unwrap();
        assert_eq!(std::fs::read_link(&stale).unwrap(), sock);
        // Someone else's live socket: refused, nothing left linked.
        let other = d.path().join("other.sock");
        let _o = std::os::unix::net::UnixListener::bind(&other).unwrap();
        let taken = dirs[1].join("sb3").join(SOCKET_NAME);
        std::fs::create_dir_all(taken.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&other, &taken).unwrap();
        let e = link(&dirs, "sb3", &sock).unwrap_err();
        assert!(e.contains("another shim"), "{e}");
        assert!(!dirs[0].join("sb3").join(SOCKET_NAME).exists());
        unlink(&dirs, "sb3", &sock);
        assert_eq!(std::fs::read_link(&taken).unwrap(), other, "not ours: kept");
        // Teardown removes our links and their directories.
        unlink(&dirs, "sb1", &sock);
        for p in paths(&dirs, "sb1") {
            assert!(!p.parent().unwrap().exists(), "{}", p.display());
        }
    }
}
