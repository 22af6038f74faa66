//! Containers in ember VMs: the core that `containerd-shim-ember-v2` and
//! `ember-oci` share.
//!
//! A [`pod::Pod`] is one VM with the guest agent (`guests/agent`) running
//! in it, driven over one byte stream ([`agent::AgentClient`]); several
//! containers may live in it (the CRI pod model), each a root file system
//! shared from the host and processes the agent starts chrooted there. On
//! the QEMU backend the VM is `ember run` on the host's root: the agent is
//! its command (so its stdin and stdout are the stream, relayed by the
//! appliance's channel) and each container's rootfs — containerd's
//! snapshot mounted on the host in the bundle, not copied — is a
//! `--share …,rw` over virtio-fs, so the container's writes land in its
//! snapshot's upper layer.

pub mod agent;
pub mod pod;
pub mod rootfs;
pub mod spec;

/// Stamps a stage of a container's start in `EMBER_STAGES`'s file, which
/// `ember run` and the VMM stamp theirs in too (bench/containers.py).
pub use ember_vmm::events::stage;

use thiserror::Error;

/// Where containers' roots are shared in the guest (`GUEST_ROOTS/ID`).
pub const GUEST_ROOTS: &str = "/run/ember-containers";

/// Container errors.
#[derive(Debug, Error)]
pub enum ContainerError {
    /// The agent answered with an error.
    #[error("{0}")]
    Agent(String),
    /// The agent's stream ended (the VM stopped).
    #[error("the VM's agent is gone")]
    AgentGone,
    /// The agent did not answer in time.
    #[error("the VM's agent did not answer within {0} s")]
    Timeout(u64),
    /// A helper program is missing.
    #[error("cannot find `{0}` (beside this program or on PATH)")]
    MissingProgram(String),
    /// The bundle's config.json is unusable.
    #[error("bundle {bundle}: {why}")]
    Spec {
        /// The bundle.
        bundle: String,
        /// Why.
        why: String,
    },
    /// A spec's JSON (a bundle's config.json, an update's resources) is
    /// not what the OCI runtime spec says.
    #[error("{what}: {source}")]
    Json {
        /// What was parsed.
        what: String,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
    /// A spec field is not supported yet.
    #[error("not implemented: {0}")]
    NotImplemented(String),
    /// A rootfs mount failed.
    #[error("mount {what}: {source}")]
    Mount {
        /// What was mounted where.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// Other I/O.
    #[error("{what}: {source}")]
    Io {
        /// What was done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

impl ContainerError {
    /// An I/O error with what was being done.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ContainerError {
        let what = what.into();
        move |source| ContainerError::Io { what, source }
    }
}

/// A program ember ships beside its own binaries: `$ENV`, else beside the
/// running program, else on PATH.
pub fn companion(name: &str, env: &str) -> Result<std::path::PathBuf, ContainerError> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(p.into());
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Into::into))
    {
        let p: std::path::PathBuf = dir;
        let p = p.join(name);
        if crate::backend::is_executable(&p) {
            return Ok(p);
        }
    }
    crate::backend::find_binary(name).ok_or_else(|| ContainerError::MissingProgram(name.into()))
}
