//! Guest memory: anonymous, lazily allocated, transparent-huge-page advised.
//!
//! Nothing is touched at creation, so a 64 GiB guest costs what a 512 MiB one
//! does until the guest uses its memory (the Alibaba talk's point: boot time
//! must not grow with memory size).

use crate::arch::x86_64::layout;
use thiserror::Error;
use vm_memory::{
    GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap,
    MmapRegion,
};

/// Smallest guest ember will build: room for the boot structures in the low
/// megabyte plus a kernel above it.
pub(crate) const MIN_MEM_SIZE: u64 = 4 << 20;
/// Largest guest: KVM's guest-physical limit on common hosts is 2^46+; stay well under.
pub(crate) const MAX_MEM_SIZE: u64 = 1 << 42;

/// Guest memory errors.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MemoryError {
    /// Not a size.
    #[error("`{0}` is not a memory size (examples: 512M, 2G, 1048576)")]
    Parse(String),
    /// A size, but not of whole 4 KiB pages.
    #[error("`{0}` is not a multiple of the 4 KiB page size")]
    NotWholePages(String),
    /// Too small to boot anything.
    #[error("guest memory of {0} bytes is too small (at least {MIN_MEM_SIZE} bytes, i.e. 4M)")]
    TooSmall(u64),
    /// Too large for this VMM.
    #[error("guest memory of {0} bytes is too large (at most 4T)")]
    TooLarge(u64),
    /// The mmap failed.
    #[error("cannot map {0} bytes of guest memory")]
    Map(u64),
}

/// Parses `512M`, `2G`, `64k`, `1048576` (bytes) into bytes. Sizes must be a
/// whole number of 4 KiB pages.
pub fn parse_size(s: &str) -> Result<u64, MemoryError> {
    let err = || MemoryError::Parse(s.to_owned());
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last().ok_or_else(err)? {
        (i, 'k' | 'K') => (&t[..i], 10),
        (i, 'm' | 'M') => (&t[..i], 20),
        (i, 'g' | 'G') => (&t[..i], 30),
        (i, 't' | 'T') => (&t[..i], 40),
        _ => (t, 0),
    };
    let n: u64 = digits.parse().map_err(|_| err())?;
    let bytes = n.checked_mul(1 << shift).ok_or_else(err)?;
    if bytes % 4096 != 0 {
        return Err(MemoryError::NotWholePages(s.to_owned()));
    }
    Ok(bytes)
}

/// Checks a guest memory size.
pub(crate) fn check_size(size: u64) -> Result<(), MemoryError> {
    if size < MIN_MEM_SIZE {
        return Err(MemoryError::TooSmall(size));
    }
    if size > MAX_MEM_SIZE {
        return Err(MemoryError::TooLarge(size));
    }
    Ok(())
}

/// Host alignment of each guest RAM range. KVM maps a guest 2 MiB page with
/// one huge nested-page-table entry only when its guest and host addresses
/// agree modulo 2 MiB; guest ranges start on 2 MiB boundaries, so their host
/// mappings must too. A plain mmap is only page-aligned on kernels before 6.7
/// (which do not align large anonymous mappings to huge pages themselves):
/// there every 4 KiB page the guest touched was a nested page fault of its
/// own — 17 558 of them in a Debian boot in the nested rig against QEMU's
/// 1 201, QEMU aligning its RAM to 2 MiB.
pub(crate) const HOST_ALIGN: usize = 2 << 20;

/// Maps `len` bytes of anonymous, MAP_NORESERVE memory starting on a
/// [`HOST_ALIGN`] boundary: `len + HOST_ALIGN` bytes are mapped and the
/// unaligned head and the tail beyond `len` given back.
fn map_aligned(len: usize) -> std::io::Result<*mut u8> {
    let padded = len
        .checked_add(HOST_ALIGN)
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
    // SAFETY: a fresh anonymous mapping at an address the kernel picks; it
    // cannot alias anything Rust holds.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            padded,
            libc::PROT_READ | libc::PROT_WRITE,
            RAM_MAP_FLAGS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HOST_ALIGN);
    let (head, tail) = (aligned - start, padded - (aligned - start) - len);
    // SAFETY: both pieces lie inside the mapping made above and nothing
    // refers to them; `aligned..aligned + len` stays mapped.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((aligned + len) as *mut libc::c_void, tail);
        }
    }
    Ok(aligned as *mut u8)
}

/// How guest RAM is mapped (vm-memory's own defaults for anonymous memory).
const RAM_MAP_FLAGS: i32 = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;

/// Maps `size` bytes of guest RAM around the 32-bit device hole. Each range is
/// MAP_NORESERVE, starts on a 2 MiB host boundary ([`HOST_ALIGN`]) and is
/// advised for huge pages.
///
/// The mappings live as long as the process: ember runs one VM per process and
/// leaves the VM's teardown to its exit (`vstate::teardown`), and vm-memory
/// unmaps only the mappings it made itself.
pub(crate) fn create(size: u64) -> Result<GuestMemoryMmap, MemoryError> {
    check_size(size)?;
    let mut regions = Vec::new();
    for (start, len) in layout::ram_ranges(size) {
        let len = usize::try_from(len).map_err(|_| MemoryError::Map(size))?;
        let host = map_aligned(len).map_err(|_| MemoryError::Map(size))?;
        // SAFETY: `host..host + len` is a mapping made just above, readable and
        // writable, that nothing else uses and that is never unmapped.
        let mapping = unsafe {
            MmapRegion::build_raw(host, len, libc::PROT_READ | libc::PROT_WRITE, RAM_MAP_FLAGS)
        }
        .map_err(|_| MemoryError::Map(size))?;
        regions.push(
            GuestRegionMmap::new(mapping, GuestAddress(start)).ok_or(MemoryError::Map(size))?,
        );
    }
    let mem = GuestMemoryMmap::from_regions(regions).map_err(|_| MemoryError::Map(size))?;
    for region in mem.iter() {
        let len = region.len() as usize;
        if let Ok(addr) = region.get_host_address(vm_memory::MemoryRegionAddress(0)) {
            // The low range stays on small pages (see `layout::SMALL_PAGES_END`).
            if let Some((start, end)) = huge_page_part(region) {
                let small = (start - region.start_addr().0) as usize;
                // SAFETY: `addr+small..addr+small+(end-start)` lies within one mapping
                // vm-memory owns and keeps alive as long as `mem`; MADV_HUGEPAGE only
                // changes how future faults are backed, never the contents, so it
                // cannot break any Rust reference.
                let rc = unsafe {
                    libc::madvise(
                        addr.add(small).cast(),
                        (end - start) as usize,
                        libc::MADV_HUGEPAGE,
                    )
                };
                if rc != 0 {
                    // THP disabled on the host: a performance hint lost, not an error.
                    log::debug!(
                        "madvise(MADV_HUGEPAGE) failed: {}",
                        std::io::Error::last_os_error()
                    );
                }
            }
            // A child forked later (a helper process) must not inherit guest
            // memory: fork would copy its page tables and make its pages
            // copy-on-write under a running guest. QEMU advises the same.
            // SAFETY: as above; MADV_DONTFORK only affects future forks.
            if unsafe { libc::madvise(addr.cast(), len, libc::MADV_DONTFORK) } != 0 {
                log::debug!(
                    "madvise(MADV_DONTFORK) failed: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
    Ok(mem)
}

/// The guest-physical part of `region` ember advises for huge pages: an
/// anonymous region's (only [`create`] and [`add_hotplug`] map those) above
/// the small-page low range; none of hugetlbfs memory's, nor of a restored
/// VM's memory file. Balloon holes go by it (`holes`).
pub(crate) fn huge_page_part(region: &GuestRegionMmap) -> Option<(u64, u64)> {
    let flags = region.flags();
    if flags & libc::MAP_ANONYMOUS == 0 || flags & libc::MAP_HUGETLB != 0 {
        return None;
    }
    let (start, end) = (region.start_addr().0, region.start_addr().0 + region.len());
    let start = start.max(layout::SMALL_PAGES_END).min(end);
    (start < end).then_some((start, end))
}

/// Adds a virtio-mem region of `size` bytes at guest-physical `addr` to
/// `mem`, mapped and advised as RAM is (lazily backed, 2 MiB aligned, huge
/// pages, not inherited by children). Returns all of guest memory and the
/// region alone (for its committer).
pub(crate) fn add_hotplug(
    mem: &GuestMemoryMmap,
    addr: u64,
    size: u64,
) -> Result<(GuestMemoryMmap, GuestMemoryMmap), MemoryError> {
    let err = || MemoryError::Map(size);
    let len = usize::try_from(size).map_err(|_| err())?;
    let host = map_aligned(len).map_err(|_| err())?;
    // SAFETY: `host..host + len` is a mapping made just above, readable and
    // writable, that nothing else uses and that is never unmapped.
    let mapping = unsafe {
        MmapRegion::build_raw(host, len, libc::PROT_READ | libc::PROT_WRITE, RAM_MAP_FLAGS)
    }
    .map_err(|_| err())?;
    let region =
        std::sync::Arc::new(GuestRegionMmap::new(mapping, GuestAddress(addr)).ok_or_else(err)?);
    // SAFETY: the range is the mapping above, alive as long as the region;
    // the advice changes how it is backed and forked, never its contents.
    unsafe {
        libc::madvise(host.cast(), len, libc::MADV_HUGEPAGE);
        libc::madvise(host.cast(), len, libc::MADV_DONTFORK);
    }
    let all = mem.insert_region(region.clone()).map_err(|_| err())?;
    let alone = GuestMemoryMmap::from_arc_regions(vec![region]).map_err(|_| err())?;
    Ok((all, alone))
}

/// Commits `host..host+len` (one call; the kernel allocates and zeroes every page
/// not yet present, huge pages where the mapping allows).
pub(crate) fn populate(host: u64, len: u64) -> std::io::Result<()> {
    loop {
        // SAFETY: callers pass a range inside guest memory, which stays mapped as
        // long as the VM (the committer holds the memory). POPULATE_WRITE only
        // allocates pages that are not present; it never changes the contents of
        // a page the guest may be using concurrently.
        let rc = unsafe { libc::madvise(host as *mut _, len as usize, libc::MADV_POPULATE_WRITE) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        // EINTR/EAGAIN: interrupted or transient; what was populated stays.
        if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) {
            return Err(e);
        }
    }
}

/// How many bytes of guest memory are resident on the host, from
/// /proc/self/smaps (cheap even for a 64 GiB guest, unlike mincore).
pub(crate) fn resident_bytes(mem: &GuestMemoryMmap) -> u64 {
    // Host ranges of guest RAM. Advice splits a region into several mappings
    // (small pages first, see `create`), so match mappings inside a range.
    let ranges: Vec<(u64, u64)> = mem
        .iter()
        .filter_map(|r| {
            let start = r.get_host_address(vm_memory::MemoryRegionAddress(0)).ok()? as u64;
            Some((start, start + r.len()))
        })
        .collect();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut total_kib = 0;
    let mut in_guest = false;
    for line in smaps.lines() {
        // A mapping header looks like `7f21a000-7f22a000 rw-p 00000000 00:00 0`.
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((start, _)) = range.split_once('-') {
                if let Ok(start) = u64::from_str_radix(start, 16) {
                    in_guest = ranges.iter().any(|&(s, e)| (s..e).contains(&start));
                    continue;
                }
            }
        }
        if in_guest {
            if let Some(v) = line.strip_prefix("Rss:") {
                total_kib += v
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0);
            }
        }
    }
    total_kib * 1024
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size(" 1T "), Ok(1 << 40));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "M",
            "12Q",
            "-1M",
            "1.5G",
            "99999999999999999999G",
            "4097",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bounds() {
        assert_eq!(check_size(1 << 20), Err(MemoryError::TooSmall(1 << 20)));
        assert_eq!(
            check_size(MAX_MEM_SIZE * 2),
            Err(MemoryError::TooLarge(MAX_MEM_SIZE * 2))
        );
        assert!(check_size(MIN_MEM_SIZE).is_ok());
    }

    #[test]
    fn host_mappings_are_2mib_aligned() {
        // 3 GiB + a bit: the low range and the range above the 32-bit hole.
        let mem = create((3 << 30) + (6 << 20)).unwrap();
        assert_eq!(mem.iter().count(), 2);
        for region in mem.iter() {
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .unwrap() as usize;
            assert_eq!(
                host % HOST_ALIGN,
                0,
                "region at {:#x}",
                region.start_addr().0
            );
            assert_eq!(region.start_addr().0 as usize % HOST_ALIGN, 0);
        }
        // Sizes that are no multiple of 2 MiB, which kernels from 6.7 on
        // would not align by themselves either.
        for _ in 0..8 {
            let p = map_aligned(HOST_ALIGN + 4096).unwrap();
            assert_eq!(p as usize % HOST_ALIGN, 0);
        }
        // The memory is usable from end to end.
        let last = mem.last_addr();
        mem.write_obj(0xabu8, last).unwrap();
        assert_eq!(mem.read_obj::<u8>(last).unwrap(), 0xab);
    }

    #[test]
    fn boot_range_is_on_small_pages_and_the_rest_huge() {
        let mem = create(16 << 20).unwrap();
        let base = mem
            .iter()
            .next()
            .unwrap()
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .unwrap() as u64;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        // (start, end, advised for huge pages) of the mappings at `base`.
        let mut maps = Vec::new();
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
                    {
                        maps.push((a, b, false));
                        continue;
                    }
                }
            }
            if let (Some(flags), Some(last)) = (line.strip_prefix("VmFlags:"), maps.last_mut()) {
                last.2 = flags.split_whitespace().any(|f| f == "hg");
            }
        }
        let low = maps.iter().find(|m| m.0 == base).expect("the low mapping");
        assert_eq!((low.1 - low.0, low.2), (layout::SMALL_PAGES_END, false));
        let high = maps.iter().find(|m| m.0 == low.1).expect("the rest");
        // A kernel without THP refuses the advice (and ember goes on without).
        if std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            assert!(high.2, "the rest is advised for huge pages");
        }
    }

    #[test]
    fn resident_bytes_counts_touched_pages() {
        let mem = create(16 << 20).unwrap();
        let before = resident_bytes(&mem);
        // One page on small pages, one in the huge-page range.
        mem.write_obj(1u8, GuestAddress(0x1000)).unwrap();
        let small = resident_bytes(&mem);
        assert!(small >= before + 4096, "{before} -> {small}");
        mem.write_obj(1u8, GuestAddress(8 << 20)).unwrap();
        assert!(resident_bytes(&mem) >= small + 4096);
    }

    #[test]
    fn large_guests_are_lazy_and_split_around_the_hole() {
        // 64 GiB of address space must map instantly and touch nothing.
        let mem = create(64 << 30).unwrap();
        assert_eq!(mem.num_regions(), 2);
        let total: u64 = mem.iter().map(|r| r.len()).sum();
        assert_eq!(total, 64 << 30);
        assert!(mem.address_in_range(GuestAddress(layout::MMIO_GAP_END)));
        assert!(!mem.address_in_range(GuestAddress(layout::MMIO_GAP_START)));
    }
}
