//! End-to-end: the PVM test kernel (see tests/linux_pvm/linux_pvm.rs) boots under ember
//! from an ext4 root on virtio-pmem mounted with DAX, then mounts an ext4 data
//! disk on virtio-blk, reads a file the host put there and writes one back.
//!
//! Both file systems are made on the host with `mkfs.ext4 -d` (no root needed).
//! The root holds busybox-static and a shell /init. The test checks the guest's
//! console and then, with `debugfs`, that the guest's file really reached the
//! data disk's image.

use crate::common;

use common::{PVM_CMDLINE, Scratch, ember, output, pvm_kernel_dir, require_kvm, stderr, stdout};
use std::path::Path;
use std::process::Command;

/// The root's /init (busybox ash). Builtins (`read`, `echo`, `[`) where they do,
/// since every fork and exec is kernel work, which this host emulates slowly.
const INIT: &str = r#"#!/bin/sh
b=/bin/busybox
$b mount -t proc proc /proc
$b mount -t sysfs sys /sys
$b mount -t devtmpfs dev /dev
while read -r dev dir fs opts rest; do
  [ "$dir" = / ] && echo "ROOT-MOUNT: $dev $fs $opts"
done < /proc/mounts
read -r q < /sys/block/pmem0/queue/dax && echo "PMEM-QUEUE-DAX: $q"
if $b mount -t ext4 /dev/vda /mnt; then
  read -r line < /mnt/hello.txt && echo "DISK-READ: $line"
  echo "guest saw: $line" > /mnt/from-guest.txt
  $b sync
  $b umount /mnt && echo "DISK-UNMOUNTED"
else
  echo "DISK-MOUNT-FAILED"
fi
echo "EMBER-DISK-DONE"
$b reboot -f
"#;

/// Root and data file systems: 4 KiB blocks (DAX needs the page size), inode
/// tables and journal zeroed by mkfs so the guest kernel never does it lazily.
fn mkfs_ext4(image: &Path, size: u64, from: &Path) {
    std::fs::File::create(image).unwrap().set_len(size).unwrap();
    let o = output(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096"])
            .args(["-E", "lazy_itable_init=0,lazy_journal_init=0", "-d"])
            .arg(from)
            .arg(image),
    );
    assert!(o.status.success(), "mkfs.ext4: {}", stderr(&o));
}

/// A file of an ext4 image, read on the host with debugfs.
fn debugfs_cat(image: &Path, file: &str) -> String {
    let o = output(
        Command::new("debugfs")
            .arg("-R")
            .arg(format!("cat {file}"))
            .arg(image),
    );
    assert!(o.status.success(), "debugfs: {}", stderr(&o));
    stdout(&o)
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn linux_mounts_a_dax_pmem_root_and_an_ext4_disk() {
    let test = "linux_disk";
    if !require_kvm(test) {
        return;
    }
    let Some(dir) = pvm_kernel_dir(test) else {
        return;
    };
    for tool in ["mkfs.ext4", "debugfs"] {
        if !have(tool) {
            ember_testing::skip(test, &format!("{tool} not found (scripts/install-deps)"));
            return;
        }
    }
    let busybox = std::fs::read(ember::lab::guest::DEFAULT_BUSYBOX)
        .expect("busybox-static (scripts/install-deps installs it)");
    let scratch = Scratch::new(test);

    let root = scratch.path("root");
    for d in ["bin", "dev", "proc", "sys", "mnt"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let write_exec = |path: &Path, bytes: &[u8]| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, bytes).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    write_exec(&root.join("bin/busybox"), &busybox);
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    write_exec(&root.join("init"), INIT.as_bytes());
    let root_img = scratch.path("root.img");
    mkfs_ext4(&root_img, 16 << 20, &root);

    // A token of this run, so a stale image or console cannot pass the test.
    let token = format!(
        "hello from the host {}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let data = scratch.path("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("hello.txt"), format!("{token}\n")).unwrap();
    let data_img = scratch.path("data.img");
    mkfs_ext4(&data_img, 16 << 20, &data);

    let started = std::time::Instant::now();
    let o = output(
        ember()
            .arg("boot")
            .arg("--kernel")
            .arg(dir.join("vmlinux"))
            .arg("--pmem")
            .arg(&root_img)
            .arg("--disk")
            .arg(&data_img)
            // No `rootwait`: Linux waits for probing to finish before it mounts
            // the root anyway, and a kernel without the pmem driver should panic
            // (and so reboot, panic=-1) rather than wait until the timeout.
            .args(["--mem", "64M", "--timeout", "300", "--cmdline"])
            .arg(format!(
                "{PVM_CMDLINE} root=/dev/pmem0 rootfstype=ext4 rootflags=dax ro init=/init"
            )),
    );
    let out = stdout(&o);
    // The guest's console, for `--nocapture` (the harness keeps it otherwise).
    eprintln!("{test}: ember ran {:?}; console:\n{out}", started.elapsed());
    let after = |marker: &str| -> &str {
        let at = out
            .find(&format!("\n{marker}"))
            .unwrap_or_else(|| panic!("`{marker}` missing; stderr: {}\n{out}", stderr(&o)));
        out[at + 1 + marker.len()..].lines().next().unwrap().trim()
    };
    // The root is ext4 on the pmem device, and mounted with DAX: ext4 refuses
    // `dax=always` outright unless the block device can do DAX.
    let root_mount = after("ROOT-MOUNT:");
    assert!(
        root_mount.starts_with("/dev/root ext4 ro,") && root_mount.contains("dax=always"),
        "root: {root_mount}\n{out}"
    );
    assert_eq!(after("PMEM-QUEUE-DAX:"), "1", "{out}");
    assert!(out.contains("pmem0"), "{out}");
    // The data disk: the host's file read back, and a clean unmount.
    assert_eq!(after("DISK-READ:"), token, "{out}");
    assert!(out.contains("\nDISK-UNMOUNTED"), "{out}");
    after("EMBER-DISK-DONE");
    assert_eq!(
        o.status.code(),
        Some(ember::exit::EXIT_GUEST_RESET),
        "{test}: {}",
        stderr(&o)
    );
    // What the guest wrote is in the image.
    assert_eq!(
        debugfs_cat(&data_img, "/from-guest.txt"),
        format!("guest saw: {token}\n")
    );
}
