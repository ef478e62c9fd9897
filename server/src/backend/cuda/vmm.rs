//! Virtual memory management on the real driver: cuMemCreate, cuMemAddressReserve, cuMemMap,
//! cuMemSetAccess and their inverses, forwarded as they are ([`crate::vmm`] has checked them).
//! What this adds is what a session owes the next owner of the memory, as for `cuMemAlloc`:
//! an allocation is charged to the lease, it is zeroed before it goes back to the driver (the
//! driver may hand those bytes to another session of this process, through either API; where
//! zeroing fails, later allocations on the device are zeroed instead), and whatever a session
//! leaves mapped, reserved or allocated is undone when it ends.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;

use cudarc::driver::sys;
use tracing::warn;

use super::driver::cu;
use super::CudaSession;
use crate::backend::{BackendSession, PhysicalToken, StreamRef, TransferError};

/// The way of a [`CudaSession::physical_transfer`].
pub(super) enum PhysicalIo<'a> {
    Read(&'a mut dyn FnMut(&[u8]) -> std::io::Result<()>),
    Write(&'a mut dyn FnMut(&mut [u8]) -> std::io::Result<()>),
}
use crate::vmm::{ACCESS_NONE, ACCESS_READ, GRANULARITY};
use rgpu_cuda_types::{CuError, CuResult};

#[derive(Debug, Default)]
pub struct CudaVmm {
    /// Raw allocation handle -> (device, size).
    physical: HashMap<u64, (u32, u64)>,
    /// start -> size.
    reservations: BTreeMap<u64, u64>,
    /// start -> size.
    mappings: BTreeMap<u64, u64>,
}

fn location(dev: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev }
}

pub(super) fn access(dev: sys::CUdevice, flags: u32) -> sys::CUmemAccessDesc {
    let flags = match flags {
        ACCESS_NONE => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
        ACCESS_READ => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        _ => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    sys::CUmemAccessDesc { location: location(dev), flags }
}

impl CudaSession {
    pub(super) fn raw_device(&self, device: u32) -> CuResult<sys::CUdevice> {
        self.shared.handles.get(device as usize).copied().ok_or(CuError::INVALID_DEVICE)
    }

    pub(super) fn vmm_create(&mut self, device: u32, size: u64) -> CuResult<PhysicalToken> {
        let bytes = usize::try_from(size).map_err(|_| CuError::OUT_OF_MEMORY)?;
        let dev = self.raw_device(device)?;
        self.bind(device)?;
        self.account.take(size)?;
        let h = match self.physical_new(dev, bytes) {
            Ok(h) => h,
            Err(e) => {
                self.account.give(size);
                return Err(e);
            }
        };
        if self.shared.scrub_on_alloc[device as usize].load(Ordering::Relaxed) {
            if let Err(e) = self.zero_physical(dev, h, bytes) {
                let _ = cu!(sys::cuMemRelease(h));
                self.account.give(size);
                return Err(e);
            }
        }
        self.vmm.physical.insert(h, (device, size));
        Ok(PhysicalToken(h))
    }

    /// `bytes` of new physical memory on `dev` (the current context's device).
    pub(super) fn physical_new(&mut self, dev: sys::CUdevice, bytes: usize) -> CuResult<sys::CUmemGenericAllocationHandle> {
        // SAFETY: an all-zero CUmemAllocationProp is the driver's documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = location(dev);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        cu!(sys::cuMemCreate(&mut h, bytes, &prop, 0))?;
        Ok(h)
    }

    /// Runs `f` with `h` mapped read-write at a scratch range, then unmaps it again.
    fn with_scratch_map<R>(
        &mut self,
        dev: sys::CUdevice,
        h: sys::CUmemGenericAllocationHandle,
        bytes: usize,
        f: impl FnOnce(&mut Self, u64) -> Result<R, CuError>,
    ) -> Result<R, CuError> {
        let mut va: sys::CUdeviceptr = 0;
        cu!(sys::cuMemAddressReserve(&mut va, bytes, GRANULARITY as usize, 0, 0))?;
        let r = (|| {
            cu!(sys::cuMemMap(va, bytes, 0, h, 0))?;
            let desc = access(dev, crate::vmm::ACCESS_READWRITE);
            let r = cu!(sys::cuMemSetAccess(va, bytes, &desc, 1)).and_then(|()| f(self, va));
            let u = cu!(sys::cuMemUnmap(va, bytes));
            r.and_then(|v| u.map(|()| v))
        })();
        let free = cu!(sys::cuMemAddressFree(va, bytes));
        r.and_then(|v| free.map(|()| v))
    }

    /// Maps `h` at a scratch range, zeroes it and waits, then unmaps it again.
    fn zero_physical(&mut self, dev: sys::CUdevice, h: sys::CUmemGenericAllocationHandle, bytes: usize) -> CuResult {
        self.with_scratch_map(dev, h, bytes, |_, va| {
            cu!(sys::cuMemsetD8_v2(va, 0, bytes)).and_then(|()| cu!(sys::cuCtxSynchronize()))
        })
    }

    /// A snapshot's read (`write == None`: read into `sink`) or a rebuild's write of the whole
    /// of physical allocation `phys`, through a scratch mapping.
    pub(super) fn physical_transfer(
        &mut self,
        phys: PhysicalToken,
        mut io: PhysicalIo<'_>,
    ) -> Result<(), TransferError> {
        let &(device, size) = self.vmm.physical.get(&phys.0).ok_or(CuError::INVALID_VALUE)?;
        let dev = self.raw_device(device)?;
        self.bind(device)?;
        let bytes = usize::try_from(size).map_err(|_| CuError::INVALID_VALUE)?;
        let mut failed_io: Option<std::io::Error> = None;
        let r = self.with_scratch_map(dev, phys.0, bytes, |this, va| {
            let stream = StreamRef::Default { device };
            let moved = match &mut io {
                PhysicalIo::Read(sink) => this.memcpy_dtoh(stream, va, size, *sink),
                PhysicalIo::Write(fill) => this.memcpy_htod(stream, va, size, *fill),
            };
            // The mapping goes when this returns: the copies must be over.
            let moved = moved.and_then(|()| cu!(sys::cuCtxSynchronize()).map_err(TransferError::Device));
            match moved {
                Ok(()) => Ok(()),
                Err(TransferError::Device(e)) => Err(e),
                Err(TransferError::Io(e)) => {
                    let _ = cu!(sys::cuCtxSynchronize());
                    failed_io = Some(e);
                    Err(CuError::UNKNOWN)
                }
            }
        });
        match (r, failed_io) {
            (_, Some(e)) => Err(TransferError::Io(e)),
            (Ok(()), None) => Ok(()),
            (Err(e), None) => Err(TransferError::Device(e)),
        }
    }

    /// Zeroes an unmapped allocation before it goes back to the driver; where that fails, the
    /// device's later allocations are zeroed instead.
    fn scrub(&mut self, device: u32, h: sys::CUmemGenericAllocationHandle, size: u64) {
        let r = self.raw_device(device).and_then(|dev| {
            self.bind(device)?;
            self.zero_physical(dev, h, size as usize)
        });
        if let Err(e) = r {
            warn!(device, "cannot zero a released allocation: {e}; later allocations on the device are zeroed instead");
            self.shared.scrub_on_alloc[device as usize].store(true, Ordering::Relaxed);
        }
    }

    pub(super) fn vmm_release(&mut self, phys: PhysicalToken) -> CuResult {
        let &(device, size) = self.vmm.physical.get(&phys.0).ok_or(CuError::INVALID_VALUE)?;
        self.scrub(device, phys.0, size);
        self.bind(device)?;
        cu!(sys::cuMemRelease(phys.0))?;
        self.vmm.physical.remove(&phys.0);
        self.account.give(size);
        Ok(())
    }

    pub(super) fn vmm_reserve(&mut self, size: u64, alignment: u64, hint: u64) -> CuResult<u64> {
        let bytes = usize::try_from(size).map_err(|_| CuError::OUT_OF_MEMORY)?;
        let align = usize::try_from(alignment).map_err(|_| CuError::INVALID_VALUE)?;
        let mut va: sys::CUdeviceptr = 0;
        cu!(sys::cuMemAddressReserve(&mut va, bytes, align, hint, 0))?;
        self.vmm.reservations.insert(va, size);
        Ok(va)
    }

    pub(super) fn vmm_address_free(&mut self, ptr: u64, size: u64) -> CuResult {
        cu!(sys::cuMemAddressFree(ptr, size as usize))?;
        self.vmm.reservations.remove(&ptr);
        Ok(())
    }

    pub(super) fn vmm_map(&mut self, ptr: u64, size: u64, offset: u64, phys: PhysicalToken) -> CuResult {
        cu!(sys::cuMemMap(ptr, size as usize, offset as usize, phys.0, 0))?;
        self.vmm.mappings.insert(ptr, size);
        Ok(())
    }

    pub(super) fn vmm_unmap(&mut self, ptr: u64, size: u64) -> CuResult {
        cu!(sys::cuMemUnmap(ptr, size as usize))?;
        self.vmm.mappings.remove(&ptr);
        Ok(())
    }

    pub(super) fn vmm_set_access(&mut self, ptr: u64, size: u64, device: u32, flags: u32) -> CuResult {
        let desc = access(self.raw_device(device)?, flags);
        cu!(sys::cuMemSetAccess(ptr, size as usize, &desc, 1))
    }

    /// The session's end: unmaps, releases and frees what it left (its work is finished).
    pub(super) fn vmm_teardown(&mut self) {
        for (p, s) in std::mem::take(&mut self.vmm.mappings) {
            if let Err(e) = cu!(sys::cuMemUnmap(p, s as usize)) {
                warn!("cuMemUnmap at session end failed: {e}");
            }
        }
        for (h, (device, size)) in std::mem::take(&mut self.vmm.physical) {
            self.scrub(device, h, size);
            if let Err(e) = cu!(sys::cuMemRelease(h)) {
                warn!("cuMemRelease at session end failed: {e}");
            }
            self.account.give(size);
        }
        for (p, s) in std::mem::take(&mut self.vmm.reservations) {
            let _ = cu!(sys::cuMemAddressFree(p, s as usize));
        }
    }
}
