//! Ready-made userspaces for boot measurements, each a boot that goes
//! kernel → userspace → shutdown → VMM exit with nothing else in the way:
//!
//! - by default, ember's appliance without a command ([`appliance_initramfs`]):
//!   what `ember run` boots, as libguestfs's boot-benchmark boots its
//!   appliance;
//! - with `--busybox-init`, a newc initramfs with busybox-static and an
//!   `/init` script that prints the lab's markers and powers the guest off
//!   at once.
//!
//! The busybox script's markers (matched by the built-in activity definitions): `ember-lab: begin init-script` /
//! `ember-lab: end init-script` around the script's work, and
//! `ember-lab: poweroff` just before `poweroff -f`.

use crate::appliance::{self, ApplianceError};
use crate::backend::Backend;
use crate::initramfs::{InitramfsError, NewcWriter};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// Where busybox-static lives on Debian.
pub const DEFAULT_BUSYBOX: &str = "/bin/busybox";

/// The `/init` script.
pub const INIT_SCRIPT: &str = "#!/bin/sh
echo 'ember-lab: begin init-script'
/bin/busybox mount -t proc proc /proc
echo 'ember-lab: end init-script'
echo 'ember-lab: poweroff'
/bin/busybox poweroff -f
";

/// Errors building the initramfs.
#[derive(Debug, Error)]
pub enum GuestError {
    /// busybox could not be read.
    #[error("cannot read busybox at {path} (install busybox-static)")]
    Busybox {
        /// Where we looked.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// ember's cache directory cannot be found.
    #[error("the busybox initramfs: {0}")]
    Cache(String),
    /// Writing the archive failed.
    #[error("cannot write the initramfs {path}")]
    Write {
        /// The output.
        path: PathBuf,
        /// Why.
        #[source]
        source: InitramfsError,
    },
}

/// Writes the busybox initramfs to `out`, taking busybox from `busybox`
/// (a static binary: the archive has no libraries).
pub fn write_busybox_initramfs(out: &Path, busybox: &Path) -> Result<(), GuestError> {
    let binary = std::fs::read(busybox).map_err(|source| GuestError::Busybox {
        path: busybox.to_path_buf(),
        source,
    })?;
    let write = |source| GuestError::Write {
        path: out.to_path_buf(),
        source,
    };
    let file = std::fs::File::create(out).map_err(|e| write(InitramfsError::Io(e)))?;
    let mut w = NewcWriter::new(std::io::BufWriter::new(file));
    let build = |w: &mut NewcWriter<_>| -> Result<(), InitramfsError> {
        for dir in ["bin", "dev", "proc"] {
            w.dir(dir, 0o755)?;
        }
        w.file("bin/busybox", 0o755, &binary)?;
        w.symlink("bin/sh", "busybox")?;
        w.file("init", 0o755, INIT_SCRIPT.as_bytes())?;
        Ok(())
    };
    build(&mut w).map_err(write)?;
    let (mut buf, _) = w.finish().map_err(write)?;
    std::io::Write::flush(&mut buf).map_err(|e| write(InitramfsError::Io(e)))
}

/// The busybox initramfs, built once into ember's cache (written under a
/// private name and renamed, so concurrent lab runs never see half a file;
/// the cache, not the temp directory, so nothing is left in a shared place).
pub fn busybox_initramfs() -> Result<PathBuf, GuestError> {
    let dir = crate::appliance::kernel::cache_dir()
        .map_err(|e| GuestError::Cache(e.to_string()))?
        .join("lab");
    std::fs::create_dir_all(&dir).map_err(|e| GuestError::Write {
        path: dir.clone(),
        source: InitramfsError::Io(e),
    })?;
    let path = dir.join("busybox.cpio");
    if !path.is_file() {
        let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
        write_busybox_initramfs(&tmp, Path::new(DEFAULT_BUSYBOX))?;
        std::fs::rename(&tmp, &path).map_err(|e| GuestError::Write {
            path: path.clone(),
            source: InitramfsError::Io(e),
        })?;
    }
    Ok(path)
}

/// The appliance's initramfs for `kernel` (`None`: the default kernel, as
/// `ember run` finds it) booted on `backend`, built once into ember's cache
/// (see [`appliance::prepare_boot_only`]): ember-init and the kernel's
/// modules for `ember run`'s console channel on that backend. Its path,
/// and the file held (share-locked) for as long as the lab boots it.
pub fn appliance_initramfs(
    kernel: Option<&Path>,
    backend: &dyn Backend,
) -> Result<(PathBuf, Option<Arc<File>>), ApplianceError> {
    let p = appliance::prepare_boot_only(kernel, backend)?;
    Ok((p.initrd, p.held))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_holds_init_and_busybox() {
        let dir = ember_testing::TempDir::new("lab-guest-test");
        let fake = dir.join("busybox");
        std::fs::write(&fake, b"\x7fELF not really").unwrap();
        let out = dir.join("i.cpio");
        write_busybox_initramfs(&out, &fake).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(bytes.starts_with(b"070701"));
        for needle in [
            "bin/busybox",
            "init",
            "ember-lab: poweroff",
            "TRAILER!!!",
            "ELF not really",
        ] {
            assert!(text.contains(needle), "missing {needle}");
        }
        let e = write_busybox_initramfs(&out, &dir.join("nope")).unwrap_err();
        assert!(e.to_string().contains("install busybox-static"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
