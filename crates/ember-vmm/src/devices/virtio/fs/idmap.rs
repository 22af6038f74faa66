//! Whose files the guest sees as its own in a share.
//!
//! ember as root serves each request as its guest caller (see
//! `passthrough`): a host id and a guest id are the same number. Another
//! user cannot switch, so every file the guest creates is that user's; it
//! is then the guest's root, the view the QEMU backend's `virtiofsd` gives
//! (`--sandbox=namespace --translate-uid=map:0:UID:1`, and the same for
//! gids): the caller's uid and gid are the guest's 0, every other host id
//! shows as the overflow id (as an id a user namespace does not map
//! shows), and no guest id but 0 may own a file (a chown to another, or a
//! file made by another guest user, is `EINVAL`, as chown(2) answers for an
//! id its user namespace does not map, and as `virtiofsd` answers).
//!
//! The map is the serving process's, taken when the device is made: a
//! snapshot does not record it, so a restore by another user than the one
//! who made the snapshot shows the guest that user's view (the guest's
//! cached attributes expire within a second).

/// What the guest sees for a host id it has no mapping for (the kernel's
/// default `overflowuid` and `overflowgid`).
pub const OVERFLOW_ID: u32 = 65534;

/// How host uids and gids appear in the guest, and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdMap {
    /// Every id is itself (ember is root).
    Identity,
    /// The caller's ids are the guest's root's; nothing else is mapped.
    Caller {
        /// The host uid the guest sees as 0.
        uid: u32,
        /// The host gid the guest sees as 0.
        gid: u32,
    },
}

impl IdMap {
    /// The map for a process with effective ids `uid` and `gid`.
    pub fn for_caller(uid: u32, gid: u32) -> Self {
        if uid == 0 {
            IdMap::Identity
        } else {
            IdMap::Caller { uid, gid }
        }
    }

    /// The map for this process.
    pub fn of_process() -> Self {
        // SAFETY: geteuid/getegid cannot fail.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Self::for_caller(uid, gid)
    }

    /// The host (uid, gid) the guest's root is, when not the identity.
    pub fn caller(self) -> Option<(u32, u32)> {
        match self {
            IdMap::Identity => None,
            IdMap::Caller { uid, gid } => Some((uid, gid)),
        }
    }

    /// The guest's view of host uid `host`.
    pub fn uid_to_guest(self, host: u32) -> u32 {
        to_guest(self.caller().map(|c| c.0), host)
    }

    /// The guest's view of host gid `host`.
    pub fn gid_to_guest(self, host: u32) -> u32 {
        to_guest(self.caller().map(|c| c.1), host)
    }

    /// The host uid guest uid `guest` is, `None` if it has none.
    pub fn uid_to_host(self, guest: u32) -> Option<u32> {
        to_host(self.caller().map(|c| c.0), guest)
    }

    /// The host gid guest gid `guest` is, `None` if it has none.
    pub fn gid_to_host(self, guest: u32) -> Option<u32> {
        to_host(self.caller().map(|c| c.1), guest)
    }
}

/// One id, host to guest: `own` (`None`: the identity) is the guest's 0.
fn to_guest(own: Option<u32>, host: u32) -> u32 {
    match own {
        None => host,
        Some(own) if host == own => 0,
        Some(_) => OVERFLOW_ID,
    }
}

/// One id, guest to host: the inverse of [`to_guest`] where there is one.
fn to_host(own: Option<u32>, guest: u32) -> Option<u32> {
    match own {
        None => Some(guest),
        Some(own) => (guest == 0).then_some(own),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_the_identity_both_ways() {
        let m = IdMap::for_caller(0, 0);
        assert_eq!(m, IdMap::Identity);
        // A root uid decides it, whatever its gid.
        assert_eq!(IdMap::for_caller(0, 5), IdMap::Identity);
        assert_eq!(m.caller(), None);
        for id in [0, 1, 1000, OVERFLOW_ID, u32::MAX - 1] {
            assert_eq!(m.uid_to_guest(id), id);
            assert_eq!(m.gid_to_guest(id), id);
            assert_eq!(m.uid_to_host(id), Some(id));
            assert_eq!(m.gid_to_host(id), Some(id));
        }
    }

    #[test]
    fn a_user_is_the_guests_root_and_nothing_else_is_mapped() {
        let m = IdMap::for_caller(1000, 100);
        assert_eq!(m.caller(), Some((1000, 100)));
        // Host to guest: the caller is 0, the rest overflow (root too).
        assert_eq!((m.uid_to_guest(1000), m.gid_to_guest(100)), (0, 0));
        for other in [0, 1, 100, 999, 1001] {
            assert_eq!(m.uid_to_guest(other), OVERFLOW_ID, "uid {other}");
        }
        for other in [0, 1000, 101] {
            assert_eq!(m.gid_to_guest(other), OVERFLOW_ID, "gid {other}");
        }
        // Guest to host: 0 is the caller; nothing else has a host id, not
        // even the overflow id the guest is shown, nor the caller's own
        // number.
        assert_eq!(
            (m.uid_to_host(0), m.gid_to_host(0)),
            (Some(1000), Some(100))
        );
        for other in [1, 100, 1000, OVERFLOW_ID] {
            assert_eq!(m.uid_to_host(other), None, "uid {other}");
            assert_eq!(m.gid_to_host(other), None, "gid {other}");
        }
        // Both ways round trip where a mapping exists.
        assert_eq!(m.uid_to_host(m.uid_to_guest(1000)), Some(1000));
        assert_eq!(m.gid_to_guest(m.gid_to_host(0).unwrap()), 0);
    }

    #[test]
    fn nobody_as_the_caller_is_root_in_the_guest_and_others_are_nobody() {
        // `nobody` is the overflow id itself: its files are the guest's
        // root's, and root's files show as nobody's.
        let m = IdMap::for_caller(OVERFLOW_ID, 994);
        assert_eq!(m.uid_to_guest(OVERFLOW_ID), 0);
        assert_eq!(m.uid_to_guest(0), OVERFLOW_ID);
        assert_eq!(m.gid_to_guest(994), 0);
        assert_eq!(m.uid_to_host(OVERFLOW_ID), None);
    }
}
