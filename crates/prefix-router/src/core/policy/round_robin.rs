//! `round_robin`: each request to the next backend in turn; the others by load.

use super::order::by_load;
use super::{CandidateRow, Choice, Policy, Reason, RequestFacts};

pub struct RoundRobin;

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn choose(&self, rows: &[CandidateRow], facts: &RequestFacts) -> Choice {
        let n = rows.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.rotate_left((facts.turn % n as u64) as usize);
        // Fallbacks by load.
        by_load(rows, &mut order[1..], facts.turn);
        Choice {
            order,
            reason: Reason::RoundRobin,
            matched_ratio: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{plain, rows};
    use super::*;

    #[test]
    fn round_robin_cycles() {
        let r = rows(3);
        let firsts: Vec<usize> = (0..6)
            .map(|turn| RoundRobin.choose(&r, &plain(None, turn)).order[0])
            .collect();
        assert_eq!(firsts[..3], firsts[3..]);
        assert_eq!(
            firsts
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len(),
            3
        );
    }
}
