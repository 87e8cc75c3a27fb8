//! The other replicas' load, as they last told it: each replica's whole table replaces its
//! previous one, and a replica not heard from for a while is forgotten (its requests have
//! ended or it is gone; either way its counts must not hold backends down for ever). With it,
//! the prompts each has in flight (by their last chunk), from the requests it said it sent and
//! ended; a table saying it has nothing in flight at a backend clears them there, so a lost
//! message is healed when the backend next goes quiet.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::wire::Load;
use crate::core::continued::PromptInFlight;

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
    /// The last frame number applied: an older or repeated one is a replay.
    seq: u64,
    load: Vec<Load>,
    /// When `load` came: its queues' ages count from then.
    told: Instant,
    /// Its prompts in flight: (backend, last hash of the chain) → requests.
    prompts: HashMap<(u64, u64), InFlight>,
}

/// Requests of one prompt in flight through a peer at one backend.
struct InFlight {
    requests: u32,
    /// The hash of the prompt's last full chunk.
    full: u64,
    bytes: u64,
}

/// Prompts in flight tracked per peer at most (beyond, a broken peer's are not).
const MAX_PROMPTS: usize = 1 << 16;

/// The peers' load tables. Times are arguments, so tests need no clock.
#[derive(Default)]
pub struct PeerLoads {
    peers: HashMap<u64, Peer>,
    /// Whether the set of prompts in flight changed since [`PeerLoads::take_prompts_changed`]:
    /// the map the request path reads is rebuilt only then, not for every heartbeat.
    prompts_changed: bool,
}

impl PeerLoads {
    /// A peer was heard at `now`; `load`, if given, is its whole table now.
    pub fn heard(&mut self, replica: u64, load: Option<Vec<Load>>, now: Instant) {
        let peer = self.peer(replica, now);
        peer.heard = peer.heard.max(now);
        if let Some(load) = load {
            let busy: std::collections::HashSet<u64> = load
                .iter()
                .filter(|l| l.inflight > 0)
                .map(|l| l.backend)
                .collect();
            let before = peer.prompts.len();
            peer.prompts
                .retain(|(backend, _), _| busy.contains(backend));
            let cleared = peer.prompts.len() != before;
            peer.load = load;
            peer.told = now;
            self.prompts_changed |= cleared;
        }
    }

    fn peer(&mut self, replica: u64, now: Instant) -> &mut Peer {
        self.peers.entry(replica).or_insert_with(|| Peer {
            heard: now,
            seq: 0,
            load: Vec::new(),
            told: now,
            prompts: HashMap::new(),
        })
    }

    /// Whether a frame numbered `seq` from `replica` may be applied: a known peer's must be
    /// newer than the last one applied, and a new peer must find room among `max_peers`.
    pub fn admit(
        &mut self,
        replica: u64,
        seq: u64,
        max_peers: usize,
        now: Instant,
    ) -> Result<(), &'static str> {
        if !self.peers.contains_key(&replica) && self.peers.len() >= max_peers {
            return Err("too_many_peers");
        }
        let peer = self.peer(replica, now);
        if seq <= peer.seq {
            return Err("replayed");
        }
        peer.seq = seq;
        Ok(())
    }

    /// A peer sent a request to `prompt.backend`, whose prompt's last full chunk hashed to
    /// `full`.
    pub fn started(&mut self, replica: u64, full: u64, prompt: PromptInFlight, now: Instant) {
        let prompts = &mut self.peer(replica, now).prompts;
        if prompts.len() < MAX_PROMPTS {
            let in_flight = prompts
                .entry((prompt.backend, prompt.last))
                .or_insert(InFlight {
                    requests: 0,
                    full,
                    bytes: prompt.bytes,
                });
            in_flight.requests += 1;
            let new = in_flight.requests == 1;
            self.prompts_changed |= new;
        }
    }

    /// A peer's request to `backend` whose chain ended in `last` ended.
    pub fn ended(&mut self, replica: u64, backend: u64, last: u64) {
        let Some(peer) = self.peers.get_mut(&replica) else {
            return;
        };
        if let Some(p) = peer.prompts.get_mut(&(backend, last)) {
            p.requests -= 1;
            if p.requests == 0 {
                peer.prompts.remove(&(backend, last));
                self.prompts_changed = true;
            }
        }
    }

    /// The live peers' prompts in flight, with their last full chunk's hash.
    pub fn prompts(&self) -> impl Iterator<Item = (u64, PromptInFlight)> + '_ {
        self.peers.values().flat_map(|p| {
            p.prompts.iter().map(|(&(backend, last), f)| {
                let prompt = PromptInFlight {
                    backend,
                    bytes: f.bytes,
                    last,
                };
                (f.full, prompt)
            })
        })
    }

    /// Forgets the peers not heard from since `now - silence`; returns how many.
    pub fn expire(&mut self, now: Instant, silence: Duration) -> usize {
        let before = self.peers.len();
        let mut prompts_gone = false;
        self.peers.retain(|_, p| {
            let live = now.saturating_duration_since(p.heard) <= silence;
            prompts_gone |= !live && !p.prompts.is_empty();
            live
        });
        self.prompts_changed |= prompts_gone;
        before - self.peers.len()
    }

    /// Whether the prompts in flight changed since the last call (and resets it).
    pub fn take_prompts_changed(&mut self) -> bool {
        std::mem::take(&mut self.prompts_changed)
    }

    /// Peers heard from and not expired.
    pub fn live(&self) -> usize {
        self.peers.len()
    }

    /// The rank of the replica `own` among itself and the live peers, by id: every replica
    /// that hears the same peers ranks them alike.
    pub fn rank_of(&self, own: u64) -> u32 {
        let below = self.peers.keys().filter(|&&id| id < own).count();
        u32::try_from(below).unwrap_or(u32::MAX)
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

    /// (backend, last hash) of the prompts in flight.
    fn prompts(peers: &PeerLoads) -> Vec<(u64, u64)> {
        let mut out: Vec<_> = peers.prompts().map(|(_, p)| (p.last, p.backend)).collect();
        out.sort();
        out
    }

    fn start(peers: &mut PeerLoads, replica: u64, backend: u64, last: u64, now: Instant) {
        let prompt = PromptInFlight {
            backend,
            bytes: 1000,
            last,
        };
        peers.started(replica, last + 1, prompt, now);
    }

    #[test]
    fn prompts_in_flight_are_tracked_until_they_end_or_the_backend_is_quiet() {
        let t0 = Instant::now();
        let mut peers = PeerLoads::default();
        start(&mut peers, 1, 10, 500, t0);
        start(&mut peers, 1, 10, 500, t0);
        start(&mut peers, 1, 11, 600, t0);
        start(&mut peers, 2, 10, 700, t0);
        assert_eq!(prompts(&peers), vec![(500, 10), (600, 11), (700, 10)]);
        // One of the two requests of prompt 500 ended: the other is still in flight.
        peers.ended(1, 10, 500);
        assert_eq!(prompts(&peers).len(), 3);
        peers.ended(1, 10, 500);
        peers.ended(1, 10, 999);
        peers.ended(3, 10, 500);
        assert_eq!(prompts(&peers), vec![(600, 11), (700, 10)]);
        // Peer 1's table says nothing is in flight at backend 11: an end it lost is healed.
        peers.heard(1, Some(vec![load(10, 1), load(11, 0)]), t0);
        assert_eq!(prompts(&peers), vec![(700, 10)]);
        // A silent peer's prompts go with it.
        peers.expire(t0 + Duration::from_secs(10), Duration::from_secs(3));
        assert!(prompts(&peers).is_empty());
    }

    #[test]
    fn the_prompts_changed_only_when_a_prompt_came_or_went() {
        let t0 = Instant::now();
        let mut peers = PeerLoads::default();
        assert!(!peers.take_prompts_changed());
        start(&mut peers, 1, 10, 500, t0);
        assert!(peers.take_prompts_changed());
        // A second request of the same prompt, a heartbeat, a table with the backend busy,
        // an unknown end: the set is what it was.
        start(&mut peers, 1, 10, 500, t0);
        peers.heard(1, None, t0);
        peers.heard(1, Some(vec![load(10, 2)]), t0);
        peers.ended(1, 10, 999);
        peers.ended(1, 10, 500);
        assert!(!peers.take_prompts_changed());
        peers.ended(1, 10, 500);
        assert!(peers.take_prompts_changed());
        // Cleared by a quiet table.
        start(&mut peers, 1, 10, 500, t0);
        peers.take_prompts_changed();
        peers.heard(1, Some(vec![load(10, 0)]), t0);
        assert!(peers.take_prompts_changed());
        // Gone with a silent peer; a silent peer without prompts changes nothing.
        start(&mut peers, 2, 10, 700, t0);
        peers.heard(3, None, t0);
        peers.take_prompts_changed();
        peers.expire(t0 + Duration::from_secs(10), Duration::from_secs(3));
        assert!(peers.take_prompts_changed());
        peers.heard(4, None, t0 + Duration::from_secs(10));
        peers.expire(t0 + Duration::from_secs(20), Duration::from_secs(3));
        assert!(!peers.take_prompts_changed());
    }

    #[test]
    fn replicas_rank_themselves_alike() {
        let t0 = Instant::now();
        let ids = [40u64, 7, 900];
        let ranks: Vec<u32> = ids
            .iter()
            .map(|&own| {
                let mut peers = PeerLoads::default();
                for &id in ids.iter().filter(|&&id| id != own) {
                    peers.heard(id, None, t0);
                }
                peers.rank_of(own)
            })
            .collect();
        assert_eq!(ranks, vec![1, 0, 2]);
        assert_eq!(PeerLoads::default().rank_of(40), 0);
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

    /// New replica ids beyond the bound are not tracked (20 frames of fresh ids once added a
    /// peer each), and a peer's frames are applied in order only.
    #[test]
    fn peers_are_bounded_and_replays_refused() {
        let now = Instant::now();
        let mut peers = PeerLoads::default();
        for id in 0..4 {
            assert_eq!(peers.admit(id, 1, 4, now), Ok(()));
        }
        assert_eq!(peers.admit(99, 1, 4, now), Err("too_many_peers"));
        assert_eq!(peers.live(), 4);
        assert_eq!(peers.admit(0, 2, 4, now), Ok(()));
        assert_eq!(peers.admit(0, 2, 4, now), Err("replayed"));
        assert_eq!(peers.admit(0, 1, 4, now), Err("replayed"));
        assert_eq!(peers.admit(0, 3, 4, now), Ok(()));
        // A silent peer's place frees up.
        peers.expire(now + Duration::from_secs(10), Duration::from_secs(3));
        assert_eq!(peers.admit(99, 1, 4, now + Duration::from_secs(10)), Ok(()));
    }
}
