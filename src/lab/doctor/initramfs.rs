//! A look inside the guest's initramfs: compressed or not, and the kernel
//! modules it carries.

/// What an initramfs holds.
#[derive(Debug, Default, PartialEq)]
pub struct InitramfsInfo {
    /// `gzip`, `xz`, `zstd`, `lz4`, `bzip2` or `lzma` for a compressed archive.
    pub compression: Option<&'static str>,
    /// `.ko.xz`/`.ko.zst`/`.ko.gz` members.
    pub compressed_modules: usize,
    /// Bytes of `.ko` members that carry `.debug_info`.
    pub debug_module_bytes: u64,
}

/// Looks into a (newc) initramfs.
pub fn inspect_initramfs(data: &[u8]) -> InitramfsInfo {
    const MAGICS: &[(&[u8], &str)] = &[
        (&[0x1f, 0x8b], "gzip"),
        (&[0xfd, b'7', b'z', b'X', b'Z'], "xz"),
        (&[0x28, 0xb5, 0x2f, 0xfd], "zstd"),
        (&[0x02, 0x21, 0x4c, 0x18], "lz4"),
        (b"BZh", "bzip2"),
        (&[0x5d, 0x00, 0x00], "lzma"),
    ];
    let mut info = InitramfsInfo {
        compression: MAGICS
            .iter()
            .find(|(m, _)| data.starts_with(m))
            .map(|(_, n)| *n),
        ..Default::default()
    };
    if info.compression.is_some() {
        return info;
    }
    // newc: "070701", 13 8-digit hex fields, name, padding to 4, data, padding.
    let mut off = 0usize;
    let hex = |b: &[u8]| {
        std::str::from_utf8(b)
            .ok()
            .and_then(|s| usize::from_str_radix(s, 16).ok())
    };
    while off + 110 <= data.len() && &data[off..off + 6] == b"070701" {
        let h = &data[off..off + 110];
        let (Some(size), Some(namesize)) = (hex(&h[54..62]), hex(&h[94..102])) else {
            break;
        };
        let name_start = off + 110;
        let Some(name) = data.get(name_start..name_start + namesize.saturating_sub(1)) else {
            break;
        };
        let body_start = (name_start + namesize + 3) & !3;
        let Some(body) = data.get(body_start..body_start + size) else {
            break;
        };
        let name = String::from_utf8_lossy(name);
        if name == "TRAILER!!!" {
            break;
        }
        if [".ko.xz", ".ko.zst", ".ko.gz"]
            .iter()
            .any(|s| name.ends_with(s))
        {
            info.compressed_modules += 1;
        } else if name.ends_with(".ko") && body.windows(12).any(|w| w == b".debug_info\0") {
            info.debug_module_bytes += size as u64;
        }
        off = (body_start + size + 3) & !3;
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initramfs_compression_and_module_debug_info() {
        assert_eq!(
            inspect_initramfs(&[0x1f, 0x8b, 8, 0]).compression,
            Some("gzip")
        );
        let mut w = crate::initramfs::NewcWriter::new(Vec::new());
        w.file("a.ko", 0o644, b"\x7fELF....debug_info\0.debug_info\0rest")
            .unwrap();
        w.file("b.ko.xz", 0o644, b"xz").unwrap();
        w.file("c.ko", 0o644, b"\x7fELF stripped").unwrap();
        let (data, _) = w.finish().unwrap();
        let info = inspect_initramfs(&data);
        assert_eq!(info.compression, None);
        assert_eq!(info.compressed_modules, 1);
        assert_eq!(info.debug_module_bytes, 35);
    }
}
