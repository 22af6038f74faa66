//! The appliance kernel: where it lives in ember's cache, how `ember setup`
//! fetches Debian's cloud kernel, and how the ELF vmlinux is pulled out of a
//! bzImage once so that no boot pays for decompression.
//!
//! Which kernel a run uses, first match wins:
//! 1. `ember run --kernel PATH` (modules from `<cache>/kernel/<ver>/lib/modules/<ver>`
//!    or `/lib/modules/<ver>` when they exist, else none);
//! 2. the kernel `ember setup --kernel PATH` recorded (`<cache>/kernel/explicit`);
//! 3. the kernel `ember setup` fetched (`<cache>/kernel/current`);
//! 4. a kernel under `/boot` whose modules are in `/lib/modules/<ver>`.
//!
//! A `/boot` kernel comes last, not first: a host kernel is often missing
//! its modules (containers, this machine) or ships them compressed, while
//! the fetched one is known to work; `ember setup` also falls back to it
//! when it cannot download.

use crate::tool::{self, ToolError};
use ember_vmm::arch::x86_64::boot::{SETUP_CODE_OFFSET, read_setup_header};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use thiserror::Error;

/// Debian's meta package that depends on the current cloud kernel.
pub const META_PACKAGE: &str = "linux-image-cloud-amd64";
const SECTOR: usize = 512;
/// `setup_sects` 0 means this many (boot.rst: the historical default).
const DEFAULT_SETUP_SECTS: usize = 4;
/// The kernel's LZ4 "legacy" frame magic, and its fixed chunk size.
const LZ4_LEGACY_MAGIC: u32 = 0x184c_2102;
const LZ4_LEGACY_CHUNK: usize = 8 << 20;
const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
/// gzip, xz, zstd, bzip2, lzma, lzo magics: payload formats we name in errors.
const OTHER_MAGICS: &[(&[u8], &str)] = &[
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh", "bzip2"),
    (b"\x5d\x00\x00", "lzma"),
    (b"\x89LZO", "lzo"),
];

/// Kernel errors.
#[derive(Debug, Error)]
pub enum KernelError {
    /// Not a bzImage.
    #[error("`{0}` is not a bzImage or ELF kernel")]
    NotBzImage(PathBuf),
    /// The payload is compressed with something we don't decompress.
    #[error("the kernel payload is {0}-compressed; only LZ4 (Debian's) is supported")]
    Compression(&'static str),
    /// The LZ4 stream is damaged.
    #[error("the kernel's LZ4 payload is corrupt: {0}")]
    BadLz4(String),
    /// Decompressed, but not an ELF image.
    #[error("the decompressed kernel payload is not an ELF vmlinux")]
    NotElf,
    /// No kernel anywhere.
    #[error(
        "no appliance kernel: run `ember setup` (fetches Debian's cloud kernel), or pass --kernel"
    )]
    NoKernel,
    /// Reading or writing a file failed.
    #[error("{what} `{path}`")]
    Io {
        /// What we were doing.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// apt-get/apt-cache/dpkg failed.
    #[error(transparent)]
    Tool(#[from] ToolError),
    /// The cache directory cannot be determined.
    #[error("no cache directory: set EMBER_CACHE, XDG_CACHE_HOME or HOME")]
    NoCacheDir,
    /// The cache's path names something other than a directory.
    #[error("the cache `{}` (from {var}) is not a directory", .path.display())]
    CacheNotADir {
        /// The path.
        path: PathBuf,
        /// The variable it came from.
        var: &'static str,
    },
}

fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> KernelError + 'a {
    move |source| KernelError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// ember's cache directory: `$EMBER_CACHE`, else `$XDG_CACHE_HOME/ember`,
/// else `~/.cache/ember`.
pub fn cache_dir() -> Result<PathBuf, KernelError> {
    let var = |k| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let (path, from) = if let Some(d) = var("EMBER_CACHE") {
        (d, "EMBER_CACHE")
    } else if let Some(d) = var("XDG_CACHE_HOME") {
        (d.join("ember"), "XDG_CACHE_HOME")
    } else {
        let home = var("HOME").ok_or(KernelError::NoCacheDir)?;
        (home.join(".cache/ember"), "HOME")
    };
    // A missing cache is made when needed; a file in its place would only
    // fail later, each use saying something else (`run ember setup`).
    match std::fs::metadata(&path) {
        Ok(m) if !m.is_dir() => Err(KernelError::CacheNotADir { path, var: from }),
        _ => Ok(path),
    }
}

/// A kernel ready to boot as an appliance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// What to boot: the extracted vmlinux (or the given image).
    pub image: PathBuf,
    /// Its release string (`6.1.0-56-cloud-amd64`), if known.
    pub version: Option<String>,
    /// Its modules directory (`…/lib/modules/<ver>`), if any.
    pub modules: Option<PathBuf>,
}

/// Where `ember setup` puts things, under the cache directory.
#[derive(Debug, Clone)]
pub struct KernelCache {
    root: PathBuf,
}

impl KernelCache {
    /// The kernel cache inside `cache_dir`.
    pub fn new(cache_dir: &Path) -> Self {
        KernelCache {
            root: cache_dir.join("kernel"),
        }
    }

    /// The directory a package version is unpacked into.
    pub fn unpack_dir(&self, version: &str) -> PathBuf {
        self.root.join(version)
    }

    /// The file naming the installed version.
    fn current_file(&self) -> PathBuf {
        self.root.join("current")
    }

    /// The installed kernel, if `ember setup` completed.
    pub fn current(&self) -> Option<Kernel> {
        let version = fs::read_to_string(self.current_file()).ok()?;
        let version = version.trim();
        let dir = self.unpack_dir(version);
        let image = dir.join("vmlinux");
        image.is_file().then(|| Kernel {
            image,
            version: Some(version.to_owned()),
            modules: Some(dir.join("lib/modules").join(version)).filter(|m| m.is_dir()),
        })
    }

    /// The file naming a kernel chosen with `ember setup --kernel`.
    fn explicit_file(&self) -> PathBuf {
        self.root.join("explicit")
    }

    /// The kernel chosen with `ember setup --kernel`, if it still exists.
    pub fn explicit(&self) -> Option<PathBuf> {
        let p = PathBuf::from(fs::read_to_string(self.explicit_file()).ok()?.trim());
        p.is_file().then_some(p)
    }

    /// Records `path` as the kernel to use (`None`: back to the fetched one).
    pub fn set_explicit(&self, path: Option<&Path>) -> Result<(), KernelError> {
        let file = self.explicit_file();
        match path {
            Some(p) => {
                let abs = std::path::absolute(p).map_err(io_err("cannot resolve", p))?;
                write_atomic(&file, abs.to_string_lossy().as_bytes())
            }
            None => match fs::remove_file(&file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(io_err("cannot remove", &file)(e))
                }
                _ => Ok(()),
            },
        }
    }

    /// Records `version` as installed (atomically).
    pub fn set_current(&self, version: &str) -> Result<(), KernelError> {
        write_atomic(&self.current_file(), version.as_bytes())
    }
}

/// Resolves the kernel for a run (see the module docs for the order).
pub fn find_kernel(explicit: Option<&Path>, cache_dir: &Path) -> Result<Kernel, KernelError> {
    if let Some(path) = explicit {
        fs::File::open(path).map_err(io_err("cannot read the kernel", path))?;
        return Ok(explicit_kernel(path, cache_dir));
    }
    let cache = KernelCache::new(cache_dir);
    if let Some(path) = cache.explicit() {
        return Ok(explicit_kernel(&path, cache_dir));
    }
    if let Some(k) = cache.current() {
        return Ok(k);
    }
    boot_kernel().ok_or(KernelError::NoKernel)
}

/// A `--kernel` image, with modules found by its version string.
fn explicit_kernel(path: &Path, cache_dir: &Path) -> Kernel {
    let version = image_version(path);
    let modules = version.as_ref().and_then(|v| {
        [
            KernelCache::new(cache_dir)
                .unpack_dir(v)
                .join("lib/modules")
                .join(v),
            Path::new("/lib/modules").join(v),
        ]
        .into_iter()
        .find(|d| d.join("modules.order").is_file())
    });
    Kernel {
        image: path.to_path_buf(),
        version,
        modules,
    }
}

/// The newest `/boot/vmlinuz-<ver>` whose `/lib/modules/<ver>` exists.
fn boot_kernel() -> Option<Kernel> {
    let mut found: Vec<_> = fs::read_dir("/boot")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let ver = name.strip_prefix("vmlinuz-")?.to_owned();
            let modules = Path::new("/lib/modules").join(&ver);
            modules.join("modules.order").is_file().then(|| Kernel {
                image: e.path(),
                version: Some(ver),
                modules: Some(modules),
            })
        })
        .collect();
    found.sort_by(|a, b| a.version.cmp(&b.version));
    found.pop()
}

/// Whether `kernel`'s build configuration sets `symbol` (`y` or `m`), from
/// the `config-<ver>` beside it (the unpacked package's `boot/`, or
/// `/boot`); `None` when no configuration is found.
pub fn config_has(kernel: &Kernel, symbol: &str) -> Option<bool> {
    let version = kernel.version.as_ref()?;
    let name = format!("config-{version}");
    let beside = kernel.image.parent().map(|d| d.join("boot").join(&name));
    let text = beside
        .into_iter()
        .chain([Path::new("/boot").join(&name)])
        .find_map(|p| fs::read_to_string(p).ok())?;
    let set = text.lines().any(|l| {
        l.strip_prefix(symbol)
            .and_then(|rest| rest.strip_prefix('='))
            .is_some_and(|v| v == "y" || v == "m")
    });
    Some(set)
}

/// The release string of a bzImage (its setup header's kernel_version) or of
/// a vmlinux whose name is `vmlinux-<ver>`.
pub fn image_version(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut head = vec![0u8; 0x4000];
    let n = fs::File::open(path).ok()?.read(&mut head).ok()?;
    head.truncate(n);
    if let Some(v) = bzimage_version(&head) {
        return Some(v);
    }
    let name = path.file_name()?.to_str()?;
    name.strip_prefix("vmlinux-")
        .or_else(|| name.strip_prefix("vmlinuz-"))
        .map(str::to_owned)
}

fn bzimage_version(head: &[u8]) -> Option<String> {
    // A pointer relative to the setup code; 0 when the kernel names none.
    let ptr = usize::from(read_setup_header(head)?.kernel_version);
    if ptr == 0 {
        return None;
    }
    let s = head.get(ptr + SETUP_CODE_OFFSET..)?;
    let end = s.iter().position(|&b| b == 0 || b == b' ')?;
    String::from_utf8(s[..end].to_vec()).ok()
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Extracts the ELF vmlinux from a bzImage whose payload is LZ4 (legacy frames).
pub fn extract_vmlinux(bzimage: &[u8], name: &Path) -> Result<Vec<u8>, KernelError> {
    if bzimage.starts_with(ELF_MAGIC) {
        return Ok(bzimage.to_vec());
    }
    let not_bz = || KernelError::NotBzImage(name.to_path_buf());
    let hdr = read_setup_header(bzimage).ok_or_else(not_bz)?;
    let setup_sects = match hdr.setup_sects {
        0 => DEFAULT_SETUP_SECTS,
        n => usize::from(n),
    };
    let (offset, length) = (hdr.payload_offset as usize, hdr.payload_length as usize);
    let start = (setup_sects + 1) * SECTOR + offset;
    let payload = bzimage.get(start..start + length).ok_or_else(not_bz)?;
    let elf = decompress_lz4_legacy(payload)?;
    if !elf.starts_with(ELF_MAGIC) {
        return Err(KernelError::NotElf);
    }
    Ok(elf)
}

/// Decompresses the kernel's LZ4 legacy format: magic, then chunks of
/// `[u32 le compressed size][LZ4 block]`, each at most 8 MiB decompressed.
/// Streams may be concatenated (the magic repeats); the kernel build appends
/// the decompressed size as a trailing u32, which is skipped.
pub fn decompress_lz4_legacy(data: &[u8]) -> Result<Vec<u8>, KernelError> {
    if le32(data, 0) != Some(LZ4_LEGACY_MAGIC) {
        let kind = OTHER_MAGICS
            .iter()
            .find(|(m, _)| data.starts_with(m))
            .map_or("unknown", |(_, k)| *k);
        return Err(KernelError::Compression(kind));
    }
    let mut out = Vec::new();
    let mut pos = 4;
    while data.len() - pos >= 4 {
        let size = le32(data, pos).unwrap_or(0);
        pos += 4;
        if size == LZ4_LEGACY_MAGIC {
            continue;
        }
        let size = size as usize;
        if data.len() - pos < size {
            if data.len() == pos {
                break; // that u32 was the appended length
            }
            return Err(KernelError::BadLz4(format!(
                "chunk of {size} bytes overruns"
            )));
        }
        let block = &data[pos..pos + size];
        pos += size;
        let at = out.len();
        out.resize(at + LZ4_LEGACY_CHUNK, 0);
        let n = lz4_flex::block::decompress_into(block, &mut out[at..])
            .map_err(|e| KernelError::BadLz4(e.to_string()))?;
        out.truncate(at + n);
    }
    Ok(out)
}

/// Writes `path` atomically and 0600 (see [`super::cache`]).
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), KernelError> {
    super::cache::write_atomic(path, data).map_err(io_err("cannot write", path))
}

/// Prints one progress line (setup is interactive; keep it terse).
fn progress(msg: &str) {
    eprintln!("ember setup: {msg}");
}

/// `ember setup`: fetch, unpack and extract Debian's cloud kernel into the
/// cache (or register `--kernel`). Fast and silent-ish when already done.
pub fn setup(cache_dir: &Path, explicit: Option<&Path>) -> Result<Kernel, KernelError> {
    let cache = KernelCache::new(cache_dir);
    super::cache::private_dir(cache_dir).map_err(io_err("cannot create", cache_dir))?;
    super::cache::private_dir(&cache.root).map_err(io_err("cannot create", &cache.root))?;
    if let Some(path) = explicit {
        if !path.is_file() {
            return Err(io_err("cannot read", path)(
                std::io::ErrorKind::NotFound.into(),
            ));
        }
        let k = explicit_kernel(path, cache_dir);
        cache.set_explicit(Some(path))?;
        progress(&format!(
            "using {} from now on (modules: {})",
            path.display(),
            k.modules
                .as_ref()
                .map_or("none found".into(), |m| m.display().to_string())
        ));
        return Ok(k);
    }
    cache.set_explicit(None)?;
    let package = match resolve_package() {
        Ok(p) => p,
        Err(e) => {
            if let Some(k) = cache.current().or_else(boot_kernel) {
                progress(&format!(
                    "cannot reach apt ({e}); keeping {}",
                    k.image.display()
                ));
                return Ok(k);
            }
            return Err(e);
        }
    };
    let version = package
        .strip_prefix("linux-image-")
        .unwrap_or(&package)
        .to_owned();
    if let Some(k) = cache
        .current()
        .filter(|k| k.version.as_deref() == Some(&version))
    {
        progress(&format!("kernel {version} already set up"));
        return Ok(k);
    }
    let dir = cache.unpack_dir(&version);
    let vmlinuz = dir.join("boot").join(format!("vmlinuz-{version}"));
    if !vmlinuz.is_file() {
        let deb = download(&cache.root, &package)?;
        progress(&format!("unpacking {}", deb.display()));
        tool::run(Command::new("dpkg").arg("-x").arg(&deb).arg(&dir))?;
        let _ = fs::remove_file(&deb);
    }
    progress("extracting vmlinux from the bzImage");
    let bz = fs::read(&vmlinuz).map_err(io_err("cannot read", &vmlinuz))?;
    let elf = extract_vmlinux(&bz, &vmlinuz)?;
    write_atomic(&dir.join("vmlinux"), &elf)?;
    cache.set_current(&version)?;
    progress(&format!("kernel {version} ready in {}", dir.display()));
    cache.current().ok_or(KernelError::NoKernel)
}

/// The real package behind [`META_PACKAGE`] (`linux-image-<ver>-cloud-amd64`),
/// from apt-cache; runs `apt-get update` once if apt knows nothing yet.
fn resolve_package() -> Result<String, KernelError> {
    let depends = || -> Result<Option<String>, KernelError> {
        let out = tool::run(Command::new("apt-cache").args(["depends", META_PACKAGE]));
        Ok(out.ok().and_then(|text| {
            text.lines()
                .filter_map(|l| l.trim().strip_prefix("Depends: "))
                .map(str::trim)
                .find(|p| p.starts_with("linux-image-") && *p != META_PACKAGE)
                .map(str::to_owned)
        }))
    };
    if let Some(p) = depends()? {
        return Ok(p);
    }
    progress("apt does not know the kernel package yet: running apt-get update");
    tool::run(Command::new("apt-get").arg("update"))?;
    depends()?.ok_or_else(|| {
        KernelError::Tool(ToolError {
            cmd: format!("apt-cache depends {META_PACKAGE}"),
            why: "no linux-image dependency found".into(),
        })
    })
}

/// `apt-get download PACKAGE` into `dir`; returns the .deb.
fn download(dir: &Path, package: &str) -> Result<PathBuf, KernelError> {
    progress(&format!("downloading {package}"));
    // apt-get shows its own download progress: let it through (to stderr,
    // so setup's stdout stays clean).
    let fetch = || {
        let mut cmd = Command::new("apt-get");
        cmd.args(["download", package])
            .current_dir(dir)
            .stdout(std::io::stderr());
        let why = match cmd.status() {
            Ok(s) if s.success() => return Ok(()),
            Ok(s) => s.to_string(),
            Err(e) => e.to_string(),
        };
        Err(ToolError {
            cmd: tool::command_line(&cmd),
            why,
        })
    };
    if fetch().is_err() {
        progress("download failed: running apt-get update and retrying");
        tool::run(Command::new("apt-get").arg("update"))?;
        fetch()?;
    }
    fs::read_dir(dir)
        .map_err(io_err("cannot read", dir))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|e| e == "deb")
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{package}_")))
        })
        .ok_or_else(|| {
            KernelError::Tool(ToolError {
                cmd: format!("apt-get download {package}"),
                why: "no .deb".into(),
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_vmm::arch::x86_64::boot::{HDRS_MAGIC, setup_header, write_setup_header};

    /// A fake bzImage around `payload`.
    fn bzimage(payload: &[u8]) -> Vec<u8> {
        let hdr = setup_header {
            setup_sects: 1,
            header: HDRS_MAGIC,
            kernel_version: VERSION_AT as u16,
            payload_offset: 16,
            payload_length: payload.len() as u32,
            ..Default::default()
        };
        let mut b = vec![0u8; 2 * SECTOR];
        write_setup_header(&mut b, &hdr).unwrap();
        let at = VERSION_AT + SETUP_CODE_OFFSET;
        b[at..at + 12].copy_from_slice(b"6.1.0-test \0");
        b.extend_from_slice(&[0xcc; 16]);
        b.extend_from_slice(payload);
        b
    }

    /// Where the fake bzImage's release string is, from the setup code.
    const VERSION_AT: usize = 0x100;

    #[test]
    fn the_release_string_comes_from_the_setup_header() {
        assert_eq!(
            bzimage_version(&bzimage(b"")).as_deref(),
            Some("6.1.0-test")
        );
        let mut no_version = bzimage(b"");
        no_version[0x20e..0x210].fill(0);
        assert_eq!(bzimage_version(&no_version), None);
        assert_eq!(bzimage_version(b"short"), None);
    }

    fn lz4_legacy(data: &[u8], chunk: usize) -> Vec<u8> {
        let mut out = LZ4_LEGACY_MAGIC.to_le_bytes().to_vec();
        for c in data.chunks(chunk) {
            let block = lz4_flex::block::compress(c);
            out.extend_from_slice(&(block.len() as u32).to_le_bytes());
            out.extend_from_slice(&block);
        }
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out
    }

    #[test]
    fn extracts_a_synthetic_lz4_payload() {
        let mut elf = ELF_MAGIC.to_vec();
        elf.extend((0..300_000u32).map(|i| (i % 251) as u8));
        let got = extract_vmlinux(&bzimage(&lz4_legacy(&elf, 100_000)), Path::new("x")).unwrap();
        assert_eq!(got, elf);
    }

    #[test]
    fn rejects_other_formats_and_damage() {
        let p = Path::new("k");
        assert!(matches!(
            extract_vmlinux(b"not a kernel at all", p),
            Err(KernelError::NotBzImage(_))
        ));
        assert!(matches!(
            extract_vmlinux(&bzimage(b"\x1f\x8b\x08\x00rest"), p),
            Err(KernelError::Compression("gzip"))
        ));
        let not_elf = lz4_legacy(b"just some bytes, not ELF", 8);
        assert!(matches!(
            extract_vmlinux(&bzimage(&not_elf), p),
            Err(KernelError::NotElf)
        ));
        let mut cut = lz4_legacy(&[7u8; 5000], 5000);
        cut.truncate(cut.len() - 8);
        assert!(matches!(
            decompress_lz4_legacy(&cut),
            Err(KernelError::BadLz4(_))
        ));
    }

    #[test]
    fn extracts_the_real_debian_kernel_when_present() {
        // The kernel `ember setup` fetched (scripts/test runs it first).
        let cache = KernelCache::new(&cache_dir().unwrap());
        let version = cache.current().and_then(|k| k.version).unwrap_or_default();
        let dir = cache.unpack_dir(&version).join("boot");
        let Some(vmlinuz) = fs::read_dir(&dir).ok().and_then(|d| {
            d.flatten()
                .map(|e| e.path())
                .find(|p| p.to_string_lossy().contains("vmlinuz-"))
        }) else {
            let why = format!(
                "no Debian kernel under {} (run `ember setup`)",
                dir.display()
            );
            ember_testing::skip("extracts_the_real_debian_kernel", &why);
            return;
        };
        let bz = fs::read(&vmlinuz).unwrap();
        let elf = extract_vmlinux(&bz, &vmlinuz).unwrap();
        assert!(elf.len() > bz.len(), "decompressed is larger");
        assert_eq!(
            image_version(&vmlinuz).as_deref(),
            vmlinuz
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .strip_prefix("vmlinuz-")
        );
    }

    #[test]
    fn config_symbols_are_read_beside_the_kernel() {
        let dir = crate::appliance::test_dir("kernel-config");
        fs::create_dir_all(dir.join("boot")).unwrap();
        fs::write(
            dir.join("boot/config-9.9.9-test"),
            "CONFIG_VIRTIO_MMIO=m\n# CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES is not set\n\
             CONFIG_VIRTIO_MMIO_CMDLINE=y\n",
        )
        .unwrap();
        let k = Kernel {
            image: dir.join("vmlinux"),
            version: Some("9.9.9-test".into()),
            modules: None,
        };
        assert_eq!(config_has(&k, "CONFIG_VIRTIO_MMIO"), Some(true));
        assert_eq!(
            config_has(&k, "CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES"),
            Some(false)
        );
        let unknown = Kernel {
            version: Some("0.0.0-none".into()),
            ..k
        };
        assert_eq!(config_has(&unknown, "CONFIG_VIRTIO_MMIO"), None);
    }

    #[test]
    fn setup_kernel_choice_is_remembered_and_cleared() {
        let dir = crate::appliance::test_dir("kernel-explicit");
        let cache = KernelCache::new(&dir);
        fs::create_dir_all(dir.join("kernel")).unwrap();
        let image = dir.join("vmlinux-9.9.9-test");
        fs::write(&image, b"\x7fELF").unwrap();
        assert_eq!(cache.explicit(), None);
        cache.set_explicit(Some(&image)).unwrap();
        assert_eq!(cache.explicit(), Some(image.clone()));
        let k = find_kernel(None, &dir).unwrap();
        assert_eq!(k.image, image);
        assert_eq!(k.version.as_deref(), Some("9.9.9-test"));
        // --kernel on the run still wins.
        let other = dir.join("other");
        fs::write(&other, b"k").unwrap();
        assert_eq!(find_kernel(Some(&other), &dir).unwrap().image, other);
        assert!(find_kernel(Some(Path::new("/nonexistent/k")), &dir).is_err());
        cache.set_explicit(None).unwrap();
        cache.set_explicit(None).unwrap();
        assert_eq!(cache.explicit(), None);
    }

    #[test]
    fn cache_dir_precedence() {
        // Only reads the environment; the variables are process-wide, so
        // check the rule without mutating them.
        let d = cache_dir().unwrap();
        if let Some(e) = std::env::var_os("EMBER_CACHE").filter(|v| !v.is_empty()) {
            assert_eq!(d, PathBuf::from(e));
        } else {
            assert!(d.ends_with("ember"), "{}", d.display());
        }
    }
}
