//! The memory functions the compiler calls (there is no libc). Written with
//! `rep movsb`/`rep stosb` so the compiler can't turn them back into calls to
//! themselves; this runs in ring 3, where those are native and fast.

use core::arch::asm;

/// # Safety
/// The C contract: `dest` and `src` valid for `n` bytes, not overlapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller's contract; DF is clear (the ABI guarantees it).
    unsafe {
        asm!("rep movsb", inout("rdi") dest => _, inout("rsi") src => _, inout("rcx") n => _,
             options(nostack, preserves_flags));
    }
    dest
}

/// # Safety
/// The C contract: `dest` and `src` valid for `n` bytes; they may overlap.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dest as usize).wrapping_sub(src as usize) >= n {
        // Copying forwards never reads a byte it already overwrote.
        // SAFETY: the caller's contract.
        return unsafe { memcpy(dest, src, n) };
    }
    // Overlap with dest above src: copy backwards (DF=1 only within this asm).
    // SAFETY: the caller's contract; we restore DF before returning.
    unsafe {
        asm!("std", "rep movsb", "cld",
             inout("rdi") dest.add(n).wrapping_sub(1) => _,
             inout("rsi") src.add(n).wrapping_sub(1) => _,
             inout("rcx") n => _,
             options(nostack));
    }
    dest
}

/// # Safety
/// The C contract: `dest` valid for `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memset(dest: *mut u8, c: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller's contract.
    unsafe {
        asm!("rep stosb", inout("rdi") dest => _, inout("rcx") n => _, in("al") c as u8,
             options(nostack, preserves_flags));
    }
    dest
}

/// # Safety
/// The C contract: `a` and `b` valid for `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: i < n, within the caller's buffers. Volatile reads keep the
        // compiler from recognising this loop as a memcmp call.
        let (x, y) = unsafe { (a.add(i).read_volatile(), b.add(i).read_volatile()) };
        if x != y {
            return i32::from(x) - i32::from(y);
        }
        i += 1;
    }
    0
}

/// `memcmp` under the name the compiler sometimes uses for equality tests.
///
/// # Safety
/// As for [`memcmp`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: forwarded contract.
    unsafe { memcmp(a, b, n) }
}
