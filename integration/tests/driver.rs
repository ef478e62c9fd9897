//! Driver-API programs (integration/cuda/drv_*.cu), linked with `-lcuda`
//! against the shim's libcuda.so and run through `rgpu run`.

use rgpu_integration::*;

#[test]
fn drv_api() {
    run_program("drv_api", Variant::Driver, &[]);
}

/// cuModuleLoadData with an `nvcc -fatbin` image and with PTX text, both
/// embedded in the program; globals, functions, attributes, launch.
#[test]
fn drv_module() {
    run_program("drv_module", Variant::Driver, &launch_args());
}

/// Virtual memory management: reserve, create, map end to end, access, copies and kernels
/// across the boundary, aliases, release/unmap order, errors, a fault without access.
#[test]
fn drv_vmm() {
    run_program("drv_vmm", Variant::Driver, &[]);
}

/// A graph built by hand (memset, kernel, memcpy, host and event nodes with
/// dependencies), its queries, a cycle refused, clone and child graph.
#[test]
fn drv_graph() {
    run_program("drv_graph", Variant::Driver, &[]);
}
