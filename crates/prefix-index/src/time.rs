//! The store's clock: `t` arrives as unix seconds (`f64`) and is kept as whole milliseconds.
//!
//! A millisecond is far finer than any KV cache's lifetime, and 42 bits of milliseconds last
//! until the year 2109, which lets an entry's time, depth and hash pack into one 128-bit key.

/// Bits of a [`Tick`] value.
pub const TICK_BITS: u32 = 42;
/// The largest representable tick; later times are clamped to it.
pub const MAX_TICK: u64 = (1 << TICK_BITS) - 1;

/// A point in time, in milliseconds since the unix epoch, in `0..=MAX_TICK`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Tick(u64);

impl Tick {
    /// Converts unix seconds, rounding to the nearest millisecond; negative and NaN become 0,
    /// times past [`MAX_TICK`] are clamped.
    pub fn from_secs(secs: f64) -> Self {
        let ms = (secs * 1000.0).round();
        // `as` saturates and maps NaN to 0.
        Tick((ms as u64).min(MAX_TICK))
    }

    /// From raw milliseconds (clamped).
    pub fn from_millis(ms: u64) -> Self {
        Tick(ms.min(MAX_TICK))
    }

    /// Milliseconds since the unix epoch.
    pub fn millis(self) -> u64 {
        self.0
    }

    /// Seconds since the unix epoch.
    pub fn secs(self) -> f64 {
        self.0 as f64 / 1000.0
    }

    /// The earliest `last_used` still visible at `self` under a time-to-live of `ttl_ms`.
    pub fn ttl_cutoff(self, ttl_ms: u64) -> Tick {
        Tick(self.0.saturating_sub(ttl_ms))
    }
}

/// The current wall-clock time in unix seconds, the default `t` of notify and query.
pub fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversion_rounds_and_clamps() {
        assert_eq!(Tick::from_secs(1.0004).millis(), 1000);
        assert_eq!(Tick::from_secs(1.0006).millis(), 1001);
        assert_eq!(Tick::from_secs(-5.0).millis(), 0);
        assert_eq!(Tick::from_secs(f64::NAN).millis(), 0);
        assert_eq!(Tick::from_secs(1e300).millis(), MAX_TICK);
        assert_eq!(Tick::from_secs(1_700_000_000.25).secs(), 1_700_000_000.25);
    }

    #[test]
    fn ttl_cutoff_saturates() {
        assert_eq!(Tick::from_millis(5).ttl_cutoff(10).millis(), 0);
        assert_eq!(Tick::from_millis(50).ttl_cutoff(10).millis(), 40);
    }
}
