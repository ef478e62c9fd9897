//! Inputs the fuzzer (`fuzz/`, target `ptx`) found that made the parser or
//! the lowering panic. Each must now be refused with an error, the module
//! and the server around it untouched.

use rgpu_ptx::{Module, PtxError};

fn kernel(body: &str) -> String {
    format!(
        ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 p)\n{{\n\t.reg .pred %p<3>;\n\t.reg .b32 %r<4>;\n{body}\n\tret;\n}}\n"
    )
}

fn lower(body: &str) -> Result<(), PtxError> {
    let m = Module::parse(&kernel(body))?;
    m.lower("k", &|_| None).map(|_| ())
}

#[test]
fn setp_with_too_few_operands_is_an_error() {
    // Indexed its third operand unchecked: "index out of bounds: the len is 2".
    for body in ["\tsetp.lt.s32 %p1, %r1;", "\tset.lt.u32.s32 %r1, %r2;", "\tsetp.eq.s32 %p1;"] {
        let e = lower(body).expect_err(body);
        assert!(matches!(e, PtxError::Parse { .. }), "{body}: {e}");
    }
    // Still fine with 3 and 4.
    lower("\tsetp.lt.s32 %p1, %r1, %r2;").unwrap();
    lower("\tsetp.lt.and.s32 %p1, %r1, %r2, %p2;").unwrap();
}
