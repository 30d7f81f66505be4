//! The runtime CLI's workload: one container on the guest's own root
//! (the guest brings its tools; the bundle's `root.path` is not used), run
//! through the agent's one execution model, as a pod's containers are. Its
//! stdout and stderr come over the stdio port into one log file on the
//! host, which outlives the guest.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crust_agent_proto::stdio::{Output, StdioMux};
use crust_agent_proto::{
    AgentClient, ClientError, ContainerMount, CreateContainer, MountSource, ProcessExit,
    ProcessRef, RemoveContainer, Rootfs, ShareRef, SignalProcess, StartContainer, StdioSpec,
    WaitProcess,
};

use crate::bundle::Bundle;
use crate::error::RuntimeError;
use crate::records::SandboxState;
use crate::volumes::AgentCallError;

/// The workload's container id in the guest.
pub const ID: &str = "workload";
/// Its log, in the sandbox's directory.
pub const LOG_FILE: &str = "workload.log";
/// At most this much of the log's end is answered.
pub const MAX_LOG_TAIL: u64 = 256 * 1024;
/// The workload's stdio stream (it is the guest's only process with one).
const STREAM: u32 = 1;
/// PATH when the bundle gives none (the guest's).
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long one wait for its exit lasts before it is asked again.
const WAIT_SLICE: Duration = Duration::from_secs(30);

fn init() -> ProcessRef {
    ProcessRef {
        container: ID.into(),
        exec_id: None,
    }
}

/// The container the bundle asks for: its process (read as the containerd
/// door reads a container's) and seccomp profile, with the sandbox's
/// volumes (subPath included) and shared host binds at their destinations.
pub fn request(bundle: &Bundle, state: &SandboxState, share_tag: &str) -> CreateContainer {
    let mut process = bundle.process.clone();
    if !process.env.iter().any(|kv| kv.starts_with("PATH=")) {
        process.env.push(DEFAULT_PATH.into());
    }
    process.cwd = Some(bundle.cwd.clone());
    process.stdio = StdioSpec {
        stream: STREAM,
        stdin: false,
        stdout: true,
        stderr: true,
    };
    let volumes = state.mounts.iter().map(|m| ContainerMount {
        destination: m.destination.clone(),
        source: MountSource::Volume {
            volume: m.volume.clone(),
            subpath: (!m.subpath.is_empty()).then(|| m.subpath.clone()),
        },
        readonly: m.readonly,
        options: Vec::new(),
        submounts: Vec::new(),
    });
    let shares = state.shared_mounts.iter().map(|m| ContainerMount {
        destination: m.destination.clone(),
        source: MountSource::Share(ShareRef {
            tag: share_tag.into(),
            path: m.path.clone(),
        }),
        readonly: m.readonly,
        options: Vec::new(),
        submounts: Vec::new(),
    });
    CreateContainer {
        mounts: volumes.chain(shares).collect(),
        seccomp: bundle.seccomp.clone(),
        ..CreateContainer::new(ID, Rootfs::Guest, process)
    }
}

/// Creates and starts the workload, its output appended to `log` (made
/// empty first). A failure removes what was created.
pub async fn start(
    agent: &AgentClient,
    stdio: &StdioMux,
    req: CreateContainer,
    log: &Path,
    timeout: Duration,
) -> Result<(), RuntimeError> {
    let file = std::fs::File::create(log).map_err(|source| RuntimeError::Io {
        context: format!("creating the workload's log {}", log.display()),
        source,
    })?;
    // Registered before the process exists, so no output is missed.
    pump(stdio.register(STREAM), file);
    let started = async {
        agent
            .call_with_timeout(req, timeout)
            .await
            .map_err(AgentCallError::of("starting the workload"))?;
        agent
            .call_with_timeout(StartContainer { id: ID.into() }, timeout)
            .await
            .map_err(AgentCallError::of("starting the workload"))
    }
    .await;
    if let Err(e) = started {
        let _ = agent.call(RemoveContainer { id: ID.into() }).await;
        stdio.unregister(STREAM);
        return Err(e.into());
    }
    Ok(())
}

/// Appends what the guest sends on the stream to `file`, until both
/// streams end or the VM goes.
fn pump(mut rx: tokio::sync::mpsc::UnboundedReceiver<Output>, file: std::fs::File) {
    tokio::spawn(async move {
        let mut file = file;
        let mut open = 2;
        while let Some(out) = rx.recv().await {
            let data = match out {
                Output::Stdout(d) | Output::Stderr(d) => d,
                Output::StdoutEof | Output::StderrEof => {
                    open -= 1;
                    if open == 0 {
                        break;
                    }
                    continue;
                }
            };
            if let Err(e) = file.write_all(&data) {
                tracing::warn!("writing the workload's log: {e}");
            }
        }
    });
}

/// How the workload ended, if it did within `within`.
async fn exited(agent: &AgentClient, within: Duration) -> Result<Option<ProcessExit>, ClientError> {
    let req = WaitProcess {
        process: init(),
        timeout_ms: within.as_millis() as u64,
    };
    let r = agent
        .call_with_timeout(req, within + Duration::from_secs(10))
        .await?;
    Ok(r.exited)
}

/// Waits for the workload to exit (asking again every [`WAIT_SLICE`]).
pub async fn wait(agent: &AgentClient) -> Result<ProcessExit, ClientError> {
    loop {
        if let Some(exit) = exited(agent, WAIT_SLICE).await? {
            return Ok(exit);
        }
    }
}

/// Sends `signal` to every process of the workload.
pub async fn signal(agent: &AgentClient, signal: i32) -> Result<(), AgentCallError> {
    agent
        .call(SignalProcess {
            process: init(),
            signal,
            all: true,
        })
        .await
        .map(drop)
        .map_err(AgentCallError::of("signalling the workload"))
}

/// TERM, then KILL after `grace`, then removes it (its binds go, so its
/// volumes can be unmounted). Errors are logged: the guest is stopping.
pub async fn stop(agent: &AgentClient, grace: Duration) {
    let gone = |within| async move { matches!(exited(agent, within).await, Ok(Some(_))) };
    if !gone(Duration::ZERO).await {
        let _ = signal(agent, libc::SIGTERM).await;
        if !gone(grace).await {
            let _ = signal(agent, libc::SIGKILL).await;
            gone(Duration::from_secs(10)).await;
        }
    }
    if let Err(e) = agent.call(RemoveContainer { id: ID.into() }).await {
        tracing::warn!("removing the workload: {e}");
    }
}

/// The end of the log (at most [`MAX_LOG_TAIL`] bytes), lossily UTF-8;
/// empty before the workload started.
pub fn tail(log: &Path) -> std::io::Result<String> {
    let mut f = match std::fs::File::open(log) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(String::new()),
        Err(e) => return Err(e),
    };
    let size = f.metadata()?.len();
    f.seek(SeekFrom::Start(size.saturating_sub(MAX_LOG_TAIL)))?;
    let mut buf = Vec::new();
    f.take(MAX_LOG_TAIL).read_to_end(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Where a sandbox's workload log is.
pub fn log_path(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir.join(LOG_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{SharedMount, WorkloadMount};

    #[test]
    fn the_bundles_process_and_the_sandboxs_mounts_make_the_request() {
        let b = crate::bundle::for_tests(Vec::new());
        let mut st = SandboxState::for_bundle_dir("sb", "/b".into());
        st.mounts = vec![WorkloadMount {
            volume: "v1".into(),
            subpath: "db".into(),
            destination: "/data".into(),
            readonly: false,
        }];
        st.shared_mounts = vec![SharedMount {
            destination: "/cfg".into(),
            source: "/host/cfg".into(),
            path: "m0".into(),
            readonly: true,
        }];
        let r = request(&b, &st, "crust-pod");
        assert_eq!(r.rootfs, Rootfs::Guest);
        assert_eq!(r.process.args, b.process.args);
        assert!(r.process.env.iter().any(|e| e.starts_with("PATH=")));
        assert!(r.process.stdio.stdout && r.process.stdio.stderr && !r.process.stdio.stdin);
        assert_eq!(r.mounts.len(), 2);
        assert_eq!(
            r.mounts[0].source,
            MountSource::Volume {
                volume: "v1".into(),
                subpath: Some("db".into())
            }
        );
        assert_eq!(r.mounts[1].destination, "/cfg");
        assert!(r.mounts[1].readonly);
    }

    #[test]
    fn the_log_answers_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let log = log_path(dir.path());
        assert_eq!(tail(&log).unwrap(), "");
        let mut big = vec![b'a'; MAX_LOG_TAIL as usize];
        big.extend_from_slice(b"END");
        std::fs::write(&log, &big).unwrap();
        let t = tail(&log).unwrap();
        assert_eq!(t.len() as u64, MAX_LOG_TAIL);
        assert!(t.ends_with("END"));
    }
}
