//! prefix-index: the string server's core, without HTTP.
//!
//! A request string is cut into fixed-size byte chunks; every prefix is named by a chained
//! 64-bit hash ([`PrefixHasher`]). A [`PrefixStore`] remembers, per server, which prefixes were
//! recently sent there (`notify`) and answers which candidate holds the longest prefix of a new
//! request (`query`), with a per-server LRU capacity. See `DESIGN.md` for the idea.
//!
//! Stores: [`MemoryStore`] (fastest, lost on restart), [`SqliteStore`] (embedded, durable),
//! [`PostgresStore`] (shared by several processes).
// One reviewed `unsafe` (a transparent cast in memory/shard.rs) is allowed where it is.
#![deny(unsafe_code)]

pub mod blocks;
pub mod hashing;
pub mod memory;
pub mod postgres;
pub mod reference;
pub mod sql;
pub mod sqlite;
pub mod store;
pub mod time;

pub use blocks::{BlockError, BlockHasher, BlockIndex};
pub use hashing::{PrefixHasher, PrefixHashes, DEFAULT_CHUNK_SIZE};
pub use memory::MemoryStore;
pub use postgres::PostgresStore;
pub use reference::ReferenceStore;
pub use sqlite::SqliteStore;
pub use store::{
    NotifyOutcome, PrefixStore, QueryOutcome, ServerId, ServerInfo, StoreConfig, StoreError,
    DEFAULT_CAPACITY, MAX_CAPACITY,
};
pub use time::{now_secs, Tick};
