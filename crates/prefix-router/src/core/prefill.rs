//! Each backend's prefill speed, learned from the TTFTs the router sees there, so the cost
//! policy predicts a request's time to first token without per-model constants.
//!
//! The model is a line: `ttft ≈ overhead + seconds_per_token × work`, where `work` is the
//! prompt tokens the backend must compute before this request's first token (the uncached
//! tokens of the requests ahead of it that have not started answering, plus its own). It is
//! fitted by exponentially weighted least squares over the recent streamed requests, held near
//! a prior until the data say otherwise, and robust to stalls: an observation far above the
//! line counts only as a bounded amount above it.

use parking_lot::Mutex;

/// Weight left to an observation after each newer one (~50 observations of memory).
const DECAY: f64 = 0.98;
/// The prior's weight, in observations, before any data; it shrinks as data arrive (divided
/// by 1 + the data's weight): its far point would otherwise tilt a line the data describe
/// well but over a narrow range of work. It never reaches zero, so data of a single size
/// still get a slope.
const PRIOR_WEIGHT: f64 = 0.5;
/// The prior line: 20 ms, 10,000 tokens/s (a small GPU; corrected within a few requests).
const PRIOR_OVERHEAD_S: f64 = 0.02;
const PRIOR_SECONDS_PER_TOKEN: f64 = 1e-4;
/// Where the prior's second point lies, in tokens of work.
const PRIOR_SPAN: f64 = 2048.0;
/// An observation counts as at most this many times the prediction (plus 50 ms).
const CLIP_FACTOR: f64 = 3.0;

/// A fitted line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillLine {
    pub overhead_s: f64,
    pub seconds_per_token: f64,
}

impl PrefillLine {
    /// The predicted TTFT with `work` tokens to compute first.
    pub fn ttft(&self, work: u64) -> f64 {
        self.overhead_s + self.seconds_per_token * work as f64
    }
}

impl Default for PrefillLine {
    fn default() -> Self {
        Self {
            overhead_s: PRIOR_OVERHEAD_S,
            seconds_per_token: PRIOR_SECONDS_PER_TOKEN,
        }
    }
}

/// Exponentially weighted sums of (work, ttft).
#[derive(Default)]
struct Sums {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    observations: u64,
}

/// One backend's learned prefill line.
pub struct PrefillModel {
    sums: Mutex<Sums>,
    /// The current fit, read on every request without the lock.
    line: arc_swap::ArcSwap<PrefillLine>,
}

impl Default for PrefillModel {
    fn default() -> Self {
        Self {
            sums: Mutex::default(),
            line: arc_swap::ArcSwap::from_pointee(PrefillLine::default()),
        }
    }
}

impl PrefillModel {
    /// The current line.
    pub fn line(&self) -> PrefillLine {
        **self.line.load()
    }

    /// How many TTFTs it has learned from.
    pub fn observations(&self) -> u64 {
        self.sums.lock().observations
    }

    /// A streamed request with `work` tokens to compute first answered after `ttft` seconds.
    pub fn observe(&self, work: u64, ttft: f64) {
        if !ttft.is_finite() || ttft < 0.0 {
            return;
        }
        let x = work as f64;
        let predicted = self.line().ttft(work);
        let y = ttft.min(predicted * CLIP_FACTOR + 0.05);
        let mut s = self.sums.lock();
        s.w = s.w * DECAY + 1.0;
        s.x = s.x * DECAY + x;
        s.y = s.y * DECAY + y;
        s.xx = s.xx * DECAY + x * x;
        s.xy = s.xy * DECAY + x * y;
        s.observations += 1;
        let line = fit(&s);
        self.line.store(std::sync::Arc::new(line));
    }
}

/// The weighted least-squares line through the data and the prior's two points, kept
/// physical (a positive cost per token, no negative overhead).
fn fit(s: &Sums) -> PrefillLine {
    let prior = PrefillLine::default();
    let prior_weight = PRIOR_WEIGHT / (1.0 + s.w);
    let half = prior_weight / 2.0;
    let (x0, y0) = (0.0, prior.overhead_s);
    let (x1, y1) = (PRIOR_SPAN, prior.ttft(PRIOR_SPAN as u64));
    let w = s.w + prior_weight;
    let x = s.x + half * (x0 + x1);
    let y = s.y + half * (y0 + y1);
    let xx = s.xx + half * (x0 * x0 + x1 * x1);
    let xy = s.xy + half * (x0 * y0 + x1 * y1);
    let (mx, my) = (x / w, y / w);
    let var = xx / w - mx * mx;
    let cov = xy / w - mx * my;
    let slope = if var > 1e-9 {
        cov / var
    } else {
        prior.seconds_per_token
    };
    let slope = slope.max(1e-8);
    let overhead = my - slope * mx;
    if overhead < 0.0 && xx > 0.0 {
        // The line through the data would start below zero (typically: every request had
        // the same work, so the prior alone set the slope). Clamping its start would lift
        // the whole line above the data; the line through the origin fits them instead.
        return PrefillLine {
            overhead_s: 0.0,
            seconds_per_token: (xy / xx).max(1e-8),
        };
    }
    PrefillLine {
        overhead_s: overhead.max(0.0),
        seconds_per_token: slope,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_is_learned_from_observations() {
        let model = PrefillModel::default();
        assert_eq!(model.line(), PrefillLine::default());
        // A backend at 5 ms + 14,000 tokens/s.
        for i in 0..200u64 {
            let work = 100 + (i * 397) % 4000;
            model.observe(work, 0.005 + work as f64 / 14_000.0);
        }
        let line = model.line();
        assert!((line.overhead_s - 0.005).abs() < 0.004, "{line:?}");
        assert!(
            (1.0 / line.seconds_per_token - 14_000.0).abs() < 1_500.0,
            "{line:?}"
        );
    }

    #[test]
    fn a_stall_moves_the_line_a_bounded_amount() {
        let model = PrefillModel::default();
        for i in 0..100u64 {
            let work = 200 + (i * 131) % 2000;
            model.observe(work, 0.01 + work as f64 / 20_000.0);
        }
        let before = model.line().ttft(1000);
        // One request stuck behind something the model does not see: 30 s.
        model.observe(1000, 30.0);
        let after = model.line().ttft(1000);
        assert!(after < before * 1.2, "before {before}, after {after}");
        // Nonsense is ignored.
        model.observe(10, f64::NAN);
        model.observe(10, -1.0);
        assert_eq!(model.line().ttft(1000), after);
    }

    #[test]
    fn requests_of_one_size_are_predicted_at_their_size() {
        // A gateway queue releases one request at a time: every TTFT is seen at the same
        // work (1,024 tokens, 61 ms: faster per token than the prior, with little overhead).
        let model = PrefillModel::default();
        for _ in 0..60 {
            model.observe(1024, 0.061);
        }
        let predicted = model.line().ttft(1024);
        assert!(
            (predicted - 0.061).abs() < 0.061 * 0.1,
            "{:?}",
            model.line()
        );
    }

    #[test]
    fn the_prior_does_not_bend_a_line_the_data_describe() {
        // As on CPU vLLM with a tiny model: ~12 ms a step whatever the prompt, 60,000
        // tokens/s beyond it; most requests short, one in eight long. The prior's far point
        // (2,048 tokens at 10,000 tokens/s) had tilted the line to predict 53 ms for 21 ms.
        let model = PrefillModel::default();
        for i in 0..100u64 {
            let work = if i % 8 == 0 { 480 } else { 120 + (i * 7) % 60 };
            model.observe(work, 0.012 + work as f64 / 60_000.0);
        }
        let line = model.line();
        for work in [100, 150, 480] {
            let truth = 0.012 + work as f64 / 60_000.0;
            let predicted = line.ttft(work);
            assert!(
                (predicted - truth).abs() < truth * 0.1,
                "{work} tokens: {predicted} for {truth}, {line:?}"
            );
        }
    }

    #[test]
    fn a_slower_backend_shows_within_a_few_requests() {
        let model = PrefillModel::default();
        for _ in 0..10 {
            model.observe(1000, 0.5);
            model.observe(3000, 1.5);
        }
        let line = model.line();
        assert!(line.ttft(2000) > 0.8 && line.ttft(2000) < 1.2, "{line:?}");
    }
}
