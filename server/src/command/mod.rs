//! Data-plane commands.
//!
//! [`commands!`] below is the one list of the messages this server
//! understands. Each line names the wire message (the `Request` union field
//! of `protocol/schema/data.capnp`), the handler struct (the same name in
//! CamelCase, in the file of its driver-API group) and whether the request
//! carries bulk bytes; its doc comment lists the driver functions whose
//! calls the shim forwards as that message. From the list come the decoded
//! [`Command`], [`Command::decode`], [`Command::name`], the bulk rule, the
//! dispatch to the handler and the [`Reply`] it answers with.
//!
//! A handler is a struct with `decode` (from its capnp reader) and an impl
//! of [`Handler`] (or [`BulkHandler`], if it reads the request's bulk) whose
//! `apply` checks the request against the session's objects
//! ([`crate::state`]), calls the backend method of the same name, and
//! returns the handler's own `Reply` type, which knows how to encode itself
//! ([`EncodeReply`]). A new reply shape is a new type next to its handler;
//! nothing else changes.

pub mod context;
pub mod event;
pub mod graph;
pub mod ipc;
pub mod launch;
pub mod memory;
pub mod module;
pub mod stream;
pub mod vmm;

use std::io;

use rgpu_protocol::data_capnp::{reply, request};
use rgpu_transport::Transport;

use crate::backend::{StreamRef, TransferError};
use crate::state::SessionState;
use rgpu_cuda_types::CuError;

/// A request's handler (one that carries no bulk bytes; any bulk sent with
/// it is skipped and the request refused before `apply` runs).
pub trait Handler {
    /// What a successful `apply` answers, if the client asked for a reply.
    type Reply: EncodeReply;
    fn apply(self, s: &mut SessionState) -> Result<Self::Reply, Fail>;
}

/// The handler of a request whose bulk bytes are its payload (a copy's
/// bytes, a module image, a kernel parameter buffer). Whatever `apply`
/// leaves unread is skipped afterwards, so the stream stays in sync.
pub trait BulkHandler {
    type Reply: EncodeReply;
    fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<Self::Reply, Fail>;
}

/// A reply body: fills the `Reply` union, and may name device memory the
/// session streams after it as the reply's bulk.
pub trait EncodeReply {
    fn encode(&self, r: reply::Builder<'_>);

    /// Device memory to send as the reply's bulk. The session streams it
    /// from the backend straight to the socket, after the reply's message,
    /// without a copy in between.
    fn device_bytes(&self) -> Option<DeviceBytes> {
        None
    }
}

/// The reply of commands that answer nothing but their result code.
impl EncodeReply for () {
    fn encode(&self, mut r: reply::Builder<'_>) {
        r.set_none(());
    }
}

/// `none`, or the reply of the command when there is one.
impl<R: EncodeReply> EncodeReply for Option<R> {
    fn encode(&self, mut r: reply::Builder<'_>) {
        match self {
            Some(b) => b.encode(r),
            None => r.set_none(()),
        }
    }

    fn device_bytes(&self) -> Option<DeviceBytes> {
        self.as_ref().and_then(R::device_bytes)
    }
}

/// `len` bytes from device address `src`, in `stream`'s order, as the reply
/// bulk of a `none` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBytes {
    pub src: u64,
    pub len: u64,
    pub stream: StreamRef,
}

impl EncodeReply for DeviceBytes {
    fn encode(&self, mut r: reply::Builder<'_>) {
        r.set_none(());
    }

    fn device_bytes(&self) -> Option<DeviceBytes> {
        Some(*self)
    }
}

/// The table. One line per `Request` union field, in the schema's order:
///
/// ```text
/// /// driver functions that send it
/// wireName => group::WireName [bulk];
/// ```
///
/// `[bulk]` marks a request whose bulk bytes its handler reads (it must
/// implement [`BulkHandler`]; the others [`Handler`]). The wire name is
/// checked against the schema by a test, and the CamelCase name is both
/// capnp's `request::Which` variant and the handler struct, so a typo or a
/// schema variant missing from the table does not compile.
macro_rules! commands {
    (@reply $t:ty) => { <$t as Handler>::Reply };
    (@reply $t:ty, bulk) => { <$t as BulkHandler>::Reply };
    (@takes_bulk) => { false };
    (@takes_bulk bulk) => { true };
    (@apply $c:ident, $s:ident, $b:ident) => { Handler::apply($c, $s) };
    (@apply $c:ident, $s:ident, $b:ident, bulk) => { BulkHandler::apply($c, $s, $b) };
    ($(
        $(#[doc = $doc:literal])*
        $wire:ident => $group:ident :: $name:ident $([$bulk:ident])?;
    )*) => {
        /// One decoded request.
        #[derive(Debug)]
        pub enum Command {
            $( $(#[doc = $doc])* $name($group::$name), )*
        }

        /// What a successful command answers: its handler's reply type.
        #[derive(Debug)]
        pub enum Reply {
            $( $name(commands!(@reply $group::$name $(, $bulk)?)), )*
        }

        impl Command {
            /// Every wire name, in the schema's order.
            pub const NAMES: &'static [&'static str] = &[$(stringify!($wire)),*];

            /// Decodes a request. An error means the peer sent something
            /// that is not a valid `Request` (garbage, or a variant this
            /// server does not know): the stream can no longer be trusted.
            pub fn decode(req: request::Reader<'_>) -> capnp::Result<Command> {
                use request::Which as W;
                Ok(match req.which()? {
                    $( W::$name(r) => Command::$name($group::$name::decode(Arm::get(r)?)), )*
                })
            }

            /// The wire name (`eventElapsedTime`), for logs.
            pub fn name(&self) -> &'static str {
                match self {
                    $( Command::$name(_) => stringify!($wire), )*
                }
            }

            /// Whether the request carries bulk bytes; any other with bulk
            /// is refused (its bulk is skipped, so the stream stays in sync).
            pub fn takes_bulk(&self) -> bool {
                match self {
                    $( Command::$name(_) => commands!(@takes_bulk $($bulk)?), )*
                }
            }

            fn dispatch(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<Reply, Fail> {
                match self {
                    $( Command::$name(c) => commands!(@apply c, s, bulk $(, $bulk)?).map(Reply::$name), )*
                }
            }
        }

        impl EncodeReply for Reply {
            fn encode(&self, r: reply::Builder<'_>) {
                match self {
                    $( Reply::$name(b) => b.encode(r), )*
                }
            }

            fn device_bytes(&self) -> Option<DeviceBytes> {
                match self {
                    $( Reply::$name(b) => b.device_bytes(), )*
                }
            }
        }
    };
}

commands! {
    /// cuMemAlloc_v2, cuMemAllocPitch_v2
    memAlloc => memory::MemAlloc;
    /// cuMemFree_v2; cuCtxDestroy_v2 and cuDevicePrimaryCtxReset_v2 for
    /// what the context still holds
    memFree => memory::MemFree;
    /// cuMemGetInfo_v2
    memGetInfo => memory::MemGetInfo;
    /// cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds, cuMemcpyHtoDAsync_v2,
    /// cuMemcpyHtoDAsync_v2_ptsz; cuMemcpy, cuMemcpy_ptds, cuMemcpyAsync,
    /// cuMemcpyAsync_ptsz from host memory; cuMemcpy2D_v2,
    /// cuMemcpy2D_v2_ptds, cuMemcpy2DUnaligned_v2,
    /// cuMemcpy2DUnaligned_v2_ptds, cuMemcpy2DAsync_v2,
    /// cuMemcpy2DAsync_v2_ptsz (row by row); the second half of a copy
    /// between two servers' devices, staged through the client
    memcpyHtoD => memory::MemcpyHtoD [bulk];
    /// cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, cuMemcpyDtoHAsync_v2,
    /// cuMemcpyDtoHAsync_v2_ptsz; cuMemcpy, cuMemcpy_ptds, cuMemcpyAsync,
    /// cuMemcpyAsync_ptsz to host memory; the cuMemcpy2D family; the first
    /// half of a copy between two servers' devices
    memcpyDtoH => memory::MemcpyDtoH;
    /// cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds, cuMemcpyDtoDAsync_v2,
    /// cuMemcpyDtoDAsync_v2_ptsz, cuMemcpyPeer, cuMemcpyPeerAsync; cuMemcpy,
    /// cuMemcpy_ptds, cuMemcpyAsync, cuMemcpyAsync_ptsz between device
    /// pointers; the cuMemcpy2D family (device to device)
    memcpyDtoD => memory::MemcpyDtoD;
    /// cuMemsetD8_v2, cuMemsetD16_v2, cuMemsetD32_v2, cuMemsetD8_v2_ptds,
    /// cuMemsetD16_v2_ptds, cuMemsetD32_v2_ptds, cuMemsetD8Async,
    /// cuMemsetD16Async, cuMemsetD32Async, cuMemsetD8Async_ptsz,
    /// cuMemsetD16Async_ptsz, cuMemsetD32Async_ptsz, cuMemsetD2D8_v2,
    /// cuMemsetD2D16_v2, cuMemsetD2D32_v2, cuMemsetD2D8Async,
    /// cuMemsetD2D16Async, cuMemsetD2D32Async
    memset => memory::Memset;
    /// cuStreamCreate, cuStreamCreateWithPriority
    streamCreate => stream::StreamCreate;
    /// cuStreamDestroy_v2; context teardown for the context's streams
    streamDestroy => stream::StreamDestroy;
    /// cuStreamSynchronize, cuStreamSynchronize_ptsz
    streamSynchronize => stream::StreamSynchronize;
    /// cuStreamQuery, cuStreamQuery_ptsz
    streamQuery => stream::StreamQuery;
    /// cuStreamWaitEvent, cuStreamWaitEvent_ptsz
    streamWaitEvent => stream::StreamWaitEvent;
    /// cuEventCreate
    eventCreate => event::EventCreate;
    /// cuEventDestroy_v2; context teardown for the context's events
    eventDestroy => event::EventDestroy;
    /// cuEventRecord, cuEventRecord_ptsz, cuEventRecordWithFlags,
    /// cuEventRecordWithFlags_ptsz
    eventRecord => event::EventRecord;
    /// cuEventSynchronize
    eventSynchronize => event::EventSynchronize;
    /// cuEventQuery
    eventQuery => event::EventQuery;
    /// cuEventElapsedTime, cuEventElapsedTime_v2
    eventElapsedTime => event::EventElapsedTime;
    /// cuCtxSynchronize, cuCtxSynchronize_v2
    ctxSynchronize => context::CtxSynchronize;
    /// cuModuleLoad, cuModuleLoadData, cuModuleLoadDataEx,
    /// cuModuleLoadFatBinary; cuLibraryLoadData and cuLibraryLoadFromFile
    /// (on the current device), and the cuLibraryGet*/cuKernelGet* calls
    /// that first use a library on another device
    moduleLoad => module::ModuleLoad [bulk];
    /// cuModuleUnload, cuLibraryUnload; context teardown for its modules
    moduleUnload => module::ModuleUnload;
    /// cuLaunchKernel, cuLaunchKernel_ptsz, cuLaunchKernelEx,
    /// cuLaunchKernelEx_ptsz
    launchKernel => launch::LaunchKernel [bulk];
    /// No driver function: a round trip for latency probes and tests
    ping => context::Ping;
    /// cuMemCreate
    memCreate => vmm::MemCreate;
    /// cuMemRelease
    memRelease => vmm::MemRelease;
    /// cuMemAddressReserve
    memAddressReserve => vmm::MemAddressReserve;
    /// cuMemAddressFree
    memAddressFree => vmm::MemAddressFree;
    /// cuMemMap
    memMap => vmm::MemMap;
    /// cuMemUnmap
    memUnmap => vmm::MemUnmap;
    /// cuMemSetAccess
    memSetAccess => vmm::MemSetAccess;
    /// cuGraphInstantiate, cuGraphInstantiate_v2, cuGraphInstantiateWithFlags,
    /// cuGraphInstantiateWithParams (once per segment between host nodes);
    /// cuGraphExecUpdate, cuGraphExecUpdate_v2, cuGraphExecKernelNodeSetParams,
    /// cuGraphExecKernelNodeSetParams_v2, cuGraphExecMemcpyNodeSetParams,
    /// cuGraphExecMemsetNodeSetParams (sent again under the same handle)
    graphExecCreate => graph::GraphExecCreate [bulk];
    /// cuGraphExecDestroy
    graphExecDestroy => graph::GraphExecDestroy;
    /// cuGraphLaunch, cuGraphLaunch_ptsz (one per segment)
    graphLaunch => graph::GraphLaunch [bulk];
    /// cuDevicePrimaryCtxReset, cuDevicePrimaryCtxReset_v2, cuCtxDestroy,
    /// cuCtxDestroy_v2 (after the context's objects are released)
    ctxReset => context::CtxReset;
    /// cuIpcGetMemHandle
    ipcExport => ipc::IpcExport;
    /// cuIpcOpenMemHandle, cuIpcOpenMemHandle_v2
    ipcOpen => ipc::IpcOpen;
    /// cuIpcCloseMemHandle; context teardown for the handles it opened
    ipcClose => ipc::IpcClose;
    /// cuIpcGetEventHandle
    ipcEventExport => ipc::IpcEventExport;
    /// cuIpcOpenEventHandle
    ipcEventOpen => ipc::IpcEventOpen;
}

impl Command {
    /// Runs the command. The request's bulk is consumed completely, whatever
    /// the outcome, unless the connection itself failed (`Fail::Io`).
    pub fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<Reply, Fail> {
        if !self.takes_bulk() && bulk.remaining() > 0 {
            bulk.discard()?;
            return Err(CuError::INVALID_VALUE.into());
        }
        let r = self.dispatch(s, bulk);
        // Whatever a command left unread (it failed before reading) is skipped.
        bulk.discard()?;
        r
    }
}

/// What a `request::Which` arm holds: a struct's reader (still to be
/// checked) or `()` for a `Void` one, so the table decodes both alike.
trait Arm {
    type Reader;
    fn get(self) -> capnp::Result<Self::Reader>;
}

impl<R> Arm for capnp::Result<R> {
    type Reader = R;
    fn get(self) -> capnp::Result<R> {
        self
    }
}

impl Arm for () {
    type Reader = ();
    fn get(self) -> capnp::Result<()> {
        Ok(())
    }
}

/// Why a command failed: a CUDA error for the client, or the connection
/// broke while moving its bulk bytes (then the session ends).
#[derive(Debug, thiserror::Error)]
pub enum Fail {
    #[error(transparent)]
    Cuda(#[from] CuError),
    #[error("connection failed while moving bulk bytes: {0}")]
    Io(#[from] io::Error),
}

impl From<TransferError> for Fail {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Device(e) => Fail::Cuda(e),
            TransferError::Io(e) => Fail::Io(e),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use capnp::dynamic_struct;
    use capnp::dynamic_value;
    use capnp::introspect::TypeVariant;
    use capnp::message::{Builder, HeapAllocator, ReaderOptions};

    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::backend::Backend;

    /// Bulk bytes waiting on an in-memory connection; `read` says how many
    /// the server consumed.
    struct Wire {
        input: Vec<u8>,
        read: usize,
    }

    impl Transport for Wire {
        fn send(&mut self, _bufs: &[&[u8]]) -> io::Result<()> {
            Ok(())
        }
        fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
            let rest = &self.input[self.read..];
            if rest.len() < buf.len() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            buf.copy_from_slice(&rest[..buf.len()]);
            self.read += buf.len();
            Ok(())
        }
        fn peer(&self) -> &str {
            "test"
        }
        fn shutdown(&self) {}
    }

    fn session() -> SessionState {
        let cfg = SimConfig {
            devices: 1,
            memory: 16 << 20,
            compute_capability: (9, 0),
            seed: None,
            kernel_time_limit: Duration::from_secs(30),
            compiled_tier: true,
        };
        let sim = SimBackend::new(&cfg).expect("sim backend");
        SessionState::new(sim.open_session(None).expect("session"), 1)
    }

    /// The `Request` union's fields, in discriminant order.
    fn schema_fields() -> Vec<(String, capnp::schema::Field)> {
        let mut m = Builder::new_default();
        let root: request::Builder<'_> = m.init_root();
        let dynamic: dynamic_struct::Builder<'_> = dynamic_value::Builder::from(root).downcast();
        let mut fields: Vec<_> = dynamic
            .get_schema()
            .get_union_fields()
            .unwrap()
            .into_iter()
            .map(|f| (f.get_proto().get_discriminant_value(), f))
            .collect();
        fields.sort_by_key(|&(d, _)| d);
        fields.into_iter().map(|(_, f)| (f.get_proto().get_name().unwrap().to_string().unwrap(), f)).collect()
    }

    /// A request with union field `field` set (all its own fields zero).
    fn request_with(field: capnp::schema::Field) -> Builder<HeapAllocator> {
        let mut m = Builder::new_default();
        let root: request::Builder<'_> = m.init_root();
        let mut dynamic: dynamic_struct::Builder<'_> = dynamic_value::Builder::from(root).downcast();
        match field.get_type().which() {
            TypeVariant::Void => dynamic.set(field, dynamic_value::Reader::Void).unwrap(),
            TypeVariant::Struct(_) => {
                dynamic.reborrow().init(field).unwrap();
            }
            other => panic!("request arm of an unexpected type: {other:?}"),
        }
        m
    }

    #[test]
    fn the_table_lists_every_request_of_the_schema_in_order() {
        let names: Vec<String> = schema_fields().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, Command::NAMES, "one table line per Request field, named and ordered as in data.capnp");
    }

    #[test]
    fn every_request_decodes_to_its_own_command() {
        for (name, field) in schema_fields() {
            let m = request_with(field);
            let req = m.get_root_as_reader::<request::Reader<'_>>().unwrap();
            let cmd = Command::decode(req).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(cmd.name(), name);
        }
    }

    #[test]
    fn only_payload_requests_take_bulk() {
        let mut takers = Vec::new();
        for (name, field) in schema_fields() {
            let m = request_with(field);
            let cmd = Command::decode(m.get_root_as_reader().unwrap()).unwrap();
            if cmd.takes_bulk() {
                takers.push(name);
            }
        }
        assert_eq!(takers, ["memcpyHtoD", "moduleLoad", "launchKernel", "graphExecCreate", "graphLaunch"]);
    }

    /// Whatever a request is and however it fails, its bulk is consumed to
    /// the last byte, so the next frame header is read where it starts; a
    /// request that takes no bulk is refused when it has some.
    #[test]
    fn stray_bulk_is_refused_and_consumed_for_every_request() {
        let mut s = session();
        let mut scratch = Vec::new();
        for (name, field) in schema_fields() {
            let m = request_with(field);
            let cmd = Command::decode(m.get_root_as_reader().unwrap()).unwrap();
            let takes = cmd.takes_bulk();
            let mut wire = Wire { input: vec![0xab; 4099], read: 0 };
            let r = cmd.apply(&mut s, &mut Bulk::new(&mut wire, 4099, &mut scratch));
            assert_eq!(wire.read, 4099, "{name}: the stream must stay in sync");
            match r {
                Err(Fail::Cuda(e)) if !takes => assert_eq!(e, CuError::INVALID_VALUE, "{name}"),
                Err(Fail::Cuda(_)) => {}
                Ok(_) if takes => {}
                Ok(_) => panic!("{name} accepted bulk it does not take"),
                Err(Fail::Io(e)) => panic!("{name}: {e}"),
            }
        }
    }

    #[test]
    fn a_request_beyond_the_schema_does_not_decode() {
        let mut m = Builder::new_default();
        m.init_root::<request::Builder<'_>>().set_ping(());
        let mut bytes = capnp::serialize::write_message_to_words(&m);
        // Segment table (8 bytes), root pointer (8), then the data word whose
        // first 16 bits are the union's discriminant.
        let ping = Command::NAMES.iter().position(|&n| n == "ping").unwrap() as u16;
        assert_eq!(u16::from_le_bytes([bytes[16], bytes[17]]), ping);
        bytes[16..18].copy_from_slice(&999u16.to_le_bytes());
        let msg = capnp::serialize::read_message_from_flat_slice(&mut &bytes[..], ReaderOptions::new()).unwrap();
        let req = msg.get_root::<request::Reader<'_>>().unwrap();
        assert!(matches!(req.which(), Err(capnp::NotInSchema(999))));
        assert!(Command::decode(req).is_err());
    }

    #[test]
    fn replies_come_from_the_handlers_types() {
        let mut s = session();
        let mut scratch = Vec::new();
        let mut wire = Wire { input: Vec::new(), read: 0 };
        let mut run = |s: &mut SessionState, cmd: Command| cmd.apply(s, &mut Bulk::new(&mut wire, 0, &mut scratch));
        let Ok(Reply::MemAlloc(a)) = run(&mut s, Command::MemAlloc(memory::MemAlloc { device: 0, size: 4096 })) else {
            panic!("memAlloc");
        };
        let read = memory::MemcpyDtoH { src: a.ptr + 16, size: 100, stream: 0 };
        let Ok(reply) = run(&mut s, Command::MemcpyDtoH(read)) else { panic!("memcpyDtoH") };
        let want = DeviceBytes { src: a.ptr + 16, len: 100, stream: StreamRef::Default { device: 0 } };
        assert_eq!(reply.device_bytes(), Some(want), "device-to-host bytes follow the reply, read while sending");
        let empty = memory::MemcpyDtoH { src: a.ptr, size: 0, stream: 0 };
        assert_eq!(run(&mut s, Command::MemcpyDtoH(empty)).ok().and_then(|r| r.device_bytes()), None);
        let Ok(info) = run(&mut s, Command::MemGetInfo(memory::MemGetInfo { device: 0 })) else { panic!("memGetInfo") };
        let mut m = Builder::new_default();
        info.encode(m.init_root::<reply::Builder<'_>>());
        let r = m.get_root_as_reader::<reply::Reader<'_>>().unwrap();
        let Ok(reply::Which::MemGetInfo(Ok(mi))) = r.which() else { panic!("a memGetInfo reply") };
        assert_eq!(mi.get_total(), 16 << 20);
        assert!(mi.get_free() < mi.get_total());
    }
}
