//! Each backend's prefill speed, learned from the TTFTs the router sees there, so the cost
//! policy predicts a request's time to first token without per-model constants.
//!
//! The model is a line: `ttft ≈ overhead + seconds_per_token × work`, where `work` is the
//! prompt tokens the backend must compute before this request's first token (the uncached
//! tokens of the requests ahead of it that have not started answering, plus its own). It is
//! fitted by exponentially weighted least squares over the recent streamed requests, held near
//! a prior until the data say otherwise, and robust to outliers on both sides: an observation
//! far from the line counts only as two spreads from it, the spread being the recent mean
//! distance of the observations from the line (a Huber-style fit: on CPU vLLM one 190 ms stall
//! among 15 ms answers had lifted the line by a third for dozens of requests; an answer far
//! sooner than any prefill could be, such as a refusal, would otherwise make the backend look
//! free).
//!
//! A least-squares line predicts the mean TTFT, and under load TTFTs are skewed: a request waits
//! for 0 to 1 engine step in progress, and a few wait behind a long batch, so most come sooner
//! than the mean. The line is therefore scaled by a calibration factor that tracks the median of
//! observed ÷ predicted (the whole prediction: queue, stall and KV pressure included), so the
//! prediction is as often too high as too low.

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
/// An observation counts as at most this many spreads above the line, or below it...
const CLIP_SPREADS: f64 = 2.0;
/// ... where the low side is never clipped closer than this fraction of the line (an answer a
/// hundred times sooner than any prefill could be, a refusal, counts as half the line)...
const LOW_CLIP_FRACTION: f64 = 0.5;
/// ... and only once the line has this many observations: a backend several times faster than
/// the prior must be learned within its first answers (clipped from the first, a fresh
/// router's predictions on CPU vLLM erred 20 % instead of 16 %).
const LOW_CLIP_AFTER: u64 = 16;
/// The spread before any observation, as a fraction of the prediction (the prior is a guess).
const PRIOR_SPREAD: f64 = 0.5;
/// The spread never falls below this fraction of the prediction: a backend whose answers were
/// exactly on the line for a while must still be able to learn that it became slower.
const MIN_SPREAD: f64 = 0.1;
/// The spread moves by this fraction toward each observation's distance from the line (a clipped
/// one's being two spreads, a run of them widens it 20 % a request: a real slowdown is learned
/// within a dozen requests, a lone stall is not).
const SPREAD_STEP: f64 = 0.2;
/// The calibration moves by this fraction toward each observation (up if the TTFT came later
/// than predicted, down if sooner): a stochastic median, settling within a few dozen requests
/// and jittering by about this much once there.
const CALIBRATION_STEP: f64 = 0.03;
/// Before that, the step is 1 ÷ (this + observations so far), a Robbins–Monro schedule: a
/// fresh router's first answers correct the prior's guess within a few requests, not thirty
/// (on CPU vLLM the prior predicted 35 ms for 16 ms answers through the first third of a
/// 96-request run). Not from 1 ÷ 1: the line learns from the first answers too, and larger
/// early steps overshot with it (replayed on recorded first bytes: 1 ÷ (4 + n) had the sims'
/// multi-turn error at 10-11 % against 9 %; 1 ÷ (8 + n) kept it, and real vLLM's gain).
const EARLY_CALIBRATION_OFFSET: f64 = 8.0;
/// The calibration corrects a skew, not a wrong line: it stays within these factors.
const CALIBRATION_RANGE: (f64, f64) = (0.25, 4.0);

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

impl PrefillLine {
    fn scaled(self, factor: f64) -> Self {
        Self {
            overhead_s: self.overhead_s * factor,
            seconds_per_token: self.seconds_per_token * factor,
        }
    }
}

/// What one streamed request's first byte says about its backend's prefill: enough to learn
/// the line from and to recompute the prediction through any line, so that router replicas
/// can learn from each other's answers (each alone sees only its share of them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FirstByte {
    /// Prompt tokens the backend computed before it: the queue ahead and its own.
    pub work: u64,
    /// Of those, its own.
    pub uncached: u64,
    pub ttft_s: f64,
    /// How long the queue ahead had been worked on when it was sent.
    pub under_way_s: f64,
    /// The backend's KV-cache usage (0..1) when it was sent.
    pub kv_usage: f64,
}

/// Exponentially weighted sums of (work, ttft), the line fitted through them, and the
/// calibration applied to it.
struct Sums {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    observations: u64,
    /// Recent mean distance of the (clipped) observations from the line; `None` before any.
    spread: Option<f64>,
    fitted: PrefillLine,
    calibration: f64,
}

impl Default for Sums {
    fn default() -> Self {
        Self {
            w: 0.0,
            x: 0.0,
            y: 0.0,
            xx: 0.0,
            xy: 0.0,
            observations: 0,
            spread: None,
            fitted: PrefillLine::default(),
            calibration: 1.0,
        }
    }
}

impl Sums {
    /// Adds one (work, ttft) point, clipped against the fitted line, and refits.
    fn add(&mut self, work: u64, ttft: f64) {
        if !ttft.is_finite() || ttft < 0.0 {
            return;
        }
        let x = work as f64;
        let line = self.fitted.ttft(work);
        let spread = self
            .spread
            .unwrap_or(line * PRIOR_SPREAD)
            .max(line * MIN_SPREAD);
        let low = if self.observations < LOW_CLIP_AFTER {
            0.0
        } else {
            (line - CLIP_SPREADS * spread)
                .min(line * LOW_CLIP_FRACTION)
                .max(0.0)
        };
        let y = ttft.clamp(low, line + CLIP_SPREADS * spread);
        self.spread = Some(spread + SPREAD_STEP * ((y - line).abs() - spread));
        self.w = self.w * DECAY + 1.0;
        self.x = self.x * DECAY + x;
        self.y = self.y * DECAY + y;
        self.xx = self.xx * DECAY + x * x;
        self.xy = self.xy * DECAY + x * y;
        self.observations += 1;
        self.fitted = fit(self);
    }

    /// Moves the calibration one step toward `ttft` ÷ `predicted`.
    fn calibrate(&mut self, predicted: f64, ttft: f64) {
        if !(predicted > 0.0 && ttft > 0.0 && predicted.is_finite() && ttft.is_finite()) {
            return;
        }
        let size =
            CALIBRATION_STEP.max(1.0 / (EARLY_CALIBRATION_OFFSET + self.observations as f64));
        let step = if ttft > predicted {
            1.0 + size
        } else if ttft < predicted {
            1.0 / (1.0 + size)
        } else {
            return;
        };
        self.calibration =
            (self.calibration * step).clamp(CALIBRATION_RANGE.0, CALIBRATION_RANGE.1);
    }
}

/// One backend's learned prefill line.
pub struct PrefillModel {
    sums: Mutex<Sums>,
    /// The current calibrated fit, read on every request without the lock.
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
    /// The current line, calibrated.
    pub fn line(&self) -> PrefillLine {
        **self.line.load()
    }

    /// How many TTFTs it has learned from.
    pub fn observations(&self) -> u64 {
        self.sums.lock().observations
    }

    /// A streamed request with `work` tokens to compute first answered after `ttft` seconds:
    /// the line alone learns, without the calibration (the tests of the fit).
    #[cfg(test)]
    pub fn observe(&self, work: u64, ttft: f64) {
        let mut s = self.sums.lock();
        s.add(work, ttft);
        self.publish(&s);
    }

    /// A streamed request with `work` tokens to compute first answered after `ttft` seconds:
    /// the calibration moves toward the median of observed ÷ predicted, then the line learns.
    /// `predict` is the caller's prediction through a given line (its queue, stall and KV
    /// terms included). It is asked with the line as it is *now*, not the one the request was
    /// routed by: under load that one is a whole TTFT old, and every answer in flight would
    /// push the calibration the same way long after the line had caught up.
    ///
    /// `under_way` is how long the queue ahead had already been worked on when the request was
    /// sent (the backend's [`crate::core::backend::Backend::stalled_secs`] then): the work took
    /// that much longer than the TTFT, and the line learns the whole time.
    pub fn learn(
        &self,
        work: u64,
        ttft: f64,
        under_way: f64,
        predict: impl FnOnce(PrefillLine) -> f64,
    ) {
        let predicted = predict(self.line());
        let mut s = self.sums.lock();
        s.calibrate(predicted, ttft);
        s.add(work, ttft + under_way);
        self.publish(&s);
    }

    /// The calibration factor (1: none; below 1, TTFTs mostly come sooner than the line's mean).
    pub fn calibration(&self) -> f64 {
        self.sums.lock().calibration
    }

    fn publish(&self, s: &Sums) {
        let line = s.fitted.scaled(s.calibration);
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
        // It counts as two spreads above the line (the spread being at least a tenth of it).
        assert!(after < before * 1.01, "before {before}, after {after}");
        // Nonsense is ignored.
        model.observe(10, f64::NAN);
        model.observe(10, -1.0);
        assert_eq!(model.line().ttft(1000), after);
    }

    /// An answer far sooner than its work allows (a refusal, an error event) moves the line a
    /// bounded amount, as a stall does the other way.
    #[test]
    fn an_answer_far_below_the_line_moves_it_a_bounded_amount() {
        let model = PrefillModel::default();
        for i in 0..100u64 {
            let work = 200 + (i * 131) % 2000;
            model.observe(work, 0.01 + work as f64 / 20_000.0);
        }
        let before = model.line();
        // Four prompts of the model's whole length (the router bounds work by it) answered in
        // a millisecond.
        for _ in 0..4 {
            model.observe(4_096, 0.001);
        }
        let after = model.line();
        let speed = |l: PrefillLine| 1.0 / l.seconds_per_token;
        assert!(
            speed(after) < speed(before) * 5.0,
            "{:.0} tokens/s before, {:.0} after",
            speed(before),
            speed(after)
        );
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

    /// Feeds `model` one answered request, predicted through the bare line.
    fn serve(model: &PrefillModel, work: u64, ttft: f64) {
        model.learn(work, ttft, 0.0, |line| line.ttft(work));
    }

    #[test]
    fn skewed_ttfts_are_predicted_at_their_median() {
        // As on a saturated CPU vLLM behind the gateway queue: the same work every time, most
        // first bytes after the step in progress (45-55 ms), two in five after a long batch
        // (300 ms). The mean is ~150 ms; the median between 45 and 55.
        let model = PrefillModel::default();
        for i in 0..400u64 {
            let ttft = if i % 5 >= 3 {
                0.3
            } else {
                0.045 + (i % 3) as f64 * 0.005
            };
            serve(&model, 4900, ttft);
        }
        let predicted = model.line().ttft(4900);
        assert!((0.045..0.06).contains(&predicted), "{predicted}");
        assert!(model.calibration() < 0.7, "{}", model.calibration());
    }

    #[test]
    fn a_fresh_model_predicts_steady_answers_despite_early_stalls() {
        // As on CPU vLLM with a tiny model (a 96-request shared-prefix run): most answers in
        // 11-19 ms whatever the prompt (145 or 1,017 tokens), one in seven 25-55 ms (behind a
        // decode step), and stalls of 190 ms among the first answers. The prior (20 ms +
        // 10,000 tokens/s) says 35-120 ms. The prediction must settle near the median within a
        // few requests and not be lifted by each stall for dozens after it (the previous fit,
        // clipping at 3x + 50 ms and calibrating 3 % a step, scored 0.21 here).
        let model = PrefillModel::default();
        let mut errors = Vec::new();
        for i in 0..96u64 {
            let work = if i % 4 == 1 { 1017 } else { 145 };
            let u = (i as f64 * 0.618_034).fract();
            let ttft = match i {
                2 | 13 => 0.19,
                _ if i % 7 == 3 => 0.025 + 0.03 * u,
                _ => 0.011 + 0.008 * u,
            };
            let predicted = model.line().ttft(work);
            if i >= 8 {
                errors.push((predicted - ttft).abs() / ttft);
            }
            serve(&model, work, ttft);
        }
        errors.sort_by(f64::total_cmp);
        let median = errors[errors.len() / 2];
        assert!(median < 0.19, "median |error| {median}, {:?}", model.line());
    }

    #[test]
    fn the_calibration_leaves_a_right_line_alone_and_stays_bounded() {
        let model = PrefillModel::default();
        for i in 0..300u64 {
            let work = 200 + (i * 131) % 2000;
            serve(&model, work, 0.01 + work as f64 / 20_000.0);
        }
        assert!(
            (model.calibration() - 1.0).abs() < 0.1,
            "{}",
            model.calibration()
        );
        for _ in 0..1000 {
            model.learn(1000, 100.0, 0.0, |_| 0.01);
        }
        assert_eq!(model.calibration(), CALIBRATION_RANGE.1);
        model.learn(1000, 1.0, 0.0, |_| f64::NAN);
        model.learn(1000, 1.0, 0.0, |_| 0.0);
        assert_eq!(model.calibration(), CALIBRATION_RANGE.1);
    }

    #[test]
    fn the_time_a_queue_was_under_way_is_learned_as_part_of_its_work() {
        // A backend at 5 ms + 20,000 tokens/s; every request is sent 30 ms into the work queued
        // ahead of it, so it answers 30 ms sooner than its work takes. The line learns the
        // work's whole time (as if it had been sent when the queue last moved), and the
        // prediction that subtracts those 30 ms stays calibrated.
        let model = PrefillModel::default();
        for i in 0..300u64 {
            let work = 800 + (i * 131) % 1500;
            let whole = 0.005 + work as f64 / 20_000.0;
            model.learn(work, whole - 0.03, 0.03, |line| line.ttft(work) - 0.03);
        }
        let predicted = model.line().ttft(1000);
        assert!((predicted - 0.055).abs() < 0.055 * 0.1, "{predicted}");
        assert!(
            (model.calibration() - 1.0).abs() < 0.1,
            "{}",
            model.calibration()
        );
    }

    #[test]
    fn answers_in_flight_during_a_slowdown_do_not_wind_up_the_calibration() {
        // A backend learned at 5,000 tokens/s (1,000 tokens: 0.2 s) turns twice as slow, and
        // 200 answers arrive before any request routed after the change: each was routed by
        // the old line, so each came 2x later than it was predicted when sent. Judged by that
        // stale prediction the calibration would climb 3 % per answer, to its bound (4x).
        let model = PrefillModel::default();
        for _ in 0..200 {
            serve(&model, 1000, 0.2);
        }
        let routed_by = model.line();
        for _ in 0..200 {
            model.learn(1000, 0.4, 0.0, |line| line.ttft(1000));
        }
        let predicted = model.line().ttft(1000);
        assert!((predicted - 0.4).abs() < 0.4 * 0.15, "{predicted}");
        assert!(model.calibration() < 1.5, "{}", model.calibration());
        assert!((routed_by.ttft(1000) - 0.2).abs() < 0.02, "{routed_by:?}");
    }
}
