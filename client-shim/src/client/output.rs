//! Device `printf` output: the server sends what kernels printed with the
//! next reply (`Reply.output`), and it is written here to the program's own
//! stdout.
//!
//! It goes through C's `stdout` stream rather than straight to fd 1, as
//! NVIDIA's driver does, so that it stays in order with what the program
//! itself printed before the synchronising call that brought it, even when
//! stdout is a buffered pipe.

use rgpu_protocol::data_capnp::reply;

extern "C" {
    /// glibc's `FILE *stdout`.
    static mut stdout: *mut libc::FILE;
}

/// Writes the reply's kernel output, if any, to the program's stdout.
pub fn write_reply_output(r: &reply::Reader<'_>) {
    if !r.has_output() {
        return;
    }
    let Ok(bytes) = r.get_output() else { return };
    if bytes.is_empty() {
        return;
    }
    // SAFETY: reading the `stdout` pointer glibc initialises before main;
    // fwrite locks the stream itself, so concurrent application printing is fine.
    unsafe {
        let out = std::ptr::addr_of!(stdout).read();
        if !out.is_null() {
            libc::fwrite(bytes.as_ptr() as *const libc::c_void, 1, bytes.len(), out);
        }
    }
}
