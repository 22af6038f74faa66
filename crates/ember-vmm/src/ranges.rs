//! A set of `u64` half-open ranges kept merged: adjacent and overlapping ranges
//! become one. The balloon keeps the guest pages it holds this way (a guest
//! that inflates 8 GiB page by page mostly hands over runs of adjacent pages,
//! so millions of pages become a handful of ranges), and the memory committer
//! keeps what it has committed.
//!
//! Memory is bounded by the universe it describes: at most one range per two
//! units of it (alternating members and gaps).

use std::collections::BTreeMap;

/// Merged half-open ranges `start..end`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RangeSet {
    /// start -> end; no two ranges overlap or touch.
    map: BTreeMap<u64, u64>,
    total: u64,
}

impl RangeSet {
    /// An empty set.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Sum of the lengths.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Number of (merged) ranges.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// No ranges at all.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The ranges in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.iter().map(|(&s, &e)| (s, e))
    }

    /// Adds `start..end` (merging with neighbours).
    pub(crate) fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let (mut start, mut end) = (start, end);
        // A range starting at or before `start` that reaches it absorbs us.
        if let Some((&s, &e)) = self.map.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
                self.map.remove(&s);
                self.total -= e - s;
            }
        }
        // Every range starting inside (or touching) the new one is absorbed.
        while let Some((&s, &e)) = self.map.range(start..=end).next() {
            end = end.max(e);
            self.map.remove(&s);
            self.total -= e - s;
        }
        self.map.insert(start, end);
        self.total += end - start;
    }

    /// Removes `start..end`; returns how much of it was in the set.
    pub(crate) fn remove(&mut self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        let mut removed = 0;
        // A range beginning before `start` that reaches into it is cut.
        if let Some((&s, &e)) = self.map.range(..start).next_back() {
            if e > start {
                self.map.insert(s, start);
                if e > end {
                    self.map.insert(end, e);
                }
                let cut = e.min(end) - start;
                removed += cut;
                self.total -= cut;
            }
        }
        while let Some((&s, &e)) = self.map.range(start..end).next() {
            self.map.remove(&s);
            if e > end {
                self.map.insert(end, e);
            }
            let cut = e.min(end) - s;
            removed += cut;
            self.total -= cut;
        }
        removed
    }

    /// Whether all of `start..end` is in the set.
    pub(crate) fn contains(&self, start: u64, end: u64) -> bool {
        if start >= end {
            return true;
        }
        matches!(self.map.range(..=start).next_back(), Some((_, &e)) if e >= end)
    }

    /// The parts of `start..end` NOT in the set, in order, at most `budget`
    /// units in all (the last part is cut short to fit).
    pub(crate) fn gaps(&self, start: u64, end: u64, budget: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut left = budget;
        let mut at = start;
        // A range covering `start` moves us to its end.
        if let Some((_, &e)) = self.map.range(..=start).next_back() {
            at = at.max(e);
        }
        let mut push = |s: u64, e: u64, left: &mut u64| {
            let e = e.min(s.saturating_add(*left));
            if s < e {
                out.push((s, e));
                *left -= e - s;
            }
        };
        for (&s, &e) in self.map.range(start..end) {
            if left == 0 {
                break;
            }
            if s > at {
                push(at, s.min(end), &mut left);
            }
            at = at.max(e);
        }
        if at < end && left > 0 {
            push(at, end, &mut left);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(s: &RangeSet) -> Vec<(u64, u64)> {
        s.iter().collect()
    }

    #[test]
    fn inserts_merge_adjacent_and_overlapping() {
        let mut s = RangeSet::new();
        s.insert(10, 20);
        s.insert(30, 40);
        s.insert(20, 25); // touches the first
        assert_eq!(ranges(&s), [(10, 25), (30, 40)]);
        s.insert(24, 31); // bridges both
        assert_eq!(ranges(&s), [(10, 40)]);
        s.insert(12, 13); // inside
        s.insert(5, 5); // empty
        assert_eq!(ranges(&s), [(10, 40)]);
        assert_eq!(s.total(), 30);
        // Page by page, out of order: one range.
        let mut p = RangeSet::new();
        for i in (0..1000u64).rev().step_by(2).chain((0..1000).step_by(2)) {
            p.insert(i, i + 1);
        }
        assert_eq!(ranges(&p), [(0, 1000)]);
        assert_eq!(p.total(), 1000);
    }

    #[test]
    fn removes_split_and_count() {
        let mut s = RangeSet::new();
        s.insert(0, 100);
        assert_eq!(s.remove(10, 20), 10);
        assert_eq!(ranges(&s), [(0, 10), (20, 100)]);
        assert_eq!(s.remove(5, 30), 15);
        assert_eq!(ranges(&s), [(0, 5), (30, 100)]);
        assert_eq!(s.remove(200, 300), 0, "nothing there");
        assert_eq!(s.remove(0, 1000), 75);
        assert!(s.is_empty());
        assert_eq!(s.total(), 0);
    }

    #[test]
    fn contains_and_gaps() {
        let mut s = RangeSet::new();
        s.insert(10, 20);
        s.insert(30, 40);
        assert!(s.contains(10, 20) && s.contains(12, 18) && s.contains(5, 5));
        assert!(!s.contains(10, 21) && !s.contains(15, 35) && !s.contains(0, 1));
        assert_eq!(s.gaps(0, 50, u64::MAX), [(0, 10), (20, 30), (40, 50)]);
        assert_eq!(s.gaps(15, 35, u64::MAX), [(20, 30)]);
        assert_eq!(s.gaps(0, 50, 15), [(0, 10), (20, 25)]);
        assert_eq!(s.gaps(12, 18, 100), []);
        assert_eq!(RangeSet::new().gaps(3, 9, 100), [(3, 9)]);
    }

    #[test]
    fn matches_a_bitmap_under_random_operations() {
        // A small LCG: the same sequence every run.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % n
        };
        let mut s = RangeSet::new();
        let mut bits = [false; 256];
        for _ in 0..5000 {
            let a = next(256);
            let b = (a + next(16)).min(256);
            if next(2) == 0 {
                s.insert(a, b);
                bits[a as usize..b as usize].fill(true);
            } else {
                let had = bits[a as usize..b as usize].iter().filter(|&&v| v).count() as u64;
                assert_eq!(s.remove(a, b), had);
                bits[a as usize..b as usize].fill(false);
            }
            assert_eq!(s.total(), bits.iter().filter(|&&v| v).count() as u64);
            // Merged: no two ranges touch.
            let r = ranges(&s);
            assert!(r.windows(2).all(|w| w[0].1 < w[1].0), "{r:?}");
            for (i, &b) in bits.iter().enumerate() {
                assert_eq!(s.contains(i as u64, i as u64 + 1), b);
            }
        }
    }
}
