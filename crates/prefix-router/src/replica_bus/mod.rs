//! The replica bus: router replicas tell each other over NATS what they decide and what load
//! they hold, so that each routes from its own memory as if it had seen the whole fleet's
//! traffic.
//!
//! - The request path only hands its decision to an outbox (a bounded channel, never
//!   awaited); a publisher task batches decisions every [`FLUSH_EVERY`] with this replica's
//!   load table and publishes one compressed frame ([`wire`]).
//! - A reader applies the peers' frames to the same local state the router's own decisions
//!   feed: the string index (notify at the peer's time), block credits in precise mode,
//!   each backend's [`crate::core::backend::RemoteLoad`] (the sum of the live peers' tables;
//!   a peer silent for [`PEER_SILENCE`] is forgotten), and each backend's prefill line (the
//!   peers' first bytes, learned as if seen here).
//! - On every (re)connection a replica asks a peer for its string index
//!   (`SUBJECT.snapshot`, answered in parts to an inbox) and merges it; until then, and
//!   while the bus is down, it routes from what it has. Nothing waits on the bus: its failure
//!   shows in the metrics and logs, not in requests.
//! - Peers are the replicas holding the fleet's key ([`auth`]): every frame and snapshot
//!   request is authenticated, fresh (a replayed frame is dropped) and bounded (peers, load
//!   rows and their values, queued bytes), so a stranger on the NATS server can neither steer
//!   nor read the router, nor make it spend memory.

pub mod auth;
mod metrics;
mod peers;
mod settings;
pub mod wire;

pub use settings::{BusSettings, NatsAuth, NatsTls, ReplicaBusArgs};

use std::sync::atomic::{AtomicBool, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use bytes::Bytes;
use futures_util::StreamExt;
use parking_lot::Mutex;
use prefix_index::{now_secs, PrefixHashes, Tick};
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use crate::core::backend::Backend;
use crate::core::continued::{last_full_chunk, PromptInFlight, PromptsElsewhere};
use crate::core::matches::PromptKey;
use crate::core::prefill::FirstByte;
use crate::core::{Core, LocalEvents};
use metrics::BusMetrics;
use peers::PeerLoads;

/// How often decisions and load changes are published.
pub const FLUSH_EVERY: Duration = Duration::from_millis(5);
/// A replica with nothing to say still publishes its load this often.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// With nothing in flight here and nothing new for this many ticks, the publisher sleeps
/// until a request wakes it (or the heartbeat is due): an idle replica costs no timer wake-ups.
const IDLE_TICKS: u32 = 50;
/// A peer not heard from for this long is forgotten (its load no longer counts).
pub const PEER_SILENCE: Duration = Duration::from_secs(3);
/// Decisions waiting for the publisher; beyond, they are dropped and counted.
const OUTBOX: usize = 65_536;
/// Bytes of decisions waiting for the publisher; beyond, they are dropped and counted.
const OUTBOX_BYTES: usize = 64 << 20;
/// Peers tracked at most; a frame from one more is dropped (a fleet runs a few replicas).
const MAX_PEERS: usize = 256;
/// The most requests a peer may claim in flight (or waiting) at one backend, and the most
/// prefill tokens queued: beyond, its load table is a broken or hostile peer's.
const MAX_PEER_REQUESTS: u64 = 1 << 20;
const MAX_PEER_PREFILL_TOKENS: u64 = 1 << 40;
/// Snapshot parts one answer may have at most (each under NATS's message limit).
const MAX_SNAPSHOT_PARTS: u32 = 4096;
/// Hashes (chunks and blocks) per frame at most: about 0.5 MB before compression, under
/// NATS's 1 MB default message limit. A longer request is told by its first this many chunks
/// (a prefix of its chain is a valid, shorter request to the index).
const MAX_FRAME_HASHES: usize = 56_000;
/// A request's chunks (and blocks) told at most.
const MAX_SENT_HASHES: usize = MAX_FRAME_HASHES / 2;
/// Index entries per snapshot part (about 0.5 MB before compression: under NATS's 1 MB
/// default message limit).
const SNAPSHOT_PART_ENTRIES: usize = 25_000;
/// Tries, 100 ms apart, to see a first backend before asking for a snapshot.
const FLEET_WAIT_TRIES: u32 = 100;
/// Longest wait for a peer's whole snapshot.
const SNAPSHOT_WAIT: Duration = Duration::from_secs(5);
/// A peer's decision time is believed up to this far ahead of this replica's clock.
const MAX_CLOCK_AHEAD_MS: u64 = 60_000;

/// A running bus connection (its tasks stop when the core is dropped).
pub struct ReplicaBus {
    /// This replica's id on the bus.
    pub replica: u64,
    metrics: Arc<BusMetrics>,
    /// Whether this replica has caught up since it last (re)connected: a peer's snapshot was
    /// merged, or no peer had one. Decisions made before are counted.
    synced: AtomicBool,
    /// Set while the publisher sleeps (idle); the next request wakes it through `wake`.
    sleeping: AtomicBool,
    wake: tokio::sync::Notify,
    /// The fleet's key (None: an insecure bus).
    key: Option<auth::BusKey>,
    /// Bytes of decisions handed and not yet taken by the publisher.
    outbox_bytes: std::sync::atomic::AtomicUsize,
}

impl ReplicaBus {
    fn encode<T: serde::Serialize>(&self, message: &T, kind: wire::Kind) -> Vec<u8> {
        wire::encode(message, kind, self.key.as_ref())
    }

    fn decode<T: for<'de> serde::Deserialize<'de>>(
        &self,
        frame: &[u8],
        kind: wire::Kind,
    ) -> Result<T, wire::DecodeError> {
        wire::decode(frame, kind, self.key.as_ref())
    }
}

/// Whether a time told by a peer is near enough to this replica's clock to be no replay.
fn fresh(at_ms: u64) -> bool {
    now_ms().abs_diff(at_ms) <= MAX_CLOCK_AHEAD_MS
}

/// What the publisher is handed.
enum Outgoing {
    Sent(wire::Sent),
    Unhealthy(u64),
    FirstByte(wire::FirstByte),
    Ended(wire::Ended),
}

/// Hands decisions and health changes to the publisher without waiting, and without waking
/// it: a std channel the publisher drains on its tick, so a request costs a copy of its hashes
/// and one lock-free push, not a task wake-up.
struct Outbox {
    tx: std::sync::mpsc::SyncSender<Outgoing>,
    bus: Arc<ReplicaBus>,
}

impl Outgoing {
    /// About the bytes it holds (its hashes), for the outbox's bound.
    fn bytes(&self) -> usize {
        match self {
            Outgoing::Sent(s) => 64 + 8 * (s.chunks.len() + s.blocks.as_ref().map_or(0, Vec::len)),
            _ => 64,
        }
    }
}

impl Outbox {
    fn hand(&self, out: Outgoing) {
        let bytes = out.bytes();
        let queued = self.bus.outbox_bytes.fetch_add(bytes, Relaxed);
        if queued + bytes > OUTBOX_BYTES || self.tx.try_send(out).is_err() {
            self.bus.outbox_bytes.fetch_sub(bytes, Relaxed);
            self.bus.metrics.drop_decisions("outbox_full", 1);
        }
        self.wake_publisher();
    }

    /// Wakes an idle publisher (one wake-up per idle period; an atomic load otherwise). The
    /// fence pairs with the publisher's: either it sees what was handed, or this sees it asleep.
    fn wake_publisher(&self) {
        std::sync::atomic::fence(SeqCst);
        if self.bus.sleeping.load(SeqCst) && self.bus.sleeping.swap(false, SeqCst) {
            self.bus.wake.notify_one();
        }
    }
}

impl LocalEvents for Outbox {
    fn sent(
        &self,
        prompt: Option<&PromptKey>,
        blocks: Option<(u32, &Arc<[u64]>)>,
        backend: &Backend,
    ) {
        if !self.bus.synced.load(Relaxed) {
            self.bus.metrics.unsynced_decisions.inc();
        }
        if prompt.is_none() && blocks.is_none() {
            // Nothing to match: only its load, which the next tick tells.
            self.wake_publisher();
            return;
        }
        self.hand(Outgoing::Sent(wire::Sent {
            backend: backend.id,
            t_ms: now_ms(),
            chunks: prompt.map_or_else(Vec::new, |p| {
                let chunks = p.chunks.as_slice();
                chunks[..chunks.len().min(MAX_SENT_HASHES)].to_vec()
            }),
            blocks: blocks.map(|(_, b)| b[..b.len().min(MAX_SENT_HASHES)].to_vec()),
            bytes: prompt.map(|p| p.text_bytes),
            block_size: blocks.map(|(size, _)| size),
        }));
    }

    fn backend_unhealthy(&self, backend: &Backend) {
        self.hand(Outgoing::Unhealthy(backend.id));
    }

    fn ended(&self, last: u64, backend: &Backend) {
        self.hand(Outgoing::Ended(wire::Ended {
            backend: backend.id,
            last,
        }));
    }

    fn first_byte(&self, backend: &Backend, seen: FirstByte) {
        self.hand(Outgoing::FirstByte(wire::FirstByte::from_seen(
            backend.id, &seen,
        )));
    }
}

fn now_ms() -> u64 {
    Tick::from_secs(now_secs()).millis()
}

impl ReplicaBus {
    /// Connects to the bus in the background (a bus that is down at start is retried; the
    /// router serves meanwhile) and starts publishing and applying.
    pub async fn start(
        settings: BusSettings,
        core: &Arc<Core>,
        registry: &mut Registry,
    ) -> anyhow::Result<Arc<Self>> {
        anyhow::ensure!(
            core.store().as_memory().is_some(),
            "--replica-bus needs the memory store: each replica keeps its own index and the bus \
             keeps them alike (a shared --store or --index-url is the other way to share one)"
        );
        if settings.key.is_none() {
            tracing::warn!(
                bus = %settings.url,
                "replica bus without a shared key (--replica-bus-insecure): any client of the NATS server is a trusted peer"
            );
        }
        let metrics = Arc::new(BusMetrics::register(registry));
        let replica = crate::core::random_u64();
        let bus = Arc::new(Self {
            replica,
            metrics: metrics.clone(),
            synced: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
            key: settings.key.clone(),
            outbox_bytes: std::sync::atomic::AtomicUsize::new(0),
        });
        let (connected_tx, connected_rx) = mpsc::unbounded_channel();
        let options = || async {
            let (bus, url, connected_tx) =
                (bus.clone(), settings.url.clone(), connected_tx.clone());
            Ok::<_, anyhow::Error>(settings
                .connect_options()
                .await?
                .no_echo()
                .connection_timeout(Duration::from_secs(2))
                .name(format!("prefix-router-{replica:016x}"))
                .event_callback(move |event| {
                    let (bus, url, connected_tx) =
                        (bus.clone(), url.clone(), connected_tx.clone());
                    async move {
                        match event {
                            async_nats::Event::Connected => {
                                tracing::info!(bus = %url, "replica bus connected");
                                bus.metrics.connected.set(1);
                                let _ = connected_tx.send(());
                            }
                            async_nats::Event::Disconnected => {
                                tracing::warn!(bus = %url, "replica bus lost: routing from local state until it returns");
                                bus.metrics.connected.set(0);
                                bus.synced.store(false, Relaxed);
                            }
                            async_nats::Event::ServerError(e) => {
                                tracing::warn!(bus = %url, error = %e, "replica bus: the NATS server reports an error");
                            }
                            other => tracing::debug!(bus = %url, event = %other, "replica bus event"),
                        }
                    }
                }))
        };
        // A bus that is down at start is retried in the background (the router serves
        // meanwhile); one that refuses this router's credentials or TLS is a configuration
        // error, said at once rather than logged for ever.
        let client = match options().await?.connect(settings.url.as_str()).await {
            Ok(client) => client,
            Err(e) => {
                use async_nats::ConnectErrorKind as K;
                match e.kind() {
                    K::AuthorizationViolation | K::Authentication => anyhow::bail!(
                        "--replica-bus {}: the NATS server refused this router's credentials ({:?}): {e}",
                        settings.url,
                        settings.auth
                    ),
                    K::Tls | K::ServerParse => {
                        anyhow::bail!("--replica-bus {}: {e}", settings.url)
                    }
                    _ => {
                        tracing::warn!(bus = %settings.url, error = %e, "replica bus unreachable at start: routing alone, connecting in the background");
                        options()
                            .await?
                            .retry_on_initial_connect()
                            .connect(settings.url.as_str())
                            .await
                            .map_err(|e| anyhow::anyhow!("--replica-bus {}: {e}", settings.url))?
                    }
                }
            }
        };
        let batches = client.subscribe(settings.subject.clone()).await?;
        let snapshot_subject = format!("{}.snapshot", settings.subject);
        let snapshot_requests = client.subscribe(snapshot_subject.clone()).await?;
        let (tx, rx) = std::sync::mpsc::sync_channel(OUTBOX);
        core.on_local_events(Box::new(Outbox {
            tx,
            bus: bus.clone(),
        }));
        let weak = Arc::downgrade(core);
        tokio::spawn(publish(
            client.clone(),
            settings.subject.clone(),
            weak.clone(),
            rx,
            bus.clone(),
        ));
        tokio::spawn(apply(batches, weak.clone(), bus.clone()));
        tokio::spawn(serve_snapshots(
            client.clone(),
            snapshot_requests,
            weak.clone(),
            bus.clone(),
        ));
        tokio::spawn(fetch_snapshots(
            client,
            snapshot_subject,
            connected_rx,
            weak,
            bus.clone(),
        ));
        Ok(bus)
    }
}

/// Waits for `next`, giving up (`None`) once the core is gone (checked every second), so the
/// bus's tasks, and with them its connection, end with the router.
async fn while_alive<F: std::future::Future>(core: &Weak<Core>, next: F) -> Option<F::Output> {
    tokio::pin!(next);
    let mut check = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            out = &mut next => return Some(out),
            _ = check.tick() => if core.strong_count() == 0 {
                return None;
            },
        }
    }
}

/// This replica's own load on every backend of its fleet.
fn own_load(core: &Core) -> Vec<wire::Load> {
    core.fleet
        .snapshot()
        .iter()
        .map(|b| wire::Load {
            backend: b.id,
            inflight: b.inflight.load(Relaxed),
            waiting_first_byte: b.waiting_first_byte.load(Relaxed),
            queued_prefill_tokens: b.queued_prefill_tokens.load(Relaxed),
            queue_moved_ms_ago: Some(b.queue_moved_ago().as_millis() as u64),
        })
        .collect()
}

/// Whether two load tables hold the same counts (the queues' ages grow by themselves; they
/// move only with the counts, so they alone are no reason to publish).
fn same_counts(a: &[wire::Load], b: &[wire::Load]) -> bool {
    let counts = |l: &wire::Load| wire::Load {
        queue_moved_ms_ago: None,
        ..*l
    };
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| counts(x) == counts(y))
}

/// What the outbox handed since the last frame.
#[derive(Default)]
struct Said {
    sent: Vec<wire::Sent>,
    unhealthy: Vec<u64>,
    first_bytes: Vec<wire::FirstByte>,
    ended: Vec<wire::Ended>,
}

impl Said {
    fn take(&mut self, out: Outgoing, bus: &ReplicaBus) {
        bus.outbox_bytes.fetch_sub(out.bytes(), Relaxed);
        match out {
            Outgoing::Sent(s) => self.sent.push(s),
            Outgoing::Unhealthy(id) => self.unhealthy.push(id),
            Outgoing::FirstByte(f) => self.first_bytes.push(f),
            Outgoing::Ended(e) => self.ended.push(e),
        }
    }

    fn len(&self) -> usize {
        self.sent.len() + self.unhealthy.len() + self.first_bytes.len() + self.ended.len()
    }
}

/// Batches the outbox's decisions with this replica's load and publishes them.
async fn publish(
    client: async_nats::Client,
    subject: String,
    core: Weak<Core>,
    outbox: std::sync::mpsc::Receiver<Outgoing>,
    bus: Arc<ReplicaBus>,
) {
    let metrics = &bus.metrics;
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut said = Said::default();
    let mut told_load: Option<Vec<wire::Load>> = None;
    let mut told_at = Instant::now();
    let mut seq = 0u64;
    let mut idle_ticks = 0u32;
    loop {
        let handed = said.len();
        let nothing_here = told_load
            .as_ref()
            .is_some_and(|l| l.iter().all(|l| l.inflight == 0));
        if idle_ticks >= IDLE_TICKS && nothing_here {
            bus.sleeping.store(true, SeqCst);
            std::sync::atomic::fence(SeqCst);
            // Handed before the flag could be seen: not left waiting for the sleep to end.
            match outbox.try_recv() {
                Ok(out) => said.take(out, &bus),
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    let sleep = tokio::time::sleep(HEARTBEAT.saturating_sub(told_at.elapsed()));
                    tokio::select! {
                        _ = bus.wake.notified() => {}
                        _ = sleep => {}
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
            }
            bus.sleeping.store(false, SeqCst);
            idle_ticks = 0;
            tick.reset();
        } else {
            tick.tick().await;
        }
        loop {
            match outbox.try_recv() {
                Ok(out) => said.take(out, &bus),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                // The core (which holds the sender) is gone.
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
            }
        }
        let idle = said.len() == handed;
        let Some(core) = core.upgrade() else {
            return;
        };
        let load = own_load(&core);
        drop(core);
        let load_changed = told_load
            .as_ref()
            .is_none_or(|told| !same_counts(told, &load));
        if idle && !load_changed {
            idle_ticks = idle_ticks.saturating_add(1);
        } else {
            idle_ticks = 0;
        }
        if said.len() == 0 && !load_changed && told_at.elapsed() < HEARTBEAT {
            continue;
        }
        if client.connection_state() != State::Connected {
            metrics.drop_decisions("disconnected", said.sent.len() as u64);
            said = Said::default();
            told_load = None;
            continue;
        }
        let mut load = Some(load);
        let Said {
            sent,
            mut unhealthy,
            mut first_bytes,
            mut ended,
        } = std::mem::take(&mut said);
        let mut rest = sent.into_iter().peekable();
        // One frame at least (the load table, a heartbeat), more when the decisions are many.
        loop {
            let mut frame_sent = Vec::new();
            let mut hashes = 0;
            while let Some(next) = rest.peek() {
                let size = next.chunks.len() + next.blocks.as_ref().map_or(0, Vec::len);
                if !frame_sent.is_empty() && hashes + size > MAX_FRAME_HASHES {
                    break;
                }
                hashes += size;
                frame_sent.push(rest.next().expect("peeked"));
            }
            seq += 1;
            let decisions = frame_sent.len() as u64;
            let told_first_bytes = first_bytes.len() as u64;
            let frame = bus.encode(
                &wire::Batch {
                    replica: bus.replica,
                    seq,
                    at_ms: Some(now_ms()),
                    sent: frame_sent,
                    load: load.clone(),
                    unhealthy: std::mem::take(&mut unhealthy),
                    first_bytes: std::mem::take(&mut first_bytes),
                    // In the last frame: after every decision it may end.
                    ended: Some(if rest.peek().is_none() {
                        std::mem::take(&mut ended)
                    } else {
                        Vec::new()
                    }),
                },
                wire::Kind::Batch,
            );
            let bytes = frame.len() as u64;
            match client.publish(subject.clone(), Bytes::from(frame)).await {
                Ok(()) => {
                    metrics.count(&metrics.messages, "sent", 1);
                    metrics.count(&metrics.bytes, "sent", bytes);
                    metrics.count(&metrics.decisions, "sent", decisions);
                    metrics.count(&metrics.first_bytes, "sent", told_first_bytes);
                    if let Some(load) = load.take() {
                        told_load = Some(load);
                        told_at = Instant::now();
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "replica bus publish failed");
                    metrics.drop_decisions("publish_failed", decisions);
                    told_load = None;
                }
            }
            if rest.peek().is_none() {
                break;
            }
        }
    }
}

/// Applies the peers' batches, and forgets peers that fell silent.
async fn apply(mut batches: async_nats::Subscriber, core: Weak<Core>, bus: Arc<ReplicaBus>) {
    let metrics = &bus.metrics;
    let peers = Mutex::new(PeerLoads::default());
    let mut expiry = tokio::time::interval(Duration::from_secs(1));
    loop {
        let message = tokio::select! {
            m = batches.next() => match m {
                Some(m) => m,
                None => return,
            },
            _ = expiry.tick() => {
                let Some(core) = core.upgrade() else { return };
                let gone = peers.lock().expire(Instant::now(), PEER_SILENCE);
                if gone > 0 {
                    tracing::info!(replicas = gone, "replica bus: peers fell silent; their load no longer counts");
                    let mut peers = peers.lock();
                    set_remote_load(&core, &peers);
                    if peers.take_prompts_changed() {
                        core.set_prompts_elsewhere(PromptsElsewhere::new(peers.prompts()));
                    }
                }
                core.set_replica_rank(peers.lock().rank_of(bus.replica));
                metrics.peers.set(peers.lock().live() as i64);
                continue;
            }
        };
        metrics.count(&metrics.messages, "received", 1);
        metrics.count(&metrics.bytes, "received", message.payload.len() as u64);
        let mut batch = match bus.decode::<wire::Batch>(&message.payload, wire::Kind::Batch) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(error = %e, subject = %message.subject, "replica bus: message ignored");
                metrics.reject(e.label());
                continue;
            }
        };
        if batch.replica == bus.replica {
            continue;
        }
        // An authenticated frame must be recent: a recorded one replayed later is not.
        if bus.key.is_some() && !batch.at_ms.is_some_and(fresh) {
            metrics.reject("stale");
            continue;
        }
        let Some(core) = core.upgrade() else { return };
        if let Some(load) = &mut batch.load {
            if let Err(reason) = bounded_load(&core, load) {
                metrics.reject(reason);
                continue;
            }
        }
        let has_load = batch.load.is_some();
        {
            let mut peers = peers.lock();
            let now = Instant::now();
            if let Err(reason) = peers.admit(batch.replica, batch.seq, MAX_PEERS, now) {
                metrics.reject(reason);
                continue;
            }
            // Its prompts in flight, if it tells their ends: started, ended, then cleared
            // where its table (sent after both) says nothing is in flight.
            let tells_ends = batch.ended.is_some();
            if tells_ends {
                for sent in &batch.sent {
                    if let Some((full, prompt)) = in_flight(&core, sent) {
                        peers.started(batch.replica, full, prompt, now);
                    }
                }
                for e in batch.ended.iter().flatten() {
                    peers.ended(batch.replica, e.backend, e.last);
                }
            }
            peers.heard(batch.replica, batch.load, now);
            core.set_replica_rank(peers.rank_of(bus.replica));
            if has_load {
                set_remote_load(&core, &peers);
            }
            if peers.take_prompts_changed() {
                core.set_prompts_elsewhere(PromptsElsewhere::new(peers.prompts()));
            }
        }
        for id in batch.unhealthy {
            match core.backend(id) {
                Some(backend) if backend.is_healthy() => {
                    tracing::info!(backend = backend.url(), "replica bus: a peer found the backend unhealthy; counted as a failed check here");
                    metrics.health_reports.inc();
                    core.backend_failed(&backend);
                }
                Some(_) => {}
                None => metrics.reject("unknown_backend"),
            }
        }
        for first_byte in batch.first_bytes {
            let Some(backend) = core.backend(first_byte.backend) else {
                metrics.reject("unknown_backend");
                continue;
            };
            match first_byte.seen() {
                Some(seen) => {
                    core.peer_first_byte(&backend, seen);
                    metrics.count(&metrics.first_bytes, "received", 1);
                }
                None => metrics.reject("implausible"),
            }
        }
        let latest = now_ms() + MAX_CLOCK_AHEAD_MS;
        for sent in batch.sent {
            let Some(backend) = core.backend(sent.backend) else {
                metrics.reject("unknown_backend");
                continue;
            };
            let chunks = PrefixHashes::from_raw(sent.chunks);
            let blocks = sent
                .blocks
                .map(|b| (sent.block_size, Arc::<[u64]>::from(b)));
            let t = Tick::from_millis(sent.t_ms.min(latest));
            core.peer_sent(&chunks, blocks, &backend, t);
            metrics.count(&metrics.decisions, "received", 1);
        }
    }
}

/// A peer's decision as a prompt in flight, with its last full chunk's hash: if its whole
/// chain was told, and is as long as its string needs.
fn in_flight(core: &Core, sent: &wire::Sent) -> Option<(u64, PromptInFlight)> {
    let hasher = &core.strings.hasher;
    let bytes = sent.bytes?;
    let whole = sent.chunks.len() < MAX_SENT_HASHES
        && u64::try_from(sent.chunks.len()).ok()? == bytes.div_ceil(hasher.chunk_size() as u64);
    let full = whole
        .then(|| last_full_chunk(hasher, &sent.chunks, bytes))
        .flatten()?;
    let prompt = PromptInFlight {
        backend: sent.backend,
        bytes,
        last: *sent.chunks.last()?,
    };
    Some((full, prompt))
}

/// Keeps the rows of a peer's load table that name backends of this fleet (once each), or
/// refuses the table when a value is beyond what a replica can hold.
fn bounded_load(core: &Core, load: &mut Vec<wire::Load>) -> Result<(), &'static str> {
    let implausible = |l: &wire::Load| {
        l.inflight > MAX_PEER_REQUESTS
            || l.waiting_first_byte > MAX_PEER_REQUESTS
            || l.queued_prefill_tokens > MAX_PEER_PREFILL_TOKENS
    };
    if load.iter().any(implausible) {
        return Err("implausible");
    }
    let mut seen = std::collections::HashSet::with_capacity(load.len().min(4096));
    load.retain(|l| core.backend(l.backend).is_some() && seen.insert(l.backend));
    Ok(())
}

/// Writes the live peers' summed load into every backend (zero where none holds any).
fn set_remote_load(core: &Core, peers: &PeerLoads) {
    let totals = peers.totals();
    for b in core.fleet.snapshot().iter() {
        let t = totals.get(&b.id).copied().unwrap_or_default();
        b.remote.inflight.store(t.inflight, Relaxed);
        b.remote
            .waiting_first_byte
            .store(t.waiting_first_byte, Relaxed);
        b.remote
            .queued_prefill_tokens
            .store(t.queued_prefill_tokens, Relaxed);
        b.remote
            .set_queue_moved_ago(t.queue_moved_at.map(|at| at.elapsed()));
    }
}

/// Answers peers' snapshot requests with this replica's string index, in parts.
async fn serve_snapshots(
    client: async_nats::Client,
    mut requests: async_nats::Subscriber,
    core: Weak<Core>,
    bus: Arc<ReplicaBus>,
) {
    while let Some(Some(request)) = while_alive(&core, requests.next()).await {
        let Some(reply) = request.reply else {
            bus.metrics.reject("malformed");
            continue;
        };
        // With the fleet's key, only a peer's fresh request, for the inbox it names, is
        // answered: the index is not for strangers.
        if bus.key.is_some() {
            match bus.decode::<wire::SnapshotRequest>(&request.payload, wire::Kind::SnapshotRequest)
            {
                Ok(asked) if fresh(asked.at_ms) && asked.inbox == reply.as_str() => {}
                Ok(_) => {
                    bus.metrics.reject("stale");
                    continue;
                }
                Err(e) => {
                    bus.metrics.reject(e.label());
                    continue;
                }
            }
        }
        let Some(core) = core.upgrade() else { return };
        let Some(memory) = core.store().as_memory() else {
            return;
        };
        let servers = memory.export();
        drop(core);
        let mut parts: Vec<Vec<wire::ServerEntries>> = vec![Vec::new()];
        let mut in_part = 0;
        for (server, _capacity, entries) in servers {
            for piece in entries.chunks(SNAPSHOT_PART_ENTRIES) {
                if in_part + piece.len() > SNAPSHOT_PART_ENTRIES && in_part > 0 {
                    parts.push(Vec::new());
                    in_part = 0;
                }
                in_part += piece.len();
                let piece = piece.iter().map(|&(h, d, t)| (h, d, t.millis())).collect();
                parts
                    .last_mut()
                    .expect("one part at least")
                    .push((server, piece));
            }
        }
        let count = parts.len() as u32;
        for (i, servers) in parts.into_iter().enumerate() {
            let frame = bus.encode(
                &wire::SnapshotPart {
                    replica: bus.replica,
                    part: i as u32,
                    parts: count,
                    servers,
                },
                wire::Kind::SnapshotPart,
            );
            if let Err(e) = client.publish(reply.clone(), Bytes::from(frame)).await {
                tracing::debug!(error = %e, "replica bus: could not send a snapshot part");
                break;
            }
        }
        bus.metrics.snapshot("served");
    }
}

/// On each (re)connection, asks a peer for its string index and merges it.
async fn fetch_snapshots(
    client: async_nats::Client,
    subject: String,
    mut connected: mpsc::UnboundedReceiver<()>,
    core: Weak<Core>,
    bus: Arc<ReplicaBus>,
) {
    while let Some(Some(())) = while_alive(&core, connected.recv()).await {
        // Several connection events in a row ask once.
        while connected.try_recv().is_ok() {}
        // A peer's index is merged for the backends this replica knows: wait (a little) for
        // discovery to find the first ones.
        for _ in 0..FLEET_WAIT_TRIES {
            match core.upgrade() {
                Some(c) if c.fleet.snapshot().is_empty() => {}
                Some(_) => break,
                None => return,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let Some(strong) = core.upgrade() else { return };
        let outcome = fetch_snapshot(&client, &subject, &strong, &bus).await;
        match outcome {
            Ok(entries) => {
                tracing::info!(entries, "replica bus: merged a peer's index snapshot");
                bus.metrics.snapshot("applied");
                bus.synced.store(true, Relaxed);
            }
            Err("no_peer") => {
                tracing::info!("replica bus: no peer to ask for a snapshot (the first replica)");
                bus.metrics.snapshot("no_peer");
                bus.synced.store(true, Relaxed);
            }
            Err(outcome) => {
                tracing::info!(outcome, "replica bus: no index snapshot merged");
                bus.metrics.snapshot(outcome);
            }
        }
    }
}

/// Asks for one snapshot: `Ok(entries merged)`, or why none was.
async fn fetch_snapshot(
    client: &async_nats::Client,
    subject: &str,
    core: &Core,
    bus: &ReplicaBus,
) -> Result<u64, &'static str> {
    let inbox = client.new_inbox();
    let mut answers = client
        .subscribe(inbox.clone())
        .await
        .map_err(|_| "failed")?;
    let request = match bus.key {
        Some(_) => bus.encode(
            &wire::SnapshotRequest {
                replica: bus.replica,
                at_ms: now_ms(),
                inbox: inbox.to_string(),
            },
            wire::Kind::SnapshotRequest,
        ),
        None => Vec::new(),
    };
    client
        .publish_with_reply(subject.to_owned(), inbox, Bytes::from(request))
        .await
        .map_err(|_| "failed")?;
    let memory = core.store().as_memory().ok_or("failed")?;
    let deadline = tokio::time::Instant::now() + SNAPSHOT_WAIT;
    let mut from = None;
    let mut seen = 0u32;
    let mut merged = 0u64;
    loop {
        let answer = match tokio::time::timeout_at(deadline, answers.next()).await {
            Ok(Some(a)) => a,
            Ok(None) => return Err("failed"),
            Err(_) => return Err(if from.is_none() { "timeout" } else { "failed" }),
        };
        if answer
            .status
            .is_some_and(|s| s == async_nats::StatusCode::NO_RESPONDERS)
        {
            return Err("no_peer");
        }
        let part = match bus.decode::<wire::SnapshotPart>(&answer.payload, wire::Kind::SnapshotPart)
        {
            Ok(p) if p.parts <= MAX_SNAPSHOT_PARTS => p,
            Ok(_) => {
                bus.metrics.reject("too_large");
                continue;
            }
            Err(e) => {
                bus.metrics.reject(e.label());
                continue;
            }
        };
        // The first peer to answer is the one listened to.
        if *from.get_or_insert(part.replica) != part.replica {
            continue;
        }
        for (server, entries) in part.servers {
            let Some(backend) = core.backend(server) else {
                bus.metrics.reject("unknown_backend");
                continue;
            };
            // A peer's clock a little ahead is believed; an entry dated far in the future would
            // outlive every real one.
            let latest = now_ms() + MAX_CLOCK_AHEAD_MS;
            let mut entries: Vec<(u64, u32, Tick)> = entries
                .into_iter()
                .map(|(h, d, t)| (h, d, Tick::from_millis(t.min(latest))))
                .collect();
            if let Err(e) = memory.merge(server, &mut entries) {
                tracing::warn!(error = %e, "replica bus: could not merge a snapshot part");
                continue;
            }
            merged += entries.len() as u64;
            bus.metrics.snapshot_entries.inc_by(entries.len() as u64);
            if let Some(info) = memory
                .servers_now()
                .into_iter()
                .find(|s| s.server_id == backend.id)
            {
                backend.entries.store(info.entries, Relaxed);
            }
        }
        seen += 1;
        if seen >= part.parts {
            return Ok(merged);
        }
    }
}
