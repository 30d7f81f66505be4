//! Directory creation that remembers what it made, so teardown removes
//! exactly those directories and never one that existed before.

use std::path::{Path, PathBuf};

/// Creates `dir` and its missing parents, outermost first, calling `made`
/// for each directory this call created. On failure, returns the path that
/// could not be created and why.
pub fn create_missing(
    dir: &Path,
    mut made: impl FnMut(&Path),
) -> Result<(), (PathBuf, std::io::Error)> {
    let mut missing = Vec::new();
    for a in dir.ancestors() {
        if a.as_os_str().is_empty() || a.exists() {
            break;
        }
        missing.push(a.to_path_buf());
    }
    for p in missing.into_iter().rev() {
        match std::fs::create_dir(&p) {
            Ok(()) => made(&p),
            // Made concurrently by someone else: not ours to remove.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err((p, e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_only_the_directories_it_made() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("a")).unwrap();
        let target = tmp.path().join("a/b/c");
        let mut made = Vec::new();
        create_missing(&target, |p| made.push(p.to_path_buf())).unwrap();
        assert!(target.is_dir());
        assert_eq!(made, vec![tmp.path().join("a/b"), target.clone()]);

        made.clear();
        create_missing(&target, |p| made.push(p.to_path_buf())).unwrap();
        assert!(made.is_empty(), "nothing new to make");
    }

    #[test]
    fn fails_under_a_file_naming_the_path() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("f"), b"x").unwrap();
        let (path, _) = create_missing(&tmp.path().join("f/sub"), |_| {}).unwrap_err();
        assert_eq!(path, tmp.path().join("f/sub"));
    }
}
