//! The CONTEXT_LOCAL_STORAGE export table: cudart keeps its per-context state
//! in the driver. The store (and the destructors run at context teardown) is
//! `objects::cls`.

use std::ffi::c_void;

use crate::cuda::types::*;
use crate::objects::cls::Dtor;
use crate::objects::{context, objects};

fn ctx_handle(ctx: CUcontext) -> CuResult<u64> {
    Ok(context::resolve(ctx)?.0)
}

pub(super) unsafe extern "C" fn put(ctx: CUcontext, key: *mut c_void, value: *mut c_void, dtor: Dtor) -> CUresult {
    crate::entry::call("CONTEXT_LOCAL_STORAGE[0]", &[], || {
        objects().cls.put(ctx_handle(ctx)?, key as usize, value as usize, dtor);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn delete(ctx: CUcontext, key: *mut c_void) -> CUresult {
    crate::entry::call("CONTEXT_LOCAL_STORAGE[1]", &[], || {
        objects().cls.delete(ctx_handle(ctx)?, key as usize);
        Ok(())
    })
}

pub(super) unsafe extern "C" fn get(value: *mut *mut c_void, ctx: CUcontext, key: *mut c_void) -> CUresult {
    crate::entry::call("CONTEXT_LOCAL_STORAGE[2]", &[], || {
        let value = value.as_mut().ok_or(CuError::INVALID_VALUE)?;
        *value = objects().cls.get(ctx_handle(ctx)?, key as usize).ok_or(CuError::INVALID_HANDLE)? as *mut c_void;
        Ok(())
    })
}
