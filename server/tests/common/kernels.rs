//! Kernels the launch tests run.

/// `busy(out, n)`: each thread counts to `n`, then stores the count at `out`.
/// `capped(out, n)`: stores 1 at `out`; `.maxntid 128`.
/// `meet(mine, theirs, n)`: sets `*mine` to 1, waits (at most `n` turns) to
/// see `*theirs` set, then sets `*mine` to 2: both flags end at 2 only if
/// two such kernels ran at the same time.
pub const BUSY_PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry busy(.param .u64 out, .param .u32 n)\n{\n\t.reg .pred %p<2>;\n\t.reg .b32 %r<4>;\n\t.reg .b64 %rd<2>;\n\
\tld.param.u64 %rd1, [out];\n\tld.param.u32 %r1, [n];\n\tmov.u32 %r2, 0;\n$L__loop:\n\tadd.u32 %r2, %r2, 1;\n\
\tsetp.lt.u32 %p1, %r2, %r1;\n\t@%p1 bra $L__loop;\n\tst.global.u32 [%rd1], %r2;\n\tret;\n}\n\
.visible .entry capped(.param .u64 out, .param .u32 n)\n.maxntid 128, 1, 1\n{\n\t.reg .b64 %rd<2>;\n\tld.param.u64 %rd1, [out];\n\
\tst.global.u32 [%rd1], 1;\n\tret;\n}\n\
.visible .entry meet(.param .u64 mine, .param .u64 theirs, .param .u32 n)\n{\n\t.reg .pred %p<3>;\n\t.reg .b32 %r<4>;\n\t.reg .b64 %rd<3>;\n\
\tld.param.u64 %rd1, [mine];\n\tld.param.u64 %rd2, [theirs];\n\tld.param.u32 %r1, [n];\n\tst.volatile.global.u32 [%rd1], 1;\n\tmov.u32 %r2, 0;\n\
$L__spin:\n\tld.volatile.global.u32 %r3, [%rd2];\n\tsetp.ne.u32 %p1, %r3, 0;\n\t@%p1 bra $L__met;\n\tadd.u32 %r2, %r2, 1;\n\
\tsetp.lt.u32 %p2, %r2, %r1;\n\t@%p2 bra $L__spin;\n\tret;\n$L__met:\n\tst.volatile.global.u32 [%rd1], 2;\n\tret;\n}\n";

/// The packed parameters of both kernels.
pub fn params(out: u64, n: u32) -> Vec<u8> {
    let mut p = out.to_le_bytes().to_vec();
    p.extend_from_slice(&n.to_le_bytes());
    p
}
