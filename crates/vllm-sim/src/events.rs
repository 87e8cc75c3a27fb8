//! Publishes a server's KV-cache changes as vLLM does: a ZMQ PUB socket, three-frame messages
//! (topic, 8-byte big-endian sequence number, msgpack batch), map-shaped events — so that
//! precise routing is tested and benchmarked against the simulator as against vLLM. Like vLLM
//! with a `replay_endpoint`, it keeps its last batches and sends them again on request.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::sync::mpsc;
use vllm_protocol::{
    encode_batch, BlockRemoved, BlockStored, EventBatch, ExternalHash, KvEvent, ReplayBuffer,
};
use zeromq::{Socket, SocketSend, ZmqMessage};

use crate::kv_cache::CacheEvent;

/// A running publisher: where subscribers connect, and where the engine sends its changes.
pub struct Publisher {
    /// `tcp://127.0.0.1:PORT`
    pub endpoint: String,
    /// The replay socket (ROUTER), `tcp://127.0.0.1:PORT`.
    pub replay: String,
    pub changes: mpsc::UnboundedSender<Vec<CacheEvent>>,
}

/// Batches kept for replay (vLLM's default `buffer_steps`).
const REPLAY_BATCHES: usize = 10_000;

/// Binds a PUB socket and a replay socket on free loopback ports and publishes what comes in on
/// the returned channel, one batch per message, until the channel closes.
pub async fn start(block_size: usize) -> anyhow::Result<Publisher> {
    let mut socket = zeromq::PubSocket::new();
    let bound = socket.bind("tcp://127.0.0.1:0").await?;
    let endpoint = bound.to_string();
    let mut replay_socket = zeromq::RouterSocket::new();
    let replay = replay_socket.bind("tcp://127.0.0.1:0").await?.to_string();
    let buffer = Arc::new(Mutex::new(ReplayBuffer::new(REPLAY_BATCHES)));
    let replay_task = tokio::spawn(vllm_protocol::replay::serve_replay(
        replay_socket,
        buffer.clone(),
    ));
    let (changes, mut incoming) = mpsc::unbounded_channel::<Vec<CacheEvent>>();
    tokio::spawn(async move {
        // The replay socket closes with the publisher.
        let _replay_task = AbortOnDrop(replay_task);
        let mut seq: u64 = 0;
        while let Some(mut events) = incoming.recv().await {
            // Whatever else is waiting goes in the same batch (vLLM batches per engine step).
            while let Ok(more) = incoming.try_recv() {
                events.extend(more);
            }
            let batch = EventBatch {
                ts: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64()),
                events: events
                    .into_iter()
                    .filter_map(|e| to_vllm(e, block_size))
                    .collect(),
                data_parallel_rank: Some(0),
                skipped: Vec::new(),
            };
            let payload = bytes::Bytes::from(encode_batch(&batch));
            let mut message = ZmqMessage::from(Vec::<u8>::new());
            message.push_back(seq.to_be_bytes().to_vec().into());
            message.push_back(payload.clone());
            buffer.lock().push(seq, payload);
            if socket.send(message).await.is_err() {
                return;
            }
            seq += 1;
        }
    });
    Ok(Publisher {
        endpoint,
        replay,
        changes,
    })
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn to_vllm(event: CacheEvent, block_size: usize) -> Option<KvEvent> {
    Some(match event {
        CacheEvent::Stored {
            hashes,
            parent,
            tokens,
        } => KvEvent::Stored(BlockStored {
            block_hashes: hashes.into_iter().map(ExternalHash).collect(),
            parent: parent.map(ExternalHash),
            // Real tokenizer ids fit (the byte model's do not: events need `--tokenizer`).
            token_ids: tokens
                .into_iter()
                .map(|t| u32::try_from(t).ok())
                .collect::<Option<Vec<u32>>>()?,
            block_size: block_size as u32,
            lora: None,
            medium: Some("GPU".into()),
            extra_keys: false,
            group_idx: Some(0),
        }),
        CacheEvent::Removed(hash) => KvEvent::Removed(BlockRemoved {
            block_hashes: vec![ExternalHash(hash)],
            medium: Some("GPU".into()),
            group_idx: Some(0),
        }),
        CacheEvent::Cleared => KvEvent::AllCleared,
    })
}
