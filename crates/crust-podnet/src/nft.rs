//! Netfilter's own tools, run inside the pod's namespace: `nft` (the
//! anti-spoofing table, reading nftables and iptables-nft rules) and
//! `iptables-legacy-save` (reading legacy tables). A child forked from a
//! thread that entered the namespace is born in it, so the tools need no
//! namespace handling of their own.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{NetError, NetNs};

/// Where a netfilter tool is looked for: next to the running binary (the
/// node payload carries `nft` beside the shim), `$PATH`, then the sbin
/// directories a service's environment often lacks.
pub(crate) fn locate(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf));
    beside
        .into_iter()
        .chain(std::env::split_paths(&path))
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Runs `tool args` in `ns` with `stdin`, and returns its standard
/// output; a non-zero exit is an error carrying its standard error.
pub(crate) fn run_in(
    ns: &NetNs,
    tool: &Path,
    args: &[&str],
    stdin: Option<String>,
) -> Result<String, NetError> {
    let tool = tool.to_path_buf();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    ns.run(move || {
        let what = format!("{} {}", tool.display(), args.join(" "));
        let io = |source| NetError::Io {
            what: what.clone(),
            source,
        };
        let mut child = Command::new(&tool)
            .args(&args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io)?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes()).map_err(io)?;
        }
        let out = child.wait_with_output().map_err(io)?;
        if !out.status.success() {
            return Err(NetError::Tool {
                what,
                reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    })
}

/// Deletes `table` of `family` in `ns` if there: idempotent, and a node
/// without `nft` can have made none. A failure is logged as `what`.
pub(crate) fn delete_table(ns: &NetNs, family: &str, table: &str, what: &str) {
    let Some(nft) = locate("nft") else {
        return;
    };
    let script = format!("table {family} {table}\ndelete table {family} {table}\n");
    if let Err(e) = run_in(ns, &nft, &["-f", "-"], Some(script)) {
        tracing::warn!(netns = %ns.path(), "removing {what}: {e}");
    }
}

/// `nft`, or an error saying what needs it.
pub(crate) fn nft(why: &str) -> Result<PathBuf, NetError> {
    locate("nft").ok_or_else(|| NetError::Tool {
        what: "nft".into(),
        reason: format!("not found on the node (package nftables): {why}"),
    })
}
