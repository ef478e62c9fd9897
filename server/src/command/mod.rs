//! Data-plane commands, one file per driver-API group (mini-redis `cmd/`):
//! each command is a struct with `decode` (from its capnp reader) and
//! `apply` (against the session's state and backend); reply bodies that need
//! more than a field are encoded next to the command that makes them.

pub mod context;
pub mod event;
pub mod launch;
pub mod memory;
pub mod module;
pub mod stream;

use std::io;

use rgpu_protocol::data_capnp::{reply, request};
use rgpu_transport::Transport;

use crate::backend::{LoadedModule, StreamRef, TransferError};
use rgpu_cuda_types::CuError;
use crate::session::state::SessionState;

/// One decoded request.
#[derive(Debug)]
pub enum Command {
    MemAlloc(memory::MemAlloc),
    MemFree(memory::MemFree),
    MemGetInfo(memory::MemGetInfo),
    MemcpyHtoD(memory::MemcpyHtoD),
    MemcpyDtoH(memory::MemcpyDtoH),
    MemcpyDtoD(memory::MemcpyDtoD),
    Memset(memory::MemsetCmd),
    StreamCreate(stream::StreamCreate),
    StreamDestroy(stream::StreamDestroy),
    StreamSynchronize(stream::StreamSynchronize),
    StreamQuery(stream::StreamQuery),
    StreamWaitEvent(stream::StreamWaitEvent),
    EventCreate(event::EventCreate),
    EventDestroy(event::EventDestroy),
    EventRecord(event::EventRecord),
    EventSynchronize(event::EventSynchronize),
    EventQuery(event::EventQuery),
    EventElapsedTime(event::EventElapsedTime),
    CtxSynchronize(context::CtxSynchronize),
    Ping(context::Ping),
    ModuleLoad(module::ModuleLoad),
    ModuleUnload(module::ModuleUnload),
    LaunchKernel(launch::LaunchKernel),
}

impl Command {
    /// Decodes a request. An error means the peer sent something that is not
    /// a valid `Request` (garbage, or a variant this server does not know):
    /// the stream can no longer be trusted.
    pub fn decode(req: request::Reader<'_>) -> capnp::Result<Command> {
        use request::Which as W;
        Ok(match req.which()? {
            W::MemAlloc(r) => Command::MemAlloc(memory::MemAlloc::decode(r?)),
            W::MemFree(r) => Command::MemFree(memory::MemFree::decode(r?)),
            W::MemGetInfo(r) => Command::MemGetInfo(memory::MemGetInfo::decode(r?)),
            W::MemcpyHtoD(r) => Command::MemcpyHtoD(memory::MemcpyHtoD::decode(r?)),
            W::MemcpyDtoH(r) => Command::MemcpyDtoH(memory::MemcpyDtoH::decode(r?)),
            W::MemcpyDtoD(r) => Command::MemcpyDtoD(memory::MemcpyDtoD::decode(r?)),
            W::Memset(r) => Command::Memset(memory::MemsetCmd::decode(r?)),
            W::StreamCreate(r) => Command::StreamCreate(stream::StreamCreate::decode(r?)),
            W::StreamDestroy(r) => Command::StreamDestroy(stream::StreamDestroy::decode(r?)),
            W::StreamSynchronize(r) => Command::StreamSynchronize(stream::StreamSynchronize::decode(r?)),
            W::StreamQuery(r) => Command::StreamQuery(stream::StreamQuery::decode(r?)),
            W::StreamWaitEvent(r) => Command::StreamWaitEvent(stream::StreamWaitEvent::decode(r?)),
            W::EventCreate(r) => Command::EventCreate(event::EventCreate::decode(r?)),
            W::EventDestroy(r) => Command::EventDestroy(event::EventDestroy::decode(r?)),
            W::EventRecord(r) => Command::EventRecord(event::EventRecord::decode(r?)),
            W::EventSynchronize(r) => Command::EventSynchronize(event::EventSynchronize::decode(r?)),
            W::EventQuery(r) => Command::EventQuery(event::EventQuery::decode(r?)),
            W::EventElapsedTime(r) => Command::EventElapsedTime(event::EventElapsedTime::decode(r?)),
            W::CtxSynchronize(r) => Command::CtxSynchronize(context::CtxSynchronize::decode(r?)),
            W::Ping(()) => Command::Ping(context::Ping),
            W::ModuleLoad(r) => Command::ModuleLoad(module::ModuleLoad::decode(r?)),
            W::ModuleUnload(r) => Command::ModuleUnload(module::ModuleUnload::decode(r?)),
            W::LaunchKernel(r) => Command::LaunchKernel(launch::LaunchKernel::decode(r?)),
        })
    }

    /// Whether the request carries bulk bytes; any other with bulk is refused
    /// (its bulk is skipped, so the stream stays in sync).
    fn takes_bulk(&self) -> bool {
        matches!(self, Command::MemcpyHtoD(_) | Command::ModuleLoad(_) | Command::LaunchKernel(_))
    }

    pub fn name(&self) -> &'static str {
        match self {
            Command::MemAlloc(_) => "memAlloc",
            Command::MemFree(_) => "memFree",
            Command::MemGetInfo(_) => "memGetInfo",
            Command::MemcpyHtoD(_) => "memcpyHtoD",
            Command::MemcpyDtoH(_) => "memcpyDtoH",
            Command::MemcpyDtoD(_) => "memcpyDtoD",
            Command::Memset(_) => "memset",
            Command::StreamCreate(_) => "streamCreate",
            Command::StreamDestroy(_) => "streamDestroy",
            Command::StreamSynchronize(_) => "streamSynchronize",
            Command::StreamQuery(_) => "streamQuery",
            Command::StreamWaitEvent(_) => "streamWaitEvent",
            Command::EventCreate(_) => "eventCreate",
            Command::EventDestroy(_) => "eventDestroy",
            Command::EventRecord(_) => "eventRecord",
            Command::EventSynchronize(_) => "eventSynchronize",
            Command::EventQuery(_) => "eventQuery",
            Command::EventElapsedTime(_) => "eventElapsedTime",
            Command::CtxSynchronize(_) => "ctxSynchronize",
            Command::Ping(_) => "ping",
            Command::ModuleLoad(_) => "moduleLoad",
            Command::ModuleUnload(_) => "moduleUnload",
            Command::LaunchKernel(_) => "launchKernel",
        }
    }

    /// Runs the command. The request's bulk is consumed completely, whatever
    /// the outcome, unless the connection itself failed (`Fail::Io`).
    pub fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<ReplyBody, Fail> {
        if !self.takes_bulk() && bulk.remaining() > 0 {
            bulk.discard()?;
            return Err(CuError::INVALID_VALUE.into());
        }
        let r = match self {
            Command::MemAlloc(c) => c.apply(s),
            Command::MemFree(c) => c.apply(s),
            Command::MemGetInfo(c) => c.apply(s),
            Command::MemcpyHtoD(c) => c.apply(s, bulk),
            Command::MemcpyDtoH(c) => c.apply(s),
            Command::MemcpyDtoD(c) => c.apply(s),
            Command::Memset(c) => c.apply(s),
            Command::StreamCreate(c) => c.apply(s),
            Command::StreamDestroy(c) => c.apply(s),
            Command::StreamSynchronize(c) => c.apply(s),
            Command::StreamQuery(c) => c.apply(s),
            Command::StreamWaitEvent(c) => c.apply(s),
            Command::EventCreate(c) => c.apply(s),
            Command::EventDestroy(c) => c.apply(s),
            Command::EventRecord(c) => c.apply(s),
            Command::EventSynchronize(c) => c.apply(s),
            Command::EventQuery(c) => c.apply(s),
            Command::EventElapsedTime(c) => c.apply(s),
            Command::CtxSynchronize(c) => c.apply(s),
            Command::Ping(c) => c.apply(s),
            Command::ModuleLoad(c) => c.apply(s, bulk),
            Command::ModuleUnload(c) => c.apply(s),
            Command::LaunchKernel(c) => c.apply(s, bulk),
        };
        // Whatever a command left unread (it failed before reading) is skipped.
        bulk.discard()?;
        r
    }
}

/// Why a command failed: a CUDA error for the client, or the connection
/// broke while moving its bulk bytes (then the session ends).
#[derive(Debug)]
pub enum Fail {
    Cuda(CuError),
    Io(io::Error),
}

impl From<CuError> for Fail {
    fn from(e: CuError) -> Self {
        Fail::Cuda(e)
    }
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Self {
        Fail::Io(e)
    }
}

impl From<TransferError> for Fail {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Device(e) => Fail::Cuda(e),
            TransferError::Io(e) => Fail::Io(e),
        }
    }
}

/// What a successful command answers, if the client asked for a reply.
#[derive(Debug)]
pub enum ReplyBody {
    None,
    MemAlloc(u64),
    MemGetInfo { free: u64, total: u64 },
    EventElapsedTime(f32),
    ModuleLoad(Box<LoadedModule>),
    /// `none`, with `len` bytes from device address `src` as the reply bulk.
    /// The session streams them from the backend while sending.
    DeviceBytes { src: u64, len: u64, stream: StreamRef },
}

impl ReplyBody {
    /// Fills the union of a reply.
    pub fn encode(&self, mut r: reply::Builder<'_>) {
        match self {
            ReplyBody::None | ReplyBody::DeviceBytes { .. } => r.set_none(()),
            ReplyBody::MemAlloc(p) => r.set_mem_alloc(*p),
            ReplyBody::MemGetInfo { free, total } => {
                let mut m = r.init_mem_get_info();
                m.set_free(*free);
                m.set_total(*total);
            }
            ReplyBody::EventElapsedTime(ms) => r.set_event_elapsed_time(*ms),
            ReplyBody::ModuleLoad(m) => module::encode_loaded(m, r.init_module_load()),
        }
    }
}

/// The bulk bytes of the request being processed, read from the transport
/// on demand so they can land straight in device memory.
pub struct Bulk<'a> {
    transport: &'a mut dyn Transport,
    remaining: u64,
    scratch: &'a mut Vec<u8>,
}

impl<'a> Bulk<'a> {
    pub fn new(transport: &'a mut dyn Transport, len: u64, scratch: &'a mut Vec<u8>) -> Self {
        Bulk { transport, remaining: len, scratch }
    }

    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Fills `buf` with the next bulk bytes.
    pub fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        if buf.len() as u64 > self.remaining {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "read past the frame's bulk"));
        }
        self.transport.recv_exact(buf)?;
        self.remaining -= buf.len() as u64;
        Ok(())
    }

    /// Reads all remaining bulk into a vector (callers bound its length first).
    pub fn read_to_vec(&mut self) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; self.remaining as usize];
        self.read_exact(&mut v)?;
        Ok(v)
    }

    /// Reads and drops the remaining bulk, in bounded chunks.
    pub fn discard(&mut self) -> io::Result<()> {
        const CHUNK: usize = 1 << 20;
        while self.remaining > 0 {
            let n = (self.remaining as usize).min(CHUNK);
            if self.scratch.len() < n {
                self.scratch.resize(n, 0);
            }
            self.transport.recv_exact(&mut self.scratch[..n])?;
            self.remaining -= n as u64;
        }
        Ok(())
    }
}
