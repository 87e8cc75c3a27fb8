//! vLLM's replay socket: a publisher configured with `replay_endpoint` keeps its last batches
//! (`buffer_steps`, 10,000 by default) and sends them again on request, so a subscriber that
//! missed some (a sequence gap, a late start) can fill them in instead of forgetting what it
//! knew.
//!
//! The exchange, as `ZmqEventPublisher` serves it on a ROUTER socket: the client sends an empty
//! delimiter and the first sequence number it wants (8 bytes, big-endian); the publisher answers
//! with one message per buffered batch from there on — delimiter, topic, sequence number,
//! msgpack payload (vLLM 0.32; earlier versions sent no topic) — and ends with the sequence
//! number −1 and an empty payload.
//!
//! [`serve_replay`] is the publisher's side, for the simulator and tests.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use zeromq::{SocketRecv, SocketSend, ZmqMessage};

use crate::events::{decode_message, EventMessage};
use crate::zmtp::{Connection, Limits, SocketType};

/// The sequence number that ends a replay (−1 as vLLM writes it).
pub const END_OF_REPLAY: [u8; 8] = (-1i64).to_be_bytes();

/// Batches taken from one replay at most (vLLM keeps 10,000 by default).
const MAX_REPLAYED: usize = 1 << 17;

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("cannot reach the replay socket {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("the replay from {endpoint} failed: {reason}")]
    Exchange { endpoint: String, reason: String },
    #[error("the replay from {endpoint} did not end within {timeout:?}")]
    Timeout { endpoint: String, timeout: Duration },
}

/// What a replay brought.
#[derive(Debug)]
pub enum Replayed {
    /// Every batch from the wanted one on, in order, without a hole (none: the publisher has
    /// published nothing from there on).
    Filled(Vec<EventMessage>),
    /// The publisher no longer holds the wanted batch (its buffer starts later, at `first`):
    /// what was missed cannot be filled in.
    Lost { first: u64 },
}

/// Asks the publisher's replay socket at `endpoint` for every batch from `from` on; the whole
/// exchange takes at most `timeout`, each message at most `limits`, all of them together at
/// most [`MAX_REPLAY_BYTES`].
pub async fn replay(
    endpoint: &str,
    from: u64,
    limits: Limits,
    timeout: Duration,
) -> Result<Replayed, ReplayError> {
    match tokio::time::timeout(timeout, exchange(endpoint, from, limits, timeout)).await {
        Ok(result) => result,
        Err(_) => Err(ReplayError::Timeout {
            endpoint: endpoint.to_owned(),
            timeout,
        }),
    }
}

/// The payload bytes one replay may bring at most.
pub const MAX_REPLAY_BYTES: usize = 256 << 20;

async fn exchange(
    endpoint: &str,
    from: u64,
    limits: Limits,
    timeout: Duration,
) -> Result<Replayed, ReplayError> {
    let mut socket = Connection::connect(endpoint, SocketType::Dealer, limits, timeout)
        .await
        .map_err(|e| ReplayError::Connect {
            endpoint: endpoint.to_owned(),
            reason: e.to_string(),
        })?;
    let failed = |reason: String| ReplayError::Exchange {
        endpoint: endpoint.to_owned(),
        reason,
    };
    socket
        .send(&[b"", &from.to_be_bytes()])
        .await
        .map_err(|e| failed(e.to_string()))?;
    let mut messages: Vec<EventMessage> = Vec::new();
    let mut bytes = 0usize;
    loop {
        let message = socket.recv().await.map_err(|e| failed(e.to_string()))?;
        let mut frames: Vec<&[u8]> = message.iter().map(|f| f.as_ref()).collect();
        // The delimiter the ROUTER put first, where it arrives.
        if frames.first().is_some_and(|f| f.is_empty()) {
            frames.remove(0);
        }
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] | [seq, payload] => (*seq, *payload),
            _ => return Err(failed(format!("a message of {} frames", frames.len()))),
        };
        if seq == END_OF_REPLAY {
            return Ok(Replayed::Filled(messages));
        }
        bytes += payload.len();
        if bytes > MAX_REPLAY_BYTES {
            return Err(failed(format!("more than {MAX_REPLAY_BYTES} bytes")));
        }
        let message = decode_message(&[b"", seq, payload]).map_err(|e| failed(e.to_string()))?;
        let Some(expected) = from.checked_add(messages.len() as u64) else {
            return Err(failed("sequence numbers past 2^64".into()));
        };
        if message.seq != expected {
            // The buffer starts later than wanted (dropping the socket ends the exchange).
            if messages.is_empty() && message.seq > from {
                return Ok(Replayed::Lost { first: message.seq });
            }
            return Err(failed(format!(
                "batch {} where {expected} was due",
                message.seq
            )));
        }
        if messages.len() >= MAX_REPLAYED {
            return Err(failed(format!("more than {MAX_REPLAYED} batches")));
        }
        messages.push(message);
    }
}

/// The publisher's side: the last `capacity` batches it sent, as (sequence number, payload).
#[derive(Debug)]
pub struct ReplayBuffer {
    batches: VecDeque<(u64, Bytes)>,
    capacity: usize,
}

impl ReplayBuffer {
    pub fn new(capacity: usize) -> Self {
        Self {
            batches: VecDeque::with_capacity(capacity.min(1 << 14)),
            capacity,
        }
    }

    /// Keeps a batch just published.
    pub fn push(&mut self, seq: u64, payload: Bytes) {
        if self.batches.len() >= self.capacity {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// The answer to a request (the frames after the client's identity), as messages to send.
    fn answer(&self, request: &[&[u8]]) -> Vec<ZmqMessage> {
        let from = match request {
            [[], seq] => <[u8; 8]>::try_from(*seq).ok(),
            _ => None,
        };
        let Some(from) = from.map(u64::from_be_bytes) else {
            return Vec::new();
        };
        let mut answer: Vec<ZmqMessage> = self
            .batches
            .iter()
            .filter(|(seq, _)| *seq >= from)
            .map(|(seq, payload)| frames(&seq.to_be_bytes(), payload.clone()))
            .collect();
        answer.push(frames(&END_OF_REPLAY, Bytes::new()));
        answer
    }
}

/// Delimiter, topic (empty), sequence number, payload: vLLM 0.32's replay message.
fn frames(seq: &[u8], payload: Bytes) -> ZmqMessage {
    let mut message = ZmqMessage::from(Bytes::new());
    message.push_back(Bytes::new());
    message.push_back(Bytes::copy_from_slice(seq));
    message.push_back(payload);
    message
}

/// Answers replay requests on `socket` (a bound ROUTER) from what `buffer` holds, until the
/// socket fails. Malformed requests are ignored, as vLLM ignores them.
pub async fn serve_replay(
    mut socket: zeromq::RouterSocket,
    buffer: std::sync::Arc<parking_lot::Mutex<ReplayBuffer>>,
) {
    while let Ok(request) = socket.recv().await {
        let mut frames = request.into_vec();
        if frames.is_empty() {
            continue;
        }
        let identity = frames.remove(0);
        let request: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        let answer = buffer.lock().answer(&request);
        for mut message in answer {
            message.push_front(identity.clone());
            if socket.send(message).await.is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_answers_from_the_wanted_batch_and_ends() {
        let mut buffer = ReplayBuffer::new(3);
        for seq in 0..5u64 {
            buffer.push(seq, Bytes::from(vec![seq as u8]));
        }
        // Only the last three are kept.
        let answer = buffer.answer(&[b"", &1u64.to_be_bytes()]);
        let seqs: Vec<Vec<u8>> = answer.iter().map(|m| m.get(2).unwrap().to_vec()).collect();
        assert_eq!(
            seqs,
            vec![
                2u64.to_be_bytes().to_vec(),
                3u64.to_be_bytes().to_vec(),
                4u64.to_be_bytes().to_vec(),
                END_OF_REPLAY.to_vec()
            ]
        );
        assert_eq!(buffer.answer(&[b"", &4u64.to_be_bytes()]).len(), 2);
        assert!(buffer.answer(&[b"x", &4u64.to_be_bytes()]).is_empty());
        assert!(buffer.answer(&[b"", b"short"]).is_empty());
    }
}
