//! Validation of paths received from a container orchestrator.

use std::path::PathBuf;

/// Longest accepted path in bytes. `PATH_MAX` is 4096 including the
/// terminating NUL, so the kernel accepts at most 4095 bytes.
pub const MAX_PATH_LEN: usize = 4095;
/// Longest path component (`NAME_MAX`).
pub const MAX_NAME_LEN: usize = 255;

/// Why a path was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("path is empty")]
    Empty,
    #[error("path is {0} bytes long (limit {MAX_PATH_LEN})")]
    TooLong(usize),
    #[error("path component of {0} bytes exceeds {MAX_NAME_LEN}")]
    NameTooLong(usize),
    #[error("path contains a NUL byte")]
    Nul,
    #[error("path {} is not absolute", crust_fs::quote(.0))]
    NotAbsolute(String),
    #[error("path {} contains a \"..\" component", crust_fs::quote(.0))]
    ParentComponent(String),
    #[error("path {} is not normalized (\".\" component, repeated or trailing \"/\")", crust_fs::quote(.0))]
    NotNormalized(String),
}

/// Accepts only absolute, normalized paths: starts with `/`, no empty,
/// `.` or `..` components (so no `//` and no trailing `/` except the root
/// itself), no NUL, at most [`MAX_PATH_LEN`] bytes and components of at
/// most [`MAX_NAME_LEN`] bytes. Returns the path unchanged as a `PathBuf`.
/// Symlinks are not resolved: callers that must stay inside a directory
/// use `openat2(RESOLVE_BENEATH)`.
pub fn validate_abs_path(p: &str) -> Result<PathBuf, PathError> {
    if p.is_empty() {
        return Err(PathError::Empty);
    }
    if p.len() > MAX_PATH_LEN {
        return Err(PathError::TooLong(p.len()));
    }
    if p.contains('\0') {
        return Err(PathError::Nul);
    }
    if !p.starts_with('/') {
        return Err(PathError::NotAbsolute(p.to_owned()));
    }
    if p == "/" {
        return Ok(PathBuf::from(p));
    }
    for comp in p[1..].split('/') {
        match comp {
            ".." => return Err(PathError::ParentComponent(p.to_owned())),
            "" | "." => return Err(PathError::NotNormalized(p.to_owned())),
            c if c.len() > MAX_NAME_LEN => return Err(PathError::NameTooLong(c.len())),
            _ => {}
        }
    }
    Ok(PathBuf::from(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_normal_paths() {
        for p in [
            "/",
            "/var/lib/kubelet/pods/x/volumes",
            "/a b/c\td",
            "/..a/b..",
            "/.hidden",
        ] {
            assert_eq!(validate_abs_path(p), Ok(PathBuf::from(p)), "{p}");
        }
    }

    #[test]
    fn rejects_bad_paths() {
        assert_eq!(validate_abs_path(""), Err(PathError::Empty));
        assert!(matches!(
            validate_abs_path("rel/x"),
            Err(PathError::NotAbsolute(_))
        ));
        assert!(matches!(
            validate_abs_path("/a/../b"),
            Err(PathError::ParentComponent(_))
        ));
        assert!(matches!(
            validate_abs_path("/a/.."),
            Err(PathError::ParentComponent(_))
        ));
        assert!(matches!(
            validate_abs_path("/a//b"),
            Err(PathError::NotNormalized(_))
        ));
        assert!(matches!(
            validate_abs_path("/a/./b"),
            Err(PathError::NotNormalized(_))
        ));
        assert!(matches!(
            validate_abs_path("/a/"),
            Err(PathError::NotNormalized(_))
        ));
        assert_eq!(validate_abs_path("/a\0b"), Err(PathError::Nul));
        let long = format!("/{}", "a/".repeat(2048));
        assert!(matches!(
            validate_abs_path(&long),
            Err(PathError::TooLong(_))
        ));
        let name = format!("/{}", "n".repeat(256));
        assert_eq!(validate_abs_path(&name), Err(PathError::NameTooLong(256)));
        let ok = format!("/{}", "n".repeat(255));
        assert!(validate_abs_path(&ok).is_ok());
    }
}
