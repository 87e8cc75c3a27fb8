//! The prefill work other router replicas sent a backend, in the order this router heard of it.
//!
//! A replica hears of a peer's decision a few milliseconds after it is made (the bus batches
//! them). A request sent meanwhile to the same backend queues behind the peer's request
//! without having counted it, so its first byte, learned as "this much work took this long",
//! would teach the backend's prefill line a rate too slow. Measured on a burst workload through
//! 4 replicas: 37–56 % of the first bytes had a whole 2,200-token prompt missing from their
//! work, and the lines predicted an idle miss at 138–140 ms where one router, which counts
//! everything, predicts 126. At the first byte the peers' decisions made before the request
//! have been heard, so the work ahead is completed then from this log.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Unix time in microseconds, the clock replicas stamp their decisions with to order a peer's
/// against this router's: the siblings of a burst reach different replicas a fraction of a
/// millisecond apart (median 0.9 ms on the bursty workload), so milliseconds counted many of
/// those behind a request as ahead of it. Replicas on different hosts need clocks that agree
/// to well under that.
pub fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// How long a peer's decision is kept: longer than any first byte it could still complete
/// is worth waiting for (a request slower than this learns without it).
const KEEP: Duration = Duration::from_secs(10);
/// Decisions kept per backend at most (beyond, the oldest go first).
const MAX_KEPT: usize = 1 << 14;
/// A peer's decision heard more than this after a request was sent, or made more than this
/// before it, is not counted ahead of it: a bus that is this late delivers a backlog whose
/// requests have long been prefilled, not a sibling sent at the same moment.
const LATE: Duration = Duration::from_secs(1);

struct Heard {
    at: Instant,
    /// When the peer sent it (Unix time, µs, the peer's clock).
    sent_us: u64,
    uncached: u64,
}

/// Per backend: the peers' decisions heard recently, oldest first.
#[derive(Default)]
pub struct UnheardAhead {
    heard: Mutex<VecDeque<Heard>>,
}

impl UnheardAhead {
    /// A peer sent a request asking `uncached` prompt tokens of this backend at `sent_us`;
    /// this router heard of it at `now`.
    pub fn heard(&self, sent_us: u64, uncached: u64, now: Instant) {
        let mut heard = self.heard.lock();
        while heard
            .front()
            .is_some_and(|h| now.saturating_duration_since(h.at) > KEEP)
            || heard.len() >= MAX_KEPT
        {
            heard.pop_front();
        }
        heard.push_back(Heard {
            at: now,
            sent_us,
            uncached,
        });
    }

    /// Prompt tokens the peers sent here before a request this router sent at `sent_at`
    /// (`sent_us` by [`unix_us`]) that it heard of only after sending it: work that was ahead
    /// of the request and that it did not count.
    pub fn ahead_of(&self, sent_at: Instant, sent_us: u64) -> u64 {
        let heard = self.heard.lock();
        let first = heard.partition_point(|h| h.at <= sent_at);
        let late_us = LATE.as_micros() as u64;
        heard
            .range(first..)
            .take_while(|h| h.at.saturating_duration_since(sent_at) <= LATE)
            .filter(|h| h.sent_us < sent_us && h.sent_us.saturating_add(late_us) >= sent_us)
            .fold(0u64, |sum, h| sum.saturating_add(h.uncached))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn counts_what_peers_sent_before_a_request_and_it_heard_after() {
        let t0 = Instant::now();
        let log = UnheardAhead::default();
        let sent_us = 1_000_000_000;
        // Heard before the request was sent: already counted in its work.
        log.heard(sent_us - 20_000, 100, t0);
        // The request is sent at t0 + 10 ms. Heard after: sent 3 ms and 1 µs before it
        // (counted), at the same microsecond and 200 µs after it (behind it).
        log.heard(sent_us - 3_000, 2_000, t0 + ms(12));
        log.heard(sent_us - 1, 30, t0 + ms(13));
        log.heard(sent_us, 500, t0 + ms(14));
        log.heard(sent_us + 200, 4_000, t0 + ms(15));
        assert_eq!(log.ahead_of(t0 + ms(10), sent_us), 2_030);
        // A request sent after hearing them all has nothing unheard ahead.
        assert_eq!(log.ahead_of(t0 + ms(20), sent_us + 10_000), 0);
    }

    #[test]
    fn a_late_backlog_is_not_counted_ahead() {
        let t0 = Instant::now();
        let log = UnheardAhead::default();
        let sent_us = 1_000_000_000;
        // A bus back from an outage delivers decisions made seconds before the request.
        log.heard(sent_us - 5_000_000, 2_000, t0 + ms(50));
        // One made just before it but heard only two seconds later.
        log.heard(sent_us - 1_000, 3_000, t0 + ms(2_000));
        assert_eq!(log.ahead_of(t0, sent_us), 0);
    }

    #[test]
    fn old_decisions_are_dropped_and_the_log_is_bounded() {
        let t0 = Instant::now();
        let log = UnheardAhead::default();
        log.heard(1, 1, t0);
        log.heard(2, 1, t0 + KEEP + ms(1));
        assert_eq!(log.heard.lock().len(), 1);
        for i in 0..MAX_KEPT as u64 + 10 {
            log.heard(i, 1, t0 + KEEP + ms(2));
        }
        assert_eq!(log.heard.lock().len(), MAX_KEPT);
    }
}
