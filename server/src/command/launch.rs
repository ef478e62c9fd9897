//! `launchKernel` (cuLaunchKernel and its forms): the packed kernelParams
//! buffer is the bulk.

use rgpu_protocol::data_capnp::launch_kernel;

use super::{Bulk, BulkHandler, Fail};
use crate::backend::LaunchDims;
use crate::state::SessionState;

#[derive(Debug)]
pub struct LaunchKernel {
    pub module: u64,
    pub function: u32,
    pub dims: LaunchDims,
    pub stream: u64,
}

impl LaunchKernel {
    pub fn decode(r: launch_kernel::Reader<'_>) -> Self {
        LaunchKernel {
            module: r.get_module(),
            function: r.get_function(),
            dims: LaunchDims {
                grid: [r.get_grid_x(), r.get_grid_y(), r.get_grid_z()],
                block: [r.get_block_x(), r.get_block_y(), r.get_block_z()],
                shared_mem_bytes: r.get_shared_mem_bytes(),
                cooperative: r.get_cooperative(),
            },
            stream: r.get_stream(),
        }
    }
}

impl BulkHandler for LaunchKernel {
    type Reply = ();
    fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<(), Fail> {
        // Refused unread when past the device's limits (the parameter
        // buffer is at most MAX_PARAM_BYTES by then).
        let (token, device) = s.check_launch(self.module, self.function, &self.dims, bulk.remaining())?;
        let stream = s.stream(self.stream, device)?;
        let params = bulk.read_to_vec()?;
        s.backend.launch_kernel(token, self.function, &self.dims, stream, &params)?;
        Ok(())
    }
}
