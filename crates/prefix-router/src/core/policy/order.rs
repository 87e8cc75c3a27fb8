//! Ordering candidates by load: the tie-breaking and fallback order every policy shares.

use super::CandidateRow;

/// Orders `positions` (into `rows`) by load: in flight at this router, then the backend's own
/// queue, then index entries (so new prefixes go where the index is emptiest), each per unit of
/// weight, then a rotating position (so equal backends take turns).
pub fn by_load(rows: &[CandidateRow], positions: &mut [usize], rotation: u64) {
    order(rows, positions, rotation, false)
}

/// Like [`by_load`], but first by requests still waiting for their first byte: the prefill
/// queue, which is what a new request's time to first token waits behind (decoding requests
/// barely delay it). The prefix policies place requests without a useful match this way.
pub fn by_prefill_load(rows: &[CandidateRow], positions: &mut [usize], rotation: u64) {
    order(rows, positions, rotation, true)
}

fn order(rows: &[CandidateRow], positions: &mut [usize], rotation: u64, prefill_first: bool) {
    let n = positions.len() as u64;
    if n < 2 {
        return;
    }
    /// (waiting for first byte, in flight, backend queue, index entries, turn)
    type LoadKey = (u64, u64, u64, u64, u64);
    let mut keyed: Vec<(LoadKey, usize)> = positions
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let r = &rows[p];
            // A backend of weight 2 takes twice the requests of a backend of weight 1.
            let weight = r.weight.max(1);
            let prefill = if prefill_first {
                r.waiting_first_byte * 1024 / weight
            } else {
                0
            };
            let turn = (i as u64 + n - rotation % n) % n;
            let key = (
                prefill,
                r.inflight * 1024 / weight,
                r.queue * 1024 / weight,
                r.entries / weight,
                turn,
            );
            (key, p)
        })
        .collect();
    keyed.sort_unstable_by_key(|(k, _)| *k);
    for (slot, (_, p)) in positions.iter_mut().zip(keyed) {
        *slot = p;
    }
}

/// All positions of `rows`, ordered by [`by_load`].
pub fn all_by_load(rows: &[CandidateRow], rotation: u64) -> Vec<usize> {
    let mut positions: Vec<usize> = (0..rows.len()).collect();
    by_load(rows, &mut positions, rotation);
    positions
}

/// In-flight requests per unit of weight.
pub fn per_weight(r: &CandidateRow) -> f64 {
    r.inflight as f64 / r.weight.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::rows;
    use super::*;

    #[test]
    fn weights_scale_load() {
        let mut r = rows(2);
        r[0].inflight = 1; // weight 1
        r[1].inflight = 3;
        r[1].weight = 4;
        assert_eq!(
            all_by_load(&r, 0),
            vec![1, 0],
            "3 of weight 4 is less load than 1 of weight 1"
        );
    }

    #[test]
    fn ties_take_turns_and_entries_break_them() {
        let mut r = rows(3);
        let firsts: Vec<usize> = (0..3).map(|t| all_by_load(&r, t)[0]).collect();
        assert_eq!(firsts, vec![0, 1, 2]);
        r[0].entries = 10;
        r[2].entries = 10;
        assert_eq!(all_by_load(&r, 0)[0], 1);
    }
}
