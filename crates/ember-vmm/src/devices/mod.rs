//! Emulated devices. Devices are state machines: they hold no KVM objects and
//! reach the outside world only through what they are given (an [`Interrupt`],
//! a `Write` sink, a file), so each can be unit-tested on its own.

pub(crate) mod image_lock;
pub mod legacy;
pub mod virtio;
pub(crate) mod vmgenid;

use std::io;

/// Raising an interrupt line towards the guest. Backed by an irqfd in the VMM
/// and by a counter in tests.
pub trait Interrupt: Send + Sync {
    /// Asserts the (edge-triggered) interrupt once.
    fn trigger(&self) -> io::Result<()>;
}

/// An [`Interrupt`] backed by an eventfd registered with KVM as an irqfd.
#[derive(Debug)]
pub(crate) struct IrqFdLine(pub vmm_sys_util::eventfd::EventFd);

impl Interrupt for IrqFdLine {
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// An [`Interrupt`] that counts its triggers, for tests.
#[derive(Debug, Default)]
pub struct CountingInterrupt(pub std::sync::atomic::AtomicU64);

impl CountingInterrupt {
    /// How many times it fired.
    pub fn count(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Interrupt for CountingInterrupt {
    fn trigger(&self) -> io::Result<()> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}
