//! The profiler control API (cuProfiler*). No profiler is attached to a remote device through
//! rgpu; starting and stopping collection is then a no-op, as it is for a driver with no
//! profiler attached.

use crate::cuda::types::*;
use crate::runtime;

pub(crate) unsafe fn start() -> CuResult<()> {
    runtime::get()?;
    Ok(())
}

pub(crate) unsafe fn stop() -> CuResult<()> {
    runtime::get()?;
    Ok(())
}
