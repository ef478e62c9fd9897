//! The bodies of rgpu's fuzz targets, one module per target. Each `run`
//! takes any bytes and must return without panicking, aborting, or running
//! away in time or memory, whatever they are: that is what the servers
//! promise for input off the wire. `fuzz/` calls them under libFuzzer
//! (nightly, `cargo fuzz run NAME`); `tests/corpus.rs` feeds them the
//! committed seed corpus (`fuzz/corpus/NAME/`) on stable, so every input
//! that once crashed one stays checked by `cargo test`.
//!
//! Parsers that the server runs on a session thread run here on a thread
//! with the same stack (`on_session_stack`): a recursion that fits the
//! fuzzer's main thread may still overflow a session's.

pub mod capnp_msg;
pub mod frame;
pub mod module;
pub mod ptx;
pub mod session;
pub mod snapshot;
pub mod token;

/// The targets by name, as `fuzz/fuzz_targets/NAME.rs` and
/// `fuzz/corpus/NAME/` name them.
pub const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("frame", frame::run),
    ("capnp_msg", capnp_msg::run),
    ("module", module::run),
    ("ptx", ptx::run),
    ("session", session::run),
    ("snapshot", snapshot::run),
    ("token", token::run),
];

/// Stack of a session thread: `std::thread::Builder`'s default, which
/// `server/src/listener.rs` keeps.
pub const SESSION_STACK: usize = 2 << 20;

/// Runs `f` on a thread with a session's stack; a panic there is re-raised
/// here, so the fuzzer sees it.
pub fn on_session_stack<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        let t = std::thread::Builder::new()
            .stack_size(SESSION_STACK)
            .spawn_scoped(s, f)
            .expect("spawn a session-sized thread");
        match t.join() {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}
