//! One simulated server's engine: a FIFO waiting queue, one prefill engine, and decode seats.
//!
//! A request waits until a seat is free (`max_num_seqs`) and the KV cache can hold it, then
//! the prefill engine computes its uncached prompt tokens in steps, as vLLM's scheduler does:
//! each step computes up to `max_num_batched_tokens` prompt tokens of the requests admitted,
//! at `prefill_tokens_per_s` plus a fixed overhead a step — so misses and imbalance turn into
//! queueing delay, and requests arriving together share a step. After prefill the
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
    /// For a decode after a remote prefill: the prompt tokens pulled from the prefill server
    /// just before (cached when it is scheduled, but vLLM counts them as the connector's hits,
    /// not the prefix cache's).
    pub external_tokens: Option<usize>,
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
    /// Admitted requests whose prompt is still being computed, in the order they started.
    prefilling: VecDeque<Prefilling>,
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
        no_longer_coming(&mut self.coming, hashes);
    }
}

/// Takes a request's prompt blocks off `coming` (prefilled, refused or abandoned).
fn no_longer_coming(coming: &mut HashMap<u64, u32>, hashes: &[u64]) {
    for h in hashes {
        if let Some(n) = coming.get_mut(h) {
            *n -= 1;
            if *n == 0 {
                coming.remove(h);
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
    /// The prefill step running now (real start and end), if any: decode tokens due within
    /// it come out at its end ([`Engine::decode_delay`]).
    prefill_step: Mutex<Option<(Instant, Instant)>>,
    /// Peers whose blocks this server has pulled (the first pull pays the handshake).
    pub peers: crate::disagg::Peers,
}

impl Engine {
    /// Creates the engine and starts its scheduler.
    pub fn start(config: Arc<SimConfig>) -> Arc<Self> {
        let engine = Arc::new(Self {
            metrics: Metrics::default(),
            state: Mutex::new(State {
                cache: KvCache::new(config.kv_blocks, config.block_size),
                waiting: VecDeque::new(),
                prefilling: VecDeque::new(),
                running: 0,
                coming: HashMap::new(),
            }),
            wake: Notify::new(),
            killed: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            time_scale_bits: AtomicU64::new(config.time_scale.to_bits()),
            kill_signal: Notify::new(),
            events_out: Mutex::new(None),
            prefill_step: Mutex::new(None),
            peers: Default::default(),
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
        state.prefilling.clear();
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

    /// Caches blocks pulled from a prefill server (the hashes of the prompt's leading full
    /// blocks, of `tokens`) as if computed here. None are kept when running requests hold every
    /// block: the request then computes its prompt itself.
    pub fn receive(&self, hashes: &[u64], tokens: &[TokenId]) {
        if hashes.is_empty() {
            return;
        }
        let n = hashes.len() * self.config.block_size;
        let mut state = self.state.lock();
        if let Ok(mut alloc) = state.cache.allocate(hashes, n, n) {
            state.cache.commit(&mut alloc, hashes, tokens);
            state.cache.release(alloc);
        }
        drop(state);
        self.publish_events();
    }

    /// How long past `now` a decode token due now waits: until the end of the prefill step
    /// running now, times `--prefill-stalls-decode`.
    pub fn decode_delay(&self, now: Instant) -> std::time::Duration {
        match *self.prefill_step.lock() {
            Some((start, end)) if start <= now && now < end => {
                (end - now).mul_f64(self.config.prefill_stalls_decode)
            }
            _ => std::time::Duration::ZERO,
        }
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

/// A request admitted to the prefill engine whose first token is not out yet.
struct Prefilling {
    waiting: Waiting,
    alloc: Allocation,
    cached_tokens: usize,
    /// Prompt tokens computed so far, the cached ones included.
    computed: usize,
}

impl Prefilling {
    fn done(&self) -> bool {
        self.computed >= self.waiting.job.prompt_tokens
    }
}

/// What one engine step computes.
#[derive(Default)]
struct Step {
    /// Prompt tokens computed in the step.
    tokens: usize,
    /// Requests that can never fit, taken off the queue.
    refused: Vec<(Waiting, usize, usize)>,
}

impl State {
    /// Drops the requests whose client left; returns how many had been admitted.
    fn drop_abandoned(&mut self, block_size: usize) -> u64 {
        let State {
            cache,
            waiting,
            prefilling,
            running,
            coming,
        } = self;
        waiting.retain(|w| {
            let open = !w.reply.is_closed();
            if !open {
                no_longer_coming(coming, w.job.prompt_hashes(block_size));
            }
            open
        });
        let before = prefilling.len();
        prefilling.retain_mut(|p| {
            let open = !p.waiting.reply.is_closed();
            if !open {
                cache.release(std::mem::take(&mut p.alloc));
                *running -= 1;
                no_longer_coming(coming, p.waiting.job.prompt_hashes(block_size));
            }
            open
        });
        (before - prefilling.len()) as u64
    }

    /// Plans the next engine step as vLLM's scheduler does: the prompts being prefilled go on
    /// first, then waiting requests are admitted while a seat, KV blocks and the step's token
    /// budget last; a prompt longer than what is left of the budget is computed in chunks.
    /// The blocks a step computes are cached when it is planned, so a request admitted later
    /// in the same step finds the blocks of the ones before it: siblings arriving together
    /// compute their shared prefix once.
    fn plan_step(&mut self, config: &SimConfig) -> Step {
        let block_size = config.block_size;
        let mut budget = config.max_num_batched_tokens;
        let mut step = Step::default();
        let State {
            cache,
            waiting,
            prefilling,
            running,
            ..
        } = self;
        for p in prefilling.iter_mut() {
            if budget == 0 {
                break;
            }
            step.tokens += advance(cache, p, &mut budget, block_size);
        }
        while budget > 0 && *running < config.max_num_seqs {
            let Some(w) = waiting.front() else { break };
            let job = &w.job;
            match cache.allocate(
                job.prompt_hashes(block_size),
                job.prompt_tokens,
                job.total_tokens,
            ) {
                Ok(alloc) => {
                    *running += 1;
                    let cached_tokens = alloc.cached_blocks() * block_size;
                    let mut p = Prefilling {
                        waiting: waiting.pop_front().expect("front exists"),
                        alloc,
                        cached_tokens,
                        computed: cached_tokens,
                    };
                    step.tokens += advance(cache, &mut p, &mut budget, block_size);
                    prefilling.push_back(p);
                }
                Err(Shortage::Wait) => break,
                Err(Shortage::Never { needed, total }) => {
                    let w = waiting.pop_front().expect("front exists");
                    step.refused.push((w, needed, total));
                }
            }
        }
        for (w, _, _) in &step.refused {
            self.arrived(w.job.prompt_hashes(block_size));
        }
        step
    }
}

/// Computes the next chunk of `p`'s prompt within `budget` and caches its full blocks;
/// returns the tokens computed.
fn advance(
    cache: &mut KvCache,
    p: &mut Prefilling,
    budget: &mut usize,
    block_size: usize,
) -> usize {
    let job = &p.waiting.job;
    let take = job.prompt_tokens.saturating_sub(p.computed).min(*budget);
    p.computed += take;
    *budget -= take;
    let hashes = job.prompt_hashes(block_size);
    let full = (p.computed / block_size).min(hashes.len());
    cache.commit(&mut p.alloc, &hashes[..full], &job.tokens);
    take
}

/// The scheduler: runs engine steps back to back while there are prompts to prefill, each
/// taking the step overhead plus its tokens at the prefill rate; a request's first token is
/// out when the step that computes the end of its prompt ends. Ends at [`Engine::shutdown`].
async fn schedule(engine: Arc<Engine>) {
    // When the prefill engine finishes its current step (planned, in real time).
    let mut free_at = Instant::now();
    while !engine.stopped.load(Relaxed) {
        let step = {
            let mut state = engine.state.lock();
            let aborted = state.drop_abandoned(engine.config.block_size);
            if aborted > 0 {
                engine.metrics.success_abort.fetch_add(aborted, Relaxed);
            }
            state.plan_step(&engine.config)
        };
        let refused = !step.refused.is_empty();
        for (w, needed_blocks, total_blocks) in step.refused {
            let _ = w.reply.send(Err(Refusal::TooLong {
                needed_blocks,
                total_blocks,
            }));
        }
        if step.tokens == 0 {
            if !refused {
                engine.wake.notified().await;
            }
            continue;
        }
        // Admissions may have evicted blocks, and the step cached new ones.
        engine.publish_events();
        let step_secs = engine.config.step_secs(step.tokens);
        // Planned times, not measured ones: a late wake-up shortens the next wait instead of
        // pushing every later request back (timers have a resolution of about 1 ms).
        let start = free_at.max(Instant::now());
        let done = start + engine.real(step_secs);
        free_at = done;
        *engine.prefill_step.lock() = Some((start, done));
        if engine.time_scale() > 0.0 {
            tokio::time::sleep_until(done.into()).await;
        }
        first_tokens(&engine, done, step_secs);
    }
}

/// Hands the requests whose prompt the step finished their first token.
fn first_tokens(engine: &Arc<Engine>, done: Instant, step_secs: f64) {
    let block_size = engine.config.block_size;
    let finished: Vec<Prefilling> = {
        let mut state = engine.state.lock();
        let (finished, going_on): (Vec<_>, Vec<_>) = std::mem::take(&mut state.prefilling)
            .into_iter()
            .partition(Prefilling::done);
        state.prefilling = going_on.into();
        for p in &finished {
            state.arrived(p.waiting.job.prompt_hashes(block_size));
        }
        finished
    };
    let m = &engine.metrics;
    for p in finished {
        let Prefilling {
            waiting: w,
            alloc,
            cached_tokens,
            ..
        } = p;
        let external = w.job.external_tokens.unwrap_or(0).min(cached_tokens);
        m.prefix_cache_queries
            .fetch_add(w.job.prompt_tokens as u64, Relaxed);
        m.prefix_cache_hits
            .fetch_add((cached_tokens - external) as u64, Relaxed);
        if w.job.external_tokens.is_some() {
            // What the local cache lacked was asked of the connector.
            m.external_prefix_cache_queries.fetch_add(
                (w.job.prompt_tokens - (cached_tokens - external)) as u64,
                Relaxed,
            );
            m.external_prefix_cache_hits
                .fetch_add(external as u64, Relaxed);
        }
        m.prompt_tokens
            .fetch_add(w.job.prompt_tokens as u64, Relaxed);
        let ttft_secs = engine
            .simulated(done.saturating_duration_since(w.arrived))
            .max(step_secs);
        m.ttft.observe(ttft_secs);
        let lease = Lease {
            engine: engine.clone(),
            alloc: Some(alloc),
            hashes: w.job.block_hashes,
            tokens: w.job.tokens,
        };
        // If the client left meanwhile, the lease comes back and is dropped: blocks and seat
        // free.
        let _ = w.reply.send(Ok(Admitted {
            lease,
            cached_tokens,
            first_token_at: done,
            ttft_secs,
        }));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: usize = 16;

    fn config(max_num_batched_tokens: usize) -> SimConfig {
        SimConfig {
            block_size: BLOCK,
            kv_blocks: 100,
            max_num_batched_tokens,
            ..SimConfig::default()
        }
    }

    fn state() -> State {
        State {
            cache: KvCache::new(100, BLOCK),
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            running: 0,
            coming: HashMap::new(),
        }
    }

    /// Queues a prompt of `tokens` tokens whose full blocks are named `first_block..`.
    fn enqueue(
        state: &mut State,
        first_block: u64,
        tokens: usize,
    ) -> oneshot::Receiver<Result<Admitted, Refusal>> {
        let block_hashes: Vec<u64> = (first_block..).take(tokens / BLOCK).collect();
        let job = Job {
            block_hashes,
            tokens: vec![0; tokens].into(),
            prompt_tokens: tokens,
            total_tokens: tokens + 1,
            external_tokens: None,
        };
        state.expect(job.prompt_hashes(BLOCK));
        let (reply, admitted) = oneshot::channel();
        state.waiting.push_back(Waiting {
            job,
            arrived: Instant::now(),
            reply,
        });
        admitted
    }

    #[test]
    fn requests_waiting_together_share_a_step_and_compute_a_common_prefix_once() {
        let mut state = state();
        // Two siblings (10 equal blocks, then 10 more tokens) and an unrelated prompt.
        let _a = enqueue(&mut state, 0, 170);
        let _b = enqueue(&mut state, 0, 170);
        let _c = enqueue(&mut state, 1000, 50);
        let step = state.plan_step(&config(8192));
        // a computes 170; b finds a's 10 blocks and computes its last 10 tokens; c its 50.
        assert_eq!(step.tokens, 170 + 10 + 50);
        let cached: Vec<usize> = state.prefilling.iter().map(|p| p.cached_tokens).collect();
        assert_eq!(cached, [0, 160, 0]);
        assert!(state.prefilling.iter().all(Prefilling::done));
        assert_eq!(state.running, 3);
    }

    #[test]
    fn a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks() {
        let mut state = state();
        let _long = enqueue(&mut state, 0, 170);
        let config = config(64);
        // Each step computes 64 tokens and caches the blocks it completed.
        assert_eq!(state.plan_step(&config).tokens, 64);
        assert_eq!(state.cache.cached_blocks(), 4);
        assert!(!state.prefilling[0].done());
        // A request arriving meanwhile waits: the budget goes to the prompt already started.
        let _next = enqueue(&mut state, 1000, 50);
        assert_eq!(state.plan_step(&config).tokens, 64);
        assert_eq!(state.prefilling.len(), 1);
        // The last 42 tokens, and 22 of the next prompt in the budget left.
        assert_eq!(state.plan_step(&config).tokens, 64);
        assert!(state.prefilling[0].done());
        assert_eq!(state.prefilling[1].computed, 22);
        assert_eq!(state.cache.cached_blocks(), 10 + 1);
    }

    #[test]
    fn a_client_that_leaves_frees_its_seat_and_blocks_mid_prefill() {
        let mut state = state();
        let gone = enqueue(&mut state, 0, 170);
        let config = config(64);
        state.plan_step(&config);
        assert_eq!((state.running, state.cache.usage() > 0.0), (1, true));
        drop(gone);
        assert_eq!(state.drop_abandoned(BLOCK), 1);
        assert_eq!((state.running, state.cache.usage()), (0, 0.0));
        assert!(state.coming.is_empty());
        assert_eq!(state.plan_step(&config).tokens, 0);
    }
}
