//! Tests of the x86-64 writers together (each one's own format is unit-tested
//! beside it), and of the CPUID and MSR tables against this host's KVM.

mod boot_state;
mod cpuid_kvm;

use ember_testing::require_kvm;
