//! The parts of an OCI runtime spec (a bundle's `config.json`) ember
//! honours, and what turns them into the agent's requests.

use super::ContainerError;
use ember_agent::{ContainerSpec, Mount, ProcessSpec};
use serde::Deserialize;
use std::path::Path;

/// A bundle's `config.json`, the fields ember reads.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// The container's process.
    pub process: Option<Process>,
    /// Its root.
    pub root: Option<Root>,
    /// Its hostname.
    pub hostname: Option<String>,
    /// Its mounts.
    #[serde(default)]
    pub mounts: Vec<SpecMount>,
}

/// `process`, as in the spec (also an exec's process).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Process {
    /// Whether it runs on a terminal.
    #[serde(default)]
    pub terminal: bool,
    /// Its user.
    #[serde(default)]
    pub user: User,
    /// argv.
    #[serde(default)]
    pub args: Vec<String>,
    /// `NAME=value` entries.
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory.
    #[serde(default)]
    pub cwd: String,
}

/// `process.user`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct User {
    /// uid.
    #[serde(default)]
    pub uid: u32,
    /// gid.
    #[serde(default)]
    pub gid: u32,
    /// Supplementary groups.
    #[serde(default)]
    pub additional_gids: Vec<u32>,
}

/// `root`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Root {
    /// The root's path, relative to the bundle or absolute.
    pub path: String,
    /// Read-only.
    #[serde(default)]
    pub readonly: bool,
}

/// One of `mounts`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecMount {
    /// Where, in the container.
    pub destination: String,
    /// Type.
    #[serde(rename = "type", default)]
    pub fstype: String,
    /// Source.
    #[serde(default)]
    pub source: String,
    /// Options.
    #[serde(default)]
    pub options: Vec<String>,
}

impl Spec {
    /// Reads `BUNDLE/config.json`.
    pub fn load(bundle: &Path) -> Result<Spec, ContainerError> {
        let bad = |why: String| ContainerError::Spec {
            bundle: bundle.display().to_string(),
            why,
        };
        let text = std::fs::read(bundle.join("config.json"))
            .map_err(|e| bad(format!("config.json: {e}")))?;
        Spec::parse(&text).map_err(bad)
    }

    /// Parses a spec's JSON.
    pub fn parse(json: &[u8]) -> Result<Spec, String> {
        serde_json::from_slice(json).map_err(|e| format!("config.json: {e}"))
    }

    /// The agent's description of the container whose root the guest sees
    /// at `guest_rootfs`. Mounts of host paths (bind mounts) cannot reach
    /// the guest yet: refused in one line.
    pub fn container(&self, id: &str, guest_rootfs: &str) -> Result<ContainerSpec, ContainerError> {
        if self.root.as_ref().is_some_and(|r| r.readonly) {
            return Err(ContainerError::NotImplemented(
                "a read-only root (root.readonly)".into(),
            ));
        }
        let mut mounts = Vec::new();
        for m in &self.mounts {
            let bind = m.fstype == "bind" || m.options.iter().any(|o| o == "bind" || o == "rbind");
            if bind {
                return Err(ContainerError::NotImplemented(format!(
                    "bind mount of host path {} at {}",
                    m.source, m.destination
                )));
            }
            mounts.push(Mount {
                destination: m.destination.clone(),
                fstype: m.fstype.clone(),
                source: m.source.clone(),
                options: m.options.clone(),
            });
        }
        Ok(ContainerSpec {
            id: id.to_owned(),
            rootfs: guest_rootfs.to_owned(),
            hostname: self.hostname.clone().filter(|h| !h.is_empty()),
            mounts,
        })
    }
}

impl Process {
    /// Parses an exec's process JSON.
    pub fn parse(json: &[u8]) -> Result<Process, String> {
        serde_json::from_slice(json).map_err(|e| format!("process spec: {e}"))
    }

    /// The agent's start request for this process as `handle` in `container`.
    pub fn to_agent(&self, handle: u32, container: &str, stdin: bool) -> ProcessSpec {
        ProcessSpec {
            handle,
            container: container.to_owned(),
            args: self.args.clone(),
            env: self.env.clone(),
            cwd: if self.cwd.is_empty() {
                "/".into()
            } else {
                self.cwd.clone()
            },
            uid: self.user.uid,
            gid: self.user.gid,
            additional_gids: self.user.additional_gids.clone(),
            terminal: self.terminal,
            stdin,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTR_LIKE: &str = r#"{
        "ociVersion": "1.0.2-dev",
        "process": {"terminal": false, "user": {"uid": 1000, "gid": 100, "additionalGids": [10]},
                    "args": ["sh", "-c", "echo hi"], "env": ["PATH=/bin", "A=b"], "cwd": "/tmp",
                    "capabilities": {"bounding": ["CAP_KILL"]}, "noNewPrivileges": true},
        "root": {"path": "rootfs"},
        "hostname": "box",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]}],
        "linux": {"namespaces": [{"type": "pid"}]}
    }"#;

    #[test]
    fn a_ctr_spec_becomes_agent_requests() {
        let spec = Spec::parse(CTR_LIKE.as_bytes()).unwrap();
        let c = spec.container("c1", "/.ember-containers/c1").unwrap();
        assert_eq!(c.hostname.as_deref(), Some("box"));
        assert_eq!(c.mounts.len(), 2);
        assert_eq!(c.mounts[1].options, ["nosuid", "mode=755"]);
        let p = spec.process.unwrap().to_agent(1, "c1", true);
        assert_eq!(p.args, ["sh", "-c", "echo hi"]);
        assert_eq!(
            (p.uid, p.gid, p.additional_gids.as_slice()),
            (1000, 100, &[10][..])
        );
        assert_eq!(p.cwd, "/tmp");
        assert!(p.stdin && !p.terminal);
    }

    #[test]
    fn bind_mounts_and_a_readonly_root_are_refused_in_one_line() {
        let spec = Spec::parse(
            br#"{"mounts": [{"destination": "/etc/hosts", "type": "bind", "source": "/etc/hosts", "options": ["rbind"]}]}"#,
        )
        .unwrap();
        let e = spec.container("c", "/r").unwrap_err().to_string();
        assert_eq!(
            e,
            "not implemented: bind mount of host path /etc/hosts at /etc/hosts"
        );
        let spec = Spec::parse(br#"{"root": {"path": "rootfs", "readonly": true}}"#).unwrap();
        assert!(
            spec.container("c", "/r")
                .unwrap_err()
                .to_string()
                .contains("read-only root")
        );
    }
}
