//! Implementations of the driver API, one module per group (see `rgpu_shim_macros` for the
//! name -> `module::function` rule).

pub mod driver;
