//! Differential runs: a launch on the interpreter and on the compiled tier from the same
//! memory, compared. The crate's kernel tests run every launch through [`check_tiers`], so
//! a specialised kernel that computes anything else than the interpreter's code fails them.

use crate::exec::{ExecError, Fault, LaunchConfig, LaunchOutput};
use crate::ir::{Op, Program};
use crate::HostMemory;

/// A launch entry point (`launch`, or `launch_cooperative` with its extra arguments bound).
pub type Launcher<'a> = &'a dyn Fn(&Program, &LaunchConfig, &[u8], &HostMemory) -> Result<LaunchOutput, ExecError>;

/// Runs `p` from `mem`'s current contents on the interpreter and on the compiled tier, one
/// worker each (so that the order of blocks, and so the first fault, is the same), and says
/// how they differ, if they do: the memory after, the printf output, the instructions
/// counted, or the fault (of a time limit or cancel only its kind, as where a launch was
/// stopped depends on timing). `mem` is left as the interpreter's run left it.
pub fn compare_tiers(p: &Program, c: &LaunchConfig, params: &[u8], mem: &HostMemory, launch: Launcher) -> Result<(), String> {
    let before = mem.snapshot();
    let run = |compiled: bool| {
        mem.restore(&before);
        let cfg = LaunchConfig { workers: 1, compiled, ..c.clone() };
        let r = launch(p, &cfg, params, mem);
        (r, mem.snapshot())
    };
    let (compiled, compiled_mem) = run(true);
    let (interp, interp_mem) = run(false);
    let timing = |e: &ExecError| matches!(e.fault, Fault::Timeout | Fault::Cancelled | Fault::Aborted);
    match (&interp, &compiled) {
        (Ok(a), Ok(b)) => {
            if a.printf != b.printf {
                return Err(format!("printf output differs: {:?} vs {:?}", String::from_utf8_lossy(&a.printf), String::from_utf8_lossy(&b.printf)));
            }
            if a.thread_instructions != b.thread_instructions {
                return Err(format!("instructions counted differ: {} vs {}", a.thread_instructions, b.thread_instructions));
            }
        }
        (Err(a), Err(b)) if timing(a) && timing(b) => {
            return if a.fault == b.fault { Ok(()) } else { Err(format!("faults differ: {a} vs {b}")) };
        }
        (Err(a), Err(b)) if a == b => {}
        (a, b) => return Err(format!("results differ: interpreter {a:?}, compiled tier {b:?}")),
    }
    if let Some(at) = interp_mem.iter().zip(&compiled_mem).position(|(x, y)| x != y) {
        let w = at & !7;
        return Err(format!(
            "memory differs at byte {at:#x}: interpreter {:02x?}, compiled tier {:02x?}",
            &interp_mem[w..(w + 8).min(interp_mem.len())],
            &compiled_mem[w..(w + 8).min(compiled_mem.len())]
        ));
    }
    Ok(())
}

/// [`compare_tiers`], panicking where the tiers differ, then the launch as `c` asks for it
/// from the same starting memory: its result, and `mem` as it leaves it. A kernel that
/// reads a clock gives different values run to run, so it is only run as asked.
pub fn check_tiers(p: &Program, c: &LaunchConfig, params: &[u8], mem: &HostMemory, launch: Launcher) -> Result<LaunchOutput, ExecError> {
    if !p.insts.iter().any(|i| matches!(i.op, Op::Clock { .. })) {
        let before = mem.snapshot();
        if let Err(e) = compare_tiers(p, c, params, mem, launch) {
            panic!("kernel {}: the compiled tier and the interpreter differ: {e}", p.name);
        }
        mem.restore(&before);
    }
    launch(p, c, params, mem)
}
