//! Running host programs: the crate's one runner, below both the
//! filesystem tools ([`crate::fs`]) and the signature probe
//! ([`crate::probe`]'s wipefs).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Why a program did not run or did not succeed. [`crate::FsError::Tool`]
/// carries it as it is, so both say the same.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("{0} not found in PATH, /usr/sbin or /sbin")]
    NotFound(&'static str),
    #[error("running {tool}: {source}")]
    Spawn {
        tool: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{tool} on {target} failed ({status}): {stderr}")]
    Failed {
        tool: &'static str,
        target: PathBuf,
        status: String,
        stderr: String,
    },
}

/// Finds an admin tool even when PATH lacks the sbin directories (systemd
/// units and test harnesses often run with a short PATH).
pub(crate) fn find_tool(name: &'static str) -> Result<PathBuf, ToolError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(ToolError::NotFound(name))
}

/// Runs a tool on `target` (named in errors); exit codes in `ok_codes`
/// count as success. Returns its stdout.
pub(crate) fn run_accepting(
    tool: &'static str,
    args: &[&std::ffi::OsStr],
    target: &Path,
    ok_codes: &[i32],
) -> Result<String, ToolError> {
    let exe = find_tool(tool)?;
    let out = Command::new(&exe)
        .args(args)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|source| ToolError::Spawn { tool, source })?;
    if !out.status.code().is_some_and(|c| ok_codes.contains(&c)) {
        let mut stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if stderr.is_empty() {
            stderr = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        }
        return Err(ToolError::Failed {
            tool,
            target: target.to_path_buf(),
            status: out.status.to_string(),
            stderr,
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
