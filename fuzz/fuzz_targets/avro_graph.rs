#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sortie_fuzz::decoders::avro_graph(data));
