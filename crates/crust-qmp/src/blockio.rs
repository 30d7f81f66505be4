//! How QEMU reads and writes a volume: O_DIRECT or through the host page
//! cache, and with which asynchronous I/O engine.
//!
//! Volumes are opened with `cache.direct=on` (the guest's writes never sit
//! in the host page cache, where no pod is charged for them and the host,
//! not the pod, schedules their writeback; a guest flush still reaches the
//! disk: `cache.no-flush=off`) and the best engine the host allows:
//! `io_uring`, else `native` (Linux AIO, which needs O_DIRECT), else
//! `threads`. What the host allows is probed, not assumed: the kernel is
//! asked once per process ([`host_engines`]: `io_uring_setup`, `io_setup`),
//! and QEMU's own refusal of an engine moves a hot-plug to the next
//! [`BlockIo::candidates`] entry. Buffered I/O is the last resort, for a
//! file on a filesystem without O_DIRECT.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// QEMU's `aio` option of a `file`/`host_device` node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aio {
    IoUring,
    Native,
    Threads,
    /// The node was opened by another QMP client (QEMU does not report
    /// the engine of an existing node).
    Unknown,
}

impl Aio {
    /// The QAPI name.
    pub fn as_str(self) -> &'static str {
        match self {
            Aio::IoUring => "io_uring",
            Aio::Native => "native",
            Aio::Threads => "threads",
            Aio::Unknown => "unknown",
        }
    }
}

/// What a volume's block node was opened with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockIo {
    /// `cache.direct`: O_DIRECT, no host page cache.
    pub direct: bool,
    pub aio: Aio,
}

impl std::fmt::Display for BlockIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cache = if self.direct { "on" } else { "off" };
        write!(f, "cache.direct={cache} aio={}", self.aio.as_str())
    }
}

/// `CRUST_RUNTIME_HOST_CACHE=true`: every volume is opened through the
/// host page cache (`cache.direct=off`, `aio=threads`), the path before
/// direct I/O. An A/B switch for measurements (`bench --guest-io
/// --host-cache`); the host, not the pod, then pays for the cache.
pub const HOST_CACHE_ENV: &str = "CRUST_RUNTIME_HOST_CACHE";

/// Buffered with threads: the last resort, or the A/B path.
const BUFFERED: BlockIo = BlockIo {
    direct: false,
    aio: Aio::Threads,
};

/// Whether [`HOST_CACHE_ENV`] asks for the host page cache; read once.
pub fn host_cache_forced() -> bool {
    static FORCED: OnceLock<bool> = OnceLock::new();
    *FORCED.get_or_init(|| {
        let v = std::env::var(HOST_CACHE_ENV).unwrap_or_default();
        let on = parse_switch(&v);
        match on {
            Some(true) => {
                tracing::warn!("{HOST_CACHE_ENV}: volumes go through the host page cache")
            }
            Some(false) => {}
            None => {
                tracing::warn!("{HOST_CACHE_ENV}={v:?} is not true/1/false/0: direct I/O kept")
            }
        }
        on == Some(true)
    })
}

/// `true`/`1` on, `false`/`0`/unset off, anything else unknown.
fn parse_switch(v: &str) -> Option<bool> {
    match v {
        "true" | "1" => Some(true),
        "" | "false" | "0" => Some(false),
        _ => None,
    }
}

impl BlockIo {
    /// What to try for a node, best first: direct I/O with each engine
    /// the kernel offers, then buffered with threads (only that under
    /// [`HOST_CACHE_ENV`]).
    pub fn candidates() -> Vec<BlockIo> {
        Self::candidates_of(host_engines(), host_cache_forced())
    }

    fn candidates_of(engines: &[Aio], host_cache: bool) -> Vec<BlockIo> {
        if host_cache {
            return vec![BUFFERED];
        }
        let mut out: Vec<BlockIo> = engines
            .iter()
            .map(|&aio| BlockIo { direct: true, aio })
            .collect();
        out.push(BUFFERED);
        out
    }

    /// The best the host offers, for a disk on QEMU's command line (which
    /// cannot be retried with the next choice).
    pub fn host_best() -> BlockIo {
        Self::candidates()[0]
    }

    /// The `cache` and `aio` members of a `file`/`host_device` node's
    /// `blockdev-add` arguments, merged into `node`.
    pub fn apply(&self, node: &mut Value) {
        node["cache"] = json!({ "direct": self.direct, "no-flush": false });
        node["aio"] = json!(self.aio.as_str());
    }
}

/// The engines the kernel lets this process use, best first; `threads`
/// always. Probed once: `io_uring_setup` (off under
/// `kernel.io_uring_disabled`, seccomp, old kernels), then `io_setup`
/// (off without `CONFIG_AIO` or with `fs.aio-max-nr` used up).
pub fn host_engines() -> &'static [Aio] {
    static ENGINES: OnceLock<Vec<Aio>> = OnceLock::new();
    ENGINES.get_or_init(|| {
        let mut v = Vec::new();
        if io_uring_works() {
            v.push(Aio::IoUring);
        }
        if linux_aio_works() {
            v.push(Aio::Native);
        }
        v.push(Aio::Threads);
        tracing::info!(engines = ?v, "asynchronous I/O engines this host allows");
        v
    })
}

fn io_uring_works() -> bool {
    crust_sys::aio::io_uring_works()
        .inspect_err(|e| tracing::debug!("io_uring_setup: {e}"))
        .is_ok()
}

fn linux_aio_works() -> bool {
    crust_sys::aio::linux_aio_works()
        .inspect_err(|e| tracing::debug!("io_setup: {e}"))
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_end_buffered_and_prefer_direct() {
        let c = BlockIo::candidates();
        assert!(c[..c.len() - 1].iter().all(|b| b.direct));
        assert_eq!(
            c.last(),
            Some(&BlockIo {
                direct: false,
                aio: Aio::Threads
            })
        );
        assert_eq!(BlockIo::host_best(), c[0]);
        let mut n = json!({ "driver": "file" });
        c[0].apply(&mut n);
        assert_eq!(n["cache"]["direct"], true);
        assert_eq!(n["cache"]["no-flush"], false);
        assert_eq!(n["aio"], c[0].aio.as_str());
    }

    #[test]
    fn the_host_cache_switch_leaves_only_the_buffered_path() {
        let engines = [Aio::IoUring, Aio::Native, Aio::Threads];
        assert_eq!(BlockIo::candidates_of(&engines, false).len(), 4);
        assert_eq!(BlockIo::candidates_of(&engines, true), vec![BUFFERED]);
        assert_eq!(parse_switch("true"), Some(true));
        assert_eq!(parse_switch("1"), Some(true));
        assert_eq!(parse_switch(""), Some(false));
        assert_eq!(parse_switch("0"), Some(false));
        assert_eq!(parse_switch("yes"), None);
        assert_eq!(parse_switch("TRUE"), None);
    }
}
