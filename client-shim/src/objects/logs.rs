//! Log callbacks (cuLogsRegisterCallback): the driver's messages for the program. rgpu's are
//! the warnings a program would otherwise only see on stderr: a driver function rgpu does not
//! offer (named once), and a kernel its server cannot run.

use std::ffi::c_void;
use std::sync::Mutex;

use rgpu_cuda_types::*;

struct Entry {
    handle: usize,
    callback: unsafe extern "C" fn(*mut c_void, CUlogLevel, *mut std::ffi::c_char, usize),
    user_data: usize,
}

#[derive(Default)]
pub struct Callbacks {
    entries: Mutex<Vec<Entry>>,
    next: std::sync::atomic::AtomicUsize,
}

/// Handles are tagged counters, never pointers to anything.
const HANDLE_TAG: usize = 0x106 << 40;

impl Callbacks {
    pub fn register(&self, callback: CUlogsCallback, user_data: *mut c_void) -> CuResult<CUlogsCallbackHandle> {
        let callback = callback.ok_or(CuError::INVALID_VALUE)?;
        let handle = HANDLE_TAG | (1 + self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        self.lock().push(Entry { handle, callback, user_data: user_data as usize });
        Ok(handle as CUlogsCallbackHandle)
    }

    pub fn unregister(&self, handle: CUlogsCallbackHandle) -> CuResult<()> {
        let mut e = self.lock();
        let before = e.len();
        e.retain(|x| x.handle != handle as usize);
        if e.len() == before {
            return Err(CuError::INVALID_VALUE);
        }
        Ok(())
    }

    /// Hands `message` to every registered callback.
    pub fn deliver(&self, level: CUlogLevel, message: &str) {
        // Called outside the lock: a callback may register or unregister.
        let targets: Vec<(unsafe extern "C" fn(*mut c_void, CUlogLevel, *mut std::ffi::c_char, usize), usize)> =
            self.lock().iter().map(|e| (e.callback, e.user_data)).collect();
        if targets.is_empty() {
            return;
        }
        let mut text = message.as_bytes().to_vec();
        text.push(0);
        for (cb, data) in targets {
            // SAFETY: a callback the program registered for exactly this call; the message is
            // NUL-terminated and lives for the call, its length excluding the NUL.
            unsafe { cb(data as *mut c_void, level, text.as_mut_ptr() as *mut std::ffi::c_char, text.len() - 1) };
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}
