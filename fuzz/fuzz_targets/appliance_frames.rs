//! The appliance protocol, host side: arbitrary bytes as everything the guest sent on the
//! channel (frames, truncated frames, unknown types, oversized lengths, repeated READY).
//! ember must end the run with an outcome or a protocol error, never crash or hang.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ember::appliance::host::fuzz_converse(data);
    // The decoder alone, fed in pieces of every size the first byte picks.
    let mut dec = ember::appliance::protocol::Decoder::new();
    let piece = usize::from(data.first().copied().unwrap_or(1)).max(1);
    for p in data.chunks(piece) {
        dec.feed(p);
        while let Ok(Some(_)) = dec.next_frame() {}
    }
    let _ = dec.finish();
});
