//! What one kernel launch may ask of a device, read from the device's own
//! attributes, and the check every launch passes on the server before a
//! backend sees it: the shim checks too, but a raw client does not go
//! through the shim, and the sim would otherwise try to build whatever it
//! is asked for.

use rgpu_cuda_types::{CuError, CuResult};

use super::{DeviceInfo, LaunchDims};

/// Largest kernel parameter buffer a driver accepts (CUDA 12.1+ on Volta
/// and newer: 32,764 bytes).
pub const MAX_PARAM_BYTES: u64 = 32_764;

/// One device's launch limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchLimits {
    pub max_threads_per_block: u32,
    pub max_block: [u32; 3],
    pub max_grid: [u32; 3],
    /// Static plus dynamic shared memory of one block (the opt-in maximum).
    pub max_shared_per_block: u32,
}

/// What the launch asks of the kernel, from its module's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelNeeds {
    /// `.maxntid` (or the device's maximum when the kernel sets none).
    pub max_threads_per_block: u32,
    pub static_shared: u32,
}

impl Default for LaunchLimits {
    /// CUDA's limits on every device since compute capability 3.0, with
    /// Hopper's 227 KiB of shared memory a block.
    fn default() -> Self {
        LaunchLimits {
            max_threads_per_block: 1024,
            max_block: [1024, 1024, 64],
            max_grid: [i32::MAX as u32, 65535, 65535],
            max_shared_per_block: 227 * 1024,
        }
    }
}

impl LaunchLimits {
    /// The device's attributes (`CU_DEVICE_ATTRIBUTE_*`); one it does not
    /// report keeps CUDA's value.
    pub fn of(d: &DeviceInfo) -> Self {
        let mut l = LaunchLimits::default();
        let attr = |id: u32| d.attributes.iter().find(|a| a.0 == id).and_then(|a| u32::try_from(a.1).ok()).filter(|&v| v > 0);
        let set = |slot: &mut u32, id: u32| {
            if let Some(v) = attr(id) {
                *slot = v;
            }
        };
        set(&mut l.max_threads_per_block, 1);
        for k in 0..3 {
            set(&mut l.max_block[k], 2 + k as u32);
            set(&mut l.max_grid[k], 5 + k as u32);
        }
        // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, else MAX_SHARED_MEMORY_PER_BLOCK.
        if let Some(v) = attr(97).or_else(|| attr(8)) {
            l.max_shared_per_block = v;
        }
        l
    }

    /// The error a driver gives for this launch, if any: `INVALID_VALUE`
    /// for dimensions or shared memory past the device's limits (cudart
    /// reports it as cudaErrorInvalidConfiguration),
    /// `LAUNCH_OUT_OF_RESOURCES` for more threads than the kernel allows or
    /// a parameter buffer past [`MAX_PARAM_BYTES`].
    pub fn check(&self, dims: &LaunchDims, kernel: &KernelNeeds, param_bytes: u64) -> CuResult {
        let (g, b) = (dims.grid, dims.block);
        if g.contains(&0) || b.contains(&0) {
            return Err(CuError::INVALID_VALUE);
        }
        if (0..3).any(|k| b[k] > self.max_block[k] || g[k] > self.max_grid[k]) {
            return Err(CuError::INVALID_VALUE);
        }
        let threads = b.iter().map(|&x| x as u64).product::<u64>();
        if threads > self.max_threads_per_block as u64 {
            return Err(CuError::INVALID_VALUE);
        }
        if threads > kernel.max_threads_per_block.max(1) as u64 {
            return Err(CuError::LAUNCH_OUT_OF_RESOURCES);
        }
        let shared = dims.shared_mem_bytes as u64 + kernel.static_shared as u64;
        if shared > self.max_shared_per_block as u64 {
            return Err(CuError::INVALID_VALUE);
        }
        if param_bytes > MAX_PARAM_BYTES {
            return Err(CuError::LAUNCH_OUT_OF_RESOURCES);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(grid: [u32; 3], block: [u32; 3], shared: u32) -> LaunchDims {
        LaunchDims { grid, block, shared_mem_bytes: shared, cooperative: false }
    }

    const ANY: KernelNeeds = KernelNeeds { max_threads_per_block: 1024, static_shared: 0 };

    #[test]
    fn limits_are_cudas() {
        let l = LaunchLimits::default();
        assert_eq!(l.check(&dims([1, 1, 1], [1024, 1, 1], 0), &ANY, 8), Ok(()));
        assert_eq!(l.check(&dims([i32::MAX as u32, 65535, 65535], [1, 1, 64], 227 * 1024), &ANY, MAX_PARAM_BYTES), Ok(()));
        for bad in [
            dims([1, 1, 1], [1024, 1024, 64], 0),
            dims([1, 1, 1], [1025, 1, 1], 0),
            dims([1, 1, 1], [1, 1, 65], 0),
            dims([1, 1, 1], [32, 32, 2], 0),
            dims([1, 65536, 1], [1, 1, 1], 0),
            dims([1, 1, 65536], [1, 1, 1], 0),
            dims([u32::MAX, 1, 1], [1, 1, 1], 0),
            dims([0, 1, 1], [1, 1, 1], 0),
            dims([1, 1, 1], [1, 0, 1], 0),
            dims([1, 1, 1], [32, 1, 1], u32::MAX),
            dims([1, 1, 1], [32, 1, 1], 227 * 1024 + 1),
        ] {
            assert_eq!(l.check(&bad, &ANY, 0), Err(CuError::INVALID_VALUE), "{bad:?}");
        }
        // Static shared memory counts against the same limit.
        let static_big = KernelNeeds { max_threads_per_block: 1024, static_shared: 200 * 1024 };
        assert_eq!(l.check(&dims([1, 1, 1], [32, 1, 1], 28 * 1024), &static_big, 0), Err(CuError::INVALID_VALUE));
        // The kernel's own .maxntid and the parameter limit.
        let small = KernelNeeds { max_threads_per_block: 128, static_shared: 0 };
        assert_eq!(l.check(&dims([1, 1, 1], [256, 1, 1], 0), &small, 0), Err(CuError::LAUNCH_OUT_OF_RESOURCES));
        assert_eq!(l.check(&dims([1, 1, 1], [1, 1, 1], 0), &ANY, MAX_PARAM_BYTES + 1), Err(CuError::LAUNCH_OUT_OF_RESOURCES));
    }

    #[test]
    fn read_from_the_device() {
        let d = DeviceInfo {
            ordinal: 0,
            name: String::new(),
            uuid: [0; 16],
            total_mem: 0,
            pci_domain: 0,
            pci_bus: 0,
            pci_device: 0,
            attributes: vec![(1, 512), (2, 512), (4, 16), (6, 100), (97, 100 * 1024)],
        };
        let l = LaunchLimits::of(&d);
        assert_eq!(l.max_threads_per_block, 512);
        assert_eq!(l.max_block, [512, 1024, 16]);
        assert_eq!(l.max_grid, [i32::MAX as u32, 100, 65535]);
        assert_eq!(l.max_shared_per_block, 100 * 1024);
    }
}
