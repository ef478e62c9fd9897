//! Managed memory (cuMemAllocManaged): one address that the program's host code and its
//! kernels both use, kept coherent by the shim under the rule CUDA sets for devices without
//! concurrent managed access (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 0, as rgpu
//! reports): the host may not touch managed memory while the device may be running work.
//!
//! Each allocation is device memory mapped (with the VMM messages) at an address the server
//! reserved, and host memory mapped (`mmap(MAP_FIXED_NOREPLACE)`) at the same address in this
//! process. It is in one of two states:
//!
//! - **host-owned**: the host copy is the newer one; the host may read and write it freely;
//! - **device-owned**: the device copy is the newer one (device work was queued since the
//!   last synchronisation); by the rule the host does not touch it.
//!
//! Before any device work is queued (a launch, a copy, a memset: [`to_device`]) every
//! host-owned allocation that work may touch (all, unless the program attached some to the
//! host or to another stream: [`Attach`]) is copied to the device and becomes device-owned. At every point
//! where CUDA lets the host touch managed memory again (context, stream and event
//! synchronisation, a query that answers "done", a synchronous copy: [`sync_point`]) every
//! device-owned allocation's device is synchronised whole and its bytes are copied back: it is
//! host-owned again. A copy whose host side is managed memory brings it to the host first
//! ([`before_host_access`]) and, when the copy wrote it, leaves it host-owned. The unit is the
//! whole allocation: simple, always right under the rule, and it costs one copy of the
//! managed memory each way per synchronisation epoch that has device work.
//!
//! A module's `__managed__` variable (cuLibraryGetManaged) is kept the same way: its device
//! side is the module's own storage for it, and its host side is this process's memory at
//! the same address, the pages mapped for it shared with the module's other such variables
//! ([`adopt_global`]).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use rgpu_cuda_types::*;

use crate::client::connection::Sink;
use crate::runtime::{cu_err, Runtime};

/// Bytes per message of a push or pull.
const CHUNK: usize = 16 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    Host,
    Device,
}

#[derive(Debug)]
pub struct Managed {
    pub device: CUdevice,
    /// Bytes the program asked for; the mapping is `mapped` bytes.
    pub size: u64,
    pub mapped: u64,
    /// The physical allocation's server handle and the reservation.
    pub handle: u64,
    pub flags: u32,
    pub owner: Owner,
    /// cuMemAdvise and cuMemPrefetchAsync, for cuMemRangeGetAttribute.
    pub advice: AdviceMap,
    /// A module's `__managed__` variable: freed with its module, never by cuMemFree.
    pub module_global: bool,
    /// Its stream association, once the program set one (cuStreamAttachMemAsync).
    pub attached: Option<Attach>,
}

/// A stream association a program set with cuStreamAttachMemAsync. Setting one, the program
/// takes on CUDA's rule for devices without concurrent managed access: memory attached to the
/// host is touched by no device work, memory attached to one stream by that stream's work
/// only, and the host may touch either while other work runs. So such memory goes to the
/// device only before its own stream's work ([`to_device`]): pushed before other streams'
/// work, it would be device-owned while the host writes it, and the host's writes would be
/// lost to the next pull. Memory with no association set is pushed before all work (what a
/// program written for GPUs with concurrent managed access expects, whatever flags it
/// allocated with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    Global,
    Host,
    /// One stream (its server handle).
    Single(u64),
}

#[derive(Default)]
pub struct ManagedTable {
    /// By address (the same on host and device).
    allocs: Mutex<BTreeMap<u64, Managed>>,
    /// Host pages mapped for module variables, with how many variables use each.
    global_pages: Mutex<BTreeMap<u64, usize>>,
}

impl ManagedTable {
    pub fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Managed>> {
        self.allocs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The allocation containing `ptr`, as (start, size, device, flags).
    pub fn find(&self, ptr: u64) -> Option<(u64, u64, CUdevice, u32)> {
        let m = self.lock();
        let (&s, a) = m.range(..=ptr).next_back()?;
        (ptr - s < a.size.max(1)).then_some((s, a.size, a.device, a.flags))
    }

    fn overlaps(m: &BTreeMap<u64, Managed>, ptr: u64, n: u64) -> bool {
        let Some(end) = ptr.checked_add(n.max(1)) else { return false };
        m.range(..end).next_back().is_some_and(|(&s, a)| s + a.size > ptr)
    }
}

fn table() -> &'static ManagedTable {
    &super::objects().managed
}

/// Maps `size` bytes of host memory at exactly `va`; false if anything is there already.
pub fn map_host(va: u64, size: u64) -> bool {
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the result is checked.
    let p = unsafe {
        libc::mmap(
            va as usize as *mut libc::c_void,
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    if p as usize as u64 != va {
        // An old kernel that takes the flag as a hint.
        // SAFETY: unmapping the mapping just made.
        unsafe { libc::munmap(p, size as usize) };
        return false;
    }
    true
}

/// The host pages `[ptr, ptr + size)` lies on.
fn pages(ptr: u64, size: u64) -> CuResult<std::ops::Range<u64>> {
    let end = ptr.checked_add(size.max(1)).and_then(|e| e.checked_next_multiple_of(PAGE)).ok_or(CuError::INVALID_VALUE)?;
    Ok(ptr / PAGE..end / PAGE)
}

/// Makes module variable `[ptr, ptr + size)` on `device` managed memory: host pages mapped at
/// its address (or shared with a variable already there), its bytes (the module's initial
/// values, or what kernels wrote) brought to them, and host-owned from then on. Asking again
/// for the same variable changes nothing.
pub fn adopt_global(rt: &Runtime, device: CUdevice, ptr: u64, size: u64) -> CuResult<()> {
    let d = rt.device(device)?;
    if d.server != 0 || d.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? == 0 {
        tracing::warn!("__managed__ variables need managed memory, which device {device} does not offer through rgpu");
        return Err(CuError::NOT_SUPPORTED);
    }
    let mut m = table().lock();
    if m.contains_key(&ptr) {
        return Ok(());
    }
    let mut used = table().global_pages.lock().unwrap_or_else(|e| e.into_inner());
    let range = pages(ptr, size)?;
    let mut fresh = vec![];
    for page in range.clone() {
        if used.contains_key(&page) {
            continue;
        }
        if !map_host(page * PAGE, PAGE) {
            for p in fresh {
                // SAFETY: the pages mapped just above, in no table yet.
                unsafe { libc::munmap((p * PAGE) as usize as *mut libc::c_void, PAGE as usize) };
            }
            tracing::warn!("a __managed__ variable at {ptr:#x}: this process has something else at that address");
            return Err(CuError::NOT_SUPPORTED);
        }
        fresh.push(page);
    }
    let a = Managed {
        device,
        size,
        mapped: 0,
        handle: 0,
        flags: 1,
        owner: Owner::Device,
        advice: AdviceMap::new(size),
        module_global: true,
        attached: None,
    };
    if let Err(e) = pull(rt, ptr, &a) {
        for p in fresh {
            // SAFETY: as above.
            unsafe { libc::munmap((p * PAGE) as usize as *mut libc::c_void, PAGE as usize) };
        }
        return Err(e);
    }
    for page in range {
        *used.entry(page).or_insert(0) += 1;
    }
    m.insert(ptr, Managed { owner: Owner::Host, ..a });
    Ok(())
}

/// Forgets module variable `ptr` (its module is unloaded) and unmaps the host pages no other
/// variable uses. Nothing happens for an address that is not one.
pub fn release_global(ptr: u64) {
    let mut m = table().lock();
    if !m.get(&ptr).is_some_and(|a| a.module_global) {
        return;
    }
    let Some(a) = m.remove(&ptr) else { return };
    let mut used = table().global_pages.lock().unwrap_or_else(|e| e.into_inner());
    let Ok(range) = pages(ptr, a.size) else { return };
    for page in range {
        if let Some(n) = used.get_mut(&page) {
            *n -= 1;
            if *n == 0 {
                used.remove(&page);
                // SAFETY: a page mapped by `adopt_global` that no variable uses any more.
                unsafe { libc::munmap((page * PAGE) as usize as *mut libc::c_void, PAGE as usize) };
            }
        }
    }
}

/// Whether `ptr` is a module's `__managed__` variable.
pub fn is_global(ptr: u64) -> bool {
    table().lock().get(&ptr).is_some_and(|a| a.module_global)
}

/// Copies the host bytes of `a` at `ptr` to its device.
fn push(rt: &Runtime, ptr: u64, a: &Managed) -> CuResult<()> {
    let conn = rt.conn(a.device)?;
    // SAFETY: [ptr, ptr + size) is this allocation's host mapping, owned by the table.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as usize as *const u8, a.size as usize) };
    for (i, chunk) in bytes.chunks(CHUNK).enumerate() {
        let d = Runtime::to_remote(ptr) + (i * CHUNK) as u64;
        conn.post(
            |r| {
                let mut m = r.init_memcpy_hto_d();
                m.set_dst(d);
                m.set_stream(0);
            },
            chunk,
        )
        .map_err(cu_err)?;
    }
    Ok(())
}

/// Waits for all of `a`'s device's work and copies its bytes back to the host.
fn pull(rt: &Runtime, ptr: u64, a: &Managed) -> CuResult<()> {
    let conn = rt.conn(a.device)?;
    let remote = rt.device(a.device)?.remote.ordinal;
    // Work on other streams may still write it (a non-blocking stream on a real GPU).
    conn.call(|r| r.init_ctx_synchronize().set_device(remote), &[], Sink::None, |_| Ok(())).map_err(cu_err)?;
    // SAFETY: as in `push`; the host does not touch a device-owned allocation.
    let out = unsafe { std::slice::from_raw_parts_mut(ptr as usize as *mut u8, a.size as usize) };
    for (i, chunk) in out.chunks_mut(CHUNK).enumerate() {
        let s = Runtime::to_remote(ptr) + (i * CHUNK) as u64;
        let len = chunk.len() as u64;
        conn.call(
            |r| {
                let mut m = r.init_memcpy_dto_h();
                m.set_src(s);
                m.set_size(len);
                m.set_stream(0);
            },
            &[],
            Sink::Host(chunk),
            |_| Ok(()),
        )
        .map_err(cu_err)?;
    }
    Ok(())
}

/// Device work is about to be queued: every host-owned allocation goes to its device.
pub fn to_device(rt: &Runtime, stream: u64) -> CuResult<()> {
    let mut m = table().lock();
    let mut pushed: Vec<CUdevice> = Vec::new();
    for (&p, a) in m.iter_mut() {
        let theirs = match a.attached {
            None | Some(Attach::Global) => true,
            Some(Attach::Host) => false,
            Some(Attach::Single(h)) => h == stream,
        };
        if a.owner == Owner::Host && theirs {
            push(rt, p, a)?;
            a.owner = Owner::Device;
            if !pushed.contains(&a.device) {
                pushed.push(a.device);
            }
        }
    }
    // The pushes went to the legacy stream, which a non-blocking stream does not wait for (on
    // a real GPU): they are finished before the work that may read them is queued.
    for dev in pushed {
        let remote = rt.device(dev)?.remote.ordinal;
        rt.conn(dev)?
            .call(|r| r.init_ctx_synchronize().set_device(remote), &[], Sink::None, |_| Ok(()))
            .map_err(cu_err)?;
    }
    Ok(())
}

/// The host may touch managed memory again: every device-owned allocation comes back.
pub fn sync_point(rt: &Runtime) -> CuResult<()> {
    let mut m = table().lock();
    for (&p, a) in m.iter_mut() {
        if a.owner == Owner::Device {
            pull(rt, p, a)?;
            a.owner = Owner::Host;
        }
    }
    Ok(())
}

/// The shim is about to read or write `[ptr, ptr + n)` on the host: if that is managed
/// memory, it is brought to the host first. Returns whether it was managed.
pub fn before_host_access(rt: &Runtime, ptr: u64, n: u64) -> CuResult<bool> {
    if !ManagedTable::overlaps(&table().lock(), ptr, n) {
        return Ok(false);
    }
    sync_point(rt)?;
    Ok(true)
}

/// The shim wrote `[ptr, ptr + n)` of managed memory on the host (a copy into it, which
/// waited for its bytes): those allocations are host-owned.
pub fn host_wrote(ptr: u64, n: u64) {
    let mut m = table().lock();
    let Some(end) = ptr.checked_add(n.max(1)) else { return };
    for (&s, a) in m.range_mut(..end) {
        if s + a.size > ptr {
            a.owner = Owner::Host;
        }
    }
}

/// Sets the stream association of the allocation or variable starting at `ptr`; `len` is 0
/// or its whole size (CUDA associates no part of one).
pub fn attach(ptr: u64, len: u64, to: Attach) -> CuResult<()> {
    let mut m = table().lock();
    let a = m.get_mut(&ptr).ok_or(CuError::INVALID_VALUE)?;
    if len != 0 && len != a.size {
        return Err(CuError::INVALID_VALUE);
    }
    a.attached = Some(to);
    Ok(())
}

/// Stream `h` is gone: memory attached to it alone is attached globally, as CUDA does.
pub fn forget_stream(h: u64) {
    for a in table().lock().values_mut() {
        if a.attached == Some(Attach::Single(h)) {
            a.attached = Some(Attach::Global);
        }
    }
}

/// Records a new allocation (host-owned: both copies are zero, and the host may write first).
pub fn insert(ptr: u64, a: Managed) {
    table().lock().insert(ptr, a);
}

pub fn remove(ptr: u64) -> Option<Managed> {
    table().lock().remove(&ptr)
}

/// `CU_DEVICE_CPU` and `CU_DEVICE_INVALID` as advice locations.
pub const CPU: i32 = -1;
pub const INVALID: i32 = -2;

/// The advice (cuMemAdvise) and last prefetch of one stretch of an allocation. The bit of
/// device `d` in `accessed_by` is `1 << d` (devices 0..62); bit 63 is the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Advice {
    pub read_mostly: bool,
    pub preferred: Option<i32>,
    pub accessed_by: u64,
    pub last_prefetch: Option<i32>,
}

/// Advice over an allocation, piecewise constant on 4 KiB pages: each key starts a stretch
/// that runs to the next key (the first key is 0).
#[derive(Debug)]
pub struct AdviceMap {
    size: u64,
    stretches: BTreeMap<u64, Advice>,
}

const PAGE: u64 = 4096;

impl AdviceMap {
    pub fn new(size: u64) -> Self {
        AdviceMap { size: size.next_multiple_of(PAGE), stretches: BTreeMap::from([(0, Advice::default())]) }
    }

    /// `[off, off + len)` widened to whole pages and cut to the allocation.
    fn pages(&self, off: u64, len: u64) -> (u64, u64) {
        let a = off / PAGE * PAGE;
        let b = off.saturating_add(len).next_multiple_of(PAGE).min(self.size);
        (a.min(b), b)
    }

    fn split(&mut self, at: u64) {
        if at >= self.size || self.stretches.contains_key(&at) {
            return;
        }
        let v = self.stretches.range(..at).next_back().map(|(_, v)| *v).unwrap_or_default();
        self.stretches.insert(at, v);
    }

    pub fn update(&mut self, off: u64, len: u64, f: impl Fn(&mut Advice)) {
        let (a, b) = self.pages(off, len);
        self.split(a);
        self.split(b);
        for (_, v) in self.stretches.range_mut(a..b) {
            f(v);
        }
    }

    /// The stretches that cover `[off, off + len)`.
    pub fn over(&self, off: u64, len: u64) -> Vec<Advice> {
        let (a, b) = self.pages(off, len);
        let first = self.stretches.range(..=a).next_back().map(|(_, v)| *v);
        first.into_iter().chain(self.stretches.range(a + 1..b).map(|(_, v)| *v)).collect()
    }
}

/// Runs `f` on the advice of the allocation holding all of `[ptr, ptr + n)`.
pub fn with_advice<R>(ptr: u64, n: u64, f: impl FnOnce(&mut AdviceMap, u64) -> R) -> CuResult<R> {
    let mut m = table().lock();
    let (&s, a) = m.range_mut(..=ptr).next_back().ok_or(CuError::INVALID_VALUE)?;
    let end = ptr.checked_add(n).ok_or(CuError::INVALID_VALUE)?;
    if n == 0 || end > s + a.size {
        return Err(CuError::INVALID_VALUE);
    }
    Ok(f(&mut a.advice, ptr - s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_is_kept_per_page_range() {
        let mut m = AdviceMap::new(10 * PAGE);
        m.update(PAGE + 5, 2 * PAGE, |a| a.read_mostly = true); // pages 1..4
        assert!(m.over(PAGE, 3 * PAGE).iter().all(|a| a.read_mostly));
        assert!(!m.over(0, 2 * PAGE).iter().all(|a| a.read_mostly), "page 0 has no advice");
        assert!(!m.over(3 * PAGE, 2 * PAGE).iter().all(|a| a.read_mostly), "page 4 has no advice");
        m.update(0, 10 * PAGE, |a| a.preferred = Some(0));
        m.update(2 * PAGE, PAGE, |a| a.preferred = Some(CPU));
        let p: Vec<Option<i32>> = m.over(0, 10 * PAGE).iter().map(|a| a.preferred).collect();
        assert!(p.contains(&Some(0)) && p.contains(&Some(CPU)));
        assert_eq!(m.over(5 * PAGE, PAGE).iter().map(|a| a.preferred).collect::<Vec<_>>(), [Some(0)]);
        m.update(0, 100 * PAGE, |a| a.read_mostly = false);
        assert!(m.over(0, 10 * PAGE).iter().all(|a| !a.read_mostly), "cut to the allocation");
    }
}
