//! The one place that knows the boot order: memory, kernel, devices, vCPUs.
