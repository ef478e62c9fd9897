//! A session's snapshot as a server reads it: from a file (`rgpu restore`,
//! `--restore`) or from a live migration's intake stream (pre-copied
//! ranges, the list of stale ones, then the snapshot with delta records).
//! The input's first byte picks which (odd: a migration stream); the rest
//! is the stream. Whatever it holds is rebuilt on a sim session, which is
//! then dropped, freeing it.

use rgpu_server::backend::Backend;
use rgpu_server::checkpoint::{self, precopy, SnapshotError};
use rgpu_server::state::SessionState;

pub fn run(data: &[u8]) {
    crate::on_session_stack(|| snapshot(data));
}

fn snapshot(data: &[u8]) {
    let Some((&mode, mut r)) = data.split_first() else { return };
    let sim = crate::session::backend();
    let sizes: Vec<u64> = sim.devices().iter().map(|d| d.total_mem).collect();
    let staged = if mode & 1 == 1 {
        // As the intake does: a leased stream's ranges are charged to a budget of its limit.
        let mut open = |whose: Option<precopy::Whose>| {
            let budget = whose.and_then(|w| w.memory_limit).map(|l| std::sync::Arc::new(rgpu_server::backend::MemoryBudget::new(l)));
            sim.open_session(budget).map_err(|e| SnapshotError::Device(e, "opening a session"))
        };
        match precopy::receive(&mut r, &sizes, &mut open) {
            Ok(s) => s,
            Err(_) => return,
        }
    } else {
        None
    };
    let Ok(mut opened) = checkpoint::open(&mut r) else { return };
    let Ok(fresh) = sim.open_session(None) else { return };
    if opened.check_fits(sim.devices(), fresh.module_arch(0)).is_err() {
        return;
    }
    let backend = match staged {
        Some(s) => {
            if s.check_lease(opened.meta.admission.as_ref()).is_err() {
                return;
            }
            opened = opened.with_staged(s.ranges);
            s.backend
        }
        None => fresh,
    };
    let mut state = SessionState::new(backend, sizes.len() as u32).with_devices(sim.devices());
    let _ = opened.rebuild(&mut state);
}
