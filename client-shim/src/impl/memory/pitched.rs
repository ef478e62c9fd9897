//! Pitched copies (cuMemcpy2D*, cuMemcpy3D*) between linear memory: slices
//! of rows, each row the 1-D copy its sides call for.
//!
//! Every offset is computed with checked arithmetic and both whole spans are
//! checked (a device side against the allocation tables) before the first
//! byte moves, so a hostile pitch or offset is `CUDA_ERROR_INVALID_VALUE`
//! and never a partial copy, a wrapped address or a huge staging buffer.
//! CUDA arrays are not offered by rgpu (`CUDA_ERROR_NOT_SUPPORTED`).
//!
//! The same checked copy becomes a graph memcpy node ([`Copy3::node`]) when a stream
//! captures it or a program adds it to a graph (`impl::graph`): a node of rows that the
//! instantiated graph runs as contiguous pieces.

use std::ffi::c_void;

use super::{dtod, dtoh, htod, synchronous};
use crate::cuda::types::*;
use crate::objects::graph::{Copy, Node, Rows, MAX_RUNS};
use crate::objects::{capture, managed, objects, stream};
use crate::runtime::{self, Runtime};

/// Most bytes staged on the host at once: rows are read or gathered in
/// groups of at most this much.
const GROUP: usize = 8 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Host(usize),
    Device(u64),
}

/// One side of a pitched copy: the address of its first byte (offsets
/// applied), its pitch and the rows from one slice to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plane {
    at: Side,
    pitch: usize,
    slice_rows: usize,
}

impl Plane {
    /// The offset of row `y` of slice `z`; within the span checked by [`Copy3::new`].
    fn row(&self, y: usize, z: usize) -> usize {
        (z * self.slice_rows + y) * self.pitch
    }
}

/// A pitched copy: `depth` slices of `height` rows of `width` bytes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Copy3 {
    src: Plane,
    dst: Plane,
    width: usize,
    height: usize,
    depth: usize,
}

/// The side a memory type and its pointers name, before offsets.
fn base(p: &SideParams, is_device: &dyn Fn(u64) -> bool) -> CuResult<Side> {
    Ok(match p.ty {
        CUmemorytype::CU_MEMORYTYPE_HOST => Side::Host(p.host),
        CUmemorytype::CU_MEMORYTYPE_DEVICE => Side::Device(p.dev),
        // Unified: the address says which.
        CUmemorytype::CU_MEMORYTYPE_UNIFIED if is_device(p.dev) => Side::Device(p.dev),
        CUmemorytype::CU_MEMORYTYPE_UNIFIED => Side::Host(p.dev as usize),
        CUmemorytype::CU_MEMORYTYPE_ARRAY => {
            tracing::warn!("copies to and from CUDA arrays are not supported by rgpu");
            return Err(CuError::NOT_SUPPORTED);
        }
        _ => return Err(CuError::INVALID_VALUE),
    })
}

/// Bytes from a side's first byte to past its last: `height` rows a slice
/// `pitch` apart, `depth` slices `slice_rows` rows apart.
fn span(pitch: usize, slice_rows: usize, width: usize, height: usize, depth: usize) -> CuResult<usize> {
    if height > 1 && pitch < width || depth > 1 && (pitch < width || slice_rows < height) {
        return Err(CuError::INVALID_VALUE);
    }
    let last_row = (depth - 1).checked_mul(slice_rows).and_then(|r| r.checked_add(height - 1));
    last_row.and_then(|r| r.checked_mul(pitch)).and_then(|o| o.checked_add(width)).ok_or(CuError::INVALID_VALUE)
}

/// `side` moved by `p`'s (x, y, z) and checked over `len` bytes from there.
fn place(side: Side, p: &SideParams, len: usize, check_device: &dyn Fn(u64, u64) -> CuResult<()>) -> CuResult<Side> {
    let off = p.z.checked_mul(p.slice_rows).and_then(|r| r.checked_add(p.y)).and_then(|r| r.checked_mul(p.pitch)).and_then(|o| o.checked_add(p.x)).ok_or(CuError::INVALID_VALUE)?;
    match side {
        Side::Host(p) => {
            let at = p.checked_add(off).filter(|&a| p != 0 && a.checked_add(len).is_some()).ok_or(CuError::INVALID_VALUE)?;
            Ok(Side::Host(at))
        }
        Side::Device(p) => {
            let at = p.checked_add(off as u64).ok_or(CuError::INVALID_VALUE)?;
            check_device(at, len as u64)?;
            Ok(Side::Device(at))
        }
    }
}

/// One side's parameters as CUDA_MEMCPY3D spells them.
struct SideParams {
    ty: CUmemorytype,
    host: usize,
    dev: u64,
    x: usize,
    y: usize,
    z: usize,
    lod: usize,
    pitch: usize,
    slice_rows: usize,
}

impl Copy3 {
    /// Validates a copy; `is_device` says whether a unified address is device
    /// memory, `check_device` whether a device range lies in allocations.
    /// None: nothing to copy.
    fn new(src: SideParams, dst: SideParams, (width, height, depth): (usize, usize, usize), is_device: &dyn Fn(u64) -> bool, check_device: &dyn Fn(u64, u64) -> CuResult<()>) -> CuResult<Option<Copy3>> {
        if src.lod != 0 || dst.lod != 0 {
            return Err(CuError::INVALID_VALUE);
        }
        let sb = base(&src, is_device)?;
        let db = base(&dst, is_device)?;
        if width == 0 || height == 0 || depth == 0 {
            return Ok(None);
        }
        let plane = |b: Side, p: &SideParams| -> CuResult<Plane> {
            let len = span(p.pitch, p.slice_rows, width, height, depth)?;
            let at = place(b, p, len, check_device)?;
            Ok(Plane { at, pitch: p.pitch, slice_rows: p.slice_rows })
        };
        Ok(Some(Copy3 { src: plane(sb, &src)?, dst: plane(db, &dst)?, width, height, depth }))
    }

    /// Whether a side's rows of one slice are back to back.
    fn dense(&self, p: &Plane) -> bool {
        self.height == 1 || p.pitch == self.width
    }

    /// Runs the copy, slice by slice.
    unsafe fn run(&self, rt: &Runtime, stream: u64) -> CuResult<()> {
        for z in 0..self.depth {
            let (s, d) = (self.src.row(0, z), self.dst.row(0, z));
            match (self.src.at, self.dst.at) {
                (Side::Device(sp), Side::Host(dp)) => self.dtoh_slice(rt, sp + s as u64, dp + d, stream)?,
                (Side::Host(sp), Side::Device(dp)) => self.htod_slice(rt, sp + s, dp + d as u64, stream)?,
                (Side::Device(sp), Side::Device(dp)) => self.dtod_slice(rt, sp + s as u64, dp + d as u64, stream)?,
                (Side::Host(sp), Side::Host(dp)) => self.htoh_slice(rt, sp + s, dp + d)?,
            }
        }
        Ok(())
    }

    /// Device rows read in groups of at most [`GROUP`] bytes and spread
    /// over the host rows; rows far apart (pitch over four widths) are
    /// read one by one, so a wide pitch never reads what is not copied.
    unsafe fn dtoh_slice(&self, rt: &Runtime, src: u64, dst: usize, stream: u64) -> CuResult<()> {
        let (w, h) = (self.width, self.height);
        let (sp, dp) = (self.src.pitch, self.dst.pitch);
        if self.dense(&self.src) && self.dense(&self.dst) {
            return dtoh(rt, dst as *mut c_void, src, w * h, stream);
        }
        if sp > 4 * w {
            for r in 0..h {
                dtoh(rt, (dst + r * dp) as *mut c_void, src + (r * sp) as u64, w, stream)?;
            }
            return Ok(());
        }
        let dspan = (h - 1) * dp + w;
        let into_managed = managed::before_host_access(rt, dst as u64, dspan as u64)?;
        let per_group = (GROUP / sp.max(1)).max(1);
        let mut tmp = Vec::new();
        let mut r0 = 0;
        while r0 < h {
            let k = per_group.min(h - r0);
            let len = (k - 1) * sp + w;
            tmp.resize(len, 0u8);
            dtoh(rt, tmp.as_mut_ptr() as *mut c_void, src + (r0 * sp) as u64, len, stream)?;
            for r in 0..k {
                std::ptr::copy_nonoverlapping(tmp.as_ptr().add(r * sp), (dst + (r0 + r) * dp) as *mut u8, w);
            }
            r0 += k;
        }
        if into_managed {
            managed::host_wrote(dst as u64, dspan as u64);
        }
        Ok(())
    }

    /// Into back-to-back device rows, host rows are gathered into groups of
    /// at most [`GROUP`] bytes (sent as one copy each); otherwise each row is
    /// its own copy. Either way nothing waits for the device.
    unsafe fn htod_slice(&self, rt: &Runtime, src: usize, dst: u64, stream: u64) -> CuResult<()> {
        let (w, h) = (self.width, self.height);
        let (sp, dp) = (self.src.pitch, self.dst.pitch);
        if !self.dense(&self.dst) {
            for r in 0..h {
                htod(rt, dst + (r * dp) as u64, (src + r * sp) as *const c_void, w, stream)?;
            }
            return Ok(());
        }
        if self.dense(&self.src) {
            return htod(rt, dst, src as *const c_void, w * h, stream);
        }
        managed::before_host_access(rt, src as u64, ((h - 1) * sp + w) as u64)?;
        let per_group = (GROUP / w).max(1);
        let mut tmp = Vec::new();
        let mut r0 = 0;
        while r0 < h {
            let k = per_group.min(h - r0);
            tmp.clear();
            for r in r0..r0 + k {
                tmp.extend_from_slice(std::slice::from_raw_parts((src + r * sp) as *const u8, w));
            }
            htod(rt, dst + (r0 * w) as u64, tmp.as_ptr() as *const c_void, tmp.len(), stream)?;
            r0 += k;
        }
        Ok(())
    }

    unsafe fn dtod_slice(&self, rt: &Runtime, src: u64, dst: u64, stream: u64) -> CuResult<()> {
        let (w, h) = (self.width, self.height);
        if self.dense(&self.src) && self.dense(&self.dst) {
            return dtod(rt, dst, src, w * h, stream);
        }
        for r in 0..h {
            dtod(rt, dst + (r * self.dst.pitch) as u64, src + (r * self.src.pitch) as u64, w, stream)?;
        }
        Ok(())
    }

    unsafe fn htoh_slice(&self, rt: &Runtime, src: usize, dst: usize) -> CuResult<()> {
        let (w, h) = (self.width, self.height);
        let (sp, dp) = (self.src.pitch, self.dst.pitch);
        managed::before_host_access(rt, src as u64, ((h - 1) * sp + w) as u64)?;
        let into_managed = managed::before_host_access(rt, dst as u64, ((h - 1) * dp + w) as u64)?;
        for r in 0..h {
            std::ptr::copy((src + r * sp) as *const u8, (dst + r * dp) as *mut u8, w);
        }
        if into_managed {
            managed::host_wrote(dst as u64, ((h - 1) * dp + w) as u64);
        }
        Ok(())
    }
}

fn is_device(p: u64) -> bool {
    objects().memory.find_alloc(p).is_some()
}

fn check_device(p: u64, len: u64) -> CuResult<()> {
    objects().memory.check_range(p, len).map(|_| ())
}

/// The two sides of a CUDA_MEMCPY3D or a CUDA_MEMCPY3D_PEER, which name them alike.
macro_rules! sides_3d {
    ($c:expr) => {
        (
            SideParams {
                ty: $c.srcMemoryType,
                host: $c.srcHost as usize,
                dev: $c.srcDevice,
                x: $c.srcXInBytes,
                y: $c.srcY,
                z: $c.srcZ,
                lod: $c.srcLOD,
                pitch: $c.srcPitch,
                slice_rows: $c.srcHeight,
            },
            SideParams {
                ty: $c.dstMemoryType,
                host: $c.dstHost as usize,
                dev: $c.dstDevice,
                x: $c.dstXInBytes,
                y: $c.dstY,
                z: $c.dstZ,
                lod: $c.dstLOD,
                pitch: $c.dstPitch,
                slice_rows: $c.dstHeight,
            },
        )
    };
}

impl Copy3 {
    /// A CUDA_MEMCPY2D's copy, checked; None: nothing to copy.
    pub(crate) fn from_2d(c: &CUDA_MEMCPY2D) -> CuResult<Option<Copy3>> {
        let side = |ty, host: *const c_void, dev, x, y, pitch| SideParams { ty, host: host as usize, dev, x, y, z: 0, lod: 0, pitch, slice_rows: 0 };
        let src = side(c.srcMemoryType, c.srcHost, c.srcDevice, c.srcXInBytes, c.srcY, c.srcPitch);
        let dst = side(c.dstMemoryType, c.dstHost as *const c_void, c.dstDevice, c.dstXInBytes, c.dstY, c.dstPitch);
        Copy3::new(src, dst, (c.WidthInBytes, c.Height, 1), &is_device, &check_device)
    }

    /// A CUDA_MEMCPY3D's copy, checked; None: nothing to copy.
    pub(crate) fn from_3d(c: &CUDA_MEMCPY3D) -> CuResult<Option<Copy3>> {
        if !c.reserved0.is_null() || !c.reserved1.is_null() {
            return Err(CuError::INVALID_VALUE);
        }
        let (src, dst) = sides_3d!(c);
        Copy3::new(src, dst, (c.WidthInBytes, c.Height, c.Depth), &is_device, &check_device)
    }

    /// A CUDA_MEMCPY3D_PEER's copy, checked; None: nothing to copy. The contexts are not
    /// needed: unified addresses say each side's device.
    pub(crate) fn from_3d_peer(c: &CUDA_MEMCPY3D_PEER) -> CuResult<Option<Copy3>> {
        let (src, dst) = sides_3d!(c);
        Copy3::new(src, dst, (c.WidthInBytes, c.Height, c.Depth), &is_device, &check_device)
    }

    /// The copy as a graph memcpy node, on the device of its device side (the destination's
    /// for device to device). Graphs do not copy between host buffers here, and a copy of more
    /// than [`MAX_RUNS`] separate rows is not made a node.
    pub(crate) fn node(&self) -> CuResult<Node> {
        let rows = Rows {
            height: self.height,
            depth: self.depth,
            src_pitch: self.src.pitch,
            src_rows: self.src.slice_rows,
            dst_pitch: self.dst.pitch,
            dst_rows: self.dst.slice_rows,
        };
        if rows.run_count(self.width) > MAX_RUNS {
            tracing::warn!("a graph memcpy node of more than {MAX_RUNS} separate rows is not supported by rgpu");
            return Err(CuError::NOT_SUPPORTED);
        }
        let device = |p: u64| objects().memory.check_range(p, 1);
        let (copy, device) = match (self.src.at, self.dst.at) {
            (Side::Host(src), Side::Device(dst)) => (Copy::HtoD { dst, src }, device(dst)?),
            (Side::Device(src), Side::Host(dst)) => (Copy::DtoH { dst, src }, device(src)?),
            (Side::Device(src), Side::Device(dst)) => (Copy::DtoD { dst, src }, device(dst)?),
            (Side::Host(_), Side::Host(_)) => {
                tracing::warn!("graph memcpy nodes between host buffers are not supported by rgpu");
                return Err(CuError::NOT_SUPPORTED);
            }
        };
        Ok(Node::Memcpy { copy, size: self.width, rows, device })
    }
}

/// Runs `copy` on `stream`, or records it as a node if the stream captures (an empty copy as
/// an empty node, keeping the stream's order).
unsafe fn copy_on(stream: u64, copy: impl Fn() -> CuResult<Option<Copy3>>) -> CuResult<()> {
    if capture::record(stream, || copy()?.map_or(Ok(Node::Empty), |c| c.node()))? {
        return Ok(());
    }
    match copy()? {
        Some(c) => c.run(runtime::get()?, stream),
        None => Ok(()),
    }
}

unsafe fn copy_2d(c: *const CUDA_MEMCPY2D, stream: u64) -> CuResult<()> {
    let c = c.as_ref().ok_or(CuError::INVALID_VALUE)?;
    copy_on(stream, || Copy3::from_2d(c))
}

unsafe fn copy_3d(c: *const CUDA_MEMCPY3D, stream: u64) -> CuResult<()> {
    let c = c.as_ref().ok_or(CuError::INVALID_VALUE)?;
    copy_on(stream, || Copy3::from_3d(c))
}

pub(crate) unsafe fn memcpy_2d_v2(c: *const CUDA_MEMCPY2D) -> CuResult<()> {
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    synchronous(rt, copy_2d(c, 0))
}
pub(crate) unsafe fn memcpy_2d_async_v2(c: *const CUDA_MEMCPY2D, s: CUstream) -> CuResult<()> {
    copy_2d(c, stream::remote(s)?)
}
pub(crate) unsafe fn memcpy_3d_v2(c: *const CUDA_MEMCPY3D) -> CuResult<()> {
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    synchronous(rt, copy_3d(c, 0))
}
pub(crate) unsafe fn memcpy_3d_async_v2(c: *const CUDA_MEMCPY3D, s: CUstream) -> CuResult<()> {
    copy_3d(c, stream::remote(s)?)
}

pub(crate) unsafe fn memcpy_3d_peer(c: *const CUDA_MEMCPY3D_PEER) -> CuResult<()> {
    capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    let c = c.as_ref().ok_or(CuError::INVALID_VALUE)?;
    synchronous(rt, copy_on(0, || Copy3::from_3d_peer(c)))
}
pub(crate) unsafe fn memcpy_3d_peer_async(c: *const CUDA_MEMCPY3D_PEER, s: CUstream) -> CuResult<()> {
    let stream = stream::remote(s)?;
    let c = c.as_ref().ok_or(CuError::INVALID_VALUE)?;
    copy_on(stream, || Copy3::from_3d_peer(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(p: usize, x: usize, y: usize, z: usize, pitch: usize, slice_rows: usize) -> SideParams {
        SideParams { ty: CUmemorytype::CU_MEMORYTYPE_HOST, host: p, dev: 0, x, y, z, lod: 0, pitch, slice_rows }
    }
    fn device(p: u64, x: usize, y: usize, z: usize, pitch: usize, slice_rows: usize) -> SideParams {
        SideParams { ty: CUmemorytype::CU_MEMORYTYPE_DEVICE, host: 0, dev: p, x, y, z, lod: 0, pitch, slice_rows }
    }
    /// One allocation: [0x1000, 0x1000 + 4096).
    fn in_alloc(p: u64, len: u64) -> CuResult<()> {
        let end = p.checked_add(len).ok_or(CuError::INVALID_VALUE)?;
        if p >= 0x1000 && end <= 0x2000 {
            Ok(())
        } else {
            Err(CuError::INVALID_VALUE)
        }
    }
    fn new(src: SideParams, dst: SideParams, w: usize, h: usize, d: usize) -> CuResult<Option<Copy3>> {
        Copy3::new(src, dst, (w, h, d), &|p| (0x1000..0x2000).contains(&p), &in_alloc)
    }

    #[test]
    fn offsets_pitches_and_slices_place_each_side() {
        let c = new(host(0x10_0000, 3, 2, 0, 64, 5), device(0x1000, 8, 1, 1, 128, 4), 16, 3, 2).unwrap().unwrap();
        assert_eq!(c.src.at, Side::Host(0x10_0000 + 2 * 64 + 3));
        // Slice 1 of 4 rows, row 1: (1 * 4 + 1) * 128 + 8.
        assert_eq!(c.dst.at, Side::Device(0x1000 + 5 * 128 + 8));
        assert_eq!(c.dst.row(2, 1), (4 + 2) * 128);
        assert_eq!(c.src.row(1, 1), (5 + 1) * 64);
    }

    #[test]
    fn hostile_pitches_and_offsets_are_invalid_values_before_any_byte_moves() {
        let bad = [
            // A pitch narrower than a row.
            new(host(0x10_0000, 0, 0, 0, 8, 0), device(0x1000, 0, 0, 0, 16, 0), 16, 2, 1),
            // Slices closer than their rows.
            new(host(0x10_0000, 0, 0, 0, 16, 1), device(0x1000, 0, 0, 0, 16, 2), 16, 2, 2),
            // Offsets whose products wrap.
            new(host(0x10_0000, 0, usize::MAX / 2, 0, 4, 0), device(0x1000, 0, 0, 0, 16, 0), 4, 1, 1),
            new(host(0x10_0000, 0, 0, 0, 16, 0), device(0x1000, usize::MAX, 0, 0, 16, 0), 4, 1, 1),
            new(host(0x10_0000, 0, 0, 0, usize::MAX, 0), device(0x1000, 0, 0, 0, 16, 0), 4, 2, 1),
            new(host(0x10_0000, 0, 0, 0, 16, 0), device(0x1000, 0, 0, usize::MAX, 16, 2), 4, 1, 2),
            // A pitch that reaches past the allocation on the last row only.
            new(host(0x10_0000, 0, 0, 0, 16, 0), device(0x1000, 0, 0, 0, 1024, 0), 16, 5, 1),
            // A span past the end of the address space on the host.
            new(host(usize::MAX - 8, 0, 0, 0, 16, 0), device(0x1000, 0, 0, 0, 16, 0), 16, 1, 1),
            // A null host pointer.
            new(host(0, 0, 0, 0, 16, 0), device(0x1000, 0, 0, 0, 16, 0), 16, 1, 1),
            // A level of detail (arrays only).
            new(SideParams { lod: 1, ..host(0x10_0000, 0, 0, 0, 16, 0) }, device(0x1000, 0, 0, 0, 16, 0), 16, 1, 1),
        ];
        for (i, r) in bad.into_iter().enumerate() {
            assert_eq!(r.unwrap_err(), CuError::INVALID_VALUE, "case {i}");
        }
        // The last row ends exactly at the allocation's end: fine.
        assert!(new(host(0x10_0000, 0, 0, 0, 16, 0), device(0x1000, 0, 0, 0, 1024, 0), 16, 4, 1).unwrap().is_some());
    }

    #[test]
    fn arrays_are_not_supported_and_empty_copies_do_nothing() {
        let array = SideParams { ty: CUmemorytype::CU_MEMORYTYPE_ARRAY, ..host(0x10_0000, 0, 0, 0, 16, 0) };
        assert_eq!(new(array, device(0x1000, 0, 0, 0, 16, 0), 16, 1, 1).unwrap_err(), CuError::NOT_SUPPORTED);
        assert_eq!(new(host(0x10_0000, 0, 0, 0, 16, 0), device(0x1000, 0, 0, 0, 16, 0), 0, 4, 1).unwrap(), None);
        assert_eq!(new(host(0x10_0000, 0, 0, 0, 16, 0), device(0x1000, 0, 0, 0, 16, 0), 16, 4, 0).unwrap(), None);
        // A unified address is device memory when it lies in an allocation.
        let unified = |p: u64| SideParams { ty: CUmemorytype::CU_MEMORYTYPE_UNIFIED, ..device(p, 0, 0, 0, 16, 0) };
        let c = new(unified(0x20_0000), unified(0x1800), 16, 1, 1).unwrap().unwrap();
        assert_eq!((c.src.at, c.dst.at), (Side::Host(0x20_0000), Side::Device(0x1800)));
    }
}
