//! The parts of an OCI runtime spec (a bundle's `config.json`) ember
//! honours, and what turns them into the agent's requests.

use super::ContainerError;
use ember_agent::{Capabilities, ContainerSpec, Mount, ProcessSpec, Resources, Rlimit};
use serde::Deserialize;
use std::path::{Path, PathBuf};

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
    /// `linux`.
    #[serde(default)]
    pub linux: Linux,
    /// Hooks (run by `ember-oci` on the host, as runc does).
    #[serde(default)]
    pub hooks: Hooks,
    /// Annotations (a CRI pod's sandbox id and container type among them).
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// `hooks`: programs run on the host at points of the container's life.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hooks {
    /// After the container is created, before its process starts (old name).
    #[serde(default)]
    pub prestart: Vec<Hook>,
    /// After the runtime created the container's namespaces.
    #[serde(default)]
    pub create_runtime: Vec<Hook>,
    /// After its process started.
    #[serde(default)]
    pub poststart: Vec<Hook>,
    /// After it was deleted.
    #[serde(default)]
    pub poststop: Vec<Hook>,
}

/// One hook.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Hook {
    /// The program.
    pub path: String,
    /// argv (argv\[0\] included).
    #[serde(default)]
    pub args: Vec<String>,
    /// Its environment.
    #[serde(default)]
    pub env: Vec<String>,
    /// Seconds it may take.
    pub timeout: Option<u64>,
}

/// `linux`, the fields ember reads.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Linux {
    /// Paths hidden from the container.
    #[serde(default)]
    pub masked_paths: Vec<String>,
    /// Paths it sees read-only.
    #[serde(default)]
    pub readonly_paths: Vec<String>,
    /// Kernel parameters.
    #[serde(default)]
    pub sysctl: std::collections::BTreeMap<String, String>,
    /// A seccomp filter (refused: not applied yet).
    pub seccomp: Option<serde_json::Value>,
    /// The namespaces to join or make.
    #[serde(default)]
    pub namespaces: Vec<SpecNamespace>,
    /// Cgroup limits (applied to the container's cgroup in the guest).
    pub resources: Option<LinuxResources>,
}

/// `linux.resources` (also an update request's resources).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LinuxResources {
    /// `memory`.
    pub memory: Option<MemoryResources>,
    /// `cpu`.
    pub cpu: Option<CpuResources>,
    /// `pids`.
    pub pids: Option<PidsResources>,
    /// Device rules: the VM has only its own devices, and a container's
    /// /dev only the usual ones, so the rules have nothing to restrict.
    #[serde(default)]
    pub devices: Vec<serde_json::Value>,
    /// Block I/O weights and throttles (refused when set).
    #[serde(rename = "blockIO")]
    pub block_io: Option<serde_json::Value>,
    /// Huge page limits (refused when set).
    #[serde(default)]
    pub hugepage_limits: Vec<serde_json::Value>,
    /// Network class and priorities (refused when set).
    pub network: Option<serde_json::Value>,
    /// RDMA limits (refused when set).
    pub rdma: Option<serde_json::Value>,
    /// Raw cgroup v2 files (refused when set).
    pub unified: Option<std::collections::BTreeMap<String, String>>,
}

/// `linux.resources.memory`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MemoryResources {
    /// Bytes.
    pub limit: Option<i64>,
    /// Memory + swap, bytes.
    pub swap: Option<i64>,
}

/// `linux.resources.cpu`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CpuResources {
    /// Relative weight (cgroup v1 shares).
    pub shares: Option<u64>,
    /// CFS quota, microseconds per period.
    pub quota: Option<i64>,
    /// CFS period, microseconds.
    pub period: Option<u64>,
    /// A cpuset (refused when set: the VM's vCPUs are the container's).
    pub cpus: Option<String>,
    /// Memory nodes (refused when set).
    pub mems: Option<String>,
}

/// `linux.resources.pids`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct PidsResources {
    /// Most processes.
    pub limit: i64,
}

impl LinuxResources {
    /// Parses the JSON of an update request's resources.
    pub fn parse(json: &[u8]) -> Result<LinuxResources, ContainerError> {
        serde_json::from_slice(json).map_err(|source| ContainerError::Json {
            what: "resources".into(),
            source,
        })
    }

    /// The limits the agent applies; what it cannot apply is refused in one line.
    pub fn to_agent(&self) -> Result<Resources, ContainerError> {
        let refuse = |what: &str| {
            Err(ContainerError::NotImplemented(format!(
                "{what} in a VM's guest"
            )))
        };
        if self.block_io.as_ref().is_some_and(is_set) {
            return refuse("block I/O limits (linux.resources.blockIO)");
        }
        if !self.hugepage_limits.is_empty() {
            return refuse("huge page limits (linux.resources.hugepageLimits)");
        }
        if self.network.as_ref().is_some_and(is_set) {
            return refuse("network priorities (linux.resources.network)");
        }
        if self.rdma.as_ref().is_some_and(is_set) {
            return refuse("RDMA limits (linux.resources.rdma)");
        }
        if self.unified.as_ref().is_some_and(|u| !u.is_empty()) {
            return refuse("raw cgroup files (linux.resources.unified)");
        }
        let cpu = self.cpu.clone().unwrap_or_default();
        if cpu.cpus.as_ref().is_some_and(|c| !c.is_empty())
            || cpu.mems.as_ref().is_some_and(|m| !m.is_empty())
        {
            return refuse("cpusets (linux.resources.cpu.cpus/mems)");
        }
        let memory = self.memory.clone().unwrap_or_default();
        Ok(Resources {
            memory_limit: memory.limit.filter(|&l| l != 0),
            memory_swap: memory.swap.filter(|&s| s != 0),
            cpu_quota: cpu.quota.filter(|&q| q != 0),
            cpu_period: cpu.period.filter(|&p| p != 0),
            cpu_shares: cpu.shares.filter(|&s| s != 0),
            pids_limit: self.pids.as_ref().map(|p| p.limit),
        })
    }

    /// The vCPUs the limits call for: the CFS quota over its period, rounded up.
    pub fn vcpus(&self) -> Option<u32> {
        let cpu = self.cpu.as_ref()?;
        let quota = cpu.quota.filter(|&q| q > 0)?;
        let period = cpu.period.filter(|&p| p > 0).unwrap_or(100_000);
        Some((quota as u64).div_ceil(period).max(1) as u32)
    }

    /// The memory limit, bytes, if one is set.
    pub fn memory_limit(&self) -> Option<u64> {
        self.memory
            .as_ref()?
            .limit
            .filter(|&l| l > 0)
            .map(|l| l as u64)
    }
}

/// A bind mount of a host path: the host brings its source into the
/// guest (through the pod's share); the agent binds it from there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBind {
    /// The host path.
    pub source: std::path::PathBuf,
    /// Where, in the container.
    pub destination: String,
    /// Read-only.
    pub readonly: bool,
}

/// One of `linux.namespaces`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SpecNamespace {
    /// `network`, `pid`, `mount`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// An existing namespace to join (CNI's network namespace).
    #[serde(default)]
    pub path: Option<String>,
}

/// One of `process.rlimits`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SpecRlimit {
    /// `RLIMIT_*`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Soft limit.
    pub soft: u64,
    /// Hard limit.
    pub hard: u64,
}

/// `process.capabilities`: capability names per set.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SpecCapabilities {
    /// Bounding.
    #[serde(default)]
    pub bounding: Vec<String>,
    /// Effective.
    #[serde(default)]
    pub effective: Vec<String>,
    /// Permitted.
    #[serde(default)]
    pub permitted: Vec<String>,
    /// Inheritable.
    #[serde(default)]
    pub inheritable: Vec<String>,
    /// Ambient.
    #[serde(default)]
    pub ambient: Vec<String>,
}

/// Capability names in number order (`CAP_CHOWN` is 0).
const CAPABILITIES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// `RLIMIT_*` names in number order (`RLIMIT_CPU` is 0).
const RLIMITS: &[&str] = &[
    "CPU",
    "FSIZE",
    "DATA",
    "STACK",
    "CORE",
    "RSS",
    "NPROC",
    "NOFILE",
    "MEMLOCK",
    "AS",
    "LOCKS",
    "SIGPENDING",
    "MSGQUEUE",
    "NICE",
    "RTPRIO",
    "RTTIME",
];

fn cap_mask(names: &[String]) -> Result<u64, ContainerError> {
    let mut m = 0u64;
    for n in names {
        let bare = n.strip_prefix("CAP_").unwrap_or(n);
        let i = CAPABILITIES
            .iter()
            .position(|c| *c == bare)
            .ok_or_else(|| ContainerError::NotImplemented(format!("capability {n}")))?;
        m |= 1 << i;
    }
    Ok(m)
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
    /// no_new_privs.
    #[serde(default)]
    pub no_new_privileges: bool,
    /// Resource limits.
    #[serde(default)]
    pub rlimits: Vec<SpecRlimit>,
    /// Capabilities (root's full sets when absent).
    pub capabilities: Option<SpecCapabilities>,
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
    /// The network namespace to join, when the spec names one (a pod's,
    /// made by CNI): the VM takes its interface (`ember run --netns`).
    pub fn network_namespace(&self) -> Option<PathBuf> {
        self.linux
            .namespaces
            .iter()
            .find(|n| n.kind == "network")
            .and_then(|n| n.path.as_deref())
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
    }

    /// Reads `BUNDLE/config.json`.
    pub fn load(bundle: &Path) -> Result<Spec, ContainerError> {
        let path = bundle.join("config.json");
        let text = std::fs::read(&path).map_err(ContainerError::io(path.display().to_string()))?;
        serde_json::from_slice(&text).map_err(|source| ContainerError::Json {
            what: path.display().to_string(),
            source,
        })
    }

    /// The container's process (a spec without one cannot be run).
    pub fn process_in(&self, bundle: &Path) -> Result<Process, ContainerError> {
        self.process.clone().ok_or_else(|| ContainerError::Spec {
            bundle: bundle.display().to_string(),
            why: "no process".into(),
        })
    }

    /// The root filesystem's directory: `root.path` (default `rootfs`),
    /// relative to the bundle unless absolute.
    pub fn root_dir(&self, bundle: &Path) -> PathBuf {
        let root = self.root.as_ref().map_or("rootfs", |r| r.path.as_str());
        bundle.join(root)
    }

    /// Parses a spec's JSON.
    pub fn parse(json: &[u8]) -> Result<Spec, ContainerError> {
        serde_json::from_slice(json).map_err(|source| ContainerError::Json {
            what: "config.json".into(),
            source,
        })
    }

    /// The bind mounts of host paths, in order.
    pub fn host_binds(&self) -> Vec<HostBind> {
        self.mounts
            .iter()
            .filter(|m| is_bind(m))
            .map(|m| HostBind {
                source: m.source.clone().into(),
                destination: m.destination.clone(),
                readonly: m.options.iter().any(|o| o == "ro"),
            })
            .collect()
    }

    /// The agent's description of the container whose root the guest sees
    /// at `guest_rootfs`, the sources of [`Spec::host_binds`] seen by the
    /// guest at `guest_binds` (in their order; `PodDir::add` puts them
    /// there); a bind beyond them is refused in one line.
    pub fn container(
        &self,
        id: &str,
        guest_rootfs: &str,
        guest_binds: &[String],
    ) -> Result<ContainerSpec, ContainerError> {
        let mut mounts = Vec::new();
        let mut binds = guest_binds.iter();
        for m in &self.mounts {
            let source = if is_bind(m) {
                binds.next().cloned().ok_or_else(|| {
                    ContainerError::NotImplemented(format!(
                        "bind mount of host path {} at {}",
                        m.source, m.destination
                    ))
                })?
            } else {
                m.source.clone()
            };
            mounts.push(Mount {
                destination: m.destination.clone(),
                fstype: m.fstype.clone(),
                source,
                options: m.options.clone(),
            });
        }
        let resources = match &self.linux.resources {
            Some(r) => r.to_agent()?,
            None => Resources::default(),
        };
        if self.linux.seccomp.is_some() {
            return Err(ContainerError::NotImplemented(
                "seccomp filters (linux.seccomp)".into(),
            ));
        }
        Ok(ContainerSpec {
            id: id.to_owned(),
            rootfs: guest_rootfs.to_owned(),
            hostname: self.hostname.clone().filter(|h| !h.is_empty()),
            mounts,
            masked_paths: self.linux.masked_paths.clone(),
            readonly_paths: self.linux.readonly_paths.clone(),
            sysctl: self.linux.sysctl.clone().into_iter().collect(),
            readonly_root: self.root.as_ref().is_some_and(|r| r.readonly),
            resources,
        })
    }

    /// The annotation value under `key`.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).map(String::as_str)
    }
}

/// Whether a JSON value asks for anything: Docker sends `blockIO` with a
/// zero weight when none was given, which asks for nothing.
fn is_set(v: &serde_json::Value) -> bool {
    use serde_json::Value;
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => a.iter().any(is_set),
        Value::Object(o) => o.values().any(is_set),
    }
}

fn is_bind(m: &SpecMount) -> bool {
    m.fstype == "bind" || m.options.iter().any(|o| o == "bind" || o == "rbind")
}

impl Process {
    /// Parses an exec's process JSON.
    pub fn parse(json: &[u8]) -> Result<Process, String> {
        serde_json::from_slice(json).map_err(|e| format!("process spec: {e}"))
    }

    /// The agent's start request for this process as `handle` in
    /// `container`; an unknown capability or limit is refused in one line.
    pub fn to_agent(
        &self,
        handle: u32,
        container: &str,
        stdin: bool,
    ) -> Result<ProcessSpec, ContainerError> {
        let rlimits =
            self.rlimits
                .iter()
                .map(|r| {
                    let bare = r.kind.strip_prefix("RLIMIT_").unwrap_or(&r.kind);
                    let resource = RLIMITS.iter().position(|n| *n == bare).ok_or_else(|| {
                        ContainerError::NotImplemented(format!("rlimit {}", r.kind))
                    })?;
                    Ok(Rlimit {
                        resource: resource as u32,
                        soft: r.soft,
                        hard: r.hard,
                    })
                })
                .collect::<Result<Vec<_>, ContainerError>>()?;
        let capabilities = match &self.capabilities {
            Some(c) => Some(Capabilities {
                bounding: cap_mask(&c.bounding)?,
                effective: cap_mask(&c.effective)?,
                permitted: cap_mask(&c.permitted)?,
                inheritable: cap_mask(&c.inheritable)?,
                ambient: cap_mask(&c.ambient)?,
            }),
            None => None,
        };
        Ok(ProcessSpec {
            no_new_privileges: self.no_new_privileges,
            rlimits,
            capabilities,
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The root is the bundle's `rootfs` unless the spec names one; a
    /// relative name is the bundle's, an absolute one is itself.
    #[test]
    fn the_root_and_process_come_from_the_spec_and_bundle() {
        let b = Path::new("/b");
        let mut s = Spec::parse(b"{}").unwrap();
        assert_eq!(s.root_dir(b), Path::new("/b/rootfs"));
        assert!(
            s.process_in(b)
                .unwrap_err()
                .to_string()
                .contains("no process")
        );
        s = Spec::parse(br#"{"root": {"path": "r"}, "process": {"args": ["sh"]}}"#).unwrap();
        assert_eq!(s.root_dir(b), Path::new("/b/r"));
        assert_eq!(s.process_in(b).unwrap().args, ["sh"]);
        s = Spec::parse(br#"{"root": {"path": "/abs/root"}}"#).unwrap();
        assert_eq!(s.root_dir(b), Path::new("/abs/root"));
    }

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
    fn a_spec_that_does_not_parse_says_where() {
        let e = Spec::parse(br#"{"process": {"args": 3}}"#).unwrap_err();
        assert!(matches!(e, ContainerError::Json { ref what, .. } if what == "config.json"));
        assert!(
            e.to_string()
                .starts_with("config.json: invalid type: integer `3`"),
            "{e}"
        );
        let e = LinuxResources::parse(b"[").unwrap_err();
        assert!(e.to_string().starts_with("resources: "), "{e}");
    }

    #[test]
    fn a_ctr_spec_becomes_agent_requests() {
        let spec = Spec::parse(CTR_LIKE.as_bytes()).unwrap();
        let c = spec.container("c1", "/.ember-containers/c1", &[]).unwrap();
        // No network namespace to join: the VM has no network.
        assert_eq!(spec.network_namespace(), None);
        assert_eq!(c.hostname.as_deref(), Some("box"));
        assert_eq!(c.mounts.len(), 2);
        assert_eq!(c.mounts[1].options, ["nosuid", "mode=755"]);
        let p = spec.process.unwrap().to_agent(1, "c1", true).unwrap();
        assert!(p.no_new_privileges);
        assert_eq!(p.capabilities.map(|c| c.bounding), Some(1 << 5));
        assert_eq!(p.args, ["sh", "-c", "echo hi"]);
        assert_eq!(
            (p.uid, p.gid, p.additional_gids.as_slice()),
            (1000, 100, &[10][..])
        );
        assert_eq!(p.cwd, "/tmp");
        assert!(p.stdin && !p.terminal);
    }

    #[test]
    fn a_network_namespace_path_is_the_pods_network() {
        let spec = Spec::parse(
            br#"{"linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/var/run/netns/cni-1"}]}}"#,
        )
        .unwrap();
        assert_eq!(
            spec.network_namespace(),
            Some(PathBuf::from("/var/run/netns/cni-1"))
        );
        // A new, empty one (no path) gives the VM no network.
        let spec = Spec::parse(br#"{"linux": {"namespaces": [{"type": "network"}]}}"#).unwrap();
        assert_eq!(spec.network_namespace(), None);
    }

    #[test]
    fn bind_mounts_take_the_guest_sources_given_or_are_refused_in_one_line() {
        let spec = Spec::parse(
            br#"{"root": {"path": "rootfs", "readonly": true},
                 "mounts": [{"destination": "/etc/hosts", "type": "bind", "source": "/etc/hosts", "options": ["rbind", "ro"]},
                            {"destination": "/t", "type": "tmpfs", "source": "tmpfs"}]}"#,
        )
        .unwrap();
        let e = spec.container("c", "/r", &[]).unwrap_err().to_string();
        assert_eq!(
            e,
            "not implemented: bind mount of host path /etc/hosts at /etc/hosts"
        );
        assert_eq!(
            spec.host_binds(),
            [HostBind {
                source: "/etc/hosts".into(),
                destination: "/etc/hosts".into(),
                readonly: true
            }]
        );
        let c = spec.container("c", "/r", &["/g/c.binds/0".into()]).unwrap();
        assert!(c.readonly_root);
        assert_eq!(c.mounts[0].source, "/g/c.binds/0");
        assert_eq!(c.mounts[1].source, "tmpfs");
    }

    #[test]
    fn resources_become_cgroup_limits_and_vm_sizes_or_are_refused() {
        let r = LinuxResources::parse(
            br#"{"devices": [{"allow": false, "access": "rwm"}],
                 "memory": {"limit": 67108864}, "cpu": {"quota": 150000, "period": 100000, "shares": 1024},
                 "pids": {"limit": 100}}"#,
        )
        .unwrap();
        let a = r.to_agent().unwrap();
        assert_eq!(a.memory_limit, Some(64 << 20));
        assert_eq!((a.cpu_quota, a.cpu_period), (Some(150_000), Some(100_000)));
        assert_eq!(a.pids_limit, Some(100));
        assert_eq!(r.vcpus(), Some(2));
        assert_eq!(r.memory_limit(), Some(64 << 20));
        // Docker's "no weight" asks for nothing.
        let r =
            LinuxResources::parse(br#"{"blockIO": {"weight": 0, "weightDevice": []}}"#).unwrap();
        assert!(r.to_agent().is_ok());
        let r = LinuxResources::parse(br#"{"blockIO": {"weight": 10}}"#).unwrap();
        assert_eq!(
            r.to_agent().unwrap_err().to_string(),
            "not implemented: block I/O limits (linux.resources.blockIO) in a VM's guest"
        );
    }
}
