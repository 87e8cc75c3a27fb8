//! Rendering and tokenizing a chat request as vLLM does, then naming its token blocks: the
//! cost precise routing adds per request (goal: under 100 µs for an 8 KiB chat request).
//!
//! Needs the real-vLLM model directory (its tokenizer and chat template):
//! `scripts/vllm-fleet.sh` writes it to `target/vllm-fleet/model`; or set
//! PREFIX_ROUTER_VLLM_MODEL to another one.

use std::path::PathBuf;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use prefix_index::BlockHasher;
use serde_json::json;
use vllm_protocol::ChatTokenizer;

fn model_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("PREFIX_ROUTER_VLLM_MODEL").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/vllm-fleet/model"),
        PathBuf::from,
    );
    dir.join("tokenizer.json").exists().then_some(dir)
}

/// English-like text of about `bytes` bytes.
fn text(bytes: usize, seed: u64) -> String {
    const WORDS: [&str; 16] = [
        "river", "stone", "light", "paper", "garden", "window", "signal", "market", "silver",
        "forest", "engine", "letter", "winter", "castle", "number", "orange",
    ];
    let mut s = seed | 1;
    let mut out = String::new();
    while out.len() < bytes {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.push_str(WORDS[(s % 16) as usize]);
        out.push(if s.is_multiple_of(11) { '.' } else { ' ' });
    }
    out
}

/// Words of random letters, about `bytes` bytes.
fn letters(bytes: usize, seed: u64) -> String {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::new();
    while out.len() < bytes {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        for i in 0..(2 + s % 8) {
            out.push((b'a' + ((s >> (5 * i)) % 26) as u8) as char);
        }
        out.push(' ');
    }
    out
}

fn bench(c: &mut Criterion) {
    let Some(dir) = model_dir() else {
        eprintln!(
            "no model directory: run scripts/vllm-fleet.sh once (or set PREFIX_ROUTER_VLLM_MODEL)"
        );
        return;
    };
    let tokenizer = ChatTokenizer::from_dir(&dir).unwrap();
    let hasher = BlockHasher::new(32, 0);
    let body = json!({"messages": [
        {"role": "system", "content": text(6 * 1024, 1)},
        {"role": "user", "content": text(2 * 1024, 2)},
    ]});
    assert!(body.to_string().len() >= 8 * 1024);
    let ids = tokenizer.chat_ids(&body).unwrap();
    eprintln!("8 KiB chat request: {} tokens", ids.len());
    let mut g = c.benchmark_group("tokenize");
    g.bench_function("chat 8 KiB: render + tokenize + block hashes", |b| {
        b.iter(|| {
            let ids = tokenizer.chat_ids(black_box(&body)).unwrap();
            black_box(hasher.hash(&ids))
        })
    });
    let rendered = tokenizer
        .render_chat(&body["messages"], None, true, false)
        .unwrap();
    // The same size of never-seen words (random letters, as the bench workloads' text): no
    // word is in the encoder's cache, so the BPE model runs on every one — the worst case.
    let mut seed = 7u64;
    g.bench_function(
        "chat 8 KiB of new words: render + tokenize + block hashes",
        |b| {
            b.iter_batched(
                || {
                    seed += 1;
                    json!({"messages": [
                        {"role": "system", "content": letters(6 * 1024, seed)},
                        {"role": "user", "content": letters(2 * 1024, seed ^ 0xABCD)},
                    ]})
                },
                |body| {
                    let ids = tokenizer.chat_ids(&body).unwrap();
                    black_box(hasher.hash(&ids))
                },
                criterion::BatchSize::SmallInput,
            )
        },
    );
    g.bench_function("chat 8 KiB: render only", |b| {
        b.iter(|| tokenizer.render_chat(black_box(&body["messages"]), None, true, false))
    });
    g.bench_function("8 KiB: tokenize only", |b| {
        b.iter(|| tokenizer.encode(black_box(&rendered), false))
    });
    g.bench_function("8 KiB: block hashes only", |b| {
        b.iter(|| hasher.hash(black_box(&ids)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
