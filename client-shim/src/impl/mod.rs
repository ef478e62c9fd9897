//! Implementations of the driver API, one module per group (see
//! `rgpu_shim_macros` for the name -> `module::function` rule:
//! `cuMemAlloc_v2` is `memory::alloc_v2`).

pub mod context;
pub mod device;
pub mod driver;
pub mod event;
pub mod function;
pub mod graph;
pub mod ipc;
pub mod kernel;
pub mod launch;
pub mod library;
pub mod link;
pub mod managed;
pub mod memory;
pub mod module;
pub mod occupancy;
pub mod pointer;
pub mod primary_context;
pub mod profiler;
pub mod stream;
pub mod vmm;
