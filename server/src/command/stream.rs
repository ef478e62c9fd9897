//! Stream commands: cuStreamCreate[WithPriority], cuStreamDestroy,
//! cuStreamSynchronize, cuStreamQuery, cuStreamWaitEvent.
//!
//! Handles are minted by the client; 0 is the default stream and always
//! valid. The data plane's `Handle` does not say which device a default
//! stream belongs to, so a bare `0` means device 0's (the sim has nothing to
//! wait for either way; the cuda backend will synchronise the session's
//! contexts instead).

use rgpu_protocol::data_capnp::{handle, stream_create, stream_wait_event};

use super::{Fail, ReplyBody};
use rgpu_cuda_types::CuError;
use crate::session::state::{SessionState, Stream};

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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        if self.handle == 0 || s.streams.contains_key(&self.handle) {
            return Err(CuError::INVALID_VALUE.into());
        }
        s.check_device(self.device)?;
        let token = s.backend.stream_create(self.device, self.flags, self.priority)?;
        s.streams.insert(self.handle, Stream { token, device: self.device });
        Ok(ReplyBody::None)
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        let st = s.streams.get(&self.handle).copied().ok_or(CuError::INVALID_HANDLE)?;
        s.backend.stream_destroy(st.token)?;
        s.streams.remove(&self.handle);
        Ok(ReplyBody::None)
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        let st = s.stream(self.handle, 0)?;
        s.backend.stream_synchronize(st)?;
        Ok(ReplyBody::None)
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        let st = s.stream(self.handle, 0)?;
        s.backend.stream_query(st)?;
        Ok(ReplyBody::None)
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

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        let ev = s.event(self.event)?;
        let st = s.stream(self.stream, ev.device)?;
        s.backend.stream_wait_event(st, ev.token, self.flags)?;
        Ok(ReplyBody::None)
    }
}
