//! A direct path to the same token ids as the `tokenizers` pipeline, for SentencePiece-style BPE
//! tokenizers (Llama, Mistral and their kind as `transformers` converts them): no normalizer, a
//! `Metaspace` pre-tokenizer, a BPE model, plain added tokens.
//!
//! The pipeline tracks offsets and alignments for every piece and clones every token's string
//! out of its cache: for an 8 KiB prompt that is most of a millisecond. This encoder does what
//! the pipeline does to the text — split out added tokens, turn spaces into `▁`, prepend one
//! where `Metaspace` would, cut words at `▁`-runs (exact only where the vocabulary proves it, see
//! [`crate::tokenizer`]) — and keeps each word's ids in a cache of its own, calling the BPE model
//! only for words it has not seen. Where the tokenizer is of another kind, it is not used.

use std::collections::HashMap;

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::RwLock;
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::Model;

/// Bytes (words' text and ids) kept per cache shard; a full shard is emptied (a cheap, crude
/// bound): 16 shards of 1 MiB.
const SHARD_BYTES: usize = 1 << 20;
const SHARDS: usize = 16;
/// Longer words are not cached: real words repeat and are short; a long "word" (a base64
/// blob, a run without spaces) is usually unique, and one would fill a shard by itself.
const MAX_CACHED_WORD: usize = 256;

/// One shard of the word cache: a word's text to its token ids, and the bytes they take.
#[derive(Default)]
struct WordShard {
    words: HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>,
    bytes: usize,
}

impl WordShard {
    /// What one entry costs: its text, its ids and the table's own share.
    fn cost(word: &str, ids: &[u32]) -> usize {
        word.len() + 4 * ids.len() + 48
    }
}

pub(crate) struct WordEncoder {
    mark: char,
    prepend: PrependScheme,
    /// Added tokens, matched in the raw text, leftmost and longest first.
    added: Option<AhoCorasick>,
    added_ids: Vec<u32>,
    /// Ids the post-processor puts around a sequence when special tokens are added.
    special_prefix: Vec<u32>,
    special_suffix: Vec<u32>,
    cache: Vec<RwLock<WordShard>>,
}

impl WordEncoder {
    /// The encoder for `tokenizer` (already made to split words, where that is exact), if it is
    /// of the kind this encoder reproduces.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer) -> Option<Self> {
        if tokenizer.get_normalizer().is_some()
            || tokenizer.get_truncation().is_some()
            || tokenizer.get_padding().is_some()
            || !matches!(tokenizer.get_model(), ModelWrapper::BPE(_))
        {
            return None;
        }
        let meta = match tokenizer.get_pre_tokenizer()? {
            PreTokenizerWrapper::Sequence(seq) => match seq.as_ref() {
                // What `split_into_words` installs: Metaspace, then a split at `▁`-runs.
                [PreTokenizerWrapper::Metaspace(m), PreTokenizerWrapper::Split(_)] => m.clone(),
                _ => return None,
            },
            _ => return None,
        };
        let mut added_strings = Vec::new();
        let mut added_ids = Vec::new();
        let mut decoder: Vec<(u32, tokenizers::AddedToken)> =
            tokenizer.get_added_tokens_decoder().into_iter().collect();
        decoder.sort_by_key(|(id, _)| *id);
        for (id, token) in decoder {
            if token.single_word || token.lstrip || token.rstrip || token.normalized {
                return None;
            }
            added_strings.push(token.content);
            added_ids.push(id);
        }
        let added = if added_strings.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&added_strings)
                    .ok()?,
            )
        };
        let mut encoder = Self {
            mark: meta.get_replacement(),
            prepend: meta.get_prepend_scheme(),
            added,
            added_ids,
            special_prefix: Vec::new(),
            special_suffix: Vec::new(),
            cache: (0..SHARDS).map(|_| RwLock::default()).collect(),
        };
        // The post-processor's additions, from one probe: what the pipeline adds around "a".
        let plain = tokenizer.encode_fast("a", false).ok()?.get_ids().to_vec();
        let with = tokenizer.encode_fast("a", true).ok()?.get_ids().to_vec();
        let at = (0..=with.len().checked_sub(plain.len())?)
            .find(|&i| with[i..i + plain.len()] == plain[..])?;
        encoder.special_prefix = with[..at].to_vec();
        encoder.special_suffix = with[at + plain.len()..].to_vec();
        Some(encoder)
    }

    /// The ids of `text`, as the pipeline gives them.
    /// Bytes the word cache holds now (its entries' cost).
    #[cfg(test)]
    pub(crate) fn cached_bytes(&self) -> usize {
        self.cache.iter().map(|s| s.read().bytes).sum()
    }

    pub(crate) fn encode(
        &self,
        model: &ModelWrapper,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, String> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        if add_special_tokens {
            ids.extend_from_slice(&self.special_prefix);
        }
        let mut at = 0;
        if let Some(added) = &self.added {
            for m in added.find_iter(text) {
                self.encode_section(model, text, at, m.start(), &mut ids)?;
                ids.push(self.added_ids[m.pattern().as_usize()]);
                at = m.end();
            }
        }
        self.encode_section(model, text, at, text.len(), &mut ids)?;
        if add_special_tokens {
            ids.extend_from_slice(&self.special_suffix);
        }
        Ok(ids)
    }

    /// The ids of `text[start..end]`, a stretch between added tokens.
    fn encode_section(
        &self,
        model: &ModelWrapper,
        text: &str,
        start: usize,
        end: usize,
        ids: &mut Vec<u32>,
    ) -> Result<(), String> {
        if start == end {
            return Ok(());
        }
        let section = &text[start..end];
        let mut replaced = String::with_capacity(section.len() + 8);
        let begins_with_mark = section.starts_with(' ') || section.starts_with(self.mark);
        let prepend = match self.prepend {
            PrependScheme::Always => !begins_with_mark,
            PrependScheme::First => !begins_with_mark && start == 0,
            PrependScheme::Never => false,
        };
        if prepend {
            replaced.push(self.mark);
        }
        for c in section.chars() {
            replaced.push(if c == ' ' { self.mark } else { c });
        }
        // Words: a run of marks starts a word; text before the first run is a word of its own.
        let mut word_start = 0;
        let mut previous_mark = true;
        for (i, c) in replaced.char_indices() {
            let mark = c == self.mark;
            if mark && !previous_mark && i > word_start {
                self.encode_word(model, &replaced[word_start..i], ids)?;
                word_start = i;
            }
            previous_mark = mark;
        }
        if word_start < replaced.len() {
            self.encode_word(model, &replaced[word_start..], ids)?;
        }
        Ok(())
    }

    fn encode_word(
        &self,
        model: &ModelWrapper,
        word: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), String> {
        let shard = &self.cache[(xxhash_rust::xxh3::xxh3_64(word.as_bytes()) as usize) % SHARDS];
        if let Some(cached) = shard.read().words.get(word) {
            ids.extend_from_slice(cached);
            return Ok(());
        }
        let tokens = model.tokenize(word).map_err(|e| e.to_string())?;
        if word.len() > MAX_CACHED_WORD {
            ids.extend(tokens.iter().map(|t| t.id));
            return Ok(());
        }
        let word_ids: Box<[u32]> = tokens.iter().map(|t| t.id).collect();
        ids.extend_from_slice(&word_ids);
        let cost = WordShard::cost(word, &word_ids);
        let mut shard = shard.write();
        if shard.bytes + cost > SHARD_BYTES {
            shard.words = HashMap::default();
            shard.bytes = 0;
        }
        if shard.words.insert(word.into(), word_ids).is_none() {
            shard.bytes += cost;
        }
        Ok(())
    }
}
