//! `memtouch`: a libc-free guest program that writes and verifies memory
//! (the PVM tests' virtio-mem checks and the nested rig's balloon case).

/// A static x86-64 program without libc (so without the TLS that a fresh
/// busybox now and then reads wrongly on this host's PVM): maps `mib` MiB
/// of anonymous memory, populated (one system call: the kernel hands out
/// every page at once, far cheaper here than a fault per page), writes every
/// 8-byte word a value derived from its index, sleeps a second (a late
/// discard of a page would land in it), reads every word back, and prints
/// `TOUCH-OK`, `TOUCH-BAD` (a word differs) or `TOUCH-NOMEM`.
pub fn memtouch(mib: u32) -> Vec<u8> {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let words = mib << 17;
    let mut c: Vec<u8> = Vec::new();
    // rel32 fields to patch: (where the field is, what it targets).
    let mut jumps: Vec<(usize, &str)> = Vec::new();
    let mut leas: Vec<(usize, &str)> = Vec::new();
    // mmap(NULL, len, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE, -1, 0)
    c.extend([0xb8, 9, 0, 0, 0]); // mov eax, 9
    c.extend([0x31, 0xff]); // xor edi, edi
    c.push(0xbe); // mov esi, len
    c.extend((mib << 20).to_le_bytes());
    c.extend([0xba, 3, 0, 0, 0]); // mov edx, 3
    c.extend([0x41, 0xba]); // mov r10d, flags
    c.extend(0x8022u32.to_le_bytes());
    c.extend([0x49, 0xc7, 0xc0, 0xff, 0xff, 0xff, 0xff]); // mov r8, -1
    c.extend([0x45, 0x31, 0xc9]); // xor r9d, r9d
    c.extend([0x0f, 0x05]); // syscall
    c.extend([0x48, 0x3d, 0x00, 0xf0, 0xff, 0xff]); // cmp rax, -4096
    c.extend([0x0f, 0x87]); // ja nomem
    jumps.push((c.len(), "nomem"));
    c.extend([0; 4]);
    c.extend([0x48, 0x89, 0xc3]); // mov rbx, rax
    // r11 = K (reloaded after the sleep: syscall clobbers rcx and r11).
    let set_k = |c: &mut Vec<u8>| {
        c.extend([0x49, 0xbb]); // mov r11, K
        c.extend(K.to_le_bytes());
        c.extend([0x31, 0xc9]); // xor ecx, ecx
    };
    set_k(&mut c);
    let write_loop = c.len();
    c.extend([0x48, 0x89, 0xc8]); // mov rax, rcx
    c.extend([0x49, 0x0f, 0xaf, 0xc3]); // imul rax, r11
    c.extend([0x48, 0x89, 0x04, 0xcb]); // mov [rbx+rcx*8], rax
    c.extend([0x48, 0xff, 0xc1]); // inc rcx
    c.extend([0x48, 0x81, 0xf9]); // cmp rcx, words
    c.extend(words.to_le_bytes());
    c.push(0x72); // jb write_loop
    c.push((write_loop as isize - (c.len() as isize + 1)) as i8 as u8);
    c.extend([0xb8, 35, 0, 0, 0]); // mov eax, 35 (nanosleep)
    c.extend([0x48, 0x8d, 0x3d]); // lea rdi, [rip + timespec]
    leas.push((c.len(), "timespec"));
    c.extend([0; 4]);
    c.extend([0x31, 0xf6]); // xor esi, esi
    c.extend([0x0f, 0x05]); // syscall
    set_k(&mut c);
    let read_loop = c.len();
    c.extend([0x48, 0x89, 0xc8]); // mov rax, rcx
    c.extend([0x49, 0x0f, 0xaf, 0xc3]); // imul rax, r11
    c.extend([0x48, 0x39, 0x04, 0xcb]); // cmp [rbx+rcx*8], rax
    c.extend([0x0f, 0x85]); // jne bad
    jumps.push((c.len(), "bad"));
    c.extend([0; 4]);
    c.extend([0x48, 0xff, 0xc1]); // inc rcx
    c.extend([0x48, 0x81, 0xf9]); // cmp rcx, words
    c.extend(words.to_le_bytes());
    c.push(0x72); // jb read_loop
    c.push((read_loop as isize - (c.len() as isize + 1)) as i8 as u8);
    // Each ending: write(1, message, len); exit_group(status).
    let mut labels: Vec<(&str, usize)> = Vec::new();
    let messages = [
        ("ok", "TOUCH-OK\n", 0u8),
        ("bad", "TOUCH-BAD\n", 1),
        ("nomem", "TOUCH-NOMEM\n", 2),
    ];
    for (label, msg, status) in messages {
        labels.push((label, c.len()));
        c.extend([0xb8, 1, 0, 0, 0]); // mov eax, 1 (write)
        c.extend([0xbf, 1, 0, 0, 0]); // mov edi, 1
        c.extend([0x48, 0x8d, 0x35]); // lea rsi, [rip + message]
        leas.push((c.len(), msg));
        c.extend([0; 4]);
        c.push(0xba); // mov edx, len
        c.extend((msg.len() as u32).to_le_bytes());
        c.extend([0x0f, 0x05]); // syscall
        c.extend([0xb8, 231, 0, 0, 0]); // mov eax, 231 (exit_group)
        c.extend([0xbf, status, 0, 0, 0]); // mov edi, status
        c.extend([0x0f, 0x05]); // syscall
    }
    while c.len() % 8 != 0 {
        c.push(0x90);
    }
    labels.push(("timespec", c.len()));
    c.extend(1u64.to_le_bytes()); // tv_sec
    c.extend(0u64.to_le_bytes()); // tv_nsec
    for (_, msg, _) in messages {
        labels.push((msg, c.len()));
        c.extend(msg.as_bytes());
    }
    let at = |name: &str| labels.iter().find(|(l, _)| *l == name).unwrap().1;
    for (field, target) in jumps.into_iter().chain(leas) {
        let disp = (at(target) as i64 - (field as i64 + 4)) as i32;
        c[field..field + 4].copy_from_slice(&disp.to_le_bytes());
    }
    ember_testing::static_elf(0x40_0000, &c)
}
