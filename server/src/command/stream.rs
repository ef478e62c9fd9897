//! Stream commands: `streamCreate`, `streamDestroy`, `streamSynchronize`,
//! `streamQuery`, `streamWaitEvent` (the driver functions that send each
//! are listed in the table in `mod.rs`).
//!
//! Handles are minted by the client; 0 is the default stream and always
//! valid. The data plane's `Handle` does not say which device a default
//! stream belongs to, so a bare `0` means device 0's (the sim has nothing to
//! wait for either way; the cuda backend waits on device 0's legacy stream,
//! if the session has a context there).

use rgpu_protocol::data_capnp::{handle, stream_create, stream_wait_event};

use super::{Fail, Handler};
use crate::state::{SessionState, Stream};
use rgpu_cuda_types::CuError;

#[derive(Debug)]
pub struct StreamCreate {
    pub handle: u64,
    pub device: u32,
    pub flags: u32,
    pub priority: i32,
}

impl StreamCreate {
    pub fn decode(r: stream_create::Reader<'_>) -> Self {
        StreamCreate {
            handle: r.get_handle(),
            device: r.get_device(),
            flags: r.get_flags(),
            priority: r.get_priority(),
        }
    }
}

impl Handler for StreamCreate {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        if self.handle == 0 || s.streams.contains_key(&self.handle) {
            return Err(CuError::INVALID_VALUE.into());
        }
        s.check_device(self.device)?;
        let token = s.backend.stream_create(self.device, self.flags, self.priority)?;
        s.streams.insert(self.handle, Stream { token, device: self.device, flags: self.flags, priority: self.priority });
        Ok(())
    }
}

#[derive(Debug)]
pub struct StreamDestroy {
    pub handle: u64,
}

impl StreamDestroy {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        StreamDestroy { handle: r.get_handle() }
    }
}

impl Handler for StreamDestroy {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let st = s.streams.get(&self.handle).copied().ok_or(CuError::INVALID_HANDLE)?;
        s.backend.stream_destroy(st.token)?;
        s.streams.remove(&self.handle);
        Ok(())
    }
}

#[derive(Debug)]
pub struct StreamSynchronize {
    pub handle: u64,
}

impl StreamSynchronize {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        StreamSynchronize { handle: r.get_handle() }
    }
}

impl Handler for StreamSynchronize {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let st = s.stream(self.handle, 0)?;
        s.backend.stream_synchronize(st)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct StreamQuery {
    pub handle: u64,
}

impl StreamQuery {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        StreamQuery { handle: r.get_handle() }
    }
}

impl Handler for StreamQuery {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let st = s.stream(self.handle, 0)?;
        s.backend.stream_query(st)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct StreamWaitEvent {
    pub stream: u64,
    pub event: u64,
    pub flags: u32,
}

impl StreamWaitEvent {
    pub fn decode(r: stream_wait_event::Reader<'_>) -> Self {
        StreamWaitEvent { stream: r.get_stream(), event: r.get_event(), flags: r.get_flags() }
    }
}

impl Handler for StreamWaitEvent {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let ev = s.event(self.event)?;
        let st = s.stream(self.stream, ev.device)?;
        s.backend.stream_wait_event(st, ev.token, self.flags)?;
        Ok(())
    }
}
