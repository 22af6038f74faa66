//! ember-init: PID 1 of the ember appliance.
//!
//! It does only what running one command needs, because every instruction of
//! a boot counts: mount devtmpfs, proc and sysfs (no udev, no hwclock, no
//! ldconfig), make busybox's applet links from `/.ember/applets` (cheaper
//! than the kernel unpacking them), load the kernel modules listed in `/.ember/modules` with
//! `init_module`, without their signatures where the kernel allows (only the groups named by `EMBER_MODULES=`), put the data channel (a tty named by `EMBER_CHANNEL=` on
//! the kernel command line) in raw mode, receive the command over it, run it
//! with pipes on stdin/stdout/stderr, forward its output and exit status as
//! frames, and power off.
//!
//! No libc: raw syscalls, a naked `_start`, and fixed buffers on the stack
//! (no allocator). The frame format is in `src/appliance/protocol.rs`; the type
//! bytes, the applet list's format and the module signature trailer come from
//! the `ember-frames` crate, shared with ember.

#![no_std]
#![no_main]

mod hostroot;
mod net;
mod sys;
mod vector;

use ember_frames as ft;
use ember_frames::{applets, module_sig};
use sys::Fd;

/// The file the appliance builder writes: module paths, one a line, in load order.
const MODULE_LIST: &[u8] = b"/.ember/modules\0";
/// Where the channel device path comes from (kernel command line → init's environment).
const CHANNEL_VAR: &[u8] = b"EMBER_CHANNEL=";
/// Which module groups to load (comma-separated; all when absent).
const MODULES_VAR: &[u8] = b"EMBER_MODULES=";
/// The virtio-fs tag of the host's root, to mount before READY (the
/// appliance's snapshot then holds it mounted); `HOSTROOT` names it again.
const HOSTROOT_VAR: &[u8] = b"EMBER_HOSTROOT=";
/// Tags of shares to mount before READY, comma-separated (see
/// [`hostroot::premount_shares`]).
const SHARES_VAR: &[u8] = b"EMBER_SHARES=";
/// How long to wait for the channel device node to appear (2 ms steps, 20 s):
/// virtio-serial adds ports asynchronously, after its control queue talks to
/// the device, which takes long on a busy TCG host.
const CHANNEL_OPEN_TRIES: u32 = 10_000;
const CHANNEL_OPEN_STEP_MS: u64 = 2;
/// Room for the kernel command line (x86's COMMAND_LINE_SIZE is 2048).
const CMDLINE_LEN: usize = 4096;
/// Room for argv/env/cwd/exec strings together.
const ARENA_LEN: usize = 128 * 1024;
/// Most argv or env entries accepted.
const MAX_PTRS: usize = 1024;
/// Most `SHARE`s accepted.
const MAX_SHARES: usize = 16;
/// Exit status reported when the command cannot be started.
const EXIT_NOT_FOUND: i32 = 127;
const EXIT_CANNOT_EXEC: i32 = 126;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    sys::write_all(2, b"ember-init: panic\n");
    sys::power_off()
}

/// The prebuilt `core` references the unwinding personality routine even
/// though this binary aborts on panic and never unwinds.
#[unsafe(no_mangle)]
pub extern "C" fn rust_eh_personality() {}

/// Entry point: the kernel starts us with the stack holding argc, argv, envp.
///
/// # Safety
/// Only the kernel calls this, once, with the initial process stack.
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn _start() -> ! {
    core::arch::naked_asm!(
        "mov rdi, rsp",
        "and rsp, -16",
        "call {main}",
        "ud2",
        main = sym start,
    );
}

extern "C" fn start(sp: *const usize) -> ! {
    // SAFETY: the kernel's initial stack is argc, argv[argc], NULL, envp…, NULL.
    let envp = unsafe {
        let argc = *sp;
        sp.add(1 + argc + 1) as *const *const u8
    };
    if let Err(msg) = run(envp) {
        sys::write_all(2, b"ember-init: ");
        sys::write_all(2, msg);
        sys::write_all(2, b"\n");
    }
    sys::sync();
    sys::power_off()
}

/// Everything init does; an `Err` is a message for the console.
fn run(envp: *const *const u8) -> Result<(), &'static [u8]> {
    // devtmpfs provides /dev/ttyS*, /dev/hvc0, /dev/null…; nothing to do if it fails
    // for proc/sys (the command just sees empty directories).
    sys::mount(b"devtmpfs\0", b"/dev\0", b"devtmpfs\0").map_err(|_| &b"mount /dev failed"[..])?;
    let _ = sys::mount(b"proc\0", b"/proc\0", b"proc\0");
    let _ = sys::mount(b"sysfs\0", b"/sys\0", b"sysfs\0");
    make_applet_links();
    let module_error = load_modules(env_value(envp, MODULES_VAR));

    let path =
        env_value(envp, CHANNEL_VAR).ok_or(&b"no EMBER_CHANNEL= on the kernel command line"[..])?;
    let vsock = vsock_port(path);
    let chan = match vsock {
        Some(port) => connect_vsock(port)?,
        None => open_channel(path)?,
    };
    let mut ch = Channel::new(chan, vsock);
    if let Some(name) = module_error {
        ch.error_with(b"cannot load module ", name);
        return Ok(());
    }
    let host_root = env_value(envp, HOSTROOT_VAR);
    let premounted = env_value(envp, SHARES_VAR);
    let staged = match host_root {
        Some(tag) => hostroot::mount(tag, ROOT_DIR)
            .and_then(|()| premounted.map_or(Ok(()), hostroot::premount_shares)),
        None => Ok(()),
    };
    if let Err(msg) = staged {
        ch.error_with(msg, b"");
        return Ok(());
    }
    ch.send(ft::READY, &[]);

    let mut arena = Arena::new();
    let cmd = match receive_command(&mut ch, &mut arena) {
        Ok(cmd) => cmd,
        Err(msg) => {
            ch.error_with(msg, b"");
            return Ok(());
        }
    };
    if !cmd.root.is_null() {
        // SAFETY: root is a NUL-terminated string in the arena.
        let dev = unsafe { sys::cstr(cmd.root) };
        // SAFETY: as above; the slice includes the NUL.
        let dev = unsafe { core::slice::from_raw_parts(dev.as_ptr(), dev.len() + 1) };
        if let Err(msg) = mount_root(dev) {
            ch.error_with(msg, b"");
            return Ok(());
        }
    }
    if !cmd.host_root.is_null() {
        let premounted = host_root.map(|_| premounted);
        if let Err(msg) = mount_host_root(&cmd, premounted) {
            ch.error_with(msg, b"");
            return Ok(());
        }
    }
    // After the root is mounted: resolv.conf goes into the command's.
    let root = cmd.chrooted().then_some(ROOT_DIR);
    if let Err(msg) = net::configure(root) {
        ch.error_with(msg, b"");
        return Ok(());
    }
    let ran = match ch.vsock {
        Some(port) => run_command_on_vsock(&cmd, port),
        None => run_command(&mut ch, &cmd),
    };
    match ran {
        Ok(code) => {
            // The host may stop the VM as soon as EXIT arrives: flush disks first.
            sys::sync();
            ch.send(ft::EXIT, &code.to_le_bytes());
            ch.wait_done();
        }
        Err(msg) => ch.error_with(msg, b""),
    }
    Ok(())
}

/// Loads the modules of [`MODULE_LIST`] (`GROUP PATH` lines) whose group is
/// in `groups` (a comma list, NUL-terminated; `None` loads all), in order;
/// returns the first failing path.
fn load_modules(groups: Option<&[u8]>) -> Option<&'static [u8]> {
    static mut LIST: [u8; 16 * 1024] = [0; 16 * 1024];
    // SAFETY: init is single-threaded and this is the only use of LIST.
    let list: &'static mut [u8; 16 * 1024] = unsafe { &mut *core::ptr::addr_of_mut!(LIST) };
    let Ok(fd) = sys::open(MODULE_LIST, sys::O_RDONLY) else {
        return None; // no modules in this appliance
    };
    let len = sys::read_full(fd, &mut list[..]);
    sys::close(fd);
    let groups = groups.map(|g| &g[..g.len() - 1]);
    // The kernel hands module parameters on its command line only to
    // built-in code (modprobe reads them for the rest): a module ember
    // loads gets its own `NAME.param=` words here, so `virtio_mmio.device=`
    // (how devices are announced without ACPI) reaches the module.
    let mut cmdline = [0u8; CMDLINE_LEN];
    let cmdline_len = match sys::open(b"/proc/cmdline\0", sys::O_RDONLY) {
        Ok(fd) => {
            let n = sys::read_full(fd, &mut cmdline);
            sys::close(fd);
            n
        }
        Err(_) => 0,
    };
    let mut params = [0u8; CMDLINE_LEN + 1];
    let mut path = [0u8; 512];
    for line in list[..len].split(|&b| b == b'\n') {
        let Some(space) = line.iter().position(|&b| b == b' ') else {
            continue;
        };
        let (group, file) = (&line[..space], &line[space + 1..]);
        let wanted = groups.is_none_or(|g| g.split(|&b| b == b',').any(|w| w == group));
        if !wanted || file.is_empty() || file.len() >= path.len() {
            continue;
        }
        path[..file.len()].copy_from_slice(file);
        path[file.len()] = 0;
        let ok = match sys::open(&path[..=file.len()], sys::O_RDONLY) {
            Ok(m) => {
                let n = module_params(file, &cmdline[..cmdline_len], &mut params);
                let r = load_module(m, &params[..=n]);
                sys::close(m);
                r.is_ok() || r == Err(sys::EEXIST)
            }
            Err(_) => false,
        };
        if !ok {
            return Some(file);
        }
    }
    None
}

/// Makes the symlinks [`applets::LIST`] names (none when the appliance has
/// no busybox). A link that cannot be made is left out: an entry already
/// there (the command's own file) wins, as it did when the links were in the
/// initramfs; a missing one shows as "not found" when something runs it.
fn make_applet_links() {
    static mut LIST: [u8; 32 * 1024] = [0; 32 * 1024];
    // SAFETY: init is single-threaded and this is the only use of LIST.
    let list: &'static mut [u8; 32 * 1024] = unsafe { &mut *core::ptr::addr_of_mut!(LIST) };
    let Ok(fd) = sys::open(applets::LIST, sys::O_RDONLY) else {
        return;
    };
    let len = sys::read_full(fd, &mut list[..]);
    sys::close(fd);
    let Some((dir, target, names)) = applets::parse(&list[..len]) else {
        return;
    };
    let mut target_z = [0u8; 512];
    if target.len() >= target_z.len() {
        return;
    }
    target_z[..target.len()].copy_from_slice(target);
    let target_z = &target_z[..=target.len()];
    let mut path = [0u8; 512];
    for name in names {
        if let Some(link) = applets::link_path(dir, name, &mut path) {
            let _ = sys::symlink(target_z, link);
        }
    }
}

/// Writes the `param=value` words of `cmdline` meant for the module in
/// `file` (`…/virtio_mmio.ko`: the words `virtio_mmio.param=value`; `-` and
/// `_` alike in the name, as the kernel has it), space-separated, into `out`
/// followed by a NUL; returns the length without the NUL. Words that do not
/// fit are left out.
fn module_params(file: &[u8], cmdline: &[u8], out: &mut [u8]) -> usize {
    let base = file.rsplit(|&b| b == b'/').next().unwrap_or(file);
    let name = base.split(|&b| b == b'.').next().unwrap_or(base);
    let same = |a: u8, b: u8| a == b || (a == b'-' || a == b'_') && (b == b'-' || b == b'_');
    let mut len = 0;
    for word in cmdline.split(|&b| b == b' ' || b == b'\n' || b == 0) {
        let ours = word.len() > name.len() + 1
            && word[name.len()] == b'.'
            && word.iter().zip(name).all(|(&a, &b)| same(a, b));
        if !ours {
            continue;
        }
        let param = &word[name.len() + 1..];
        if len + param.len() + 1 >= out.len() {
            continue;
        }
        if len > 0 {
            out[len] = b' ';
            len += 1;
        }
        out[len..len + param.len()].copy_from_slice(param);
        len += param.len();
    }
    out[len] = 0;
    len
}

/// Loads one module, without its signature where the kernel allows (see
/// `module_sig`: checking it is most of what loading costs under TCG). A
/// kernel that enforces signatures refuses the cut module (EKEYREJECTED, or
/// EPERM under lockdown) and gets the whole file.
fn load_module(fd: Fd, params: &[u8]) -> Result<usize, sys::Errno> {
    let Ok(map) = sys::Mapped::file(fd) else {
        return sys::finit_module(fd, params);
    };
    let image = map.bytes();
    if let Some(len) = module_sig::unsigned_len(image) {
        match sys::init_module(&image[..len], params) {
            Err(sys::EKEYREJECTED) | Err(sys::EPERM) => {}
            r => return r,
        }
    }
    sys::init_module(image, params)
}

/// The value of the last `NAME=` entry (`prefix` includes the `=`) in init's
/// environment, NUL-terminated. The last wins so that a user's `--cmdline`
/// overrides ember's own setting.
fn env_value(envp: *const *const u8, prefix: &[u8]) -> Option<&'static [u8]> {
    let mut found = None;
    let mut i = 0;
    loop {
        // SAFETY: envp is the NULL-terminated array the kernel built.
        let p = unsafe { *envp.add(i) };
        if p.is_null() {
            return found;
        }
        // SAFETY: every entry is a NUL-terminated string that lives forever.
        let s = unsafe { sys::cstr(p) };
        if let Some(v) = s.strip_prefix(prefix) {
            // SAFETY: v ends right before the entry's NUL, which is readable.
            found = Some(unsafe { core::slice::from_raw_parts(v.as_ptr(), v.len() + 1) });
        }
        i += 1;
    }
}

/// The host port of a vsock channel (`EMBER_CHANNEL=vsock:PORT`, the
/// value NUL-terminated); `None` for a device path.
fn vsock_port(value: &[u8]) -> Option<u32> {
    let digits = value.strip_prefix(b"vsock:")?;
    let digits = &digits[..digits.iter().position(|&b| b == 0).unwrap_or(digits.len())];
    let mut port: u32 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        port = port.checked_mul(10)?.checked_add(u32::from(d - b'0'))?;
    }
    (!digits.is_empty()).then_some(port)
}

/// Connects the channel to the host's vsock `port`, waiting (as for a
/// device node) while the transport is not up yet or the host's side does
/// not answer: the VMM connects a guest's connection to the host's socket
/// for that port, which the host listens on before the VMM starts.
fn connect_vsock(port: u32) -> Result<Fd, &'static [u8]> {
    let mut tries = 0;
    loop {
        match sys::vsock_connect(port) {
            Ok(fd) => return Ok(fd),
            // No waiting makes a kernel without vsock grow it.
            Err(sys::EAFNOSUPPORT) => {
                return Err(b"the kernel has no vsock (CONFIG_VIRTIO_VSOCKETS) for the channel");
            }
            Err(_) if tries < CHANNEL_OPEN_TRIES => {
                tries += 1;
                sys::sleep_ms(CHANNEL_OPEN_STEP_MS);
            }
            Err(_) => return Err(b"cannot connect the vsock channel"),
        }
    }
}

/// Opens the channel (waiting for a driver to create it) and makes a tty raw,
/// so no byte of a frame is echoed, translated or taken as a signal.
fn open_channel(path: &[u8]) -> Result<Fd, &'static [u8]> {
    let mut tries = 0;
    let fd = loop {
        match sys::open(path, sys::O_RDWR | sys::O_NOCTTY | sys::O_CLOEXEC) {
            Ok(fd) => break fd,
            Err(_) if tries < CHANNEL_OPEN_TRIES => {
                tries += 1;
                sys::sleep_ms(CHANNEL_OPEN_STEP_MS);
            }
            Err(_) => return Err(b"cannot open the channel device"),
        }
    };
    // A virtio-serial port that is not a console (QEMU's channel) is no
    // tty: there is nothing to make raw, its bytes pass as they are.
    match sys::make_raw(fd) {
        Ok(_) | Err(sys::ENOTTY) => Ok(fd),
        Err(_) => Err(b"cannot make the channel raw"),
    }
}

/// Where a `ROOT` device is mounted (a directory of the initramfs skeleton).
const ROOT_DIR: &[u8] = b"/.ember/root\0";

/// Mounts the command's root file system from block device `dev`
/// (NUL-terminated) at [`ROOT_DIR`], with /dev, /proc and /sys inside it.
///
/// The device may have been probed (its first blocks read and cached) when
/// this appliance booted, with other contents: a restored appliance's slot
/// is backed by this run's image. Its cache is dropped first, so the mount
/// reads what is there now. DAX is asked for first (the files are then
/// mapped, not copied: guest kernel copies are slow under a software KVM),
/// a plain mount where the device cannot do it.
fn mount_root(dev: &[u8]) -> Result<(), &'static [u8]> {
    if let Ok(fd) = sys::open(dev, sys::O_RDONLY | sys::O_CLOEXEC) {
        let _ = sys::flush_block_cache(fd);
        sys::close(fd);
    }
    sys::mount_with(dev, ROOT_DIR, b"ext4\0", 0, b"dax\0")
        .or_else(|_| sys::mount_with(dev, ROOT_DIR, b"ext4\0", 0, b"\0"))
        .map_err(|_| {
            &b"cannot mount the command's root (a kernel without virtio-pmem or ext4? \
               `ember run --no-snapshot` boots without it)"[..]
        })?;
    // Missing directories only mean the command sees no such files.
    let _ = sys::mount(b"devtmpfs\0", b"/.ember/root/dev\0", b"devtmpfs\0");
    let _ = sys::mount(b"proc\0", b"/.ember/root/proc\0", b"proc\0");
    let _ = sys::mount(b"sysfs\0", b"/.ember/root/sys\0", b"sysfs\0");
    Ok(())
}

/// Mounts the host's root (`HOSTROOT`) at [`ROOT_DIR`] and the `SHARE`s
/// into it; `premounted` when the root was mounted before READY, with the
/// tags of the shares mounted then.
fn mount_host_root(cmd: &Command, premounted: Option<Option<&[u8]>>) -> Result<(), &'static [u8]> {
    if premounted.is_none() {
        // SAFETY: host_root is a NUL-terminated string in the arena.
        let tag = unsafe { sys::cstr(cmd.host_root) };
        // SAFETY: as above; the slice includes the NUL.
        let tag = unsafe { core::slice::from_raw_parts(tag.as_ptr(), tag.len() + 1) };
        hostroot::mount(tag, ROOT_DIR)?;
    }
    for &share in &cmd.shares[..cmd.nshares] {
        // SAFETY: every share is a NUL-terminated string in the arena.
        let share = unsafe { sys::cstr(share) };
        hostroot::mount_share(share, ROOT_DIR, premounted.flatten())?;
    }
    Ok(())
}

/// Strings received from the host, NUL-terminated, in one fixed buffer.
struct Arena {
    buf: [u8; ARENA_LEN],
    used: usize,
}

impl Arena {
    fn new() -> Self {
        Arena {
            buf: [0; ARENA_LEN],
            used: 0,
        }
    }

    /// Copies `s` plus a NUL in; returns its offset.
    fn push(&mut self, s: &[u8]) -> Result<usize, &'static [u8]> {
        let end = self.used + s.len() + 1;
        if end > self.buf.len() || s.contains(&0) {
            return Err(b"command, environment or directory too long or contains NUL");
        }
        let at = self.used;
        self.buf[at..at + s.len()].copy_from_slice(s);
        self.buf[at + s.len()] = 0;
        self.used = end;
        Ok(at)
    }
}

/// The command as pointers into an [`Arena`].
struct Command {
    argv: [*const u8; MAX_PTRS + 1],
    envp: [*const u8; MAX_PTRS + 1],
    cwd: *const u8,
    /// The command's root file system's device (`ROOT`), or null.
    root: *const u8,
    /// The virtio-fs tag of the host's root (`HOSTROOT`), or null.
    host_root: *const u8,
    /// `SHARE` payloads, the first `nshares`.
    shares: [*const u8; MAX_SHARES],
    nshares: usize,
    exec: *const u8,
}

impl Command {
    /// Whether the command runs chrooted in [`ROOT_DIR`].
    fn chrooted(&self) -> bool {
        !self.root.is_null() || !self.host_root.is_null()
    }
}

/// Reads ARG/ENV/CWD frames up to EXEC.
fn receive_command(ch: &mut Channel, arena: &mut Arena) -> Result<Command, &'static [u8]> {
    let mut argv = [0usize; MAX_PTRS];
    let mut envp = [0usize; MAX_PTRS];
    let (mut nargs, mut nenv) = (0, 0);
    let mut cwd = None;
    let mut root = None;
    let mut host_root = None;
    let mut shares = [0usize; MAX_SHARES];
    let mut nshares = 0;
    let mut first = true;
    let exec = loop {
        // The appliance's snapshot is taken while init waits here: restored,
        // its vsock connection is gone (the device resets them all), and
        // the host of this run waits for a new one to send the command.
        if first && !ch.has_buffered_frame() && ch.vsock.is_some() {
            ch.recv_or_reconnect()?;
        }
        first = false;
        let (kind, payload) = ch.recv().ok_or(&b"channel closed before the command"[..])?;
        // Binary, not a string: kept by the network's module.
        if kind == ft::NET {
            net::keep(payload)?;
            continue;
        }
        let at = arena.push(payload)?;
        match kind {
            ft::ARG if nargs < MAX_PTRS => {
                argv[nargs] = at;
                nargs += 1;
            }
            ft::ENV if nenv < MAX_PTRS => {
                envp[nenv] = at;
                nenv += 1;
            }
            ft::CWD => cwd = Some(at),
            ft::ROOT => root = Some(at),
            ft::HOSTROOT => host_root = Some(at),
            ft::SHARE if nshares < MAX_SHARES => {
                shares[nshares] = at;
                nshares += 1;
            }
            ft::SHARE => return Err(b"too many shares"),
            ft::EXEC => break at,
            ft::ARG | ft::ENV => return Err(b"too many arguments or environment entries"),
            _ => return Err(b"unexpected frame before the command"),
        }
    };
    if vector::kernel_misses_vector_state() {
        keep_glibc_off_vectors(arena, &mut envp, &mut nenv)?;
    }
    let base = arena.buf.as_ptr();
    let mut cmd = Command {
        argv: [core::ptr::null(); MAX_PTRS + 1],
        envp: [core::ptr::null(); MAX_PTRS + 1],
        cwd: core::ptr::null(),
        root: core::ptr::null(),
        host_root: core::ptr::null(),
        shares: [core::ptr::null(); MAX_SHARES],
        nshares,
        // SAFETY: every offset came from Arena::push, so is inside buf.
        exec: unsafe { base.add(exec) },
    };
    for (dst, &off) in cmd.shares.iter_mut().zip(&shares[..nshares]) {
        // SAFETY: as above.
        *dst = unsafe { base.add(off) };
    }
    if let Some(off) = host_root {
        // SAFETY: as above.
        cmd.host_root = unsafe { base.add(off) };
    }
    for (dst, &off) in cmd.argv.iter_mut().zip(&argv[..nargs]) {
        // SAFETY: as above.
        *dst = unsafe { base.add(off) };
    }
    for (dst, &off) in cmd.envp.iter_mut().zip(&envp[..nenv]) {
        // SAFETY: as above.
        *dst = unsafe { base.add(off) };
    }
    if let Some(off) = cwd {
        // SAFETY: as above.
        cmd.cwd = unsafe { base.add(off) };
    }
    if let Some(off) = root {
        // SAFETY: as above.
        cmd.root = unsafe { base.add(off) };
    }
    Ok(cmd)
}

/// Gives the command's environment (offsets into `arena`) the glibc tunables
/// of [`vector`], merged into a `GLIBC_TUNABLES` it already has.
fn keep_glibc_off_vectors(
    arena: &mut Arena,
    envp: &mut [usize; MAX_PTRS],
    nenv: &mut usize,
) -> Result<(), &'static [u8]> {
    let entry = |off: usize| {
        let rest = &arena.buf[off..];
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    };
    let slot = envp[..*nenv]
        .iter()
        .position(|&off| entry(off).starts_with(vector::TUNABLES_VAR));
    let mut buf = [0u8; 4096];
    let Some(new) = vector::tunables_entry(slot.map(|i| entry(envp[i])), &mut buf) else {
        return Ok(());
    };
    let at = arena.push(new)?;
    match slot {
        Some(i) => envp[i] = at,
        None if *nenv < MAX_PTRS => {
            envp[*nenv] = at;
            *nenv += 1;
        }
        None => return Err(b"too many arguments or environment entries"),
    }
    Ok(())
}

/// Starts the command with pipes as its stdio and relays until both output
/// pipes close; returns its exit code.
fn run_command(ch: &mut Channel, cmd: &Command) -> Result<i32, &'static [u8]> {
    let (in_r, in_w) = sys::pipe().map_err(|_| &b"pipe failed"[..])?;
    let (out_r, out_w) = sys::pipe().map_err(|_| &b"pipe failed"[..])?;
    let (err_r, err_w) = sys::pipe().map_err(|_| &b"pipe failed"[..])?;
    let pid = sys::fork().map_err(|_| &b"fork failed"[..])?;
    if pid == 0 {
        exec_child(cmd, in_r, out_w, err_w);
    }
    for fd in [in_r, out_w, err_w] {
        sys::close(fd);
    }
    let _ = sys::set_nonblocking(in_w);
    relay(ch, in_w, out_r, err_r);
    sys::wait_for(pid).map_err(|_| &b"wait failed"[..])
}

/// Starts the command with a vsock connection of its own to the host's
/// `port` as each of its stdin, stdout and stderr (made in that order: the
/// host takes them in the order they come), so its output goes to the host
/// as it writes it and its input comes as the host sends it, with no pipe
/// and no copy through init; returns its exit code when it exits (the host
/// reads its stdout and stderr to their end before it takes the status).
fn run_command_on_vsock(cmd: &Command, port: u32) -> Result<i32, &'static [u8]> {
    let stdin = connect_vsock(port)?;
    let stdout = connect_vsock(port)?;
    let stderr = connect_vsock(port)?;
    let pid = sys::fork().map_err(|_| &b"fork failed"[..])?;
    if pid == 0 {
        exec_child(cmd, stdin, stdout, stderr);
    }
    sys::close(stdin);
    let code = sys::wait_for(pid).map_err(|_| &b"wait failed"[..]);
    // Ends its output for every holder (what a process it left behind
    // writes now fails), but keeps the connections open until the host
    // says it has read them: a vsock connection closed both ways with
    // output still queued for a slow host reader is reset after a while,
    // losing that output.
    for fd in [stdout, stderr] {
        sys::shutdown_write(fd);
    }
    code
}

/// In the forked child: wire up stdio, change directory, exec.
fn exec_child(cmd: &Command, stdin: Fd, stdout: Fd, stderr: Fd) -> ! {
    sys::dup2(stdin, 0);
    sys::dup2(stdout, 1);
    sys::dup2(stderr, 2);
    if cmd.chrooted()
        && (sys::chroot(ROOT_DIR.as_ptr()).is_err() || sys::chdir(c"/".as_ptr().cast()).is_err())
    {
        sys::write_all(2, b"ember: cannot enter the command's root\n");
        sys::exit(EXIT_CANNOT_EXEC);
    }
    if !cmd.cwd.is_null() && sys::chdir(cmd.cwd).is_err() {
        sys::write_all(2, b"ember: cannot change to the working directory ");
        // SAFETY: cwd is a NUL-terminated string in the arena.
        sys::write_all(2, unsafe { sys::cstr(cmd.cwd) });
        sys::write_all(2, b" (it must exist in the appliance)\n");
        sys::exit(1);
    }
    let err = sys::execve(cmd.exec, cmd.argv.as_ptr(), cmd.envp.as_ptr());
    sys::write_all(2, b"ember: cannot execute ");
    // SAFETY: exec is a NUL-terminated string in the arena.
    sys::write_all(2, unsafe { sys::cstr(cmd.exec) });
    sys::write_all(2, b": ");
    sys::write_all(2, sys::errno_name(err));
    sys::write_all(2, b"\n");
    sys::exit(if err == sys::ENOENT {
        EXIT_NOT_FOUND
    } else {
        EXIT_CANNOT_EXEC
    })
}

/// Moves command output to the channel and channel STDIN frames to the
/// command, until stdout and stderr are both closed. Stdin writes are
/// non-blocking: a command that does not read its stdin never stalls output.
fn relay(ch: &mut Channel, stdin: Fd, stdout: Fd, stderr: Fd) {
    let mut stdin = Some(stdin);
    let mut outs = [Some(stdout), Some(stderr)];
    let kinds = [ft::STDOUT, ft::STDERR];
    let mut buf = [0u8; 16 * 1024];
    // Unwritten STDIN bytes live in the channel's frame buffer until consumed.
    let mut pending: Option<(usize, usize)> = None;
    while outs.iter().any(Option::is_some) {
        let mut fds = [sys::PollFd::new(-1, 0); 4];
        for (slot, fd) in fds.iter_mut().zip(outs) {
            if let Some(fd) = fd {
                *slot = sys::PollFd::new(fd, sys::POLLIN);
            }
        }
        // Only read more from the host once the last STDIN frame is delivered.
        match (pending, stdin) {
            (Some(_), Some(fd)) => fds[2] = sys::PollFd::new(fd, sys::POLLOUT),
            _ if !ch.has_buffered_frame() => fds[3] = sys::PollFd::new(ch.fd, sys::POLLIN),
            _ => {}
        }
        if !ch.has_buffered_frame() || pending.is_some() {
            if sys::poll(&mut fds).is_err() {
                continue;
            }
        } else {
            fds[3].revents = sys::POLLIN;
        }
        for i in 0..2 {
            if fds[i].revents == 0 {
                continue;
            }
            let Some(fd) = outs[i] else { continue };
            match sys::read(fd, &mut buf) {
                Ok(n) if n > 0 => ch.send(kinds[i], &buf[..n]),
                Err(sys::EINTR) | Err(sys::EAGAIN) => {}
                _ => {
                    sys::close(fd);
                    outs[i] = None;
                }
            }
        }
        if let (Some((from, to)), Some(fd)) = (pending, stdin) {
            if fds[2].revents != 0 {
                match sys::write(fd, &ch.frame[from..to]) {
                    Ok(n) if from + n < to => pending = Some((from + n, to)),
                    Ok(_) => pending = None,
                    Err(sys::EAGAIN) | Err(sys::EINTR) => {}
                    Err(_) => {
                        // The command closed its stdin: drop the rest.
                        sys::close(fd);
                        stdin = None;
                        pending = None;
                    }
                }
            }
        } else if fds[3].revents != 0 {
            match ch.recv() {
                Some((ft::STDIN, data)) if !data.is_empty() && stdin.is_some() => {
                    pending = Some((ft::HEADER_LEN, ft::HEADER_LEN + data.len()));
                }
                Some((ft::STDIN_EOF, _)) => {
                    if let Some(fd) = stdin.take() {
                        sys::close(fd);
                    }
                }
                Some(_) => {}
                None => {
                    // The host went away; nobody will read the output.
                    return;
                }
            }
        }
    }
}

/// The framed channel: blocking sends, buffered receives.
struct Channel {
    fd: Fd,
    /// The host's vsock port, for a channel that is a vsock connection.
    vsock: Option<u32>,
    /// Bytes read from the tty not yet returned as frames.
    rx: [u8; ft::HEADER_LEN + ft::MAX_PAYLOAD],
    rx_len: usize,
    /// The last frame returned by `recv` (header + payload).
    frame: [u8; ft::HEADER_LEN + ft::MAX_PAYLOAD],
}

impl Channel {
    fn new(fd: Fd, vsock: Option<u32>) -> Self {
        Channel {
            fd,
            vsock,
            rx: [0; ft::HEADER_LEN + ft::MAX_PAYLOAD],
            rx_len: 0,
            frame: [0; ft::HEADER_LEN + ft::MAX_PAYLOAD],
        }
    }

    fn send(&mut self, kind: u8, payload: &[u8]) {
        for chunk in payload.chunks(ft::MAX_PAYLOAD).chain(
            // An empty payload still sends one frame.
            payload.is_empty().then_some(&[][..]),
        ) {
            let mut header = [kind, 0, 0, 0, 0];
            header[1..].copy_from_slice(&(chunk.len() as u32).to_le_bytes());
            sys::write_all(self.fd, &header);
            sys::write_all(self.fd, chunk);
        }
    }

    fn error_with(&mut self, msg: &[u8], detail: &[u8]) {
        let mut buf = [0u8; 640];
        let n = msg.len().min(128);
        buf[..n].copy_from_slice(&msg[..n]);
        let m = detail.len().min(buf.len() - n);
        buf[n..n + m].copy_from_slice(&detail[..m]);
        self.send(ft::ERROR, &buf[..n + m]);
        self.wait_done();
    }

    /// After the last frame: waits until the host says it has it (`DONE`),
    /// dropping whatever else comes (stdin the command never read). A port
    /// the host reads slowly still holds output in its queue when `write`
    /// returns, and powering off now would drop it with the VM. A closed
    /// channel ends the wait too.
    fn wait_done(&mut self) {
        sys::tcdrain(self.fd);
        while let Some((kind, _)) = self.recv() {
            if kind == ft::DONE {
                break;
            }
        }
    }

    /// Length of the complete frame at the start of `rx`, if there is one.
    fn buffered_frame_len(&self) -> Option<usize> {
        if self.rx_len < ft::HEADER_LEN {
            return None;
        }
        let len = u32::from_le_bytes([self.rx[1], self.rx[2], self.rx[3], self.rx[4]]) as usize;
        let total = ft::HEADER_LEN + len.min(ft::MAX_PAYLOAD);
        (self.rx_len >= total).then_some(total)
    }

    fn has_buffered_frame(&self) -> bool {
        self.buffered_frame_len().is_some()
    }

    /// Waits until bytes of the next frame are buffered; a vsock
    /// connection that ends before any came is made again, once (see
    /// [`receive_command`]).
    fn recv_or_reconnect(&mut self) -> Result<(), &'static [u8]> {
        let mut reconnected = false;
        while self.rx_len == 0 {
            match sys::read(self.fd, &mut self.rx) {
                Ok(n) if n > 0 => self.rx_len = n,
                Err(sys::EINTR) | Err(sys::EAGAIN) => {}
                _ if reconnected => return Err(b"channel closed before the command"),
                _ => {
                    let Some(port) = self.vsock else {
                        return Err(b"channel closed before the command");
                    };
                    sys::close(self.fd);
                    self.fd = connect_vsock(port)?;
                    reconnected = true;
                }
            }
        }
        Ok(())
    }

    /// The next frame (blocking); `None` when the channel fails.
    fn recv(&mut self) -> Option<(u8, &[u8])> {
        let total = loop {
            if let Some(total) = self.buffered_frame_len() {
                break total;
            }
            match sys::read(self.fd, &mut self.rx[self.rx_len..]) {
                Ok(n) if n > 0 => self.rx_len += n,
                Err(sys::EINTR) | Err(sys::EAGAIN) => {}
                _ => return None,
            }
        };
        self.frame[..total].copy_from_slice(&self.rx[..total]);
        self.rx.copy_within(total..self.rx_len, 0);
        self.rx_len -= total;
        Some((self.frame[0], &self.frame[ft::HEADER_LEN..total]))
    }
}
