//! A memcpy slowdown that halves TLS bulk on some CPUs, found and avoided.
//!
//! glibc's `memcpy` copies blocks from a few KiB up with `rep movsb` on CPUs
//! that advertise fast string moves. On AMD Zen 4 (this project's machines,
//! glibc 2.36) that instruction runs at 2-3 GB/s instead of 45-55 GB/s when
//! the destination lies 1-15 bytes past the source modulo 4 KiB. rustls
//! copies every received record's plaintext out of its buffer at an offset
//! of 5 (the record header), into a buffer the allocator hands back at the
//! same address record after record, so a connection either never meets the
//! slow case or meets it on every record: TLS bulk measured 1.0-1.3 GiB/s
//! in some runs and 1.9-2.3 GiB/s in others, on the same build.
//! (`cargo bench -p rgpu-transport --bench tls_bulk`; docs/performance.md.)
//!
//! glibc has a switch for it: the tunable `glibc.cpu.x86_rep_movsb_threshold`,
//! read once at process start, above which size `rep movsb` is used. Set
//! past any copy's size, glibc copies with vector loops at every alignment.
//! [`reexec_if_slow`] measures the slow case at the start of an rgpu binary
//! (about a millisecond), and where it is real, restarts the binary with the
//! tunable set; children (servers `rgpu demo` starts, programs `rgpu run`
//! starts, with the shim in them) inherit it. A program run without `rgpu
//! run` gets a one-time hint from the shim ([`hint_if_slow`]).
//! `RGPU_MEMCPY_PROBE=off` turns all of it off.

/// The tunable and the value set: one gigabyte, above glibc's stop threshold
/// for `rep movsb`, so the instruction is never chosen.
pub const TUNABLE: &str = "glibc.cpu.x86_rep_movsb_threshold";
const VALUE: &str = "1073741824";
/// Set in the restarted process: the check was made (so a glibc that ignores
/// the tunable cannot make a binary restart itself again and again).
const PROBED_ENV: &str = "RGPU_MEMCPY_PROBED";
/// `off`: no probe, no restart, no hint.
pub const PROBE_ENV: &str = "RGPU_MEMCPY_PROBE";

/// Bytes per probe copy: a TLS record's plaintext.
const LEN: usize = 16 << 10;

/// Nanoseconds of the fastest of `reps` copies of [`LEN`] bytes whose
/// destination lies `delta` bytes past the source modulo 4 KiB.
fn fastest_copy_ns(buf: &mut [u8], delta: usize, reps: u32) -> u64 {
    let base = buf.as_mut_ptr() as usize;
    let src = (4096 - base % 4096) % 4096;
    // Five pages past the source: no overlap, same offset within a page.
    let dst = src + LEN + 4096 + delta;
    assert!(dst + LEN <= buf.len());
    let mut best = u64::MAX;
    for _ in 0..reps {
        let (head, tail) = buf.split_at_mut(dst);
        let from = std::hint::black_box(&head[src..src + LEN]);
        let t = std::time::Instant::now();
        tail[..LEN].copy_from_slice(from);
        std::hint::black_box(&mut tail[..LEN]);
        best = best.min(t.elapsed().as_nanos() as u64);
    }
    best
}

/// Times copies whose alignment meets the slow case against ones that do
/// not: (slow case, reference) in nanoseconds, the fastest of several each.
pub fn measure() -> (u64, u64) {
    let mut buf = vec![1u8; LEN * 2 + 3 * 4096];
    // Two warm-up passes: pages faulted in, caches and frequency settled.
    for _ in 0..2 {
        fastest_copy_ns(&mut buf, 64, 8);
        fastest_copy_ns(&mut buf, 5, 8);
    }
    let slow = [1, 5, 11].iter().map(|&d| fastest_copy_ns(&mut buf, d, 16)).max().unwrap_or(0);
    let reference = [0, 64, 320].iter().map(|&d| fastest_copy_ns(&mut buf, d, 16)).max().unwrap_or(0);
    (slow, reference)
}

/// Whether this process copies at some alignments four times slower (or
/// worse) than at others: the case above. Measured, not assumed from the
/// CPU's name, so a glibc that already avoids it costs nothing.
pub fn copies_are_slow() -> bool {
    let (slow, reference) = measure();
    slow > reference.max(1) * 4
}

fn enabled() -> bool {
    cfg!(all(target_os = "linux", target_env = "gnu", target_arch = "x86_64"))
        && std::env::var(PROBE_ENV).map_or(true, |v| v != "off")
}

fn tunable_set() -> bool {
    std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains(TUNABLE))
}

/// `GLIBC_TUNABLES` with the tunable added to what is there.
fn tunables_with_fix() -> String {
    match std::env::var("GLIBC_TUNABLES") {
        Ok(t) if !t.is_empty() => format!("{t}:{TUNABLE}={VALUE}"),
        _ => format!("{TUNABLE}={VALUE}"),
    }
}

/// Call first in `main`, before any thread starts: if this process meets the
/// slow case and the tunable is not set, restarts the binary (same pid,
/// arguments and environment, the tunable added). Returns when there is
/// nothing to do or the restart failed (the binary then runs as it is).
pub fn reexec_if_slow() {
    if !enabled() || tunable_set() || std::env::var_os(PROBED_ENV).is_some() || !copies_are_slow() {
        return;
    }
    use std::os::unix::process::CommandExt;
    let Ok(exe) = std::env::current_exe() else { return };
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| exe.clone().into_os_string());
    let err = std::process::Command::new(&exe)
        .arg0(arg0)
        .args(args)
        .env("GLIBC_TUNABLES", tunables_with_fix())
        .env(PROBED_ENV, "1")
        .exec();
    // Nothing logs yet this early; the binary goes on without the fix.
    eprintln!("rgpu: could not restart {} with {TUNABLE} set ({err}); going on without it", exe.display());
}

/// For a process rgpu did not start (the shim in a program run without
/// `rgpu run`): says once, at info level, how to avoid the slow case when
/// this process meets it. Costs the probe (about a millisecond) once.
pub fn hint_if_slow() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if enabled() && !tunable_set() && copies_are_slow() {
            tracing::info!(
                "memcpy here is slow at some alignments (glibc's rep movsb on this CPU), which halves TLS bulk \
                 copies; run the program with `rgpu run`, or with GLIBC_TUNABLES={}, to avoid it",
                tunables_with_fix()
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_copies_the_bytes_it_times() {
        let mut buf: Vec<u8> = (0..LEN * 2 + 3 * 4096).map(|i| (i * 7 + 3) as u8).collect();
        let base = buf.as_ptr() as usize;
        let src = (4096 - base % 4096) % 4096;
        let want: Vec<u8> = buf[src..src + LEN].to_vec();
        fastest_copy_ns(&mut buf, 5, 1);
        let dst = src + LEN + 4096 + 5;
        assert_eq!((dst + base) % 4096, (src + base + 5) % 4096, "the destination's page offset is 5 past the source's");
        assert!(buf[dst..dst + LEN] == want[..], "the probe must copy what it times");
    }

    #[test]
    fn the_tunable_is_added_to_those_already_set() {
        // One test touches the environment, so no other can race it.
        let old = std::env::var("GLIBC_TUNABLES").ok();
        std::env::set_var("GLIBC_TUNABLES", "glibc.malloc.arena_max=2");
        assert_eq!(tunables_with_fix(), format!("glibc.malloc.arena_max=2:{TUNABLE}={VALUE}"));
        assert!(!tunable_set());
        std::env::remove_var("GLIBC_TUNABLES");
        assert_eq!(tunables_with_fix(), format!("{TUNABLE}={VALUE}"));
        std::env::set_var("GLIBC_TUNABLES", tunables_with_fix());
        assert!(tunable_set());
        match old {
            Some(v) => std::env::set_var("GLIBC_TUNABLES", v),
            None => std::env::remove_var("GLIBC_TUNABLES"),
        }
    }

    /// In a process started with the tunable, no alignment is slow: the
    /// switch does what the module says. Run as a child with the tunable set
    /// (glibc reads it only at start).
    #[test]
    fn with_the_tunable_set_no_alignment_is_slow() {
        if !cfg!(all(target_os = "linux", target_env = "gnu", target_arch = "x86_64")) {
            return;
        }
        if std::env::var_os("RGPU_REP_MOVSB_CHILD").is_some() {
            let (slow, reference) = measure();
            assert!(slow <= reference.max(1) * 4, "slow case {slow} ns against {reference} ns with {TUNABLE} set");
            return;
        }
        let me = std::env::current_exe().unwrap();
        let out = std::process::Command::new(me)
            .args(["--exact", "rep_movsb::tests::with_the_tunable_set_no_alignment_is_slow", "--nocapture"])
            .env("RGPU_REP_MOVSB_CHILD", "1")
            .env("GLIBC_TUNABLES", format!("{TUNABLE}={VALUE}"))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        assert!(stdout.contains("1 passed"), "the child ran no test: {stdout}");
    }
}
