//! Context-level commands: cuCtxSynchronize, and the protocol's ping.

use rgpu_protocol::data_capnp::device;

use super::{Fail, ReplyBody};
use crate::session::state::SessionState;

#[derive(Debug)]
pub struct CtxSynchronize {
    pub device: u32,
}

impl CtxSynchronize {
    pub fn decode(r: device::Reader<'_>) -> Self {
        CtxSynchronize { device: r.get_device() }
    }

    pub fn apply(self, s: &mut SessionState) -> Result<ReplyBody, Fail> {
        s.check_device(self.device)?;
        s.backend.ctx_synchronize(self.device)?;
        Ok(ReplyBody::None)
    }
}

/// A no-op round trip (latency probes; collecting a deferred error).
#[derive(Debug)]
pub struct Ping;

impl Ping {
    pub fn apply(self, _s: &mut SessionState) -> Result<ReplyBody, Fail> {
        Ok(ReplyBody::None)
    }
}
