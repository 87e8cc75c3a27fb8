//! What replicas say to each other on the bus, and how it is framed.
//!
//! A frame is a 4-byte tag (`PRB` + version), then an LZ4 block (its size prepended) of one
//! MessagePack value. Compression pays because a batch's decisions repeat each other's
//! leading chunk hashes (a shared system prompt, earlier turns of a conversation). Decoding
//! checks the tag and bounds the decompressed size before allocating, so a foreign or hostile
//! message costs a counter, never a panic or a large allocation.
//!
//! With the fleet's shared key ([`BusKey`]) a frame is `PRB2`, the HMAC-SHA256 of the rest,
//! the message's kind (one byte: a batch cannot be replayed as a snapshot), then the LZ4 block;
//! a frame whose tag does not verify is refused before it is decompressed. Without a key,
//! frames are `PRB1` and the LZ4 block.

use serde::{Deserialize, Serialize};

use super::auth::{BusKey, TAG_LEN};

/// The frame tag of unauthenticated frames.
pub const TAG: [u8; 4] = *b"PRB1";
/// The frame tag of frames authenticated with the fleet's key.
pub const SIGNED_TAG: [u8; 4] = *b"PRB2";

/// What a frame holds (bound into an authenticated frame's tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Batch = 1,
    SnapshotRequest = 2,
    SnapshotPart = 3,
}
/// The largest decompressed message accepted.
pub const MAX_DECODED: usize = 16 << 20;

/// One routing decision: a request with these string-index chunks (and, in precise mode,
/// these token-block names) went to `backend` at `t_ms` (Unix time, milliseconds).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sent {
    pub backend: u64,
    pub t_ms: u64,
    pub chunks: Vec<u64>,
    pub blocks: Option<Vec<u64>>,
    /// The request string's length in bytes (None from replicas before it).
    #[serde(default)]
    pub bytes: Option<u64>,
    /// The block size `blocks` are named under (None from replicas before it).
    #[serde(default)]
    pub block_size: Option<u32>,
}

/// This replica's own load on one backend, whole (not a delta): a lost message is healed
/// by the next one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load {
    pub backend: u64,
    pub inflight: u64,
    pub waiting_first_byte: u64,
    pub queued_prefill_tokens: u64,
    /// Milliseconds since this replica last saw the backend's prefill queue move (a first
    /// byte, a request leaving without one, or a queue forming where none waited), as of
    /// sending: the others' stall clocks start from it. An age, not a time, so that replicas'
    /// clocks need not agree. None from replicas before it.
    #[serde(default)]
    pub queue_moved_ms_ago: Option<u64>,
}

/// A streamed request's first byte, as [`crate::core::prefill::FirstByte`] (times in
/// microseconds, KV usage in millionths: integers, so no NaN crosses the bus).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirstByte {
    pub backend: u64,
    pub work: u64,
    pub uncached: u64,
    pub ttft_us: u64,
    pub under_way_us: u64,
    pub kv_usage_ppm: u32,
}

/// The most prompt tokens an observation may claim (a hundred times the longest contexts
/// served today): beyond, it is a broken or hostile peer's, and would wreck the line.
const MAX_WORK: u64 = 1 << 27;
/// The longest TTFT (or queue under way) an observation may claim.
const MAX_SECONDS_US: u64 = 3_600_000_000;

impl FirstByte {
    pub fn from_seen(backend: u64, seen: &crate::core::prefill::FirstByte) -> Self {
        let us = |s: f64| (s.max(0.0) * 1e6).round() as u64;
        Self {
            backend,
            work: seen.work,
            uncached: seen.uncached,
            ttft_us: us(seen.ttft_s),
            under_way_us: us(seen.under_way_s),
            kv_usage_ppm: (seen.kv_usage.clamp(0.0, 1.0) * 1e6).round() as u32,
        }
    }

    /// The observation, if it is one a backend could have produced.
    pub fn seen(&self) -> Option<crate::core::prefill::FirstByte> {
        let plausible = self.work <= MAX_WORK
            && self.uncached <= self.work
            && self.ttft_us <= MAX_SECONDS_US
            && self.under_way_us <= MAX_SECONDS_US
            && self.kv_usage_ppm <= 1_000_000;
        plausible.then(|| crate::core::prefill::FirstByte {
            work: self.work,
            uncached: self.uncached,
            ttft_s: self.ttft_us as f64 / 1e6,
            under_way_s: self.under_way_us as f64 / 1e6,
            kv_usage: f64::from(self.kv_usage_ppm) / 1e6,
        })
    }
}

/// A request ended at `backend`: `last` is its chain's last hash (its [`Sent::chunks`]'
/// last, unless those were cut short).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ended {
    pub backend: u64,
    pub last: u64,
}

/// What one replica publishes every few milliseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The sender (a random id chosen at start).
    pub replica: u64,
    pub seq: u64,
    pub sent: Vec<Sent>,
    /// Its load on every backend it knows, when it changed (and as a heartbeat).
    pub load: Option<Vec<Load>>,
    /// Backends it just found unhealthy.
    #[serde(default)]
    pub unhealthy: Vec<u64>,
    /// First bytes it saw, for the others' prefill lines. Empty from replicas before it.
    #[serde(default)]
    pub first_bytes: Vec<FirstByte>,
    /// Requests that ended. None from replicas before it (which tell no ends: their
    /// prompts in flight are not tracked).
    #[serde(default)]
    pub ended: Option<Vec<Ended>>,
    /// When it was sent (Unix ms): an authenticated frame much older or newer than the
    /// receiver's clock is a replay. None from replicas before it.
    #[serde(default)]
    pub at_ms: Option<u64>,
}

/// A replica asks for a peer's string index, to be answered on `inbox` (bound into the
/// authenticated request, so a captured request cannot be redirected to another inbox).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    pub replica: u64,
    pub at_ms: u64,
    pub inbox: String,
}

/// A server's index entries in a snapshot: `(server, [(hash, depth, last_used ms)])`.
pub type ServerEntries = (u64, Vec<(u64, u32, u64)>);

/// A slice of a replica's string index, answering a peer's snapshot request: servers with
/// their entries `(hash, depth, last_used ms)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotPart {
    pub replica: u64,
    pub part: u32,
    pub parts: u32,
    pub servers: Vec<ServerEntries>,
}

/// Why a message was not applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("not a replica-bus frame (foreign or of another version)")]
    Foreign,
    #[error("declared size {0} is above the limit")]
    TooLarge(usize),
    #[error("bad compression: {0}")]
    Compression(String),
    #[error("bad message: {0}")]
    Message(String),
    #[error("not authenticated with the fleet's key")]
    Unauthenticated,
}

impl DecodeError {
    /// A metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Foreign => "foreign",
            Self::TooLarge(_) => "too_large",
            Self::Compression(_) => "compression",
            Self::Message(_) => "malformed",
            Self::Unauthenticated => "unauthenticated",
        }
    }
}

/// Frames a message of `kind`, with the fleet's key when it has one.
pub fn encode<T: Serialize>(message: &T, kind: Kind, key: Option<&BusKey>) -> Vec<u8> {
    let packed = rmp_serde::to_vec(message).expect("bus messages serialize");
    let compressed = lz4_flex::compress_prepend_size(&packed);
    match key {
        None => {
            let mut out = Vec::with_capacity(TAG.len() + compressed.len());
            out.extend_from_slice(&TAG);
            out.extend_from_slice(&compressed);
            out
        }
        Some(key) => {
            let kind = [kind as u8];
            let tag = key.tag(&[&SIGNED_TAG, &kind, &compressed]);
            let mut out = Vec::with_capacity(SIGNED_TAG.len() + TAG_LEN + 1 + compressed.len());
            out.extend_from_slice(&SIGNED_TAG);
            out.extend_from_slice(&tag);
            out.extend_from_slice(&kind);
            out.extend_from_slice(&compressed);
            out
        }
    }
}

/// Reads a framed message of `kind`: with a key, only one whose tag verifies under it.
pub fn decode<T: for<'de> Deserialize<'de>>(
    frame: &[u8],
    kind: Kind,
    key: Option<&BusKey>,
) -> Result<T, DecodeError> {
    let body = match key {
        None => frame.strip_prefix(&TAG).ok_or(DecodeError::Foreign)?,
        Some(key) => {
            let signed = frame
                .strip_prefix(&SIGNED_TAG)
                .ok_or(DecodeError::Unauthenticated)?;
            if signed.len() < TAG_LEN + 1 {
                return Err(DecodeError::Unauthenticated);
            }
            let (tag, rest) = signed.split_at(TAG_LEN);
            if !key.verify(&[&SIGNED_TAG, rest], tag) {
                return Err(DecodeError::Unauthenticated);
            }
            if rest[0] != kind as u8 {
                return Err(DecodeError::Foreign);
            }
            &rest[1..]
        }
    };
    let size = body
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or_else(|| DecodeError::Compression("no size".into()))?;
    if size > MAX_DECODED {
        return Err(DecodeError::TooLarge(size));
    }
    let packed = lz4_flex::decompress_size_prepended(body)
        .map_err(|e| DecodeError::Compression(e.to_string()))?;
    rmp_serde::from_slice(&packed).map_err(|e| DecodeError::Message(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn batch() -> Batch {
        Batch {
            replica: 7,
            seq: 3,
            sent: vec![Sent {
                backend: u64::MAX,
                t_ms: 1_700_000_000_000,
                chunks: vec![1, 2, u64::MAX],
                blocks: Some(vec![9]),
                bytes: Some(300),
                block_size: Some(16),
            }],
            load: Some(vec![Load {
                backend: 5,
                inflight: 2,
                waiting_first_byte: 1,
                queued_prefill_tokens: 900,
                queue_moved_ms_ago: Some(40),
            }]),
            unhealthy: vec![5],
            first_bytes: vec![FirstByte {
                backend: 5,
                work: 2_300,
                uncached: 100,
                ttft_us: 41_000,
                under_way_us: 7_000,
                kv_usage_ppm: 250_000,
            }],
            ended: Some(vec![Ended {
                backend: 5,
                last: u64::MAX,
            }]),
            at_ms: Some(1_700_000_000_000),
        }
    }

    #[test]
    fn a_batch_survives_the_round_trip() {
        assert_eq!(
            decode::<Batch>(&encode(&batch(), Kind::Batch, None), Kind::Batch, None),
            Ok(batch())
        );
    }

    /// A decision as replicas sent it before they told the request string's length.
    #[derive(Serialize)]
    struct EarlierSent {
        backend: u64,
        t_ms: u64,
        chunks: Vec<u64>,
        blocks: Option<Vec<u64>>,
    }

    /// A load table as replicas sent it before they said when their queues moved.
    #[derive(Serialize)]
    struct EarlierLoad {
        backend: u64,
        inflight: u64,
        waiting_first_byte: u64,
        queued_prefill_tokens: u64,
    }

    #[derive(Serialize)]
    struct EarlierBatch {
        replica: u64,
        seq: u64,
        sent: Vec<EarlierSent>,
        load: Option<Vec<EarlierLoad>>,
        unhealthy: Vec<u64>,
    }

    #[test]
    fn an_earlier_replicas_batch_is_read_without_what_it_did_not_tell() {
        let earlier = EarlierBatch {
            replica: 7,
            seq: 3,
            sent: batch()
                .sent
                .into_iter()
                .map(|s| EarlierSent {
                    backend: s.backend,
                    t_ms: s.t_ms,
                    chunks: s.chunks,
                    blocks: s.blocks,
                })
                .collect(),
            load: Some(vec![EarlierLoad {
                backend: 5,
                inflight: 2,
                waiting_first_byte: 1,
                queued_prefill_tokens: 900,
            }]),
            unhealthy: vec![5],
        };
        let mut expected = batch();
        expected.load.as_mut().unwrap()[0].queue_moved_ms_ago = None;
        expected.first_bytes.clear();
        expected.ended = None;
        expected.at_ms = None;
        expected.sent[0].bytes = None;
        expected.sent[0].block_size = None;
        assert_eq!(
            decode::<Batch>(&encode(&earlier, Kind::Batch, None), Kind::Batch, None),
            Ok(expected)
        );
    }

    #[test]
    fn a_first_byte_crosses_the_bus_as_seen() {
        let seen = crate::core::prefill::FirstByte {
            work: 2_300,
            uncached: 100,
            ttft_s: 0.041,
            under_way_s: 0.007,
            kv_usage: 0.25,
        };
        let sent = FirstByte::from_seen(5, &seen);
        let back = decode::<FirstByte>(&encode(&sent, Kind::Batch, None), Kind::Batch, None)
            .unwrap()
            .seen()
            .unwrap();
        assert_eq!(back, seen);
    }

    #[test]
    fn an_implausible_first_byte_is_not_learned() {
        let fine = batch().first_bytes[0];
        assert!(fine.seen().is_some());
        for broken in [
            FirstByte {
                work: u64::MAX,
                ..fine
            },
            FirstByte {
                uncached: fine.work + 1,
                ..fine
            },
            FirstByte {
                ttft_us: u64::MAX,
                ..fine
            },
            FirstByte {
                under_way_us: MAX_SECONDS_US + 1,
                ..fine
            },
            FirstByte {
                kv_usage_ppm: 1_000_001,
                ..fine
            },
        ] {
            assert_eq!(broken.seen(), None, "{broken:?}");
        }
    }

    #[test]
    fn repeated_prefixes_compress() {
        let shared: Vec<u64> = (0..64u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let mut b = batch();
        b.sent = (0..100)
            .map(|i| Sent {
                backend: i % 4,
                t_ms: 1_700_000_000_000 + i,
                chunks: shared.iter().copied().chain([i]).collect(),
                blocks: None,
                bytes: None,
                block_size: None,
            })
            .collect();
        let framed = encode(&b, Kind::Batch, None).len();
        let raw = 100 * 65 * 8;
        assert!(framed * 4 < raw, "{framed} bytes framed for {raw} raw");
    }

    #[test]
    fn foreign_and_broken_frames_are_refused() {
        assert_eq!(
            decode::<Batch>(b"{\"hello\":1}", Kind::Batch, None),
            Err(DecodeError::Foreign)
        );
        let mut bomb = TAG.to_vec();
        bomb.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode::<Batch>(&bomb, Kind::Batch, None),
            Err(DecodeError::TooLarge(u32::MAX as usize))
        );
        let mut truncated = encode(&batch(), Kind::Batch, None);
        truncated.truncate(truncated.len() - 3);
        assert!(decode::<Batch>(&truncated, Kind::Batch, None).is_err());
        let other = encode(&("not", "a", "batch"), Kind::Batch, None);
        assert_eq!(
            decode::<Batch>(&other, Kind::Batch, None).map_err(|e| e.label()),
            Err("malformed")
        );
    }

    /// With the fleet's key, a frame is read only when its tag verifies: a forged one, one
    /// under another key, an unauthenticated one, one damaged after signing, or one of another
    /// kind is refused before it is decompressed.
    #[test]
    fn only_frames_tagged_with_the_fleets_key_are_read() {
        let key = BusKey::new(b"the fleet's key, long enough").unwrap();
        let other = BusKey::new(b"another fleet's key, as long").unwrap();
        let signed = encode(&batch(), Kind::Batch, Some(&key));
        assert_eq!(
            decode::<Batch>(&signed, Kind::Batch, Some(&key)),
            Ok(batch())
        );
        let refused = |frame: &[u8]| {
            decode::<Batch>(frame, Kind::Batch, Some(&key))
                .map_err(|e| e.label())
                .err()
        };
        assert_eq!(
            refused(&encode(&batch(), Kind::Batch, Some(&other))),
            Some("unauthenticated")
        );
        assert_eq!(
            refused(&encode(&batch(), Kind::Batch, None)),
            Some("unauthenticated")
        );
        let mut damaged = signed.clone();
        *damaged.last_mut().unwrap() ^= 1;
        assert_eq!(refused(&damaged), Some("unauthenticated"));
        let mut forged = signed.clone();
        forged[SIGNED_TAG.len()] ^= 1;
        assert_eq!(refused(&forged), Some("unauthenticated"));
        assert_eq!(refused(&signed[..20]), Some("unauthenticated"));
        assert_eq!(
            decode::<Batch>(&signed, Kind::SnapshotPart, Some(&key)).map_err(|e| e.label()),
            Err("foreign"),
            "a batch is no snapshot part"
        );
        assert_eq!(
            decode::<Batch>(&signed, Kind::Batch, None).map_err(|e| e.label()),
            Err("foreign"),
            "a replica without the key reads no signed frame"
        );
    }

    proptest! {
        #[test]
        fn no_input_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let key = BusKey::new(b"a key of the fleet, 32 bytes long").unwrap();
            let _ = decode::<Batch>(&bytes, Kind::Batch, None);
            let _ = decode::<Batch>(&bytes, Kind::Batch, Some(&key));
            for tag in [TAG, SIGNED_TAG] {
                let mut tagged = tag.to_vec();
                tagged.extend_from_slice(&bytes);
                let _ = decode::<Batch>(&tagged, Kind::Batch, None);
                let _ = decode::<SnapshotPart>(&tagged, Kind::SnapshotPart, Some(&key));
            }
        }
    }
}
