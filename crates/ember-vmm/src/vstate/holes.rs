//! Holes in guest memory that must stay holes: pages ember discarded on the
//! guest's behalf (a balloon's) and the guest has not taken back, kept off
//! transparent huge pages until it does.
//!
//! Guest RAM is advised `MADV_HUGEPAGE` (`memory::create`). A 4 KiB discard
//! inside a huge page leaves a hole the kernel refills on its own: khugepaged
//! collapses a 2 MiB range with holes back into one huge page (up to
//! `khugepaged/max_ptes_none` of them, 511 by default), and a fault or a
//! populate in a 2 MiB range with nothing mapped allocates a whole huge page
//! over the pages still given away. Either way memory the guest gave back is
//! resident again. So each 2 MiB range holding a hole is advised
//! `MADV_NOHUGEPAGE` *before* the discard (neither path touches it then), and
//! `MADV_HUGEPAGE` again once its last hole is given back.
//!
//! Each advice splits a mapping, and a process has at most
//! `vm.max_map_count` (65530) of them: past `MAX_RUNS` runs of advised
//! ranges, the whole of guest RAM goes off huge pages until the last hole is
//! given back (slower memory, never more of it).
//!
//! Whole 2 MiB ranges need none of this (nothing left to collapse; no fault
//! wanted there): virtio-mem blocks, and the free page reports of Linux's
//! driver (2 MiB and larger, and reused without telling the device, so there
//! would be no moment to give the advice back).

use std::sync::{Arc, Mutex, MutexGuard};

use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress};

use crate::ranges::RangeSet;

/// A transparent huge page (and the host alignment of advised memory).
const HUGE: u64 = 2 << 20;
/// Most separate runs of 2 MiB ranges kept off huge pages (each splits its
/// mapping in three): a tenth of the default `vm.max_map_count` each side.
pub(crate) const MAX_RUNS: usize = 8192;

/// The holes of one guest memory (cheap to clone; shared by the balloon and
/// the memory committer that discard on the guest's behalf).
#[derive(Debug, Clone, Default)]
pub struct Holes {
    /// Guest-physical (start, end, host start) of the memory advised for
    /// huge pages: empty when none is (hugetlbfs, a restored VM's file).
    advised: Arc<Vec<(u64, u64, u64)>>,
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    /// Guest-physical ranges discarded and not given back.
    holes: RangeSet,
    /// Guest-physical 2 MiB ranges advised MADV_NOHUGEPAGE.
    off: RangeSet,
    /// Past [`MAX_RUNS`]: all advised memory is off until no hole is left.
    all_off: bool,
}

impl Holes {
    /// The holes of `mem`, whose huge-page advice is ember's own
    /// (`memory::huge_page_part`).
    pub fn new(mem: &GuestMemoryMmap) -> Self {
        let advised = mem
            .iter()
            .filter_map(|r| {
                let (start, end) = super::memory::huge_page_part(r)?;
                let host = r
                    .get_host_address(MemoryRegionAddress(start - r.start_addr().0))
                    .ok()?;
                Some((start, end, host as u64))
            })
            .collect();
        Holes {
            advised: Arc::new(advised),
            state: Arc::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Guest `start..end` is about to be discarded and stays the host's until
    /// [`Holes::give_back`]: keeps the 2 MiB ranges around it off huge pages.
    /// Call it before the discard.
    pub fn punch(&self, start: u64, end: u64) {
        let mut s = self.lock();
        s.holes.insert(start, end);
        if s.all_off {
            return;
        }
        let mut todo = Vec::new();
        for &(g0, g1, _) in self.advised.iter() {
            let (a, b) = (start.max(g0), end.min(g1));
            if a >= b {
                continue;
            }
            let (a, b) = ((a / HUGE * HUGE).max(g0), b.next_multiple_of(HUGE).min(g1));
            todo.extend(s.off.gaps(a, b, u64::MAX));
        }
        for (a, b) in todo {
            // Touching runs merge; a new run past the budget, or a kernel out
            // of mappings, turns everything off instead.
            let runs = s.off.len() + 1
                - usize::from(a > 0 && s.off.contains(a - 1, a))
                - usize::from(s.off.contains(b, b + 1));
            if runs > MAX_RUNS || !self.advise(a, b, libc::MADV_NOHUGEPAGE) {
                self.all_off(&mut s);
                return;
            }
            s.off.insert(a, b);
        }
    }

    /// The guest took `start..end` back (a deflate): 2 MiB ranges left
    /// without holes go back to huge pages. Call it before the pages are
    /// committed or touched, so they may be huge again.
    pub fn give_back(&self, start: u64, end: u64) {
        let mut s = self.lock();
        if s.holes.remove(start, end) == 0 && !s.all_off {
            return;
        }
        if s.holes.total() == 0 {
            let off: Vec<_> = s.off.iter().collect();
            for (a, b) in off {
                self.advise(a, b, libc::MADV_HUGEPAGE);
            }
            s.off = RangeSet::new();
            s.all_off = false;
            return;
        }
        if s.all_off {
            return;
        }
        // The 2 MiB ranges around `start..end` that are off and hold no hole,
        // merged.
        let mut on: Vec<(u64, u64)> = Vec::new();
        let mut at = start / HUGE * HUGE;
        while at < end {
            // An advised range may end short of a 2 MiB boundary (RAM need
            // only be whole pages); its last piece is off up to its end.
            let next = self
                .advised
                .iter()
                .find(|r| (r.0..r.1).contains(&at))
                .map_or(at + HUGE, |r| r.1.min(at + HUGE));
            if s.off.contains(at, next) && s.holes.gaps(at, next, u64::MAX) == [(at, next)] {
                match on.last_mut() {
                    Some(last) if last.1 == at => last.1 = next,
                    _ => on.push((at, next)),
                }
            }
            at = next;
        }
        for (x, y) in on {
            // Cutting a piece out of a run may split it: past the budget the
            // piece stays off until the last hole goes.
            let runs = s.off.len() - 1
                + usize::from(x > 0 && s.off.contains(x - 1, x))
                + usize::from(s.off.contains(y, y + 1));
            if runs <= MAX_RUNS && self.advise(x, y, libc::MADV_HUGEPAGE) {
                s.off.remove(x, y);
            }
        }
    }

    /// Every advised range off huge pages (the budget is spent).
    fn all_off(&self, s: &mut State) {
        for &(g0, g1, _) in self.advised.iter() {
            for (a, b) in s.off.gaps(g0, g1, u64::MAX) {
                self.advise(a, b, libc::MADV_NOHUGEPAGE);
            }
            s.off.insert(g0, g1);
        }
        s.all_off = true;
    }

    /// Advises the advised memory in guest `a..b` `advice` (a range may
    /// run from one region into the next: the virtio-mem region can start
    /// where RAM ends); whether the kernel took all of it.
    fn advise(&self, a: u64, b: u64, advice: i32) -> bool {
        let mut ok = true;
        for &(g0, g1, host) in self.advised.iter() {
            let (x, y) = (a.max(g0), b.min(g1));
            if x >= y {
                continue;
            }
            // SAFETY: `x..y` lies inside guest memory mapped for as long as
            // `self.advised` is used (ember never unmaps guest memory);
            // huge-page advice changes how pages are backed, never their
            // contents.
            let rc =
                unsafe { libc::madvise((host + (x - g0)) as *mut _, (y - x) as usize, advice) };
            if rc != 0 {
                log::debug!(
                    "madvise({advice}) of guest {x:#x}..{y:#x}: {}",
                    std::io::Error::last_os_error()
                );
                ok = false;
            }
        }
        ok
    }

    /// Guest-physical 2 MiB ranges now kept off huge pages.
    #[cfg(test)]
    pub(crate) fn off(&self) -> Vec<(u64, u64)> {
        self.lock().off.iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory;
    use vm_memory::{Bytes, GuestAddress};

    const M: u64 = 1 << 20;
    const PAGE: u64 = 4096;

    /// (start, end, huge-page advice) of the mappings over `mem`'s first region.
    fn advice(mem: &GuestMemoryMmap) -> Vec<(u64, u64, Option<bool>)> {
        advice_of(mem, 0)
    }

    /// The same over `mem`'s region `i`.
    fn advice_of(mem: &GuestMemoryMmap, i: usize) -> Vec<(u64, u64, Option<bool>)> {
        let r = mem.iter().nth(i).unwrap();
        let host = r.get_host_address(MemoryRegionAddress(0)).unwrap() as u64;
        let end = host + r.len();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut maps: Vec<(u64, u64, Option<bool>)> = Vec::new();
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
            {
                maps.push((a, b, None));
                continue;
            }
            if let (Some(flags), Some(last)) = (line.strip_prefix("VmFlags:"), maps.last_mut()) {
                let f: Vec<_> = flags.split_whitespace().collect();
                last.2 = if f.contains(&"hg") {
                    Some(true)
                } else if f.contains(&"nh") {
                    Some(false)
                } else {
                    None
                };
            }
        }
        maps.into_iter()
            .filter(|m| m.0 >= host && m.1 <= end)
            .map(|(a, b, f)| (a - host, b - host, f))
            .collect()
    }

    #[test]
    fn holes_keep_their_2mib_ranges_off_huge_pages_until_given_back() {
        let mem = memory::create(32 * M).unwrap();
        let h = Holes::new(&mem);
        // Two pages in one 2 MiB range, one in the next, one in a third apart.
        h.punch(8 * M, 8 * M + PAGE);
        h.punch(9 * M, 9 * M + PAGE);
        h.punch(10 * M + 5 * PAGE, 10 * M + 6 * PAGE);
        h.punch(20 * M, 20 * M + PAGE);
        assert_eq!(h.off(), [(8 * M, 12 * M), (20 * M, 22 * M)]);
        assert_eq!(
            advice(&mem),
            [
                (0, 2 * M, None),
                (2 * M, 8 * M, Some(true)),
                (8 * M, 12 * M, Some(false)),
                (12 * M, 20 * M, Some(true)),
                (20 * M, 22 * M, Some(false)),
                (22 * M, 32 * M, Some(true)),
            ]
        );
        // One of two holes back: the range stays off; the second: it is on.
        h.give_back(8 * M, 8 * M + PAGE);
        assert_eq!(h.off(), [(8 * M, 12 * M), (20 * M, 22 * M)]);
        h.give_back(9 * M, 9 * M + PAGE);
        assert_eq!(h.off(), [(10 * M, 12 * M), (20 * M, 22 * M)]);
        // Giving back what was never a hole changes nothing.
        h.give_back(14 * M, 16 * M);
        assert_eq!(h.off(), [(10 * M, 12 * M), (20 * M, 22 * M)]);
        h.give_back(0, 32 * M);
        assert_eq!(h.off(), []);
        assert_eq!(
            advice(&mem),
            [(0, 2 * M, None), (2 * M, 32 * M, Some(true))],
            "the mappings merge back"
        );
        // The low range is never advised either way.
        h.punch(PAGE, 2 * PAGE);
        assert_eq!(h.off(), []);
        mem.write_obj(1u8, GuestAddress(PAGE)).unwrap();
    }

    #[test]
    fn a_2mib_range_either_side_of_two_adjacent_regions_goes_back_to_huge_pages() {
        // The virtio-mem region starts where RAM ends (two mappings).
        let ram = memory::create(16 * M).unwrap();
        let (mem, _) = memory::add_hotplug(&ram, 16 * M, 128 * M).unwrap();
        let h = Holes::new(&mem);
        h.punch(15 * M, 15 * M + PAGE);
        h.punch(16 * M, 16 * M + PAGE);
        h.punch(40 * M, 40 * M + PAGE);
        assert_eq!(h.off(), [(14 * M, 18 * M), (40 * M, 42 * M)]);
        assert_eq!(advice(&mem).last(), Some(&(14 * M, 16 * M, Some(false))));
        assert_eq!(advice_of(&mem, 1)[0], (0, 2 * M, Some(false)));
        // One deflate across both: one 4 MiB piece back, in two mappings.
        h.give_back(15 * M, 16 * M + PAGE);
        assert_eq!(h.off(), [(40 * M, 42 * M)]);
        assert_eq!(advice(&mem).last(), Some(&(2 * M, 16 * M, Some(true))));
        h.give_back(40 * M, 40 * M + PAGE);
        assert_eq!(h.off(), []);
        assert_eq!(advice(&mem).last(), Some(&(2 * M, 16 * M, Some(true))));
        assert_eq!(advice_of(&mem, 1), [(0, 128 * M, Some(true))]);
    }

    #[test]
    fn past_the_budget_all_of_ram_goes_off_until_the_last_hole_is_back() {
        let size = (2 * MAX_RUNS as u64 + 8) * 2 * M;
        let mem = memory::create(size).unwrap();
        let h = Holes::new(&mem);
        let advised: Vec<(u64, u64)> = h.advised.iter().map(|r| (r.0, r.1)).collect();
        // One page every other 2 MiB range: a run each.
        let holes: Vec<u64> = advised
            .iter()
            .flat_map(|&(a, b)| (a..b - HUGE).step_by(2 * HUGE as usize))
            .take(MAX_RUNS + 1)
            .collect();
        assert_eq!(holes.len(), MAX_RUNS + 1);
        for &p in &holes[..MAX_RUNS] {
            h.punch(p, p + PAGE);
        }
        assert_eq!(h.off().len(), MAX_RUNS);
        h.punch(holes[MAX_RUNS], holes[MAX_RUNS] + PAGE);
        assert_eq!(h.off(), advised);
        let first = advised[0].1;
        assert_eq!(
            advice(&mem),
            [(0, 2 * M, None), (2 * M, first, Some(false))]
        );
        for &p in &holes[1..] {
            h.give_back(p, p + PAGE);
        }
        assert_eq!(h.off(), advised, "one hole left");
        h.give_back(holes[0], holes[0] + PAGE);
        assert_eq!(h.off(), []);
        assert_eq!(advice(&mem), [(0, 2 * M, None), (2 * M, first, Some(true))]);
    }

    #[test]
    fn memory_ember_did_not_advise_is_left_alone() {
        // A restored VM's: its memory file mapped privately, never advised.
        let dir = ember_testing::TempDir::new("holes");
        let path = dir.join("memory");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(16 * M)
            .unwrap();
        let mem = crate::snapshot::memory::map_private(&path, 16 * M).unwrap();
        let h = Holes::new(&mem);
        h.punch(8 * M, 8 * M + PAGE);
        h.give_back(8 * M, 8 * M + PAGE);
        assert_eq!(h.off(), []);
        assert!(
            advice(&mem).iter().all(|m| m.2.is_none()),
            "{:?}",
            advice(&mem)
        );
    }
}
