//! The guest image: found in a crust checkout, or built there.

use std::path::{Path, PathBuf};
use std::process::Stdio;

/// Ancestors of the executable and of the current directory that hold
/// `guest/build-image.sh` (a crust checkout).
pub fn workspace_roots() -> Vec<PathBuf> {
    let mut starts = Vec::new();
    if let Ok(e) = std::env::current_exe() {
        starts.push(e);
    }
    if let Ok(d) = std::env::current_dir() {
        starts.push(d);
    }
    let mut out: Vec<PathBuf> = Vec::new();
    for s in starts {
        for a in s.ancestors() {
            if a.join("guest/build-image.sh").is_file() && !out.iter().any(|o| o == a) {
                out.push(a.to_path_buf());
            }
        }
    }
    out
}

pub(crate) fn has_image(dir: &Path) -> bool {
    dir.join("vmlinuz").is_file() && dir.join("initramfs.cpio.gz").is_file()
}

/// Finds the guest image, or builds it with `guest/build-image.sh` (its
/// output goes to stderr so progress stays visible). Returns the
/// directory and whether it was built now.
pub async fn ensure_guest_image(explicit: Option<&Path>) -> Result<(PathBuf, bool), String> {
    let env_dir = std::env::var_os("CRUST_GUEST_DIR").map(PathBuf::from);
    let roots = workspace_roots();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(d) = explicit {
        candidates.push(d.to_path_buf());
    } else {
        candidates.extend(env_dir.clone());
        if let Some(d) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|p| p.join("../guest-image")))
        {
            candidates.push(d);
        }
        candidates.extend(roots.iter().map(|r| r.join("target/guest-image")));
    }
    if let Some(d) = candidates.iter().find(|d| has_image(d)) {
        return Ok((
            std::fs::canonicalize(d).unwrap_or_else(|_| d.clone()),
            false,
        ));
    }
    let Some(root) = roots.first() else {
        return Err(format!(
            "no guest image in {} and no crust checkout (guest/build-image.sh) found above the \
             executable or the current directory; build it with guest/build-image.sh or pass --guest-dir",
            candidates
                .iter()
                .map(|c| c.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    };
    let out = explicit
        .map(Path::to_path_buf)
        .or(env_dir)
        .unwrap_or_else(|| root.join("target/guest-image"));
    let script = root.join("guest/build-image.sh");
    crust_report::say(&format!(
        "building the guest image with {} (first run only)...",
        script.display()
    ));
    let st = tokio::process::Command::new("bash")
        .arg(&script)
        .arg("--out")
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(std::io::stderr())
        .stderr(std::io::stderr())
        .status()
        .await
        .map_err(|e| format!("run {}: {e}", script.display()))?;
    if !st.success() || !has_image(&out) {
        return Err(format!("{} failed ({st})", script.display()));
    }
    Ok((out, true))
}
