//! The gateway queue (flow control): when every backend that could serve a request is
//! saturated, the request waits here instead of in vLLM's own queue, where it would be served
//! in arrival order whatever its priority and whoever sent it.
//!
//! It sits before the decision: a request leaves the queue when some backend for its model has
//! room again, and only then is it matched and routed, so its choice is made on the state it
//! will meet. Requests leave by priority (highest first), fairly between the tenants of one
//! priority (they take turns, one request each), and first in first out within a tenant.
//! Requests "in transit" (admitted, not yet counted against a backend) are bounded: at most as
//! many as the backends with room when admitted at once, and one at a time when released from
//! the queue, so a backend that frees one slot does not receive the whole queue, and a burst
//! arriving at a nearly saturated fleet does not pass on one look at its room (while an idle
//! fleet places requests side by side). When the queue is full, a tenant holding less than its
//! share of it (the bound over the tenants queued) takes the place of the newest request of the
//! tenant holding the most, which is refused instead: one tenant cannot fill the queue for
//! all.
//!
//! Nothing is lost or duplicated: a waiter that leaves (client gone, queue timeout) removes
//! itself; a release sent to a waiter that has just left is handed to the next one.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Relaxed},
};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::sync::{oneshot, Notify};

use super::policy::{queue_wait, CandidateRow};

/// Priorities a request may have (`x-priority`, a tenant's class): a small range keeps the
/// queue's metric series bounded.
pub const PRIORITIES: std::ops::RangeInclusive<i32> = -100..=100;

/// When a backend counts as saturated, and how much the queue may hold.
#[derive(Clone, Debug)]
pub struct AdmissionSettings {
    /// A backend whose predicted wait (the prefill queued ahead of a new request, through its
    /// learned prefill line) is above this is saturated.
    pub max_wait: Option<Duration>,
    /// A backend that reports at least this many waiting requests is saturated.
    pub max_waiting: Option<u64>,
    /// A backend whose KV cache is at least this full (0..1) is saturated: a request sent
    /// there would wait in vLLM for blocks to free.
    pub max_kv_usage: Option<f64>,
    /// Requests held at once; one more is refused (429).
    pub max_queued: usize,
    /// Longest stay in the queue; then the request is refused (503).
    pub timeout: Duration,
    /// The share of each bound kept for requests above the default priority: one of
    /// priority 0 or below is held once a backend reaches `1 - reserve` of a bound, so a
    /// backend always has room (and a short queue of its own) when a high-priority request
    /// comes. 0 keeps no reserve.
    pub priority_reserve: f64,
}

/// The bounds a request of one priority is held by.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bounds {
    pub max_wait: Option<Duration>,
    pub max_waiting: Option<u64>,
    pub max_kv_usage: Option<f64>,
}

impl AdmissionSettings {
    /// Whether any bound is set (without one nothing is ever held).
    pub fn enabled(&self) -> bool {
        self.max_wait.is_some() || self.max_waiting.is_some() || self.max_kv_usage.is_some()
    }

    /// The bounds for a request of `priority`: the full bounds above the default priority,
    /// the bounds less the reserve at or below it (at least one waiting request).
    pub fn bounds(&self, priority: i32) -> Bounds {
        let full = Bounds {
            max_wait: self.max_wait,
            max_waiting: self.max_waiting,
            max_kv_usage: self.max_kv_usage,
        };
        let keep = 1.0 - self.priority_reserve.clamp(0.0, 1.0);
        if priority > 0 || keep >= 1.0 {
            return full;
        }
        Bounds {
            max_wait: full.max_wait.map(|d| d.mul_f64(keep)),
            max_waiting: full
                .max_waiting
                .map(|n| ((n as f64 * keep).floor() as u64).max(1)),
            max_kv_usage: full.max_kv_usage.map(|share| share * keep),
        }
    }
}

/// Whether `row`'s backend has no room for more work now.
///
/// The wait is what the work queued ahead adds to a request's TTFT (the learned line's slope
/// times that work), not the line's overhead: a backend whose TTFT is never below the bound
/// (a CPU vLLM's ~0.2 s) would otherwise count as saturated while idle and hold every request
/// until `--queue-timeout` (seen on real vLLM). A backend with nothing in flight from this
/// router and no one else's requests waiting is never saturated. Waiting requests are this
/// router's without a first byte, counted live, plus the others' the backend last reported;
/// KV-cache use likewise (see [`CandidateRow::kv_tokens_in_use`]).
pub fn saturated(row: &CandidateRow, bounds: &Bounds) -> bool {
    if row.inflight == 0 && row.foreign_waiting == 0 {
        return false;
    }
    let waiting = bounds
        .max_waiting
        .is_some_and(|n| row.waiting_first_byte + row.foreign_waiting >= n);
    let slow = bounds
        .max_wait
        .is_some_and(|bound| queue_wait(row) > bound.as_secs_f64());
    let full = bounds.max_kv_usage.is_some_and(|share| {
        row.kv_cache_tokens > 0 && row.kv_tokens_in_use as f64 >= share * row.kv_cache_tokens as f64
    });
    waiting || slow || full
}

/// Which candidates a request the queue let go may be sent to: those with room under
/// `bounds`, and those holding more of its prompt than any of those (a cache hit there may
/// still be cheaper than a wait elsewhere, and the policy weighs the two; a match every
/// backend has, such as a chat template's opening, is no reason). None when every candidate
/// may (all have room, or none has: the room it was let go for has been taken meanwhile).
/// Without this, the policy sent requests let go for one backend's room wherever it predicted
/// the lowest cost: on real vLLM a learned line that favoured one server sent it 60 in a row
/// (30 waiting in its own queue) while the other had the room; restricting to backends with
/// room alone lost the sims' shared-prefix hit rate (0.547 -> 0.265).
pub fn where_released_may_go(rows: &[CandidateRow], bounds: &Bounds) -> Option<Vec<bool>> {
    let room: Vec<bool> = rows.iter().map(|r| !saturated(r, bounds)).collect();
    if room.iter().all(|r| *r) || !room.iter().any(|r| *r) {
        return None;
    }
    let best_with_room = rows
        .iter()
        .zip(&room)
        .filter(|(_, room)| **room)
        .map(|(r, _)| r.matched_tokens)
        .max()
        .unwrap_or(0);
    Some(
        rows.iter()
            .zip(room)
            .map(|(r, room)| room || r.matched_tokens > best_with_room)
            .collect(),
    )
}

/// Who asks, and for what.
#[derive(Clone, Debug)]
pub struct Ticket {
    /// Higher goes first.
    pub priority: i32,
    /// Requests of one tenant are served in order; tenants of one priority take turns.
    pub tenant: u64,
    /// The model it asks for (saturation is judged among the backends serving it).
    pub model: Option<Arc<str>>,
}

/// Why a request was not admitted.
#[derive(Debug, PartialEq)]
pub enum Refused {
    /// The queue holds `--max-queued` requests.
    Full { retry_after: Duration },
    /// It waited `--queue-timeout` without room freeing up.
    TimedOut { retry_after: Duration },
}

/// Room for one request. Drop it once the request is counted against a backend (its
/// [`super::backend::InflightGuard`] exists): until then it holds the queue's one in-transit
/// place.
pub struct Permit {
    admission: Option<Arc<Admission>>,
}

impl Permit {
    /// A permit that holds nothing (admission off).
    pub fn free() -> Self {
        Self { admission: None }
    }

    /// What to tell when the backend's load eases (the queue's dispatcher), if anything.
    pub fn waker(&self) -> Option<Arc<Notify>> {
        self.admission.as_ref().map(|a| a.wake.clone())
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(a) = self.admission.take() {
            a.in_transit.fetch_sub(1, Relaxed);
            a.wake.notify_one();
        }
    }
}

/// Tells the queue how many of a model's backends have room under some bounds (0: all are
/// saturated).
pub type RoomCheck = Box<dyn Fn(Option<&str>, &Bounds) -> usize + Send + Sync>;

struct Waiter {
    id: u64,
    model: Option<Arc<str>>,
    tx: oneshot::Sender<Result<Permit, Refused>>,
}

#[derive(Default)]
struct Level {
    /// Tenants with waiting requests, in the order they are served next.
    tenants: VecDeque<(u64, VecDeque<Waiter>)>,
}

#[derive(Default)]
struct Queue {
    /// By priority; the highest is served first.
    levels: BTreeMap<i32, Level>,
    next_id: u64,
    /// Requests queued per tenant, all priorities together.
    per_tenant: HashMap<u64, usize>,
}

impl Queue {
    fn push(&mut self, ticket: &Ticket, tx: oneshot::Sender<Result<Permit, Refused>>) -> u64 {
        *self.per_tenant.entry(ticket.tenant).or_default() += 1;
        self.next_id += 1;
        let waiter = Waiter {
            id: self.next_id,
            model: ticket.model.clone(),
            tx,
        };
        let level = self.levels.entry(ticket.priority).or_default();
        match level.tenants.iter_mut().find(|(t, _)| *t == ticket.tenant) {
            Some((_, waiters)) => waiters.push_back(waiter),
            None => level
                .tenants
                .push_back((ticket.tenant, VecDeque::from([waiter]))),
        }
        self.next_id
    }

    /// Removes a waiter that left; false if it was no longer here (released just now).
    fn remove(&mut self, ticket: &Ticket, id: u64) -> bool {
        let Some(level) = self.levels.get_mut(&ticket.priority) else {
            return false;
        };
        let Some(t) = level.tenants.iter().position(|(t, _)| *t == ticket.tenant) else {
            return false;
        };
        let waiters = &mut level.tenants[t].1;
        let Some(w) = waiters.iter().position(|w| w.id == id) else {
            return false;
        };
        waiters.remove(w);
        if waiters.is_empty() {
            level.tenants.remove(t);
            if level.tenants.is_empty() {
                self.levels.remove(&ticket.priority);
            }
        }
        self.left(ticket.tenant);
        true
    }

    /// One of `tenant`'s requests left the queue.
    fn left(&mut self, tenant: u64) {
        if let Some(n) = self.per_tenant.get_mut(&tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&tenant);
            }
        }
    }

    /// With the queue full at `max_queued`: if `tenant` holds less than its share (the bound
    /// over the tenants queued, itself counted), the newest, lowest-priority request of the
    /// tenant holding the most beyond its share leaves to make room; returned with its
    /// priority.
    fn make_room_for(&mut self, tenant: u64, max_queued: usize) -> Option<(i32, Waiter)> {
        let tenants = self.per_tenant.len() + usize::from(!self.per_tenant.contains_key(&tenant));
        let share = (max_queued / tenants.max(1)).max(1);
        let holds = self.per_tenant.get(&tenant).copied().unwrap_or(0);
        if holds >= share {
            return None;
        }
        let (&largest, &held) = self.per_tenant.iter().max_by_key(|(t, n)| (**n, **t))?;
        if held <= share {
            return None;
        }
        let (&priority, level) = self
            .levels
            .iter_mut()
            .find(|(_, l)| l.tenants.iter().any(|(t, _)| *t == largest))?;
        let t = level.tenants.iter().position(|(t, _)| *t == largest)?;
        let waiter = level.tenants[t].1.pop_back()?;
        if level.tenants[t].1.is_empty() {
            level.tenants.remove(t);
            if level.tenants.is_empty() {
                self.levels.remove(&priority);
            }
        }
        self.left(largest);
        Some((priority, waiter))
    }

    /// Takes the next waiter whose model has room for its priority: highest priority first,
    /// the tenant whose turn it is, its oldest request for a model with room. The tenant goes
    /// to the back.
    fn next(
        &mut self,
        mut has_room: impl FnMut(Option<&str>, i32) -> bool,
    ) -> Option<(i32, Waiter)> {
        let mut found = None;
        'levels: for (&priority, level) in self.levels.iter_mut().rev() {
            for t in 0..level.tenants.len() {
                let waiters = &level.tenants[t].1;
                if let Some(w) = waiters
                    .iter()
                    .position(|w| has_room(w.model.as_deref(), priority))
                {
                    found = Some((priority, t, w));
                    break 'levels;
                }
            }
        }
        let (priority, t, w) = found?;
        let level = self.levels.get_mut(&priority)?;
        let (tenant, mut waiters) = level.tenants.remove(t)?;
        let waiter = waiters.remove(w)?;
        if !waiters.is_empty() {
            level.tenants.push_back((tenant, waiters));
        } else if level.tenants.is_empty() {
            self.levels.remove(&priority);
        }
        self.left(tenant);
        Some((priority, waiter))
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PriorityLabels {
    priority: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdmittedLabels {
    priority: i32,
    /// `direct` (room at once) or `queued`.
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeftLabels {
    priority: i32,
    /// `full` (429), `timeout` (503) or `cancelled` (the client left while queued).
    reason: &'static str,
}

struct AdmissionMetrics {
    depth: Family<PriorityLabels, Gauge>,
    wait: Family<PriorityLabels, Histogram>,
    admitted: Family<AdmittedLabels, Counter>,
    left: Family<LeftLabels, Counter>,
}

impl AdmissionMetrics {
    fn register(r: &mut Registry) -> Self {
        let m = Self {
            depth: Family::default(),
            wait: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.005, 2.0, 14))
            }),
            admitted: Family::default(),
            left: Family::default(),
        };
        r.register(
            "prefix_router_queue_depth",
            "Requests held in the gateway queue, by priority",
            m.depth.clone(),
        );
        r.register(
            "prefix_router_queue_wait_seconds",
            "Time queued requests waited before release, by priority",
            m.wait.clone(),
        );
        r.register(
            "prefix_router_queue_admitted",
            "Requests admitted, at once (direct) or after waiting (queued)",
            m.admitted.clone(),
        );
        r.register(
            "prefix_router_queue_refused",
            "Requests that left without being admitted: queue full (429), queue timeout (503), client gone",
            m.left.clone(),
        );
        // The default priority's series exist before anything queues (dashboards, alerts).
        drop(m.depth.get_or_create(&PriorityLabels { priority: 0 }));
        for reason in ["full", "timeout", "cancelled"] {
            drop(m.left.get_or_create(&LeftLabels {
                priority: 0,
                reason,
            }));
        }
        m
    }
}

/// The gateway queue.
pub struct Admission {
    settings: AdmissionSettings,
    queue: Mutex<Queue>,
    /// Requests in the queue (read without the lock on the fast path).
    depth: AtomicUsize,
    /// Released requests not yet counted against a backend.
    in_transit: AtomicUsize,
    /// Told whenever room may have freed: a first byte, a finished request, a permit used.
    wake: Arc<Notify>,
    room: RoomCheck,
    /// Exponentially weighted mean wait of released requests, in µs (for `Retry-After`).
    mean_wait_us: AtomicU64,
    metrics: AdmissionMetrics,
}

/// How often the dispatcher looks again while requests wait, besides being woken: the
/// backends' own queues change with their scraped metrics, which wake nobody.
const RECHECK: Duration = Duration::from_millis(25);

impl Admission {
    /// A queue judging the fleet's room with `room`, with its dispatcher running.
    pub fn start(
        settings: AdmissionSettings,
        room: RoomCheck,
        registry: &mut Registry,
    ) -> Arc<Self> {
        let admission = Arc::new(Self {
            settings,
            queue: Mutex::default(),
            depth: AtomicUsize::new(0),
            in_transit: AtomicUsize::new(0),
            wake: Arc::new(Notify::new()),
            room,
            mean_wait_us: AtomicU64::new(0),
            metrics: AdmissionMetrics::register(registry),
        });
        tokio::spawn(dispatch(Arc::downgrade(&admission)));
        admission
    }

    /// Waits for room for `ticket`'s request, or refuses it. Dropping the future (the client
    /// left) gives up its place.
    pub async fn admit(self: &Arc<Self>, ticket: Ticket) -> Result<Permit, Refused> {
        let priority = PriorityLabels {
            priority: ticket.priority,
        };
        // Room at once, and nobody ahead: admitted directly, while fewer are in transit than
        // backends have room (none of them is counted against a backend until it is routed:
        // a burst must not all pass on one look at one backend's room).
        if self.depth.load(Relaxed) == 0 {
            let bounds = self.settings.bounds(ticket.priority);
            let room = (self.room)(ticket.model.as_deref(), &bounds);
            if self.take_transit_within(room) {
                self.count_admitted(ticket.priority, "direct");
                return Ok(self.permit());
            }
        }
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut queue = self.queue.lock();
            if self.depth.load(Relaxed) >= self.settings.max_queued {
                match queue.make_room_for(ticket.tenant, self.settings.max_queued) {
                    Some((pushed_priority, pushed)) => {
                        self.depth.fetch_sub(1, Relaxed);
                        self.metrics
                            .depth
                            .get_or_create(&PriorityLabels {
                                priority: pushed_priority,
                            })
                            .dec();
                        self.count_left(pushed_priority, "full");
                        let _ = pushed.tx.send(Err(Refused::Full {
                            retry_after: self.retry_after(),
                        }));
                    }
                    None => {
                        drop(queue);
                        self.count_left(ticket.priority, "full");
                        return Err(Refused::Full {
                            retry_after: self.retry_after(),
                        });
                    }
                }
            }
            self.depth.fetch_add(1, Relaxed);
            queue.push(&ticket, tx)
        };
        self.metrics.depth.get_or_create(&priority).inc();
        self.wake.notify_one();
        let enqueued = Instant::now();
        let mut place = Place {
            admission: self,
            ticket: &ticket,
            id,
            released: false,
        };
        match tokio::time::timeout(self.settings.timeout, rx).await {
            Ok(Ok(Err(pushed_out))) => {
                place.released = true;
                Err(pushed_out)
            }
            Ok(Ok(Ok(permit))) => {
                place.released = true;
                let waited = enqueued.elapsed();
                self.metrics
                    .wait
                    .get_or_create(&priority)
                    .observe(waited.as_secs_f64());
                self.learn_wait(waited);
                self.count_admitted(ticket.priority, "queued");
                Ok(permit)
            }
            // The sender went without a permit: only if the queue itself is gone.
            Ok(Err(_)) => {
                place.released = true;
                Err(Refused::TimedOut {
                    retry_after: self.retry_after(),
                })
            }
            Err(_) => {
                drop(place);
                self.count_left(ticket.priority, "timeout");
                Err(Refused::TimedOut {
                    retry_after: self.retry_after(),
                })
            }
        }
    }

    /// The bounds a request of `priority` is held by.
    pub fn bounds(&self, priority: i32) -> Bounds {
        self.settings.bounds(priority)
    }

    /// Requests waiting now.
    pub fn depth(&self) -> usize {
        self.depth.load(Relaxed)
    }

    /// When a refused client should come back: about the queue's recent mean wait, at least
    /// one second.
    fn retry_after(&self) -> Duration {
        let mean = Duration::from_micros(self.mean_wait_us.load(Relaxed));
        Duration::from_secs(mean.as_secs_f64().ceil().max(1.0) as u64)
    }

    fn learn_wait(&self, waited: Duration) {
        let us = waited.as_micros().min(u64::MAX as u128) as u64;
        let old = self.mean_wait_us.load(Relaxed);
        let new = if old == 0 { us } else { (old * 7 + us) / 8 };
        self.mean_wait_us.store(new, Relaxed);
    }

    fn count_admitted(&self, priority: i32, path: &'static str) {
        self.metrics
            .admitted
            .get_or_create(&AdmittedLabels { priority, path })
            .inc();
    }

    fn count_left(&self, priority: i32, reason: &'static str) {
        self.metrics
            .left
            .get_or_create(&LeftLabels { priority, reason })
            .inc();
    }

    /// Takes the one in-transit place if it is free.
    fn take_transit(&self) -> bool {
        self.take_transit_within(1)
    }

    /// Takes a place in transit if fewer than `limit` are taken.
    fn take_transit_within(&self, limit: usize) -> bool {
        let mut taken = self.in_transit.load(Relaxed);
        while taken < limit {
            match self
                .in_transit
                .compare_exchange_weak(taken, taken + 1, AcqRel, Relaxed)
            {
                Ok(_) => return true,
                Err(now) => taken = now,
            }
        }
        false
    }

    /// Room for one request, holding the in-transit place (taken) until dropped.
    fn permit(self: &Arc<Self>) -> Permit {
        Permit {
            admission: Some(self.clone()),
        }
    }

    /// Releases waiters while one may go: nothing in transit, and a model with room.
    fn release(self: &Arc<Self>) {
        while self.depth.load(Relaxed) > 0 && self.take_transit() {
            // Room is judged once per model and priority class (reserve or not) per release.
            let mut room: HashMap<(Option<Arc<str>>, bool), bool> = HashMap::new();
            let next = {
                let mut queue = self.queue.lock();
                let next = queue.next(|model, priority| {
                    let key = (model.map(Arc::<str>::from), priority > 0);
                    *room
                        .entry(key)
                        .or_insert_with(|| (self.room)(model, &self.settings.bounds(priority)) > 0)
                });
                if next.is_some() {
                    self.depth.fetch_sub(1, Relaxed);
                }
                next
            };
            let Some((priority, waiter)) = next else {
                // Whoever queues next wakes the dispatcher: nothing is lost by not waking it.
                self.in_transit.fetch_sub(1, Relaxed);
                return;
            };
            self.metrics
                .depth
                .get_or_create(&PriorityLabels { priority })
                .dec();
            // A waiter that has just left drops the permit with its receiver: the place in
            // transit frees again and the loop goes on with the next.
            let _ = waiter.tx.send(Ok(self.permit()));
        }
    }
}

/// A request's place in the queue; leaving it (dropped unreleased) removes the waiter.
struct Place<'a> {
    admission: &'a Admission,
    ticket: &'a Ticket,
    id: u64,
    released: bool,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let a = self.admission;
        let removed = a.queue.lock().remove(self.ticket, self.id);
        if removed {
            a.depth.fetch_sub(1, Relaxed);
            a.metrics
                .depth
                .get_or_create(&PriorityLabels {
                    priority: self.ticket.priority,
                })
                .dec();
            if !std::thread::panicking() {
                a.count_left(self.ticket.priority, "cancelled");
            }
        }
        // Not removed: it was released as it left; its permit, dropped with the receiver,
        // frees the place in transit.
    }
}

/// Releases waiters whenever woken, and every [`RECHECK`] while any wait.
async fn dispatch(admission: Weak<Admission>) {
    loop {
        let Some(a) = admission.upgrade() else {
            return;
        };
        let wake = a.wake.clone();
        let waiting = a.depth() > 0;
        a.release();
        drop(a);
        if waiting {
            let _ = tokio::time::timeout(RECHECK, wake.notified()).await;
        } else {
            wake.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn settings(max_queued: usize) -> AdmissionSettings {
        AdmissionSettings {
            max_wait: Some(Duration::from_millis(100)),
            max_waiting: None,
            max_kv_usage: None,
            max_queued,
            timeout: Duration::from_secs(5),
            priority_reserve: 0.0,
        }
    }

    /// A queue whose fleet is saturated while `full` is set.
    fn queue(max_queued: usize) -> (Arc<Admission>, Arc<AtomicBool>) {
        let full = Arc::new(AtomicBool::new(true));
        let f = full.clone();
        let a = Admission::start(
            settings(max_queued),
            Box::new(move |_, _| usize::from(!f.load(Relaxed))),
            &mut Registry::default(),
        );
        (a, full)
    }

    #[test]
    fn waiting_counts_ours_live_and_the_others_as_reported() {
        let settings = AdmissionSettings {
            max_wait: None,
            max_waiting: Some(2),
            ..settings(10)
        };
        // Three decoding, none waiting: room.
        let mut row = CandidateRow {
            inflight: 3,
            ..Default::default()
        };
        assert!(!saturated(&row, &settings.bounds(0)));
        row.waiting_first_byte = 1;
        assert!(!saturated(&row, &settings.bounds(0)));
        row.foreign_waiting = 1;
        assert!(
            saturated(&row, &settings.bounds(0)),
            "one of ours and one of another router's"
        );
        row.waiting_first_byte = 0;
        row.inflight = 0;
        assert!(!saturated(&row, &settings.bounds(0)));
        row.foreign_waiting = 2;
        assert!(
            saturated(&row, &settings.bounds(0)),
            "idle for us, full of others'"
        );
    }

    #[test]
    fn a_full_kv_cache_saturates_once_its_size_is_known() {
        let settings = AdmissionSettings {
            max_wait: None,
            max_kv_usage: Some(0.9),
            priority_reserve: 0.25,
            ..settings(10)
        };
        let mut row = CandidateRow {
            inflight: 8,
            kv_tokens_in_use: 14_000,
            ..Default::default()
        };
        assert!(!saturated(&row, &settings.bounds(0)), "size unknown");
        row.kv_cache_tokens = 16_384;
        assert!(saturated(&row, &settings.bounds(0)), "85 % above 67.5 %");
        assert!(!saturated(&row, &settings.bounds(1)), "85 % below 90 %");
        row.kv_tokens_in_use = 15_000;
        assert!(saturated(&row, &settings.bounds(1)));
    }

    #[test]
    fn a_released_request_goes_where_there_is_room_or_its_prefix() {
        let bounds = Bounds {
            max_waiting: Some(2),
            ..Bounds::default()
        };
        let row = |waiting: u64, matched: u64| CandidateRow {
            inflight: waiting,
            waiting_first_byte: waiting,
            matched_tokens: matched,
            ..Default::default()
        };
        // Full and holding nothing of it / with room / full but holding its prefix.
        let rows = [row(2, 0), row(1, 0), row(3, 512)];
        assert_eq!(
            where_released_may_go(&rows, &bounds),
            Some(vec![false, true, true])
        );
        // A match the backend with room has too is no reason to go to a full one.
        let rows = [row(2, 64), row(1, 64), row(3, 512)];
        assert_eq!(
            where_released_may_go(&rows, &bounds),
            Some(vec![false, true, true])
        );
        // All have room, or none has (taken since the release): no restriction.
        assert_eq!(
            where_released_may_go(&[row(1, 0), row(0, 0)], &bounds),
            None
        );
        assert_eq!(
            where_released_may_go(&[row(2, 0), row(5, 9)], &bounds),
            None
        );
    }

    #[test]
    fn the_reserve_holds_the_default_priority_first() {
        let settings = AdmissionSettings {
            max_wait: Some(Duration::from_millis(400)),
            max_waiting: Some(4),
            priority_reserve: 0.5,
            ..settings(10)
        };
        let row = CandidateRow {
            inflight: 2,
            waiting_first_byte: 2,
            ..Default::default()
        };
        assert!(saturated(&row, &settings.bounds(0)), "half of 4 waiting");
        assert!(saturated(&row, &settings.bounds(-3)));
        assert!(!saturated(&row, &settings.bounds(1)), "room kept for it");
        let low = settings.bounds(0);
        assert_eq!(low.max_wait, Some(Duration::from_millis(200)));
        // Never below one waiting request, or the default priority would never be admitted
        // beside one being prefilled.
        let all = AdmissionSettings {
            priority_reserve: 1.0,
            ..settings.clone()
        };
        assert_eq!(all.bounds(0).max_waiting, Some(1));
        let none = AdmissionSettings {
            priority_reserve: 0.0,
            ..settings
        };
        assert_eq!(none.bounds(0).max_waiting, Some(4));
    }

    #[test]
    fn an_idle_backend_is_never_saturated_whatever_its_overhead() {
        let settings = AdmissionSettings {
            max_wait: Some(Duration::from_millis(100)),
            ..settings(10)
        };
        // A CPU vLLM: 0.3 s before any first token, 0.1 ms a token.
        let mut row = CandidateRow {
            prefill: crate::core::prefill::PrefillLine {
                overhead_s: 0.3,
                seconds_per_token: 1e-4,
            },
            ..Default::default()
        };
        assert!(!saturated(&row, &settings.bounds(0)), "idle");
        row.inflight = 2;
        row.waiting_first_byte = 2;
        row.queued_prefill_tokens = 500;
        assert!(!saturated(&row, &settings.bounds(0)), "50 ms of work ahead");
        row.queued_prefill_tokens = 2_000;
        assert!(saturated(&row, &settings.bounds(0)), "200 ms of work ahead");
    }

    #[test]
    fn a_stalled_backend_is_saturated_by_the_wait_bound() {
        let settings = AdmissionSettings {
            max_wait: Some(Duration::from_millis(100)),
            ..settings(10)
        };
        let mut row = CandidateRow {
            inflight: 1,
            waiting_first_byte: 1,
            queued_prefill_tokens: 100,
            ..Default::default()
        };
        assert!(!saturated(&row, &settings.bounds(0)));
        row.stalled_secs = 0.5;
        assert!(
            saturated(&row, &settings.bounds(0)),
            "no first byte for 0.5 s"
        );
    }

    fn ticket(priority: i32, tenant: u64) -> Ticket {
        Ticket {
            priority,
            tenant,
            model: None,
        }
    }

    #[test]
    fn the_queue_serves_priority_then_tenants_in_turn_then_arrival() {
        let mut q = Queue::default();
        let mut ids = HashMap::new();
        for (label, p, t) in [
            ("a1", 0, 1),
            ("a2", 0, 1),
            ("a3", 0, 1),
            ("b1", 0, 2),
            ("hi", 5, 3),
            ("c1", 0, 3),
        ] {
            let (tx, _rx) = oneshot::channel();
            std::mem::forget(_rx);
            ids.insert(q.push(&ticket(p, t), tx), label);
        }
        let order: Vec<&str> = std::iter::from_fn(|| q.next(|_, _| true))
            .map(|(_, w)| ids[&w.id])
            .collect();
        assert_eq!(order, ["hi", "a1", "b1", "c1", "a2", "a3"]);
        assert!(q.levels.is_empty());
    }

    #[test]
    fn a_model_without_room_does_not_block_the_others() {
        let mut q = Queue::default();
        let (tx, _rx1) = oneshot::channel();
        let busy = Ticket {
            priority: 9,
            tenant: 1,
            model: Some(Arc::from("busy")),
        };
        q.push(&busy, tx);
        let (tx, _rx2) = oneshot::channel();
        let free = Ticket {
            priority: 0,
            tenant: 1,
            model: Some(Arc::from("free")),
        };
        let id = q.push(&free, tx);
        let (_, w) = q.next(|m, _| m == Some("free")).unwrap();
        assert_eq!(w.id, id);
        assert!(q.next(|m, _| m == Some("free")).is_none());
        assert!(q.remove(&busy, 1));
        assert!(q.levels.is_empty());
    }

    #[tokio::test]
    async fn requests_wait_while_saturated_and_leave_when_room_frees() {
        let (a, full) = queue(10);
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.admit(ticket(0, 1)).await.map(|_| ()) }
        });
        while a.depth() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished());
        full.store(false, Relaxed);
        a.wake.notify_one();
        assert_eq!(waiting.await.unwrap(), Ok(()));
        assert_eq!(a.depth(), 0);
        // Room at once: admitted directly.
        assert!(a.admit(ticket(0, 1)).await.is_ok());
    }

    #[tokio::test]
    async fn a_full_queue_refuses_with_a_retry_time() {
        let (a, _full) = queue(1);
        let first = tokio::spawn({
            let a = a.clone();
            async move { a.admit(ticket(0, 1)).await.map(|_| ()) }
        });
        while a.depth() == 0 {
            tokio::task::yield_now().await;
        }
        match a.admit(ticket(0, 2)).await {
            Err(Refused::Full { retry_after }) => assert!(retry_after >= Duration::from_secs(1)),
            other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
        }
        first.abort();
    }

    #[tokio::test]
    async fn a_client_that_leaves_frees_its_place() {
        let (a, full) = queue(1);
        let leaving = tokio::spawn({
            let a = a.clone();
            async move { a.admit(ticket(0, 1)).await.map(|_| ()) }
        });
        while a.depth() == 0 {
            tokio::task::yield_now().await;
        }
        leaving.abort();
        let _ = leaving.await;
        assert_eq!(a.depth(), 0);
        // Its place is free for the next, which is released when room frees.
        let next = tokio::spawn({
            let a = a.clone();
            async move { a.admit(ticket(0, 2)).await.map(|_| ()) }
        });
        while a.depth() == 0 {
            tokio::task::yield_now().await;
        }
        full.store(false, Relaxed);
        a.wake.notify_one();
        assert_eq!(next.await.unwrap(), Ok(()));
    }

    #[tokio::test]
    async fn one_release_is_in_transit_at_a_time() {
        let (a, full) = queue(10);
        let mut waiters = Vec::new();
        for t in 0..3 {
            let a2 = a.clone();
            waiters.push(tokio::spawn(async move { a2.admit(ticket(0, t)).await }));
            while a.depth() < t as usize + 1 {
                tokio::task::yield_now().await;
            }
        }
        full.store(false, Relaxed);
        a.wake.notify_one();
        // The first is released; the others wait until its permit is used.
        let first = loop {
            if let Some(i) = waiters.iter().position(|w| w.is_finished()) {
                break waiters.remove(i).await.unwrap().unwrap();
            }
            tokio::task::yield_now().await;
        };
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(a.depth(), 2, "released while one was in transit");
        drop(first);
        for w in waiters {
            assert!(w.await.unwrap().is_ok());
        }
    }

    #[tokio::test]
    async fn a_direct_admission_holds_the_transit_place_until_counted() {
        let (a, full) = queue(10);
        full.store(false, Relaxed);
        let first = a.admit(ticket(0, 1)).await.unwrap();
        // The first is not counted against a backend yet: the fleet's room it saw is not
        // known to be left for the second, which waits for its turn.
        let second = tokio::spawn({
            let a = a.clone();
            async move { a.admit(ticket(0, 2)).await.map(|_| ()) }
        });
        while a.depth() == 0 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!second.is_finished(), "admitted beside one in transit");
        // Counted now, and the fleet full with it: the second stays queued.
        full.store(true, Relaxed);
        drop(first);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!second.is_finished(), "admitted into a saturated fleet");
        full.store(false, Relaxed);
        a.wake.notify_one();
        assert_eq!(second.await.unwrap(), Ok(()));
        assert_eq!(a.in_transit.load(Relaxed), 0);
    }

    #[tokio::test]
    async fn a_request_that_waits_too_long_is_refused() {
        let full = Arc::new(AtomicBool::new(true));
        let f = full.clone();
        let mut s = settings(10);
        s.timeout = Duration::from_millis(50);
        let a = Admission::start(
            s,
            Box::new(move |_, _| usize::from(!f.load(Relaxed))),
            &mut Registry::default(),
        );
        assert!(matches!(
            a.admit(ticket(0, 1)).await,
            Err(Refused::TimedOut { .. })
        ));
        assert_eq!(a.depth(), 0);
    }

    /// With `--max-queued 5` full of tenant A's requests, tenant B's first is queued in
    /// place of A's newest (refused), not refused itself; A cannot take more than its share.
    #[tokio::test]
    async fn a_full_queue_makes_room_for_a_tenant_below_its_share() {
        let (a, _full) = queue(5);
        let mut held = Vec::new();
        for i in 0..5 {
            let a2 = a.clone();
            held.push(tokio::spawn(async move {
                a2.admit(ticket(0, 1)).await.map(|_| ())
            }));
            while a.depth() < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        let b = tokio::spawn({
            let a = a.clone();
            async move { a.admit(ticket(0, 2)).await.map(|_| ()) }
        });
        // A's newest leaves with a 429, B takes its place.
        let newest = held.pop().unwrap();
        assert!(matches!(newest.await.unwrap(), Err(Refused::Full { .. })));
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!b.is_finished(), "B waits in the queue");
        assert_eq!(a.depth(), 5);
        // A holds 4, beyond its share (5 / 2): its next is refused.
        assert!(matches!(
            a.admit(ticket(0, 1)).await,
            Err(Refused::Full { .. })
        ));
        for h in held {
            h.abort();
        }
        b.abort();
    }

    /// An idle fleet of four backends with room admits four requests side by side; a fifth
    /// waits until one of them is counted against a backend.
    #[tokio::test]
    async fn requests_pass_side_by_side_up_to_the_backends_with_room() {
        let a = Admission::start(settings(10), Box::new(|_, _| 4), &mut Registry::default());
        let mut permits = Vec::new();
        for t in 0..4 {
            permits.push(a.admit(ticket(0, t)).await.unwrap());
        }
        let fifth = tokio::spawn({
            let a = a.clone();
            async move { a.admit(ticket(0, 9)).await.map(|_| ()) }
        });
        while a.depth() == 0 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!fifth.is_finished());
        permits.clear();
        assert_eq!(fifth.await.unwrap(), Ok(()));
    }
}
