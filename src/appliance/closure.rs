//! What a command needs to run: its executable, the script interpreter or
//! dynamic loader (`PT_INTERP`), and its shared libraries (`DT_NEEDED`,
//! recursively), found the way ld.so finds them.

use object::Endianness;
use object::elf;
use object::read::elf::{Dyn, ElfFile64, FileHeader, ProgramHeader};
use std::collections::{BTreeSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// ld.so's default search path on Debian (from /etc/ld.so.conf.d plus the
/// built-in defaults), in order.
pub const LIBRARY_DIRS: &[&str] = &[
    "/usr/local/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/local/lib",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

/// The PATH commands are looked up in inside a `--rootfs`.
pub const GUEST_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How deep `#!` interpreters may nest (the kernel allows 4).
const MAX_SCRIPT_DEPTH: usize = 4;

/// Errors finding a command or what it needs.
#[derive(Debug, Error)]
pub enum ClosureError {
    /// Not on PATH / no such file.
    #[error("{0}: command not found")]
    NotFound(String),
    /// Found, but the appliance cannot run it.
    #[error("cannot carry `{path}` into the appliance: {why}")]
    NotCarriable {
        /// The file.
        path: PathBuf,
        /// The reason.
        why: Unrunnable,
    },
    /// A shared library it needs is nowhere on the search path.
    #[error("`{binary}` needs `{library}`, which is not in the library search path")]
    MissingLibrary {
        /// The ELF object.
        binary: PathBuf,
        /// The DT_NEEDED entry.
        library: String,
    },
    /// I/O failure.
    #[error("cannot read `{path}`")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Why a found file cannot run in the appliance (the reason
/// [`ClosureError::NotCarriable`] gives).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Unrunnable {
    /// Neither ELF nor `#!`.
    #[error("not an ELF executable or a #! script")]
    Unknown,
    /// A 32-bit or broken ELF file.
    #[error("not a 64-bit ELF file (the appliance runs x86_64 code)")]
    Not64Bit,
    /// Another machine's code.
    #[error("built for another architecture (the appliance runs x86_64 code)")]
    ForeignArch,
    /// The program headers do not parse.
    #[error("its program headers are corrupt")]
    ProgramHeaders,
    /// PT_INTERP does not parse.
    #[error("bad PT_INTERP")]
    Interp,
    /// PT_DYNAMIC does not parse.
    #[error("bad PT_DYNAMIC")]
    Dynamic,
    /// No DT_STRTAB.
    #[error("its dynamic section has no string table")]
    NoStringTable,
    /// DT_STRTAB is in no PT_LOAD segment.
    #[error("its string table is outside every segment")]
    StringTableOutside,
    /// `#!` within `#!` beyond [`MAX_SCRIPT_DEPTH`].
    #[error("script interpreters nest too deeply")]
    ScriptDepth,
    /// The `#!` interpreter is not a file.
    #[error("its script interpreter `{0}` is missing")]
    NoInterpreter(String),
}

/// Finds `cmd` like a shell: a name with a `/` is a path, otherwise the
/// first executable on `path_var`. With `root`, the lookup happens inside
/// that directory and the result is the path inside it.
pub fn find_command(
    cmd: &str,
    path_var: &str,
    root: Option<&Path>,
) -> Result<PathBuf, ClosureError> {
    let host = |p: &Path| match root {
        Some(r) => r.join(p.strip_prefix("/").unwrap_or(p)),
        None => p.to_path_buf(),
    };
    if cmd.is_empty() {
        return Err(ClosureError::NotFound(String::new()));
    }
    if cmd.contains('/') {
        let p = if root.is_none() {
            std::path::absolute(cmd).map_err(|source| ClosureError::Io {
                path: cmd.into(),
                source,
            })?
        } else {
            Path::new("/").join(cmd)
        };
        return if host(&p).is_file() {
            Ok(p)
        } else {
            Err(ClosureError::NotFound(cmd.to_owned()))
        };
    }
    path_var
        .split(':')
        .filter(|d| d.starts_with('/'))
        .map(|d| Path::new(d).join(cmd))
        .find(|p| crate::backend::is_executable(&host(p)))
        .ok_or_else(|| ClosureError::NotFound(cmd.to_owned()))
}

/// Everything `exe` needs, `exe` first: interpreters, the ELF loader and all
/// shared libraries (host paths, as named — symlinks are kept by the caller).
pub fn closure(exe: &Path) -> Result<Vec<PathBuf>, ClosureError> {
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    let mut queue = VecDeque::from([(exe.to_path_buf(), 0usize)]);
    while let Some((path, depth)) = queue.pop_front() {
        let key = fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
        if !seen.insert(key) {
            continue;
        }
        let data = fs::read(&path).map_err(|source| ClosureError::Io {
            path: path.clone(),
            source,
        })?;
        let not = |why: Unrunnable| ClosureError::NotCarriable {
            path: path.clone(),
            why,
        };
        if let Some(interp) = shebang(&data) {
            if depth >= MAX_SCRIPT_DEPTH {
                return Err(not(Unrunnable::ScriptDepth));
            }
            if !Path::new(&interp).is_file() {
                return Err(not(Unrunnable::NoInterpreter(interp)));
            }
            out.push(path);
            queue.push_back((interp.into(), depth + 1));
            continue;
        }
        let deps = elf_deps(&data).map_err(not)?;
        let origin = path.parent().unwrap_or(Path::new("/")).to_path_buf();
        out.push(path.clone());
        if let Some(interp) = deps.interp {
            queue.push_back((interp.into(), depth));
        }
        let search = search_dirs(&deps.rpath, &origin);
        for lib in deps.needed {
            let found =
                find_library(&lib, &search).ok_or_else(|| ClosureError::MissingLibrary {
                    binary: path.clone(),
                    library: lib.clone(),
                })?;
            queue.push_back((found, depth));
        }
    }
    Ok(out)
}

/// The interpreter of a `#!` script.
fn shebang(data: &[u8]) -> Option<String> {
    let line = data.strip_prefix(b"#!")?;
    let line = &line[..line.iter().position(|&b| b == b'\n').unwrap_or(line.len())];
    let text = String::from_utf8_lossy(line);
    text.split_whitespace().next().map(str::to_owned)
}

/// The dynamic-linking facts of an ELF executable or library.
#[derive(Debug, Default, PartialEq, Eq)]
struct ElfDeps {
    interp: Option<String>,
    needed: Vec<String>,
    rpath: Vec<String>,
}

fn elf_deps(data: &[u8]) -> Result<ElfDeps, Unrunnable> {
    if !data.starts_with(b"\x7fELF") {
        return Err(Unrunnable::Unknown);
    }
    let file = ElfFile64::<Endianness>::parse(data).map_err(|_| Unrunnable::Not64Bit)?;
    let endian = file.endian();
    let header = file.elf_header();
    if header.e_machine(endian) != elf::EM_X86_64 {
        return Err(Unrunnable::ForeignArch);
    }
    let mut deps = ElfDeps::default();
    let segments = header
        .program_headers(endian, data)
        .map_err(|_| Unrunnable::ProgramHeaders)?;
    let mut dynamic = None;
    for ph in segments {
        match ph.p_type(endian) {
            elf::PT_INTERP => {
                let bytes = ph.data(endian, data).map_err(|_| Unrunnable::Interp)?;
                let s = bytes.split(|&b| b == 0).next().unwrap_or(&[]);
                deps.interp = Some(String::from_utf8_lossy(s).into_owned());
            }
            elf::PT_DYNAMIC => {
                dynamic = ph.dynamic(endian, data).map_err(|_| Unrunnable::Dynamic)?;
            }
            _ => {}
        }
    }
    let Some(dynamic) = dynamic else {
        return Ok(deps); // static
    };
    // DT_STRTAB is a virtual address; map it to a file offset through PT_LOAD.
    let strtab_addr = dynamic
        .iter()
        .find(|d| d.d_tag(endian) == elf::DT_STRTAB)
        .map(|d| d.d_val(endian))
        .ok_or(Unrunnable::NoStringTable)?;
    let strtab_off = segments
        .iter()
        .filter(|ph| ph.p_type(endian) == elf::PT_LOAD)
        .find_map(|ph| {
            let (va, sz) = (ph.p_vaddr(endian), ph.p_filesz(endian));
            (strtab_addr >= va && strtab_addr < va + sz)
                .then(|| ph.p_offset(endian) + (strtab_addr - va))
        })
        .ok_or(Unrunnable::StringTableOutside)? as usize;
    let string = |off: u64| -> Option<String> {
        let s = data.get(strtab_off + off as usize..)?;
        let end = s.iter().position(|&b| b == 0)?;
        Some(String::from_utf8_lossy(&s[..end]).into_owned())
    };
    for d in dynamic {
        let tag = d.d_tag(endian);
        let Some(s) = string(d.d_val(endian))
            .filter(|_| tag == elf::DT_NEEDED || tag == elf::DT_RPATH || tag == elf::DT_RUNPATH)
        else {
            continue;
        };
        if tag == elf::DT_NEEDED {
            deps.needed.push(s);
        } else {
            deps.rpath.extend(s.split(':').map(str::to_owned));
        }
    }
    Ok(deps)
}

/// RPATH/RUNPATH (with `$ORIGIN`) then the default directories.
fn search_dirs(rpath: &[String], origin: &Path) -> Vec<PathBuf> {
    let origin = origin.to_string_lossy();
    rpath
        .iter()
        .map(|r| PathBuf::from(r.replace("${ORIGIN}", &origin).replace("$ORIGIN", &origin)))
        .chain(LIBRARY_DIRS.iter().map(PathBuf::from))
        .collect()
}

/// The first `name` in `dirs` that is a 64-bit x86_64 ELF (ld.so skips
/// libraries of the wrong class, e.g. i386 ones in /usr/lib).
fn find_library(name: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name)).filter(|p| p.is_file());
    }
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file() && is_x86_64_elf(p))
}

fn is_x86_64_elf(p: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 20];
    let ok = fs::File::open(p).and_then(|mut f| f.read_exact(&mut head));
    // e_ident[EI_CLASS] = 2 (64-bit), e_machine (offset 18) = EM_X86_64.
    ok.is_ok()
        && head.starts_with(b"\x7fELF")
        && head[4] == 2
        && u16::from_le_bytes([head[18], head[19]]) == elf::EM_X86_64.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_names(paths: &[PathBuf]) -> Vec<String> {
        paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn bin_true_needs_libc_and_the_loader() {
        let exe = find_command("true", GUEST_PATH, None).unwrap();
        let c = closure(&exe).unwrap();
        assert_eq!(c[0], exe);
        let names = file_names(&c);
        assert!(names.iter().any(|n| n == "libc.so.6"), "{names:?}");
        assert!(
            names.iter().any(|n| n.starts_with("ld-linux-x86-64")),
            "{names:?}"
        );
        assert!(c.iter().all(|p| p.is_file()));
    }

    #[test]
    fn scripts_bring_their_interpreter() {
        let dir = crate::appliance::test_dir("closure-script");
        let script = dir.join("hello");
        fs::write(&script, "#!/bin/sh -e\necho hi\n").unwrap();
        let c = closure(&script).unwrap();
        assert_eq!(c[0], script);
        assert_eq!(c[1], PathBuf::from("/bin/sh"));
        assert!(file_names(&c).iter().any(|n| n == "libc.so.6"));

        let broken = dir.join("broken");
        fs::write(&broken, "#!/nonexistent/interp\n").unwrap();
        let e = closure(&broken).unwrap_err().to_string();
        assert!(
            e.contains("script interpreter `/nonexistent/interp` is missing"),
            "{e}"
        );

        let text = dir.join("text");
        fs::write(&text, "plain text").unwrap();
        let e = closure(&text).unwrap_err().to_string();
        assert!(e.contains("not an ELF executable"), "{e}");
    }

    #[test]
    fn command_lookup() {
        assert!(matches!(
            find_command("no-such-command-xyz", GUEST_PATH, None),
            Err(ClosureError::NotFound(_))
        ));
        assert_eq!(
            find_command("/bin/sh", "", None).unwrap(),
            PathBuf::from("/bin/sh")
        );
        let root = crate::appliance::test_dir("closure-root");
        fs::create_dir_all(root.join("bin")).unwrap();
        fs::copy("/bin/true", root.join("bin/mytool")).unwrap();
        assert_eq!(
            find_command("mytool", GUEST_PATH, Some(&root)).unwrap(),
            PathBuf::from("/bin/mytool")
        );
    }

    #[test]
    fn static_and_foreign_elves() {
        // A static executable has no dependencies.
        if let Ok(bb) = find_command("busybox", GUEST_PATH, None) {
            let data = fs::read(&bb).unwrap();
            let d = elf_deps(&data).unwrap();
            if d.interp.is_none() {
                assert!(d.needed.is_empty());
            }
        }
        let mut fake = fs::read("/bin/true").unwrap();
        fake[18] = 0x28; // EM_ARM
        assert_eq!(elf_deps(&fake).unwrap_err(), Unrunnable::ForeignArch);
    }
}
