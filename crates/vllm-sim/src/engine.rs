//! One simulated server's engine: a FIFO waiting queue, one prefill engine, and decode seats.
//!
//! A request waits until a seat is free (`max_num_seqs`) and the KV cache can hold it, then
//! the prefill engine computes its uncached prompt tokens — one request at a time, at
//! `prefill_tokens_per_s` — so misses and imbalance turn into queueing delay. After prefill the
//! request holds its seat and blocks while it decodes (timed by the API layer), and frees both
//! when it finishes or its client goes away.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

use crate::config::SimConfig;
use crate::kv_cache::{Allocation, CacheEvent, KvCache, Shortage};
use crate::metrics::{Gauges, Metrics};
use crate::tokens::TokenId;

/// What the engine needs to know of a request.
pub struct Job {
    /// Hashes of every full block of the prompt followed by the whole answer.
    pub block_hashes: Vec<u64>,
    /// The prompt followed by the whole answer (the tokens the KV events report).
    pub tokens: Arc<[TokenId]>,
    pub prompt_tokens: usize,
    /// Prompt plus answer.
    pub total_tokens: usize,
}

impl Job {
    /// Hashes of the prompt's full blocks.
    fn prompt_hashes(&self, block_size: usize) -> &[u64] {
        &self.block_hashes[..(self.prompt_tokens / block_size).min(self.block_hashes.len())]
    }
}

/// A request that finished prefill: it may now emit tokens.
pub struct Admitted {
    pub lease: Lease,
    pub cached_tokens: usize,
    /// When the first token is out (now, in real time).
    pub first_token_at: Instant,
    /// Simulated time from arrival to first token.
    pub ttft_secs: f64,
}

/// Why the engine refused a request.
#[derive(Debug)]
pub enum Refusal {
    /// It can never fit in the KV cache.
    TooLong {
        needed_blocks: usize,
        total_blocks: usize,
    },
}

struct Waiting {
    job: Job,
    arrived: Instant,
    reply: oneshot::Sender<Result<Admitted, Refusal>>,
}

struct State {
    cache: KvCache,
    waiting: VecDeque<Waiting>,
    running: usize,
    /// Prompt blocks of the requests waiting or in prefill (with how many hold each): cached
    /// by the time a request arriving now is prefilled, since prefill runs in arrival order.
    coming: HashMap<u64, u32>,
}

impl State {
    fn expect(&mut self, hashes: &[u64]) {
        for &h in hashes {
            *self.coming.entry(h).or_default() += 1;
        }
    }

    fn arrived(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(n) = self.coming.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.coming.remove(h);
                }
            }
        }
    }
}

pub struct Engine {
    pub config: Arc<SimConfig>,
    pub metrics: Metrics,
    state: Mutex<State>,
    wake: Notify,
    killed: AtomicBool,
    stopped: AtomicBool,
    /// `--time-scale`, changeable at run time (`POST /sim/config`), as f64 bits.
    time_scale_bits: AtomicU64,
    /// Wakes streams when the server is killed.
    pub kill_signal: Notify,
    /// Where the cache's changes go when KV events are published.
    events_out: Mutex<Option<tokio::sync::mpsc::UnboundedSender<Vec<CacheEvent>>>>,
}

impl Engine {
    /// Creates the engine and starts its scheduler.
    pub fn start(config: Arc<SimConfig>) -> Arc<Self> {
        let engine = Arc::new(Self {
            metrics: Metrics::default(),
            state: Mutex::new(State {
                cache: KvCache::new(config.kv_blocks, config.block_size),
                waiting: VecDeque::new(),
                running: 0,
                coming: HashMap::new(),
            }),
            wake: Notify::new(),
            killed: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            time_scale_bits: AtomicU64::new(config.time_scale.to_bits()),
            kill_signal: Notify::new(),
            events_out: Mutex::new(None),
            config,
        });
        tokio::spawn(schedule(engine.clone()));
        engine
    }

    /// Sends the cache's changes to `out` from now on (the KV-event publisher).
    pub fn publish_to(&self, out: tokio::sync::mpsc::UnboundedSender<Vec<CacheEvent>>) {
        self.state.lock().cache.record_events();
        *self.events_out.lock() = Some(out);
    }

    /// Hands the cache's changes since the last call to the publisher, if there is one.
    fn publish_events(&self) {
        let out = self.events_out.lock();
        if let Some(out) = out.as_ref() {
            let events = self.state.lock().cache.take_events();
            if !events.is_empty() {
                let _ = out.send(events);
            }
        }
    }

    /// Stops the scheduler (the server is going away); queued requests are refused.
    pub fn shutdown(&self) {
        self.stopped.store(true, Relaxed);
        let mut state = self.state.lock();
        state.waiting.clear();
        state.coming.clear();
        drop(state);
        self.wake.notify_one();
    }

    /// Queues a request; the answer comes when its prefill is done.
    pub fn submit(&self, job: Job) -> oneshot::Receiver<Result<Admitted, Refusal>> {
        let (reply, admitted) = oneshot::channel();
        let mut state = self.state.lock();
        state.expect(job.prompt_hashes(self.config.block_size));
        state.waiting.push_back(Waiting {
            job,
            arrived: Instant::now(),
            reply,
        });
        drop(state);
        self.wake.notify_one();
        admitted
    }

    /// Prompt tokens a request arriving now would find cached when its prefill starts (the
    /// cache now, and the prompts of the requests ahead of it), without changing anything.
    pub fn probe(&self, block_hashes: &[u64], prompt_tokens: usize) -> usize {
        let state = self.state.lock();
        let blocks = state.cache.probe_with(block_hashes, prompt_tokens, |h| {
            state.coming.contains_key(&h)
        });
        blocks * self.config.block_size
    }

    /// Empties the cache and the counters.
    pub fn reset(&self) {
        self.state.lock().cache.reset();
        self.publish_events();
        self.metrics.reset();
    }

    pub fn gauges(&self) -> Gauges {
        let state = self.state.lock();
        Gauges {
            running: state.running,
            waiting: state.waiting.len(),
            kv_usage: state.cache.usage(),
            block_size: state.cache.block_size(),
            num_blocks: state.cache.num_blocks(),
        }
    }

    /// Cached blocks right now.
    pub fn cached_blocks(&self) -> usize {
        self.state.lock().cache.cached_blocks()
    }

    /// The current time scale (0: simulated time does not pass).
    pub fn time_scale(&self) -> f64 {
        f64::from_bits(self.time_scale_bits.load(Relaxed))
    }

    pub fn set_time_scale(&self, scale: f64) {
        self.time_scale_bits.store(scale.to_bits(), Relaxed);
    }

    /// Real time that `sim_secs` of simulated time takes now.
    pub fn real(&self, sim_secs: f64) -> std::time::Duration {
        std::time::Duration::from_secs_f64((sim_secs * self.time_scale()).max(0.0))
    }

    /// Simulated seconds a real duration stands for (0 when time does not pass).
    pub fn simulated(&self, real: std::time::Duration) -> f64 {
        let scale = self.time_scale();
        if scale > 0.0 {
            real.as_secs_f64() / scale
        } else {
            0.0
        }
    }

    pub fn is_killed(&self) -> bool {
        self.killed.load(Relaxed)
    }

    /// Makes the server drop every connection but its `/sim/` control endpoints.
    pub fn kill(&self) {
        self.killed.store(true, Relaxed);
        self.kill_signal.notify_waiters();
    }

    pub fn revive(&self) {
        self.killed.store(false, Relaxed);
    }
}

/// The scheduler: admits the head of the queue when a seat and KV blocks are free, then runs
/// its prefill. Ends at [`Engine::shutdown`].
async fn schedule(engine: Arc<Engine>) {
    // When the prefill engine finishes its current work (planned, in real time).
    let mut free_at = Instant::now();
    while !engine.stopped.load(Relaxed) {
        let next = {
            let mut state = engine.state.lock();
            let block_size = engine.config.block_size;
            while let Some(w) = state.waiting.pop_front() {
                if !w.reply.is_closed() {
                    state.waiting.push_front(w);
                    break;
                }
                state.arrived(w.job.prompt_hashes(block_size));
            }
            let State {
                cache,
                waiting,
                running,
                ..
            } = &mut *state;
            let admitted = match waiting.front() {
                Some(w) if *running < engine.config.max_num_seqs => {
                    let job = &w.job;
                    match cache.allocate(
                        job.prompt_hashes(block_size),
                        job.prompt_tokens,
                        job.total_tokens,
                    ) {
                        Ok(alloc) => {
                            *running += 1;
                            Some(Ok((waiting.pop_front().expect("front exists"), alloc)))
                        }
                        Err(Shortage::Wait) => None,
                        Err(Shortage::Never { needed, total }) => Some(Err((
                            waiting.pop_front().expect("front exists"),
                            needed,
                            total,
                        ))),
                    }
                }
                _ => None,
            };
            if let Some(Err((w, _, _))) = &admitted {
                state.arrived(w.job.prompt_hashes(block_size));
            }
            admitted
        };
        match next {
            None => engine.wake.notified().await,
            Some(Err((w, needed_blocks, total_blocks))) => {
                let _ = w.reply.send(Err(Refusal::TooLong {
                    needed_blocks,
                    total_blocks,
                }));
            }
            Some(Ok((w, alloc))) => {
                // The allocation may have evicted blocks.
                engine.publish_events();
                prefill(&engine, w, alloc, &mut free_at).await
            }
        }
    }
}

async fn prefill(engine: &Arc<Engine>, w: Waiting, mut alloc: Allocation, free_at: &mut Instant) {
    let config = &engine.config;
    let cached_tokens = alloc.cached_blocks() * config.block_size;
    let uncached = w.job.prompt_tokens - cached_tokens;
    let prefill_secs = config.prefill_secs(uncached);
    // Planned times, not measured ones: a late wake-up shortens the next wait instead of
    // pushing every later request back (timers have a resolution of about 1 ms).
    let start = (*free_at).max(Instant::now());
    let done = start + engine.real(prefill_secs);
    *free_at = done;
    if engine.time_scale() > 0.0 {
        tokio::time::sleep_until(done.into()).await;
    }
    let mut state = engine.state.lock();
    let prompt_hashes = w.job.prompt_hashes(config.block_size);
    state.cache.commit(&mut alloc, prompt_hashes, &w.job.tokens);
    state.arrived(prompt_hashes);
    drop(state);
    engine.publish_events();
    let m = &engine.metrics;
    m.prefix_cache_queries
        .fetch_add(w.job.prompt_tokens as u64, Relaxed);
    m.prefix_cache_hits.fetch_add(cached_tokens as u64, Relaxed);
    m.prompt_tokens
        .fetch_add(w.job.prompt_tokens as u64, Relaxed);
    let ttft_secs = engine
        .simulated(done.saturating_duration_since(w.arrived))
        .max(prefill_secs);
    m.ttft.observe(ttft_secs);
    let lease = Lease {
        engine: engine.clone(),
        alloc: Some(alloc),
        hashes: w.job.block_hashes,
        tokens: w.job.tokens,
    };
    // If the client left meanwhile, the lease comes back and is dropped: blocks and seat free.
    let _ = w.reply.send(Ok(Admitted {
        lease,
        cached_tokens,
        first_token_at: done,
        ttft_secs,
    }));
}

/// A running request's seat and KV blocks, given back when dropped.
pub struct Lease {
    engine: Arc<Engine>,
    alloc: Option<Allocation>,
    hashes: Vec<u64>,
    tokens: Arc<[TokenId]>,
}

impl Lease {
    /// Caches the full blocks of the prompt and the first `tokens_done` tokens of the sequence
    /// before the blocks are released.
    pub fn finish(mut self, tokens_done: usize) {
        if let Some(mut alloc) = self.alloc.take() {
            let blocks = (tokens_done / self.engine.config.block_size).min(self.hashes.len());
            let mut state = self.engine.state.lock();
            state
                .cache
                .commit(&mut alloc, &self.hashes[..blocks], &self.tokens);
            state.cache.release(alloc);
            state.running -= 1;
            drop(state);
            self.engine.publish_events();
            self.engine.wake.notify_one();
        }
    }
}

impl Drop for Lease {
    /// A lease dropped without [`Lease::finish`] is an aborted request.
    fn drop(&mut self) {
        if let Some(alloc) = self.alloc.take() {
            self.engine.metrics.success_abort.fetch_add(1, Relaxed);
            let mut state = self.engine.state.lock();
            state.cache.release(alloc);
            state.running -= 1;
            drop(state);
            self.engine.wake.notify_one();
        }
    }
}
