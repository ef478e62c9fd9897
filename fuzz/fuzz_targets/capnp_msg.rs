#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| rgpu_fuzz_targets::capnp_msg::run(data));
