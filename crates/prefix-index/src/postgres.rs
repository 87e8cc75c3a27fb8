//! The PostgreSQL store: shared by several routers and string servers, the way to run more
//! than one router replica.
//!
//! Every operation is one round trip: notify, set_capacity, drop and purge are PL/pgSQL
//! functions installed with the schema, and query is one `SELECT`. A notify locks its server's
//! row for the length of its transaction, so concurrent notifies for one server from several
//! processes serialize: no lost updates, and the entry count is within capacity whenever no
//! notify is running. Connections come from a pool that replaces broken ones, so the store
//! reconnects by itself after an outage.

use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

use crate::sql::{self, APPLICATION, SCHEMA_VERSION};
use crate::store::{check_candidates, check_capacity};
use crate::{
    NotifyOutcome, PrefixHashes, PrefixStore, QueryOutcome, ServerId, ServerInfo, StoreConfig,
    StoreError, Tick,
};

const SCHEMA_V1: &str = r#"
CREATE TABLE prefix_router_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE prefix_router_servers (
    server_id BIGINT PRIMARY KEY,
    capacity BIGINT NOT NULL,
    entries BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE prefix_router_entries (
    hash BIGINT NOT NULL,
    server_id BIGINT NOT NULL,
    depth INTEGER NOT NULL,
    last_used BIGINT NOT NULL,
    PRIMARY KEY (hash, server_id)
);
CREATE INDEX prefix_router_entries_lru
    ON prefix_router_entries (server_id, last_used, depth DESC, hash);

CREATE FUNCTION prefix_router_evict(p_server BIGINT, p_excess BIGINT) RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE v_evicted BIGINT := 0;
BEGIN
    IF p_excess > 0 THEN
        WITH victims AS (
            SELECT hash FROM prefix_router_entries WHERE server_id = p_server
            ORDER BY last_used, depth DESC, hash LIMIT p_excess)
        DELETE FROM prefix_router_entries e USING victims v
        WHERE e.server_id = p_server AND e.hash = v.hash;
        GET DIAGNOSTICS v_evicted = ROW_COUNT;
    END IF;
    RETURN v_evicted;
END $$;

CREATE FUNCTION prefix_router_notify(
    p_server BIGINT, p_hashes BIGINT[], p_depths INT[], p_t BIGINT,
    p_default_capacity BIGINT, p_chunks BIGINT)
RETURNS TABLE (inserted BIGINT, evicted BIGINT)
LANGUAGE plpgsql AS $$
DECLARE
    v_capacity BIGINT; v_entries BIGINT; v_kept INT;
    v_inserted BIGINT := 0; v_evicted BIGINT; v_beyond BIGINT;
BEGIN
    -- Takes the server's row lock until commit: notifies for one server serialize.
    INSERT INTO prefix_router_servers AS s (server_id, capacity) VALUES (p_server, p_default_capacity)
        ON CONFLICT (server_id) DO UPDATE SET server_id = s.server_id
        RETURNING s.capacity, s.entries INTO v_capacity, v_entries;
    v_kept := LEAST(cardinality(p_hashes), v_capacity);
    v_beyond := p_chunks - LEAST(p_chunks, v_capacity);
    IF v_kept > 0 THEN
        WITH ins AS (
            INSERT INTO prefix_router_entries AS e (hash, server_id, depth, last_used)
            SELECT h, p_server, d, p_t FROM unnest(p_hashes[1:v_kept], p_depths[1:v_kept]) AS u(h, d)
            ON CONFLICT (hash, server_id) DO UPDATE SET last_used = GREATEST(e.last_used, EXCLUDED.last_used)
            RETURNING (xmax = 0) AS fresh)
        SELECT count(*) FILTER (WHERE fresh) INTO v_inserted FROM ins;
    END IF;
    v_entries := v_entries + v_inserted;
    v_evicted := prefix_router_evict(p_server, v_entries - v_capacity);
    UPDATE prefix_router_servers SET entries = v_entries - v_evicted WHERE server_id = p_server;
    RETURN QUERY SELECT v_inserted + v_beyond, v_evicted + v_beyond;
END $$;

CREATE FUNCTION prefix_router_set_capacity(p_server BIGINT, p_capacity BIGINT) RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE v_entries BIGINT; v_evicted BIGINT;
BEGIN
    INSERT INTO prefix_router_servers AS s (server_id, capacity) VALUES (p_server, p_capacity)
        ON CONFLICT (server_id) DO UPDATE SET capacity = EXCLUDED.capacity
        RETURNING s.entries INTO v_entries;
    v_evicted := prefix_router_evict(p_server, v_entries - p_capacity);
    UPDATE prefix_router_servers SET entries = v_entries - v_evicted WHERE server_id = p_server;
    RETURN v_evicted;
END $$;

CREATE FUNCTION prefix_router_drop(p_server BIGINT) RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE v_removed BIGINT;
BEGIN
    PERFORM 1 FROM prefix_router_servers WHERE server_id = p_server FOR UPDATE;
    DELETE FROM prefix_router_entries WHERE server_id = p_server;
    GET DIAGNOSTICS v_removed = ROW_COUNT;
    DELETE FROM prefix_router_servers WHERE server_id = p_server;
    RETURN v_removed;
END $$;

CREATE FUNCTION prefix_router_purge(p_cutoff BIGINT) RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE r RECORD; v_n BIGINT; v_total BIGINT := 0;
BEGIN
    -- Servers locked in id order: no deadlock with notifies, which lock one server each.
    FOR r IN SELECT server_id FROM prefix_router_servers ORDER BY server_id FOR UPDATE LOOP
        DELETE FROM prefix_router_entries WHERE server_id = r.server_id AND last_used < p_cutoff;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        IF v_n > 0 THEN
            UPDATE prefix_router_servers SET entries = entries - v_n WHERE server_id = r.server_id;
        END IF;
        v_total := v_total + v_n;
    END LOOP;
    RETURN v_total;
END $$;
"#;

fn db_error(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("postgres: {e}"))
}

/// The PostgreSQL-backed prefix store.
pub struct PostgresStore {
    pool: Pool,
    config: StoreConfig,
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host/db`, with libpq-style parameters such as
    /// `options=-csearch_path%3Dx`), then checks or creates the schema. Fails clearly when the
    /// database cannot be reached.
    pub async fn open(
        url: &str,
        config: StoreConfig,
        pool_size: usize,
    ) -> Result<Self, StoreError> {
        config.validate()?;
        let mut pg: tokio_postgres::Config = url
            .parse()
            .map_err(|e| StoreError::InvalidArgument(format!("invalid PostgreSQL URL: {e}")))?;
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(Duration::from_secs(5));
        }
        pg.application_name("prefix-router");
        // The index is a routing hint: a notify is visible to every process as soon as it
        // commits, and waiting for its WAL flush would cost a disk sync per request. A crash
        // of the database server can lose the last fraction of a second of notifies; a crash of
        // a router loses nothing.
        let options = pg.get_options().map(str::to_owned).unwrap_or_default();
        pg.options(format!("{options} -c synchronous_commit=off").trim());
        let manager = Manager::from_config(
            pg,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(5)))
            .create_timeout(Some(Duration::from_secs(5)))
            .recycle_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(|e| StoreError::InvalidArgument(format!("PostgreSQL pool: {e}")))?;
        let store = Self { pool, config };
        store.migrate().await?;
        Ok(store)
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(db_error)
    }

    /// Creates the schema of an empty database (under an advisory lock, so that routers
    /// starting together do not race), accepts ours, refuses anything else.
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut client = self
            .pool
            .get()
            .await
            .map_err(|e| StoreError::Unavailable(format!("cannot reach PostgreSQL: {e}")))?;
        let tx = client.transaction().await.map_err(db_error)?;
        tx.execute("SELECT pg_advisory_xact_lock(7364812398471)", &[])
            .await
            .map_err(db_error)?;
        let meta_exists: bool = tx
            .query_one("SELECT to_regclass('prefix_router_meta') IS NOT NULL", &[])
            .await
            .map_err(db_error)?
            .get(0);
        if !meta_exists {
            let ours: i64 = tx
                .query_one(
                    "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'prefix_router_%'",
                    &[],
                )
                .await
                .map_err(db_error)?
                .get(0);
            if ours > 0 {
                return Err(StoreError::Incompatible(
                    "the database has prefix_router tables but no prefix_router_meta: a foreign schema".into(),
                ));
            }
            tx.batch_execute(SCHEMA_V1).await.map_err(db_error)?;
            tx.execute(
                "INSERT INTO prefix_router_meta (key, value) VALUES ('application', $1), ('schema_version', $2)",
                &[&APPLICATION, &SCHEMA_VERSION.to_string()],
            )
            .await
            .map_err(db_error)?;
            return tx.commit().await.map_err(db_error);
        }
        let rows = tx
            .query("SELECT key, value FROM prefix_router_meta", &[])
            .await
            .map_err(db_error)?;
        let get = |key: &str| {
            rows.iter()
                .find(|r| r.get::<_, String>(0) == key)
                .map(|r| r.get::<_, String>(1))
        };
        match (get("application"), get("schema_version")) {
            (Some(app), Some(version)) if app == APPLICATION => match version.parse::<i64>() {
                Ok(v) if v == SCHEMA_VERSION => tx.commit().await.map_err(db_error),
                Ok(v) if v > SCHEMA_VERSION => Err(StoreError::Incompatible(format!(
                    "the database has schema version {v}, newer than this build's {SCHEMA_VERSION}: upgrade prefix-router"
                ))),
                _ => Err(StoreError::Incompatible(format!("unknown schema version {version:?}"))),
            },
            (app, _) => Err(StoreError::Incompatible(format!(
                "the prefix_router tables belong to another application ({app:?}), not {APPLICATION}"
            ))),
        }
    }
}

#[async_trait]
impl PrefixStore for PostgresStore {
    async fn notify(
        &self,
        hashes: &PrefixHashes,
        server: ServerId,
        t: Tick,
    ) -> Result<NotifyOutcome, StoreError> {
        let (h, d) = sql::entries(hashes);
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "SELECT inserted, evicted FROM prefix_router_notify($1, $2, $3, $4, $5, $6)",
            )
            .await
            .map_err(db_error)?;
        let row = client
            .query_one(
                &stmt,
                &[
                    &sql::encode(server),
                    &h,
                    &d,
                    &(t.millis() as i64),
                    &(self.config.default_capacity as i64),
                    &(hashes.len() as i64),
                ],
            )
            .await
            .map_err(db_error)?;
        Ok(NotifyOutcome {
            chunks: hashes.len() as u64,
            inserted: row.get::<_, i64>(0) as u64,
            evicted: row.get::<_, i64>(1) as u64,
        })
    }

    async fn query(
        &self,
        hashes: &PrefixHashes,
        candidates: &[ServerId],
        t: Tick,
    ) -> Result<QueryOutcome, StoreError> {
        check_candidates(candidates)?;
        if hashes.is_empty() {
            return Ok(sql::outcome(hashes, candidates, []));
        }
        let cutoff = self
            .config
            .ttl_ms
            .map_or(0, |ttl| t.ttl_cutoff(ttl).millis()) as i64;
        let h: Vec<i64> = hashes.as_slice().iter().map(|&x| sql::encode(x)).collect();
        let ids: Vec<i64> = candidates.iter().map(|&x| sql::encode(x)).collect();
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                // `+ 0` keeps the planner on the primary key (hash first): a probe per chunk,
                // not a scan of every candidate's entries through the LRU index.
                "SELECT server_id, hash FROM prefix_router_entries
                 WHERE hash = ANY($1) AND server_id + 0 = ANY($2) AND last_used + 0 >= $3",
            )
            .await
            .map_err(db_error)?;
        let rows = client
            .query(&stmt, &[&h, &ids, &cutoff])
            .await
            .map_err(db_error)?;
        Ok(sql::outcome(
            hashes,
            candidates,
            rows.iter()
                .map(|r| (sql::decode(r.get(0)), sql::decode(r.get(1)))),
        ))
    }

    async fn drop_server(&self, server: ServerId) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one("SELECT prefix_router_drop($1)", &[&sql::encode(server)])
            .await
            .map_err(db_error)?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    async fn set_capacity(&self, server: ServerId, capacity: u64) -> Result<u64, StoreError> {
        check_capacity(capacity)?;
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT prefix_router_set_capacity($1, $2)",
                &[&sql::encode(server), &(capacity as i64)],
            )
            .await
            .map_err(db_error)?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    async fn servers(&self) -> Result<Vec<ServerInfo>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT server_id, entries, capacity FROM prefix_router_servers",
                &[],
            )
            .await
            .map_err(db_error)?;
        let mut servers: Vec<ServerInfo> = rows
            .iter()
            .map(|r| ServerInfo {
                server_id: sql::decode(r.get(0)),
                entries: r.get::<_, i64>(1) as u64,
                capacity: r.get::<_, i64>(2) as u64,
            })
            .collect();
        servers.sort_unstable_by_key(|s| s.server_id);
        Ok(servers)
    }

    async fn purge_expired(&self, now: Tick) -> Result<u64, StoreError> {
        let Some(ttl) = self.config.ttl_ms else {
            return Ok(0);
        };
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT prefix_router_purge($1)",
                &[&(now.ttl_cutoff(ttl).millis() as i64)],
            )
            .await
            .map_err(db_error)?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }
}
