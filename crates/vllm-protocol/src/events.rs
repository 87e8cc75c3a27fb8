//! vLLM's KV-cache events, as its ZMQ publisher sends them (`vllm/distributed/kv_events.py`).
//!
//! A message is three frames: a topic, an 8-byte big-endian sequence number, and a msgpack
//! payload: the batch `[ts, events, data_parallel_rank]`. An event is a map with a `"type"`
//! key (vLLM ≥ 0.26) or, from older vLLM, an array whose first element is that type name and
//! whose next elements are the fields in declaration order:
//!
//! - `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...}`
//! - `BlockRemoved {block_hashes, medium, group_idx, ...}`
//! - `AllBlocksCleared {}`
//!
//! Block hashes are ints or bytes. Decoding never panics: a malformed batch is an error, an
//! unknown or malformed event inside a good batch is skipped and reported.

use rmpv::Value;

use crate::msgpack::{Cursor, ReadError};

/// A block hash as vLLM published it, as a key: an int as is, bytes by their xxh3 (vLLM's hashes
/// are not reproduced here, only matched).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExternalHash(pub u64);

/// Blocks a server has just cached.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<ExternalHash>,
    /// The block before the first of these (None: they start a prompt).
    pub parent: Option<ExternalHash>,
    /// `block_size` tokens per block, in order.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    /// The LoRA adapter (its name, else its id): blocks of different adapters never match.
    pub lora: Option<String>,
    /// `"GPU"` for the prefix cache; other media are offloading tiers.
    pub medium: Option<String>,
    /// Whether any block's hash has extra keys (images, cache salt, prompt embeddings): such
    /// blocks cannot be matched from token ids alone.
    pub extra_keys: bool,
    pub group_idx: Option<u32>,
}

impl BlockStored {
    /// Whether these blocks are the GPU prefix cache's and can be matched from token ids alone
    /// (not an offloading tier, not a LoRA adapter's, no extra keys such as images).
    pub fn is_matchable(&self) -> bool {
        self.medium.as_deref().is_none_or(|m| m == "GPU") && self.lora.is_none() && !self.extra_keys
    }
}

/// Blocks a server has evicted.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<ExternalHash>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
}

impl BlockRemoved {
    /// Whether these blocks left the GPU prefix cache (not an offloading tier).
    pub fn is_gpu(&self) -> bool {
        self.medium.as_deref().is_none_or(|m| m == "GPU")
    }
}

/// The hashes as plain numbers (the block index's keys).
pub fn raw_hashes(hashes: &[ExternalHash]) -> Vec<u64> {
    hashes.iter().map(|h| h.0).collect()
}

#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    Stored(BlockStored),
    Removed(BlockRemoved),
    /// The server's prefix cache was emptied (e.g. `/reset_prefix_cache`).
    AllCleared,
}

/// One published batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The publisher's clock (unix seconds).
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<u32>,
    /// Events that could not be read (unknown type, wrong field types), skipped.
    pub skipped: Vec<EventError>,
}

/// Why a message or an event could not be read.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EventError {
    #[error("a message has {0} frames, not 3 (topic, sequence, payload)")]
    Frames(usize),
    #[error("the sequence frame has {0} bytes, not 8")]
    Sequence(usize),
    #[error("the payload is not msgpack: {0}")]
    Msgpack(String),
    #[error("the batch is not [ts, events, dp_rank]: {0}")]
    Batch(&'static str),
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    #[error("event {kind}: field {field} {problem}")]
    Field {
        kind: &'static str,
        field: &'static str,
        problem: &'static str,
    },
    #[error("an event is neither a map nor a tagged array")]
    Shape,
}

/// A decoded message: its topic, sequence number and batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EventMessage {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub batch: EventBatch,
}

/// Decodes the three frames of one ZMQ message.
pub fn decode_message(frames: &[&[u8]]) -> Result<EventMessage, EventError> {
    let [topic, seq, payload] = frames else {
        return Err(EventError::Frames(frames.len()));
    };
    let seq: [u8; 8] = (*seq)
        .try_into()
        .map_err(|_| EventError::Sequence(seq.len()))?;
    Ok(EventMessage {
        topic: topic.to_vec(),
        seq: u64::from_be_bytes(seq),
        batch: decode_batch(payload)?,
    })
}

/// Nesting deeper than this is no batch of vLLM's (its deepest is extra_keys' tuples).
const MAX_DEPTH: usize = 16;

impl From<ReadError> for EventError {
    fn from(e: ReadError) -> Self {
        EventError::Msgpack(e.to_string())
    }
}

/// Decodes one msgpack payload, reading it in place: token ids and hashes go straight into
/// their vectors (no value per element), and every declared length is checked against the
/// bytes left before anything is reserved.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, EventError> {
    let mut c = Cursor::new(payload);
    let Some(parts) = c.array()? else {
        c.skip(MAX_DEPTH)?;
        return Err(EventError::Batch("not an array"));
    };
    if parts == 0 {
        return Err(EventError::Batch("no timestamp"));
    }
    let Some(ts) = c.float()? else {
        return Err(EventError::Batch("no timestamp"));
    };
    if parts < 2 {
        return Err(EventError::Batch("no list of events"));
    }
    let Some(count) = c.array()? else {
        return Err(EventError::Batch("no list of events"));
    };
    let mut events = Vec::with_capacity(count.min(1024));
    let mut skipped = Vec::new();
    for _ in 0..count {
        // Where the event ends is found first, so a bad field skips only its event.
        let mut probe = c;
        probe.skip(MAX_DEPTH)?;
        let mut one = c;
        match decode_event(&mut one) {
            Ok(e) => events.push(e),
            Err(EventError::Msgpack(m)) => return Err(EventError::Msgpack(m)),
            Err(e) => skipped.push(e),
        }
        c = probe;
    }
    let data_parallel_rank = if parts >= 3 {
        let rank = c
            .int()?
            .and_then(|(v, negative)| (!negative).then_some(v).and_then(|v| u32::try_from(v).ok()));
        if rank.is_none() {
            c.skip(MAX_DEPTH)?;
        }
        rank
    } else {
        None
    };
    for _ in 3..parts {
        c.skip(MAX_DEPTH)?;
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
        skipped,
    })
}

/// A field as read: absent (or nil), a value, or a value of the wrong kind.
#[derive(Default)]
enum Field<T> {
    #[default]
    Absent,
    Read(T),
    Wrong,
}

impl<T> Field<T> {
    /// The value, if present and of the right kind; an error if of the wrong kind.
    fn optional(
        self,
        kind: &'static str,
        field: &'static str,
        problem: &'static str,
    ) -> Result<Option<T>, EventError> {
        match self {
            Field::Absent => Ok(None),
            Field::Read(v) => Ok(Some(v)),
            Field::Wrong => Err(EventError::Field {
                kind,
                field,
                problem,
            }),
        }
    }

    fn required(
        self,
        kind: &'static str,
        field: &'static str,
        problem: &'static str,
    ) -> Result<T, EventError> {
        self.optional(kind, field, problem)?
            .ok_or(EventError::Field {
                kind,
                field,
                problem,
            })
    }

    /// The value if it was read; absent or wrong alike give nothing (lenient fields).
    fn ok(self) -> Option<T> {
        match self {
            Field::Read(v) => Some(v),
            _ => None,
        }
    }
}

/// The fields of one event that this crate reads, whichever of vLLM's two shapes it came in.
#[derive(Default)]
struct RawEvent {
    block_hashes: Field<Vec<ExternalHash>>,
    parent: Field<ExternalHash>,
    token_ids: Field<Vec<u32>>,
    block_size: Field<u32>,
    lora_id: Field<String>,
    lora_name: Field<String>,
    medium: Field<String>,
    extra_keys: Field<bool>,
    group_idx: Field<u32>,
}

/// Field order of the array shape, after the tag.
const STORED_ORDER: [&str; 7] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
];
const REMOVED_ORDER: [&str; 2] = ["block_hashes", "medium"];

impl RawEvent {
    /// Reads the value of field `name` into its place (the caller passes over the value).
    fn read(&mut self, name: &[u8], c: &mut Cursor<'_>) -> Result<(), EventError> {
        if c.nil()? {
            return Ok(());
        }
        match name {
            b"block_hashes" => self.block_hashes = hashes(c)?,
            b"parent_block_hash" => self.parent = field(hash(c)?),
            b"token_ids" => self.token_ids = token_ids(c)?,
            b"block_size" => self.block_size = field(small(c)?),
            b"lora_id" => self.lora_id = field(text(c)?),
            b"lora_name" => self.lora_name = field(text(c)?),
            b"medium" => self.medium = field(text(c)?),
            b"group_idx" => self.group_idx = field(small(c)?),
            b"extra_keys" => self.extra_keys = extra_keys(c)?,
            _ => {}
        }
        Ok(())
    }
}

fn field<T>(v: Option<T>) -> Field<T> {
    v.map_or(Field::Wrong, Field::Read)
}

/// Python ints (vLLM's hashes are 64-bit, taken modulo 2^64 when negative) as they are, bytes
/// by their xxh3.
fn hash(c: &mut Cursor<'_>) -> Result<Option<ExternalHash>, ReadError> {
    if let Some((v, _)) = c.int()? {
        return Ok(Some(ExternalHash(v)));
    }
    Ok(c.bin()?
        .map(|b| ExternalHash(xxhash_rust::xxh3::xxh3_64(b))))
}

/// A non-negative integer that fits in 32 bits.
fn small(c: &mut Cursor<'_>) -> Result<Option<u32>, ReadError> {
    Ok(c.int()?
        .and_then(|(v, negative)| (!negative).then_some(v))
        .and_then(|v| u32::try_from(v).ok()))
}

/// A string, or an integer as its decimal text.
fn text(c: &mut Cursor<'_>) -> Result<Option<String>, ReadError> {
    if let Some(s) = c.str()? {
        return Ok(std::str::from_utf8(s).ok().map(str::to_owned));
    }
    Ok(c.int()?.map(|(v, negative)| {
        if negative {
            (v as i64).to_string()
        } else {
            v.to_string()
        }
    }))
}

fn hashes(c: &mut Cursor<'_>) -> Result<Field<Vec<ExternalHash>>, EventError> {
    let Some(n) = c.array()? else {
        return Ok(Field::Wrong);
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        match hash(c)? {
            Some(h) => out.push(h),
            None => return Ok(Field::Wrong),
        }
    }
    Ok(Field::Read(out))
}

fn token_ids(c: &mut Cursor<'_>) -> Result<Field<Vec<u32>>, EventError> {
    let Some(n) = c.array()? else {
        return Ok(Field::Wrong);
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        match small(c)? {
            Some(t) => out.push(t),
            None => return Ok(Field::Wrong),
        }
    }
    Ok(Field::Read(out))
}

/// Whether any block has extra keys (any element not nil).
fn extra_keys(c: &mut Cursor<'_>) -> Result<Field<bool>, EventError> {
    let Some(n) = c.array()? else {
        return Ok(Field::Wrong);
    };
    let mut any = false;
    for _ in 0..n {
        if !c.nil()? {
            any = true;
            c.skip(MAX_DEPTH)?;
        }
    }
    Ok(Field::Read(any))
}

fn kind_of(name: &[u8]) -> Option<&'static str> {
    ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        .into_iter()
        .find(|k| k.as_bytes() == name)
}

/// Reads one event (the cursor is left anywhere inside it: the caller knows where it ends).
fn decode_event(c: &mut Cursor<'_>) -> Result<KvEvent, EventError> {
    let mut raw = RawEvent::default();
    let kind = if let Some(pairs) = c.map()? {
        let mut kind = None;
        for _ in 0..pairs {
            let Some(key) = c.str()? else {
                c.skip(MAX_DEPTH)?;
                c.skip(MAX_DEPTH)?;
                continue;
            };
            if key == b"type" {
                let name = c.str()?.ok_or(EventError::Shape)?;
                kind = Some(kind_of(name).ok_or_else(|| unknown(name))?);
                continue;
            }
            let mut value = *c;
            c.skip(MAX_DEPTH)?;
            raw.read(key, &mut value)?;
        }
        kind.ok_or(EventError::Shape)?
    } else if let Some(items) = c.array()? {
        let name = match items {
            0 => None,
            _ => c.str()?,
        };
        let name = name.ok_or(EventError::Shape)?;
        let kind = kind_of(name).ok_or_else(|| unknown(name))?;
        let order: &[&str] = match kind {
            "BlockStored" => &STORED_ORDER,
            "BlockRemoved" => &REMOVED_ORDER,
            _ => &[],
        };
        for i in 0..items - 1 {
            let mut value = *c;
            c.skip(MAX_DEPTH)?;
            if let Some(name) = order.get(i) {
                raw.read(name.as_bytes(), &mut value)?;
            }
        }
        kind
    } else {
        return Err(EventError::Shape);
    };
    build(kind, raw)
}

fn unknown(name: &[u8]) -> EventError {
    EventError::UnknownType(String::from_utf8_lossy(name).chars().take(64).collect())
}

fn build(kind: &'static str, raw: RawEvent) -> Result<KvEvent, EventError> {
    match kind {
        "BlockStored" => {
            let block_hashes = raw.block_hashes.required(
                kind,
                "block_hashes",
                "is missing or not a list of hashes",
            )?;
            let parent = raw
                .parent
                .optional(kind, "parent_block_hash", "is no hash")?;
            let token_ids = raw.token_ids.required(
                kind,
                "token_ids",
                "is missing or not a list of token ids",
            )?;
            let block_size = raw
                .block_size
                .required(kind, "block_size", "is missing or not a positive integer")
                .and_then(|b| {
                    (b > 0).then_some(b).ok_or(EventError::Field {
                        kind,
                        field: "block_size",
                        problem: "is missing or not a positive integer",
                    })
                })?;
            Ok(KvEvent::Stored(BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora: raw.lora_name.ok().or(raw.lora_id.ok()),
                medium: raw.medium.ok(),
                extra_keys: raw.extra_keys.ok().unwrap_or(false),
                group_idx: raw.group_idx.ok(),
            }))
        }
        "BlockRemoved" => Ok(KvEvent::Removed(BlockRemoved {
            block_hashes: raw.block_hashes.required(
                kind,
                "block_hashes",
                "is missing or not a list of hashes",
            )?,
            medium: raw.medium.ok(),
            group_idx: raw.group_idx.ok(),
        })),
        _ => Ok(KvEvent::AllCleared),
    }
}

/// Encodes a batch as vLLM ≥ 0.26 does (events as maps with `"type"`): what the simulator
/// publishes, so that it speaks vLLM's wire format.
pub fn encode_batch(batch: &EventBatch) -> Vec<u8> {
    let s = |x: &str| Value::from(x);
    let hashes = |h: &[ExternalHash]| Value::Array(h.iter().map(|h| Value::from(h.0)).collect());
    let opt = |o: &Option<String>| o.as_deref().map_or(Value::Nil, Value::from);
    let events = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::Stored(b) => Value::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), hashes(&b.block_hashes)),
                (
                    s("parent_block_hash"),
                    b.parent.map_or(Value::Nil, |p| Value::from(p.0)),
                ),
                (
                    s("token_ids"),
                    Value::Array(b.token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                (s("block_size"), Value::from(b.block_size)),
                (s("lora_id"), Value::Nil),
                (s("medium"), opt(&b.medium)),
                (s("lora_name"), opt(&b.lora)),
                (
                    s("extra_keys"),
                    Value::Array(vec![Value::Nil; b.block_hashes.len()]),
                ),
                (s("group_idx"), b.group_idx.map_or(Value::Nil, Value::from)),
                (s("kv_cache_spec_kind"), s("full_attention")),
            ]),
            KvEvent::Removed(b) => Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), hashes(&b.block_hashes)),
                (s("medium"), opt(&b.medium)),
                (s("group_idx"), b.group_idx.map_or(Value::Nil, Value::from)),
            ]),
            KvEvent::AllCleared => Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        })
        .collect();
    let value = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(events),
        batch.data_parallel_rank.map_or(Value::Nil, Value::from),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &value).expect("writing to a Vec cannot fail");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch captured from vLLM 0.32 (CPU build, block size 32): one BlockStored of three
    /// blocks for a 100-token prompt.
    const VLLM_0_32_BATCH: &str = "93cb41dac460947059a9918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657393cf9eb5354dc09556b7cf716126dd596330facf513b";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
            .collect()
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> BlockStored {
        BlockStored {
            block_hashes: hashes.iter().map(|&h| ExternalHash(h)).collect(),
            parent: parent.map(ExternalHash),
            token_ids: tokens,
            block_size: 2,
            lora: None,
            medium: Some("GPU".into()),
            extra_keys: false,
            group_idx: Some(0),
        }
    }

    #[test]
    fn a_captured_prefix_is_a_map_shaped_batch() {
        // The capture is cut after the first hashes: decoding it must fail cleanly.
        let err = decode_batch(&unhex(VLLM_0_32_BATCH)).unwrap_err();
        assert!(matches!(err, EventError::Msgpack(_)), "{err}");
    }

    /// A batch with an event of every kind.
    fn every_kind() -> EventBatch {
        EventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::Stored(stored(&[1, 2], None, vec![5, 6, 7, 8])),
                KvEvent::Stored(stored(&[3], Some(2), vec![9, 10])),
                KvEvent::Removed(BlockRemoved {
                    block_hashes: vec![ExternalHash(3)],
                    medium: Some("GPU".into()),
                    group_idx: None,
                }),
                KvEvent::AllCleared,
            ],
            data_parallel_rank: Some(0),
            skipped: vec![],
        }
    }

    #[test]
    fn map_shaped_batches_round_trip() {
        let batch = every_kind();
        assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
    }

    #[test]
    fn tagged_arrays_from_older_vllm_decode() {
        let v = Value::Array(vec![
            Value::F64(2.0),
            Value::Array(vec![
                Value::Array(vec![
                    Value::from("BlockStored"),
                    Value::Array(vec![Value::Binary(vec![1, 2, 3]), Value::from(-5i64)]),
                    Value::Nil,
                    Value::Array((0..4u32).map(Value::from).collect()),
                    Value::from(2u32),
                    Value::Nil,
                ]),
                Value::Array(vec![
                    Value::from("BlockRemoved"),
                    Value::Array(vec![Value::from(7u64)]),
                ]),
                Value::Array(vec![Value::from("AllBlocksCleared")]),
            ]),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &v).unwrap();
        let batch = decode_batch(&bytes).unwrap();
        assert_eq!(batch.events.len(), 3, "{:?}", batch.skipped);
        let KvEvent::Stored(s) = &batch.events[0] else {
            panic!()
        };
        assert_eq!(
            s.block_hashes[0],
            ExternalHash(xxhash_rust::xxh3::xxh3_64(&[1, 2, 3]))
        );
        assert_eq!(s.block_hashes[1], ExternalHash(-5i64 as u64));
        assert_eq!((s.token_ids.len(), s.block_size, s.parent), (4, 2, None));
        assert_eq!(batch.events[2], KvEvent::AllCleared);
    }

    #[test]
    fn bad_events_are_skipped_and_bad_batches_refused() {
        let v = Value::Array(vec![
            Value::F64(2.0),
            Value::Array(vec![
                Value::Map(vec![(Value::from("type"), Value::from("Bogus"))]),
                Value::Map(vec![
                    (Value::from("type"), Value::from("BlockStored")),
                    (Value::from("block_hashes"), Value::from("no")),
                ]),
                Value::from(5),
                Value::Map(vec![(Value::from("type"), Value::from("AllBlocksCleared"))]),
            ]),
            Value::Nil,
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &v).unwrap();
        let batch = decode_batch(&bytes).unwrap();
        assert_eq!(batch.events, vec![KvEvent::AllCleared]);
        assert_eq!(batch.skipped.len(), 3);
        for bad in [&b""[..], b"\x90", b"\x92\xa1x\x90", b"\xdd\xff\xff\xff\xff"] {
            assert!(decode_batch(bad).is_err());
        }
        assert_eq!(
            decode_message(&[b"", b"\x00\x01", b""]).unwrap_err(),
            EventError::Sequence(2)
        );
    }

    proptest::proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = decode_batch(&bytes);
        }

        /// Damaged real batches (cut short, bytes changed) reach deeper than random bytes:
        /// every one decodes to something or an error, never a panic.
        #[test]
        fn damaged_batches_never_panic(
            cut in 0usize..400,
            flips in proptest::collection::vec((0usize..400, proptest::num::u8::ANY), 0..6),
        ) {
            let mut bytes = encode_batch(&every_kind());
            for (at, byte) in flips {
                let n = bytes.len();
                bytes[at % n] = byte;
            }
            bytes.truncate(cut.max(1));
            let _ = decode_batch(&bytes);
            let seq = 7u64.to_be_bytes();
            let _ = decode_message(&[b"kv", &seq, &bytes]);
        }
    }
}
