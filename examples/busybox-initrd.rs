//! Writes the initramfs of the Linux snapshot test and benchmark: static
//! busybox and an /init that prints `EMBER-SNAPSHOT-READY`, runs one command
//! line from the console, prints `EMBER-CMD-DONE` and reboots.
//!
//! `cargo run --example busybox-initrd -- OUT.cpio`

#[path = "../tests/common/busybox.rs"]
mod busybox;

fn main() {
    let Some(out) = std::env::args().nth(1) else {
        eprintln!("usage: busybox-initrd OUT.cpio");
        std::process::exit(2);
    };
    busybox::busybox_initramfs(std::path::Path::new(&out));
}
