//! `least_loaded`: fewest requests in flight here, then the backend's own queue.

use super::order::all_by_load;
use super::{CandidateRow, Choice, Policy, Reason, RequestFacts};

pub struct LeastLoaded;

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn choose(&self, rows: &[CandidateRow], facts: &RequestFacts) -> Choice {
        Choice {
            order: all_by_load(rows, facts.turn),
            reason: Reason::LeastLoaded,
            matched_ratio: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{plain, rows};
    use super::*;

    #[test]
    fn the_least_loaded_goes_first() {
        let mut r = rows(3);
        r[0].inflight = 2;
        r[1].inflight = 1;
        r[2].inflight = 1;
        r[2].queue = 5;
        assert_eq!(LeastLoaded.choose(&r, &plain(None, 0)).order, vec![1, 2, 0]);
    }
}
