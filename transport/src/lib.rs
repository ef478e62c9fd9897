//! Byte transports under the data plane.
//!
//! Nothing above this crate knows which transport carries its frames: the
//! shim and the server see a [`Transport`]: TCP ([`tcp::TcpTransport`]) or
//! RDMA verbs ([`rdma::RdmaTransport`], through a plugin loaded at run time),
//! chosen per connection by [`select`].

use std::io;

pub mod chunks;
pub mod rdma;
pub mod records;
pub mod rep_movsb;
pub mod select;
pub mod tcp;
mod tls;
pub use tls::Sealer;

/// A reliable, ordered, bidirectional byte stream to one peer.
///
/// Methods are blocking: the shim's hot path is plain synchronous code on the
/// application's own thread, and each server session has its own thread.
pub trait Transport: Send {
    /// Sends every byte of `bufs`, in order, as one batch where the transport
    /// allows (one syscall for TCP when the socket buffer has room).
    fn send(&mut self, bufs: &[&[u8]]) -> io::Result<()>;

    /// Fills `buf` completely or fails. End of stream before it is full is
    /// `UnexpectedEof`.
    fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()>;

    /// A human-readable name of the peer, for logs and error messages.
    fn peer(&self) -> &str;

    /// Closes both directions; a thread blocked in `recv_exact` on another
    /// handle to the same connection returns with an error.
    fn shutdown(&self);
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    fn send(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        (**self).send(bufs)
    }
    fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        (**self).recv_exact(buf)
    }
    fn peer(&self) -> &str {
        (**self).peer()
    }
    fn shutdown(&self) {
        (**self).shutdown()
    }
}
