//! `ember run`'s default root: the host's own, read-only over virtio-fs,
//! under a writable overlay in guest memory, so whatever runs on the host
//! runs in the guest (its interpreters' libraries, a compiler's helpers, a
//! script's `#!` line are all there) with the guest's kernel. The guest's
//! kernel modules still come from the appliance's initramfs: the host's
//! /lib/modules are the host kernel's. `--share DIR[:GUEST][,rw]` adds host
//! directories; writes anywhere else stay in the guest and vanish with it.
//!
//! The initramfs-only appliance (the command and its files carried in) is
//! what runs when asked (`--initramfs`), when an option of its own is given
//! (`--rootfs`, `--bare`, `--with`, `--file`, `--nested-kvm`), and when the
//! host's root cannot be served (no virtiofsd, a backend without virtio-fs,
//! a kernel without its modules): then with a line saying why.

use super::cli::RunArgs;
use super::error::ApplianceError;
use super::host::GuestShare;
use super::{kernel, modules};
use crate::backend::{self, Backend, ShareSupport, virtiofsd};
use std::path::{Component, Path, PathBuf};

/// The virtio-fs tag of the host's root.
pub const ROOT_TAG: &str = "ember-root";
/// The module group that mounts it (see [`fs_modules`]).
pub const FS_GROUP: &str = "fs";
/// What the guest needs to mount it: virtio-fs (with fuse) and overlayfs.
const FS_MODULES: &[&str] = &["virtiofs", "overlay"];

/// One `--share DIR[:GUEST][,rw]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareArg {
    /// The host directory, absolute and without symlinks.
    pub host: PathBuf,
    /// Where the command sees it.
    pub guest: String,
    /// Its writes reach the host.
    pub writable: bool,
}

impl ShareArg {
    /// Parses `DIR[:GUEST][,rw|,ro]`; DIR must be a directory.
    pub fn parse(s: &str) -> Result<ShareArg, ApplianceError> {
        let bad = |why: &str| ApplianceError::BadArg(format!("--share {s}: {why}"));
        let mut rest = s;
        // The last of `,rw` and `,ro` counts.
        let mut writable = None;
        while let Some((head, opt)) = rest.rsplit_once(',') {
            match opt {
                "rw" => writable = writable.or(Some(true)),
                "ro" => writable = writable.or(Some(false)),
                _ => break,
            }
            rest = head;
        }
        let writable = writable.unwrap_or(false);
        let (dir, guest) = match rest.split_once(':') {
            Some((d, g)) => (d, Some(g)),
            None => (rest, None),
        };
        if dir.is_empty() {
            return Err(bad("no directory"));
        }
        let host = std::fs::canonicalize(dir).map_err(|e| bad(&format!("{dir}: {e}")))?;
        if !host.is_dir() {
            return Err(bad(&format!("{dir} is not a directory")));
        }
        // Whoever serves it (ember's device, or a virtiofsd) runs as the
        // caller: a directory the caller cannot list and enter is refused
        // here, in one line, rather than by the VMM once it starts.
        std::fs::read_dir(&host)
            .and_then(|_| std::fs::metadata(host.join(".")))
            .map_err(|e| bad(&format!("{dir}: {e}")))?;
        let guest = match guest {
            Some(g) => g.to_owned(),
            None => host
                .to_str()
                .ok_or_else(|| bad("not a UTF-8 path (give its GUEST path)"))?
                .to_owned(),
        };
        let p = Path::new(&guest);
        let plain = p
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if !p.is_absolute() || !plain || p.parent().is_none() {
            return Err(bad(&format!(
                "the guest path `{guest}` must be absolute, below / and without `..`"
            )));
        }
        Ok(ShareArg {
            host,
            guest,
            writable,
        })
    }
}

/// Where the command's root comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Root {
    /// The host's, with these shares.
    Host(Vec<ShareArg>),
    /// The initramfs appliance's.
    Initramfs,
}

/// Chooses the run's root; says on stderr why, when the host's was
/// possible in principle but cannot be served here.
pub(super) fn choose(args: &RunArgs, backend: &dyn Backend) -> Result<Root, ApplianceError> {
    let shares = args
        .share
        .iter()
        .map(|s| ShareArg::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, s) in shares.iter().enumerate() {
        if shares[..i].iter().any(|t| t.guest == s.guest) {
            return Err(ApplianceError::BadArg(format!(
                "--share: `{}` is shared twice",
                s.guest
            )));
        }
    }
    let own_option = [
        (args.initramfs, "--initramfs"),
        (args.rootfs.is_some(), "--rootfs"),
        (args.bare, "--bare"),
        (!args.with.is_empty(), "--with"),
        (!args.file.is_empty(), "--file"),
        (args.nested_kvm, "--nested-kvm"),
    ]
    .into_iter()
    .find_map(|(given, name)| given.then_some(name));
    if let Some(option) = own_option {
        if !shares.is_empty() {
            return Err(ApplianceError::BadArg(format!(
                "--share needs the host's root, which {option} does not use"
            )));
        }
        return Ok(Root::Initramfs);
    }
    match unservable(args, backend) {
        None => Ok(Root::Host(shares)),
        Some(why) if shares.is_empty() => {
            eprintln!("ember: running from the initramfs appliance: {why}");
            Ok(Root::Initramfs)
        }
        Some(why) => Err(ApplianceError::BadArg(format!(
            "--share cannot be served: {why}"
        ))),
    }
}

/// Why the host's root cannot be served to this run's guest, if it cannot.
fn unservable(args: &RunArgs, backend: &dyn Backend) -> Option<String> {
    match backend.share_support() {
        ShareSupport::Unsupported(why) => return Some(why.to_owned()),
        ShareSupport::Virtiofsd => {
            if let Err(e) = virtiofsd::Virtiofsd::find() {
                return Some(e.to_string());
            }
        }
        ShareSupport::InProcess => {}
    }
    // A kernel or module tree that cannot be used at all is the assembly's
    // error to report, not a reason to fall back.
    let cache = kernel::cache_dir().ok()?;
    let k = kernel::find_kernel(args.kernel.as_deref(), &cache).ok()?;
    if let Some(dir) = &k.modules {
        modules::resolve_cached(dir, &cache).ok()?;
    }
    match fs_modules(k.modules.as_deref(), &[]) {
        Ok(_) => None,
        Err(e) => Some(format!("the guest kernel cannot mount it: {e}")),
    }
}

/// The virtiofs and overlay modules with their dependencies, tagged
/// [`FS_GROUP`], minus those in `already`. A kernel with no module tree has
/// them built in, or the guest says it cannot mount the root.
pub(super) fn fs_modules(
    modules_dir: Option<&Path>,
    already: &[modules::GroupedModule],
) -> Result<Vec<modules::GroupedModule>, modules::ModuleError> {
    let Some(dir) = modules_dir else {
        return Ok(Vec::new());
    };
    let tree = modules::ModuleTree::open(dir)?;
    Ok(tree
        .resolve(FS_MODULES, modules::BLACKLIST)?
        .into_iter()
        .filter(|p| !already.iter().any(|m| &m.path == p))
        .map(|path| modules::GroupedModule {
            group: FS_GROUP.to_owned(),
            path,
        })
        .collect())
}

/// The VMM's shares (the root first) and the guest's view of them.
pub(super) fn shares(user: &[ShareArg]) -> (Vec<backend::Share>, Vec<GuestShare>) {
    let root = backend::Share {
        tag: ROOT_TAG.to_owned(),
        dir: PathBuf::from("/"),
        read_only: true,
        socket: None,
    };
    let mut vmm = vec![root];
    let mut guest = Vec::new();
    for (i, s) in user.iter().enumerate() {
        let tag = format!("ember-share{i}");
        vmm.push(backend::Share {
            tag: tag.clone(),
            dir: s.host.clone(),
            read_only: !s.writable,
            socket: None,
        });
        guest.push(GuestShare {
            tag,
            path: s.guest.clone(),
            writable: s.writable,
        });
    }
    (vmm, guest)
}

/// The command's environment: the caller's, then `--env` entries (the same
/// name replaces). Entries that are not UTF-8 are left out.
pub(super) fn environment(extra: &[String]) -> Result<Vec<String>, ApplianceError> {
    let mut env: Vec<String> = std::env::vars_os()
        .filter_map(|(k, v)| Some(format!("{}={}", k.to_str()?, v.to_str()?)))
        .collect();
    for e in extra {
        let Some((name, _)) = e.split_once('=').filter(|(n, _)| !n.is_empty()) else {
            return Err(ApplianceError::BadArg(format!(
                "bad --env `{e}` (want NAME=VALUE)"
            )));
        };
        env.retain(|x| x.split_once('=').map(|(n, _)| n) != Some(name));
        env.push(e.clone());
    }
    Ok(env)
}

/// The command's working directory: `--workdir`, else the caller's.
pub(super) fn workdir(args: &RunArgs) -> Option<String> {
    args.workdir.clone().or_else(|| {
        std::env::current_dir()
            .ok()
            .and_then(|d| d.to_str().map(str::to_owned))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_arguments_parse_and_bad_ones_are_one_line_errors() {
        let dir = super::super::test_dir("share-args");
        std::fs::create_dir_all(&dir).unwrap();
        let d = std::fs::canonicalize(&dir).unwrap();
        let ds = d.to_str().unwrap();
        let s = ShareArg::parse(ds).unwrap();
        assert_eq!(
            (s.host.as_path(), s.guest.as_str(), s.writable),
            (d.as_path(), ds, false)
        );
        let s = ShareArg::parse(&format!("{ds}:/mnt/x,rw")).unwrap();
        assert_eq!((s.guest.as_str(), s.writable), ("/mnt/x", true));
        let s = ShareArg::parse(&format!("{ds},rw,ro")).unwrap();
        assert!(!s.writable);
        let file = d.join("f");
        std::fs::write(&file, "").unwrap();
        for (arg, why) in [
            ("/nonexistent-ember-share".to_owned(), "No such file"),
            (file.display().to_string(), "is not a directory"),
            (format!("{ds}:relative"), "must be absolute"),
            (format!("{ds}:/"), "must be absolute, below /"),
            (format!("{ds}:/a/../b"), "without `..`"),
            (",rw".to_owned(), "no directory"),
        ] {
            let e = ShareArg::parse(&arg).unwrap_err().to_string();
            assert!(e.contains(why) && !e.contains('\n'), "{arg}: {e}");
        }
    }

    #[test]
    fn the_root_is_the_first_share_and_read_only() {
        let user = [ShareArg {
            host: "/srv".into(),
            guest: "/data".into(),
            writable: true,
        }];
        let (vmm, guest) = shares(&user);
        assert_eq!(vmm.len(), 2);
        assert_eq!((vmm[0].tag.as_str(), vmm[0].read_only), (ROOT_TAG, true));
        assert_eq!(vmm[0].dir, Path::new("/"));
        assert_eq!(
            (vmm[1].dir.as_path(), vmm[1].read_only),
            (Path::new("/srv"), false)
        );
        assert_eq!(
            guest,
            [GuestShare {
                tag: "ember-share0".into(),
                path: "/data".into(),
                writable: true
            }]
        );
    }

    #[test]
    fn the_environment_is_the_callers_with_overrides() {
        let e = environment(&["PATH=/x".into()]).unwrap();
        assert!(e.contains(&"PATH=/x".to_string()));
        assert_eq!(e.iter().filter(|x| x.starts_with("PATH=")).count(), 1);
        let home = std::env::var("HOME").unwrap();
        assert!(e.contains(&format!("HOME={home}")));
        assert!(environment(&["=v".into()]).is_err());
    }
}
