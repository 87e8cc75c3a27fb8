//! The load driver: sends a workload's requests at their arrival times and measures each.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use indicatif::ProgressBar;
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::oracle::Oracle;
use crate::workload::{self, Api, Job, TraceItem, WorkloadArgs};

/// How requests arrive.
#[derive(Clone, Copy, Debug)]
pub enum Arrivals {
    /// Open loop: a Poisson process at this many jobs per second.
    Poisson(f64),
    /// Closed loop: this many clients, each sending its next job when the last one ends.
    Closed(usize),
    /// At the times the trace gives.
    Trace,
}

/// One request's measurements.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Sample {
    /// Seconds from the run's start to sending it.
    pub sent_at: f64,
    pub ok: bool,
    pub status: u16,
    /// Seconds to the first byte of the answer (streams) or to the whole answer.
    pub ttft: f64,
    pub e2e: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    /// Streams: seconds between successive chunks of the answer after the first (each chunk
    /// one token or more: vLLM streams a token a chunk), the inter-token latencies.
    #[serde(skip)]
    pub itl: Vec<f64>,
    pub error: Option<String>,
    /// Its `x-priority` and `x-tenant` headers, if it had them (overload workload).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// Where requests go.
pub enum Target {
    /// A system's URL(s): several replicas get requests round robin.
    Urls {
        urls: Vec<String>,
        next: AtomicUsize,
    },
    /// Straight to the sims, routed by their own `/sim/probe`.
    Oracle(Arc<Oracle>),
}

impl Target {
    pub fn urls(urls: Vec<String>) -> Self {
        Target::Urls {
            urls,
            next: AtomicUsize::new(0),
        }
    }

    /// The base URL for the next request (the oracle's lease counts it in flight until
    /// dropped).
    pub async fn pick(
        &self,
        client: &reqwest::Client,
        body: &Value,
    ) -> (String, Option<crate::oracle::Lease>) {
        match self {
            Target::Urls { urls, next } => {
                (urls[next.fetch_add(1, Relaxed) % urls.len()].clone(), None)
            }
            Target::Oracle(oracle) => {
                let (url, lease) = oracle.pick(client, body).await;
                (url, Some(lease))
            }
        }
    }
}

/// What a run produced.
pub struct Driven {
    pub samples: Vec<Sample>,
    pub wall: Duration,
    /// The requests as sent, with their send times (for `--write-trace`).
    pub sent: Vec<TraceItem>,
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(900))
        .build()
        .expect("a plain HTTP client builds")
}

struct Shared {
    client: reqwest::Client,
    target: Target,
    args: WorkloadArgs,
    started: Instant,
    samples: Mutex<Vec<Sample>>,
    sent: Mutex<Vec<TraceItem>>,
    progress: ProgressBar,
    record_sent: bool,
    deadline: Option<Instant>,
}

impl Shared {
    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Sends one request; returns its sample and the answer's text.
    async fn send(
        &self,
        endpoint: Api,
        body: &Value,
        headers: &BTreeMap<String, String>,
    ) -> (Sample, String) {
        if self.record_sent {
            self.sent.lock().push(TraceItem {
                t: Some(self.started.elapsed().as_secs_f64()),
                endpoint,
                body: body.clone(),
                headers: headers.clone(),
            });
        }
        let (base, mut lease) = match &self.target {
            Target::Urls { urls, next } => {
                (urls[next.fetch_add(1, Relaxed) % urls.len()].clone(), None)
            }
            Target::Oracle(oracle) => {
                let (url, lease) = oracle.pick(&self.client, body).await;
                (url, Some(lease))
            }
        };
        let start = Instant::now();
        let result = exchange_with(
            &self.client,
            &format!("{base}{}", endpoint.path()),
            body,
            headers,
            start,
            || {
                if let Some(l) = &mut lease {
                    l.first_byte();
                }
            },
        )
        .await;
        drop(lease);
        let (mut sample, answer) = match result {
            Ok(x) => x,
            Err(e) => (
                Sample {
                    ok: false,
                    ttft: start.elapsed().as_secs_f64(),
                    e2e: start.elapsed().as_secs_f64(),
                    error: Some(e),
                    ..Sample::default()
                },
                String::new(),
            ),
        };
        sample.sent_at = start.duration_since(self.started).as_secs_f64();
        sample.priority = headers.get("x-priority").cloned();
        sample.tenant = headers.get("x-tenant").cloned();
        self.samples.lock().push(sample.clone());
        self.progress.inc(1);
        (sample, answer)
    }

    async fn run_job(&self, job: Job) {
        match job {
            Job::Single(item) => {
                self.send(item.endpoint, &item.body, &item.headers).await;
            }
            Job::Burst(items) => {
                let start = tokio::time::Instant::now();
                let sends = items.iter().map(|item| async move {
                    let at = Duration::from_secs_f64(item.t.unwrap_or(0.0).max(0.0));
                    tokio::time::sleep_until(start + at).await;
                    self.send(item.endpoint, &item.body, &item.headers).await;
                });
                futures_util::future::join_all(sends).await;
            }
            Job::Conversation(mut conv) => {
                let no_headers = &BTreeMap::new();
                for turn in 0..conv.questions.len() {
                    if turn > 0 {
                        if let Some(&think) = conv.think.get(turn) {
                            tokio::time::sleep(Duration::from_secs_f64(think.max(0.0))).await;
                        }
                    }
                    if self.past_deadline() {
                        return;
                    }
                    let question = conv.questions[turn].clone();
                    let body = workload::turn_body(&self.args, &conv, &question);
                    let retry = conv.retries.get(turn).and_then(Option::as_ref).map(|r| {
                        let body = workload::turn_body(&self.args, &conv, &r.question);
                        let after = Duration::from_secs_f64(r.after.max(0.0));
                        async move {
                            tokio::time::sleep(after).await;
                            self.send(self.args.api, &body, no_headers).await;
                        }
                    });
                    let turn_itself = self.send(self.args.api, &body, no_headers);
                    let ((sample, answer), ()) = futures_util::future::join(
                        turn_itself,
                        futures_util::future::OptionFuture::from(retry).map(|_| ()),
                    )
                    .await;
                    if !sample.ok {
                        return;
                    }
                    conv.messages
                        .push(json!({"role": "user", "content": question}));
                    conv.messages
                        .push(json!({"role": "assistant", "content": answer}));
                }
            }
        }
    }
}

/// Sends `body` to `url` and reads the answer (SSE or JSON) to its end.
pub async fn exchange(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    start: Instant,
) -> Result<(Sample, String), String> {
    exchange_with(client, url, body, &BTreeMap::new(), start, || {}).await
}

/// [`exchange`] with request headers.
pub async fn exchange_with(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &BTreeMap<String, String>,
    start: Instant,
    mut on_first_byte: impl FnMut(),
) -> Result<(Sample, String), String> {
    let mut request = client.post(url).json(body);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let resp = request.send().await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let streamed = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let mut ttft = None;
    let mut last_chunk = 0.0;
    let mut itl = Vec::new();
    let mut bytes = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("the answer broke off: {e}"))?;
        if chunk.is_empty() {
            continue;
        }
        let now = start.elapsed().as_secs_f64();
        if ttft.is_none() {
            ttft = Some(now);
            on_first_byte();
        } else {
            itl.push(now - last_chunk);
        }
        last_chunk = now;
        bytes.extend_from_slice(&chunk);
    }
    let e2e = start.elapsed().as_secs_f64();
    let mut sample = Sample {
        ok: (200..300).contains(&status),
        status,
        ttft: if streamed { ttft.unwrap_or(e2e) } else { e2e },
        e2e,
        itl: if streamed { itl } else { Vec::new() },
        ..Sample::default()
    };
    let text = String::from_utf8_lossy(&bytes);
    let mut answer = String::new();
    let mut read_usage = |v: &Value| {
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            sample.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
            sample.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
            sample.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
    };
    if streamed {
        let mut done = false;
        // Chunks that carried text: the output tokens where the stream reports no usage (a
        // request without `stream_options.include_usage`; vLLM streams a token a chunk).
        let mut text_chunks = 0u64;
        for event in text.split("\n\n") {
            let Some(data) = event.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if v.get("error").is_some() {
                sample.ok = false;
                sample.error = Some(
                    v["error"]["message"]
                        .as_str()
                        .unwrap_or("error event")
                        .to_owned(),
                );
            }
            read_usage(&v);
            if let Some(c) = v["choices"].get(0) {
                if let Some(t) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
                    answer.push_str(t);
                    text_chunks += u64::from(!t.is_empty());
                }
            }
        }
        if sample.completion_tokens == 0 {
            sample.completion_tokens = text_chunks;
        }
        if !done && sample.ok {
            sample.ok = false;
            sample.error = Some("the stream ended without [DONE]".into());
        }
    } else if let Ok(v) = serde_json::from_str::<Value>(&text) {
        read_usage(&v);
        if let Some(c) = v["choices"].get(0) {
            if let Some(t) = c["message"]["content"].as_str().or(c["text"].as_str()) {
                answer.push_str(t);
            }
        }
        if !sample.ok {
            sample.error = Some(v["error"]["message"].as_str().unwrap_or("error").to_owned());
        }
    }
    if !sample.ok && sample.error.is_none() {
        sample.error = Some(format!("status {status}"));
    }
    Ok((sample, answer))
}

/// Exponential inter-arrival times from a seeded generator.
pub fn poisson_times(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut t = 0.0;
    let mut state = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    (0..n)
        .map(|_| {
            state = workload::splitmix(state);
            let u = ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let at = t;
            t += -u.ln() / rate;
            at
        })
        .collect()
}

/// Runs `jobs` against `target`, stopping new jobs after `duration` if given.
pub async fn drive(
    target: Target,
    jobs: Vec<Job>,
    args: &WorkloadArgs,
    arrivals: Arrivals,
    duration: Option<Duration>,
    progress: ProgressBar,
) -> Driven {
    let started = Instant::now();
    let shared = Arc::new(Shared {
        client: client(),
        target,
        args: args.clone(),
        started,
        samples: Mutex::new(Vec::new()),
        sent: Mutex::new(Vec::new()),
        progress,
        record_sent: args.write_trace.is_some(),
        deadline: duration.map(|d| started + d),
    });
    match arrivals {
        Arrivals::Closed(clients) => {
            let queue = Arc::new(Mutex::new(VecDeque::from(jobs)));
            let workers = (0..clients.max(1)).map(|_| {
                let (shared, queue) = (shared.clone(), queue.clone());
                tokio::spawn(async move {
                    loop {
                        if shared.past_deadline() {
                            return;
                        }
                        let Some(job) = queue.lock().pop_front() else {
                            return;
                        };
                        shared.run_job(job).await;
                    }
                })
            });
            futures_util::future::join_all(workers).await;
        }
        Arrivals::Poisson(_) | Arrivals::Trace => {
            let times: Vec<f64> = match arrivals {
                Arrivals::Poisson(rate) => poisson_times(jobs.len(), rate, args.seed),
                _ => jobs.iter().map(|j| j.start().unwrap_or(0.0)).collect(),
            };
            let tasks: Vec<_> = jobs
                .into_iter()
                .zip(times)
                .map(|(job, at)| {
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep_until(
                            (started + Duration::from_secs_f64(at.max(0.0))).into(),
                        )
                        .await;
                        if !shared.past_deadline() {
                            shared.run_job(job).await;
                        }
                    })
                })
                .collect();
            futures_util::future::join_all(tasks).await;
        }
    }
    let wall = started.elapsed();
    let shared = Arc::try_unwrap(shared).ok().expect("all tasks ended");
    shared.progress.finish_and_clear();
    Driven {
        samples: shared.samples.into_inner(),
        wall,
        sent: shared.sent.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_times_have_the_asked_rate() {
        let times = poisson_times(20_000, 100.0, 7);
        let rate = times.len() as f64 / times.last().unwrap();
        assert!((95.0..105.0).contains(&rate), "{rate}");
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(times, poisson_times(20_000, 100.0, 7));
    }
}
