//! The request-string canonicalization never panics, and a chat conversation's string is a
//! prefix of the string of the same conversation with one more message.
#![no_main]
use libfuzzer_sys::fuzz_target;
use prefix_router::serve::request_string::{routing, Endpoint};

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings, Endpoint::Responses, Endpoint::Other] {
        let _ = routing(endpoint, data);
    }
    // Use the input as a message's content: appending a message keeps the prefix.
    let content = String::from_utf8_lossy(data);
    let one = format!(r#"{{"model":"m","messages":[{{"role":"user","content":{}}}]}}"#, serde_quote(&content));
    let two = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":{}}},{{"role":"assistant","content":"ok"}}]}}"#,
        serde_quote(&content)
    );
    let a = routing(Endpoint::Chat, one.as_bytes()).expect("a valid chat body");
    let b = routing(Endpoint::Chat, two.as_bytes()).expect("a valid chat body");
    assert!(b.text.starts_with(&a.text));
});

fn serde_quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
