//! PTX for rgpu's simulated GPU: a parser, a lowering to a pre-decoded
//! form, and an interpreter that runs a grid with CUDA's semantics.
//!
//! ```text
//! Module::parse(text)          PTX text -> AST (errors name line and token)
//! module.lower(kernel, addr)   AST -> Program (device functions inlined,
//!                              symbols resolved; unknown instructions refused)
//! launch(&program, cfg, params, &memory)
//!                              runs every block (in parallel) over memory
//!                              the caller provides through GlobalMemory
//! ```
//!
//! The crate knows nothing of the server: device memory is reached through
//! the [`GlobalMemory`] trait, and faults come back as [`ExecError`] for the
//! caller to map to CUDA errors.

pub mod exec;
mod fault;
pub mod float;
pub mod ir;
mod lower;
pub mod parse;
mod printf;
mod reconverge;
pub mod testing;

pub use exec::{launch, Compiled, launch_cancellable, launch_cooperative, launch_gated, BlockGate, ExecError, Fault, GlobalMemory, LaunchConfig, LaunchOutput, Region};
pub use ir::Program;

use std::sync::atomic::AtomicU64;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PtxError {
    #[error("PTX line {line}: {msg}")]
    Parse { line: u32, msg: String },
    #[error("PTX line {line}: the rgpu PTX interpreter does not support `{what}`")]
    Unsupported { line: u32, what: String },
    /// Past one of the parser's or the lowering's bounds (nesting, inlined
    /// size): what a driver's PTX compiler refuses too, so the module is.
    #[error("PTX line {line}: {msg}")]
    TooComplex { line: u32, msg: String },
    #[error("no kernel named {0} in the PTX")]
    NoKernel(String),
}

/// A parsed PTX module.
#[derive(Debug, Clone)]
pub struct Module {
    ast: parse::Ast,
}

impl Module {
    pub fn parse(text: &str) -> Result<Module, PtxError> {
        Ok(Module { ast: parse::parse(text)? })
    }

    /// Names of the kernels (`.entry` with a body), in order.
    pub fn kernels(&self) -> Vec<String> {
        self.ast.funcs.iter().filter(|f| f.entry && f.body.is_some()).map(|f| f.name.clone()).collect()
    }

    /// Lowers one kernel. `global_addr` gives the device address of each
    /// module-scope `.global`/`.const` variable by name.
    pub fn lower(&self, kernel: &str, global_addr: &dyn Fn(&str) -> Option<u64>) -> Result<Program, PtxError> {
        self.lower_within(kernel, global_addr, MAX_KERNEL_INSTS)
    }

    /// As [`Module::lower`], refusing (`Unsupported`) a kernel that lowers
    /// to more than `max_insts` instructions (device functions are inlined
    /// per call, so a short text can ask for exponentially many).
    pub fn lower_within(
        &self,
        kernel: &str,
        global_addr: &dyn Fn(&str) -> Option<u64>,
        max_insts: usize,
    ) -> Result<Program, PtxError> {
        lower::Lowerer::new(&self.ast, global_addr, max_insts).lower_kernel(kernel)
    }
}

/// Most instructions one kernel lowers to by default.
pub const MAX_KERNEL_INSTS: usize = 1 << 22;

impl Module {
    /// Instructions of `p` in memory, for callers that bound what they keep.
    pub fn program_bytes(p: &Program) -> usize {
        p.insts.len() * std::mem::size_of::<ir::Inst>() + p.compiled.bytes()
    }
}

/// Device memory in a host buffer: for tests and benchmarks of the
/// interpreter without a server. Allocations are spaced apart so that an
/// access just past one faults.
pub struct HostMemory {
    base: u64,
    words: Vec<AtomicU64>,
    allocs: Vec<(u64, u64)>,
    next: u64,
}

impl HostMemory {
    /// `size` bytes of device memory starting at device address `base`.
    pub fn new(base: u64, size: u64) -> Self {
        let words = (0..size.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        HostMemory { base, words, allocs: Vec::new(), next: 0 }
    }

    /// Reserves `len` bytes; `None` when full.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let off = self.next;
        let end = off.checked_add(len)?;
        if end > self.words.len() as u64 * 8 {
            return None;
        }
        self.next = (end + 256).div_ceil(256) * 256;
        self.allocs.push((self.base + off, len));
        Some(self.base + off)
    }

    fn host(&self) -> *mut u8 {
        self.words.as_ptr() as *mut u8
    }

    fn check(&self, addr: u64, len: usize) -> Option<usize> {
        let off = addr.checked_sub(self.base)? as usize;
        (off + len <= self.words.len() * 8).then_some(off)
    }

    /// Copies `data` to `addr` (must lie inside the buffer).
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        let Some(off) = self.check(addr, data.len()) else { return false };
        // SAFETY: in bounds; the words are atomics, so writing through a
        // shared reference is allowed, and no launch runs concurrently
        // with this &self call on the same bytes in the tests that use it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.host().add(off), data.len()) };
        true
    }

    /// Every byte of the buffer (to compare two launches' effects).
    pub fn snapshot(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.words.len() * 8];
        // SAFETY: the whole buffer, as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(self.host(), v.as_mut_ptr(), v.len()) };
        v
    }

    /// Puts back what [`HostMemory::snapshot`] returned (a shorter slice: its bytes only).
    pub fn restore(&self, bytes: &[u8]) {
        let n = bytes.len().min(self.words.len() * 8);
        // SAFETY: in bounds, as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.host(), n) };
    }

    pub fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let off = self.check(addr, len)?;
        let mut v = vec![0u8; len];
        // SAFETY: in bounds, as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(self.host().add(off), v.as_mut_ptr(), len) };
        Some(v)
    }
}

// SAFETY: regions lie inside `words`, which lives as long as `self` and
// is only accessed atomically by the interpreter.
unsafe impl GlobalMemory for HostMemory {
    fn region(&self, addr: u64) -> Option<Region> {
        let &(start, len) = self.allocs.iter().find(|(s, l)| addr >= *s && addr - *s < *l)?;
        // SAFETY: start - base is inside the buffer (alloc checked it).
        Some(Region { start, len, host: unsafe { self.host().add((start - self.base) as usize) } })
    }
}

#[cfg(test)]
mod tests;
