#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sortie_fuzz::decoders::signature(data));
