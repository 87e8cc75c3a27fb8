//! The server's counters, exposed under vLLM's metric names in the Prometheus text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// vLLM's buckets for `vllm:time_to_first_token_seconds`.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for `vllm:e2e_request_latency_seconds`.
const E2E_BUCKETS: [f64; 22] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0, 30720.0,
];

/// A fixed-bucket histogram of seconds.
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, secs: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| secs <= b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.sum_micros
            .fetch_add((secs.max(0.0) * 1e6) as u64, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    fn reset(&self) {
        for c in &self.counts {
            c.store(0, Relaxed);
        }
        self.sum_micros.store(0, Relaxed);
        self.count.store(0, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count.load(Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{bound:?}\"}} {cumulative}.0"
            );
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}.0");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}.0");
        let sum = self.sum_micros.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
    }
}

/// Counters of one server.
pub struct Metrics {
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    /// Prompt tokens asked of the KV connector (a decode's prompt less its local hits), and
    /// those pulled from a prefill server.
    pub external_prefix_cache_queries: AtomicU64,
    pub external_prefix_cache_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub success_stop: AtomicU64,
    pub success_length: AtomicU64,
    pub success_abort: AtomicU64,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            external_prefix_cache_queries: AtomicU64::new(0),
            external_prefix_cache_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            success_stop: AtomicU64::new(0),
            success_length: AtomicU64::new(0),
            success_abort: AtomicU64::new(0),
            ttft: Histogram::new(&TTFT_BUCKETS),
            e2e: Histogram::new(&E2E_BUCKETS),
        }
    }
}

/// Values read at scrape time from the engine's state.
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl Metrics {
    pub fn reset(&self) {
        for c in [
            &self.prefix_cache_queries,
            &self.prefix_cache_hits,
            &self.external_prefix_cache_queries,
            &self.external_prefix_cache_hits,
            &self.prompt_tokens,
            &self.generation_tokens,
            &self.success_stop,
            &self.success_length,
            &self.success_abort,
        ] {
            c.store(0, Relaxed);
        }
        self.ttft.reset();
        self.e2e.reset();
    }

    /// The Prometheus text exposition, as vLLM names things.
    pub fn render(&self, model: &str, g: &Gauges) -> String {
        let labels = format!("engine=\"0\",model_name=\"{model}\"");
        let mut out = String::with_capacity(8 * 1024);
        let gauge = |out: &mut String, name: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {value:?}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {value}.0"
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            g.running as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            g.waiting as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            g.kv_usage,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prefix_cache_queries.load(Relaxed),
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_cache_hits.load(Relaxed),
        );
        counter(
            &mut out,
            "vllm:external_prefix_cache_queries",
            "Prompt tokens asked of the KV connector (another server's cache).",
            self.external_prefix_cache_queries.load(Relaxed),
        );
        counter(
            &mut out,
            "vllm:external_prefix_cache_hits",
            "Prompt tokens the KV connector brought from another server.",
            self.external_prefix_cache_hits.load(Relaxed),
        );
        counter(
            &mut out,
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            self.prompt_tokens.load(Relaxed),
        );
        counter(
            &mut out,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            self.generation_tokens.load(Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
        );
        for (reason, c) in [
            ("stop", &self.success_stop),
            ("length", &self.success_length),
            ("abort", &self.success_abort),
        ] {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {}.0",
                c.load(Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",model_name=\"{model}\",num_gpu_blocks=\"{}\"}} 1.0",
            g.block_size, g.num_blocks
        );
        self.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
        );
        self.e2e.render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &labels,
        );
        out
    }
}
