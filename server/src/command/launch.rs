//! `launchKernel` (cuLaunchKernel and its forms): the packed kernelParams
//! buffer is the bulk.

use rgpu_protocol::data_capnp::launch_kernel;

use super::{Bulk, BulkHandler, Fail};
use crate::backend::LaunchDims;
use crate::state::SessionState;
use rgpu_cuda_types::CuError;

/// Parameter buffers above this are refused unread (CUDA's own limit is 32 KiB).
const MAX_PARAMS_LEN: u64 = 1 << 20;

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
            },
            stream: r.get_stream(),
        }
    }
}

impl BulkHandler for LaunchKernel {
    type Reply = ();
    fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<(), Fail> {
        let m = s.module(self.module)?;
        let (token, device) = (m.token, m.device);
        let want = *m.param_lens.get(self.function as usize).ok_or(CuError::INVALID_HANDLE)?;
        let stream = s.stream(self.stream, device)?;
        if bulk.remaining() != want || want > MAX_PARAMS_LEN {
            return Err(CuError::INVALID_VALUE.into());
        }
        if self.dims.grid.contains(&0) || self.dims.block.contains(&0) {
            return Err(CuError::INVALID_VALUE.into());
        }
        let params = bulk.read_to_vec()?;
        s.backend.launch_kernel(token, self.function, &self.dims, stream, &params)?;
        Ok(())
    }
}
