//! Requests that continue a prompt another router replica has in flight.
//!
//! A conversation's next turn (an agent's next step) carries the previous turn's prompt and
//! answer: its client has read that answer, so the previous request has ended, whatever the
//! replica that sent it has told the others yet. Clients that answer at once and are spread
//! over replicas (an agent's tool loop behind a load balancer) send the next turn before the
//! previous replica's load table arrives, and the turn then found the backend holding its
//! history one request busier than it was: through 4 replicas on 8 sims the load guard sent
//! 52–58 of 256 turns away from their history against 10–11 through one router (a 20 ms pause
//! between turns removed the difference, a bus flushing every 0.5 ms instead of 5 did not).
//! The replica bus says which prompts each peer has in flight (the last hash of their chain and
//! their length); a request whose string is longer and begins with one of them (the same
//! prompt again is a sibling, not a continuation) is routed as if that request had ended.

use std::collections::HashMap;

use prefix_index::{PrefixHasher, ServerId};

/// A prompt in flight through another replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptInFlight {
    pub backend: ServerId,
    /// Its request string's length in bytes.
    pub bytes: u64,
    /// The last hash of its chain.
    pub last: u64,
}

/// The other replicas' prompts in flight, by the hash of their last full chunk (which every
/// string they begin shares, where the last, partial one is not).
#[derive(Debug, Default)]
pub struct PromptsElsewhere(HashMap<u64, Vec<PromptInFlight>, foldhash::fast::FixedState>);

impl PromptsElsewhere {
    /// From each prompt's last full chunk's hash and the prompt.
    pub fn new(prompts: impl IntoIterator<Item = (u64, PromptInFlight)>) -> Self {
        let mut map: HashMap<u64, Vec<PromptInFlight>, _> = HashMap::default();
        for (full, prompt) in prompts {
            let at = map.entry(full).or_default();
            if !at.contains(&prompt) {
                at.push(prompt);
            }
        }
        Self(map)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The backends where a prompt that `text` (of chain `chain`) continues is in flight (a
    /// backend at most once).
    pub fn continued(&self, hasher: &PrefixHasher, chain: &[u64], text: &[u8]) -> Vec<ServerId> {
        let mut out = Vec::new();
        if self.0.is_empty() {
            return out;
        }
        for (i, prompts) in chain
            .iter()
            .enumerate()
            .filter_map(|(i, h)| Some((i, self.0.get(h)?)))
        {
            for p in prompts {
                let Ok(len) = usize::try_from(p.bytes) else {
                    continue;
                };
                let continues = len < text.len()
                    && len / hasher.chunk_size() == i + 1
                    && hasher.last_hash_of_prefix(chain, text, len) == Some(p.last);
                if continues && !out.contains(&p.backend) {
                    out.push(p.backend);
                }
            }
        }
        out
    }
}

/// The hash `prompts` are kept by for a prompt of `bytes` bytes and chain `chain`: its last
/// full chunk's (None for a prompt shorter than a chunk, or a chain too short for its length).
pub fn last_full_chunk(hasher: &PrefixHasher, chain: &[u64], bytes: u64) -> Option<u64> {
    let full = usize::try_from(bytes / hasher.chunk_size() as u64).ok()?;
    full.checked_sub(1).and_then(|i| chain.get(i)).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_flight(hasher: &PrefixHasher, backend: ServerId, text: &str) -> (u64, PromptInFlight) {
        let chain = hasher.hash(text.as_bytes());
        let chain = chain.as_slice();
        let full = last_full_chunk(hasher, chain, text.len() as u64).unwrap();
        let prompt = PromptInFlight {
            backend,
            bytes: text.len() as u64,
            last: *chain.last().unwrap(),
        };
        (full, prompt)
    }

    fn continued(elsewhere: &PromptsElsewhere, hasher: &PrefixHasher, text: &str) -> Vec<u64> {
        elsewhere.continued(
            hasher,
            hasher.hash(text.as_bytes()).as_slice(),
            text.as_bytes(),
        )
    }

    #[test]
    fn a_request_continues_the_prompts_it_begins_with() {
        let h = PrefixHasher::new(16, 1).unwrap();
        let system = "You are a helpful assistant. Answer briefly. ";
        let turn1 = format!("{system}user: what is a prefix cache?");
        let other = format!("{system}user: what is a KV event?");
        let elsewhere = PromptsElsewhere::new([
            in_flight(&h, 1, &turn1),
            in_flight(&h, 1, &turn1),
            in_flight(&h, 2, &other),
        ]);
        // The next turn holds the first turn's prompt and its answer.
        let turn2 = format!("{turn1} assistant: reused KV blocks. user: and eviction?");
        assert_eq!(continued(&elsewhere, &h, &turn2), vec![1]);
        // The same prompt again (a sibling, a repetition) continues nothing.
        assert!(continued(&elsewhere, &h, &turn1).is_empty());
        // Nor does a sibling sharing the system prompt and the last full chunk of another's
        // but not its last few bytes.
        let sibling = format!("{system}user: what is a prefix cache!? tell me more");
        let (full, _) = in_flight(&h, 1, &turn1);
        assert!(h.hash(sibling.as_bytes()).as_slice().contains(&full));
        assert!(continued(&elsewhere, &h, &sibling).is_empty());
        assert!(continued(&elsewhere, &h, "").is_empty());
        assert!(continued(&PromptsElsewhere::default(), &h, &turn2).is_empty());
    }
}
