//! The other replicas' load, as they last told it: each replica's whole table replaces its
//! previous one, and a replica not heard from for a while is forgotten (its requests have
//! ended or it is gone; either way its counts must not hold backends down for ever).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::wire::Load;

/// Per backend: the sums over the live peers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub inflight: u64,
    pub waiting_first_byte: u64,
    pub queued_prefill_tokens: u64,
    /// The latest time a peer saw the backend's prefill queue move.
    pub queue_moved_at: Option<Instant>,
}

struct Peer {
    heard: Instant,
    load: Vec<Load>,
    /// When `load` came: its queues' ages count from then.
    told: Instant,
}

/// The peers' load tables. Times are arguments, so tests need no clock.
#[derive(Default)]
pub struct PeerLoads {
    peers: HashMap<u64, Peer>,
}

impl PeerLoads {
    /// A peer was heard at `now`; `load`, if given, is its whole table now.
    pub fn heard(&mut self, replica: u64, load: Option<Vec<Load>>, now: Instant) {
        let peer = self.peers.entry(replica).or_insert_with(|| Peer {
            heard: now,
            load: Vec::new(),
            told: now,
        });
        peer.heard = peer.heard.max(now);
        if let Some(load) = load {
            peer.load = load;
            peer.told = now;
        }
    }

    /// Forgets the peers not heard from since `now - silence`; returns how many.
    pub fn expire(&mut self, now: Instant, silence: Duration) -> usize {
        let before = self.peers.len();
        self.peers
            .retain(|_, p| now.saturating_duration_since(p.heard) <= silence);
        before - self.peers.len()
    }

    /// Peers heard from and not expired.
    pub fn live(&self) -> usize {
        self.peers.len()
    }

    /// The live peers' load summed per backend.
    pub fn totals(&self) -> HashMap<u64, Totals> {
        let mut out: HashMap<u64, Totals> = HashMap::new();
        for (told, load) in self
            .peers
            .values()
            .flat_map(|p| p.load.iter().map(|l| (p.told, l)))
        {
            let t = out.entry(load.backend).or_default();
            let moved = load
                .queue_moved_ms_ago
                .and_then(|ago| told.checked_sub(Duration::from_millis(ago)));
            t.queue_moved_at = t.queue_moved_at.max(moved);
            t.inflight = t.inflight.saturating_add(load.inflight);
            t.waiting_first_byte = t.waiting_first_byte.saturating_add(load.waiting_first_byte);
            t.queued_prefill_tokens = t
                .queued_prefill_tokens
                .saturating_add(load.queued_prefill_tokens);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(backend: u64, inflight: u64) -> Load {
        Load {
            backend,
            inflight,
            waiting_first_byte: inflight,
            queued_prefill_tokens: 100 * inflight,
            queue_moved_ms_ago: None,
        }
    }

    #[test]
    fn tables_replace_and_sum_across_peers() {
        let t0 = Instant::now();
        let mut peers = PeerLoads::default();
        peers.heard(1, Some(vec![load(10, 3), load(11, 1)]), t0);
        peers.heard(2, Some(vec![load(10, 2)]), t0);
        assert_eq!(peers.totals()[&10].inflight, 5);
        assert_eq!(peers.totals()[&11].queued_prefill_tokens, 100);
        // A newer table replaces the peer's whole table; a heartbeat without one keeps it.
        peers.heard(1, Some(vec![load(10, 1)]), t0);
        peers.heard(2, None, t0);
        assert_eq!(peers.totals()[&10].inflight, 3);
        assert!(!peers.totals().contains_key(&11));
    }

    #[test]
    fn a_queue_moved_when_the_latest_peer_saw_it_move() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut peers = PeerLoads::default();
        let moved = |ago| Load {
            queue_moved_ms_ago: Some(ago),
            ..load(10, 1)
        };
        peers.heard(1, Some(vec![moved(300)]), t0);
        peers.heard(2, Some(vec![moved(50)]), t0 + Duration::from_millis(100));
        peers.heard(3, Some(vec![load(10, 1)]), t0);
        // Peer 1 saw it move at t0 - 300 ms, peer 2 at t0 + 50 ms; peer 3 does not say.
        assert_eq!(
            peers.totals()[&10].queue_moved_at,
            Some(t0 + Duration::from_millis(50))
        );
        // A heartbeat without a table keeps the table's time.
        peers.heard(2, None, t0 + Duration::from_secs(1));
        assert_eq!(
            peers.totals()[&10].queue_moved_at,
            Some(t0 + Duration::from_millis(50))
        );
    }

    #[test]
    fn a_silent_peer_is_forgotten() {
        let t0 = Instant::now();
        let mut peers = PeerLoads::default();
        peers.heard(1, Some(vec![load(10, 3)]), t0);
        peers.heard(2, Some(vec![load(10, 2)]), t0 + Duration::from_secs(2));
        assert_eq!(
            peers.expire(t0 + Duration::from_secs(4), Duration::from_secs(3)),
            1
        );
        assert_eq!(peers.live(), 1);
        assert_eq!(peers.totals()[&10].inflight, 2);
    }
}
