#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| rgpu_fuzz_targets::session::run(data));
