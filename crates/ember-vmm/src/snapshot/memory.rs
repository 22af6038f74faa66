//! Guest memory as a file: written sparsely (only pages the guest may have
//! written and that are not all zeroes take space), and mapped back
//! privately, copy-on-write, so a restore reads nothing up front and never
//! changes the snapshot.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap, MemoryRegionAddress, MmapRegion,
};

use crate::arch::x86_64::layout;

const PAGE: usize = 4096;
/// pagemap entry bits: the page is in RAM / in swap.
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
/// Largest single write: long runs are split so progress stays smooth.
const MAX_RUN: usize = 8 << 20;

/// Writes guest memory to `file` (new and empty): regions back to
/// back in guest-address order, as [`map_private`] expects. `anonymous`
/// says guest memory is anonymous (a booted VM): then a page the host never
/// faulted in (pagemap: neither present nor swapped) is zero without being
/// read. A restored VM's memory is a private file mapping, whose untouched
/// pages are the old file's: those are read like any other.
/// Returns the bytes written (the rest of the file is holes) and the file's
/// [`checksum`], taken as it is written.
#[cfg(test)]
pub(crate) fn write(mem: &GuestMemoryMmap, file: &File, anonymous: bool) -> io::Result<(u64, u32)> {
    write_range(mem, file, anonymous, 0..u64::MAX)
}

/// [`write`] for the regions of `mem` that start in `range` (guest-physical):
/// the boot RAM into the memory file, a virtio-mem region into its own.
pub(crate) fn write_range(
    mem: &GuestMemoryMmap,
    file: &File,
    anonymous: bool,
    range: std::ops::Range<u64>,
) -> io::Result<(u64, u32)> {
    let regions: Vec<_> = mem
        .iter()
        .filter(|r| range.contains(&r.start_addr().0))
        .collect();
    let total: u64 = regions.iter().map(|r| r.len()).sum();
    file.set_len(total)?;
    let pagemap = if anonymous {
        Some(File::open("/proc/self/pagemap")?)
    } else {
        None
    };
    let mut written = 0u64;
    let mut sum = crc32fast::Hasher::new();
    let mut file_off = 0u64;
    for region in regions {
        let len = usize::try_from(region.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| io::Error::other(e.to_string()))?;
        // SAFETY: `host..host+len` is this region's mapping, alive as long
        // as `mem`. The VM is paused and its queues drained, so nothing
        // writes it while it is read here (a racing write could only make
        // the snapshot stale, never unsound: it is plain bytes).
        let bytes = unsafe { std::slice::from_raw_parts(host.cast_const(), len) };
        let mut present = vec![0u64; 0];
        let mut run: Option<usize> = None;
        let mut flush = |start: usize, end: usize| -> io::Result<()> {
            // A run holds only non-zero pages.
            for (i, page) in bytes[start..end].chunks(PAGE).enumerate() {
                add_page(&mut sum, file_off + (start + i * PAGE) as u64, page);
            }
            file.write_all_at(&bytes[start..end], file_off + start as u64)?;
            written += (end - start) as u64;
            Ok(())
        };
        for (i, page) in bytes.chunks(PAGE).enumerate() {
            let off = i * PAGE;
            if let Some(pm) = &pagemap {
                // pagemap in batches of 512 entries (2 MiB of guest memory).
                let slot = i % 512;
                if slot == 0 {
                    let n = (len / PAGE - i).min(512);
                    present.resize(n, 0);
                    let mut raw = vec![0u8; n * 8];
                    pm.read_exact_at(&mut raw, (host as u64 / PAGE as u64 + i as u64) * 8)?;
                    for (e, c) in present.iter_mut().zip(raw.chunks_exact(8)) {
                        *e = u64::from_le_bytes(c.try_into().unwrap_or_default());
                    }
                }
                if present[slot] & (PM_PRESENT | PM_SWAPPED) == 0 {
                    if let Some(s) = run.take() {
                        flush(s, off)?;
                    }
                    continue;
                }
            }
            if is_zero(page) {
                if let Some(s) = run.take() {
                    flush(s, off)?;
                }
            } else {
                match run {
                    Some(s) if off - s >= MAX_RUN => {
                        flush(s, off)?;
                        run = Some(off);
                    }
                    Some(_) => {}
                    None => run = Some(off),
                }
            }
        }
        if let Some(s) = run {
            flush(s, len)?;
        }
        file_off += region.len();
    }
    file.sync_all()?;
    Ok((written, sum.finalize()))
}

/// Adds the page at `offset` of the memory file to a checksum.
fn add_page(sum: &mut crc32fast::Hasher, offset: u64, page: &[u8]) {
    sum.update(&offset.to_le_bytes());
    sum.update(page);
}

/// The memory file's checksum: CRC-32 over its non-zero pages, each after
/// its offset, in file order. Zero pages (holes, or zeroes written) count
/// for nothing, so a sparse file and the same memory written densely agree.
/// Reads the whole file: for a restore that went wrong, not for every one.
pub(crate) fn checksum(path: &Path) -> io::Result<u32> {
    use std::io::Read;
    // Sequential reads: this runs on a filtered main thread, whose
    // allow-list has read, not pread.
    let mut file = crate::files::open_regular(path)?;
    let mut sum = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0u64;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            match file.read(&mut buf[filled..])? {
                0 => break,
                n => filled += n,
            }
        }
        if filled == 0 {
            break;
        }
        for page in buf[..filled].chunks(PAGE) {
            if !is_zero(page) {
                add_page(&mut sum, off, page);
            }
            off += page.len() as u64;
        }
    }
    Ok(sum.finalize())
}

fn is_zero(page: &[u8]) -> bool {
    // SAFETY: u128 has no invalid bit patterns; align_to hands back the
    // unaligned ends as bytes.
    let (head, body, tail) = unsafe { page.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && body.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Adds the virtio-mem region saved at `path` to `mem`, at guest-physical
/// `addr`, mapped as [`map_private`] maps RAM.
pub(crate) fn add_private_region(
    mem: &GuestMemoryMmap,
    path: &Path,
    addr: u64,
) -> io::Result<GuestMemoryMmap> {
    let file = crate::files::open_regular(path)?;
    let len = usize::try_from(file.metadata()?.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
    let mapping = MmapRegion::build(
        Some(FileOffset::new(file, 0)),
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_NORESERVE,
    )
    .map_err(|e| io::Error::other(e.to_string()))?;
    // SAFETY: the mapping was just made and is `len` bytes long;
    // MADV_DONTFORK only affects future forks.
    unsafe { libc::madvise(mapping.as_ptr().cast(), len, libc::MADV_DONTFORK) };
    let region = GuestRegionMmap::new(mapping, GuestAddress(addr))
        .ok_or_else(|| io::Error::other("guest region overflows"))?;
    mem.insert_region(std::sync::Arc::new(region))
        .map_err(|e| io::Error::other(e.to_string()))
}

/// Maps the memory file at `path` as the RAM of a `size`-byte guest,
/// privately: the guest's writes go to copies, the file is only read, and
/// only the pages the guest touches.
pub(crate) fn map_private(path: &Path, size: u64) -> io::Result<GuestMemoryMmap> {
    let file = std::sync::Arc::new(crate::files::open_regular(path)?);
    let mut regions = Vec::new();
    let mut off = 0u64;
    for (start, len) in layout::ram_ranges(size) {
        let ulen = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        let mapping = MmapRegion::build(
            Some(FileOffset::from_arc(file.clone(), off)),
            ulen,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE,
        )
        .map_err(|e| io::Error::other(e.to_string()))?;
        let host = mapping.as_ptr();
        // A helper process forked later must not share these pages (see
        // `vstate::memory::create`).
        // SAFETY: the mapping was just made and is `ulen` bytes long;
        // MADV_DONTFORK only affects future forks.
        unsafe { libc::madvise(host.cast(), ulen, libc::MADV_DONTFORK) };
        regions.push(
            GuestRegionMmap::new(mapping, GuestAddress(start))
                .ok_or_else(|| io::Error::other("guest region overflows"))?,
        );
        off += len;
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| io::Error::other(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn written_memory_maps_back_sparse_and_private() {
        let dir = ember_testing::TempDir::new("snapmem");
        let path = dir.join("memory");
        let mem = crate::vstate::memory::create(16 << 20).unwrap();
        mem.write_obj(0xdead_beef_u32, GuestAddress(0x1000))
            .unwrap();
        mem.write_obj(0x1234_u16, GuestAddress((8 << 20) + 6))
            .unwrap();
        // Touched, but zero: takes no space.
        mem.write_obj(0u64, GuestAddress(12 << 20)).unwrap();
        let (written, sum) = write(&mem, &File::create(&path).unwrap(), true).unwrap();
        assert_eq!(written, 2 * PAGE as u64, "two non-zero pages");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 16 << 20);
        assert_eq!(
            checksum(&path).unwrap(),
            sum,
            "the file's checksum is the one taken"
        );
        // Written densely (its zero pages too), the same memory sums the same.
        let dense = dir.join("dense");
        let mut all = vec![0u8; 16 << 20];
        mem.read_slice(&mut all, GuestAddress(0)).unwrap();
        std::fs::write(&dense, &all).unwrap();
        assert_eq!(checksum(&dense).unwrap(), sum);
        all[0x1000] ^= 1;
        std::fs::write(&dense, &all).unwrap();
        assert_ne!(checksum(&dense).unwrap(), sum, "one bit changed");

        let back = map_private(&path, 16 << 20).unwrap();
        assert_eq!(
            back.read_obj::<u32>(GuestAddress(0x1000)).unwrap(),
            0xdead_beef
        );
        assert_eq!(
            back.read_obj::<u16>(GuestAddress((8 << 20) + 6)).unwrap(),
            0x1234
        );
        // Writes stay private: the file does not change.
        back.write_obj(7u8, GuestAddress(0x1000)).unwrap();
        let again = map_private(&path, 16 << 20).unwrap();
        assert_eq!(
            again.read_obj::<u32>(GuestAddress(0x1000)).unwrap(),
            0xdead_beef
        );
        // A snapshot of the restored (file-backed) memory keeps the file's
        // pages the guest never touched, and its own writes.
        let path2 = dir.join("memory2");
        write(&back, &File::create(&path2).unwrap(), false).unwrap();
        let third = map_private(&path2, 16 << 20).unwrap();
        assert_eq!(third.read_obj::<u8>(GuestAddress(0x1000)).unwrap(), 7);
        assert_eq!(
            third.read_obj::<u16>(GuestAddress((8 << 20) + 6)).unwrap(),
            0x1234
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
