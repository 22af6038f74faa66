//! Links ember-init as a tiny static executable: no C runtime, no libc, no
//! dynamic loader, not position-independent (so nothing needs relocating
//! before `_start` runs).

fn main() {
    for arg in [
        "-nostartfiles",
        "-nostdlib",
        "-static",
        "-no-pie",
        "-Wl,--gc-sections",
        "-Wl,--build-id=none",
        "-Wl,-z,norelro",
        "-Wl,--strip-all",
    ] {
        println!("cargo:rustc-link-arg-bins={arg}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
