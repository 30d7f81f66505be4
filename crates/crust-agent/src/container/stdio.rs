//! Guest end of the stdio port ([`crust_agent_proto::stdio`]): output
//! threads write whole frames under one lock; one reader thread hands
//! stdin frames to per-process writer threads, so a process that does not
//! read its stdin never stalls the others.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_agent_proto::stdio::{Decoder, Kind, MAX_PAYLOAD, encode};
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

/// What a process's stdin writer thread receives.
pub enum StdinMsg {
    Data(Vec<u8>),
    Close,
}

#[derive(Default)]
struct Inner {
    port: Mutex<Option<OwnedFd>>,
    stdin: Mutex<HashMap<u32, mpsc::Sender<StdinMsg>>>,
}

/// The stdio port; a no-op when the VM has none (older hosts).
#[derive(Clone, Default)]
pub struct StdioPort {
    inner: Arc<Inner>,
}

impl StdioPort {
    /// Opens the port named [`crust_agent_proto::STDIO_PORT_NAME`] when
    /// present and starts the reader.
    pub fn open() -> StdioPort {
        let me = StdioPort::default();
        let Ok(path) = crate::port::find_port(crust_agent_proto::STDIO_PORT_NAME) else {
            return me;
        };
        let Ok(fd) = rustix::fs::open(
            path.as_path(),
            OFlags::RDWR | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            return me;
        };
        let Ok(reader) = fd.try_clone() else {
            return me;
        };
        *me.inner.port.lock().expect("port") = Some(fd);
        let inner = me.inner.clone();
        std::thread::Builder::new()
            .name("stdio-in".into())
            .spawn(move || read_loop(reader, inner))
            .ok();
        me
    }

    /// Sends one chunk of output (or an EOF mark) for `stream`. Blocks
    /// while the host is not reading: that is the back-pressure.
    pub fn send(&self, stream: u32, kind: Kind, data: &[u8]) {
        let guard = self.inner.port.lock().unwrap_or_else(|p| p.into_inner());
        let Some(port) = guard.as_ref() else { return };
        let frame = encode(stream, kind, data);
        let mut buf = &frame[..];
        while !buf.is_empty() {
            match rustix::io::write(port, buf) {
                Ok(n) => buf = &buf[n..],
                Err(Errno::INTR) | Err(Errno::AGAIN) => {}
                Err(_) => return,
            }
        }
    }

    /// Routes stdin frames of `stream` to `tx`.
    pub fn register_stdin(&self, stream: u32, tx: mpsc::Sender<StdinMsg>) {
        self.inner.stdin.lock().expect("stdin").insert(stream, tx);
    }

    pub fn unregister_stdin(&self, stream: u32) {
        self.inner.stdin.lock().expect("stdin").remove(&stream);
    }

    /// Copies `src` (a pipe or pty master) to the host as `kind` frames
    /// until EOF, then sends the EOF mark. Runs on its own thread.
    pub fn pump(&self, stream: u32, kind: Kind, src: OwnedFd) {
        let me = self.clone();
        let eof = if kind == Kind::Stderr {
            Kind::StderrEof
        } else {
            Kind::StdoutEof
        };
        std::thread::Builder::new()
            .name(format!("stdio-out-{stream}"))
            .spawn(move || {
                let mut f = std::fs::File::from(src);
                let mut buf = vec![0u8; MAX_PAYLOAD];
                loop {
                    match f.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => me.send(stream, kind, &buf[..n]),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        // EIO: the pty's last holder closed it.
                        Err(_) => break,
                    }
                }
                me.send(stream, eof, &[]);
            })
            .ok();
    }
}

/// Writes what arrives for one process's stdin into `dst`, closing it on
/// [`StdinMsg::Close`] or when the sender goes away.
pub fn stdin_writer(dst: OwnedFd) -> mpsc::Sender<StdinMsg> {
    let (tx, rx) = mpsc::channel::<StdinMsg>();
    std::thread::Builder::new()
        .name("stdio-stdin".into())
        .spawn(move || {
            let mut f = std::fs::File::from(dst);
            for m in rx {
                match m {
                    StdinMsg::Data(d) => {
                        if f.write_all(&d).is_err() {
                            break;
                        }
                    }
                    StdinMsg::Close => break,
                }
            }
        })
        .ok();
    tx
}

fn read_loop(port: OwnedFd, inner: Arc<Inner>) {
    let mut dec = Decoder::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match rustix::io::read(port.as_fd(), &mut buf) {
            Ok(0) => {
                // No host on the other end (yet): poll.
                dec.reset();
                std::thread::sleep(Duration::from_millis(25));
            }
            Ok(n) => {
                dec.push(&buf[..n]);
                while let Some(f) = dec.next_frame() {
                    let Ok(f) = f else {
                        dec.reset();
                        break;
                    };
                    let msg = match f.kind {
                        Kind::Stdin => StdinMsg::Data(f.data),
                        Kind::StdinClose => StdinMsg::Close,
                        _ => continue,
                    };
                    let tx = inner.stdin.lock().expect("stdin").get(&f.stream).cloned();
                    if let Some(tx) = tx {
                        let _ = tx.send(msg);
                    }
                }
            }
            Err(Errno::INTR) | Err(Errno::AGAIN) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}
