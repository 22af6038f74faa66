//! Tests of the x86-64 writers together (each one's own format is unit-tested
//! beside it), and of the CPUID and MSR tables against this host's KVM.

mod boot_state;
mod cpuid_kvm;

/// Whether /dev/kvm can be used; without it a test fails, unless
/// `EMBER_ALLOW_NO_KVM` is set, when it is skipped loudly.
fn require_kvm(test: &str) -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        if std::env::var_os("EMBER_ALLOW_NO_KVM").is_some() {
            ember_testing::skip(test, "/dev/kvm is not usable on this host");
            return false;
        }
        panic!(
            "{test}: /dev/kvm is not usable (set EMBER_ALLOW_NO_KVM=1 to skip KVM tests loudly)"
        );
    }
    true
}
