//! The entry paths (bzImage, vmlinux via PVH, vmlinux via the 64-bit boot
//! protocol) with 1 and 2 vCPUs, and COM1 both ways.

use crate::rig::rig;

/// `type_of_loader` Linux sets after a PVH entry outside Xen (0xb: QEMU's
/// loader id; `init_pvh_bootparams`).
const LOADER_PVH: u32 = 0xb0;
/// `type_of_loader` ember writes into the zero page ("undefined").
const LOADER_UNDEFINED: u32 = 0xff;

/// One entry path with `cpus` vCPUs: reached /init, `cpus` CPUs online, and
/// the guest's own zero page says which entry it came through.
fn check_boot(case: &str, cpus: u32, pvh: bool, bzimage: bool) {
    let c = rig().case(case);
    assert_eq!(c.rc, Some(0), "{case}: ember's exit status\n{}", c.dump());
    assert!(
        c.fact("init").is_some(),
        "{case}: no /init marker\n{}",
        c.dump()
    );
    let online = if cpus == 1 { "0" } else { "0-1" };
    assert_eq!(
        c.fact("cpus"),
        Some(online),
        "{case}: CPUs online\n{}",
        c.dump()
    );
    let loader: u32 = c.fact("loader").and_then(|v| v.parse().ok()).unwrap_or(0);
    let want = if pvh { LOADER_PVH } else { LOADER_UNDEFINED };
    assert_eq!(
        loader,
        want,
        "{case}: type_of_loader (0xb0 = PVH entry)\n{}",
        c.dump()
    );
    let sects: u32 = c
        .fact("setup_sects")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert_eq!(
        sects != 0,
        bzimage,
        "{case}: setup_sects {sects} (non-zero = bzImage header)"
    );
}

#[test]
fn boots_bzimage_1_vcpu() {
    check_boot("boot-bzimage-1", 1, false, true);
}
#[test]
fn boots_bzimage_2_vcpus() {
    check_boot("boot-bzimage-2", 2, false, true);
}
#[test]
fn boots_vmlinux_pvh_1_vcpu() {
    check_boot("boot-pvh-1", 1, true, false);
}
#[test]
fn boots_vmlinux_pvh_2_vcpus() {
    check_boot("boot-pvh-2", 2, true, false);
}
#[test]
fn boots_vmlinux_64bit_entry_1_vcpu() {
    check_boot("boot-elf64-1", 1, false, false);
}
#[test]
fn boots_vmlinux_64bit_entry_2_vcpus() {
    check_boot("boot-elf64-2", 2, false, false);
}

/// COM1 both ways, with no appliance in between: what the L1 writes to
/// `ember boot`'s stdin (a token line and 1.6 KiB more, 25 times the UART's
/// FIFO) reaches the guest's console intact, and the guest's answer comes back
/// on ember's stdout.
#[test]
fn uart_console_carries_input_in_and_output_out() {
    let r = rig();
    let c = r.case("uart");
    assert_eq!(c.rc, Some(0), "ember's exit status\n{}", c.dump());
    assert_eq!(
        c.fact("uart-got"),
        Some(format!("uart-in-{}", r.token).as_str()),
        "the token line the host typed, as the guest read it\n{}",
        c.dump()
    );
    let sent = c.fact("uart-sent-md5").unwrap_or_default();
    assert_eq!(sent.len(), 32, "the md5 of what was sent\n{}", c.dump());
    assert_eq!(
        c.fact("uart-md5"),
        Some(sent),
        "the 20 lines the guest read, against what was sent\n{}",
        c.dump()
    );
    assert!(c.fact("done").is_some(), "the guest finished\n{}", c.dump());
}
