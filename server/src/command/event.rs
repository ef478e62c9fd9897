//! Event commands: `eventCreate`, `eventDestroy`, `eventRecord`,
//! `eventSynchronize`, `eventQuery`, `eventElapsedTime` (the driver
//! functions that send each are listed in the table in `mod.rs`).

use rgpu_protocol::data_capnp::{event_create, event_pair, event_record, handle, reply};

use super::{EncodeReply, Fail, Handler};
use crate::state::{Event, SessionState};
use rgpu_cuda_types::CuError;

#[derive(Debug)]
pub struct EventCreate {
    pub handle: u64,
    pub device: u32,
    pub flags: u32,
}

impl EventCreate {
    pub fn decode(r: event_create::Reader<'_>) -> Self {
        EventCreate { handle: r.get_handle(), device: r.get_device(), flags: r.get_flags() }
    }
}

impl Handler for EventCreate {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        if self.handle == 0 || s.events.contains_key(&self.handle) {
            return Err(CuError::INVALID_VALUE.into());
        }
        s.check_device(self.device)?;
        let token = s.backend.event_create(self.device, self.flags)?;
        s.events.insert(self.handle, Event { token, device: self.device, flags: self.flags });
        Ok(())
    }
}

#[derive(Debug)]
pub struct EventDestroy {
    pub handle: u64,
}

impl EventDestroy {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        EventDestroy { handle: r.get_handle() }
    }
}

impl Handler for EventDestroy {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let ev = s.event(self.handle)?;
        s.backend.event_destroy(ev.token)?;
        s.events.remove(&self.handle);
        s.ipc.event_gone(self.handle);
        Ok(())
    }
}

#[derive(Debug)]
pub struct EventRecord {
    pub event: u64,
    pub stream: u64,
}

impl EventRecord {
    pub fn decode(r: event_record::Reader<'_>) -> Self {
        EventRecord { event: r.get_event(), stream: r.get_stream() }
    }
}

impl Handler for EventRecord {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let ev = s.event(self.event)?;
        let st = s.stream(self.stream, ev.device)?;
        s.backend.event_record(ev.token, st)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct EventSynchronize {
    pub handle: u64,
}

impl EventSynchronize {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        EventSynchronize { handle: r.get_handle() }
    }
}

impl Handler for EventSynchronize {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let ev = s.event(self.handle)?;
        s.backend.event_synchronize(ev.token)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct EventQuery {
    pub handle: u64,
}

impl EventQuery {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        EventQuery { handle: r.get_handle() }
    }
}

impl Handler for EventQuery {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let ev = s.event(self.handle)?;
        s.backend.event_query(ev.token)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct EventElapsedTime {
    pub start: u64,
    pub end: u64,
}

impl EventElapsedTime {
    pub fn decode(r: event_pair::Reader<'_>) -> Self {
        EventElapsedTime { start: r.get_start(), end: r.get_end() }
    }
}

impl Handler for EventElapsedTime {
    type Reply = EventElapsedTimeReply;
    fn apply(self, s: &mut SessionState) -> Result<EventElapsedTimeReply, Fail> {
        let a = s.event(self.start)?;
        let b = s.event(self.end)?;
        let ms = s.backend.event_elapsed_time(a.token, b.token)?;
        Ok(EventElapsedTimeReply { ms })
    }
}

/// Milliseconds from the start event to the end event.
#[derive(Debug)]
pub struct EventElapsedTimeReply {
    pub ms: f32,
}

impl EncodeReply for EventElapsedTimeReply {
    fn encode(&self, mut r: reply::Builder<'_>) {
        r.set_event_elapsed_time(self.ms);
    }
}
