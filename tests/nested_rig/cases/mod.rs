//! The tests, one a case (or one a device of the virtio case), grouped by
//! what they exercise. Each judges what its case printed in the shared rig.

mod appliance;
mod boot;
mod containers;
mod fs;
mod lab;
mod memory;
mod net;
mod snapshot;
mod virtio;
mod vsock;
