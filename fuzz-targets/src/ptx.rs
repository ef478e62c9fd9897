//! The sim's PTX parser and lowering (`ptx/`) on their own: the text
//! parsed, and each kernel lowered with every module-scope name resolving
//! to an address, under a smaller instruction budget than the server's (the
//! bound is the same code; a smaller one keeps executions fast).
//!
//! Input: PTX text (bytes that are not UTF-8 are skipped, as the server's
//! module reader refuses them before the parser sees them).

/// Instructions one fuzzed kernel may lower to.
const BUDGET: usize = 1 << 16;

pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    crate::on_session_stack(|| {
        let Ok(m) = rgpu_ptx::Module::parse(text) else {
            return;
        };
        for k in m.kernels() {
            if let Ok(p) = m.lower_within(&k, &|_| Some(0x7f00_0000_0000), BUDGET) {
                assert!(
                    p.insts.len() <= BUDGET,
                    "kernel {k} lowered past its budget"
                );
            }
        }
    });
}
