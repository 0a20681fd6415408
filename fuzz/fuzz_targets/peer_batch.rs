#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| inference_picker::fuzzing::peer_batch(data));
