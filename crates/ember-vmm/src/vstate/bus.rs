//! Port-I/O and MMIO buses: which device answers at an address.

use std::sync::{Arc, Mutex};
use thiserror::Error;

/// A device on a bus. `offset` is relative to the start of its range.
pub trait BusDevice: Send {
    /// A guest read of `data.len()` bytes.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A guest write.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Bus errors.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BusError {
    /// Two devices asked for overlapping ranges.
    #[error("bus range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap {
        /// Start of the rejected range.
        base: u64,
        /// Its length.
        len: u64,
    },
    /// A zero-length range.
    #[error("bus range at {0:#x} is empty")]
    Empty(u64),
}

/// A shared device handle.
pub(crate) type SharedDevice = Arc<Mutex<dyn BusDevice>>;

struct Entry {
    base: u64,
    len: u64,
    device: SharedDevice,
}

/// A set of non-overlapping address ranges, each owned by one device. Small
/// (a handful of devices), so a sorted vector beats a tree.
#[derive(Default)]
pub(crate) struct Bus {
    entries: Vec<Entry>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<_> = self.entries.iter().map(|e| (e.base, e.len)).collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    /// An empty bus.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Puts `device` at `base..base+len`.
    pub(crate) fn insert(
        &mut self,
        device: SharedDevice,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let end = base
            .checked_add(len)
            .ok_or(BusError::Overlap { base, len })?;
        if self
            .entries
            .iter()
            .any(|e| base < e.base + e.len && e.base < end)
        {
            return Err(BusError::Overlap { base, len });
        }
        let at = self.entries.partition_point(|e| e.base < base);
        self.entries.insert(at, Entry { base, len, device });
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(&Entry, u64)> {
        let i = self
            .entries
            .partition_point(|e| e.base <= addr)
            .checked_sub(1)?;
        let e = &self.entries[i];
        let offset = addr - e.base;
        // An access must lie wholly inside one device.
        (offset + size as u64 <= e.len).then_some((e, offset))
    }

    /// Dispatches a read; returns false (and leaves `data` as all-ones, as an
    /// unclaimed ISA/PCI read would) when nothing is there.
    pub(crate) fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((e, offset)) => {
                e.device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .read(offset, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Dispatches a write; returns false when nothing is there.
    pub(crate) fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((e, offset)) => {
                e.device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Echo {
        last: Vec<(u64, Vec<u8>)>,
    }
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_by_range_with_relative_offsets() {
        let a = Arc::new(Mutex::new(Echo::default()));
        let mut bus = Bus::new();
        bus.insert(a.clone(), 0x3f8, 8).unwrap();
        bus.insert(Arc::new(Mutex::new(Echo::default())), 0x80, 1)
            .unwrap();
        let mut d = [0u8; 1];
        assert!(bus.read(0x3fa, &mut d));
        assert_eq!(d, [2]);
        assert!(bus.write(0x3f8, &[7]));
        assert_eq!(a.lock().unwrap().last, vec![(0, vec![7])]);
    }

    #[test]
    fn unclaimed_reads_float_high() {
        let bus = Bus::new();
        let mut d = [0u8; 2];
        assert!(!bus.read(0x10, &mut d));
        assert_eq!(d, [0xff, 0xff]);
        assert!(!bus.write(0x10, &[1]));
    }

    #[test]
    fn rejects_overlap_empty_and_straddling_access() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Echo::default())), 0x100, 0x10)
            .unwrap();
        let dup = bus.insert(Arc::new(Mutex::new(Echo::default())), 0x108, 0x10);
        assert_eq!(
            dup,
            Err(BusError::Overlap {
                base: 0x108,
                len: 0x10
            })
        );
        assert_eq!(
            bus.insert(Arc::new(Mutex::new(Echo::default())), 0x200, 0),
            Err(BusError::Empty(0x200))
        );
        let mut d = [0u8; 4];
        assert!(
            !bus.read(0x10e, &mut d),
            "an access crossing the end is not claimed"
        );
    }
}
