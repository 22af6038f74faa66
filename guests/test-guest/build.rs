//! Links the test guest as a freestanding, statically placed ELF: no C
//! runtime, no PIE, our own linker script (which fixes the load address and
//! the boot entry points), and a PT_NOTE for the Xen PVH entry.

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let script = format!("{dir}/link.ld");
    println!("cargo:rerun-if-changed={script}");
    for arg in [
        "-nostartfiles",
        "-nostdlib",
        "-static",
        "-no-pie",
        &format!("-Wl,-T,{script}"),
        "-Wl,--build-id=none",
        "-Wl,-z,max-page-size=4096",
        "-Wl,--gc-sections",
        // Debug info would make the ELF ten times its loaded size; keep the symbols.
        "-Wl,--strip-debug",
    ] {
        println!("cargo:rustc-link-arg-bins={arg}");
    }
}
