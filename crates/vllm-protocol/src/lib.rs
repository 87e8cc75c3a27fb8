//! vLLM's wire formats, shared by the router (to read a backend's KV-cache events) and the
//! simulator (to publish them): it knows vLLM, not routing.
//!
//! - [`events`]: KV-cache event batches (msgpack) and the three-frame ZMQ messages carrying
//!   them, decoded leniently and never with a panic.
//! - [`zmtp`]: ZeroMQ's wire protocol (SUB and DEALER over TCP), every frame bounded before
//!   it is read.
//! - [`subscriber`]: a ZMQ SUB connection to one publisher, reconnecting when it goes away.
//! - [`replay`]: the publisher's replay socket, to fill in batches a subscriber missed.
//! - [`tokenizer`]: a request's token ids exactly as vLLM computes them (chat template and
//!   tokenizer of the model), or an error where that cannot be reproduced.
#![forbid(unsafe_code)]

pub mod events;
pub mod msgpack;
pub mod replay;
pub mod subscriber;
pub mod tokenizer;
mod word_encoder;
pub mod zmtp;

pub use events::{
    decode_batch, decode_message, encode_batch, BlockRemoved, BlockStored, EventBatch, EventError,
    EventMessage, ExternalHash, KvEvent,
};
pub use replay::{replay, ReplayBuffer, ReplayError, Replayed};
pub use subscriber::{Received, Subscriber};
pub use tokenizer::{ChatTokenizer, TokenizeError};
pub use zmtp::Limits as FrameLimits;
