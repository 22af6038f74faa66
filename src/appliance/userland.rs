//! The appliance's base userland: busybox and its applets, so a command can
//! be a shell script (`ember run -- sh -c 'ls / | head'`) and not only the
//! one program whose files were carried.
//!
//! The applets live in their own directory ([`APPLET_DIR`]) at the end of the
//! guest's `PATH`: the command's own closure (and `--with` closures) come
//! first, busybox fills in what they lack. The host's busybox is carried with
//! its closure, so a static one (Debian's `busybox-static`) is one file, ~2 MB.
//! The applet symlinks are not in the initramfs: ember-init makes them from a
//! list at boot, which costs the guest half as much (see [`applets`]).

use super::builder::{Entry, Tree};
use super::closure;
use ember_frames::applets;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where busybox's applet symlinks go in the guest.
pub const APPLET_DIR: &str = "/usr/lib/ember/busybox";

/// A busybox found on the host and the applets it offers.
#[derive(Debug, Clone)]
pub struct Busybox {
    /// The host binary (symlinks resolved by the closure).
    pub path: PathBuf,
    /// Applet names (`ls`, `sh`, …).
    pub applets: Vec<String>,
}

impl Busybox {
    /// The busybox on `path_var` (a PATH), asked for its applets; `None` when
    /// there is none or it does not answer `--list`.
    pub fn find(path_var: &str) -> Option<Busybox> {
        Self::find_cached(path_var, None)
    }

    /// [`Busybox::find`], keeping the applet list in `cache` (a directory),
    /// keyed by the binary's identity (path, device, inode, size, mtime): a
    /// `busybox --list` writes each name with a system call of its own, ~10
    /// ms of every `ember run` for a list that changes only with busybox.
    pub fn find_cached(path_var: &str, cache: Option<&Path>) -> Option<Busybox> {
        let path = closure::find_command("busybox", path_var, None).ok()?;
        let cached = cache.and_then(|dir| Some(dir.join(list_key(&path)?)));
        let text = match cached.as_deref().map(std::fs::read) {
            Some(Ok(text)) if !text.is_empty() => text,
            _ => {
                let mut list = Command::new(&path);
                list.arg("--list");
                crate::cleanup::dies_with_ember(&mut list);
                let out = list.output().ok()?;
                if !out.status.success() {
                    return None;
                }
                if let (Some(file), Some(dir)) = (&cached, cache) {
                    // A cache that cannot be written only costs the next run the --list.
                    let _ = super::cache::private_dir(dir)
                        .and_then(|()| super::cache::write_atomic(file, &out.stdout));
                }
                out.stdout
            }
        };
        let applets: Vec<String> = String::from_utf8_lossy(&text)
            .lines()
            .map(str::trim)
            // Applet names are plain file names; anything else is not one.
            .filter(|a| !a.is_empty() && !a.contains('/') && *a != "." && *a != "..")
            .map(str::to_owned)
            .collect();
        (!applets.is_empty()).then_some(Busybox { path, applets })
    }

    /// Adds busybox (with its closure), the empty [`APPLET_DIR`] and the
    /// list ([`applets::LIST`]) from which ember-init makes one symlink per
    /// applet there at boot.
    pub fn add_to(&self, tree: &mut Tree) -> Result<(), super::error::ApplianceError> {
        for f in closure::closure(&self.path)? {
            tree.add_host_path(&f)?;
        }
        tree.add_dir(Path::new(APPLET_DIR));
        tree.add_data(Path::new(&list_path()), self.link_list(), 0o644);
        Ok(())
    }

    /// The list ember-init reads (format in [`applets`]): the directory, the
    /// link target (the carried busybox), then the applet names.
    fn link_list(&self) -> Vec<u8> {
        let mut list = format!("{APPLET_DIR}\n{}\n", self.path.to_string_lossy());
        for a in &self.applets {
            list.push_str(a);
            list.push('\n');
        }
        list.into_bytes()
    }

    /// The guest path of applet `name`, if busybox has it.
    pub fn applet(&self, name: &str) -> Option<PathBuf> {
        self.applets
            .iter()
            .any(|a| a == name)
            .then(|| Path::new(APPLET_DIR).join(name))
    }
}

/// `tree` with the links of its applet list as symlinks, for a tree written
/// to a disk image (the warm appliance's per-run root, `warm::root_image`):
/// init makes links only in the initramfs, and links on the image cost the
/// host, not the guest's boot.
pub fn with_links(tree: &Tree) -> Tree {
    let mut t = tree.clone();
    let list = list_path();
    let Some(Entry::Data(data, _)) = tree.entries().get(list.trim_start_matches('/')) else {
        return t;
    };
    let Some((dir, target, names)) = applets::parse(data) else {
        return t;
    };
    let (dir_s, target) = (
        String::from_utf8_lossy(dir),
        String::from_utf8_lossy(target),
    );
    let mut buf = [0u8; 4096];
    for name in names {
        if applets::link_path(dir, name, &mut buf).is_some() {
            let at = Path::new(&*dir_s).join(&*String::from_utf8_lossy(name));
            t.add_symlink(&at, &target);
        }
    }
    t
}

/// The applet list's cache file name for the busybox at `path`: a hash of
/// its path and identity, so a new or changed busybox is asked again.
fn list_key(path: &Path) -> Option<String> {
    let mut h = super::cache::KeyHasher::new();
    h.put_identity(path).then(|| format!("{}.applets", h.hex()))
}

/// [`applets::LIST`] as a host string, without its NUL.
fn list_path() -> String {
    let l = applets::LIST;
    String::from_utf8_lossy(&l[..l.len() - 1]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_applet_list_is_cached_by_the_binarys_identity() {
        let dir = crate::appliance::test_dir("busybox-applets");
        let cache = dir.join("cache");
        let fresh = Busybox::find_cached("/usr/bin:/bin", Some(&cache)).expect("busybox-static");
        let files: Vec<_> = std::fs::read_dir(&cache).unwrap().flatten().collect();
        assert_eq!(files.len(), 1, "one list file");
        // The cached list is the one used: an edited file shows through.
        std::fs::write(files[0].path(), "only\n").unwrap();
        let cached = Busybox::find_cached("/usr/bin:/bin", Some(&cache)).unwrap();
        assert_eq!(cached.applets, ["only"]);
        // An empty (truncated) entry is asked again and rewritten.
        std::fs::write(files[0].path(), "").unwrap();
        let again = Busybox::find_cached("/usr/bin:/bin", Some(&cache)).unwrap();
        assert_eq!(again.applets, fresh.applets);
        assert!(!std::fs::read(files[0].path()).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn applets_are_listed_for_init_to_link_to_the_carried_busybox() {
        let Some(bb) = Busybox::find("/usr/bin:/bin") else {
            panic!("busybox is not installed (scripts/install-deps installs busybox-static)");
        };
        assert!(bb.applets.iter().any(|a| a == "ls"), "{:?}", bb.applets);
        let mut t = Tree::skeleton(b"init".to_vec(), &[]);
        bb.add_to(&mut t).unwrap();
        // No link is carried: the directory is empty, and init reads the list.
        assert_eq!(t.entries().get("usr/lib/ember/busybox"), Some(&Entry::Dir));
        assert!(
            !t.entries()
                .keys()
                .any(|k| k.starts_with("usr/lib/ember/busybox/")),
            "applet links carried in the initramfs"
        );
        let Some(Entry::Data(list, 0o644)) = t.entries().get(".ember/applets") else {
            panic!("no applet list: {:?}", t.entries().get(".ember/applets"));
        };
        // What init will make of it, with its own parser and path builder.
        let (dir, target, names) = applets::parse(list).expect("a well-formed list");
        assert_eq!(dir, APPLET_DIR.as_bytes());
        assert_eq!(target, bb.path.to_string_lossy().as_bytes());
        let names: Vec<&[u8]> = names.collect();
        assert_eq!(names.len(), bb.applets.len());
        let mut buf = [0u8; 256];
        let ls = applets::link_path(dir, b"ls", &mut buf).unwrap();
        assert_eq!(ls, b"/usr/lib/ember/busybox/ls\0");
        assert!(names.contains(&&b"ls"[..]));
        // Written to a disk image, the tree has the links themselves.
        let linked = with_links(&t);
        assert_eq!(
            linked.entries().get("usr/lib/ember/busybox/ls"),
            Some(&Entry::Symlink(bb.path.to_string_lossy().into_owned()))
        );
        let links = linked
            .entries()
            .keys()
            .filter(|k| k.starts_with("usr/lib/ember/busybox/"))
            .count();
        assert_eq!(links, bb.applets.len());
        assert!(
            t.entries()
                .get(bb.path.to_string_lossy().trim_start_matches('/'))
                .is_some_and(|e| matches!(e, Entry::File { .. }))
        );
        assert_eq!(
            bb.applet("ls"),
            Some(PathBuf::from("/usr/lib/ember/busybox/ls"))
        );
        assert_eq!(bb.applet("no-such-applet"), None);
    }
}
