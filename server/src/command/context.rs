//! Context-level commands: `ctxSynchronize`, and the protocol's `ping`.

use rgpu_protocol::data_capnp::device;

use super::{Fail, Handler};
use crate::state::SessionState;

#[derive(Debug)]
pub struct CtxSynchronize {
    pub device: u32,
}

impl CtxSynchronize {
    pub fn decode(r: device::Reader<'_>) -> Self {
        CtxSynchronize { device: r.get_device() }
    }
}

impl Handler for CtxSynchronize {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        s.check_device(self.device)?;
        s.backend.ctx_synchronize(self.device)?;
        Ok(())
    }
}

/// A no-op round trip (latency probes; collecting a deferred error).
#[derive(Debug)]
pub struct Ping;

impl Ping {
    pub fn decode((): ()) -> Self {
        Ping
    }
}

impl Handler for Ping {
    type Reply = ();
    fn apply(self, _s: &mut SessionState) -> Result<(), Fail> {
        Ok(())
    }
}
