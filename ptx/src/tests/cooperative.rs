//! Cooperative launches: every block resident at once, so blocks that wait
//! for each other through global memory all make progress, on one host
//! thread or several; bounded by the time limit and the cancel flag.

use super::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

struct Free;
impl BlockGate for Free {
    fn enter(&self, _: &dyn Fn() -> bool) -> bool {
        true
    }
    fn leave(&self, _: bool) {}
}

/// Block 0 waits (thread 0 polling word 0 with `ld` + `modifier`) until the last block has
/// set it; then it stores 7 to word 1. Other blocks do nothing but the last sets the flag.
fn wait_for_last_block(modifier: &str) -> String {
    kernel(&format!(
        "mov.u32 %r10, %nctaid.x;\nsub.s32 %r10, %r10, 1;\nsetp.ne.s32 %p1, %r60, %r10;\n@%p1 bra $NOTLAST;\n\
         setp.ne.s32 %p2, %r62, 0;\n@%p2 bra $NOTLAST;\nmov.u32 %r11, 1;\nst.global.u32 [%rd1], %r11;\n\
         $NOTLAST:\nsetp.ne.s32 %p3, %r0, 0;\n@%p3 bra $DONE;\n\
         $SPIN:\nld{modifier}.global.u32 %r12, [%rd1];\nsetp.eq.s32 %p4, %r12, 0;\n@%p4 bra $SPIN;\n\
         mov.u32 %r13, 7;\nst.global.u32 [%rd1+4], %r13;\n$DONE:"
    ))
}

fn run_coop(src: &str, c: LaunchConfig, init: &[u32], cancel: &AtomicBool) -> Result<Vec<u32>, ExecError> {
    let m = Module::parse(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let p = m.lower("k", &|_| None).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut mem = HostMemory::new(BASE, 1 << 20);
    let buf = mem.alloc(init.len() as u64 * 4).unwrap();
    mem.write(buf, &init.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<_>>());
    crate::testing::check_tiers(&p, &c, &buf.to_le_bytes(), &mem, &|p, c, params, mem| launch_cooperative(p, c, params, mem, cancel, &Free))?;
    let out = mem.read(buf, init.len() * 4).unwrap();
    Ok(out.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

#[test]
fn a_block_waiting_for_a_later_block_gets_there() {
    let no = AtomicBool::new(false);
    // Volatile and acquire polls let the others run at once; a plain load loop (which a
    // compiler would not emit for a flag, but PTX allows) after its steps.
    for modifier in [".volatile", ".acquire.gpu", ".relaxed.gpu", ""] {
        for workers in [1, 3] {
            let mut c = cfg(9, 64);
            c.workers = workers;
            let r = run_coop(&wait_for_last_block(modifier), c, &[0, 0], &no).unwrap_or_else(|e| panic!("ld{modifier}, {workers} workers: {e}"));
            assert_eq!(r, vec![1, 7], "ld{modifier}, {workers} workers");
        }
    }
}

/// The test above means something: an ordinary launch on one host thread runs block 0 to its
/// end first, so it never sees the flag.
#[test]
fn an_ordinary_launch_does_not_wait_for_a_later_block() {
    let mut c = cfg(9, 64);
    c.workers = 1;
    c.time_limit = Duration::from_millis(300);
    assert_eq!(run_words(&wait_for_last_block(".volatile"), c, &[0, 0]).unwrap_err().fault, Fault::Timeout);
}

#[test]
fn a_cooperative_kernel_that_never_meets_still_stops() {
    // Nobody sets the flag: the time limit ends it, and so does a cancel.
    let src = kernel("$SPIN:\nld.volatile.global.u32 %r12, [%rd1];\nsetp.eq.s32 %p4, %r12, 0;\n@%p4 bra $SPIN;");
    let mut c = cfg(6, 64);
    c.time_limit = Duration::from_millis(300);
    let no = AtomicBool::new(false);
    assert_eq!(run_coop(&src, c.clone(), &[0], &no).unwrap_err().fault, Fault::Timeout);
    c.time_limit = Duration::from_secs(60);
    let cancel = AtomicBool::new(false);
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            cancel.store(true, Ordering::Relaxed);
        });
        assert_eq!(run_coop(&src, c, &[0], &cancel).unwrap_err().fault, Fault::Cancelled);
    });
    assert!(t.elapsed() < Duration::from_secs(10), "cancel took {:?}", t.elapsed());
}

#[test]
fn the_grid_sync_workspace_is_in_envreg1_and_2_only_in_a_cooperative_launch() {
    let src = kernel(
        "mov.u32 %r1, %envreg1;\nmov.u32 %r2, %envreg2;\nst.global.u32 [%rd1], %r1;\nst.global.u32 [%rd1+4], %r2;\n\
         mov.b64 %rd5, {%r2, %r1};\nld.u32 %r3, [%rd5+4];\nst.global.u32 [%rd1+8], %r3;",
    );
    let c = cfg(1, 1);
    let r = run_coop(&src, c.clone(), &[9, 9, 9], &AtomicBool::new(false)).unwrap();
    assert_eq!((r[0] as u64) << 32 | r[1] as u64, ir::GRID_SYNC_ADDR);
    assert_eq!(r[2], 0, "the barrier word starts at 0");
    let plain = kernel("mov.u32 %r1, %envreg1;\nmov.u32 %r2, %envreg2;\nst.global.u32 [%rd1], %r1;\nst.global.u32 [%rd1+4], %r2;");
    assert_eq!(run_words(&plain, c, &[9, 9]).unwrap(), vec![0, 0]);
    let other = kernel("mov.u32 %r1, %envreg3;");
    let e = Module::parse(&other).unwrap().lower("k", &|_| None).unwrap_err();
    assert!(matches!(e, PtxError::Unsupported { .. }), "{e}");
}
