//! vLLM KV-event messages as a router receives them from the network: any bytes, split into
//! the three frames, must decode to a batch or an error, never panic or hang.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = vllm_protocol::decode_batch(data);
    // The same bytes as a whole message: topic, sequence, payload at two cut points.
    if data.len() >= 2 {
        let a = data[0] as usize % data.len();
        let b = a + (data[1] as usize % (data.len() - a + 1));
        let _ = vllm_protocol::decode_message(&[&data[..a], &data[a..b], &data[b..]]);
    }
});
