//! Backends: the VMMs a guest can be booted with. The boot lab and the
//! appliance describe *what* to boot as a [`GuestSpec`]; a [`Backend`] turns
//! that into a command line for its VMM. Adding Firecracker or Cloud
//! Hypervisor means adding one more implementation of [`Backend`].

pub mod qemu;

use std::path::{Path, PathBuf};
use std::process::Command;
use thiserror::Error;

/// Backend errors.
#[derive(Debug, Error)]
pub enum BackendError {
    /// The VMM binary is not installed or not executable.
    #[error("{name}: `{binary}` not found or not executable (install it, or pass its path)")]
    MissingBinary {
        /// Backend name.
        name: String,
        /// The binary we looked for.
        binary: String,
    },
    /// Running the VMM to ask its version failed.
    #[error("{0}: could not query its version")]
    Version(String, #[source] std::io::Error),
    /// The spec asks for something this backend cannot do.
    #[error("{backend} cannot {what}")]
    Unsupported {
        /// Backend name.
        backend: String,
        /// What it cannot do.
        what: String,
    },
    /// An unknown backend name.
    #[error("unknown backend `{0}` (known: auto, ember, qemu)")]
    Unknown(String),
}

/// A disk attached to the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSpec {
    /// Raw image path.
    pub path: PathBuf,
    /// Read-only.
    pub read_only: bool,
}

/// Everything needed to boot one guest, independent of the VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestSpec {
    /// Kernel (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// vCPUs.
    pub cpus: u32,
    /// Disks.
    pub disks: Vec<DiskSpec>,
    /// A unix socket (already listening) the guest's data channel connects to:
    /// a virtio-console port where the backend has one, else a second serial
    /// line. The guest sees it as `/dev/hvc0` or `/dev/ttyS1`.
    pub channel: Option<PathBuf>,
    /// Where ember writes its event timeline (ignored by other backends).
    pub events: Option<PathBuf>,
    /// Guest console on the backend's stdout (`false`: no console device).
    pub console: bool,
}

impl GuestSpec {
    /// A spec with defaults for everything but the kernel.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        GuestSpec {
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::new(),
            mem_mib: 256,
            cpus: 1,
            disks: Vec::new(),
            channel: None,
            events: None,
            console: true,
        }
    }
}

/// How the backend's guest data channel appears inside the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelKind {
    /// `/dev/hvc0` (virtio-console; needs the virtio_console driver).
    VirtioConsole,
    /// `/dev/ttyS1` (second 16550).
    Serial,
}

/// A VMM that can boot a [`GuestSpec`].
pub trait Backend: Send + Sync {
    /// Short name (`ember`, `qemu`).
    fn name(&self) -> &str;
    /// The binary's version string.
    fn version(&self) -> Result<String, BackendError>;
    /// Human description of how it runs guests (`KVM`, `TCG`, machine type).
    fn describe(&self) -> String;
    /// How the data channel shows up in the guest.
    fn channel_kind(&self) -> ChannelKind;
    /// The command that boots `spec`; the guest console is on its stdout.
    fn command(&self, spec: &GuestSpec) -> Result<Command, BackendError>;
}

/// ember itself, run as a child process (`ember run --kernel …`).
#[derive(Debug, Clone)]
pub struct EmberBackend {
    /// Path of the ember binary (normally the running executable).
    pub binary: PathBuf,
}

impl EmberBackend {
    /// The running executable.
    pub fn current() -> Result<Self, BackendError> {
        let binary = std::env::current_exe().map_err(|_| BackendError::MissingBinary {
            name: "ember".into(),
            binary: "ember".into(),
        })?;
        Ok(EmberBackend { binary })
    }
}

impl Backend for EmberBackend {
    fn name(&self) -> &str {
        "ember"
    }

    fn version(&self) -> Result<String, BackendError> {
        binary_version("ember", &self.binary)
    }

    fn describe(&self) -> String {
        "ember on KVM".into()
    }

    fn channel_kind(&self) -> ChannelKind {
        ChannelKind::VirtioConsole
    }

    fn command(&self, spec: &GuestSpec) -> Result<Command, BackendError> {
        let mut c = Command::new(&self.binary);
        c.arg("run").arg("--kernel").arg(&spec.kernel);
        if let Some(initrd) = &spec.initrd {
            c.arg("--initrd").arg(initrd);
        }
        c.arg("--cmdline").arg(&spec.cmdline);
        c.arg("--mem").arg(format!("{}M", spec.mem_mib));
        c.arg("--cpus").arg(spec.cpus.to_string());
        c.arg("--console")
            .arg(if spec.console { "serial" } else { "none" });
        for d in &spec.disks {
            let mut arg = d.path.as_os_str().to_owned();
            if d.read_only {
                arg.push(",ro");
            }
            c.arg("--disk").arg(arg);
        }
        if let Some(ch) = &spec.channel {
            c.arg("--channel").arg(ch);
        }
        if let Some(ev) = &spec.events {
            c.arg("--events").arg(ev);
        }
        Ok(c)
    }
}

/// Looks up a backend by name.
pub fn by_name(name: &str, qemu_machine: &str) -> Result<Box<dyn Backend>, BackendError> {
    match name {
        // ember itself where KVM runs guest kernels natively, QEMU/TCG elsewhere
        // (a software KVM emulates guest kernel mode, far slower than TCG).
        "auto" if qemu::hardware_kvm_usable() => by_name("ember", qemu_machine),
        "auto" => by_name("qemu", qemu_machine),
        "ember" => Ok(Box::new(EmberBackend::current()?)),
        "qemu" => Ok(Box::new(qemu::QemuBackend::detect(
            qemu_machine,
            qemu::Accel::Auto,
        )?)),
        other => Err(BackendError::Unknown(other.to_owned())),
    }
}

/// First line of `binary --version`.
pub fn binary_version(name: &str, binary: &Path) -> Result<String, BackendError> {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| BackendError::Version(name.to_owned(), e))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_owned())
}

/// Finds `binary` on PATH (or accepts it as a path).
pub fn find_binary(binary: &str) -> Option<PathBuf> {
    let p = Path::new(binary);
    if p.components().count() > 1 {
        return is_executable(p).then(|| p.to_path_buf());
    }
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(binary))
        .find(|c| is_executable(c))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ember_command_carries_the_spec() {
        let b = EmberBackend {
            binary: "/bin/ember".into(),
        };
        let mut spec = GuestSpec::new("/k");
        spec.initrd = Some("/i".into());
        spec.cmdline = "console=ttyS0".into();
        spec.disks.push(DiskSpec {
            path: "/d.img".into(),
            read_only: true,
        });
        let c = b.command(&spec).unwrap();
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "run",
                "--kernel",
                "/k",
                "--initrd",
                "/i",
                "--cmdline",
                "console=ttyS0",
                "--mem",
                "256M",
                "--cpus",
                "1",
                "--console",
                "serial",
                "--disk",
                "/d.img,ro"
            ]
        );
    }

    #[test]
    fn unknown_backend_and_missing_binary_are_errors() {
        assert!(matches!(
            by_name("bochs", "microvm"),
            Err(BackendError::Unknown(_))
        ));
        assert_eq!(find_binary("/nonexistent/qemu"), None);
        assert!(find_binary("sh").is_some());
    }
}
