//! The simulated server's settings.
//!
//! Defaults model Llama-3.1-8B-Instruct in bf16 on one H100 80 GB SXM (see the README's
//! "simulator" section for the arithmetic): 24,000 KV blocks of 16 tokens, 20,000 prefill
//! tokens/s, 8 ms between output tokens, 256 sequences at once.

#[derive(clap::Args, Debug, Clone)]
pub struct SimConfig {
    /// Model name the servers serve (`/v1/models`, checked against each request's `model`).
    #[arg(long, env = "SIM_MODEL", default_value = "sim-model")]
    pub model: String,
    /// Tokens per KV block (vLLM's `--block-size`).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache capacity in blocks (vLLM's `num_gpu_blocks`).
    #[arg(long, default_value_t = 24_000)]
    pub kv_blocks: usize,
    /// Uncached prompt tokens one server prefills per second.
    #[arg(long, default_value_t = 20_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Fixed time of every engine step that prefills (scheduling, the forward pass's fixed
    /// part), in ms: requests prefilled in one step share it.
    #[arg(long, default_value_t = 10.0)]
    pub prefill_overhead_ms: f64,
    /// Prompt tokens one engine step computes at most (vLLM's `--max-num-batched-tokens`):
    /// the requests waiting are prefilled together up to it, a longer prompt in chunks.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Time between two output tokens of one sequence, in ms.
    #[arg(long, default_value_t = 8.0)]
    pub itl_ms: f64,
    /// Sequences a server runs at once; later requests wait.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Longest prompt plus output a request may have, in tokens.
    #[arg(long, default_value_t = 131_072)]
    pub max_model_len: usize,
    /// Multiplies all simulated time; 0 means no sleeping at all (fast tests).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Seed of the generated text (with the prompt) and of random faults.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Probability that a generation request fails with a 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Real milliseconds every generation request waits before it is handled (a hang).
    #[arg(long, default_value_t = 0)]
    pub stall_ms: u64,
    /// Like vLLM's `--api-key`: every `/v1` path needs `Authorization: Bearer <key>` (401
    /// otherwise); health, metrics and the rest stay open.
    #[arg(long, env = "VLLM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A model directory (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
    /// the files vLLM loads): tokenize and render chat with them, so that token ids, block
    /// boundaries and usage equal vLLM's. Without it, 4 bytes a token and a ChatML-like
    /// template.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// Prefill/decode disaggregation: the bandwidth, in GB/s, at which a decode server pulls a
    /// prefill server's KV blocks (NIXL over RDMA: 25 GB/s is one 200 Gb/s link).
    #[arg(long, default_value_t = 25.0)]
    pub kv_transfer_gbps: f64,
    /// Bytes of KV cache per token (Llama-3.1-8B in bf16: 32 layers × K and V × 8 heads × 128
    /// × 2 bytes = 131,072).
    #[arg(long, default_value_t = 131_072)]
    pub kv_bytes_per_token: u64,
    /// The first pull from a peer pays this handshake, in ms (NIXL exchanges its metadata).
    #[arg(long, default_value_t = 200.0)]
    pub kv_handshake_ms: f64,
    /// The share of a prefill step's time that the decoding sequences of the same server wait:
    /// one forward pass computes both, so a token due during a step comes out at its end (1),
    /// or not at all delayed (0). Why disaggregated prefill exists.
    #[arg(long, default_value_t = 1.0)]
    pub prefill_stalls_decode: f64,
    /// Publish KV-cache events as vLLM does (ZMQ PUB on a free loopback port per server,
    /// printed at start and in `/sim/state`); needs `--tokenizer` (token ids as vLLM's).
    #[arg(long)]
    pub kv_events: bool,
    /// The text model loaded from `tokenizer` (by [`SimConfig::load`]).
    #[arg(skip)]
    pub text: crate::text::TextModel,
}

impl Default for SimConfig {
    fn default() -> Self {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            config: SimConfig,
        }
        Wrapper::parse_from(["sim"]).config
    }
}

impl SimConfig {
    /// Checks the settings for values the model cannot run with.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.block_size > 0, "--block-size must be positive");
        anyhow::ensure!(self.kv_blocks > 0, "--kv-blocks must be positive");
        anyhow::ensure!(
            self.prefill_tokens_per_s > 0.0,
            "--prefill-tokens-per-s must be positive"
        );
        anyhow::ensure!(self.itl_ms >= 0.0, "--itl-ms must not be negative");
        anyhow::ensure!(
            self.prefill_overhead_ms >= 0.0,
            "--prefill-overhead-ms must not be negative"
        );
        anyhow::ensure!(self.max_num_seqs > 0, "--max-num-seqs must be positive");
        anyhow::ensure!(
            self.max_num_batched_tokens > 0,
            "--max-num-batched-tokens must be positive"
        );
        anyhow::ensure!(
            self.time_scale >= 0.0 && self.time_scale.is_finite(),
            "--time-scale must be a finite number >= 0"
        );
        anyhow::ensure!(
            self.kv_transfer_gbps > 0.0 && self.kv_handshake_ms >= 0.0,
            "--kv-transfer-gbps must be positive and --kv-handshake-ms not negative"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.prefill_stalls_decode),
            "--prefill-stalls-decode must be within 0..1"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.fail_rate),
            "--fail-rate must be within 0..1"
        );
        anyhow::ensure!(
            !self.kv_events || self.tokenizer.is_some(),
            "--kv-events needs --tokenizer: events carry token ids, and the byte model's are not vLLM's"
        );
        Ok(())
    }

    /// Checks the settings and loads the tokenizer, if one is named.
    pub fn load(mut self) -> anyhow::Result<Self> {
        self.validate()?;
        if self.tokenizer.is_some() && matches!(self.text, crate::text::TextModel::Bytes) {
            self.text = crate::text::TextModel::load(self.tokenizer.as_deref())?;
        }
        Ok(self)
    }

    /// Simulated time of one engine step that computes `uncached` prompt tokens.
    pub fn step_secs(&self, uncached: usize) -> f64 {
        self.prefill_overhead_ms / 1000.0 + uncached as f64 / self.prefill_tokens_per_s
    }
}
