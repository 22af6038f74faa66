//! "Virtual state": thin owners of the KVM file descriptors and guest memory.
