//! The SQLite store: the memory store made durable by a journal.
//!
//! Every change (notify, drop, set_capacity, purge) is first appended to a journal table and
//! committed — one small row, one sequential write — and then applied to an in-memory
//! [`MemoryStore`], which answers queries. At open, the last snapshot is loaded and the journal
//! replayed in order; because the memory store is deterministic, the state is exactly the one
//! before (a process killed with SIGKILL keeps every change it acknowledged: WAL journal mode, a
//! commit reaches the operating system before the call returns). When the journal grows long,
//! the state is written as a new snapshot and the journal emptied.
//!
//! One process owns a database file (a second one is refused while the first holds it); to
//! share state between processes, use the PostgreSQL store.
//!
//! Writes run on a thread of their own, in order: a commit, and the occasional snapshot that
//! rewrites the whole index, never block an async worker (the caller awaits the answer), and
//! queries read the memory store without waiting for either.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use crate::sql::{self, APPLICATION, SCHEMA_VERSION};
use crate::store::{check_candidates, check_capacity};
use crate::{
    MemoryStore, NotifyOutcome, PrefixHashes, PrefixStore, QueryOutcome, ServerId, ServerInfo,
    StoreConfig, StoreError, Tick,
};

const SCHEMA_V1: &str = "
CREATE TABLE prefix_router_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE prefix_router_snapshot_servers (
    server_id INTEGER PRIMARY KEY,
    capacity INTEGER NOT NULL
);
CREATE TABLE prefix_router_snapshot_entries (
    server_id INTEGER NOT NULL,
    hash INTEGER NOT NULL,
    depth INTEGER NOT NULL,
    last_used INTEGER NOT NULL
);
CREATE TABLE prefix_router_journal (
    seq INTEGER PRIMARY KEY,
    op INTEGER NOT NULL,
    server_id INTEGER NOT NULL,
    t INTEGER NOT NULL,
    arg INTEGER NOT NULL,
    hashes BLOB
);
";

/// Journal rows after which the state is written as a snapshot.
const COMPACT_AFTER: u64 = 100_000;

#[derive(Clone, Copy)]
#[repr(i64)]
enum Op {
    Notify = 1,
    Drop = 2,
    SetCapacity = 3,
    Purge = 4,
}

fn db_error(e: rusqlite::Error) -> StoreError {
    StoreError::Unavailable(format!("sqlite: {e}"))
}

struct Journal {
    conn: Connection,
    rows: u64,
    /// Rows after which the state is written as a snapshot.
    compact_after: u64,
}

/// One change for the writer thread: it appends the journal row, applies the change to memory
/// and answers.
type Job = Box<dyn FnOnce(&mut Journal, &MemoryStore) + Send>;

/// The SQLite-backed prefix store.
pub struct SqliteStore {
    memory: Arc<MemoryStore>,
    /// To the writer thread, which owns the connection: journal order is memory order.
    writer: Option<std::sync::mpsc::Sender<Job>>,
    /// Joined on drop, so the file is free again (for a reopen) once the store is gone.
    thread: Option<std::thread::JoinHandle<()>>,
    path: PathBuf,
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        self.writer.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn blob(hashes: &PrefixHashes) -> Vec<u8> {
    hashes
        .as_slice()
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect()
}

fn unblob(bytes: &[u8]) -> PrefixHashes {
    PrefixHashes::from_raw(
        bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect(),
    )
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path`: checks or creates its schema, loads
    /// the snapshot and replays the journal.
    pub fn open(path: &Path, config: StoreConfig) -> Result<Self, StoreError> {
        Self::open_compacting_after(path, config, COMPACT_AFTER)
    }

    /// [`SqliteStore::open`], writing a snapshot every `compact_after` journal rows.
    pub fn open_compacting_after(
        path: &Path,
        config: StoreConfig,
        compact_after: u64,
    ) -> Result<Self, StoreError> {
        Self::open_inner(path, config, compact_after.max(1)).map_err(|e| match e {
            StoreError::Unavailable(m) if m.contains("database is locked") || m.contains("busy") => {
                StoreError::Unavailable(format!(
                    "{} is in use by another process (one process owns a SQLite store; share state through PostgreSQL)",
                    path.display()
                ))
            }
            other => other,
        })
    }

    fn open_inner(
        path: &Path,
        config: StoreConfig,
        compact_after: u64,
    ) -> Result<Self, StoreError> {
        config.validate()?;
        let mut conn = Connection::open(path).map_err(|e| {
            StoreError::Unavailable(format!(
                "cannot open SQLite database {}: {e}",
                path.display()
            ))
        })?;
        conn.busy_timeout(std::time::Duration::from_millis(100))
            .map_err(db_error)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(db_error)?;
        // With WAL, NORMAL loses no committed transaction when the process dies; only an
        // operating-system crash or power loss can take the last ones.
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(db_error)?;
        // The file is this process's: a second process gets a clear error, not a stale copy.
        conn.pragma_update(None, "locking_mode", "EXCLUSIVE")
            .map_err(db_error)?;
        migrate(&mut conn, path)?;
        let memory = Arc::new(MemoryStore::new(config)?);
        let rows = load(&conn, &memory)?;
        let mut journal = Journal {
            conn,
            rows,
            compact_after,
        };
        if rows > 0 {
            compact(&mut journal, &memory)?;
        }
        let (writer, jobs) = std::sync::mpsc::channel::<Job>();
        let state = memory.clone();
        let thread = std::thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || {
                // Ends when the store (the only sender) is dropped.
                for job in jobs {
                    job(&mut journal, &state);
                }
            })
            .map_err(|e| StoreError::Unavailable(format!("cannot start the SQLite writer: {e}")))?;
        Ok(Self {
            memory,
            writer: Some(writer),
            thread: Some(thread),
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one change to the journal (committed), then applies it to memory, on the
    /// writer thread; resolves when both are done.
    async fn record<T: Send + 'static>(
        &self,
        op: Op,
        server: ServerId,
        t: i64,
        arg: i64,
        hashes: Option<&PrefixHashes>,
        apply: impl FnOnce(&MemoryStore) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let hashes = hashes.map(blob);
        let (answer, answered) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |journal, memory| {
            let _ = answer.send(append(journal, op, server, t, arg, hashes).and_then(|()| {
                let result = apply(memory)?;
                if journal.rows >= journal.compact_after {
                    compact(journal, memory)?;
                }
                Ok(result)
            }));
        });
        let gone = || StoreError::Unavailable("sqlite: the writer thread has stopped".into());
        self.writer
            .as_ref()
            .ok_or_else(gone)?
            .send(job)
            .map_err(|_| gone())?;
        answered.await.map_err(|_| gone())?
    }
}

/// Appends one row to the journal (committed when this returns).
fn append(
    journal: &mut Journal,
    op: Op,
    server: ServerId,
    t: i64,
    arg: i64,
    hashes: Option<Vec<u8>>,
) -> Result<(), StoreError> {
    journal
        .conn
        .prepare_cached(
            "INSERT INTO prefix_router_journal (op, server_id, t, arg, hashes) VALUES (?1, ?2, ?3, ?4, ?5)",
        )
        .and_then(|mut s| s.execute(params![op as i64, sql::encode(server), t, arg, hashes]))
        .map_err(db_error)?;
    journal.rows += 1;
    Ok(())
}

/// Writes the whole state as the new snapshot and empties the journal, in one transaction.
fn compact(journal: &mut Journal, memory: &MemoryStore) -> Result<(), StoreError> {
    let state = memory.export();
    let tx = journal
        .conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db_error)?;
    tx.execute_batch(
        "DELETE FROM prefix_router_snapshot_entries; DELETE FROM prefix_router_snapshot_servers;
         DELETE FROM prefix_router_journal;",
    )
    .map_err(db_error)?;
    {
        let mut server_row = tx
            .prepare(
                "INSERT INTO prefix_router_snapshot_servers (server_id, capacity) VALUES (?1, ?2)",
            )
            .map_err(db_error)?;
        let mut entry_row = tx
            .prepare(
                "INSERT INTO prefix_router_snapshot_entries (server_id, hash, depth, last_used) VALUES (?1, ?2, ?3, ?4)",
            )
            .map_err(db_error)?;
        for (server, capacity, entries) in &state {
            let server = sql::encode(*server);
            server_row
                .execute(params![server, *capacity as i64])
                .map_err(db_error)?;
            for &(hash, depth, t) in entries {
                entry_row
                    .execute(params![server, sql::encode(hash), depth, t.millis() as i64])
                    .map_err(db_error)?;
            }
        }
    }
    tx.commit().map_err(db_error)?;
    journal.rows = 0;
    Ok(())
}

/// Loads the snapshot into `memory` and replays the journal; returns the journal's length.
fn load(conn: &Connection, memory: &MemoryStore) -> Result<u64, StoreError> {
    let servers: Vec<(i64, i64)> = conn
        .prepare("SELECT server_id, capacity FROM prefix_router_snapshot_servers")
        .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
        .map_err(db_error)?;
    let mut entries: std::collections::HashMap<i64, Vec<(u64, u32, Tick)>> = Default::default();
    conn.prepare("SELECT server_id, hash, depth, last_used FROM prefix_router_snapshot_entries")
        .and_then(|mut s| {
            let rows = s.query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                ))
            })?;
            for row in rows {
                let (server, hash, depth, t) = row?;
                entries.entry(server).or_default().push((
                    sql::decode(hash),
                    depth as u32,
                    Tick::from_millis(t as u64),
                ));
            }
            Ok(())
        })
        .map_err(db_error)?;
    for (server, capacity) in servers {
        let mut list = entries.remove(&server).unwrap_or_default();
        memory.restore(sql::decode(server), capacity as u64, &mut list)?;
    }
    let mut replayed = 0;
    let mut stmt = conn
        .prepare("SELECT op, server_id, t, arg, hashes FROM prefix_router_journal ORDER BY seq")
        .map_err(db_error)?;
    let mut rows = stmt.query([]).map_err(db_error)?;
    while let Some(row) = rows.next().map_err(db_error)? {
        let op: i64 = row.get(0).map_err(db_error)?;
        let server = sql::decode(row.get(1).map_err(db_error)?);
        let t = Tick::from_millis(row.get::<_, i64>(2).map_err(db_error)? as u64);
        let arg: i64 = row.get(3).map_err(db_error)?;
        let hashes: Option<Vec<u8>> = row.get(4).map_err(db_error)?;
        match op {
            x if x == Op::Notify as i64 => {
                memory.notify_now(&unblob(&hashes.unwrap_or_default()), server, t)?;
            }
            x if x == Op::Drop as i64 => {
                memory.drop_server_now(server);
            }
            x if x == Op::SetCapacity as i64 => {
                memory.set_capacity_now(server, arg as u64)?;
            }
            x if x == Op::Purge as i64 => {
                memory.purge_expired_now(t);
            }
            other => {
                return Err(StoreError::Incompatible(format!(
                    "unknown journal operation {other}"
                )))
            }
        }
        replayed += 1;
    }
    Ok(replayed)
}

/// Creates the schema of an empty database, accepts ours, refuses anything else.
fn migrate(conn: &mut Connection, path: &Path) -> Result<(), StoreError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db_error)?;
    let has_meta: bool = tx
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'prefix_router_meta'",
            [],
            |r| r.get::<_, i64>(0),
        )
        .map_err(db_error)?
        > 0;
    if !has_meta {
        let ours: i64 = tx
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name LIKE 'prefix_router_%'",
                [],
                |r| r.get(0),
            )
            .map_err(db_error)?;
        if ours > 0 {
            return Err(StoreError::Incompatible(format!(
                "{} has prefix_router tables but no prefix_router_meta: a foreign schema",
                path.display()
            )));
        }
        tx.execute_batch(SCHEMA_V1).map_err(db_error)?;
        tx.execute(
            "INSERT INTO prefix_router_meta (key, value) VALUES ('application', ?1), ('schema_version', ?2)",
            params![APPLICATION, SCHEMA_VERSION.to_string()],
        )
        .map_err(db_error)?;
        return tx.commit().map_err(db_error);
    }
    let meta = |key: &str| -> Result<Option<String>, StoreError> {
        tx.query_row(
            "SELECT value FROM prefix_router_meta WHERE key = ?1",
            [key],
            |r| r.get(0),
        )
        .optional()
        .map_err(db_error)
    };
    let verdict = match (meta("application")?, meta("schema_version")?) {
        (Some(app), Some(version)) if app == APPLICATION => match version.parse::<i64>() {
            Ok(v) if v == SCHEMA_VERSION => Ok(()),
            Ok(v) if v > SCHEMA_VERSION => Err(StoreError::Incompatible(format!(
                "{} has schema version {v}, newer than this build's {SCHEMA_VERSION}: upgrade prefix-router",
                path.display()
            ))),
            _ => Err(StoreError::Incompatible(format!(
                "{} has an unknown schema version {version:?}",
                path.display()
            ))),
        },
        (app, _) => Err(StoreError::Incompatible(format!(
            "{} belongs to another application ({app:?}), not {APPLICATION}",
            path.display()
        ))),
    };
    verdict?;
    tx.commit().map_err(db_error)
}

#[async_trait]
impl PrefixStore for SqliteStore {
    async fn notify(
        &self,
        hashes: &PrefixHashes,
        server: ServerId,
        t: Tick,
    ) -> Result<NotifyOutcome, StoreError> {
        let owned = hashes.clone();
        self.record(
            Op::Notify,
            server,
            t.millis() as i64,
            0,
            Some(hashes),
            move |m| m.notify_now(&owned, server, t),
        )
        .await
    }

    async fn query(
        &self,
        hashes: &PrefixHashes,
        candidates: &[ServerId],
        t: Tick,
    ) -> Result<QueryOutcome, StoreError> {
        check_candidates(candidates)?;
        self.memory.query_now(hashes, candidates, t)
    }

    async fn drop_server(&self, server: ServerId) -> Result<u64, StoreError> {
        self.record(Op::Drop, server, 0, 0, None, move |m| {
            Ok(m.drop_server_now(server))
        })
        .await
    }

    async fn set_capacity(&self, server: ServerId, capacity: u64) -> Result<u64, StoreError> {
        check_capacity(capacity)?;
        self.record(
            Op::SetCapacity,
            server,
            0,
            capacity as i64,
            None,
            move |m| m.set_capacity_now(server, capacity),
        )
        .await
    }

    async fn servers(&self) -> Result<Vec<ServerInfo>, StoreError> {
        Ok(self.memory.servers_now())
    }

    async fn purge_expired(&self, now: Tick) -> Result<u64, StoreError> {
        self.record(Op::Purge, 0, now.millis() as i64, 0, None, move |m| {
            Ok(m.purge_expired_now(now))
        })
        .await
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_round_trip() {
        let hashes = crate::PrefixHasher::new(3, 1).unwrap().hash(b"abcdefghij");
        assert_eq!(unblob(&blob(&hashes)), hashes);
    }
}
