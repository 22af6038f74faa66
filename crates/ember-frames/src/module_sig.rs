//! Where a kernel module's appended signature starts.
//!
//! Debian signs its modules, and `finit_module` checks the signature of
//! every module ember-init loads: SHA-256 over the module and an RSA
//! verification in the guest kernel. Under QEMU/TCG that was 66 M guest
//! instructions for the appliance's seven `core` modules — 70 % of
//! everything the appliance's boot to `true` does beyond a bare busybox
//! initramfs (BENCHMARKS.md §8, measured with `-icount`). ember-init
//! therefore hands the kernel the module without its signature
//! (`init_module` on the mapped file, cut here); a kernel that enforces
//! signatures refuses that, and ember-init then loads the whole file.
//!
//! Used by the guest init (`guests/init`), which is `no_std`: no allocation,
//! no std. ember's tests hold it against Debian's own modules
//! (`src/appliance/modules.rs`).

/// The marker `scripts/sign-file` appends after the signature.
pub const MARKER: &[u8] = b"~Module signature appended~\n";
/// `struct module_signature`: algo, hash, id_type, signer_len, key_id_len,
/// 3 bytes of padding, then the signature's length (big-endian u32).
pub const SIG_INFO_LEN: usize = 12;

/// The length of `module` without its appended signature, or `None` when it
/// carries none (or a trailer that does not add up).
#[inline]
pub fn unsigned_len(module: &[u8]) -> Option<usize> {
    let body = module.len().checked_sub(MARKER.len())?;
    if &module[body..] != MARKER {
        return None;
    }
    let info = body.checked_sub(SIG_INFO_LEN)?;
    let l = &module[body - 4..body];
    let sig_len = u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize;
    let end = info.checked_sub(sig_len)?;
    // An ELF header at least must remain.
    if end < 64 { None } else { Some(end) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec;
    use std::vec::Vec;

    fn signed(body: &[u8], sig: &[u8]) -> Vec<u8> {
        let mut m = body.to_vec();
        m.extend_from_slice(sig);
        m.extend_from_slice(&[0, 0, 2, 0, 0, 0, 0, 0]);
        m.extend_from_slice(&(sig.len() as u32).to_be_bytes());
        m.extend_from_slice(MARKER);
        m
    }

    #[test]
    fn cuts_the_signature_and_its_trailer() {
        let body = vec![0x7f; 200];
        let m = signed(&body, &[0xaa; 300]);
        assert_eq!(unsigned_len(&m), Some(200));
    }

    #[test]
    fn unsigned_or_damaged_modules_are_left_whole() {
        let body = vec![0x7f; 200];
        assert_eq!(unsigned_len(&body), None);
        assert_eq!(unsigned_len(b""), None);
        assert_eq!(unsigned_len(MARKER), None);
        // A signature longer than the file.
        let mut m = signed(&body, &[0xaa; 300]);
        let n = m.len() - MARKER.len() - 4;
        m[n..n + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(unsigned_len(&m), None);
        // One that would leave less than an ELF header.
        assert_eq!(unsigned_len(&signed(&[1; 10], &[2; 5])), None);
    }
}
