#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| rgpu_fuzz_targets::snapshot::run(data));
