//! Kernel module selection: the appliance carries exactly the modules it needs
//! plus their dependencies, in load order.
//!
//! Debian's kernel package ships no `modules.dep`, so dependencies come from
//! each `.ko`'s `.modinfo` section (`depends=a,b`). `modules.order` maps
//! module names to files; `modules.builtin` lists what is compiled in (and so
//! never needs loading).

use object::read::elf::{ElfFile64, FileHeader};
use object::{Object, ObjectSection};
use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// What the appliance carries, in groups the guest init loads selectively
/// (`EMBER_MODULES=core,blk` on the kernel command line): loading a module
/// costs guest-kernel time, so a run loads only the groups for the devices it
/// has. `core` is the console channel (with virtio itself); `pci` and `mmio`
/// are the two virtio transports, loaded per backend (see
/// `Backend::virtio_transports`: q35 has no virtio-mmio device, and loading
/// `virtio_mmio` there cost ~0.8 M guest instructions for nothing). The init
/// loads them in this order: virtio-mem (`ember run --mem-boot`) comes right
/// after the transports so that the guest plugs its memory while the rest
/// boots, then the balloon, because with `--prefault async` it is the fence that keeps the guest on
/// committed memory, which holds only once its driver is up.
pub const MODULE_GROUPS: &[(&str, &[&str])] = &[
    ("core", &["virtio_console"]),
    ("pci", &["virtio_pci"]),
    ("mmio", &["virtio_mmio"]),
    (MEM_GROUP, &["virtio_mem"]),
    ("balloon", &["virtio_balloon"]),
    ("blk", &["virtio_blk"]),
    ("rng", &["virtio_rng"]),
    ("pmem", &["virtio_pmem", "nd_pmem"]),
    ("vsock", &["vmw_vsock_virtio_transport"]),
    ("net", &["virtio_net"]),
];

/// The group of the virtio-mem driver (`ember run --mem-boot`).
pub const MEM_GROUP: &str = "mem";

/// Every module of [`MODULE_GROUPS`]: virtio transports, disks, the console
/// channel, entropy, the balloon, DAX-capable pmem and vsock.
pub const APPLIANCE_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_pci",
    "virtio_console",
    "virtio_blk",
    "virtio_rng",
    "virtio_balloon",
    "virtio_mem",
    "virtio_pmem",
    "nd_pmem",
    "vmw_vsock_virtio_transport",
    "virtio_net",
];

/// A module file and the group that first needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupedModule {
    /// Group name from [`MODULE_GROUPS`].
    pub group: String,
    /// The `.ko` file.
    pub path: PathBuf,
}

/// Modules never carried, even as a dependency: graphics and input pull in
/// large subsystems (drm) a command runner has no use for.
pub const BLACKLIST: &[&str] = &["drm", "drm_kms_helper", "virtio_gpu", "virtio_input", "ttm"];

/// Module errors.
#[derive(Debug, Error)]
pub enum ModuleError {
    /// A wanted module is neither built in nor shipped.
    #[error("kernel modules in `{dir}` lack `{name}` (neither built in nor a .ko)")]
    Missing {
        /// The modules directory.
        dir: PathBuf,
        /// The module.
        name: String,
    },
    /// A wanted module needs a blacklisted one.
    #[error("module `{name}` depends on blacklisted `{dep}`")]
    Blacklisted {
        /// The module.
        name: String,
        /// Its blacklisted dependency.
        dep: String,
    },
    /// A `.ko` without a readable `.modinfo`.
    #[error("`{0}` is not a kernel module (no .modinfo section)")]
    NotAModule(PathBuf),
    /// A dependency cycle (a broken modules tree).
    #[error("module dependency cycle through `{0}`")]
    Cycle(String),
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

/// `virtio-rng` and `virtio_rng` are the same module to the kernel.
pub fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// The module name of a `.ko` path.
fn module_name(path: &str) -> Option<String> {
    let file = path.rsplit('/').next()?;
    Some(normalize(file.strip_suffix(".ko")?))
}

/// A kernel's module tree.
#[derive(Debug)]
pub struct ModuleTree {
    dir: PathBuf,
    files: HashMap<String, PathBuf>,
    builtin: BTreeSet<String>,
}

impl ModuleTree {
    /// Reads `modules.order` and `modules.builtin` of `dir` (`…/lib/modules/<ver>`).
    pub fn open(dir: &Path) -> Result<Self, ModuleError> {
        let read = |name: &str| {
            let path = dir.join(name);
            fs::read_to_string(&path).map_err(|source| ModuleError::Io { path, source })
        };
        let files = read("modules.order")?
            .lines()
            .filter_map(|l| Some((module_name(l.trim())?, dir.join(l.trim()))))
            .collect();
        // Missing modules.builtin means nothing is known to be built in.
        let builtin = read("modules.builtin")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| module_name(l.trim()))
            .collect();
        Ok(ModuleTree {
            dir: dir.to_path_buf(),
            files,
            builtin,
        })
    }

    /// `wanted` and their dependencies, dependencies first, skipping built-ins.
    pub fn resolve(
        &self,
        wanted: &[&str],
        blacklist: &[&str],
    ) -> Result<Vec<PathBuf>, ModuleError> {
        let blacklist: BTreeSet<String> = blacklist.iter().map(|b| normalize(b)).collect();
        let mut order = Vec::new();
        let mut state = HashMap::new();
        for w in wanted {
            self.visit(&normalize(w), None, &blacklist, &mut state, &mut order)?;
        }
        Ok(order)
    }

    /// [`MODULE_GROUPS`] resolved in order; each module is tagged with the
    /// first group that needs it (later groups rely on earlier ones loaded).
    pub fn resolve_groups(&self, blacklist: &[&str]) -> Result<Vec<GroupedModule>, ModuleError> {
        let mut wanted: Vec<&str> = Vec::new();
        let mut out: Vec<GroupedModule> = Vec::new();
        for (group, mods) in MODULE_GROUPS {
            wanted.extend_from_slice(mods);
            // Post-order DFS over a longer wanted list extends the shorter one's order.
            let all = self.resolve(&wanted, blacklist)?;
            for path in all.into_iter().skip(out.len()) {
                out.push(GroupedModule {
                    group: (*group).to_owned(),
                    path,
                });
            }
        }
        Ok(out)
    }

    /// Depth-first post-order visit; `state` is false while on the stack.
    fn visit(
        &self,
        name: &str,
        parent: Option<&str>,
        blacklist: &BTreeSet<String>,
        state: &mut HashMap<String, bool>,
        order: &mut Vec<PathBuf>,
    ) -> Result<(), ModuleError> {
        match state.get(name) {
            Some(true) => return Ok(()),
            Some(false) => return Err(ModuleError::Cycle(name.to_owned())),
            None => {}
        }
        if self.builtin.contains(name) {
            state.insert(name.to_owned(), true);
            return Ok(());
        }
        if blacklist.contains(name) {
            return Err(ModuleError::Blacklisted {
                name: parent.unwrap_or(name).to_owned(),
                dep: name.to_owned(),
            });
        }
        let path = self.files.get(name).ok_or_else(|| ModuleError::Missing {
            dir: self.dir.clone(),
            name: name.to_owned(),
        })?;
        state.insert(name.to_owned(), false);
        for dep in depends(path)? {
            self.visit(&dep, Some(name), blacklist, state, order)?;
        }
        state.insert(name.to_owned(), true);
        order.push(path.clone());
        Ok(())
    }
}

/// [`MODULE_GROUPS`] of the tree in `dir`, resolved once and remembered in
/// `cache_dir` (keyed by the directory and its `modules.order` mtime), so a
/// cached run reads one small file instead of every `.ko`.
pub fn resolve_cached(dir: &Path, cache_dir: &Path) -> Result<Vec<GroupedModule>, ModuleError> {
    use std::os::unix::ffi::OsStrExt;
    let order = dir.join("modules.order");
    let mtime = fs::metadata(&order)
        .and_then(|m| m.modified())
        .map_err(|source| ModuleError::Io {
            path: order.clone(),
            source,
        })?;
    let mut h = super::cache::KeyHasher::new();
    h.put(dir.as_os_str().as_bytes());
    let since = mtime
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.put(&since.as_nanos().to_le_bytes());
    for (group, names) in MODULE_GROUPS {
        h.put(group.as_bytes());
        h.put(&names.len().to_le_bytes());
        names.iter().for_each(|n| h.put(n.as_bytes()));
    }
    BLACKLIST.iter().for_each(|n| h.put(n.as_bytes()));
    let memo = cache_dir.join("modules").join(format!("{}.list", h.hex()));
    if let Ok(text) = fs::read_to_string(&memo) {
        let list: Option<Vec<GroupedModule>> = text
            .lines()
            .map(|l| {
                let (group, path) = l.split_once(' ')?;
                Some(GroupedModule {
                    group: group.to_owned(),
                    path: PathBuf::from(path),
                })
            })
            .collect();
        // An empty list is never a valid memo (a truncated write of an
        // older ember): rejected, it is resolved and written again.
        if let Some(list) = list.filter(|l| !l.is_empty() && l.iter().all(|m| m.path.is_file())) {
            return Ok(list);
        }
    }
    let list = ModuleTree::open(dir)?.resolve_groups(BLACKLIST)?;
    let text: String = list
        .iter()
        .map(|m| format!("{} {}\n", m.group, m.path.display()))
        .collect();
    // Best effort: an unwritable cache only costs speed here. Atomic, so a
    // crash or a full disk cannot leave a truncated list behind.
    let parent = memo.parent().unwrap_or(cache_dir);
    if !list.is_empty()
        && super::cache::private_dir(cache_dir).is_ok()
        && super::cache::private_dir(parent).is_ok()
    {
        let _ = super::cache::write_atomic(&memo, text.as_bytes());
    }
    Ok(list)
}

/// The `depends=` list of a `.ko` file's `.modinfo` section.
pub fn depends(ko: &Path) -> Result<Vec<String>, ModuleError> {
    let data = fs::read(ko).map_err(|source| ModuleError::Io {
        path: ko.to_path_buf(),
        source,
    })?;
    let modinfo = modinfo(&data).ok_or_else(|| ModuleError::NotAModule(ko.to_path_buf()))?;
    Ok(modinfo
        .split(|&b| b == 0)
        .filter_map(|kv| kv.strip_prefix(b"depends="))
        .flat_map(|v| v.split(|&b| b == b','))
        .filter(|d| !d.is_empty())
        .map(|d| normalize(&String::from_utf8_lossy(d)))
        .collect())
}

/// The bytes of the `.modinfo` section of an ELF64 object.
fn modinfo(data: &[u8]) -> Option<&[u8]> {
    let elf = ElfFile64::<object::Endianness>::parse(data).ok()?;
    // Relocatable objects only: a module is ET_REL.
    let header = elf.elf_header();
    if header.e_type(elf.endian()) != object::elf::ET_REL {
        return None;
    }
    elf.section_by_name(".modinfo")?.data().ok()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ember_frames::module_sig;
    use object::write::{Object as WObject, StandardSection};

    /// A minimal relocatable x86_64 ELF with a `.modinfo` section.
    pub(crate) fn fake_ko(modinfo: &str) -> Vec<u8> {
        let mut obj = WObject::new(
            object::BinaryFormat::Elf,
            object::Architecture::X86_64,
            object::Endianness::Little,
        );
        let text = obj.section_id(StandardSection::Text);
        obj.append_section_data(text, &[0xc3], 1);
        let id = obj.add_section(Vec::new(), b".modinfo".to_vec(), object::SectionKind::Data);
        obj.append_section_data(id, modinfo.as_bytes(), 1);
        obj.write().unwrap()
    }

    /// Writes a fake modules tree: (relative path, depends) pairs; `builtin` lines.
    pub(crate) fn fake_tree(dir: &Path, mods: &[(&str, &str)], builtin: &[&str]) {
        let mut order = String::new();
        for (rel, deps) in mods {
            let p = dir.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            let name = module_name(rel).unwrap();
            fs::write(
                &p,
                fake_ko(&format!("license=GPL\0depends={deps}\0name={name}\0")),
            )
            .unwrap();
            order.push_str(rel);
            order.push('\n');
        }
        fs::write(dir.join("modules.order"), order).unwrap();
        fs::write(dir.join("modules.builtin"), builtin.join("\n")).unwrap();
    }

    fn names(paths: &[PathBuf]) -> Vec<String> {
        paths
            .iter()
            .map(|p| module_name(p.to_str().unwrap()).unwrap())
            .collect()
    }

    #[test]
    fn resolves_dependencies_first_and_skips_builtins() {
        let dir = crate::appliance::test_dir("modules-synthetic");
        fake_tree(
            &dir,
            &[
                ("kernel/a/virtio_ring.ko", ""),
                ("kernel/a/virtio.ko", "virtio_ring"),
                ("kernel/b/virtio-rng.ko", "virtio,virtio_ring,rng_core"),
                ("kernel/c/virtio_gpu.ko", "drm,virtio"),
                ("kernel/c/drm.ko", ""),
            ],
            &["kernel/d/rng-core.ko"],
        );
        let tree = ModuleTree::open(&dir).unwrap();
        let got = names(&tree.resolve(&["virtio-rng"], &[]).unwrap());
        assert_eq!(got, ["virtio_ring", "virtio", "virtio_rng"]);
        // Asking twice for shared deps loads them once.
        let got = names(&tree.resolve(&["virtio", "virtio_rng"], &[]).unwrap());
        assert_eq!(got, ["virtio_ring", "virtio", "virtio_rng"]);
        assert!(matches!(
            tree.resolve(&["virtio_gpu"], &["drm"]),
            Err(ModuleError::Blacklisted { .. })
        ));
        assert!(matches!(
            tree.resolve(&["nope"], &[]),
            Err(ModuleError::Missing { .. })
        ));
    }

    #[test]
    fn groups_tag_each_module_once_with_its_first_user() {
        let dir = crate::appliance::test_dir("modules-groups");
        let mut mods = vec![
            ("kernel/virtio_ring.ko", ""),
            ("kernel/virtio.ko", "virtio_ring"),
        ];
        let names: Vec<String> = MODULE_GROUPS
            .iter()
            .flat_map(|(_, m)| m.iter())
            .map(|m| format!("kernel/{m}.ko"))
            .collect();
        for n in &names {
            mods.push((n.as_str(), "virtio"));
        }
        fake_tree(&dir, &mods, &[]);
        let got = ModuleTree::open(&dir).unwrap().resolve_groups(&[]).unwrap();
        let tag = |n: &str| {
            got.iter()
                .find(|m| m.path.ends_with(format!("{n}.ko")))
                .unwrap()
                .group
                .clone()
        };
        assert_eq!(tag("virtio_ring"), "core");
        assert_eq!(tag("virtio_console"), "core");
        // Each transport is its own group, so a machine without it skips it;
        // what they share (virtio, virtio_ring) is `core`'s, loaded first.
        assert_eq!(tag("virtio_pci"), "pci");
        assert_eq!(tag("virtio_mmio"), "mmio");
        assert_eq!(tag("virtio"), "core");
        assert_eq!(tag("virtio_blk"), "blk");
        assert_eq!(tag("nd_pmem"), "pmem");
        assert_eq!(got.len(), 2 + names.len());
        // Cached resolution returns the same.
        let cache = dir.join("cache");
        assert_eq!(resolve_cached(&dir, &cache).unwrap(), got);
        assert_eq!(resolve_cached(&dir, &cache).unwrap(), got);
        // The memo is private, and an empty or corrupt one (an older
        // ember's truncated write) is rebuilt, not believed.
        use std::os::unix::fs::MetadataExt;
        let memo_dir = cache.join("modules");
        assert_eq!(fs::metadata(&cache).unwrap().mode() & 0o777, 0o700);
        assert_eq!(fs::metadata(&memo_dir).unwrap().mode() & 0o777, 0o700);
        let memo = fs::read_dir(&memo_dir)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        assert_eq!(fs::metadata(&memo).unwrap().mode() & 0o777, 0o600);
        for junk in ["", "garbage-without-a-space\n"] {
            fs::write(&memo, junk).unwrap();
            assert_eq!(resolve_cached(&dir, &cache).unwrap(), got, "memo {junk:?}");
            assert!(!fs::read(&memo).unwrap().is_empty());
        }
    }

    #[test]
    fn cycles_and_non_modules_are_errors() {
        let dir = crate::appliance::test_dir("modules-cycle");
        fake_tree(&dir, &[("a.ko", "b"), ("b.ko", "a")], &[]);
        let tree = ModuleTree::open(&dir).unwrap();
        assert!(matches!(
            tree.resolve(&["a"], &[]),
            Err(ModuleError::Cycle(_))
        ));
        let junk = dir.join("junk.ko");
        fs::write(&junk, b"not elf").unwrap();
        assert!(matches!(depends(&junk), Err(ModuleError::NotAModule(_))));
    }

    #[test]
    fn resolves_the_real_debian_modules_when_present() {
        // The modules of the kernel `ember setup` fetched (scripts/test runs it first).
        let cache = crate::appliance::kernel::cache_dir()
            .map(|d| crate::appliance::kernel::KernelCache::new(&d));
        let Some(dir) = cache.ok().and_then(|c| c.current()).and_then(|k| k.modules) else {
            ember_testing::skip(
                "resolves_the_real_debian_modules",
                "no Debian modules tree (run `ember setup`)",
            );
            return;
        };
        let tree = ModuleTree::open(&dir).unwrap();
        let got = names(&tree.resolve(APPLIANCE_MODULES, BLACKLIST).unwrap());
        let pos = |n: &str| {
            got.iter()
                .position(|g| g == n)
                .unwrap_or_else(|| panic!("{n} in {got:?}"))
        };
        assert!(pos("virtio_ring") < pos("virtio"));
        assert!(pos("virtio") < pos("virtio_console"));
        assert!(pos("libnvdimm") < pos("nd_pmem"));
        assert!(pos("vsock") < pos("vmw_vsock_virtio_transport"));
        assert!(pos("nd_btt") < pos("nd_pmem"));
        assert!(
            !got.iter().any(|g| g.contains("drm") || g == "dax"),
            "{got:?}"
        );
        let unique: BTreeSet<_> = got.iter().collect();
        assert_eq!(unique.len(), got.len());
    }

    /// Debian's own signed modules, when `ember setup` has fetched them: where
    /// ember-init cuts their signature.
    #[test]
    fn a_real_signed_module_loses_only_its_signature() {
        let Ok(cache) = crate::appliance::kernel::cache_dir() else {
            return;
        };
        let Some(k) = crate::appliance::kernel::KernelCache::new(&cache).current() else {
            eprintln!("no cached kernel: no real module to try");
            return;
        };
        let Some(dir) = k.modules else { return };
        let Ok(tree) = ModuleTree::open(&dir) else {
            return;
        };
        let Ok(mods) = tree.resolve(&["virtio_console"], &[]) else {
            return;
        };
        for m in mods {
            let Ok(bytes) = std::fs::read(&m) else {
                continue;
            };
            if !bytes.ends_with(module_sig::MARKER) {
                continue; // compressed or unsigned
            }
            let n = module_sig::unsigned_len(&bytes).expect("a signed module's length");
            assert_eq!(&bytes[..4], b"\x7fELF");
            // PKCS#7 signatures of Debian's key are several hundred bytes.
            assert!(
                bytes.len() - n > 300 && bytes.len() - n < 4096,
                "{}",
                m.display()
            );
        }
    }
}
