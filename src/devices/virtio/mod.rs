//! Virtio devices over the MMIO transport.
