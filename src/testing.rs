//! Helpers for tests and benchmarks: building and locating the test guest.
