//! Running a program as `rgpu run`'s child so that it goes where its
//! parent goes: the signals a user or a job system sends `rgpu run`
//! (SIGINT, SIGTERM, SIGHUP) reach the program, and killing `rgpu run`
//! (SIGKILL included) kills the program, which the kernel does for us with
//! PR_SET_PDEATHSIG. A SIGINT from the terminal already reached the program
//! (it shares the terminal's process group), so only one sent by a process
//! (`kill`, `timeout`, a scheduler) is forwarded, never the same twice.

use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{Context, Result};

const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The running child's pid (0 before it started).
static CHILD: AtomicI32 = AtomicI32::new(0);
/// A signal that came before the child's pid was known.
static EARLY: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo with SA_SIGINFO.
    let code = unsafe { info.as_ref() }.map_or(0, |i| i.si_code);
    if sig == libc::SIGINT && code == libc::SI_KERNEL {
        return; // the terminal's: the program has it already
    }
    let child = CHILD.load(Ordering::SeqCst);
    if child > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(child, sig) };
    } else {
        EARLY.store(sig, Ordering::SeqCst);
    }
}

/// Runs `cmd` to its end, forwarding signals; returns how it ended.
pub fn run(mut cmd: Command, name: &str) -> Result<ExitStatus> {
    // SAFETY: a plain handler that only reads atomics and calls kill.
    unsafe {
        for sig in FORWARDED {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = forward as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec only async-signal-safe calls.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the prctl took effect.
            if libc::getppid() != parent {
                libc::_exit(137);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().with_context(|| format!("cannot run {name}"))?;
    CHILD.store(child.id() as i32, Ordering::SeqCst);
    let early = EARLY.swap(0, Ordering::SeqCst);
    if early != 0 {
        // SAFETY: the child's pid, still ours to signal until it is reaped.
        unsafe { libc::kill(child.id() as i32, early) };
    }
    let status = child.wait().with_context(|| format!("cannot wait for {name}"));
    CHILD.store(0, Ordering::SeqCst);
    status
}
