//! Test support: what a piece of code logs, captured through a subscriber scoped to the
//! calling thread.
//!
//! Tests run on many threads at once, and tracing caches each callsite's interest globally
//! when the callsite is first hit. A callsite first hit on a thread with no subscriber was
//! cached as uninteresting, racing with another thread's scoped subscriber, so a captured log
//! could miss a line or a span under load. A process-wide subscriber that takes everything
//! (and writes nowhere) keeps every callsite interesting; each capture then sees what its
//! own thread logs.

use std::sync::{Arc, Mutex, Once};

#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with this thread's log captured at trace level; returns its result and the log.
pub(crate) fn captured<R>(f: impl FnOnce() -> R) -> (R, String) {
    static GLOBAL: Once = Once::new();
    GLOBAL.call_once(|| {
        let sink = tracing_subscriber::fmt().with_writer(std::io::sink).with_max_level(tracing::Level::TRACE).finish();
        // Another test binary's harness may have set one; either way every callsite is live.
        let _ = tracing::subscriber::set_global_default(sink);
    });
    let buf = Buffer::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .finish();
    let r = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    (r, text)
}
