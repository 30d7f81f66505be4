//! The connection's two tasks: a reader that matches replies to callers
//! by id and routes events, a writer that owns the socket's write half
//! (descriptors go with a command as `SCM_RIGHTS`).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::Value;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::blockio::BlockIo;
use crate::types::{QemuVersion, QmpEvent};
use crate::{MAX_LINE, QmpError};

pub(crate) type Reply = Result<Value, QmpError>;

#[derive(Default)]
pub(crate) struct State {
    pub(crate) pending: HashMap<u64, oneshot::Sender<Reply>>,
    /// Set once, when the connection dies; the reason every later call gets.
    pub(crate) closed: Option<QmpError>,
    /// Dropped on close so event receivers see the end of the stream.
    pub(crate) events: Option<broadcast::Sender<QmpEvent>>,
    /// How this client opened each block node.
    pub(crate) opened: HashMap<String, BlockIo>,
    /// `query-hotpluggable-cpus`' count, asked once.
    pub(crate) max_vcpus: Option<u16>,
}

pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn closed_error(&self) -> QmpError {
        self.lock()
            .closed
            .clone()
            .unwrap_or_else(|| QmpError::Disconnected("connection closed".into()))
    }

    /// Marks the connection dead and fails every pending call with `err`.
    pub(crate) fn close(&self, err: QmpError) {
        let (pending, events) = {
            let mut st = self.lock();
            if st.closed.is_some() {
                return;
            }
            tracing::debug!(error = %err, "QMP connection closed");
            st.closed = Some(err.clone());
            (std::mem::take(&mut st.pending), st.events.take())
        };
        for (_, tx) in pending {
            let _ = tx.send(Err(err.clone()));
        }
        drop(events);
    }

    /// Routes one line from QEMU. An error is fatal for the connection.
    pub(crate) fn dispatch(&self, line: &[u8]) -> Result<(), QmpError> {
        let line = line.trim_ascii();
        if line.is_empty() {
            return Ok(());
        }
        // A line that is not JSON could have been anyone's reply: fail them
        // all now instead of letting one caller hang until its timeout.
        let msg: Value = serde_json::from_slice(line).map_err(|e| {
            QmpError::Protocol(format!("malformed JSON from QEMU ({e}): {}", excerpt(line)))
        })?;
        let Value::Object(mut obj) = msg else {
            return Err(QmpError::Protocol(format!(
                "QMP message is not an object: {}",
                excerpt(line)
            )));
        };
        if obj.contains_key("event") {
            let event = QmpEvent::from_message(obj);
            tracing::trace!(event = %event.name, "QMP event");
            if let Some(tx) = &self.lock().events {
                let _ = tx.send(event);
            }
            return Ok(());
        }
        let reply = if let Some(ret) = obj.remove("return") {
            Ok(ret)
        } else if let Some(err) = obj.remove("error") {
            Err(command_error(err))
        } else {
            tracing::warn!(message = %excerpt(line), "ignoring unexpected QMP message");
            return Ok(());
        };
        let id = obj.get("id").and_then(Value::as_u64);
        let waiter = id.and_then(|id| self.lock().pending.remove(&id));
        match waiter {
            Some(tx) => {
                let _ = tx.send(reply);
            }
            // A reply to a call that already timed out or was cancelled.
            None => tracing::debug!(?id, "QMP reply nobody waits for"),
        }
        Ok(())
    }
}

pub(crate) fn command_error(err: Value) -> QmpError {
    let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    QmpError::Command {
        class: field("class"),
        desc: field("desc"),
    }
}

pub(crate) fn excerpt(line: &[u8]) -> String {
    let s = String::from_utf8_lossy(&line[..line.len().min(200)]);
    if line.len() > 200 {
        format!("{s}...")
    } else {
        s.into_owned()
    }
}

/// Reads one `\n`-terminated line (without the newline); `None` at EOF.
pub(crate) async fn read_line<R: AsyncBufRead + Unpin>(
    rd: &mut R,
) -> Result<Option<Vec<u8>>, QmpError> {
    let mut line = Vec::new();
    loop {
        let buf = rd
            .fill_buf()
            .await
            .map_err(|e| QmpError::io("reading from QEMU", e))?;
        if buf.is_empty() {
            // EOF; a partial last line is not a message.
            return Ok(None);
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], i + 1),
            None => (buf, buf.len()),
        };
        if line.len() + chunk.len() > MAX_LINE {
            return Err(QmpError::Protocol(format!(
                "QMP message longer than {MAX_LINE} bytes"
            )));
        }
        line.extend_from_slice(chunk);
        let found_newline = chunk.len() < done;
        rd.consume(done);
        if found_newline {
            return Ok(Some(line));
        }
    }
}

pub(crate) async fn read_loop(mut rd: BufReader<OwnedReadHalf>, shared: Arc<Shared>) {
    let err = loop {
        match read_line(&mut rd).await {
            Ok(Some(line)) => {
                if let Err(e) = shared.dispatch(&line) {
                    break e;
                }
            }
            Ok(None) => break QmpError::Disconnected("QEMU closed the QMP socket".into()),
            Err(e) => break e,
        }
    };
    shared.close(err);
}

/// One command line for the writer task, with a descriptor to pass along.
pub(crate) struct Outgoing {
    pub(crate) line: Vec<u8>,
    pub(crate) fd: Option<OwnedFd>,
}

pub(crate) async fn write_loop(
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    shared: Arc<Shared>,
) {
    while let Some(out) = rx.recv().await {
        let mut sent = 0;
        if let Some(fd) = &out.fd {
            match send_with_fd(&wr, &out.line, fd).await {
                Ok(n) => sent = n,
                Err(e) => {
                    shared.close(QmpError::io("passing a descriptor to QEMU", e));
                    return;
                }
            }
        }
        if let Err(e) = wr.write_all(&out.line[sent..]).await {
            shared.close(QmpError::io("writing a command to QEMU", e));
            return;
        }
    }
}

/// Sends (a first part of) `line` with `fd` attached as `SCM_RIGHTS`;
/// QEMU takes the descriptor for the command that this data starts.
/// Returns how many bytes went.
pub(crate) async fn send_with_fd(
    wr: &OwnedWriteHalf,
    line: &[u8],
    fd: &OwnedFd,
) -> std::io::Result<usize> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let stream: &UnixStream = wr.as_ref();
    loop {
        stream.writable().await?;
        let res = stream.try_io(tokio::io::Interest::WRITABLE, || {
            let fds = [fd.as_fd()];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut anc = SendAncillaryBuffer::new(&mut space);
            anc.push(SendAncillaryMessage::ScmRights(&fds));
            rustix::net::sendmsg(
                stream,
                &[std::io::IoSlice::new(line)],
                &mut anc,
                SendFlags::NOSIGNAL,
            )
            .map_err(std::io::Error::from)
        });
        match res {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Removes a call's reply slot when the call ends in any way, including
/// being cancelled, so the pending map cannot leak.
pub(crate) struct PendingGuard<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.shared.lock().pending.remove(&self.id);
    }
}

pub(crate) fn parse_greeting(line: &[u8]) -> Result<QemuVersion, QmpError> {
    let bad = || QmpError::Protocol(format!("not a QMP greeting: {}", excerpt(line)));
    let msg: Value = serde_json::from_slice(line).map_err(|_| bad())?;
    let version = msg
        .get("QMP")
        .and_then(|q| q.get("version"))
        .ok_or_else(bad)?;
    let qemu = version.get("qemu").ok_or_else(bad)?;
    let num = |k: &str| {
        qemu.get(k)
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(bad)
    };
    Ok(QemuVersion {
        major: num("major")?,
        minor: num("minor")?,
        micro: num("micro")?,
        package: version
            .get("package")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
    })
}
