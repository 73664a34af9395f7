#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sortie_fuzz::decoders::canonical_json(data));
