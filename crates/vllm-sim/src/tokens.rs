//! The simulator's tokenizer, chat template and text generator.
//!
//! Deterministic and byte-based, so that cache behaviour depends only on the bytes a server
//! sees: one token per 4 bytes of the rendered prompt. Chat requests are rendered through a
//! ChatML-like template first, as vLLM does, so the server's token stream is not the router's
//! string.

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes per token.
pub const BYTES_PER_TOKEN: usize = 4;

/// A token id: the token's bytes (little endian) and, above bit 32, its length, so that a
/// shorter final token never equals a full one.
pub type TokenId = u64;

/// Cuts text into tokens of [`BYTES_PER_TOKEN`] bytes (the last may be shorter).
pub fn tokenize(bytes: &[u8]) -> Vec<TokenId> {
    bytes.chunks(BYTES_PER_TOKEN).map(token_id).collect()
}

fn token_id(piece: &[u8]) -> TokenId {
    let mut word = [0u8; 4];
    word[..piece.len()].copy_from_slice(piece);
    u64::from(u32::from_le_bytes(word)) | ((piece.len() as u64) << 32)
}

/// The text of a token id (ids that did not come from [`tokenize`] render as their number).
pub fn detokenize(ids: &[TokenId]) -> String {
    let mut bytes = Vec::with_capacity(ids.len() * BYTES_PER_TOKEN);
    for &id in ids {
        let len = (id >> 32) as usize;
        if (1..=BYTES_PER_TOKEN).contains(&len) {
            bytes.extend_from_slice(&(id as u32).to_le_bytes()[..len]);
        } else {
            bytes.extend_from_slice(format!("<{id}>").as_bytes());
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Renders chat messages (and tools) the way a ChatML template does, with the generation
/// prompt at the end. Turn k+1's rendering starts with turn k's rendering plus its answer.
pub fn render_chat(
    messages: &[Value],
    tools: Option<&Value>,
    add_generation_prompt: bool,
) -> String {
    let mut out = String::new();
    if let Some(tools) = tools.filter(|t| !t.is_null()) {
        out.push_str("<|im_start|>system\n# Tools\n");
        out.push_str(&tools.to_string());
        out.push_str("<|im_end|>\n");
    }
    for message in messages {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("user");
        out.push_str("<|im_start|>");
        out.push_str(role);
        out.push('\n');
        render_content(message.get("content"), &mut out);
        if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
            out.push_str("<tool_call>");
            out.push_str(&calls.to_string());
            out.push_str("</tool_call>");
        }
        out.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

fn render_content(content: Option<&Value>, out: &mut String) {
    match content {
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for part in parts {
                match part.get("type").and_then(Value::as_str) {
                    Some("text") | Some("input_text") => {
                        out.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some("image_url") | Some("input_image") => out.push_str("<image>"),
                    Some(other) => {
                        out.push('<');
                        out.push_str(other);
                        out.push('>');
                    }
                    None => out.push_str(&part.to_string()),
                }
            }
        }
        Some(Value::Null) | None => {}
        Some(other) => out.push_str(&other.to_string()),
    }
}

/// Four-byte words the generator draws from, so every output token is exactly one word.
pub const WORDS: [&str; 32] = [
    " the", " and", " for", " are", " but", " not", " you", " all", " any", " can", " had", " her",
    " was", " one", " our", " out", " day", " get", " has", " him", " his", " how", " man", " new",
    " now", " old", " see", " two", " way", " who", " its", " say",
];

/// The answer a prompt gets: deterministic in the prompt and the seed.
pub struct Answer {
    pub tokens: Vec<&'static str>,
    /// Which word of the vocabulary each token is.
    pub word_indexes: Vec<usize>,
    /// True when the answer ended by itself (EOS or a stop string), false when cut at
    /// `max_tokens`.
    pub stopped: bool,
}

/// What shapes the answer.
#[derive(Clone, Debug, Default)]
pub struct AnswerLimits {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
}

/// Generates the answer to `prompt_ids`. Its natural length (where "EOS" falls) is 16 to 271
/// tokens, drawn from the prompt's hash; `ignore_eos` generates exactly `max_tokens`.
pub fn answer(
    prompt_ids: &[TokenId],
    seed: u64,
    limits: &AnswerLimits,
    words: &[&'static str],
) -> Answer {
    let bytes: Vec<u8> = prompt_ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    let mut state = xxh3_64_with_seed(&bytes, seed);
    let natural = 16 + (splitmix(&mut state) % 256) as usize;
    let eos_at = if limits.ignore_eos {
        usize::MAX
    } else {
        natural.max(limits.min_tokens)
    };
    let count = limits.max_tokens.min(eos_at);
    let mut tokens = Vec::with_capacity(count);
    let mut word_indexes = Vec::with_capacity(count);
    let mut text = String::new();
    for _ in 0..count {
        let index = (splitmix(&mut state) % words.len() as u64) as usize;
        let word = words[index];
        tokens.push(word);
        word_indexes.push(index);
        if !limits.stop.is_empty() && tokens.len() >= limits.min_tokens {
            text.push_str(word);
            if limits
                .stop
                .iter()
                .any(|s| !s.is_empty() && text.contains(s.as_str()))
            {
                // vLLM drops the token that completed the stop string from the text.
                tokens.pop();
                word_indexes.pop();
                return Answer {
                    tokens,
                    word_indexes,
                    stopped: true,
                };
            }
        }
    }
    Answer {
        stopped: eos_at < limits.max_tokens,
        tokens,
        word_indexes,
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn four_bytes_a_token_and_round_trip() {
        let ids = tokenize(b"hello world");
        assert_eq!(ids.len(), 3);
        assert_eq!(detokenize(&ids), "hello world");
        // The short final token differs from a full one with the same first bytes.
        assert_ne!(tokenize(b"ab")[0], tokenize(b"ab\0\0")[0]);
    }

    #[test]
    fn chat_rendering_is_prefix_preserving_across_turns() {
        let turn1 = vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi"}),
        ];
        let mut turn2 = turn1.clone();
        turn2.push(json!({"role": "assistant", "content": " the and"}));
        turn2.push(json!({"role": "user", "content": [{"type": "text", "text": "More"}]}));
        let r1 = render_chat(&turn1, None, true);
        let r2 = render_chat(&turn2, None, true);
        assert!(r2.starts_with(&format!("{r1} the and")), "{r1:?} / {r2:?}");
        assert!(r1.ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn answers_are_deterministic_and_respect_limits() {
        let prompt = tokenize(b"what is the answer?");
        let limits = AnswerLimits {
            max_tokens: 1000,
            ..AnswerLimits::default()
        };
        let a = answer(&prompt, 1, &limits, &WORDS);
        let b = answer(&prompt, 1, &limits, &WORDS);
        assert_eq!(a.tokens, b.tokens);
        assert!(a.stopped);
        assert!((16..=271).contains(&a.tokens.len()));
        let cut = answer(
            &prompt,
            1,
            &AnswerLimits {
                max_tokens: 5,
                ..limits.clone()
            },
            &WORDS,
        );
        assert_eq!((cut.tokens.len(), cut.stopped), (5, false));
        let forced = answer(
            &prompt,
            1,
            &AnswerLimits {
                max_tokens: 300,
                ignore_eos: true,
                ..limits.clone()
            },
            &WORDS,
        );
        assert_eq!((forced.tokens.len(), forced.stopped), (300, false));
        assert_ne!(answer(&prompt, 2, &limits, &WORDS).tokens, a.tokens);
    }

    #[test]
    fn stop_strings_end_the_answer() {
        let prompt = tokenize(b"stop test");
        let full = answer(
            &prompt,
            0,
            &AnswerLimits {
                max_tokens: 50,
                ignore_eos: true,
                ..Default::default()
            },
            &WORDS,
        );
        let third = full.tokens[2].to_string();
        let stopped = answer(
            &prompt,
            0,
            &AnswerLimits {
                max_tokens: 50,
                ignore_eos: true,
                stop: vec![third.clone()],
                ..Default::default()
            },
            &WORDS,
        );
        assert!(stopped.stopped);
        assert!(!stopped.tokens.concat().contains(&third));
        assert!(stopped.tokens.len() <= 2);
    }
}
