//! Writes the one-file initramfs the Linux end-to-end tests boot: an /init that
//! prints its argument (default `EMBER-INIT-OK`) and reboots.
//!
//! `cargo run --example tiny-initrd -- OUT.cpio [MESSAGE]`

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(out) = args.next() else {
        eprintln!("usage: tiny-initrd OUT.cpio [MESSAGE]");
        std::process::exit(2);
    };
    let msg = args.next().unwrap_or_else(|| "EMBER-INIT-OK".into());
    let written = ember::initramfs::with_init(&ember_testing::tiny_init_elf(&format!("{msg}\n")))
        .map_err(|e| e.to_string())
        .and_then(|bytes| std::fs::write(&out, bytes).map_err(|e| e.to_string()));
    if let Err(e) = written {
        eprintln!("tiny-initrd: cannot write {out}: {e}");
        std::process::exit(1);
    }
}
