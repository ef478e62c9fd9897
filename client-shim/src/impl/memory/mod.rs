//! Device memory, copies, memsets and page-locked host memory (cuMem*).
//!
//! Copies and memsets are checked against the shim's tables of allocations
//! (`objects::memory`) before anything is sent; the server checks every range
//! again against the session's own allocations.

use std::ffi::c_void;

use crate::client::connection::Sink;
use crate::client::ClientError;
use crate::cuda::types::*;
use crate::objects::managed;
use crate::objects::memory::{self as mem, Alloc, HostAlloc};
use crate::objects::{capture, graph_mem};
use crate::objects::graph::{Copy, MemsetNode, Node, Rows};
use crate::objects::{context, objects, stream};
use crate::runtime::{self, cu_err, Runtime};

/// Largest payload sent in one frame; bigger copies are split.
const CHUNK: usize = 1 << 30;

fn current_device(rt: &Runtime) -> CuResult<(u64, CUdevice)> {
    let (h, c) = context::current()?;
    rt.device(c.device)?;
    Ok((h, c.device))
}

pub(crate) unsafe fn alloc_v2(dptr: &mut CUdeviceptr, bytesize: usize) -> CuResult<()> {
    if bytesize == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    let (ctx, dev) = current_device(rt)?;
    *dptr = alloc_on(rt, dev, ctx, bytesize as u64, 0)?;
    Ok(())
}

/// Allocates on `dev` and records the allocation; returns the client address.
fn alloc_on(rt: &Runtime, dev: CUdevice, ctx: u64, size: u64, pool: u64) -> CuResult<u64> {
    let remote_dev = rt.device(dev)?.remote.ordinal;
    let remote = rt
        .conn(dev)?
        .call(
            |r| {
                let mut m = r.init_mem_alloc();
                m.set_device(remote_dev);
                m.set_size(size);
            },
            &[],
            Sink::None,
            |reply| match reply.which() {
                Ok(rgpu_protocol::data_capnp::reply::MemAlloc(p)) => Ok(p),
                _ => Err(ClientError::Cuda(CuError::UNKNOWN.code())),
            },
        )
        .map_err(cu_err)?;
    let ptr = rt.to_client(dev, remote);
    objects().memory.record(ptr, Alloc { size, device: dev, ctx, pool, mapped: false, ipc: 0 });
    Ok(ptr)
}

pub(crate) unsafe fn free_v2(dptr: CUdeviceptr) -> CuResult<()> {
    capture::check_unsafe_call()?;
    if let Some(m) = graph_mem::find(dptr) {
        return graph_mem::free(&m);
    }
    free_now(dptr)
}

fn free_now(dptr: CUdeviceptr) -> CuResult<()> {
    let rt = runtime::get()?;
    if dptr == 0 {
        return Ok(());
    }
    if super::managed::free(dptr)? {
        return Ok(());
    }
    let a = {
        let mut m = objects().memory.allocs.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(&dptr) {
            // Module globals are freed with their module, memory opened from another process
            // is closed by cuIpcCloseMemHandle: neither by cuMemFree.
            Some(a) if a.ctx != 0 && a.ipc == 0 => m.remove(&dptr).ok_or(CuError::INVALID_VALUE)?,
            _ => return Err(CuError::INVALID_VALUE),
        }
    };
    mem::release(rt, dptr, &a)
}

// ---- the stream-ordered allocator (objects::pool) ------------------------------------------

pub(crate) unsafe fn alloc_async(dptr: &mut CUdeviceptr, bytesize: usize, s: CUstream) -> CuResult<()> {
    let (_, dev) = stream::device_of(s)?;
    let pool = objects().device_pools.current(dev);
    alloc_from_pool_async(dptr, bytesize, pool as usize as CUmemoryPool, s)
}

pub(crate) unsafe fn alloc_from_pool_async(dptr: &mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool, s: CUstream) -> CuResult<()> {
    if bytesize == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let rt = runtime::get()?;
    let (sh, dev) = stream::device_of(s)?;
    let (ph, p) = crate::objects::pool::get(pool)?;
    if p.device != dev {
        return Err(CuError::INVALID_VALUE);
    }
    // On a capturing stream: graph memory, allocated now and kept for the graph's life.
    let captured = std::cell::Cell::new(0u64);
    let node = || {
        let ptr = alloc_on(rt, dev, 0, bytesize as u64, 0)?;
        captured.set(ptr);
        Ok(Node::MemAlloc { mem: graph_mem::adopt(ptr, bytesize as u64, dev) })
    };
    if capture::record(sh, node)? {
        *dptr = captured.get();
        return Ok(());
    }
    let ctx = if sh == 0 { context::current()?.0 } else { stream::get(sh)?.ctx };
    *dptr = alloc_on(rt, dev, ctx, bytesize as u64, ph)?;
    p.took(bytesize as u64);
    Ok(())
}

pub(crate) unsafe fn free_async(dptr: CUdeviceptr, s: CUstream) -> CuResult<()> {
    let (sh, _) = stream::device_of(s)?;
    if let Some(m) = graph_mem::find(dptr) {
        if capture::record(sh, || Ok(Node::MemFree { ptr: dptr, device: m.device }))? {
            return Ok(());
        }
        return graph_mem::free(&m);
    }
    capture::refuse(sh, CuError::NOT_SUPPORTED, "cuMemFreeAsync of memory not allocated in a graph")?;
    free_now(dptr)
}

pub(crate) unsafe fn pool_create(pool: &mut CUmemoryPool, props: &CUmemPoolProps) -> CuResult<()> {
    let rt = runtime::get()?;
    if props.allocType != CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
        || props.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
    {
        return Err(CuError::NOT_SUPPORTED);
    }
    if props.handleTypes != CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE {
        // Exportable pools need IPC, which rgpu does not offer yet.
        return Err(CuError::NOT_SUPPORTED);
    }
    // SAFETY: for a device location the union holds the device ordinal.
    let dev = props.location.__bindgen_anon_1.id;
    rt.device(dev)?;
    let (h, _) = objects().pools.insert(crate::objects::pool::MemPool::new(dev));
    *pool = h as usize as CUmemoryPool;
    Ok(())
}

pub(crate) unsafe fn pool_destroy(pool: CUmemoryPool) -> CuResult<()> {
    let (h, _) = crate::objects::pool::get(pool)?;
    if objects().device_pools.is_default(h) {
        return Err(CuError::INVALID_VALUE);
    }
    // Allocations still out stay valid and are freed as usual; the pool is only bookkeeping.
    objects().pools.remove(h);
    Ok(())
}

pub(crate) unsafe fn pool_trim_to(pool: CUmemoryPool, _min_bytes_to_keep: usize) -> CuResult<()> {
    // Nothing is held back: freed memory goes back to the device at once.
    crate::objects::pool::get(pool).map(|_| ())
}

pub(crate) unsafe fn pool_get_attribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) -> CuResult<()> {
    type P = CUmemPool_attribute;
    let (_, p) = crate::objects::pool::get(pool)?;
    if value.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    p.with(|s| {
        match attr {
            P::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES => *(value as *mut i32) = s.reuse[0] as i32,
            P::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC => *(value as *mut i32) = s.reuse[1] as i32,
            P::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => *(value as *mut i32) = s.reuse[2] as i32,
            P::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => *(value as *mut u64) = s.release_threshold,
            // Nothing is reserved beyond what is in use.
            P::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT | P::CU_MEMPOOL_ATTR_USED_MEM_CURRENT => *(value as *mut u64) = s.used,
            P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH | P::CU_MEMPOOL_ATTR_USED_MEM_HIGH => *(value as *mut u64) = s.used_high,
            P::CU_MEMPOOL_ATTR_LOCATION_TYPE => *(value as *mut u32) = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE.0,
            P::CU_MEMPOOL_ATTR_LOCATION_ID => *(value as *mut i32) = p.device,
            P::CU_MEMPOOL_ATTR_ALLOCATION_TYPE => *(value as *mut u32) = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED.0,
            P::CU_MEMPOOL_ATTR_EXPORT_HANDLE_TYPES => *(value as *mut u32) = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE.0,
            _ => return Err(CuError::INVALID_VALUE),
        }
        Ok(())
    })
}

pub(crate) unsafe fn pool_set_attribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) -> CuResult<()> {
    type P = CUmemPool_attribute;
    let (_, p) = crate::objects::pool::get(pool)?;
    if value.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    p.with(|s| {
        match attr {
            P::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES => s.reuse[0] = *(value as *const i32) != 0,
            P::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC => s.reuse[1] = *(value as *const i32) != 0,
            P::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => s.reuse[2] = *(value as *const i32) != 0,
            P::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => s.release_threshold = *(value as *const u64),
            // Only resetting a high-water mark is allowed, as in CUDA.
            P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH | P::CU_MEMPOOL_ATTR_USED_MEM_HIGH if *(value as *const u64) == 0 => {
                s.used_high = s.used
            }
            _ => return Err(CuError::INVALID_VALUE),
        }
        Ok(())
    })
}

pub(crate) unsafe fn get_info_v2(free: Option<&mut usize>, total: Option<&mut usize>) -> CuResult<()> {
    let rt = runtime::get()?;
    let (_, dev) = current_device(rt)?;
    let remote_dev = rt.device(dev)?.remote.ordinal;
    let (f, t) = rt
        .conn(dev)?
        .call(
            |r| r.init_mem_get_info().set_device(remote_dev),
            &[],
            Sink::None,
            |reply| match reply.which() {
                Ok(rgpu_protocol::data_capnp::reply::MemGetInfo(Ok(i))) => Ok((i.get_free(), i.get_total())),
                _ => Err(ClientError::Cuda(CuError::UNKNOWN.code())),
            },
        )
        .map_err(cu_err)?;
    if let Some(free) = free {
        *free = f as usize;
    }
    if let Some(total) = total {
        *total = t as usize;
    }
    Ok(())
}

pub(crate) unsafe fn alloc_pitch_v2(
    dptr: &mut CUdeviceptr,
    pitch: &mut usize,
    width: usize,
    height: usize,
    element_size: u32,
) -> CuResult<()> {
    if width == 0 || height == 0 || !matches!(element_size, 4 | 8 | 16) {
        return Err(CuError::INVALID_VALUE);
    }
    // The pitch alignment an sm_90 device reports (CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT).
    let p = width.div_ceil(512) * 512;
    let bytes = p.checked_mul(height).ok_or(CuError::INVALID_VALUE)?;
    alloc_v2(dptr, bytes)?;
    *pitch = p;
    Ok(())
}

pub(crate) unsafe fn get_address_range_v2(base: Option<&mut CUdeviceptr>, size: Option<&mut usize>, dptr: CUdeviceptr) -> CuResult<()> {
    runtime::get()?;
    let (start, a) = objects().memory.find_alloc(dptr).ok_or(CuError::NOT_FOUND)?;
    if let Some(b) = base {
        *b = start;
    }
    if let Some(s) = size {
        *s = a.size as usize;
    }
    Ok(())
}

// ---- copies -------------------------------------------------------------

/// Whether `[p, p+n)` lies in page-locked memory (cuMemHostAlloc'd or
/// registered): CUDA forbids changing it until an asynchronous copy from it
/// completed, so such a copy need not be kept aside nor waited for.
fn page_locked(p: usize, n: usize) -> bool {
    objects().memory.find_host(p).is_some_and(|(start, a)| p.checked_add(n).is_some_and(|end| end <= start + a.size))
}

/// Host to device. `stream` is the server-side stream handle (0: default).
unsafe fn htod(rt: &Runtime, dst: u64, src: *const c_void, n: usize, stream: u64) -> CuResult<()> {
    htod_as(rt, dst, src, n, stream, false)
}

/// [`htod`]; `asynchronous`: the program may go on before the copy
/// completed, so a page-locked source is sent from where it is and nobody
/// waits.
unsafe fn htod_as(rt: &Runtime, dst: u64, src: *const c_void, n: usize, stream: u64, asynchronous: bool) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    if src.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let dev = objects().memory.check_range(dst, n as u64)?;
    if capture::record(stream, || Ok(Node::Memcpy { copy: Copy::HtoD { dst, src: src as usize }, size: n, rows: Rows::ONE, device: dev }))? {
        return Ok(());
    }
    // Managed memory as the source is read on the host: its newest bytes first.
    managed::before_host_access(rt, src as u64, n as u64)?;
    managed::to_device(rt, stream)?;
    let conn = rt.conn(dev)?;
    let borrow = asynchronous && page_locked(src as usize, n);
    let bytes = std::slice::from_raw_parts(src as *const u8, n);
    for (i, chunk) in bytes.chunks(CHUNK).enumerate() {
        let d = Runtime::to_remote(dst) + (i * CHUNK) as u64;
        let build = |r: rgpu_protocol::data_capnp::request::Builder<'_>| {
            let mut m = r.init_memcpy_hto_d();
            m.set_dst(d);
            m.set_stream(stream);
        };
        if borrow {
            // SAFETY: page-locked memory the program may not change before
            // the copy completed, which only a later reply can tell it; it
            // may not free it before either (free_host acknowledges first).
            conn.post_borrowed(build, chunk)
        } else {
            conn.post(build, chunk)
        }
        .map_err(cu_err)?;
    }
    Ok(())
}

/// Device to host, waiting for the bytes.
unsafe fn dtoh(rt: &Runtime, dst: *mut c_void, src: u64, n: usize, stream: u64) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    if dst.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let dev = objects().memory.check_range(src, n as u64)?;
    // Managed memory as the destination is written on the host: brought there first, and
    // the host's (newer) copy afterwards.
    let into_managed = managed::before_host_access(rt, dst as u64, n as u64)?;
    managed::to_device(rt, stream)?;
    let conn = rt.conn(dev)?;
    let out = std::slice::from_raw_parts_mut(dst as *mut u8, n);
    for (i, chunk) in out.chunks_mut(CHUNK).enumerate() {
        let s = Runtime::to_remote(src) + (i * CHUNK) as u64;
        let len = chunk.len() as u64;
        conn.call(
            |r| {
                let mut m = r.init_memcpy_dto_h();
                m.set_src(s);
                m.set_size(len);
                m.set_stream(stream);
            },
            &[],
            Sink::Host(chunk),
            |_| Ok(()),
        )
        .map_err(cu_err)?;
    }
    if into_managed {
        managed::host_wrote(dst as u64, n as u64);
    }
    Ok(())
}

/// An asynchronous device-to-host copy. Into page-locked memory it does not
/// wait: the bytes land when the program next synchronises, as with a real
/// asynchronous copy. Into pageable memory CUDA returns only once the copy
/// is done (programs rely on it: numba reads the buffer right after, or
/// frees it), so that copy waits for its bytes, in the stream's order.
unsafe fn dtoh_async(rt: &Runtime, dst: *mut c_void, src: u64, n: usize, stream: u64) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    if dst.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let node = || {
        let device = objects().memory.check_range(src, n as u64)?;
        Ok(Node::Memcpy { copy: Copy::DtoH { dst: dst as usize, src }, size: n, rows: Rows::ONE, device })
    };
    if capture::record(stream, node)? {
        return Ok(());
    }
    if !is_page_locked(dst as usize, n) {
        return dtoh(rt, dst, src, n, stream);
    }
    let dev = objects().memory.check_range(src, n as u64)?;
    managed::to_device(rt, stream)?;
    let conn = rt.conn(dev)?;
    let mut off = 0usize;
    while off < n {
        let len = (n - off).min(CHUNK);
        let s = Runtime::to_remote(src) + off as u64;
        conn.post_read(
            |r| {
                let mut m = r.init_memcpy_dto_h();
                m.set_src(s);
                m.set_size(len as u64);
                m.set_stream(stream);
            },
            (dst as *mut u8).add(off),
            len,
        )
        .map_err(cu_err)?;
        off += len;
    }
    Ok(())
}

/// Whether [ptr, ptr+n) lies in one page-locked host range (cuMemHostAlloc,
/// cuMemAllocHost, cuMemHostRegister).
fn is_page_locked(ptr: usize, n: usize) -> bool {
    match objects().memory.find_host(ptr) {
        Some((start, a)) => ptr.checked_add(n).is_some_and(|end| end <= start + a.size),
        None => false,
    }
}

unsafe fn dtod(rt: &Runtime, dst: u64, src: u64, n: usize, stream: u64) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    let ddev = objects().memory.check_range(dst, n as u64)?;
    let sdev = objects().memory.check_range(src, n as u64)?;
    if capture::record(stream, || Ok(Node::Memcpy { copy: Copy::DtoD { dst, src }, size: n, rows: Rows::ONE, device: ddev }))? {
        return Ok(());
    }
    if rt.device(ddev)?.server != rt.device(sdev)?.server {
        // Different servers: stage through this host.
        let mut buf = vec![0u8; n];
        dtoh(rt, buf.as_mut_ptr() as *mut c_void, src, n, 0)?;
        return htod(rt, dst, buf.as_ptr() as *const c_void, n, 0);
    }
    managed::to_device(rt, stream)?;
    rt.conn(ddev)?
        .post(
            |r| {
                let mut m = r.init_memcpy_dto_d();
                m.set_dst(Runtime::to_remote(dst));
                m.set_src(Runtime::to_remote(src));
                m.set_size(n as u64);
                m.set_stream(stream);
            },
            &[],
        )
        .map_err(cu_err)
}

/// A copy between unified addresses: each side is device memory if it lies
/// in one of our allocations, host memory otherwise.
unsafe fn generic(rt: &Runtime, dst: u64, src: u64, n: usize, stream: u64, asynchronous: bool) -> CuResult<()> {
    let d_dev = objects().memory.find_alloc(dst).is_some();
    let s_dev = objects().memory.find_alloc(src).is_some();
    match (d_dev, s_dev) {
        (true, true) => dtod(rt, dst, src, n, stream),
        (true, false) => htod_as(rt, dst, src as usize as *const c_void, n, stream, asynchronous),
        (false, true) if asynchronous => dtoh_async(rt, dst as usize as *mut c_void, src, n, stream),
        (false, true) => dtoh(rt, dst as usize as *mut c_void, src, n, stream),
        (false, false) => {
            if asynchronous {
                capture::refuse(stream, CuError::NOT_SUPPORTED, "a host-to-host copy")?;
            }
            if n > 0 {
                if dst == 0 || src == 0 {
                    return Err(CuError::INVALID_VALUE);
                }
                managed::before_host_access(rt, src, n as u64)?;
                managed::before_host_access(rt, dst, n as u64)?;
                std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, n);
            }
            Ok(())
        }
    }
}

/// A synchronous copy is a point where CUDA lets the host touch managed memory again.
fn synchronous(rt: &Runtime, r: CuResult<()>) -> CuResult<()> {
    r?;
    managed::sync_point(rt)
}

pub(crate) unsafe fn memcpy_htod_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    synchronous(rt, htod(rt, dst, src, n, 0))
}
pub(crate) unsafe fn memcpy_dtoh_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    synchronous(rt, dtoh(rt, dst, src, n, 0))
}
pub(crate) unsafe fn memcpy_dtod_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    synchronous(rt, dtod(rt, dst, src, n, 0))
}
pub(crate) unsafe fn memcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    synchronous(rt, generic(rt, dst, src, n, 0, false))
}
pub(crate) unsafe fn memcpy_async(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) -> CuResult<()> {
    let st = stream::remote(s)?;
    generic(runtime::get()?, dst, src, n, st, true)
}
pub(crate) unsafe fn memcpy_htod_async_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) -> CuResult<()> {
    let st = stream::remote(s)?;
    htod_as(runtime::get()?, dst, src, n, st, true)
}
pub(crate) unsafe fn memcpy_dtoh_async_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) -> CuResult<()> {
    let st = stream::remote(s)?;
    dtoh_async(runtime::get()?, dst, src, n, st)
}
pub(crate) unsafe fn memcpy_dtod_async_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) -> CuResult<()> {
    let st = stream::remote(s)?;
    dtod(runtime::get()?, dst, src, n, st)
}
pub(crate) unsafe fn memcpy_peer(dst: CUdeviceptr, _dctx: CUcontext, src: CUdeviceptr, _sctx: CUcontext, n: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    synchronous(rt, dtod(rt, dst, src, n, 0))
}
pub(crate) unsafe fn memcpy_peer_async(
    dst: CUdeviceptr,
    _dctx: CUcontext,
    src: CUdeviceptr,
    _sctx: CUcontext,
    n: usize,
    s: CUstream,
) -> CuResult<()> {
    let st = stream::remote(s)?;
    dtod(runtime::get()?, dst, src, n, st)
}

// ---- memsets ------------------------------------------------------------

fn memset(dst: u64, value: u32, elem: u8, count: usize, pitch: usize, rows: usize, stream: u64) -> CuResult<()> {
    if count == 0 || (pitch != 0 && rows == 0) {
        return Ok(());
    }
    let rt = runtime::get()?;
    if !dst.is_multiple_of(elem as u64) {
        return Err(CuError::INVALID_VALUE);
    }
    let row_bytes = (count as u64).checked_mul(elem as u64).ok_or(CuError::INVALID_VALUE)?;
    let span = if pitch == 0 {
        row_bytes
    } else {
        if (pitch as u64) < row_bytes {
            return Err(CuError::INVALID_VALUE);
        }
        (pitch as u64).checked_mul(rows as u64 - 1).and_then(|b| b.checked_add(row_bytes)).ok_or(CuError::INVALID_VALUE)?
    };
    let dev = objects().memory.check_range(dst, span)?;
    let op = MemsetNode { dst, value, elem, width: count, pitch, height: if pitch == 0 { 1 } else { rows } };
    if capture::record(stream, || Ok(Node::Memset { op, device: dev }))? {
        return Ok(());
    }
    managed::to_device(rt, stream)?;
    rt.conn(dev)?
        .post(
            |r| {
                let mut m = r.init_memset();
                m.set_dst(Runtime::to_remote(dst));
                m.set_value(value);
                m.set_element_size(elem);
                m.set_count(count as u64);
                m.set_pitch(pitch as u64);
                m.set_rows(rows as u64);
                m.set_stream(stream);
            },
            &[],
        )
        .map_err(cu_err)
}

pub(crate) unsafe fn memset_d8_v2(d: CUdeviceptr, v: u8, n: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    memset(d, v as u32, 1, n, 0, 0, 0)
}
pub(crate) unsafe fn memset_d16_v2(d: CUdeviceptr, v: u16, n: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    memset(d, v as u32, 2, n, 0, 0, 0)
}
pub(crate) unsafe fn memset_d32_v2(d: CUdeviceptr, v: u32, n: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    memset(d, v, 4, n, 0, 0, 0)
}
pub(crate) unsafe fn memset_d8_async(d: CUdeviceptr, v: u8, n: usize, s: CUstream) -> CuResult<()> {
    memset(d, v as u32, 1, n, 0, 0, stream::remote(s)?)
}
pub(crate) unsafe fn memset_d16_async(d: CUdeviceptr, v: u16, n: usize, s: CUstream) -> CuResult<()> {
    memset(d, v as u32, 2, n, 0, 0, stream::remote(s)?)
}
pub(crate) unsafe fn memset_d32_async(d: CUdeviceptr, v: u32, n: usize, s: CUstream) -> CuResult<()> {
    memset(d, v, 4, n, 0, 0, stream::remote(s)?)
}
pub(crate) unsafe fn memset_d2d8_v2(d: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    memset(d, v as u32, 1, w, pitch, h, 0)
}
pub(crate) unsafe fn memset_d2d16_v2(d: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    memset(d, v as u32, 2, w, pitch, h, 0)
}
pub(crate) unsafe fn memset_d2d32_v2(d: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize) -> CuResult<()> {
    capture::check_unsafe_call()?;
    memset(d, v, 4, w, pitch, h, 0)
}
pub(crate) unsafe fn memset_d2d8_async(d: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize, s: CUstream) -> CuResult<()> {
    memset(d, v as u32, 1, w, pitch, h, stream::remote(s)?)
}
pub(crate) unsafe fn memset_d2d16_async(d: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize, s: CUstream) -> CuResult<()> {
    memset(d, v as u32, 2, w, pitch, h, stream::remote(s)?)
}
pub(crate) unsafe fn memset_d2d32_async(d: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize, s: CUstream) -> CuResult<()> {
    memset(d, v, 4, w, pitch, h, stream::remote(s)?)
}
// ---- page-locked host memory --------------------------------------------

/// Host memory stays on this host: a remote GPU cannot map it, so it is
/// ordinary memory here, and copies from it go over the network like any
/// other. It is tracked so pointer queries and cuMemFreeHost behave.
pub(crate) unsafe fn host_alloc(pp: &mut *mut c_void, bytesize: usize, flags: u32) -> CuResult<()> {
    runtime::get()?;
    context::current()?;
    if bytesize == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    if libc::posix_memalign(&mut p, 4096, bytesize) != 0 || p.is_null() {
        return Err(CuError::OUT_OF_MEMORY);
    }
    objects().memory.host
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(p as usize, HostAlloc { size: bytesize, flags, owned: true });
    *pp = p;
    Ok(())
}

pub(crate) unsafe fn alloc_host_v2(pp: &mut *mut c_void, bytesize: usize) -> CuResult<()> {
    host_alloc(pp, bytesize, 0)
}

/// Before page-locked memory goes, no resend of a copy from it may read it.
fn release_borrowed(rt: &Runtime) -> CuResult<()> {
    rt.servers.iter().try_for_each(|s| s.conn.release_borrowed()).map_err(cu_err)
}

pub(crate) unsafe fn free_host(p: *mut c_void) -> CuResult<()> {
    release_borrowed(runtime::get()?)?;
    let mut m = objects().memory.host.lock().unwrap_or_else(|e| e.into_inner());
    match m.get(&(p as usize)) {
        Some(a) if a.owned => {
            m.remove(&(p as usize));
            libc::free(p);
            Ok(())
        }
        _ => Err(CuError::INVALID_VALUE),
    }
}

pub(crate) unsafe fn host_get_flags(flags: &mut u32, p: *mut c_void) -> CuResult<()> {
    let (_, a) = objects().memory.find_host(p as usize).ok_or(CuError::INVALID_VALUE)?;
    *flags = a.flags;
    Ok(())
}

pub(crate) unsafe fn host_register_v2(p: *mut c_void, bytesize: usize, flags: u32) -> CuResult<()> {
    runtime::get()?;
    if p.is_null() || bytesize == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let mut m = objects().memory.host.lock().unwrap_or_else(|e| e.into_inner());
    if m.contains_key(&(p as usize)) {
        return Err(CuError::HOST_MEMORY_ALREADY_REGISTERED);
    }
    m.insert(p as usize, HostAlloc { size: bytesize, flags, owned: false });
    Ok(())
}

pub(crate) unsafe fn host_unregister(p: *mut c_void) -> CuResult<()> {
    release_borrowed(runtime::get()?)?;
    let mut m = objects().memory.host.lock().unwrap_or_else(|e| e.into_inner());
    match m.get(&(p as usize)) {
        Some(a) if !a.owned => {
            m.remove(&(p as usize));
            Ok(())
        }
        _ => Err(CuError::HOST_MEMORY_NOT_REGISTERED),
    }
}

mod pitched;
pub(crate) use pitched::{memcpy_2d_async_v2, memcpy_2d_v2, memcpy_3d_async_v2, memcpy_3d_peer, memcpy_3d_peer_async, memcpy_3d_v2, Copy3};
