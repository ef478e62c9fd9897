//! Where the lanes of a warp that a branch divides meet again: the branch's immediate
//! post-dominator, the first instruction every path from the branch to the kernel's exit goes
//! through. A GPU reconverges a divided warp there (the SIMT stack, or the convergence barriers
//! compilers place on Volta and later), and kernels written warp-synchronously (CuPy's
//! partition kernels, for one) count on it: lanes that leave an inner loop early must not run on
//! through the outer loop while the others are still in the inner one.

use crate::ir::{Inst, Op};

/// No reconvergence point: a path from the branch exits (or loops forever) without meeting the
/// others.
pub const NONE: u32 = u32::MAX;

/// For each instruction, the pc where the lanes a guarded branch there divides meet again
/// (`NONE` for other instructions and for branches whose paths never meet).
pub fn points(insts: &[Inst]) -> Vec<u32> {
    let n = insts.len();
    let exit = n; // a virtual node every exit goes to
    let succ = |i: usize| -> [usize; 2] {
        let next = if i + 1 < n { i + 1 } else { exit };
        match (&insts[i].op, insts[i].guard.is_some()) {
            (Op::Bra { target }, guarded) => {
                let t = if (*target as usize) < n { *target as usize } else { exit };
                [t, if guarded { next } else { t }]
            }
            (Op::Exit | Op::Trap, true) => [exit, next],
            (Op::Exit | Op::Trap, false) => [exit, exit],
            _ => [next, next],
        }
    };
    // Predecessor lists of the forward graph are the successor lists of the reverse graph, in
    // which post-dominators are dominators (Cooper, Harvey and Kennedy's iterative algorithm).
    let mut pred_count = vec![0u32; n + 1];
    for i in 0..n {
        let s = succ(i);
        pred_count[s[0]] += 1;
        if s[1] != s[0] {
            pred_count[s[1]] += 1;
        }
    }
    let mut start = vec![0usize; n + 2];
    for v in 0..=n {
        start[v + 1] = start[v] + pred_count[v] as usize;
    }
    let mut preds = vec![0usize; start[n + 1]];
    let mut fill = start.clone();
    for i in 0..n {
        let s = succ(i);
        preds[fill[s[0]]] = i;
        fill[s[0]] += 1;
        if s[1] != s[0] {
            preds[fill[s[1]]] = i;
            fill[s[1]] += 1;
        }
    }
    // Postorder of the reverse graph from the exit, without recursion (kernels are long).
    const UNSEEN: usize = usize::MAX;
    let mut order = vec![UNSEEN; n + 1];
    let mut post = Vec::with_capacity(n + 1);
    let mut stack = vec![(exit, start[exit])];
    order[exit] = 0;
    while let Some(&mut (v, ref mut k)) = stack.last_mut() {
        if *k < start[v + 1] {
            let p = preds[*k];
            *k += 1;
            if order[p] == UNSEEN {
                order[p] = 0;
                stack.push((p, start[p]));
            }
        } else {
            order[v] = post.len();
            post.push(v);
            stack.pop();
        }
    }
    let mut ipdom = vec![UNSEEN; n + 1];
    ipdom[exit] = exit;
    let intersect = |ipdom: &[usize], mut a: usize, mut b: usize| {
        while a != b {
            while order[a] < order[b] {
                a = ipdom[a];
            }
            while order[b] < order[a] {
                b = ipdom[b];
            }
        }
        a
    };
    let mut changed = true;
    while changed {
        changed = false;
        // Reverse postorder, the exit (last in postorder) left out.
        for &v in post.iter().rev().skip(1) {
            let mut new = UNSEEN;
            for s in succ(v) {
                if ipdom[s] != UNSEEN {
                    new = if new == UNSEEN { s } else { intersect(&ipdom, s, new) };
                }
            }
            if new != UNSEEN && ipdom[v] != new {
                ipdom[v] = new;
                changed = true;
            }
        }
    }
    (0..n)
        .map(|i| match (&insts[i].op, insts[i].guard.is_some(), ipdom[i]) {
            (Op::Bra { .. }, true, p) if p < n => p as u32,
            _ => NONE,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Src;

    fn inst(op: Op, guarded: bool) -> Inst {
        Inst { guard: guarded.then_some((0, false)), op, line: 0 }
    }

    #[test]
    fn if_else_loops_and_exits() {
        let nop = || inst(Op::Nop, false);
        let bra = |t: u32, g: bool| inst(Op::Bra { target: t }, g);
        // 0: @p bra 3; 1: nop; 2: bra 4; 3: nop; 4: nop (join of 0);
        // 5: @p bra 5 (a self loop: joins at 6); 6: @p exit; 7: @p bra 9; 8: exit; 9: nop
        let prog = vec![
            bra(3, true),
            nop(),
            bra(4, false),
            nop(),
            nop(),
            bra(5, true),
            inst(Op::Exit, true),
            bra(9, true),
            inst(Op::Exit, false),
            inst(Op::Mov { bits: 32, d: 0, a: Src::C(0) }, false),
        ];
        let r = points(&prog);
        assert_eq!(r[0], 4);
        assert_eq!(r[5], 6);
        assert_eq!(r[7], NONE, "one side exits: the paths meet only at the exit");
        assert!(r.iter().enumerate().all(|(i, &p)| p == NONE || matches!(prog[i].op, Op::Bra { .. })));
    }

    #[test]
    fn an_inner_loop_whose_exit_is_the_outer_latch() {
        // The shape of CuPy's bitonic sort step: the inner loop's header branches back to the
        // outer latch (a lower pc) for lanes with no work.
        // 0: nop (outer head); 1: @p bra 0 ... laid out as:
        // 0: latch: nop; 1: @p bra 6 (outer done); 2: @p bra 0 (inner header: no work -> latch);
        // 3: nop (body); 4: @p bra 3 (inner back edge); 5: bra 0; 6: exit
        let prog = vec![
            inst(Op::Nop, false),
            inst(Op::Bra { target: 6 }, true),
            inst(Op::Bra { target: 0 }, true),
            inst(Op::Nop, false),
            inst(Op::Bra { target: 3 }, true),
            inst(Op::Bra { target: 0 }, false),
            inst(Op::Exit, false),
        ];
        let r = points(&prog);
        assert_eq!(r[2], 0, "lanes that skip the inner loop wait at the latch");
        assert_eq!(r[4], 5);
        assert_eq!(r[1], 6);
    }
}
