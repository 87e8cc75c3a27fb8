//! Workloads: seeded, deterministic request streams. Lengths are in the simulator's tokens
//! (4 bytes of text each).

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Bytes of text per simulator token.
pub const BYTES_PER_TOKEN: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[clap(rename_all = "kebab-case")]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// SGLang's generated-shared-prefix: groups of questions under one long system prompt.
    SharedPrefix,
    /// production-stack's multi-round QA: conversations that grow by the answers they get.
    MultiTurn,
    /// vLLM's prefix-repetition: a few prefixes, each followed by random suffixes.
    PrefixRepetition,
    /// Nothing shared at all: the control where prefix routing must not lose.
    Random,
    /// Replays a JSONL trace (`--trace FILE`).
    Trace,
    /// Replays a Mooncake trace (`--trace FILE`: `timestamp` ms, `input_length`,
    /// `output_length`, `hash_ids` of 512-token blocks; equal ids are equal text), its blocks
    /// and lengths scaled by `--mooncake-block-tokens`.
    Mooncake,
    /// Agents fanning out: bursts of `--burst` siblings under one long prefix, arriving within
    /// `--burst-spread-ms`.
    Bursty,
    /// Random prompts with two priorities (`--high-share` of them high, `x-priority: 1`) from
    /// `--tenants` tenants (`x-tenant`; the first sends half of them): run it above the fleet's
    /// capacity.
    Overload,
    /// Agent sessions: `--sessions` sessions, each under one of `--tool-specs` long tool
    /// specifications (a few popular, most rare), taking `--min-turns` to `--max-turns` turns
    /// whose history grows by every answer, a `--retry-share` of turns followed shortly by a
    /// retry branch on the same history, and a `--one-off-share` of unrelated one-off prompts
    /// between them. Times are the workload's own (`--session-rate`, tool time between turns),
    /// run `--speedup` times faster.
    Agent,
    /// Retrieval-augmented generation: each request is a short question after `--top-k`
    /// documents drawn from `--documents` long ones (a few popular, most rare), behind one
    /// shared instruction.
    Rag,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[clap(rename_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Chat,
    Completions,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }
}

/// The simulator's model name.
pub const DEFAULT_MODEL: &str = "sim-model";

#[derive(clap::Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// Which workload.
    #[arg(long, value_enum, default_value = "shared-prefix")]
    pub workload: WorkloadKind,
    /// The trace to replay (`--workload trace`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write the requests as sent (times and bodies) to this JSONL trace.
    #[arg(long)]
    pub write_trace: Option<PathBuf>,
    /// chat or completions.
    #[arg(long, value_enum, default_value = "chat")]
    pub api: Api,
    /// Ask for whole answers instead of streams (TTFT is then the whole latency).
    #[arg(long)]
    pub no_stream: bool,
    /// Model name in the requests (with `--fleet vllm`, the fleet's model unless given).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Seed of the texts and of the arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// shared-prefix: groups.
    #[arg(long, default_value_t = 64)]
    pub groups: usize,
    /// shared-prefix: prompts per group.
    #[arg(long, default_value_t = 16)]
    pub prompts_per_group: usize,
    /// shared-prefix and multi-turn: system prompt tokens.
    #[arg(long, default_value_t = 2048)]
    pub system_len: usize,
    /// shared-prefix and multi-turn: question tokens.
    #[arg(long, default_value_t = 128)]
    pub question_len: usize,
    /// Output tokens (shared-prefix, prefix-repetition, random).
    #[arg(long, default_value_t = 256)]
    pub output_len: usize,
    /// multi-turn: users (conversations).
    #[arg(long, default_value_t = 32)]
    pub users: usize,
    /// multi-turn: turns per user.
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    /// multi-turn: tokens of each user's own history before the first turn.
    #[arg(long, default_value_t = 1024)]
    pub history_len: usize,
    /// multi-turn: answer tokens per turn.
    #[arg(long, default_value_t = 128)]
    pub answer_len: usize,
    /// prefix-repetition: prefix tokens.
    #[arg(long, default_value_t = 1024)]
    pub prefix_len: usize,
    /// prefix-repetition: suffix tokens.
    #[arg(long, default_value_t = 256)]
    pub suffix_len: usize,
    /// prefix-repetition: distinct prefixes.
    #[arg(long, default_value_t = 16)]
    pub num_prefixes: usize,
    /// random: prompt tokens.
    #[arg(long, default_value_t = 1024)]
    pub input_len: usize,
    /// random and overload: requests in the workload.
    #[arg(long, default_value_t = 1024)]
    pub random_count: usize,
    /// mooncake and agent: time runs this many times faster than the trace's or the workload's
    /// own (the agent workload's load level).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// mooncake: tokens of text each hash id becomes (the trace's blocks hold 512). Input and
    /// output lengths scale with it, so a small fleet (a CPU vLLM with an 8k context) replays
    /// the trace's sharing and timing at its own size.
    #[arg(long, default_value_t = MOONCAKE_BLOCK_TOKENS)]
    pub mooncake_block_tokens: usize,
    /// bursty: siblings per burst.
    #[arg(long, default_value_t = 8)]
    pub burst: usize,
    /// bursty: the siblings of a burst arrive within this many milliseconds.
    #[arg(long, default_value_t = 5.0)]
    pub burst_spread_ms: f64,
    /// overload: tenants.
    #[arg(long, default_value_t = 4)]
    pub tenants: usize,
    /// overload: the share of high-priority requests.
    #[arg(long, default_value_t = 0.2)]
    pub high_share: f64,
    /// agent: sessions.
    #[arg(long, default_value_t = 32)]
    pub sessions: usize,
    /// agent: new sessions per second (Poisson, before `--speedup`).
    #[arg(long, default_value_t = 2.0)]
    pub session_rate: f64,
    /// agent: distinct tool specifications; session i uses spec k with probability ∝ 1/(k+1).
    #[arg(long, default_value_t = 8)]
    pub tool_specs: usize,
    /// agent: tokens of each tool specification.
    #[arg(long, default_value_t = 3000)]
    pub tool_spec_len: usize,
    /// agent: fewest turns of a session.
    #[arg(long, default_value_t = 4)]
    pub min_turns: usize,
    /// agent: most turns of a session.
    #[arg(long, default_value_t = 9)]
    pub max_turns: usize,
    /// agent: the share of turns followed 50 ms later by a retry branch on the same history.
    #[arg(long, default_value_t = 0.25)]
    pub retry_share: f64,
    /// agent: the share of all requests that are unrelated one-off prompts.
    #[arg(long, default_value_t = 0.18)]
    pub one_off_share: f64,
    /// rag: documents.
    #[arg(long, default_value_t = 64)]
    pub documents: usize,
    /// rag: mean tokens of a document (each is 0.5 to 1.5 times it).
    #[arg(long, default_value_t = 2000)]
    pub document_len: usize,
    /// rag: documents retrieved for each question (distinct; popular ones first more often).
    #[arg(long, default_value_t = 3)]
    pub top_k: usize,
}

/// Tokens of one Mooncake hash id.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// One line of a Mooncake trace.
#[derive(Clone, Debug, Deserialize)]
pub struct MooncakeLine {
    /// Milliseconds from the trace's start.
    pub timestamp: f64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

/// One request of a workload.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TraceItem {
    /// Seconds from the start (traces); generated workloads get Poisson times. In a burst:
    /// from the burst's start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub t: Option<f64>,
    pub endpoint: Api,
    pub body: Value,
    /// Request headers (`x-priority`, `x-tenant`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub headers: std::collections::BTreeMap<String, String>,
}

/// A conversation (multi-turn) or an agent session: its later turns depend on the answers.
#[derive(Clone, Debug, Default)]
pub struct Conversation {
    pub messages: Vec<Value>,
    pub questions: Vec<String>,
    pub answer_len: usize,
    /// Seconds from the run's start to its first turn (agent sessions; otherwise the arrival
    /// process decides).
    pub start: Option<f64>,
    /// Seconds between an answer and the next turn (an agent's tool running); none if empty.
    pub think: Vec<f64>,
    /// Per turn, a retry branch sent shortly after it, on the same history.
    pub retries: Vec<Option<Retry>>,
}

/// A retry branch of an agent's turn: the same history with another last message, sent
/// `after` seconds after the turn itself; its answer is not kept.
#[derive(Clone, Debug)]
pub struct Retry {
    pub after: f64,
    pub question: String,
}

/// What the driver sends.
#[derive(Clone, Debug)]
pub enum Job {
    Single(TraceItem),
    Conversation(Conversation),
    /// Requests sent together, each `t` seconds after the burst's start.
    Burst(Vec<TraceItem>),
}

impl Job {
    /// Requests this job sends.
    pub fn requests(&self) -> usize {
        match self {
            Job::Single(_) => 1,
            Job::Conversation(c) => c.questions.len() + c.retries.iter().flatten().count(),
            Job::Burst(items) => items.len(),
        }
    }

    /// Seconds from the run's start to the job, if the workload sets it.
    pub fn start(&self) -> Option<f64> {
        match self {
            Job::Single(item) => item.t,
            Job::Conversation(c) => c.start,
            Job::Burst(_) => None,
        }
    }
}

/// Deterministic text: `tokens` simulator tokens of lowercase words, different for every seed.
pub fn text(seed: u64, tokens: usize) -> String {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let len = tokens * BYTES_PER_TOKEN;
    let mut out = String::with_capacity(len);
    while out.len() < len {
        state = splitmix(state);
        let word_len = 2 + (state % 8) as usize;
        for i in 0..word_len {
            out.push((b'a' + ((state >> (8 + i * 5)) % 26) as u8) as char);
        }
        out.push(' ');
    }
    out.truncate(len);
    out
}

pub fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A body for `api` with a system prompt and a user message.
pub fn body(args: &WorkloadArgs, system: &str, user: &str, max_tokens: usize) -> Value {
    let stream = !args.no_stream;
    let mut body = match args.api {
        Api::Chat => json!({
            "model": args.model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
        }),
        Api::Completions => json!({"model": args.model, "prompt": format!("{system}\n\n{user}")}),
    };
    let fields = body.as_object_mut().expect("an object");
    fields.insert("max_tokens".into(), json!(max_tokens));
    fields.insert("ignore_eos".into(), json!(true));
    fields.insert("temperature".into(), json!(0.0));
    fields.insert("stream".into(), json!(stream));
    if stream {
        fields.insert("stream_options".into(), json!({"include_usage": true}));
    }
    body
}

/// Shuffles deterministically.
fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut state = seed;
    for i in (1..items.len()).rev() {
        state = splitmix(state);
        items.swap(i, (state % (i as u64 + 1)) as usize);
    }
}

/// A uniform number in [0, 1) from `seed`.
fn unit(seed: u64) -> f64 {
    (splitmix(seed) >> 11) as f64 / (1u64 << 53) as f64
}

/// An index in `0..n` drawn with probability ∝ 1/(i+1) (Zipf with exponent 1): a few popular
/// items, a long tail of rare ones.
fn zipf(n: usize, u: f64) -> usize {
    let total: f64 = (1..=n).map(|i| 1.0 / i as f64).sum();
    let mut acc = 0.0;
    for i in 0..n {
        acc += 1.0 / (i + 1) as f64 / total;
        if u < acc {
            return i;
        }
    }
    n.saturating_sub(1)
}

/// A length between `lo` and `hi` tokens (inclusive) drawn from `seed`.
fn length(seed: u64, lo: usize, hi: usize) -> usize {
    lo + (splitmix(seed) % (hi.max(lo) - lo + 1) as u64) as usize
}

/// The workload's jobs, in arrival order.
pub fn jobs(args: &WorkloadArgs) -> anyhow::Result<Vec<Job>> {
    let seed = args.seed;
    let item = |body: Value| TraceItem {
        t: None,
        endpoint: args.api,
        body,
        headers: Default::default(),
    };
    let single = |body: Value| Job::Single(item(body));
    Ok(match args.workload {
        WorkloadKind::SharedPrefix => {
            let mut jobs = Vec::with_capacity(args.groups * args.prompts_per_group);
            for g in 0..args.groups as u64 {
                let system = text(seed ^ (g << 20), args.system_len);
                for p in 0..args.prompts_per_group as u64 {
                    let question = text(seed ^ (g << 20) ^ (p + 1) << 40, args.question_len);
                    jobs.push(single(body(args, &system, &question, args.output_len)));
                }
            }
            shuffle(&mut jobs, seed);
            jobs
        }
        WorkloadKind::PrefixRepetition => {
            let prefixes: Vec<String> = (0..args.num_prefixes as u64)
                .map(|i| text(seed ^ (i << 24), args.prefix_len))
                .collect();
            let n = args.num_prefixes * 16;
            (0..n as u64)
                .map(|i| {
                    let prefix = &prefixes[(splitmix(seed ^ i) % prefixes.len() as u64) as usize];
                    let suffix = text(seed ^ (i + 1) << 44, args.suffix_len);
                    single(body(args, prefix, &suffix, args.output_len))
                })
                .collect()
        }
        WorkloadKind::Random => (0..args.random_count as u64)
            .map(|i| {
                let prompt = text(seed ^ (i + 1) << 32, args.input_len);
                single(body(args, "", &prompt, args.output_len))
            })
            .collect(),
        WorkloadKind::MultiTurn => {
            let system = text(seed ^ 0xABCD, args.system_len);
            (0..args.users as u64)
                .map(|u| {
                    let history = text(seed ^ (u + 1) << 28, args.history_len);
                    Job::Conversation(Conversation {
                        messages: vec![
                            json!({"role": "system", "content": system}),
                            json!({"role": "user", "content": history}),
                            json!({"role": "assistant", "content": "Understood."}),
                        ],
                        questions: (0..args.turns as u64)
                            .map(|r| text(seed ^ (u + 1) << 28 ^ (r + 1) << 48, args.question_len))
                            .collect(),
                        answer_len: args.answer_len,
                        ..Conversation::default()
                    })
                })
                .collect()
        }
        WorkloadKind::Trace => {
            let path = args
                .trace
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("--workload trace needs --trace FILE"))?;
            read_trace(path)?.into_iter().map(Job::Single).collect()
        }
        WorkloadKind::Mooncake => {
            let path = args
                .trace
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("--workload mooncake needs --trace FILE"))?;
            anyhow::ensure!(args.speedup > 0.0, "--speedup must be positive");
            let block_tokens = args.mooncake_block_tokens;
            anyhow::ensure!(block_tokens > 0, "--mooncake-block-tokens must be positive");
            let mut blocks = std::collections::HashMap::new();
            read_mooncake(path)?
                .into_iter()
                .map(|line| {
                    let prompt = mooncake_prompt(&line, block_tokens, seed, &mut blocks);
                    let output = scale_to_block(line.output_length, block_tokens).max(1);
                    Job::Single(TraceItem {
                        t: Some(line.timestamp / 1000.0 / args.speedup),
                        ..item(body(args, "", &prompt, output))
                    })
                })
                .collect()
        }
        WorkloadKind::Bursty => (0..args.groups as u64)
            .map(|g| {
                let system = text(seed ^ (g << 20) ^ 0xB0B5, args.system_len);
                let n = args.burst.max(1);
                Job::Burst(
                    (0..n as u64)
                        .map(|s| {
                            let question =
                                text(seed ^ (g << 20) ^ (s + 1) << 40, args.question_len);
                            TraceItem {
                                t: Some(args.burst_spread_ms / 1e3 * s as f64 / n as f64),
                                ..item(body(args, &system, &question, args.output_len))
                            }
                        })
                        .collect(),
                )
            })
            .collect(),
        WorkloadKind::Agent => agent_jobs(args)?,
        WorkloadKind::Rag => rag_jobs(args)?,
        WorkloadKind::Overload => (0..args.random_count as u64)
            .map(|i| {
                let prompt = text(seed ^ (i + 1) << 32 ^ 0x0E, args.input_len);
                let roll =
                    |salt: u64| (splitmix(seed ^ i ^ salt) >> 11) as f64 / (1u64 << 53) as f64;
                let high = roll(0x41) < args.high_share;
                // The first tenant sends half of the requests, the others share the rest.
                let tenants = args.tenants.max(1);
                let tenant = if tenants == 1 || roll(0x7E) < 0.5 {
                    0
                } else {
                    1 + (splitmix(seed ^ i ^ 0x7F) % (tenants as u64 - 1)) as usize
                };
                let mut it = item(body(args, "", &prompt, args.output_len));
                it.headers
                    .insert("x-priority".into(), u8::from(high).to_string());
                it.headers
                    .insert("x-tenant".into(), format!("tenant-{tenant}"));
                Job::Single(it)
            })
            .collect(),
    })
}

/// Agent sessions (see [`WorkloadKind::Agent`]) and one-off prompts, each with its start time.
fn agent_jobs(args: &WorkloadArgs) -> anyhow::Result<Vec<Job>> {
    anyhow::ensure!(args.speedup > 0.0, "--speedup must be positive");
    anyhow::ensure!(args.session_rate > 0.0, "--session-rate must be positive");
    anyhow::ensure!(args.tool_specs > 0, "--tool-specs must be positive");
    anyhow::ensure!(
        (1..=args.max_turns).contains(&args.min_turns),
        "--min-turns must be between 1 and --max-turns"
    );
    anyhow::ensure!(
        (0.0..1.0).contains(&args.one_off_share) && (0.0..=1.0).contains(&args.retry_share),
        "--one-off-share must be in [0, 1) and --retry-share in [0, 1]"
    );
    let seed = args.seed ^ 0xA6E7;
    let specs: Vec<String> = (0..args.tool_specs as u64)
        .map(|k| text(seed ^ (k + 1) << 36, args.tool_spec_len))
        .collect();
    let starts = crate::driver::poisson_times(args.sessions, args.session_rate, seed);
    let mut jobs = Vec::new();
    let mut session_requests = 0usize;
    let mut last_start = 0.0f64;
    for (i, at) in starts.into_iter().enumerate() {
        let i = i as u64;
        let s = seed ^ (i + 1) << 20;
        let spec = &specs[zipf(specs.len(), unit(s ^ 1))];
        let turns = length(s ^ 2, args.min_turns, args.max_turns);
        // The task that opens the session, then per turn a tool's result.
        let task = text(s ^ 3, length(s ^ 4, 64, 256));
        let questions: Vec<String> = (0..turns as u64)
            .map(|t| text(s ^ (t + 1) << 44, length(s ^ (t + 1) << 44 ^ 5, 64, 512)))
            .collect();
        let think = (0..turns as u64)
            .map(|t| (0.3 + 1.2 * unit(s ^ (t + 1) << 44 ^ 6)) / args.speedup)
            .collect();
        let retries: Vec<Option<Retry>> = (0..turns as u64)
            .map(|t| {
                (unit(s ^ (t + 1) << 44 ^ 7) < args.retry_share).then(|| Retry {
                    after: 0.050 / args.speedup,
                    question: text(
                        s ^ (t + 1) << 44 ^ 8,
                        length(s ^ (t + 1) << 44 ^ 9, 64, 512),
                    ),
                })
            })
            .collect();
        session_requests += turns + retries.iter().flatten().count();
        let start = at / args.speedup;
        last_start = last_start.max(start);
        jobs.push(Job::Conversation(Conversation {
            messages: vec![
                json!({"role": "system", "content": spec}),
                json!({"role": "user", "content": task}),
                json!({"role": "assistant", "content": "Planning the steps."}),
            ],
            questions,
            answer_len: length(s ^ 10, 16, 128),
            start: Some(start),
            think,
            retries,
        }));
    }
    // One-offs: a share of all requests, spread evenly (Poisson) over the sessions' span.
    let one_offs = (session_requests as f64 * args.one_off_share / (1.0 - args.one_off_share))
        .round() as usize;
    let span = last_start.max(1.0 / args.speedup) + 8.0 / args.speedup;
    let times = crate::driver::poisson_times(one_offs, one_offs as f64 / span, seed ^ 0x0FF);
    for (j, t) in times.into_iter().enumerate() {
        let j = j as u64;
        let prompt = text(
            seed ^ (j + 1) << 30 ^ 0x0FF,
            length(seed ^ j ^ 0x0F1, 256, 2048),
        );
        jobs.push(Job::Single(TraceItem {
            t: Some(t),
            endpoint: args.api,
            body: body(args, "", &prompt, length(seed ^ j ^ 0x0F2, 16, 256)),
            headers: Default::default(),
        }));
    }
    jobs.sort_by(|a, b| {
        a.start()
            .unwrap_or(0.0)
            .total_cmp(&b.start().unwrap_or(0.0))
    });
    Ok(jobs)
}

/// RAG requests (see [`WorkloadKind::Rag`]).
fn rag_jobs(args: &WorkloadArgs) -> anyhow::Result<Vec<Job>> {
    anyhow::ensure!(args.documents > 0, "--documents must be positive");
    anyhow::ensure!(
        (1..=args.documents).contains(&args.top_k),
        "--top-k must be between 1 and --documents"
    );
    let seed = args.seed ^ 0x7A6;
    let instruction = text(seed, 200);
    let documents: Vec<String> = (0..args.documents as u64)
        .map(|d| {
            let len = length(
                seed ^ d ^ 0xD0C,
                args.document_len / 2,
                args.document_len * 3 / 2,
            );
            text(seed ^ (d + 1) << 32, len)
        })
        .collect();
    Ok((0..args.random_count as u64)
        .map(|i| {
            let s = seed ^ (i + 1) << 40;
            let mut picked: Vec<usize> = Vec::with_capacity(args.top_k);
            let mut draw = 0u64;
            while picked.len() < args.top_k {
                let d = zipf(documents.len(), unit(s ^ draw));
                draw += 1;
                if !picked.contains(&d) {
                    picked.push(d);
                }
            }
            let mut user = String::new();
            for d in picked {
                user.push_str(&documents[d]);
                user.push_str("\n\n");
            }
            user.push_str(&text(s ^ 0x0A, length(s ^ 0x0B, 16, 96)));
            Job::Single(TraceItem {
                t: None,
                endpoint: args.api,
                body: body(args, &instruction, &user, args.output_len),
                headers: Default::default(),
            })
        })
        .collect())
}

/// A length in the trace's tokens, in tokens of blocks of `block_tokens` (rounded up, so a
/// request that asked for something still does).
fn scale_to_block(tokens: usize, block_tokens: usize) -> usize {
    tokens
        .saturating_mul(block_tokens)
        .div_ceil(MOONCAKE_BLOCK_TOKENS)
}

/// A Mooncake request's prompt: the text of each hash id (the same for equal ids, each
/// `block_tokens` long), cut to its input length scaled to those blocks.
fn mooncake_prompt(
    line: &MooncakeLine,
    block_tokens: usize,
    seed: u64,
    blocks: &mut std::collections::HashMap<u64, String>,
) -> String {
    let tokens = scale_to_block(line.input_length, block_tokens);
    let bytes = tokens * BYTES_PER_TOKEN;
    let mut prompt = String::with_capacity(bytes);
    for id in &line.hash_ids {
        if prompt.len() >= bytes {
            break;
        }
        let block = blocks
            .entry(*id)
            .or_insert_with(|| text(seed ^ splitmix(*id ^ 0x4D00), block_tokens));
        prompt.push_str(block);
    }
    // A trace whose ids cover less than its length: the rest is this request's own.
    if prompt.len() < bytes {
        let own = text(seed ^ splitmix(line.timestamp.to_bits()) ^ 0x0D, tokens);
        prompt.push_str(&own[..bytes - prompt.len()]);
    }
    prompt.truncate(bytes);
    prompt
}

pub fn read_mooncake(path: &Path) -> anyhow::Result<Vec<MooncakeLine>> {
    read_jsonl(path)
}

/// The body of a conversation's next turn: its messages so far plus `question`.
pub fn turn_body(args: &WorkloadArgs, conv: &Conversation, question: &str) -> Value {
    let stream = !args.no_stream;
    let mut messages = conv.messages.clone();
    messages.push(json!({"role": "user", "content": question}));
    let mut body = match args.api {
        Api::Chat => json!({"model": args.model, "messages": messages}),
        Api::Completions => {
            let prompt: String = messages
                .iter()
                .map(|m| {
                    format!(
                        "{}: {}\n",
                        m["role"].as_str().unwrap_or(""),
                        m["content"].as_str().unwrap_or("")
                    )
                })
                .collect();
            json!({"model": args.model, "prompt": prompt})
        }
    };
    let fields = body.as_object_mut().expect("an object");
    fields.insert("max_tokens".into(), json!(conv.answer_len));
    fields.insert("ignore_eos".into(), json!(true));
    fields.insert("stream".into(), json!(stream));
    if stream {
        fields.insert("stream_options".into(), json!({"include_usage": true}));
    }
    body
}

pub fn read_trace(path: &Path) -> anyhow::Result<Vec<TraceItem>> {
    read_jsonl(path)
}

/// The lines of a JSONL file (blank lines skipped), each parsed as a `T`.
fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> anyhow::Result<Vec<T>> {
    let file = std::fs::File::open(path)
        .map_err(|e| anyhow::anyhow!("cannot open trace {}: {e}", path.display()))?;
    std::io::BufReader::new(file)
        .lines()
        .enumerate()
        .filter(|(_, l)| l.as_ref().map_or(true, |l| !l.trim().is_empty()))
        .map(|(i, line)| {
            serde_json::from_str(&line?)
                .map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), i + 1))
        })
        .collect()
}

/// Writes trace items as JSONL.
pub fn write_trace(path: &Path, items: &[TraceItem]) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for item in items {
        serde_json::to_writer(&mut out, item)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct W {
        #[command(flatten)]
        w: WorkloadArgs,
    }

    fn args(extra: &[&str]) -> WorkloadArgs {
        let mut argv = vec!["w"];
        argv.extend_from_slice(extra);
        W::parse_from(argv).w
    }

    #[test]
    fn text_has_the_asked_length_and_depends_on_the_seed() {
        assert_eq!(text(1, 100).len(), 400);
        assert_eq!(text(1, 100), text(1, 100));
        assert_ne!(text(1, 100), text(2, 100));
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let a = args(&[
            "--groups",
            "3",
            "--prompts-per-group",
            "4",
            "--system-len",
            "50",
            "--question-len",
            "5",
        ]);
        let jobs = jobs(&a).unwrap();
        assert_eq!(jobs.len(), 12);
        let systems: std::collections::HashSet<String> = jobs
            .iter()
            .map(|j| match j {
                Job::Single(t) => t.body["messages"][0]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(systems.len(), 3);
        // Deterministic.
        let again = jobs_bodies(&a);
        assert_eq!(again, jobs_bodies(&a));
    }

    fn jobs_bodies(a: &WorkloadArgs) -> Vec<String> {
        jobs(a)
            .unwrap()
            .iter()
            .map(|j| match j {
                Job::Single(t) => t.body.to_string(),
                Job::Conversation(c) => c.questions.join("|"),
                Job::Burst(items) => items.len().to_string(),
            })
            .collect()
    }

    #[test]
    fn traces_round_trip() {
        let a = args(&[
            "--workload",
            "random",
            "--api",
            "completions",
            "--input-len",
            "8",
        ]);
        let items: Vec<TraceItem> = jobs(&a)
            .unwrap()
            .into_iter()
            .take(3)
            .map(|j| match j {
                Job::Single(mut t) => {
                    t.t = Some(0.5);
                    t
                }
                _ => unreachable!(),
            })
            .collect();
        let path = std::env::temp_dir().join(format!("trace-{}.jsonl", std::process::id()));
        write_trace(&path, &items).unwrap();
        let back = read_trace(&path).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back[0].body, items[0].body);
        assert_eq!(back[0].endpoint, Api::Completions);
        assert_eq!(back[0].t, Some(0.5));
    }

    #[test]
    fn multi_turn_bodies_grow() {
        let a = args(&[
            "--workload",
            "multi-turn",
            "--users",
            "2",
            "--turns",
            "3",
            "--system-len",
            "10",
            "--history-len",
            "10",
            "--question-len",
            "5",
        ]);
        let jobs = jobs(&a).unwrap();
        let Job::Conversation(c) = &jobs[0] else {
            panic!()
        };
        let b0 = turn_body(&a, c, &c.questions[0]);
        assert_eq!(b0["messages"].as_array().unwrap().len(), 4);
        assert_eq!(jobs.iter().map(Job::requests).sum::<usize>(), 6);
    }

    #[test]
    fn agent_sessions_have_their_shape() {
        let a = args(&["--workload", "agent", "--sessions", "400"]);
        let jobs = jobs(&a).unwrap();
        let sessions: Vec<&Conversation> = jobs
            .iter()
            .filter_map(|j| match j {
                Job::Conversation(c) => Some(c),
                _ => None,
            })
            .collect();
        assert_eq!(sessions.len(), 400);
        // Arrival order, and deterministic.
        assert!(jobs
            .windows(2)
            .all(|w| w[0].start().unwrap() <= w[1].start().unwrap()));
        assert_eq!(
            jobs_requests(&jobs),
            jobs_requests(&super::jobs(&a).unwrap())
        );
        let turns: Vec<usize> = sessions.iter().map(|c| c.questions.len()).collect();
        assert!(turns.iter().all(|t| (4..=9).contains(t)));
        assert!(turns.contains(&4) && turns.contains(&9));
        // A quarter of the turns have a retry, 50 ms later.
        let total_turns: usize = turns.iter().sum();
        let retries: Vec<&Retry> = sessions
            .iter()
            .flat_map(|c| c.retries.iter().flatten())
            .collect();
        let share = retries.len() as f64 / total_turns as f64;
        assert!((0.21..0.29).contains(&share), "{share}");
        assert!(retries.iter().all(|r| (r.after - 0.05).abs() < 1e-9));
        // 18 % of all requests are one-offs.
        let all: usize = jobs.iter().map(Job::requests).sum();
        let one_offs = jobs.iter().filter(|j| matches!(j, Job::Single(_))).count();
        let share = one_offs as f64 / all as f64;
        assert!((0.17..0.19).contains(&share), "{share}");
        // Tool specs: the most popular takes about 1/H(8) = 37 % of the sessions, all are used.
        let mut by_spec = std::collections::HashMap::<String, usize>::new();
        for c in &sessions {
            let spec = c.messages[0]["content"].as_str().unwrap().to_owned();
            assert_eq!(spec.len(), 3000 * BYTES_PER_TOKEN);
            *by_spec.entry(spec).or_default() += 1;
        }
        assert_eq!(by_spec.len(), 8);
        let top = *by_spec.values().max().unwrap() as f64 / 400.0;
        assert!((0.30..0.45).contains(&top), "{top}");
        // Sessions arrive at --session-rate; --speedup runs the same sessions faster.
        let last = sessions
            .iter()
            .map(|c| c.start.unwrap())
            .fold(0.0, f64::max);
        assert!(
            (400.0 / 2.0 * 0.85..400.0 / 2.0 * 1.15).contains(&last),
            "{last}"
        );
        let fast = super::jobs(&args(&[
            "--workload",
            "agent",
            "--sessions",
            "400",
            "--speedup",
            "4",
        ]))
        .unwrap();
        let Job::Conversation(c) = fast
            .iter()
            .find(|j| matches!(j, Job::Conversation(_)))
            .unwrap()
        else {
            unreachable!()
        };
        assert!((c.start.unwrap() * 4.0 - sessions[0].start.unwrap()).abs() < 1e-9);
        assert_eq!(c.questions, sessions[0].questions);
        assert!((c.think[1] * 4.0 - sessions[0].think[1]).abs() < 1e-9);
    }

    #[test]
    fn agent_rejects_nonsense() {
        for bad in [
            ["--min-turns", "0"],
            ["--max-turns", "2"],
            ["--one-off-share", "1"],
            ["--speedup", "0"],
            ["--tool-specs", "0"],
        ] {
            let mut argv = vec!["--workload", "agent"];
            argv.extend(bad);
            assert!(jobs(&args(&argv)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rag_questions_follow_distinct_documents() {
        let a = args(&[
            "--workload",
            "rag",
            "--random-count",
            "2000",
            "--document-len",
            "100",
        ]);
        let jobs = jobs(&a).unwrap();
        assert_eq!(jobs.len(), 2000);
        let mut first = std::collections::HashMap::<String, usize>::new();
        for j in &jobs {
            let user = prompt(single(j));
            let parts: Vec<&str> = user.split("\n\n").collect();
            // Three documents and the question.
            assert_eq!(parts.len(), 4);
            let docs: std::collections::HashSet<&str> = parts[..3].iter().copied().collect();
            assert_eq!(docs.len(), 3);
            for d in &parts[..3] {
                assert!((50 * BYTES_PER_TOKEN..=150 * BYTES_PER_TOKEN).contains(&d.len()));
            }
            *first.entry(parts[0].to_owned()).or_default() += 1;
        }
        // Popular documents lead more often: the top one about 1/H(64) = 21 % of the time.
        let top = *first.values().max().unwrap() as f64 / 2000.0;
        assert!((0.16..0.27).contains(&top), "{top}");
        assert!(first.len() > 32);
        assert!(super::jobs(&args(&["--workload", "rag", "--top-k", "65"])).is_err());
    }

    fn jobs_requests(jobs: &[Job]) -> Vec<String> {
        jobs.iter()
            .map(|j| match j {
                Job::Single(t) => t.body.to_string(),
                Job::Conversation(c) => format!("{:?}{:?}", c.questions, c.start),
                Job::Burst(b) => format!("{}", b.len()),
            })
            .collect()
    }

    fn single(job: &Job) -> &TraceItem {
        match job {
            Job::Single(t) => t,
            _ => panic!("not a single request"),
        }
    }

    fn prompt(item: &TraceItem) -> String {
        item.body["messages"][1]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// The jobs of a Mooncake trace of `lines`, written to a file of its own, with `flags`.
    fn mooncake_jobs(name: &str, lines: &[&str], flags: &[&str]) -> Vec<Job> {
        let path = std::env::temp_dir().join(format!("{name}-{}.jsonl", std::process::id()));
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let mut all = vec!["--workload", "mooncake", "--trace", path.to_str().unwrap()];
        all.extend_from_slice(flags);
        let made = jobs(&args(&all)).unwrap();
        std::fs::remove_file(&path).unwrap();
        made
    }

    #[test]
    fn mooncake_ids_become_shared_text_at_the_traces_times() {
        let jobs = mooncake_jobs(
            "mooncake",
            &[
                r#"{"timestamp": 0, "input_length": 1024, "output_length": 7, "hash_ids": [1, 2]}"#,
                r#"{"timestamp": 3000, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]}"#,
                r#"{"timestamp": 4000, "input_length": 600, "output_length": 1, "hash_ids": [9]}"#,
            ],
            &["--speedup", "2"],
        );
        let items: Vec<&TraceItem> = jobs.iter().map(single).collect();
        assert_eq!(
            items.iter().map(|i| i.t.unwrap()).collect::<Vec<_>>(),
            [0.0, 1.5, 2.0]
        );
        let prompts: Vec<String> = items.iter().map(|i| prompt(i)).collect();
        let block = MOONCAKE_BLOCK_TOKENS * BYTES_PER_TOKEN;
        assert_eq!(prompts[0].len(), 1024 * BYTES_PER_TOKEN);
        assert_eq!(prompts[1].len(), 700 * BYTES_PER_TOKEN);
        // Equal first ids: equal first blocks; other ids: other text.
        assert_eq!(prompts[0][..block], prompts[1][..block]);
        assert_ne!(
            prompts[0][block..block + 100],
            prompts[1][block..block + 100]
        );
        // Ids covering less than the length: padded with the request's own text.
        assert_eq!(prompts[2].len(), 600 * BYTES_PER_TOKEN);
        assert_eq!(items[0].body["max_tokens"], 7);
    }

    #[test]
    fn mooncake_blocks_shrink_with_the_lengths_they_make() {
        let jobs = mooncake_jobs(
            "mooncake-small",
            &[
                r#"{"timestamp": 0, "input_length": 1024, "output_length": 100, "hash_ids": [1, 2]}"#,
                r#"{"timestamp": 10, "input_length": 700, "output_length": 3, "hash_ids": [1, 3]}"#,
            ],
            &["--mooncake-block-tokens", "16"],
        );
        let items: Vec<&TraceItem> = jobs.iter().map(single).collect();
        let prompts: Vec<String> = items.iter().map(|i| prompt(i)).collect();
        // 1,024 and 700 of the trace's tokens at 16 a block instead of 512: 32 and 22 (rounded up).
        assert_eq!(prompts[0].len(), 32 * BYTES_PER_TOKEN);
        assert_eq!(prompts[1].len(), 22 * BYTES_PER_TOKEN);
        let block = 16 * BYTES_PER_TOKEN;
        assert_eq!(prompts[0][..block], prompts[1][..block]);
        let rest = prompts[1].len() - block;
        assert_ne!(prompts[0][block..block + rest], prompts[1][block..]);
        // Outputs scale too, but never to nothing: 100 → 4 (3.1 rounded up), 3 → 1.
        assert_eq!(items[0].body["max_tokens"], 4);
        assert_eq!(items[1].body["max_tokens"], 1);
        let zero = args(&[
            "--workload",
            "mooncake",
            "--trace",
            "x",
            "--mooncake-block-tokens",
            "0",
        ]);
        assert!(super::jobs(&zero).is_err());
    }

    #[test]
    fn bursts_share_a_prefix_and_arrive_within_the_spread() {
        let a = args(&[
            "--workload",
            "bursty",
            "--groups",
            "3",
            "--burst",
            "4",
            "--burst-spread-ms",
            "8",
            "--system-len",
            "20",
        ]);
        let jobs = jobs(&a).unwrap();
        assert_eq!(jobs.len(), 3);
        let Job::Burst(items) = &jobs[1] else {
            panic!("not a burst")
        };
        assert_eq!(items.len(), 4);
        let systems: std::collections::HashSet<&str> = items
            .iter()
            .map(|i| i.body["messages"][0]["content"].as_str().unwrap())
            .collect();
        assert_eq!(systems.len(), 1);
        assert!(items.iter().all(|i| i.t.unwrap() < 0.008));
        assert_eq!(jobs.iter().map(Job::requests).sum::<usize>(), 12);
    }

    #[test]
    fn overload_requests_carry_priorities_and_tenants() {
        let a = args(&[
            "--workload",
            "overload",
            "--random-count",
            "2000",
            "--tenants",
            "4",
        ]);
        let jobs = jobs(&a).unwrap();
        let count = |name: &str, value: &str| {
            jobs.iter()
                .filter(|j| single(j).headers.get(name).map(String::as_str) == Some(value))
                .count() as f64
        };
        assert!((300.0..500.0).contains(&count("x-priority", "1")));
        assert!((900.0..1100.0).contains(&count("x-tenant", "tenant-0")));
        for t in 1..4 {
            assert!((250.0..420.0).contains(&count("x-tenant", &format!("tenant-{t}"))));
        }
    }
}
