//! A process's stdio on the host: the FIFOs containerd passes in
//! Create/Exec, relayed to and from the guest's stdio port.
//!
//! Output FIFOs are opened read-write (so the open neither blocks nor
//! fails while containerd's reader is not there yet) and closed when the
//! guest sends the stream's EOF, which is what ends CRI's log copy and
//! `ctr`'s output. Stdin is read until CloseIO.

use std::path::Path;
use std::time::Duration;

use crust_agent_proto::StdioSpec;
use crust_agent_proto::stdio::{Output, StdioMux};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// The FIFO paths of one process (empty: not wanted).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StdioPaths {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("stdio {0:?}: only FIFO paths are supported (no binary:// or file:// loggers)")]
    Unsupported(String),
    #[error("opening {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl StdioPaths {
    /// What the guest should send for these paths on `stream`.
    pub fn spec(&self, stream: u32) -> StdioSpec {
        StdioSpec {
            stream,
            stdin: !self.stdin.is_empty(),
            stdout: !self.stdout.is_empty(),
            stderr: !self.stderr.is_empty() && !self.terminal,
        }
    }

    fn check(&self) -> Result<(), IoError> {
        for p in [&self.stdin, &self.stdout, &self.stderr] {
            if !p.is_empty() && !p.starts_with('/') {
                return Err(IoError::Unsupported(p.clone()));
            }
        }
        Ok(())
    }
}

/// The relay of one process; dropping it stops the stdin copy.
pub struct Relay {
    /// Becomes true once every output stream reached EOF.
    pub done: watch::Receiver<bool>,
    stdin_task: Option<JoinHandle<()>>,
    stdin_close: Option<oneshot::Sender<()>>,
    output_task: Option<JoinHandle<()>>,
}

impl Relay {
    /// Waits (bounded) until the output is all delivered.
    pub async fn drained(&mut self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.done.wait_for(|d| *d)).await;
    }

    /// Ends the relay now (a process that never ran): the FIFOs close,
    /// so whoever reads them sees EOF.
    pub fn abort(&mut self) {
        for t in [self.stdin_task.take(), self.output_task.take()]
            .into_iter()
            .flatten()
        {
            t.abort();
        }
    }

    /// CloseIO: no more stdin.
    pub fn close_stdin(&mut self) {
        if let Some(tx) = self.stdin_close.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.abort();
    }
}

fn open_writer(path: &str) -> Result<pipe::Sender, IoError> {
    pipe::OpenOptions::new()
        .read_write(true)
        .open_sender(path)
        .map_err(|source| IoError::Open {
            path: path.into(),
            source,
        })
}

/// Starts relaying `paths` for guest stream `stream`. Register before the
/// guest process exists so no output is lost.
pub fn start(mux: &StdioMux, stream: u32, paths: &StdioPaths) -> Result<Relay, IoError> {
    paths.check()?;
    let spec = paths.spec(stream);
    let mut stdout = if spec.stdout {
        Some(open_writer(&paths.stdout)?)
    } else {
        None
    };
    let mut stderr = if spec.stderr {
        Some(open_writer(&paths.stderr)?)
    } else {
        None
    };
    let stdin = if spec.stdin {
        Some(
            pipe::OpenOptions::new()
                .read_write(true)
                .open_receiver(&paths.stdin)
                .map_err(|source| IoError::Open {
                    path: paths.stdin.clone(),
                    source,
                })?,
        )
    } else {
        None
    };
    let mut rx = mux.register(stream);
    let (done_tx, done) = watch::channel(!spec.stdout && !spec.stderr);
    let mux2 = mux.clone();
    let output_task = tokio::spawn(async move {
        let (mut want_out, mut want_err) = (stdout.is_some(), stderr.is_some());
        while want_out || want_err {
            let Some(msg) = rx.recv().await else { break };
            match msg {
                Output::Stdout(d) => {
                    if let Some(w) = stdout.as_mut()
                        && w.write_all(&d).await.is_err()
                    {
                        stdout = None;
                    }
                }
                Output::Stderr(d) => {
                    if let Some(w) = stderr.as_mut()
                        && w.write_all(&d).await.is_err()
                    {
                        stderr = None;
                    }
                }
                Output::StdoutEof => {
                    stdout = None;
                    want_out = false;
                }
                Output::StderrEof => {
                    stderr = None;
                    want_err = false;
                }
            }
        }
        drop((stdout, stderr));
        mux2.unregister(stream);
        let _ = done_tx.send(true);
    });
    let (close_tx, close_rx) = oneshot::channel::<()>();
    let stdin_task = stdin.map(|mut r| {
        let mux = mux.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 32 * 1024];
            let mut close_rx = close_rx;
            loop {
                tokio::select! {
                    n = r.read(&mut buf) => match n {
                        Ok(0) | Err(_) => break,
                        Ok(n) => mux.stdin(stream, &buf[..n]),
                    },
                    _ = &mut close_rx => {
                        // Deliver what is already in the FIFO, then close.
                        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(50), r.read(&mut buf)).await {
                            if n == 0 { break; }
                            mux.stdin(stream, &buf[..n]);
                        }
                        break;
                    }
                }
            }
            mux.close_stdin(stream);
        })
    });
    Ok(Relay {
        done,
        stdin_close: Some(close_tx),
        stdin_task,
        output_task: Some(output_task),
    })
}

/// Whether `p` names a FIFO we can open (for error messages up front).
pub fn exists(p: &str) -> bool {
    p.is_empty() || Path::new(p).exists()
}
