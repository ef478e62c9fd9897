//! The CUDA driver's types as every part of rgpu sees them: the shim (which is the driver to
//! the program), the server (which answers with driver results) and the cli (which loads a
//! driver to run checks).
//!
//! `types.rs` is generated from `cuda.h` by `tools/rgpu-bindgen` and committed ("DO NOT EDIT");
//! this file adds what is rgpu's own: the wire form of a result and the tags of the handles the
//! shim mints.

#[allow(clippy::all)]
mod types;
pub use types::*;

impl CuError {
    /// The error for a raw non-zero `CUresult`; `None` for 0 (success).
    pub const fn from_code(code: u32) -> Option<CuError> {
        match ::std::num::NonZeroU32::new(code) {
            Some(c) => Some(CuError(c)),
            None => None,
        }
    }

    /// The error for a `CUresult` a peer sent as a failure. 0 cannot be a failure: a peer that
    /// says so is confused, and the caller gets `CUDA_ERROR_UNKNOWN` rather than a success.
    pub const fn from_failure_code(code: u32) -> CuError {
        match CuError::from_code(code) {
            Some(e) => e,
            None => CuError::UNKNOWN,
        }
    }
}

/// The wire form of a result: 0 for success, else the `CUresult` number.
pub fn code_of<T>(r: &CuResult<T>) -> u32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.code(),
    }
}

/// Passed by value to cuMemPrefetchAsync_v2 and cuMemAdvise_v2, so the shim's call log
/// prints it; the union is an int in every variant.
impl std::fmt::Debug for types::CUmemLocation_st {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: every member of the union is plain data of the same size or smaller.
        let id = unsafe { self.__bindgen_anon_1.id };
        write!(f, "CUmemLocation {{ type: {}, id: {id} }}", self.type_.0)
    }
}

/// The tag in bits 48..64 of each kind of handle the shim mints (`tag << 48 | id`), so that a
/// handle of one kind passed where another is expected is refused, never misread. Tools that
/// print handles (the cli) decode them with the same table.
pub mod tag {
    pub const CONTEXT: u16 = 0xC7;
    pub const STREAM: u16 = 0x57;
    pub const EVENT: u16 = 0xE7;
    pub const MODULE: u16 = 0x3D;
    pub const FUNCTION: u16 = 0xF7;
    pub const LIBRARY: u16 = 0x1B;
    pub const KERNEL: u16 = 0x4E;
    pub const MEMPOOL: u16 = 0x9A;
    pub const LINK: u16 = 0x11;
    /// A physical allocation of the virtual memory management API (cuMemCreate).
    pub const MEM_HANDLE: u16 = 0x6A;
    pub const GRAPH: u16 = 0x7A;
    pub const GRAPH_NODE: u16 = 0x7B;
    pub const GRAPH_EXEC: u16 = 0x7C;
    pub const USER_OBJECT: u16 = 0x7D;

    /// Where the tag sits in a handle.
    pub const SHIFT: u32 = 48;

    /// The tag of a handle value.
    pub const fn of(handle: u64) -> u16 {
        (handle >> SHIFT) as u16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        assert_eq!(CuError::from_code(0), None);
        assert_eq!(CuError::from_code(801), Some(CuError::NOT_SUPPORTED));
        assert_eq!(CuError::from_failure_code(0), CuError::UNKNOWN);
        assert_eq!(code_of(&Ok::<_, CuError>(5)), 0);
        assert_eq!(code_of::<()>(&Err(CuError::ILLEGAL_ADDRESS)), 700);
        assert_eq!(format!("{:?}", CuError::INVALID_VALUE), "CUDA_ERROR_INVALID_VALUE");
        assert_eq!(format!("{:?}", CuError::from_failure_code(123_456)), "CUresult(123456)");
    }

    #[test]
    fn tags_are_distinct_and_decodable() {
        let all = [tag::CONTEXT, tag::STREAM, tag::EVENT, tag::MODULE, tag::FUNCTION, tag::LIBRARY, tag::KERNEL, tag::MEMPOOL, tag::LINK, tag::MEM_HANDLE];
        let set: std::collections::BTreeSet<u16> = all.iter().copied().collect();
        assert_eq!(set.len(), all.len());
        assert_eq!(tag::of((tag::STREAM as u64) << tag::SHIFT | 42), tag::STREAM);
    }
}
