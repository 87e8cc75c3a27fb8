//! How a server turns text into tokens and back: the simulator's own byte model (4 bytes a
//! token, a ChatML-like template: cheap and model-free), or a real model's tokenizer and chat
//! template (`--tokenizer DIR`, the files vLLM loads), so that token streams, block boundaries
//! and `usage` equal vLLM's for the same requests.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use vllm_protocol::ChatTokenizer;

use crate::tokens::{self, TokenId};

/// The text model of a server.
#[derive(Clone, Default)]
pub enum TextModel {
    #[default]
    Bytes,
    Real(Arc<RealText>),
}

/// A real tokenizer, and the answer words that are exactly one of its tokens.
pub struct RealText {
    tokenizer: Arc<ChatTokenizer>,
    words: Vec<&'static str>,
    word_ids: Vec<TokenId>,
}

impl std::fmt::Debug for TextModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TextModel::Bytes => f.write_str("Bytes"),
            TextModel::Real(_) => f.write_str("Real"),
        }
    }
}

impl TextModel {
    /// The byte model, or the tokenizer and chat template in `dir`.
    pub fn load(dir: Option<&Path>) -> anyhow::Result<Self> {
        let Some(dir) = dir else {
            return Ok(TextModel::Bytes);
        };
        let tokenizer = ChatTokenizer::from_dir(dir)?;
        let mut words = Vec::new();
        let mut word_ids = Vec::new();
        for &word in tokens::WORDS.iter() {
            if let Ok([id]) = tokenizer.encode(word, false).as_deref() {
                words.push(word);
                word_ids.push(TokenId::from(*id));
            }
        }
        anyhow::ensure!(
            words.len() >= 8,
            "the tokenizer in {} has too few one-token English words for the answers",
            dir.display()
        );
        Ok(TextModel::Real(Arc::new(RealText {
            tokenizer,
            words,
            word_ids,
        })))
    }

    /// Token ids of a completions prompt string.
    pub fn prompt(&self, text: &str) -> Result<Vec<TokenId>, String> {
        match self {
            TextModel::Bytes => Ok(tokens::tokenize(text.as_bytes())),
            TextModel::Real(r) => r
                .tokenizer
                .encode(text, true)
                .map(|ids| ids.into_iter().map(TokenId::from).collect())
                .map_err(|e| e.to_string()),
        }
    }

    /// Token ids of a chat request body (its messages through the chat template).
    pub fn chat(&self, body: &Value) -> Result<Vec<TokenId>, String> {
        match self {
            TextModel::Bytes => {
                let messages = body
                    .get("messages")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let add_generation_prompt = body
                    .get("add_generation_prompt")
                    .and_then(Value::as_bool)
                    .unwrap_or(true);
                let text = tokens::render_chat(messages, body.get("tools"), add_generation_prompt);
                Ok(tokens::tokenize(text.as_bytes()))
            }
            TextModel::Real(r) => r
                .tokenizer
                .chat_ids(body)
                .map(|ids| ids.into_iter().map(TokenId::from).collect())
                .map_err(|e| e.to_string()),
        }
    }

    /// The words answers are made of (each exactly one token).
    pub fn words(&self) -> &[&'static str] {
        match self {
            TextModel::Bytes => &tokens::WORDS,
            TextModel::Real(r) => &r.words,
        }
    }

    /// The token id of answer word `i` of [`TextModel::words`].
    pub fn word_id(&self, i: usize) -> TokenId {
        match self {
            TextModel::Bytes => tokens::tokenize(tokens::WORDS[i].as_bytes())[0],
            TextModel::Real(r) => r.word_ids[i],
        }
    }

    /// The text of token ids.
    pub fn detokenize(&self, ids: &[TokenId]) -> String {
        match self {
            TextModel::Bytes => tokens::detokenize(ids),
            TextModel::Real(r) => {
                let ids: Vec<u32> = ids.iter().filter_map(|&i| u32::try_from(i).ok()).collect();
                r.tokenizer.decode(&ids).unwrap_or_default()
            }
        }
    }
}
