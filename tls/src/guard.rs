//! A plaintext client's side of "never fall back silently": a TLS endpoint
//! answers a plaintext client with [`NEEDS_TLS`] and closes. The guard sits
//! under the client's reader and turns those 8 bytes, if they come first,
//! into an error, and records it, so that the client reports "the server
//! requires TLS" rather than a capnp decoding failure.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::NEEDS_TLS;

/// Set when the server refused this plaintext connection for want of TLS.
#[derive(Debug, Clone, Default)]
pub struct Refusal(Arc<AtomicBool>);

impl Refusal {
    pub fn needs_tls(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

pub struct PlaintextGuard<S> {
    inner: S,
    head: [u8; 8],
    have: usize,
    given: usize,
    checked: bool,
    refusal: Refusal,
}

impl<S> PlaintextGuard<S> {
    pub fn new(inner: S) -> (PlaintextGuard<S>, Refusal) {
        let refusal = Refusal::default();
        let g = PlaintextGuard { inner, head: [0; 8], have: 0, given: 0, checked: false, refusal: refusal.clone() };
        (g, refusal)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for PlaintextGuard<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if !me.checked {
            while me.have < NEEDS_TLS.len() {
                let mut rb = ReadBuf::new(&mut me.head[me.have..]);
                ready!(Pin::new(&mut me.inner).poll_read(cx, &mut rb))?;
                let n = rb.filled().len();
                if n == 0 {
                    break;
                }
                me.have += n;
                // Anything that is not the marker's beginning is the server's
                // real answer: pass it on without waiting for more.
                if !NEEDS_TLS.starts_with(&me.head[..me.have]) {
                    break;
                }
            }
            me.checked = true;
            if &me.head[..me.have] == NEEDS_TLS {
                me.refusal.0.store(true, Ordering::Relaxed);
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionRefused, "the server requires TLS")));
            }
        }
        if me.given < me.have {
            let n = (me.have - me.given).min(buf.remaining());
            buf.put_slice(&me.head[me.given..me.given + n]);
            me.given += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut me.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for PlaintextGuard<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn the_marker_is_an_error_and_anything_else_passes() {
        rt().block_on(async {
            let (mut a, b) = tokio::io::duplex(64);
            let (mut g, refusal) = PlaintextGuard::new(b);
            a.write_all(NEEDS_TLS).await.unwrap();
            let mut buf = [0u8; 16];
            assert!(g.read(&mut buf).await.is_err());
            assert!(refusal.needs_tls());

            let (mut a, b) = tokio::io::duplex(64);
            let (mut g, refusal) = PlaintextGuard::new(b);
            a.write_all(b"\0\0\0\0hello").await.unwrap();
            drop(a);
            let mut got = Vec::new();
            g.read_to_end(&mut got).await.unwrap();
            assert_eq!(got, b"\0\0\0\0hello");
            assert!(!refusal.needs_tls());
        });
    }
}
