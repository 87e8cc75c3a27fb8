//! What a KV-event publisher (or a stranger on its port) sends after a valid handshake: any
//! bytes must end in messages or an error within the frame and message limits, never a panic,
//! a hang or an allocation of what a frame header declares.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;
use vllm_protocol::zmtp::{Connection, Limits, SocketType};

fn handshake() -> Vec<u8> {
    let mut out = vec![0u8; 64];
    out[0] = 0xFF;
    out[9] = 0x7F;
    out[10] = 3;
    out[12..16].copy_from_slice(b"NULL");
    let ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
    out.extend_from_slice(&[0x04, ready.len() as u8]);
    out.extend_from_slice(ready);
    out
}

fuzz_target!(|data: &[u8]| {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        // Half the inputs start after a valid handshake, half are the whole stream.
        let mut stream = if data.first().is_some_and(|b| b & 1 == 0) {
            handshake()
        } else {
            Vec::new()
        };
        stream.extend_from_slice(data);
        let (ours, mut theirs) = tokio::io::duplex(1 << 20);
        let _ = theirs.write_all(&stream).await;
        let _ = theirs.shutdown().await;
        let (r, w) = tokio::io::split(ours);
        let limits = Limits {
            max_frame: 1 << 16,
            max_message: 1 << 17,
            max_frames: 8,
        };
        if let Ok(mut c) = Connection::over(r, w, SocketType::Sub, limits).await {
            while c.recv().await.is_ok() {}
        }
        drop(theirs);
    });
});
