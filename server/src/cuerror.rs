//! CUDA driver results as a Rust `Result` (house style item 4): success is
//! `Ok`, every failure a non-zero [`CuError`] that travels on the wire as the
//! `CUresult` number.

use std::fmt;
use std::num::NonZeroU32;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct CuError(NonZeroU32);

pub type CuResult<T = ()> = Result<T, CuError>;

macro_rules! codes {
    ($($name:ident = $v:literal),* $(,)?) => {
        impl CuError {
            $(pub const $name: CuError = CuError(match NonZeroU32::new($v) {
                Some(v) => v,
                None => panic!("zero is success, not an error"),
            });)*

            /// The `CUDA_ERROR_*` name of a known code.
            pub fn name(self) -> Option<&'static str> {
                match self.0.get() {
                    $($v => Some(concat!("CUDA_ERROR_", stringify!($name))),)*
                    _ => None,
                }
            }
        }
    };
}

codes! {
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_OUT_OF_RESOURCES = 701,
    LAUNCH_TIMEOUT = 702,
    MISALIGNED_ADDRESS = 716,
    LAUNCH_FAILED = 719,
    NOT_SUPPORTED = 801,
    UNKNOWN = 999,
}

impl CuError {
    pub fn code(self) -> u32 {
        self.0.get()
    }

    /// The error for a raw non-zero `CUresult`; `None` for 0 (success).
    pub fn from_code(code: u32) -> Option<CuError> {
        NonZeroU32::new(code).map(CuError)
    }
}

/// The wire form of a result: 0 for success.
pub fn code_of<T>(r: &CuResult<T>) -> u32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.code(),
    }
}

impl fmt::Debug for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n} ({})", self.0),
            None => write!(f, "CUresult {}", self.0),
        }
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for CuError {}
