//! Context-level commands: `ctxSynchronize`, `ctxReset`, and the protocol's `ping`.

use rgpu_cuda_types::CuError;
use rgpu_protocol::data_capnp::device;
use tracing::{debug, info, warn};

use super::{Fail, Handler};
use crate::state::{is_sticky, SessionState};

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

/// The client destroyed or reset a context on `device` and has released what
/// it held there. A session left holding nothing is as a fresh context, so
/// a device assert stops failing its calls: CUDA's answer to
/// `CUDA_ERROR_ASSERT` is to destroy the context and go on in a new one.
/// The other sticky errors stay (CUDA: the process must start again), and
/// so does an assert while the client still holds objects on the server
/// (another context's: they share the session).
#[derive(Debug)]
pub struct CtxReset {
    pub device: u32,
}

impl CtxReset {
    pub fn decode(r: device::Reader<'_>) -> Self {
        CtxReset { device: r.get_device() }
    }
}

impl Handler for CtxReset {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        s.check_device(self.device)?;
        if !s.holds_nothing() {
            if s.sticky == Some(CuError::ASSERT) {
                debug!(device = self.device, "context reset while the session still holds objects: the assert stays");
            }
            return Ok(());
        }
        match s.backend.reset_context(self.device) {
            Ok(late) => {
                let fatal = late.filter(|&e| is_sticky(e) && e != CuError::ASSERT);
                match (s.sticky, fatal) {
                    (None | Some(CuError::ASSERT), Some(e)) => s.sticky = Some(e),
                    (Some(CuError::ASSERT), None) => {
                        info!(device = self.device, "the context was reset after a device assert: the session works again");
                        s.sticky = None;
                    }
                    _ => {}
                }
            }
            Err(e) => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| warn!("this backend cannot start a session's context afresh ({e}): errors that end a context stay"));
            }
        }
        Ok(())
    }
}
