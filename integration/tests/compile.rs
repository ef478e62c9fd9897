//! Every CUDA program builds in every variant (needs only the toolchain; the
//! driver-API programs also need the shim's libcuda.so to link against).
//! This also fills the build cache for the other tests.

use rgpu_integration::*;

const RUNTIME_PROGRAMS: &[&str] = &[
    "rt_device",
    "rt_memory",
    "rt_copy",
    "rt_memset",
    "rt_stream",
    "rt_event",
    "rt_pinned",
    "rt_pageable",
    "rt_newer_ptx",
    "rt_host_func",
    "rt_mempool",
    "rt_managed",
    "rt_graph",
    "rt_launch_ex",
    "rt_globals",
    "rt_funcattr",
    "rt_launch",
    "rt_kernels",
    "rt_errors",
    "rt_backpressure",
    "rt_two_devices",
    "rt_killed",
    "rt_reconnect",
    "rt_async_device",
    "rt_tensor_core",
    "rt_async_copy",
    "rt_tls_canary",
    "rt_cooperative",
    "rt_checkpoint",
    "rt_ipc",
    "rt_graph_nodes",
    "rt_per_thread",
    "rt_managed_vars",
    "rt_managed_attach",
    "rt_busy",
    "rt_pitched",
];

/// Every `rt_*.cu` in integration/cuda is listed above (so none is forgotten).
#[test]
fn every_runtime_program_is_listed() {
    for e in std::fs::read_dir(cuda_src_dir()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if let Some(p) = name.strip_suffix(".cu").filter(|p| p.starts_with("rt_")) {
            assert!(RUNTIME_PROGRAMS.contains(&p), "{p} is not in RUNTIME_PROGRAMS");
        }
    }
}

fn build_all(variant: Variant) {
    // Two threads: `build` itself limits nvcc to two at a time.
    let progs: Vec<&str> = RUNTIME_PROGRAMS.to_vec();
    std::thread::scope(|s| {
        for half in progs.chunks(progs.len().div_ceil(2)) {
            s.spawn(move || {
                for p in half {
                    let exe = build(p, variant);
                    assert!(exe.exists());
                }
            });
        }
    });
}

#[test]
fn runtime_programs_cudart13_shared() {
    build_all(Variant::Cudart13Shared);
}

#[test]
fn runtime_programs_cudart13_static() {
    build_all(Variant::Cudart13Static);
}

#[test]
fn runtime_programs_cudart12_shared() {
    build_all(Variant::Cudart12Shared);
}

#[test]
fn driver_programs() {
    for p in ["drv_api", "drv_module", "drv_graph"] {
        assert!(build(p, Variant::Driver).exists());
    }
}
