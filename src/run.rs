//! `ember run`: boot a kernel directly on KVM, or (with a trailing command)
//! run that command in a fresh appliance VM.

use clap::Args;
use std::path::PathBuf;

/// Arguments of `ember run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Kernel: ELF vmlinux (with or without a PVH note) or bzImage. In appliance
    /// mode, defaults to the kernel `ember setup` fetched.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initramfs.
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long)]
    pub cmdline: Option<String>,
    /// Guest memory, with an optional K/M/G suffix (bytes without one).
    #[arg(long, default_value = "256M")]
    pub mem: String,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    /// Where the guest's COM1 goes.
    #[arg(long, value_enum, default_value_t = ConsoleMode::Serial)]
    pub console: ConsoleMode,
    /// Write the VMM-side boot timeline (JSON) here.
    #[arg(long, value_name = "FILE.json")]
    pub events: Option<PathBuf>,
    /// A virtio-blk disk: PATH[,ro][,direct][,serial=ID]. Repeatable.
    #[arg(long, value_name = "PATH[,ro][,direct][,serial=ID]")]
    pub disk: Vec<String>,
    /// A virtio-pmem region backed by this file (a DAX root). Repeatable.
    #[arg(long)]
    pub pmem: Vec<PathBuf>,
    /// Connect a virtio-console port to this unix socket (the appliance's data channel).
    #[arg(long)]
    pub channel: Option<PathBuf>,
    /// Describe devices with an MP table and the command line only (no ACPI tables).
    #[arg(long)]
    pub no_acpi: bool,
    /// Appliance mode: which VMM boots the appliance (`ember` or `qemu`).
    #[arg(long, default_value = "ember")]
    pub backend: String,
    /// Appliance mode, qemu backend: machine type.
    #[arg(long, default_value = "q35")]
    pub machine: String,
    /// Give up after this many seconds (the VM is killed; exit status 124).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Appliance mode: set VAR=VALUE in the command's environment. Repeatable.
    #[arg(long, value_name = "VAR=VALUE")]
    pub env: Vec<String>,
    /// Appliance mode: the command's working directory in the guest.
    #[arg(long)]
    pub workdir: Option<String>,
    /// Appliance mode: run in a copy of this host directory instead of a minimal root.
    #[arg(long)]
    pub rootfs: Option<PathBuf>,
    /// Appliance mode: show the guest kernel's console.
    #[arg(long, short)]
    pub verbose: bool,
    /// Appliance mode: the command to run in the guest, and its arguments.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Where the guest's serial console goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConsoleMode {
    /// COM1 to stdout (and stdin when it is a terminal).
    Serial,
    /// No console device.
    None,
}

/// Runs `ember run`; returns the process exit status.
pub fn main(args: RunArgs) -> anyhow::Result<i32> {
    if !args.command.is_empty() {
        return crate::appliance::run_command(&args);
    }
    anyhow::bail!("not yet")
}
