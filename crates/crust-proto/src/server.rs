//! What every crust gRPC server serves through: connections whose
//! client-to-server bytes pass the [`authority`](crate::authority)
//! front, so grpc-core (Python, C++), grpc-java and grpc-go clients can
//! all call it on a unix socket with their default `:authority`.
//!
//! ```no_run
//! # async fn f(listener: tokio::net::UnixListener) -> Result<(), tonic::transport::Error> {
//! # let svc = tonic::service::Routes::default();
//! tonic::transport::Server::builder()
//!     .add_routes(svc)
//!     .serve_with_incoming(crust_proto::server::incoming(listener))
//!     .await
//! # }
//! ```

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::Stream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::server::Connected;

use crate::authority::Rewriter;

/// Accepted connections of `listener`, each behind the authority front.
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<AuthorityFront<UnixStream>>> + Send + 'static {
    UnixListenerStream::new(listener).map(|r| r.map(AuthorityFront::new))
}

/// A connection whose reads are rewritten by [`Rewriter`]; writes pass
/// straight through.
pub struct AuthorityFront<IO> {
    io: IO,
    rw: Rewriter,
    buf: Box<[u8]>,
    eof: bool,
}

const READ_CHUNK: usize = 16 * 1024;

impl<IO> AuthorityFront<IO> {
    pub fn new(io: IO) -> Self {
        AuthorityFront {
            io,
            rw: Rewriter::new(),
            buf: vec![0; READ_CHUNK].into_boxed_slice(),
            eof: false,
        }
    }

    /// How many `:authority` values this connection had replaced.
    pub fn rewritten(&self) -> u64 {
        self.rw.rewritten()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityFront<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let ready = this.rw.output();
            if !ready.is_empty() {
                let n = ready.len().min(out.remaining());
                out.put_slice(&ready[..n]);
                this.rw.consume(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut rb = ReadBuf::new(&mut this.buf);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                this.eof = true;
                continue;
            }
            if let Err(e) = this.rw.feed(rb.filled()) {
                tracing::warn!("closing a gRPC connection: {e}");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityFront<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for AuthorityFront<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
